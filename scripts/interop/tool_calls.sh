#!/usr/bin/env bash
# llama.cpp's own server returns OpenAI tool calls from a k3mini student: a tiny student learns one
# conversation by heart, a `get_weather` call for Oslo with the tool declared, is exported to GGUF
# (which carries its format's chat template) and served by stock `llama-server --jinja`; asked the
# question with the tool declared, greedy, it must come back as one parsed `tool_calls` entry with
# that name and those arguments and `finish_reason: "tool_calls"`. What is checked is the path
# (k3mini's rendering in training, the template in the GGUF, llama.cpp's parser for the format),
# not the student's skill: a student this small does not learn to copy a city from the question in
# minutes of CPU.
#   [FORMAT=chatml|kimi_k3|kimi_k2] bash scripts/interop/tool_calls.sh
# The student's vocabulary is a byte-level BPE of its own with the format's markers as specials.
# chatml (default): k3mini's ChatML template, llama.cpp's Hermes parser; kimi_k3: K3's XTML,
# llama.cpp's Kimi-K3.jinja in the GGUF and its K3 parser; kimi_k2: Moonshot's
# Kimi-K2-Thinking.jinja and llama.cpp's K2 parser. About 2 minutes each.
# Needs the llama-server that scripts/interop/llama-server.sh builds.
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${K3MINI_CACHE:-${HOME:-}/.cache/k3mini}"
SERVER="${LLAMA_SERVER:-$CACHE/llama-server/bin/llama-server}"
BIN="${K3MINI_BIN:-target/debug/k3mini}"
W="$(mktemp -d)"
PID=""
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$W"' EXIT
[ -x "$SERVER" ] || { echo "no llama-server at $SERVER: run scripts/interop/llama-server.sh"; exit 1; }

TOOLS='[{"type": "function", "function": {"name": "get_weather", "description": "The weather now in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]'
QUESTION="What is the weather in Oslo right now?"
for _ in $(seq 8); do
  printf '{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}}]}], "tools": %s}\n' \
    "$QUESTION" "$TOOLS"
done > "$W/chats.jsonl"
# The format's markers are the BPE's specials, so each is one id; the chats are rendered in it.
FORMAT="${FORMAT:-chatml}"
case "$FORMAT" in
  chatml) SPECIALS=('<|im_start|>' '<|im_end|>') ;;
  kimi_k3) SPECIALS=('<|open|>' '<|sep|>' '<|close|>' '<|end_of_msg|>') ;;
  kimi_k2) SPECIALS=('<|im_system|>' '<|im_user|>' '<|im_assistant|>' '<|im_middle|>' '<|im_end|>'
    '<|tool_calls_section_begin|>' '<|tool_calls_section_end|>' '<|tool_call_begin|>'
    '<|tool_call_argument_begin|>' '<|tool_call_end|>') ;;
  *) echo "FORMAT must be chatml, kimi_k3 or kimi_k2, not $FORMAT"; exit 1 ;;
esac
"$BIN" data tokenizer train "$W/chats.jsonl" --vocab-size 512 "${SPECIALS[@]/#/--special=}" \
  --out "$W/bpe.json" > /dev/null
cat > "$W/tools.toml" <<TOML
[run]
name = "tool-calls"
seed = 5
out_dir = "$W/run"
[model]
preset = "tiny"
vocab_size = 512
d_model = 64
[data]
tokenizer = "$W/bpe.json"
seq_len = 384
held_out_fraction = 0
[[data.sources]]
path = "chats.jsonl"
chat = "$FORMAT"
[optim]
lr = 1e-2
[schedule]
kind = "constant"
warmup_steps = 0
[train]
steps = 100
batch_tokens = 1536
micro_batch = 4
TOML
"$BIN" train "$W/tools.toml" --quiet > /dev/null
"$BIN" export "$W/run" --format gguf --quant f32 --out "$W/student.gguf" > /dev/null

# A free port, and health from our own server only (it must still be running).
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$SERVER" -m "$W/student.gguf" --jinja --host 127.0.0.1 --port "$PORT" -c 1024 -t 2 --no-webui \
  > "$W/server.log" 2>&1 &
PID=$!
for i in $(seq 121); do
  kill -0 "$PID" 2>/dev/null || { echo "llama-server exited:"; cat "$W/server.log"; exit 1; }
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  [ "$i" -lt 121 ] || { echo "llama-server not healthy after 60 s:"; tail -20 "$W/server.log"; exit 1; }
  sleep 0.5
done
body=$(printf '{"messages": [{"role": "user", "content": "%s"}], "tools": %s, "temperature": 0, "max_tokens": 160}' \
  "$QUESTION" "$TOOLS")
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" \
  > "$W/reply.json" || { echo "llama-server refused the request"; tail -20 "$W/server.log"; exit 1; }
python3 - "$W/reply.json" <<'PY'
import json, sys
reply = json.load(open(sys.argv[1]))
choice = reply["choices"][0]
calls = choice["message"].get("tool_calls") or []
want = {"city": "Oslo"}
ok = (choice["finish_reason"] == "tool_calls" and len(calls) == 1
      and calls[0]["function"]["name"] == "get_weather"
      and json.loads(calls[0]["function"]["arguments"]) == want)
print(f"llama-server --jinja: {json.dumps(choice['message'], ensure_ascii=False)}")
if not ok:
    sys.exit(f"expected one get_weather call with {want} and finish_reason tool_calls")
PY
echo "tool calls: llama-server returns a k3mini $FORMAT student's calls in OpenAI's shape"
