//! `k3mini agent serve` between a real client and a real remote (`k3mini teacher serve` running
//! SmolLM2-135M-Instruct) on loopback: the verify cascade answers exactly what the teacher answers
//! greedily, whether the student drafts well (SmolLM2 itself) or badly (a random student with the
//! teacher's vocabulary); streaming gives the same text; every answer's cost is its usage at the
//! policy's prices; a remote that answers garbage, stalls or dies gives a marked local answer or
//! a clear error, never a hang.
use crate::export::checkpoint_with;
use crate::fixture::{Scratch, k3mini_ok};
use crate::teacher_server::{Server, listen, raw, serve};
use k3mini::agent::cost::Prices;
use k3mini::agent::policy::Policy;
use k3mini::agent::student::Student;
use k3mini::agent::{Agent, AnsweredBy, Ask};
use k3mini::export::export_gguf;
use k3mini::run_dir::open_checkpoint;
use k3mini_gguf::mix::FileType;
use k3mini_http::{Limits, Reply, transport};
use k3mini_teacher::{GenerateParams, TeacherError, fetch};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::{Duration, Instant};

fn smollm2() -> PathBuf {
    fetch::fetch(
        "smollm2",
        fetch::Kind::Teacher,
        &fetch::cache_dir(),
        &mut |_| {},
    )
    .unwrap()
}

/// A freshly initialised tiny student with SmolLM2's tokenizer, as a GGUF.
fn random_student(scratch: &Scratch) -> PathBuf {
    let run = scratch.path("student");
    checkpoint_with(
        &run,
        "preset = \"tiny\"\nvocab_size = 49152\nd_model = 64",
        "teacher",
    );
    let path = scratch.path("random.gguf");
    export_gguf(&open_checkpoint(&run).unwrap(), FileType::F32, None, &path).unwrap();
    path
}

fn agent(local: &str, remote: &str, policy: &str, extra: &[&str]) -> Server {
    let mut args = vec![
        "agent", "serve", "--local", local, "--remote", remote, "--policy", policy, "--port", "0",
    ];
    args.extend(extra);
    listen(&args, &[])
}

/// One raw HTTP/1.1 exchange: status and body text.
fn exchange(url: &str, path: &str, body: &Value) -> (u16, String) {
    exchange_as(url, path, body, None)
}

/// [`exchange`] with `Authorization: Bearer KEY`.
fn exchange_as(url: &str, path: &str, body: &Value, key: Option<&str>) -> (u16, String) {
    let addr = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let body = body.to_string();
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    // A stream arrives chunked: undo the framing.
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let (mut out, mut rest) = (String::new(), body);
        while let Some((size, tail)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        return (status, out);
    }
    (status, body.to_string())
}

fn post(url: &str, path: &str, body: &Value) -> (u16, Value) {
    post_as(url, path, body, None)
}

fn post_as(url: &str, path: &str, body: &Value, key: Option<&str>) -> (u16, Value) {
    let (status, text) = exchange_as(url, path, body, key);
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

fn chat(question: &str) -> Value {
    json!({"messages": [{"role": "user", "content": question}], "max_tokens": 24,
           "temperature": 0})
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

fn near(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 + 1e-9 * b.abs()
}

/// The cost fields of a report are its usage at `prices`, as `cost.rs` defines them.
fn check_cost(k: &Value, prices: &Prices) {
    let u = &k["usage"];
    let n = |key: &str| u[key].as_u64().unwrap();
    let c = &k["cost"];
    let usd = |key: &str| c[key].as_f64().unwrap();
    let hit = prices.cached_input_per_mtok.unwrap();
    let remote = ((n("remote_input") - n("remote_cached")) as f64 * prices.input_per_mtok
        + n("remote_cached") as f64 * hit
        + n("remote_output") as f64 * prices.output_per_mtok)
        / 1e6;
    let all = (n("prompt_tokens") as f64 * prices.input_per_mtok
        + n("completion_tokens") as f64 * prices.output_per_mtok)
        / 1e6;
    let local = u["local_seconds"].as_f64().unwrap()
        * (prices.hardware_per_hour + prices.watts * prices.per_kwh / 1000.0)
        / 3600.0;
    assert!(near(usd("remote_usd"), remote), "{k}");
    assert!(near(usd("all_remote_usd"), all), "{k}");
    assert!(near(usd("local_usd"), local), "{k}");
    assert!(near(usd("total_usd"), local + remote), "{k}");
}

/// The data events of a stream, up to `[DONE]` (which must end it).
fn events(text: &str) -> Vec<Value> {
    let data: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("{e:?}")))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Four servers (teacher, two gateways) and ~12 chat answers of 24 tokens on 2 cores: most of
/// the time is the random student's one-token rounds, so two questions (one streamed too).
#[test]
fn verify_answers_exactly_the_teachers_greedy_output() {
    let scratch = Scratch::new("agent-verify");
    let teacher = serve("smollm2", &[]);
    let (good, bad) = (smollm2(), random_student(&scratch));
    // Never handed over, so every token comes through drafting and verification.
    let policy = scratch.write(
        "cascade.toml",
        "route = \"all\"\nescalate_by = \"verify\"\n[verify]\nmin_acceptance = 0.0\n\
         [cost]\ncached_input_per_mtok = 0.15\n",
    );
    let prices = Prices {
        cached_input_per_mtok: Some(0.15),
        ..Prices::default()
    };
    let policy = policy.to_str().unwrap();
    let strong = agent(good.to_str().unwrap(), &teacher.url, policy, &[]);
    let weak = agent(bad.to_str().unwrap(), &teacher.url, policy, &[]);
    let questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
    ];
    let (mut strong_rate, mut weak_rate) = ((0, 0), (0, 0));
    for q in questions {
        let (status, want) = raw(
            &teacher.url,
            "POST",
            "/v1/chat/completions",
            &chat(q).to_string(),
        );
        assert_eq!(status, 200, "{want}");
        for (gateway, rate) in [(&strong, &mut strong_rate), (&weak, &mut weak_rate)] {
            let (status, got) = post(&gateway.url, "/v1/chat/completions", &chat(q));
            assert_eq!(status, 200, "{got}");
            assert_eq!(content(&got), content(&want), "{q}: {got}");
            assert_eq!(
                got["choices"][0]["finish_reason"],
                want["choices"][0]["finish_reason"]
            );
            assert_eq!(
                got["usage"]["completion_tokens"],
                want["usage"]["completion_tokens"]
            );
            let k = &got["k3mini"];
            assert_eq!(k["answered_by"], "cascade", "{k}");
            assert_eq!(k["escalated"], true);
            assert_eq!(k["policy"], "cascade");
            assert_eq!(k["verify"]["rounds"], k["usage"]["remote_calls"]);
            check_cost(k, &prices);
            // Every round after the first re-sends the context, which the remote has cached.
            let (calls, cached) = (
                k["usage"]["remote_calls"].as_u64().unwrap(),
                k["usage"]["remote_cached"].as_u64().unwrap(),
            );
            assert_eq!(cached > 0, calls > 1, "{k}");
            rate.0 += k["verify"]["accepted"].as_u64().unwrap();
            rate.1 += k["verify"]["drafted"].as_u64().unwrap();
        }
    }
    // SmolLM2 drafting for itself is accepted almost whole; the random student almost never.
    assert!(strong_rate.0 * 10 >= strong_rate.1 * 8, "{strong_rate:?}");
    assert!(weak_rate.0 * 10 <= weak_rate.1, "{weak_rate:?}");

    // Streamed, the same text arrives in pieces, and the last event carries the report.
    let mut request = chat(questions[1]);
    request["stream"] = json!(true);
    let (status, text) = exchange(&weak.url, "/v1/chat/completions", &request);
    assert_eq!(status, 200, "{text}");
    let events = events(&text);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    let (_, whole) = post(&weak.url, "/v1/chat/completions", &chat(questions[1]));
    assert_eq!(streamed, content(&whole));
    assert!(events.len() > 3, "a cascade streams round by round: {text}");
    let last = events.last().unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string());
    assert_eq!(last["k3mini"]["answered_by"], "cascade");
    assert_eq!(last["usage"], whole["usage"]);

    // Completions, from text, under the built-in verify policy.
    let builtin = agent(good.to_str().unwrap(), &teacher.url, "verify", &[]);
    let request = json!({"prompt": "The three primary colours are", "max_tokens": 16,
                         "temperature": 0});
    let (_, want) = raw(
        &teacher.url,
        "POST",
        "/v1/completions",
        &request.to_string(),
    );
    let (status, got) = post(&builtin.url, "/v1/completions", &request);
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        got["choices"][0]["text"], want["choices"][0]["text"],
        "{got}"
    );
    assert_eq!(got["k3mini"]["policy"], "verify");
    // Fields the gateway does not serve are refused, naming the field.
    let (status, e) = post(
        &builtin.url,
        "/v1/completions",
        &json!({"prompt": "Hi", "logprobs": 3}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("logprobs")),
        "{e}"
    );
}

/// A remote in-process that answers what the gateway's start-up asks (its model, and the probe's
/// tokenization as the student's), then, by `mode`: 0 garbage, 1 a stall of 120 s.
fn fake_remote(probe: Vec<u64>, mode: Arc<AtomicU8>, stop: Arc<AtomicBool>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        transport::serve(listener, Limits::default(), &stop.clone(), move |r, _| {
            let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            match r.path.as_str() {
                "/v1/models" => {
                    Reply::json(200, &json!({"object": "list", "data": [{"id": "fake"}]}))
                }
                _ if body["prompt"].is_string() => Reply::json(
                    200,
                    &json!({"choices": [{"text": "", "prompt_token_ids": probe}]}),
                ),
                _ if mode.load(Ordering::SeqCst) == 0 => Reply {
                    status: 200,
                    body: b"<html>not json".to_vec(),
                    retry_after: None,
                    events: None,
                    held: None,
                },
                _ => {
                    std::thread::sleep(Duration::from_secs(120));
                    Reply::json(200, &json!({}))
                }
            }
        })
        .unwrap();
    });
    url
}

/// Each fault answers within the 2 s remote timeout plus the student's own work: far below the
/// 120 s stall (60 s allows for a loaded machine, where llama.cpp's threads wait on each other).
#[test]
fn a_failing_remote_gives_a_marked_local_answer_or_a_clear_error_never_a_hang() {
    let scratch = Scratch::new("agent-faults");
    let student = random_student(&scratch);
    let tokenizer = k3mini::teachers::gguf_tokenizer(&student).unwrap();
    let probe = tokenizer
        .encode(k3mini_teacher::PROBE)
        .unwrap()
        .iter()
        .map(|&i| i as u64)
        .collect();
    let (mode, stop) = (Arc::new(AtomicU8::new(0)), Arc::new(AtomicBool::new(false)));
    let remote = fake_remote(probe, mode.clone(), stop.clone());
    let fast = ["--remote-timeout", "2", "--remote-retries", "0"];
    let student = student.to_str().unwrap();
    let lenient = agent(student, &remote, "verify", &fast);
    let strict_policy = scratch.write(
        "strict.toml",
        "route = \"all\"\non_remote_error = \"error\"\n",
    );
    let strict = agent(student, &remote, strict_policy.to_str().unwrap(), &fast);
    // A bench against a failing remote stops naming it, and caches nothing as its answer.
    let tasks = scratch.write("tasks.jsonl", "{\"text\": \"Hello\"}\n");
    let runs = scratch.path("runs");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args([
            "agent", "bench", "--local", student, "--remote", &remote, "--quiet",
        ])
        .args([
            "--tasks",
            tasks.to_str().unwrap(),
            "--runs",
            runs.to_str().unwrap(),
        ])
        .args(fast)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("(remote)"), "{err}");
    assert!(!runs.join("runs.jsonl").exists());
    for (m, what) in [(0u8, "garbage"), (1, "a stall"), (2, "a dead remote")] {
        mode.store(m, Ordering::SeqCst);
        if m == 2 {
            stop.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(500));
        }
        let t0 = Instant::now();
        let (status, got) = post(&lenient.url, "/v1/chat/completions", &chat("Hello?"));
        assert_eq!(status, 200, "{what}: {got}");
        let k = &got["k3mini"];
        assert_eq!(k["answered_by"], "local", "{what}: {k}");
        assert!(
            k["remote_error"].as_str().is_some_and(|e| !e.is_empty()),
            "{what}: {k}"
        );
        assert!(
            got["usage"]["completion_tokens"].as_u64().unwrap() > 0,
            "{what}: {got}"
        );
        let (status, e) = post(&strict.url, "/v1/chat/completions", &chat("Hello?"));
        assert_eq!(status, 502, "{what}: {e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("the remote"),
            "{what}: {e}"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{what} took {:?}",
            t0.elapsed()
        );
    }
}

/// A remote in-process that writes `ids` to every generation (unless it `fail`s) and counts its
/// calls; its scoring fails.
struct Scripted {
    calls: std::sync::atomic::AtomicUsize,
    fail: bool,
    ids: Vec<u32>,
}

impl k3mini_teacher::Teacher for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn vocab_size(&self) -> usize {
        49152
    }
    fn score(&self, _: &[u32], _: usize) -> Result<k3mini_teacher::Scored, TeacherError> {
        Err(TeacherError::Server("scoring is not scripted".into()))
    }
    fn generate(
        &self,
        _: &[u32],
        p: &GenerateParams,
    ) -> Result<k3mini_teacher::Generation, TeacherError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.fail {
            return Err(TeacherError::Server("the scripted remote is down".into()));
        }
        Ok(k3mini_teacher::Generation {
            ids: self.ids.clone(),
            logprobs: vec![-0.1; self.ids.len()],
            k: 0,
            top_ids: vec![],
            top_logprobs: vec![],
            finish: k3mini::agent::finish_of(&self.ids, &p.stop),
        })
    }
}

#[test]
fn confidence_and_budget_decide_who_answers() {
    let scratch = Scratch::new("agent-policy");
    let path = random_student(&scratch);
    let open = || {
        Student::new(
            k3mini::teachers::open_local(&path, Default::default(), &Default::default()).unwrap(),
        )
    };
    let gateway = |policy: &str, fail: bool| {
        Agent::new(
            open(),
            Box::new(Scripted {
                calls: Default::default(),
                fail,
                ids: vec![7, 8, 9],
            }),
            1,
            Policy::parse(policy, "test").unwrap(),
        )
    };
    let ask = Ask {
        prompt: vec![1, 9906, 28, 2],
        params: GenerateParams {
            max_tokens: 6,
            ..Default::default()
        },
        stop_text: Vec::new(),
        gate: None,
        parts: None,
    };
    let answer = |a: &Agent| a.answer(&ask, Default::default(), &mut |_| {}).unwrap();

    // A random student's mean logprob is near −ln(49152) ≈ −10.8: a threshold of −20 keeps
    // every answer local, one of −1 sends every answer to the remote.
    let local = gateway(
        "route = \"confidence\"\nescalate_by = \"remote\"\n[confidence]\nmin_mean_logprob = -20.0",
        false,
    );
    let a = answer(&local);
    assert_eq!(a.report.answered_by, AnsweredBy::Local);
    assert!(!a.report.escalated);
    assert_eq!(a.ids.len(), 6);
    let s = a.report.signals.unwrap();
    assert!(s.mean_logprob < -5.0 && s.entropy_p50 > 5.0, "{s:?}");
    assert_eq!(a.report.usage.spent.remote_calls, 0);
    assert_eq!(a.report.cost.remote_usd, 0.0);

    let unsure = "route = \"confidence\"\nescalate_by = \"remote\"\n[confidence]\n\
                  min_mean_logprob = -1.0";
    let remote = gateway(unsure, false);
    let a = answer(&remote);
    assert_eq!(
        (a.report.answered_by, a.ids.clone()),
        (AnsweredBy::Remote, vec![7, 8, 9])
    );
    assert!(
        a.report
            .reason
            .as_deref()
            .unwrap()
            .starts_with("mean_logprob"),
        "{:?}",
        a.report
    );
    // The remote read the prompt and wrote three tokens; the student wrote six first.
    let u = a.report.usage.spent;
    assert_eq!((u.remote_input, u.remote_output, u.remote_calls), (4, 3, 1));
    assert_eq!(
        (
            u.local_read,
            u.local_written,
            a.report.usage.completion_tokens
        ),
        (4, 6, 3)
    );

    // At most half the requests may escalate: of four, the second and fourth stay local.
    let capped = gateway(
        &format!("{unsure}\n[budget]\nmax_escalation_share = 0.5"),
        false,
    );
    let who: Vec<AnsweredBy> = (0..4).map(|_| answer(&capped).report.answered_by).collect();
    use AnsweredBy::{Local, Remote};
    assert_eq!(who, [Local, Remote, Local, Remote]);
    let a = answer(&gateway(
        &format!("{unsure}\n[budget]\nmax_usd_per_request = 1e-9"),
        false,
    ));
    assert_eq!(a.report.answered_by, Local);
    assert!(a.report.reason.unwrap().contains("cap"));

    // A remote that fails: the student's answer, marked; or the error, as the policy says.
    let a = answer(&gateway(unsure, true));
    assert_eq!((a.report.answered_by, a.ids.len()), (Local, 6));
    assert!(a.report.remote_error.unwrap().contains("down"));
    // The failed call (it may have timed out after billing) is booked at its worst case: each
    // of the client's attempts reading the 4-token prompt and writing all 6 tokens.
    let mut flaky = gateway(
        &format!(
            "{unsure}\n[budget]\nmax_usd_per_day = 1.0\n[cost]\ninput_per_mtok = 50000.0\noutput_per_mtok = 50000.0"
        ),
        true,
    );
    flaky.remote_attempts = 2;
    let a = answer(&flaky);
    let u = a.report.usage.spent;
    assert_eq!(
        (
            u.remote_failed,
            u.remote_calls,
            u.remote_input,
            u.remote_output
        ),
        (2, 2, 8, 12)
    );
    assert!(
        (a.report.cost.remote_usd - 20.0 * 0.05).abs() < 1e-9,
        "{:?}",
        a.report.cost
    );
    // $1.00 booked of the day's $1.00: the next escalation is refused before it is made.
    let a = answer(&flaky);
    assert_eq!(a.report.answered_by, Local);
    assert!(a.report.reason.unwrap().contains("daily cap"));
    let strict = gateway(&format!("on_remote_error = \"error\"\n{unsure}"), true);
    let e = strict
        .answer(&ask, Default::default(), &mut |_| {})
        .err()
        .unwrap();
    assert!(e.to_string().contains("down"), "{e}");
}

/// `agent bench` and `agent calibrate` through the real binary: SmolLM2 as its own student
/// against itself behind `teacher serve`, so the cascade must equal the remote on every task and
/// the remote writes only its corrections; the second command reuses the cached answers, a
/// corrupt cache is named, and the calibrated policy is refused for another student's GGUF.
#[test]
fn bench_and_calibrate_measure_once_replay_and_tie_the_policy_to_its_student() {
    use k3mini::agent::bench::Bench;
    let scratch = Scratch::new("agent-bench");
    let teacher = serve("smollm2", &[]);
    let tasks = scratch.write(
        "tasks.jsonl",
        "{\"id\": \"fox\", \"text\": \"The quick brown fox\"}\n\
         {\"text\": \"Once upon a time, in a land far away,\"}\n\
         {\"id\": \"sum\", \"prompt\": \"What is 2 + 3? Answer with a number.\", \"answer\": 5}\n\
         {\"text\": \"Water boils at\"}\n\
         {\"id\": \"add\", \"text\": \"def add(a, b):\\n    \\\"\\\"\\\"Return the sum of a and b.\\\"\\\"\\\"\\n\", \
         \"tests\": \"def check(candidate):\\n    assert candidate(2, 3) == 5\\n\", \
         \"entry_point\": \"add\", \"max_tokens\": 16}\n",
    );
    let bench = scratch.write(
        "bench.toml",
        "max_tokens = 12\n[cost]\noutput_per_mtok = 10.0\n",
    );
    let (runs, out) = (scratch.path("runs"), scratch.path("report"));
    let local = smollm2();
    let sides = |cmd: &str| -> Vec<String> {
        [
            "agent",
            cmd,
            "--local",
            local.to_str().unwrap(),
            "--remote",
            &teacher.url,
            "--tasks",
            tasks.to_str().unwrap(),
            "--bench",
            bench.to_str().unwrap(),
            "--runs",
            runs.to_str().unwrap(),
            "--quiet",
            "--run-tests",
        ]
        .map(String::from)
        .to_vec()
    };
    // A code task runs model-written Python: only when asked to.
    let mut unasked = sides("bench");
    unasked.pop();
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(&unasked)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("task add carries tests"),
        "{err}"
    );
    let mut args = sides("bench");
    args.extend(["--out".into(), out.to_str().unwrap().into()]);
    let printed = String::from_utf8(k3mini_ok(&args).stdout).unwrap();
    assert!(printed.contains("| all-remote | 100% |"), "{printed}");
    let b: Bench =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!((b.tasks, b.settings.max_tokens), (5, 12));
    assert_eq!(b.verify.equal, 1.0, "{b:?}");
    assert!(
        b.verify.acceptance.unwrap() >= 0.8 && b.verify.output_saved.unwrap() >= 0.5,
        "{:?}",
        b.verify
    );
    let names: Vec<&str> = b.points.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        ["all-local", "all-remote", "verify", "oracle", "random"]
    );
    // Continuations are scored against the remote, which agrees with itself.
    assert!(b.points[1].quality >= 0.6);
    assert_eq!(b.sweeps.len(), 5);
    let svg = std::fs::read_to_string(out.join("pareto.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("confidence: mean_logprob"));
    let cache = std::fs::read_to_string(runs.join("runs.jsonl")).unwrap();
    assert_eq!(cache.lines().count(), 5);

    // Calibrating on the same tasks reads the cache: no task is answered again.
    let policy = scratch.path("calibrated.toml");
    let mut args = sides("calibrate");
    args.extend(["--max-share", "0.5", "--out", policy.to_str().unwrap()].map(String::from));
    let printed = String::from_utf8(k3mini_ok(&args).stdout).unwrap();
    assert!(printed.contains("escalate when"), "{printed}");
    assert_eq!(
        std::fs::read_to_string(runs.join("runs.jsonl")).unwrap(),
        cache
    );
    let p = Policy::resolve(policy.to_str().unwrap()).unwrap();
    let sha = k3mini_data::digest::sha256_file(&local).unwrap();
    assert_eq!(p.student_sha256.as_deref(), Some(sha.as_str()));
    assert_eq!(p.confidence.set().len(), 1);

    // The policy, with its thresholds for SmolLM2's signals, is refused for another student.
    let other = random_student(&scratch);
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args([
            "agent",
            "serve",
            "--local",
            other.to_str().unwrap(),
            "--remote",
            &teacher.url,
        ])
        .args(["--policy", policy.to_str().unwrap(), "--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("was calibrated for the student GGUF"),
        "{err}"
    );

    // A cache that does not read back is named, not trusted.
    std::fs::write(runs.join("runs.jsonl"), format!("{cache}{{\"key\": 1}}\n")).unwrap();
    let broken = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(sides("bench"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&broken.stderr);
    assert!(err.contains("runs.jsonl:6 is not a bench record"), "{err}");
}

/// `agent bench` on BFCL-format tasks (three from `bfcl-eval`'s data: simple, parallel,
/// irrelevance): each answer is scored by BFCL's AST check on the calls its reply makes, the
/// report adds the valid-call rate and the gate policy's point, and the figures are the ones the
/// cached runs give. The verify runs draft their whole answer in one round: with the default
/// rounds, re-reading a tools prompt of ~300 tokens, they took ~30 of the ~55 s it ran alone.
#[test]
fn agent_bench_scores_bfcl_tasks_by_their_calls() {
    use k3mini::agent::bench::{Bench, Record, read_tasks, rows};
    let scratch = Scratch::new("agent-bfcl");
    let teacher = serve("smollm2", &[]);
    let area = r#"{"type": "function", "function": {"name": "calculate_triangle_area", "description": "Calculate the area of a triangle given its base and height.", "parameters": {"type": "object", "properties": {"base": {"type": "integer", "description": "The base of the triangle."}, "height": {"type": "integer", "description": "The height of the triangle."}, "unit": {"type": "string", "description": "The unit of measure (defaults to 'units' if not specified)"}}, "required": ["base", "height"]}}}"#;
    let tasks = scratch.write(
        "bfcl.jsonl",
        &format!(
            "{{\"id\": \"simple_python_0\", \"messages\": [{{\"role\": \"user\", \"content\": \"Find the area of a triangle with a base of 10 units and height of 5 units.\"}}], \"tools\": [{area}], \"category\": \"simple\", \"calls\": [{{\"calculate_triangle_area\": {{\"base\": [10], \"height\": [5], \"unit\": [\"units\", \"\"]}}}}]}}\n\
             {{\"id\": \"parallel_x\", \"messages\": [{{\"role\": \"user\", \"content\": \"Find the areas of triangles with base 3, height 4 and base 6, height 8.\"}}], \"tools\": [{area}], \"category\": \"parallel\", \"calls\": [{{\"calculate_triangle_area\": {{\"base\": [3], \"height\": [4], \"unit\": [\"\"]}}}}, {{\"calculate_triangle_area\": {{\"base\": [6], \"height\": [8], \"unit\": [\"\"]}}}}]}}\n\
             {{\"id\": \"irrelevance_x\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"tools\": [{area}], \"category\": \"irrelevance\"}}\n"
        ),
    );
    let (runs, out) = (scratch.path("runs"), scratch.path("report"));
    let bench = scratch.write(
        "bench.toml",
        "max_tokens = 32\n[verify]\ndraft = 32\nmax_draft = 32\n",
    );
    let local = smollm2();
    let printed = String::from_utf8(
        k3mini_ok(&[
            "agent",
            "bench",
            "--local",
            local.to_str().unwrap(),
            "--remote",
            &teacher.url,
            "--tasks",
            tasks.to_str().unwrap(),
            "--bench",
            bench.to_str().unwrap(),
            "--runs",
            runs.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ])
        .stdout,
    )
    .unwrap();
    assert!(
        printed.contains("| calls made | valid calls |"),
        "{printed}"
    );
    let b: Bench =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let names: Vec<&str> = b.points.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "all-local",
            "all-remote",
            "verify",
            "oracle",
            "random",
            "gate"
        ]
    );
    // The figures are those of the cached runs, scored again here.
    let tasks = read_tasks(&tasks).unwrap();
    let cache = std::fs::read_to_string(runs.join("runs.jsonl")).unwrap();
    let mut records: Vec<Record> = cache
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    records.sort_by_key(|r| tasks.iter().position(|t| t.id == r.task));
    let scored = rows(&tasks, &records, &b.settings).unwrap();
    let share = |f: &dyn Fn(&k3mini::agent::bench::Row) -> bool| {
        scored.iter().filter(|r| f(r)).count() as f64 / 3.0
    };
    assert_eq!(b.points[0].accuracy, share(&|r| r.local.correct));
    assert_eq!(b.points[1].accuracy, share(&|r| r.remote.correct));
    use k3mini::agent::bench::Call;
    assert_eq!(
        b.points[0].calls_made,
        Some(share(&|r| r.local.call != Some(Call::None)))
    );
    let count =
        |c: &dyn Fn(Option<Call>) -> bool| scored.iter().filter(|r| c(r.local.call)).count();
    let tried = count(&|c| c != Some(Call::None));
    let valid = count(&|c| c == Some(Call::Valid));
    assert_eq!(
        b.points[0].valid_calls,
        (tried > 0).then(|| valid as f64 / tried as f64)
    );
    for (task, r) in tasks.iter().zip(&records) {
        // A reply that makes no call is right only where no call is relevant.
        let (category, _) = task.calls.as_ref().unwrap();
        if r.local.calls.as_ref().is_none_or(Vec::is_empty) {
            let right = *category == k3mini::agent::bfcl::Category::Irrelevance;
            let row = &scored[tasks.iter().position(|t| t.id == task.id).unwrap()];
            assert_eq!(row.local.correct, right, "{}: {}", task.id, r.local.text);
        }
    }
}

/// The gate through real servers: a chat that asks for JSON a schema accepts escalates when the
/// student's answer is not that JSON, naming why; a schema keyword the gate cannot check is
/// refused with the request; a teacher server, which cannot constrain its answers, refuses JSON
/// formats rather than ignore them.
#[test]
fn the_gate_escalates_answers_that_are_not_the_json_asked_for() {
    let teacher = serve("smollm2", &[]);
    let local = smollm2();
    let gateway = agent(local.to_str().unwrap(), &teacher.url, "gate", &[]);
    let ask = |format: Value| {
        let mut body = chat("Name the capital of France.");
        body["response_format"] = format;
        body
    };
    let schema = json!({"type": "json_schema", "json_schema": {"name": "city", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": false}}});
    let (status, got) = post(&gateway.url, "/v1/chat/completions", &ask(schema.clone()));
    assert_eq!(status, 200, "{got}");
    let k = &got["k3mini"];
    let reason = k["reason"].as_str().unwrap_or_default();
    // SmolLM2 answers in prose; had it written the JSON, the answer would have stayed local.
    let fails = k3mini::agent::gate::Gate::of(&serde_json::from_value(schema).unwrap())
        .unwrap()
        .unwrap()
        .fails(&content(&got), Default::default())
        .unwrap();
    match fails {
        _ if k["answered_by"] == "remote" => {
            assert!(reason.starts_with("gate: "), "{k}");
            assert_eq!(k["escalated"], true);
            // The remote's answer is judged as the student's was: a failing one says so.
            assert_eq!(
                k["gate_failure"].as_str(),
                fails.as_deref(),
                "the remote's answer: {k}"
            );
        }
        None => assert_eq!(k["answered_by"], "local", "{k}"),
        Some(why) => panic!("a local answer failing the gate ({why}) was not escalated: {k}"),
    }
    // Plain text asks for nothing: the gate passes it.
    let (status, got) = post(
        &gateway.url,
        "/v1/chat/completions",
        &ask(json!({"type": "text"})),
    );
    assert_eq!(
        (status, &got["k3mini"]["answered_by"]),
        (200, &json!("local")),
        "{got}"
    );
    let unchecked = json!({"type": "json_schema", "json_schema": {"schema": {
        "type": "text", "pattern": "^P"}}});
    let (status, got) = post(&gateway.url, "/v1/chat/completions", &ask(unchecked));
    assert_eq!(status, 400, "{got}");
    assert!(got.to_string().contains("not a JSON Schema"), "{got}");
    let (status, got) = post(
        &teacher.url,
        "/v1/chat/completions",
        &ask(json!({"type": "json_object"})),
    );
    assert_eq!(status, 400, "{got}");
    assert!(got.to_string().contains("response_format"), "{got}");

    // OpenAI's stop strings are honoured: the answer ends before the first.
    let mut stopped = chat("What is the capital of France?");
    let (_, plain) = post(
        &gateway.url,
        "/v1/chat/completions",
        &chat("What is the capital of France?"),
    );
    let plain = content(&plain);
    let stops = [" Paris".to_string(), ".".to_string()];
    let (at, _) = k3mini_teacher::stop::first_stop(&plain, &stops)
        .unwrap_or_else(|| panic!("the unstopped answer holds neither stop string: {plain:?}"));
    stopped["stop"] = json!(stops);
    let (status, got) = post(&gateway.url, "/v1/chat/completions", &stopped);
    assert_eq!(status, 200, "{got}");
    assert_eq!(content(&got), plain[..at], "{got}");
    assert_eq!(got["choices"][0]["finish_reason"], "stop", "{got}");
    // Streamed, the text held back while it might begin a stop string never passes it.
    stopped["stream"] = json!(true);
    let (status, text) = exchange(&gateway.url, "/v1/chat/completions", &stopped);
    assert_eq!(status, 200, "{text}");
    let streamed: String = events(&text)
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, plain[..at]);
    // Sampling fields the gateway cannot honour are refused by name, not ignored.
    for (field, value) in [
        ("presence_penalty", json!(0.5)),
        ("logit_bias", json!({"42": -100})),
        ("tool_choice", json!("auto")),
        ("k3mini_tests", json!({"tests": "", "entry_point": "f"})),
    ] {
        let mut body = chat("Hi");
        body[field] = value;
        let (status, got) = post(&gateway.url, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{field}: {got}");
        assert!(got.to_string().contains(field), "{got}");
    }
    // So are vLLM's extensions a teacher server answers and the gateway does not.
    for (field, value) in [
        ("return_token_ids", json!(true)),
        ("return_tokens_as_token_ids", json!(true)),
        ("routed_experts_prompt_start", json!(0)),
    ] {
        let mut body = json!({"prompt": "Hi", "max_tokens": 2});
        body[field] = value;
        let (status, got) = post(&gateway.url, "/v1/completions", &body);
        assert_eq!(status, 400, "{field}: {got}");
        assert!(got.to_string().contains(field), "{got}");
    }

    // Tests a completion carries: run only where the policy says so, and a failing completion
    // escalates (the random student cannot write `add`; SmolLM2 may).
    let scratch = Scratch::new("agent-gate-tests");
    let student = random_student(&scratch);
    let tests = json!({"tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
                       "entry_point": "add"});
    let body = json!({"prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
                      "max_tokens": 12, "temperature": 0, "k3mini_tests": tests});
    let (status, got) = post(&gateway.url, "/v1/completions", &body);
    assert_eq!(status, 400, "{got}");
    assert!(got.to_string().contains("run_tests = true"), "{got}");
    let runs = scratch.write(
        "tests.toml",
        "route = \"gate\"\nescalate_by = \"remote\"\n[gate]\nrun_tests = true\n",
    );
    let policy = runs.to_str().unwrap();
    // Clients' Python runs only behind a key (and in the sandbox).
    let local = student.to_str().unwrap();
    let serve = [
        "agent",
        "serve",
        "--local",
        local,
        "--remote",
        &teacher.url,
        "--policy",
        policy,
        "--port",
        "0",
    ];
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(serve)
        .env_remove("K3MINI_API_KEY")
        .output()
        .unwrap();
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && why.contains("API key"),
        "{why}"
    );
    let weak = listen(&serve, &[("K3MINI_API_KEY", "gate-key")]);
    let (status, got) = post(&weak.url, "/v1/completions", &body);
    assert_eq!(status, 401, "{got}");
    let (status, got) = post_as(&weak.url, "/v1/completions", &body, Some("gate-key"));
    assert_eq!(status, 200, "{got}");
    let k = &got["k3mini"];
    assert_eq!(k["answered_by"], "remote", "{k}");
    assert_eq!(
        k["reason"], "gate: the completion fails the request's tests",
        "{k}"
    );
    // A teacher server ignores the extension, as vLLM ignores fields it does not know.
    let (status, got) = post(&teacher.url, "/v1/completions", &body);
    assert_eq!(status, 200, "{got}");
    // A teacher server parses no tool calls: refused, not ignored.
    let mut with_tools = chat("What is the weather?");
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "weather"}}]);
    let (status, got) = post(&teacher.url, "/v1/chat/completions", &with_tools);
    assert_eq!(status, 400, "{got}");
    assert!(got.to_string().contains("tools"), "{got}");
}

/// `agent serve` in-process with `remote`, under `policy`: its URL and the flag that stops it.
fn serve_agent(
    student: &std::path::Path,
    remote: Box<dyn k3mini_teacher::Teacher + Send + Sync>,
    policy: &str,
) -> (String, Arc<AtomicBool>) {
    let local =
        k3mini::teachers::open_local(student, Default::default(), &Default::default()).unwrap();
    let agent = Agent::new(
        Student::new(local),
        remote,
        1,
        Policy::parse(policy, "test").unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let flag = stop.clone();
    std::thread::spawn(move || {
        k3mini::agent::server::serve(agent, "127.0.0.1:0", Default::default(), flag, |a| {
            tx.send(a).unwrap()
        })
        .unwrap()
    });
    (format!("http://{}", rx.recv().unwrap()), stop)
}

/// Tools at the gateway: the random student writes no call where one is required, so the gate
/// escalates and the remote's call comes back in OpenAI's shape (streamed only once judged); a
/// kept answer that fails says why; what cannot be checked is refused. Each way a call fails
/// the gate is `k3mini_agent::gate`'s unit tests'.
#[test]
fn tool_calls_pass_the_gate_or_escalate_and_come_back_in_openais_shape() {
    let scratch = Scratch::new("agent-tools");
    let student = random_student(&scratch);
    let tokenizer = k3mini::teachers::gguf_tokenizer(&student).unwrap();
    let writes = |text: &str| {
        Box::new(Scripted {
            calls: Default::default(),
            fail: false,
            ids: tokenizer.encode_with_specials(text).unwrap(),
        })
    };
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call><|im_end|>";
    let gate = "route = \"gate\"\nescalate_by = \"remote\"\n";
    let (url, stop) = serve_agent(&student, writes(call), gate);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather now.", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let mut body = json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 8, "temperature": 0, "tools": tools, "tool_choice": "required"});
    let (status, got) = post(&url, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{got}");
    let k = &got["k3mini"];
    assert_eq!(k["answered_by"], "remote", "{k}");
    assert_eq!(
        k["reason"], "gate: tool_choice is \"required\" and the answer calls no tool",
        "{k}"
    );
    assert!(k["gate_failure"].is_null(), "{k}");
    let choice = &got["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{got}");
    let message = &choice["message"];
    assert!(message["content"].is_null(), "{message}");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{message}");
    assert_eq!(calls[0]["type"], "function");
    assert!(
        calls[0]["id"]
            .as_str()
            .unwrap()
            .starts_with("call-chatcmpl-")
    );
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Oslo"}));

    // Streamed: the role, then the call whole, then the finish; no text before the call.
    body["stream"] = json!(true);
    let (status, text) = exchange(&url, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{text}");
    let events = events(&text);
    let deltas: Vec<&Value> = events.iter().map(|e| &e["choices"][0]["delta"]).collect();
    assert_eq!(deltas[0]["role"], "assistant", "{text}");
    let streamed: Vec<&Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(streamed.len(), 1, "{text}");
    assert_eq!(streamed[0]["index"], 0);
    assert_eq!(streamed[0]["function"], calls[0]["function"]);
    assert!(deltas.iter().all(|d| d["content"].is_null()), "{text}");
    let last = events.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{text}");
    assert_eq!(last["k3mini"]["answered_by"], "remote");

    // Requests the gate cannot check are refused, naming the field.
    for (field, value, param, why) in [
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "now"}}),
            "tool_choice",
            "do not declare",
        ),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f",
            "parameters": {"type": "obj"}}}]),
            "tools[0]",
            "not a JSON Schema",
        ),
        (
            "response_format",
            json!({"type": "json_object"}),
            "response_format",
            "tool calls",
        ),
    ] {
        let mut bad = body.clone();
        bad[field] = value;
        bad["stream"] = json!(false);
        let (status, got) = post(&url, "/v1/chat/completions", &bad);
        assert_eq!(
            (status, got["error"]["param"].as_str()),
            (400, Some(param)),
            "{got}"
        );
        assert!(got.to_string().contains(why), "{got}");
    }
    let (status, got) = post(
        &url,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "auto"}),
    );
    assert_eq!(status, 400, "{got}");
    assert!(got.to_string().contains("goes with `tools`"), "{got}");
    stop.store(true, Ordering::SeqCst);

    // Escalated, the remote's call to a tool not declared is returned, and the report says why
    // it fails the gate.
    let unknown = call.replace("get_weather", "get_wether");
    let (url, stop) = serve_agent(&student, writes(&unknown), gate);
    body["stream"] = json!(false);
    let (status, got) = post(&url, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{got}");
    let failure = got["k3mini"]["gate_failure"].as_str().unwrap_or_default();
    assert!(
        failure.contains("names `get_wether`, which is not one"),
        "{got}"
    );
    stop.store(true, Ordering::SeqCst);

    // A local-only policy reads the student's reply and says why it fails: nothing escalates.
    let (url, stop) = serve_agent(&student, writes(call), "route = \"none\"\n");
    let (status, got) = post(&url, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{got}");
    let k = &got["k3mini"];
    assert_eq!(
        (&k["answered_by"], &k["escalated"]),
        (&json!("local"), &json!(false)),
        "{k}"
    );
    let failure = k["gate_failure"].as_str().unwrap_or_default();
    assert!(failure.starts_with("gate: "), "{k}");
    stop.store(true, Ordering::SeqCst);
}

/// Constrained decoding: under `[gate] constrain_calls`, the same random student that writes no
/// call unconstrained answers `required` with a call of the declared tool whose arguments match
/// its schema, which passes the gate, so nothing escalates.
#[test]
fn constrained_calls_pass_the_gate_by_construction() {
    let scratch = Scratch::new("agent-constrained");
    let student = random_student(&scratch);
    let tokenizer = k3mini::teachers::gguf_tokenizer(&student).unwrap();
    let remote = || {
        Box::new(Scripted {
            calls: Default::default(),
            fail: false,
            ids: tokenizer.encode_with_specials("Remote.<|im_end|>").unwrap(),
        })
    };
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": false}}}]);
    let body = json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 160, "temperature": 0, "tools": tools, "tool_choice": "required",
        "parallel_tool_calls": false});
    let gate = "route = \"gate\"\nescalate_by = \"remote\"\n";
    for (constrained, answered_by) in [(false, "remote"), (true, "local")] {
        let policy = format!("{gate}[gate]\nconstrain_calls = {constrained}\n");
        let (url, stop) = serve_agent(&student, remote(), &policy);
        let (status, got) = post(&url, "/v1/chat/completions", &body);
        stop.store(true, Ordering::SeqCst);
        assert_eq!(status, 200, "{got}");
        assert_eq!(got["k3mini"]["answered_by"], answered_by, "{got}");
        if !constrained {
            continue;
        }
        let choice = &got["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{got}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{got}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(
            ["Oslo", "Lima"].contains(&args["city"].as_str().unwrap()),
            "{args}"
        );
        assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
    }
}

/// The learning loop end to end: a gateway escalating every request writes each one, scored
/// once more by the remote, as a teacher-signal shard; `k3mini train` with `distill.mode =
/// "traffic"` reads them back (cut into its 16-token segments) and trains from the student's
/// checkpoint; a directory of another top-k is refused rather than mixed.
#[test]
fn escalations_become_shards_the_next_student_trains_on() {
    let scratch = Scratch::new("agent-traffic");
    let teacher = serve("smollm2", &[]);
    let student = random_student(&scratch);
    let traffic = scratch.path("traffic");
    let dir = traffic.to_str().unwrap();
    let gateway = agent(
        student.to_str().unwrap(),
        &teacher.url,
        "remote",
        &["--traffic", dir],
    );
    for (i, q) in ["What is the capital of France?", "Name a colour."]
        .iter()
        .enumerate()
    {
        let (status, got) = post(&gateway.url, "/v1/chat/completions", &chat(q));
        assert_eq!(status, 200, "{got}");
        assert_eq!(
            got["k3mini"]["traffic"]["shard"],
            format!("shard-{i:05}.parquet"),
            "{got}"
        );
        // The scoring call is booked: two remote calls, the prompt a cache hit.
        assert_eq!(got["k3mini"]["usage"]["remote_calls"], 2, "{got}");
    }
    let body = json!({"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0});
    let (status, got) = post(&gateway.url, "/v1/completions", &body);
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        got["k3mini"]["traffic"]["shard"], "shard-00002.parquet",
        "{got}"
    );
    // Streamed, its last event names the shard.
    let mut streamed = chat("Name a fruit.");
    streamed["stream"] = json!(true);
    let (status, text) = exchange(&gateway.url, "/v1/chat/completions", &streamed);
    assert_eq!(status, 200, "{text}");
    let last = events(&text).pop().unwrap();
    assert_eq!(
        last["k3mini"]["traffic"]["shard"], "shard-00003.parquet",
        "{text}"
    );
    // Each shard's journal line is written once its answer is sent: soon after it arrives.
    let listed = |n: usize| {
        let t0 = Instant::now();
        loop {
            let m = k3mini_teacher::manifest::read_traffic(&traffic)
                .unwrap()
                .unwrap();
            if m.shards.len() >= n || t0.elapsed() > Duration::from_secs(10) {
                return m;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let manifest = listed(4);
    drop(gateway);
    assert_eq!(manifest.job.kind, "traffic");
    assert_eq!(manifest.shards.len(), 4);
    let first =
        k3mini_data::shards::read_shard(&traffic.join("shard-00000.parquet"), None).unwrap();
    let row = &first.rows[0];
    let parts = row.parts.as_ref().expect("a chat keeps its parts");
    let answer = parts
        .iter()
        .filter(|p| **p == k3mini_data::chat::Part::Answer)
        .count();
    assert!(answer > 0 && answer < parts.len(), "{parts:?}");
    // The answer's closing stop id trains too: the next student must learn to stop.
    assert_eq!(
        parts.last(),
        Some(&k3mini_data::chat::Part::Answer),
        "{parts:?}"
    );
    assert_eq!(row.positions(), row.input_ids.len() - 1);

    // The next student: the current one's checkpoint, trained on the traffic alone.
    std::fs::write(
        scratch.path("unused.txt"),
        "The corpus a traffic run does not read.",
    )
    .unwrap();
    let recipe = scratch.write(
        "next.toml",
        &format!(
            "[run]\nname = \"next\"\nseed = 3\nout_dir = {:?}\n[model]\npreset = \"tiny\"\n\
             vocab_size = 49152\nd_model = 64\n[data]\ntokenizer = \"teacher\"\nseq_len = 16\n\
             held_out_fraction = 0.0\n[[data.sources]]\npath = \"unused.txt\"\n[teacher]\n\
             model = \"smollm2\"\nk = 4\n[distill]\nmode = \"traffic\"\ntraffic = {dir:?}\n\
             objectives = [{{ kind = \"forward_kl\", weight = 0.5 }}, {{ kind = \"ce\", weight = 0.5 }}]\n\
             [optim]\nlr = 3e-3\n[schedule]\nkind = \"constant\"\nwarmup_steps = 0\n[train]\n\
             steps = 3\nbatch_tokens = 64\nmicro_batch = 2\neval_every = 3\neval_batches = 0\ncheckpoint_every = 3\n",
            scratch.path("next").display().to_string()
        ),
    );
    k3mini_ok([
        "train",
        recipe.to_str().unwrap(),
        "--init",
        scratch.path("student").to_str().unwrap(),
        "--quiet",
    ]);
    let metrics = std::fs::read_to_string(scratch.path("next").join("metrics.jsonl")).unwrap();
    let steps: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|m| m.get("loss").is_some())
        .collect();
    assert_eq!(steps.len(), 3, "{metrics}");
    assert!(
        steps
            .iter()
            .all(|m| m["loss"].as_f64().unwrap().is_finite()),
        "{metrics}"
    );

    // Traffic escalated after the run's plan was made belongs to a later run: a resume keeps
    // the four shards its checkpoint pinned (no plan change), while a fresh plan takes five.
    let gateway = agent(
        student.to_str().unwrap(),
        &teacher.url,
        "remote",
        &["--traffic", dir],
    );
    let (status, got) = post(&gateway.url, "/v1/completions", &body);
    let shard = &got["k3mini"]["traffic"]["shard"];
    assert_eq!(
        (status, shard),
        (200, &json!("shard-00004.parquet")),
        "{got}"
    );
    assert_eq!(listed(5).shards.len(), 5);
    drop(gateway);
    let init = scratch.path("student");
    let resumed = k3mini_ok([
        "train",
        recipe.to_str().unwrap(),
        "--init",
        init.to_str().unwrap(),
        "--resume",
        "--quiet",
    ]);
    let err = String::from_utf8_lossy(&resumed.stderr);
    assert!(!err.contains("changed plan"), "{err}");
    let shards = |p: &k3mini::recipe::RunPlan| match &p.distill.as_ref().unwrap().mode {
        k3mini::recipe::ModePlan::Traffic { shards, .. } => *shards,
        m => panic!("{m:?}"),
    };
    assert_eq!(shards(&k3mini::recipe::load(&recipe).unwrap()), 5);
    let ck = k3mini::run_dir::open_checkpoint(&scratch.path("next")).unwrap();
    assert_eq!(shards(&ck.plan), 4);

    // Full: past --traffic-max-bytes the answer still goes out, unrecorded and unscored.
    let gateway = agent(
        student.to_str().unwrap(),
        &teacher.url,
        "remote",
        &["--traffic", dir, "--traffic-max-bytes", "1"],
    );
    let (status, got) = post(&gateway.url, "/v1/completions", &body);
    assert_eq!(status, 200, "{got}");
    let why = got["k3mini"]["traffic"]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(why.contains("full"), "{got}");
    assert_eq!(got["k3mini"]["usage"]["remote_calls"], 1, "{got}");
    drop(gateway);

    // A gateway asking another top-k may not add to this directory.
    let mut refused = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"));
    let policy = scratch.write(
        "k8.toml",
        "route = \"all\"\nescalate_by = \"remote\"\n[verify]\nk = 8\n",
    );
    refused.args([
        "agent",
        "serve",
        "--local",
        student.to_str().unwrap(),
        "--remote",
    ]);
    refused.args([
        &teacher.url,
        "--policy",
        policy.to_str().unwrap(),
        "--traffic",
        dir,
    ]);
    let out = refused.args(["--port", "0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("another remote, top-k or tokenizer"),
        "{err}"
    );
}
