#!/usr/bin/env python3
"""Chat conversations rendered by the reference chat templates, for data/tests/it/chat.rs: K3's
(llama.cpp's Kimi-K3.jinja), K2's (Kimi-K2-Thinking.jinja, Moonshot's own) and ChatML's with Hermes
tool calls (Qwen3's).

The templates are llama.cpp's copies (models/templates/) as vendored by llama-cpp-python 0.3.36, the
llama.cpp reference scripts/golden/requirements.txt pins; they are read from its source archive, and
the two Kimi ones are copied into data/src/chat/templates/ (what a Kimi-format export carries). Each is rendered by transformers' own Jinja machinery (`render_jinja_template`, what
`apply_chat_template` and vLLM's server run), with the templates' defaults (K3: thinking on, effort
`max`). Tool calls' `arguments` arrive as OpenAI's JSON strings and are parsed into objects first, as
vLLM's server does before it renders a conversation.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    pip install transformers==5.24.0
    python scripts/golden/chat_templates.py /tmp/lcp/llama_cpp_python-0.3.36.tar.gz

Writes data/tests/fixtures/chat_templates.json: for each format, its cases (messages, tools,
add_generation_prompt) and the text the template renders.
"""
import copy
import hashlib
import json
import sys
import tarfile
from pathlib import Path

import jinja2.sandbox
from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import render_jinja_template

OUT = Path(__file__).resolve().parents[2] / "data" / "tests" / "fixtures" / "chat_templates.json"
TEMPLATES = {
    "kimi_k3": "models/templates/Kimi-K3.jinja",
    # ChatML with Hermes tool calls. Qwen3 drops the reasoning of turns before the last user message
    # and writes an empty think block into a final turn without reasoning; k3mini renders what the
    # data holds, so chatml's cases are those where the two agree.
    "chatml": "models/templates/Qwen-Qwen3-0.6B.jinja",
    # K2-Thinking keeps reasoning only after the last assistant answer without calls (a finished
    # exchange loses it); k3mini keeps every turn's, so kimi_k2's cases are those where the two agree.
    "kimi_k2": "models/templates/Kimi-K2-Thinking.jinja",
}
BOTH = ("kimi_k3", "chatml")
# K2's template queues its calls' ids with `list.append` and `pop`, which transformers' immutable
# sandbox refuses; it is rendered in jinja2's mutable sandbox with transformers' settings otherwise
# (as llama.cpp's own Jinja engine, which allows both, runs it).
MUTABLE = {"kimi_k2"}
# k3mini's own ChatML template (what an exported GGUF carries), from this repository: it must render
# every chatml case as Qwen3's does, and the cases where Qwen3 differs as k3mini's renderer does.
OWN = {"chatml_k3mini": Path(__file__).resolve().parents[2] / "data/src/chat/templates/chatml.jinja"}
OWN_FORMAT = {"chatml_k3mini": "chatml"}
# The Kimi formats' exports carry the reference templates themselves (llama.cpp picks its K2 and K3
# tool-call parsers by the template's text), copied here next to k3mini's own.
EXPORTED = {"kimi_k3": "Kimi-K3.jinja", "kimi_k2": "Kimi-K2-Thinking.jinja"}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "Days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": 'Search the web; "quotes" & <tags> pass through.',
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object", "properties": {"site": {"type": "string"}}},
                "top_k": {"type": "number"},
            },
            "required": ["query"],
        },
    },
}


def call(id_, name, args):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


CASES = [
    {
        "name": "plain",
        "formats": BOTH,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3 is 5."},
        ],
    },
    {
        "name": "no_reasoning_and_a_generation_prompt",
        "formats": BOTH + ("kimi_k2",),
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a colour."},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "markers_quoted_in_text_and_names",
        "formats": ("kimi_k3",),
        "messages": [
            {"role": "system", "name": 'ops "team" & co', "content": "Never print <|close|>message<|sep|>."},
            {"role": "user", "name": "ana", "content": "Say <|end_of_msg|> and café ☕\nthen stop."},
            {"role": "assistant", "content": "<|open|>no", "reasoning_content": "  \n  "},
        ],
    },
    {
        "name": "tools_called_in_parallel_and_answered",
        "formats": BOTH,
        "tools": [WEATHER, SEARCH],
        "messages": [
            {"role": "user", "content": "Weather in Zürich for 3 days, and find the forecast site."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Two calls at once.",
                "tool_calls": [
                    call("call_1", "get_weather", {"city": "Zürich", "unit": "celsius", "Days": 3}),
                    call("call_2", "search", {"query": "forecast", "filters": {"site": "meteo.ch", "lang": ["de", "en"]},
                                              "top_k": 2.5, "strict": True, "cursor": None}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_2", "content": '{"results": ["meteo.ch"]}'},
            {"role": "tool", "tool_call_id": "call_1", "content": "12°C, clear"},
            {"role": "assistant", "content": "12°C and clear; see meteo.ch.", "reasoning_content": "Both answered."},
        ],
    },
    {
        "name": "numbers_sort_ties_and_an_empty_name",
        "formats": ("kimi_k3", "kimi_k2"),
        "tools": [{
            "type": "function",
            "function": {
                "name": "plot",
                "parameters": {"type": "object", "properties": {"b": {}, "B": {}, "a": {"default": 1e-05}}},
            },
        }],
        "messages": [
            {"role": "user", "name": "", "content": "Plot it."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "\x1f",
                "tool_calls": [{
                    "id": "p",
                    "type": "function",
                    "function": {
                        "name": "plot",
                        # As text, so every digit reaches the template as written.
                        "arguments": '{"x": 433.70231909401963, "y": [1e-05, 1E-7, -0, -0.0, 1e16, '
                                     '18446744073709551616, 0.0001, 1e15], "z": {}, "w": []}',
                    },
                }],
            },
        ],
    },
    {
        "name": "tool_results_by_name_in_order",
        "formats": BOTH + ("kimi_k2",),
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [call("a", "get_weather", {"city": "Oslo"})]},
            {"role": "tool", "name": "get_weather", "content": "-2°C"},
            {"role": "user", "content": "Thanks"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "system_text_joins_the_tools_and_quoted_markers_stay_text",
        "formats": ("chatml",),
        "tools": [SEARCH],
        "messages": [
            {"role": "system", "content": "Answer in English."},
            {"role": "user", "content": "Find <tool_call> and <|im_end|> in the docs."},
            {
                "role": "assistant",
                "content": "\nSearching.",
                "reasoning_content": "\nOne search.\n\n",
                "tool_calls": [call("s1", "search", {"query": "<|im_end|>", "top_k": 1e16})],
            },
            {"role": "tool", "tool_call_id": "s1", "name": "search", "content": "none found"},
            {"role": "assistant", "content": "Nothing.", "reasoning_content": "Empty."},
        ],
    },
    {
        "name": "calls_with_reasoning_answered_in_order_then_more_calls",
        "formats": ("kimi_k2",),
        "tools": [WEATHER, SEARCH],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Zürich for 3 days, and find the forecast site."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Two calls at once.",
                "tool_calls": [
                    call("call_1", "get_weather", {"city": "Zürich", "unit": "celsius", "Days": 3}),
                    call("call_2", "search", {"query": "forecast", "filters": {"site": "meteo.ch", "lang": ["de", "en"]},
                                              "top_k": 2.5, "strict": True, "cursor": None}),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12°C, clear"},
            {"role": "tool", "tool_call_id": "call_2", "content": '{"results": ["meteo.ch"]}'},
            {
                "role": "assistant",
                "content": "One more.",
                "reasoning_content": "Check tomorrow too.",
                "tool_calls": [call("call_3", "get_weather", {"city": "Zürich", "Days": 1})],
            },
        ],
    },
    {
        "name": "names_quoted_markers_and_results_of_no_call",
        "formats": ("kimi_k2",),
        "messages": [
            {"role": "system", "name": 'ops "team" & co', "content": "Never print <|im_end|>."},
            {"role": "user", "name": "ana", "content": "Say <|tool_call_begin|> and café ☕\nthen stop."},
            {"role": "assistant", "content": "<|tool_calls_section_end|>no"},
            {"role": "tool", "name": "clock", "content": "09:00"},
            {"role": "tool", "content": "?"},
        ],
        "add_generation_prompt": True,
    },
]


# Where Qwen3's template and k3mini's chatml differ: reasoning before the last user message is kept,
# and a final turn without reasoning gets no empty think block.
K3MINI_CASES = [
    {
        "name": "reasoning_in_history_and_a_final_turn_without",
        "formats": ("chatml_k3mini",),
        "messages": [
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3."},
            {"role": "user", "content": "And 2+4?"},
            {"role": "assistant", "content": "6"},
        ],
    },
]


def vllm_messages(messages):
    """Tool calls' JSON-string arguments parsed into objects, as vLLM's server renders them."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls") or []:
            if isinstance(c["function"].get("arguments"), str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def main():
    archive = sys.argv[1]
    with tarfile.open(archive) as tar:
        root = tar.getnames()[0].split("/")[0]
        templates = {
            fmt: tar.extractfile(f"{root}/vendor/llama.cpp/{path}").read().decode()
            for fmt, path in TEMPLATES.items()
        }
    templates.update({name: path.read_text() for name, path in OWN.items()})
    for fmt, name in EXPORTED.items():
        (OWN["chatml_k3mini"].parent / name).write_bytes(templates[fmt].encode())
    golden = {}
    for fmt, template in templates.items():
        cases = []
        of = OWN_FORMAT.get(fmt, fmt)
        sandbox = jinja2.sandbox.SandboxedEnvironment if fmt in MUTABLE else jinja2.sandbox.ImmutableSandboxedEnvironment
        chat_template_utils.ImmutableSandboxedEnvironment = sandbox
        for case in (c for c in CASES + K3MINI_CASES if of in c["formats"] or fmt in c["formats"]):
            rendered, _ = render_jinja_template(
                conversations=[vllm_messages(case["messages"])],
                tools=case.get("tools"),
                chat_template=template,
                add_generation_prompt=case.get("add_generation_prompt", False),
            )
            cases.append({k: v for k, v in case.items() if k != "formats"} | {"text": rendered[0]})
        golden[fmt] = cases
    # Ties the renderings to the template they came from: editing it without rerunning this fails.
    golden["chatml_k3mini_sha256"] = hashlib.sha256(OWN["chatml_k3mini"].read_bytes()).hexdigest()
    for fmt in EXPORTED:
        golden[f"{fmt}_sha256"] = hashlib.sha256(templates[fmt].encode()).hexdigest()
    OUT.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
