"""Routed-expert payloads as vLLM and SGLang build them, for teacher/tests/it/routing_wire.rs.

    python -m venv .venv && .venv/bin/pip install numpy
    .venv/bin/python scripts/golden/routing_fixtures.py

Each payload is built the way the server's own code does (SPEC §10): vLLM `np.save`s the
`[tokens, layers, k]` array and base64s the file (int32; newer releases narrow the dtype to uint8 or
uint16 when the ids fit); vLLM 0.21 sent nested int16 lists, the prompt's at the response's top level
and the generated tokens' in the choice; SGLang base64s the raw int32 bytes. Every payload comes with
the array it encodes as plain lists, and numpy's per-layer expert counts over the MoE layers, so the
Rust readers are checked against numpy, not against themselves.
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
    doc = {"shape": shape, "numpy": np.__version__, "fixtures": fixtures}
    (OUT / "payloads.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT / 'payloads.json'} ({len(fixtures)} payloads, numpy {np.__version__})")


if __name__ == "__main__":
    main()
