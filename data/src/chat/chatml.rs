//! ChatML (SmolLM2, Qwen), with Hermes-style tool calls as Qwen3's template writes them
//! (llama.cpp's `models/templates/Qwen-Qwen3-0.6B.jinja`):
//!
//! ```text
//! <|im_start|>system\n[SYSTEM\n\n]# Tools\n\n…<tools>\n{TOOL}\n…</tools>\n\n…</tool_call><|im_end|>\n
//! <|im_start|>user\nTEXT<|im_end|>\n
//! <|im_start|>assistant\n<think>\nREASONING\n</think>\n\nANSWER\n<tool_call>\n{"name": "N", "arguments": {…}}\n</tool_call><|im_end|>\n
//! <|im_start|>user\n<tool_response>\nRESULT\n</tool_response>\n<tool_response>\n…\n</tool_response><|im_end|>\n
//! ```
//!
//! The tools' block (with the first system message's text, when it has one) exists only with tools;
//! each TOOL and each call's arguments are `json.dumps` of what the request holds, keys in its order.
//! A run of tool results is one user turn, in the order written (Hermes answers calls by position;
//! a result's `tool_call_id` and `name` are read and not rendered, as Qwen3's template does).
//!
//! Where Qwen3's template and this renderer differ, k3mini renders what the data holds: Qwen3 drops
//! the reasoning of assistant turns before the last user message and writes an empty
//! `<think>\n\n</think>\n\n` into a final assistant turn without reasoning; k3mini keeps every turn's
//! reasoning and writes no empty block (SmolLM2's turns have none). The golden cases are those on
//! which the two agree.
//!
//! `<tool_call>`, `</tool_call>` and the `<tool_response>` tags are markup: in a vocabulary that has
//! them as tokens (Qwen's) they are single ids, in one that does not (SmolLM2's) ordinary text.

use super::json::Json;
use super::{Message, Part, Rendered, Role, Tool, ToolCall};
use super::{Reply, THINK_CLOSE, THINK_OPEN, arguments_object};
use crate::error::DataError;

pub const TOOL_CALL_OPEN: &str = "<tool_call>";
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";
const RESPONSE_OPEN: &str = "\n<tool_response>\n";
const RESPONSE_CLOSE: &str = "\n</tool_response>";

const TOOLS_HEADER: &str = "# Tools\n\nYou may call one or more functions to assist with the user \
query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>";
const TOOLS_FOOTER: &str = "\n</tools>\n\nFor each function call, return a json object with \
function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
<function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// The opening markup of a `role`'s turn.
fn open(role: &str) -> String {
    format!("<|im_start|>{role}\n")
}
const END: &str = "<|im_end|>";

/// Renders `messages` after the declaration of `tools` (see the module's doc).
pub fn render(
    messages: &[Message],
    tools: &[Tool],
    generation_prompt: bool,
) -> Result<Rendered, DataError> {
    for (i, m) in messages.iter().enumerate() {
        if m.role != Role::Tool && (m.name.is_some() || m.tool_call_id.is_some()) {
            return Err(DataError::Conversation(format!(
                "message {i}: the chatml format writes no `name` or `tool_call_id` on a {:?} turn \
                 (kimi_k3 does)",
                m.role
            )));
        }
    }
    // The template writes a call's name between quotes as it is: one that JSON would escape
    // cannot be written, and would not read back.
    let calls = messages.iter().flat_map(|m| &m.tool_calls);
    if let Some(c) = calls.into_iter().find(|c| {
        let name = &c.function.name;
        name.chars()
            .any(|ch| ch == '"' || ch == '\\' || ch.is_control())
    }) {
        return Err(DataError::Conversation(format!(
            "the tool name {:?} cannot be written in a chatml call (it would need escaping)",
            c.function.name
        )));
    }
    let mut out = Rendered::default();
    let mut rest = messages;
    if !tools.is_empty() {
        out.push(Part::Markup, true, &open("system"));
        if let Some((first, after)) = messages.split_first()
            && first.role == Role::System
        {
            out.push(Part::Prompt, false, &format!("{}\n\n", first.content));
            rest = after;
        }
        let mut block = TOOLS_HEADER.to_string();
        for t in tools {
            block.push('\n');
            block.push_str(&t.to_json().python_dumps());
        }
        block.push_str(TOOLS_FOOTER);
        out.push(Part::Prompt, false, &block);
        out.push(Part::Markup, true, &format!("{END}\n"));
    }
    let mut i = 0;
    while i < rest.len() {
        let m = &rest[i];
        match m.role {
            Role::System | Role::User => {
                let role = m.role.name();
                out.push(Part::Markup, true, &open(role));
                out.push(Part::Prompt, false, &m.content);
                out.push(Part::Markup, true, &format!("{END}\n"));
            }
            Role::Assistant => assistant(&mut out, m),
            Role::Tool => {
                out.push(Part::Markup, true, "<|im_start|>user");
                while let Some(t) = rest.get(i).filter(|t| t.role == Role::Tool) {
                    out.push(Part::Markup, true, RESPONSE_OPEN);
                    out.push(Part::Prompt, false, &t.content);
                    out.push(Part::Markup, true, RESPONSE_CLOSE);
                    i += 1;
                }
                out.push(Part::Markup, true, &format!("{END}\n"));
                continue;
            }
        }
        i += 1;
    }
    if generation_prompt {
        out.push(Part::Markup, true, &open("assistant"));
    }
    Ok(out)
}

/// An assistant turn: its reasoning (Qwen3 style, the tags on their own lines), its answer, its
/// calls and the `<|im_end|>` that ends it are what the model writes.
fn assistant(out: &mut Rendered, m: &Message) {
    out.push(Part::Markup, true, &open("assistant"));
    let mut content = m.content.as_str();
    if let Some(thinking) = &m.thinking {
        out.push(Part::Thinking, true, THINK_OPEN);
        out.push(
            Part::Thinking,
            false,
            &format!("\n{}\n", thinking.trim_matches('\n')),
        );
        out.push(Part::Thinking, true, THINK_CLOSE);
        out.push(Part::Thinking, false, "\n\n");
        content = content.trim_start_matches('\n');
    }
    out.push(Part::Answer, false, content);
    for (k, call) in m.tool_calls.iter().enumerate() {
        if k > 0 || !content.is_empty() {
            out.push(Part::Answer, false, "\n");
        }
        out.push(Part::Answer, true, TOOL_CALL_OPEN);
        out.push(Part::Answer, false, &format!("\n{}\n", call_json(call)));
        out.push(Part::Answer, true, TOOL_CALL_CLOSE);
    }
    out.push(Part::Answer, true, END);
    out.push(Part::Markup, true, "\n");
}

/// `{"name": "N", "arguments": {…}}`, as the template writes it.
fn call_json(call: &ToolCall) -> String {
    format!(
        "{{\"name\": \"{}\", \"arguments\": {}}}",
        call.function.name,
        Json::Object(call.function.arguments.0.clone()).python_dumps()
    )
}

/// Reads what a model wrote after the generation prompt (its end-of-turn marker cut off): the
/// reasoning in `<think>…</think>`, the answer, then `<tool_call>` blocks, each one JSON object
/// `{"name": …, "arguments": {…}}`, separated by whitespace only. Refused: a block that is not
/// closed (the answer was cut short), JSON that is not of that shape, text after the calls, and a
/// tag left over in the answer.
pub fn parse_reply(text: &str) -> Result<Reply, String> {
    let (thinking, rest) = match text.trim_start().strip_prefix(THINK_OPEN) {
        Some(after) => {
            let (reasoning, rest) = after.split_once(THINK_CLOSE).ok_or_else(|| {
                format!("the reasoning's {THINK_OPEN} is never closed (cut short?)")
            })?;
            (Some(reasoning.trim().to_string()), rest)
        }
        None => (None, text),
    };
    let (content, mut calls_text) = rest
        .split_once(TOOL_CALL_OPEN)
        .map_or((rest, ""), |(c, _)| (c, &rest[c.len()..]));
    for tag in [THINK_OPEN, THINK_CLOSE, TOOL_CALL_CLOSE] {
        if content.contains(tag) {
            return Err(format!("the answer holds a stray {tag}"));
        }
    }
    let mut calls = Vec::new();
    while let Some(after) = calls_text.strip_prefix(TOOL_CALL_OPEN) {
        let n = calls.len() + 1;
        let (body, rest) = after.split_once(TOOL_CALL_CLOSE).ok_or_else(|| {
            format!("tool call {n} is not closed by {TOOL_CALL_CLOSE} (cut short?)")
        })?;
        calls.push(parse_call(body.trim()).map_err(|e| format!("tool call {n}: {e}"))?);
        calls_text = rest.trim_start();
    }
    if !calls_text.is_empty() {
        let shown: String = calls_text.chars().take(40).collect();
        return Err(format!("text follows the tool calls: {shown:?}"));
    }
    Ok(Reply {
        thinking,
        content: content.trim().to_string(),
        calls,
    })
}

/// One block's `{"name": "N", "arguments": {…}}`.
fn parse_call(body: &str) -> Result<ToolCall, String> {
    let Json::Object(entries) = Json::parse(body).map_err(|e| format!("not JSON ({e})"))? else {
        return Err("not a JSON object".into());
    };
    let (mut name, mut arguments) = (None, None);
    for (key, value) in entries {
        match (key.as_str(), value) {
            ("name", Json::String(n)) => name = Some(n),
            ("name", _) => return Err("its `name` is not a string".into()),
            ("arguments", value) => arguments = Some(arguments_object(value)?.strict()?),
            (other, _) => return Err(format!("unexpected key `{other}`")),
        }
    }
    Ok(ToolCall::new(
        name.ok_or("no `name`")?,
        arguments.ok_or("no `arguments`")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse_into_answer_and_calls_or_are_refused_by_name() {
        let r = parse_reply(
            "<think>\nlook it up\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"w\", \
             \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"s\", \
             \"arguments\": \"{\\\"q\\\": 1}\"}\n</tool_call>\n",
        )
        .unwrap();
        assert_eq!(r.thinking.as_deref(), Some("look it up"));
        assert_eq!(r.content, "Checking.");
        let names: Vec<&str> = r.calls.iter().map(|c| c.function.name.as_str()).collect();
        assert_eq!(names, ["w", "s"]);
        assert_eq!(r.calls[1].function.arguments.0[0].0, "q");
        assert_eq!(parse_reply(" Just text. ").unwrap().content, "Just text.");
        // An integer past 64 bits is kept exact on the wire (OpenAI's arguments string).
        let big = parse_reply(
            "<tool_call>{\"name\": \"w\", \"arguments\": {\"n\": 123456789012345678901234567890}}</tool_call>",
        )
        .unwrap();
        let wire = serde_json::to_value(&big.calls[0]).unwrap();
        assert_eq!(
            wire["function"]["arguments"],
            "{\"n\": 123456789012345678901234567890}"
        );
        for (text, why) in [
            ("<tool_call>\n{\"name\": \"w\", \"argu", "not closed"),
            ("<tool_call>{\"name\": \"w\"}</tool_call>", "no `arguments`"),
            (
                "<tool_call>{\"name\": 1, \"arguments\": {}}</tool_call>",
                "not a string",
            ),
            (
                "<tool_call>{\"name\": \"w\", \"arguments\": [1]}</tool_call>",
                "not a JSON object",
            ),
            (
                "<tool_call>{\"name\": \"w\", \"arguments\": {}, \"id\": 1}</tool_call>",
                "`id`",
            ),
            ("<tool_call>{name: w}</tool_call>", "not JSON"),
            (
                "<tool_call>{\"name\": \"w\", \"arguments\": {}}</tool_call> and more",
                "follows",
            ),
            ("done</tool_call>", "stray"),
            ("<think>forever", "never closed"),
            (
                "<tool_call>{\"name\": \"w\", \"arguments\": {\"a\": [1e999]}}</tool_call>",
                "Infinity",
            ),
        ] {
            let e = parse_reply(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }
}
