//! Accept loops for HTTPS and plain HTTP with one connection policy and graceful shutdown.
//!
//! Every listener bounds what a client that never authenticates can hold:
//! - at most `max_connections` open connections. When a new one arrives at the cap, the idle
//!   connection that has waited longest for its first request (else the one idle longest) is
//!   closed to make room, so idle connections can never lock a legitimate client out; only when
//!   every connection has a request running does accepting pause;
//! - a TLS handshake deadline, a deadline from accept to the first complete request head, an
//!   idle timeout between requests, and on HTTP/1 a deadline for the rest of a head once its first
//!   byte came. Bodies are bounded by each router's own request timeout and size limit;
//! - at most `max_in_flight` requests running at once; more are answered 503 at once, before
//!   their body is read;
//! - small protocol buffers (HTTP/1 head buffer, HTTP/2 flow-control windows and header lists),
//!   so what a connection can make the server buffer is known.
//!
//! On shutdown the listener stops accepting at once, in-flight requests finish, idle keep-alive
//! connections are closed (HTTP/1) or sent GOAWAY (HTTP/2), and whatever is still open after the
//! drain deadline is dropped.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Connection-level limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Longest TLS handshake.
    pub handshake_timeout: Duration,
    /// Longest time from accept to the first complete request head (handshake included).
    pub first_request_timeout: Duration,
    /// Longest time a connection may stay open with no request running after its last one.
    pub idle_timeout: Duration,
    /// HTTP/1: longest time to receive the rest of a request head once its first byte arrived.
    pub header_read_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Most requests running at once; more are answered 503.
    pub max_in_flight: usize,
    /// How long in-flight requests may run after shutdown starts.
    pub drain_timeout: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            first_request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            header_read_timeout: Duration::from_secs(10),
            max_connections: 4096,
            max_in_flight: 1024,
            drain_timeout: Duration::from_secs(20),
        }
    }
}

impl ServeOptions {
    /// Limits for an admin port (probes and metrics scrapes: a handful of clients).
    pub fn admin(drain_timeout: Duration) -> Self {
        Self {
            max_connections: 64,
            max_in_flight: 16,
            drain_timeout,
            ..Self::default()
        }
    }
}

/// Largest HTTP/1 read buffer: a request head must fit (hyper's default is 400 KiB).
const H1_MAX_BUF: usize = 64 * 1024;
/// HTTP/2 flow-control windows: what a client may send ahead of the handler reading it.
const H2_STREAM_WINDOW: u32 = 128 * 1024;
const H2_CONN_WINDOW: u32 = 256 * 1024;
const H2_MAX_STREAMS: u32 = 64;
const H2_MAX_HEADER_LIST: u32 = 32 * 1024;

fn builder(opts: &ServeOptions) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_read_timeout)
        .max_buf_size(H1_MAX_BUF)
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONN_WINDOW)
        .max_concurrent_streams(H2_MAX_STREAMS)
        .max_header_list_size(H2_MAX_HEADER_LIST)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    b
}

/// One open connection as the policy sees it.
#[derive(Debug, Clone)]
struct Conn {
    opened: Instant,
    /// Requests running now.
    in_flight: usize,
    /// When the last request ended; `None` before the first.
    last_request: Option<Instant>,
    close: CancellationToken,
}

impl Conn {
    /// When the connection is idle for good, if no request starts before.
    fn idle_deadline(&self, opts: &ServeOptions) -> Option<Instant> {
        (self.in_flight == 0).then(|| match self.last_request {
            None => self.opened + opts.first_request_timeout,
            Some(t) => t + opts.idle_timeout,
        })
    }

    /// Eviction order among idle connections: never used first, then longest idle.
    fn eviction_key(&self) -> Option<(bool, Instant)> {
        (self.in_flight == 0).then_some(match self.last_request {
            None => (false, self.opened),
            Some(t) => (true, t),
        })
    }
}

/// The open connections of one listener: the pure part of the policy (time is passed in).
#[derive(Debug)]
struct Table {
    max: usize,
    next_id: u64,
    conns: HashMap<u64, Conn>,
}

impl Table {
    fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            next_id: 0,
            conns: HashMap::new(),
        }
    }

    /// Registers a connection opened at `now`, closing an idle one if the table is full. `None`:
    /// full of busy connections; try again once one closes.
    fn open(&mut self, now: Instant) -> Option<(u64, CancellationToken)> {
        if self.conns.len() >= self.max {
            let victim = self
                .conns
                .iter()
                .filter_map(|(id, c)| Some((c.eviction_key()?, *id)))
                .min()
                .map(|(_, id)| id)?;
            if let Some(c) = self.conns.remove(&victim) {
                c.close.cancel();
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let close = CancellationToken::new();
        self.conns.insert(
            id,
            Conn {
                opened: now,
                in_flight: 0,
                last_request: None,
                close: close.clone(),
            },
        );
        Some((id, close))
    }

    fn request_started(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.in_flight += 1;
        }
    }

    fn request_ended(&mut self, id: u64, now: Instant) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.in_flight = c.in_flight.saturating_sub(1);
            c.last_request = Some(now);
        }
    }

    fn close(&mut self, id: u64) {
        self.conns.remove(&id);
    }
}

/// What every connection of a listener shares.
#[derive(Debug)]
struct Listener {
    opts: ServeOptions,
    table: Mutex<Table>,
    closed: Notify,
    in_flight: Arc<Semaphore>,
}

impl Listener {
    fn new(opts: ServeOptions) -> Arc<Self> {
        Arc::new(Self {
            opts,
            table: Mutex::new(Table::new(opts.max_connections)),
            closed: Notify::new(),
            in_flight: Arc::new(Semaphore::new(opts.max_in_flight.max(1))),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a new connection, waiting while every connection is busy.
    async fn open(self: &Arc<Self>, shutdown: &CancellationToken) -> Option<ConnGuard> {
        loop {
            let closed = self.closed.notified();
            if let Some((id, close)) = self.table().open(Instant::now()) {
                return Some(ConnGuard {
                    listener: Arc::clone(self),
                    id,
                    close,
                });
            }
            tracing::warn!(
                max = self.opts.max_connections,
                "every connection is busy; accepting paused"
            );
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = closed => {}
            }
        }
    }
}

/// A registered connection; dropping it frees its place.
struct ConnGuard {
    listener: Arc<Listener>,
    id: u64,
    close: CancellationToken,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.listener.table().close(self.id);
        self.listener.closed.notify_one();
    }
}

impl ConnGuard {
    /// Resolves when the connection has been idle past its deadline.
    async fn idle(&self) {
        let opts = self.listener.opts;
        loop {
            let deadline = self
                .listener
                .table()
                .conns
                .get(&self.id)
                .map(|c| c.idle_deadline(&opts));
            match deadline {
                // Evicted: `close` fires.
                None => return std::future::pending().await,
                Some(Some(d)) if d <= Instant::now() => return,
                Some(Some(d)) => tokio::time::sleep_until(d).await,
                // A request runs: look again after the shorter of the two timeouts.
                Some(None) => {
                    tokio::time::sleep(opts.idle_timeout.min(opts.first_request_timeout)).await
                }
            }
        }
    }
}

/// Ends a request in the table when dropped (the handler finished or was cancelled).
struct RequestGuard {
    listener: Arc<Listener>,
    id: u64,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.listener.table().request_ended(self.id, Instant::now());
    }
}

fn busy() -> Response<Body> {
    let mut r = Response::new(Body::from("server busy, retry later\n"));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let h = r.headers_mut();
    h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Serves one accepted connection under the policy.
async fn serve_conn<I>(
    io: I,
    peer: SocketAddr,
    conn: ConnGuard,
    app: axum::Router,
    builder: Arc<auto::Builder<TokioExecutor>>,
    watcher: Watcher,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let listener = Arc::clone(&conn.listener);
    let id = conn.id;
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let app = app.clone();
        let listener = Arc::clone(&listener);
        async move {
            let Ok(_permit) = Arc::clone(&listener.in_flight).try_acquire_owned() else {
                tracing::debug!(%peer, "too many requests in flight; answered 503");
                return Ok::<_, Infallible>(busy());
            };
            listener.table().request_started(id);
            let _running = RequestGuard { listener, id };
            Ok(app.oneshot(req).await.unwrap_or_else(|e| match e {}))
        }
    });
    let served = watcher.watch(
        builder
            .serve_connection_with_upgrades(TokioIo::new(io), service)
            .into_owned(),
    );
    tokio::select! {
        r = served => if let Err(error) = r {
            tracing::debug!(%peer, %error, "connection ended with an error");
        },
        () = conn.close.cancelled() => {
            tracing::debug!(%peer, "idle connection closed to make room for a new one");
        }
        () = conn.idle() => tracing::debug!(%peer, "idle connection closed"),
    }
}

async fn accept(
    listener: &TcpListener,
    shutdown: &CancellationToken,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return None,
            r = listener.accept() => match r {
                Ok(c) => return Some(c),
                Err(error) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// Serves `app` over TLS on `listener` until `shutdown` fires, then drains.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: CancellationToken,
    opts: ServeOptions,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(builder(&opts));
    let policy = Listener::new(opts);
    while let Some((tcp, peer)) = accept(&listener, &shutdown).await {
        let Some(conn) = policy.open(&shutdown).await else {
            break;
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let (app, builder, watcher) = (app.clone(), Arc::clone(&builder), graceful.watcher());
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            // The handshake counts against the first-request deadline too.
            let handshake = tokio::time::timeout(opts.handshake_timeout, acceptor.accept(tcp));
            let tls = tokio::select! {
                () = shutdown.cancelled() => return,
                () = conn.close.cancelled() => return,
                r = handshake => match r {
                    Ok(Ok(s)) => s,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                },
            };
            serve_conn(tls, peer, conn, app, builder, watcher).await;
        });
    }
    drop(listener);
    drain(graceful, opts.drain_timeout).await;
}

/// Serves `app` over plain HTTP on `listener` until `shutdown` fires, then drains.
pub async fn serve_plain(
    listener: TcpListener,
    app: axum::Router,
    shutdown: CancellationToken,
    opts: ServeOptions,
) {
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(builder(&opts));
    let policy = Listener::new(opts);
    while let Some((tcp, peer)) = accept(&listener, &shutdown).await {
        let Some(conn) = policy.open(&shutdown).await else {
            break;
        };
        let _ = tcp.set_nodelay(true);
        let (app, builder, watcher) = (app.clone(), Arc::clone(&builder), graceful.watcher());
        tokio::spawn(async move {
            serve_conn(tcp, peer, conn, app, builder, watcher).await;
        });
    }
    drop(listener);
    drain(graceful, opts.drain_timeout).await;
}

async fn drain(graceful: GracefulShutdown, deadline: Duration) {
    if tokio::time::timeout(deadline, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?deadline,
            "connections still open after the drain deadline; dropping them"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_closes_the_oldest_unused_then_the_longest_idle_never_a_busy_one() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut t = Table::new(3);
        let (used, used_close) = t.open(t0).unwrap();
        let (busy, _) = t.open(t0).unwrap();
        let (fresh, fresh_close) = t.open(t0 + s).unwrap();
        t.request_started(used);
        t.request_ended(used, t0 + 2 * s);
        t.request_started(busy);
        // Full: the unused connection goes first, even though it is younger than the used one.
        let (newer, _) = t.open(t0 + 3 * s).unwrap();
        assert!(fresh_close.is_cancelled() && !t.conns.contains_key(&fresh));
        // Then the unused newcomer, then the idle used one; the busy one never.
        let (_, _) = t.open(t0 + 4 * s).unwrap();
        assert!(!t.conns.contains_key(&newer));
        assert!(!used_close.is_cancelled());
        t.request_started(t.next_id - 1);
        let _ = t.open(t0 + 5 * s).unwrap();
        assert!(used_close.is_cancelled());
        // Every connection busy: no room until one closes.
        t.request_started(t.next_id - 1);
        assert!(t.open(t0 + 6 * s).is_none());
        assert!(t.conns.contains_key(&busy));
        t.close(busy);
        assert!(t.open(t0 + 6 * s).is_some());
    }

    #[test]
    fn idle_deadlines_run_from_accept_then_from_the_last_request() {
        let opts = ServeOptions::default();
        let t0 = Instant::now();
        let mut t = Table::new(4);
        let (id, _) = t.open(t0).unwrap();
        let deadline = |t: &Table| t.conns[&id].idle_deadline(&opts);
        assert_eq!(deadline(&t), Some(t0 + opts.first_request_timeout));
        t.request_started(id);
        t.request_started(id);
        assert_eq!(deadline(&t), None, "never idle while a request runs");
        let later = t0 + Duration::from_secs(100);
        t.request_ended(id, later);
        assert_eq!(deadline(&t), None);
        t.request_ended(id, later);
        assert_eq!(deadline(&t), Some(later + opts.idle_timeout));
    }
}
