//! Provisioning latency on a warm multiplexed connection to a real loopback sshd, with the OTP
//! store of each new key (what the controller does per TaskRun), and deprovisioning latency; for
//! the default ed25519 keys and for RSA-3072 (FIPS hosts).
//!
//! `cargo bench -p e2e --bench provision` (env: PROVISION_BENCH_ROUNDS, default 50; RSA runs a
//! fifth of that). Needs root and what e2e/setup.sh installs (openssh-server, podman, sudo).
//!
//! The admin's shell startup file is part of every SSH command (bash reads `~/.bashrc` for commands
//! arriving over SSH). The host's sessions get `HOME` pointed at a directory whose `.bashrc` is
//! empty, as on a build host whose admin account has a guarded one, so the figures measure the
//! scripts rather than this machine's shell setup.

use std::time::{Duration, Instant};

use e2e::sshd::{HostSetup, SshdHost, unique_name};
use mpc::config::{BuildUserSettings, KeyType};
use mpc::otp::{OtpClient, OtpServerArgs, RunningServer};
use mpc::provision::{ProvisionRequest, Provisioner, SshOptions, Zeroizing};

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

fn report(what: &str, mut lat: Vec<Duration>) {
    lat.sort_unstable();
    println!(
        "{what}: n={} p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        lat.len(),
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        percentile(&lat, 1.0)
    );
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; a test run (`cargo test --benches`) must stay quick.
    if !std::env::args().any(|a| a == "--bench") {
        println!("provision bench: skipped (run with cargo bench -p e2e --bench provision)");
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
    let admin_home = tempfile::tempdir()?;
    std::fs::write(admin_home.path().join(".bashrc"), "")?;
    let host = SshdHost::start_with(HostSetup {
        env: vec![("HOME".into(), admin_home.path().display().to_string())],
        ..HostSetup::default()
    })?;
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
    let rsa = BuildUserSettings {
        key_type: KeyType::Rsa { bits: 3072 },
        ..BuildUserSettings::DEFAULT
    };

    for (label, settings, n) in [
        ("ed25519", &BuildUserSettings::DEFAULT, rounds),
        ("rsa-3072", &rsa, rounds.div_ceil(5)),
    ] {
        fn req<'a>(
            name: &'a str,
            sudo: &'a [String],
            settings: &'a BuildUserSettings,
        ) -> ProvisionRequest<'a> {
            ProvisionRequest {
                taskrun_name: name,
                namespace: "bench",
                sudo_commands: sudo,
                settings,
            }
        }
        // Warm up: the master connection, the OTP connection, the page cache.
        let warm = unique_name("bench-warm");
        let user = mpc::contract::remote_user_name(&warm, "bench");
        host.track_user(&user);
        let p = provisioner
            .provision(&target, &req(&warm, &sudo, settings))
            .await?;
        client.store_key(p.private_key.as_bytes()).await?;
        provisioner.deprovision(&target, &user).await?;

        let (mut prov, mut deprov) = (Vec::new(), Vec::new());
        for i in 0..n {
            let name = unique_name(&format!("bench{i}"));
            let user = mpc::contract::remote_user_name(&name, "bench");
            host.track_user(&user);
            let t = Instant::now();
            let p = provisioner
                .provision(&target, &req(&name, &sudo, settings))
                .await?;
            client.store_key(p.private_key.as_bytes()).await?;
            prov.push(t.elapsed());
            let t = Instant::now();
            provisioner.deprovision(&target, &user).await?;
            deprov.push(t.elapsed());
        }
        report(
            &format!("{label}: provision + OTP store (with sudoers and limits)"),
            prov,
        );
        report(&format!("{label}: deprovision"), deprov);
    }
    provisioner.close().await;
    otp.shutdown().await;
    Ok(())
}
