//! The server's HTTP/1.1 layer over loopback with a handler that echoes what it was given:
//! keep-alive, chunked bodies, `Expect: 100-continue`, malformed requests answered and closed, a
//! disconnected client seen by the handler, and a prompt stop with idle connections open.
use k3mini_teacher::http::{self, HttpError, Peer, Request, Response};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

fn reply(status: u16, text: String) -> Response {
    Response {
        status,
        content_type: "text/plain",
        body: text.into_bytes(),
        retry_after: None,
    }
}

/// `METHOD PATH BODY` for a request; `error STATUS MESSAGE` for one that could not be read. A
/// request to `/wait` holds until its client has gone (at most 20 s) and sends how long that took.
fn echo(
    request: Result<&Request, HttpError>,
    peer: &Peer,
    gone: &mpsc::Sender<Duration>,
) -> Response {
    match request {
        Ok(r) if r.path == "/wait" => {
            let t0 = Instant::now();
            while !peer.gone() && t0.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = gone.send(t0.elapsed());
            reply(200, "done".into())
        }
        Ok(r) => reply(
            200,
            format!(
                "{} {} {}",
                r.method,
                r.path,
                String::from_utf8_lossy(&r.body)
            ),
        ),
        Err(e) => reply(e.status, format!("error {} {}", e.status, e.message)),
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

fn start() -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, gone) = mpsc::channel();
    let s = stop.clone();
    let thread = std::thread::spawn(move || {
        let tx = std::sync::Mutex::new(tx);
        http::serve(listener, &s, &|r, p| {
            echo(r, p, &tx.lock().unwrap().clone())
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
    let status = line.split_whitespace().nth(1).unwrap().parse().unwrap();
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

#[test]
fn keep_alive_chunked_and_expect_continue() {
    let s = start();
    let (mut w, mut r) = connect(&s);
    // Two requests on one connection, the second chunked, with a query string dropped.
    write!(
        w,
        "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    )
    .unwrap();
    let (status, headers, body) = response(&mut r);
    assert_eq!((status, body.as_str()), (200, "POST /a hello"));
    assert!(
        headers.contains(&"connection: keep-alive".into()),
        "{headers:?}"
    );
    write!(
        w,
        "POST /b?x=1 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nTrailer: t\r\n\r\n"
    )
    .unwrap();
    assert_eq!(response(&mut r).2, "POST /b wikipedia");
    // Expect: 100-continue is answered before the body is sent.
    write!(
        w,
        "POST /c HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n"
    )
    .unwrap();
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert_eq!(line, "HTTP/1.1 100 Continue\r\n");
    r.read_line(&mut line).unwrap();
    w.write_all(b"abc").unwrap();
    assert_eq!(response(&mut r).2, "POST /c abc");
    // Connection: close is honoured: the server closes after answering.
    write!(w, "GET /d HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
    let (_, headers, body) = response(&mut r);
    assert_eq!(body, "GET /d ");
    assert!(headers.contains(&"connection: close".into()), "{headers:?}");
    assert_eq!(r.read(&mut [0; 1]).unwrap(), 0, "closed");
}

#[test]
fn malformed_requests_are_answered_and_closed() {
    let s = start();
    let long = format!("GET /x HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(70 << 10));
    for (request, status) in [
        ("GARBAGE\r\n\r\n".to_string(), 400),
        ("GET /x HTTP/2.0\r\n\r\n".into(), 505),
        ("GET /x HTTP/1.1\r\nno colon\r\n\r\n".into(), 400),
        (
            "POST /x HTTP/1.1\r\nContent-Length: ten\r\n\r\n".into(),
            400,
        ),
        (
            "POST /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n".into(),
            400,
        ),
        (
            "POST /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n".into(),
            501,
        ),
        (
            "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".into(),
            400,
        ),
        (
            format!("POST /x HTTP/1.1\r\nContent-Length: {}\r\n\r\n", 1u64 << 40),
            413,
        ),
        (long, 431),
    ] {
        let (mut w, mut r) = connect(&s);
        w.write_all(request.as_bytes()).unwrap();
        let (got, headers, body) = response(&mut r);
        assert_eq!(got, status, "{request:.60?}: {body}");
        assert!(body.starts_with(&format!("error {status} ")), "{body}");
        assert!(headers.contains(&"connection: close".into()), "{headers:?}");
    }
    // The server still serves.
    let (mut w, mut r) = connect(&s);
    write!(w, "GET /ok HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(response(&mut r).0, 200);
}

#[test]
fn the_handler_sees_a_client_disconnect() {
    let s = start();
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
    let mut s = start();
    let (mut w, mut r) = connect(&s);
    write!(w, "GET /x HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(response(&mut r).0, 200);
    // The connection stays open (keep-alive) and idle; the server still stops promptly.
    let t0 = Instant::now();
    s.stop.store(true, Ordering::SeqCst);
    s.thread.take().unwrap().join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}
