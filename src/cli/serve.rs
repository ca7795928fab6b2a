//! What every k3mini server takes on the command line (`teacher serve`, `agent serve`): where it
//! listens, its queue, its time limits and its API key; and the line it prints when it listens.

use anyhow::Result;
use k3mini_http::{Limits, exposure_warning};
use k3mini_teacher::server::ServeOptions;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (printed on the first line).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Model requests running or waiting for the model, at most (it runs one at a time);
    /// more are answered 503 with Retry-After. `/health` and `/v1/models` are never queued.
    #[arg(long, default_value_t = 3)]
    max_queued: usize,
    /// Seconds one model request may take, queueing included, before it is stopped with a
    /// 504 (0: no limit).
    #[arg(long, default_value_t = 300)]
    request_timeout: u64,
    /// Seconds a connection has to send a whole request head, counted from connecting or
    /// from the previous response (so also how long an idle keep-alive connection stays).
    #[arg(long, default_value_t = 10)]
    header_timeout: u64,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (as vLLM's
    /// --api-key). Default: the K3MINI_API_KEY environment variable, which `ps` does not show.
    #[arg(long)]
    api_key: Option<String>,
    /// A host name clients may call the server by (its `Host` header), besides IP addresses and
    /// localhost; repeat for several. Requests naming another are refused (421), which stops a
    /// web page reaching the server through DNS rebinding.
    #[arg(long = "allowed-host")]
    allowed_hosts: Vec<String>,
    /// A web page origin (`https://app.example:8443`, or `*`) that may call the server from a
    /// browser, with CORS; repeat for several. Requests from other pages are refused (403).
    #[arg(long = "allowed-origin")]
    allowed_origins: Vec<String>,
    /// Connections one client (an IPv4 address, or an IPv6 /64) may hold open; the server's
    /// others are kept for the rest.
    #[arg(long, default_value_t = 32)]
    max_connections_per_peer: usize,
}

impl ServeArgs {
    /// The address to bind and the server's options, checked.
    pub fn options(self) -> Result<(String, ServeOptions)> {
        let api_key = self
            .api_key
            .or_else(|| std::env::var("K3MINI_API_KEY").ok());
        if let Some(key) = &api_key {
            anyhow::ensure!(
                !key.is_empty() && key.bytes().all(|b| b.is_ascii_graphic()),
                "the API key is empty or holds spaces or control characters (a trailing \
                 newline?): no client could send it in a header"
            );
        }
        anyhow::ensure!(
            self.header_timeout > 0,
            "--header-timeout must be at least 1 second"
        );
        anyhow::ensure!(
            self.max_connections_per_peer > 0,
            "--max-connections-per-peer must be at least 1"
        );
        let options = ServeOptions {
            max_queued: self.max_queued,
            request_timeout: (self.request_timeout > 0)
                .then(|| Duration::from_secs(self.request_timeout)),
            limits: Limits {
                header_timeout: Duration::from_secs(self.header_timeout),
                api_key,
                allowed_hosts: self.allowed_hosts,
                allowed_origins: self.allowed_origins,
                max_per_peer: self.max_connections_per_peer,
                ..Default::default()
            },
        };
        Ok((format!("{}:{}", self.host, self.port), options))
    }
}

/// The stop flag Ctrl-C (or SIGTERM: a service manager's stop) sets.
pub fn stop_on_ctrl_c() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let on_ctrl_c = stop.clone();
    ctrlc::set_handler(move || on_ctrl_c.store(true, Ordering::SeqCst))?;
    Ok(stop)
}

/// Prints where the server listens on the first line (scripts and tests read the port from it),
/// and the exposure warning where there is one.
pub fn announce(addr: &SocketAddr, what: &str, limits: &Limits) {
    println!("listening on http://{addr} ({what})");
    let _ = std::io::Write::flush(&mut std::io::stdout());
    if let Some(w) = exposure_warning(addr, limits) {
        eprintln!("{w}");
    }
}
