//! `e2e try`, as a person uses it: the real command starts the product and prints a kubeconfig;
//! the usual kubectl commands, typed as in the README, create a namespace and a ConfigMap, apply
//! the example TaskRun, watch its Secret appear, describe it, see a second one wait (events), delete
//! the first; its Secret and build user go and the second gets the host; Ctrl-C cleans up the
//! second, stops everything, and the command exits cleanly.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use e2e::apiserver::testing::eventually;
use e2e::kubectl::Kubectl;
use tokio::io::{AsyncBufReadExt, BufReader};

const T: Duration = Duration::from_secs(60);

/// Reads lines until one starts with `prefix`; returns the rest of it.
async fn line_starting<R: tokio::io::AsyncBufRead + Unpin>(
    lines: &mut tokio::io::Lines<R>,
    prefix: &str,
    seen: &mut String,
) -> Option<String> {
    while let Some(l) = lines.next_line().await.ok()? {
        seen.push_str(&l);
        seen.push('\n');
        if let Some(rest) = l.strip_prefix(prefix) {
            return Some(rest.to_owned());
        }
    }
    None
}

/// If the test stops early: stops `e2e try` with SIGTERM (its own cleanup: a SIGKILL would leave
/// its controller, OTP server and sshd running), then removes the test's build users.
struct Guard {
    pid: Option<u32>,
    users: Vec<String>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(pid) = self.pid {
            let pid = pid.to_string();
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid])
                .status();
            // Gone, or a zombie this test has not reaped yet.
            for _ in 0..400 {
                let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|st| st.rsplit(") ").next().is_some_and(|r| !r.starts_with('Z')));
                if !alive {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        for u in &self.users {
            if e2e::sshd::user_exists(u) {
                e2e::sshd::remove_user(u);
            }
        }
    }
}

/// A `kubectl get -w` running in the background.
fn watch(k: &Kubectl, args: &[&str]) -> tokio::process::Child {
    k.command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl runs")
}

/// Reads the watch's lines until one satisfies `wanted`; returns its first line (the header of
/// a table). The watch ends with it.
async fn watched(
    mut w: tokio::process::Child,
    wanted: impl Fn(&str) -> bool,
    stderr: &dyn Fn() -> String,
) -> String {
    let mut lines = BufReader::new(w.stdout.take().expect("piped")).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(T, async {
        while let Ok(Some(l)) = lines.next_line().await {
            let hit = wanted(&l);
            seen.push(l);
            if hit {
                return true;
            }
        }
        false
    })
    .await;
    assert!(
        found == Ok(true),
        "the watch never showed it: {seen:#?}\n{}",
        stderr()
    );
    seen.swap_remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_starts_the_product_for_kubectl_as_typed_and_stops_on_ctrl_c() {
    let log = tempfile::NamedTempFile::new().unwrap();
    // Its own process group, as a terminal runs it: Ctrl-C goes to the whole group.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_e2e"))
        .process_group(0)
        .arg("try")
        .arg("--mpc")
        .arg(e2e::mpc_binary!())
        .stdout(Stdio::piped())
        .stderr(log.reopen().unwrap())
        .spawn()
        .expect("e2e try starts");
    let mut guard = Guard {
        pid: child.id(),
        users: ["demo", "demo2"]
            .map(|ns| mpc::contract::remote_user_name("try-build", ns))
            .to_vec(),
    };
    let stderr = || std::fs::read_to_string(log.path()).unwrap_or_default();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut printed = String::new();
    let kubeconfig = tokio::time::timeout(
        Duration::from_secs(120),
        line_starting(&mut lines, "kubeconfig: ", &mut printed),
    )
    .await
    .unwrap_or_else(|_| panic!("no kubeconfig line in 120 s:\n{printed}\n{}", stderr()))
    .unwrap_or_else(|| panic!("e2e try ended early:\n{printed}\n{}", stderr()));
    let example = line_starting(&mut lines, "example TaskRun: ", &mut printed)
        .await
        .expect("the example's path");
    assert!(
        line_starting(&mut lines, "ready", &mut printed)
            .await
            .is_some(),
        "{printed}"
    );
    // What it says to run names the same files.
    assert!(
        printed.contains(&format!("export KUBECONFIG={kubeconfig}")),
        "{printed}"
    );
    assert!(
        printed.contains(&format!("kubectl apply -n demo -f {example}")),
        "{printed}"
    );
    let example = PathBuf::from(example);
    assert!(example.is_file(), "{}", example.display());

    let k = Kubectl::new(std::path::Path::new(&kubeconfig));
    let out = k.ok(&["create", "namespace", "demo"]).await;
    assert_eq!(out.trim(), "namespace/demo created");
    let out = k
        .ok(&[
            "create",
            "configmap",
            "notes",
            "-n",
            "demo",
            "--from-literal=owner=me",
        ])
        .await;
    assert_eq!(out.trim(), "configmap/notes created");

    // Watches started before the TaskRun: the README's on TaskRuns, with the host as a column,
    // and one on Secrets.
    let label = mpc::contract::ASSIGNED_HOST_LABEL;
    let taskruns = watch(&k, &["get", "taskruns", "-n", "demo", "-w", "-L", label]);
    let secrets = watch(&k, &["get", "secrets", "-n", "demo", "-w", "-o", "name"]);
    let ex = example.to_str().unwrap();
    let out = k.ok(&["apply", "-n", "demo", "-f", ex]).await;
    assert_eq!(out.trim(), "taskrun.tekton.dev/try-build created");
    let secret = "multi-platform-ssh-try-build";
    watched(secrets, |l| l.trim() == format!("secret/{secret}"), &stderr).await;
    let header = watched(
        taskruns,
        |l| l.contains("try-build") && l.trim_end().ends_with(" host-1"),
        &stderr,
    )
    .await;
    assert!(
        header.starts_with("NAME") && header.contains("ASSIGNED-HOST"),
        "{header}"
    );
    let yaml = k
        .ok(&["get", "secret", "-n", "demo", secret, "-o", "yaml"])
        .await;
    assert!(
        yaml.contains("otp-server:") && yaml.contains("kind: Secret"),
        "{yaml}"
    );

    // The secret carries a host and a token; the TaskRun names its host.
    let data = k.json(&["get", "secret", secret, "-n", "demo"]).await;
    for key in ["host", "otp", "otp-server", "otp-ca", "user-dir"] {
        assert!(data["data"][key].is_string(), "{key}: {data}");
    }
    let host = eventually(T, "the TaskRun labelled with its host", || async {
        let tr = k.json(&["get", "taskrun", "try-build", "-n", "demo"]).await;
        tr["metadata"]["labels"][mpc::contract::ASSIGNED_HOST_LABEL]
            .as_str()
            .map(str::to_owned)
    })
    .await;
    assert_eq!(host, "host-1");
    let described = k
        .ok(&["describe", "taskrun", "try-build", "-n", "demo"])
        .await;
    assert!(described.contains("try-build"), "{described}");
    assert!(
        described.contains(&format!("{}=host-1", mpc::contract::ASSIGNED_HOST_LABEL)),
        "{described}"
    );
    // The same TaskRun in another namespace waits for the only host: an Event says so, which
    // `kubectl events` and `describe` show.
    assert_eq!(
        k.ok(&["create", "namespace", "demo2"]).await.trim(),
        "namespace/demo2 created"
    );
    let out = k.ok(&["apply", "-n", "demo2", "-f", ex]).await;
    assert_eq!(out.trim(), "taskrun.tekton.dev/try-build created");
    let events = eventually(T, "the WaitingForHost event", || async {
        let e = k.ok(&["events", "-n", "demo2"]).await;
        e.contains("WaitingForHost").then_some(e)
    })
    .await;
    assert!(
        events.contains("TaskRun/try-build") || events.contains("taskrun/try-build"),
        "{events}"
    );
    let described = k
        .ok(&["describe", "taskrun", "try-build", "-n", "demo2"])
        .await;
    assert!(described.contains("WaitingForHost"), "{described}");

    // Deleting waits for the controller's cleanup (its finalizer); the Secret goes, and the host
    // passes to the waiting TaskRun.
    let out = k
        .ok(&[
            "delete",
            "taskrun",
            "try-build",
            "-n",
            "demo",
            "--timeout=60s",
        ])
        .await;
    assert_eq!(out.trim(), "taskrun.tekton.dev \"try-build\" deleted");
    eventually(T, "the secret deleted", || async {
        let o = k.run(&["get", "secret", secret, "-n", "demo"], None).await;
        (!o.ok && o.stderr.contains("NotFound")).then_some(())
    })
    .await;
    let first_user = mpc::contract::remote_user_name("try-build", "demo");
    eventually(T, "the first build user removed", || async {
        (!e2e::sshd::user_exists(&first_user)).then_some(())
    })
    .await;
    eventually(T, "the waiting TaskRun's secret", || async {
        k.run(&["get", "secret", secret, "-n", "demo2"], None)
            .await
            .ok
            .then_some(())
    })
    .await;
    let waiting_user = mpc::contract::remote_user_name("try-build", "demo2");
    assert!(e2e::sshd::user_exists(&waiting_user));

    // Ctrl-C in its terminal (SIGINT to its process group): the product stops in order, and the
    // command exits cleanly.
    let group = format!("-{}", child.id().expect("running"));
    assert!(
        std::process::Command::new("kill")
            .args(["-INT", "--", &group])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("e2e try exits within 30 s of Ctrl-C")
        .unwrap();
    guard.pid = None;
    assert!(status.success(), "{status}\n{}", stderr());
    // Stopping deleted the TaskRun still holding the host, so its build user is gone too.
    assert!(
        !e2e::sshd::user_exists(&waiting_user),
        "{waiting_user} left on the machine\n{}",
        stderr()
    );
    assert!(
        !std::path::Path::new(&kubeconfig).exists(),
        "the kubeconfig is removed with the rest"
    );
}
