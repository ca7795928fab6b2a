#!/usr/bin/env bash
# The export interop proof, end to end on a small real student: score a tiny corpus with the
# SmolLM2 teacher, distil 6 steps, export to HF and to GGUF (F32, Q8_0, Q4_K_M), then check that
# transformers (check_hf.py) and llama.cpp (check_gguf.py) compute what k3mini computes.
# Needs the environments scripts/interop/setup.sh builds; takes about a minute.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENVS="${K3MINI_CACHE:-$HOME/.cache/k3mini}/venvs"
BIN="${K3MINI_BIN:-target/debug/k3mini}"
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
head -c 2000 recipes/corpus/shakespeare/hamlet.txt > "$W/a.txt"
head -c 2000 recipes/corpus/shakespeare/macbeth.txt > "$W/b.txt"
head -c 2000 recipes/corpus/shakespeare/tempest.txt > "$W/c.txt"
cat > "$W/interop.toml" <<TOML
[run]
name = "interop"
seed = 3
out_dir = "$W/run"
[model]
preset = "tiny"
vocab_size = 49152
d_model = 64
[data]
tokenizer = "teacher"
seq_len = 64
held_out_fraction = 0.34
[[data.sources]]
path = "a.txt"
[[data.sources]]
path = "b.txt"
[[data.sources]]
path = "c.txt"
[teacher]
model = "smollm2"
k = 8
segments_per_shard = 8
shards_dir = "$W/shards"
[distill]
objectives = [{ kind = "forward_kl", weight = 0.5 }, { kind = "ce", weight = 0.5 }]
[optim]
lr = 3e-3
[schedule]
kind = "constant"
warmup_steps = 0
[train]
steps = 6
batch_tokens = 256
micro_batch = 4
eval_every = 6
eval_batches = 1
TOML
"$BIN" teacher score "$W/interop.toml" --quiet
"$BIN" train "$W/interop.toml" --quiet > /dev/null
"$BIN" export "$W/run" --format hf --out "$W/hf" --with-reference > /dev/null
"$VENVS/hf/bin/python" scripts/interop/check_hf.py "$W/hf" 2>&1 | grep -E "^transformers vs" 
for q in f32 q8_0 q4_k_m; do
  "$BIN" export "$W/run" --format gguf --quant "$q" --out "$W/$q.gguf"
  case "$q" in
    f32) args=(--tol 5e-4) ;;
    *) args=(--tol 1e9 --max-kl 0.1) ;;
  esac
  "$VENVS/llama/bin/python" scripts/interop/check_gguf.py "$W/$q.gguf" "$W/hf" "${args[@]}"
done
echo "interop: transformers and llama.cpp agree with k3mini"
