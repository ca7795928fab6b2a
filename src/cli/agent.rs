//! `k3mini agent`: the student as a local agent with K3 on call.

use super::serve::{ServeArgs, announce, stop_on_ctrl_c};
use anyhow::Result;
use clap::Subcommand;
use k3mini::agent::bench::{self, Settings};
use k3mini::agent::calibrate::Target;
use k3mini::agent::policy::{EscalateBy, Policy};
use k3mini::agent::student::Student;
use k3mini::agent::traffic::Traffic;
use k3mini::agent::{Agent, server};
use k3mini::device::DeviceList;
use k3mini::teachers::{connect_served, open_local, resolve};
use k3mini_teacher::Teacher;
use k3mini_teacher::client::{Api, ClientOptions};
use k3mini_teacher::local::Engine;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn api(s: &str) -> Result<Api, String> {
    match s {
        "vllm" => Ok(Api::Vllm),
        "sglang" => Ok(Api::Sglang),
        "openai" => Ok(Api::Openai),
        _ => Err(format!("{s:?}: the APIs are vllm, sglang, openai")),
    }
}

fn escalate_by(s: &str) -> Result<EscalateBy, String> {
    match s {
        "remote" => Ok(EscalateBy::Remote),
        "verify" => Ok(EscalateBy::Verify),
        _ => Err(format!("{s:?}: escalate by remote or verify")),
    }
}

/// The student and the remote, as every agent command takes them.
#[derive(clap::Args)]
pub struct Sides {
    /// The student: a .gguf (k3mini's GGUF export) or a built-in model name.
    #[arg(long)]
    local: String,
    /// The remote: http://host:port of a server k3mini's clients speak (comma-separated for
    /// several). Its API key, if it wants one, from K3MINI_REMOTE_API_KEY.
    #[arg(long, value_delimiter = ',', required = true)]
    remote: Vec<String>,
    /// The remote's API: vllm, sglang or openai.
    #[arg(long, default_value = "vllm", value_parser = api)]
    remote_api: Api,
    /// Seconds one remote call may take.
    #[arg(long, default_value_t = 60)]
    remote_timeout: u64,
    /// Attempts after a remote call's first (on connection errors, timeouts, 429 and 5xx).
    #[arg(long, default_value_t = 1)]
    remote_retries: usize,
    /// Where the student runs: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceList,
    /// The engine that runs it: llama-cpp (any GGUF llama.cpp runs) or burn.
    #[arg(long, default_value_t)]
    engine: Engine,
}

impl Sides {
    /// What besides the student's bytes shapes its answers and timings, and the remote's.
    fn setup(&self) -> String {
        format!(
            "engine {}, device {}, remote {} ({:?})",
            self.engine,
            self.device,
            self.remote.join(","),
            self.remote_api
        )
    }

    /// The student GGUF's SHA-256, each policy refused unless it is for this student.
    fn student_sha256(&self, policies: &[&Policy]) -> Result<String> {
        let sha = k3mini_data::digest::sha256_file(&resolve(&self.local)?)?;
        for p in policies {
            p.check_student(&sha).map_err(anyhow::Error::msg)?;
        }
        Ok(sha)
    }

    /// The gateway under `policy`, and a line naming both sides.
    fn open(self, policy: Policy) -> Result<(Agent, String)> {
        let path = resolve(&self.local)?;
        let model = open_local(&path, self.engine, &self.device)?;
        let remote = connect_served(
            &self.remote,
            &model.tokenizer,
            ClientOptions {
                api: self.remote_api,
                // Whole contexts: a windowed score would verify against a cut context.
                max_request_tokens: model.context_length().max(2),
                window_overlap: 0,
                timeout: Duration::from_secs(self.remote_timeout.max(1)),
                retries: self.remote_retries,
                api_key: std::env::var("K3MINI_REMOTE_API_KEY").ok(),
                ..Default::default()
            },
        )?;
        let what = format!(
            "student {}, remote {}, policy {}",
            model.name(),
            remote.name(),
            policy.name
        );
        // vLLM's and OpenAI's scoring generates (and bills) one token; SGLang's none.
        let scoring_output = u64::from(self.remote_api != Api::Sglang);
        let student = Student::new(model);
        if policy.gate.constrain_calls {
            // Built now (a trie of the vocabulary), and refused now where it cannot be.
            student.call_grammars().map_err(|e| {
                anyhow::anyhow!("policy {}: [gate] constrain_calls: {e}", policy.name)
            })?;
        }
        let mut agent = Agent::new(student, Box::new(remote), scoring_output, policy);
        agent.remote_attempts = 1 + self.remote_retries as u64;
        Ok((agent, what))
    }
}

/// Where tasks come from and where their answers are kept.
#[derive(clap::Args)]
pub struct Measured {
    /// Tasks, JSONL (comma-separated for several files): `{"text"}` continuations, `{"prompt"}`
    /// or `{"messages"}` chats, each with an optional `id` and reference `answer`.
    #[arg(long, value_delimiter = ',', required = true)]
    tasks: Vec<PathBuf>,
    /// A bench TOML: max_tokens, agree_at, policies, [verify], [cost].
    #[arg(long)]
    bench: Option<PathBuf>,
    /// Where each task's answers (local, remote, verify) are cached: `runs.jsonl` in it.
    #[arg(long, default_value = "agent-runs")]
    runs: PathBuf,
    /// Score code tasks by running their tests: model-written Python, run in the bubblewrap
    /// sandbox (refused where none can be made).
    #[arg(long)]
    run_tests: bool,
    #[arg(long)]
    quiet: bool,
}

impl Measured {
    /// The settings and the tasks, read and checked before anything is measured.
    fn read(&self) -> Result<(Settings, Vec<bench::Task>)> {
        let mut settings = match &self.bench {
            Some(path) => Settings::read(path)?,
            None => Settings::default(),
        };
        settings.run_tests |= self.run_tests;
        let mut tasks = Vec::new();
        for path in &self.tasks {
            tasks.extend(bench::read_tasks(path)?);
        }
        bench::check_tasks(&tasks, &settings)?;
        Ok((settings, tasks))
    }

    /// The tasks' records, measured (or read back from the cache).
    fn measure(
        &self,
        agent: &mut Agent,
        sha: &str,
        setup: &str,
        settings: &Settings,
        tasks: &[bench::Task],
    ) -> Result<Vec<bench::Record>> {
        std::fs::create_dir_all(&self.runs)?;
        crate::cli::progress::set_quiet(self.quiet);
        bench::measure(
            agent,
            sha,
            setup,
            tasks,
            settings,
            &self.runs.join("runs.jsonl"),
        )
        .map_err(Into::into)
    }
}

#[derive(Subcommand)]
pub enum AgentCommand {
    /// Serve the student with the remote on call, behind OpenAI's /v1/completions and
    /// /v1/chat/completions (streaming included); every answer says who answered, why, and what
    /// it cost against sending it all to the remote.
    Serve {
        #[command(flatten)]
        sides: Sides,
        /// A built-in policy (verify, confidence, gate, local, remote) or a policy .toml.
        #[arg(long, default_value = "verify")]
        policy: String,
        /// Write every escalated request, scored once more by the remote, as teacher-signal
        /// shards here (top-k as the policy's [verify] k), for `k3mini train` with
        /// `distill.mode = "traffic"`.
        #[arg(long)]
        traffic: Option<PathBuf>,
        /// Stop writing escalations into --traffic once its shards hold this many bytes (the
        /// answers still go out, each report saying so).
        #[arg(long)]
        traffic_max_bytes: Option<u64>,
        #[command(flatten)]
        serve: ServeArgs,
    },
    /// Answer tasks all-local, all-remote and by the verify cascade (cached), replay every
    /// policy on them, and report quality, cost, latency and the routing figures (Markdown,
    /// JSON, and the cost–quality plot as SVG).
    Bench {
        #[command(flatten)]
        sides: Sides,
        #[command(flatten)]
        measured: Measured,
        /// Policy files replayed beside those the bench TOML names.
        #[arg(long, value_delimiter = ',')]
        policy: Vec<String>,
        /// Where the report goes.
        #[arg(long, default_value = "agent-bench")]
        out: PathBuf,
    },
    /// Set the confidence policy's threshold from held-out tasks for a target quality or
    /// escalation share; writes a policy file tied to this student's GGUF.
    Calibrate {
        #[command(flatten)]
        sides: Sides,
        #[command(flatten)]
        measured: Measured,
        /// The least mean quality to reach, at the least cost.
        #[arg(
            long,
            conflicts_with = "max_share",
            required_unless_present = "max_share"
        )]
        target_quality: Option<f64>,
        /// The largest share of requests to escalate, at the best quality.
        #[arg(long)]
        max_share: Option<f64>,
        /// How the policy escalates: remote (the request whole) or verify.
        #[arg(long, default_value = "remote", value_parser = escalate_by)]
        escalate_by: EscalateBy,
        /// The policy file to write.
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(cmd: AgentCommand) -> Result<()> {
    match cmd {
        AgentCommand::Serve {
            sides,
            policy,
            traffic,
            traffic_max_bytes,
            serve: args,
        } => {
            let policy = Policy::resolve(&policy).map_err(anyhow::Error::msg)?;
            if policy.student_sha256.is_some() {
                sides.student_sha256(&[&policy])?;
            }
            let (addr, options) = args.options()?;
            // Refused before the student loads; the warning printed once it listens.
            let tests_warning = server::check_policy(&policy, &options.limits)?;
            let (mut agent, what) = sides.open(policy)?;
            if let Some(dir) = traffic {
                let tokenizer = &agent.student.model.tokenizer;
                agent.traffic = Some(Traffic::open(
                    &dir,
                    agent.remote.name(),
                    &tokenizer.fingerprint(),
                    agent.policy.verify.k,
                    agent.remote.vocab_size(),
                    traffic_max_bytes,
                )?);
            }
            let stop = stop_on_ctrl_c()?;
            let limits = options.limits.clone();
            server::serve(agent, &addr, options, stop, |at| {
                announce(&at, &what, &limits);
                if let Some(w) = tests_warning {
                    eprintln!("{w}");
                }
            })?;
            Ok(())
        }
        AgentCommand::Bench {
            sides,
            measured,
            policy,
            out,
        } => {
            let (settings, tasks) = measured.read()?;
            // Policy files are checked before any money is spent at the remote; a bench file's
            // are relative to it.
            let base = measured
                .bench
                .as_ref()
                .and_then(|b| b.parent())
                .unwrap_or(Path::new(""));
            let mut policies = Vec::new();
            let named = settings
                .policies
                .iter()
                .map(|p| base.join(p).display().to_string());
            for spec in named.chain(policy) {
                policies.push(Policy::resolve(&spec).map_err(anyhow::Error::msg)?);
            }
            let sha = sides.student_sha256(&policies.iter().collect::<Vec<_>>())?;
            let setup = sides.setup();
            let (mut agent, _) = sides.open(Policy::built_in("local").expect("built-in"))?;
            let records = measured.measure(&mut agent, &sha, &setup, &settings, &tasks)?;
            let report = bench::report(&tasks, &records, &policies, &settings, &out)?;
            print!("{}", report.markdown());
            println!("\nWritten: {}", out.display());
            Ok(())
        }
        AgentCommand::Calibrate {
            sides,
            measured,
            target_quality,
            max_share,
            escalate_by,
            out,
        } => {
            let target = match (target_quality, max_share) {
                (Some(q), _) => Target::Quality(q),
                (_, Some(s)) => Target::Share(s),
                _ => unreachable!("clap requires one"),
            };
            let (settings, tasks) = measured.read()?;
            let sha = sides.student_sha256(&[])?;
            let setup = sides.setup();
            let (mut agent, _) = sides.open(Policy::built_in("local").expect("built-in"))?;
            let records = measured.measure(&mut agent, &sha, &setup, &settings, &tasks)?;
            let files: Vec<String> = measured
                .tasks
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            let c = k3mini::agent::calibrate::calibrate_into(
                &tasks,
                &records,
                &settings,
                target,
                escalate_by,
                &sha,
                &files.join(", "),
                &out,
            )?;
            println!(
                "{}: escalate when {} crosses {} ({:.1}% of {} tasks escalated, quality {:.3}, \
                 ${:.4} per 1,000 requests)",
                out.display(),
                c.signal.name(),
                c.threshold,
                c.point.share * 100.0,
                tasks.len(),
                c.point.quality,
                c.point.usd_per_1k
            );
            Ok(())
        }
    }
}
