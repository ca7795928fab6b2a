#!/usr/bin/env python3
"""A teacher's replies to BFCL prompts, as chat training data: each task of a `bfcl-tasks.py` file is
asked of a `k3mini agent serve` gateway (greedy), and its reply becomes the assistant turn of a
conversation in OpenAI's shape (`messages` with the assistant's `tool_calls`, `tools`), the JSONL
that a recipe's `chat = "chatml"` source reads.

A reply cut at the token limit (finish_reason `length`) is left out (a call cut short would teach
an unclosed call), as is one whose calls fail the request's tools (`gate_failure`) and a task the
gateway refuses (a 4xx, counted); the script stops on anything else. `--single` asks the `simple` and `multiple` tasks (one call expected) with
`parallel_tool_calls: false`, so a constrained gateway ends the turn after one call.

    python3 scripts/agent/bfcl-trajectories.py --tasks train.jsonl --url http://127.0.0.1:PORT \
        --max-tokens 160 --single [--auto] --out chats.jsonl
"""
import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections import Counter


def ask(url, body, name):
    """The gateway's reply, or None where it refuses the task (a 4xx, printed)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")[:500]
        if 400 <= e.code < 500:
            print(f"{name}: refused ({e.code}): {text}", file=sys.stderr)
            return None
        sys.exit(f"{name}: the gateway answered {e.code}: {text}")
    except (urllib.error.URLError, TimeoutError) as e:
        sys.exit(f"{name}: no answer from the gateway at {url}: {e}")


def turn(message):
    """The reply's message as a training turn: content and calls only (ids are the server's)."""
    out = {"role": "assistant", "content": message.get("content") or ""}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [{"type": "function", "function": {
            "name": c["function"]["name"], "arguments": c["function"]["arguments"]}} for c in calls]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", required=True)
    ap.add_argument("--url", required=True, help="the gateway")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--auto", action="store_true",
                    help="ask every task with tool_choice auto (the model's free replies; ChatML does "
                         "not render tool_choice, so only the gate's judgement changes)")
    ap.add_argument("--single", action="store_true",
                    help="parallel_tool_calls false for the simple and multiple categories")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tasks = [json.loads(l) for l in open(a.tasks) if l.strip()]
    ended = Counter()
    with open(a.out + ".tmp", "w") as f:
        for i, t in enumerate(tasks):
            body = {"messages": t["messages"], "tools": t["tools"], "max_tokens": a.max_tokens,
                    "temperature": 0}
            if "tool_choice" in t and not a.auto:
                body["tool_choice"] = t["tool_choice"]
            if a.single and t["category"] in ("simple", "multiple"):
                body["parallel_tool_calls"] = False
            reply = ask(a.url, body, t["id"])
            if reply is None:
                ended["refused"] += 1
                continue
            choice = reply["choices"][0]
            failure = (reply.get("k3mini") or {}).get("gate_failure")
            end = "gate_failure" if failure else choice["finish_reason"]
            ended[end] += 1
            print(f"[{i + 1}/{len(tasks)}] {t['id']}: {end}", file=sys.stderr)
            if end not in ("stop", "tool_calls"):
                continue
            f.write(json.dumps({"messages": t["messages"] + [turn(choice["message"])],
                                "tools": t["tools"]}, ensure_ascii=False) + "\n")
    kept = sum(n for r, n in ended.items() if r in ("stop", "tool_calls"))
    if kept == 0:
        os.remove(a.out + ".tmp")
        sys.exit(f"no reply kept of {len(tasks)} ({dict(ended)})")
    # Written whole or not at all: a rerun starts again rather than train on half a set.
    os.replace(a.out + ".tmp", a.out)
    print(f"{a.out}: {kept} of {len(tasks)} replies kept ({dict(ended)})")


if __name__ == "__main__":
    main()
