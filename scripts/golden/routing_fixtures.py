"""Routed-expert payloads as vLLM and SGLang build them, for teacher/tests/it/routing_wire.rs.

    python -m venv .venv && .venv/bin/pip install numpy
    .venv/bin/python scripts/golden/routing_fixtures.py

Each payload is built the way the server's own code does (SPEC §10): vLLM `np.save`s the
`[tokens, layers, k]` array and base64s the file (int32; newer releases narrow the dtype to uint8 or
uint16 when the ids fit); vLLM 0.21 sent nested int16 lists, the prompt's at the response's top level
and the generated tokens' in the choice; SGLang base64s the raw int32 bytes. Every payload comes with
the array it encodes as plain lists, and numpy's per-layer expert counts and co-selection over the
MoE layers; a white-box set (two sequences with router weights and expert output norms) comes with
numpy's REAP statistics of it. The Rust readers and statistics are checked against numpy, not
against themselves.
"""
import base64
import io
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "teacher" / "tests" / "fixtures" / "routing"
LAYERS, K, EXPERTS = 4, 3, 8
MOE_LAYERS = [1, 2, 3]  # layer 0 is dense: its row is whatever the server leaves there (zeros)


def routed(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """[tokens, LAYERS, K]: K distinct experts per token at each MoE layer, zeros at dense ones."""
    a = np.zeros((tokens, LAYERS, K), dtype=np.int32)
    for t in range(tokens):
        for layer in MOE_LAYERS:
            a[t, layer] = rng.permutation(EXPERTS)[:K]
    return a


def npy_b64(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def counts(a: np.ndarray) -> list:
    """Per MoE layer, how often each expert was picked: numpy's own recount."""
    return [np.bincount(a[:, layer].ravel(), minlength=EXPERTS).tolist() for layer in MOE_LAYERS]


def co_selected(a: np.ndarray) -> list:
    """Per MoE layer, [E, E]: tokens whose choices include both experts (one-hot outer products)."""
    out = []
    for layer in MOE_LAYERS:
        onehot = np.zeros((a.shape[0], EXPERTS), dtype=np.int64)
        for t in range(a.shape[0]):
            onehot[t, a[t, layer]] = 1
        out.append((onehot.T @ onehot).tolist())
    return out


def white_box(rng: np.random.Generator) -> dict:
    """Two scored sequences (sources 0 and 1) of a white-box teacher: ids, router weights and
    expert output norms per MoE layer, and numpy's statistics of them (REAP's, with the weights
    renormalised over the top-k)."""
    seqs = []
    for tokens in (9, 5):
        ids = routed(rng, tokens)
        weights = rng.uniform(0.05, 2.0, size=ids.shape).astype(np.float32)
        norms = rng.uniform(0.1, 9.0, size=ids.shape).astype(np.float32)
        seqs.append((ids, weights, norms))
    layers = []
    for li, layer in enumerate(MOE_LAYERS):
        ids = np.concatenate([s[0][:, layer] for s in seqs])
        w = np.concatenate([s[1][:, layer] for s in seqs]).astype(np.float64)
        n = np.concatenate([s[2][:, layer] for s in seqs]).astype(np.float64)
        g = w / w.sum(axis=1, keepdims=True)
        count = np.bincount(ids.ravel(), minlength=EXPERTS)
        norm_sum = np.bincount(ids.ravel(), weights=n.ravel(), minlength=EXPERTS)
        sal_sum = np.bincount(ids.ravel(), weights=(g * n).ravel(), minlength=EXPERTS)
        chosen = count > 0
        p = count / count.sum()
        per_source = [np.bincount(s[0][:, layer].ravel(), minlength=EXPERTS) for s in seqs]
        def kl(c):
            q = np.maximum(count, 0.5) / count.sum()
            pc = c / c.sum()
            m = c > 0
            return float((pc[m] * np.log(pc[m] / q[m])).sum())
        layers.append({
            "layer": layer,
            "tokens": int(ids.shape[0]),
            "counts": count.tolist(),
            "co_selected": co_selected(np.concatenate([s[0] for s in seqs]))[li],
            "mean_norm": [float(x) if c else None for x, c in zip(np.where(chosen, norm_sum / np.maximum(count, 1), 0), chosen)],
            "saliency": [float(x) if c else None for x, c in zip(np.where(chosen, sal_sum / np.maximum(count, 1), 0), chosen)],
            "effective_k": float((1.0 / (g ** 2).sum(axis=1)).mean()),
            "experts_in_use": float(np.exp(-(p[p > 0] * np.log(p[p > 0])).sum())),
            "source_counts": [c.tolist() for c in per_source],
            "specialisation": [kl(c) for c in per_source],
        })
    return {
        "sequences": [
            {"source": i, "experts": s[0].tolist(), "weights": s[1].tolist(), "norms": s[2].tolist()}
            for i, s in enumerate(seqs)
        ],
        "layers": layers,
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2026)
    shape = {"layers": LAYERS, "k": K, "experts": EXPERTS, "moe_layers": MOE_LAYERS}
    fixtures = {}
    for dtype in ["int32", "uint16", "uint8"]:
        a = routed(rng, 6)
        fixtures[f"vllm_npy_{dtype}"] = {
            "response": {"choices": [{"index": 0, "routed_experts": npy_b64(a.astype(dtype))}]},
            "expected": a.tolist(),
        }
    prompt, generated = routed(rng, 5), routed(rng, 2)
    fixtures["vllm_0_21_lists"] = {
        "response": {
            "prompt_routed_experts": prompt.astype(np.int16).tolist(),
            "choices": [{"index": 0, "routed_experts": generated.astype(np.int16).tolist()}],
        },
        "expected": np.concatenate([prompt, generated]).tolist(),
    }
    a = routed(rng, 7)
    fixtures["sglang_int32"] = {
        "response": {"meta_info": {"routed_experts": base64.b64encode(a.astype("<i4").tobytes()).decode()}},
        "expected": a.tolist(),
    }
    for f in fixtures.values():
        f["counts"] = counts(np.array(f["expected"]))
        f["co_selected"] = co_selected(np.array(f["expected"]))
    doc = {"shape": shape, "numpy": np.__version__, "fixtures": fixtures, "white_box": white_box(rng)}
    (OUT / "payloads.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT / 'payloads.json'} ({len(fixtures)} payloads, numpy {np.__version__})")


if __name__ == "__main__":
    main()
