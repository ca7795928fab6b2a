//! Constrained decoding of tool calls: a grammar built from a request's tools, so the calls a
//! student writes parse, name a declared tool and carry arguments of its schema by construction
//! (the gate still judges every reply: the grammar is an aid, not the check).
//!
//! ChatML's Hermes calls, for `tool_choice` `auto` (the grammar is lazy: free text, until the
//! student writes `<tool_call>`; from there on only calls):
//!
//! ```text
//! start: think? (TEXT | lead call ("\n<tool_call>" call)*)
//! think[lazy]: /<think>(.|\n)*<\/think>/
//! TEXT: any text without a tag (`<tool_call>`, `</tool_call>`, `<think>`, `</think>`)
//! lead[lazy]: text without another tag up to the first "<tool_call>"
//! call: "\n" (fn_0 | fn_1 | …) "\n</tool_call>"
//! fn_k: "{\"name\": \"NAME_k\", \"arguments\": " %json{SCHEMA_k} "}"
//! ```
//!
//! `required` and a named function start with `<tool_call>` after the reasoning (no text, no
//! lead); a named one allows only its `fn_k`; `parallel_tool_calls: false` allows one call. The
//! arguments are a JSON object (a schema that says nothing of its type is made one; a tool whose
//! schema is `false`, or typed other than an object, cannot be called) in `json.dumps`' spacing, as the student was trained on
//! them. After the last call only the end of the turn may follow. Where llguidance cannot
//! compile a tool's schema (keywords it does not implement even leniently), the tools' arguments
//! are any JSON object instead: they still parse by construction, and the gate checks the
//! schema. The matcher is llguidance's, over the student's vocabulary, its special tokens out of
//! reach of text.

use crate::gate::ToolGate;
use k3mini_data::chat::{THINK_CLOSE, THINK_OPEN};
use k3mini_data::{ChatFormat, Tokenizer};
use k3mini_teacher::wire::openai::{ToolChoice, ToolMode};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use std::sync::Arc;

/// Grammars over one student's vocabulary (its token trie is built once).
pub struct CallGrammars {
    factory: ParserFactory,
}

impl CallGrammars {
    /// For a student of `format` with `tokenizer`, `n_vocab` logits per position, whose turn
    /// ends at `end_of_turn`; refused, naming why, for what it cannot constrain.
    pub fn new(
        format: ChatFormat,
        tokenizer: &Tokenizer,
        n_vocab: usize,
        end_of_turn: u32,
    ) -> Result<Self, String> {
        if format != ChatFormat::Chatml {
            return Err(format!(
                "constrained calls are built for chatml students; this one speaks {}",
                format.name()
            ));
        }
        let json = tokenizer.json().ok_or_else(|| {
            format!(
                "constrained calls need the student's tokenizer.json; {} is built in",
                tokenizer.name()
            )
        })?;
        let json: Value = serde_json::from_str(&json).map_err(|e| e.to_string())?;
        // The grammar writes the tags as text: a vocabulary that holds one as a special token
        // (out of text's reach) would have its own id masked out.
        let specials = json["added_tokens"].as_array().into_iter().flatten();
        if let Some(tag) = specials
            .filter(|t| t["special"] == true)
            .filter_map(|t| t["content"].as_str())
            .find(|c| TAGS.contains(c))
        {
            return Err(format!(
                "the tokenizer holds {tag} as a special token, which a grammar of text cannot write"
            ));
        }
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| format!("the tokenizer's token bytes: {e}"))?;
        if words.len() > n_vocab {
            return Err(format!(
                "the tokenizer has {} ids and the student {n_vocab} logits",
                words.len()
            ));
        }
        // Ids the model has past the tokenizer's: no bytes, never allowed.
        words.resize(n_vocab, Vec::new());
        let info = TokRxInfo::new(n_vocab as u32, end_of_turn);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// A matcher for the calls `gate` allows, fresh at the start of the reply (see the module's
    /// doc for a schema llguidance cannot compile).
    pub fn matcher(&self, gate: &ToolGate) -> Result<Matcher, String> {
        let parser = |schemas| {
            let grammar = TopLevelGrammar::from_lark(lark(gate, schemas)?);
            self.factory
                .create_parser(grammar)
                .map_err(|e| format!("the tools' grammar: {e}"))
        };
        // The first error is the one to report: the fallback's would hide it.
        let parser = parser(Schemas::Declared)
            .or_else(|first| parser(Schemas::AnyObject).map_err(|_| first))?;
        Ok(Matcher::new(Ok(parser)))
    }
}

/// The text tags the grammar writes.
const TAGS: [&str; 4] = ["<tool_call>", "</tool_call>", THINK_OPEN, THINK_CLOSE];

/// What a call's arguments are held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schemas {
    /// Each tool's own JSON Schema.
    Declared,
    /// Any JSON object.
    AnyObject,
}

/// A tool's schema as the grammar embeds it: an object (where the schema does not say), in
/// `json.dumps`' spacing, lenient where llguidance is strict; None for `false` (no call can
/// match it).
fn embedded(schema: Option<&Value>, schemas: Schemas) -> Option<Value> {
    let mut schema = match (schema, schemas) {
        (Some(Value::Bool(false)), _) => return None,
        (_, Schemas::AnyObject) | (None | Some(Value::Bool(true)), _) => json!({}),
        (Some(s), _) => s.clone(),
    };
    let o = schema.as_object_mut()?;
    // Arguments are an object: a schema typed otherwise admits no call.
    match o.get("type") {
        None => {}
        Some(Value::String(t)) if t == "object" => {}
        Some(Value::Array(ts)) if ts.iter().any(|t| t == "object") => {}
        Some(_) => return None,
    }
    o.insert("type".into(), json!("object"));
    o.insert(
        "x-guidance".into(),
        json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false,
               "lenient": true, "coerce_one_of": true}),
    );
    Some(schema)
}

/// The grammar (Lark, llguidance's dialect) of the replies `gate` allows, the arguments held to
/// `schemas`: see the module's doc.
pub fn lark(gate: &ToolGate, schemas: Schemas) -> Result<String, String> {
    if gate.format != ChatFormat::Chatml {
        return Err(format!(
            "no call grammar for the {} format",
            gate.format.name()
        ));
    }
    let quoted = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let named = match &gate.choice {
        ToolChoice::Named(n) => Some(n.function.name.as_str()),
        _ => None,
    };
    let mut functions = Vec::new();
    let mut rules = String::new();
    for (k, (name, schema)) in gate.tools.iter().enumerate() {
        // A name ChatML would have to escape is never written (its renderer refuses it).
        let writable = !name
            .chars()
            .any(|c| c == '"' || c == '\\' || c.is_control());
        if named.is_some_and(|n| n != name) || !writable {
            continue;
        }
        let Some(schema) = embedded(schema.as_ref(), schemas) else {
            continue;
        };
        let head = format!("{{\"name\": \"{name}\", \"arguments\": ");
        rules.push_str(&format!(
            "fn_{k}: {} %json {schema} \"}}\"\n",
            quoted(&head)
        ));
        functions.push(format!("fn_{k}"));
    }
    if functions.is_empty() {
        return Err("no declared tool can be called".into());
    }
    let calls = if gate.parallel {
        "call (\"\\n<tool_call>\" call)*"
    } else {
        "call"
    };
    let start = match &gate.choice {
        ToolChoice::Mode(ToolMode::None) => return Err("tool_choice is \"none\"".into()),
        // The lead never spans the reasoning: a `<tool_call>` quoted in it triggers nothing.
        ToolChoice::Mode(ToolMode::Auto) => format!(
            "start: think? (TEXT | lead {calls})\n\
             TEXT: /(.|\\n)*/ & ~/(.|\\n)*(<tool_call>|<\\/tool_call>|<think>|<\\/think>)(.|\\n)*/\n\
             lead[lazy]: /(.|\\n)*<tool_call>/ & ~/(.|\\n)*(<think>|<\\/think>|<\\/tool_call>)(.|\\n)*/\n"
        ),
        _ => format!("start: think? WS? \"<tool_call>\" {calls}\nWS: /\\s{{1,4}}/\n"),
    };
    // Lazy: the reasoning ends at its first `</think>` (a greedy lexeme would run past it).
    Ok(format!(
        "{start}think[lazy]: /<think>(.|\\n)*<\\/think>/\n\
         call: \"\\n\" ({}) \"\\n</tool_call>\"\n{rules}",
        functions.join(" | ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3mini_data::chat::Tool;

    fn gate(choice: Value, parallel: Option<bool>) -> ToolGate {
        let tools: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"], "additionalProperties": false}}},
            {"type": "function", "function": {"name": "now"}}
        ]))
        .unwrap();
        let choice: ToolChoice = serde_json::from_value(choice).unwrap();
        ToolGate::of(ChatFormat::Chatml, &tools, Some(&choice), parallel).unwrap()
    }

    /// Whether `grammars` accept `text` whole, as bytes (a byte-level vocabulary).
    fn accepts(grammar: &str, text: &str) -> bool {
        let words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).chain([vec![]]).collect();
        let info = TokRxInfo::new(words.len() as u32, 256);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        let parser = factory
            .create_parser(TopLevelGrammar::from_lark(grammar.to_string()))
            .unwrap();
        let mut m = Matcher::new(Ok(parser));
        let ids: Vec<u32> = text.bytes().map(u32::from).collect();
        m.consume_tokens(&ids).is_ok() && m.is_accepting().unwrap_or(false)
    }

    #[test]
    fn the_grammar_takes_what_the_gate_passes_and_nothing_else() {
        let weather = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        let now = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let auto = lark(&gate(json!("auto"), None), Schemas::Declared).unwrap();
        for text in [
            "No tool needed.".to_string(),
            String::new(),
            format!("Checking.\n{weather}"),
            format!("{weather}\n{now}"),
            format!("<think>\nWhich <tool_call>?\n</think>\n\n{now}"),
        ] {
            assert!(accepts(&auto, &text), "{text:?}");
        }
        for text in [
            // An unknown name, arguments off the schema, other spacing, text after the calls.
            weather.replace("get_weather", "get_wether"),
            weather.replace("\"Oslo\"", "7"),
            weather.replace("{\"city\": ", "{\"city\":"),
            weather.replace("{\"city\": \"Oslo\"}", "{\"city\": \"Oslo\", \"when\": 1}"),
            format!("{weather} and more"),
            weather[..weather.len() - 3].to_string(),
            // Tags the gate refuses as stray.
            "An open <think> never closed".to_string(),
            format!("Done.</tool_call>\n{weather}"),
            // A tool without a schema still takes an object, nothing else.
            now.replace("{}", "\"x\""),
            now.replace("{}", "[1]"),
        ] {
            assert!(!accepts(&auto, &text), "{text:?}");
        }
        let required = lark(&gate(json!("required"), Some(false)), Schemas::Declared).unwrap();
        assert!(accepts(&required, weather) && accepts(&required, now));
        assert!(accepts(
            &required,
            &format!("<think>Look.</think>\n\n{now}")
        ));
        assert!(!accepts(&required, "No tool needed."));
        assert!(
            !accepts(&required, &format!("{weather}\n{now}")),
            "one call"
        );
        let named = lark(
            &gate(
                json!({"type": "function", "function": {"name": "now"}}),
                None,
            ),
            Schemas::Declared,
        )
        .unwrap();
        assert!(accepts(&named, now) && !accepts(&named, weather));
        assert!(lark(&gate(json!("none"), None), Schemas::Declared).is_err());
        // Any object, where a schema cannot be compiled: still an object.
        let any = lark(&gate(json!("required"), None), Schemas::AnyObject).unwrap();
        assert!(accepts(&any, &weather.replace("\"Oslo\"", "7")));
        assert!(!accepts(&any, &now.replace("{}", "5")));
    }

    #[test]
    fn arguments_are_an_object_whatever_the_schema_says() {
        let typed =
            |schema: Value, schemas| embedded(Some(&schema), schemas).map(|s| s["type"].clone());
        assert_eq!(typed(json!(false), Schemas::AnyObject), None);
        assert_eq!(typed(json!({"type": "string"}), Schemas::Declared), None);
        assert_eq!(typed(json!({"type": ["null"]}), Schemas::Declared), None);
        for (schema, schemas) in [
            (json!({"type": ["object", "null"]}), Schemas::Declared),
            (json!({"anyOf": [{"required": ["a"]}]}), Schemas::Declared),
            (json!(true), Schemas::Declared),
            (json!({"type": "string"}), Schemas::AnyObject),
        ] {
            assert_eq!(
                typed(schema.clone(), schemas),
                Some(json!("object")),
                "{schema}"
            );
        }
        assert_eq!(embedded(None, Schemas::Declared).unwrap()["type"], "object");
    }

    /// Schemas a hostile client could send (deep nesting, a pattern with nested counts, a huge
    /// enum, a huge array minimum) compile within llguidance's default limits (its fuel bounds
    /// the lexer) or fall back to any object, and a mask inside the arguments comes out.
    #[test]
    fn hostile_schemas_compile_within_limits_or_fall_back() {
        let bpe = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../recipes/corpus/shakespeare-bpe4k.json"
        );
        let tok = Tokenizer::load(bpe).unwrap();
        let grammars = CallGrammars::new(ChatFormat::Chatml, &tok, tok.vocab_size(), 0).unwrap();
        // 40 levels of objects is 120 of JSON, near the 128 serde_json parses a request to.
        let nested = (0..40).fold(
            json!({"type": "string"}),
            |s, _| json!({"type": "object", "properties": {"a": s}, "required": ["a"]}),
        );
        let enumerated: Vec<String> = (0..20_000).map(|i| format!("value-{i}")).collect();
        let prefix = tok
            .encode("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"")
            .unwrap();
        for schema in [
            nested,
            json!({"type": "object", "properties": {"s": {"type": "string",
                "pattern": "^((a|aa){1,200}(b{1,200}){1,200})+$"}}}),
            json!({"type": "object", "properties": {"e": {"enum": enumerated}}}),
            json!({"type": "object", "properties": {"n": {"type": "array", "minItems": 100_000,
                "maxItems": 200_000, "items": {"type": "integer"}}}, "required": ["n"]}),
        ] {
            let tools: Vec<Tool> = serde_json::from_value(json!([{"type": "function",
                "function": {"name": "f", "parameters": schema}}]))
            .unwrap();
            let choice: ToolChoice = serde_json::from_value(json!("required")).unwrap();
            let gate = ToolGate::of(ChatFormat::Chatml, &tools, Some(&choice), None).unwrap();
            // Into the arguments, where the schema's lexer is built.
            let mut m = grammars.matcher(&gate).unwrap();
            m.consume_tokens(&prefix).unwrap();
            let mask = m.compute_mask().unwrap();
            assert!(mask.num_set() > 0);
        }
    }

    #[test]
    fn formats_without_a_call_grammar_are_refused_by_name() {
        let kimi = Tokenizer::load("kimi").unwrap();
        let e = CallGrammars::new(ChatFormat::KimiK3, &kimi, 163_840, 0)
            .err()
            .unwrap();
        assert!(
            e.contains("chatml students; this one speaks kimi_k3"),
            "{e}"
        );
        let e = CallGrammars::new(ChatFormat::Chatml, &kimi, 163_840, 0)
            .err()
            .unwrap();
        assert!(e.contains("tokenizer.json"), "{e}");
    }
}
