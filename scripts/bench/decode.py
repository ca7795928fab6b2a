"""Decode speed and inference-state memory of GGUF files in llama.cpp (llama-cpp-python 0.3.36,
CPU): for each file and context length, prefill that many tokens, then decode --tokens more one at
a time (greedy), and report prefill tokens/s, decode tokens/s and the bytes of the sequence's state
(llama.cpp's KV cache plus, for KDA layers, the fixed recurrent state).

    python scripts/bench/decode.py A.gguf [B.gguf ...] [--contexts 512,8192] [--tokens 32] [--threads 2] [--flash-attn]
"""
import argparse
import json
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama


def run(path, ctx, tokens, threads, flash_attn):
    llm = Llama(model_path=path, n_ctx=ctx + tokens, n_batch=512, n_threads=threads,
                n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, llm.n_vocab(), size=ctx)]
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(tokens):
        last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))  # the last token's
        llm.eval([int(np.argmax(last))])
    decode = time.perf_counter() - t0
    state = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
    return {"file": path, "context": ctx, "prefill_tok_s": ctx / prefill, "decode_tok_s": tokens / decode,
            "state_mib": state / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [run(p, int(c), args.tokens, args.threads, args.flash_attn) for p in args.gguf for c in args.contexts.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| file | context | prefill tok/s | decode tok/s | sequence state |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['file']} | {r['context']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} "
              f"| {r['state_mib']:.1f} MiB |")


if __name__ == "__main__":
    main()
