"""A llama-architecture model of a K3 Mini student's size, for decode comparisons in llama.cpp.

Reads the student's GGUF for d_model, block count, vocabulary and tokenizer, then writes a llama
GGUF with random weights (the speed of a forward does not depend on their values): full multi-head
attention (head_dim 64), SwiGLU FFN with its width chosen so the parameter count matches
--params, untied output. The F32 file is then quantised by llama.cpp's own quantiser.

    python scripts/bench/llama_baseline.py STUDENT.gguf --params 313033312 --out llama.gguf [--quant q4_k_m]
"""
import argparse
import os

import gguf
import llama_cpp
import numpy as np

FTYPES = {"q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
          "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


def field(reader, key):
    return reader.fields[key].contents()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("student")
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quant", default="q4_k_m", choices=sorted(FTYPES))
    args = ap.parse_args()
    r = gguf.GGUFReader(args.student)
    arch = field(r, "general.architecture")
    d = field(r, f"{arch}.embedding_length")
    n_layer = field(r, f"{arch}.block_count")
    vocab = field(r, f"{arch}.vocab_size")
    heads = d // 64
    per_layer = (args.params - 2 * vocab * d - d) / n_layer - 4 * d * d - 2 * d
    ffn = max(256, int(round(per_layer / (3 * d) / 256)) * 256)
    total = 2 * vocab * d + d + n_layer * (4 * d * d + 3 * d * ffn + 2 * d)

    w = gguf.GGUFWriter(args.out + ".f32", "llama")
    w.add_name("llama baseline")
    w.add_context_length(16384)
    w.add_embedding_length(d)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            value = f.contents()
            vtype = f.types[0]
            sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(0)

    def t(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02))

    t("token_embd.weight", vocab, d)
    for i in range(n_layer):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"{b}.ffn_norm.weight", np.ones(d, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"{b}.{name}.weight", d, d)
        t(f"{b}.ffn_gate.weight", ffn, d)
        t(f"{b}.ffn_up.weight", ffn, d)
        t(f"{b}.ffn_down.weight", d, ffn)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    t("output.weight", vocab, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[args.quant]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize((args.out + ".f32").encode(), args.out.encode(), params)
    os.remove(args.out + ".f32")
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")
    print(f"{args.out}: llama, d_model {d}, {n_layer} layers, ffn {ffn}, {total:,} parameters, {args.quant}")


if __name__ == "__main__":
    main()
