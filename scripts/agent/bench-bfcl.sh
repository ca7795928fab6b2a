#!/usr/bin/env bash
# Tool calling, measured: BFCL's single-turn Python categories (the first N tasks of simple,
# multiple, parallel, parallel_multiple and irrelevance, from the `bfcl-eval` package) answered
# by a local student behind `k3mini agent`, with SmolLM2-135M-Instruct behind `teacher serve` as
# the remote; scored by BFCL's AST check, with each policy's valid-call rate (answers that pass
# the tool gate) and the gate policy replayed.
#   [REQUIRED=1] [CONSTRAIN=1] bash scripts/agent/bench-bfcl.sh [LOCAL_GGUF_OR_NAME] [OUT_DIR] [N] [MAX_TOKENS]
# (LOCAL defaults to smollm2, the remote's own model; writes OUT_DIR/{bfcl[-required].jsonl,runs,report.md,
# report.json,pareto.svg}). REQUIRED=1: the tasks that expect calls ask with tool_choice
# "required"; CONSTRAIN=1: the student's own answers are decoded under the tools' grammar.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/agent/common.sh
LOCAL="${1:-smollm2}"
OUT="${2:-bfcl-bench}"
N="${3:-10}"
MAX_TOKENS="${4:-128}"
cargo build -q
K3=target/debug/k3mini
mkdir -p "$OUT"
TASKS="$OUT/bfcl${REQUIRED:+-required}.jsonl"
[ -f "$TASKS" ] ||
  python3 scripts/agent/bfcl-tasks.py --limit "$N" --max-tokens "$MAX_TOKENS" --out "$TASKS" \
    ${REQUIRED:+--required}
bench_toml "$OUT/bench.toml" "$MAX_TOKENS"
[ -z "${CONSTRAIN:-}" ] || sed -i '1i constrain_calls = true' "$OUT/bench.toml"
serve_remote "$K3" "$OUT"

"$K3" agent bench --local "$LOCAL" --remote "$URL" --tasks "$TASKS" \
  --bench "$OUT/bench.toml" --runs "$OUT/runs" --out "$OUT"
