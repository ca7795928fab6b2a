//! Kimi K2's chat format, as Moonshot's Kimi-K2-Thinking template writes it (llama.cpp's
//! `models/templates/Kimi-K2-Thinking.jinja`, the template of the model's own repository):
//!
//! ```text
//! [<|im_system|>tool_declare<|im_middle|>[TOOLS…]<|im_end|>]
//! <|im_system|>system<|im_middle|>SYSTEM<|im_end|>
//! <|im_user|>user<|im_middle|>TEXT<|im_end|>
//! <|im_assistant|>assistant<|im_middle|><think>REASONING</think>ANSWER<|tool_calls_section_begin|>
//!   <|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|><|im_end|>
//! <|im_system|>tool<|im_middle|>## Return of functions.NAME:N\nRESULT<|im_end|>
//! ```
//!
//! TOOLS is `json.dumps` of the request's declarations, each call's arguments `json.dumps` of the
//! object, keys in the order written. A turn's header names its `name` where it has one (`ana`
//! in `<|im_user|>ana<|im_middle|>`), else its role. A conversation that does not open with a
//! system turn gets K2's default one. Calls are numbered across the conversation from 0 and tool
//! results answer them in the order they were made, as the template does: a result's
//! `tool_call_id` is not used (results written out of order are labelled as the template labels
//! them, so the student sees what K2 sees).
//!
//! Where the template and this renderer differ, k3mini renders what the data holds: the template
//! keeps the reasoning only of the turns after the last assistant answer without calls (it drops
//! it from a finished exchange); k3mini keeps every turn's. Every assistant turn opens a think
//! block, an empty one without reasoning, as the template writes. The golden cases are those on
//! which the two agree.

use super::arguments_object;
use super::json::Json;
use super::{Message, Part, Rendered, Reply, Role, THINK_CLOSE, THINK_OPEN, Tool, ToolCall};
use crate::error::DataError;

const END: &str = "<|im_end|>";
const MIDDLE: &str = "<|im_middle|>";
const SECTION_OPEN: &str = "<|tool_calls_section_begin|>";
const SECTION_CLOSE: &str = "<|tool_calls_section_end|>";
const CALL_OPEN: &str = "<|tool_call_begin|>";
const ARGUMENTS: &str = "<|tool_call_argument_begin|>";
const CALL_CLOSE: &str = "<|tool_call_end|>";

/// The special tokens K2's markup is made of (its vocabulary gives each one id).
pub const MARKERS: [&str; 10] = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    MIDDLE,
    END,
    SECTION_OPEN,
    SECTION_CLOSE,
    CALL_OPEN,
    ARGUMENTS,
    CALL_CLOSE,
];

/// What the template writes where a conversation has no system turn of its own.
pub const DEFAULT_SYSTEM: &str = "You are Kimi, an AI assistant created by Moonshot AI.";

/// The marker that opens a `role`'s turn.
fn opener(role: Role) -> &'static str {
    match role {
        Role::User => "<|im_user|>",
        Role::Assistant => "<|im_assistant|>",
        Role::System | Role::Tool => "<|im_system|>",
    }
}

/// A turn's header: its opener, who speaks (plain text: a name is the client's), `<|im_middle|>`.
fn header(out: &mut Rendered, role: Role, name: &str) {
    out.push(Part::Markup, true, opener(role));
    out.push(Part::Markup, false, name);
    out.push(Part::Markup, true, MIDDLE);
}

/// Renders `messages` after the declaration of `tools` (see the module's doc).
pub fn render(
    messages: &[Message],
    tools: &[Tool],
    generation_prompt: bool,
) -> Result<Rendered, DataError> {
    let mut out = Rendered::default();
    if !tools.is_empty() {
        header(&mut out, Role::System, "tool_declare");
        let declared = Json::Array(tools.iter().map(Tool::to_json).collect());
        out.push(Part::Prompt, false, &declared.python_dumps());
        out.push(Part::Markup, true, END);
    }
    if messages.first().is_none_or(|m| m.role != Role::System) {
        header(&mut out, Role::System, "system");
        out.push(Part::Prompt, false, DEFAULT_SYSTEM);
        out.push(Part::Markup, true, END);
    }
    // The ids the template gives calls (`functions.NAME:N`, N counted across the conversation),
    // and those not answered yet, oldest first.
    let (mut counter, mut pending) = (0usize, std::collections::VecDeque::new());
    for m in messages {
        // Jinja's `name or role`: an empty name is no name.
        let name = m.name.as_deref().filter(|n| !n.is_empty());
        header(&mut out, m.role, name.unwrap_or(m.role.name()));
        match m.role {
            Role::System | Role::User => {
                out.push(Part::Prompt, false, &m.content);
                out.push(Part::Markup, true, END);
            }
            Role::Tool => {
                // Jinja's `get('name', 'unknown')`: an empty name stays empty here.
                let id = pending.pop_front().unwrap_or_else(|| {
                    let named = m.name.as_deref().unwrap_or("unknown");
                    format!("functions.{named}:{counter}")
                });
                out.push(
                    Part::Prompt,
                    false,
                    &format!("## Return of {id}\n{}", m.content),
                );
                out.push(Part::Markup, true, END);
            }
            Role::Assistant => {
                out.push(Part::Thinking, true, THINK_OPEN);
                out.push(Part::Thinking, false, m.thinking.as_deref().unwrap_or(""));
                out.push(Part::Thinking, true, THINK_CLOSE);
                out.push(Part::Answer, false, &m.content);
                if !m.tool_calls.is_empty() {
                    out.push(Part::Answer, true, SECTION_OPEN);
                    for call in &m.tool_calls {
                        let id = format!("functions.{}:{counter}", call.function.name);
                        counter += 1;
                        out.push(Part::Answer, true, CALL_OPEN);
                        out.push(Part::Answer, false, &id);
                        out.push(Part::Answer, true, ARGUMENTS);
                        let arguments = Json::Object(call.function.arguments.0.clone());
                        out.push(Part::Answer, false, &arguments.python_dumps());
                        out.push(Part::Answer, true, CALL_CLOSE);
                        pending.push_back(id);
                    }
                    out.push(Part::Answer, true, SECTION_CLOSE);
                }
                // The end-of-turn marker of an answer is a target: the model learns to stop.
                out.push(Part::Answer, true, END);
            }
        }
    }
    if generation_prompt {
        header(&mut out, Role::Assistant, "assistant");
    }
    Ok(out)
}

/// Reads what a model wrote after the generation prompt (its `<|im_end|>` cut off): reasoning in
/// `<think>…</think>`, the answer, then one tool-calls section of
/// `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{…}<|tool_call_end|>` calls,
/// whitespace allowed between them. Refused: a section or call not closed (cut short), an id not
/// of that shape, arguments that are not one JSON object, a marker left over in the answer, text
/// after the section.
pub fn parse_reply(text: &str) -> Result<Reply, String> {
    let (head, section) = match text.split_once(SECTION_OPEN) {
        Some((head, rest)) => (head, Some(rest)),
        None => (text, None),
    };
    // Reasoning only where the reply opens with it; a think tag anywhere else is stray.
    let (thinking, content) = match head.trim_start().strip_prefix(THINK_OPEN) {
        Some(after) => {
            let (reasoning, rest) = after.split_once(THINK_CLOSE).ok_or_else(|| {
                format!("the reasoning's {THINK_OPEN} is never closed (cut short?)")
            })?;
            (Some(reasoning.trim().to_string()), rest.trim().to_string())
        }
        None => (None, head.trim().to_string()),
    };
    let mut stray = MARKERS.iter().chain([&THINK_OPEN, &THINK_CLOSE]);
    let held =
        |t: &&&str| content.contains(**t) || thinking.as_ref().is_some_and(|r| r.contains(**t));
    if let Some(tag) = stray.find(held) {
        return Err(format!("the reply holds a stray {tag}"));
    }
    let mut calls = Vec::new();
    if let Some(section) = section {
        let (mut body, after) = section.split_once(SECTION_CLOSE).ok_or_else(|| {
            format!("the tool-calls section is not closed by {SECTION_CLOSE} (cut short?)")
        })?;
        if !after.trim().is_empty() {
            let shown: String = after.trim().chars().take(40).collect();
            return Err(format!("text follows the tool calls: {shown:?}"));
        }
        body = body.trim_start();
        while !body.is_empty() {
            let n = calls.len() + 1;
            let call = body
                .strip_prefix(CALL_OPEN)
                .ok_or_else(|| format!("tool call {n} does not open with {CALL_OPEN}"))?;
            let (call, rest) = call.split_once(CALL_CLOSE).ok_or_else(|| {
                format!("tool call {n} is not closed by {CALL_CLOSE} (cut short?)")
            })?;
            calls.push(parse_call(call).map_err(|e| format!("tool call {n}: {e}"))?);
            body = rest.trim_start();
        }
    }
    Ok(Reply {
        thinking,
        content,
        calls,
    })
}

/// One call's `functions.NAME:N<|tool_call_argument_begin|>{…}`.
fn parse_call(call: &str) -> Result<ToolCall, String> {
    let (id, arguments) = call
        .split_once(ARGUMENTS)
        .ok_or_else(|| format!("no {ARGUMENTS}"))?;
    let id = id.trim();
    let name = id
        .strip_prefix("functions.")
        .and_then(|rest| rest.rsplit_once(':'))
        .filter(|(name, n)| {
            !name.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())
        })
        .map(|(name, _)| name)
        .ok_or_else(|| format!("its id {id:?} is not functions.NAME:N"))?;
    let arguments =
        Json::parse(arguments.trim()).map_err(|e| format!("arguments are not JSON ({e})"))?;
    Ok(ToolCall::new(
        name.to_string(),
        arguments_object(arguments)?.strict()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_parse_into_answer_and_calls_or_are_refused_by_name() {
        let r = parse_reply(
            "<think>look it up</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>\
             functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|>\n\
             <|tool_call_begin|>functions.a.b:1<|tool_call_argument_begin|>{}<|tool_call_end|>\
             <|tool_calls_section_end|>",
        )
        .unwrap();
        assert_eq!(r.thinking.as_deref(), Some("look it up"));
        assert_eq!(r.content, "Checking.");
        let names: Vec<&str> = r.calls.iter().map(|c| c.function.name.as_str()).collect();
        assert_eq!(names, ["get_weather", "a.b"]);
        assert_eq!(r.calls[0].function.arguments.0[0].0, "city");
        assert_eq!(parse_reply("<think></think>Hi.").unwrap().content, "Hi.");
        let call = |id: &str, args: &str| {
            format!("{SECTION_OPEN}{CALL_OPEN}{id}{ARGUMENTS}{args}{CALL_CLOSE}{SECTION_CLOSE}")
        };
        for (text, why) in [
            (
                format!("{SECTION_OPEN}{CALL_OPEN}functions.w:0{ARGUMENTS}{{"),
                "not closed",
            ),
            (
                format!("{SECTION_OPEN}{CALL_OPEN}functions.w:0{ARGUMENTS}{{}}"),
                "not closed",
            ),
            (call("w:0", "{}"), "not functions.NAME:N"),
            (call("functions.w", "{}"), "not functions.NAME:N"),
            (call("functions.w:x", "{}"), "not functions.NAME:N"),
            (call("functions.:0", "{}"), "not functions.NAME:N"),
            (call("functions.w:0", "[1]"), "not a JSON object"),
            (call("functions.w:0", "{\"a\": [1e999]}"), "Infinity"),
            (call("functions.w:0", "{a}"), "not JSON"),
            (format!("{}after", call("functions.w:0", "{}")), "follows"),
            (format!("done{CALL_CLOSE}"), "stray"),
            ("<think>forever".to_string(), "never closed"),
            ("Sure.<think>x</think>y".to_string(), "stray <think>"),
            ("x</think>y".to_string(), "stray </think>"),
            (
                format!("<think>a{CALL_OPEN}</think>y"),
                "stray <|tool_call_begin|>",
            ),
            (
                format!("{SECTION_OPEN}junk{CALL_OPEN}{SECTION_CLOSE}"),
                "does not open",
            ),
            (
                format!("{SECTION_OPEN}{CALL_OPEN}functions.w:0{CALL_CLOSE}{SECTION_CLOSE}"),
                "no <|tool_call_argument_begin|>",
            ),
        ] {
            let e = parse_reply(&text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }
}
