"""Runs a `k3mini export --format gguf` file in llama.cpp (llama-cpp-python 0.3.36, CPU) on the
reference inputs written by `k3mini export --with-reference` (an hf directory, or the
FILE.reference.safetensors next to a GGUF) and compares the
logits with k3mini's: max |Δ logit|, top-1 agreement and the mean KL(k3mini ‖ llama.cpp).
Where the reference carries k3mini's encoding of a text (`text_ids`), llama.cpp must tokenise the
text to the same ids. Exits non-zero on a tokenisation difference, when max |Δ| exceeds --tol, or
when the KL exceeds --max-kl. The default --tol is 5e-4:
llama.cpp's own F32 forward of the distilled student is 1.2e-4 from a float64 transformers forward,
while k3mini's is 1.2e-5. For quantised files the error is the quantisation's: gate on --max-kl.

    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36 numpy safetensors
    python scripts/interop/check_gguf.py MODEL.gguf REFERENCE [--tol 5e-4] [--max-kl X]
"""
import argparse
import os
import sys

import numpy as np
from llama_cpp import Llama
from safetensors import safe_open
from safetensors.numpy import load_file


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("reference", help="an hf export directory or a .safetensors reference file")
    ap.add_argument("--tol", type=float, default=5e-4)
    ap.add_argument("--max-kl", type=float, default=float("inf"))
    args = ap.parse_args()
    ref_path = args.reference
    if os.path.isdir(ref_path):
        ref_path = os.path.join(ref_path, "k3mini_reference.safetensors")
    ref = load_file(ref_path)
    ids, want = ref["input_ids"], ref["logits"]
    llm = Llama(model_path=args.gguf, logits_all=True, n_ctx=max(64, ids.shape[1]), n_batch=ids.shape[1],
                n_threads=2, verbose=False)
    if "text_ids" in ref:
        with safe_open(ref_path, "np") as f:
            text = f.metadata()["text"]
        got_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        if got_ids != ref["text_ids"].tolist():
            print(f"tokenizer: llama.cpp {got_ids} != k3mini {ref['text_ids'].tolist()} for {text!r}")
            sys.exit(1)
        print(f"tokenizer: llama.cpp encodes the reference text to k3mini's {len(got_ids)} ids")
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
    print(f"llama.cpp vs reference: max |Δ logit| = {diff:.3e}, top-1 agreement {top1:.4f}, "
          f"mean KL(reference ‖ llama.cpp) = {kl:.3e} over {ids.size} positions")
    sys.exit(0 if diff <= args.tol and kl <= args.max_kl else 1)


if __name__ == "__main__":
    main()
