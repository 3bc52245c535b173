//! Provisioning latency on a warm multiplexed connection to a real loopback sshd, with the OTP
//! store of each new key (what the scheduler does per TaskRun), and deprovisioning latency.
//!
//! `cargo bench --bench provision` (env: PROVISION_BENCH_ROUNDS, default 50). Needs root and
//! openssh-server (e2e/setup.sh).

// The e2e crate's sshd harness, compiled into this bench directly: depending on the e2e crate
// would build the whole tree a second time with its feature set.
#[allow(dead_code)]
#[path = "../e2e/src/sshd.rs"]
mod sshd;

use std::time::{Duration, Instant};

use mpc::otp::{OtpClient, OtpServerArgs, RunningServer};
use mpc::provision::{ProvisionRequest, Provisioner, SshOptions, Zeroizing};
use sshd::{SshdHost, unique_name};

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

fn report(what: &str, mut lat: Vec<Duration>) {
    lat.sort_unstable();
    println!(
        "{what}: n={} p50 {:.1} ms, p95 {:.1} ms, max {:.1} ms",
        lat.len(),
        percentile(&lat, 0.5),
        percentile(&lat, 0.95),
        percentile(&lat, 1.0)
    );
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; a test run (`cargo test --benches`) must stay quick.
    if !std::env::args().any(|a| a == "--bench") {
        println!("provision bench: skipped (run with cargo bench --bench provision)");
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    mpc::tls::install_crypto_provider();
    let rounds: usize = std::env::var("PROVISION_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let host = SshdHost::start()?;
    let work = tempfile::tempdir()?;
    let certs = mpc::certs::generate("otp", &["127.0.0.1".into()], 1)?;
    mpc::certs::write_bundle(&certs, &work.path().join("tls"))?;
    std::fs::write(work.path().join("token"), "bench-token")?;
    std::fs::write(
        work.path().join("seal"),
        "bench-sealing-secret-0123456789abcdef",
    )?;
    let otp = RunningServer::start(&OtpServerArgs::with_paths(
        work.path().join("tls"),
        work.path().join("otp.redb"),
        work.path().join("seal"),
        work.path().join("token"),
    ))
    .await?;
    let client = OtpClient::new(
        &format!("https://127.0.0.1:{}", otp.addr.port()),
        certs.ca_pem.as_bytes(),
        Zeroizing::new("bench-token".into()),
    )?;
    let provisioner = Provisioner::new(SshOptions::new(work.path().join("ssh")))?;
    let target = host.target("bench-host");
    let sudo = vec!["/usr/bin/podman".to_owned()];

    // Warm up: the master connection, the OTP connection, the page cache.
    let warm = unique_name("bench-warm");
    let user = mpc::contract::remote_user_name(&warm, "bench");
    host.track_user(&user);
    fn req<'a>(name: &'a str, sudo: &'a [String]) -> ProvisionRequest<'a> {
        ProvisionRequest {
            taskrun_name: name,
            namespace: "bench",
            sudo_commands: sudo,
        }
    }
    let p = provisioner.provision(&target, &req(&warm, &sudo)).await?;
    client.store_key(p.private_key.as_bytes()).await?;
    provisioner.deprovision(&target, &user).await?;

    let (mut prov, mut deprov) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let name = unique_name(&format!("bench{i}"));
        let user = mpc::contract::remote_user_name(&name, "bench");
        host.track_user(&user);
        let t = Instant::now();
        let p = provisioner.provision(&target, &req(&name, &sudo)).await?;
        client.store_key(p.private_key.as_bytes()).await?;
        prov.push(t.elapsed());
        let t = Instant::now();
        provisioner.deprovision(&target, &user).await?;
        deprov.push(t.elapsed());
    }
    report("provision + OTP store (with sudoers and limits)", prov);
    report("deprovision", deprov);
    provisioner.close().await;
    otp.shutdown().await;
    Ok(())
}
