//! The real client against the real `k3mini teacher serve` process on loopback: scores and
//! generations equal the in-process teacher's to the bit; bad requests get OpenAI-style errors and
//! the server keeps serving; a dead endpoint in the list is retried past.
use burn::tensor::Device;
use k3mini_teacher::client::{Api, ClientOptions, HttpTeacher};
use k3mini_teacher::local::LocalTeacher;
use k3mini_teacher::{GenerateParams, Teacher, fetch};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(["teacher", "serve", "smollm2", "--port", "0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    Server { child, url }
}

/// One raw HTTP/1.1 exchange: (status, JSON body).
fn raw(url: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let json = text.split("\r\n\r\n").nth(1).unwrap();
    (status, serde_json::from_str(json).unwrap())
}

#[test]
fn client_and_server_agree_with_the_in_process_teacher() {
    let server = start();
    let path = fetch::fetch("smollm2", &fetch::cache_dir(), &mut |_| {}).unwrap();
    let local = LocalTeacher::from_gguf(&path, &Device::default()).unwrap();
    // A dead endpoint first: round-robin moves past it after a short backoff.
    let endpoints = ["http://127.0.0.1:9".to_string(), server.url.clone()];
    let opts = ClientOptions {
        api: Api::Vllm,
        timeout: Duration::from_secs(120),
        retries: 3,
        backoff: Duration::from_millis(10),
    };
    let remote = HttpTeacher::connect(&endpoints, 49152, opts.clone()).unwrap();
    let sglang = HttpTeacher::connect(&[server.url.clone()], 49152, ClientOptions { api: Api::Sglang, ..opts })
        .unwrap();
    assert_eq!(remote.name(), "SmolLM2-135M-Instruct.Q4_1.gguf");

    let ids = local.tokenizer.encode("The capital of France is Paris. It is known for").unwrap();
    let (a, b) = (local.score(&ids, 20).unwrap(), remote.score(&ids, 20).unwrap());
    assert_eq!(a, b, "prompt_logprobs through HTTP are the teacher's, to the bit");
    assert_eq!(a, sglang.score(&ids, 20).unwrap(), "and SGLang's input_top_logprobs");

    let params = GenerateParams {
        max_tokens: 8,
        temperature: 0.8,
        seed: 3,
        logprobs: 5,
        stop: vec![2],
        ..Default::default()
    };
    let want = local.generate(&ids, &params).unwrap();
    assert_eq!(want, remote.generate(&ids, &params).unwrap());
    assert_eq!(want, sglang.generate(&ids, &params).unwrap());

    // OpenAI legacy echo: the prompt's logprobs come back with the first one null.
    let body = json!({"prompt": "Hello world, hello", "echo": true, "logprobs": 3, "max_tokens": 0});
    let (status, v) = raw(&server.url, "POST", "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{v}");
    let lps = v["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap();
    assert!(lps[0].is_null() && lps[1..].iter().all(Value::is_f64));
    assert_eq!(v["choices"][0]["text"], "Hello world, hello");

    // Chat with logprobs.
    let body = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (status, v) = raw(&server.url, "POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["content"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 2);

    // Bad requests: OpenAI-style errors, and the server is still there afterwards.
    let cases = [
        ("POST", "/v1/completions", "{not json", 400, "invalid JSON"),
        ("POST", "/v1/completions", r#"{"prompt": [1, 99999999], "max_tokens": 1}"#, 400, "outside the teacher's vocabulary"),
        ("POST", "/v1/completions", r#"{"prompt": "x", "logprobs": 5000}"#, 400, "exceeds the maximum"),
        ("POST", "/v1/completions", r#"{"prompt": 7}"#, 400, "must be a string or a list of token ids"),
        ("POST", "/v1/chat/completions", r#"{"messages": [{"role": "robot", "content": "x"}]}"#, 400, "messages"),
        ("GET", "/v1/completions", "", 405, "not allowed"),
        ("GET", "/nope", "", 404, "no route"),
    ];
    for (method, path, body, want, text) in cases {
        let (status, v) = raw(&server.url, method, path, body);
        assert_eq!(status, want, "{path} {body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(text), "{message}");
        assert_eq!(v["error"]["code"], want);
    }
    assert_eq!(raw(&server.url, "GET", "/health", "").0, 200);
}
