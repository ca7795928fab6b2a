#!/usr/bin/env bash
# The export interop proof, end to end on a small real student: score a tiny corpus with the
# SmolLM2 teacher, distil 6 steps, export to HF and to GGUF (F32, Q8_0, Q4_K_M), then check that
# transformers (check_hf.py) and llama.cpp (check_gguf.py) compute what k3mini computes.
# Needs the environments scripts/interop/setup.sh builds; takes about a minute.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENVS="${K3MINI_CACHE:-${HOME:-}/.cache/k3mini}/venvs"
BIN="${K3MINI_BIN:-target/debug/k3mini}"
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
head -c 2000 recipes/corpus/shakespeare/hamlet.txt > "$W/a.txt"
head -c 2000 recipes/corpus/shakespeare/macbeth.txt > "$W/b.txt"
head -c 2000 recipes/corpus/shakespeare/tempest.txt > "$W/c.txt"
# Four students, each distilled 6 steps from the same shards: dense and MoE Kimi Linear shapes
# (transformers and llama.cpp's kimi-linear), and two with K3 features (llama.cpp's kimi-k3; the
# HF export refuses them): block AttnRes, a full-rank safe KDA gate, q-LoRA and the MLA gate with
# SwiGLU; SiTU with LatentMoE and a low-rank KDA gate.
DENSE='preset = "tiny"
vocab_size = 49152
d_model = 64'
MOE='preset = "k3-mini-moe"
vocab_size = 49152
d_model = 64
n_layers = 4
n_heads = 2
ffn_hidden = 128
max_seq_len = 512
[model.kda]
head_dim = 32
gate_rank = 32
[model.mla]
kv_lora_rank = 32
qk_nope_head_dim = 16
qk_rope_head_dim = 8
v_head_dim = 16
[model.moe]
num_experts = 4
top_k = 2
expert_hidden = 32'
K3='preset = "tiny"
vocab_size = 49152
d_model = 64
[model.kda]
head_dim = 64
gate_lower_bound = -5.0
[model.mla]
q_lora_rank = 48
kv_lora_rank = 32
qk_nope_head_dim = 16
qk_rope_head_dim = 8
v_head_dim = 16
output_gate = true
[model.attn_res]
block_size = 4'
K3MOE="$MOE
latent_dim = 32
[model.attn_res]
block_size = 2"
K3MOE="${K3MOE/max_seq_len = 512/max_seq_len = 512
activation = \"situ\"}"
# And a student with a tokenizer of its own (byte-level BPE, 4096 ids), trained on plain text.
OWN='preset = "tiny"
vocab_size = 4096
d_model = 64'
for student in dense moe k3 k3moe own; do
  case "$student" in
    own) MODEL="$OWN" ;;
    dense) MODEL="$DENSE" ;;
    moe) MODEL="$MOE" ;;
    k3) MODEL="$K3" ;;
    k3moe) MODEL="$K3MOE" ;;
  esac
  R="$W/$student"
  mkdir -p "$R"
  cp "$W"/*.txt "$R/"
  TOKENIZER=teacher
  DISTILL='[teacher]
model = "smollm2"
k = 8
segments_per_shard = 8
shards_dir = "'"$W"'/shards"
[distill]
objectives = [{ kind = "forward_kl", weight = 0.5 }, { kind = "ce", weight = 0.5 }]'
  if [ "$student" = own ]; then
    TOKENIZER="$PWD/recipes/corpus/shakespeare-bpe4k.json"
    DISTILL=""
  fi
cat > "$R/interop.toml" <<TOML
[run]
name = "interop"
seed = 3
out_dir = "$R/run"
[model]
$MODEL
[data]
tokenizer = "$TOKENIZER"
seq_len = 64
held_out_fraction = 0.34
[[data.sources]]
path = "a.txt"
[[data.sources]]
path = "b.txt"
[[data.sources]]
path = "c.txt"
$DISTILL
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
[ -n "$DISTILL" ] && "$BIN" teacher score "$R/interop.toml" --quiet
"$BIN" train "$R/interop.toml" --quiet > /dev/null
case "$student" in
  dense|moe|own)
    "$BIN" export "$R/run" --format hf --out "$R/hf" --with-reference > /dev/null
    "$VENVS/hf/bin/python" scripts/interop/check_hf.py "$R/hf" 2>&1 | grep -E "^transformers vs" ;;
  *)
    if "$BIN" export "$R/run" --format hf --out "$R/hf" 2> "$R/refused"; then
      echo "the HF export of $student should have been refused"; exit 1
    fi ;;
esac
for q in f32 q8_0 q4_k_m; do
  "$BIN" export "$R/run" --format gguf --quant "$q" --out "$R/$q.gguf" --with-reference
  case "$q" in
    f32) args=(--tol 5e-4) ;;
    *) args=(--tol 1e9 --max-kl 0.1) ;;
  esac
  "$VENVS/llama/bin/python" scripts/interop/check_gguf.py "$R/$q.gguf" "$R/$q.reference.safetensors" "${args[@]}"
done
done
echo "interop: transformers and llama.cpp agree with k3mini"
