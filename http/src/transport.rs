//! The servers' HTTP/1.1 transport: hyper on a two-thread tokio runtime, with the limits a server
//! that fleets of scorers, or a laptop's browser, share needs. Parsing (request line, headers,
//! `Content-Length`, chunked bodies, `Expect: 100-continue`, keep-alive) is hyper's; what is ours:
//!
//! - **Connection slots**: at most `max_connections` open, and at most `max_per_peer` of them from
//!   one client, so one client cannot take them all; each holds a semaphore permit owned by its
//!   task, so a slot comes back however the connection ends (error, panic, drain). A connection
//!   past either cap goes to the overflow pool ([`OVERFLOW`] times the slots, as the process's
//!   open-file limit allows (its soft limit is lifted to the hard one first), at most
//!   `max_per_peer` from one client, each connection closed after one request or
//!   [`OVERFLOW_HEAD`] without one): `GET /health` is answered there (a reserved path, so a full
//!   server still says it is alive), anything else a 503 with `Retry-After`. Beyond that pool
//!   connections are closed. A client is an IPv4 address or an IPv6 /64; behind a reverse proxy
//!   every client is the proxy.
//! - **Deadlines**: a request head must arrive whole within `header_timeout` of the previous
//!   response (or of connecting), so it is also how long an idle keep-alive connection stays open
//!   (past it hyper closes the connection); its body must arrive within as long again of the head
//!   (else a 408).
//! - **Stalled writes**: a response whose bytes make no progress for `header_timeout` (a client
//!   that stops reading) ends its connection, so a slot cannot be held by not reading.
//! - **Caps**: a head (request line and headers) over `max_head` bytes or with over `max_headers`
//!   headers is a 431, a body over `max_body` a 413 (by its `Content-Length` before any of it is
//!   read, or as it arrives chunked).
//! - **Browsers** ([`origin`]): a web page can send a loopback server "simple" requests without a
//!   CORS preflight, and DNS rebinding lets it read the answers. So a `POST` body must be
//!   `application/json` (else 415), the `Host` must be an IP address, `localhost` or a name in
//!   `allowed_hosts` (else 421), and a request that carries an `Origin` must name one in
//!   `allowed_origins` (else 403; those get CORS headers and preflights). Clients that are not
//!   browsers (curl, the `openai` package, k3mini's) send no `Origin` and are unaffected.
//! - **API key**: with one set, every request but `GET /health` must carry `Authorization: Bearer
//!   KEY` (compared in constant time) or gets a 401 before its body is read.
//! - **Client gone**: the handler runs on a blocking thread while the request's future waits for
//!   it; hyper drops that future when the client closes the connection, and a guard in it sets the
//!   flag [`Peer::gone`] reads. Hyper stops reading while its buffer holds bytes of a next request
//!   (a stray CRLF, a pipelined request), so [`Peer::gone`] also asks the socket itself whether
//!   the client has hung up (`poll` for `POLLRDHUP`).
//! - **Drain**: once `stop` is set no connection is accepted, idle ones close, and requests in
//!   flight finish (a handler should watch `stop` too).
//!
//! - **Events**: a reply may be a `text/event-stream` ([`Reply::events`]) whose frames a producer
//!   sends as it makes them; when the client leaves, hyper drops the body and the producer's next
//!   send fails, which is how it learns to stop.
//!
//! Errors the transport answers itself are JSON in vLLM's shape ([`ErrorResponse`]); those hyper
//! answers while parsing (400, 431) have no body, and a head past its deadline is closed unanswered.

use crate::limits::Limits;
use crate::origin::{self, Cors, Verdict};
use crate::reply::Reply;
use http_body_util::{BodyExt, Limited};
use hyper::body::Bytes;
use hyper::body::{Frame, Incoming};
use hyper::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::Semaphore;

/// How often the accept loop looks at the stop flag.
const POLL: Duration = Duration::from_millis(100);
/// How long a stopping server waits for requests in flight to be answered.
const DRAIN: Duration = Duration::from_secs(10);
/// The overflow pool's size, in multiples of `max_connections`.
pub const OVERFLOW: usize = 4;
/// How long an overflow connection may take to send its one request head.
pub const OVERFLOW_HEAD: Duration = Duration::from_secs(1);

/// A request, its body read whole.
pub struct Request {
    pub method: String,
    /// The target without its query string.
    pub path: String,
    pub body: Bytes,
}

/// The client of the request being handled.
#[derive(Clone)]
pub struct Peer {
    gone: Arc<AtomicBool>,
    /// A duplicate of the connection's socket, to ask it whether the client hung up.
    socket: Option<Arc<OwnedFd>>,
}

impl Peer {
    /// Whether the client has closed its connection, or shut down its side of it (its request's
    /// future was dropped, or the socket says it hung up; so also true once the handler has
    /// returned, its reply handed to hyper).
    pub fn gone(&self) -> bool {
        if self.gone.load(Ordering::SeqCst) {
            return true;
        }
        let Some(socket) = &self.socket else {
            return false;
        };
        let mut fd = libc::pollfd {
            fd: socket.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        let ready = unsafe { libc::poll(&mut fd, 1, 0) };
        ready > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// Sets its flag when dropped: with the request's future, when hyper drops it.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Serves `listener` until `stop` is set, calling `handle` on a blocking thread for each request
/// that passed the limits. Returns once the connections have drained (at most [`DRAIN`]).
pub fn serve<H>(
    listener: std::net::TcpListener,
    limits: Limits,
    stop: &AtomicBool,
    handle: H,
) -> io::Result<()>
where
    H: Fn(&Request, &Peer) -> Reply + Send + Sync + 'static,
{
    let open_files = raise_open_files();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("k3mini-http")
        .enable_all()
        .build()?;
    listener.set_nonblocking(true)?;
    // Two descriptors a slot; the overflow pool gets what is left, past a margin for the rest of
    // the process (model files, shards, the sandbox's pipes).
    let spare = open_files.saturating_sub(2 * limits.max_connections as u64 + 256);
    let overflow = (limits.max_connections * OVERFLOW).min(spare as usize);
    let result = runtime.block_on(accept(
        listener,
        Arc::new(limits),
        overflow,
        stop,
        Arc::new(handle),
    ));
    // Handlers still running see `stop` and end at their next token; none is waited for here.
    runtime.shutdown_background();
    result
}

/// Connections open per client; a [`PeerSlot`] counts one and gives it back when dropped.
#[derive(Default)]
struct Peers(std::sync::Mutex<HashMap<IpAddr, usize>>);

struct PeerSlot {
    peers: Arc<Peers>,
    ip: IpAddr,
}

/// Who a connection counts against: its IPv4 address, or its IPv6 address's /64 (one host
/// holds a whole /64, and could take a slot from each of its addresses).
fn client(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
        v4 => v4,
    }
}

impl Peers {
    /// A slot for `ip`'s client if it holds fewer than `cap`.
    fn take(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<PeerSlot> {
        let ip = client(ip);
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(PeerSlot {
            peers: self.clone(),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

async fn accept<H>(
    listener: std::net::TcpListener,
    limits: Arc<Limits>,
    overflow: usize,
    stop: &AtomicBool,
    handle: Arc<H>,
) -> io::Result<()>
where
    H: Fn(&Request, &Peer) -> Reply + Send + Sync + 'static,
{
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let overflow = Arc::new(Semaphore::new(overflow));
    let (peers, overflowing) = (Arc::new(Peers::default()), Arc::new(Peers::default()));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_header_size(limits.max_head)
        .max_headers(limits.max_headers);
    let mut overflow_http = http.clone();
    overflow_http
        .keep_alive(false)
        .header_read_timeout(OVERFLOW_HEAD.min(limits.header_timeout));
    let graceful = GracefulShutdown::new();
    while !stop.load(Ordering::SeqCst) {
        let (stream, from) = match tokio::time::timeout(POLL, listener.accept()).await {
            Err(_) => continue,
            Ok(Ok(accepted)) => accepted,
            // A connection that failed before it was accepted, or no descriptor left: try again
            // after a moment rather than spin.
            Ok(Err(_)) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let admitted = peers
            .take(from.ip(), limits.max_per_peer)
            .and_then(|peer| Some((peer, slots.clone().try_acquire_owned().ok()?)));
        if let Some((peer, slot)) = admitted {
            // Without a duplicate to watch, a hang-up is seen only when hyper reads.
            let socket = stream.as_fd().try_clone_to_owned().ok().map(Arc::new);
            let io = Stalls::new(TokioIo::new(stream), limits.header_timeout);
            let (limits, handle) = (limits.clone(), handle.clone());
            let service =
                service_fn(move |r| respond(r, limits.clone(), handle.clone(), socket.clone()));
            let connection = graceful.watch(http.serve_connection(io, service));
            tokio::spawn(async move {
                let _ = connection.await;
                drop((slot, peer));
            });
        } else if let Some((peer, slot)) = overflowing
            .take(from.ip(), limits.max_per_peer)
            .and_then(|peer| Some((peer, overflow.clone().try_acquire_owned().ok()?)))
        {
            let io = Stalls::new(TokioIo::new(stream), limits.header_timeout);
            let (open, per_peer) = (limits.max_connections, limits.max_per_peer);
            let service = service_fn(move |r: hyper::Request<Incoming>| async move {
                let health = r.method() == hyper::Method::GET && r.uri().path() == "/health";
                Ok::<_, Infallible>(if health {
                    response(Reply::health(), None)
                } else {
                    response(
                        Reply::error(
                            503,
                            format!(
                                "the server is full ({open} connections, at most {per_peer} from \
                                 one client); retry shortly"
                            ),
                            None,
                        ),
                        None,
                    )
                })
            });
            let connection = graceful.watch(overflow_http.serve_connection(io, service));
            tokio::spawn(async move {
                let _ = connection.await;
                drop((slot, peer));
            });
        }
        // Else both pools are full, or this client holds its share of both: the stream is
        // dropped, closing it.
    }
    drop(listener);
    let _ = tokio::time::timeout(DRAIN, graceful.shutdown()).await;
    Ok(())
}

/// One request: what browsers could abuse, the key, the body within its cap, then the handler
/// on a blocking thread.
async fn respond<H>(
    request: hyper::Request<Incoming>,
    limits: Arc<Limits>,
    handle: Arc<H>,
    socket: Option<Arc<OwnedFd>>,
) -> Result<hyper::Response<Body>, Infallible>
where
    H: Fn(&Request, &Peer) -> Reply + Send + Sync + 'static,
{
    let (parts, body) = request.into_parts();
    let path = parts.uri.path().to_string();
    let cors = match origin::check(&parts.method, &parts.headers, &limits) {
        Verdict::Refused(reply) => return Ok(response(reply, None)),
        Verdict::Preflight(cors) => return Ok(response(Reply::empty(204), Some(&cors))),
        Verdict::Pass(cors) => cors,
    };
    let reply = |r: Reply| Ok(response(r, cors.as_ref()));
    let health = parts.method == hyper::Method::GET && path == "/health";
    if let Some(key) = &limits.api_key
        && !health
        && !authorized(parts.headers.get(AUTHORIZATION), key)
    {
        return reply(Reply::error(
            401,
            "a valid API key is required: send `Authorization: Bearer <key>`",
            None,
        ));
    }
    if let Some(refused) = origin::content_type(&parts.method, &parts.headers) {
        return reply(refused);
    }
    let declared = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let too_large = || {
        Reply::error(
            413,
            format!("the body exceeds {} bytes", limits.max_body),
            Some("body"),
        )
    };
    if declared.is_some_and(|n| n > limits.max_body) {
        return reply(too_large());
    }
    let limited = read_body(body, declared, limits.max_body);
    let body = match tokio::time::timeout(limits.header_timeout, limited).await {
        Ok(Ok(read)) => read,
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return reply(too_large()),
        Ok(Err(e)) if e.is::<Unreservable>() => {
            return reply(Reply::error(503, e.to_string(), Some("body")));
        }
        Err(_) => {
            return reply(Reply::error(
                408,
                format!(
                    "the request body did not arrive within {:?} of its head",
                    limits.header_timeout
                ),
                Some("body"),
            ));
        }
        Ok(Err(e)) => {
            return reply(Reply::error(
                400,
                format!("malformed request body: {e}"),
                Some("body"),
            ));
        }
    };
    let gone = Arc::new(AtomicBool::new(false));
    let _guard = SetOnDrop(gone.clone());
    let request = Request {
        method: parts.method.as_str().to_string(),
        path,
        body,
    };
    let peer = Peer { gone, socket };
    let answer = tokio::task::spawn_blocking(move || handle(&request, &peer))
        .await
        .unwrap_or_else(|e| Reply::error(500, format!("the request's handler failed: {e}"), None));
    reply(answer)
}

/// Lifts this process's soft limit on open files to its hard limit: each connection holds two
/// descriptors (its socket, and the duplicate that watches for a hang-up), and the slots and the
/// overflow pool together are more than the usual soft limit of 1,024.
/// Returns the limit it now has.
fn raise_open_files() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 1024;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return raised.rlim_cur;
            }
        }
    }
    limit.rlim_cur
}

/// The most of a declared body reserved before any of it arrives.
const RESERVED: u64 = 8 << 20;

/// The machine would not lend a body's buffer.
#[derive(Debug)]
struct Unreservable;

impl std::fmt::Display for Unreservable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no memory for the request body")
    }
}

impl std::error::Error for Unreservable {}

/// A body read whole, at most `max` bytes, into one buffer sized by its `Content-Length` up to
/// [`RESERVED`] and grown past it (so a large body is held about once, not as its frames and then
/// their copy).
async fn read_body(
    body: Incoming,
    declared: Option<u64>,
    max: u64,
) -> Result<Bytes, Box<dyn std::error::Error + Send + Sync>> {
    let mut body = Limited::new(body, max as usize);
    let mut whole = Vec::new();
    // A declared length reserves at most RESERVED up front (a length promised is not a body
    // sent), and a reservation the machine refuses is an error, not an abort.
    whole
        .try_reserve_exact(declared.unwrap_or(0).min(max.min(RESERVED)) as usize)
        .map_err(|_| Unreservable)?;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            whole.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(whole))
}

/// A connection whose writes fail once they have made no progress for `limit`. Written here
/// because hyper has no write deadline (only one for heads) and tokio's sockets take no
/// `SO_SNDTIMEO`.
struct Stalls<I> {
    io: I,
    limit: Duration,
    /// Running while a write is pending: reset by any progress.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<I> Stalls<I> {
    fn new(io: I, limit: Duration) -> Self {
        Self {
            io,
            limit,
            stalled: None,
        }
    }

    /// `polled` as it came, but a pending write past the limit is an error.
    fn watch<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: std::task::Poll<io::Result<T>>,
    ) -> std::task::Poll<io::Result<T>> {
        use std::future::Future;
        use std::task::Poll;
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<I: hyper::rt::Read + Unpin> hyper::rt::Read for Stalls<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<I: hyper::rt::Write + Unpin> hyper::rt::Write for Stalls<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, polled)
    }
}

/// Whether `header` is `Bearer <key>`, the key compared in constant time.
fn authorized(header: Option<&HeaderValue>, key: &str) -> bool {
    use subtle::ConstantTimeEq;
    let Some(token) = header.and_then(|h| h.as_bytes().strip_prefix(b"Bearer ")) else {
        return false;
    };
    bool::from(token.ct_eq(key.as_bytes()))
}

/// A response body, and what its reply holds ([`Reply::held`]): dropped on the blocking pool
/// when hyper drops the body, once it has taken the last frame to write or its client has gone.
struct Body {
    frames: Frames,
    held: Option<Box<dyn Send + Sync>>,
}

enum Frames {
    /// The whole body, until it is taken.
    Whole(Option<Bytes>),
    /// A streamed reply's frames, as they arrive.
    Events(tokio::sync::mpsc::Receiver<Bytes>),
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let frame = match &mut self.frames {
            Frames::Whole(whole) => std::task::Poll::Ready(whole.take()),
            Frames::Events(rx) => rx.poll_recv(cx),
        };
        frame.map(|frame| frame.map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.frames, Frames::Whole(None))
    }

    /// A whole body's exact length, which hyper sends as its `Content-Length`.
    fn size_hint(&self) -> hyper::body::SizeHint {
        match &self.frames {
            Frames::Whole(whole) => {
                hyper::body::SizeHint::with_exact(whole.as_ref().map_or(0, |b| b.len() as u64))
            }
            Frames::Events(_) => hyper::body::SizeHint::default(),
        }
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        // What it holds may write and sync a file: not on a thread that serves connections.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || drop(held))),
            Err(_) => drop(held),
        }
    }
}

fn response(reply: Reply, cors: Option<&Cors>) -> hyper::Response<Body> {
    let (frames, content_type) = match reply.events {
        Some(rx) => (Frames::Events(rx), Some("text/event-stream")),
        None => {
            let whole = (!reply.body.is_empty()).then(|| Bytes::from(reply.body));
            let typed = whole.is_some().then_some("application/json");
            (Frames::Whole(whole), typed)
        }
    };
    let body = Body {
        frames,
        held: reply.held,
    };
    let mut r = hyper::Response::new(body);
    *r.status_mut() = hyper::StatusCode::from_u16(reply.status)
        .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    let headers = r.headers_mut();
    if let Some(t) = content_type {
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(t));
    }
    if let Some(s) = reply.retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(s));
    }
    if let Some(cors) = cors {
        cors.headers(headers);
    }
    r
}
