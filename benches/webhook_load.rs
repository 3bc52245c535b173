//! Load generator for the real `mpc controller` binary: TLS on loopback, keep-alive connections,
//! small (~3.5 KB taskRef) AdmissionReviews. Starts the binary with certificates from
//! `mpc::certs` and the fixture host-config, waits for `/readyz`, drives it for a fixed time, and
//! prints throughput, latency percentiles, CPU time of server and client, the server's peak RSS
//! and the load average.
//!
//! cargo bench --bench webhook_load
//!
//! Knobs (environment): MPC_LOAD_SECONDS (10), MPC_LOAD_WARMUP_SECONDS (2), MPC_LOAD_CONNECTIONS
//! (32), MPC_LOAD_PROTOCOL (`http1` or `h2`), MPC_LOAD_STREAMS (concurrent streams per h2
//! connection, 4), MPC_LOAD_CLIENT_THREADS (1), MPC_LOAD_SERVER_THREADS (server runtime worker
//! threads, default: the binary's own choice).

#[path = "../core/benches/support/compact_json.rs"]
mod compact_json;
#[path = "support/proc.rs"]
mod proc_stats;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use proc_stats::{cpu_seconds, peak_rss_mib};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

const SERVER_NAME: &str = "mpc-webhook.mpc.svc";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn body() -> Bytes {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("core/tests/fixtures/admission/taskref-bundle.json");
    Bytes::from(compact_json::compact(&std::fs::read(path).unwrap()))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

struct Server {
    child: Child,
    webhook: SocketAddr,
    admin: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM for a graceful stop, then make sure it is gone.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(dir: &Path) -> Server {
    let bundle = mpc::certs::generate(
        SERVER_NAME,
        &mpc::certs::service_sans("mpc-webhook", "mpc"),
        30,
    )
    .unwrap();
    let certs = dir.join("certs");
    mpc::certs::write_bundle(&bundle, &certs).unwrap();
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("core/tests/fixtures/admission/host-config.yaml");
    let webhook = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mpc"));
    cmd.arg("controller")
        .arg("--webhook-only")
        .arg(format!("--config={}", config.display()))
        .arg(format!("--cert-dir={}", certs.display()))
        .arg(format!("--webhook-addr={webhook}"))
        .arg(format!("--admin-addr={admin}"))
        .arg("--shutdown-delay=0s")
        .env("MPC_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Ok(n) = std::env::var("MPC_LOAD_SERVER_THREADS") {
        cmd.env("TOKIO_WORKER_THREADS", n);
    }
    let child = cmd.spawn().expect("starting mpc controller");
    Server {
        child,
        webhook,
        admin,
    }
}

async fn wait_ready(admin: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(tcp) = TcpStream::connect(admin).await
            && let Ok((mut send, conn)) =
                hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await
        {
            tokio::spawn(conn);
            let req = Request::get("/readyz")
                .header("host", "admin")
                .body(Full::new(Bytes::new()))
                .unwrap();
            if let Ok(resp) = send.send_request(req).await
                && resp.status() == 200
            {
                return;
            }
        }
        assert!(Instant::now() < deadline, "server not ready in 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    errors: u64,
}

async fn connect(
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    tokio_rustls::TlsConnector::from(tls)
        .connect(ServerName::try_from(SERVER_NAME).unwrap(), tcp)
        .await
        .unwrap()
}

fn request(body: &Bytes) -> Request<Full<Bytes>> {
    Request::post("/mutate-taskrun")
        .header("host", SERVER_NAME)
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .unwrap()
}

/// Sends requests back to back until `stop`; records latencies once `measuring` is set.
async fn drive<F, Fut>(mut send: F, stop: Arc<AtomicBool>, measuring: Arc<AtomicBool>) -> Tally
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let mut t = Tally::default();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let ok = send().await;
        if measuring.load(Ordering::Relaxed) {
            if ok {
                t.latencies_us
                    .push(u32::try_from(started.elapsed().as_micros()).unwrap_or(u32::MAX));
            } else {
                t.errors += 1;
            }
        }
    }
    t
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i]) / 1000.0
}

fn main() {
    mpc::tls::install_crypto_provider();
    let seconds: f64 = env_or("MPC_LOAD_SECONDS", 10.0);
    let warmup: f64 = env_or("MPC_LOAD_WARMUP_SECONDS", 2.0);
    let connections: usize = env_or("MPC_LOAD_CONNECTIONS", 32);
    let streams: usize = env_or("MPC_LOAD_STREAMS", 4);
    let h2 = std::env::var("MPC_LOAD_PROTOCOL").is_ok_and(|p| p == "h2");
    let client_threads: usize = env_or("MPC_LOAD_CLIENT_THREADS", 1);

    let dir = tempfile::tempdir().unwrap();
    let server = start_server(dir.path());
    let ca = std::fs::read(dir.path().join("certs/ca.crt")).unwrap();
    let alpn: &[&[u8]] = if h2 { &[b"h2"] } else { &[b"http/1.1"] };
    let tls = Arc::new(mpc::tls::client_config_trusting(&ca, alpn).unwrap());
    let body = body();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(client_threads)
        .enable_all()
        .build()
        .unwrap();
    let load_before = loadavg();
    let (tally, measured, server_cpu, client_cpu, server_rss) = rt.block_on(async {
        wait_ready(server.admin).await;
        let ready_rss = peak_rss_mib(server.child.id());
        let stop = Arc::new(AtomicBool::new(false));
        let measuring = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for _ in 0..connections {
            let stream = connect(server.webhook, Arc::clone(&tls)).await;
            if h2 {
                let (send, conn) = hyper::client::conn::http2::handshake(
                    TokioExecutor::new(),
                    TokioIo::new(stream),
                )
                .await
                .unwrap();
                tokio::spawn(conn);
                for _ in 0..streams {
                    let (mut send, body, sent) = (send.clone(), body.clone(), Arc::clone(&sent));
                    tasks.push(tokio::spawn(drive(
                        move || {
                            let fut = send.send_request(request(&body));
                            let sent = Arc::clone(&sent);
                            async move {
                                sent.fetch_add(1, Ordering::Relaxed);
                                match fut.await {
                                    Ok(r) if r.status() == 200 => {
                                        r.into_body().collect().await.is_ok()
                                    }
                                    _ => false,
                                }
                            }
                        },
                        Arc::clone(&stop),
                        Arc::clone(&measuring),
                    )));
                }
            } else {
                let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .unwrap();
                tokio::spawn(conn);
                let send = Arc::new(tokio::sync::Mutex::new(send));
                let body = body.clone();
                tasks.push(tokio::spawn(drive(
                    move || {
                        let (send, body) = (Arc::clone(&send), body.clone());
                        async move {
                            let mut s = send.lock().await;
                            match s.send_request(request(&body)).await {
                                Ok(r) if r.status() == 200 => r.into_body().collect().await.is_ok(),
                                _ => false,
                            }
                        }
                    },
                    Arc::clone(&stop),
                    Arc::clone(&measuring),
                )));
            }
        }
        tokio::time::sleep(Duration::from_secs_f64(warmup)).await;
        let pid = server.child.id();
        let (s0, c0) = (cpu_seconds(pid), cpu_seconds(std::process::id()));
        let started = Instant::now();
        measuring.store(true, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
        measuring.store(false, Ordering::Relaxed);
        let measured = started.elapsed();
        let (s1, c1) = (cpu_seconds(pid), cpu_seconds(std::process::id()));
        let rss = peak_rss_mib(pid);
        stop.store(true, Ordering::Relaxed);
        let mut all = Tally::default();
        for t in tasks {
            let t = t.await.unwrap();
            all.latencies_us.extend(t.latencies_us);
            all.errors += t.errors;
        }
        (all, measured, s1 - s0, c1 - c0, (ready_rss, rss))
    });
    let load_after = loadavg();
    drop(server);

    let mut lat = tally.latencies_us;
    lat.sort_unstable();
    let n = lat.len();
    let secs = measured.as_secs_f64();
    let proto = if h2 {
        format!("h2, {connections} connections x {streams} streams")
    } else {
        format!("http/1.1, {connections} keep-alive connections")
    };
    println!(
        "webhook load: {proto}, {} B reviews, {secs:.1} s measured",
        body.len()
    );
    println!(
        "  requests {n}, errors {}, throughput {:.0} req/s",
        tally.errors,
        n as f64 / secs
    );
    println!(
        "  latency ms: p50 {:.3}  p90 {:.3}  p99 {:.3}  p99.9 {:.3}  max {:.3}",
        percentile(&lat, 0.50),
        percentile(&lat, 0.90),
        percentile(&lat, 0.99),
        percentile(&lat, 0.999),
        percentile(&lat, 1.0)
    );
    println!(
        "  cpu: server {:.2} cores, client {:.2} cores; server {:.1} us/request",
        server_cpu / secs,
        client_cpu / secs,
        server_cpu / n.max(1) as f64 * 1e6
    );
    println!(
        "  server peak RSS: {:.1} MiB when ready, {:.1} MiB after the run",
        server_rss.0, server_rss.1
    );
    println!("  load average before: {load_before}; after: {load_after}");
}
