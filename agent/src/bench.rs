//! What a policy is worth, measured: every task answered once by the student alone, once by the
//! remote alone and once by the verify cascade (greedy, cached per task), then every policy and
//! threshold replayed offline on those answers. `agent bench` reports it; `agent calibrate`
//! ([`super::calibrate`]) picks thresholds from it.
//!
//! An answer's quality: with a reference `answer`, 1 when its last number equals the reference's
//! (exact match, as `eval`'s problems), else 0; for a task with `tools` and BFCL's ground truth,
//! 1 when the calls the reply makes pass BFCL's AST check ([`super::bfcl`]), else 0, and whether
//! it calls at all and its calls pass the request's tool gate (the valid-call rate, over the
//! replies that call or do not read); without either, its agreement
//! with the remote's answer, the share of the remote's tokens it repeats from the start, correct
//! at ≥ `agree_at`.
//!
//! Cost at the bench's prices ([`super::cost`]): an escalation pays the student's answer, which
//! the policy judged first, and the remote's. Routing metrics as RouteLLM (Ong et al., 2024)
//! defines them, over a signal's threshold sweep from the student alone to the remote alone:
//!
//! - PGR(q) = (q − q_local) / (q_remote − q_local), the performance gap recovered;
//! - APGR = ∫₀¹ PGR(share) d share, trapezoids over the sweep's points;
//! - CPT(x) = the least share of requests sent to the remote at which PGR ≥ x;
//! - AUROC of a signal = P(a wrong local answer is less confident by it than a right one), ties ½.

use super::bfcl::{Category, Truth};
use super::confidence::{Signal, Signals, quantile};
use super::cost::{Cost, Prices};
use super::gate::{Gate, ToolGate};
use super::policy::{EscalateBy, OnRemoteError, Policy, Route};
use super::verify::{VerifySettings, common_prefix};
use super::{Agent, Ask, Report};
use crate::error::{Error, Result, at, refuse};
use k3mini_data::Tool;
use k3mini_data::chat::{Message, ToolCall, render};
use k3mini_data::digest::sha256_hex;
use k3mini_eval::tasks::last_number;
use k3mini_teacher::wire::openai::ToolChoice;
use k3mini_teacher::{GenerateParams, Interrupt};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A task's input: text the student continues, or a conversation it answers (ChatML).
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    Text(String),
    Chat(Vec<Message>),
}

/// One task of a tasks file.
#[derive(Clone, Debug, PartialEq)]
pub struct Task {
    pub id: String,
    pub input: Input,
    /// The reference answer (its last number is compared), where the task has one.
    pub answer: Option<String>,
    /// Tests the answer must pass ([`super::code`]), for a code task.
    pub tests: Option<CodeTests>,
    /// Tokens its answers may have, where not the bench's `max_tokens`.
    pub max_tokens: Option<usize>,
    /// The tools declared to a chat task, and its `tool_choice` (OpenAI's; `auto` when absent).
    pub tools: Vec<Tool>,
    pub tool_choice: Option<ToolChoice>,
    /// The calls a tools task's answer must make: BFCL's category and ground truth.
    pub calls: Option<(Category, Vec<Truth>)>,
}

/// A code task's tests: HumanEval's `test` (defining `check(candidate)`) and `entry_point`.
#[derive(Clone, Debug, PartialEq)]
pub struct CodeTests {
    pub tests: String,
    pub entry_point: String,
}

/// A tasks file's line: `{"text": …}`, `{"prompt": …}` (one user turn) or `{"messages": […]}`,
/// each with an optional `id` (default `FILE:LINE`), `max_tokens`, and either a reference
/// `answer`, or, for a `text` the answer completes as code, `tests` and `entry_point`, or, for a
/// chat, `tools` (and a `tool_choice`) with BFCL's `category` and ground-truth `calls`
/// (`scripts/agent/bfcl-tasks.py` writes them).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    id: Option<String>,
    text: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    answer: Option<Scalar>,
    tests: Option<String>,
    entry_point: Option<String>,
    max_tokens: Option<usize>,
    tools: Option<Vec<Tool>>,
    tool_choice: Option<ToolChoice>,
    category: Option<Category>,
    calls: Option<Vec<Truth>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Scalar {
    Text(String),
    Number(serde_json::Number),
}

/// Reads a JSONL tasks file; a bad line is an error naming it.
pub fn read_tasks(path: &Path) -> Result<Vec<Task>> {
    let text = std::fs::read_to_string(path).map_err(at(format!("{}", path.display())))?;
    let mut tasks = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if raw.trim().is_empty() {
            continue;
        }
        let line_at = || format!("{}:{}", path.display(), i + 1);
        let line: Line = serde_json::from_str(raw).map_err(at(line_at()))?;
        let input = match (line.text, line.prompt, line.messages) {
            (Some(t), None, None) if !t.is_empty() => Input::Text(t),
            (None, Some(p), None) if !p.trim().is_empty() => {
                Input::Chat(vec![Message::new(k3mini_data::chat::Role::User, p)])
            }
            (None, None, Some(m)) if !m.is_empty() => Input::Chat(m),
            _ => {
                return Err(refuse!(
                    "{}: give exactly one non-empty `text`, `prompt` or `messages`",
                    line_at()
                ));
            }
        };
        let answer = line.answer.map(|a| match a {
            Scalar::Text(s) => s,
            Scalar::Number(n) => n.to_string(),
        });
        if let Some(a) = answer.as_ref().filter(|a| last_number(a).is_none()) {
            return Err(refuse!(
                "{}: the answer {a:?} holds no number, and answers are checked by their last \
                 number (leave `answer` out to score by agreement with the remote)",
                line_at()
            ));
        }
        let tests = match (line.tests, line.entry_point) {
            (None, None) => None,
            (Some(tests), Some(entry_point))
                if answer.is_none() && matches!(input, Input::Text(_)) =>
            {
                Some(CodeTests { tests, entry_point })
            }
            _ => {
                return Err(refuse!(
                    "{}: `tests` and `entry_point` go together, on a `text` the answer completes \
                 as code, without an `answer`",
                    line_at()
                ));
            }
        };
        if !(line.max_tokens != Some(0)) {
            return Err(refuse!("{}: max_tokens must be > 0", line_at()));
        }
        if line.tool_choice.is_some() && line.tools.is_none() {
            return Err(refuse!("{}: `tool_choice` goes with `tools`", line_at()));
        }
        let calls = match (line.tools.as_deref(), line.category, line.calls) {
            (None, None, None) => None,
            (Some([_, ..]), Some(category), calls)
                if matches!(input, Input::Chat(_)) && answer.is_none() && tests.is_none() =>
            {
                let calls = calls.unwrap_or_default();
                if (category == Category::Irrelevance) != calls.is_empty() {
                    return Err(refuse!(
                        "{}: an irrelevance task expects no `calls`, every other category some",
                        line_at()
                    ));
                }
                Some((category, calls))
            }
            _ => {
                return Err(refuse!(
                    "{}: `tools` (not empty), `category` and `calls` go together, on a chat \
                     without an `answer` or `tests`",
                    line_at()
                ));
            }
        };
        tasks.push(Task {
            id: line.id.unwrap_or_else(line_at),
            input,
            answer,
            tests,
            max_tokens: line.max_tokens,
            tools: line.tools.unwrap_or_default(),
            tool_choice: line.tool_choice,
            calls,
        });
    }
    if !(!tasks.is_empty()) {
        return Err(refuse!("{}: no tasks", path.display()));
    }
    Ok(tasks)
}

/// A bench's settings: the `--bench` TOML, or these defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Tokens an answer may have.
    pub max_tokens: usize,
    /// Agreement with the remote's answer at which an answer to a task without a reference
    /// counts as correct.
    pub agree_at: f64,
    /// Policy files replayed beside the built-ins and the sweeps (budgets are not replayed).
    pub policies: Vec<PathBuf>,
    /// The cascade's settings for the verify runs.
    pub verify: VerifySettings,
    /// Run code tasks' tests: model-written Python on this machine ([`super::code`]); a bench
    /// of code tasks refuses to start without it (here or `--run-tests`).
    pub run_tests: bool,
    /// Seconds a code task's program may run.
    pub test_seconds: f64,
    /// The student's own answers to tools tasks decoded under the tools' grammar (a policy's
    /// `[gate] constrain_calls`): the local runs, and the policies replayed on them.
    pub constrain_calls: bool,
    pub cost: Prices,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_tokens: 32,
            agree_at: 0.5,
            policies: Vec::new(),
            verify: VerifySettings::default(),
            run_tests: false,
            test_seconds: 10.0,
            constrain_calls: false,
            cost: Prices::default(),
        }
    }
}

impl Settings {
    /// A bench file, checked.
    pub fn read(path: &Path) -> Result<Self> {
        let text =
            k3mini_durable::read_small(path, 1 << 20).map_err(at(path.display().to_string()))?;
        let s: Settings = toml::from_str(&text)
            .map_err(|e| Error::Refused(format!("bench {}: {e}", path.display())))?;
        if !(s.max_tokens > 0
            && (0.0..=1.0).contains(&s.agree_at)
            && s.test_seconds > 0.0
            && s.test_seconds <= 3600.0)
        {
            return Err(refuse!(
                "bench {}: max_tokens must be > 0, test_seconds in (0, 3600], agree_at in [0, 1]",
                path.display()
            ));
        }
        s.cost
            .check()
            .and_then(|()| s.verify.check())
            .map_err(|e| Error::Refused(format!("bench {}: {e}", path.display())))?;
        Ok(s)
    }
}

/// What a record's figures mean (and, from 3, the call grammar its constrained runs were
/// decoded under); records of another version are measured again.
const RECORD_VERSION: u32 = 3;

/// One way of answering a task, as it happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Run {
    pub ids: Vec<u32>,
    pub text: String,
    pub report: Report,
    /// The calls the reply makes, read in the student's format (a tools task's; None where the
    /// reply does not read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<Vec<ToolCall>>,
}

/// A task answered the three ways. `key` names what was measured (the student's bytes, the
/// remote, the prompt's ids and the settings that shape the answers): a cached record is reused
/// only where it matches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub key: String,
    pub task: String,
    pub local: Run,
    pub remote: Run,
    pub verify: Run,
}

/// The cache of runs: `runs.jsonl` in the bench's directory, rewritten whole (atomically) after
/// each task, so an interrupted bench resumes where it stopped.
fn read_cache(path: &Path) -> Result<HashMap<String, Record>> {
    if !path.exists() {
        return Ok(HashMap::new());
    }
    let text = std::fs::read_to_string(path).map_err(at(path.display().to_string()))?;
    text.lines()
        .enumerate()
        .map(|(i, line)| {
            let r: Record = serde_json::from_str(line).map_err(at({
                format!(
                    "{}:{} is not a bench record (delete the file to measure again)",
                    path.display(),
                    i + 1
                )
            }))?;
            Ok((r.key.clone(), r))
        })
        .collect()
}

/// The ids `task` asks the student with, and the greedy request.
fn ask(agent: &Agent, task: &Task, max_tokens: usize) -> Result<Ask> {
    let tokenizer = &agent.student.model.tokenizer;
    let format = agent.student.format();
    let (prompt, parts) = match &task.input {
        // As the gateway reads a completion's text prompt: special-token strings as their ids.
        Input::Text(t) => (tokenizer.encode_with_specials(t)?, None),
        Input::Chat(m) => {
            let (ids, parts) = render(m, &task.tools, format, true)?.encode(tokenizer)?;
            (ids, Some(parts))
        }
    };
    let gate = match task.tools.is_empty() {
        true => None,
        false => Some(Gate::Tools(
            ToolGate::of(format, &task.tools, task.tool_choice.as_ref(), None)
                .map_err(|(at, e)| refuse!("task {}: {at}: {e}", task.id))?,
        )),
    };
    let context = agent.student.model.context_length();
    if !(!prompt.is_empty() && prompt.len() + max_tokens <= context) {
        return Err(refuse!(
            "task {}: {} prompt tokens and {max_tokens} to answer do not fit the student's {context}",
            task.id,
            prompt.len()
        ));
    }
    Ok(Ask {
        prompt,
        params: GenerateParams {
            max_tokens,
            stop: agent.student.stops(),
            ..GenerateParams::default()
        },
        stop_text: Vec::new(),
        gate,
        parts,
    })
}

/// Answers every task the three ways (greedy), reusing the records of `cache` (a `runs.jsonl`)
/// that match and adding the rest to it; `student_sha256` names the student's weights and
/// `setup` the rest that shapes answers and timings (engine, device, remote address and API). The
/// agent's policy is restored after each answer (they run under the built-ins).
pub fn measure(
    agent: &mut Agent,
    student_sha256: &str,
    setup: &str,
    tasks: &[Task],
    settings: &Settings,
    cache: &Path,
) -> Result<Vec<Record>> {
    let mut cached = read_cache(cache)?;
    let kept = agent.policy.clone();
    let bar = k3mini_progress::observer().bar("tasks", tasks.len() as u64, 0);
    let mut records = Vec::with_capacity(tasks.len());
    for task in tasks {
        bar.message(task.id.clone());
        let ask = ask(agent, task, task.max_tokens.unwrap_or(settings.max_tokens))?;
        let key = sha256_hex(
            serde_json::to_string(&(
                RECORD_VERSION,
                student_sha256,
                setup,
                agent.remote.name(),
                agent.scoring_output,
                &ask.prompt,
                &ask.params.stop,
                ask.params.max_tokens,
                &settings.verify,
                settings.constrain_calls,
                &task.tool_choice,
            ))?
            .as_bytes(),
        );
        if let Some(r) = cached.get(&key) {
            records.push(r.clone());
            bar.inc(1);
            continue;
        }
        let mut run = |name: &str| -> Result<Run> {
            let mut policy = Policy::built_in(name).expect("a built-in");
            policy.verify = settings.verify.clone();
            policy.gate.constrain_calls = settings.constrain_calls;
            // A failing remote fails the bench: a marked local answer would be measured (and
            // cached) as the remote's.
            policy.on_remote_error = OnRemoteError::Error;
            agent.policy = policy;
            let answered = agent.answer(&ask, Interrupt::default(), &mut |_| {});
            agent.policy = kept.clone();
            let a = answered.map_err(at(format!("task {} ({name})", task.id)))?;
            // The text as a client reads it: without the stop id that ended it.
            let body = match a.ids.split_last() {
                Some((last, rest)) if ask.params.stop.contains(last) => rest,
                _ => &a.ids[..],
            };
            let text = agent.student.model.tokenizer.decode(body)?;
            let calls = (!task.tools.is_empty())
                .then(|| agent.student.format().parse_reply(&text).ok())
                .flatten()
                .map(|r| r.calls);
            Ok(Run {
                text,
                ids: a.ids,
                report: a.report,
                calls,
            })
        };
        let record = Record {
            key,
            task: task.id.clone(),
            local: run("local")?,
            remote: run("remote")?,
            verify: run("verify")?,
        };
        cached.insert(record.key.clone(), record.clone());
        records.push(record);
        // Rewritten only for a new record: what was read back stays byte for byte.
        let mut text = String::new();
        for r in cached.values() {
            text += &serde_json::to_string(r)?;
            text.push('\n');
        }
        k3mini_durable::write(cache, text.as_bytes()).map_err(at(cache.display().to_string()))?;
        bar.inc(1);
    }
    bar.finish(true);
    Ok(records)
}

/// One answer as the replay sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outcome {
    pub score: f64,
    pub correct: bool,
    /// For a tools task: whether the reply calls, and whether its calls pass the gate.
    pub call: Option<Call>,
    pub usd: f64,
    pub seconds: f64,
}

/// What a reply to a tools task did with its tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// It reads, and makes no call.
    None,
    /// Its calls pass the request's tool gate.
    Valid,
    /// It does not read in the student's format, or its calls fail the gate.
    Invalid,
}

/// A task's three answers scored and priced, and the student's signals.
#[derive(Clone, Debug)]
pub struct Row {
    pub local: Outcome,
    pub remote: Outcome,
    pub verify: Outcome,
    pub signals: Signals,
    /// Whether the student's answer fails the request's gate (a gate policy escalates it).
    pub gate_fails: bool,
}

fn score(task: &Task, run: &Run, remote: &Run, settings: &Settings) -> Result<(f64, bool)> {
    if let (Some(t), Input::Text(prompt)) = (&task.tests, &task.input) {
        let program = super::code::program(prompt, &run.text, &t.tests, &t.entry_point);
        let limit = std::time::Duration::from_secs_f64(settings.test_seconds);
        let ok = super::code::passes(&program, limit, Default::default())
            .map_err(|e| Error::Refused(e.to_string()))?;
        return Ok((f64::from(u8::from(ok)), ok));
    }
    if let Some((category, truth)) = &task.calls {
        let ok = match &run.calls {
            Some(calls) => {
                let args: Vec<serde_json::Map<String, serde_json::Value>> = calls
                    .iter()
                    .map(|c| {
                        serde_json::to_value(k3mini_data::chat::Json::Object(
                            c.function.arguments.0.clone(),
                        ))
                        .ok()
                        .and_then(|v| v.as_object().cloned())
                        .unwrap_or_default()
                    })
                    .collect();
                let made: Vec<super::bfcl::Made> = calls
                    .iter()
                    .zip(&args)
                    .map(|(c, a)| (c.function.name.as_str(), a))
                    .collect();
                super::bfcl::check(*category, &task.tools, &made, truth).is_ok()
            }
            // A reply that does not read makes no call: right only where none is relevant.
            None => *category == Category::Irrelevance,
        };
        return Ok((f64::from(u8::from(ok)), ok));
    }
    Ok(match &task.answer {
        Some(reference) => {
            let got = last_number(&run.text);
            let ok = got.is_some() && got == last_number(reference);
            (f64::from(u8::from(ok)), ok)
        }
        None => {
            let agreement = if remote.ids.is_empty() {
                f64::from(u8::from(run.ids.is_empty()))
            } else {
                common_prefix(&run.ids, &remote.ids) as f64 / remote.ids.len() as f64
            };
            (agreement, agreement >= settings.agree_at)
        }
    })
}

/// Scores and prices the records of `tasks` (in order); an error only where a code task's tests
/// cannot be run.
pub fn rows(tasks: &[Task], records: &[Record], settings: &Settings) -> Result<Vec<Row>> {
    tasks
        .iter()
        .zip(records)
        .map(|(task, r)| {
            let outcome = |run: &Run| -> Result<Outcome> {
                let (score, correct) = score(task, run, &r.remote, settings)?;
                let spent = &run.report.usage.spent;
                Ok(Outcome {
                    score,
                    correct,
                    call: task.calls.as_ref().map(|_| match &run.calls {
                        Some(calls) if calls.is_empty() => Call::None,
                        Some(_) if run.report.gate_failure.is_none() => Call::Valid,
                        _ => Call::Invalid,
                    }),
                    usd: Cost::of(&run.report.usage, &settings.cost).total_usd,
                    seconds: spent.local_seconds + spent.remote_seconds,
                })
            };
            Ok(Row {
                local: outcome(&r.local)?,
                remote: outcome(&r.remote)?,
                verify: outcome(&r.verify)?,
                signals: r.local.report.signals.unwrap_or_default(),
                gate_fails: r.local.report.gate_failure.is_some(),
            })
        })
        .collect()
}

/// Refuses tasks with tests unless the settings allow running them.
pub fn check_tasks(tasks: &[Task], settings: &Settings) -> Result<()> {
    match tasks.iter().find(|t| t.tests.is_some()) {
        Some(t) if !settings.run_tests => {
            return Err(refuse!(
                "task {} carries tests, which run model-written Python: pass --run-tests (they run in \
             the bubblewrap sandbox, agent::sandbox)",
                t.id
            ));
        }
        // Refused before any work rather than at the first task's score.
        Some(_) => super::sandbox::sandbox()
            .map(|_| ())
            .map_err(|e| Error::Refused(e.to_string())),
        None => Ok(()),
    }
}

/// A policy at one setting, over all tasks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub name: String,
    /// Share of requests escalated.
    pub share: f64,
    /// Mean quality, and the share correct.
    pub quality: f64,
    pub accuracy: f64,
    pub usd_per_1k: f64,
    pub usd_per_correct: Option<f64>,
    /// Share of tools tasks whose answer calls (or tries to: a reply that does not read), and
    /// the share of those whose calls pass the tool gate (None without any).
    #[serde(default)]
    pub calls_made: Option<f64>,
    #[serde(default)]
    pub valid_calls: Option<f64>,
    /// Latency quantiles, seconds (absent for the random router's expectation).
    pub p50_s: Option<f64>,
    pub p95_s: Option<f64>,
}

impl Point {
    /// The point of answering each row with `pick` (its outcome, and whether it escalated).
    pub fn of(name: &str, rows: &[Row], pick: impl Fn(&Row) -> (Outcome, bool)) -> Self {
        let picked: Vec<(Outcome, bool)> = rows.iter().map(pick).collect();
        let n = picked.len().max(1) as f64;
        let correct = picked.iter().filter(|(o, _)| o.correct).count();
        let usd: f64 = picked.iter().map(|(o, _)| o.usd).sum();
        let seconds: Vec<f32> = picked.iter().map(|(o, _)| o.seconds as f32).collect();
        let tools: Vec<Call> = picked.iter().filter_map(|(o, _)| o.call).collect();
        let tried: Vec<&Call> = tools.iter().filter(|c| **c != Call::None).collect();
        let share = |k: usize, of: usize| (of > 0).then(|| k as f64 / of as f64);
        Self {
            name: name.into(),
            share: picked.iter().filter(|(_, e)| *e).count() as f64 / n,
            quality: picked.iter().map(|(o, _)| o.score).sum::<f64>() / n,
            accuracy: correct as f64 / n,
            usd_per_1k: usd / n * 1000.0,
            usd_per_correct: (correct > 0).then(|| usd / correct as f64),
            calls_made: share(tried.len(), tools.len()),
            valid_calls: share(
                tried.iter().filter(|c| ***c == Call::Valid).count(),
                tried.len(),
            ),
            p50_s: Some(f64::from(quantile(&seconds, 0.5))),
            p95_s: Some(f64::from(quantile(&seconds, 0.95))),
        }
    }
}

/// The escalation of a row whose local answer was judged first: `by` the remote whole or the
/// cascade, paying for both.
fn escalated(row: &Row, by: EscalateBy) -> Outcome {
    let second = match by {
        EscalateBy::Remote => row.remote,
        EscalateBy::Verify => row.verify,
    };
    Outcome {
        usd: row.local.usd + second.usd,
        seconds: row.local.seconds + second.seconds,
        ..second
    }
}

/// The thresholds that split the rows differently by `signal`: below every value, between
/// neighbours, and above every value, ordered from escalating none to escalating all.
pub fn thresholds(rows: &[Row], signal: Signal) -> Vec<f32> {
    let mut v: Vec<f32> = rows.iter().map(|r| r.signals.get(signal)).collect();
    v.sort_by(f32::total_cmp);
    v.dedup();
    let (Some(&lo), Some(&hi)) = (v.first(), v.last()) else {
        return Vec::new();
    };
    let mut t = vec![lo - 1.0];
    t.extend(v.windows(2).map(|w| w[0] + (w[1] - w[0]) / 2.0));
    t.push(hi + 1.0);
    if !signal.higher_is_confident() {
        t.reverse();
    }
    t
}

/// The confidence policy on `signal` at every threshold, escalating `by`.
pub fn sweep(rows: &[Row], signal: Signal, by: EscalateBy) -> Vec<(f32, Point)> {
    thresholds(rows, signal)
        .into_iter()
        .map(|t| {
            let p = Point::of(signal.name(), rows, |r| {
                if signal.unsure(r.signals.get(signal), t) {
                    (escalated(r, by), true)
                } else {
                    (r.local, false)
                }
            });
            (t, p)
        })
        .collect()
}

/// A signal's routing figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SignalFigures {
    pub signal: Signal,
    pub auroc: Option<f64>,
    pub apgr: Option<f64>,
    /// CPT at PGR 50%, 80% and 95%.
    pub cpt: [Option<f64>; 3],
}

/// AUROC of `unsureness` at telling wrong answers (`wrong`) from right ones; None without both.
pub fn auroc(unsureness: &[f64], wrong: &[bool]) -> Option<f64> {
    let (mut pairs, mut wins) = (0u64, 0.0);
    for (a, &wa) in unsureness.iter().zip(wrong) {
        for (b, &wb) in unsureness.iter().zip(wrong) {
            if wa && !wb {
                pairs += 1;
                wins += if a > b {
                    1.0
                } else if a == b {
                    0.5
                } else {
                    0.0
                };
            }
        }
    }
    (pairs > 0).then(|| wins / pairs as f64)
}

/// APGR and CPT(50/80/95%) of a sweep's (share, quality) points between the student alone
/// (`q_local`) and the remote alone (`q_remote`); None where the remote is no better.
pub fn apgr_cpt(
    points: &[(f64, f64)],
    q_local: f64,
    q_remote: f64,
) -> (Option<f64>, [Option<f64>; 3]) {
    let gap = q_remote - q_local;
    if gap <= 0.0 || points.is_empty() {
        return (None, [None; 3]);
    }
    let pgr = |q: f64| (q - q_local) / gap;
    let mut curve: Vec<(f64, f64)> = points.iter().map(|&(s, q)| (s, pgr(q))).collect();
    curve.push((0.0, 0.0));
    curve.push((1.0, 1.0));
    curve.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let area = curve
        .windows(2)
        .map(|w| (w[1].0 - w[0].0) * (w[0].1 + w[1].1) / 2.0)
        .sum();
    let cpt = [0.5, 0.8, 0.95].map(|x| {
        curve
            .iter()
            .filter(|(_, p)| *p >= x - 1e-12)
            .map(|(s, _)| *s)
            .fold(None, |m: Option<f64>, s| Some(m.map_or(s, |m| m.min(s))))
    });
    (Some(area), cpt)
}

/// Where the random router's point sits in [`Bench::points`].
const RANDOM_POINT: usize = 4;

/// What the bench found.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Bench {
    pub tasks: usize,
    pub settings: Settings,
    /// All-local, all-remote, verify, oracle, random at half, and the policy files (named
    /// `policy: NAME`).
    pub points: Vec<Point>,
    /// Each signal's sweep, escalating to the remote whole.
    pub sweeps: Vec<(Signal, Vec<(f32, Point)>)>,
    pub random: Vec<Point>,
    pub signals: Vec<SignalFigures>,
    pub verify: VerifyFigures,
}

/// The verify cascade against the remote alone.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VerifyFigures {
    /// Share of tasks whose cascade answer equals the remote's, token for token.
    pub equal: f64,
    /// Drafted tokens the remote accepted (none drafted: None).
    pub acceptance: Option<f64>,
    /// Remote output tokens the cascade was billed (its corrections, or a token per scoring call
    /// where the API generates one), against the remote alone's.
    pub remote_output: u64,
    pub remote_output_alone: u64,
    /// 1 − remote_output / remote_output_alone (None when the remote alone wrote nothing).
    pub output_saved: Option<f64>,
    /// Remote input tokens, against the remote alone's.
    pub remote_input: u64,
    pub remote_input_alone: u64,
}

/// The student alone, the remote alone, the cascade, and the prompt-level oracle (sending to
/// the remote, and paying only it, exactly the tasks the remote answers better).
fn baselines(rows: &[Row]) -> [Point; 4] {
    [
        Point::of("all-local", rows, |r| (r.local, false)),
        Point::of("all-remote", rows, |r| (r.remote, true)),
        Point::of("verify", rows, |r| (r.verify, true)),
        Point::of("oracle", rows, |r| {
            if r.remote.score > r.local.score {
                (r.remote, true)
            } else {
                (r.local, false)
            }
        }),
    ]
}

/// A router escalating a random share `s` before the student answers, in expectation.
fn random(local: &Point, remote: &Point, s: f64) -> Point {
    let mix = |a: f64, b: f64| (1.0 - s) * a + s * b;
    let accuracy = mix(local.accuracy, remote.accuracy);
    let usd_per_1k = mix(local.usd_per_1k, remote.usd_per_1k);
    Point {
        name: "random".into(),
        share: s,
        quality: mix(local.quality, remote.quality),
        accuracy,
        usd_per_1k,
        usd_per_correct: (accuracy > 0.0).then(|| usd_per_1k / 1000.0 / accuracy),
        calls_made: local
            .calls_made
            .zip(remote.calls_made)
            .map(|(l, r)| mix(l, r)),
        // Of the calls made: the mix weighs each side by the calls it makes.
        valid_calls: match (local.calls_made, remote.calls_made) {
            (Some(lc), Some(rc)) if mix(lc, rc) > 0.0 => Some(
                mix(
                    lc * local.valid_calls.unwrap_or(0.0),
                    rc * remote.valid_calls.unwrap_or(0.0),
                ) / mix(lc, rc),
            ),
            _ => None,
        },
        p50_s: None,
        p95_s: None,
    }
}

/// A policy file replayed: its route and thresholds on the student's signals, escalating as it
/// says (budgets are not replayed).
pub fn replay(policy: &Policy, rows: &[Row]) -> Point {
    Point::of(&policy.name, rows, |r| {
        let escalate = match policy.route {
            Route::None => false,
            // Only tools tasks have a gate (their tool calls).
            Route::Gate => r.gate_fails,
            Route::All => true,
            Route::Confidence => r.gate_fails || policy.confidence.escalate(&r.signals).is_some(),
        };
        match (escalate, policy.route) {
            (false, _) => (r.local, false),
            // Route all never drafts a local answer first.
            (true, Route::All) => match policy.escalate_by {
                EscalateBy::Remote => (r.remote, true),
                EscalateBy::Verify => (r.verify, true),
            },
            (true, _) => (escalated(r, policy.escalate_by), true),
        }
    })
}

/// Replays every policy on the measured rows.
pub fn evaluate(
    records: &[Record],
    rows: &[Row],
    policies: &[Policy],
    settings: &Settings,
) -> Bench {
    let [local, remote, verify, oracle] = baselines(rows);
    let random_line: Vec<Point> = (0..=10)
        .map(|i| random(&local, &remote, f64::from(i) / 10.0))
        .collect();
    let sweeps: Vec<(Signal, Vec<(f32, Point)>)> = Signal::ALL
        .iter()
        .map(|&s| (s, sweep(rows, s, EscalateBy::Remote)))
        .collect();
    let wrong: Vec<bool> = rows.iter().map(|r| !r.local.correct).collect();
    let signals = sweeps
        .iter()
        .map(|(s, points)| {
            let unsureness: Vec<f64> = rows
                .iter()
                .map(|r| {
                    let v = f64::from(r.signals.get(*s));
                    if s.higher_is_confident() { -v } else { v }
                })
                .collect();
            let curve: Vec<(f64, f64)> = points.iter().map(|(_, p)| (p.share, p.quality)).collect();
            let (apgr, cpt) = apgr_cpt(&curve, local.quality, remote.quality);
            SignalFigures {
                signal: *s,
                auroc: auroc(&unsureness, &wrong),
                apgr,
                cpt,
            }
        })
        .collect();
    let sum = |f: &dyn Fn(&Record) -> u64| records.iter().map(f).sum::<u64>();
    let traces = records
        .iter()
        .filter_map(|r| r.verify.report.verify.as_ref());
    let (drafted, accepted) = traces.fold((0, 0), |(d, a), t| (d + t.drafted, a + t.accepted));
    let remote_output = sum(&|r| r.verify.report.usage.spent.remote_output);
    let remote_output_alone = sum(&|r| r.remote.report.usage.spent.remote_output);
    let verify_figures = VerifyFigures {
        equal: records
            .iter()
            .filter(|r| r.verify.ids == r.remote.ids)
            .count() as f64
            / records.len().max(1) as f64,
        acceptance: (drafted > 0).then(|| accepted as f64 / drafted as f64),
        remote_output,
        remote_output_alone,
        output_saved: (remote_output_alone > 0)
            .then(|| 1.0 - remote_output as f64 / remote_output_alone as f64),
        remote_input: sum(&|r| r.verify.report.usage.spent.remote_input),
        remote_input_alone: sum(&|r| r.remote.report.usage.spent.remote_input),
    };
    let mut points = vec![local, remote, verify, oracle, random_line[5].clone()];
    debug_assert_eq!(points[RANDOM_POINT].name, "random");
    // Tools tasks have a gate to replay: the built-in gate policy's point.
    if rows.iter().any(|r| r.local.call.is_some()) {
        let gate = Policy::built_in("gate").expect("a built-in");
        points.push(replay(&gate, rows));
    }
    points.extend(policies.iter().map(|p| Point {
        name: format!("policy: {}", p.name),
        ..replay(p, rows)
    }));
    Bench {
        tasks: rows.len(),
        settings: settings.clone(),
        points,
        sweeps,
        random: random_line,
        signals,
        verify: verify_figures,
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".into(), |v| format!("{v:.digits$}"))
}

impl Bench {
    /// The report as Markdown: the policies, each signal's routing figures, and verify's.
    pub fn markdown(&self) -> String {
        let c = &self.settings.cost;
        let mut md = format!(
            "# Agent bench: {} tasks\n\nGreedy, up to {} tokens an answer (or a task's own max_tokens); a task without a \
             reference is correct at ≥ {} agreement with the remote. Prices: remote ${}/M input, \
             ${}/M output; local ${}/h + {} W at ${}/kWh.\n\n\
             {}| policy | escalated | quality | accuracy | calls made | valid calls | $ / 1k requests | $ / correct | p50 s | p95 s |\n\
             |---|---|---|---|---|---|---|---|---|---|\n",
            self.tasks,
            self.settings.max_tokens,
            self.settings.agree_at,
            c.input_per_mtok,
            c.output_per_mtok,
            c.hardware_per_hour,
            c.watts,
            c.per_kwh,
            if self.settings.constrain_calls {
                "The student's own answers to tools tasks are decoded under the tools' grammar \
                 (`constrain_calls`; the verify cascade's drafts are not).\n\n"
            } else {
                ""
            }
        );
        for p in &self.points {
            md += &format!(
                "| {} | {:.0}% | {:.3} | {:.3} | {} | {} | {:.4} | {} | {} | {} |\n",
                p.name,
                p.share * 100.0,
                p.quality,
                p.accuracy,
                opt(p.calls_made.map(|v| v * 100.0), 1),
                opt(p.valid_calls.map(|v| v * 100.0), 1),
                p.usd_per_1k,
                opt(p.usd_per_correct, 6),
                opt(p.p50_s, 2),
                opt(p.p95_s, 2)
            );
        }
        md += "\nConfidence on one signal, escalating to the remote whole, swept over every \
               threshold (RouteLLM's APGR and CPT; AUROC at telling the student's wrong answers):\n\n\
               | signal | AUROC | APGR | CPT(50%) | CPT(80%) | CPT(95%) |\n|---|---|---|---|---|---|\n";
        for s in &self.signals {
            md += &format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                s.signal.name(),
                opt(s.auroc, 3),
                opt(s.apgr, 3),
                opt(s.cpt[0], 2),
                opt(s.cpt[1], 2),
                opt(s.cpt[2], 2)
            );
        }
        let v = &self.verify;
        md += &format!(
            "\nVerify: {:.1}% of answers equal the remote's token for token; {}% of drafted \
             tokens accepted; the remote was billed {} output tokens against {} alone ({}% \
             saved) and read {} input tokens against {}.\n",
            v.equal * 100.0,
            opt(v.acceptance.map(|a| a * 100.0), 1),
            v.remote_output,
            v.remote_output_alone,
            opt(v.output_saved.map(|s| s * 100.0), 1),
            v.remote_input,
            v.remote_input_alone
        );
        md
    }

    /// The cost–quality plot: each signal's sweep, the random router, and the single policies.
    pub fn plot(&self, path: &Path) -> Result<()> {
        use k3mini_eval::plots::{Series, Style, xy_plot};
        let xy = |p: &Point| (p.usd_per_1k, p.quality);
        let mut series: Vec<Series> = self
            .sweeps
            .iter()
            .map(|(s, points)| Series {
                name: format!("confidence: {}", s.name()),
                points: points.iter().map(|(_, p)| xy(p)).collect(),
                style: Style::LineAndPoints,
            })
            .collect();
        series.push(Series {
            name: "random".into(),
            points: self.random.iter().map(xy).collect(),
            style: Style::Line,
        });
        // The random router's midpoint is on its line already.
        series.extend(
            self.points
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != RANDOM_POINT)
                .map(|(_, p)| Series {
                    name: p.name.clone(),
                    points: vec![xy(p)],
                    style: Style::Points,
                }),
        );
        xy_plot(
            path,
            &format!("Quality against cost, {} tasks", self.tasks),
            "$ per 1,000 requests",
            "quality",
            &series,
        )
        .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))
    }
}

/// Replays `policies` on the measured `records` of `tasks` and writes the report into `out`:
/// `report.md`, `report.json` and `pareto.svg`.
pub fn report(
    tasks: &[Task],
    records: &[Record],
    policies: &[Policy],
    settings: &Settings,
    out: &Path,
) -> Result<Bench> {
    let rows = rows(tasks, records, settings)?;
    let bench = evaluate(records, &rows, policies, settings);
    std::fs::create_dir_all(out).map_err(at(out.display().to_string()))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = out.join(name);
        k3mini_durable::write(&path, bytes).map_err(at(path.display().to_string()))
    };
    write("report.md", bench.markdown().as_bytes())?;
    write(
        "report.json",
        serde_json::to_string_pretty(&bench)?.as_bytes(),
    )?;
    bench.plot(&out.join("pareto.svg"))?;
    Ok(bench)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auroc_counts_pairs_and_ties() {
        // Wrong answers (true) more unsure than every right one: 1; reversed: 0; all tied: ½.
        assert_eq!(auroc(&[3.0, 2.0, 1.0], &[true, false, false]), Some(1.0));
        assert_eq!(auroc(&[1.0, 2.0, 3.0], &[true, false, false]), Some(0.0));
        assert_eq!(auroc(&[1.0, 1.0], &[true, false]), Some(0.5));
        // 2 wrong × 2 right: (1 + 0.5 + 1 + 0) / 4.
        assert_eq!(
            auroc(&[2.0, 1.0, 1.0, 3.0], &[true, true, false, false]),
            Some(0.375)
        );
        assert_eq!(auroc(&[1.0, 2.0], &[false, false]), None);
    }

    #[test]
    fn apgr_and_cpt_follow_routellm() {
        // PGR rises to 1 at half the calls and stays: area ½·½·1 + ½·1 = 0.75.
        let (apgr, cpt) = apgr_cpt(
            &[(0.0, 0.5), (0.25, 0.75), (0.5, 1.0), (1.0, 1.0)],
            0.5,
            1.0,
        );
        assert!((apgr.unwrap() - 0.75).abs() < 1e-12);
        assert_eq!(cpt, [Some(0.25), Some(0.5), Some(0.5)]);
        // One point on the random router's diagonal: APGR ½; CPT is read at measured points,
        // so 50% at share ½ and 80% and 95% only at share 1.
        let (apgr, cpt) = apgr_cpt(&[(0.5, 0.75)], 0.5, 1.0);
        assert!((apgr.unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(cpt, [Some(0.5), Some(1.0), Some(1.0)]);
        // No gap to recover.
        assert_eq!(apgr_cpt(&[(0.5, 0.5)], 0.5, 0.5), (None, [None; 3]));
    }

    #[test]
    fn thresholds_run_from_none_escalated_to_all() {
        let row = |lp: f32, e: f32| Row {
            local: Outcome {
                score: 0.0,
                correct: false,
                call: None,
                usd: 1.0,
                seconds: 1.0,
            },
            remote: Outcome {
                score: 1.0,
                correct: true,
                call: None,
                usd: 10.0,
                seconds: 2.0,
            },
            verify: Outcome {
                score: 1.0,
                correct: true,
                call: None,
                usd: 5.0,
                seconds: 3.0,
            },
            signals: Signals {
                mean_logprob: lp,
                entropy_p50: e,
                ..Signals::default()
            },
            gate_fails: false,
        };
        let rows = [row(-1.0, 2.0), row(-3.0, 4.0), row(-1.0, 2.0)];
        for signal in [Signal::MeanLogprob, Signal::EntropyP50] {
            let shares: Vec<f64> = sweep(&rows, signal, EscalateBy::Remote)
                .iter()
                .map(|(_, p)| p.share)
                .collect();
            assert_eq!(shares, [0.0, 1.0 / 3.0, 1.0], "{signal:?}");
        }
        let all = sweep(&rows, Signal::MeanLogprob, EscalateBy::Verify)
            .pop()
            .unwrap()
            .1;
        // Every task pays its local answer and the cascade.
        assert_eq!(
            (all.quality, all.usd_per_1k, all.p50_s),
            (1.0, 6000.0, Some(4.0))
        );
    }

    #[test]
    fn a_tasks_file_names_its_bad_line() {
        let dir = std::env::temp_dir().join(format!("k3mini-tasks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        std::fs::write(
            &path,
            "{\"text\": \"a b\"}\n\n{\"prompt\": \"2+2?\", \"answer\": 4}\n",
        )
        .unwrap();
        let tasks = read_tasks(&path).unwrap();
        assert_eq!(tasks[1].answer.as_deref(), Some("4"));
        assert_eq!(tasks[0].id, format!("{}:1", path.display()));
        std::fs::write(
            &path,
            "{\"text\": \"a\"}\n{\"text\": \"a\", \"prompt\": \"b\"}\n",
        )
        .unwrap();
        let err = read_tasks(&path).unwrap_err().to_string();
        assert!(
            err.contains("t.jsonl:2") && err.contains("exactly one"),
            "{err}"
        );
        std::fs::write(&path, "{\"txt\": \"a\"}\n").unwrap();
        assert!(
            read_tasks(&path)
                .unwrap_err()
                .to_string()
                .contains("unknown field")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
