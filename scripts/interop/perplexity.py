"""Perplexity of GGUF files in llama.cpp (llama-cpp-python 0.3.36, CPU) on a text none of them saw.

The text is tokenised with the first file's tokenizer (the one k3mini copied into the export) and
cut into non-overlapping windows of --seq-len tokens; each window is evaluated from an empty state
and every position after the first is scored. All files see the same windows, so the rows compare.

    python scripts/interop/perplexity.py TEXT A.gguf [B.gguf ...] [--seq-len 256] [--windows 32] [--json]
"""
import argparse
import json
import sys

import numpy as np
from llama_cpp import Llama


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def windows(path, llm, seq_len, n):
    ids = llm.tokenize(open(path, encoding="utf-8").read().encode("utf-8"), add_bos=False, special=False)
    out = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:n]
    if not out:
        sys.exit(f"{path}: {len(ids)} tokens, fewer than one window of {seq_len}")
    return out


def nll(llm, window):
    """Summed negative log-likelihood of window[1:] given its prefix, and the number of positions."""
    llm.reset()
    llm.eval(window)
    logits = np.array(llm.scores[: len(window)], dtype=np.float64)
    lp = log_softmax(logits[:-1])
    return -lp[np.arange(len(window) - 1), window[1:]].sum(), len(window) - 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("text")
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows, wins = [], None
    for path in args.gguf:
        llm = Llama(model_path=path, logits_all=True, n_ctx=args.seq_len, n_batch=args.seq_len,
                    n_threads=2, verbose=False)
        wins = wins or windows(args.text, llm, args.seq_len, args.windows)
        total, count = 0.0, 0
        for w in wins:
            s, c = nll(llm, w)
            total, count = total + s, count + c
        rows.append({"file": path, "ppl": float(np.exp(total / count)), "positions": count})
        del llm
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("| file | held-out ppl | positions |\n|---|---|---|")
        for r in rows:
            print(f"| {r['file']} | {r['ppl']:.1f} | {r['positions']} |")


if __name__ == "__main__":
    main()
