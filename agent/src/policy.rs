//! A gateway's policy: which requests go to the remote, how, and within what budget. Read once
//! from a TOML file, or named by a built-in (`verify`, `confidence`, `local`, `remote`), into a
//! checked [`Policy`] the gateway runs.
//!
//! ```toml
//! route = "confidence"    # which requests escalate: "confidence" (those the student is unsure
//!                         # of, or whose answer fails the gate), "gate" (fails the gate: not the
//!                         # JSON the request asked for), "all", or "none"
//! escalate_by = "verify"  # how: "verify" (the speculative cascade) or "remote" (sent whole)
//! on_remote_error = "local"   # a failing remote: answer locally, marked ("local"), or fail ("error")
//! student_sha256 = "…"    # the student a calibrated policy is for (`agent calibrate` writes it)
//! [confidence]            # thresholds (see confidence.rs); unset ones are not checked
//! min_mean_logprob = -1.5
//! [verify]                # k, draft, max_draft, min_acceptance, judge_after
//! [gate]                  # run_tests, test_seconds, constrain_calls (see gate.rs)
//! [budget]                # max_usd_per_request, max_usd_per_day, max_escalation_share
//! [cost]                  # input_per_mtok, output_per_mtok, hardware_per_hour, watts, per_kwh
//! ```

use super::confidence::Thresholds;
use super::cost::{MAX_PRICE, Prices};
use super::gate::GateSettings;
use super::verify::VerifySettings;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A policy file's size, at most (one is a few hundred bytes).
const MAX_POLICY_BYTES: u64 = 1 << 20;

/// Which requests go to the remote.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    /// Those whose local answer fails the gate ([`super::gate`]) or the confidence thresholds.
    Confidence,
    /// Those whose local answer fails the gate: not the JSON the request asked for.
    Gate,
    All,
    None,
}

/// How a request that escalates is answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EscalateBy {
    /// The student drafts, the remote verifies ([`super::verify`]).
    Verify,
    /// The remote answers the request whole.
    Remote,
}

/// What a failing remote (or a spent budget) leaves the client with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnRemoteError {
    /// The student's answer, marked as such.
    Local,
    /// An error (502).
    Error,
}

/// Caps on remote spending; an escalation they forbid is answered locally, marked.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Budget {
    pub max_usd_per_request: Option<f64>,
    /// Per UTC day, over every request this gateway served.
    pub max_usd_per_day: Option<f64>,
    /// The largest share of requests that may escalate (since the gateway started).
    pub max_escalation_share: Option<f64>,
}

impl Budget {
    fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("max_usd_per_request", self.max_usd_per_request),
            ("max_usd_per_day", self.max_usd_per_day),
        ] {
            if v.is_some_and(|v| !(0.0..=MAX_PRICE).contains(&v)) {
                return Err(format!(
                    "budget.{name} must be a number in [0, {MAX_PRICE}]"
                ));
            }
        }
        if self
            .max_escalation_share
            .is_some_and(|s| !(0.0..=1.0).contains(&s))
        {
            return Err("budget.max_escalation_share must be in [0, 1]".into());
        }
        Ok(())
    }
}

/// A checked policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// The built-in's name or the file's stem (responses name the policy that answered).
    #[serde(skip)]
    pub name: String,
    pub route: Route,
    #[serde(default = "verify")]
    pub escalate_by: EscalateBy,
    #[serde(default = "local")]
    pub on_remote_error: OnRemoteError,
    #[serde(default)]
    pub confidence: Thresholds,
    #[serde(default)]
    pub verify: VerifySettings,
    #[serde(default)]
    pub gate: GateSettings,
    #[serde(default)]
    pub budget: Budget,
    #[serde(default)]
    pub cost: Prices,
    /// The SHA-256 of the student GGUF whose signals the thresholds were calibrated on (`agent
    /// calibrate` writes it); such a policy is refused for any other student.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub student_sha256: Option<String>,
}

fn verify() -> EscalateBy {
    EscalateBy::Verify
}

fn local() -> OnRemoteError {
    OnRemoteError::Local
}

impl Policy {
    pub const BUILT_IN: &str = "verify, confidence, gate, local, remote";

    /// A built-in policy: `verify` (every request through the cascade), `confidence` (the
    /// student alone unless unsure or its answer fails the gate, then the remote whole), `gate`
    /// (the student alone unless its answer fails the gate), `local`, `remote`.
    pub fn built_in(name: &str) -> Option<Self> {
        let (route, escalate_by) = match name {
            "verify" => (Route::All, EscalateBy::Verify),
            "confidence" => (Route::Confidence, EscalateBy::Remote),
            "gate" => (Route::Gate, EscalateBy::Remote),
            "local" => (Route::None, EscalateBy::Remote),
            "remote" => (Route::All, EscalateBy::Remote),
            _ => return None,
        };
        Some(Self {
            name: name.into(),
            route,
            escalate_by,
            on_remote_error: OnRemoteError::Local,
            confidence: Thresholds::default(),
            verify: VerifySettings::default(),
            gate: GateSettings::default(),
            budget: Budget::default(),
            cost: Prices::default(),
            student_sha256: None,
        })
    }

    /// Refuses a calibrated policy for a student other than its own (by the GGUF's SHA-256).
    pub fn check_student(&self, student_sha256: &str) -> Result<(), String> {
        match &self.student_sha256 {
            Some(own) if own != student_sha256 => Err(format!(
                "policy {:?} was calibrated for the student GGUF with SHA-256 {own}, not this one ({student_sha256}): its thresholds mean nothing for another model's signals; run `k3mini agent calibrate` for this student",
                self.name
            )),
            _ => Ok(()),
        }
    }

    /// A built-in's name, or a policy file.
    pub fn resolve(spec: &str) -> Result<Self, String> {
        if let Some(p) = Self::built_in(spec) {
            return Ok(p);
        }
        let path = Path::new(spec);
        if path.extension().is_none_or(|e| e != "toml") {
            return Err(format!(
                "policy {spec:?}: neither a built-in ({}) nor a .toml file",
                Self::BUILT_IN
            ));
        }
        let text = k3mini_durable::read_small(path, MAX_POLICY_BYTES)
            .map_err(|e| format!("policy {}: {e}", path.display()))?;
        let name = path
            .file_stem()
            .map_or_else(|| spec.to_string(), |s| s.to_string_lossy().into_owned());
        Self::parse(&text, &name).map_err(|e| format!("policy {}: {e}", path.display()))
    }

    /// A policy file's text, checked.
    pub fn parse(text: &str, name: &str) -> Result<Self, String> {
        let mut p: Policy = toml::from_str(text).map_err(|e| e.to_string())?;
        p.name = name.into();
        p.check()?;
        Ok(p)
    }

    fn check(&self) -> Result<(), String> {
        self.confidence.check()?;
        self.verify.check()?;
        self.gate.check()?;
        self.budget.check()?;
        self.cost.check()?;
        if self.route == Route::Confidence && self.confidence.set().is_empty() {
            return Err("route = \"confidence\" needs at least one [confidence] threshold".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_ins_and_files_resolve_and_bad_ones_are_named() {
        for name in ["verify", "confidence", "gate", "local", "remote"] {
            assert_eq!(Policy::resolve(name).unwrap().name, name);
        }
        assert!(
            Policy::resolve("fast")
                .unwrap_err()
                .contains("neither a built-in")
        );
        let p = Policy::parse(
            "route = \"confidence\"\n[confidence]\nmax_entropy_p90 = 3.0\n[budget]\n\
             max_usd_per_day = 2.5\n[cost]\ninput_per_mtok = 1.0",
            "mine",
        )
        .unwrap();
        assert_eq!(p.escalate_by, EscalateBy::Verify);
        assert_eq!(p.confidence.max_entropy_p90, Some(3.0));
        // The default threshold stays unless the table replaces it: a table given is whole.
        assert_eq!(p.confidence.min_mean_logprob, None);
        assert_eq!(p.cost.output_per_mtok, Prices::default().output_per_mtok);
        let err = |t: &str| Policy::parse(t, "x").unwrap_err();
        assert!(err("route = \"sometimes\"").contains("unknown variant"));
        assert!(err("route = \"all\"\n[verify]\ndraft = 0").contains("draft"));
        assert!(err("route = \"all\"\n[budget]\nmax_escalation_share = 1.5").contains("share"));
        assert!(err("route = \"all\"\n[cost]\nwatts = -1").contains("cost.watts"));
        assert!(err("route = \"all\"\nthreshold = 1").contains("unknown field"));
        assert!(
            err("route = \"confidence\"\n[confidence]\nmin_mean_logprob = nan")
                .contains("not a number in")
        );
        // Every value is bounded: the review's accepted ones each refused by name.
        for (bad, named) in [
            ("[verify]\nk = 1000000", "k (1000000)"),
            ("[verify]\nmax_draft = 1000000000000", "max_draft"),
            ("[verify]\njudge_after = 0", "judge_after (0)"),
            ("[cost]\ninput_per_mtok = 1e308", "cost.input_per_mtok"),
            (
                "[budget]\nmax_usd_per_day = 1e300",
                "budget.max_usd_per_day",
            ),
            ("[confidence]\nmin_mean_logprob = -1e30", "mean_logprob"),
            ("[gate]\ntest_seconds = 1e9", "test_seconds"),
        ] {
            let e = err(&format!("route = \"confidence\"\n{bad}"));
            assert!(e.contains(named), "{bad}: {e}");
        }
        // A FIFO or a device is refused without being read (it would block, or never end).
        let dir = std::env::temp_dir().join(format!("k3mini-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.toml");
        let zero = dir.join("zero.toml");
        let _ = (std::fs::remove_file(&fifo), std::fs::remove_file(&zero));
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        for path in [&fifo, &zero] {
            let e = Policy::resolve(path.to_str().unwrap()).unwrap_err();
            assert!(e.contains("not a regular file"), "{e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
