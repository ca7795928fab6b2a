//! Kimi K3's chat format ("XTML"), as llama.cpp's `models/templates/Kimi-K3.jinja` renders it with
//! its defaults (thinking on at effort `max`; no `tool_choice` or `response_format` message):
//!
//! ```text
//! <|open|>message role="system" type="tool-declare"<|sep|># Tools…```json\n[TOOLS]\n```<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="system" type="thinking-effort"<|sep|>…<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="user" name="N"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="assistant"<|sep|><|open|>think<|sep|>REASONING<|close|>think<|sep|>
//!     <|open|>response<|sep|>ANSWER<|close|>response<|sep|>
//!     <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
//!         <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>…
//!     <|close|>call<|sep|>…<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
//! <|open|>message role="tool" tool="NAME" index="I"<|sep|>RESULT<|close|>message<|sep|><|end_of_msg|>
//! ```
//!
//! The tool declaration is present only with tools, `name` only when given, the tools section only
//! with calls. TOOLS is the declarations with every object's keys sorted; VALUE a string as it is,
//! anything else as Python's `json.dumps` prints it; T one of `string`, `number`, `boolean`,
//! `null`, `object`, `array`. Attribute values escape `&` and `"`. A run of tool results that all
//! answer the preceding calls by id is written in the calls' order under their names.
//!
//! Only the four markers are special ids: tag names, attributes and everything people wrote are
//! ordinary text, so text that quotes a marker cannot open or close a section. (A server that
//! tokenizes the rendered string with its specials recognised reads such text as markers.)

use super::json::Json;
use super::{Arguments, Message, Part, Rendered, Reply, Role, Tool, ToolCall};
use crate::error::DataError;

pub const OPEN: &str = "<|open|>";
pub const SEP: &str = "<|sep|>";
pub const CLOSE: &str = "<|close|>";
pub const END_OF_MSG: &str = "<|end_of_msg|>";
pub const MARKERS: [&str; 4] = [OPEN, SEP, CLOSE, END_OF_MSG];

/// The system message the template writes at thinking effort `max`.
const THINKING_EFFORT: &str = "`thinking_effort` guides on how much to think in your thinking \
channel (not including the response channel), supported values include `low`, `medium`, `high`, \
and `max`.\nNow the system is invoked with `thinking_effort=max`.";

const TOOLS_HEADER: &str =
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n";

/// Renders `messages` after the declaration of `tools` (see the module's doc).
pub fn render(
    messages: &[Message],
    tools: &[Tool],
    generation_prompt: bool,
) -> Result<Rendered, DataError> {
    let mut x = Xtml::default();
    if !tools.is_empty() {
        let declared = Json::Array(tools.iter().map(Tool::to_json).collect());
        let body = format!("{TOOLS_HEADER}{}\n```", declared.sorted_compact());
        x.message(
            &[("role", "system"), ("type", "tool-declare")],
            Part::Prompt,
            &body,
        );
    }
    x.message(
        &[("role", "system"), ("type", "thinking-effort")],
        Part::Prompt,
        THINKING_EFFORT,
    );
    // The latest assistant turn's calls, and the tool results written since it.
    let (mut calls, mut answered): (&[ToolCall], usize) = (&[], 0);
    let mut i = 0;
    while i < messages.len() {
        let m = &messages[i];
        match m.role {
            Role::System | Role::User => {
                let role = m.role.name();
                x.message(&attrs(role, m), Part::Prompt, &m.content);
            }
            Role::Assistant => {
                (calls, answered) = (&m.tool_calls, 0);
                x.assistant(m);
            }
            Role::Tool => {
                let run = messages[i..]
                    .iter()
                    .take_while(|t| t.role == Role::Tool)
                    .count();
                x.results(&messages[i..i + run], i, calls, &mut answered)?;
                i += run;
                continue;
            }
        }
        i += 1;
    }
    if generation_prompt {
        x.open(Part::Markup, "message", &[("role", "assistant")]);
        x.open(Part::Markup, "think", &[]);
    }
    Ok(x.out)
}

/// Splits a completion written after the generation prompt (which opens the think section): the
/// reasoning is what comes before `<|close|>think<|sep|>` (all of it when the completion stopped
/// while thinking), the answer what `<|open|>response<|sep|>` opens, up to its close or the end
/// (without the section, what precedes `<|close|>message<|sep|>`). Both trimmed; tool calls after
/// the response are not kept.
pub fn split_completion(text: &str) -> (Option<String>, String) {
    let close_think = format!("{CLOSE}think{SEP}");
    let Some((reasoning, rest)) = text.split_once(&close_think) else {
        return (Some(text.trim().to_string()), String::new());
    };
    let until = |text: &str, tag: &str| {
        let close = format!("{CLOSE}{tag}{SEP}");
        text.split_once(&close).map_or(text, |(a, _)| a).to_string()
    };
    let answer = match rest.split_once(&format!("{OPEN}response{SEP}")) {
        Some((_, a)) => until(a, "response"),
        // Answered without the section: what it wrote before closing the message.
        None => until(rest, "message"),
    };
    (
        Some(reasoning.trim().to_string()),
        answer.trim().to_string(),
    )
}

/// Reads a whole reply written after the generation prompt (which opens the think section), its
/// `<|end_of_msg|>` cut off: the reasoning, the response section, the tools section, and the
/// message's close. A reply cut short while answering is its answer so far; refused: the reasoning
/// never closed, a tools section, call or argument not closed, an argument whose value is not of
/// its `type`, a marker where text goes, and text outside the sections.
pub fn parse_reply(text: &str) -> Result<Reply, String> {
    let (reasoning, mut rest) = text
        .split_once(&closing("think"))
        .ok_or("the think section is never closed (cut short?)")?;
    unmarked(reasoning, "the reasoning")?;
    let mut content = "";
    if let Some(after) = rest.strip_prefix(&opening("response")) {
        (content, rest) = after
            .split_once(&closing("response"))
            .unwrap_or((after, ""));
        unmarked(content, "the response")?;
    }
    let mut calls = Vec::new();
    if let Some(after) = rest.strip_prefix(&opening("tools")) {
        rest = after;
        while rest.strip_prefix(&closing("tools")).is_none() {
            if rest.is_empty() {
                return Err("the tools section is not closed (cut short?)".into());
            }
            let n = calls.len() + 1;
            let (call, after) = parse_call(rest, n).map_err(|e| format!("tool call {n}: {e}"))?;
            calls.push(call);
            rest = after;
        }
        rest = &rest[closing("tools").len()..];
    }
    let rest = rest.strip_prefix(&closing("message")).unwrap_or(rest);
    if !rest.is_empty() {
        let shown: String = rest.chars().take(40).collect();
        return Err(format!("text outside the message's sections: {shown:?}"));
    }
    Ok(Reply {
        thinking: Some(reasoning.trim().to_string()),
        content: content.trim().to_string(),
        calls,
    })
}

/// `<|open|>call tool="N" index="n"<|sep|>`, its arguments and `<|close|>call<|sep|>`; and what
/// follows.
fn parse_call(text: &str, n: usize) -> Result<(ToolCall, &str), String> {
    let (attrs, mut rest) = open_tag(text, "call")?;
    let tool = attr(&attrs, "tool")?;
    let index = attr(&attrs, "index")?;
    if index != n.to_string() || attrs.len() != 2 {
        return Err(format!(
            "its tag is not `call tool=\"…\" index=\"{n}\"` (attributes {attrs:?})"
        ));
    }
    let mut arguments = Vec::new();
    while let Some(after) = rest.strip_prefix(OPEN) {
        if after.starts_with("argument") {
            let (attrs, after) = open_tag(rest, "argument")?;
            let (key, kind) = (attr(&attrs, "key")?, attr(&attrs, "type")?);
            if attrs.len() != 2 {
                return Err(format!(
                    "argument {key:?} has attributes besides key and type"
                ));
            }
            let (value, after) = after
                .split_once(&closing("argument"))
                .ok_or_else(|| format!("argument {key:?} is not closed (cut short?)"))?;
            unmarked(value, "an argument")?;
            let value = match kind.as_str() {
                "string" => Json::String(value.to_string()),
                _ => Json::parse(value).map_err(|e| format!("argument {key:?}: {e}"))?,
            };
            if type_name(&value) != kind {
                return Err(format!("argument {key:?} is not of its type {kind:?}"));
            }
            arguments.push((key, value));
            rest = after;
        } else {
            break;
        }
    }
    let rest = rest
        .strip_prefix(&closing("call"))
        .ok_or("it is not closed by <|close|>call<|sep|> (cut short?)")?;
    Ok((ToolCall::new(tool, Arguments(arguments).strict()?), rest))
}

/// `<|open|>TAG k="v"…<|sep|>` at the start of `text`: its attributes, unescaped, and what follows.
fn open_tag<'a>(text: &'a str, tag: &str) -> Result<(Vec<(String, String)>, &'a str), String> {
    let header = text
        .strip_prefix(OPEN)
        .and_then(|t| t.strip_prefix(tag))
        .ok_or_else(|| format!("expected <|open|>{tag}"))?;
    let (mut attrs_text, rest) = header
        .split_once(SEP)
        .ok_or_else(|| format!("the {tag} tag is not ended by <|sep|> (cut short?)"))?;
    let mut attrs = Vec::new();
    while !attrs_text.is_empty() {
        let bad = || format!("the {tag} tag's attributes do not read: {attrs_text:?}");
        let (key, after) = attrs_text
            .strip_prefix(' ')
            .and_then(|t| t.split_once("=\""))
            .ok_or_else(bad)?;
        let (value, after) = after.split_once('"').ok_or_else(bad)?;
        attrs.push((
            key.to_string(),
            value.replace("&quot;", "\"").replace("&amp;", "&"),
        ));
        attrs_text = after;
    }
    Ok((attrs, rest))
}

fn attr(attrs: &[(String, String)], key: &str) -> Result<String, String> {
    attrs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .ok_or_else(|| format!("no `{key}` attribute"))
}

/// `<|open|>TAG<|sep|>` and `<|close|>TAG<|sep|>`.
fn opening(tag: &str) -> String {
    format!("{OPEN}{tag}{SEP}")
}
fn closing(tag: &str) -> String {
    format!("{CLOSE}{tag}{SEP}")
}

/// Refuses text holding a marker (`what` names where).
fn unmarked(text: &str, what: &str) -> Result<(), String> {
    match MARKERS.iter().find(|m| text.contains(*m)) {
        Some(m) => Err(format!("{what} holds a stray {m}")),
        None => Ok(()),
    }
}

/// `role`, and the message's `name` when it has one.
fn attrs<'a>(role: &'a str, m: &'a Message) -> Vec<(&'a str, &'a str)> {
    let mut attrs = vec![("role", role)];
    // The template writes a name only when it is not empty.
    attrs.extend(
        m.name
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(|n| ("name", n)),
    );
    attrs
}

#[derive(Default)]
struct Xtml {
    out: Rendered,
}

impl Xtml {
    /// `<|open|>TAG k="v"…<|sep|>`
    fn open(&mut self, part: Part, tag: &str, attrs: &[(&str, &str)]) {
        let mut text = tag.to_string();
        for (k, v) in attrs {
            text.push_str(&format!(
                " {k}=\"{}\"",
                v.replace('&', "&amp;").replace('"', "&quot;")
            ));
        }
        self.out.push(part, true, OPEN);
        self.out.push(part, false, &text);
        self.out.push(part, true, SEP);
    }

    /// `<|close|>TAG<|sep|>`
    fn close(&mut self, part: Part, tag: &str) {
        self.out.push(part, true, CLOSE);
        self.out.push(part, false, tag);
        self.out.push(part, true, SEP);
    }

    /// A whole message whose body is `part`.
    fn message(&mut self, attrs: &[(&str, &str)], part: Part, body: &str) {
        self.open(Part::Markup, "message", attrs);
        self.out.push(part, false, body);
        self.close(Part::Markup, "message");
        self.out.push(Part::Markup, true, END_OF_MSG);
    }

    /// An assistant turn: what follows its generation prompt is what the model writes, trained.
    fn assistant(&mut self, m: &Message) {
        self.open(Part::Markup, "message", &attrs("assistant", m));
        self.open(Part::Markup, "think", &[]);
        if let Some(reasoning) = m.thinking.as_deref().filter(|r| !python_blank(r)) {
            self.out.push(Part::Thinking, false, reasoning);
        }
        self.close(Part::Thinking, "think");
        self.open(Part::Answer, "response", &[]);
        self.out.push(Part::Answer, false, &m.content);
        self.close(Part::Answer, "response");
        if !m.tool_calls.is_empty() {
            self.open(Part::Answer, "tools", &[]);
            for (k, call) in m.tool_calls.iter().enumerate() {
                let index = (k + 1).to_string();
                self.open(
                    Part::Answer,
                    "call",
                    &[("tool", &call.function.name), ("index", &index)],
                );
                for (key, value) in &call.function.arguments.0 {
                    self.open(
                        Part::Answer,
                        "argument",
                        &[("key", key), ("type", type_name(value))],
                    );
                    let text = match value {
                        Json::String(s) => s.clone(),
                        other => other.python_dumps(),
                    };
                    self.out.push(Part::Answer, false, &text);
                    self.close(Part::Answer, "argument");
                }
                self.close(Part::Answer, "call");
            }
            self.close(Part::Answer, "tools");
        }
        self.close(Part::Answer, "message");
        self.out.push(Part::Answer, true, END_OF_MSG);
    }

    /// A run of tool results (`first` the index of its first message): in the order of `calls`
    /// under their names when every result answers one of them by id, else as written, each named
    /// by its `name` or by the call in its place. `answered` counts the results since the calls.
    fn results(
        &mut self,
        run: &[Message],
        first: usize,
        calls: &[ToolCall],
        answered: &mut usize,
    ) -> Result<(), DataError> {
        let answers = |t: &Message, c: &ToolCall| {
            c.id.is_some() && t.tool_call_id.is_some() && c.id == t.tool_call_id
        };
        if run.iter().all(|t| calls.iter().any(|c| answers(t, c))) {
            let mut seen: Vec<&str> = Vec::new();
            for c in calls {
                let Some(id) = c.id.as_deref().filter(|id| !seen.contains(id)) else {
                    continue;
                };
                seen.push(id);
                for t in run.iter().filter(|t| answers(t, c)) {
                    *answered += 1;
                    self.result(t, &c.function.name, *answered);
                }
            }
            return Ok(());
        }
        for (k, t) in run.iter().enumerate() {
            *answered += 1;
            let name = t
                .name
                .as_deref()
                .or_else(|| calls.get(*answered - 1).map(|c| c.function.name.as_str()))
                .ok_or_else(|| {
                    DataError::Conversation(format!(
                        "message {}: a tool result needs its tool's name (`name`, or a \
                         `tool_call_id` of the calls before it)",
                        first + k
                    ))
                })?;
            self.result(t, name, *answered);
        }
        Ok(())
    }

    fn result(&mut self, t: &Message, tool: &str, index: usize) {
        let index = index.to_string();
        self.message(
            &[("role", "tool"), ("tool", tool), ("index", &index)],
            Part::Prompt,
            &t.content,
        );
    }
}

/// An argument's `type` attribute (the template's `xtml_type`).
fn type_name(value: &Json) -> &'static str {
    match value {
        Json::Bool(_) => "boolean",
        Json::Null => "null",
        Json::Number(_) => "number",
        Json::String(_) => "string",
        Json::Object(_) => "object",
        Json::Array(_) => "array",
    }
}

/// Whether Python's `str.strip()` leaves nothing of `text`: its whitespace is Rust's and the
/// separators U+001C to U+001F.
fn python_blank(text: &str) -> bool {
    text.chars()
        .all(|c| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completion_splits_into_reasoning_and_answer() {
        let done = "Add them. <|close|>think<|sep|><|open|>response<|sep|> 5 <|close|>response<|sep|>\
                    <|close|>message<|sep|>";
        assert_eq!(
            split_completion(done),
            (Some("Add them.".into()), "5".into())
        );
        // Cut short while answering, and while thinking.
        let answering = "x<|close|>think<|sep|><|open|>response<|sep|>The ans";
        assert_eq!(
            split_completion(answering),
            (Some("x".into()), "The ans".into())
        );
        assert_eq!(
            split_completion(" still thinking "),
            (Some("still thinking".into()), String::new())
        );
        let bare = "x<|close|>think<|sep|> 5 <|close|>message<|sep|>";
        assert_eq!(split_completion(bare), (Some("x".into()), "5".into()));
    }

    #[test]
    fn a_reply_reads_back_what_the_renderer_wrote_or_is_refused_by_name() {
        let call = |name: &str, args: &str| {
            let Json::Object(entries) = Json::parse(args).unwrap() else {
                panic!()
            };
            ToolCall::new(name.into(), Arguments(entries))
        };
        let m = Message {
            thinking: Some("Two calls.".into()),
            tool_calls: vec![
                call(
                    "get_weather",
                    r#"{"city": "Zürich \"q\" & <b>", "days": 3}"#,
                ),
                call(
                    "search",
                    r#"{"q": {"a": [1, null]}, "ok": true, "none": null}"#,
                ),
            ],
            name: Some("a\"b".into()),
            ..Message::new(Role::Assistant, "Checking.")
        };
        let text = render(&[m.clone()], &[], false).unwrap().text();
        let prompt =
            "<|open|>message role=\"assistant\" name=\"a&quot;b\"<|sep|><|open|>think<|sep|>";
        let reply = text
            .split_once(prompt)
            .and_then(|(_, t)| t.strip_suffix(END_OF_MSG))
            .unwrap();
        let r = parse_reply(reply).unwrap();
        assert_eq!(r.thinking, m.thinking);
        assert_eq!(r.content, "Checking.");
        assert_eq!(r.calls, m.tool_calls);
        let cut = &reply[..reply.find("<|close|>argument").unwrap()];
        for (text, why) in [
            (cut, "not closed"),
            (
                &reply[..reply.find("<|close|>tools").unwrap()],
                "tools section is not closed",
            ),
            ("thinking on", "never closed"),
            (
                "x<|close|>think<|sep|> 5 <|close|>message<|sep|>",
                "outside",
            ),
            (
                "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"2\"<|sep|>",
                "index=\"1\"",
            ),
            (
                "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>\
                 <|open|>argument key=\"n\" type=\"number\"<|sep|>\"7\"<|close|>argument<|sep|>",
                "not of its type",
            ),
            ("a<|open|>b<|close|>think<|sep|>", "stray <|open|>"),
            (
                "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>\
                 <|open|>argument key=\"n\" type=\"number\"<|sep|>1<|close|>argument<|sep|>\
                 <|open|>argument key=\"n\" type=\"number\"<|sep|>2<|close|>argument<|sep|>\
                 <|close|>call<|sep|><|close|>tools<|sep|>",
                "given twice",
            ),
        ] {
            let e = parse_reply(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
        // Cut short while answering: the answer so far.
        let r = parse_reply("r<|close|>think<|sep|><|open|>response<|sep|>The ans").unwrap();
        assert_eq!((r.content.as_str(), r.calls.len()), ("The ans", 0));
    }
}
