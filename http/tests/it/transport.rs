//! The server's HTTP transport (hyper) over loopback with a handler that echoes what it was given:
//! keep-alive, chunked bodies, `Expect: 100-continue`; the caps, the connection slots (never
//! leaked, however a connection ends), the API key; a disconnected client seen by the handler; a
//! prompt stop with idle connections open; what a reply holds let go of once its body is sent; and
//! random and mutated request bytes that never panic the server or cost it a slot.
use k3mini_data::rng::splitmix64;
use k3mini_http::{Limits, Peer, Reply, Request, transport};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

fn text(status: u16, text: String) -> Reply {
    Reply::json(status, &text)
}

/// `"METHOD PATH BODY"` for a request; `/big` answers 64 MiB. `/wait` holds until its client has gone (at most 20 s) and
/// sends how long that took; `/hold` holds for 300 ms; `/panic` panics.
fn echo(r: &Request, peer: &Peer, gone: &mpsc::Sender<Duration>) -> Reply {
    match r.path.as_str() {
        "/wait" => {
            let t0 = Instant::now();
            while !peer.gone() && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = gone.send(t0.elapsed());
            text(200, "done".into())
        }
        "/hold" => {
            std::thread::sleep(Duration::from_millis(300));
            text(200, "held".into())
        }
        // A reply holding what says, on the channel, when it is let go of.
        "/held" => text(200, "held".into()).hold(Dropped(gone.clone())),
        // Two events a second apart, the reply holding the same.
        "/held-events" => {
            let (reply, tx) = Reply::events();
            std::thread::spawn(move || {
                let _ = tx.blocking_send("data: first\n\n".into());
                std::thread::sleep(Duration::from_secs(1));
                let _ = tx.blocking_send("data: last\n\n".into());
            });
            reply.hold(Dropped(gone.clone()))
        }
        "/panic" => panic!("a handler that fails"),
        // More than the socket buffers hold: sent only to a client that reads.
        "/big" => text(200, "x".repeat(64 << 20)),
        _ => text(
            200,
            format!(
                "{} {} {}",
                r.method,
                r.path,
                String::from_utf8_lossy(&r.body)
            ),
        ),
    }
}

/// Sends `Duration::ZERO` when dropped.
struct Dropped(mpsc::Sender<Duration>);

impl Drop for Dropped {
    fn drop(&mut self) {
        let _ = self.0.send(Duration::ZERO);
    }
}

struct Server {
    addr: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    gone: mpsc::Receiver<Duration>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn start(limits: Limits) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, gone) = mpsc::channel();
    let s = stop.clone();
    let thread = std::thread::spawn(move || {
        let tx = Mutex::new(tx);
        transport::serve(listener, limits, &s, move |r, p| {
            // Out of the lock before the handler runs: `/panic` must not poison it.
            let tx = tx.lock().unwrap().clone();
            echo(r, p, &tx)
        })
        .unwrap();
    });
    Server {
        addr,
        stop,
        thread: Some(thread),
        gone,
    }
}

/// Reads one response: (status, headers lower-cased, body).
fn response(reader: &mut impl BufRead) -> (u16, Vec<String>, String) {
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let status = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("no status line: {line:?}"))
        .parse()
        .unwrap();
    let mut headers = Vec::new();
    let mut length = 0;
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).unwrap();
        let h = h.trim_end().to_ascii_lowercase();
        if h.is_empty() {
            break;
        }
        if let Some(n) = h.strip_prefix("content-length:") {
            length = n.trim().parse().unwrap();
        }
        headers.push(h);
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    (status, headers, String::from_utf8(body).unwrap())
}

fn connect(s: &Server) -> (TcpStream, BufReader<TcpStream>) {
    let stream = TcpStream::connect(&s.addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let reader = BufReader::new(stream.try_clone().unwrap());
    (stream, reader)
}

/// Sends `request` on a new connection and reads one response. (The sending side stays open: a
/// client that half-closes is taken to have gone, and its request is dropped.)
fn exchange(s: &Server, request: &[u8]) -> (u16, Vec<String>, String) {
    let (mut w, mut r) = connect(s);
    w.write_all(request).unwrap();
    response(&mut r)
}

#[test]
fn keep_alive_chunked_and_expect_continue() {
    let s = start(Limits::default());
    let (mut w, mut r) = connect(&s);
    // Two requests on one connection, the second chunked, with a query string dropped.
    write!(
        w,
        "POST /a HTTP/1.1\r\nContent-Type: application/json\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello"
    )
    .unwrap();
    let (status, headers, body) = response(&mut r);
    assert_eq!((status, body.as_str()), (200, "\"POST /a hello\""));
    assert!(
        headers.contains(&"content-type: application/json".into()),
        "{headers:?}"
    );
    write!(
        w,
        "POST /b?x=1 HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nTrailer: t\r\n\r\n"
    )
    .unwrap();
    assert_eq!(response(&mut r).2, "\"POST /b wikipedia\"");
    // Expect: 100-continue is answered before the body is sent.
    write!(
        w,
        "POST /c HTTP/1.1\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n"
    )
    .unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert_eq!(line, "HTTP/1.1 100 Continue\r\n");
    r.read_line(&mut line).unwrap();
    w.write_all(b"abc").unwrap();
    assert_eq!(response(&mut r).2, "\"POST /c abc\"");
    // Connection: close is honoured: the server closes after answering.
    write!(w, "GET /d HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
    let (_, headers, body) = response(&mut r);
    assert_eq!(body, "\"GET /d \"");
    assert!(headers.contains(&"connection: close".into()), "{headers:?}");
    assert_eq!(r.read(&mut [0; 1]).unwrap(), 0, "closed");
}

#[test]
fn malformed_requests_get_their_status_and_the_server_keeps_serving() {
    let s = start(Limits::default());
    let long = format!("GET /x HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(70 << 10));
    let many = format!("GET /x HTTP/1.1\r\n{}\r\n", "X: y\r\n".repeat(101));
    for (request, status) in [
        ("GARBAGE\r\n\r\n".to_string(), 400),
        ("GET /x HTTP/1.1\r\nno colon\r\n\r\n".into(), 400),
        // RFC 9112 §5.1: no whitespace between a field name and its colon.
        (
            "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n".into(),
            400,
        ),
        // Content-Length is 1*DIGIT: no sign, no words, no two values.
        (
            "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: +2\r\n\r\nab".into(),
            400,
        ),
        (
            "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: ten\r\n\r\n".into(),
            400,
        ),
        (
            "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n".into(),
            400,
        ),
        (
            "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: gzip\r\n\r\n".into(),
            400,
        ),
        (
            "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".into(),
            400,
        ),
        // A chunk size past 64 bits, after a first chunk.
        (
            "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n1ffffffffffffffff\r\n"
                .into(),
            400,
        ),
        (
            format!("POST /x HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", 1u64 << 40),
            413,
        ),
        (long, 431),
        (many, 431),
    ] {
        let (got, _, body) = exchange(&s, request.as_bytes());
        assert_eq!(
            got,
            status,
            "{:?}: {body}",
            &request[..request.len().min(80)]
        );
        // The transport's own refusals say why, in vLLM's error shape.
        if status == 413 || request.contains("fffff") {
            let e: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(e["error"]["code"], status, "{body}");
        }
    }
    // A body over the cap, sent chunked (no length to refuse it by up front).
    let limits = Limits {
        max_body: 1000,
        ..Default::default()
    };
    let small = start(limits);
    let chunked = format!(
        "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        1500,
        "a".repeat(1500)
    );
    assert_eq!(exchange(&small, chunked.as_bytes()).0, 413);
    // A chunk of 2^64 − 1 bytes: refused as its bytes pass the cap, or, where they never come, at
    // the body's deadline.
    let huge = "POST /x HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\nffffffffffffffff\r\n";
    let (mut w, mut r) = connect(&small);
    w.write_all(huge.as_bytes()).unwrap();
    w.write_all(&[b'a'; 2000]).unwrap();
    assert_eq!(response(&mut r).0, 413);
    let slow = Limits {
        header_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let slow = start(slow);
    let t0 = Instant::now();
    let (status, _, body) = exchange(&slow, huge.as_bytes());
    assert_eq!(status, 408, "{body}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // The server still serves.
    assert_eq!(exchange(&s, b"GET /ok HTTP/1.1\r\n\r\n").0, 200);
}

#[test]
fn conflicting_length_and_chunked_is_read_by_its_chunks_alone_then_closed() {
    // RFC 9112 §6.3: Transfer-Encoding overrides Content-Length, and the server must close the
    // connection after answering. The bytes the length would have left over (a smuggled request)
    // are never read as a request of their own.
    let s = start(Limits::default());
    let (mut w, mut r) = connect(&s);
    w.write_all(
        b"POST /a HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n\
          3\r\nabc\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n",
    )
    .unwrap();
    let (status, headers, body) = response(&mut r);
    assert_eq!((status, body.as_str()), (200, "\"POST /a abc\""));
    assert!(headers.contains(&"connection: close".into()), "{headers:?}");
    let mut rest = String::new();
    r.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "", "the smuggled request was not answered");
}

#[test]
fn a_head_must_arrive_within_its_deadline() {
    let limits = Limits {
        header_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let s = start(limits);
    // One byte every 200 ms: each read is quick, the head as a whole is not.
    let (mut w, mut r) = connect(&s);
    let t0 = Instant::now();
    let closed = std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = r.read_to_end(&mut sink);
        (t0.elapsed(), sink)
    });
    for b in b"GET /slow HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
        if w.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        if closed.is_finished() {
            break;
        }
    }
    let (took, sink) = closed.join().unwrap();
    assert!(
        took < Duration::from_secs(5),
        "the connection was closed after {took:?}"
    );
    assert!(
        !String::from_utf8_lossy(&sink).contains("200"),
        "the slow request was not served"
    );
    // An idle keep-alive connection is closed by the same deadline.
    let (mut w, mut r) = connect(&s);
    write!(w, "GET /a HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(response(&mut r).0, 200);
    let t0 = Instant::now();
    assert_eq!(r.read(&mut [0; 1]).unwrap(), 0, "closed");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// `n` connections, each served and then held open at once: the open connections.
fn held_at_once(s: &Server, n: usize) -> Vec<(TcpStream, BufReader<TcpStream>)> {
    (0..n)
        .map(|_| {
            let (mut w, mut r) = connect(s);
            write!(w, "GET /a HTTP/1.1\r\n\r\n").unwrap();
            assert_eq!(response(&mut r).0, 200);
            (w, r)
        })
        .collect()
}

#[test]
fn connection_slots_come_back_however_a_connection_ends() {
    let limits = Limits {
        max_connections: 4,
        ..Default::default()
    };
    let s = start(limits);
    // Four connections held open: a fifth is told the server is busy, with Retry-After.
    let held = held_at_once(&s, 4);
    let (status, headers, body) = exchange(&s, b"GET /a HTTP/1.1\r\n\r\n");
    assert_eq!(status, 503, "{body}");
    assert!(headers.contains(&"retry-after: 1".into()), "{headers:?}");
    assert!(body.contains("server is full"), "{body}");
    drop(held);
    std::thread::sleep(Duration::from_millis(200));
    // Connections that end every way there is: answered, refused, cut off mid-head, reset with a
    // request in flight, a handler that panics (a 500, the connection kept).
    for _ in 0..3 {
        assert_eq!(exchange(&s, b"GET /a HTTP/1.1\r\n\r\n").0, 200);
        assert_eq!(exchange(&s, b"BAD\r\n\r\n").0, 400);
        let (mut w, _) = connect(&s);
        w.write_all(b"GET /a HTT").unwrap();
        drop(w);
        let (mut w, _) = connect(&s);
        w.write_all(b"GET /hold HTTP/1.1\r\n\r\n").unwrap();
        drop(w);
        let (status, _, body) = exchange(&s, b"GET /panic HTTP/1.1\r\n\r\n");
        assert_eq!(status, 500, "{body}");
    }
    std::thread::sleep(Duration::from_millis(600));
    // All four slots are free again.
    held_at_once(&s, 4);
}

#[test]
fn the_api_key_guards_every_path_but_health() {
    let limits = Limits {
        api_key: Some("sekret".into()),
        ..Default::default()
    };
    let s = start(limits);
    let health = exchange(&s, b"GET /health HTTP/1.1\r\n\r\n");
    assert_eq!(health.0, 200);
    for auth in [
        "",
        "Authorization: Bearer wrong\r\n",
        "Authorization: sekret\r\n",
    ] {
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n{auth}Content-Length: 2\r\n\r\n{{}}"
        );
        let (status, _, body) = exchange(&s, request.as_bytes());
        assert_eq!(status, 401, "{auth:?}: {body}");
        let e: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["code"], 401);
    }
    let ok = exchange(
        &s,
        b"POST /v1/x HTTP/1.1\r\nContent-Type: application/json\r\nAuthorization: Bearer sekret\r\nContent-Length: 2\r\n\r\nhi",
    );
    assert_eq!((ok.0, ok.2.as_str()), (200, "\"POST /v1/x hi\""));
}

#[test]
fn the_handler_sees_a_client_disconnect() {
    let s = start(Limits::default());
    let (mut w, r) = connect(&s);
    write!(w, "GET /wait HTTP/1.1\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop((w, r));
    let waited = s.gone.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(
        waited < Duration::from_secs(5),
        "the handler saw the disconnect after {waited:?}"
    );
}

#[test]
fn stop_returns_with_idle_connections_open() {
    let mut s = start(Limits::default());
    let (mut w, mut r) = connect(&s);
    write!(w, "GET /x HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(response(&mut r).0, 200);
    // The connection stays open (keep-alive) and idle; the server still stops promptly.
    let t0 = Instant::now();
    s.stop.store(true, Ordering::SeqCst);
    s.thread.take().unwrap().join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// A request mutated `n` times: bytes flipped, inserted, deleted, cut, or a line duplicated.
fn mutate(base: &[u8], rng: &mut u64) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..1 + splitmix64(rng) % 4 {
        let at = (splitmix64(rng) as usize) % (v.len() + 1);
        match splitmix64(rng) % 6 {
            0 if at < v.len() => v[at] = splitmix64(rng) as u8,
            1 => v.insert(at, splitmix64(rng) as u8),
            2 if at < v.len() => {
                v.remove(at);
            }
            3 => v.truncate(at),
            4 => {
                let special = [
                    b"\r\n".as_slice(),
                    b":",
                    b" ",
                    b"\0",
                    b"\xff",
                    b"ffffffffffffffffff",
                ];
                let s = special[(splitmix64(rng) % special.len() as u64) as usize];
                v.splice(at..at, s.iter().copied());
            }
            _ => {
                let line = b"Content-Length: 99999999999999999999\r\n";
                let end = v.windows(2).position(|w| w == b"\r\n").map_or(0, |p| p + 2);
                v.splice(end..end, line.iter().copied());
            }
        }
    }
    v
}

#[test]
fn random_and_mutated_requests_never_panic_or_leak_a_slot() {
    // 3000 cases from a fixed seed, each on its own connection, its sending side closed so a cut
    // request ends rather than waits for its deadline.
    let limits = Limits {
        max_connections: 8,
        header_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let s = start(limits);
    let bases: [&[u8]; 3] = [
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"prompt\":\"a\"}",
        b"POST /generate HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"GET /health HTTP/1.1\r\nConnection: keep-alive\r\n\r\nGET /v1/models HTTP/1.1\r\n\r\n",
    ];
    let mut rng = 42u64;
    let mut statuses = std::collections::BTreeMap::new();
    for case in 0..3000 {
        let request = if case % 10 == 9 {
            (0..splitmix64(&mut rng) % 200)
                .map(|_| splitmix64(&mut rng) as u8)
                .collect()
        } else {
            mutate(bases[case % 3], &mut rng)
        };
        let (mut w, mut r) = connect(&s);
        r.get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let _ = w.write_all(&request);
        let _ = w.shutdown(Shutdown::Write);
        let mut answer = Vec::new();
        let _ = r.read_to_end(&mut answer);
        let status = (answer.starts_with(b"HTTP/1.1 ") || answer.starts_with(b"HTTP/1.0 "))
            .then(|| String::from_utf8_lossy(&answer[9..12.min(answer.len())]).to_string())
            .unwrap_or_else(|| {
                if answer.is_empty() {
                    "closed".into()
                } else {
                    "garbled".into()
                }
            });
        assert_ne!(status, "garbled", "case {case}: {request:?} → {answer:?}");
        assert_ne!(status, "503", "case {case}: a slot leaked");
        *statuses.entry(status).or_insert(0) += 1;
    }
    eprintln!("mutated requests: {statuses:?}");
    assert!(
        statuses.len() > 2,
        "the cases reach more than one outcome: {statuses:?}"
    );
    // Every slot comes back: eight connections at once are all served. A connection's slot is
    // given back by its task just after its socket closes, so the last case's may still be on its
    // way (seen on a loaded 2-core machine): a leak is a slot still missing seconds later.
    let t0 = Instant::now();
    loop {
        let served: Vec<u16> = (0..8)
            .map(|_| {
                let (mut w, r) = connect(&s);
                write!(w, "GET /a HTTP/1.1\r\n\r\n").unwrap();
                (w, r)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|(_w, mut r)| response(&mut r).0)
            .collect();
        if served.iter().all(|&s| s == 200) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a slot leaked: {served:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn serving_beyond_loopback_without_a_key_is_warned_about() {
    use k3mini_http::exposure_warning;
    let open: std::net::SocketAddr = "0.0.0.0:8000".parse().unwrap();
    let w = exposure_warning(&open, &Limits::default()).unwrap();
    assert!(w.contains("0.0.0.0:8000 without an API key"), "{w}");
    let loopback = "[::1]:8000".parse().unwrap();
    assert_eq!(exposure_warning(&loopback, &Limits::default()), None);
    let keyed = Limits {
        api_key: Some("k".into()),
        ..Default::default()
    };
    assert_eq!(exposure_warning(&open, &keyed), None);
}

#[test]
fn a_client_that_stops_reading_loses_its_connection_and_slot() {
    // One slot; a client asks for 64 MiB and reads none of it. Its writes stall, and at the
    // deadline the connection ends and the slot is free for the next client.
    let limits = Limits {
        max_connections: 1,
        header_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let s = start(limits);
    let (mut w, _r) = connect(&s);
    write!(w, "GET /big HTTP/1.1\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    loop {
        let (status, _, _) = exchange(&s, b"GET /a HTTP/1.1\r\n\r\n");
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the slot was never freed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "the stalled connection's slot came back after {:?}",
        t0.elapsed()
    );
}

#[test]
fn web_pages_are_refused_and_other_clients_pass() {
    let s = start(Limits::default());
    let port = s.addr.rsplit(':').next().unwrap().to_string();
    let post = |headers: &str| {
        let request =
            format!("POST /v1/completions HTTP/1.1\r\n{headers}Content-Length: 2\r\n\r\n{{}}");
        exchange(&s, request.as_bytes())
    };
    // curl's and the openai package's requests (and k3mini's clients', ureq's).
    let curl = format!(
        "Host: 127.0.0.1:{port}\r\nUser-Agent: curl/8.5.0\r\nAccept: */*\r\n\
         Content-Type: application/json\r\n"
    );
    assert_eq!(post(&curl).0, 200);
    let openai = format!(
        "Host: localhost:{port}\r\nUser-Agent: OpenAI/Python 1.54.0\r\nAccept: application/json\r\n\
         Content-Type: application/json; charset=utf-8\r\nX-Stainless-Lang: python\r\n"
    );
    assert_eq!(post(&openai).0, 200);
    // A page's "simple" POST: text/plain, a form, or no type at all.
    for simple in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ] {
        let (status, _, body) = post(&format!("Host: 127.0.0.1\r\nContent-Type: {simple}\r\n"));
        assert_eq!(status, 415, "{simple}: {body}");
    }
    assert_eq!(post("Host: 127.0.0.1\r\n").0, 415);
    // A rebound name, and a page's Origin.
    let (status, _, body) = post("Host: evil.example:8000\r\nContent-Type: application/json\r\n");
    assert_eq!(status, 421, "{body}");
    let (status, _, body) = exchange(&s, b"GET /health HTTP/1.1\r\nHost: attacker.test\r\n\r\n");
    assert_eq!(status, 421, "{body}");
    let (status, _, body) = post(
        "Host: 127.0.0.1\r\nOrigin: https://evil.example\r\nContent-Type: application/json\r\n",
    );
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("--allowed-origin"), "{body}");

    // Opted in: a named host, and an origin with CORS.
    let open = start(Limits {
        allowed_hosts: vec!["gpu-box.lan".into()],
        allowed_origins: vec!["https://app.example".into()],
        ..Default::default()
    });
    let request =
        b"POST /v1/x HTTP/1.1\r\nHost: gpu-box.lan:8000\r\nOrigin: https://app.example\r\n\
        Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let (status, headers, _) = exchange(&open, request);
    assert_eq!(status, 200);
    assert!(
        headers.contains(&"access-control-allow-origin: https://app.example".into()),
        "{headers:?}"
    );
    let preflight = b"OPTIONS /v1/x HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: https://app.example\r\n\
        Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n\r\n";
    let (status, headers, _) = exchange(&open, preflight);
    assert_eq!(status, 204);
    assert!(
        headers
            .iter()
            .any(|h| h.starts_with("access-control-allow-headers:")),
        "{headers:?}"
    );
    let other = b"OPTIONS /v1/x HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: https://evil.example\r\n\
        Access-Control-Request-Method: POST\r\n\r\n";
    assert_eq!(exchange(&open, other).0, 403);
}

/// Raises this process's open-file limit to `n` (the test holds both ends of every connection).
fn open_files(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a local struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_cur.max(n.min(lim.rlim_max));
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
}

/// A connection to `s` from the loopback address `from` (127.0.0.0/8 is all loopback on Linux).
fn connect_from(s: &Server, from: std::net::Ipv4Addr) -> TcpStream {
    use std::os::fd::FromRawFd;
    let to: std::net::SocketAddrV4 = s.addr.parse().unwrap();
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket, bound and connected with sockaddr_in values of the right size.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let here = sockaddr(from, 0);
        assert_eq!(
            libc::bind(fd, (&here as *const libc::sockaddr_in).cast(), len),
            0
        );
        let there = sockaddr(*to.ip(), to.port());
        assert_eq!(
            libc::connect(fd, (&there as *const libc::sockaddr_in).cast(), len),
            0
        );
        TcpStream::from_raw_fd(fd)
    }
}

#[test]
fn six_hundred_idle_connections_from_one_address_leave_health_answering() {
    open_files(4096);
    let s = start(Limits::default());
    // Idle connections from 127.0.0.1, renewed as the server lets them go.
    let stop = Arc::new(AtomicBool::new(false));
    let addr = s.addr.clone();
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                held.retain(|c| {
                    let mut b = [0u8; 1];
                    c.set_nonblocking(true).unwrap();
                    // Still open: nothing to read yet.
                    matches!(c.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
                while held.len() < 600 {
                    match TcpStream::connect(&addr) {
                        Ok(c) => held.push(c),
                        Err(_) => break,
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(1500));
    let other = std::net::Ipv4Addr::new(127, 0, 0, 2);
    let ask = |request: &[u8]| {
        let mut w = connect_from(&s, other);
        w.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        w.write_all(request).unwrap();
        response(&mut BufReader::new(w))
    };
    let mut slowest = Duration::ZERO;
    for _ in 0..5 {
        let t0 = Instant::now();
        let (status, _, body) = ask(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        assert_eq!(status, 200, "{body}");
        // No bound of its own: a starved /health misses the 5 s read timeout; how fast it
        // comes on a loaded CI machine is a measurement (printed), not a test.
        slowest = slowest.max(t0.elapsed());
        // Another client is served as if the flood were not there.
        let (status, _, body) = ask(b"GET /a HTTP/1.1\r\n\r\n");
        assert_eq!(status, 200, "{body}");
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, Ordering::SeqCst);
    flood.join().unwrap();
    eprintln!("under 600 idle connections from one address, the slowest /health: {slowest:?}");
}

#[test]
fn a_full_server_still_answers_health_to_anyone() {
    // Every slot taken by other clients: /health is answered from the overflow pool.
    let s = start(Limits {
        max_connections: 2,
        ..Default::default()
    });
    let held: Vec<TcpStream> = (1..=2)
        .map(|i| connect_from(&s, std::net::Ipv4Addr::new(127, 0, 0, 10 + i)))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let (status, _, body) = exchange(&s, b"GET /health HTTP/1.1\r\n\r\n");
    assert_eq!(status, 200, "{body}");
    let (status, headers, _) = exchange(&s, b"GET /a HTTP/1.1\r\n\r\n");
    assert_eq!(status, 503);
    assert!(headers.contains(&"retry-after: 1".into()), "{headers:?}");
    drop(held);
}

#[test]
fn a_client_gone_behind_trailing_bytes_is_seen() {
    // A stray CRLF or a pipelined request after the head: hyper holds those bytes and stops
    // reading, so only the socket can say the client left.
    for trailing in ["\r\n", "GET /a HTTP/1.1\r\n\r\n"] {
        let s = start(Limits::default());
        let (mut w, r) = connect(&s);
        write!(w, "GET /wait HTTP/1.1\r\n\r\n{trailing}").unwrap();
        std::thread::sleep(Duration::from_millis(300));
        drop((w, r));
        let waited = s.gone.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(
            waited < Duration::from_secs(2),
            "{trailing:?}: the handler saw the disconnect after {waited:?}"
        );
    }
}

#[test]
fn an_unauthenticated_body_is_not_read() {
    let s = start(Limits {
        api_key: Some("sekret".into()),
        ..Default::default()
    });
    // 60 MB announced, none sent: the answer comes from the head alone, /health included.
    for path in ["/v1/completions", "/health"] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 60000000\r\n\r\n"
        );
        let t0 = Instant::now();
        let (status, _, body) = exchange(&s, head.as_bytes());
        assert_eq!(status, 401, "{path}: {body}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}

#[test]
fn what_a_reply_holds_is_let_go_once_its_body_is_sent() {
    let s = start(Limits::default());
    let (status, _, body) = exchange(&s, b"GET /held HTTP/1.1\r\n\r\n");
    assert_eq!((status, body.as_str()), (200, "\"held\""));
    s.gone.recv_timeout(Duration::from_secs(5)).unwrap();

    // A stream holds it until its last event is written, not until the handler returns.
    let (mut w, mut r) = connect(&s);
    write!(w, "GET /held-events HTTP/1.1\r\n\r\n").unwrap();
    let mut line = String::new();
    while !line.starts_with("data: first") {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
    }
    assert_eq!(
        s.gone.try_recv(),
        Err(mpsc::TryRecvError::Empty),
        "let go of while its stream was open"
    );
    while line.trim_end() != "0" {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "no last chunk");
    }
    s.gone.recv_timeout(Duration::from_secs(5)).unwrap();

    // A client gone mid-stream lets it go too.
    let (mut w, mut r) = connect(&s);
    write!(w, "GET /held-events HTTP/1.1\r\n\r\n").unwrap();
    line.clear();
    while !line.starts_with("data: first") {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "the stream ended early"
        );
    }
    drop((w, r));
    s.gone.recv_timeout(Duration::from_secs(10)).unwrap();
}
