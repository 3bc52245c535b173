//! Load generator against the real `mpc otp-server` binary: stores keys the controller's way (one
//! owner per key), redeems them all, then revokes every owner, with many concurrent HTTPS
//! keep-alive connections, and prints throughput and latency percentiles, and the server's CPU
//! time and peak RSS.
//!
//! `cargo bench --bench otp` (env: OTP_BENCH_KEYS, default 20000; OTP_BENCH_CONCURRENCY, default 64).

use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "support/proc.rs"]
mod proc_stats;

use mpc::otp::OtpClient;
use mpc::provision::Zeroizing;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn run_all<F, Fut>(n: usize, concurrency: usize, f: F) -> (Duration, Vec<Duration>)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let f = Arc::new(f);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (f, next) = (Arc::clone(&f), Arc::clone(&next));
            tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return lat;
                    }
                    let t = Instant::now();
                    f(i).await;
                    lat.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut all = Vec::with_capacity(n);
    for w in workers {
        all.extend(w.await.expect("worker"));
    }
    let elapsed = started.elapsed();
    all.sort_unstable();
    (elapsed, all)
}

fn report(what: &str, n: usize, elapsed: Duration, lat: &[Duration]) {
    println!(
        "{what}: {n} in {:.2}s = {:.0}/s; latency p50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64(),
        percentile(lat, 0.50).as_secs_f64() * 1e3,
        percentile(lat, 0.95).as_secs_f64() * 1e3,
        percentile(lat, 0.99).as_secs_f64() * 1e3,
    );
}

fn main() {
    // `cargo bench` passes `--bench`; a test run (`cargo test --benches`) must stay quick.
    if !std::env::args().any(|a| a == "--bench") {
        println!("otp bench: skipped (run with cargo bench --bench otp)");
        return;
    }
    mpc::tls::install_crypto_provider();
    let keys = env_usize("OTP_BENCH_KEYS", 20_000);
    let concurrency = env_usize("OTP_BENCH_CONCURRENCY", 64);
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = mpc::certs::generate("otp", &["127.0.0.1".into()], 1).expect("certs");
    mpc::certs::write_bundle(&certs, &dir.path().join("tls")).expect("write certs");
    std::fs::write(dir.path().join("token"), "bench-store-token").expect("token");
    std::fs::write(
        dir.path().join("seal"),
        "bench-sealing-secret-0123456789abcdef",
    )
    .expect("seal");
    let port = free_port();
    let mut server = Command::new(env!("CARGO_BIN_EXE_mpc"))
        .arg("otp-server")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--tls-dir")
        .arg(dir.path().join("tls"))
        .arg("--db")
        .arg(dir.path().join("otp.redb"))
        .arg("--seal-key-file")
        .arg(dir.path().join("seal"))
        .arg("--store-token-file")
        .arg(dir.path().join("token"))
        .env("MPC_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("starting mpc otp-server");
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "otp-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let client = OtpClient::new(
            &format!("https://127.0.0.1:{port}"),
            certs.ca_pem.as_bytes(),
            Zeroizing::new("bench-store-token".into()),
        )
        .expect("client");
        let key = mpc::provision::keys::generate("bench")
            .expect("key")
            .private_openssh
            .to_string();
        let tokens = Arc::new(std::sync::Mutex::new(vec![String::new(); keys]));
        let (c, k, t) = (client.clone(), key.clone(), Arc::clone(&tokens));
        let (elapsed, lat) = run_all(keys, concurrency, move |i| {
            let (c, k, t) = (c.clone(), k.clone(), Arc::clone(&t));
            async move {
                let token = c
                    .store_key_for(&format!("uid-{i}"), "provision-0", None, k.as_bytes())
                    .await
                    .expect("store");
                t.lock().expect("lock")[i] = token.as_str().to_owned();
            }
        })
        .await;
        report("store-key", keys, elapsed, &lat);
        let db = std::fs::metadata(dir.path().join("otp.redb")).map_or(0, |m| m.len());
        println!(
            "database with {keys} keys pending: {:.1} MiB ({} B per key)",
            db as f64 / (1 << 20) as f64,
            db / keys.max(1) as u64
        );

        let tokens = Arc::new(std::mem::take(&mut *tokens.lock().expect("lock")));
        let (c, k, t) = (client.clone(), key.clone(), Arc::clone(&tokens));
        let (elapsed, lat) = run_all(keys, concurrency, move |i| {
            let (c, k, t) = (c.clone(), k.clone(), Arc::clone(&t));
            async move {
                let got = c.redeem(&t[i]).await.expect("redeem");
                assert_eq!(got.as_slice(), k.as_bytes());
            }
        })
        .await;
        report("otp redeem", keys, elapsed, &lat);

        let c = client.clone();
        let (elapsed, lat) = run_all(keys, concurrency, move |i| {
            let c = c.clone();
            async move {
                let deleted = c.revoke(&format!("uid-{i}")).await.expect("revoke");
                assert_eq!(deleted, 1);
            }
        })
        .await;
        report("revoke", keys, elapsed, &lat);
    });
    let pid = server.id();
    println!(
        "server: {:.1} us CPU per request, peak RSS {:.1} MiB",
        proc_stats::cpu_seconds(pid) / (3 * keys).max(1) as f64 * 1e6,
        proc_stats::peak_rss_mib(pid)
    );
    let _ = server.kill();
    let _ = server.wait();
}
