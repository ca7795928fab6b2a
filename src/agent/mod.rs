//! The local agent gateway: the student answers on this machine, and the requests it should not
//! answer alone go to K3 (any endpoint k3mini's clients speak). A [`policy::Policy`] decides which
//! requests escalate ([`confidence`]) and how ([`verify`]'s speculative cascade, or the remote
//! whole), within a [`policy::Budget`]; every answer says who answered, why, the signals, the
//! tokens and the cost ([`cost`]) against sending it all to the remote. [`server`] puts it behind
//! OpenAI's `/v1/completions` and `/v1/chat/completions`, streaming included.

pub mod confidence;
pub mod cost;
pub mod policy;
pub mod server;
pub mod student;
pub mod verify;

use confidence::Signals;
use cost::{Cost, Usage};
use k3mini_teacher::{FinishReason, GenerateParams, Interrupt, Teacher, TeacherError};
use policy::{EscalateBy, OnRemoteError, Policy, Route};
use serde::{Deserialize, Serialize};
use std::sync::Mutex;
use std::time::Instant;
use student::{Sampling, Student};
use verify::{Spent, Trace};

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
    /// Why it escalated, or why an escalation the policy wanted did not happen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The student's signals over its own answer (where it wrote one first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<Signals>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Trace>,
    /// The remote failed or the budget ran out, and the student finished the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_error: Option<String>,
    pub usage: Usage,
    pub cost: Cost,
}

/// A request as ids: the rendered prompt and its sampling.
pub struct Ask {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
}

/// An answer: its ids (a stop id last when it stopped), why it ended, and its report.
pub struct Answer {
    pub ids: Vec<u32>,
    pub finish: FinishReason,
    pub report: Report,
}

/// A request the gateway could not answer.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The student failed (or the request asked it for the impossible).
    #[error("the local model: {0}")]
    Local(TeacherError),
    /// The remote failed and the policy says to fail with it.
    #[error("the remote: {0}")]
    Remote(TeacherError),
}

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

/// The gateway's core: the student, the remote and the policy.
pub struct Agent {
    pub student: Student,
    pub remote: Box<dyn Teacher + Send + Sync>,
    pub policy: Policy,
    ledger: Mutex<Ledger>,
}

impl Agent {
    pub fn new(student: Student, remote: Box<dyn Teacher + Send + Sync>, policy: Policy) -> Self {
        Self {
            student,
            remote,
            policy,
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

    /// Why the budget forbids a remote call sending `input` tokens on top of `spent`, if it does.
    fn over_budget(&self, spent: &Spent, input: u64) -> Option<String> {
        let b = &self.policy.budget;
        let prices = &self.policy.cost;
        // The call's input priced uncached: what it would cost at most.
        let request = prices.remote(
            spent.remote_input + input,
            spent.remote_cached,
            spent.remote_output + 1,
        );
        if let Some(cap) = b.max_usd_per_request
            && request > cap
        {
            return Some(format!(
                "budget: this request would spend ${request:.6} at the remote, over its ${cap} cap"
            ));
        }
        if let Some(cap) = b.max_usd_per_day {
            let today = self.ledger().spent_today + request;
            if today > cap {
                return Some(format!(
                    "budget: ${today:.6} at the remote today would pass the ${cap} daily cap"
                ));
            }
        }
        None
    }

    /// Whether the share cap lets one more request escalate.
    fn share_allows(&self) -> Option<String> {
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
    /// replaced).
    pub fn answer(
        &self,
        ask: &Ask,
        interrupt: Interrupt,
        emit: &mut dyn FnMut(&[u32]),
    ) -> Result<Answer, AgentError> {
        self.ledger().requests += 1;
        let p = &ask.params;
        let s = Sampling {
            temperature: p.temperature,
            top_p: p.top_p,
        };
        let mut spent = Spent::default();
        // The student's own answer first where the policy judges it.
        let local = match self.policy.route {
            Route::All => None,
            Route::Confidence | Route::None => {
                let t0 = Instant::now();
                let mut rng = p.seed;
                let tokens = self
                    .student
                    .decode(&ask.prompt, p.max_tokens, s, &p.stop, &mut rng, interrupt)
                    .map_err(AgentError::Local)?;
                spent.local_seconds += t0.elapsed().as_secs_f64();
                spent.local_read += ask.prompt.len() as u64;
                spent.local_written += tokens.len() as u64;
                Some(tokens)
            }
        };
        let signals = local.as_deref().map(Signals::of);
        let why = match (self.policy.route, &signals) {
            (Route::All, _) => Some(format!(
                "policy {:?} escalates every request",
                self.policy.name
            )),
            (Route::Confidence, Some(sig)) => self.policy.confidence.escalate(sig),
            _ => None,
        };
        let stopped = |ids: &[u32]| {
            if ids.last().is_some_and(|id| p.stop.contains(id)) {
                FinishReason::Stop
            } else {
                FinishReason::Length
            }
        };
        let local_ids = |tokens: &Option<Vec<student::Token>>| -> Option<Vec<u32>> {
            tokens.as_ref().map(|t| t.iter().map(|t| t.id).collect())
        };
        let mut report = Report {
            answered_by: AnsweredBy::Local,
            policy: self.policy.name.clone(),
            escalated: false,
            reason: why.clone(),
            signals,
            verify: None,
            remote_error: None,
            usage: Usage::default(),
            cost: Cost::of(&Usage::default(), &self.policy.cost),
        };
        let blocked = why.as_ref().and_then(|_| {
            self.share_allows()
                .or_else(|| self.over_budget(&spent, ask.prompt.len() as u64))
        });
        let (ids, finish) = match (why, blocked) {
            (None, _) => {
                let ids = local_ids(&local).expect("an unescalated request was answered locally");
                emit(&ids);
                let finish = stopped(&ids);
                (ids, finish)
            }
            (Some(_), Some(blocked)) => {
                report.reason = Some(blocked);
                let ids = match local_ids(&local) {
                    Some(ids) => ids,
                    None => self.finish_locally(&ask.prompt, &[], p, &mut spent, interrupt)?,
                };
                emit(&ids);
                let finish = stopped(&ids);
                (ids, finish)
            }
            (Some(_), None) => {
                report.escalated = true;
                self.ledger().escalated += 1;
                match self.escalate(ask, &mut spent, &mut report, interrupt, emit) {
                    Ok(done) => done,
                    Err((e, partial)) => {
                        if self.policy.on_remote_error == OnRemoteError::Error {
                            return Err(AgentError::Remote(e));
                        }
                        report.remote_error = Some(e.to_string());
                        report.answered_by = AnsweredBy::Local;
                        // The student's own answer where it wrote one and nothing was sent
                        // yet; else it finishes what was kept.
                        let ids = match (partial.is_empty(), local_ids(&local)) {
                            (true, Some(ids)) => {
                                emit(&ids);
                                ids
                            }
                            _ => {
                                let rest = self.finish_locally(
                                    &ask.prompt,
                                    &partial,
                                    p,
                                    &mut spent,
                                    interrupt,
                                )?;
                                emit(&rest[partial.len()..]);
                                rest
                            }
                        };
                        let finish = stopped(&ids);
                        (ids, finish)
                    }
                }
            }
        };
        report.usage = Usage {
            prompt_tokens: ask.prompt.len() as u64,
            completion_tokens: ids.len() as u64,
            local_read: spent.local_read,
            local_written: spent.local_written,
            local_seconds: spent.local_seconds,
            remote_input: spent.remote_input,
            remote_cached: spent.remote_cached,
            remote_output: spent.remote_output,
            remote_calls: spent.remote_calls,
            remote_seconds: spent.remote_seconds,
        };
        report.cost = Cost::of(&report.usage, &self.policy.cost);
        self.ledger().spent_today += report.cost.remote_usd;
        Ok(Answer {
            ids,
            finish,
            report,
        })
    }

    /// The escalation the policy names. On failure: the error and the ids already final (emitted).
    #[allow(clippy::type_complexity)]
    fn escalate(
        &self,
        ask: &Ask,
        spent: &mut Spent,
        report: &mut Report,
        interrupt: Interrupt,
        emit: &mut dyn FnMut(&[u32]),
    ) -> Result<(Vec<u32>, FinishReason), (TeacherError, Vec<u32>)> {
        match self.policy.escalate_by {
            EscalateBy::Remote => {
                let t0 = Instant::now();
                let g = self
                    .remote
                    .generate(&ask.prompt, &ask.params)
                    .map_err(|e| (e, Vec::new()))?;
                spent.remote_seconds += t0.elapsed().as_secs_f64();
                spent.remote_calls += 1;
                spent.remote_input += ask.prompt.len() as u64;
                spent.remote_output += g.ids.len() as u64;
                report.answered_by = AnsweredBy::Remote;
                emit(&g.ids);
                Ok((g.ids, g.finish))
            }
            EscalateBy::Verify => {
                let mut budget_stop = None;
                let before = *spent;
                let mut allow = |s: &Spent, input: u64| {
                    let mut total = *s;
                    total.remote_input += before.remote_input;
                    total.remote_cached += before.remote_cached;
                    total.remote_output += before.remote_output;
                    budget_stop = self.over_budget(&total, input);
                    budget_stop.is_none()
                };
                let run = verify::cascade(
                    &self.student,
                    self.remote.as_ref(),
                    &ask.prompt,
                    &ask.params,
                    &self.policy.verify,
                    interrupt,
                    &mut allow,
                    emit,
                );
                let (c, error) = match run {
                    Ok(c) => (c, None),
                    Err(stopped) => (stopped.partial, Some(stopped.error)),
                };
                spent.add(&c.spent);
                report.answered_by = AnsweredBy::Cascade;
                report.verify = Some(c.trace);
                match (error, budget_stop) {
                    (Some(e), _) => Err((e, c.ids)),
                    (None, Some(reason)) => Err((TeacherError::Request(reason), c.ids)),
                    (None, None) => Ok((c.ids, c.finish)),
                }
            }
        }
    }

    /// `kept` and the student's continuation after it, to the request's length.
    fn finish_locally(
        &self,
        prompt: &[u32],
        kept: &[u32],
        p: &GenerateParams,
        spent: &mut Spent,
        interrupt: Interrupt,
    ) -> Result<Vec<u32>, AgentError> {
        let mut ids = kept.to_vec();
        if ids.last().is_some_and(|id| p.stop.contains(id)) || ids.len() >= p.max_tokens {
            return Ok(ids);
        }
        let mut context = prompt.to_vec();
        context.extend(kept);
        let t0 = Instant::now();
        let mut rng = p.seed ^ kept.len() as u64;
        let s = Sampling {
            temperature: p.temperature,
            top_p: p.top_p,
        };
        let tokens = self
            .student
            .decode(
                &context,
                p.max_tokens - ids.len(),
                s,
                &p.stop,
                &mut rng,
                interrupt,
            )
            .map_err(AgentError::Local)?;
        spent.local_seconds += t0.elapsed().as_secs_f64();
        spent.local_read += context.len() as u64;
        spent.local_written += tokens.len() as u64;
        ids.extend(tokens.iter().map(|t| t.id));
        Ok(ids)
    }
}
