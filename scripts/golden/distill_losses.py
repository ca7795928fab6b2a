"""Reference values and gradients of every distillation objective, for student/tests/it/distill.rs.

numpy in float64, written from the formulas (not from k3mini's code): SPEC section 7, DistillKit's
temperature-from-logprobs rule, GKD's JSD, DistiLLM's skew KLs, random-sampling KD with given
frequencies, the on-policy reverse-KL advantage loss, and router distillation's KL(r ‖ s / Σ s). Gradients with respect to the student's
logits are central finite differences of these float64 functions.

    python scripts/golden/distill_losses.py      # needs numpy only
"""
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "tests" / "golden" / "distill_losses.json"
N, V, K = 6, 16, 5
FLOOR = 1e-8
rng = np.random.default_rng(2026)


def log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


logits = rng.normal(0, 1.5, (N, V))
teacher_logits = rng.normal(0, 2.0, (N, V))
teacher_lp = log_softmax(teacher_logits)
ids = np.argsort(-teacher_lp, axis=1, kind="stable")[:, :K]
top_lp = np.take_along_axis(teacher_lp, ids, 1)
targets = rng.integers(0, V, N)
mask = np.array([1, 1, 0, 1, 1, 1], dtype=np.float64)
sampled_freq = rng.multinomial(12, np.full(K + 1, 1 / (K + 1)), N) / 12.0


def buckets_teacher(tau_gen, tau):
    a = tau_gen / tau
    P = np.exp(top_lp).sum(1)
    tail = np.maximum(1 - P, FLOOR)
    w = np.concatenate([np.exp(a * top_lp), (tail ** a)[:, None]], 1)
    return w / w.sum(1, keepdims=True)  # p-hat over K and the tail


def kl(a, b):
    return (a * (np.log(a) - np.log(b))).sum(1)


def per_position(kind, z, tau, param):
    if kind == "ce":
        return -log_softmax(z)[np.arange(N), targets]
    q = np.exp(log_softmax(z / tau))
    qk = np.take_along_axis(q, ids, 1)
    Q = qk.sum(1)
    qh = np.concatenate([qk, np.maximum(1 - Q, FLOOR)[:, None]], 1)
    ph = buckets_teacher(1.0, tau)
    pk = ph[:, :K]
    if kind == "forward_kl":
        v = kl(ph, qh)
    elif kind == "topk_kl":
        pn = pk / pk.sum(1, keepdims=True)
        v = (pn * (np.log(pn) - np.log(qk))).sum(1)
    elif kind == "topk_kl_renormalised":
        v = kl(pk / pk.sum(1, keepdims=True), qk / qk.sum(1, keepdims=True))
    elif kind == "reverse_kl":
        v = kl(qh, ph)
    elif kind == "jsd":
        m = param * ph + (1 - param) * qh
        v = param * kl(ph, m) + (1 - param) * kl(qh, m)
    elif kind == "skew_kl":
        v = kl(ph, param * ph + (1 - param) * qh)
    elif kind == "skew_reverse_kl":
        v = kl(qh, param * qh + (1 - param) * ph)
    elif kind == "sampled":
        v = -(sampled_freq * np.log(qh)).sum(1)
    else:
        raise ValueError(kind)
    return v * tau * tau


def masked(v):
    return (v * mask).sum() / mask.sum()


def grad(f, z, h=1e-6):
    g = np.zeros_like(z)
    for i in np.ndindex(*z.shape):
        zp, zm = z.copy(), z.copy()
        zp[i] += h
        zm[i] -= h
        g[i] = (f(zp) - f(zm)) / (2 * h)
    return g


def main():
    cases = []
    for kind, param in [("ce", None), ("forward_kl", None), ("topk_kl", None),
                        ("topk_kl_renormalised", None), ("reverse_kl", None), ("jsd", 0.5),
                        ("jsd", 0.1), ("skew_kl", 0.1), ("skew_reverse_kl", 0.1), ("sampled", None)]:
        for tau in [1.0, 2.0]:
            if kind == "ce" and tau != 1.0:
                continue
            f = lambda z: masked(per_position(kind, z, tau, param))
            cases.append({"kind": kind, "param": param, "tau": tau, "loss": f(logits),
                          "grad": grad(f, logits).ravel().tolist()})
    # On-policy: the student's own samples x_t, the teacher's log p(x_t); advantage held constant.
    sampled = rng.integers(0, V, N)
    teacher_at = teacher_lp[np.arange(N), sampled]
    adv = teacher_at - log_softmax(logits)[np.arange(N), sampled]
    f = lambda z: masked(-adv * log_softmax(z)[np.arange(N), sampled])
    on_policy = {"sampled": sampled.tolist(), "teacher_logprobs": teacher_at.tolist(),
                 "loss": f(logits), "grad": grad(f, logits).ravel().tolist()}
    # Router distillation: the student router's logits z [N, E], scores s = sigmoid(z), π = s / Σ s;
    # the teacher's mass r on the student's experts (rows sum to 1; row 2 has none and is masked).
    E = 4
    router_logits = rng.normal(0, 1.0, (N, E))
    r = rng.dirichlet(np.ones(E), N)
    r[1, 3] = 0.0
    r[1] /= r[1].sum()
    r[2] = 0.0
    rmask = (r.sum(1) > 0).astype(np.float64)

    def router_kl(z):
        s = 1.0 / (1.0 + np.exp(-z))
        log_pi = np.log(s) - np.log(s.sum(1, keepdims=True))
        per = (r * (np.log(np.maximum(r, FLOOR)) - log_pi)).sum(1)
        return (per * rmask).sum() / rmask.sum()

    router = {"e": E, "logits": router_logits.ravel().tolist(), "target": r.ravel().tolist(),
              "mask": rmask.tolist(), "loss": router_kl(router_logits),
              "grad": grad(router_kl, router_logits).ravel().tolist()}
    OUT.write_text(json.dumps({
        "n": N, "v": V, "k": K, "logits": logits.ravel().tolist(), "ids": ids.ravel().tolist(),
        "top_logprobs": top_lp.ravel().tolist(), "targets": targets.tolist(), "mask": mask.tolist(),
        "sampled_freq": sampled_freq.ravel().tolist(), "cases": cases, "on_policy": on_policy,
        "router_kl": router,
    }, indent=1) + "\n")
    print(OUT, len(cases), "cases")


if __name__ == "__main__":
    main()
