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
//! - at most `max_in_flight` requests running at once, and at most `max_in_flight_per_peer` of
//!   them from one peer address; more are answered 503 at once, before their body is read. A
//!   listener may keep `reserved_in_flight` further places for requests its [`Reserve`] admits
//!   from their head alone (the OTP server: the controller's calls with a valid bearer token), so
//!   clients without credentials can never take the places of those with them;
//! - handlers read bodies within a [`BodyDeadline`] that fits the body (a grace plus its size at a
//!   minimum rate), separate from their request timeout, so a stalled body frees its place soon;
//! - small protocol buffers (HTTP/1 head buffer, HTTP/2 flow-control windows and header lists),
//!   so what a connection can make the server buffer is known.
//!
//! On shutdown the listener stops accepting at once, in-flight requests finish, idle keep-alive
//! connections are closed (HTTP/1) or sent GOAWAY (HTTP/2), and whatever is still open after the
//! drain deadline is dropped.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Uri, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
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
    /// Most of those `max_in_flight` places one peer address may hold at once (more of its
    /// requests are answered 503); at or above `max_in_flight` there is no share.
    pub max_in_flight_per_peer: usize,
    /// Places beyond `max_in_flight` that only requests the listener's [`Reserve`] admits may
    /// take (they take the shared places once these are full).
    pub reserved_in_flight: usize,
    /// How long the handlers wait for a request body.
    pub body: BodyDeadline,
    /// How long in-flight requests may run after shutdown starts.
    pub drain_timeout: Duration,
}

/// How long a handler waits for a request body: `grace` plus the body's size at `min_rate`
/// bytes a second, the size being the declared `Content-Length` (when within the cap) or else the
/// cap. A 1 KiB token gets about the grace, the largest body proportionally more; a client that
/// stalls its body holds its in-flight place no longer than that, whatever the request timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyDeadline {
    /// Time for the first bytes to come (one lost packet's retransmission fits).
    pub grace: Duration,
    /// Slowest rate a legitimate client sends at, in bytes a second.
    pub min_rate: u64,
}

impl BodyDeadline {
    /// The deadline for a body of at most `cap` bytes, with the request's `headers`.
    pub fn for_body(&self, headers: &HeaderMap, cap: usize) -> Duration {
        let cap = cap as u64;
        let size = declared_length(headers).map_or(cap, |n| n.min(cap));
        self.grace + Duration::from_secs_f64(size as f64 / self.min_rate.max(1) as f64)
    }
}

/// The request's `Content-Length`, if it declares a valid one.
pub fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Which requests may take a listener's reserved in-flight places.
pub trait Reserve: Send + Sync + 'static {
    /// Whether the request, judged by its head alone (nothing of its body is read yet), is one of
    /// the privileged caller's, e.g. carries a valid credential.
    fn admits(&self, uri: &Uri, headers: &HeaderMap) -> bool;
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
            max_in_flight_per_peer: 1024,
            reserved_in_flight: 0,
            body: BodyDeadline {
                grace: Duration::from_secs(1),
                min_rate: 1024 * 1024,
            },
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
            max_in_flight_per_peer: 16,
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

/// A request's in-flight place, given back when it ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Reserved,
    Shared(IpAddr),
}

/// Why a request got no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NoPlace {
    /// Every shared place is taken.
    Full,
    /// The peer holds its share of them.
    PeerShare,
}

impl NoPlace {
    fn as_str(self) -> &'static str {
        match self {
            Self::Full => "every in-flight place is taken",
            Self::PeerShare => "the peer holds its share of the in-flight places",
        }
    }
}

/// The in-flight places of one listener: the pure part of the request policy.
#[derive(Debug)]
struct Places {
    shared: usize,
    per_peer: usize,
    reserved: usize,
    shared_used: usize,
    reserved_used: usize,
    /// Shared places held, by peer; only peers holding one are present, so this has at most
    /// `shared` entries.
    by_peer: HashMap<IpAddr, usize>,
}

impl Places {
    fn new(opts: &ServeOptions) -> Self {
        Self {
            shared: opts.max_in_flight.max(1),
            per_peer: opts.max_in_flight_per_peer.max(1),
            reserved: opts.reserved_in_flight,
            shared_used: 0,
            reserved_used: 0,
            by_peer: HashMap::new(),
        }
    }

    /// A place for a request from `peer`; `privileged` ones (admitted by the listener's
    /// [`Reserve`]) take a reserved place first.
    fn take(&mut self, peer: IpAddr, privileged: bool) -> Result<Place, NoPlace> {
        if privileged && self.reserved_used < self.reserved {
            self.reserved_used += 1;
            return Ok(Place::Reserved);
        }
        if self.shared_used >= self.shared {
            return Err(NoPlace::Full);
        }
        let held = self.by_peer.get(&peer).copied().unwrap_or(0);
        if held >= self.per_peer {
            return Err(NoPlace::PeerShare);
        }
        self.by_peer.insert(peer, held + 1);
        self.shared_used += 1;
        Ok(Place::Shared(peer))
    }

    fn give_back(&mut self, place: Place) {
        match place {
            Place::Reserved => self.reserved_used = self.reserved_used.saturating_sub(1),
            Place::Shared(peer) => {
                self.shared_used = self.shared_used.saturating_sub(1);
                if let Some(held) = self.by_peer.get_mut(&peer) {
                    *held -= 1;
                    if *held == 0 {
                        self.by_peer.remove(&peer);
                    }
                }
            }
        }
    }
}

/// The address a peer's share is counted under: an IPv4 peer on an IPv6 socket counts as itself.
fn peer_key(peer: SocketAddr) -> IpAddr {
    peer.ip().to_canonical()
}

/// What every connection of a listener shares.
struct Listener {
    opts: ServeOptions,
    table: Mutex<Table>,
    closed: Notify,
    places: Mutex<Places>,
    reserve: Option<Arc<dyn Reserve>>,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("opts", &self.opts)
            .field("reserve", &self.reserve.is_some())
            .finish_non_exhaustive()
    }
}

impl Listener {
    fn new(opts: ServeOptions, reserve: Option<Arc<dyn Reserve>>) -> Arc<Self> {
        Arc::new(Self {
            opts,
            table: Mutex::new(Table::new(opts.max_connections)),
            closed: Notify::new(),
            places: Mutex::new(Places::new(&opts)),
            reserve,
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn places(&self) -> std::sync::MutexGuard<'_, Places> {
        self.places.lock().unwrap_or_else(|p| p.into_inner())
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

/// Ends a request in the table and gives its place back when dropped (the handler finished or
/// was cancelled).
struct RequestGuard {
    listener: Arc<Listener>,
    id: u64,
    place: Place,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.listener.places().give_back(self.place);
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
            let privileged = listener
                .reserve
                .as_ref()
                .is_some_and(|r| r.admits(req.uri(), req.headers()));
            let taken = listener.places().take(peer_key(peer), privileged);
            let place = match taken {
                Ok(place) => place,
                Err(why) => {
                    tracing::debug!(%peer, why = why.as_str(), "no in-flight place; answered 503");
                    return Ok::<_, Infallible>(busy());
                }
            };
            listener.table().request_started(id);
            let _running = RequestGuard {
                listener,
                id,
                place,
            };
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
    serve_tls_reserving(listener, tls, app, shutdown, opts, None).await;
}

/// [`serve_tls`] with `opts.reserved_in_flight` places kept for the requests `reserve` admits.
pub async fn serve_tls_reserving(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: CancellationToken,
    opts: ServeOptions,
    reserve: Option<Arc<dyn Reserve>>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(builder(&opts));
    let policy = Listener::new(opts, reserve);
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
    let policy = Listener::new(opts, None);
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
    fn one_peer_holds_at_most_its_share_and_reserved_places_go_to_privileged_requests_only() {
        let opts = ServeOptions {
            max_in_flight: 4,
            max_in_flight_per_peer: 2,
            reserved_in_flight: 1,
            ..ServeOptions::default()
        };
        let ip = |n: u8| IpAddr::from([10, 0, 0, n]);
        let (a, b, c) = (ip(1), ip(2), ip(3));
        let mut p = Places::new(&opts);
        let a1 = p.take(a, false).unwrap();
        p.take(a, false).unwrap();
        assert_eq!(p.take(a, false), Err(NoPlace::PeerShare));
        // A privileged request of the same peer still gets the reserved place...
        assert_eq!(p.take(a, true), Ok(Place::Reserved));
        // ...and with that taken, competes for the shared ones under the peer's share.
        assert_eq!(p.take(a, true), Err(NoPlace::PeerShare));
        assert_eq!(p.take(b, false), Ok(Place::Shared(b)));
        assert_eq!(p.take(b, false), Ok(Place::Shared(b)));
        assert_eq!(p.take(c, false), Err(NoPlace::Full));
        assert_eq!(p.take(c, true), Err(NoPlace::Full));
        p.give_back(Place::Reserved);
        // An unprivileged request never takes a reserved place, even a free one.
        assert_eq!(p.take(c, false), Err(NoPlace::Full));
        assert_eq!(p.take(c, true), Ok(Place::Reserved));
        p.give_back(a1);
        assert_eq!(p.take(c, false), Ok(Place::Shared(c)));
        for peer in [a, b, b, c] {
            p.give_back(Place::Shared(peer));
        }
        p.give_back(Place::Reserved);
        assert!(p.by_peer.is_empty(), "{:?}", p.by_peer);
        assert_eq!((p.shared_used, p.reserved_used), (0, 0));
    }

    #[test]
    fn without_a_share_one_peer_may_take_every_place() {
        let mut p = Places::new(&ServeOptions {
            max_in_flight: 3,
            max_in_flight_per_peer: 3,
            ..ServeOptions::default()
        });
        let a = IpAddr::from([10, 0, 0, 1]);
        for _ in 0..3 {
            p.take(a, false).unwrap();
        }
        assert_eq!(p.take(a, true), Err(NoPlace::Full));
    }

    #[test]
    fn an_ipv4_peer_on_an_ipv6_socket_counts_as_itself() {
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:4000".parse().unwrap();
        let plain: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        assert_eq!(peer_key(mapped), peer_key(plain));
    }

    #[test]
    fn a_body_deadline_is_the_grace_plus_the_bodys_size_at_the_minimum_rate() {
        let d = BodyDeadline {
            grace: Duration::from_millis(500),
            min_rate: 64 * 1024,
        };
        let declared = |n: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_LENGTH, HeaderValue::from_str(n).unwrap());
            h
        };
        let ms = |d: Duration| d.as_millis();
        // A token: well under a second.
        assert_eq!(ms(d.for_body(&declared("1024"), 1024)), 515);
        // Undeclared (chunked, or HTTP/2 without the header): the cap.
        assert_eq!(ms(d.for_body(&HeaderMap::new(), 64 * 1024)), 1500);
        // Declared above the cap: no more than the cap's time.
        assert_eq!(ms(d.for_body(&declared("104857600"), 1024)), 515);
        assert_eq!(ms(d.for_body(&declared("not a number"), 0)), 500);
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
