//! Provisioning against real OpenSSH servers on loopback: users are created, logged into with the
//! generated key, and removed without a trace; host failures come back as typed errors. Hosts
//! that lack a tool (or have one this machine lacks: SELinux and systemd stand-ins that record
//! their calls) are set up through the host's `PATH` ([`HostSetup`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::sshd::{
    HostSetup, OwnUsers, SshdHost, require_tools, slice_drop_in_dirs, unique_name, user_exists,
};
use mpc::config::{BuildUserSettings, CpuQuota, KeyType, MemoryMax};
use mpc::provision::{Blame, ProvisionError, ProvisionRequest, Provisioner, SshOptions};

fn provisioner(state: &tempfile::TempDir) -> Provisioner {
    let mut opts = SshOptions::new(state.path().join("ssh"));
    opts.connect_timeout = Duration::from_secs(10);
    opts.command_timeout = Duration::from_secs(30);
    Provisioner::new(opts).expect("provisioner")
}

static DEFAULT: BuildUserSettings = BuildUserSettings::DEFAULT;

fn request<'a>(name: &'a str, sudo: &'a [String]) -> ProvisionRequest<'a> {
    ProvisionRequest {
        taskrun_name: name,
        namespace: "tenant-e2e",
        sudo_commands: sudo,
        settings: &DEFAULT,
    }
}

fn with_settings<'a>(name: &'a str, settings: &'a BuildUserSettings) -> ProvisionRequest<'a> {
    ProvisionRequest {
        settings,
        ..request(name, &[])
    }
}

/// A fresh TaskRun name on `host` and its user, removed when the host is dropped.
fn new_user(host: &SshdHost, prefix: &str) -> (String, String) {
    let name = unique_name(prefix);
    let user = user_of(&name);
    host.track_user(&user);
    (name, user)
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
    let (name, user) = new_user(&host, "build");

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
    let (name, user) = new_user(&host, "retry");

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
    require_tools(&["visudo", "sudo"]).unwrap();
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("sudo-host");
    let (name, user) = new_user(&host, "sudo");
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
async fn build_users_are_listed_with_the_age_the_go_cleanup_measures() {
    const DAY: u64 = 24 * 60 * 60;
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("swept");
    let names: Vec<String> = (0..5).map(|i| unique_name(&format!("sweep{i}"))).collect();
    let users: Vec<String> = names.iter().map(|n| user_of(n)).collect();
    for (n, u) in names.iter().zip(&users) {
        host.track_user(u);
        p.provision(&target, &request(n, &[])).await.unwrap();
    }
    // 0-2: old (as the Go cleanup measures: the home's mtime); 3: young; 4: no home (aged by
    // its shadow entry: today, so young).
    for u in &users[..3] {
        e2e::sshd::age_home(u, 2 * DAY);
    }
    std::fs::remove_dir_all(format!("/home/{}", users[4])).unwrap();

    let listed = p.list_build_users(&target).await.unwrap();
    let age = |u: &str| {
        listed
            .iter()
            .find(|l| l.name == u)
            .unwrap_or_else(|| panic!("{u} not listed in {listed:?}"))
            .age
            .unwrap()
    };
    for u in &users[..3] {
        let a = age(u).as_secs();
        assert!((2 * DAY..2 * DAY + 60).contains(&a), "{u}: {a}");
    }
    assert!(age(&users[3]) < Duration::from_secs(60));
    assert!(age(&users[4]) < Duration::from_secs(DAY));

    // Which of them are removed is the scheduler's decision (`Event::HostUsersListed`).
    for u in &users {
        p.deprovision(&target, u).await.unwrap();
    }

    // Never deletes an account that is not a build user.
    let err = p.deprovision(&target, "root").await.unwrap_err();
    assert!(matches!(err, ProvisionError::InvalidRequest(_)));
}

#[tokio::test]
async fn users_the_go_controller_made_are_cleaned_up() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("switched");
    // The Go provision script's own naming and user creation, run on the host.
    let name = unique_name("go-made");
    let out = std::process::Command::new("bash")
        .args([
            "-c",
            r#"u=u-$(echo "$TASKRUN_NAME$NAMESPACE" | md5sum | cut -b-28) && useradd -m "$u" && echo "$u""#,
        ])
        .env("TASKRUN_NAME", &name)
        .env("NAMESPACE", "tenant-e2e")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let go_user = stdout(&out);
    host.track_user(&go_user);
    assert_eq!(go_user, user_of(&name));
    assert!(
        p.list_build_users(&target)
            .await
            .unwrap()
            .iter()
            .any(|u| u.name == go_user)
    );
    p.deprovision_taskrun(&target, &name, "tenant-e2e")
        .await
        .unwrap();
    assert!(!user_exists(&go_user));
    assert!(!Path::new(&format!("/home/{go_user}")).exists());
}

#[tokio::test]
async fn a_host_without_podman_is_refused_before_any_change() {
    let host = SshdHost::start_with(HostSetup::default().without("podman")).unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("no-podman");
    let (name, user) = new_user(&host, "nopodman");
    let err = p
        .provision(&target, &request(&name, &[]))
        .await
        .unwrap_err();
    match &err {
        ProvisionError::CommandFailed {
            exit_code,
            stderr_tail,
            ..
        } => {
            assert_eq!(*exit_code, Some(69));
            assert!(
                stderr_tail.contains("podman is not installed on this host")
                    && stderr_tail.contains("dnf install -y podman"),
                "{stderr_tail}"
            );
        }
        other => panic!("expected CommandFailed, got {other:?}"),
    }
    assert_eq!(err.blame(), Blame::Host, "another host may have it");
    assert!(!user_exists(&user), "nothing was created");

    // The same machine with podman: provisioned.
    let with = SshdHost::start().unwrap();
    with.track_user(&user);
    let t = with.target("with-podman");
    p.provision(&t, &request(&name, &[])).await.unwrap();
    p.deprovision(&t, &user).await.unwrap();
}

/// A stand-in for a host tool that appends its name and arguments to `log` and exits with `code`.
fn recording_tool(name: &str, log: &Path, code: i32) -> String {
    format!(
        "printf '%s\\n' \"{name} $*\" >> '{}'\nexit {code}\n",
        log.display()
    )
}

fn read_log(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn restorecon_relabels_ssh_only_on_selinux_hosts() {
    let logs = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    // (SELinux enabled?, restorecon exit code) -> expected calls, provisioning succeeds?
    for (i, (selinux, restorecon_exit, relabels, ok)) in [
        (Some(0), 0, true, true),
        (Some(1), 0, false, true),
        (None, 0, false, true),
        (Some(0), 1, true, false),
    ]
    .into_iter()
    .enumerate()
    {
        let log = logs.path().join(format!("{selinux:?}-{restorecon_exit}"));
        let mut setup = HostSetup::default().with_tool(
            "restorecon",
            &recording_tool("restorecon", &log, restorecon_exit),
        );
        setup = match selinux {
            Some(code) => setup.with_tool(
                "selinuxenabled",
                &recording_tool("selinuxenabled", &log, code),
            ),
            // This machine has no SELinux: without selinuxenabled, /sys/fs/selinux decides.
            None => setup.without("selinuxenabled"),
        };
        let host = SshdHost::start_with(setup).unwrap();
        let (name, user) = new_user(&host, "selinux");
        // One id per host: each has its own host key.
        let target = host.target(&format!("selinux-host-{i}"));
        let result = p.provision(&target, &request(&name, &[])).await;
        let calls: Vec<String> = read_log(&log)
            .into_iter()
            .filter(|l| l.starts_with("restorecon"))
            .collect();
        let case = format!("selinux {selinux:?}, restorecon exits {restorecon_exit}");
        if relabels {
            assert_eq!(
                calls,
                [format!("restorecon -FRv -- /home/{user}/.ssh")],
                "{case}"
            );
        } else {
            assert!(calls.is_empty(), "{case}: {calls:?}");
        }
        match result {
            Ok(got) if ok => {
                let out = host.ssh_as(&user, &got.private_key, "true").unwrap();
                assert!(out.status.success(), "{case}: {out:?}");
            }
            Err(ProvisionError::CommandFailed {
                exit_code: Some(75),
                stderr_tail,
                ..
            }) if !ok => assert!(stderr_tail.contains("restorecon -FRv"), "{stderr_tail}"),
            other => panic!("{case}: {other:?}"),
        }
        p.deprovision(&target, &user).await.unwrap();
    }
    // Without restorecon at all: nothing to run, provisioning works.
    let host = SshdHost::start_with(HostSetup::default().without("restorecon")).unwrap();
    let name = unique_name("no-restorecon");
    host.track_user(&user_of(&name));
    let target = host.target("plain-host");
    p.provision(&target, &request(&name, &[])).await.unwrap();
    p.deprovision(&target, &user_of(&name)).await.unwrap();
}

/// A `systemctl` that reports `state` and records `daemon-reload`s in `log`.
fn systemctl(state: &str, log: &Path) -> String {
    format!(
        "case $1 in\n  is-system-running) echo {state}; [ {state} = running ] ;;\n  \
         daemon-reload) echo daemon-reload >> '{}' ;;\n  *) exit 1 ;;\nesac\n",
        log.display()
    )
}

/// Every slice drop-in of `user` on this machine.
fn drop_ins(user: &str) -> Vec<PathBuf> {
    slice_drop_in_dirs()
        .into_iter()
        .map(|d| d.join(format!("50-mpc-{user}.conf")))
        .filter(|f| f.exists())
        .collect()
}

#[tokio::test]
async fn slice_caps_are_written_where_systemd_runs_and_removed_at_cleanup() {
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("systemctl");
    let host = SshdHost::start_with(
        HostSetup::default().with_tool("systemctl", &systemctl("running", &log)),
    )
    .unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("systemd-host");
    let capped = BuildUserSettings {
        memory_max: Some(MemoryMax::parse("8G").unwrap()),
        cpu_quota: Some(CpuQuota::parse("200%").unwrap()),
        ..BuildUserSettings::DEFAULT
    };
    let (name, user) = new_user(&host, "slice");
    let got = p
        .provision(&target, &with_settings(&name, &capped))
        .await
        .unwrap();
    let uid = stdout(
        &std::process::Command::new("id")
            .args(["-u", &user])
            .output()
            .unwrap(),
    );
    let file = PathBuf::from(format!(
        "/etc/systemd/system/user-{uid}.slice.d/50-mpc-{user}.conf"
    ));
    assert_eq!(drop_ins(&user), std::slice::from_ref(&file));
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.ends_with("\n[Slice]\nMemoryMax=8G\nCPUQuota=200%\n"),
        "{text}"
    );
    assert_eq!(read_log(&log), ["daemon-reload"]);
    let out = host.ssh_as(&user, &got.private_key, "id -un").unwrap();
    assert_eq!(stdout(&out), user, "{out:?}");

    // Re-provisioned without caps: the drop-in goes, systemd reloads.
    p.provision(&target, &request(&name, &[])).await.unwrap();
    assert!(drop_ins(&user).is_empty());
    assert_eq!(read_log(&log).len(), 2);
    p.provision(&target, &with_settings(&name, &capped))
        .await
        .unwrap();
    assert_eq!(drop_ins(&user).len(), 1);

    // Cleanup removes it with the user, and its directory.
    p.deprovision(&target, &user).await.unwrap();
    assert!(!user_exists(&user));
    assert!(drop_ins(&user).is_empty());
    assert!(!file.parent().unwrap().exists());
    assert_eq!(read_log(&log).len(), 4);
}

#[tokio::test]
async fn slice_caps_are_skipped_cleanly_without_systemd() {
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("systemctl");
    let capped = BuildUserSettings {
        memory_max: Some(MemoryMax::parse("75%").unwrap()),
        ..BuildUserSettings::DEFAULT
    };
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    // systemctl present but systemd not running (a container), and no systemctl at all.
    for (i, setup) in [
        HostSetup::default().with_tool("systemctl", &systemctl("offline", &log)),
        HostSetup::default().without("systemctl"),
    ]
    .into_iter()
    .enumerate()
    {
        let host = SshdHost::start_with(setup).unwrap();
        let target = host.target(&format!("no-systemd-{i}"));
        let (name, user) = new_user(&host, "noslice");
        let got = p
            .provision(&target, &with_settings(&name, &capped))
            .await
            .unwrap();
        assert!(drop_ins(&user).is_empty());
        let out = host.ssh_as(&user, &got.private_key, "id -un").unwrap();
        assert_eq!(stdout(&out), user, "{out:?}");
        p.deprovision(&target, &user).await.unwrap();
        assert!(!user_exists(&user));
    }
    assert!(read_log(&log).is_empty(), "no reload without systemd");
}

#[tokio::test]
async fn rsa_keys_for_fips_hosts_log_in() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("fips-host");
    let rsa = BuildUserSettings {
        key_type: KeyType::Rsa { bits: 3072 },
        ..BuildUserSettings::DEFAULT
    };
    let (name, user) = new_user(&host, "fips");
    let got = p
        .provision(&target, &with_settings(&name, &rsa))
        .await
        .unwrap();
    assert!(got.public_key.starts_with("ssh-rsa "), "{}", got.public_key);
    let out = host
        .ssh_as(&user, &got.private_key, "cat ~/.ssh/authorized_keys")
        .unwrap();
    assert!(out.status.success(), "{out:?}\n{}", host.log());
    assert_eq!(stdout(&out), got.public_key.trim());
    assert!(host.log().contains("RSA SHA256:"), "sshd saw an RSA key");
    p.deprovision(&target, &user).await.unwrap();
}

#[test]
fn admin_sessions_have_a_home_of_their_own() {
    let host = SshdHost::start().unwrap();
    let admin = String::from_utf8(host.admin_key().to_vec()).unwrap();
    let out = host.ssh_as("root", &admin, "echo $HOME").unwrap();
    let home = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(out.status.success(), "{out:?}");
    assert!(home.ends_with("/admin-home"), "{home}");
    assert_ne!(home, "/root");
}

/// Whatever of uid `uid` is still on this machine outside homes: processes, crontab, `at` jobs,
/// lingering, SysV IPC objects, files in the shared directories.
fn leftovers_of(user: &str, uid: &str, shared: &Path) -> Vec<String> {
    let mut found = Vec::new();
    // A zombie is dead already (its parent, init here, reaps it when it gets to it).
    let pgrep = std::process::Command::new("pgrep")
        .args(["-u", uid])
        .output()
        .unwrap();
    let live: Vec<String> = stdout(&pgrep)
        .lines()
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .map(str::to_owned)
        .collect();
    if !live.is_empty() {
        found.push(format!("processes {live:?}"));
    }
    for f in [
        format!("/var/spool/cron/crontabs/{user}"),
        format!("/var/lib/systemd/linger/{user}"),
    ] {
        if Path::new(&f).exists() {
            found.push(f);
        }
    }
    let dirs = [
        Path::new("/var/spool/cron/atjobs"),
        Path::new("/tmp"),
        Path::new("/var/tmp"),
        Path::new("/dev/shm"),
        shared,
    ];
    for d in dirs {
        let out = std::process::Command::new("find")
            .arg(d)
            .args(["-xdev", "-mindepth", "1", "-uid", uid])
            .output()
            .unwrap();
        found.extend(stdout(&out).lines().map(str::to_owned));
    }
    for (kind, cols) in [("shm", [7, 9]), ("msg", [7, 9]), ("sem", [4, 6])] {
        let table = std::fs::read_to_string(format!("/proc/sysvipc/{kind}")).unwrap();
        let n = table
            .lines()
            .skip(1)
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                cols.iter().any(|&c| f.get(c) == Some(&uid))
            })
            .count();
        if n > 0 {
            found.push(format!("{n} SysV {kind} object(s)"));
        }
    }
    found.sort();
    found.dedup();
    found
}

#[tokio::test]
async fn cleanup_removes_everything_a_build_user_leaves_behind() {
    require_tools(&["at", "crontab", "ipcmk", "pgrep", "find"]).unwrap();
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("static-1");
    let (name, user) = new_user(&host, "leftovers");
    let got = p.provision(&target, &request(&name, &[])).await.unwrap();
    let uid = stdout(
        &std::process::Command::new("id")
            .args(["-u", &user])
            .output()
            .unwrap(),
    );
    // A world-writable directory someone else owns (like /tmp/.X11-unix or a shared cache): a
    // file the build leaves inside it is not at the top of /tmp.
    let shared = tempfile::Builder::new()
        .prefix("mpc-shared-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(
        shared.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    let tag = unique_name("left");
    let script = format!(
        "nohup sleep 600 >/dev/null 2>&1 &
echo '* * * * * touch /tmp/{tag}-cron' | crontab - || exit 10
echo 'touch /tmp/{tag}-at' | at now + 1 hour 2>/dev/null || exit 11
mkdir -p /tmp/{tag}/deep && touch /tmp/{tag}/deep/file || exit 12
echo x > /dev/shm/{tag} && echo x > /var/tmp/{tag} && echo x > {shared}/{tag} || exit 13
ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 1 >/dev/null || exit 14",
        shared = shared.path().display()
    );
    let out = host.ssh_as(&user, &got.private_key, &script).unwrap();
    assert!(out.status.success(), "{out:?}");
    // Lingering, as `loginctl enable-linger` (which polkit lets users run for themselves) records
    // it; logind does not run here.
    std::fs::create_dir_all("/var/lib/systemd/linger").unwrap();
    std::fs::write(format!("/var/lib/systemd/linger/{user}"), "").unwrap();

    let before = leftovers_of(&user, &uid, shared.path());
    for want in [
        "processes".to_owned(),
        format!("/var/spool/cron/crontabs/{user}"),
        format!("/var/lib/systemd/linger/{user}"),
        "/var/spool/cron/atjobs/".to_owned(),
        format!("/tmp/{tag}/deep/file"),
        format!("/dev/shm/{tag}"),
        format!("/var/tmp/{tag}"),
        format!("{}/{tag}", shared.path().display()),
        "SysV shm".to_owned(),
        "SysV msg".to_owned(),
        "SysV sem".to_owned(),
    ] {
        assert!(
            before.iter().any(|f| f.contains(&want)),
            "the build left no {want}: {before:#?}"
        );
    }

    p.deprovision(&target, &user).await.unwrap();
    assert!(!user_exists(&user));
    let after = leftovers_of(&user, &uid, shared.path());
    assert!(after.is_empty(), "left behind by uid {uid}: {after:#?}");
}

fn uid_of(user: &str) -> u32 {
    let out = std::process::Command::new("id")
        .args(["-u", user])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    stdout(&out).parse().unwrap()
}

fn owner_of(path: &Path) -> u32 {
    std::os::unix::fs::MetadataExt::uid(&std::fs::symlink_metadata(path).unwrap())
}

/// Creates the file `path` owned by `uid`, with `mode` (as its owner would have made it).
fn plant(path: &Path, uid: u32, mode: u32) {
    std::fs::write(path, "x").unwrap();
    own(path, uid, mode);
}

/// Creates the directory `path` owned by `uid`, with `mode`.
fn plant_dir(path: &Path, uid: u32, mode: u32) {
    std::fs::create_dir(path).unwrap();
    own(path, uid, mode);
}

fn own(path: &Path, uid: u32, mode: u32) {
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    std::os::unix::fs::chown(path, Some(uid), None).unwrap();
}

/// A symlink at `link` to `to`, owned by `uid` (as its owner would have made it).
fn plant_link(to: &Path, link: &Path, uid: u32) {
    std::os::unix::fs::symlink(to, link).unwrap();
    std::os::unix::fs::lchown(link, Some(uid), None).unwrap();
}

/// A root-owned directory outside the swept ones, holding `target/precious`: what a tenant
/// would like root to delete for it (`/etc`, another tenant's home).
fn victim() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("mpc-victim-")
        .tempdir_in("/var/lib")
        .unwrap();
    std::fs::create_dir(dir.path().join("target")).unwrap();
    let precious = dir.path().join("target/precious");
    std::fs::write(&precious, "keep").unwrap();
    (dir, precious)
}

/// Two builds of one tenant on one host (two build users), each provisioned for real: the first
/// is cleaned up, the second plays the attacker. Returns their users and uids.
async fn two_build_users(
    host: &SshdHost,
    p: &Provisioner,
    target: &mpc::provision::Target,
) -> ((String, u32), (String, u32)) {
    let (name_a, a) = new_user(host, "swept");
    let (name_b, b) = new_user(host, "tenant");
    p.provision(target, &request(&name_a, &[])).await.unwrap();
    p.provision(target, &request(&name_b, &[])).await.unwrap();
    let (ua, ub) = (uid_of(&a), uid_of(&b));
    ((a, ua), (b, ub))
}

/// The cleanup runs as root over directories tenants write to. A tenant's second build (B) owns a
/// directory in /tmp in which the first (A) has entries; during A's cleanup B swaps its
/// directories for symlinks to a root-owned directory elsewhere and back (rename-exchange, as fast
/// as it can, for a bounded time). Before the fix `find ... -exec rm -rf {} +` handed rm paths
/// through B's directories, which rm resolved again, through the symlink: root deleted the victim.
/// Many of A's files keep the sweep busy while the swaps run. The test makes B's renames itself:
/// they happen in a directory B owns, so B may make them.
#[tokio::test]
async fn cleanup_never_deletes_through_a_directory_swapped_for_a_symlink_during_the_sweep() {
    use std::os::unix::ffi::OsStrExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    const SWAPPED: usize = 32;
    const BUSY_FILES: usize = 3000;
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("shared");
    let ((a, ua), (_b, ub)) = two_build_users(&host, &p, &target).await;
    let (_victim, precious) = victim();

    // B's own directory in /tmp; in it, B's world-writable directories each holding A's `target`
    // (the victim's name) with files, next to a symlink of B's to the victim's directory.
    let base = tempfile::Builder::new()
        .prefix("mpc-race-")
        .tempdir_in("/tmp")
        .unwrap();
    std::os::unix::fs::chown(base.path(), Some(ub), None).unwrap();
    let mut pairs = Vec::new();
    for i in 0..SWAPPED {
        let dir = base.path().join(format!("d{i}"));
        plant_dir(&dir, ub, 0o777);
        plant(&dir.join("b-file"), ub, 0o644);
        plant_dir(&dir.join("target"), ua, 0o755);
        for j in 0..20 {
            plant(&dir.join(format!("target/f{j}")), ua, 0o644);
        }
        let link = base.path().join(format!("d{i}.link"));
        plant_link(precious.parent().unwrap().parent().unwrap(), &link, ub);
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        pairs.push((c(&dir), c(&link)));
    }
    // A's files nobody swaps: many, so the sweep takes time while the swaps run.
    let busy = base.path().join("busy");
    plant_dir(&busy, ub, 0o777);
    plant(&busy.join("b-file"), ub, 0o644);
    let busy_files: Vec<PathBuf> = (0..BUSY_FILES)
        .map(|j| busy.join(format!("a{j}")))
        .collect();
    for f in &busy_files {
        plant(f, ua, 0o644);
    }

    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let swapper = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let exchange = |(x, y): &(std::ffi::CString, std::ffi::CString)| unsafe {
                libc::renameat2(
                    libc::AT_FDCWD,
                    x.as_ptr(),
                    libc::AT_FDCWD,
                    y.as_ptr(),
                    libc::RENAME_EXCHANGE,
                )
            };
            // Bounded: the cleanup retries a failed round, and must get one without swaps.
            let until = std::time::Instant::now() + Duration::from_millis(1500);
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < until {
                for pair in &pairs {
                    assert_eq!(exchange(pair), 0, "{}", std::io::Error::last_os_error());
                    swaps += 1;
                }
            }
            // Each directory back under its own name.
            for pair in &pairs {
                if std::fs::symlink_metadata(pair.0.to_str().unwrap())
                    .unwrap()
                    .file_type()
                    .is_symlink()
                {
                    assert_eq!(exchange(pair), 0);
                }
            }
            swaps
        }
    });
    let result = p.deprovision(&target, &a).await;
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    assert!(swaps > 1000, "only {swaps} swaps");

    assert!(
        precious.exists(),
        "root deleted {} through a swapped symlink",
        precious.parent().unwrap().display()
    );
    result.unwrap();
    assert!(!user_exists(&a));
    let left: Vec<&PathBuf> = busy_files.iter().filter(|f| f.exists()).collect();
    assert!(
        left.is_empty(),
        "{} of A's files left, e.g. {:?}",
        left.len(),
        left.first()
    );
    // B's own files stay. (A's files behind a directory that was a symlink when the sweep passed
    // may stay too: a tenant can always keep its files out of reach, e.g. in its own home.)
    assert!(busy.join("b-file").exists());
    for i in 0..SWAPPED {
        assert!(base.path().join(format!("d{i}/b-file")).exists());
    }
}

/// The same attack with everything in place before the cleanup starts: symlinks of either user
/// to a root-owned directory, A's directory holding B's entries, A's entries in B's directory.
/// Only A's own entries go; no symlink is followed; A's directory that holds B's entries stays,
/// handed to root (its uid is about to be reused).
#[tokio::test]
async fn cleanup_removes_only_the_users_own_entries_and_follows_no_symlink() {
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("shared");
    let ((a, ua), (_b, ub)) = two_build_users(&host, &p, &target).await;
    let (victim, precious) = victim();
    let base = tempfile::Builder::new()
        .prefix("mpc-planted-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(
        base.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    let at = |p: &str| base.path().join(p);
    plant_link(victim.path(), &at("a-link"), ua);
    plant_link(victim.path(), &at("b-link"), ub);
    plant_link(&precious, &at("a-file-link"), ua);
    // A's directory, open to others: B's file and B's directory (with A's file) inside it.
    plant_dir(&at("a-dir"), ua, 0o777);
    plant(&at("a-dir/a-file"), ua, 0o644);
    plant_dir(&at("a-dir/a-sub"), ua, 0o755);
    plant(&at("a-dir/a-sub/a-deep"), ua, 0o644);
    plant(&at("a-dir/b-file"), ub, 0o644);
    plant_dir(&at("a-dir/b-sub"), ub, 0o777);
    plant(&at("a-dir/b-sub/a-file"), ua, 0o644);
    plant(&at("a-dir/b-sub/b-file"), ub, 0o644);
    // B's directory with A's `target` (the victim's name) in it, and a symlink of B's in A's way.
    plant_dir(&at("b-dir"), ub, 0o777);
    plant_dir(&at("b-dir/target"), ua, 0o755);
    plant(&at("b-dir/target/a-file"), ua, 0o644);
    plant_link(victim.path(), &at("b-dir/target-link"), ub);

    p.deprovision(&target, &a).await.unwrap();
    assert!(!user_exists(&a));
    assert!(precious.exists());
    for gone in [
        "a-link",
        "a-file-link",
        "a-dir/a-file",
        "a-dir/a-sub",
        "a-dir/b-sub/a-file",
        "b-dir/target",
    ] {
        assert!(
            at(gone).symlink_metadata().is_err(),
            "{gone} is still there"
        );
    }
    for (kept, owner) in [
        ("b-link", ub),
        ("a-dir", 0),
        ("a-dir/b-file", ub),
        ("a-dir/b-sub", ub),
        ("a-dir/b-sub/b-file", ub),
        ("b-dir", ub),
        ("b-dir/target-link", ub),
    ] {
        assert!(at(kept).symlink_metadata().is_ok(), "{kept} was removed");
        assert_eq!(owner_of(&at(kept)), owner, "owner of {kept}");
    }
}

/// The first subordinate uid and gid of a user. `useradd` allocates them where `login.defs` says
/// so (SUB_UID_COUNT; Debian, RHEL, Fedora); where it did not, the test adds the lines itself (the
/// cleanup reads them either way), and removes them if the cleanup left them.
struct SubIds {
    user: String,
    uid: u32,
    gid: u32,
}

impl SubIds {
    fn of(user: &str, uid: u32) -> Self {
        let first = |file: &str| {
            std::fs::read_to_string(file)
                .unwrap_or_default()
                .lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split(':').collect();
                    (f.len() == 3 && f[0] == user).then(|| f[1].parse::<u32>().unwrap())
                })
        };
        // Far above what useradd hands out first, distinct per uid.
        let start = 500_000_000 + (uid % 1000) * 65_536;
        let ids = |file: &str| {
            first(file).unwrap_or_else(|| {
                append(file, &format!("{user}:{start}:65536\n"));
                start
            })
        };
        Self {
            user: user.to_owned(),
            uid: ids("/etc/subuid"),
            gid: ids("/etc/subgid"),
        }
    }
}

impl Drop for SubIds {
    fn drop(&mut self) {
        for file in ["/etc/subuid", "/etc/subgid"] {
            remove_lines(file, &format!("{}:", self.user));
        }
    }
}

// glibc's lock of the account files (`/etc/.pwd.lock`), which shadow's tools take first.
unsafe extern "C" {
    fn lckpwdf() -> libc::c_int;
    fn ulckpwdf() -> libc::c_int;
}

/// Runs `f` holding the locks shadow's tools take on `file`: `lckpwdf`, then `<file>.lock` holding
/// the holder's pid. useradd and userdel of concurrent tests rewrite the file.
fn locked<T>(file: &str, f: impl FnOnce() -> T) -> T {
    use std::io::Write;
    // SAFETY: no arguments; it waits for the lock (up to 15 s) and returns 0 once held.
    assert_eq!(unsafe { lckpwdf() }, 0, "lckpwdf");
    let lock = format!("{file}.lock");
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&lock)
        {
            Ok(mut l) => {
                write!(l, "{}", std::process::id()).unwrap();
                break;
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::AlreadyExists
                    && std::time::Instant::now() < until =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("locking {file}: {e}"),
        }
    }
    let out = f();
    std::fs::remove_file(&lock).unwrap();
    // SAFETY: releases the lock taken above.
    unsafe { ulckpwdf() };
    out
}

fn append(file: &str, line: &str) {
    use std::io::Write;
    locked(file, || {
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(file)
            .unwrap()
            .write_all(line.as_bytes())
            .unwrap()
    });
}

fn remove_lines(file: &str, prefix: &str) {
    locked(file, || {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        if text.lines().any(|l| l.starts_with(prefix)) {
            let kept: String = text
                .lines()
                .filter(|l| !l.starts_with(prefix))
                .map(|l| format!("{l}\n"))
                .collect();
            std::fs::write(file, kept).unwrap();
        }
    });
}

fn subid_lines(prefix: &str) -> Vec<String> {
    ["/etc/subuid", "/etc/subgid"]
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with(prefix))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A process group started by the test, killed whole when dropped (a failed test leaves nothing).
/// Once its leader is reaped ([`ended`]) the group's id may be reused: it is no longer killed.
struct Group(std::process::Child, bool);

impl Drop for Group {
    fn drop(&mut self) {
        if !self.1 {
            // SAFETY: kill(2) on the group this test created; no memory is involved.
            unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
            let _ = self.0.wait();
        }
    }
}

/// Starts `command` as root in a process group of its own.
fn spawn_group(command: &[&str]) -> Group {
    use std::os::unix::process::CommandExt as _;
    Group(
        std::process::Command::new(command[0])
            .args(&command[1..])
            .stdin(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap(),
        false,
    )
}

/// `setpriv` as `uid`/`gid` (no groups) running `command`, started by root: a rootless
/// container's process as the host sees it.
fn run_as(uid: u32, gid: u32, command: &[&str]) -> Group {
    let (u, g) = (format!("--reuid={uid}"), format!("--regid={gid}"));
    let mut argv = vec!["setpriv", &u, &g, "--clear-groups", "--"];
    argv.extend_from_slice(command);
    spawn_group(&argv)
}

/// Waits up to `limit` for the leader of `group` to end; its exit status, if it did.
fn ended(group: &mut Group, limit: Duration) -> Option<std::process::ExitStatus> {
    let until = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = group.0.try_wait().unwrap() {
            group.1 = true;
            return Some(status);
        }
        if std::time::Instant::now() > until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A rootless container's processes run as uids of the user's subordinate range, and its files
/// are owned by them; the next user gets the same range. Cleanup kills and removes them too,
/// from every range of the user (one a second line names by uid, which userdel does not remove:
/// the cleanup drops it itself).
#[tokio::test]
async fn cleanup_kills_and_removes_what_runs_as_the_users_subordinate_ids() {
    require_tools(&["setpriv"]).unwrap();
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let target = host.target("rootless");
    let (name, user) = new_user(&host, "rootless");
    p.provision(&target, &request(&name, &[])).await.unwrap();
    let uid = uid_of(&user);
    let sub = SubIds::of(&user, uid);
    // A second range, named by the uid.
    let second = 500_000_000 + (uid % 1000) * 65_536 + 32_768;
    for f in ["/etc/subuid", "/etc/subgid"] {
        append(f, &format!("{uid}:{second}:1000\n"));
    }
    let _second_lines = scopeguard(move || {
        for f in ["/etc/subuid", "/etc/subgid"] {
            remove_lines(f, &format!("{uid}:{second}:"));
        }
    });
    let mut in_range = run_as(sub.uid + 1000, sub.gid + 1000, &["sleep", "600"]);
    let mut in_second = run_as(second + 10, second + 10, &["sleep", "600"]);
    // Only the gid in the range (a container process whose uid maps outside it cannot exist,
    // but a set-group-id file of the range can give a process just the gid).
    let mut gid_only = run_as(65_534, sub.gid + 7, &["sleep", "600"]);
    let tmp = tempfile::Builder::new()
        .prefix("mpc-rootless-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    let files = [
        (tmp.path().join("container-file"), sub.uid + 1000),
        (tmp.path().join("second-range-file"), second + 999),
        (PathBuf::from(format!("/dev/shm/{user}-container")), sub.uid),
    ];
    for (f, owner) in &files {
        plant(f, *owner, 0o644);
    }
    let outsider = tmp.path().join("next-to-the-range");
    plant(&outsider, second + 40_000, 0o644);
    std::thread::sleep(Duration::from_millis(100));
    for c in [&mut in_range, &mut in_second, &mut gid_only] {
        assert!(c.0.try_wait().unwrap().is_none(), "setpriv failed");
    }

    p.deprovision(&target, &user).await.unwrap();
    assert!(!user_exists(&user));
    for (what, c) in [
        ("a subordinate uid's process", &mut in_range),
        ("a second range's process", &mut in_second),
        ("a subordinate gid's process", &mut gid_only),
    ] {
        let status = ended(c, Duration::from_secs(5));
        assert!(status.is_some(), "{what} survived the cleanup");
    }
    for (f, _) in &files {
        assert!(!f.exists(), "{} survived the cleanup", f.display());
    }
    assert!(outsider.exists(), "a uid outside the ranges lost its file");
    let left = subid_lines(&format!("{user}:"));
    let by_uid = subid_lines(&format!("{uid}:{second}:"));
    assert!(left.is_empty() && by_uid.is_empty(), "{left:?} {by_uid:?}");
    drop(sub);
}

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// Something in the range that keeps coming back (a supervisor outside it restarting a container
/// process) makes the cleanup fail, the account kept so its uid and range are not handed out;
/// once it stops, the cleanup succeeds.
#[tokio::test]
async fn cleanup_fails_while_a_subordinate_id_process_keeps_coming_back() {
    require_tools(&["setpriv"]).unwrap();
    let host = SshdHost::start().unwrap();
    let state = tempfile::tempdir().unwrap();
    // About a hundred rounds of scanning and killing before the cleanup gives up.
    let mut opts = SshOptions::new(state.path().join("ssh"));
    opts.command_timeout = Duration::from_secs(120);
    let p = Provisioner::new(opts).unwrap();
    let target = host.target("respawn");
    let (name, user) = new_user(&host, "respawn");
    p.provision(&target, &request(&name, &[])).await.unwrap();
    let sub = SubIds::of(&user, uid_of(&user));
    let ids = format!(
        "--reuid={} --regid={} --clear-groups",
        sub.uid + 3,
        sub.gid + 3
    );
    let supervisor = spawn_group(&[
        "sh",
        "-c",
        &format!("while :; do setpriv {ids} -- sleep 600; done"),
    ]);
    std::thread::sleep(Duration::from_millis(200));

    let err = p.deprovision(&target, &user).await.unwrap_err();
    match &err {
        ProvisionError::CommandFailed {
            exit_code: Some(75),
            stderr_tail,
            ..
        } => assert!(stderr_tail.contains("keep being started"), "{stderr_tail}"),
        other => panic!("expected the cleanup to fail, got {other:?}"),
    }
    assert!(
        user_exists(&user),
        "the account must stay while its range is in use"
    );

    // The supervisor alone (the last child it started stays): the cleanup now kills that and finishes.
    // SAFETY: kill(2) on the supervisor this test started.
    unsafe { libc::kill(supervisor.0.id() as i32, libc::SIGKILL) };
    p.deprovision(&target, &user).await.unwrap();
    assert!(!user_exists(&user));
    drop(supervisor);
}

/// Runs `command` as root on `host` over ssh.
fn as_root(host: &SshdHost, command: &str) -> std::process::Output {
    let key = String::from_utf8(host.admin_key().to_vec()).unwrap();
    host.ssh_as("root", &key, command).unwrap()
}

/// Two hosts that each have their own user database, as two machines do: a build user provisioned
/// on one is not on the other nor on this machine, and removing a user on one host does not touch
/// the other's user of the same uid (each copy of `/etc` hands out the same next uid).
async fn hosts_keep_their_own_users(own: OwnUsers) {
    let setup = || HostSetup {
        own_users: Some(own),
        ..HostSetup::default()
    };
    let (a, b) = (
        SshdHost::start_with(setup()).unwrap(),
        SshdHost::start_with(setup()).unwrap(),
    );
    let machine_passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let state = tempfile::tempdir().unwrap();
    let p = provisioner(&state);
    let (ta, tb) = (a.target("own-a"), b.target("own-b"));
    // Tracked in case the isolation fails and the users land on this machine.
    let (name_a, user_a) = new_user(&a, "own-a");
    let (name_b, user_b) = new_user(&b, "own-b");
    let _untrack = scopeguard_users(&[&user_a, &user_b]);

    let got_a = p.provision(&ta, &request(&name_a, &[])).await.unwrap();
    let got_b = p.provision(&tb, &request(&name_b, &[])).await.unwrap();

    // Each host's sessions see their own user only; this machine sees neither.
    let getent = |host: &SshdHost, user: &str| {
        as_root(host, &format!("getent passwd {user}"))
            .status
            .success()
    };
    assert!(
        getent(&a, &user_a) && !getent(&a, &user_b),
        "host A's users"
    );
    assert!(
        getent(&b, &user_b) && !getent(&b, &user_a),
        "host B's users"
    );
    assert!(!user_exists(&user_a) && !user_exists(&user_b));
    assert!(
        !std::fs::read_to_string("/etc/passwd")
            .unwrap()
            .contains("own-")
    );
    assert!(!machine_passwd.contains(&user_a));
    assert!(a.own_passwd().unwrap().contains(&user_a));
    assert!(!b.own_passwd().unwrap().contains(&user_a));
    let out = as_root(&a, "ls /home");
    assert_eq!(stdout(&out), user_a, "host A's /home");
    assert!(!Path::new(&format!("/home/{user_a}")).exists());

    // A process on B under the uid A's user has there (the copies usually hand out the same
    // next uid, but another test may add a machine user between the two copies): removing A's
    // user must not touch it.
    let uid_a = stdout(&as_root(&a, &format!("id -u {user_a}")));
    assert!(uid_a.parse::<u32>().is_ok(), "{uid_a:?}");
    let out = as_root(
        &b,
        &format!(
            "nohup setsid setpriv --reuid={uid_a} --regid={uid_a} --clear-groups sleep 300 >/dev/null 2>&1 &"
        ),
    );
    assert!(out.status.success(), "{out:?}");
    let out = b.ssh_as(&user_b, &got_b.private_key, "id -un").unwrap();
    assert_eq!(stdout(&out), user_b);
    let out = a.ssh_as(&user_a, &got_a.private_key, "id -un").unwrap();
    assert_eq!(stdout(&out), user_a);

    p.deprovision(&ta, &user_a).await.unwrap();
    assert!(!getent(&a, &user_a));
    // Live, not a zombie left unreaped.
    let sleeping = format!(
        "ps -o stat=,comm= -u {uid_a} | awk '$1 !~ /^Z/ && $2 == \"sleep\" {{ f = 1 }} END {{ exit !f }}'"
    );
    assert!(
        as_root(&b, &sleeping).status.success(),
        "removing host A's user killed host B's process of the same uid"
    );
    p.deprovision(&tb, &user_b).await.unwrap();
    assert!(!getent(&b, &user_b));
}

/// Deletes `users` from this machine at the end, should they have landed there.
fn scopeguard_users(users: &[&str]) -> impl Drop + use<> {
    struct Guard(Vec<String>);
    impl Drop for Guard {
        fn drop(&mut self) {
            for u in &self.0 {
                e2e::sshd::remove_user(u);
            }
        }
    }
    Guard(users.iter().map(|u| (*u).to_owned()).collect())
}

#[tokio::test]
async fn hosts_with_their_own_users_on_disk_do_not_share_them() {
    hosts_keep_their_own_users(OwnUsers::Disk).await;
}

#[tokio::test]
async fn hosts_with_their_own_users_in_memory_do_not_share_them() {
    hosts_keep_their_own_users(OwnUsers::Memory).await;
}
