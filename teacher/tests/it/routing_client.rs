//! The vLLM and SGLang clients reading routed experts: a loopback server answers scoring requests
//! as those engines do, with the payloads numpy built (tests/fixtures/routing/payloads.json), and
//! the client's routing of each sequence is numpy's array cut to the positions scored; a payload
//! of the wrong shape, with an expert the teacher lacks, or missing, is an error naming it.
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k3mini_http::{Limits, Reply, transport};
use k3mini_teacher::client::{Api, ClientOptions, HttpTeacher};
use k3mini_teacher::routing::wire::{RoutedExperts, RoutingShape, from_sglang, from_vllm_lists};
use k3mini_teacher::{Teacher, TeacherError};
use serde_json::{Value, json};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn fixtures() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/routing/payloads.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn shape() -> RoutingShape {
    RoutingShape {
        layers: 4,
        k: 3,
        experts: 8,
        moe_layers: vec![1, 2, 3],
    }
}

/// A server that answers `/v1/models` and every POST with `answer(path, request)`, until dropped.
struct Mock {
    url: String,
    stop: Arc<AtomicBool>,
}

impl Drop for Mock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn mock(answer: impl Fn(&str, &Value) -> Value + Send + Sync + 'static) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        transport::serve(listener, Limits::default(), &s, move |r, _| {
            let body = match r.path.as_str() {
                "/v1/models" => json!({"data": [{"id": "mock-moe"}]}),
                path => answer(path, &serde_json::from_slice(&r.body).unwrap()),
            };
            Reply::json(200, &body)
        })
        .unwrap();
    });
    Mock { url, stop }
}

/// A valid scoring answer for `ids` (every actual token at logprob −0.5, k = 1) in `api`'s shape,
/// with the routing fields of `routing` added where each API puts them.
fn scored(api: Api, ids: &[u64], routing: &Value) -> Value {
    match api {
        Api::Vllm => {
            let mut entries = vec![Value::Null];
            entries.extend(
                ids[1..]
                    .iter()
                    .map(|id| json!({id.to_string(): {"logprob": -0.5, "rank": 1}})),
            );
            let mut v = json!({"choices": [{"index": 0, "prompt_logprobs": entries}]});
            for (key, value) in routing.as_object().unwrap() {
                match key.as_str() {
                    "prompt_routed_experts" => v[key] = value.clone(),
                    _ => v["choices"][0][key] = value.clone(),
                }
            }
            v
        }
        _ => {
            let input: Vec<Value> = ids
                .iter()
                .enumerate()
                .map(|(i, id)| json!([if i == 0 { Value::Null } else { json!(-0.5) }, id, null]))
                .collect();
            let tops: Vec<Value> = ids
                .iter()
                .enumerate()
                .map(|(i, id)| match i {
                    0 => Value::Null,
                    _ => json!([[-0.5, id, null]]),
                })
                .collect();
            let mut meta = json!({"input_token_logprobs": input, "input_top_logprobs": tops});
            if let Some(r) = routing.get("routed_experts") {
                meta["routed_experts"] = r.clone();
            }
            json!({"meta_info": meta})
        }
    }
}

/// Scores `n` ids through a mock of `api` that sends `routing`; the request it got too.
fn score_through(
    api: Api,
    n: usize,
    routing: Value,
) -> (Result<k3mini_teacher::Scored, TeacherError>, Value) {
    let ids: Vec<u32> = (0..n as u32).map(|i| 10 + i).collect();
    let wire_ids: Vec<u64> = ids.iter().map(|&i| i as u64).collect();
    let seen = Arc::new(std::sync::Mutex::new(Value::Null));
    let record = seen.clone();
    let server = mock(move |_, req| {
        *record.lock().unwrap() = req.clone();
        scored(api, &wire_ids, &routing)
    });
    let opts = ClientOptions {
        api,
        retries: 0,
        timeout: Duration::from_secs(10),
        routing: Some(shape()),
        ..Default::default()
    };
    let t = HttpTeacher::connect(&[server.url.clone()], 100, opts).unwrap();
    assert_eq!(t.routing(), Some(&shape()));
    let out = t.score(&ids, 1);
    let request = seen.lock().unwrap().clone();
    (out, request)
}

/// numpy's `[tokens, layers, k]` lists as a payload.
fn expected(v: &Value) -> RoutedExperts {
    from_vllm_lists(
        &serde_json::from_value::<Vec<Vec<Vec<i64>>>>(v.clone()).unwrap(),
        4,
        3,
    )
    .unwrap()
}

#[test]
fn both_vllm_formats_and_sglangs_reach_the_scored_routing_cut_to_its_positions() {
    let doc = fixtures();
    for name in ["vllm_npy_int32", "vllm_npy_uint16", "vllm_npy_uint8"] {
        let f = &doc["fixtures"][name];
        let want = expected(&f["expected"]);
        // vLLM's payload covers the prompt and its one generated token but the last: n tokens.
        let (got, _) = score_through(Api::Vllm, want.tokens, f["response"]["choices"][0].clone());
        let got = got.unwrap();
        assert_eq!(
            got.routing,
            Some(want.routing(&shape(), want.tokens - 1)),
            "{name}"
        );
        assert_eq!(got.routing.as_ref().unwrap().tokens(), got.positions());
    }
    // vLLM 0.21: the prompt's routing at the response's top level (its tokens are the prompt's).
    let f = &doc["fixtures"]["vllm_0_21_lists"];
    let prompt = expected(&f["response"]["prompt_routed_experts"]);
    let response = json!({"prompt_routed_experts": f["response"]["prompt_routed_experts"],
                          "routed_experts": f["response"]["choices"][0]["routed_experts"]});
    let (got, _) = score_through(Api::Vllm, prompt.tokens, response);
    assert_eq!(
        got.unwrap().routing,
        Some(prompt.routing(&shape(), prompt.tokens - 1))
    );
    // SGLang: positions [0, n − 1), asked for per request.
    let f = &doc["fixtures"]["sglang_int32"];
    let b64 = f["response"]["meta_info"]["routed_experts"]
        .as_str()
        .unwrap();
    let want = from_sglang(b64, 4, 3).unwrap();
    let (got, request) =
        score_through(Api::Sglang, want.tokens + 1, json!({"routed_experts": b64}));
    assert_eq!(request["return_routed_experts"], json!(true));
    assert_eq!(
        got.unwrap().routing,
        Some(want.routing(&shape(), want.tokens))
    );
}

#[test]
fn a_missing_mis_shaped_or_out_of_range_payload_is_a_named_error() {
    let doc = fixtures();
    let f = &doc["fixtures"]["vllm_npy_int32"];
    let good = f["response"]["choices"][0]["routed_experts"].clone();
    let tokens = expected(&f["expected"]).tokens;
    let err = |api: Api, n: usize, routing: Value| {
        let e = score_through(api, n, routing).0.unwrap_err();
        assert!(matches!(e, TeacherError::Server(_)), "{e:?}");
        e.to_string()
    };
    // A server not started to return them.
    let e = err(Api::Vllm, tokens, json!({}));
    assert!(e.contains("--enable-return-routed-experts"), "{e}");
    // One token short of vLLM's n.
    let e = err(Api::Vllm, tokens + 1, json!({"routed_experts": good}));
    assert!(
        e.contains("shape") && e.contains(&format!("{} tokens", tokens + 1)),
        "{e}"
    );
    // Another teacher's layers.
    let other = RoutedExperts {
        tokens,
        layers: 5,
        k: 3,
        ids: vec![0; tokens * 15],
    };
    let npy = STANDARD.encode(k3mini_teacher::routing::wire::to_npy(&other));
    let e = err(Api::Vllm, tokens, json!({"routed_experts": npy}));
    assert!(e.contains("5") && e.contains("4 layers"), "{e}");
    // An expert past the teacher's 8 (in a MoE layer).
    let mut wrong = RoutedExperts {
        tokens,
        layers: 4,
        k: 3,
        ids: vec![1; tokens * 12],
    };
    wrong.ids[2 * 12 + 3 * 3 + 1] = 8;
    let npy = STANDARD.encode(k3mini_teacher::routing::wire::to_npy(&wrong));
    let e = err(Api::Vllm, tokens, json!({"routed_experts": npy}));
    assert!(
        e.contains("expert 8 at token 2, layer 3") && e.contains("8 experts"),
        "{e}"
    );
    // Not base64; SGLang's bytes not whole rows.
    let e = err(Api::Vllm, tokens, json!({"routed_experts": "%%%"}));
    assert!(e.contains("not base64"), "{e}");
    let e = err(
        Api::Sglang,
        tokens,
        json!({"routed_experts": STANDARD.encode([0u8; 10])}),
    );
    assert!(e.contains("not whole int32 rows"), "{e}");
}
