#!/usr/bin/env bash
# The 3:1 KDA/MLA hybrid against its same-size Transformer twin (docs/results/transformer-baseline.md):
#   bash scripts/bench/transformer-baseline.sh OUT [STEPS] [SEEDS]
# The tiny preset (13.5M at SmolLM2's 49,152-token vocabulary) and `tiny-transformer` (every layer
# Gated MLA, the FFN grown to the same parameters), each trained on the same segments in the same
# order as recipes/distill-smollm2.toml trains: distilled from SmolLM2-135M-Instruct (½ forward KL +
# ½ CE) and with CE alone, for each seed (each holds other segments out). The teacher scores the
# corpus once per seed. Every run is evaluated (`k3mini eval --suite quick` into RUN/eval:
# held-out bits per byte, perplexity, agreement with the teacher); training tokens/s and peak heap
# come from `k3mini bench train` of each distillation recipe, hybrid and twin interleaved
# (A B A B); decode tokens/s and sequence state in llama.cpp from `k3mini bench decode` of each
# distilled run's Q8_0 GGUF at 2K, 8K and 32K (the twin exports as deepseek2). Reruns resume
# unfinished runs and skip evaluated ones. Writes OUT/results.md (the 300M rows of
# docs/results/transformer-baseline.md are separate commands there).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: transformer-baseline.sh OUT [STEPS] [SEEDS]}
steps=${2:-150}
seeds=${3:-7}
k3mini=${K3MINI:-$root/target/debug/k3mini}
mkdir -p "$out"
out=$(cd "$out" && pwd)
corpus=$root/recipes/corpus

# recipe PRESET OBJECTIVE SEED → the recipe's path
recipe() {
  local preset=$1 objective=$2 seed=$3 objectives
  case $objective in
    kd) objectives='[{ kind = "forward_kl", weight = 0.5 }, { kind = "ce", weight = 0.5 }]' ;;
    ce) objectives='[{ kind = "ce" }]' ;;
  esac
  local name=$preset-$objective-s$seed-n$steps
  cat > "$out/$name.toml" <<EOF
[run]
name = "$name"
seed = $seed
out_dir = "$out/runs/$name"
[model]
preset = "$preset"
vocab_size = 49152
[data]
tokenizer = "teacher"
seq_len = 256
held_out_fraction = 0.2
[[data.sources]]
path = "$corpus/shakespeare/hamlet.txt"
[[data.sources]]
path = "$corpus/shakespeare/macbeth.txt"
[teacher]
model = "smollm2"
k = 20
segments_per_shard = 8
shards_dir = "$out/shards-s$seed"
[distill]
temperature = 1.0
objectives = $objectives
[optim]
lr = 3e-3
[schedule]
kind = "cosine"
warmup_steps = 10
[train]
steps = $steps
batch_tokens = 1024
micro_batch = 4
eval_every = 25
eval_batches = 8
checkpoint_every = 25
EOF
  echo "$out/$name.toml"
}

presets=(tiny tiny-transformer)
for seed in $seeds; do
  echo "== seed $seed: teacher shards"
  "$k3mini" teacher score "$(recipe tiny kd "$seed")" --quiet
  for preset in "${presets[@]}"; do
    for objective in kd ce; do
      r=$(recipe "$preset" "$objective" "$seed")
      run=$out/runs/$preset-$objective-s$seed-n$steps
      if [ ! -f "$run/eval/eval.json" ]; then
        echo "== $preset $objective seed $seed"
        if compgen -G "$run/step-*" >/dev/null; then
          "$k3mini" train "$r" --resume --quiet
        else
          "$k3mini" train "$r" --quiet
        fi
        "$k3mini" eval "$run" --suite quick --out "$run/eval" > /dev/null
      fi
    done
  done
done

echo "== training speed and memory (bench train, A B A B)"
first=${seeds%% *}
for round in 1 2; do
  for preset in "${presets[@]}"; do
    "$k3mini" bench train "$(recipe "$preset" kd "$first")" --steps 12 --json > "$out/bench-$preset-$round.json"
  done
done

echo "== decode in llama.cpp (bench decode, A B A B)"
ggufs=()
for preset in "${presets[@]}"; do
  gguf=$out/$preset-kd-s$first-n$steps.q8_0.gguf
  [ -f "$gguf" ] || "$k3mini" export "$out/runs/$preset-kd-s$first-n$steps" --format gguf --quant q8_0 --out "$gguf" > /dev/null
  ggufs+=("$gguf")
done
"$k3mini" bench decode "${ggufs[@]}" --contexts 2048,8192,32768 --tokens 256 --rounds 2 --json > "$out/decode.jsonl"

python3 - "$out" "$seeds" "$steps" "${presets[@]}" <<'PY'
import json, os, sys
out, seeds, steps, presets = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4:]
rows = ["| preset | objective | seed | held-out bits/byte | held-out loss | held-out ppl | top-1 with teacher | KL(teacher ‖ student) |", "|---|---|---|---|---|---|---|---|"]
for seed in seeds:
    for p in presets:
        for o in ("kd", "ce"):
            e = json.load(open(f"{out}/runs/{p}-{o}-s{seed}-n{steps}/eval/eval.json"))
            rep = e[0] if isinstance(e, list) else e["reports"][0] if "reports" in e else e
            top1, kl = rep.get("teacher_top1"), rep.get("teacher_kl")
            rows.append(f"| {p} | {o} | {seed} | {rep['bits_per_byte']:.4f} | {rep['loss']:.4f} | {rep['ppl']:.1f} | "
                        + (f"{100 * top1:.1f}%" if top1 is not None else "–") + " | "
                        + (f"{kl:.3f}" if kl is not None else "–") + " |")
rows += ["", "| preset | tokens/s (median of 12 steps), rounds 1 / 2 | peak heap (GiB), rounds 1 / 2 |", "|---|---|---|"]
for p in presets:
    b = [json.load(open(f"{out}/bench-{p}-{r}.json")) for r in (1, 2)]
    tps = " / ".join(f"{x['median_tokens_per_s']:.0f}" for x in b)
    heap = " / ".join(f"{(x.get('peak_heap_bytes') or 0) / 2**30:.3f}" for x in b)
    rows.append(f"| {p} | {tps} | {heap} |")
rows += ["", "| GGUF (Q8_0, distilled) | context | round | prefill tok/s | decode tok/s | sequence state (MiB) |", "|---|---|---|---|---|---|"]
for line in open(f"{out}/decode.jsonl"):
    d = json.loads(line)
    rows.append(f"| {os.path.basename(d['file'])} | {d['context']} | {d['round']} | {d['prefill_tokens_per_s']:.0f} | "
                f"{d['decode_tokens_per_s']:.1f} | {d['state_bytes'] / 2**20:.2f} |")
open(f"{out}/results.md", "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
