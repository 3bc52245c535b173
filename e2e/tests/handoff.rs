//! The full key hand-off on loopback: provision a build user on a real sshd, store its key in the
//! OTP server, write the TaskRun secret's data (docs/architecture.md, "The contract with the Go
//! controller") into a directory standing for `/ssh`, and run the consumer script a Konflux build
//! step would: redeem, rsync, ssh, command runs on the host as the build user.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use e2e::sshd::{SshdHost, unique_name, user_exists, write_file};
use mpc::contract::secret_keys;
use mpc::otp::{OtpClient, OtpServerArgs, RunningServer};
use mpc::provision::{ProvisionRequest, Provisioner, SshOptions, Zeroizing};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/consume-secret.sh");

fn consume(secret: &Path, home: &Path, host: &SshdHost, sync: Option<&Path>, cmd: &str) -> Output {
    let known = write_file(
        home,
        "known_hosts",
        &format!("{}\n", host.known_hosts_line()),
        0o644,
    )
    .unwrap();
    let mut c = Command::new("bash");
    c.arg(SCRIPT)
        .arg(cmd)
        .env("SSH_DIR", secret)
        .env("SSH_KNOWN_HOSTS", known)
        .env("SSH_PORT", host.port().to_string())
        .env("HOME", home);
    if let Some(d) = sync {
        c.env("SYNC_DIR", d);
    }
    c.output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioned_key_reaches_the_build_step_through_the_otp_server_once() {
    mpc::tls::install_crypto_provider();
    let host = SshdHost::start().unwrap();
    let work = tempfile::tempdir().unwrap();

    // OTP server with its own CA, sealing secret and store token.
    let certs = mpc::certs::generate("otp", &["127.0.0.1".into()], 1).unwrap();
    mpc::certs::write_bundle(&certs, &work.path().join("tls")).unwrap();
    let bearer = "store-token-for-handoff-test";
    std::fs::write(work.path().join("store-token"), bearer).unwrap();
    std::fs::write(
        work.path().join("seal"),
        "0123456789abcdef0123456789abcdef!",
    )
    .unwrap();
    let mut args = OtpServerArgs::with_paths(
        work.path().join("tls"),
        work.path().join("otp.redb"),
        work.path().join("seal"),
        work.path().join("store-token"),
    );
    args.ttl = Duration::from_secs(300);
    let otp = RunningServer::start(&args).await.unwrap();
    let client = OtpClient::new(
        &format!("https://127.0.0.1:{}", otp.addr.port()),
        certs.ca_pem.as_bytes(),
        Zeroizing::new(bearer.to_owned()),
    )
    .unwrap();

    // Controller side: provision, store, write the secret data.
    let provisioner = Provisioner::new(SshOptions::new(work.path().join("ssh-state"))).unwrap();
    let target = host.target("handoff-host");
    let name = unique_name("handoff");
    let user = mpc::contract::remote_user_name(&name, "tenant-a");
    host.track_user(&user);
    let provisioned = provisioner
        .provision(
            &target,
            &ProvisionRequest {
                taskrun_name: &name,
                namespace: "tenant-a",
                sudo_commands: &[],
                settings: &mpc::config::BuildUserSettings::DEFAULT,
            },
        )
        .await
        .unwrap();
    let token = client
        .store_key(provisioned.private_key.as_bytes())
        .await
        .unwrap();
    let secret = work.path().join("secret");
    std::fs::create_dir(&secret).unwrap();
    for (k, v) in [
        (secret_keys::OTP, token.as_str().to_owned()),
        (secret_keys::OTP_SERVER, client.otp_url()),
        (secret_keys::OTP_CA, certs.ca_pem.clone()),
        (secret_keys::HOST, provisioned.login.clone()),
        (secret_keys::USER_DIR, provisioned.home.clone()),
    ] {
        std::fs::write(secret.join(k), v).unwrap();
    }

    // Build step side.
    let sources = tempfile::tempdir().unwrap();
    std::fs::write(sources.path().join("input.txt"), "sources from the pod\n").unwrap();
    let pod_home = tempfile::tempdir().unwrap();
    let out = consume(
        &secret,
        pod_home.path(),
        &host,
        Some(sources.path()),
        "id -un; pwd; cat build/input.txt",
    );
    assert!(
        out.status.success(),
        "consumer failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        host.log()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            user.as_str(),
            provisioned.home.as_str(),
            "sources from the pod"
        ]
    );

    // A second attempt (a retried step) cannot get the key again.
    let again_home = tempfile::tempdir().unwrap();
    let again = consume(&secret, again_home.path(), &host, None, "true");
    assert!(!again.status.success());
    assert_eq!(otp.metrics.redeemed.get(), 1);
    assert_eq!(otp.metrics.rejected.with_label_values(&["used"]).get(), 1);

    // An error secret stops the step with its message.
    let failed = work.path().join("failed");
    std::fs::create_dir(&failed).unwrap();
    std::fs::write(
        failed.join(secret_keys::ERROR),
        "no host available for linux/arm64",
    )
    .unwrap();
    let out = consume(&failed, pod_home.path(), &host, None, "true");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no host available for linux/arm64"));

    provisioner.deprovision(&target, &user).await.unwrap();
    assert!(!user_exists(&user));
    provisioner.close().await;
    otp.shutdown().await;
}
