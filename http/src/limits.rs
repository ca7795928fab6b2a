//! What a server allows: connections, heads, bodies, deadlines, the API key, and the hosts and
//! origins browsers may call it by.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct Limits {
    pub max_connections: usize,
    /// Connections from one client (an IPv4 address, or an IPv6 /64), at most, in the slots and
    /// again in the overflow pool.
    pub max_per_peer: usize,
    /// A request body, read whole.
    pub max_body: u64,
    /// The request line and headers together.
    pub max_head: usize,
    pub max_headers: usize,
    /// A request head must arrive within this of the previous response or of connecting, and
    /// its body within this of its head.
    pub header_timeout: Duration,
    /// Required as `Authorization: Bearer …` on every path but `/health`.
    pub api_key: Option<String>,
    /// Host names a request's `Host` may give besides IP addresses and `localhost`.
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`) whose pages may call the server (CORS); `*` for any.
    pub allowed_origins: Vec<String>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_per_peer: 32,
            max_body: 64 << 20,
            max_head: 64 << 10,
            max_headers: 100,
            header_timeout: Duration::from_secs(10),
            api_key: None,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
        }
    }
}
