//! `k3mini agent`: the student as a local agent with K3 on call.

use super::serve::{ServeArgs, announce, stop_on_ctrl_c};
use anyhow::Result;
use clap::Subcommand;
use k3mini::agent::policy::Policy;
use k3mini::agent::student::Student;
use k3mini::agent::{Agent, server};
use k3mini::device::DeviceList;
use k3mini::teachers::{connect_served, open_local, resolve};
use k3mini_teacher::Teacher;
use k3mini_teacher::client::{Api, ClientOptions};
use k3mini_teacher::local::Engine;
use std::time::Duration;

fn api(s: &str) -> Result<Api, String> {
    match s {
        "vllm" => Ok(Api::Vllm),
        "sglang" => Ok(Api::Sglang),
        "openai" => Ok(Api::Openai),
        _ => Err(format!("{s:?}: the APIs are vllm, sglang, openai")),
    }
}

#[derive(Subcommand)]
pub enum AgentCommand {
    /// Serve the student with the remote on call, behind OpenAI's /v1/completions and
    /// /v1/chat/completions (streaming included); every answer says who answered, why, and what
    /// it cost against sending it all to the remote.
    Serve {
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
        /// A built-in policy (verify, confidence, local, remote) or a policy .toml.
        #[arg(long, default_value = "verify")]
        policy: String,
        /// Seconds one remote call may take.
        #[arg(long, default_value_t = 60)]
        remote_timeout: u64,
        /// Attempts after a remote call's first (on connection errors, timeouts, 429 and 5xx).
        #[arg(long, default_value_t = 1)]
        remote_retries: usize,
        #[command(flatten)]
        serve: ServeArgs,
        /// Where the student runs: cpu or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: DeviceList,
        /// The engine that runs it: llama-cpp (any GGUF llama.cpp runs) or burn.
        #[arg(long, default_value_t)]
        engine: Engine,
    },
}

pub fn run(cmd: AgentCommand) -> Result<()> {
    match cmd {
        AgentCommand::Serve {
            local,
            remote,
            remote_api,
            policy,
            remote_timeout,
            remote_retries,
            serve: args,
            device,
            engine,
        } => {
            let policy = Policy::resolve(&policy).map_err(anyhow::Error::msg)?;
            let (addr, options) = args.options()?;
            let model = open_local(&resolve(&local)?, engine, &device)?;
            let remote = connect_served(
                &remote,
                &model.tokenizer,
                ClientOptions {
                    api: remote_api,
                    // Whole contexts: a windowed score would verify against a cut context.
                    max_request_tokens: model.context_length().max(2),
                    window_overlap: 0,
                    timeout: Duration::from_secs(remote_timeout.max(1)),
                    retries: remote_retries,
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
            let stop = stop_on_ctrl_c()?;
            let limits = options.limits.clone();
            // vLLM's and OpenAI's scoring generates (and bills) one token; SGLang's none.
            let scoring_output = u64::from(remote_api != Api::Sglang);
            let agent = Agent::new(
                Student::new(model),
                Box::new(remote),
                scoring_output,
                policy,
            );
            server::serve(agent, &addr, options, stop, |at| {
                announce(&at, &what, &limits)
            })?;
            Ok(())
        }
    }
}
