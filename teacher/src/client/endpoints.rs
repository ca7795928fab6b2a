//! The endpoints a client spreads its requests over, and the one place requests are sent: typed
//! bodies out, typed answers back; round-robin, retries with backoff and jitter, the API key, and
//! the mapping of failures to errors that say what happened.

use super::{ClientOptions, server_err};
use crate::TeacherError;
use crate::wire::ErrorResponse;
use k3mini_data::rng::splitmix64;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Pooled connections idle longer than this are not reused: below the server's default head
/// deadline (10 s), which also closes idle keep-alive connections.
const MAX_IDLE: Duration = Duration::from_secs(5);

pub(crate) struct Endpoints {
    urls: Vec<String>,
    agent: ureq::Agent,
    retries: usize,
    backoff: Duration,
    /// `Bearer …`, where the server wants a key.
    authorization: Option<String>,
    next: AtomicUsize,
    jitter: AtomicU64,
    /// Requests sent (or tried) since it was made, and those answered: each sent may be billed.
    sent: AtomicU64,
    answered: AtomicU64,
}

/// What one attempt came to.
enum Attempt<T> {
    Done(T),
    /// Worth another try on the next endpoint (connection error, timeout, 429, 5xx).
    Retry(String),
}

impl Endpoints {
    pub fn new(urls: &[String], opts: &ClientOptions) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(opts.timeout))
            .max_idle_age(MAX_IDLE)
            .http_status_as_error(false)
            .build()
            .into();
        Self {
            urls: urls
                .iter()
                .map(|e| e.trim_end_matches('/').to_string())
                .collect(),
            agent,
            retries: opts.retries,
            backoff: opts.backoff,
            authorization: opts.api_key.as_ref().map(|k| format!("Bearer {k}")),
            next: AtomicUsize::new(0),
            jitter: AtomicU64::new(0x9E37_79B9),
            sent: AtomicU64::new(0),
            answered: AtomicU64::new(0),
        }
    }

    /// Requests sent (or tried: a connection that failed counts) since it was made, and those
    /// answered with a 200.
    pub fn requests(&self) -> crate::Requests {
        crate::Requests {
            sent: self.sent.load(Ordering::SeqCst),
            answered: self.answered.load(Ordering::SeqCst),
        }
    }

    pub fn get<R: DeserializeOwned>(&self, path: &str) -> Result<R, TeacherError> {
        self.send(path, None::<&()>)
    }

    pub fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, TeacherError> {
        self.send(path, Some(body))
    }

    fn send<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: Option<&B>,
    ) -> Result<R, TeacherError> {
        let body = body
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| server_err(format!("{path}: the request does not serialise: {e}")))?;
        let mut last = String::new();
        let mut delay = self.backoff;
        for attempt in 0..=self.retries {
            if attempt > 0 {
                let mut s = self.jitter.fetch_add(1, Ordering::Relaxed);
                let jitter = 1.0 + (splitmix64(&mut s) % 1000) as f64 / 2000.0;
                std::thread::sleep(delay.mul_f64(jitter));
                delay *= 2;
            }
            let endpoint = &self.urls[self.next.fetch_add(1, Ordering::Relaxed) % self.urls.len()];
            let url = format!("{endpoint}{path}");
            self.sent.fetch_add(1, Ordering::SeqCst);
            match self.attempt(&url, body.as_deref())? {
                Attempt::Done(text) => {
                    self.answered.fetch_add(1, Ordering::SeqCst);
                    return serde_json::from_str(&text).map_err(|e| {
                        server_err(format!(
                            "{url}: the response is not what the API sends: {e}"
                        ))
                    });
                }
                Attempt::Retry(why) => last = why,
            }
        }
        Err(server_err(format!(
            "giving up after {} attempts; last: {last}",
            self.retries + 1
        )))
    }

    fn authorized<B>(&self, r: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.authorization {
            Some(a) => r.header("Authorization", a),
            None => r,
        }
    }

    /// One request to `url`: its body on a 200, a retry for what another try may cure, an error
    /// for what it will not (a 4xx: the request or the key is wrong).
    fn attempt(&self, url: &str, body: Option<&str>) -> Result<Attempt<String>, TeacherError> {
        let sent = match body {
            Some(b) => self
                .authorized(self.agent.post(url))
                .header("Content-Type", "application/json")
                .send(b),
            None => self.authorized(self.agent.get(url)).call(),
        };
        let mut response = match sent {
            Ok(r) => r,
            Err(e) => return Ok(Attempt::Retry(format!("{url}: {e}"))),
        };
        let status = response.status().as_u16();
        let text = match response
            .body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_string()
        {
            Ok(t) => t,
            Err(e) => return Ok(Attempt::Retry(format!("{url}: reading the response: {e}"))),
        };
        // The server's own words where it sent an error in vLLM's shape.
        let said = || match serde_json::from_str::<ErrorResponse>(&text) {
            Ok(e) => e.error.message,
            Err(_) => text.chars().take(500).collect(),
        };
        match status {
            200 => Ok(Attempt::Done(text)),
            429 | 500.. => Ok(Attempt::Retry(format!("{url}: HTTP {status}: {}", said()))),
            401 | 403 => Err(server_err(format!(
                "{url}: HTTP {status}: {} ({})",
                said(),
                if self.authorization.is_some() {
                    "the API key was refused"
                } else {
                    "the server wants an API key: name the environment variable holding it in \
                     teacher.api_key_env"
                }
            ))),
            _ => Err(server_err(format!("{url}: HTTP {status}: {}", said()))),
        }
    }
}
