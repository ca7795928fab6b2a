//! The Berkeley Function Calling Leaderboard's AST check (`bfcl-eval`'s
//! `eval_checker/ast_eval/ast_checker.py`, its Python-language path), on calls read from a reply:
//! whether the calls a model made are the ones a task's ground truth allows.
//!
//! A ground truth is a list of `{function: {parameter: [allowed values]}}`, `""` among a
//! parameter's values marking it optional. One call (`simple`, `multiple`) or as many as the
//! ground truth in any order (`parallel`, `parallel_multiple`) must each: name the function,
//! give every required parameter and no parameter the function or the ground truth lacks, give
//! each the declared type (an integer passes for a float; a value of the ground truth's own type
//! when that differs from the declared one, BFCL's "variable"), and a value among the allowed ones:
//! strings compared after BFCL's standardisation (spaces and `,./-_*^` removed, lower case, `'` as
//! `"`), lists element-wise so, objects key by key; an optional parameter left out only where `""`
//! allows it. `irrelevance` passes when the reply makes no call. Types are the tools' JSON Schema
//! ones (`scripts/agent/bfcl-tasks.py` writes BFCL's `dict`, `float` and `tuple` as `object`,
//! `number` and `array`, and `any` as no type, which this check reads as BFCL reads the originals:
//! a missing type is BFCL's `any`, a string).

use k3mini_data::Tool;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// A task's kind, as BFCL names its categories.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Simple,
    Multiple,
    Parallel,
    ParallelMultiple,
    Irrelevance,
}

/// One ground-truth call: the function and each parameter's allowed values.
pub type Truth = BTreeMap<String, BTreeMap<String, Vec<Value>>>;

/// A call as the check reads it: the function's name and its arguments.
pub type Made<'a> = (&'a str, &'a Map<String, Value>);

/// Why `calls` fail the task (`tools` declared, `truth` its ground truth), or Ok.
pub fn check(
    category: Category,
    tools: &[Tool],
    calls: &[Made],
    truth: &[Truth],
) -> Result<(), String> {
    match category {
        Category::Irrelevance => match calls.len() {
            0 => Ok(()),
            n => Err(format!("{n} calls where none is relevant")),
        },
        Category::Parallel | Category::ParallelMultiple => {
            if calls.len() != truth.len() {
                return Err(format!(
                    "{} calls where {} are expected",
                    calls.len(),
                    truth.len()
                ));
            }
            // Each expected call takes the first unmatched call that passes it, as BFCL does.
            let mut matched = vec![false; calls.len()];
            for (i, t) in truth.iter().enumerate() {
                let mut last = String::new();
                let found = (0..calls.len()).filter(|&j| !matched[j]).find(|&j| {
                    match one(tools, calls[j], t) {
                        Ok(()) => true,
                        Err(e) => {
                            last = e;
                            false
                        }
                    }
                });
                match found {
                    Some(j) => matched[j] = true,
                    None => return Err(format!("no call matches expected call {i}: {last}")),
                }
            }
            Ok(())
        }
        Category::Simple | Category::Multiple => match (calls, truth) {
            ([call], [t]) => one(tools, *call, t),
            _ => Err(format!("{} calls where 1 is expected", calls.len())),
        },
    }
}

/// BFCL's `simple_function_checker`: one call against one ground-truth call.
fn one(tools: &[Tool], (name, args): Made, truth: &Truth) -> Result<(), String> {
    let (want, allowed) = truth.iter().next().ok_or("an empty ground-truth call")?;
    if name != want {
        return Err(format!("calls `{name}`, not `{want}`"));
    }
    let params = tools
        .iter()
        .find(|t| t.function.name == *want)
        .and_then(|t| t.function.parameters.as_ref())
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| e.to_string())?
        .unwrap_or(Value::Null);
    let empty = Map::new();
    let properties = params["properties"].as_object().unwrap_or(&empty);
    for r in params["required"].as_array().into_iter().flatten() {
        if let Some(r) = r.as_str()
            && !args.contains_key(r)
        {
            return Err(format!("missing required parameter `{r}`"));
        }
    }
    for (param, value) in args {
        let (Some(spec), Some(values)) = (properties.get(param), allowed.get(param)) else {
            return Err(format!("unexpected parameter `{param}`"));
        };
        let declared = spec["type"].as_str().unwrap_or("string");
        let nested = spec["items"]["type"].as_str();
        let mut value = value.clone();
        // Python converts an int where a float is declared.
        if declared == "number"
            && let Some(i) = value.as_i64().filter(|_| !value.is_f64())
        {
            value = Value::from(i as f64);
        }
        let variable = typed(param, &value, values, declared, nested)?;
        let ok = match (variable, declared) {
            (true, _) => values.iter().any(|a| same(a, &value)),
            (false, "object") => dict_ok(&value, values),
            (false, "array") if nested == Some("object") => list_dict_ok(&value, values),
            (false, "string") => {
                let v = standardize(value.as_str().unwrap_or_default());
                values
                    .iter()
                    .filter_map(Value::as_str)
                    .any(|a| standardize(a) == v)
            }
            (false, "array") => {
                // BFCL reads an optional `""` as the empty list here.
                let v = standardized(&value);
                values.iter().any(|a| match a {
                    Value::String(s) if s.is_empty() => v == Value::Array(Vec::new()),
                    a => same(&standardized(a), &v),
                })
            }
            (false, _) => values.iter().any(|a| same(a, &value)),
        };
        if !ok {
            return Err(format!(
                "`{param}` = {value} is none of {}",
                Value::Array(values.clone())
            ));
        }
    }
    for (param, values) in allowed {
        if !args.contains_key(param) && !values.iter().any(|v| v == "") {
            return Err(format!("`{param}` left out and not optional"));
        }
    }
    Ok(())
}

/// Python's type of a JSON value, as BFCL's `PYTHON_TYPE_MAPPING` names the declared ones.
fn python_type(v: &Value) -> &'static str {
    match v {
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
        Value::Null => "null",
    }
}

/// BFCL's `type_checker`: whether `value` has the declared type (one level into arrays), and
/// whether it is a "variable" (of the ground truth's type where that is not the declared one).
fn typed(
    param: &str,
    value: &Value,
    allowed: &[Value],
    declared: &str,
    nested: Option<&str>,
) -> Result<bool, String> {
    let truth_type = allowed.iter().find(|a| *a != "").map(python_type);
    let variable = truth_type.is_some_and(|t| t != declared);
    if python_type(value) == declared {
        let Some(inner) = nested.filter(|_| declared == "array") else {
            return Ok(variable);
        };
        let items = value.as_array().map(Vec::as_slice).unwrap_or_default();
        // Some allowed list whose items' types the value's items all have (BFCL checks each item
        // against the allowed list as a whole, one level deep).
        let fits = |a: &Value| match a {
            Value::Array(list) => items
                .iter()
                .all(|item| typed(param, item, list, inner, None).is_ok()),
            _ => true,
        };
        if allowed.iter().any(fits) {
            return Ok(variable);
        }
        return Err(format!(
            "`{param}`: the items of {value} are not all of type {inner}"
        ));
    }
    if truth_type.is_some_and(|t| t == python_type(value)) {
        return Ok(true);
    }
    Err(format!("`{param}` = {value} is not of type {declared}"))
}

/// BFCL's `standardize_string`.
fn standardize(s: &str) -> String {
    s.chars()
        .filter(|c| !" ,./-_*^".contains(*c))
        .collect::<String>()
        .to_lowercase()
        .replace('\'', "\"")
}

/// A list with its strings standardised (BFCL's `list_checker`, one level).
fn standardized(v: &Value) -> Value {
    match v {
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|i| match i {
                    Value::String(s) => Value::String(standardize(s)),
                    other => other.clone(),
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Python's `==` on JSON values: numbers by value (`1 == 1.0`), a boolean as 0 or 1
/// (`True == 1`).
fn same(a: &Value, b: &Value) -> bool {
    let number = |v: &Value| match v {
        Value::Bool(b) => Some(serde_json::Number::from(u8::from(*b))),
        Value::Number(n) => Some(n.clone()),
        _ => None,
    };
    match (a, b) {
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::Number(_) | Value::Bool(_), Value::Number(_) | Value::Bool(_)) => {
            let (x, y) = (number(a).expect("a number"), number(b).expect("a number"));
            match (x.as_i64(), y.as_i64()) {
                (Some(x), Some(y)) => x == y,
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

/// BFCL's `dict_checker`: some allowed dictionary has every key given, each value allowed
/// (strings standardised), and every key left out optional.
fn dict_ok(value: &Value, allowed: &[Value]) -> bool {
    let Some(given) = value.as_object() else {
        return false;
    };
    allowed.iter().filter_map(Value::as_object).any(|want| {
        let values = |k: &str| want.get(k).and_then(Value::as_array);
        given.iter().all(|(k, v)| {
            values(k).is_some_and(|options| {
                let v = match v {
                    Value::String(s) => Value::String(standardize(s)),
                    other => other.clone(),
                };
                options.iter().any(|o| match o {
                    Value::String(s) => v == Value::String(standardize(s)),
                    other => same(other, &v),
                })
            })
        }) && want.iter().all(|(k, options)| {
            given.contains_key(k)
                || options
                    .as_array()
                    .is_some_and(|o| o.iter().any(|x| x == ""))
        })
    })
}

/// BFCL's `list_dict_checker`: some allowed list of dictionaries as long as the value, each in
/// place passing [`dict_ok`].
fn list_dict_ok(value: &Value, allowed: &[Value]) -> bool {
    let Some(given) = value.as_array() else {
        return false;
    };
    // BFCL reads an optional `""` as a list of none.
    let none = Vec::new();
    let lists = allowed.iter().filter_map(|a| match a {
        Value::String(s) if s.is_empty() => Some(&none),
        a => a.as_array(),
    });
    lists.into_iter().any(|want| {
        want.len() == given.len()
            && given
                .iter()
                .zip(want)
                .all(|(g, w)| dict_ok(g, std::slice::from_ref(w)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<Tool> {
        serde_json::from_value(json!([
            {"type": "function", "function": {"name": "area", "parameters": {"type": "object",
                "properties": {"base": {"type": "integer"}, "height": {"type": "number"},
                "unit": {"type": "string"}, "sides": {"type": "array", "items": {"type": "integer"}},
                "opts": {"type": "object"}}, "required": ["base"]}}},
            {"type": "function", "function": {"name": "log", "parameters": {"type": "object",
                "properties": {"msg": {"type": "string"}}, "required": ["msg"]}}}
        ]))
        .unwrap()
    }

    fn truth(v: Value) -> Vec<Truth> {
        serde_json::from_value(v).unwrap()
    }

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn calls_match_bfcls_ground_truth_as_its_checker_does() {
        let t = truth(
            json!([{"area": {"base": [10], "height": [5.0], "unit": ["units", ""],
            "sides": [[3, 4], ""], "opts": [{"round": [true]}, ""]}}]),
        );
        let ok = |a: Value| check(Category::Simple, &tools(), &[("area", &args(a))], &t);
        // An int for a float, strings standardised, optional parameters left out.
        assert_eq!(
            ok(json!({"base": 10, "height": 5, "unit": "Units"})),
            Ok(())
        );
        assert_eq!(
            ok(json!({"base": 10, "height": 5.0, "sides": [3, 4]})),
            Ok(())
        );
        assert_eq!(
            ok(json!({"base": 10, "height": 5, "opts": {"round": true}})),
            Ok(())
        );
        for (a, why) in [
            (json!({"height": 5}), "missing required parameter `base`"),
            (json!({"base": 10}), "`height` left out"),
            (json!({"base": 10.0, "height": 5}), "not of type integer"),
            (json!({"base": 11, "height": 5}), "`base` = 11 is none of"),
            (
                json!({"base": 10, "height": 5, "colour": "red"}),
                "unexpected parameter",
            ),
            (json!({"base": 10, "height": 5, "unit": "cm"}), "`unit`"),
            (json!({"base": 10, "height": 5, "sides": [4, 3]}), "`sides`"),
            (json!({"base": 10, "height": 5, "sides": ["3"]}), "`sides`"),
            (
                json!({"base": 10, "height": 5, "opts": {"round": false}}),
                "`opts`",
            ),
        ] {
            let e = ok(a.clone()).unwrap_err();
            assert!(e.contains(why), "{a}: {e}");
        }
        let e = check(
            Category::Simple,
            &tools(),
            &[("log", &args(json!({"msg": "x"})))],
            &t,
        );
        assert!(e.unwrap_err().contains("calls `log`, not `area`"));
        assert!(check(Category::Simple, &tools(), &[], &t).is_err());
        // Parallel: any order, each expected call matched once.
        let two = truth(json!([{"log": {"msg": ["a"]}}, {"log": {"msg": ["b"]}}]));
        let (a, b) = (args(json!({"msg": "A"})), args(json!({"msg": "b"})));
        assert_eq!(
            check(
                Category::Parallel,
                &tools(),
                &[("log", &b), ("log", &a)],
                &two
            ),
            Ok(())
        );
        assert!(
            check(
                Category::Parallel,
                &tools(),
                &[("log", &b), ("log", &b)],
                &two
            )
            .is_err()
        );
        assert!(check(Category::Parallel, &tools(), &[("log", &b)], &two).is_err());
        // Irrelevance: no call is right.
        assert_eq!(check(Category::Irrelevance, &tools(), &[], &[]), Ok(()));
        assert!(check(Category::Irrelevance, &tools(), &[("log", &a)], &[]).is_err());
        // Python's equality inside lists: `True == 1`.
        let flags = truth(json!([{"area": {"base": [10], "height": [""], "sides": [[1, 0]]}}]));
        let f = args(json!({"base": 10, "sides": [1, 0]}));
        assert_eq!(
            check(Category::Simple, &tools(), &[("area", &f)], &flags),
            Ok(())
        );
        assert!(same(&json!([true, false]), &json!([1, 0])) && !same(&json!(true), &json!(2)));
        // A variable: the ground truth's strings for a declared integer.
        let var = truth(json!([{"area": {"base": ["n"], "height": [""]}}]));
        let v = args(json!({"base": "n"}));
        assert_eq!(
            check(Category::Simple, &tools(), &[("area", &v)], &var),
            Ok(())
        );
    }
}
