#!/usr/bin/env python3
"""Golden vectors for k3mini's tests, computed by the public reference implementations.

  - fla 0.6.0:  naive_recurrent_kda, naive_chunk_kda (KDA ops), naive_attnres (AttnRes)
  - transformers: KimiLinearForCausalLM on CPU (a tiny Kimi-Linear-shaped model with MoE) — run in a
    subprocess with `fla` hidden, otherwise transformers dispatches KDA to fla's Triton kernels.

Writes small safetensors files into tests/golden/ (committed), so CI needs no Python.
Usage:  python scripts/golden/generate.py [--out tests/golden]
"""
import argparse
import json
import os
import subprocess
import sys

OUT_DEFAULT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "golden")


def kda_and_attnres(out):
    import torch
    from safetensors.torch import save_file
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
    from fla.ops.attnres.naive import naive_attnres

    torch.manual_seed(0)
    B, T, H, K, V = 2, 128, 2, 32, 16  # naive_chunk_kda needs T % 64 == 0
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K) * 2 + 2).clamp_min(-5.0)
    beta = torch.sigmoid(torch.randn(B, T, H))
    s0 = torch.randn(B, H, K, V) * 0.1
    scale = K ** -0.5
    o_rec, s_rec = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True)
    o_chk, s_chk = naive_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s0, output_final_state=True,
                                   chunk_size=64)
    save_file({
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": s0,
        "o_recurrent": o_rec.float().contiguous(), "state_recurrent": s_rec.float().contiguous(),
        "o_chunk": o_chk.float().contiguous(), "state_chunk": s_chk.float().contiguous(),
        "scale": torch.tensor([scale]),
    }, os.path.join(out, "kda_ops.safetensors"), metadata={"source": "fla 0.6.0 fla.ops.kda.naive"})

    torch.manual_seed(1)
    D, L = 32, 5
    residuals = [torch.randn(2, 3, D) * (i + 1) for i in range(L)]
    query = torch.randn(D)
    rms_weight = 1 + 0.1 * torch.randn(D)
    o = naive_attnres(query, residuals, rms_weight, rms_eps=1e-5)
    tensors = {f"residual_{i}": r for i, r in enumerate(residuals)}
    tensors.update({"query": query, "rms_weight": rms_weight, "output": o.contiguous()})
    save_file(tensors, os.path.join(out, "attnres.safetensors"),
              metadata={"source": "fla 0.6.0 fla.ops.attnres.naive.naive_attnres", "rms_eps": "1e-5"})


# The tiny Kimi-Linear model: KKKM with one dense FFN then MoE (8 experts, top-2, one shared).
TINY_KIMI = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
    kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32,
    linear_head_dim=32, linear_num_heads=2, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
    rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def kimi_linear(out):
    sys.modules["fla"] = None  # hide fla: transformers would dispatch KDA to its Triton kernels
    import torch
    from safetensors.torch import save_file
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    torch.manual_seed(2)
    config = KimiLinearConfig(**TINY_KIMI)
    config._attn_implementation = "eager"
    model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        # Make every parameter matter: non-trivial norms, biases and decays.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    ids = torch.randint(0, config.vocab_size, (2, 70))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, "kimi_linear_tiny.safetensors"),
              metadata={"source": "transformers KimiLinearForCausalLM", "config": json.dumps(TINY_KIMI)})
    save_file({"input_ids": ids.to(torch.int64), "logits": logits.float().contiguous()},
              os.path.join(out, "kimi_linear_tiny_logits.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT_DEFAULT)
    ap.add_argument("--only", choices=["fla", "transformers"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.only == "fla":
        kda_and_attnres(args.out)
    elif args.only == "transformers":
        kimi_linear(args.out)
    else:  # each reference in its own process, so hiding fla cannot leak
        for part in ("fla", "transformers"):
            subprocess.run([sys.executable, __file__, "--out", args.out, "--only", part], check=True)
        for f in sorted(os.listdir(args.out)):
            print(f"{f}: {os.path.getsize(os.path.join(args.out, f))} bytes")


if __name__ == "__main__":
    main()
