//! Prompt sets for generating teacher trajectories.
//!
//! JSONL, one prompt per line: `{"prompt": "…"}` (one user turn) or `{"messages": [{"role", "content"},
//! …]}` (a conversation the teacher continues, in OpenAI's shape: tool calls and results included,
//! with the tools declared under `tools`), each with an optional `id` (default `FILE:LINE`) and an
//! optional reference `answer` (kept beside the trajectory for exact-match checks).
//!
//! CHAMP (`champ-dataset` 1.0.0 on PyPI, MIT): 270 competition-math problems with reference answers,
//! read from the package's `dataset_files/v0.json` (`problems.{id}._text` and `._answer`), in
//! category order then problem number.

use crate::chat::{Chat, Message, Role, Tool};
use crate::corpus::jsonl_records;
use crate::error::DataError;
use serde::Deserialize;
use std::path::Path;

/// One prompt: the conversation to continue and what a correct answer is, where known.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub id: String,
    pub messages: Vec<Message>,
    /// The tools declared to the conversation.
    pub tools: Vec<Tool>,
    pub answer: Option<String>,
}

/// Reads a JSONL prompt file; each bad line is an error naming it.
pub fn read_prompts(path: &Path) -> Result<Vec<Prompt>, DataError> {
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    let prompts = jsonl_records(path, |record, line| {
        let chat = match (record.get("prompt"), record.get("messages")) {
            (Some(serde_json::Value::String(p)), None) if !p.trim().is_empty() => {
                if record.get("tools").is_some() {
                    return Err("declare `tools` with `messages`, not with `prompt`".into());
                }
                Chat {
                    messages: vec![Message::new(Role::User, p.clone())],
                    tools: Vec::new(),
                }
            }
            (Some(_), None) => return Err("`prompt` is not a non-empty string".into()),
            (None, Some(_)) => {
                // Read from the line, so arguments and schemas keep their keys' order.
                let chat = Chat::from_record(line, "messages")?;
                if chat
                    .messages
                    .last()
                    .is_none_or(|m| m.role == Role::Assistant)
                {
                    return Err(
                        "`messages` must end with a turn for the assistant to answer".into(),
                    );
                }
                chat
            }
            _ => return Err("give exactly one of `prompt` and `messages`".into()),
        };
        let text = |key: &str| -> Result<Option<String>, String> {
            match record.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(serde_json::Value::Number(n)) => Ok(Some(n.to_string())),
                Some(_) => Err(format!("`{key}` is not a string")),
            }
        };
        Ok((text("id")?, chat, text("answer")?))
    })?;
    Ok(prompts
        .into_iter()
        .map(|(line, (id, chat, answer))| Prompt {
            id: id.unwrap_or_else(|| format!("{name}:{}", line + 1)),
            messages: chat.messages,
            tools: chat.tools,
            answer,
        })
        .collect())
}

#[derive(Deserialize)]
struct ChampFile {
    problems: std::collections::BTreeMap<String, ChampProblem>,
}

#[derive(Deserialize)]
struct ChampProblem {
    #[serde(rename = "_text")]
    text: String,
    #[serde(rename = "_answer")]
    answer: Option<String>,
}

/// `P_Number-Theory_12` → `("P_Number-Theory", 12)`: problems in category, then numeric, order.
fn champ_order(id: &str) -> (&str, u64) {
    match id.rsplit_once('_') {
        Some((head, n)) => (head, n.parse().unwrap_or(u64::MAX)),
        None => (id, u64::MAX),
    }
}

/// Reads CHAMP's `v0.json`: one user prompt per problem, with its reference answer.
pub fn read_champ(path: &Path) -> Result<Vec<Prompt>, DataError> {
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let parsed: ChampFile = serde_json::from_reader(std::io::BufReader::new(file))
        .map_err(|e| DataError::io(path, format!("not a CHAMP v0.json: {e}")))?;
    let mut problems: Vec<(String, ChampProblem)> = parsed.problems.into_iter().collect();
    if problems.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    problems.sort_by(|a, b| champ_order(&a.0).cmp(&champ_order(&b.0)));
    Ok(problems
        .into_iter()
        .map(|(id, p)| Prompt {
            id,
            messages: vec![Message::new(Role::User, p.text)],
            tools: Vec::new(),
            answer: p.answer,
        })
        .collect())
}
