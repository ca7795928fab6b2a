#!/usr/bin/env python3
"""Training across CPU processes of one machine, against one process: tokens/s, each process's
peak RSS and the first rank's seconds in collectives, for 1, 2 and 3 ranks started as torchrun
starts them (RANK, WORLD_SIZE, LOCAL_RANK) meeting in a store file. Rounds interleave the rank
counts (1 2 3 1 2 3 ...), so a machine's drift shows as a spread, not as a trend.

    python3 scripts/bench/ranks.py --bin target/debug/k3mini recipes/ci-tiny.toml \
        --micro-batches 6 --steps 3 --rounds 2

Needs a `--features c10d` build of k3mini and the torch wheel's libraries on LD_LIBRARY_PATH.
The recipe is copied beside itself (its relative paths stay right) with `batch_tokens` set to
`micro-batches` micro-batches a step (and `micro_batch` when given), trained for `steps` steps;
tokens/s and seconds in collectives are the means over the steps after the first.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib


def edited_recipe(path, micro_batches, micro_batch):
    text = open(path).read()
    plan = tomllib.loads(text)
    mb = micro_batch or plan["train"]["micro_batch"]
    tokens = micro_batches * mb * plan["data"]["seq_len"]
    text, n = re.subn(r"(?m)^batch_tokens\s*=.*$", f"batch_tokens = {tokens}", text)
    assert n == 1, "the recipe has one train.batch_tokens line"
    if micro_batch:
        text, n = re.subn(r"(?m)^micro_batch\s*=.*$", f"micro_batch = {micro_batch}", text)
        assert n == 1, "the recipe has one train.micro_batch line"
    out = os.path.join(os.path.dirname(os.path.abspath(path)), f".ranks-bench-{os.getpid()}.toml")
    open(out, "w").write(text)
    return out, tokens


def run(binary, recipe, world, steps, scratch):
    out = os.path.join(scratch, f"run-{world}-{time.monotonic_ns()}")
    store = out + ".store"
    children = []
    for rank in range(world):
        env = dict(os.environ)
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       K3MINI_STORE_FILE=store)
        # stderr to a file: a pipe read only after the wait would stall a chatty rank.
        err = open(f"{out}.rank{rank}.err", "w+")
        children.append((subprocess.Popen(
            [binary, "train", "--quiet", "--stop-after", str(steps), "--out", out, recipe],
            env=env, stdout=subprocess.DEVNULL, stderr=err), err))
    rss, failed = [], None
    for child, err in children:
        _, status, usage = os.wait4(child.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            err.seek(0)
            failed = f"{world} ranks: exit {code}: {err.read()}"
            # The others would wait for it until their timeout.
            for other, _ in children:
                if other.poll() is None:
                    other.kill()
        rss.append(usage.ru_maxrss * 1024)
    if failed:
        sys.exit(failed)
    metrics = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    later = metrics[1:] or metrics
    tps = sum(m["tokens_per_s"] for m in later) / len(later)
    coll = [m["collective_s"] for m in later if "collective_s" in m]
    step_s = sum(1 / m["tokens_per_s"] for m in later) / len(later)
    return tps, rss, (sum(coll) / len(coll) if coll else None), step_s


def gib(b):
    return f"{b / 2**30:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("--bin", default="target/debug/k3mini")
    p.add_argument("--micro-batches", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ranks", default="1,2,3")
    a = p.parse_args()
    recipe, tokens = edited_recipe(a.recipe, a.micro_batches, a.micro_batch)
    worlds = [int(w) for w in a.ranks.split(",")]
    try:
        with tempfile.TemporaryDirectory(prefix="k3mini-ranks-") as scratch:
            print(f"{a.recipe}: {a.micro_batches} micro-batches, {tokens} tokens a step, "
                  f"{a.steps} steps (the first not counted)")
            print("| round | processes | tokens/s | × one process | peak RSS per process (GiB) "
                  "| seconds in collectives a step (of a step's) |")
            print("|---|---|---|---|---|---|")
            for r in range(a.rounds):
                one = None
                for world in worlds:
                    tps, rss, coll, step_s = run(a.bin, recipe, world, a.steps, scratch)
                    one = tps if world == 1 else one
                    ratio = f"{tps / one:.2f}" if one else "-"
                    c = f"{coll:.3f} ({step_s * tokens:.2f})" if coll is not None else "-"
                    print(f"| {r + 1} | {world} | {tps:.0f} | {ratio} | "
                          f"{' / '.join(gib(x) for x in rss)} | {c} |", flush=True)
    finally:
        os.remove(recipe)


if __name__ == "__main__":
    main()
