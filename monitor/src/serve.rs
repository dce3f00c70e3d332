//! `vgpu-smi serve`: the Prometheus endpoint, on a port a container's neighbours may reach, so no
//! client can stop it, stall the other scrapes or make it hold unbounded memory.
//!
//! One thread runs every connection (tokio's current-thread runtime, hyper's HTTP/1 server): a
//! client that never reads blocks only its own connection, and no thread is started per client.
//! Each connection is bounded: its request head in size ([`MAX_REQUEST_BYTES`]) and in time
//! ([`HEADER_TIMEOUT`]), its whole life ([`CONNECTION_BUDGET`], which also bounds a response that
//! its client does not read) and its requests ([`MAX_REQUESTS_PER_CONNECTION`]). Connections are
//! bounded in number, overall and per client address, below the file descriptors the process may
//! open; a connection over a bound is closed at once. An accept that fails for lack of resources
//! (file descriptors, memory) backs off and carries on; any other failure of the listening socket
//! ends `serve` with one line and a non-zero status.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, TcpListener as StdListener};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONNECTION, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// The largest request head read (request line and headers): a scrape's is a few hundred bytes.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;
/// How long a client may take to send a request head, from the connection's start.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection lives, its responses written or not: a scrape takes milliseconds, and
/// Prometheus opens a new connection when its kept one was closed.
pub const CONNECTION_BUDGET: Duration = Duration::from_secs(10);
/// Requests answered on one connection; the last one's response closes it.
pub const MAX_REQUESTS_PER_CONNECTION: u32 = 100;
/// Connections open at once, at most (fewer where the process may open fewer files).
pub const MAX_CONNECTIONS: usize = 256;
/// Connections open at once from one client address, at most.
pub const MAX_CONNECTIONS_PER_CLIENT: usize = 32;
/// File descriptors kept free of connections (the listener, region files read per scrape).
const RESERVED_DESCRIPTORS: usize = 32;
/// The longest pause after an accept that failed for lack of resources.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How often connections closed for a bound are reported (as a count).
const REPORT_PERIOD: Duration = Duration::from_secs(10);

/// What a scrape of `/metrics` answers: the exposition text, or why it could not be encoded.
pub type Metrics = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

/// Serves `metrics` at `/metrics` on `listen` until the listening socket fails. Prints the address
/// (`vgpu-smi: serving metrics on http://ADDRESS/metrics`) once listening.
pub fn serve(listen: &str, metrics: Metrics) -> Result<(), String> {
    let listener = StdListener::bind(listen).map_err(|error| format!("cannot listen on {listen}: {error}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|error| format!("cannot listen on {listen}: {error}"))?;
    let address = listener
        .local_addr()
        .map_or_else(|_| listen.to_string(), |address| address.to_string());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|error| format!("cannot start the server: {error}"))?;
    runtime.block_on(async move {
        let listener =
            TcpListener::from_std(listener).map_err(|error| format!("cannot listen on {listen}: {error}"))?;
        println!("vgpu-smi: serving metrics on http://{address}/metrics");
        accept_loop(listener, metrics, connection_bound()).await
    })
}

/// Connections allowed at once: [`MAX_CONNECTIONS`], or fewer where the process's file descriptor
/// limit leaves less room.
fn connection_bound() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct it is given, which lives on this stack.
    let known = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    let descriptors = if known && limit.rlim_cur != libc::RLIM_INFINITY {
        usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
    } else {
        usize::MAX
    };
    MAX_CONNECTIONS
        .min(descriptors.saturating_sub(RESERVED_DESCRIPTORS))
        .max(1)
}

async fn accept_loop(listener: TcpListener, metrics: Metrics, bound: usize) -> Result<(), String> {
    let open = Arc::new(Mutex::new(Open::default()));
    let mut backoff = Duration::ZERO;
    let mut report = Report::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => {
                backoff = Duration::ZERO;
                accepted
            }
            Err(error) => match AcceptError::of(&error) {
                AcceptError::Transient => continue,
                AcceptError::OutOfResources => {
                    backoff = (backoff * 2).clamp(Duration::from_millis(10), MAX_BACKOFF);
                    report.note_exhausted(&error, backoff);
                    tokio::time::sleep(backoff).await;
                    continue;
                }
                AcceptError::Fatal => return Err(format!("accepting connections failed: {error}")),
            },
        };
        let Some(guard) = Open::enter(&open, peer.ip(), bound) else {
            report.note_refused(bound);
            drop(stream); // over a bound: closed at once
            continue;
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let _guard = guard;
            serve_connection(stream, metrics).await;
        });
    }
}

/// What a failed accept means for the listener.
enum AcceptError {
    /// The connection went away before it was accepted, or a signal interrupted: accept again.
    Transient,
    /// No file descriptor or memory for one more connection: accept again after a pause, once
    /// open connections have closed.
    OutOfResources,
    /// The listening socket itself failed.
    Fatal,
}

impl AcceptError {
    fn of(error: &io::Error) -> AcceptError {
        match error.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => AcceptError::OutOfResources,
            Some(
                libc::ECONNABORTED
                | libc::ECONNRESET
                | libc::EINTR
                | libc::EAGAIN
                | libc::EPROTO
                | libc::EPERM
                | libc::ENETDOWN
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH,
            ) => AcceptError::Transient,
            _ if error.kind() == io::ErrorKind::Interrupted => AcceptError::Transient,
            _ => AcceptError::Fatal,
        }
    }
}

/// The connections open now, in all and per client address.
#[derive(Default)]
struct Open {
    total: usize,
    per_client: HashMap<IpAddr, usize>,
}

/// A connection counted in [`Open`] until it is dropped.
struct OpenGuard {
    open: Arc<Mutex<Open>>,
    client: IpAddr,
}

impl Open {
    /// Counts a connection from `client`, unless it would pass a bound.
    fn enter(open: &Arc<Mutex<Open>>, client: IpAddr, bound: usize) -> Option<OpenGuard> {
        let mut counts = open.lock().unwrap_or_else(PoisonError::into_inner);
        let from_client = counts.per_client.get(&client).copied().unwrap_or(0);
        if counts.total >= bound || from_client >= MAX_CONNECTIONS_PER_CLIENT {
            return None;
        }
        counts.total += 1;
        counts.per_client.insert(client, from_client + 1);
        Some(OpenGuard {
            open: Arc::clone(open),
            client,
        })
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        let mut counts = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total = counts.total.saturating_sub(1);
        if let Some(count) = counts.per_client.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                counts.per_client.remove(&self.client);
            }
        }
    }
}

/// Reports, on stderr, connections closed for a bound and accepts that failed for lack of
/// resources: the first of each at once, then a count at most every [`REPORT_PERIOD`].
#[derive(Default)]
struct Report {
    refused: u64,
    refused_reported: Option<Instant>,
    exhausted: u64,
    exhausted_reported: Option<Instant>,
}

impl Report {
    fn note_refused(&mut self, bound: usize) {
        self.refused += 1;
        if due(&mut self.refused_reported) {
            eprintln!(
                "vgpu-smi serve: closed {} connection(s) over the bounds ({bound} open at once, {MAX_CONNECTIONS_PER_CLIENT} \
                 per client address)",
                std::mem::take(&mut self.refused)
            );
        }
    }

    fn note_exhausted(&mut self, error: &io::Error, backoff: Duration) {
        self.exhausted += 1;
        if due(&mut self.exhausted_reported) {
            eprintln!(
                "vgpu-smi serve: accepting a connection failed {} time(s) ({error}); accepting again in {} ms",
                std::mem::take(&mut self.exhausted),
                backoff.as_millis()
            );
        }
    }
}

/// Whether a report is due (none yet, or the last one [`REPORT_PERIOD`] ago); records it.
fn due(last: &mut Option<Instant>) -> bool {
    let now = Instant::now();
    if last.is_some_and(|last| now.duration_since(last) < REPORT_PERIOD) {
        return false;
    }
    *last = Some(now);
    true
}

async fn serve_connection(stream: tokio::net::TcpStream, metrics: Metrics) {
    let answered = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let count = answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let mut response = answer(&request, &metrics);
        if count >= MAX_REQUESTS_PER_CONNECTION {
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        async move { Ok::<_, Infallible>(response) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_REQUEST_BYTES)
        .max_headers(64);
    let connection = http.serve_connection(TokioIo::new(stream), service);
    // A connection's errors (a malformed or oversized request, a client gone) are its own: hyper
    // answers what it can, and the connection is closed.
    let _ = tokio::time::timeout(CONNECTION_BUDGET, connection).await;
}

/// The response to one request: `/metrics`, a pointer to it at `/`, 404 elsewhere, 405 for any
/// method but GET and HEAD.
fn answer(request: &Request<Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, TEXT, "only GET is served\n".into());
    }
    match request.uri().path() {
        "/metrics" => match metrics() {
            Ok(body) => text(StatusCode::OK, crate::metrics::CONTENT_TYPE, body),
            Err(error) => text(
                StatusCode::INTERNAL_SERVER_ERROR,
                TEXT,
                format!("encoding failed: {error}\n"),
            ),
        },
        "/" => text(StatusCode::OK, TEXT, "vgpu-smi: metrics are at /metrics\n".into()),
        _ => text(
            StatusCode::NOT_FOUND,
            TEXT,
            "not found; metrics are at /metrics\n".into(),
        ),
    }
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_errors_are_told_apart() {
        let kind = |code| AcceptError::of(&io::Error::from_raw_os_error(code));
        assert!(matches!(kind(libc::EMFILE), AcceptError::OutOfResources));
        assert!(matches!(kind(libc::ENFILE), AcceptError::OutOfResources));
        assert!(matches!(kind(libc::ECONNABORTED), AcceptError::Transient));
        assert!(matches!(kind(libc::EBADF), AcceptError::Fatal));
        assert!(matches!(kind(libc::EINVAL), AcceptError::Fatal));
    }

    #[test]
    fn connections_are_bounded_overall_and_per_client() {
        let open = Arc::new(Mutex::new(Open::default()));
        let a: IpAddr = "10.0.0.1".parse().expect("address");
        let b: IpAddr = "10.0.0.2".parse().expect("address");
        let from_a: Vec<_> = (0..MAX_CONNECTIONS_PER_CLIENT)
            .map(|_| Open::enter(&open, a, 40).expect("within the bounds"))
            .collect();
        assert!(Open::enter(&open, a, 40).is_none(), "a client past its bound");
        let from_b: Vec<_> = (0..8).map(|_| Open::enter(&open, b, 40).expect("within")).collect();
        assert!(Open::enter(&open, b, 40).is_none(), "past the overall bound");
        drop(from_a);
        assert!(
            Open::enter(&open, b, 40).is_some(),
            "closed connections free their places"
        );
        drop(from_b);
        let counts = open.lock().expect("not poisoned");
        assert_eq!((counts.total, counts.per_client.len()), (0, 0));
    }

    #[test]
    fn the_bound_leaves_room_below_the_descriptor_limit() {
        let bound = connection_bound();
        assert!((1..=MAX_CONNECTIONS).contains(&bound), "{bound}");
    }
}
