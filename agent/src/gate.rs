//! `gate`: hard checks on the student's answer that escalate when it fails them. A request that
//! asks for JSON (OpenAI's `response_format`: `json_object`, or `json_schema` with a schema) gets
//! a local answer only if the answer parses as one JSON value, an object for `json_object`, that
//! the schema accepts. A request with `tools` gets one only if the reply parses cleanly in the
//! student's chat format, every call names one of the request's tools with arguments its schema
//! accepts, and the calls are as many as `tool_choice` and `parallel_tool_calls` allow
//! ([`ToolGate`]). A completion that carries tests (`k3mini_tests`: HumanEval's `test` and
//! `entry_point`) gets a local answer only if it passes them ([`super::code`]), under a policy
//! that runs tests (`[gate] run_tests = true`: model-written code runs on the gateway's machine).
//!
//! ```toml
//! [gate]
//! run_tests = false   # run the tests a completion request carries
//! test_seconds = 10.0 # how long its program may run
//! constrain_calls = false # decode the student's answer to a tools request under the tools'
//!                         # grammar (chatml students; super::grammar)
//! ```
//!
//! Schemas are checked by the `jsonschema` crate (drafts 4 to 2020-12, 2020-12 unless `$schema`
//! says otherwise; `format` is an annotation, as the drafts have it). A schema the crate cannot
//! compile (not valid against its meta-schema, or a `$ref` outside the document: nothing is
//! fetched) is refused with the request, never taken as checked.

use super::sandbox::SandboxError;
use k3mini_data::ChatFormat;
use k3mini_data::Tool;
use k3mini_data::chat::{Json, ToolCall};
use k3mini_teacher::wire::openai::{ResponseFormat, ToolChoice, ToolMode};
use k3mini_teacher::{Interrupt, TeacherError};
use serde_json::Value;

/// What a request asked its answer to be.
#[derive(Clone, Debug, PartialEq)]
pub enum Gate {
    /// One JSON object.
    JsonObject,
    /// One JSON value the schema accepts.
    JsonSchema(Value),
    /// Tool calls the request's tools allow ([`ToolGate`]).
    Tools(ToolGate),
    /// Code that passes tests: the prompt it completes, the tests, their entry point and the
    /// program's time limit.
    Tests {
        prompt: String,
        tests: String,
        entry_point: String,
        limit: std::time::Duration,
    },
}

/// The `[gate]` table of a policy.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateSettings {
    pub run_tests: bool,
    pub test_seconds: f64,
    /// The student's own answer to a request with tools is decoded under the tools' grammar
    /// ([`crate::grammar`]), so its calls parse and match their schemas by construction.
    pub constrain_calls: bool,
}

impl Default for GateSettings {
    fn default() -> Self {
        Self {
            run_tests: false,
            test_seconds: 10.0,
            constrain_calls: false,
        }
    }
}

impl GateSettings {
    pub fn check(&self) -> Result<(), String> {
        if !(self.test_seconds > 0.0 && self.test_seconds <= 3600.0) {
            return Err(format!(
                "gate.test_seconds = {} must be in (0, 3600]",
                self.test_seconds
            ));
        }
        Ok(())
    }
}

impl Gate {
    /// The gate a request's `response_format` asks for (none for `text`), or why its schema
    /// cannot be checked.
    pub fn of(format: &ResponseFormat) -> Result<Option<Self>, String> {
        match format {
            ResponseFormat::Text => Ok(None),
            ResponseFormat::JsonObject => Ok(Some(Gate::JsonObject)),
            ResponseFormat::JsonSchema { json_schema } => {
                compiled(&json_schema.schema, "schema")?;
                Ok(Some(Gate::JsonSchema(json_schema.schema.clone())))
            }
        }
    }

    /// Why `text` fails the gate, or None when it passes; an error when `interrupt` fires while
    /// its tests run.
    pub fn fails(&self, text: &str, interrupt: Interrupt) -> Result<Option<String>, TeacherError> {
        let json = || {
            serde_json::from_str::<Value>(text.trim())
                .map_err(|e| format!("gate: the answer is not JSON ({e})"))
        };
        match self {
            Gate::Tests {
                prompt,
                tests,
                entry_point,
                limit,
            } => {
                let program = super::code::program(prompt, text, tests, entry_point);
                match super::code::passes(&program, *limit, interrupt) {
                    Ok(true) => Ok(None),
                    Ok(false) => Ok(Some(
                        "gate: the completion fails the request's tests".into(),
                    )),
                    Err(SandboxError::Interrupted(e)) => Err(e),
                    Err(e) => Ok(Some(format!("gate: the tests could not run ({e})"))),
                }
            }
            Gate::JsonObject => Ok(match json() {
                Ok(v) if v.is_object() => None,
                Ok(_) => Some("gate: the answer is JSON but not an object".into()),
                Err(e) => Some(e),
            }),
            Gate::JsonSchema(schema) => Ok(match json() {
                Ok(v) => violation(schema, &v)
                    .map(|e| format!("gate: the answer does not match the schema: {e}")),
                Err(e) => Some(e),
            }),
            Gate::Tools(tools) => Ok(tools.fails(text)),
        }
    }
}

/// `schema` compiled (`at` names it in the refusal).
fn compiled(schema: &Value, at: &str) -> Result<jsonschema::Validator, String> {
    jsonschema::validator_for(schema)
        .map_err(|e| format!("{at}: not a JSON Schema the gate can check: {e}"))
}

/// Why `schema` rejects `v`, naming the first place it does; None when it accepts it.
fn violation(schema: &Value, v: &Value) -> Option<String> {
    let validator = match compiled(schema, "the schema") {
        Ok(v) => v,
        Err(e) => return Some(e),
    };
    let e = validator.iter_errors(v).next()?;
    let at = e.instance_path().to_string();
    Some(match at.is_empty() {
        true => e.to_string(),
        false => format!("at {at}: {e}"),
    })
}

/// What a request with `tools` asks of the calls its answer makes.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolGate {
    /// The student's chat format, which its replies are read in.
    pub format: ChatFormat,
    /// Each declared function's name and its arguments' schema (any object when it has none).
    pub tools: Vec<(String, Option<Value>)>,
    pub choice: ToolChoice,
    /// Whether more than one call is allowed.
    pub parallel: bool,
}

impl ToolGate {
    /// The gate a request's tools ask for, or why it cannot be checked (a schema that does not
    /// compile, a name declared twice, a `tool_choice` naming a function not declared).
    pub fn of(
        format: ChatFormat,
        tools: &[Tool],
        choice: Option<&ToolChoice>,
        parallel: Option<bool>,
    ) -> Result<Self, (String, String)> {
        let mut declared: Vec<(String, Option<Value>)> = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            let f = &t.function;
            let at = format!("tools[{i}]");
            if t.kind != "function" {
                return Err((
                    at,
                    format!("a tool is of type \"function\", not {:?}", t.kind),
                ));
            }
            if declared.iter().any(|(name, _)| *name == f.name) {
                return Err((at, format!("the function `{}` is declared twice", f.name)));
            }
            let schema = match &f.parameters {
                Some(p) => {
                    let v = serde_json::to_value(p).map_err(|e| (at.clone(), e.to_string()))?;
                    compiled(&v, &format!("{at}.function.parameters"))
                        .map_err(|e| (at.clone(), e))?;
                    Some(v)
                }
                None => None,
            };
            declared.push((f.name.clone(), schema));
        }
        let choice = choice.cloned().unwrap_or(ToolChoice::Mode(ToolMode::Auto));
        if let ToolChoice::Named(n) = &choice
            && n.kind != "function"
        {
            return Err((
                "tool_choice".into(),
                format!("a named choice is of type \"function\", not {:?}", n.kind),
            ));
        }
        if let ToolChoice::Named(n) = &choice
            && !declared.iter().any(|(name, _)| *name == n.function.name)
        {
            return Err((
                "tool_choice".into(),
                format!(
                    "names `{}`, which the request's tools do not declare",
                    n.function.name
                ),
            ));
        }
        Ok(Self {
            format,
            tools: declared,
            choice,
            parallel: parallel.unwrap_or(true),
        })
    }

    /// Why a reply (`text`, as the student wrote it after the generation prompt) fails the gate.
    pub fn fails(&self, text: &str) -> Option<String> {
        match self.format.parse_reply(text) {
            Ok(reply) => self.judge(&reply.calls),
            Err(e) => Some(format!(
                "gate: the reply does not read as {} ({e})",
                self.format.name()
            )),
        }
    }

    /// Why parsed `calls` fail the gate: their number, their names, their arguments.
    pub fn judge(&self, calls: &[ToolCall]) -> Option<String> {
        let n = calls.len();
        let count = match &self.choice {
            ToolChoice::Mode(ToolMode::None) if n > 0 => Some(format!(
                "tool_choice is \"none\" and the answer makes {n} calls"
            )),
            ToolChoice::Mode(ToolMode::Required) if n == 0 => {
                Some("tool_choice is \"required\" and the answer calls no tool".into())
            }
            ToolChoice::Named(named) => {
                let want = &named.function.name;
                match calls.iter().find(|c| c.function.name != *want) {
                    _ if n == 0 => Some(format!(
                        "tool_choice names `{want}` and the answer calls no tool"
                    )),
                    Some(c) => Some(format!(
                        "tool_choice names `{want}` and the answer calls `{}`",
                        c.function.name
                    )),
                    None => None,
                }
            }
            _ => None,
        };
        let count = count.or_else(|| {
            (!self.parallel && n > 1)
                .then(|| format!("parallel_tool_calls is false and the answer makes {n} calls"))
        });
        if let Some(why) = count {
            return Some(format!("gate: {why}"));
        }
        for (k, call) in calls.iter().enumerate() {
            let name = &call.function.name;
            let Some((_, schema)) = self.tools.iter().find(|(t, _)| t == name) else {
                let known: Vec<&str> = self.tools.iter().map(|(t, _)| t.as_str()).collect();
                return Some(format!(
                    "gate: call {} names `{name}`, which is not one of the request's tools ({})",
                    k + 1,
                    known.join(", ")
                ));
            };
            let args = Json::Object(call.function.arguments.0.clone());
            let args = match serde_json::to_value(&args) {
                Ok(v) => v,
                Err(e) => return Some(format!("gate: call {} (`{name}`): {e}", k + 1)),
            };
            if let Some(why) = schema.as_ref().and_then(|s| violation(s, &args)) {
                return Some(format!(
                    "gate: call {} (`{name}`): its arguments do not match the tool's schema: {why}",
                    k + 1
                ));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Gate {
        Gate::JsonSchema(json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z]"},
                "population": {"type": "integer", "minimum": 0},
                "tags": {"type": "array", "items": {"enum": ["capital", "port"]}, "maxItems": 2},
                "mayor": {"anyOf": [{"type": "string"}, {"type": "null"}]}
            },
            "required": ["city", "population"],
            "additionalProperties": false
        }))
    }

    #[test]
    fn answers_pass_or_fail_with_the_place_named() {
        let g = schema();
        let fails = |g: &Gate, text: &str| g.fails(text, Interrupt::default()).unwrap();
        assert_eq!(
            fails(
                &g,
                r#" {"city": "Paris", "population": 2100000, "tags": ["capital"], "mayor": null} "#
            ),
            None
        );
        let fail = |text: &str| fails(&g, text).unwrap();
        assert!(fail("The capital is Paris.").contains("not JSON"));
        assert!(fail(r#"{"city": "Paris"}"#).contains("\"population\""));
        assert!(fail(r#"{"city": "Paris", "population": 2.5}"#).contains("at /population"));
        assert!(fail(r#"{"city": "Paris", "population": -1}"#).contains("minimum"));
        assert!(fail(r#"{"city": "P", "population": 1, "tags": ["river"]}"#).contains("/tags/0"));
        assert!(fail(r#"{"city": "P", "population": 1, "x": 1}"#).contains("'x'"));
        assert!(fail(r#"{"city": "P", "population": 1, "mayor": 3}"#).contains("/mayor"));
        // Keywords past the old hand-written subset are checked now.
        assert!(fail(r#"{"city": "paris", "population": 1}"#).contains("/city"));
        assert_eq!(fails(&Gate::JsonObject, "{}"), None);
        assert!(
            fails(&Gate::JsonObject, "[1]")
                .unwrap()
                .contains("not an object")
        );
    }

    #[test]
    fn a_schema_the_gate_cannot_check_is_refused() {
        let format = |schema: Value| -> ResponseFormat {
            serde_json::from_value(json!({
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}
            }))
            .unwrap()
        };
        for bad in [
            json!({"type": "int"}),
            json!({"required": "city"}),
            json!({"minItems": -1}),
            json!({"$ref": "https://example.com/schema.json"}),
        ] {
            let e = Gate::of(&format(bad.clone())).unwrap_err();
            assert!(e.starts_with("schema: not a JSON Schema"), "{bad}: {e}");
        }
        assert!(
            Gate::of(&format(
                json!({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}})
            ))
            .is_ok()
        );
        let text: ResponseFormat = serde_json::from_value(json!({"type": "text"})).unwrap();
        assert_eq!(Gate::of(&text), Ok(None));
    }

    fn tools() -> Vec<Tool> {
        serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1}}, "required": ["city"],
                "additionalProperties": false}}},
            {"type": "function", "function": {"name": "now"}}
        ]))
        .unwrap()
    }

    fn gate(choice: Value, parallel: Option<bool>) -> ToolGate {
        let choice: ToolChoice = serde_json::from_value(choice).unwrap();
        ToolGate::of(ChatFormat::Chatml, &tools(), Some(&choice), parallel).unwrap()
    }

    fn call(name: &str, args: &str) -> String {
        format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
    }

    #[test]
    fn a_kimi_k2_students_calls_are_read_in_its_format() {
        let k2 = ToolGate::of(ChatFormat::KimiK2, &tools(), None, None).unwrap();
        let call = |name: &str, args: &str| {
            format!(
                "<think>Look.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.\
                 {name}:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>"
            )
        };
        assert_eq!(k2.fails(&call("get_weather", r#"{"city": "Oslo"}"#)), None);
        let unknown = k2
            .fails(&call("get_wether", r#"{"city": "Oslo"}"#))
            .unwrap();
        assert!(unknown.contains("`get_wether`"), "{unknown}");
        let schema = k2.fails(&call("get_weather", r#"{"city": 7}"#)).unwrap();
        assert!(schema.contains("at /city"), "{schema}");
    }

    #[test]
    fn tool_calls_pass_or_fail_the_gate_by_name_arguments_count_and_parse() {
        let auto = gate(json!("auto"), None);
        let weather = call("get_weather", r#"{"city": "Oslo", "days": 2}"#);
        assert_eq!(auto.fails(&weather), None);
        assert_eq!(auto.fails("No tool needed."), None);
        assert_eq!(
            auto.fails(&format!("{weather}\n{}", call("now", "{}"))),
            None
        );
        for (text, why) in [
            (
                call("get_wether", r#"{"city": "Oslo"}"#),
                "names `get_wether`, which is not one",
            ),
            (
                call("get_weather", r#""city=Oslo""#),
                "arguments are not JSON",
            ),
            (
                call("get_weather", r#"{"days": 2}"#),
                "do not match the tool's schema",
            ),
            (
                call("get_weather", r#"{"city": "Oslo", "days": 0}"#),
                "at /days",
            ),
            (call("get_weather", r#"{"city": 7}"#), "at /city"),
            (
                call("get_weather", r#"{"city": "Oslo", "when": 1}"#),
                "'when'",
            ),
            (weather[..weather.len() - 5].to_string(), "not closed"),
            (format!("{weather} trailing"), "text follows the tool calls"),
        ] {
            let got = auto
                .fails(&text)
                .unwrap_or_else(|| panic!("{text:?} passed"));
            assert!(
                got.starts_with("gate: ") && got.contains(why),
                "{text:?}: {got}"
            );
        }
        let two = format!("{weather}\n{}", call("now", "{}"));
        for (gate, text, why) in [
            (
                gate(json!("required"), None),
                "Sunny.".to_string(),
                "\"required\"",
            ),
            (
                gate(json!("none"), None),
                weather.clone(),
                "\"none\" and the answer makes 1",
            ),
            (
                gate(json!("auto"), Some(false)),
                two.clone(),
                "parallel_tool_calls is false",
            ),
            (
                gate(
                    json!({"type": "function", "function": {"name": "now"}}),
                    None,
                ),
                two,
                "names `now` and the answer calls `get_weather`",
            ),
        ] {
            let got = gate
                .fails(&text)
                .unwrap_or_else(|| panic!("{text:?} passed"));
            assert!(got.contains(why), "{got}");
        }
        // What cannot be checked is refused with the request.
        let named = |name: &str| -> ToolChoice {
            serde_json::from_value(json!({"type": "function", "function": {"name": name}})).unwrap()
        };
        let e =
            ToolGate::of(ChatFormat::Chatml, &tools(), Some(&named("later")), None).unwrap_err();
        assert_eq!(e.0, "tool_choice");
        let mut twice = tools();
        twice.push(twice[0].clone());
        assert!(
            ToolGate::of(ChatFormat::Chatml, &twice, None, None)
                .unwrap_err()
                .1
                .contains("twice")
        );
        let mut bad = tools();
        bad[1].function.parameters = Some(Json::parse(r#"{"type": "whatever"}"#).unwrap());
        let e = ToolGate::of(ChatFormat::Chatml, &bad, None, None).unwrap_err();
        assert_eq!(e.0, "tools[1]");
        assert!(e.1.contains("tools[1].function.parameters"), "{}", e.1);
    }
}
