//! Provisioning against real OpenSSH servers on loopback: users are created, logged into with the
//! generated key, and removed without a trace; host failures come back as typed errors.

use std::time::Duration;

use e2e::sshd::{SshdHost, unique_name, user_exists};
use mpc::provision::{Blame, ProvisionError, ProvisionRequest, Provisioner, SshOptions};

fn provisioner(state: &tempfile::TempDir) -> Provisioner {
    let mut opts = SshOptions::new(state.path().join("ssh"));
    opts.connect_timeout = Duration::from_secs(10);
    opts.command_timeout = Duration::from_secs(30);
    Provisioner::new(opts).expect("provisioner")
}

fn request<'a>(name: &'a str, sudo: &'a [String]) -> ProvisionRequest<'a> {
    ProvisionRequest {
        taskrun_name: name,
        namespace: "tenant-e2e",
        sudo_commands: sudo,
    }
}

fn user_of(name: &str) -> String {
    mpc::contract::remote_user_name(name, "tenant-e2e")
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test]
async fn provision_login_then_deprovision_leaves_nothing() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("static-1");
    let name = unique_name("build");
    let user = user_of(&name);
    host.track_user(&user);

    let got = p.provision(&target, &request(&name, &[])).await.unwrap();
    assert_eq!(got.user, user);
    assert_eq!(got.home, format!("/home/{user}"));
    assert_eq!(got.login, format!("{user}@{}", host.address()));
    assert!(user_exists(&user));

    let out = host
        .ssh_as(
            &user,
            &got.private_key,
            "id -un; pwd; stat -c '%a %U' ~/.ssh ~/.ssh/authorized_keys ~/build; wc -l < ~/.ssh/authorized_keys",
        )
        .unwrap();
    assert!(
        out.status.success(),
        "login failed: {out:?}\n{}",
        host.log()
    );
    let lines: Vec<String> = stdout(&out).lines().map(str::to_owned).collect();
    assert_eq!(lines[0], user);
    assert_eq!(lines[1], got.home);
    assert_eq!(lines[2], format!("700 {user}"));
    assert_eq!(lines[3], format!("600 {user}"));
    assert!(lines[4].ends_with(&user), "{}", lines[4]);
    assert_eq!(lines[5], "1");
    let limits = std::fs::read_to_string(format!("/etc/security/limits.d/{user}.conf")).unwrap();
    assert!(
        limits.contains(&format!("{user} - nproc 16384")),
        "{limits}"
    );
    assert!(!std::path::Path::new(&format!("/etc/sudoers.d/{user}")).exists());

    // A process left running by the build must not keep the user alive.
    let out = host
        .ssh_as(&user, &got.private_key, "nohup sleep 300 >/dev/null 2>&1 &")
        .unwrap();
    assert!(out.status.success());

    p.deprovision(&target, &user).await.unwrap();
    assert!(!user_exists(&user));
    assert!(!std::path::Path::new(&got.home).exists());
    assert!(!std::path::Path::new(&format!("/etc/security/limits.d/{user}.conf")).exists());
    // Idempotent: the user is gone already.
    p.deprovision(&target, &user).await.unwrap();
    let out = host.ssh_as(&user, &got.private_key, "true").unwrap();
    assert!(!out.status.success());
}

#[tokio::test]
async fn provisioning_twice_leaves_one_user_with_only_the_new_key() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("static-1");
    let name = unique_name("retry");
    let user = user_of(&name);
    host.track_user(&user);

    let first = p.provision(&target, &request(&name, &[])).await.unwrap();
    let second = p.provision(&target, &request(&name, &[])).await.unwrap();
    assert_ne!(first.public_key, second.public_key);
    let old = host.ssh_as(&user, &first.private_key, "true").unwrap();
    assert!(!old.status.success(), "the old key still works");
    let new = host
        .ssh_as(&user, &second.private_key, "cat ~/.ssh/authorized_keys")
        .unwrap();
    assert!(new.status.success(), "{new:?}");
    assert_eq!(stdout(&new), second.public_key.trim());
    let entries = std::process::Command::new("getent")
        .args(["passwd", &user])
        .output()
        .unwrap();
    assert_eq!(stdout(&entries).lines().count(), 1);
    p.deprovision(&target, &user).await.unwrap();
}

#[tokio::test]
async fn two_hosts_at_once_with_concurrent_requests() {
    let a = SshdHost::start().unwrap();
    let b = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut opts = SshOptions::new(state.path().join("ssh"));
    opts.max_sessions_per_host = 2;
    let p = Provisioner::new(opts).unwrap();
    let (ta, tb) = (a.target("host-a"), b.target("host-b"));
    let names: Vec<String> = (0..6).map(|i| unique_name(&format!("multi{i}"))).collect();
    for (i, n) in names.iter().enumerate() {
        let host = if i % 2 == 0 { &a } else { &b };
        host.track_user(&user_of(n));
    }
    let jobs = names.iter().enumerate().map(|(i, n)| {
        let (p, t) = (&p, if i % 2 == 0 { &ta } else { &tb });
        async move { p.provision(t, &request(n, &[])).await }
    });
    let results = futures::future::join_all(jobs).await;
    for (i, r) in results.iter().enumerate() {
        let got = r.as_ref().unwrap();
        let host = if i % 2 == 0 { &a } else { &b };
        assert!(got.login.ends_with(&host.address()));
        let out = host.ssh_as(&got.user, &got.private_key, "id -un").unwrap();
        assert_eq!(stdout(&out), got.user, "{out:?}");
    }
    for (i, r) in results.iter().enumerate() {
        let t = if i % 2 == 0 { &ta } else { &tb };
        p.deprovision(t, &r.as_ref().unwrap().user).await.unwrap();
        assert!(!user_exists(&r.as_ref().unwrap().user));
    }
}

#[tokio::test]
async fn a_host_killed_mid_provision_gives_a_typed_error_and_recovers_after_restart() {
    let mut host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("dying");
    let warm = unique_name("warm");
    host.track_user(&user_of(&warm));
    p.provision(&target, &request(&warm, &[])).await.unwrap();

    // Freeze the machine so the next provision is certainly in flight, then kill it.
    let name = unique_name("killed");
    host.track_user(&user_of(&name));
    host.freeze();
    let killed = request(&name, &[]);
    let (result, ()) = tokio::join!(p.provision(&target, &killed), async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        host.kill();
    });
    let err = result.unwrap_err();
    assert!(
        matches!(err, ProvisionError::Unreachable { .. }),
        "expected Unreachable, got {err:?}"
    );
    assert_eq!(err.blame(), Blame::Host);

    // While it is down: refused at once, still typed.
    let err = p
        .provision(&target, &request(&name, &[]))
        .await
        .unwrap_err();
    assert!(matches!(err, ProvisionError::Unreachable { .. }), "{err:?}");

    // Back with the same key: the manager reconnects by itself.
    host.restart(false).unwrap();
    let got = p.provision(&target, &request(&name, &[])).await.unwrap();
    let out = host.ssh_as(&got.user, &got.private_key, "id -un").unwrap();
    assert_eq!(stdout(&out), got.user);
    p.deprovision(&target, &got.user).await.unwrap();
    p.deprovision(&target, &user_of(&warm)).await.unwrap();
}

#[tokio::test]
async fn a_hung_host_times_out() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut opts = SshOptions::new(state.path().join("ssh"));
    opts.command_timeout = Duration::from_secs(2);
    let p = Provisioner::new(opts).unwrap();
    let target = host.target("hung");
    assert!(p.list_build_users(&target).await.is_ok());
    host.freeze();
    let err = p.list_build_users(&target).await.unwrap_err();
    assert!(matches!(err, ProvisionError::Timeout { .. }), "{err:?}");
    assert!(err.is_host_problem());
    host.thaw();
    assert!(p.list_build_users(&target).await.is_ok());
}

#[tokio::test]
async fn a_changed_host_key_is_refused() {
    let mut host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("rekeyed");
    let users_before = p.list_build_users(&target).await.unwrap();
    drop(users_before);
    host.restart(true).unwrap();
    let err = p.list_build_users(&target).await.unwrap_err();
    match &err {
        ProvisionError::HostKeyMismatch {
            host: h, expected, ..
        } => {
            assert_eq!(h, "rekeyed");
            assert_eq!(*expected, "recorded");
        }
        other => panic!("expected HostKeyMismatch, got {other:?}"),
    }
    assert_eq!(err.blame(), Blame::Host);
    assert!(err.to_string().contains("does not match"));

    // A pinned key that is not the host's is refused on first contact.
    let mut wrong = host.pinned_target("pinned");
    wrong.host_key = mpc::provision::HostKeyTrust::Pinned(
        mpc::provision::keys::generate("x")
            .unwrap()
            .public_openssh
            .split(' ')
            .take(2)
            .collect::<Vec<_>>()
            .join(" "),
    );
    let err = p.list_build_users(&wrong).await.unwrap_err();
    assert!(
        matches!(
            err,
            ProvisionError::HostKeyMismatch {
                expected: "pinned",
                ..
            }
        ),
        "{err:?}"
    );
    // The right pinned key works; so does the TOFU id once the terminated host is forgotten.
    assert!(
        p.list_build_users(&host.pinned_target("pinned"))
            .await
            .is_ok()
    );
    p.forget_host("rekeyed").await;
    assert!(p.list_build_users(&target).await.is_ok());
}

#[tokio::test]
async fn auth_refused_is_typed() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let mut target = host.target("wrong-key");
    target.admin_key = std::sync::Arc::new(mpc::provision::Zeroizing::new(
        mpc::provision::keys::generate("other")
            .unwrap()
            .private_openssh
            .as_bytes()
            .to_vec(),
    ));
    let err = p.list_build_users(&target).await.unwrap_err();
    assert!(matches!(err, ProvisionError::AuthRefused { .. }), "{err:?}");
    assert!(err.is_host_problem());
}

#[tokio::test]
async fn sudo_commands_allow_exactly_the_listed_commands() {
    if !std::path::Path::new("/usr/sbin/visudo").exists() {
        eprintln!("sudo is not installed; skipping");
        return;
    }
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("sudo-host");
    let name = unique_name("sudo");
    let user = user_of(&name);
    host.track_user(&user);
    let sudo = vec!["/usr/bin/id".to_owned(), "/usr/bin/true".to_owned()];
    let got = p.provision(&target, &request(&name, &sudo)).await.unwrap();
    let file = format!("/etc/sudoers.d/{user}");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o440);
    let ok = host
        .ssh_as(&user, &got.private_key, "sudo -n /usr/bin/id -u")
        .unwrap();
    assert!(ok.status.success(), "{ok:?}");
    assert_eq!(stdout(&ok), "0");
    let denied = host
        .ssh_as(&user, &got.private_key, "sudo -n /bin/cat /etc/shadow")
        .unwrap();
    assert!(!denied.status.success());

    // Re-provisioning without sudo-commands withdraws the rule.
    p.provision(&target, &request(&name, &[])).await.unwrap();
    assert!(!std::path::Path::new(&file).exists());
    let with = p.provision(&target, &request(&name, &sudo)).await.unwrap();
    assert!(std::path::Path::new(&file).exists());
    drop(with);
    p.deprovision(&target, &user).await.unwrap();
    assert!(!std::path::Path::new(&file).exists());

    // Unvalidated commands never reach the host.
    let bad = vec!["/bin/sh -c 'id'".to_owned()];
    let err = p
        .provision(&target, &request(&name, &bad))
        .await
        .unwrap_err();
    assert!(matches!(err, ProvisionError::InvalidRequest(_)), "{err:?}");
    assert_eq!(err.blame(), Blame::Request);
    assert!(!user_exists(&user));
}

#[tokio::test]
async fn sweep_removes_stale_users_and_keeps_live_ones() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("swept");
    let names: Vec<String> = (0..3).map(|i| unique_name(&format!("sweep{i}"))).collect();
    let users: Vec<String> = names.iter().map(|n| user_of(n)).collect();
    for (n, u) in names.iter().zip(&users) {
        host.track_user(u);
        p.provision(&target, &request(n, &[])).await.unwrap();
    }
    // Other tests share this machine's passwd: treat every user but our two stale ones as live.
    let stale = [users[1].clone(), users[2].clone()];
    let removed = p
        .sweep(&target, |u| !stale.contains(&u.to_owned()))
        .await
        .unwrap();
    let mut removed_sorted = removed.clone();
    removed_sorted.sort();
    let mut expected = stale.to_vec();
    expected.sort();
    assert_eq!(removed_sorted, expected);
    assert!(user_exists(&users[0]));
    assert!(!user_exists(&users[1]) && !user_exists(&users[2]));
    let listed = p.list_build_users(&target).await.unwrap();
    assert!(listed.contains(&users[0]));
    p.deprovision(&target, &users[0]).await.unwrap();

    // Never deletes an account that is not a build user.
    let err = p.deprovision(&target, "root").await.unwrap_err();
    assert!(matches!(err, ProvisionError::InvalidRequest(_)));
}
