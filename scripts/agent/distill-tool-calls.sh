#!/usr/bin/env bash
# Tool-call trajectories, distilled and measured: two tiny students with SmolLM2's vocabulary
# distilled from SmolLM2-135M-Instruct on the same BFCL prompts (tasks SKIP.. of each category,
# disjoint from the bench's first ones), one on the teacher's replies decoded under the tools'
# grammar (calls: SmolLM2 never writes one unconstrained), one on its free replies (no calls); then
# both behind `k3mini agent bench` on BFCL's first N tasks, unconstrained under `auto` and
# constrained under `required`, with SmolLM2 as the remote.
#   bash scripts/agent/distill-tool-calls.sh [OUT_DIR] [N_TRAIN] [STEPS] [N_BENCH]
# (writes OUT_DIR/{train.jsonl,<side>/{chats.jsonl,recipe.toml,runs,student.gguf},
# bench-<side>-{auto,required}/report.md}; each stage is skipped when its output is there)
set -euo pipefail
OUT="$(mkdir -p "${1:-tool-calls}" && cd "${1:-tool-calls}" && pwd)"
N_TRAIN="${2:-20}"
STEPS="${3:-150}"
N_BENCH="${4:-4}"
cd "$(dirname "$0")/../.."
source scripts/agent/common.sh
[ "$N_BENCH" -le 20 ] || { echo "N_BENCH must be ≤ 20: the training prompts start at task 20"; exit 1; }
# What is in OUT was made with these parameters, or the stages that are there would be reused
# under the wrong label.
stamp="n_train=$N_TRAIN steps=$STEPS n_bench=$N_BENCH"
[ ! -f "$OUT/params" ] || [ "$(cat "$OUT/params")" = "$stamp" ] ||
  { echo "$OUT was made with $(cat "$OUT/params"), not $stamp: use another OUT_DIR"; exit 1; }
echo "$stamp" > "$OUT/params"
cargo build -q
K3="$PWD/target/debug/k3mini"

# Training prompts from task 20 on (the bench takes the first N_BENCH ≤ 20), asked as the
# constrained bench asks them (`required` where a call is expected).
[ -f "$OUT/train.jsonl" ] ||
  python3 scripts/agent/bfcl-tasks.py --skip 20 --limit "$N_TRAIN" --max-tokens 160 --required \
    --out "$OUT/train.jsonl"
serve_remote "$K3" "$OUT"

# gateway POLICY LOG: `agent serve` with SmolLM2 local on a free port; sets GATEWAY (and GW, its
# pid, stopped with the remote when the script exits).
gateway() {
  "$K3" agent serve --local smollm2 --remote "$URL" --policy "$1" --port 0 > "$2" 2>&1 &
  GW=$!
  trap 'kill $TEACHER ${GW:-} 2>/dev/null' EXIT
  for _ in $(seq 300); do grep -q "^listening on" "$2" && break; sleep 0.2; done
  GATEWAY=$(awk '/^listening on/ {print $3; exit}' "$2")
  [ -n "$GATEWAY" ] || { cat "$2"; exit 1; }
}

printf 'route = "none"\n[gate]\nconstrain_calls = true\n' > "$OUT/constrained.toml"
for side in with without; do
  S="$OUT/$side"
  mkdir -p "$S"
  if [ ! -f "$S/chats.jsonl" ]; then
    # Constrained, asked as the tasks say (`required` where a call is expected); free, asked
    # with `auto` (the same prompt text), so a reply without a call is not a gate failure.
    policy="$OUT/constrained.toml" ask=()
    [ "$side" = with ] || policy=local ask=(--auto)
    gateway "$policy" "$S/gateway.log"
    python3 scripts/agent/bfcl-trajectories.py --tasks "$OUT/train.jsonl" --url "$GATEWAY" \
      --max-tokens 160 --single "${ask[@]}" --out "$S/chats.jsonl"
    kill "$GW"
    wait "$GW" 2>/dev/null || true
    GW=
  fi
  # One recipe per side: only the chats differ (the same student, seed, objectives and steps).
  cat > "$S/recipe.toml" <<TOML
[run]
name = "tools-$side"
out_dir = "$S/runs"
seed = 7
[model]
preset = "tiny"
vocab_size = 49152
[data]
tokenizer = "teacher"
seq_len = 1024
held_out_fraction = 0.1
[[data.sources]]
path = "$S/chats.jsonl"
chat = "chatml"
[teacher]
model = "smollm2"
k = 20
segments_per_shard = 8
shards_dir = "$S/shards"
[distill]
objectives = [{ kind = "forward_kl", weight = 0.5 }, { kind = "ce", weight = 0.5 }]
[optim]
lr = 3e-3
[schedule]
kind = "cosine"
warmup_steps = 10
[train]
steps = $STEPS
batch_tokens = 2048
micro_batch = 2
eval_every = 50
eval_batches = 2
checkpoint_every = 50
TOML
  [ -f "$S/student.gguf" ] || {
    "$K3" teacher score "$S/recipe.toml"
    "$K3" train "$S/recipe.toml"
    "$K3" export "$S/runs" --format gguf --quant q8_0 --out "$S/student.gguf"
  }
done

# The bench: BFCL's first N_BENCH tasks of each category, as bench-bfcl.sh asks them.
for mode in auto required; do
  tasks="$OUT/bench-$mode.jsonl"
  required=()
  [ "$mode" = auto ] || required=(--required)
  [ -f "$tasks" ] ||
    python3 scripts/agent/bfcl-tasks.py --limit "$N_BENCH" --max-tokens 96 "${required[@]}" \
      --out "$tasks"
  bench_toml "$OUT/bench-$mode.toml" 96
  [ "$mode" = auto ] || sed -i '1i constrain_calls = true' "$OUT/bench-$mode.toml"
  for side in with without; do
    "$K3" agent bench --local "$OUT/$side/student.gguf" --remote "$URL" --tasks "$tasks" \
      --bench "$OUT/bench-$mode.toml" --runs "$OUT/runs" --out "$OUT/bench-$side-$mode"
  done
done
