//! What a web page could make of a server on this machine, refused. A page the operator opens can
//! send any loopback server a CORS "simple" request (a `text/plain` or form `POST`) with no
//! preflight, and by DNS rebinding (its own name re-pointed at 127.0.0.1) read the answers too.
//! Three checks close that, and leave every client that is not a browser as it was:
//!
//! - **Host**: a rebound page's requests carry the page's own name as `Host`. Accepted: an IP
//!   address (a rebinding needs a name), `localhost`, or a name the operator allowed. Anything
//!   else is a 421. A request without `Host` (HTTP/1.0) passes: browsers always send one.
//! - **Origin**: browsers name the page's origin on cross-site requests; a request naming one the
//!   operator did not allow is a 403. Allowed origins get CORS headers and their preflights
//!   answered; there are none by default.
//! - **Content-Type**: a `POST` must say `application/json`, which no simple request can (415).

use crate::limits::Limits;
use crate::reply::Reply;
use hyper::Method;
use hyper::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_METHOD, CONTENT_TYPE, HOST, HeaderMap,
    HeaderValue, ORIGIN, VARY,
};
use std::net::IpAddr;

/// What to do with a request before its key and body are looked at.
pub enum Verdict {
    /// Serve it (with CORS headers for an allowed origin).
    Pass(Option<Cors>),
    /// An allowed origin's preflight: answer it (204) with these headers.
    Preflight(Cors),
    Refused(Reply),
}

/// The CORS headers for an allowed origin.
pub struct Cors {
    origin: HeaderValue,
}

impl Cors {
    pub fn headers(&self, headers: &mut HeaderMap) {
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, self.origin.clone());
        headers.insert(VARY, HeaderValue::from_static("Origin"));
        headers.insert(
            ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        headers.insert(
            ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("Authorization, Content-Type"),
        );
        headers.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    }
}

/// The `Host` and `Origin` checks.
pub fn check(method: &Method, headers: &HeaderMap, limits: &Limits) -> Verdict {
    if let Some(host) = headers.get(HOST) {
        let text = String::from_utf8_lossy(host.as_bytes());
        if !host_allowed(&text, &limits.allowed_hosts) {
            return Verdict::Refused(Reply::error(
                421,
                format!(
                    "Host {text:?} is not this server's name: requests must name it by IP \
                     address, as localhost, or as a name it was started with (--allowed-host)"
                ),
                None,
            ));
        }
    }
    let Some(origin) = headers.get(ORIGIN) else {
        return Verdict::Pass(None);
    };
    let text = String::from_utf8_lossy(origin.as_bytes());
    let allowed = limits
        .allowed_origins
        .iter()
        .any(|o| o == "*" || o.eq_ignore_ascii_case(text.trim_end_matches('/')));
    if !allowed {
        return Verdict::Refused(Reply::error(
            403,
            format!(
                "requests from web pages are refused (Origin {text:?}); start the server with \
                 --allowed-origin {text} to let that page call it"
            ),
            None,
        ));
    }
    let cors = Cors {
        origin: origin.clone(),
    };
    if method == Method::OPTIONS && headers.contains_key(ACCESS_CONTROL_REQUEST_METHOD) {
        return Verdict::Preflight(cors);
    }
    Verdict::Pass(Some(cors))
}

/// Whether a `Host` value (`name`, `name:port`, `[v6]:port`) names this server.
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = if let Some(v6) = host.strip_prefix('[') {
        // `[v6]` or `[v6]:port`, nothing else after the bracket.
        let Some((v6, after)) = v6.split_once(']') else {
            return false;
        };
        let port = after.strip_prefix(':').unwrap_or(after);
        if !(after.is_empty()
            || (after.starts_with(':') && port.bytes().all(|b| b.is_ascii_digit())))
        {
            return false;
        }
        v6
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        }
    };
    name.parse::<IpAddr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || allowed
            .iter()
            .any(|a| a.eq_ignore_ascii_case(name) || a.eq_ignore_ascii_case(host))
}

/// A 415 for a `POST` whose body is not declared JSON.
pub fn content_type(method: &Method, headers: &HeaderMap) -> Option<Reply> {
    if method != Method::POST {
        return None;
    }
    let declared = headers
        .get(CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()));
    let json = declared.as_deref().is_some_and(|v| {
        v.split(';')
            .next()
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
    });
    (!json).then(|| {
        Reply::error(
            415,
            format!(
                "a POST body must be sent as `Content-Type: application/json` (got {}): web \
                 pages' form and text posts are refused",
                declared.map_or("none".into(), |d| format!("{d:?}"))
            ),
            Some("Content-Type"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_by_address_loopback_name_or_allowance() {
        let allowed = vec!["gpu-box.lan".to_string()];
        for ok in [
            "127.0.0.1:8000",
            "127.0.0.1",
            "[::1]:8000",
            "10.1.2.3:80",
            "localhost:8000",
            "LOCALHOST",
            "gpu-box.lan:8000",
        ] {
            assert!(host_allowed(ok, &allowed), "{ok}");
        }
        for bad in [
            "evil.example:8000",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "",
        ] {
            assert!(!host_allowed(bad, &allowed), "{bad}");
        }
    }
}
