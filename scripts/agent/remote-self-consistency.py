#!/usr/bin/env python3
"""How far a remote's greedy answer depends on how its prefix was computed: for each task, the
remote's greedy continuation of the prompt against its greedy continuation of the prompt plus its
own first K tokens, prefilled in one batch instead of decoded one at a time. A verify cascade
hands the remote exactly such prefixes, so this bounds how often its answer can equal the
remote's answer token for token. Token ids throughout (no text re-tokenisation).

    python3 scripts/agent/remote-self-consistency.py --url http://127.0.0.1:8101 \\
        --tasks test.jsonl --max-tokens 32 --k 3
(tasks: `agent bench` JSONL; `text` tasks only, each with its own `max_tokens` where it has one)
"""
import argparse
import json
import urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--tasks", required=True, nargs="+")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    a = ap.parse_args()
    same = total = 0
    for path in a.tasks:
        for line in open(path):
            t = json.loads(line)
            if "text" not in t:
                continue
            n = t.get("max_tokens", a.max_tokens)
            whole = post(a.url, {"prompt": t["text"], "max_tokens": n, "temperature": 0,
                                 "return_token_ids": True})
            prompt, ids = whole["prompt_token_ids"], whole["token_ids"]
            if len(ids) <= a.k:
                continue
            rest = post(a.url, {"prompt": prompt + ids[:a.k], "max_tokens": n - a.k,
                                "temperature": 0, "return_token_ids": True})["token_ids"]
            total += 1
            same += ids == ids[:a.k] + rest
    print(f"{same} of {total} greedy answers unchanged with the first {a.k} tokens prefilled "
          f"({100 * same / max(total, 1):.1f}%)")


if __name__ == "__main__":
    main()
