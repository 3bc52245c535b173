//! Unauthenticated resource exhaustion (issue 23 §3), against the real binaries on loopback: each
//! test runs a bounded attack (fixed counts, a time limit), measures the server's memory from
//! `/proc/<pid>/status` against its pod limit (`manifests/`: OTP server 128 Mi, controller
//! 512 Mi), and has a legitimate client served throughout.

use std::net::{SocketAddr, TcpListener};
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
    let tcp = TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(Arc::clone(client))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
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

/// 1,000 clients without a bearer token start `/store-key` uploads of a key's maximum size and
/// never finish them. The server used to read each body before checking the bearer (the issue
/// measured 69 MB growing to 158 MB); now it refuses them unread.
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
            let mut s = tls_connect(addr, &client).await.ok()?;
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
    // Every upload is answered 401 (then closed) without the server waiting for its last byte.
    let answers: Vec<_> = held
        .into_iter()
        .map(|mut s| tokio::spawn(async move { read_status(&mut s, Duration::from_secs(3)).await }))
        .collect();
    let (mut refused, mut other) = (0, std::collections::BTreeMap::new());
    for a in answers {
        match a.await.unwrap() {
            401 | CLOSED => refused += 1,
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
    let otp = Otp::start(&["--rearm-wait", "6s"]);
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

/// 120 clients start webhook requests declaring 4 MiB bodies (the old limit) and 80 more send all
/// but the last byte of a body just under the new limit, and none finishes. The old limit let
/// the first wave alone buffer 480 MiB; now a body above the largest review the API server can
/// send is refused before it is read, and the ones under it are bounded by the in-flight cap.
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
                let mut s = tls_connect(addr, &client).await.ok()?;
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
                let mut s = tls_connect(addr, &client).await.ok()?;
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
