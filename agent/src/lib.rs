//! The local agent gateway: the student answers on this machine, and the requests it should not
//! answer alone go to K3 (any endpoint k3mini's clients speak). A [`policy::Policy`] decides which
//! requests escalate ([`confidence`]) and how ([`verify`]'s speculative cascade, or the remote
//! whole), within a [`policy::Budget`]; every answer says who answered, why, the signals, the
//! tokens and the cost ([`cost`]) against sending it all to the remote. [`server`] puts it behind
//! OpenAI's `/v1/completions` and `/v1/chat/completions`, streaming included.

pub mod bench;
pub mod bfcl;
pub mod calibrate;
pub mod code;
pub mod confidence;
pub mod cost;
pub mod error;
pub mod gate;
pub mod grammar;
pub mod policy;
pub mod sandbox;
pub mod server;
pub mod student;
pub mod traffic;
pub mod verify;
pub mod wire;

use confidence::Signals;
use cost::{Cost, Spent, Usage};
use gate::Gate;
use k3mini_teacher::sampling::Sampling;
use k3mini_teacher::wire::openai::{ToolChoice, ToolMode};
use k3mini_teacher::{FinishReason, GenerateParams, Interrupt, Teacher, TeacherError};
use policy::{EscalateBy, OnRemoteError, Policy, Route};
use serde::{Deserialize, Serialize};
use std::sync::Mutex;
use std::time::Instant;
use student::Student;
use traffic::Traffic;
use verify::{Halt, Trace, Verifier};

/// Who wrote the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AnsweredBy {
    /// The student alone.
    Local,
    /// The remote, sent the request whole.
    Remote,
    /// The student's drafts as the remote verified them ([`verify`]).
    Cascade,
}

/// What every response carries about how it was answered (the `k3mini` field beside OpenAI's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub answered_by: AnsweredBy,
    pub policy: String,
    pub escalated: bool,
    /// Why it escalated, or why an escalation the policy wanted did not happen (or stopped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The student's signals over its own answer (where it wrote one first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<Signals>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Trace>,
    /// The remote failed, and the student finished the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_error: Option<String>,
    /// Why the answer returned fails the request's gate: the remote's answer is judged as the
    /// student's was, and a student's failing answer kept (the budget or the remote stopped the
    /// escalation) says so too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate_failure: Option<String>,
    /// The traffic shard this escalation was written to ([`traffic`]), or why it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic: Option<Recorded>,
    pub usage: Usage,
    pub cost: Cost,
}

/// Where an escalation went for the next student: its shard, or why it was not written (the
/// answer stands either way).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recorded {
    Shard(String),
    Error(String),
}

/// A request as ids: the rendered prompt, its sampling, and what its answer must be.
pub struct Ask {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
    /// OpenAI's stop strings: the answer ends before the first its text holds.
    pub stop_text: Vec<String>,
    pub gate: Option<Gate>,
    /// What each prompt id is, for a chat (markup, prompt); None for a completion's text.
    pub parts: Option<Vec<k3mini_data::chat::Part>>,
}

/// An answer: its ids (a stop id last when it stopped), why it ended, and its report.
pub struct Answer {
    pub ids: Vec<u32>,
    pub finish: FinishReason,
    pub report: Report,
    /// The journal line of the traffic shard the report names: hold it until the answer is sent.
    pub unjournaled: Option<traffic::Unjournaled>,
}

pub use error::{AgentError, Error};

/// Remote spending and escalations since the gateway started (the budget's ledger).
#[derive(Default)]
struct Ledger {
    /// UTC day of `spent_today`.
    day: u64,
    spent_today: f64,
    requests: u64,
    escalated: u64,
}

fn utc_day() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400)
}

/// [`FinishReason::Stop`] where `ids` end at a stop id.
pub fn finish_of(ids: &[u32], stop: &[u32]) -> FinishReason {
    if ids.last().is_some_and(|id| stop.contains(id)) {
        FinishReason::Stop
    } else {
        FinishReason::Length
    }
}

/// How an escalation ended short of an answer: the ids already final (emitted), and why.
struct Short {
    kept: Vec<u32>,
    halt: Halt,
}

/// The gateway's core: the student, the remote and the policy.
pub struct Agent {
    pub student: Student,
    pub remote: Box<dyn Teacher + Send + Sync>,
    /// Output tokens the remote bills per scoring call ([`Verifier::scoring_output`]).
    pub scoring_output: u64,
    pub policy: Policy,
    /// Where escalations are written for the next student, if anywhere.
    pub traffic: Option<Traffic>,
    /// Tries the remote's client makes of one call (1 + its retries): each may be billed.
    pub remote_attempts: u64,
    ledger: Mutex<Ledger>,
}

impl Agent {
    /// A gateway whose remote bills `scoring_output` output tokens per scoring call (1 for vLLM
    /// and OpenAI-echo servers, which generate one token; 0 for SGLang).
    pub fn new(
        student: Student,
        remote: Box<dyn Teacher + Send + Sync>,
        scoring_output: u64,
        policy: Policy,
    ) -> Self {
        Self {
            student,
            remote,
            scoring_output,
            policy,
            traffic: None,
            remote_attempts: 1,
            ledger: Mutex::new(Ledger::default()),
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        let mut l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        let today = utc_day();
        if l.day != today {
            l.day = today;
            l.spent_today = 0.0;
        }
        l
    }

    /// Why the budget forbids a remote call that sends `input` tokens and may write `output`, on
    /// top of `spent`, if it does: the call priced at its worst case, every attempt uncached and
    /// billed (what a call that fails is booked at, [`Spent::remote_call`]).
    fn over_budget(&self, spent: &Spent, input: u64, output: u64) -> Option<String> {
        let b = &self.policy.budget;
        let prices = &self.policy.cost;
        let attempts = self.remote_attempts.max(1);
        let request = prices.remote(
            spent.remote_input + input.saturating_mul(attempts),
            spent.remote_cached,
            spent.remote_output + output.saturating_mul(attempts),
        );
        if let Some(cap) = b.max_usd_per_request
            && request > cap
        {
            return Some(format!(
                "budget: this request could spend ${request:.6} at the remote, over its ${cap} cap"
            ));
        }
        if let Some(cap) = b.max_usd_per_day {
            let today = self.ledger().spent_today + request;
            if today > cap {
                return Some(format!(
                    "budget: ${today:.6} at the remote today could pass the ${cap} daily cap"
                ));
            }
        }
        None
    }

    /// Why the share cap forbids one more escalation, if it does: the share counts every request
    /// since the gateway started, this one included, so with a cap `s` the first ⌈1/s⌉ − 1
    /// requests answer locally.
    fn share_forbids(&self) -> Option<String> {
        let cap = self.policy.budget.max_escalation_share?;
        let l = self.ledger();
        let share = (l.escalated + 1) as f64 / l.requests.max(1) as f64;
        (share > cap).then(|| {
            format!(
                "budget: escalating would make {} of {} requests escalated, over the {cap} share",
                l.escalated + 1,
                l.requests
            )
        })
    }

    /// Answers `ask` under the policy. `emit` receives the answer's ids as they become final (a
    /// cascade's after each round; otherwise all at once, since a local answer may yet be
    /// replaced). What the remote was paid counts against the daily budget however the request
    /// ends.
    pub fn answer(
        &self,
        ask: &Ask,
        interrupt: Interrupt,
        emit: &mut dyn FnMut(&[u32]),
    ) -> Result<Answer, AgentError> {
        self.ledger().requests += 1;
        let mut spent = Spent::default();
        let answered = self.run(ask, &mut spent, interrupt, emit).and_then(
            |(mut ids, mut finish, mut report)| {
                if let Some(n) = self.cut_at_stop(ask, &ids) {
                    ids.truncate(n);
                    finish = FinishReason::Stop;
                }
                // An answer the gate has not judged: the remote's, one the student finished, or
                // one no policy judges (a request's tool calls are read under every policy).
                if report.answered_by != AnsweredBy::Local
                    || report.escalated
                    || self.policy.route == Route::None
                {
                    report.gate_failure = self.gate_fails(ask, Some(&ids), interrupt)?;
                }
                let (recorded, unjournaled) =
                    match self.record(ask, &ids, &report, &mut spent, interrupt) {
                        Some(Ok((file, line))) => (Some(Recorded::Shard(file)), Some(line)),
                        Some(Err(why)) => (Some(Recorded::Error(why)), None),
                        None => (None, None),
                    };
                report.traffic = recorded;
                Ok((ids, finish, report, unjournaled))
            },
        );
        self.ledger().spent_today += spent.remote_usd(&self.policy.cost);
        let (ids, finish, mut report, unjournaled) = answered?;
        report.usage = Usage {
            prompt_tokens: ask.prompt.len() as u64,
            completion_tokens: ids.len() as u64,
            spent,
        };
        report.cost = Cost::of(&report.usage, &self.policy.cost);
        Ok(Answer {
            ids,
            finish,
            report,
            unjournaled,
        })
    }

    fn run(
        &self,
        ask: &Ask,
        spent: &mut Spent,
        interrupt: Interrupt,
        emit: &mut dyn FnMut(&[u32]),
    ) -> Result<(Vec<u32>, FinishReason, Report), AgentError> {
        let p = &ask.params;
        let mut report = Report {
            answered_by: AnsweredBy::Local,
            policy: self.policy.name.clone(),
            escalated: false,
            reason: None,
            signals: None,
            verify: None,
            remote_error: None,
            gate_failure: None,
            traffic: None,
            usage: Usage::default(),
            cost: Cost::of(&Usage::default(), &self.policy.cost),
        };
        if p.max_tokens == 0 {
            report.reason = Some("max_tokens is 0: nothing to write".into());
            return Ok((Vec::new(), FinishReason::Length, report));
        }
        // The student's own answer first where the policy judges it.
        let local = match self.policy.route {
            Route::All => None,
            Route::Confidence | Route::Gate | Route::None => {
                let mut grammar = self.call_grammar(ask)?;
                let tokens = self.decode(&ask.prompt, p, spent, grammar.as_mut(), interrupt)?;
                report.signals = Some(Signals::of(&tokens));
                // The gate judges what the client would get: the answer cut at its stop string.
                let ids: Vec<u32> = tokens.iter().map(|t| t.id).collect();
                let n = self.cut_at_stop(ask, &ids).unwrap_or(ids.len());
                Some(ids[..n].to_vec())
            }
        };
        let why = match (self.policy.route, &report.signals) {
            (Route::All, _) => Some(format!(
                "policy {:?} escalates every request",
                self.policy.name
            )),
            (Route::Confidence, Some(sig)) => self
                .gate_fails(ask, local.as_deref(), interrupt)?
                .or_else(|| self.policy.confidence.escalate(sig)),
            (Route::Gate, _) => self.gate_fails(ask, local.as_deref(), interrupt)?,
            _ => None,
        };
        let Some(why) = why else {
            let ids = local.expect("an unescalated request was answered locally");
            emit(&ids);
            let finish = finish_of(&ids, &p.stop);
            return Ok((ids, finish, report));
        };
        let blocked = self.share_forbids().or_else(|| {
            let output = match self.policy.escalate_by {
                EscalateBy::Remote => p.max_tokens as u64,
                EscalateBy::Verify => self.scoring_output,
            };
            self.over_budget(spent, ask.prompt.len() as u64, output)
        });
        let short = match blocked {
            Some(reason) => {
                // The student's answer stands: say so where it failed the gate.
                report.gate_failure = why.starts_with("gate:").then_some(why);
                Short {
                    kept: Vec::new(),
                    halt: Halt::Budget(reason),
                }
            }
            None => {
                report.reason = Some(why);
                report.escalated = true;
                self.ledger().escalated += 1;
                match self.escalate(ask, spent, &mut report, interrupt, emit) {
                    Ok((ids, finish)) => return Ok((ids, finish, report)),
                    Err(short) => short,
                }
            }
        };
        // Short of an answer: the student's, or the student finishing what was kept.
        match short.halt {
            Halt::Local(e) => return Err(AgentError::Local(e)),
            Halt::Remote(e) if self.policy.on_remote_error == OnRemoteError::Error => {
                return Err(AgentError::Remote(e));
            }
            Halt::Remote(e) => report.remote_error = Some(e.to_string()),
            Halt::Budget(reason) => report.reason = Some(reason),
        }
        report.answered_by = AnsweredBy::Local;
        let ids = match (short.kept.is_empty(), local) {
            (true, Some(ids)) => {
                emit(&ids);
                ids
            }
            _ => {
                let mut ids = short.kept;
                if finish_of(&ids, &p.stop) == FinishReason::Length && ids.len() < p.max_tokens {
                    let mut context = ask.prompt.clone();
                    context.extend(&ids);
                    let rest = GenerateParams {
                        max_tokens: p.max_tokens - ids.len(),
                        seed: p.seed ^ ids.len() as u64,
                        ..p.clone()
                    };
                    let tokens = self.decode(&context, &rest, spent, None, interrupt)?;
                    let more: Vec<u32> = tokens.iter().map(|t| t.id).collect();
                    emit(&more);
                    ids.extend(more);
                }
                ids
            }
        };
        let finish = finish_of(&ids, &p.stop);
        Ok((ids, finish, report))
    }

    /// Writes an answer the remote wrote (whole, or as the cascade's verifier) to the traffic
    /// directory, after one more remote call that scores prompt and answer (its cost booked in
    /// `spent`, the prompt a prefix-cache hit after the escalation's calls): its shard's name and
    /// journal line, or why it was not written; None when there is no directory or the remote
    /// wrote nothing of it.
    fn record(
        &self,
        ask: &Ask,
        ids: &[u32],
        report: &Report,
        spent: &mut Spent,
        interrupt: Interrupt,
    ) -> Option<Result<(String, traffic::Unjournaled), String>> {
        let traffic = self.traffic.as_ref()?;
        if report.answered_by == AnsweredBy::Local || ids.is_empty() {
            return None;
        }
        let mut seq = ask.prompt.clone();
        seq.extend(ids);
        let blocked = interrupt
            .check()
            .err()
            .map(|e| e.to_string())
            .or_else(|| traffic.blocked())
            .or_else(|| self.over_budget(spent, seq.len() as u64, self.scoring_output));
        if let Some(why) = blocked {
            return Some(Err(format!("not scored for the traffic: {why}")));
        }
        let scored = spent.remote_call(
            self.remote.as_ref(),
            self.remote_attempts,
            seq.len() as u64,
            self.scoring_output,
            || self.remote.score(&seq, traffic.k()),
            |_| (ask.prompt.len() as u64, self.scoring_output),
        );
        Some(
            scored
                .map_err(Error::from)
                .and_then(|s| traffic.record(ask, ids, s))
                .map_err(|e| e.to_string()),
        )
    }

    /// Where the answer `ids` ends at the request's first stop string, if its text holds one.
    fn cut_at_stop(&self, ask: &Ask, ids: &[u32]) -> Option<usize> {
        let tokenizer = &self.student.model.tokenizer;
        k3mini_teacher::stop::cut_at_stop(ids, &ask.stop_text, |ids| {
            tokenizer.decode(ids).unwrap_or_default()
        })
    }

    /// Why the local answer `ids` fails the request's gate, if it has one and it does.
    fn gate_fails(
        &self,
        ask: &Ask,
        ids: Option<&[u32]>,
        interrupt: Interrupt,
    ) -> Result<Option<String>, AgentError> {
        let (Some(gate), Some(ids)) = (ask.gate.as_ref(), ids) else {
            return Ok(None);
        };
        // What the client reads (the gateway's chat text): no stop ids, and nothing from the
        // first stop string on.
        let body: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|id| !ask.params.stop.contains(id))
            .collect();
        match self.student.model.tokenizer.decode(&body) {
            Ok(text) => {
                let text = k3mini_teacher::stop::cut_text(text, &ask.stop_text);
                gate.fails(&text, interrupt).map_err(AgentError::Local)
            }
            Err(e) => Ok(Some(format!("gate: the answer does not decode ({e})"))),
        }
    }

    /// The grammar the student's own answer to `ask` is decoded under: its tools' where the
    /// policy constrains calls and the request has tools (and lets the student call them).
    fn call_grammar(&self, ask: &Ask) -> Result<Option<llguidance::Matcher>, AgentError> {
        let Some(Gate::Tools(tools)) = &ask.gate else {
            return Ok(None);
        };
        if !self.policy.gate.constrain_calls || tools.choice == ToolChoice::Mode(ToolMode::None) {
            return Ok(None);
        }
        let grammars = self.student.call_grammars().map_err(|e| {
            AgentError::Local(TeacherError::Request(format!(
                "policy {:?} constrains tool calls: {e}",
                self.policy.name
            )))
        })?;
        grammars
            .matcher(tools)
            .map(Some)
            .map_err(|e| AgentError::Local(TeacherError::Request(e)))
    }

    /// The student's answer after `context` under `p` (and `grammar`), its work added to `spent`.
    fn decode(
        &self,
        context: &[u32],
        p: &GenerateParams,
        spent: &mut Spent,
        grammar: Option<&mut llguidance::Matcher>,
        interrupt: Interrupt,
    ) -> Result<Vec<student::Token>, AgentError> {
        let t0 = Instant::now();
        let mut rng = p.seed;
        let tokens = self
            .student
            .decode(
                context,
                p.max_tokens,
                Sampling::from(p),
                &p.stop,
                false,
                &mut rng,
                grammar,
                interrupt,
            )
            .map_err(AgentError::Local)?;
        spent.local_seconds += t0.elapsed().as_secs_f64();
        spent.local_read += context.len() as u64;
        spent.local_written += tokens.len() as u64;
        Ok(tokens)
    }

    /// The escalation the policy names: the answer, or how it ended short.
    fn escalate(
        &self,
        ask: &Ask,
        spent: &mut Spent,
        report: &mut Report,
        interrupt: Interrupt,
        emit: &mut dyn FnMut(&[u32]),
    ) -> Result<(Vec<u32>, FinishReason), Short> {
        match self.policy.escalate_by {
            EscalateBy::Remote => {
                let g = spent
                    .remote_call(
                        self.remote.as_ref(),
                        self.remote_attempts,
                        ask.prompt.len() as u64,
                        ask.params.max_tokens as u64,
                        || self.remote.generate(&ask.prompt, &ask.params),
                        |g| (0, g.ids.len() as u64),
                    )
                    .map_err(|e| Short {
                        kept: Vec::new(),
                        halt: Halt::Remote(e),
                    })?;
                report.answered_by = AnsweredBy::Remote;
                emit(&g.ids);
                Ok((g.ids, g.finish))
            }
            EscalateBy::Verify => {
                let before = *spent;
                let mut forbid = |s: &Spent, input: u64, output: u64| {
                    let mut total = before;
                    total.add(s);
                    self.over_budget(&total, input, output)
                };
                let run = verify::cascade(
                    &self.student,
                    Verifier {
                        teacher: self.remote.as_ref(),
                        scoring_output: self.scoring_output,
                        attempts: self.remote_attempts,
                    },
                    &ask.prompt,
                    &ask.params,
                    &self.policy.verify,
                    interrupt,
                    &mut forbid,
                    emit,
                );
                report.answered_by = AnsweredBy::Cascade;
                match run {
                    Ok(c) => {
                        spent.add(&c.spent);
                        report.verify = Some(c.trace);
                        Ok((c.ids, c.finish))
                    }
                    Err(stopped) => {
                        let c = stopped.partial;
                        spent.add(&c.spent);
                        report.verify = Some(c.trace);
                        Err(Short {
                            kept: c.ids,
                            halt: stopped.halt,
                        })
                    }
                }
            }
        }
    }
}
