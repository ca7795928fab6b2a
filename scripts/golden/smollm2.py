"""Golden vectors for the local SmolLM2-135M-Instruct teacher, from transformers' own GGUF loader
(gguf-py dequantises the Q4_1/Q8_0 weights, LlamaForCausalLM runs them in float32): an independent
float reference of the same dequantised weights k3mini runs.

    .venv/bin/pip install -r scripts/golden/requirements.txt
    k3mini teacher fetch smollm2          # prints the GGUF path
    .venv/bin/python scripts/golden/smollm2.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = Path(__file__).resolve().parents[2] / "tests" / "golden" / "smollm2.json"
TOP = 32

TEXTS = [
    "Hello world",
    "The year 2026 has 365 days; 12345 + 678 = 13023.",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "Caf\u00e9 na\u00efve \u4e2d\u6587 \U0001f600 emoji",
    "<|im_start|>user\nHi<|im_end|>\n",
]
SCORED = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


def main() -> None:
    gguf = Path(sys.argv[1]).resolve()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    out = {"top": TOP}
    out["tokenizer"] = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TEXTS]
    scored = []
    with torch.no_grad():
        for text in SCORED:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([ids])).logits[0].double()
            logprobs = torch.log_softmax(logits, -1)
            top = torch.topk(logprobs, TOP, dim=-1)
            scored.append(
                {
                    "ids": ids,
                    "top_ids": top.indices.tolist(),
                    "top_logprobs": top.values.tolist(),
                    "logsumexp": torch.logsumexp(logits, -1).tolist(),
                    "last_logits": logits[-1].tolist()[:2048],
                }
            )
        out["scored"] = scored
        prompt = tok(CHAT, add_special_tokens=False)["input_ids"]
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        out["greedy"] = {"prompt": CHAT, "prompt_ids": prompt, "ids": gen.tolist(), "text": tok.decode(gen)}
    OUT.write_text(json.dumps(out))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); greedy: {out['greedy']['text']!r}")


if __name__ == "__main__":
    main()
