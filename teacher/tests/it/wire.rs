//! The typed wire formats against the golden fixtures taken from vLLM's, SGLang's and OpenAI's
//! own documentation and tests (`tests/fixtures/wire/`, each naming its source): every request
//! reads as the server's request type, every response as the client's response type, and what we
//! read we write back unchanged (no field dropped or altered on the way through). The server's
//! side of each fixture runs against the real server in `tests/it/teacher_http.rs`.
use k3mini_teacher::wire::openai::{
    ChatRequest, ChatResponse, CompletionRequest, CompletionResponse,
};
use k3mini_teacher::wire::sglang::{GenerateRequest, GenerateResponse};
use k3mini_teacher::wire::{ErrorResponse, ModelList, parse_request};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Every fixture: (file name, its JSON).
pub(crate) fn fixtures() -> Vec<(String, Value)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/wire");
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            (
                name,
                serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap(),
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// That every value of `ours` (written back from the typed struct) is the fixture's, at the same
/// place: numbers equal as f32 (logprobs are f32 on both sides), objects key by key (`ours` may
/// leave out what the struct does not model, never add or change anything).
fn same_where_modelled(ours: &Value, theirs: &Value, at: &str) {
    match (ours, theirs) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                match b.get(k) {
                    Some(w) => same_where_modelled(v, w, &format!("{at}.{k}")),
                    // A field the fixture leaves out comes back absent, or as its default.
                    None => assert!(
                        v.is_null()
                            || v == &Value::String(String::new())
                            || v.as_u64() == Some(0)
                            || v.as_array().is_some_and(Vec::is_empty)
                            || v.as_object().is_some_and(|o| o.is_empty()),
                        "{at}.{k}: {v} where the fixture has nothing"
                    ),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{at}: lengths");
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                same_where_modelled(v, w, &format!("{at}[{i}]"));
            }
        }
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert_eq!(a as f32, b as f32, "{at}: {a} vs the fixture's {b}");
        }
        _ => assert_eq!(ours, theirs, "{at}"),
    }
}

/// `json` read as `T` and written back: the same where `T` models it.
fn round_trip<T: DeserializeOwned + Serialize>(json: &Value, what: &str) {
    let bytes = serde_json::to_vec(json).unwrap();
    let typed: T =
        parse_request(&bytes).unwrap_or_else(|(field, e)| panic!("{what}: {field}: {e}"));
    let back = serde_json::to_value(&typed).unwrap();
    same_where_modelled(&back, json, what);
}

#[test]
fn every_fixture_reads_as_its_type_and_writes_back_unchanged() {
    let mut seen = 0;
    for (name, f) in fixtures() {
        let (request, response) = (&f["request"], &f["response"]);
        let endpoint = f["endpoint"].as_str().unwrap();
        if f.get("status").is_some() {
            // Errors: vLLM's shape since 0.10.1 reads as ours. Its older flat shape and its 401's
            // bare string do not: the client reports those by their text.
            let typed = serde_json::from_value::<ErrorResponse>(response.clone());
            assert_eq!(
                typed.is_ok(),
                response["error"].is_object(),
                "{name}: {response}"
            );
            if let Ok(e) = typed {
                assert_eq!(Some(e.error.code as u64), f["status"].as_u64(), "{name}");
            }
            seen += 1;
            continue;
        }
        match endpoint {
            "/v1/completions" => {
                round_trip::<CompletionRequest>(request, &format!("{name} request"));
                round_trip::<CompletionResponse>(response, &format!("{name} response"));
            }
            "/v1/chat/completions" => {
                round_trip::<ChatRequest>(request, &format!("{name} request"));
                round_trip::<ChatResponse>(response, &format!("{name} response"));
            }
            "/generate" => {
                round_trip::<GenerateRequest>(request, &format!("{name} request"));
                round_trip::<GenerateResponse>(response, &format!("{name} response"));
            }
            "/v1/models" => round_trip::<ModelList>(response, &format!("{name} response")),
            other => panic!("{name}: endpoint {other}"),
        }
        seen += 1;
    }
    assert!(seen >= 15, "{seen} fixtures");
}

#[test]
fn a_malformed_request_names_its_field() {
    let cases: [(&[u8], &str, &str); 6] = [
        (b"{not json", "body", "invalid JSON"),
        (br#"{"prompt": "x"}garbage"#, "body", "invalid JSON"),
        (
            br#"{"prompt": 7}"#,
            "prompt",
            "must be a string or a list of token ids",
        ),
        (br#"{"prompt": [1, -2]}"#, "prompt", "must hold token ids"),
        (
            br#"{"prompt": "x", "temperature": "hot"}"#,
            "temperature",
            "`temperature`",
        ),
        (
            br#"{"prompt": "x", "logprobs": 1.5}"#,
            "logprobs",
            "`logprobs`",
        ),
    ];
    for (body, field, says) in cases {
        let (f, message) = parse_request::<CompletionRequest>(body).unwrap_err();
        assert_eq!(f, field, "{message}");
        assert!(message.contains(says), "{message}");
    }
    let (f, message) =
        parse_request::<ChatRequest>(br#"{"messages": [{"role": "robot", "content": "x"}]}"#)
            .unwrap_err();
    assert_eq!(f, "messages");
    assert!(message.contains("messages[0].role"), "{message}");
    // Unknown fields are ignored, as vLLM ignores them.
    let r: CompletionRequest =
        parse_request(br#"{"prompt": [1, 2], "frobnicate": {"x": 1}}"#).unwrap();
    assert_eq!(
        r.prompt,
        k3mini_teacher::wire::openai::Prompt::Ids(vec![1, 2])
    );
    // Ids past u32 arrive intact, to be refused by range rather than wrapped.
    let r: CompletionRequest = parse_request(br#"{"prompt": [4294967301]}"#).unwrap();
    assert_eq!(
        r.prompt,
        k3mini_teacher::wire::openai::Prompt::Ids(vec![4294967301])
    );
}
