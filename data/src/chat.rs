//! Chat templates: a conversation rendered as tagged segments, so the token stream knows which ids
//! are template markup, prompt, thinking or answer and a loss mask can cover or skip each part.
//!
//! ChatML (SmolLM2, Qwen):
//! `<|im_start|>{role}\n{content}<|im_end|>\n`, an assistant turn with reasoning as
//! `<|im_start|>assistant\n<think>\n{thinking}\n</think>\n\n{answer}<|im_end|>\n`.
//!
//! Kimi (K2/K3):
//! `<|im_system|>system<|im_middle|>{content}<|im_end|>`, `<|im_user|>user<|im_middle|>…<|im_end|>`,
//! `<|im_assistant|>assistant<|im_middle|><think>{thinking}</think>{answer}<|im_end|>`; tool results
//! use `<|im_system|>tool<|im_middle|>`.
//!
//! What an assistant turn trains on: its answer and the `<|im_end|>` that closes it (the model must
//! learn to stop) are [`Part::Answer`]; `<think>…</think>` with its tags is [`Part::Thinking`]; the
//! turn header is [`Part::Markup`]; system, user and tool content is [`Part::Prompt`]. Segments are
//! tokenized one by one, so every id has exactly one part.

use crate::error::DataError;
use crate::tokenizer::{END_OF_TURN, KIMI_THINK_TAGS, Tokenizer};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// One turn. `thinking` is the assistant's reasoning (also accepted as `reasoning_content`, the
/// field vLLM and SGLang return).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: Role,
    pub content: String,
    #[serde(default, alias = "reasoning_content", alias = "reasoning")]
    pub thinking: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatFormat {
    Chatml,
    Kimi,
}

/// What a span of a rendered conversation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    Markup,
    Prompt,
    Thinking,
    Answer,
}

/// Which parts carry loss (the targets a chat document trains on).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossParts {
    #[serde(default)]
    pub prompt: bool,
    #[serde(default = "yes")]
    pub thinking: bool,
    #[serde(default = "yes")]
    pub answer: bool,
}

fn yes() -> bool {
    true
}

impl Default for LossParts {
    fn default() -> Self {
        Self {
            prompt: false,
            thinking: true,
            answer: true,
        }
    }
}

impl LossParts {
    pub fn trains(&self, part: Part) -> bool {
        match part {
            Part::Markup => false,
            Part::Prompt => self.prompt,
            Part::Thinking => self.thinking,
            Part::Answer => self.answer,
        }
    }
}

/// A span of a rendered conversation. `special` spans (template markup, think tags) are encoded with
/// special tokens recognised; everything people wrote is encoded as plain text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub part: Part,
    pub special: bool,
    pub text: String,
}

/// A conversation as tagged text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered {
    pub segments: Vec<Segment>,
}

impl Rendered {
    fn push(&mut self, part: Part, special: bool, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.segments.last_mut() {
            Some(s) if s.part == part && s.special == special => s.text.push_str(text),
            _ => self.segments.push(Segment {
                part,
                special,
                text: text.into(),
            }),
        }
    }

    /// The whole conversation as one string.
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect()
    }

    /// The bytes of its text, markup included.
    pub fn text_len(&self) -> usize {
        self.segments.iter().map(|s| s.text.len()).sum()
    }

    /// Token ids and the part of each.
    pub fn encode(&self, tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<Part>), DataError> {
        let (mut ids, mut parts) = (Vec::new(), Vec::new());
        for s in &self.segments {
            let piece = if s.special {
                tokenizer.encode_with_specials(&s.text)?
            } else {
                tokenizer.encode(&s.text)?
            };
            parts.extend(std::iter::repeat_n(s.part, piece.len()));
            ids.extend(piece);
        }
        Ok((ids, parts))
    }
}

/// The reasoning tags (one place: Kimi's vocabulary gives them reserved ids).
pub const THINK_OPEN: &str = KIMI_THINK_TAGS[0].0;
pub const THINK_CLOSE: &str = KIMI_THINK_TAGS[1].0;

/// Renders a conversation. `generation_prompt` appends the assistant header (for sampling).
pub fn render(
    messages: &[Message],
    format: ChatFormat,
    generation_prompt: bool,
) -> Result<Rendered, DataError> {
    if messages.is_empty() {
        return Err(DataError::Conversation(
            "the conversation has no messages".into(),
        ));
    }
    let mut out = Rendered::default();
    for (i, m) in messages.iter().enumerate() {
        if m.thinking.is_some() && m.role != Role::Assistant {
            return Err(DataError::Conversation(format!(
                "message {i}: only assistant turns carry thinking"
            )));
        }
        let (open, close) = header(format, m.role);
        out.push(Part::Markup, true, open);
        if m.role == Role::Assistant {
            if let Some(thinking) = &m.thinking {
                // ChatML models (Qwen3 style) put the tags on their own lines.
                let nl = if format == ChatFormat::Chatml {
                    "\n"
                } else {
                    ""
                };
                out.push(Part::Thinking, true, THINK_OPEN);
                out.push(Part::Thinking, false, &format!("{nl}{thinking}{nl}"));
                out.push(Part::Thinking, true, THINK_CLOSE);
                out.push(Part::Thinking, false, &format!("{nl}{nl}"));
            }
            out.push(Part::Answer, false, &m.content);
            // The end-of-turn marker of an answer is a target: the model learns to stop.
            let end = close.trim_end_matches('\n');
            out.push(Part::Answer, true, end);
            out.push(Part::Markup, true, &close[end.len()..]);
        } else {
            out.push(Part::Prompt, false, &m.content);
            out.push(Part::Markup, true, close);
        }
    }
    if generation_prompt {
        out.push(Part::Markup, true, header(format, Role::Assistant).0);
    }
    Ok(out)
}

/// Splits a completion into its reasoning and its answer: the text between `<think>` and `</think>`
/// (or before a lone `</think>`, for templates whose generation header opens the block) and what
/// follows, both trimmed. Without the tags it is all answer.
pub fn split_thinking(text: &str) -> (Option<String>, String) {
    let Some((before, after)) = text.split_once(THINK_CLOSE) else {
        return (None, text.trim().to_string());
    };
    let thinking = before.split_once(THINK_OPEN).map_or(before, |(_, t)| t);
    (Some(thinking.trim().to_string()), after.trim().to_string())
}

impl ChatFormat {
    /// The marker that ends a turn in this template.
    pub fn end_of_turn(self) -> &'static str {
        END_OF_TURN
    }
}

/// The special tokens a template's markup is made of.
pub fn markers(format: ChatFormat) -> &'static [&'static str] {
    match format {
        ChatFormat::Chatml => &["<|im_start|>", END_OF_TURN],
        ChatFormat::Kimi => &[
            "<|im_system|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_middle|>",
            END_OF_TURN,
        ],
    }
}

/// Refuses a tokenizer in which a template marker is not one token (the markup would be trained as
/// ordinary text and the model would never see the ids its runtime sends).
pub fn check_markers(format: ChatFormat, tokenizer: &Tokenizer) -> Result<(), DataError> {
    let missing: Vec<&str> = markers(format)
        .iter()
        .copied()
        .filter(|m| tokenizer.token_id(m).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let hint = match (format, tokenizer.name()) {
        (ChatFormat::Kimi, "kimi_k3") => {
            ": the Kimi template uses K2's chat markers, which K3's vocabulary renames; use tokenizer = \"kimi_k2\""
        }
        (ChatFormat::Chatml, _) => {
            ": a trained BPE needs them as specials (`k3mini data tokenizer train --special '<|im_start|>' --special '<|im_end|>'`)"
        }
        _ => "",
    };
    Err(DataError::Markers {
        template: format!("{format:?}"),
        missing: missing.join(" "),
        tokenizer: tokenizer.name().to_string(),
        hint,
    })
}

/// A turn's opening and closing markup.
fn header(format: ChatFormat, role: Role) -> (&'static str, &'static str) {
    match format {
        ChatFormat::Chatml => (
            match role {
                Role::System => "<|im_start|>system\n",
                Role::User => "<|im_start|>user\n",
                Role::Assistant => "<|im_start|>assistant\n",
                Role::Tool => "<|im_start|>tool\n",
            },
            "<|im_end|>\n",
        ),
        ChatFormat::Kimi => (
            match role {
                Role::System => "<|im_system|>system<|im_middle|>",
                Role::User => "<|im_user|>user<|im_middle|>",
                Role::Assistant => "<|im_assistant|>assistant<|im_middle|>",
                Role::Tool => "<|im_system|>tool<|im_middle|>",
            },
            "<|im_end|>",
        ),
    }
}
