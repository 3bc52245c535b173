//! The OTP server end to end: in-process for protocol details, and the real `mpc otp-server`
//! binary for crashes, TTLs, logs, owner-keyed stores, re-arms and revokes, and the curl line
//! Konflux build steps run.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use mpc::otp::token::Token;
use mpc::otp::{OtpClient, OtpClientError, OtpServerArgs, Rearm, RunningServer};
use mpc::provision::Zeroizing;

/// Certificates, secrets and a database path in a temp dir.
struct Fixture {
    dir: tempfile::TempDir,
    ca_pem: String,
    bearer: String,
    seal: String,
}

impl Fixture {
    fn new() -> Self {
        mpc::tls::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let bundle =
            mpc::certs::generate("otp", &["localhost".into(), "127.0.0.1".into()], 2).unwrap();
        std::fs::create_dir(dir.path().join("tls")).unwrap();
        mpc::certs::write_bundle(&bundle, &dir.path().join("tls")).unwrap();
        let bearer = format!("bearer-{}", Token::random().as_str());
        let seal = format!("seal-{}", Token::random().as_str());
        std::fs::write(dir.path().join("store-token"), format!("{bearer}\n")).unwrap();
        std::fs::write(dir.path().join("seal-key"), &seal).unwrap();
        Self {
            ca_pem: bundle.ca_pem,
            dir,
            bearer,
            seal,
        }
    }

    /// `mpc otp-server` on these files; `db` and `seal` are names inside the fixture.
    fn otp_server_command(&self, listen: &str, admin: &str, db: &str, seal: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_mpc"));
        c.arg("otp-server")
            .args(["--listen", listen, "--admin-listen", admin])
            .arg("--tls-dir")
            .arg(self.path("tls"))
            .arg("--db")
            .arg(self.path(db))
            .arg("--seal-key-file")
            .arg(self.path(seal))
            .arg("--store-token-file")
            .arg(self.path("store-token"));
        c
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn args(&self) -> OtpServerArgs {
        OtpServerArgs::with_paths(
            self.path("tls"),
            self.path("data/otp.redb"),
            self.path("seal-key"),
            self.path("store-token"),
        )
    }

    fn client(&self, addr: SocketAddr) -> OtpClient {
        let mut c = OtpClient::new(
            &format!("https://127.0.0.1:{}", addr.port()),
            self.ca_pem.as_bytes(),
            Zeroizing::new(self.bearer.clone()),
        )
        .unwrap();
        c.backoff = Duration::from_millis(20);
        c
    }

    /// Runs `curl` against the server with our CA; returns (HTTP status, body).
    fn curl(&self, args: &[&str]) -> (u16, String) {
        let out = Command::new("curl")
            .args(["-sS", "--cacert"])
            .arg(self.path("tls/ca.crt"))
            .args(["-o", "-", "-w", "\n%{http_code}"])
            .args(args)
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        let code = code.trim().parse().unwrap_or(0);
        assert_ne!(
            code,
            0,
            "curl failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (code, body.to_owned())
    }
}

fn private_key(n: usize) -> String {
    mpc::provision::keys::generate(&format!("test-{n}"))
        .unwrap()
        .private_openssh
        .to_string()
}

fn rejected_status(e: &OtpClientError) -> u16 {
    match e.status() {
        Some(status) => status.as_u16(),
        None => panic!("expected an HTTP error status, got {e:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_then_redeem_exactly_once() {
    let f = Fixture::new();
    let server = RunningServer::start(&f.args()).await.unwrap();
    let client = f.client(server.addr);
    let key = private_key(1);
    let token = client.store_key(key.as_bytes()).await.unwrap();
    assert_eq!(token.as_str().len(), 43);
    let got = client.redeem(token.as_str()).await.unwrap();
    assert_eq!(got.as_slice(), key.as_bytes());
    let again = client.redeem(token.as_str()).await.unwrap_err();
    assert_eq!(rejected_status(&again), 410);
    assert!(again.to_string().contains("already used"), "{again}");
    let unknown = client.redeem(Token::random().as_str()).await.unwrap_err();
    assert_eq!(rejected_status(&unknown), 404);
    let malformed = client.redeem("not-a-token").await.unwrap_err();
    assert_eq!(rejected_status(&malformed), 400);
    let m = &server.metrics;
    assert_eq!(m.stored.get(), 1);
    assert_eq!(m.redeemed.get(), 1);
    assert_eq!(m.rejected.with_label_values(&["used"]).get(), 1);
    assert_eq!(m.rejected.with_label_values(&["unknown"]).get(), 1);
    assert_eq!(m.rejected.with_label_values(&["malformed"]).get(), 1);
    assert_eq!(m.pending.get(), 0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_redeems_of_one_token_yield_exactly_one_key() {
    let f = Fixture::new();
    let server = RunningServer::start(&f.args()).await.unwrap();
    // Separate clients: separate connection pools, so requests really race.
    let clients: Vec<OtpClient> = (0..8).map(|_| f.client(server.addr)).collect();
    let key = private_key(2);
    for round in 0..40 {
        let token = clients[0].store_key(key.as_bytes()).await.unwrap();
        let racers = clients.iter().flat_map(|c| {
            let t = token.as_str().to_owned();
            (0..2).map(move |_| {
                let (c, t) = (c.clone(), t.clone());
                tokio::spawn(async move { c.redeem(&t).await })
            })
        });
        let results = futures::future::join_all(racers).await;
        let mut wins = 0;
        for r in results {
            match r.unwrap() {
                Ok(k) => {
                    assert_eq!(k.as_slice(), key.as_bytes());
                    wins += 1;
                }
                Err(e) => assert_eq!(rejected_status(&e), 410, "round {round}: {e}"),
            }
        }
        assert_eq!(wins, 1, "round {round}");
    }
    assert_eq!(server.metrics.redeemed.get(), 40);
    assert_eq!(
        server.metrics.rejected.with_label_values(&["used"]).get(),
        40 * 15
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_requires_the_current_bearer_token() {
    let f = Fixture::new();
    let server = RunningServer::start(&f.args()).await.unwrap();
    let url = format!("https://127.0.0.1:{}/store-key", server.addr.port());
    let (code, _) = f.curl(&["-XPOST", "--data-binary", "KEY", &url]);
    assert_eq!(code, 401);
    let (code, _) = f.curl(&[
        "-XPOST",
        "-H",
        "Authorization: Bearer wrong",
        "-d",
        "KEY",
        &url,
    ]);
    assert_eq!(code, 401);
    let auth = format!("Authorization: Bearer {}", f.bearer);
    let (code, token) = f.curl(&["-XPOST", "-H", &auth, "-d", "KEY", &url]);
    assert_eq!(code, 201, "{token}");

    // The token file is a mounted Secret: after rotation only the new token works.
    std::fs::write(f.path("store-token"), "rotated-token").unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (code, _) = f.curl(&["-XPOST", "-H", &auth, "-d", "KEY", &url]);
    assert_eq!(code, 401);
    let (code, _) = f.curl(&[
        "-XPOST",
        "-H",
        "Authorization: Bearer rotated-token",
        "-d",
        "KEY",
        &url,
    ]);
    assert_eq!(code, 201);
    // No token file at all refuses everything.
    std::fs::remove_file(f.path("store-token")).unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (code, _) = f.curl(&[
        "-XPOST",
        "-H",
        "Authorization: Bearer rotated-token",
        "-d",
        "KEY",
        &url,
    ]);
    assert_eq!(code, 401);
    assert_eq!(
        server
            .metrics
            .rejected
            .with_label_values(&["unauthorized"])
            .get(),
        4
    );
    let err = f.client(server.addr).store_key(b"KEY").await.unwrap_err();
    assert_eq!(rejected_status(&err), 401, "{err:?}");
    assert!(!err.is_retryable());
    let err = f.client(server.addr).revoke("uid").await.unwrap_err();
    assert_eq!(rejected_status(&err), 401, "{err:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_stores_get_the_same_token_and_limits_hold() {
    let f = Fixture::new();
    let mut args = f.args();
    args.max_key_bytes = 4096;
    let server = RunningServer::start(&args).await.unwrap();
    let url = format!("https://127.0.0.1:{}/store-key", server.addr.port());
    let auth = format!("Authorization: Bearer {}", f.bearer);
    let store = |body: &str, idem: &str| {
        f.curl(&[
            "-XPOST",
            "-H",
            &auth,
            "-H",
            &format!("Idempotency-Key: {idem}"),
            "--data-binary",
            body,
            &url,
        ])
    };
    let (c1, t1) = store("KEY-A", "req-1");
    let (c2, t2) = store("KEY-A", "req-1");
    assert_eq!((c1, c2), (201, 200));
    assert_eq!(t1, t2);
    let (c3, _) = store("KEY-B", "req-1");
    assert_eq!(c3, 409);
    let (c4, t4) = store("KEY-A", "req-2");
    assert_eq!(c4, 201);
    assert_ne!(t1, t4);
    // Once redeemed, a late retry cannot put the key back.
    let client = f.client(server.addr);
    assert_eq!(client.redeem(&t1).await.unwrap().as_slice(), b"KEY-A");
    assert_eq!(store("KEY-A", "req-1").0, 409);
    assert_eq!(server.metrics.stored.get(), 2);
    assert_eq!(server.metrics.store_replayed.get(), 1);

    let big = "x".repeat(5000);
    let (code, _) = f.curl(&["-XPOST", "-H", &auth, "--data-binary", &big, &url]);
    assert_eq!(code, 413);
    let otp_url = format!("https://127.0.0.1:{}/otp", server.addr.port());
    let (code, _) = f.curl(&["-XPOST", "--data-binary", &big, &otp_url]);
    assert_eq!(code, 413);
    assert_eq!(
        server
            .metrics
            .rejected
            .with_label_values(&["too_large"])
            .get(),
        2
    );
    let (code, _) = f.curl(&["-XPOST", "-H", &auth, "--data-binary", "", &url]);
    assert_eq!(code, 400);
    let (code, body) = f.curl(&[&format!("https://127.0.0.1:{}/healthz", server.addr.port())]);
    assert_eq!((code, body.as_str()), (200, "ok"));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_on_the_admin_port_and_lint_clean() {
    let f = Fixture::new();
    let server = RunningServer::start(&f.args()).await.unwrap();
    let client = f.client(server.addr);
    let t = client.store_key(b"KEY").await.unwrap();
    client.redeem(t.as_str()).await.unwrap();
    let _ = client.redeem(t.as_str()).await;
    let out = Command::new("curl")
        .args(["-sSf", &format!("http://{}/metrics", server.admin_addr)])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("multi_platform_controller_otp_stored 1"),
        "{text}"
    );
    assert!(text.contains("multi_platform_controller_otp_redeemed 1"));
    assert!(text.contains("multi_platform_controller_otp_rejected{reason=\"used\"} 1"));
    assert!(text.contains("multi_platform_controller_otp_rejected{reason=\"expired\"} 0"));
    assert!(text.contains("multi_platform_controller_otp_rearmed 0"));
    assert!(text.contains("multi_platform_controller_otp_revoked 0"));
    assert!(text.contains("multi_platform_controller_otp_held 0"));
    assert!(text.contains(
        "multi_platform_controller_otp_hold_duration_seconds_count{outcome=\"served\"} 0"
    ));
    // The build-facing port does not expose metrics.
    let (code, _) = f.curl(&[&format!("https://127.0.0.1:{}/metrics", server.addr.port())]);
    assert_eq!(code, 404);
    if let Ok(mut lint) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        use std::io::Write;
        lint.stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = lint.wait_with_output().unwrap();
        // The project names counters without `_total` (as the Go controller's dashboards expect);
        // that lint is the only complaint allowed.
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let problems: Vec<&str> = report
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.contains("should have \"_total\" suffix"))
            .collect();
        assert!(problems.is_empty(), "promtool: {report}");
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_certificate_is_served_without_restart() {
    let f = Fixture::new();
    let mut args = f.args();
    args.cert_reload_interval = Duration::from_millis(100);
    let server = RunningServer::start(&args).await.unwrap();
    let url = format!("https://127.0.0.1:{}/healthz", server.addr.port());
    assert_eq!(f.curl(&[&url]).0, 200);
    let fresh = mpc::certs::generate("otp", &["127.0.0.1".into()], 2).unwrap();
    let next = f.path("next");
    mpc::certs::write_bundle(&fresh, &next).unwrap();
    std::fs::copy(next.join("tls.key"), f.path("tls/tls.key")).unwrap();
    std::fs::copy(next.join("tls.crt"), f.path("tls/tls.crt")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = Command::new("curl")
            .args(["-sSf", "--cacert"])
            .arg(next.join("ca.crt"))
            .arg(&url)
            .output()
            .unwrap();
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "new certificate never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let old = Command::new("curl")
        .args(["-sSf", "--cacert"])
        .arg(f.path("tls/ca.crt"))
        .arg(&url)
        .output()
        .unwrap();
    assert!(!old.status.success(), "the old CA is still accepted");
    server.shutdown().await;
}

/// The real binary, with stderr captured to a file.
struct ServerProcess {
    child: Child,
    port: u16,
    admin: u16,
    log: PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl ServerProcess {
    fn start(f: &Fixture, extra: &[&str], log_name: &str) -> Self {
        let port = free_port();
        let admin = free_port();
        let log = f.path(log_name);
        let child = f
            .otp_server_command(
                &format!("127.0.0.1:{port}"),
                &format!("127.0.0.1:{admin}"),
                "data/otp.redb",
                "seal-key",
            )
            .args(extra)
            .env("MPC_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting mpc otp-server");
        let mut p = Self {
            child,
            port,
            admin,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("otp-server exited with {status}: {}", p.log_text());
            }
            assert!(Instant::now() < deadline, "otp-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The value of one series on the admin port's `/metrics`, e.g. `name{label="v"}`.
    fn metric(&self, series: &str) -> f64 {
        let out = Command::new("curl")
            .args(["-sSf", &format!("http://127.0.0.1:{}/metrics", self.admin)])
            .output()
            .expect("curl");
        assert!(out.status.success(), "{out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no series {series} in {text}"))
    }

    /// Waits (up to 10 s) until `series` has `value`.
    async fn wait_metric(&self, series: &str, value: f64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.metric(series) != value {
            assert!(Instant::now() < deadline, "{series} never reached {value}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_between_store_and_redeem_loses_nothing() {
    let f = Fixture::new();
    let mut server = ServerProcess::start(&f, &[], "first.log");
    let client = f.client(server.addr());
    let mut stored = Vec::new();
    for i in 0..12 {
        let key = format!("key-{i}");
        stored.push((client.store_key(key.as_bytes()).await.unwrap(), key));
    }
    for (t, key) in &stored[..4] {
        assert_eq!(
            client.redeem(t.as_str()).await.unwrap().as_slice(),
            key.as_bytes()
        );
    }
    server.kill9();
    let server = ServerProcess::start(&f, &[], "second.log");
    let client = f.client(server.addr());
    for (t, key) in &stored[4..] {
        assert_eq!(
            client.redeem(t.as_str()).await.unwrap().as_slice(),
            key.as_bytes()
        );
    }
    for (t, _) in &stored {
        let e = client.redeem(t.as_str()).await.unwrap_err();
        assert_eq!(rejected_status(&e), 410);
    }
    let out = Command::new("curl")
        .args(["-sSf", "--cacert"])
        .arg(f.path("tls/ca.crt"))
        .arg(format!("https://127.0.0.1:{}/healthz", server.port))
        .output()
        .unwrap();
    assert!(out.status.success());
    // The database alone holds neither the keys nor the tokens.
    let db = std::fs::read(f.path("data/otp.redb")).unwrap();
    for (t, key) in &stored {
        assert!(!contains(&db, t.as_str().as_bytes()));
        assert!(!contains(&db, key.as_bytes()));
    }
}

/// A consumer step's key fetch exactly as Konflux runs it, on a `/ssh` directory at `dir`.
fn konflux(dir: &Path) -> Output {
    Command::new("bash")
        .arg("-c")
        .arg(
            "curl --fail --cacert /ssh/otp-ca -XPOST -d @/ssh/otp $(cat /ssh/otp-server)"
                .replace("/ssh", &dir.display().to_string()),
        )
        .output()
        .unwrap()
}

impl Fixture {
    /// A `/ssh` directory as the TaskRun's secret mounts it (docs/architecture.md, "The contract
    /// with the Go controller"), holding `token`.
    fn ssh_dir(&self, name: &str, token: &Token, server: &ServerProcess) -> PathBuf {
        let ssh = self.path(name);
        std::fs::create_dir(&ssh).unwrap();
        // Secret values as the controller writes them; the token file ends with a newline here to
        // show curl's stripping is not needed.
        std::fs::write(ssh.join("otp"), format!("{}\n", token.as_str())).unwrap();
        std::fs::write(
            ssh.join("otp-server"),
            format!("https://127.0.0.1:{}/otp", server.port),
        )
        .unwrap();
        std::fs::write(ssh.join("otp-ca"), &self.ca_pem).unwrap();
        ssh
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_expire_after_the_ttl() {
    let f = Fixture::new();
    let server = ServerProcess::start(
        &f,
        &["--ttl", "400ms", "--purge-interval", "100ms"],
        "ttl.log",
    );
    let client = f.client(server.addr());
    let fresh = client.store_key(b"redeemed in time").await.unwrap();
    let stale = client.store_key(b"left too long").await.unwrap();
    assert_eq!(
        client.redeem(fresh.as_str()).await.unwrap().as_slice(),
        b"redeemed in time"
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    let e = client.redeem(stale.as_str()).await.unwrap_err();
    // Expired, and purged by now: either way it is refused with a 4xx.
    let code = rejected_status(&e);
    assert!(code == 410 || code == 404, "{e}");
    let log = server.log_text();
    assert!(log.contains("purged OTP entries"), "purge never ran: {log}");
}

/// A `/ssh` directory as the TaskRun's secret mounts it (docs/architecture.md, "The contract with
/// the Go controller"), with a consumer step's key fetch exactly as Konflux runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_konflux_curl_line_redeems_the_key_once_and_logs_stay_clean() {
    let f = Fixture::new();
    let server = ServerProcess::start(&f, &[], "konflux.log");
    let client = f.client(server.addr());
    let key = private_key(3);
    let token = client.store_key(key.as_bytes()).await.unwrap();
    let ssh = f.ssh_dir("ssh", &token, &server);
    let first = konflux(&ssh);
    assert!(first.status.success(), "{first:?}");
    assert_eq!(String::from_utf8_lossy(&first.stdout), key);
    let second = konflux(&ssh);
    assert!(!second.status.success());
    assert!(second.stdout.is_empty());

    // Failures of every kind, then check the captured logs.
    let _ = client.redeem("garbage").await;
    let _ = client.redeem(Token::random().as_str()).await;
    let log = server.log_text();
    assert!(
        log.contains("key stored") && log.contains("key redeemed"),
        "{log}"
    );
    assert!(!log.contains(token.as_str()), "token in logs");
    for line in key.lines().filter(|l| l.len() > 20) {
        assert!(!log.contains(line), "key material in logs");
    }
    assert!(!log.contains(&f.bearer), "bearer token in logs");
    assert!(!log.contains(&f.seal), "sealing secret in logs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconfiguration_stops_the_server_with_a_clear_message() {
    let f = Fixture::new();
    let first = RunningServer::start(&f.args()).await.unwrap();
    // One writer per database file: a second server on the same volume refuses to start.
    let second = RunningServer::start(&f.args()).await.unwrap_err();
    assert!(
        second.to_string().contains("otp.redb"),
        "unhelpful error: {second}"
    );
    first.shutdown().await;

    std::fs::write(f.path("weak-seal"), "short").unwrap();
    let out = f
        .otp_server_command("127.0.0.1:0", "127.0.0.1:0", "weak/otp.redb", "weak-seal")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("weak-seal") && err.contains("at least 32"),
        "unhelpful error: {err}"
    );
}

const STORED: &str = "multi_platform_controller_otp_stored";
const REPLAYED: &str = "multi_platform_controller_otp_store_replayed";
const PENDING: &str = "multi_platform_controller_otp_pending";
const HELD: &str = "multi_platform_controller_otp_held";
const ENTRIES: &str = "multi_platform_controller_otp_entries";

fn hold_count(outcome: &str) -> String {
    format!("multi_platform_controller_otp_hold_duration_seconds_count{{outcome=\"{outcome}\"}}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_keyed_stores_are_idempotent_across_a_restart() {
    let f = Fixture::new();
    let args = ["--rearm-wait", "1s"];
    let mut server = ServerProcess::start(&f, &args, "first.log");
    let client = f.client(server.addr());
    let key = private_key(10);
    let t1 = client
        .store_key_for("uid-a", "prov-1", None, key.as_bytes())
        .await
        .unwrap();
    // The controller lost the answer and retries: same token, no second entry.
    let again = client
        .store_key_for("uid-a", "prov-1", None, key.as_bytes())
        .await
        .unwrap();
    assert_eq!(t1, again);
    let t2 = client
        .store_key_for("uid-a", "prov-2", None, key.as_bytes())
        .await
        .unwrap();
    assert_ne!(t1, t2);
    let e = client
        .store_key_for("uid-a", "prov-1", None, b"another key")
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 409, "{e}");
    assert!(!e.is_retryable());
    assert_eq!(server.metric(STORED), 2.0);
    assert_eq!(server.metric(REPLAYED), 1.0);
    assert_eq!(server.metric(PENDING), 2.0);

    // A crash, then the retry reaches the new process: still the same entry.
    server.kill9();
    let server = ServerProcess::start(&f, &args, "second.log");
    let client = f.client(server.addr());
    let after = client
        .store_key_for("uid-a", "prov-1", None, key.as_bytes())
        .await
        .unwrap();
    assert_eq!(after, t1);
    assert_eq!(server.metric(STORED), 0.0);
    assert_eq!(server.metric(REPLAYED), 1.0);
    assert_eq!(server.metric(PENDING), 2.0);
    assert_eq!(
        client.redeem(t1.as_str()).await.unwrap().as_slice(),
        key.as_bytes()
    );
    // A retry after the redeem answers the same token and does not put the key back: the next
    // redeem waits for a re-arm that never comes, then is refused.
    let late = client
        .store_key_for("uid-a", "prov-1", None, key.as_bytes())
        .await
        .unwrap();
    assert_eq!(late, t1);
    let e = client.redeem(t1.as_str()).await.unwrap_err();
    assert_eq!(rejected_status(&e), 410, "{e}");
    assert_eq!(server.metric(&hold_count("timed_out")), 1.0);
    assert_eq!(server.metric(PENDING), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_attempt_redeems_the_same_token_after_a_rearm() {
    let f = Fixture::new();
    let server = ServerProcess::start(&f, &["--rearm-wait", "3s"], "rearm.log");
    let client = f.client(server.addr());
    let (k1, k2, k3) = (private_key(11), private_key(12), private_key(13));
    let token = client
        .store_key_for("uid-r", "attempt-0", None, k1.as_bytes())
        .await
        .unwrap();
    let ssh = f.ssh_dir("ssh", &token, &server);
    let first = konflux(&ssh);
    assert!(first.status.success(), "{first:?}");
    assert_eq!(String::from_utf8_lossy(&first.stdout), k1);

    // The attempt failed; Tekton's retry pod mounts the same secret and redeems before the
    // controller re-armed the token: the redeem waits.
    let retry_pod = {
        let ssh = ssh.clone();
        tokio::task::spawn_blocking(move || konflux(&ssh))
    };
    server.wait_metric(HELD, 1.0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!retry_pod.is_finished(), "the redeem did not wait");
    let rearmed = client
        .store_key_for("uid-r", "attempt-1", Some(token.as_str()), k2.as_bytes())
        .await
        .unwrap();
    assert_eq!(rearmed, token);
    let second = retry_pod.await.unwrap();
    assert!(second.status.success(), "{second:?}");
    assert_eq!(String::from_utf8_lossy(&second.stdout), k2);
    assert_eq!(server.metric(HELD), 0.0);
    assert_eq!(server.metric(&hold_count("served")), 1.0);

    // Late copies of both requests change nothing.
    for (req, key) in [("attempt-1", &k2), ("attempt-0", &k1)] {
        let rearm = (req == "attempt-1").then_some(token.as_str());
        let t = client
            .store_key_for("uid-r", req, rearm, key.as_bytes())
            .await
            .unwrap();
        assert_eq!(t, token);
    }
    // Only the owner can re-arm, only its own tokens.
    let e = client
        .store_key_for("uid-other", "x", Some(token.as_str()), k3.as_bytes())
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 403, "{e}");
    assert!(!e.is_retryable());
    let go_style = client.store_key(b"anonymous key").await.unwrap();
    let e = client
        .store_key_for("uid-r", "y", Some(go_style.as_str()), k3.as_bytes())
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 403, "{e}");
    let e = client
        .store_key_for("uid-r", "z", Some(Token::random().as_str()), k3.as_bytes())
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 404, "{e}");

    // Re-armed before the next redeem: served at once, exactly once.
    client
        .store_key_for("uid-r", "attempt-2", Some(token.as_str()), k3.as_bytes())
        .await
        .unwrap();
    let started = Instant::now();
    assert_eq!(
        client.redeem(token.as_str()).await.unwrap().as_slice(),
        k3.as_bytes()
    );
    assert!(started.elapsed() < Duration::from_secs(1));
    // No key comes back: neither the last one nor an older one.
    let last = konflux(&ssh);
    assert!(!last.status.success());
    assert!(last.stdout.is_empty());
    assert_eq!(server.metric(&hold_count("timed_out")), 1.0);
    assert_eq!(server.metric("multi_platform_controller_otp_rearmed"), 2.0);
    assert_eq!(server.metric("multi_platform_controller_otp_redeemed"), 3.0);
    assert_eq!(
        server.metric("multi_platform_controller_otp_rejected{reason=\"forbidden\"}"),
        2.0
    );
    let log = server.log_text();
    assert!(log.contains("waiting for a re-arm"), "{log}");
    for secret in [token.as_str(), &f.bearer] {
        assert!(!log.contains(secret), "secret in logs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_token_with_a_rearm_to_come_is_held_and_the_owner_rearms_it_by_name() {
    let f = Fixture::new();
    let args = ["--rearm-wait", "3s"];
    let mut server = ServerProcess::start(&f, &args, "budget.log");
    let client = f.client(server.addr());
    let (k1, k2, k3) = (private_key(21), private_key(22), private_key(23));
    // A TaskRun with one retry: its used token waits for the re-arm...
    let token = client
        .store_key_owned("uid-b", "attempt-0", Rearm::No, Some(1), k1.as_bytes())
        .await
        .unwrap();
    assert_eq!(
        client.redeem(token.as_str()).await.unwrap().as_slice(),
        k1.as_bytes()
    );
    let waiting = {
        let (c, t) = (client.clone(), token.clone());
        tokio::spawn(async move { c.redeem(t.as_str()).await })
    };
    server.wait_metric(HELD, 1.0).await;
    // ...which names the owner only: the controller never reads the token back.
    let rearmed = client
        .store_key_owned("uid-b", "attempt-1", Rearm::Latest, Some(0), k2.as_bytes())
        .await
        .unwrap();
    assert_eq!(rearmed, token);
    assert_eq!(
        waiting.await.unwrap().unwrap().as_slice(),
        k2.as_bytes(),
        "the held redeem gets the re-armed key"
    );
    // No retry left: a redeem of the used token is refused at once, never held.
    let refused_at_once = |c: OtpClient, t: Token| async move {
        let started = Instant::now();
        let e = c.redeem(t.as_str()).await.unwrap_err();
        assert_eq!(rejected_status(&e), 410, "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "held for {:?}",
            started.elapsed()
        );
    };
    refused_at_once(client.clone(), token.clone()).await;
    // A TaskRun without retries: its used token is never held.
    let t0 = client
        .store_key_owned("uid-c", "attempt-0", Rearm::No, Some(0), k3.as_bytes())
        .await
        .unwrap();
    client.redeem(t0.as_str()).await.unwrap();
    for _ in 0..3 {
        refused_at_once(client.clone(), t0.clone()).await;
    }
    assert_eq!(server.metric(HELD), 0.0);
    assert_eq!(server.metric(&hold_count("served")), 1.0);

    // The budget and the owner's latest token survive a restart.
    let t_d = client
        .store_key_owned("uid-d", "attempt-0", Rearm::No, Some(0), k1.as_bytes())
        .await
        .unwrap();
    let newer = client
        .store_key_owned("uid-b", "fresh-0", Rearm::No, Some(2), k3.as_bytes())
        .await
        .unwrap();
    assert_ne!(newer, token);
    server.kill9();
    let server = ServerProcess::start(&f, &args, "budget-2.log");
    let client = f.client(server.addr());
    client.redeem(t_d.as_str()).await.unwrap();
    refused_at_once(client.clone(), t_d).await;
    // The latest first store of the owner is what `Latest` re-arms.
    client.redeem(newer.as_str()).await.unwrap();
    let again = client
        .store_key_owned("uid-b", "attempt-2", Rearm::Latest, Some(1), k2.as_bytes())
        .await
        .unwrap();
    assert_eq!(again, newer);
    // An owner without a token has nothing to re-arm.
    let e = client
        .store_key_owned("uid-none", "r", Rearm::Latest, Some(1), k2.as_bytes())
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 404, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_deletes_an_owners_entries_and_releases_held_redeems() {
    let f = Fixture::new();
    let args = ["--rearm-wait", "60s"];
    let mut server = ServerProcess::start(&f, &args, "revoke.log");
    let client = f.client(server.addr());
    let t1 = client
        .store_key_for("uid-v", "p1", None, b"K1")
        .await
        .unwrap();
    let t2 = client
        .store_key_for("uid-v", "p2", None, b"K2")
        .await
        .unwrap();
    let t3 = client
        .store_key_for("uid-w", "p1", None, b"K3")
        .await
        .unwrap();
    assert_eq!(server.metric(ENTRIES), 3.0);
    assert_eq!(client.redeem(t1.as_str()).await.unwrap().as_slice(), b"K1");
    // A redeemed key leaves a tombstone until its owner is revoked.
    assert_eq!(server.metric(ENTRIES), 3.0);
    let held = {
        let (c, t) = (client.clone(), t1.as_str().to_owned());
        tokio::spawn(async move { c.redeem(&t).await })
    };
    server.wait_metric(HELD, 1.0).await;
    let started = Instant::now();
    assert_eq!(client.revoke("uid-v").await.unwrap(), 2);
    let e = held.await.unwrap().unwrap_err();
    assert_eq!(rejected_status(&e), 410, "{e}");
    assert!(e.to_string().contains("revoked"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(server.metric(&hold_count("revoked")), 1.0);
    let e = client.redeem(t2.as_str()).await.unwrap_err();
    assert_eq!(rejected_status(&e), 404, "{e}");
    assert_eq!(client.revoke("uid-v").await.unwrap(), 0, "idempotent");
    // The TaskRun ended: a late store for it is refused, not resurrected.
    let e = client
        .store_key_for("uid-v", "p2", None, b"K2")
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 410, "{e}");
    assert!(e.to_string().contains("revoked"), "{e}");
    assert!(!e.is_retryable());
    assert_eq!(server.metric("multi_platform_controller_otp_revoked"), 2.0);
    assert_eq!(server.metric(PENDING), 1.0);
    assert_eq!(server.metric(ENTRIES), 1.0);

    // Durable: after a crash the owner is still revoked and its entries gone; others untouched.
    server.kill9();
    let server = ServerProcess::start(&f, &args, "revoke2.log");
    let client = f.client(server.addr());
    let e = client
        .store_key_for("uid-v", "p1", None, b"K1")
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 410, "{e}");
    assert_eq!(client.revoke("uid-v").await.unwrap(), 0);
    // Counted from the file at start.
    assert_eq!(server.metric(ENTRIES), 1.0);
    let e = client.redeem(t2.as_str()).await.unwrap_err();
    assert_eq!(rejected_status(&e), 404, "{e}");
    assert_eq!(client.redeem(t3.as_str()).await.unwrap().as_slice(), b"K3");
    assert_eq!(client.revoke("uid-w").await.unwrap(), 1);
    assert_eq!(server.metric(ENTRIES), 0.0);

    // Bad requests say what is wrong.
    let url = |q: &str| format!("https://127.0.0.1:{}/revoke{q}", server.port);
    let auth = format!("Authorization: Bearer {}", f.bearer);
    let (code, body) = f.curl(&["-XPOST", &url("?owner=uid-w")]);
    assert_eq!((code, body.trim()), (401, "unauthorized"));
    let (code, body) = f.curl(&["-XPOST", "-H", &auth, &url("")]);
    assert_eq!((code, body.trim()), (400, "owner parameter missing"));
    let (code, body) = f.curl(&["-XPOST", "-H", &auth, &url("?owner=a%20b")]);
    assert_eq!(code, 400);
    assert!(body.contains("owner must be"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_redeems_are_capped_and_end_at_shutdown() {
    let f = Fixture::new();
    let mut args = f.args();
    args.max_held_redeems = 2;
    args.rearm_wait = Duration::from_secs(60);
    let server = RunningServer::start(&args).await.unwrap();
    let metrics = server.metrics.clone();
    let client = f.client(server.addr);
    // A token waits in one place only: the cap is across tokens.
    let mut tokens = Vec::new();
    for owner in ["uid-c", "uid-d", "uid-e"] {
        let t = client
            .store_key_for(owner, "p1", None, b"KEY")
            .await
            .unwrap();
        client.redeem(t.as_str()).await.unwrap();
        tokens.push(t);
    }
    let waiters: Vec<_> = tokens[..2]
        .iter()
        .map(|t| {
            let (c, t) = (client.clone(), t.as_str().to_owned());
            tokio::spawn(async move { c.redeem(&t).await })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics.held.get() < 2 {
        assert!(Instant::now() < deadline, "redeems never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = Instant::now();
    let e = client.redeem(tokens[2].as_str()).await.unwrap_err();
    assert_eq!(rejected_status(&e), 503, "{e}");
    assert!(e.to_string().contains("too many"), "{e}");
    assert!(e.is_retryable());
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(metrics.rejected.with_label_values(&["busy"]).get(), 1);

    let started = Instant::now();
    server.shutdown().await;
    for w in waiters {
        let e = w.await.unwrap().unwrap_err();
        assert_eq!(rejected_status(&e), 503, "{e}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "shutdown waited for held redeems"
    );
    assert_eq!(metrics.held.get(), 0);
    assert_eq!(
        metrics
            .hold_duration
            .with_label_values(&["shutdown"])
            .get_sample_count(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_errors_say_what_failed_and_whether_to_retry() {
    let f = Fixture::new();
    let server = RunningServer::start(&f.args()).await.unwrap();
    let client = f.client(server.addr);
    let e = client
        .store_key_for("has space", "p1", None, b"KEY")
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 400);
    assert!(e.to_string().contains("owner must be"), "{e}");
    assert!(!e.is_retryable());
    let e = client
        .store_key_for("uid", "p1", Some("not-a-token"), b"KEY")
        .await
        .unwrap_err();
    assert_eq!(rejected_status(&e), 400);
    assert!(e.to_string().contains("rearm is not a token"), "{e}");
    // Characters that need escaping reach the server intact.
    let t = client
        .store_key_for("uid/1+&=", "req?#%", None, b"KEY")
        .await
        .unwrap();
    assert_eq!(
        client
            .store_key_for("uid/1+&=", "req?#%", None, b"KEY")
            .await
            .unwrap(),
        t
    );
    assert_eq!(client.revoke("uid/1+&=").await.unwrap(), 1);

    // A server whose certificate our CA did not sign: TLS, and retrying will not help.
    let other = mpc::certs::generate("other", &["127.0.0.1".into()], 1).unwrap();
    let stranger = OtpClient::new(
        &format!("https://127.0.0.1:{}", server.addr.port()),
        other.ca_pem.as_bytes(),
        Zeroizing::new(f.bearer.clone()),
    )
    .unwrap();
    let e = stranger.store_key(b"KEY").await.unwrap_err();
    assert!(matches!(e, OtpClientError::Handshake(_)), "{e:?}");
    assert!(!e.is_retryable());
    server.shutdown().await;

    // Nobody listening: unreachable, worth retrying later.
    let mut gone = f.client(SocketAddr::from(([127, 0, 0, 1], free_port())));
    gone.attempts = 2;
    let e = gone.revoke("uid").await.unwrap_err();
    assert!(matches!(e, OtpClientError::Unreachable(_)), "{e:?}");
    assert!(e.is_retryable());
    assert!(e.to_string().contains("after 2 attempts"), "{e}");
}
