#!/usr/bin/env bash
# Every GPU check in one command (under ten minutes on one H200), and its CPU half anywhere:
#
#   scripts/device/gpu-check.sh [K3MINI_BINARY] [OUT_DIR]
#
# 1. correctness: ci-tiny's first 6 f32 steps on $DEVICE against the same steps on the CPU
#    (per-step loss; with 2+ GPUs also cuda:0,1 data-parallel against cuda:0);
# 2. speed and memory: `k3mini bench train` on smoke-300m in f32, f32 with activation
#    checkpointing, and bf16 matmuls: tokens/s, peak GPU memory (nvidia-smi, sampled every 0.2 s),
#    and model FLOPs utilisation (model FLOPs per token, as `k3mini_student::info::train_flops_per_token`
#    counts them, × tokens/s over the device's dense peak);
# 3. the 3B recipe (recipes/k3-mini-3b.toml: checkpointing, 1 x 4096 micro-batches) in bf16 for
#    two optimizer steps of 4 micro-batches each: tokens/s, peak memory against `model info`.
# 4. scaling over 1, 2, 4 and all GPUs on the 300M and 3B steps (section 4 below);
# 5. ranks as processes under torchrun (NCCL on GPUs, Gloo on CPUs; section 5 below).
# (2b: host memory of smoke-300m checkpointing after every step against never, GPU only.)
#
# DEVICE defaults to cuda:0 when nvidia-smi sees a GPU, else cpu (the CPU half: step 1 compares
# one CPU device with two CPU replicas, step 2 runs on the CPU, step 3 is skipped, step 4 scales
# ci-tiny over one and two CPU replicas).
# PEAK_TFLOPS and PEAK_BF16_TFLOPS are the dense peaks MFU is taken against (defaults 67 and 989:
# H100/H200 SXM, f32 without TF32, and bf16 tensor cores).
#
# A `--features tch` binary must be built against the PyTorch the GPU machine runs (README,
# "Training on GPUs"), and finds it through LD_LIBRARY_PATH=<site-packages>/torch/lib, which this
# script sets from `python3 -c "import torch"` when it can.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${1:-target/release/k3mini}"
OUT="${2:-${OUT:-gpu-check}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
if torch_lib="$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"; then
  export LD_LIBRARY_PATH="$torch_lib:${LD_LIBRARY_PATH:-}"
fi
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
DEVICE="${DEVICE:-$([ "$gpus" -gt 0 ] && echo cuda:0 || echo cpu)}"
PEAK_TFLOPS="${PEAK_TFLOPS:-67}"
PEAK_BF16_TFLOPS="${PEAK_BF16_TFLOPS:-989}"
echo "k3mini gpu-check: $BIN on $DEVICE ($gpus GPU(s) seen), results in $OUT"
"$BIN" --version || { echo "cannot run $BIN (is LD_LIBRARY_PATH at PyTorch's torch/lib?)"; exit 1; }
[ "$gpus" -gt 0 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"

# Peak memory.used (MiB) of GPU 0 while a command runs; "-" without a GPU.
with_peak() {
  local log="$1"; shift
  if [ "$gpus" -eq 0 ]; then "$@"; echo "-" > "$log.peak"; return; fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 200 > "$log.mem" &
  local sampler=$!
  local rc=0
  "$@" || rc=$?
  kill "$sampler" 2>/dev/null || true
  sort -n "$log.mem" | tail -1 > "$log.peak"
  return $rc
}

# 1. Correctness.
steps_of() {  # recipe device out
  "$BIN" train "$1" --device "$2" --out "$3" --stop-after 6 --quiet > "$3.log" 2>&1
}
rm -rf "$OUT/ref" "$OUT/dev" "$OUT/dp"
if [ "$DEVICE" = cpu ]; then
  steps_of recipes/ci-tiny.toml cpu "$OUT/ref"
  steps_of recipes/ci-tiny.toml cpu,cpu "$OUT/dev"
  pair="cpu against cpu,cpu (two replicas)"
else
  steps_of recipes/ci-tiny.toml cpu "$OUT/ref"
  steps_of recipes/ci-tiny.toml "$DEVICE" "$OUT/dev"
  pair="cpu against $DEVICE"
  if [ "$gpus" -ge 2 ]; then
    steps_of recipes/ci-tiny.toml cuda:0,1 "$OUT/dp"
  fi
fi
python3 - "$OUT" "$pair" <<'EOF'
import json, sys, os
out, pair = sys.argv[1], sys.argv[2]
def losses(d):
    return [json.loads(l)["loss"] for l in open(os.path.join(d, "metrics.jsonl"))]
ref = losses(os.path.join(out, "ref"))
rows = [("dev", pair)]
if os.path.isdir(os.path.join(out, "dp")):
    rows.append(("dp", "cpu against cuda:0,1 (two GPU replicas)"))
with open(os.path.join(out, "correctness.md"), "w") as f:
    for name, what in rows:
        other = losses(os.path.join(out, name))
        worst = max(abs(a - b) / abs(a) for a, b in zip(ref, other))
        line = f"- ci-tiny, 6 f32 steps, {what}: max relative loss difference {worst:.2e}"
        print(line); f.write(line + "\n")
        assert worst < 1e-3, f"{what}: the losses differ by {worst}"
EOF

# 2. smoke-300m: tokens/s, peak memory, MFU, without and with activation checkpointing.
# On the CPU two steps: smoke-300m checkpoints at step 2, after the last step's peak RSS is read,
# so that peak is the steps' own (GPU memory is not touched by a checkpoint).
STEPS="$([ "$DEVICE" = cpu ] && echo 2 || echo 3)"
bench() {  # name recipe extra-args...
  local name="$1" recipe="$2"; shift 2
  with_peak "$OUT/$name" "$BIN" bench train "$recipe" --steps "$STEPS" --json --device "$DEVICE" "$@" \
    > "$OUT/$name.json" 2> "$OUT/$name.log"
}
bench smoke recipes/smoke-300m.toml
bench smoke-ckpt recipes/smoke-300m.toml --activation-checkpointing
bench smoke-bf16 recipes/smoke-300m.toml --precision bf16
# 2b. What checkpoints cost the host: smoke-300m writing one after every step against none before
# the last measured step (the moments come off the GPU a tensor at a time). GPU only: the CPU
# figure is in docs/training.md.
if [ "$DEVICE" != cpu ]; then
  bench smoke-ckpt-every recipes/smoke-300m.toml --checkpoint-every 1
  bench smoke-ckpt-never recipes/smoke-300m.toml --checkpoint-every 0
fi

# 3. The 3B recipe, two steps of four 1 x 4096 micro-batches (GPU only).
if [ "$DEVICE" != cpu ]; then
  sed -e 's/^batch_tokens = .*/batch_tokens = 16384/' -e 's/^log_every = .*/log_every = 1/' \
    -e "s|\"corpus/|\"$PWD/recipes/corpus/|" recipes/k3-mini-3b.toml > "$OUT/k3-mini-3b-check.toml"
  "$BIN" model info --recipe "$OUT/k3-mini-3b-check.toml" > "$OUT/k3-mini-3b-info.txt"
  bench k3-3b "$OUT/k3-mini-3b-check.toml" --precision bf16 || echo "3B run failed: see $OUT/k3-3b.log"
fi

# 4. Scaling: the same global batch over 1, 2, 4 and all GPUs (strong scaling; two micro-batches
# per device at the most devices), three optimizer steps each of smoke-300m in f32 and of the 3B
# recipe in bf16 (its 1 x 4096 micro-batches, checkpointing): tokens/s of the steps after the
# first, efficiency against one GPU, how many devices worked at once (Σ each device's busy seconds
# / the step's seconds, from metrics.jsonl), every GPU's peak memory, and the losses against one
# GPU's. Each run's checkpoint is deleted once its metrics are copied (the 3B's is ~40 GiB). With
# one GPU there is nothing to scale over; without one: ci-tiny on 1 and 2 CPU replicas (the same
# code path).
with_peak_all() {  # log cmd...: every GPU's memory.used (MiB), sampled while cmd runs
  local log="$1"; shift
  if [ "$DEVICE" = cpu ]; then : > "$log.mem"; "$@"; return; fi
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$log.mem" &
  local sampler=$!
  local rc=0
  "$@" || rc=$?
  kill "$sampler" 2>/dev/null || true
  return $rc
}
devices_of() {  # n: the first n devices, as --device takes them
  if [ "$DEVICE" = cpu ]; then
    local d=cpu i
    for ((i = 1; i < $1; i++)); do d="$d,cpu"; done
    echo "$d"
  else
    echo "cuda:$(seq -s, 0 $(($1 - 1)))"
  fi
}
# CUDA numbers devices as nvidia-smi does (by PCI bus), so GPU i's memory is cuda:i's.
export CUDA_DEVICE_ORDER=PCI_BUS_ID
most="$([ "$DEVICE" = cpu ] && echo 2 || echo "$gpus")"
counts="$(for n in 1 2 4 "$most"; do [ "$n" -le "$most" ] && echo "$n"; done | sort -nu | tr '\n' ' ')"
scaled() {  # name recipe tokens-per-micro-batch precision: a copy stepping two micro-batches per
            # device at $most devices, logging every step, at that precision
  sed -e "s/^batch_tokens = .*/batch_tokens = $((2 * most * $3))/" -e '/^log_every = /d' \
    -e '/^checkpoint_every = /d' -e '/^precision = /d' \
    -e 's/^\[train\]$/[train]\nlog_every = 1\ncheckpoint_every = 1000000/' \
    -e "s/^\[model\]$/[model]\nprecision = \"$4\"/" -e "s|\"corpus/|\"$PWD/recipes/corpus/|" \
    "$2" > "$OUT/scale-$1.toml"
}
scaling=()
if [ "$DEVICE" = cpu ]; then
  scaled ci-tiny recipes/ci-tiny.toml 512 f32
  scaling=(ci-tiny)
elif [ "$most" -ge 2 ]; then
  scaled smoke-300m recipes/smoke-300m.toml 512 f32
  scaled k3-3b recipes/k3-mini-3b.toml 4096 bf16
  scaling=(smoke-300m k3-3b)
fi
for name in "${scaling[@]}"; do
  for n in $counts; do
    run="$OUT/scale-$name-$n"
    rm -rf "$run"
    with_peak_all "$run" "$BIN" train "$OUT/scale-$name.toml" --device "$(devices_of "$n")" \
      --out "$run" --stop-after 3 --quiet > "$run.log" 2>&1 ||
      echo "scaling: $name on $n device(s) failed, see $run.log"
    cp "$run/metrics.jsonl" "$run.metrics.jsonl" 2>/dev/null || true
    rm -rf "$run"
  done
done
python3 - "$OUT" "$counts" "${scaling[@]}" <<'EOF'
import json, sys, os, statistics
out, counts, runs = sys.argv[1], [int(n) for n in sys.argv[2].split()], sys.argv[3:]
rows = ["| recipe | devices | tokens/s | efficiency against 1 | devices working at once | peak memory per GPU (GiB) | max relative loss difference against 1 |",
        "|---|---|---|---|---|---|---|"]
def steps(name, n):
    try:
        return [json.loads(l) for l in open(os.path.join(out, f"scale-{name}-{n}.metrics.jsonl"))]
    except (OSError, ValueError):
        return []
def peaks(name, n):
    peak = {}
    for line in open(os.path.join(out, f"scale-{name}-{n}.mem")):
        try:
            i, used = (int(x) for x in line.split(","))
        except ValueError:  # a line nvidia-smi was still writing, or [N/A]
            continue
        peak[i] = max(peak.get(i, 0), used)
    return " / ".join(f"{peak[i] / 1024:.1f}" for i in sorted(peak) if i < n) or "-"
for name in runs:
    one = steps(name, 1)
    base = statistics.median(m["tokens_per_s"] for m in one[1:]) if len(one) > 1 else None
    for n in counts:
        ms = steps(name, n)
        if len(ms) < 2:
            rows.append(f"| {name} | {n} | failed | | | | |")
            continue
        rate = statistics.median(m["tokens_per_s"] for m in ms[1:])
        per_step = ms[0]["tokens"] // ms[0]["step"]
        at_once = statistics.median(sum(m["replica_busy_s"]) * m["tokens_per_s"] / per_step for m in ms[1:])
        losses = [(a["loss"], b["loss"]) for a, b in zip(one, ms)]
        diff = max((abs(a - b) / abs(a) for a, b in losses if a is not None and b is not None), default=float("nan"))
        eff = f"{rate / (n * base):.2f}" if base else "-"
        rows.append(f"| {name} | {n} | {rate:.0f} | {eff} | {at_once:.2f} | {peaks(name, n)} | {diff:.1e} |")
if not runs:
    rows.append("| (one GPU: nothing to scale over) | | | | | | |")
table = "\n".join(rows)
print(table)
open(os.path.join(out, "scaling.md"), "w").write(table + "\n")
EOF

# 5. Ranks as processes, one device each, started by torchrun (needs a `--features c10d` binary,
# `tch,nccl` on GPUs, and torchrun on PATH): a copy of ci-tiny stepping two micro-batches per
# device at the most devices, 6 steps across 2 up to all GPUs meeting through NCCL (CPU half: 2
# processes over Gloo): tokens/s, seconds in collectives a step, and the first step's loss against
# one process's on the same batch. DIST_TEST, the dist crate's test binary of a `--features nccl`
# build (target/debug/deps/collectives-*), checks NCCL's collectives of a group of one on GPU 0
# against the thread ranks'.
rank_counts="$(for n in 2 4 "$most"; do [ "$n" -le "$most" ] && echo "$n"; done | sort -nu | tr '\n' ' ')"
sed -e "s/^batch_tokens = .*/batch_tokens = $((2 * most * 512))/" \
  -e "s|\"corpus/|\"$PWD/recipes/corpus/|" recipes/ci-tiny.toml > "$OUT/ranks-ci-tiny.toml"
rank_device="$([ "$DEVICE" = cpu ] && echo cpu || echo cuda)"
: > "$OUT/ranks.md"
if [ -n "${DIST_TEST:-}" ]; then
  # A binary built without nccl has no such test and passes nothing: the count must say 1.
  if "$DIST_TEST" --exact gloo::nccl_runs_on_a_cuda_device_or_says_there_is_none > "$OUT/nccl-test.log" 2>&1 &&
    grep -q "1 passed" "$OUT/nccl-test.log"; then
    echo "- NCCL, a group of one on GPU 0: its collectives equal the thread ranks' (passed)" >> "$OUT/ranks.md"
  else
    echo "- NCCL, a group of one on GPU 0: FAILED, see nccl-test.log" >> "$OUT/ranks.md"
  fi
fi
rm -rf "$OUT/ranks-1"
"$BIN" train "$OUT/ranks-ci-tiny.toml" --device "$DEVICE" --out "$OUT/ranks-1" --stop-after 1 \
  --quiet > "$OUT/ranks-1.log" 2>&1 || echo "ranks: one process failed, see $OUT/ranks-1.log"
if command -v torchrun >/dev/null 2>&1; then
  for n in $rank_counts; do
    run="$OUT/ranks-$n"
    rm -rf "$run"
    # Each rank takes cuda:LOCAL_RANK (`--device cuda`), or the CPU.
    K3MINI_STORE_FILE="$OUT/ranks-$n.store" torchrun --standalone \
      --nproc-per-node "$n" --no-python "$BIN" train "$OUT/ranks-ci-tiny.toml" \
      --device "$rank_device" --out "$run" --stop-after 6 --quiet > "$run.log" 2>&1 ||
      echo "ranks: $n processes failed, see $run.log"
    rm -f "$OUT/ranks-$n.store"
  done
else
  echo "- ranks: no torchrun on PATH, not run" >> "$OUT/ranks.md"
fi
python3 - "$OUT" "$rank_counts" "$DEVICE" <<'EOF'
import json, os, statistics, sys
out, counts, device = sys.argv[1], [int(n) for n in sys.argv[2].split()], sys.argv[3]
def steps(name):
    try:
        return [json.loads(l) for l in open(os.path.join(out, name, "metrics.jsonl"))]
    except (OSError, ValueError):
        return []
one = steps("ranks-1")
rows = [f"| ci-tiny, processes on {device} | tokens/s | collectives a step (s) | step 1's loss against one process's |",
        "|---|---|---|---|"]
def diff(a, b):  # a non-finite loss is logged as null
    if a is None or b is None:
        return "n/a"
    return f"{abs(a - b) / abs(b):.1e}"
for n in counts:
    ms = steps(f"ranks-{n}")
    if len(ms) < 2:
        rows.append(f"| {n} | failed | | |")
        continue
    rate = statistics.median(m["tokens_per_s"] for m in ms[1:])
    coll = statistics.median(m.get("collective_s") or 0.0 for m in ms[1:])
    rows.append(f"| {n} | {rate:.0f} | {coll:.3f} | {diff(ms[0]['loss'], one[0]['loss']) if one else 'n/a'} |")
if not counts:
    rows.append("| (one GPU: no second rank to run) | | | |")
table = "\n".join(rows)
print(table)
with open(os.path.join(out, "ranks.md"), "a") as f:
    f.write(table + "\n")
EOF

python3 - "$OUT" "$DEVICE" "$PEAK_TFLOPS" "$PEAK_BF16_TFLOPS" <<'EOF'
import json, sys, os
out, device = sys.argv[1], sys.argv[2]
peaks = {"f32": float(sys.argv[3]), "bf16": float(sys.argv[4])}
rows = ["| run | device | params | tokens/s | peak GPU memory | MFU |", "|---|---|---|---|---|---|"]
for name, label, prec in [("smoke", "smoke-300m, f32", "f32"),
                          ("smoke-ckpt", "smoke-300m, f32, activation checkpointing", "f32"),
                          ("smoke-bf16", "smoke-300m, bf16 matmuls", "bf16"),
                          ("k3-3b", "k3-mini-3b, bf16 matmuls, checkpointing, 1 x 4096", "bf16")]:
    peak = peaks[prec]
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p) or os.path.getsize(p) == 0:
        continue
    r = json.load(open(p))
    peak_mib = open(os.path.join(out, name + ".peak")).read().strip()
    mem = f"{int(peak_mib) / 1024:.1f} GiB" if peak_mib.isdigit() else "- (peak RSS %.2f GB)" % (r["peak_rss_bytes"] / 1e9)
    mfu = r["flops_per_token"] * r["median_tokens_per_s"] / (peak * 1e12) if device != "cpu" else None
    rows.append(f"| {label} | {device} | {r['params']/1e6:.0f}M | {r['median_tokens_per_s']:.0f} | {mem} | "
                + (f"{100 * mfu:.1f}% of {prec} peak" if mfu is not None else "-") + " |")
rss = {}
for name in ("smoke-ckpt-every", "smoke-ckpt-never"):
    p = os.path.join(out, name + ".json")
    if os.path.exists(p) and os.path.getsize(p) > 0:
        rss[name] = json.load(open(p))["peak_rss_bytes"] / 2**30
if len(rss) == 2:
    a, b = rss["smoke-ckpt-every"], rss["smoke-ckpt-never"]
    rows.append("")
    rows.append(f"- host peak RSS, smoke-300m on {device}: a checkpoint after every step {a:.2f} GiB, "
                f"none {b:.2f} GiB ({a - b:+.2f} GiB)")
table = "\n".join(rows)
print(table)
parts = [open(os.path.join(out, "correctness.md")).read(), table] + \
    [open(os.path.join(out, n)).read() for n in ("scaling.md", "ranks.md")]
open(os.path.join(out, "gpu-check.md"), "w").write("\n".join(parts) + "\n")
EOF
echo "written: $OUT/gpu-check.md"
