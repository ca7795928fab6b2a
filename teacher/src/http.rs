//! The teacher server's HTTP/1.1 layer: one thread per connection (at most [`MAX_CONNECTIONS`]),
//! keep-alive, `Content-Length` and chunked request bodies, `Expect: 100-continue`.
//!
//! Written here rather than taken from a crate because a request's work must stop when its client
//! disconnects, and only the thread that owns the connection's socket can see that: while the
//! handler runs, [`Peer::gone`] peeks at the socket without blocking (end of stream or a reset
//! means the client closed it).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Connections served at once; one more is answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 256;
/// A request body, read whole.
pub const MAX_BODY: u64 = 64 << 20;
/// The request line and headers together.
const MAX_HEAD: u64 = 64 << 10;
const MAX_HEADERS: usize = 100;
/// How often an idle connection looks at the stop flag.
const POLL: Duration = Duration::from_millis(200);
/// An idle keep-alive connection is closed after this (clients reconnect).
const KEEP_ALIVE: Duration = Duration::from_secs(120);
/// A request's bytes, once begun, and a response's, must move within this.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// A request, its body read whole.
pub struct Request {
    pub method: String,
    /// The target without its query string.
    pub path: String,
    pub body: Vec<u8>,
    keep_alive: bool,
}

/// A request that could not be read, answered with `status` and the connection closed.
#[derive(Debug)]
pub struct HttpError {
    pub status: u16,
    pub message: String,
}

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u32>,
}

/// The client of the request being handled.
pub struct Peer {
    stream: TcpStream,
}

impl Peer {
    /// Whether the client has closed its connection (or reset it). Never blocks; a pipelined
    /// request waiting in the socket counts as still there.
    pub fn gone(&self) -> bool {
        match self.stream.peek(&mut [0u8; 1]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
        }
    }
}

/// Serves `listener` until `stop` is set, calling `handle` for each request (or for each that
/// could not be read, with its error, to say so in the handler's own format). Returns once every
/// connection has closed: idle ones notice `stop` within [`POLL`]; a handler should watch it too.
pub fn serve<H>(listener: TcpListener, stop: &AtomicBool, handle: &H) -> io::Result<()>
where
    H: Fn(Result<&Request, HttpError>, &Peer) -> Response + Sync,
{
    listener.set_nonblocking(true)?;
    let open = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        while !stop.load(Ordering::SeqCst) {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                // A connection that failed between arriving and being accepted.
                Err(_) => continue,
            };
            if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                open.fetch_sub(1, Ordering::SeqCst);
                let _ = refuse_busy(stream, handle);
                continue;
            }
            let open = &open;
            scope.spawn(move || {
                let _ = connection(stream, stop, handle);
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Ok(())
}

fn refuse_busy<H>(stream: TcpStream, handle: &H) -> io::Result<()>
where
    H: Fn(Result<&Request, HttpError>, &Peer) -> Response,
{
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let error = HttpError {
        status: 503,
        message: format!("the server has {MAX_CONNECTIONS} connections open; retry shortly"),
    };
    let peer = Peer {
        stream: stream.try_clone()?,
    };
    let mut response = handle(Err(error), &peer);
    response.retry_after.get_or_insert(1);
    write_response(&stream, &response, false)?;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    Ok(())
}

/// One connection's requests, in order, until it closes, errs, idles out or the server stops.
fn connection<H>(stream: TcpStream, stop: &AtomicBool, handle: &H) -> io::Result<()>
where
    H: Fn(Result<&Request, HttpError>, &Peer) -> Response,
{
    // Accepted sockets may inherit the listener's non-blocking mode on some platforms.
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let peer = Peer {
        stream: stream.try_clone()?,
    };
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut idle_since = Instant::now();
    loop {
        // Wait for a request's first byte, looking at the stop flag meanwhile.
        stream.set_read_timeout(Some(POLL))?;
        match reader.fill_buf() {
            Ok([]) => return Ok(()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if stop.load(Ordering::SeqCst) || idle_since.elapsed() > KEEP_ALIVE {
                    return Ok(());
                }
                continue;
            }
            Err(e) => return Err(e),
        }
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        let (response, keep_alive) = match read_request(&mut reader, &stream) {
            Ok(request) => {
                // Non-blocking while the handler runs, so `Peer::gone` can peek.
                stream.set_nonblocking(true)?;
                let response = handle(Ok(&request), &peer);
                stream.set_nonblocking(false)?;
                (response, request.keep_alive)
            }
            Err(Failure::Http(e)) => (handle(Err(e), &peer), false),
            Err(Failure::Io(e)) => return Err(e),
        };
        let keep_alive = keep_alive && !stop.load(Ordering::SeqCst);
        write_response(&stream, &response, keep_alive)?;
        if !keep_alive {
            return linger(&stream, reader);
        }
        idle_since = Instant::now();
    }
}

/// Closes after a response without losing it: a socket closed with unread input (the rest of a
/// refused request) is reset, and a reset can discard the response before the client reads it. So
/// stop sending, then read and drop what still arrives, for a moment, until the client closes.
fn linger(stream: &TcpStream, mut reader: BufReader<TcpStream>) -> io::Result<()> {
    stream.shutdown(std::net::Shutdown::Write)?;
    stream.set_read_timeout(Some(Duration::from_millis(500)))?;
    let until = Instant::now() + Duration::from_secs(2);
    let mut sink = [0u8; 8192];
    while Instant::now() < until {
        match reader.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    Ok(())
}

enum Failure {
    /// Answer with this, then close.
    Http(HttpError),
    /// The connection itself failed: nothing to answer.
    Io(io::Error),
}

fn fail(status: u16, message: impl Into<String>) -> Failure {
    Failure::Http(HttpError {
        status,
        message: message.into(),
    })
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => fail(
                408,
                format!("the request did not arrive within {IO_TIMEOUT:?}"),
            ),
            io::ErrorKind::InvalidData => fail(400, format!("malformed request: {e}")),
            _ => Failure::Io(e),
        }
    }
}

/// One line of the head, without its line ending; `budget` is what the head may still take.
fn head_line(reader: &mut impl BufRead, budget: &mut u64) -> Result<String, Failure> {
    let mut line = Vec::new();
    let n = reader.take(*budget).read_until(b'\n', &mut line)?;
    *budget -= n as u64;
    if line.last() != Some(&b'\n') {
        return Err(if *budget == 0 {
            fail(431, format!("the request head exceeds {MAX_HEAD} bytes"))
        } else {
            fail(400, "the connection closed inside the request head")
        });
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| fail(400, "the request head is not UTF-8"))
}

fn read_request(reader: &mut impl BufRead, stream: &TcpStream) -> Result<Request, Failure> {
    let mut budget = MAX_HEAD;
    // RFC 9112 2.2: empty lines before the request line are ignored.
    let mut line = String::new();
    while line.is_empty() {
        line = head_line(reader, &mut budget)?;
    }
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(fail(400, format!("malformed request line {line:?}")));
    };
    let http11 = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        _ => return Err(fail(505, format!("{version:?} is not HTTP/1.0 or 1.1"))),
    };
    let mut headers = Vec::new();
    loop {
        let line = head_line(reader, &mut budget)?;
        if line.is_empty() {
            break;
        }
        if headers.len() == MAX_HEADERS {
            return Err(fail(431, format!("more than {MAX_HEADERS} headers")));
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(fail(400, format!("malformed header line {line:?}")));
        };
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let header = |name: &'static str| {
        headers
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    let tokens = |name: &'static str| {
        header(name)
            .flat_map(|v| v.split(','))
            .map(|t| t.trim().to_ascii_lowercase())
            .collect::<Vec<_>>()
    };
    let connection = tokens("connection");
    let keep_alive = if http11 {
        !connection.iter().any(|t| t == "close")
    } else {
        connection.iter().any(|t| t == "keep-alive")
    };
    let chunked = match tokens("transfer-encoding").as_slice() {
        [] => false,
        [t] if t == "chunked" => true,
        other => {
            return Err(fail(
                501,
                format!("transfer-encoding {other:?} is not supported"),
            ));
        }
    };
    let lengths: Vec<&str> = header("content-length").collect();
    let length = match lengths.as_slice() {
        [] => None,
        _ if chunked => {
            return Err(fail(
                400,
                "both content-length and chunked transfer-encoding",
            ));
        }
        [first, rest @ ..] if rest.iter().all(|v| v == first) => Some(
            first
                .parse::<u64>()
                .map_err(|_| fail(400, format!("content-length {first:?} is not a number")))?,
        ),
        _ => return Err(fail(400, "conflicting content-length headers")),
    };
    if length.is_some_and(|n| n > MAX_BODY) {
        return Err(too_large());
    }
    let expects_body = chunked || length.is_some_and(|n| n > 0);
    if http11 && expects_body && header("expect").any(|v| v.eq_ignore_ascii_case("100-continue")) {
        let mut s = stream;
        s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    }
    let body = if chunked {
        read_chunked(reader)?
    } else {
        let n = length.unwrap_or(0) as usize;
        let mut body = vec![0; n];
        reader.read_exact(&mut body).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                fail(400, "the body is shorter than its content-length")
            }
            _ => e.into(),
        })?;
        body
    };
    Ok(Request {
        method: method.to_string(),
        path: target.split('?').next().unwrap_or("").to_string(),
        body,
        keep_alive,
    })
}

fn too_large() -> Failure {
    fail(413, format!("the body exceeds {MAX_BODY} bytes"))
}

/// A chunked body (RFC 9112 7.1): hex sizes with optional extensions, then trailers.
fn read_chunked(reader: &mut impl BufRead) -> Result<Vec<u8>, Failure> {
    let mut body = Vec::new();
    let mut budget = MAX_HEAD;
    loop {
        let line = head_line(reader, &mut budget)?;
        let size = line.split(';').next().unwrap_or("").trim();
        let size = u64::from_str_radix(size, 16)
            .map_err(|_| fail(400, format!("malformed chunk size {line:?}")))?;
        if size == 0 {
            // Trailers, up to the empty line.
            while !head_line(reader, &mut budget)?.is_empty() {}
            return Ok(body);
        }
        if body.len() as u64 + size > MAX_BODY {
            return Err(too_large());
        }
        let start = body.len();
        body.resize(start + size as usize, 0);
        reader.read_exact(&mut body[start..])?;
        if !head_line(reader, &mut budget)?.is_empty() {
            return Err(fail(400, "a chunk is longer than its size"));
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

fn write_response(stream: &TcpStream, r: &Response, keep_alive: bool) -> io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len(),
        if keep_alive { "keep-alive" } else { "close" }
    );
    if let Some(s) = r.retry_after {
        head += &format!("Retry-After: {s}\r\n");
    }
    head += "\r\n";
    let mut w = io::BufWriter::new(stream);
    w.write_all(head.as_bytes())?;
    w.write_all(&r.body)?;
    w.flush()
}
