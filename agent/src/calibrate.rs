//! `agent calibrate`: the confidence policy's threshold from held-out tasks. The tasks are
//! measured as the bench measures them ([`super::bench`]: the student's answer labelled right or
//! wrong by the task's checker or by its agreement with the remote), every signal is swept over
//! every threshold, and the cheapest setting that meets the target wins:
//!
//! - `Target::Quality(q)`: mean quality ≥ q at the least $ per request;
//! - `Target::Share(s)`: at most a share `s` of requests escalated, at the best quality (then the
//!   least $).
//!
//! The result is a policy file tied to the student's GGUF by its SHA-256: the thresholds mean
//! nothing for another model's signals, so the gateway and the bench refuse it for one.

use super::bench::{Point, Record, Row, Settings, Task, rows, sweep};
use super::confidence::Signal;
use super::policy::{EscalateBy, Policy};
use crate::error::{Error, Result, at, refuse};
use std::path::Path;

/// What to calibrate for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    Quality(f64),
    Share(f64),
}

/// The setting chosen, and what it measured on the calibration tasks.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibrated {
    pub signal: Signal,
    pub threshold: f32,
    pub point: Point,
    pub policy: Policy,
    /// The policy file's text.
    pub toml: String,
}

fn better(target: Target, a: &Point, b: &Point) -> bool {
    let cheaper = a.usd_per_1k < b.usd_per_1k;
    match target {
        Target::Quality(_) => cheaper,
        Target::Share(_) => a.quality > b.quality || (a.quality == b.quality && cheaper),
    }
}

fn meets(target: Target, p: &Point) -> bool {
    match target {
        Target::Quality(q) => p.quality >= q - 1e-12,
        Target::Share(s) => p.share <= s + 1e-12,
    }
}

/// The best single-signal threshold for `target`, escalating `by`, as a policy for the student
/// whose GGUF has `student_sha256`; an error naming the best reachable figure where none meets it.
pub fn calibrate(
    rows: &[Row],
    target: Target,
    by: EscalateBy,
    settings: &Settings,
    student_sha256: &str,
    provenance: &str,
) -> Result<Calibrated> {
    match target {
        Target::Quality(q) if !(0.0..=1.0).contains(&q) => {
            return Err(refuse!("the target quality {q} is not in [0, 1]"));
        }
        Target::Share(s) if !(0.0..=1.0).contains(&s) => {
            return Err(refuse!(
                "the escalation share {s} is not in [0, 1] (a fraction, not a percentage)"
            ));
        }
        _ => {}
    }
    let mut best: Option<(Signal, f32, Point)> = None;
    let mut reach = (0.0f64, 1.0f64);
    for &signal in &Signal::ALL {
        for (t, p) in sweep(rows, signal, by) {
            reach = (reach.0.max(p.quality), reach.1.min(p.share));
            if meets(target, &p) && best.as_ref().is_none_or(|(_, _, b)| better(target, &p, b)) {
                best = Some((signal, t, p));
            }
        }
    }
    let Some((signal, threshold, point)) = best else {
        return Err(Error::Refused(match target {
            Target::Quality(q) => format!(
                "no threshold reaches quality {q} on these tasks (the best is {:.3}, the remote's \
                 answer on every escalation)",
                reach.0
            ),
            Target::Share(s) => format!("no threshold escalates at most {s} of these tasks"),
        }));
    };
    let key = signal.threshold_key();
    let by_name = match by {
        EscalateBy::Remote => "remote",
        EscalateBy::Verify => "verify",
    };
    let table = |t: Result<String, toml::ser::Error>| t.map_err(|e| Error::Refused(e.to_string()));
    let cost = table(toml::to_string(&settings.cost))?;
    let verify = table(toml::to_string(&settings.verify))?;
    let toml = format!(
        "# Calibrated by `k3mini agent calibrate` {provenance}.\n\
         # On those tasks: {:.1}% escalated, quality {:.3}, accuracy {:.3}, ${:.4} per 1,000 requests,\n\
         # with answers of up to {} tokens, or a task's own max_tokens (longer answers' signals differ).\n\
         route = \"confidence\"\n\
         escalate_by = \"{by_name}\"\n\
         student_sha256 = \"{student_sha256}\"\n\n\
         [confidence]\n{key} = {threshold:?}\n\n[verify]\n{verify}\n[cost]\n{cost}",
        point.share * 100.0,
        point.quality,
        point.accuracy,
        point.usd_per_1k,
        settings.max_tokens,
    );
    // The file must read back as the policy it describes.
    let policy = Policy::parse(&toml, "calibrated").map_err(Error::Refused)?;
    if !(policy.confidence.set() == [(signal, threshold)]) {
        return Err(refuse!(
            "the calibrated threshold {key} = {threshold} did not read back"
        ));
    }
    Ok(Calibrated {
        signal,
        threshold,
        point,
        policy,
        toml,
    })
}

/// Calibrates on the measured `records` of `tasks` and writes the policy file `out`
/// (atomically); `provenance` names the tasks in its header.
#[allow(clippy::too_many_arguments)]
pub fn calibrate_into(
    tasks: &[Task],
    records: &[Record],
    settings: &Settings,
    target: Target,
    by: EscalateBy,
    student_sha256: &str,
    provenance: &str,
    out: &Path,
) -> Result<Calibrated> {
    let rows = rows(tasks, records, settings)?;
    let c = calibrate(
        &rows,
        target,
        by,
        settings,
        student_sha256,
        &format!("on {} tasks from {provenance}", tasks.len()),
    )?;
    k3mini_durable::write(out, c.toml.as_bytes()).map_err(at(out.display().to_string()))?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{Outcome, Row};
    use crate::confidence::Signals;

    fn outcome(score: f64, usd: f64) -> Outcome {
        Outcome {
            score,
            correct: score >= 0.5,
            call: None,
            usd,
            seconds: 1.0,
        }
    }

    /// Four tasks: the student is right on the two it is sure of (mean logprob −0.1, −0.2) and
    /// wrong on the two it is not (−2, −3); the remote is right on all.
    fn rows() -> Vec<Row> {
        [(-0.1, true), (-2.0, false), (-0.2, true), (-3.0, false)]
            .into_iter()
            .map(|(lp, right)| Row {
                local: outcome(f64::from(u8::from(right)), 0.001),
                remote: outcome(1.0, 0.01),
                verify: outcome(1.0, 0.005),
                signals: Signals {
                    tokens: 4,
                    mean_logprob: lp,
                    min_logprob: lp,
                    // Entropy says nothing: the same for all.
                    entropy_p50: 1.0,
                    entropy_p90: 1.0,
                    margin_p10: 0.5,
                },
                gate_fails: false,
            })
            .collect()
    }

    #[test]
    fn a_target_outside_zero_to_one_is_refused() {
        let err = calibrate(
            &rows(),
            Target::Share(50.0),
            EscalateBy::Remote,
            &Settings::default(),
            "ab",
            "",
        )
        .unwrap_err();
        assert!(err.to_string().contains("not a percentage"), "{err}");
    }

    #[test]
    fn the_cheapest_threshold_that_meets_the_target_is_written_for_this_student() {
        let rows = rows();
        let c = calibrate(
            &rows,
            Target::Quality(1.0),
            EscalateBy::Remote,
            &Settings::default(),
            "ab",
            "here",
        )
        .unwrap();
        // Escalating exactly the two unsure tasks: between −2 and −0.2.
        assert!(matches!(c.signal, Signal::MeanLogprob | Signal::MinLogprob));
        assert_eq!(c.threshold, -1.1);
        assert_eq!((c.point.share, c.point.quality), (0.5, 1.0));
        assert!((c.point.usd_per_1k - (4.0 * 0.001 + 2.0 * 0.01) / 4.0 * 1000.0).abs() < 1e-9);
        assert_eq!(c.policy.student_sha256.as_deref(), Some("ab"));
        assert!(
            c.policy
                .check_student("cd")
                .unwrap_err()
                .contains("calibrate")
        );
        assert!(c.policy.check_student("ab").is_ok());
        // Escalating by verify is cheaper here, and the file says so.
        let v = calibrate(
            &rows,
            Target::Quality(1.0),
            EscalateBy::Verify,
            &Settings::default(),
            "ab",
            "",
        )
        .unwrap();
        assert!(v.toml.contains("escalate_by = \"verify\""));
        assert!(v.point.usd_per_1k < c.point.usd_per_1k);
        // At most a quarter escalated: the least sure task only, quality 0.75.
        let s = calibrate(
            &rows,
            Target::Share(0.25),
            EscalateBy::Remote,
            &Settings::default(),
            "ab",
            "",
        )
        .unwrap();
        assert_eq!((s.point.share, s.point.quality), (0.25, 0.75));
        let err = calibrate(
            &rows,
            Target::Quality(1.5),
            EscalateBy::Remote,
            &Settings::default(),
            "ab",
            "",
        )
        .unwrap_err();
        assert!(err.to_string().contains("not in [0, 1]"), "{err}");
    }
}
