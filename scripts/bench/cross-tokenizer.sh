#!/usr/bin/env bash
# Cross-tokenizer distillation against cross-entropy alone, in bits per byte
# (docs/results/cross-tokenizer.md):
#   bash scripts/bench/cross-tokenizer.sh OUT [STEPS]
# Two domains (prose: Hamlet and Macbeth; code: fifteen CPython modules), each scored once by
# SmolLM2-135M-Instruct (49,152 ids) into aligned shards for the tiny student on the 4,096-id
# Shakespeare BPE; then, for seeds 5 and 7 (each holds other documents out), five students on the
# same segments in the same order: ce, ce + alm (binarisation temperature 100, tokenkit's default,
# and 1), ce + xtoken, ce + alm + xtoken (recipes as recipes/distill-cross.toml). The ce run of each domain and seed is evaluated (`k3mini eval`: held-out
# bits per byte); every run's logged held-out losses are converted to bits per byte with that
# bytes-per-token ratio (the runs of a domain and seed hold out the same segments). Reruns skip finished runs. Writes OUT/results.md and
# OUT/results.json.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: cross-tokenizer.sh OUT [STEPS]}
steps=${2:-150}
k3mini=${K3MINI:-$root/target/debug/k3mini}
mkdir -p "$out"
out=$(cd "$out" && pwd)
corpus=$root/recipes/corpus

# recipe DOMAIN SEED CONFIG OBJECTIVES → the recipe's path
recipe() {
  local domain=$1 seed=$2 config=$3 objectives=$4 sources
  case $domain in
    prose) sources="[[data.sources]]
path = \"$corpus/shakespeare/hamlet.txt\"
[[data.sources]]
path = \"$corpus/shakespeare/macbeth.txt\"" ;;
    code) sources="[[data.sources]]
path = \"$corpus/code/python-stdlib.jsonl\"
[[data.sources]]
path = \"$corpus/code/python-stdlib-heldout.jsonl\"" ;;
  esac
  local path=$out/$domain-$config-s$seed.toml
  cat > "$path" <<EOF
[run]
name = "$domain-$config-s$seed"
seed = $seed
out_dir = "$out/runs/$domain-$config-s$seed"
[model]
preset = "tiny"
vocab_size = 4096
[data]
tokenizer = "$corpus/shakespeare-bpe4k.json"
seq_len = 256
held_out_fraction = 0.2
$sources
[teacher]
model = "smollm2"
k = 20
segments_per_shard = 8
shards_dir = "$out/$domain-shards"
[distill]
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
eval_every = 10
eval_batches = 8
checkpoint_every = $steps
EOF
  echo "$path"
}

declare -A configs=(
  [ce]='[{ kind = "ce" }]'
  [alm]='[{ kind = "ce" }, { kind = "alm" }]'
  [alm1]='[{ kind = "ce" }, { kind = "alm", binarization_temperature = 1.0 }]'
  [xtoken]='[{ kind = "ce" }, { kind = "xtoken", weight = 0.5 }]'
  [both]='[{ kind = "ce" }, { kind = "alm" }, { kind = "xtoken", weight = 0.5 }]'
)
for domain in prose code; do
  echo "== $domain: scoring (aligned shards)"
  "$k3mini" teacher score --quiet "$(recipe "$domain" 7 both "${configs[both]}")"
  for seed in 5 7; do
    for config in ce alm alm1 xtoken both; do
      r=$(recipe "$domain" "$seed" "$config" "${configs[$config]}")
      run=$out/runs/$domain-$config-s$seed
      # A finished run of this very recipe is kept; anything else is trained afresh.
      sum=$(sha256sum < "$r")
      if [ ! -d "$run/step-$(printf %08d "$steps")" ] || [ "$(cat "$run.recipe-sha256" 2>/dev/null)" != "$sum" ]; then
        echo "== $domain $config seed $seed"
        rm -rf "$run" "$run.recipe-sha256"
        start=$(date +%s)
        "$k3mini" train --quiet "$r"
        echo $(( $(date +%s) - start )) > "$out/$domain-$config-s$seed.seconds"
        echo "$sum" > "$run.recipe-sha256"
      fi
      # One `k3mini eval` per domain and seed (the ce run): the held-out segments, and so their
      # bytes per token, are the same for every run of the domain and seed.
      if [ "$config" = ce ] && { [ ! -f "$run/eval/eval.json" ] || [ "$run/eval/eval.json" -ot "$run.recipe-sha256" ]; }; then
        "$k3mini" eval --out "$run/eval" "$run" > /dev/null
      fi
    done
  done
done

python3 - "$out" "$steps" <<'PY'
import json, math, sys
out, steps = sys.argv[1], int(sys.argv[2])
rows, summary = [], []
for domain in ("prose", "code"):
    for seed in (5, 7):
        runs = {}
        ev = json.load(open(f"{out}/runs/{domain}-ce-s{seed}/eval/eval.json"))
        ev = ev[0] if isinstance(ev, list) else ev
        # The held-out batches are fixed per seed: bits per byte = loss (nats/token) × this ratio.
        ratio = ev["bits_per_byte"] / ev["loss"]
        for config in ("ce", "alm", "alm1", "xtoken", "both"):
            run = f"{out}/runs/{domain}-{config}-s{seed}"
            evals = [m for m in map(json.loads, open(f"{run}/metrics.jsonl"))
                     if m.get("eval_loss") is not None]
            last = evals[-1]
            assert last["step"] == steps, (run, last["step"])
            runs[config] = dict(bpb=last["eval_loss"] * ratio, loss=last["eval_loss"],
                                kl=last.get("eval_kl"), top1=last.get("eval_top1"),
                                curve=[(m["step"], m["eval_loss"] * ratio) for m in evals],
                                seconds=float(open(f"{out}/{domain}-{config}-s{seed}.seconds").read()))
        # The ce run's own eval reproduces its logged held-out loss (the same batches).
        assert abs(runs["ce"]["loss"] - ev["loss"]) < 1e-4, (runs["ce"]["loss"], ev["loss"])
        target = runs["ce"]["bpb"]
        for config, r in runs.items():
            reach = next((s for s, b in r["curve"] if b <= target), None)
            r["steps_to_ce_final"] = reach
            rows.append(dict(domain=domain, seed=seed, config=config, **r))
json.dump(rows, open(f"{out}/results.json", "w"), indent=1)
names = {"ce": "ce", "alm": "ce + alm (T = 100)", "alm1": "ce + alm (T = 1)",
         "xtoken": "ce + xtoken", "both": "ce + alm + xtoken"}
with open(f"{out}/results.md", "w") as f:
    f.write("| domain | seed | objectives | held-out bits/byte | vs ce | steps to ce's final bits/byte (of %d) | top-1 agreement | KL (projected) | train s |\n" % steps)
    f.write("|---|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        ce = next(x for x in rows if x["domain"] == r["domain"] and x["seed"] == r["seed"] and x["config"] == "ce")
        d = (r["bpb"] - ce["bpb"]) / ce["bpb"] * 100
        reach = "—" if r["steps_to_ce_final"] is None else str(r["steps_to_ce_final"])
        fmt = lambda x, p: "—" if x is None else f"{x:.{p}f}"
        f.write(f"| {r['domain']} | {r['seed']} | {names[r['config']]} | {r['bpb']:.4f} | {d:+.2f}% | {reach} | "
                f"{fmt(r['top1'], 3)} | {fmt(r['kl'], 3)} | {r['seconds']:.0f} |\n")
print(open(f"{out}/results.md").read())
PY
