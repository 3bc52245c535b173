//! Unauthenticated resource exhaustion (issue 23 §3), against the real binaries on loopback: each
//! test runs a bounded attack (fixed counts, a time limit), measures the server's memory from
//! `/proc/<pid>/status` against its pod limit (`manifests/`: OTP server 128 Mi, controller
//! 512 Mi), and has a legitimate client served throughout. Where the attack is about in-flight
//! places (issue 31 §5), the attacker, the controller and a build pod (or the API server) come
//! from distinct loopback addresses, as they do in a cluster.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use mpc::otp::token::Token;
use mpc::otp::{OtpClient, Rearm};
use mpc::provision::Zeroizing;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

const MIB: u64 = 1024 * 1024;
const OTP_POD_LIMIT: u64 = 128 * MIB;
const CONTROLLER_POD_LIMIT: u64 = 512 * MIB;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server binary, killed on drop.
struct Process {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Process {
    fn start(mut cmd: Command, addr: SocketAddr, log: PathBuf) -> Self {
        let child = cmd
            .env("MPC_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting mpc");
        let mut p = Self { child, addr, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(addr).is_err() {
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("mpc exited with {status}: {}", p.log_text());
            }
            assert!(Instant::now() < deadline, "mpc did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A `/proc/<pid>/status` field in bytes (`VmRSS`, `VmHWM`).
    fn memory(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().strip_suffix("kB")?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in {status}"));
        kib * 1024
    }

    /// Open sockets of the server (connections plus its listeners).
    fn sockets(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.to_string_lossy().starts_with("socket:"))
            .count()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A temp dir with a CA-signed serving certificate for `localhost`/127.0.0.1 in `tls/`.
struct Certs {
    dir: tempfile::TempDir,
    ca_pem: String,
    client: Arc<rustls::ClientConfig>,
}

impl Certs {
    fn new() -> Self {
        mpc::tls::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let bundle =
            mpc::certs::generate("test", &["localhost".into(), "127.0.0.1".into()], 2).unwrap();
        std::fs::create_dir(dir.path().join("tls")).unwrap();
        mpc::certs::write_bundle(&bundle, &dir.path().join("tls")).unwrap();
        let client =
            mpc::tls::client_config_trusting(bundle.ca_pem.as_bytes(), &[b"http/1.1"]).unwrap();
        Self {
            dir,
            ca_pem: bundle.ca_pem,
            client: Arc::new(client),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

async fn tls_connect(
    addr: SocketAddr,
    client: &Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    tls_connect_from(LOOPBACK, addr, client).await
}

/// The default client address; the others below stand for distinct peers.
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1));
/// One tenant's pod attacking.
const ATTACKER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
/// The controller (OTP server) or the API server (webhook).
const TRUSTED: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3));
/// Another tenant's build pod.
const BUILD_POD: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 4));

/// A TLS connection to `addr` from the loopback address `from`.
async fn tls_connect_from(
    from: IpAddr,
    addr: SocketAddr,
    client: &Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    let tcp = socket.connect(addr).await?;
    tcp.set_nodelay(true)?;
    tokio_rustls::TlsConnector::from(Arc::clone(client))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// One HTTP/1.1 request from `from` on a fresh TLS connection: the status and body, or
/// [`NO_ANSWER`] if the whole answer did not come within `limit`.
async fn exchange_from(
    from: IpAddr,
    addr: SocketAddr,
    client: &Arc<rustls::ClientConfig>,
    path: &str,
    headers: &str,
    body: &[u8],
    limit: Duration,
) -> (u16, Vec<u8>) {
    let exchange = async {
        let mut s = tls_connect_from(from, addr, client).await.ok()?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.ok()?;
        s.write_all(body).await.ok()?;
        let mut answer = Vec::new();
        // The server closes after answering (`Connection: close`); a TLS close without
        // close_notify still leaves the answer read.
        let _ = s.read_to_end(&mut answer).await;
        let split = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
        let status = String::from_utf8_lossy(&answer[..split])
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some((status, answer[split + 4..].to_vec()))
    };
    tokio::time::timeout(limit, exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or((NO_ANSWER, Vec::new()))
}

/// A request body that sends one byte and then stalls (never ends).
type StalledBody = http_body_util::combinators::BoxBody<bytes::Bytes, std::convert::Infallible>;

fn stalled_body() -> StalledBody {
    use http_body_util::BodyExt;
    let first = hyper::body::Frame::data(bytes::Bytes::from_static(b"x"));
    let frames = futures::StreamExt::chain(
        futures::stream::once(std::future::ready(Ok(first))),
        futures::stream::pending(),
    );
    http_body_util::StreamBody::new(frames).boxed()
}

/// A slowloris attack from one address over HTTP/2, as a client that wants to hold places
/// cheaply does it: `slots` streams over connections of 64 (the server's stream limit), each
/// sending a request head and the first byte of the body it declares, waiting for the answer and
/// starting over, until `until` (at most `rounds` times each): at once after a 408 (its body was
/// waited for), else two seconds after its last try, so refusals do not turn the attack into a
/// CPU flood of a test machine's shared cores. `established` counts slots whose first request is out.
struct SlowBodies {
    established: Arc<AtomicUsize>,
    slots: Vec<tokio::task::JoinHandle<BTreeMap<u16, usize>>>,
    stop: tokio_util::sync::CancellationToken,
}

impl SlowBodies {
    async fn start(
        addr: SocketAddr,
        ca_pem: &str,
        path: &'static str,
        headers: Vec<(&'static str, String)>,
        slots: usize,
        rounds: usize,
        until: tokio::time::Instant,
    ) -> Self {
        let h2 = Arc::new(mpc::tls::client_config_trusting(ca_pem.as_bytes(), &[b"h2"]).unwrap());
        let established = Arc::new(AtomicUsize::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let mut tasks = Vec::new();
        for first in (0..slots).step_by(64) {
            let tls = tls_connect_from(ATTACKER, addr, &h2).await.unwrap();
            let (send, conn) = hyper::client::conn::http2::handshake(
                hyper_util::rt::TokioExecutor::new(),
                hyper_util::rt::TokioIo::new(tls),
            )
            .await
            .unwrap();
            tokio::spawn(conn);
            for _ in first..slots.min(first + 64) {
                let (mut send, headers, established, stop) = (
                    send.clone(),
                    headers.clone(),
                    Arc::clone(&established),
                    stop.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    let mut answers = BTreeMap::new();
                    for round in 0..rounds {
                        if tokio::time::Instant::now() >= until || send.is_closed() {
                            break;
                        }
                        let mut req = http::Request::post(path).header("host", "localhost");
                        for (name, value) in &headers {
                            req = req.header(*name, value);
                        }
                        let answer = send.send_request(req.body(stalled_body()).unwrap());
                        if round == 0 {
                            established.fetch_add(1, Ordering::Relaxed);
                        }
                        let sent_at = tokio::time::Instant::now();
                        let status = tokio::select! {
                            () = stop.cancelled() => break,
                            r = tokio::time::timeout_at(until, answer) => match r {
                                Ok(Ok(r)) => r.status().as_u16(),
                                Ok(Err(_)) => CLOSED,
                                Err(_) => NO_ANSWER,
                            },
                        };
                        *answers.entry(status).or_insert(0) += 1;
                        // A stream whose body was waited for starts over at once; a refused one
                        // two seconds after its last try.
                        if status != 408 {
                            let next = until.min(sent_at + Duration::from_secs(2));
                            tokio::select! {
                                () = stop.cancelled() => break,
                                () = tokio::time::sleep_until(next) => {}
                            }
                        }
                    }
                    answers
                }));
            }
        }
        Self {
            established,
            slots: tasks,
            stop,
        }
    }

    /// Waits until every slot's first request is out (or `limit` passes); how many are.
    async fn established(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        let all = self.slots.len();
        while self.established.load(Ordering::Relaxed) < all && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Let the last heads and first bytes reach the server.
        tokio::time::sleep(Duration::from_millis(500)).await;
        self.established.load(Ordering::Relaxed)
    }

    /// Ends the attack; the answers it got, by status.
    async fn answers(self) -> BTreeMap<u16, usize> {
        self.stop.cancel();
        let mut all = BTreeMap::new();
        for slot in self.slots {
            for (status, n) in slot.await.unwrap() {
                *all.entry(status).or_insert(0) += n;
            }
        }
        all
    }
}

/// Runs `legit` `calls` times, one after the other, for at most `limit`: how many succeeded and
/// the failures. Counted rather than timed, so a test machine busy with other tests only makes
/// the run slower.
async fn legitimate_calls<F, Fut>(
    calls: usize,
    limit: Duration,
    mut legit: F,
) -> (usize, Vec<String>)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + limit;
    let (mut served, mut failures) = (0, Vec::new());
    for _ in 0..calls {
        if Instant::now() >= deadline {
            break;
        }
        match legit().await {
            Ok(()) => served += 1,
            Err(e) => failures.push(e),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (served, failures)
}

/// How many of `failures` start with `what`.
fn failed(failures: &[String], what: &str) -> usize {
    failures.iter().filter(|f| f.starts_with(what)).count()
}

/// No answer within the time limit.
const NO_ANSWER: u16 = 0;
/// The server closed (or reset) the connection without a status line.
const CLOSED: u16 = 1;

/// The status of the response at the start of `stream`, read within `limit`.
async fn read_status<S: tokio::io::AsyncRead + Unpin>(stream: &mut S, limit: Duration) -> u16 {
    let mut buf = Vec::new();
    let mut closed = false;
    let read = async {
        let mut chunk = [0u8; 4096];
        while !buf.windows(2).any(|w| w == b"\r\n") {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    closed = true;
                    break;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    let _ = tokio::time::timeout(limit, read).await;
    let line = String::from_utf8_lossy(&buf);
    let status = line.split_whitespace().nth(1).and_then(|s| s.parse().ok());
    match status {
        Some(s) => s,
        None if closed => CLOSED,
        None => NO_ANSWER,
    }
}

/// One HTTP/1.1 request on a fresh TLS connection; the response status, or 0 if none came
/// within `limit`.
async fn request(
    addr: SocketAddr,
    client: &Arc<rustls::ClientConfig>,
    path: &str,
    headers: &str,
    body: &[u8],
    limit: Duration,
) -> u16 {
    let exchange = async {
        let mut s = tls_connect(addr, client).await.ok()?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}Content-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.ok()?;
        s.write_all(body).await.ok()?;
        Some(read_status(&mut s, limit).await)
    };
    tokio::time::timeout(limit, exchange)
        .await
        .ok()
        .flatten()
        .unwrap_or(NO_ANSWER)
}

/// Runs `legit` every `every` until `stop`, counting successes and keeping the first failures.
fn legitimate_client<F, Fut>(
    stop: Arc<AtomicBool>,
    every: Duration,
    mut legit: F,
) -> tokio::task::JoinHandle<(usize, Vec<String>)>
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    tokio::spawn(async move {
        let (mut served, mut failures) = (0, Vec::new());
        while !stop.load(Ordering::Acquire) {
            match legit().await {
                Ok(()) => served += 1,
                Err(e) => failures.push(e),
            }
            tokio::time::sleep(every).await;
        }
        (served, failures)
    })
}

/// `count` attack connections opened `concurrency` at a time, each running `attack` and then kept
/// open (idle) until the attack ends, so the server keeps whatever they made it hold.
async fn attack<F, Fut>(
    count: usize,
    concurrency: usize,
    time_limit: Duration,
    attack: F,
) -> Vec<TlsStream<TcpStream>>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<TlsStream<TcpStream>>> + Send,
{
    let attack = Arc::new(attack);
    let next = Arc::new(AtomicUsize::new(0));
    let deadline = tokio::time::Instant::now() + time_limit;
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (attack, next) = (Arc::clone(&attack), Arc::clone(&next));
            tokio::spawn(async move {
                let mut held = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count || tokio::time::Instant::now() >= deadline {
                        return held;
                    }
                    if let Ok(Some(s)) = tokio::time::timeout_at(deadline, attack(i)).await {
                        held.push(s);
                    }
                }
            })
        })
        .collect();
    let mut held = Vec::new();
    for w in workers {
        held.extend(w.await.unwrap());
    }
    held
}

// ---------------------------------------------------------------------------------------------
// OTP server

/// One round of a legitimate client.
type LegitCall = std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

struct Otp {
    certs: Certs,
    bearer: String,
    server: Process,
}

impl Otp {
    fn start(extra: &[&str]) -> Self {
        let certs = Certs::new();
        let bearer = format!("bearer-{}", Token::random().as_str());
        std::fs::write(certs.path("store-token"), &bearer).unwrap();
        std::fs::write(
            certs.path("seal-key"),
            format!("seal-{}", Token::random().as_str()),
        )
        .unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mpc"));
        cmd.arg("otp-server")
            .arg(format!("--listen={addr}"))
            .arg(format!("--admin-listen=127.0.0.1:{}", free_port()))
            .arg("--tls-dir")
            .arg(certs.path("tls"))
            .arg("--db")
            .arg(certs.path("otp.redb"))
            .arg("--seal-key-file")
            .arg(certs.path("seal-key"))
            .arg("--store-token-file")
            .arg(certs.path("store-token"))
            .args(extra);
        let log = certs.path("otp.log");
        let server = Process::start(cmd, addr, log);
        Self {
            certs,
            bearer,
            server,
        }
    }

    fn client(&self) -> OtpClient {
        OtpClient::new(
            &format!("https://127.0.0.1:{}", self.server.addr.port()),
            self.certs.ca_pem.as_bytes(),
            Zeroizing::new(self.bearer.clone()),
        )
        .unwrap()
    }

    /// What the controller and a build pod do: store a key, redeem it once.
    fn store_and_redeem(&self) -> impl FnMut() -> LegitCall + Send + 'static {
        let client = self.client();
        let n = Arc::new(AtomicUsize::new(0));
        move || {
            let (client, n) = (client.clone(), Arc::clone(&n));
            Box::pin(async move {
                let i = n.fetch_add(1, Ordering::Relaxed);
                let key = format!("legit-key-{i}");
                let started = Instant::now();
                // Two shared cores busy with the attack's TLS handshakes: slow, but served.
                let token = tokio::time::timeout(
                    Duration::from_secs(8),
                    client.store_key_for(&format!("uid-legit-{i}"), "p1", None, key.as_bytes()),
                )
                .await
                .map_err(|_| format!("store {i} timed out"))?
                .map_err(|e| format!("store {i}: {e}"))?;
                let got =
                    tokio::time::timeout(Duration::from_secs(5), client.redeem(token.as_str()))
                        .await
                        .map_err(|_| format!("redeem {i} timed out"))?
                        .map_err(|e| format!("redeem {i}: {e}"))?;
                if got.as_slice() != key.as_bytes() {
                    return Err(format!("redeem {i} returned another key"));
                }
                if started.elapsed() > Duration::from_secs(8) {
                    return Err(format!("store+redeem {i} took {:?}", started.elapsed()));
                }
                Ok(())
            })
        }
    }
}

/// 1,000 clients without a bearer token (from one address, as one tenant's pod) start
/// `/store-key` uploads of a key's maximum size and never finish them. The server used to read
/// each body before checking the bearer (the issue measured 69 MB growing to 158 MB); now it
/// refuses them unread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_store_uploads_are_refused_before_their_body_is_read() {
    let otp = Otp::start(&[]);
    let stop = Arc::new(AtomicBool::new(false));
    let legit = legitimate_client(
        Arc::clone(&stop),
        Duration::from_millis(100),
        otp.store_and_redeem(),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = otp.server.memory("VmRSS");

    let (addr, client) = (otp.server.addr, Arc::clone(&otp.certs.client));
    let started = Instant::now();
    let held = attack(1000, 32, Duration::from_secs(10), move |_| {
        let client = Arc::clone(&client);
        async move {
            let mut s = tls_connect_from(ATTACKER, addr, &client).await.ok()?;
            // 64 KiB is `--max-key-bytes`: all but the last byte is sent.
            let head =
                "POST /store-key HTTP/1.1\r\nHost: localhost\r\nContent-Length: 65536\r\n\r\n";
            s.write_all(head.as_bytes()).await.ok()?;
            let _ = s.write_all(&[b'k'; 65535]).await;
            Some(s)
        }
    })
    .await;
    let attack_took = started.elapsed();
    let peak = otp.server.memory("VmHWM");
    let after = otp.server.memory("VmRSS");
    // Every upload is answered 401 or 503 (then closed) without the server waiting for its last
    // byte.
    let answers: Vec<_> = held
        .into_iter()
        .map(|mut s| tokio::spawn(async move { read_status(&mut s, Duration::from_secs(3)).await }))
        .collect();
    let (mut refused, mut other) = (0, std::collections::BTreeMap::new());
    for a in answers {
        match a.await.unwrap() {
            // 503: refused before the handler (the address holds its share of the places).
            401 | 503 | CLOSED => refused += 1,
            s => *other.entry(s).or_insert(0) += 1,
        }
    }
    stop.store(true, Ordering::Release);
    let (served, failures) = legit.await.unwrap();

    eprintln!(
        "OTP /store-key uploads: {refused} refused, others {other:?}, in {attack_took:?}; RSS {} -> {} MiB, peak {} MiB; legit served {served}",
        before / MIB,
        after / MIB,
        peak / MIB
    );
    assert!(
        failures.is_empty(),
        "legitimate client failed: {failures:?}"
    );
    assert!(served >= 3, "legitimate client served only {served} times");
    // The bound is the pod limit (the old code reached 213 MiB). What grows is connection state
    // (TLS and HTTP buffers, ~45 KiB each with 1,000 open at once in a busy test run), bounded
    // by `--max-connections`; no body is held.
    assert!(peak < OTP_POD_LIMIT, "peak RSS {} MiB", peak / MIB);
    assert!(
        refused >= 500,
        "only {refused} uploads were refused; {other:?}"
    );
    assert!(other.is_empty(), "uploads not refused: {other:?}");
}

/// Clients complete a TLS handshake and then send nothing (the issue kept 3,000 open
/// indefinitely). Here 600 against a cap of 200 (scaled down so it fits in seconds on a shared
/// CI machine): the server keeps at most `--max-connections` open, makes room for new clients by
/// closing the idle ones, and closes the rest after `--first-request-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_capped_and_closed() {
    const CAP: usize = 200;
    let otp = Otp::start(&[
        "--max-connections",
        &CAP.to_string(),
        "--first-request-timeout",
        "3s",
    ]);
    let stop = Arc::new(AtomicBool::new(false));
    let legit = legitimate_client(
        Arc::clone(&stop),
        Duration::from_millis(100),
        otp.store_and_redeem(),
    );
    let (addr, client) = (otp.server.addr, Arc::clone(&otp.certs.client));
    let started = Instant::now();
    let held = attack(3 * CAP, 32, Duration::from_secs(8), move |_| {
        let client = Arc::clone(&client);
        async move { tls_connect(addr, &client).await.ok() }
    })
    .await;
    let opened = held.len();
    let attack_took = started.elapsed();
    let sockets = otp.server.sockets();
    let peak = otp.server.memory("VmHWM");
    eprintln!(
        "OTP idle TLS connections: {opened} of {} opened in {attack_took:?}; server holds {sockets} sockets; peak RSS {} MiB",
        3 * CAP,
        peak / MIB
    );
    assert!(opened >= 2 * CAP, "only {opened} handshakes completed");
    // Its connections, the admin listener and a few of the legitimate client's.
    assert!(sockets <= CAP + 16, "the server holds {sockets} sockets");

    // Each idle connection is closed by the server within its first-request deadline.
    let closed = Arc::new(AtomicUsize::new(0));
    let waits: Vec<_> = held
        .into_iter()
        .map(|mut s| {
            let closed = Arc::clone(&closed);
            tokio::spawn(async move {
                let mut b = [0u8; 64];
                if let Ok(Ok(0) | Err(_)) =
                    tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await
                {
                    closed.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in waits {
        w.await.unwrap();
    }
    stop.store(true, Ordering::Release);
    let (served, failures) = legit.await.unwrap();
    let peak = otp.server.memory("VmHWM");
    eprintln!(
        "closed by the server: {} of {opened} after {:?}; legit served {served}",
        closed.load(Ordering::Relaxed),
        started.elapsed()
    );
    assert_eq!(closed.load(Ordering::Relaxed), opened);
    assert!(
        failures.is_empty(),
        "legitimate client failed: {failures:?}"
    );
    assert!(served >= 3, "legitimate client served only {served} times");
    assert!(peak < OTP_POD_LIMIT, "peak RSS {} MiB", peak / MIB);
}

/// A tenant holds its TaskRun's used token (it is in a Secret of its namespace) and redeems it
/// 260 times at once. Each redeem used to take a place among the 256 that may wait for a re-arm,
/// for `--rearm-wait`, so another tenant's retry was answered 503. Now a token whose TaskRun has
/// no retry to come is never held (every redeem refused at once), and one with a retry to come
/// waits in one place only, for one window per re-arm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redeeming_ones_own_used_token_cannot_deny_another_tenants_retry() {
    // All of them come from one loopback address here; in a cluster a tenant redeems from many
    // pods, so the per-address share is lifted to test the waiting places alone.
    let otp = Otp::start(&["--rearm-wait", "6s", "--max-in-flight-per-peer", "512"]);
    let client = otp.client();
    // The controller stores each key with the retries its TaskRun may still start.
    let store = |owner: &'static str, left: u32, key: &'static [u8]| {
        let client = client.clone();
        async move {
            client
                .store_key_owned(owner, "p1", Rearm::No, Some(left), key)
                .await
                .unwrap()
        }
    };
    let no_retry = store("uid-attacker-0", 0, b"KEY-A0").await;
    let mine = store("uid-attacker", 1, b"KEY-A").await;
    let theirs = store("uid-victim", 1, b"KEY-B1").await;
    for t in [&no_retry, &mine, &theirs] {
        client.redeem(t.as_str()).await.unwrap();
    }

    let (addr, tls) = (otp.server.addr, Arc::clone(&otp.certs.client));
    let redeem = move |token: String| {
        let tls = Arc::clone(&tls);
        async move {
            request(
                addr,
                &tls,
                "/otp",
                "",
                token.as_bytes(),
                Duration::from_secs(10),
            )
            .await
        }
    };
    // No retry to come: 260 redeems at once are all refused at once, none held.
    let started = Instant::now();
    let refused: Vec<_> = (0..260)
        .map(|_| tokio::spawn(redeem(no_retry.as_str().to_owned())))
        .collect();
    for r in refused {
        assert_eq!(r.await.unwrap(), 410);
    }
    eprintln!(
        "260 redeems of a used token with no retry to come: all 410 in {:?}",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    let started = Instant::now();
    let sent = Arc::new(AtomicUsize::new(0));
    let attackers: Vec<_> = (0..260)
        .map(|_| {
            let (tls, sent, token) = (
                Arc::clone(&otp.certs.client),
                Arc::clone(&sent),
                mine.as_str().to_owned(),
            );
            tokio::spawn(async move {
                let mut s = tls_connect(addr, &tls).await.ok()?;
                let head = format!(
                    "POST /otp HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{token}",
                    token.len()
                );
                s.write_all(head.as_bytes()).await.ok()?;
                sent.fetch_add(1, Ordering::Relaxed);
                Some(read_status(&mut s, Duration::from_secs(10)).await)
            })
        })
        .collect();
    // Every attacking redeem is in before the other tenant's retry.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sent.load(Ordering::Relaxed) < 260 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The other tenant's retry pod redeems before the controller re-armed its token: it waits,
    // and gets the new key once the re-arm comes.
    let retry = tokio::spawn({
        let (client, t) = (client.clone(), theirs.as_str().to_owned());
        async move { client.redeem(&t).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rearmed = client
        .store_key_for("uid-victim", "p2", Some(theirs.as_str()), b"KEY-B2")
        .await
        .unwrap();
    assert_eq!(rearmed, theirs);
    let got = retry.await.unwrap();
    let mut statuses = std::collections::BTreeMap::new();
    for a in attackers {
        *statuses
            .entry(a.await.unwrap().unwrap_or(NO_ANSWER))
            .or_insert(0) += 1;
    }
    eprintln!(
        "260 redeems of one used token: {statuses:?} in {:?}",
        started.elapsed()
    );
    assert_eq!(
        got.map(|k| k.to_vec()).map_err(|e| e.to_string()),
        Ok(b"KEY-B2".to_vec()),
        "the other tenant's retry was not served"
    );
    // One waited for the window (6 s) and was refused; the others were superseded at once.
    assert_eq!(statuses.get(&410), Some(&1), "{statuses:?}");
    assert_eq!(statuses.get(&409), Some(&259), "{statuses:?}");

    // The window closed without a re-arm: this arm's redeems are refused at once from now on.
    let again = Instant::now();
    assert_eq!(redeem(mine.as_str().to_owned()).await, 410);
    assert!(
        again.elapsed() < Duration::from_secs(1),
        "{:?}",
        again.elapsed()
    );
    let peak = otp.server.memory("VmHWM");
    assert!(peak < OTP_POD_LIMIT, "peak RSS {} MiB", peak / MIB);
}

/// The controller storing a key from [`TRUSTED`] and a build pod redeeming it from [`BUILD_POD`],
/// each one attempt on a fresh connection (no retries), the failure named `store` or `redeem`.
fn controller_and_build_pod(otp: &Otp) -> impl FnMut() -> LegitCall + Send + 'static {
    let (addr, tls, bearer) = (
        otp.server.addr,
        Arc::clone(&otp.certs.client),
        otp.bearer.clone(),
    );
    let n = Arc::new(AtomicUsize::new(0));
    move || {
        let (tls, bearer, i) = (
            Arc::clone(&tls),
            bearer.clone(),
            n.fetch_add(1, Ordering::Relaxed),
        );
        Box::pin(async move {
            let key = format!("legit-key-{i}");
            let limit = Duration::from_secs(5);
            let (status, token) = exchange_from(
                TRUSTED,
                addr,
                &tls,
                &format!("/store-key?owner=uid-legit-{i}&request=p1"),
                &format!("Authorization: Bearer {bearer}\r\n"),
                key.as_bytes(),
                limit,
            )
            .await;
            if status != 201 {
                return Err(format!("store {i}: {status}"));
            }
            let (status, got) =
                exchange_from(BUILD_POD, addr, &tls, "/otp", "", &token, limit).await;
            if status != 200 || got != key.as_bytes() {
                return Err(format!("redeem {i}: {status}"));
            }
            Ok(())
        })
    }
}

/// 512 clients from one address (a tenant's pod) start `/otp` redeems declaring a token's 1,024
/// bytes, send one, and start over whenever the server answers. The in-flight places were first
/// come, first served and a stalled body held one for the request timeout (10 s), so the
/// controller's `/store-key` calls from another address were answered 503 (the issue: 153 of
/// 155). Now one address holds at most its share of the places (64), a stalled token body about
/// half a second, and the controller's authenticated calls have places of their own; another
/// tenant's build pod redeems from a third address. Bound: at least 95% of the legitimate calls
/// (one attempt each, no retries) succeed while the attack runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_token_bodies_from_one_peer_leave_the_controller_and_build_pods_served() {
    // The default `--max-in-flight`.
    const SLOTS: usize = 512;
    const CALLS: usize = 40;
    let otp = Otp::start(&[]);
    let addr = otp.server.addr;
    let mut call = controller_and_build_pod(&otp);
    call().await.expect("served before the attack");

    // The attack lasts until the legitimate calls are done, 30 s at most.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let headers = vec![("content-length", "1024".to_owned())];
    let attack =
        SlowBodies::start(addr, &otp.certs.ca_pem, "/otp", headers, SLOTS, 40, until).await;
    let established = attack.established(Duration::from_secs(5)).await;
    let (served, failures) = legitimate_calls(CALLS, Duration::from_secs(20), call).await;
    let answers = attack.answers().await;
    let peak = otp.server.memory("VmHWM");

    let (stores_failed, redeems_failed) = (failed(&failures, "store"), failed(&failures, "redeem"));
    let stores = served + failures.len();
    eprintln!(
        "OTP slow /otp bodies from one address ({established} of {SLOTS} out): controller stores {} of {stores} served, build-pod redeems {served} of {} served; attack answered {answers:?}; peak RSS {} MiB; first failures {:?}",
        stores - stores_failed,
        served + redeems_failed,
        peak / MIB,
        &failures[..failures.len().min(5)]
    );
    assert!(
        established >= SLOTS * 9 / 10,
        "only {established} slow bodies out"
    );
    assert!(stores >= 10, "only {stores} legitimate calls ran in time");
    assert!(
        failures.len() * 20 <= stores,
        "{} of {stores} legitimate calls failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(10)]
    );
    assert!(peak < OTP_POD_LIMIT, "peak RSS {} MiB", peak / MIB);
}

/// With every shared place held by stalled token bodies, the controller's `/store-key` and
/// `/revoke` with the valid bearer token still get a reserved place; the same calls with a wrong
/// token, and redeems, get 503 (they never take a reserved place).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_valid_bearer_token_takes_a_reserved_place() {
    let otp = Otp::start(&[
        "--max-in-flight=2",
        "--max-held-redeems=1",
        "--reserved-in-flight=1",
        "--body-timeout=30s",
    ]);
    let (addr, tls) = (otp.server.addr, Arc::clone(&otp.certs.client));
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = tls_connect_from(ATTACKER, addr, &tls).await.unwrap();
        let head = "POST /otp HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1024\r\n\r\nx";
        s.write_all(head.as_bytes()).await.unwrap();
        held.push(s);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let limit = Duration::from_secs(5);
    let call = |from, path: &'static str, bearer: &str, body: &'static [u8]| {
        let (tls, auth) = (
            Arc::clone(&tls),
            format!("Authorization: Bearer {bearer}\r\n"),
        );
        async move { exchange_from(from, addr, &tls, path, &auth, body, limit).await }
    };
    let store = "/store-key?owner=uid-1&request=r1";
    assert_eq!(call(TRUSTED, store, "wrong", b"KEY").await.0, 503);
    assert_eq!(call(BUILD_POD, "/otp", "", b"token").await.0, 503);
    let (status, token) = call(TRUSTED, store, &otp.bearer, b"KEY").await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&token));
    let (status, _) = call(TRUSTED, "/revoke?owner=uid-1", &otp.bearer, b"").await;
    assert_eq!(status, 200);
    // Once the stalled bodies are gone, redeems are served again.
    drop(held);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, _) = call(BUILD_POD, "/otp", "", b"malformed").await;
    assert_eq!(status, 400);
}

/// A token body that stalls after its first byte is answered 408 well within a second, not after
/// the request timeout (10 s), so it holds its in-flight place that long at most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_token_body_is_answered_within_a_second() {
    let otp = Otp::start(&[]);
    let mut s = tls_connect(otp.server.addr, &otp.certs.client)
        .await
        .unwrap();
    let head = "POST /otp HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1024\r\n\r\nx";
    s.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let status = read_status(&mut s, Duration::from_secs(3)).await;
    let took = started.elapsed();
    eprintln!("stalled token body: {status} after {took:?}");
    assert_eq!(status, 408, "after {took:?}");
    assert!(took < Duration::from_secs(1), "{took:?}");
}

// ---------------------------------------------------------------------------------------------
// Controller webhook

fn admission_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("core/tests/fixtures/admission")
        .join(name)
}

fn start_webhook(certs: &Certs) -> Process {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mpc"));
    cmd.arg("controller")
        .arg("--webhook-only")
        .arg(format!(
            "--config={}",
            admission_fixture("host-config.yaml").display()
        ))
        .arg(format!("--cert-dir={}", certs.path("tls").display()))
        .arg(format!("--webhook-addr={addr}"))
        .arg(format!("--admin-addr=127.0.0.1:{}", free_port()))
        .arg("--shutdown-delay=0s");
    Process::start(cmd, addr, certs.path("controller.log"))
}

/// 120 clients (from one address, as a pod) start webhook requests declaring 4 MiB bodies (the
/// old limit) and 80 more send all but the last byte of a body just under the new limit, and none
/// finishes. The old limit let the first wave alone buffer 480 MiB; now a body above the largest
/// review the API server can send is refused before it is read, and the ones under it are bounded
/// by the in-flight cap (and the address's share of it) and their body deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_webhook_bodies_stay_bounded() {
    let certs = Certs::new();
    let server = start_webhook(&certs);
    let review = std::fs::read(admission_fixture("taskref-bundle.json")).unwrap();
    let (addr, client) = (server.addr, Arc::clone(&certs.client));
    // Ready once a review is answered (the certificate is loaded).
    let deadline = Instant::now() + Duration::from_secs(20);
    while request(
        addr,
        &client,
        "/mutate-taskrun",
        "",
        &review,
        Duration::from_secs(2),
    )
    .await
        != 200
    {
        assert!(
            Instant::now() < deadline,
            "webhook not ready: {}",
            server.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let legit = {
        let (client, review) = (Arc::clone(&client), review.clone());
        legitimate_client(Arc::clone(&stop), Duration::from_millis(100), move || {
            let (client, review) = (Arc::clone(&client), review.clone());
            async move {
                let started = Instant::now();
                match request(
                    addr,
                    &client,
                    "/mutate-taskrun",
                    "Content-Type: application/json\r\n",
                    &review,
                    Duration::from_secs(3),
                )
                .await
                {
                    200 => Ok(()),
                    s => Err(format!("review answered {s} after {:?}", started.elapsed())),
                }
            }
        })
    };
    let before = server.memory("VmRSS");
    let refused = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let (over, under) = {
        let (tls, refused) = (Arc::clone(&client), Arc::clone(&refused));
        let over = attack(120, 24, Duration::from_secs(10), move |_| {
            let (client, refused) = (Arc::clone(&tls), Arc::clone(&refused));
            async move {
                let mut s = tls_connect_from(ATTACKER, addr, &client).await.ok()?;
                let len = 4 * MIB as usize;
                let head = format!(
                    "POST /mutate-taskrun HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
                );
                s.write_all(head.as_bytes()).await.ok()?;
                let chunk = vec![b' '; 64 * 1024];
                let (mut sent, mut cut_off) = (0, false);
                while sent + chunk.len() < len {
                    if s.write_all(&chunk).await.is_err() {
                        cut_off = true;
                        break;
                    }
                    sent += chunk.len();
                }
                let status = read_status(&mut s, Duration::from_millis(200)).await;
                if cut_off || status == 413 || status == CLOSED {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
                Some(s)
            }
        });
        let client = Arc::clone(&client);
        let under = attack(80, 16, Duration::from_secs(10), move |_| {
            let client = Arc::clone(&client);
            async move {
                let mut s = tls_connect_from(ATTACKER, addr, &client).await.ok()?;
                let len = 1536 * 1024;
                let head = format!(
                    "POST /mutate-taskrun HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
                );
                s.write_all(head.as_bytes()).await.ok()?;
                let _ = s.write_all(&vec![b' '; len - 1]).await;
                Some(s)
            }
        });
        tokio::join!(over, under)
    };
    let attack_took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let peak = server.memory("VmHWM");
    let after = server.memory("VmRSS");
    stop.store(true, Ordering::Release);
    let (served, failures) = legit.await.unwrap();
    drop((over, under));
    eprintln!(
        "webhook bodies: {} of 120 over the limit refused 413, 80 under it held, in {attack_took:?}; RSS {} -> {} MiB, peak {} MiB; legit served {served}",
        refused.load(Ordering::Relaxed),
        before / MIB,
        after / MIB,
        peak / MIB
    );
    assert!(
        failures.is_empty(),
        "legitimate client failed: {failures:?}"
    );
    assert!(served >= 3, "legitimate client served only {served} times");
    assert!(peak < CONTROLLER_POD_LIMIT, "peak RSS {} MiB", peak / MIB);
    // 80 bodies of 1.5 MiB are 120 MiB; nothing of the 4 MiB ones may stay.
    assert!(
        peak.saturating_sub(before) < 200 * MIB,
        "RSS grew from {} to {} MiB",
        before / MIB,
        peak / MIB
    );
    assert!(
        refused.load(Ordering::Relaxed) >= 100,
        "only {} bodies over the limit were refused",
        refused.load(Ordering::Relaxed)
    );
}

/// Waits until the webhook answers a review (its certificate is loaded).
async fn webhook_ready(server: &Process, client: &Arc<rustls::ClientConfig>, review: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while request(
        server.addr,
        client,
        "/mutate-taskrun",
        "",
        review,
        Duration::from_secs(2),
    )
    .await
        != 200
    {
        assert!(
            Instant::now() < deadline,
            "webhook not ready: {}",
            server.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// 140 clients from one address start admission reviews, send one byte of the body, and start
/// over whenever the server answers. Stalled bodies held the 128 in-flight places for the request
/// timeout (10 s) and the API server's reviews from another address were answered 503 (the issue:
/// 158 of 159; with `failurePolicy: Ignore` the TaskRuns are admitted unmarked). Now one address
/// holds at most half the places and a stalled review about a second. Bound: at least 95% of the
/// API server's reviews (one attempt each) are answered 200 while the attack runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_review_bodies_from_one_peer_leave_the_api_server_served() {
    const SLOTS: usize = 140;
    const CALLS: usize = 60;
    let certs = Certs::new();
    let server = start_webhook(&certs);
    let review = std::fs::read(admission_fixture("taskref-bundle.json")).unwrap();
    let (addr, tls) = (server.addr, Arc::clone(&certs.client));
    webhook_ready(&server, &tls, &review).await;

    // The attack lasts until the legitimate calls are done, 30 s at most.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    let headers = vec![
        ("content-type", "application/json".to_owned()),
        ("content-length", review.len().to_string()),
    ];
    let attack = SlowBodies::start(
        addr,
        &certs.ca_pem,
        "/mutate-taskrun",
        headers,
        SLOTS,
        40,
        until,
    )
    .await;
    let established = attack.established(Duration::from_secs(5)).await;
    let call = move || {
        let (tls, review) = (Arc::clone(&tls), review.clone());
        async move {
            let (status, _) = exchange_from(
                TRUSTED,
                addr,
                &tls,
                "/mutate-taskrun",
                "Content-Type: application/json\r\n",
                &review,
                Duration::from_secs(5),
            )
            .await;
            match status {
                200 => Ok(()),
                s => Err(format!("review answered {s}")),
            }
        }
    };
    let (served, failures) = legitimate_calls(CALLS, Duration::from_secs(20), call).await;
    let answers = attack.answers().await;
    let reviews = served + failures.len();
    eprintln!(
        "webhook slow review bodies from one address ({established} of {SLOTS} out): API server reviews {served} of {reviews} answered 200; attack answered {answers:?}; first failures {:?}",
        &failures[..failures.len().min(5)]
    );
    assert!(
        established >= SLOTS * 9 / 10,
        "only {established} slow bodies out"
    );
    assert!(reviews >= 10, "only {reviews} reviews ran in time");
    assert!(
        failures.len() * 20 <= reviews,
        "{} of {reviews} reviews failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(10)]
    );
}
