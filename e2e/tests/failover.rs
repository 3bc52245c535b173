//! Failover between two real `mpc controller` replicas (issue 24 §1, §2): one leader even when
//! the API server hangs for the leader, and nothing lost across a hand-over. And what a term's
//! end leaves behind on a build host: nothing (an SSH job dropped mid-script stops remotely).
//!
//! Each replica talks to the test API server as its own user, so the fault layer can slow one
//! replica down and the request log tells whose writes landed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::apiserver::audit::Request;
use e2e::apiserver::faults::{RequestMatch, Verb};
use e2e::product::Product;
use e2e::sshd::{HostSetup, SshdHost, unique_name, user_exists};
use e2e::tekton;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use mpc::config::BuildUserSettings;
use mpc::contract;
use mpc::provision::{ProvisionRequest, Provisioner, SshOptions};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);
/// `--lease-renew-deadline` of the product's replicas.
const RENEW_DEADLINE: Duration = Duration::from_secs(2);
/// The fault: the leader's requests answer only after this long.
const HANG: Duration = Duration::from_secs(60);

fn is_leader(metrics: &str) -> bool {
    metrics
        .lines()
        .any(|l| l == "multi_platform_controller_leader 1")
}

/// A webhook-only replica serving admission, then scheduling replicas `x` (the leader) and `y`;
/// returns their indexes once `x` leads and `y` follows.
async fn replicas(p: &mut Product) -> (usize, usize) {
    p.user_per_replica = true;
    p.controller_flags = vec!["--webhook-only".into()];
    p.start_controller("webhook").await.unwrap();
    p.controller_flags.clear();
    let x = p.start_controller("replica-x").await.unwrap();
    p.wait(T, "replica-x leads", || async {
        is_leader(&p.controllers[x].metrics().await).then_some(())
    })
    .await;
    let y = p.start_controller("replica-y").await.unwrap();
    (x, y)
}

/// Writes `user` made to TaskRuns and Secrets so far, per request.
fn writes_of(p: &Product, user: &str) -> BTreeMap<Request, u64> {
    p.api
        .requests()
        .of(user)
        .into_iter()
        .filter(|(r, _)| {
            matches!(
                r.verb,
                Verb::Create | Verb::Update | Verb::Patch | Verb::Delete
            ) && matches!(r.resource.as_str(), "taskruns" | "secrets")
        })
        .collect()
}

async fn secret_with(p: &Product, ns: &str, name: &str, key: &str) {
    let what = format!("secret of {ns}/{name} with {key}");
    p.wait(T, &what, || async {
        p.secret(ns, name)
            .await
            .filter(|s| s.contains_key(key))
            .map(|_| ())
    })
    .await;
}

/// Samples, until stopped, how many of `names` hold the one-slot host at once while not ended
/// (a remote secret or a build user, as the soak counts: the slot is handed over when a TaskRun
/// ends, while its user is still being removed); returns the most seen.
fn watch_holders(
    client: kube::Client,
    names: Vec<(String, String)>,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<usize>) {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let task = tokio::spawn(async move {
        let mut most = 0;
        while !s.load(Ordering::Relaxed) {
            let mut holding = 0;
            for (ns, name) in &names {
                let trs: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), ns, &tekton::taskrun_resource());
                let Ok(Some(tr)) = trs.get_opt(name).await else {
                    continue;
                };
                let tr = serde_json::to_value(tr).unwrap();
                if tekton::is_done(&tr) || tr["metadata"]["deletionTimestamp"].is_string() {
                    continue;
                }
                let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
                let remote = secrets
                    .get_opt(&contract::secret_name(name))
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|x| x.data.is_some_and(|d| d.contains_key("otp")));
                if remote || user_exists(&contract::remote_user_name(name, ns)) {
                    holding += 1;
                }
            }
            most = most.max(holding);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        most
    });
    (stop, task)
}

/// The leader's requests (`hung`) hang for a minute: it must step down within its renew
/// deadline, the other replica must take over, and from then on the old leader writes nothing
/// while a one-slot host serves one TaskRun at a time. TaskRun names start with `prefix`: build
/// users are the machine's, shared by tests that run at once.
async fn leader_hangs(prefix: &str, hung: impl Fn(&str) -> RequestMatch) {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    let (x, y) = replicas(&mut p).await;
    let (before, during_1, during_2) = (
        format!("{prefix}-before"),
        format!("{prefix}-during-1"),
        format!("{prefix}-during-2"),
    );
    let names = [
        ("tenant-a", before.as_str()),
        ("tenant-a", during_1.as_str()),
        ("tenant-b", during_2.as_str()),
    ];
    for (ns, n) in names {
        p.hosts[0]
            .sshd
            .track_user(&contract::remote_user_name(n, ns));
    }
    let owned = names.map(|(ns, n)| (ns.to_owned(), n.to_owned()));
    let (stop, most) = watch_holders(p.client.clone(), owned.to_vec());

    p.create_taskrun("tenant-a", &before, "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-a", &before, "otp").await;

    p.api.faults().add_latency(hung("replica-x"), HANG);
    let hung_at = Instant::now();
    p.wait(T, "replica-x steps down", || async {
        (!is_leader(&p.controllers[x].metrics().await)).then_some(())
    })
    .await;
    let stepped_down = hung_at.elapsed();
    // The deadline counts from the start of the last renewal round, at most one retry period
    // (300 ms) before the fault; a second of slack for the polling of the gauge.
    assert!(
        stepped_down < RENEW_DEADLINE + Duration::from_secs(1),
        "replica-x led for {stepped_down:?} after its Lease requests hung"
    );
    p.wait(T, "replica-y takes over", || async {
        is_leader(&p.controllers[y].metrics().await).then_some(())
    })
    .await;
    // Anything replica-x sent before it stepped down has arrived by now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let old_leader_writes = writes_of(&p, "replica-x");

    // While replica-x still hangs, work flows through replica-y alone.
    p.build("tenant-a", &before).await;
    p.cleaned_up("tenant-a", &before).await;
    p.create_taskrun("tenant-a", &during_1, "linux/arm64", json!({}))
        .await
        .unwrap();
    p.create_taskrun("tenant-b", &during_2, "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-a", &during_1, "otp").await;
    p.build("tenant-a", &during_1).await;
    secret_with(&p, "tenant-b", &during_2, "otp").await;
    p.build("tenant-b", &during_2).await;
    for (ns, name) in names {
        p.cleaned_up(ns, name).await;
    }

    stop.store(true, Ordering::Relaxed);
    let most = most.await.unwrap();
    assert!(most <= 1, "{most} TaskRuns held a one-slot host at once");
    let after = writes_of(&p, "replica-x");
    let late: Vec<_> = after
        .iter()
        .filter(|(r, n)| old_leader_writes.get(*r) != Some(*n))
        .collect();
    assert!(
        late.is_empty(),
        "replica-x wrote after stepping down: {late:#?}\n{}",
        p.logs()
    );
    let by_y = writes_of(&p, "replica-y");
    assert!(
        by_y.keys().any(|r| r.resource == "secrets"
            && r.name.as_deref() == Some(&contract::secret_name(&during_2))),
        "replica-y served {during_2}: {by_y:#?}"
    );
    p.api.faults().clear();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_lease_requests_hang_steps_down_in_time_and_writes_nothing_after() {
    leader_hangs("lease", |user| {
        RequestMatch {
            resource: Some("leases".into()),
            ..RequestMatch::any()
        }
        .by(user)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_every_request_hangs_steps_down_in_time_and_writes_nothing_after() {
    leader_hangs("all", |user| RequestMatch::any().by(user)).await;
}

fn gated(tr: &Value) -> bool {
    tr["spec"]["status"] == "TaskRunPending"
}

fn has_our_finalizer(tr: &Value) -> bool {
    tr["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == contract::FINALIZER))
}

/// TaskRuns that change while no replica leads (the leader died, the other has not taken the
/// Lease yet) get the un-gating and the finalizer they need once the other replica leads.
/// replica-y's Lease requests fail (500) until the changes are in, so it is still following
/// when it sees them however slow the machine is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_wanted_during_a_hand_over_are_done_by_the_next_leader() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    let mut cfg = p.base_config();
    cfg.push(("gate-pending".into(), "true".into()));
    p.set_config(&cfg).await.unwrap();
    let (x, y) = replicas(&mut p).await;
    // A Task that never mounts the secret, referenced by name: undecided at creation, released
    // once Tekton resolves it (a show-sbom-like Task).
    p.api
        .create_yaml(
            "apiVersion: tekton.dev/v1\nkind: Task\nmetadata:\n  name: show-sbom\n  namespace: tenant-a\nspec:\n  params:\n  - name: PLATFORM\n    type: string\n  steps:\n  - name: show\n    image: quay.io/konflux-ci/appstudio-utils:latest\n    script: echo sbom\n",
        )
        .await
        .unwrap();
    let user = contract::remote_user_name("hand-over", "tenant-b");
    p.hosts[0].sshd.track_user(&user);

    let lease_of_y = RequestMatch {
        resource: Some("leases".into()),
        ..RequestMatch::any()
    }
    .by("replica-y");
    p.api.faults().fail_next(lease_of_y, 500, usize::MAX);
    // The leader dies without releasing the Lease.
    p.controllers[x].kill();
    p.create_taskrun(
        "tenant-a",
        "sbom",
        "linux/arm64",
        json!({"spec": {"taskSpec": null, "taskRef": {"name": "show-sbom"}}}),
    )
    .await
    .unwrap();
    let created = p
        .create_taskrun("tenant-b", "hand-over", "linux/arm64", json!({}))
        .await
        .unwrap();
    assert!(gated(&created), "the webhook gates: {created:#}");
    assert!(has_our_finalizer(&created), "{created:#}");
    // As a TaskRun labelled by hand (or by an older webhook) would be: no finalizer.
    let uid = created["metadata"]["uid"].as_str().unwrap();
    let index = created["metadata"]["finalizers"]
        .as_array()
        .unwrap()
        .iter()
        .position(|f| f == contract::FINALIZER)
        .unwrap();
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "remove", "path": format!("/metadata/finalizers/{index}")},
    ]))
    .unwrap();
    let taskruns: Api<DynamicObject> =
        Api::namespaced_with(p.client.clone(), "tenant-b", &tekton::taskrun_resource());
    taskruns
        .patch(
            "hand-over",
            &PatchParams::default(),
            &Patch::<()>::Json(ops),
        )
        .await
        .unwrap();
    // replica-y has seen both while following (Tekton resolved the Task meanwhile).
    p.wait(T, "Tekton resolved sbom's Task", || async {
        p.taskrun("tenant-a", "sbom")
            .await
            .filter(|t| t["status"]["taskSpec"].is_object())
            .map(|_| ())
    })
    .await;
    // Its watch has delivered them by now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!is_leader(&p.controllers[y].metrics().await));
    p.api.faults().clear();

    p.wait(T, "replica-y takes over", || async {
        is_leader(&p.controllers[y].metrics().await).then_some(())
    })
    .await;
    p.wait(T, "sbom un-gated", || async {
        p.taskrun("tenant-a", "sbom")
            .await
            .filter(|t| !gated(t))
            .map(|_| ())
    })
    .await;
    p.wait(T, "hand-over finalized again", || async {
        p.taskrun("tenant-b", "hand-over")
            .await
            .filter(has_our_finalizer)
            .map(|_| ())
    })
    .await;
    secret_with(&p, "tenant-b", "hand-over", "otp").await;
    p.build("tenant-b", "hand-over").await;
    p.cleaned_up("tenant-b", "hand-over").await;
    p.wait(T, "user of hand-over removed", || async {
        (!user_exists(&user)).then_some(())
    })
    .await;
}

/// The scheduler forgets a TaskRun once it asked for its finalizer to go: a removal the API
/// refuses (403), fails (500) or does not answer in time is tried again until it lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_or_failing_finalizer_removal_is_retried_until_it_lands() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    p.user_per_replica = true;
    p.start_controller("c1").await.unwrap();
    let (ns, name) = ("tenant-a", "refused");
    p.hosts[0]
        .sshd
        .track_user(&contract::remote_user_name(name, ns));
    p.create_taskrun(ns, name, "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, ns, name, "otp").await;
    let faults = p.api.faults();
    // Once built, the controller's only patches of the TaskRun are finalizer removals.
    let removal = || {
        RequestMatch::on(Verb::Patch, "taskruns")
            .named(name)
            .by("c1")
    };
    faults.fail_next(removal(), 403, 2);
    faults.fail_next(removal(), 500, 2);
    p.build(ns, name).await;
    p.wait(T, "four removals refused or failed", || async {
        (faults.injected() >= 4).then_some(())
    })
    .await;
    // Then removals that time out (the replica's request timeout is its 2 s renew deadline).
    faults.add_latency(removal(), Duration::from_secs(30));
    tokio::time::sleep(Duration::from_secs(6)).await;
    faults.clear();
    p.cleaned_up(ns, name).await;
    assert!(
        p.controllers[0]
            .log_text()
            .contains("finalizer not removed; retrying"),
        "{}",
        p.logs()
    );
}

/// Whether process `pid` runs (a zombie does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let state = stat.rsplit_once(") ")?.1.chars().next()?;
            Some(state != 'Z')
        })
        .unwrap_or(false)
}

/// A provisioning whose job is dropped mid-script (its term ended, or it timed out) leaves no
/// process on the host: SSH alone lets a remote command run on when its client goes, and the
/// next leader would then provision or clean up beside the old leader's leftover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provisioning_dropped_mid_script_leaves_no_remote_process() {
    let logs = tempfile::tempdir().unwrap();
    let pid_file = logs.path().join("useradd.pid");
    // A `useradd` that hangs: the script is mid-way when the job is dropped.
    let useradd = format!("echo $$ > '{}'\nexec sleep 300\n", pid_file.display());
    let host = SshdHost::start_with(HostSetup::default().with_tool("useradd", &useradd)).unwrap();
    let state = tempfile::tempdir().unwrap();
    let provisioner =
        Arc::new(Provisioner::new(SshOptions::new(state.path().join("ssh"))).unwrap());
    let name = unique_name("dropped");
    host.track_user(&contract::remote_user_name(&name, "tenant-e2e"));
    let job = tokio::spawn({
        let (provisioner, target) = (provisioner.clone(), host.target("dropped-host"));
        async move {
            let settings = BuildUserSettings::DEFAULT;
            let request = ProvisionRequest {
                taskrun_name: &name,
                namespace: "tenant-e2e",
                sudo_commands: &[],
                settings: &settings,
            };
            provisioner.provision(&target, &request).await
        }
    });
    let started = Instant::now();
    let pid = loop {
        let pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        if let Some(pid) = pid {
            break pid;
        }
        assert!(started.elapsed() < T, "useradd never ran: {}", host.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(running(pid));
    job.abort();
    assert!(job.await.unwrap_err().is_cancelled());
    let dropped = Instant::now();
    while running(pid) && dropped.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !running(pid),
        "the remote useradd (pid {pid}) still runs 10 s after its job was dropped"
    );
    // SIGTERM goes out as soon as the channel closes; SIGKILL 2 s later for what ignores it.
    assert!(
        dropped.elapsed() < Duration::from_secs(3),
        "stopped {:?} after the drop",
        dropped.elapsed()
    );
}

/// Lease timings that cannot keep one leader at a time are refused before anything starts.
#[test]
fn the_controller_refuses_lease_timings_that_cannot_keep_one_leader() {
    for (flags, message) in [
        (
            &["--lease-duration=10s", "--lease-renew-deadline=10s"][..],
            "--lease-renew-deadline (10s) must be shorter than --lease-duration (10s)",
        ),
        (
            &["--lease-retry-period=9s"],
            "must be longer than 1.2 × --lease-retry-period (9s)",
        ),
    ] {
        let out = std::process::Command::new(e2e::mpc_binary!())
            .args(["controller", "--webhook-only"])
            .args(flags)
            .env_remove("KUBECONFIG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} started");
        assert!(stderr.contains(message), "{flags:?}: {stderr}");
    }
}
