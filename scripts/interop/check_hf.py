"""Loads a `k3mini export --format hf --with-reference` directory in transformers'
KimiLinearForCausalLM (CPU, eager attention, fla hidden so KDA runs transformers' own torch code)
and compares its logits for the reference inputs with k3mini's. Exits non-zero past the tolerance.

    pip install torch==2.9.0 transformers==5.24.0 safetensors     # scripts/golden/requirements.txt
    python scripts/interop/check_hf.py EXPORT_DIR [--tol 1e-4]
"""
import argparse
import sys

sys.modules["fla"] = None  # transformers would dispatch KDA to fla's Triton kernels

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, KimiLinearForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("export_dir")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    config = AutoConfig.from_pretrained(args.export_dir)
    config._attn_implementation = "eager"
    model = KimiLinearForCausalLM.from_pretrained(args.export_dir, config=config, torch_dtype=torch.float32).eval()
    ref = load_file(f"{args.export_dir}/k3mini_reference.safetensors")
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"]).logits
    diff = (logits - ref["logits"]).abs().max().item()
    top1 = (logits.argmax(-1) == ref["logits"].argmax(-1)).float().mean().item()
    print(f"transformers vs k3mini: max |Δ logit| = {diff:.3e}, top-1 agreement {top1:.4f} "
          f"over {ref['input_ids'].numel()} positions (tolerance {args.tol})")
    sys.exit(0 if diff <= args.tol else 1)


if __name__ == "__main__":
    main()
