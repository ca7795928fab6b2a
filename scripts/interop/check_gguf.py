"""Runs a `k3mini export --format gguf` file in llama.cpp (llama-cpp-python 0.3.36, CPU) on the
reference inputs of a `k3mini export --format hf --with-reference` directory and compares the
logits with k3mini's: max |Δ logit|, top-1 agreement and the mean KL(k3mini ‖ llama.cpp).
Exits non-zero when max |Δ| exceeds --tol (use a loose --tol for quantised files, whose error is
set by the quantisation; top-1 and KL are what to read there).

    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36 numpy safetensors
    python scripts/interop/check_gguf.py MODEL.gguf REFERENCE_DIR [--tol 1e-4]
"""
import argparse
import sys

import numpy as np
from llama_cpp import Llama
from safetensors.numpy import load_file


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("reference_dir")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    ref = load_file(f"{args.reference_dir}/k3mini_reference.safetensors")
    ids, want = ref["input_ids"], ref["logits"]
    llm = Llama(model_path=args.gguf, logits_all=True, n_ctx=max(64, ids.shape[1]), n_batch=ids.shape[1],
                n_threads=2, verbose=False)
    got = []
    for row in ids:
        llm.reset()
        llm.eval([int(t) for t in row])
        got.append(np.array(llm.scores[: len(row)], dtype=np.float32))
    got = np.stack(got)
    diff = np.abs(got - want).max()
    top1 = (got.argmax(-1) == want.argmax(-1)).mean()
    p = log_softmax(want.astype(np.float64))
    kl = (np.exp(p) * (p - log_softmax(got.astype(np.float64)))).sum(-1).mean()
    print(f"llama.cpp vs k3mini: max |Δ logit| = {diff:.3e}, top-1 agreement {top1:.4f}, "
          f"mean KL(k3mini ‖ llama.cpp) = {kl:.3e} over {ids.size} positions")
    sys.exit(0 if diff <= args.tol else 1)


if __name__ == "__main__":
    main()
