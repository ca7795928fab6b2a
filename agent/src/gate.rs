//! `gate`: hard checks on the student's answer that escalate when it fails them. A request that
//! asks for JSON (OpenAI's `response_format`: `json_object`, or `json_schema` with a schema) gets
//! a local answer only if the answer parses as one JSON value, an object for `json_object`, that
//! the schema accepts. A completion that carries tests (`k3mini_tests`: HumanEval's `test` and
//! `entry_point`) gets a local answer only if it passes them ([`super::code`]), under a policy
//! that runs tests (`[gate] run_tests = true`: model-written code runs on the gateway's machine).
//!
//! ```toml
//! [gate]
//! run_tests = false   # run the tests a completion request carries
//! test_seconds = 10.0 # how long its program may run
//! ```
//!
//! The schema is checked by a subset of JSON Schema (`type`, `properties`, `required`,
//! `additionalProperties`, `items` as one schema, `enum`, `const`, `anyOf`,
//! `minItems`/`maxItems`, `minimum`/`maximum`; annotations such as `description` pass), written
//! here because no JSON Schema crate is among this project's vendored dependencies. A keyword
//! outside the subset (`$ref`, `pattern`, `format`, …), or one whose value is not of its shape, is
//! refused with the request, never ignored, so a schema is never taken as checked when it was
//! not. Numbers compare as numbers (`1.0` is `const: 1`).

use super::sandbox::SandboxError;
use k3mini_teacher::wire::openai::ResponseFormat;
use k3mini_teacher::{Interrupt, TeacherError};
use serde_json::Value;

/// What a request asked its answer to be.
#[derive(Clone, Debug, PartialEq)]
pub enum Gate {
    /// One JSON object.
    JsonObject,
    /// One JSON value the schema accepts.
    JsonSchema(Value),
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
}

impl Default for GateSettings {
    fn default() -> Self {
        Self {
            run_tests: false,
            test_seconds: 10.0,
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

/// The keywords checked.
const CHECKED: [&str; 12] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "const",
    "anyOf",
    "minItems",
    "maxItems",
    "minimum",
    "maximum",
];
/// Keywords that say nothing about which values are valid.
const ANNOTATIONS: [&str; 7] = [
    "description",
    "title",
    "$schema",
    "$comment",
    "$id",
    "default",
    "examples",
];
const TYPES: [&str; 7] = [
    "object", "array", "string", "number", "integer", "boolean", "null",
];

impl Gate {
    /// The gate a request's `response_format` asks for (none for `text`), or why its schema
    /// cannot be checked.
    pub fn of(format: &ResponseFormat) -> Result<Option<Self>, String> {
        match format {
            ResponseFormat::Text => Ok(None),
            ResponseFormat::JsonObject => Ok(Some(Gate::JsonObject)),
            ResponseFormat::JsonSchema { json_schema } => {
                supported(&json_schema.schema, "schema")?;
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
                Ok(v) => validate(schema, &v, "$")
                    .err()
                    .map(|e| format!("gate: the answer does not match the schema: {e}")),
                Err(e) => Some(e),
            }),
        }
    }
}

/// Refuses a schema that uses keywords outside the checked subset (at `at`).
fn supported(schema: &Value, at: &str) -> Result<(), String> {
    let Value::Object(map) = schema else {
        return match schema {
            Value::Bool(_) => Ok(()),
            _ => Err(format!("{at}: a schema is an object")),
        };
    };
    for (key, sub) in map {
        let k = key.as_str();
        if ANNOTATIONS.contains(&k) {
            continue;
        }
        if !CHECKED.contains(&k) {
            return Err(format!(
                "{at}: the gate does not check the JSON Schema keyword `{key}` (it checks {})",
                CHECKED.join(", ")
            ));
        }
        let shaped = match (k, sub) {
            ("properties", Value::Object(props)) => {
                for (name, s) in props {
                    supported(s, &format!("{at}.properties.{name}"))?;
                }
                true
            }
            ("items" | "additionalProperties", s) => {
                supported(s, &format!("{at}.{key}"))?;
                true
            }
            ("anyOf", Value::Array(options)) if !options.is_empty() => {
                for (i, s) in options.iter().enumerate() {
                    supported(s, &format!("{at}.anyOf[{i}]"))?;
                }
                true
            }
            ("type", Value::String(t)) => TYPES.contains(&t.as_str()),
            ("type", Value::Array(ts)) => ts
                .iter()
                .all(|t| t.as_str().is_some_and(|t| TYPES.contains(&t))),
            ("required", Value::Array(r)) => r.iter().all(Value::is_string),
            ("enum", Value::Array(_)) | ("const", _) => true,
            ("minItems" | "maxItems", v) => v.is_u64(),
            ("minimum" | "maximum", v) => v.is_number(),
            _ => false,
        };
        if !shaped {
            return Err(format!(
                "{at}.{key}: {sub} is not a valid value for `{key}`"
            ));
        }
    }
    Ok(())
}

fn type_matches(name: &str, v: &Value) -> bool {
    match name {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => false,
    }
}

/// JSON equality with numbers compared by value (JSON Schema's: `1.0` equals `1`).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            match (x.as_i64(), y.as_i64(), x.as_u64(), y.as_u64()) {
                (Some(x), Some(y), _, _) => x == y,
                (_, _, Some(x), Some(y)) => x == y,
                _ => x.as_f64() == y.as_f64(),
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, a)| y.get(k).is_some_and(|b| same(a, b)))
        }
        _ => a == b,
    }
}

/// Whether `schema` (of the checked subset) accepts `v`; the error names where it does not.
pub fn validate(schema: &Value, v: &Value, at: &str) -> Result<(), String> {
    let map = match schema {
        Value::Bool(true) => return Ok(()),
        Value::Bool(false) => return Err(format!("{at}: no value is allowed here")),
        Value::Object(map) => map,
        _ => return Err(format!("{at}: the schema here is not an object")),
    };
    if let Some(t) = map.get("type") {
        let names: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if !names.iter().any(|n| type_matches(n, v)) {
            return Err(format!("{at}: {v} is not of type {t}"));
        }
    }
    if let Some(Value::Array(allowed)) = map.get("enum")
        && !allowed.iter().any(|a| same(a, v))
    {
        return Err(format!(
            "{at}: {v} is not one of {}",
            Value::Array(allowed.clone())
        ));
    }
    if let Some(c) = map.get("const")
        && !same(c, v)
    {
        return Err(format!("{at}: {v} is not {c}"));
    }
    if let Some(Value::Array(options)) = map.get("anyOf")
        && !options.iter().any(|s| validate(s, v, at).is_ok())
    {
        return Err(format!("{at}: {v} matches none of anyOf"));
    }
    if let Some(n) = v.as_f64() {
        if let Some(min) = map.get("minimum").and_then(Value::as_f64)
            && n < min
        {
            return Err(format!("{at}: {n} is below the minimum {min}"));
        }
        if let Some(max) = map.get("maximum").and_then(Value::as_f64)
            && n > max
        {
            return Err(format!("{at}: {n} is above the maximum {max}"));
        }
    }
    if let Value::Object(obj) = v {
        if let Some(Value::Array(required)) = map.get("required") {
            for key in required.iter().filter_map(Value::as_str) {
                if !obj.contains_key(key) {
                    return Err(format!("{at}: the required key {key:?} is missing"));
                }
            }
        }
        let props = map.get("properties").and_then(Value::as_object);
        for (key, value) in obj {
            match (
                props.and_then(|p| p.get(key)),
                map.get("additionalProperties"),
            ) {
                (Some(s), _) => validate(s, value, &format!("{at}.{key}"))?,
                (None, Some(extra)) => validate(extra, value, &format!("{at}.{key}"))?,
                (None, None) => {}
            }
        }
    }
    if let Value::Array(items) = v {
        let len = items.len() as u64;
        if let Some(min) = map.get("minItems").and_then(Value::as_u64)
            && len < min
        {
            return Err(format!("{at}: {len} items, fewer than {min}"));
        }
        if let Some(max) = map.get("maxItems").and_then(Value::as_u64)
            && len > max
        {
            return Err(format!("{at}: {len} items, more than {max}"));
        }
        if let Some(s) = map.get("items") {
            for (i, item) in items.iter().enumerate() {
                validate(s, item, &format!("{at}[{i}]"))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema() -> Gate {
        Gate::JsonSchema(json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
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
        assert!(fail(r#"{"city": "Paris"}"#).contains("\"population\" is missing"));
        assert!(fail(r#"{"city": "Paris", "population": 2.5}"#).contains("$.population"));
        assert!(fail(r#"{"city": "Paris", "population": -1}"#).contains("below the minimum"));
        assert!(fail(r#"{"city": "P", "population": 1, "tags": ["river"]}"#).contains("$.tags[0]"));
        assert!(fail(r#"{"city": "P", "population": 1, "x": 1}"#).contains("no value is allowed"));
        assert!(fail(r#"{"city": "P", "population": 1, "mayor": 3}"#).contains("anyOf"));
        assert_eq!(fails(&Gate::JsonObject, "{}"), None);
        assert!(
            fails(&Gate::JsonObject, "[1]")
                .unwrap()
                .contains("not an object")
        );
    }

    #[test]
    fn a_keyword_the_gate_does_not_check_is_refused() {
        let format: ResponseFormat = serde_json::from_value(json!({
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "s": {"type": "string", "pattern": "^a"}}}}
        }))
        .unwrap();
        let err = Gate::of(&format).unwrap_err();
        assert!(
            err.contains("schema.properties.s") && err.contains("`pattern`"),
            "{err}"
        );
        // A checked keyword with a value of the wrong shape is refused too, not ignored.
        for bad in [
            json!({"required": "city"}),
            json!({"type": "int"}),
            json!({"items": [{"type": "string"}]}),
            json!({"anyOf": {"type": "string"}}),
            json!({"minItems": -1}),
        ] {
            assert!(supported(&bad, "schema").is_err(), "{bad}");
        }
        assert!(
            supported(
                &json!({"type": "object", "default": {}, "$comment": "x"}),
                "s"
            )
            .is_ok()
        );
        assert!(validate(&json!({"const": 1}), &json!(1.0), "$").is_ok());
        assert!(validate(&json!({"enum": [2, "a"]}), &json!(2.0), "$").is_ok());
        let text: ResponseFormat = serde_json::from_value(json!({"type": "text"})).unwrap();
        assert_eq!(Gate::of(&text), Ok(None));
    }
}
