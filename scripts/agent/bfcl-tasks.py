#!/usr/bin/env python3
"""The Berkeley Function Calling Leaderboard's single-turn Python categories as `k3mini agent bench`
tasks: the questions, function documents and ground truths the `bfcl-eval` package on PyPI ships
(bfcl_eval/data/BFCL_v4_*.json and possible_answer/, Apache-2.0), each a chat with `tools`, the
ground truth as `calls` and its `category`, scored by BFCL's AST check (agent/src/bfcl.rs).

Function documents become OpenAI tools: BFCL's types `dict`, `float` and `tuple` are written as JSON
Schema's `object`, `number` and `array`, and `any` as no type, so the gateway's gate can check the
arguments; the AST check reads them back as BFCL's types.

    python3 scripts/agent/bfcl-tasks.py --limit 10 --max-tokens 96 --out bfcl.jsonl
"""
import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "2026.3.23"
# k3mini's category: BFCL's file.
CATEGORIES = {
    "simple": "simple_python",
    "multiple": "multiple",
    "parallel": "parallel",
    "parallel_multiple": "parallel_multiple",
    "irrelevance": "irrelevance",
}
TYPES = {"dict": "object", "float": "number", "tuple": "array"}


def schema(node):
    """A BFCL parameter document as JSON Schema, recursively; `any` leaves the type out (any value
    passes the gate; BFCL's checker reads a missing type as its `any`, a string)."""
    if isinstance(node, dict):
        out = {k: schema(v) for k, v in node.items()}
        if out.get("type") == "any":
            del out["type"]
        elif isinstance(out.get("type"), str):
            out["type"] = TYPES.get(out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [schema(v) for v in node]
    return node


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=20, help="N tasks of each category")
    ap.add_argument("--skip", type=int, default=0,
                    help="from the category's task SKIP on (training prompts disjoint from a bench's first ones)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    ap.add_argument("--required", action="store_true",
                    help="tasks that expect calls carry tool_choice \"required\" (irrelevance stays auto)")
    a = ap.parse_args()
    if a.limit < 0 or a.skip < 0:
        ap.error("--limit and --skip must be ≥ 0")
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", d,
                        f"bfcl-eval=={VERSION}"], check=True)
        wheel = next(Path(d).glob("bfcl_eval-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            def lines(path):
                return [json.loads(l) for l in z.read(path).decode().splitlines() if l.strip()]
            data = {c: lines(f"bfcl_eval/data/BFCL_v4_{f}.json") for c, f in CATEGORIES.items()}
            truth = {c: {t["id"]: t["ground_truth"] for t in lines(f"bfcl_eval/data/possible_answer/BFCL_v4_{f}.json")}
                     for c, f in CATEGORIES.items() if c != "irrelevance"}
    n = 0
    with open(a.out, "w") as f:
        for category, tasks in data.items():
            for t in tasks[a.skip:a.skip + a.limit]:
                if len(t["question"]) != 1:
                    sys.exit(f"{t['id']}: a multi-turn question in a single-turn category")
                tools = [{"type": "function", "function": {
                    "name": fn["name"], "description": fn.get("description", ""),
                    "parameters": schema(fn["parameters"])}} for fn in t["function"]]
                task = {
                    "id": t["id"], "messages": t["question"][0], "tools": tools,
                    "category": category, "calls": truth.get(category, {}).get(t["id"], []),
                    "max_tokens": a.max_tokens}
                if a.required and category != "irrelevance":
                    task["tool_choice"] = "required"
                f.write(json.dumps(task, ensure_ascii=False) + "\n")
                n += 1
    print(f"{a.out}: {n} BFCL tasks ({', '.join(CATEGORIES)}; up to {a.limit} each from task {a.skip})")


if __name__ == "__main__":
    main()
