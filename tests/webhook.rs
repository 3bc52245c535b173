//! The webhook server: routers in-process (tower `oneshot`), the metrics exposition through the
//! real `promtool`, and the real `WebhookServer` over TLS on loopback with a client that trusts only
//! the CA written by `mpc certs` (certificate hot reload, late certificate, drain on shutdown).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use mpc::certs;
use mpc::config_source::{ConfigMetrics, ConfigSource};
use mpc::server::admin::{self, AdminState, Readiness};
use mpc::server::webhook::{self, Limits, WebhookMetrics, WebhookState};
use mpc::server::{WebhookArgs, WebhookServer};
use prometheus::Registry;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::ServiceExt;

mod support;
use support::promtool;

const SERVICE: &str = "mpc-webhook";
const NAMESPACE: &str = "mpc";
const SERVER_NAME: &str = "mpc-webhook.mpc.svc";

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("core/tests/fixtures/admission")
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join(format!("{name}.json"))).unwrap()
}

fn fixture_config() -> mpc::config::HostConfig {
    let text = std::fs::read_to_string(fixtures().join("host-config.yaml")).unwrap();
    let (data, _) = mpc::config::read_configmap_yaml(&text).unwrap();
    mpc::config::parse(&data).config
}

fn fixed_clock() -> u64 {
    1_700_000_000
}

// ---------------------------------------------------------------------------------------------
// In-process routers.

struct Apps {
    webhook: axum::Router,
    admin: axum::Router,
    readiness: Readiness,
    config: ConfigSource,
}

fn apps(config: Option<mpc::config::HostConfig>, limits: Limits) -> Apps {
    let registry = Registry::new();
    let config_metrics = ConfigMetrics::register(&registry).unwrap();
    let source = ConfigSource::new(Some(config_metrics));
    if let Some(cfg) = config {
        // Publish through the normal path so the pool-size gauge is set.
        let text = std::fs::read_to_string(fixtures().join("host-config.yaml")).unwrap();
        let (data, diags) = mpc::config::read_configmap_yaml(&text).unwrap();
        source.publish("fixture", data, diags);
        assert_eq!(*source.current().unwrap(), cfg);
    }
    let readiness = Readiness::new(source.clone());
    let webhook = webhook::router(
        WebhookState {
            config: source.clone(),
            metrics: Some(WebhookMetrics::register(&registry).unwrap()),
            clock: fixed_clock,
        },
        limits,
    );
    let admin = admin::router(AdminState {
        readiness: readiness.clone(),
        registry,
    });
    Apps {
        webhook,
        admin,
        readiness,
        config: source,
    }
}

async fn call(app: &axum::Router, method: &str, path: &str, body: Vec<u8>) -> (StatusCode, Bytes) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, bytes)
}

#[tokio::test]
async fn router_answers_reviews_and_rejects_bad_requests() {
    let a = apps(Some(fixture_config()), Limits::default());

    let (status, body) = call(
        &a.webhook,
        "POST",
        "/mutate-taskrun",
        fixture("taskref-bundle"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true);
    assert_eq!(v["response"]["patchType"], "JSONPatch");
    let req: Value = serde_json::from_slice(&fixture("taskref-bundle")).unwrap();
    assert_eq!(v["response"]["uid"], req["request"]["uid"]);

    let (status, body) = call(&a.webhook, "POST", "/mutate-taskrun", fixture("truncated")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let msg = String::from_utf8_lossy(&body);
    assert!(msg.contains("malformed AdmissionReview"), "{msg}");
    assert!(msg.contains("EOF"), "{msg}");

    let (status, _) = call(&a.webhook, "POST", "/mutate-taskrun", b"not json".to_vec()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, _) = call(&a.webhook, "GET", "/mutate-taskrun", Vec::new()).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    let (status, _) = call(&a.webhook, "POST", "/mutate", Vec::new()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (status, body) = call(&a.admin, "GET", "/metrics", Vec::new()).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        text.contains("multi_platform_controller_webhook_requests{outcome=\"remote\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("multi_platform_controller_webhook_requests{outcome=\"bad_request\"} 2"),
        "{text}"
    );
    assert!(text.contains(
        "multi_platform_controller_webhook_request_duration_seconds_count{outcome=\"remote\"} 1"
    ));
    assert!(
        text.contains("multi_platform_controller_platform_pool_size{platform=\"linux-arm64\"} 10")
    );
    // The disabled fixture platform still has a series, at zero.
    assert!(
        text.contains("multi_platform_controller_platform_pool_size{platform=\"linux-s390x\"} 0")
    );
    // One error in the fixture config (the disabled platform's missing ami).
    assert!(
        text.contains("multi_platform_controller_config_errors 1"),
        "{text}"
    );
}

#[tokio::test]
async fn body_limit_gives_413_and_no_config_gives_503() {
    let a = apps(
        Some(fixture_config()),
        Limits {
            max_body_bytes: 10_000,
            request_timeout: Duration::from_secs(5),
            ..Limits::default()
        },
    );
    let (status, _) = call(
        &a.webhook,
        "POST",
        "/mutate-taskrun",
        fixture("large-inline-taskspec"),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

    let empty = apps(None, Limits::default());
    let (status, body) = call(
        &empty.webhook,
        "POST",
        "/mutate-taskrun",
        fixture("taskref-bundle"),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(String::from_utf8_lossy(&body).contains("host-config"));
    let (_, metrics) = call(&empty.admin, "GET", "/metrics", Vec::new()).await;
    let text = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(text.contains("multi_platform_controller_webhook_requests{outcome=\"unavailable\"} 1"));
}

/// A review whose body stalls after its first byte is answered 408 within its body deadline (1 s
/// plus its size at 1 MiB/s), not after the request timeout (10 s): a client that stalls bodies
/// holds an in-flight place about a second each.
#[tokio::test]
async fn a_stalled_review_body_is_answered_408_within_its_body_deadline() {
    use futures::StreamExt;
    let a = apps(Some(fixture_config()), Limits::default());
    let review = fixture("taskref-bundle");
    let first = Bytes::copy_from_slice(&review[..1]);
    let stalled = futures::stream::once(async move { Ok::<_, std::io::Error>(first) })
        .chain(futures::stream::pending());
    let req = Request::builder()
        .method("POST")
        .uri("/mutate-taskrun")
        .header("content-type", "application/json")
        .header("content-length", review.len())
        .body(Body::from_stream(stalled))
        .unwrap();
    let started = Instant::now();
    let resp = tokio::time::timeout(Duration::from_secs(15), a.webhook.clone().oneshot(req))
        .await
        .expect("no answer")
        .unwrap();
    let took = started.elapsed();
    assert_eq!(resp.status(), StatusCode::REQUEST_TIMEOUT, "after {took:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"request body not received in time\n");
}

#[tokio::test]
async fn readiness_needs_cert_and_config_and_drops_on_shutdown() {
    let a = apps(None, Limits::default());
    let (status, _) = call(&a.admin, "GET", "/healthz", Vec::new()).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = call(&a.admin, "GET", "/readyz", Vec::new()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let msg = String::from_utf8_lossy(&body);
    assert!(msg.contains("serving certificate not loaded"), "{msg}");
    assert!(msg.contains("host-config not loaded"), "{msg}");

    a.readiness.set_cert_loaded();
    let (status, body) = call(&a.admin, "GET", "/readyz", Vec::new()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!String::from_utf8_lossy(&body).contains("certificate"));

    let text = std::fs::read_to_string(fixtures().join("host-config.yaml")).unwrap();
    let (data, diags) = mpc::config::read_configmap_yaml(&text).unwrap();
    a.config.publish("t", data, diags);
    let (status, _) = call(&a.admin, "GET", "/readyz", Vec::new()).await;
    assert_eq!(status, StatusCode::OK);

    a.readiness.set_stopping();
    let (status, body) = call(&a.admin, "GET", "/readyz", Vec::new()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(String::from_utf8_lossy(&body).contains("shutting down"));
}

#[tokio::test]
async fn metrics_exposition_passes_promtool() {
    let a = apps(Some(fixture_config()), Limits::default());
    for f in [
        "taskref-bundle",
        "local-no-podtemplate",
        "no-platform",
        "unknown-platform",
        "truncated",
    ] {
        call(&a.webhook, "POST", "/mutate-taskrun", fixture(f)).await;
    }
    let (_, body) = call(&a.admin, "GET", "/metrics", Vec::new()).await;
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (installed by e2e/setup.sh; MPC_PROMTOOL overrides the path)");
    child.stdin.take().unwrap().write_all_sync(&body);
    let out = child.wait_with_output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Exit 0 is clean; 3 means lint findings only. The one finding we accept is the `_total`
    // suffix on counters, whose names are kept exactly as the Go controller's (compat).
    let code = out.status.code();
    assert!(
        matches!(code, Some(0) | Some(3)),
        "promtool failed ({code:?}): {report}"
    );
    for line in report.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            line.contains("counter metrics should have \"_total\" suffix"),
            "unexpected promtool finding: {line}\n{report}"
        );
    }
}

trait WriteAllSync {
    fn write_all_sync(self, bytes: &[u8]);
}

impl WriteAllSync for std::process::ChildStdin {
    fn write_all_sync(mut self, bytes: &[u8]) {
        use std::io::Write;
        self.write_all(bytes).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// The real controller over TLS.

struct Pair {
    ca: String,
    cert: String,
    key: String,
}

fn new_pair() -> Pair {
    let b = certs::generate(SERVER_NAME, &certs::service_sans(SERVICE, NAMESPACE), 30).unwrap();
    Pair {
        ca: b.ca_pem,
        cert: b.cert_pem,
        key: b.key_pem,
    }
}

/// Writes a pair the way the kubelet updates a mounted Secret: a new timestamped directory, then
/// an atomic swap of the `..data` symlink that `tls.crt` and `tls.key` point through.
fn install(dir: &Path, generation: u32, cert: &str, key: &str) {
    use std::os::unix::fs::symlink;
    let snap = format!("..gen{generation}");
    std::fs::create_dir(dir.join(&snap)).unwrap();
    std::fs::write(dir.join(&snap).join("tls.crt"), cert).unwrap();
    std::fs::write(dir.join(&snap).join("tls.key"), key).unwrap();
    symlink(&snap, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    for f in ["tls.crt", "tls.key"] {
        if std::fs::symlink_metadata(dir.join(f)).is_err() {
            symlink(format!("..data/{f}"), dir.join(f)).unwrap();
        }
    }
}

fn der(pem: &str) -> CertificateDer<'static> {
    mpc::tls::parse_certs(pem.as_bytes(), Path::new("pem")).unwrap()[0].clone()
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

async fn tls_connect(addr: std::net::SocketAddr, cas: &[&str]) -> Tls {
    let pem = cas.concat();
    let cfg = mpc::tls::client_config_trusting(pem.as_bytes(), &[b"http/1.1"]).unwrap();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let tcp = TcpStream::connect(addr).await.unwrap();
    connector
        .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
        .await
        .unwrap()
}

fn peer_cert(s: &Tls) -> CertificateDer<'static> {
    s.get_ref().1.peer_certificates().unwrap()[0].clone()
}

async fn post_over<S>(stream: S, body: Vec<u8>) -> (StatusCode, Bytes)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::post("/mutate-taskrun")
        .header("host", SERVER_NAME)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

async fn admin_get(addr: std::net::SocketAddr, path: &str) -> (StatusCode, String) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get(path)
        .header("host", "admin")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Setup {
    dir: tempfile::TempDir,
    cert_dir: PathBuf,
    config: PathBuf,
}

fn setup() -> Setup {
    mpc::tls::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let cert_dir = dir.path().join("certs");
    std::fs::create_dir(&cert_dir).unwrap();
    let config = dir.path().join("host-config.yaml");
    std::fs::copy(fixtures().join("host-config.yaml"), &config).unwrap();
    Setup {
        dir,
        cert_dir,
        config,
    }
}

async fn start(s: &Setup, tweak: impl FnOnce(&mut WebhookArgs)) -> WebhookServer {
    let mut args = WebhookArgs::with_config(s.config.clone(), s.cert_dir.clone());
    args.reload_interval = Duration::from_millis(100);
    tweak(&mut args);
    WebhookServer::start(&args, Registry::new()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_webhook_with_mpc_certs_ca_and_hot_reload() {
    let s = setup();
    // The files `mpc certs` writes, read back as the deployment would mount them.
    let out = s.dir.path().join("mpc-certs");
    certs::run(&certs::CertsArgs {
        service: SERVICE.into(),
        namespace: NAMESPACE.into(),
        out: out.clone(),
        days: 30,
        extra_sans: Vec::new(),
    })
    .unwrap();
    let read = |n: &str| std::fs::read_to_string(out.join(n)).unwrap();
    let a = Pair {
        ca: read("ca.crt"),
        cert: read("tls.crt"),
        key: read("tls.key"),
    };
    let b = new_pair();
    install(&s.cert_dir, 1, &a.cert, &a.key);
    let c = start(&s, |_| {}).await;
    let admin = c.admin_addr();
    eventually("ready", || async {
        admin_get(admin, "/readyz").await.0 == StatusCode::OK
    })
    .await;

    let stream = tls_connect(c.webhook_addr(), &[&a.ca, &b.ca]).await;
    assert_eq!(peer_cert(&stream), der(&a.cert));
    let (status, body) = post_over(stream, fixture("local-node-selector-terms")).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true);
    assert!(v["response"]["patch"].is_string());

    // A client trusting only another CA is refused.
    let other = new_pair();
    let cfg = mpc::tls::client_config_trusting(other.ca.as_bytes(), &[]).unwrap();
    let tcp = TcpStream::connect(c.webhook_addr()).await.unwrap();
    let refused = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
        .await;
    assert!(refused.is_err());

    // Rotation: new handshakes get the new certificate.
    install(&s.cert_dir, 2, &b.cert, &b.key);
    let addr = c.webhook_addr();
    let (ca_a, ca_b, b_der) = (a.ca.clone(), b.ca.clone(), der(&b.cert));
    eventually("new certificate served", || {
        let (ca_a, ca_b, b_der) = (ca_a.clone(), ca_b.clone(), b_der.clone());
        async move { peer_cert(&tls_connect(addr, &[&ca_a, &ca_b]).await) == b_der }
    })
    .await;

    // A broken update (key of another pair, then garbage) keeps the last good pair serving.
    install(&s.cert_dir, 3, &b.cert, &a.key);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stream = tls_connect(addr, &[&a.ca, &b.ca]).await;
    assert_eq!(peer_cert(&stream), der(&b.cert));
    install(&s.cert_dir, 4, "not a certificate", "not a key");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let stream = tls_connect(addr, &[&a.ca, &b.ca]).await;
    assert_eq!(peer_cert(&stream), der(&b.cert));
    let (status, _) = post_over(stream, fixture("taskref-bundle")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(admin_get(admin, "/readyz").await.0, StatusCode::OK);

    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_starts_serving_when_the_certificate_appears_and_follows_config_changes() {
    let s = setup();
    let c = start(&s, |_| {}).await;
    let admin = c.admin_addr();
    let (status, body) = admin_get(admin, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("serving certificate not loaded"), "{body}");
    assert!(
        !body.contains("host-config"),
        "config loads at startup: {body}"
    );

    let p = new_pair();
    install(&s.cert_dir, 1, &p.cert, &p.key);
    eventually("ready", || async {
        admin_get(admin, "/readyz").await.0 == StatusCode::OK
    })
    .await;
    let (status, body) = post_over(
        tls_connect(c.webhook_addr(), &[&p.ca]).await,
        fixture("unknown-platform"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["response"]["allowed"], true);

    // Turning on reject-unknown-platforms in the file takes effect without a restart.
    let mut text = std::fs::read_to_string(&s.config).unwrap();
    text.push_str("  reject-unknown-platforms: \"true\"\n");
    std::fs::write(&s.config, text).unwrap();
    let addr = c.webhook_addr();
    let ca = p.ca.clone();
    eventually("config reloaded", || {
        let ca = ca.clone();
        async move {
            let (_, body) =
                post_over(tls_connect(addr, &[&ca]).await, fixture("unknown-platform")).await;
            let v: Value = serde_json::from_slice(&body).unwrap();
            v["response"]["allowed"] == false && v["response"]["status"]["code"] == 422
        }
    })
    .await;

    // An unparsable file keeps the last good config serving, and is counted.
    std::fs::write(&s.config, "kind: ConfigMap\ndata: [").unwrap();
    let (_, metrics) = {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = admin_get(admin, "/metrics").await;
            if m.1.contains("multi_platform_controller_config_errors 3")
                || Instant::now() > deadline
            {
                break m;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // 1 (disabled fixture platform at startup) + 1 (same error again in the edited file) + 1.
    assert!(
        metrics.contains("multi_platform_controller_config_errors 3"),
        "{metrics}"
    );
    let (_, body) = post_over(
        tls_connect(addr, &[&p.ca]).await,
        fixture("unknown-platform"),
    )
    .await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v["response"]["allowed"], false,
        "last good config still serving"
    );
    assert_eq!(admin_get(admin, "/readyz").await.0, StatusCode::OK);

    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_in_flight_requests_and_closes_keep_alive() {
    let s = setup();
    let p = new_pair();
    install(&s.cert_dir, 1, &p.cert, &p.key);
    let c = start(&s, |a| a.drain_timeout = Duration::from_secs(10)).await;
    let admin = c.admin_addr();
    eventually("ready", || async {
        admin_get(admin, "/readyz").await.0 == StatusCode::OK
    })
    .await;
    let addr = c.webhook_addr();

    // An idle keep-alive connection and a request whose body is still being uploaded.
    let mut idle = tls_connect(addr, &[&p.ca]).await;
    let mut busy = tls_connect(addr, &[&p.ca]).await;
    let body = fixture("taskref-bundle");
    let head = format!(
        "POST /mutate-taskrun HTTP/1.1\r\nhost: {SERVER_NAME}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    busy.write_all(head.as_bytes()).await.unwrap();
    busy.write_all(&body[..body.len() / 2]).await.unwrap();
    busy.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let shutdown = tokio::spawn(c.shutdown());
    // New connections are refused once the listener is closed.
    eventually("listener closed", || async {
        TcpStream::connect(addr).await.is_err()
    })
    .await;
    // The idle keep-alive connection is closed by the server.
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buf))
        .await
        .expect("idle connection closed promptly")
        .unwrap_or(0);
    assert_eq!(n, 0, "idle connection gets EOF");
    assert!(
        !shutdown.is_finished(),
        "still draining the in-flight request"
    );

    // The in-flight request completes normally.
    busy.write_all(&body[body.len() / 2..]).await.unwrap();
    busy.flush().await.unwrap();
    let mut resp = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), busy.read_to_end(&mut resp))
        .await
        .expect("response and close")
        .ok();
    let text = String::from_utf8_lossy(&resp);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("\"allowed\":true"), "{text}");

    tokio::time::timeout(Duration::from_secs(5), shutdown)
        .await
        .expect("shutdown finishes once drained")
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// The binary's JSON logs.

/// The `mpc` binary serving only the webhook, its stderr (JSON lines) read on a thread.
struct LoggingWebhook {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<Value>,
    seen: Vec<Value>,
    addr: std::net::SocketAddr,
}

impl LoggingWebhook {
    fn start(s: &Setup) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mpc"))
            .args(["--log-format", "json", "controller", "--webhook-only"])
            .arg(format!("--config={}", s.config.display()))
            .arg(format!("--cert-dir={}", s.cert_dir.display()))
            .args([
                "--webhook-addr=127.0.0.1:0",
                "--admin-addr=127.0.0.1:0",
                "--shutdown-delay=0s",
            ])
            // Admitted TaskRuns are logged at debug.
            .env("MPC_LOG", "info,mpc::server::webhook=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in stderr.lines() {
                let line = line.unwrap();
                let v: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        let mut w = Self {
            child,
            lines,
            seen: Vec::new(),
            addr: ([127, 0, 0, 1], 0).into(),
        };
        let started = w.wait_for("webhook server started");
        w.addr = started["webhook_addr"].as_str().unwrap().parse().unwrap();
        w
    }

    /// The first line (from now on) whose message is `message`.
    fn wait_for(&mut self, message: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no {message:?} log line ({e}); saw {:#?}", self.seen));
            self.seen.push(line.clone());
            if line["message"] == message {
                return line;
            }
        }
    }
}

impl Drop for LoggingWebhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `jq 'select(.span.<field> == $v or any(.spans[]?; .<field> == $v))'`.
fn in_span(line: &Value, field: &str, v: &str) -> bool {
    line["span"][field] == v
        || line["spans"]
            .as_array()
            .is_some_and(|spans| spans.iter().any(|s| s[field] == v))
}

/// Each review's log lines carry one span with the review's uid and the TaskRun's namespace,
/// name and (when the object has one) uid, as the binary writes them with `--log-format json`:
/// one filter on the span's fields finds a TaskRun's webhook lines, as it finds its jobs'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_log_lines_carry_the_review_and_taskrun_in_one_span() {
    let s = setup();
    let pair = new_pair();
    install(&s.cert_dir, 1, &pair.cert, &pair.key);
    let mut w = LoggingWebhook::start(&s);
    let addr = w.addr;
    let post = |body: &Value| {
        let (ca, body) = (pair.ca.clone(), serde_json::to_vec(body).unwrap());
        async move {
            let (status, _) = post_over(tls_connect(addr, &[&ca]).await, body).await;
            assert_eq!(status, StatusCode::OK);
        }
    };

    // As the API server sends a CREATE: no metadata.uid yet (it is assigned after admission).
    let mut unknown: Value = serde_json::from_slice(&fixture("unknown-platform")).unwrap();
    unknown["request"]["object"]["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("uid");
    post(&unknown).await;
    let line = w.wait_for("TaskRun with an unusable platform");
    let review_uid = unknown["request"]["uid"].as_str().unwrap();
    assert_eq!(
        line["span"],
        serde_json::json!({
            "name": "admission_review",
            "review_uid": review_uid,
            "namespace": "tenant-a",
            "taskrun": "riscv-build",
        }),
        "{line}"
    );
    assert_eq!(line["spans"], serde_json::json!([line["span"].clone()]));
    assert_eq!(line["level"], "INFO");
    assert!(line["platform"].is_string(), "{line}");
    assert!(
        line.get("namespace").is_none(),
        "the span carries it: {line}"
    );

    // An object that has a uid (a replayed or adopted review) puts it in the span.
    let mut admitted: Value = serde_json::from_slice(&fixture("taskref-bundle")).unwrap();
    let uid = "0b6f2d9e-5c1a-4e2b-9f3d-7a8c1e4b2d60";
    admitted["request"]["object"]["metadata"]["uid"] = uid.into();
    post(&admitted).await;
    let line = w.wait_for("TaskRun admitted");
    assert_eq!(line["span"]["uid"], uid, "{line}");
    assert_eq!(
        line["span"]["review_uid"], admitted["request"]["uid"],
        "{line}"
    );
    assert_eq!(line["span"]["namespace"], admitted["request"]["namespace"]);
    assert_eq!(line["span"]["taskrun"], admitted["request"]["name"]);

    // The documented filters pick each review's lines and nothing else.
    let by_uid: Vec<_> = w.seen.iter().filter(|l| in_span(l, "uid", uid)).collect();
    assert_eq!(by_uid, [&line]);
    let by_review: Vec<_> = w
        .seen
        .iter()
        .filter(|l| in_span(l, "review_uid", review_uid))
        .collect();
    assert_eq!(by_review.len(), 1);
    assert_eq!(by_review[0]["message"], "TaskRun with an unusable platform");
}
