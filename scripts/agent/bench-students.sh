#!/usr/bin/env bash
# What distillation is worth to the agent, measured: the quickstart's two students (distilled,
# and trained with cross-entropy only on the same tokens) each behind `k3mini agent`, with
# SmolLM2-135M-Instruct (the teacher) as the remote. Tasks: continuations of The Tempest, which
# neither student saw (scored by agreement with the remote's greedy continuation), the word
# problems (exact match), and the first 20 HumanEval problems (their tests run: model-written
# Python runs on this machine). The confidence policy is calibrated on half of the tasks and
# replayed on the other half beside the baselines.
#   bash scripts/agent/bench-students.sh [QUICKSTART_DIR]
# (runs `k3mini quickstart --fast` into QUICKSTART_DIR first when its students are not there;
# writes QUICKSTART_DIR/agent/{tasks,runs,<student>/report.md,report.json,pareto.svg})
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/agent/common.sh
Q="${1:-quickstart-fast}"
cargo build -q
K3=target/debug/k3mini
[ -d "$Q/runs/distill" ] && [ -d "$Q/runs/baseline" ] || "$K3" quickstart --fast --out "$Q"
A="$Q/agent"
mkdir -p "$A"
for run in distill baseline; do
  [ -f "$A/$run.q4_k_m.gguf" ] ||
    "$K3" export "$Q/runs/$run" --format gguf --quant q4_k_m --out "$A/$run.q4_k_m.gguf"
done

# Tasks, alternating between the calibration half and the test half: 40 openings of about 30
# words spread over the play, the 12 word problems as chats, 20 HumanEval problems (128 tokens).
[ -f "$A/humaneval.jsonl" ] ||
  python3 scripts/agent/humaneval-tasks.py --limit 20 --max-tokens 128 --out "$A/humaneval.jsonl"
python3 - "$A" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
words = Path("recipes/corpus/shakespeare/tempest.txt").read_text().split()
step = (len(words) - 40) // 40
tasks = [{"id": f"tempest-{i:02}", "text": " ".join(words[i * step:i * step + 30])} for i in range(40)]
tasks += [json.loads(l) for l in Path("recipes/prompts/word-problems.jsonl").read_text().splitlines() if l.strip()]
tasks += [json.loads(l) for l in (out / "humaneval.jsonl").read_text().splitlines() if l.strip()]
for half, name in [(0, "calibrate"), (1, "test")]:
    (out / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[half::2]))
PY
bench_toml "$A/bench.toml" 32
serve_remote "$K3" "$A"

for run in distill baseline; do
  side=(--local "$A/$run.q4_k_m.gguf" --remote "$URL" --bench "$A/bench.toml" --runs "$A/runs"
    --run-tests)
  "$K3" agent calibrate "${side[@]}" --tasks "$A/calibrate.jsonl" --max-share 0.5 \
    --out "$A/$run.confidence.toml"
  "$K3" agent bench "${side[@]}" --tasks "$A/test.jsonl" --policy "$A/$run.confidence.toml" \
    --out "$A/$run"
done
