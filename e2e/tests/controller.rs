//! The product end to end: the real `mpc controller` and `mpc otp-server` processes against the
//! test API server with the Tekton stand-in and loopback sshd build hosts.
//!
//! After each scenario: no host over its concurrency, no leaked users, secrets or finalizers.

use std::time::Duration;

use e2e::product::Product;
use e2e::sshd::user_exists;
use e2e::tekton::{Outcome, RunOptions};
use mpc::contract::{self, FINALIZER};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn finalizers(tr: &Value) -> Vec<String> {
    serde_json::from_value(tr["metadata"]["finalizers"].clone()).unwrap_or_default()
}

fn label<'a>(tr: &'a Value, key: &str) -> Option<&'a str> {
    tr["metadata"]["labels"][key].as_str()
}

/// Waits until the TaskRun's secret exists with `key`; returns its data.
async fn secret_with(
    p: &Product,
    ns: &str,
    name: &str,
    key: &str,
) -> std::collections::BTreeMap<String, String> {
    let what = format!("secret of {ns}/{name} with {key}");
    p.wait(T, &what, || async {
        p.secret(ns, name).await.filter(|s| s.contains_key(key))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_host_end_to_end_as_the_build_user_then_everything_is_gone() {
    let p = running(&[("h1", 1)]).await;
    p.create_taskrun("tenant-a", "build-1", "linux/arm64", json!({}))
        .await
        .unwrap();
    let user = contract::remote_user_name("build-1", "tenant-a");
    p.hosts[0].sshd.track_user(&user);

    let s = secret_with(&p, "tenant-a", "build-1", "otp").await;
    let address = p.hosts[0].sshd.address();
    assert_eq!(s["host"], format!("{user}@{address}"));
    assert_eq!(s["user-dir"], format!("/home/{user}"));
    assert!(s["otp-server"].ends_with("/otp"), "{s:?}");
    assert!(s["otp-ca"].contains("BEGIN CERTIFICATE"));
    let tr = p.taskrun("tenant-a", "build-1").await.unwrap();
    assert_eq!(label(&tr, contract::ASSIGNED_HOST_LABEL), Some("h1"));
    assert_eq!(label(&tr, contract::WAITING_FOR_PLATFORM_LABEL), None);
    assert!(finalizers(&tr).iter().any(|f| f == FINALIZER));
    assert!(user_exists(&user));

    let run = p
        .tekton
        .run_steps("tenant-a", "build-1", RunOptions::default())
        .await
        .unwrap();
    assert_eq!(
        run.exit_code,
        0,
        "{}\n{}\n{}",
        run.stdout,
        run.stderr,
        p.logs()
    );
    assert!(
        run.stdout.contains(&format!(
            "built-by={user} in=/home/{user} source=source of build-1"
        )),
        "{}",
        run.stdout
    );
    assert_eq!(run.outcome, Outcome::Succeeded);

    assert_clean(&p, &[("tenant-a", "build-1")]).await;
    // The token was redeemed once; it never works again.
    let again = p.otp_redeem(&s["otp"]).await;
    assert!(again.is_err(), "a redeemed token redeemed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_platform_gets_localhost_and_the_build_runs_in_the_pod() {
    let p = running(&[]).await;
    p.create_taskrun("tenant-a", "local-1", "linux/amd64", json!({}))
        .await
        .unwrap();
    let s = secret_with(&p, "tenant-a", "local-1", "host").await;
    assert_eq!(s["host"], "localhost");
    assert_eq!(s.len(), 1);
    let tr = p
        .wait(T, "assigned-host=localhost", || async {
            p.taskrun("tenant-a", "local-1")
                .await
                .filter(|t| label(t, contract::ASSIGNED_HOST_LABEL) == Some("localhost"))
        })
        .await;
    assert_eq!(
        label(&tr, contract::TARGET_PLATFORM_LABEL),
        Some("linux-amd64")
    );
    assert!(
        finalizers(&tr).is_empty(),
        "local TaskRuns get no finalizer"
    );
    let run = p
        .tekton
        .run_steps("tenant-a", "local-1", RunOptions::default())
        .await
        .unwrap();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("built-in-pod"));
    p.wait(T, "local secret deleted", || async {
        p.secret("tenant-a", "local-1")
            .await
            .is_none()
            .then_some(())
    })
    .await;
}

/// The product with one controller replica `c1`, ready.
async fn running(hosts: &[(&str, u32)]) -> Product {
    let mut p = Product::start(e2e::mpc_binary!(), hosts).await.unwrap();
    p.start_controller("c1").await.unwrap();
    p
}

/// Creates a `linux/arm64` TaskRun that mounts the secret; its build user is removed from the
/// machine when the first host stops, whatever the test's outcome.
async fn submit(p: &Product, ns: &str, name: &str) {
    p.create_taskrun(ns, name, "linux/arm64", json!({}))
        .await
        .unwrap();
    if let Some(h) = p.hosts.first() {
        h.sshd.track_user(&contract::remote_user_name(name, ns));
    }
}

/// Nothing left behind at the end of a scenario: [`released`] for `names`, and no entry in the
/// OTP store (every ended TaskRun's keys revoked, tombstones included).
async fn assert_clean(p: &Product, names: &[(&str, &str)]) {
    released(p, names).await;
    otp_store_empty(p).await;
}

/// No secret of ours, no finalizer of ours, no build user for `names`.
async fn released(p: &Product, names: &[(&str, &str)]) {
    for (ns, name) in names {
        p.cleaned_up(ns, name).await;
        let user = contract::remote_user_name(name, ns);
        p.wait(
            T,
            &format!("user {user} of {ns}/{name} removed"),
            || async { (!user_exists(&user)).then_some(()) },
        )
        .await;
    }
}

/// Every ended TaskRun's OTP entries were revoked (tombstones of redeemed keys included).
async fn otp_store_empty(p: &Product) {
    p.wait(T, "an empty OTP store", || async {
        (p.otp_entries().await == Some(0)).then_some(())
    })
    .await;
}

/// TaskRuns of `names` that hold a remote secret now.
async fn holding(p: &Product, names: &[(&str, &str)]) -> Vec<String> {
    let mut out = Vec::new();
    for (ns, name) in names {
        if p.secret(ns, name)
            .await
            .is_some_and(|s| s.contains_key("otp"))
        {
            out.push(format!("{ns}/{name}"));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slot_five_taskruns_two_namespaces_fair_order_each_served_on_release() {
    let p = running(&[("h1", 1)]).await;
    let all = [
        ("tenant-a", "a1"),
        ("tenant-a", "a2"),
        ("tenant-a", "a3"),
        ("tenant-b", "b1"),
        ("tenant-b", "b2"),
    ];
    for (ns, name) in all {
        p.hosts[0]
            .sshd
            .track_user(&contract::remote_user_name(name, ns));
        p.create_taskrun(ns, name, "linux/arm64", json!({}))
            .await
            .unwrap();
    }
    let mut order = Vec::new();
    for _ in 0..all.len() {
        let next = p
            .wait(T, "the next TaskRun to get the slot", || async {
                let h = holding(&p, &all).await;
                assert!(h.len() <= 1, "host over its concurrency: {h:?}");
                h.into_iter().find(|x| !order.contains(x))
            })
            .await;
        // Everyone else still waits, labelled so.
        for (ns, name) in all {
            let id = format!("{ns}/{name}");
            if id != next && !order.contains(&id) {
                let tr = p.taskrun(ns, name).await.unwrap();
                assert_eq!(
                    label(&tr, contract::WAITING_FOR_PLATFORM_LABEL),
                    Some("linux-arm64"),
                    "{id} waits"
                );
            }
        }
        let (ns, name) = next.split_once('/').unwrap();
        p.build(ns, name).await;
        order.push(next);
    }
    // FIFO per namespace, round-robin across namespaces.
    assert_eq!(
        order,
        [
            "tenant-a/a1",
            "tenant-a/a2",
            "tenant-b/b1",
            "tenant-a/a3",
            "tenant-b/b2"
        ],
        "{}",
        p.logs()
    );
    assert_clean(&p, &all).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_never_mounts_the_secret_is_released_without_a_host() {
    let p = running(&[("h1", 1)]).await;
    // A referenced Task (as show-sbom: takes PLATFORM, mounts nothing): the webhook cannot tell
    // at CREATE, the controller learns it from the resolved spec.
    p.api
        .create(json!({
            "apiVersion": "tekton.dev/v1", "kind": "Task",
            "metadata": {"name": "show-sbom", "namespace": "tenant-a"},
            "spec": {"params": [{"name": "PLATFORM", "type": "string"}],
                     "steps": [{"name": "show", "image": "x", "script": "echo sbom for $(params.PLATFORM)"}]}
        }))
        .await
        .unwrap();
    for name in ["sbom-1", "sbom-2"] {
        let tr = p
            .create_taskrun(
                "tenant-a",
                name,
                "linux/arm64",
                json!({"spec": {"taskSpec": null, "taskRef": {"name": "show-sbom"}}}),
            )
            .await
            .unwrap();
        assert!(
            finalizers(&tr).iter().any(|f| f == FINALIZER),
            "webhook marked it"
        );
        p.wait(T, "the finalizer released", || async {
            p.taskrun("tenant-a", name)
                .await
                .filter(|t| !finalizers(t).iter().any(|f| f == FINALIZER))
        })
        .await;
        let run = p
            .tekton
            .run_steps("tenant-a", name, RunOptions::default())
            .await
            .unwrap();
        assert_eq!(run.exit_code, 0, "{}", run.stderr);
        assert!(run.stdout.contains("sbom for linux/arm64"));
        assert!(p.secret("tenant-a", name).await.is_none());
        assert!(!user_exists(&contract::remote_user_name(name, "tenant-a")));
    }
    // The host was never taken: a mounting TaskRun gets it at once.
    submit(&p, "tenant-a", "build-1").await;
    secret_with(&p, "tenant-a", "build-1", "otp").await;
    p.build("tenant-a", "build-1").await;
    assert_clean(&p, &[("tenant-a", "build-1")]).await;
}

/// Freezes the first host (its provisioning then hangs in the SSH connection), creates the
/// TaskRun and waits until it is assigned there; returns its build user.
async fn stuck_provisioning(p: &Product, ns: &str, name: &str) -> String {
    let user = contract::remote_user_name(name, ns);
    p.hosts[0].sshd.track_user(&user);
    p.hosts[0].sshd.freeze();
    p.create_taskrun(ns, name, "linux/arm64", json!({}))
        .await
        .unwrap();
    p.wait(T, "assigned to h1 (provisioning under way)", || async {
        p.taskrun(ns, name)
            .await
            .filter(|t| label(t, contract::ASSIGNED_HOST_LABEL) == Some("h1"))
    })
    .await;
    user
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletion_mid_provision_removes_the_user_then_the_finalizer() {
    let p = running(&[("h1", 1)]).await;
    let user = stuck_provisioning(&p, "tenant-a", "doomed").await;
    p.delete_taskrun("tenant-a", "doomed").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tr = p.taskrun("tenant-a", "doomed").await.unwrap();
    assert!(
        finalizers(&tr).iter().any(|f| f == FINALIZER),
        "held while the user may exist"
    );
    p.hosts[0].sshd.thaw();
    p.wait(T, "the TaskRun gone", || async {
        p.taskrun("tenant-a", "doomed")
            .await
            .is_none()
            .then_some(())
    })
    .await;
    assert!(
        !user_exists(&user),
        "the user provisioned meanwhile was removed"
    );
    assert!(p.secret("tenant-a", "doomed").await.is_none());
    // The slot is free again.
    submit(&p, "tenant-a", "next").await;
    secret_with(&p, "tenant-a", "next", "otp").await;
    p.build("tenant-a", "next").await;
    assert_clean(&p, &[("tenant-a", "next")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_and_recreated_with_the_same_name_is_a_new_taskrun() {
    let p = running(&[("h1", 1)]).await;
    let user = contract::remote_user_name("same", "tenant-a");
    p.hosts[0].sshd.track_user(&user);
    let first = p
        .create_taskrun("tenant-a", "same", "linux/arm64", json!({}))
        .await
        .unwrap();
    let s1 = secret_with(&p, "tenant-a", "same", "otp").await;
    p.delete_taskrun("tenant-a", "same").await;
    p.wait(T, "the first TaskRun gone", || async {
        p.taskrun("tenant-a", "same").await.is_none().then_some(())
    })
    .await;
    let second = p
        .create_taskrun("tenant-a", "same", "linux/arm64", json!({}))
        .await
        .unwrap();
    assert_ne!(first["metadata"]["uid"], second["metadata"]["uid"]);
    let s2 = p
        .wait(T, "a fresh secret for the new TaskRun", || async {
            p.secret("tenant-a", "same")
                .await
                .filter(|s| s.get("otp").is_some_and(|o| *o != s1["otp"]))
        })
        .await;
    assert_ne!(s1["otp"], s2["otp"]);
    p.build("tenant-a", "same").await;
    assert_clean(&p, &[("tenant-a", "same")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_provision_then_restart_recovers_and_serves() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    let c1 = p.start_controller("c1").await.unwrap();
    stuck_provisioning(&p, "tenant-a", "survivor").await;
    p.controllers[c1].kill();
    p.hosts[0].sshd.thaw();
    // Another TaskRun arrives while no controller runs: it waits for the slot.
    submit(&p, "tenant-b", "later").await;
    p.start_controller("c1-restarted").await.unwrap();
    secret_with(&p, "tenant-a", "survivor", "otp").await;
    let names = [("tenant-a", "survivor"), ("tenant-b", "later")];
    assert_eq!(holding(&p, &names).await, ["tenant-a/survivor"]);
    p.build("tenant-a", "survivor").await;
    secret_with(&p, "tenant-b", "later", "otp").await;
    p.build("tenant-b", "later").await;
    assert_clean(&p, &names).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_one_lease_the_survivor_takes_over() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 2)])
        .await
        .unwrap();
    let a = p.start_controller("replica-a").await.unwrap();
    let b = p.start_controller("replica-b").await.unwrap();
    let leader = |text: &str| {
        text.lines()
            .any(|l| l == "multi_platform_controller_leader 1")
    };
    let (leading, other) = p
        .wait(T, "exactly one leader", || async {
            let (ma, mb) = (
                p.controllers[a].metrics().await,
                p.controllers[b].metrics().await,
            );
            match (leader(&ma), leader(&mb)) {
                (true, false) => Some((a, b)),
                (false, true) => Some((b, a)),
                _ => None,
            }
        })
        .await;
    submit(&p, "tenant-a", "one").await;
    secret_with(&p, "tenant-a", "one", "otp").await;
    // The leader dies without releasing; the other takes over within the Lease duration.
    p.controllers[leading].kill();
    let took_over = std::time::Instant::now();
    p.wait(T, "the survivor leads", || async {
        leader(&p.controllers[other].metrics().await).then_some(())
    })
    .await;
    assert!(took_over.elapsed() < Duration::from_secs(15));
    submit(&p, "tenant-b", "two").await;
    secret_with(&p, "tenant-b", "two", "otp").await;
    let names = [("tenant-a", "one"), ("tenant-b", "two")];
    p.build("tenant-a", "one").await;
    p.build("tenant-b", "two").await;
    assert_clean(&p, &names).await;
    // Graceful shutdown releases the Lease: a new replica leads at once.
    assert!(p.controllers[other].terminate(Duration::from_secs(20)));
    let c = p.start_controller("replica-c").await.unwrap();
    let released = std::time::Instant::now();
    p.wait(T, "the new replica leads", || async {
        leader(&p.controllers[c].metrics().await).then_some(())
    })
    .await;
    assert!(
        released.elapsed() < Duration::from_secs(3),
        "took {:?}: the Lease was not released",
        released.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_conflicts_errors_dropped_watches_compaction_and_a_restart() {
    use e2e::apiserver::faults::{RequestMatch, Verb};
    let p = running(&[("h1", 1)]).await;
    let names = [("tenant-a", "f1"), ("tenant-b", "f2"), ("tenant-a", "f3")];
    for (ns, name) in names {
        p.hosts[0]
            .sshd
            .track_user(&contract::remote_user_name(name, ns));
    }
    let faults = p.api.faults();
    faults.fail_next(RequestMatch::on(Verb::Patch, "taskruns"), 409, 3);
    faults.fail_next(RequestMatch::on(Verb::Create, "secrets"), 500, 3);
    p.create_taskrun("tenant-a", "f1", "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-a", "f1", "otp").await;
    p.create_taskrun("tenant-b", "f2", "linux/arm64", json!({}))
        .await
        .unwrap();
    p.api.drop_watches();
    p.build("tenant-a", "f1").await;
    secret_with(&p, "tenant-b", "f2", "otp").await;
    // Compacted history: the controller's watch resumes with 410 and relists.
    p.api.compact();
    p.api.drop_watches();
    p.create_taskrun("tenant-a", "f3", "linux/arm64", json!({}))
        .await
        .unwrap();
    faults.fail_next(RequestMatch::on(Verb::Patch, "taskruns"), 500, 2);
    p.build("tenant-b", "f2").await;
    secret_with(&p, "tenant-a", "f3", "otp").await;
    // The API server restarts (history compacted) while f3 builds.
    p.api.restart(true).await.unwrap();
    p.build("tenant-a", "f3").await;
    assert_clean(&p, &names).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learned_host_keys_survive_restarts_and_a_replaced_key_is_refused() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    let c1 = p.start_controller("c1").await.unwrap();
    submit(&p, "tenant-a", "k1").await;
    secret_with(&p, "tenant-a", "k1", "otp").await;
    p.build("tenant-a", "k1").await;
    assert_clean(&p, &[("tenant-a", "k1")]).await;
    let stored = p.known_hosts().await;
    assert!(
        stored.get("h1").is_some_and(|k| k.contains("ssh-ed25519")),
        "{stored:?}"
    );
    // The controller restarts with an empty state directory, and the host now presents another
    // key: the key learned before still decides.
    p.controllers[c1].kill();
    p.hosts[0].sshd.restart(true).unwrap();
    p.start_controller("c2").await.unwrap();
    p.create_taskrun("tenant-a", "k2", "linux/arm64", json!({}))
        .await
        .unwrap();
    let s = secret_with(&p, "tenant-a", "k2", "error").await;
    assert!(s["error"].contains("h1"), "{}", s["error"]);
    assert!(
        s["error"].to_lowercase().contains("host key"),
        "{}",
        s["error"]
    );
    assert!(!user_exists(&contract::remote_user_name("k2", "tenant-a")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_pod_that_mounted_the_used_token_redeems_the_fresh_key() {
    let p = running(&[("h1", 1)]).await;
    p.create_taskrun(
        "tenant-a",
        "flaky",
        "linux/arm64",
        json!({"spec": {"retries": 1}}),
    )
    .await
    .unwrap();
    p.hosts[0]
        .sshd
        .track_user(&contract::remote_user_name("flaky", "tenant-a"));
    let first = secret_with(&p, "tenant-a", "flaky", "otp").await;
    // The first attempt's pod redeems the key, then the attempt fails.
    p.otp_redeem(&first["otp"]).await.unwrap();
    p.tekton
        .finish(
            "tenant-a",
            "flaky",
            Outcome::Failed {
                message: "flaky build".into(),
            },
        )
        .await
        .unwrap();
    // Tekton starts the retry pod at once; the kubelet mounts the secret as it is now (the used
    // token), and the step redeems it before the controller has even seen the retry.
    let run = p
        .tekton
        .run_steps("tenant-a", "flaky", RunOptions::default())
        .await
        .unwrap();
    assert_eq!(
        run.exit_code,
        0,
        "{}\n{}\n{}",
        run.stdout,
        run.stderr,
        p.logs()
    );
    let tr = p.taskrun("tenant-a", "flaky").await.unwrap();
    assert_eq!(
        tr["status"]["retriesStatus"].as_array().map(Vec::len),
        Some(1)
    );
    // One secret for both attempts: the token was re-armed, never replaced.
    let s = p.secret("tenant-a", "flaky").await;
    assert!(
        s.is_none_or(|s| s.get("otp") == first.get("otp")),
        "the secret's token changed"
    );
    assert_clean(&p, &[("tenant-a", "flaky")]).await;
}

/// The product with a cloud platform `linux/arm64` on moto (`kind`: `dynamic` or `dynamic-pool`,
/// with `extra` keys), a real sshd answering at each of the first `instances` addresses moto
/// hands out in loopback subnet `127.0.<subnet>.0/24`, and one controller replica.
async fn on_moto(
    subnet: u8,
    kind: &str,
    extra: &[(&str, &str)],
    instances: u8,
    flags: &[&str],
) -> (Product, e2e::moto::Moto, Vec<e2e::sshd::SshdHost>) {
    use e2e::moto::Moto;
    let mut p = Product::start(e2e::mpc_binary!(), &[]).await.unwrap();
    let moto = Moto::start().await.unwrap();
    let fx = moto.loopback_subnet("us-east-1", subnet).await.unwrap();
    // The instances of one template share its admin key pair.
    let admin = e2e::sshd::AdminKey::generate().unwrap();
    let hosts: Vec<_> = (0..instances)
        .map(|i| {
            e2e::sshd::SshdHost::start_with(e2e::sshd::HostSetup {
                address: Some(std::net::Ipv4Addr::new(127, 0, subnet, 4 + i)),
                port: Some(22),
                admin_key: Some(admin.clone()),
                ..Default::default()
            })
            .unwrap()
        })
        .collect();
    let mut cfg = p.base_config();
    let cloud = p
        .moto_platform(&fx, "linux/arm64", &admin.private(), "e2e-arm64")
        .await
        .unwrap();
    for (k, v) in cloud {
        // The same template keys serve a dynamic platform and a pool.
        let k = if k == "dynamic-platforms" {
            format!("{kind}-platforms")
        } else {
            k
        };
        cfg.push((k, v));
    }
    for (k, v) in extra {
        cfg.push((format!("dynamic.linux-arm64.{k}"), (*v).to_owned()));
    }
    p.set_config(&cfg).await.unwrap();
    p.controller_flags = vec!["--ec2-endpoint".into(), moto.endpoint()];
    p.controller_flags
        .extend(flags.iter().map(|f| (*f).to_owned()));
    p.start_controller("c1").await.unwrap();
    (p, moto, hosts)
}

/// The EC2 state of instance `id`.
async fn instance_state(moto: &e2e::moto::Moto, id: &str) -> Option<String> {
    let d = moto
        .ec2("us-east-1")
        .describe_instances()
        .instance_ids(id)
        .send()
        .await
        .ok()?;
    Some(
        d.reservations()
            .first()?
            .instances()
            .first()?
            .state()?
            .name()?
            .as_str()
            .to_owned(),
    )
}

/// Waits until instance `id` is terminated (or shutting down).
async fn terminated(p: &Product, moto: &e2e::moto::Moto, id: &str) {
    p.wait(T, &format!("instance {id} terminated"), || async {
        let s = instance_state(moto, id).await?;
        (s == "terminated" || s == "shutting-down").then_some(())
    })
    .await;
}

/// The instance a TaskRun was given: its `assigned-host` label, as the Go controller writes for
/// dynamic platforms (which also carry the `cloud-instance-id` annotation) and pools.
async fn instance_of(p: &Product, ns: &str, name: &str) -> String {
    let tr = p.taskrun(ns, name).await.unwrap();
    let id = label(&tr, contract::ASSIGNED_HOST_LABEL)
        .expect("assigned-host")
        .to_owned();
    assert!(id.starts_with("i-"), "{id}");
    if let Some(a) = tr["metadata"]["annotations"][contract::CLOUD_INSTANCE_ID_ANNOTATION].as_str()
    {
        assert_eq!(a, id);
    }
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_platform_launches_probes_provisions_and_terminates() {
    let (p, moto, hosts) = on_moto(1, "dynamic", &[], 1, &[]).await;
    let user = contract::remote_user_name("dyn-1", "tenant-a");
    hosts[0].track_user(&user);

    p.create_taskrun("tenant-a", "dyn-1", "linux/arm64", json!({}))
        .await
        .unwrap();
    let s = p
        .wait(
            Duration::from_secs(120),
            "the instance's secret",
            || async {
                p.secret("tenant-a", "dyn-1")
                    .await
                    .filter(|s| s.contains_key("otp") || s.contains_key("error"))
            },
        )
        .await;
    assert!(s.contains_key("otp"), "{s:?}\n{}", p.logs());
    assert_eq!(s["host"], format!("{user}@127.0.1.4"));
    let id = instance_of(&p, "tenant-a", "dyn-1").await;
    let tr = p.taskrun("tenant-a", "dyn-1").await.unwrap();
    let annotated = &tr["metadata"]["annotations"][contract::CLOUD_INSTANCE_ID_ANNOTATION];
    assert_eq!(annotated.as_str(), Some(id.as_str()));
    let ec2 = moto.ec2("us-east-1");
    let tags = |d: aws_sdk_ec2::operation::describe_instances::DescribeInstancesOutput| {
        d.reservations()
            .iter()
            .flat_map(|r| r.instances())
            .flat_map(|i| i.tags())
            .map(|t| {
                (
                    t.key().unwrap_or("").to_owned(),
                    t.value().unwrap_or("").to_owned(),
                )
            })
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let t = tags(
        ec2.describe_instances()
            .instance_ids(&id)
            .send()
            .await
            .unwrap(),
    );
    assert_eq!(
        t.get("taskRunID").map(String::as_str),
        Some("tenant-a:dyn-1")
    );
    assert_eq!(
        t.get("multi-platform-instance").map(String::as_str),
        Some("e2e-arm64")
    );
    assert!(t.values().any(|v| v == "e2e-cluster"), "cluster tag: {t:?}");
    // The instance's host key, learned on first contact, is where every replica reads it.
    let stored = p.known_hosts().await;
    assert!(
        stored.get(&id).is_some_and(|k| k.contains("ssh-ed25519")),
        "{stored:?}"
    );

    p.build("tenant-a", "dyn-1").await;
    // The instance is terminated, not deprovisioned: its user goes with it.
    p.cleaned_up("tenant-a", "dyn-1").await;
    otp_store_empty(&p).await;
    terminated(&p, &moto, &id).await;
    // A terminated instance's key is dropped (its address may serve another instance later).
    p.wait(T, "the terminated instance's host key removed", || async {
        (!p.known_hosts().await.contains_key(&id)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_keys_are_read_at_use_time_and_a_missing_one_is_named() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    let key = p.hosts[0].sshd.admin_key();
    // The host's admin-key Secret is gone: the error names it.
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(p.client.clone(), e2e::product::NS);
    secrets
        .delete("h1-admin", &Default::default())
        .await
        .unwrap();
    p.start_controller("c1").await.unwrap();
    p.create_taskrun("tenant-a", "nokey", "linux/arm64", json!({}))
        .await
        .unwrap();
    let s = secret_with(&p, "tenant-a", "nokey", "error").await;
    assert!(
        s["error"].contains("multi-platform-controller/h1-admin"),
        "{}",
        s["error"]
    );
    // Created again, and then rotated to a wrong key and back: each takes effect without a
    // restart.
    p.put_secret(e2e::product::NS, "h1-admin", &[("id_rsa", b"not a key")])
        .await
        .unwrap();
    p.create_taskrun("tenant-a", "badkey", "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-a", "badkey", "error").await;
    p.put_secret(e2e::product::NS, "h1-admin", &[("id_rsa", key.as_slice())])
        .await
        .unwrap();
    submit(&p, "tenant-a", "goodkey").await;
    secret_with(&p, "tenant-a", "goodkey", "otp").await;
    p.build("tenant-a", "goodkey").await;
    assert_clean(&p, &[("tenant-a", "goodkey")]).await;
}

/// A missing admin-key Secret is the controller's problem, not the host's: failures for it do
/// not back the host off, so once the Secret is back the host serves at once (its back-off
/// would hold new work for a minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_admin_key_does_not_back_the_host_off() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    let key = p.hosts[0].sshd.admin_key();
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(p.client.clone(), e2e::product::NS);
    secrets
        .delete("h1-admin", &Default::default())
        .await
        .unwrap();
    p.start_controller("c1").await.unwrap();
    // As many failures in a row as trip a host's back-off.
    for n in 0..3 {
        let name = format!("nokey-{n}");
        p.create_taskrun("tenant-a", &name, "linux/arm64", json!({}))
            .await
            .unwrap();
        secret_with(&p, "tenant-a", &name, "error").await;
    }
    p.put_secret(e2e::product::NS, "h1-admin", &[("id_rsa", key.as_slice())])
        .await
        .unwrap();
    submit(&p, "tenant-a", "after").await;
    p.wait(
        Duration::from_secs(30),
        "tenant-a/after served at once by h1",
        || async {
            p.secret("tenant-a", "after")
                .await
                .filter(|s| s.contains_key("otp"))
        },
    )
    .await;
    p.build("tenant-a", "after").await;
    assert_clean(&p, &[("tenant-a", "after")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taskrun_the_go_controller_allocated_is_adopted_and_cleaned_up() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    // Before the switch: the Go controller allocated h1 to this TaskRun (its labels, finalizer,
    // annotation, user and secret), and no webhook of ours marked it.
    let tr = p
        .create_taskrun("tenant-a", "go-built", "linux/arm64", json!({}))
        .await
        .unwrap();
    let uid = tr["metadata"]["uid"].as_str().unwrap().to_owned();
    let user = contract::remote_user_name("go-built", "tenant-a");
    p.hosts[0].sshd.track_user(&user);
    let state = tempfile::tempdir().unwrap();
    let go =
        mpc::provision::Provisioner::new(mpc::provision::SshOptions::new(state.path())).unwrap();
    let settings = mpc::config::BuildUserSettings::DEFAULT;
    let made = go
        .provision(
            &p.hosts[0].sshd.target("h1"),
            &mpc::provision::ProvisionRequest {
                taskrun_name: "go-built",
                namespace: "tenant-a",
                sudo_commands: &[],
                settings: &settings,
            },
        )
        .await
        .unwrap();
    assert_eq!(made.user, user, "the Go controller's user name");
    let api: kube::Api<kube::api::DynamicObject> = kube::Api::namespaced_with(
        p.client.clone(),
        "tenant-a",
        &e2e::tekton::taskrun_resource(),
    );
    api.patch(
        "go-built",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"metadata": {
            "labels": {contract::TARGET_PLATFORM_LABEL: "linux-arm64", contract::ASSIGNED_HOST_LABEL: "h1"},
            "annotations": {contract::ALLOCATION_START_TIME_ANNOTATION: "1700000000"},
            "finalizers": [FINALIZER]
        }})),
    )
    .await
    .unwrap();
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(p.client.clone(), "tenant-a");
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": "multi-platform-ssh-go-built",
                     "labels": {contract::MULTI_PLATFORM_SECRET_LABEL: "true"},
                     "ownerReferences": [{"apiVersion": "tekton.dev/v1", "kind": "TaskRun",
                                          "name": "go-built", "uid": uid}]},
        "stringData": {"otp": "go-token", "otp-server": "https://go-otp/otp", "otp-ca": "",
                       "host": made.login, "user-dir": made.home}
    }))
    .unwrap();
    secrets.create(&Default::default(), &secret).await.unwrap();

    p.start_controller("c1").await.unwrap();
    // The adopted allocation holds h1's only slot: a new TaskRun waits.
    submit(&p, "tenant-b", "after").await;
    p.wait(
        T,
        "the new TaskRun queued behind the adopted one",
        || async {
            p.taskrun("tenant-b", "after")
                .await
                .filter(|t| label(t, contract::WAITING_FOR_PLATFORM_LABEL) == Some("linux-arm64"))
        },
    )
    .await;
    assert!(p.secret("tenant-b", "after").await.is_none());
    // The Go-era build ends: its user, secret and finalizer go, and the slot is handed over.
    p.tekton
        .finish("tenant-a", "go-built", Outcome::Succeeded)
        .await
        .unwrap();
    released(&p, &[("tenant-a", "go-built")]).await;
    secret_with(&p, "tenant-b", "after", "otp").await;
    p.build("tenant-b", "after").await;
    assert_clean(&p, &[("tenant-b", "after")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_user_sweep_removes_old_users_no_allocation_owns() {
    const DAY: u64 = 24 * 60 * 60;
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 2)])
        .await
        .unwrap();
    p.controller_flags = vec!["--host-user-sweep-interval".into(), "1s".into()];
    p.start_controller("c1").await.unwrap();
    // A live allocation whose user is old (a long build) is never swept.
    submit(&p, "tenant-a", "long").await;
    secret_with(&p, "tenant-a", "long", "otp").await;
    let live = contract::remote_user_name("long", "tenant-a");
    e2e::sshd::age_home(&live, 2 * DAY);
    // Leftovers nothing owns: an old one (a crash, or the Go controller's) and a young one (an
    // allocation whose result may still be on its way).
    let stale = contract::remote_user_name(&e2e::sshd::unique_name("crashed"), "tenant-a");
    let young = contract::remote_user_name(&e2e::sshd::unique_name("recent"), "tenant-a");
    for u in [&stale, &young] {
        p.hosts[0].sshd.track_user(u);
        let st = std::process::Command::new("useradd")
            .args(["-m", u])
            .status()
            .unwrap();
        assert!(st.success(), "useradd {u}");
    }
    e2e::sshd::age_home(&stale, 2 * DAY);
    p.wait(T, "the old leftover user removed", || async {
        (!user_exists(&stale)).then_some(())
    })
    .await;
    // Sweeps keep running every second: the owned and the young user stay.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(user_exists(&live), "{}", p.logs());
    assert!(user_exists(&young), "{}", p.logs());
    p.build("tenant-a", "long").await;
    assert_clean(&p, &[("tenant-a", "long")]).await;
    e2e::sshd::remove_user(&young);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_pool_reuses_an_instance_then_reaps_it_when_idle() {
    let pool = [("concurrency", "2"), ("max-age", "60")];
    // Long enough that the instance is still idle-kept when pool-3 arrives on a loaded machine.
    let (p, moto, hosts) =
        on_moto(2, "dynamic-pool", &pool, 2, &["--pool-idle-timeout", "12s"]).await;
    let names = [
        ("tenant-a", "pool-1"),
        ("tenant-b", "pool-2"),
        ("tenant-a", "pool-3"),
    ];
    for (ns, name) in names {
        for h in &hosts {
            h.track_user(&contract::remote_user_name(name, ns));
        }
    }
    // The first TaskRun launches an instance and is provisioned on it.
    p.create_taskrun("tenant-a", "pool-1", "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-a", "pool-1", "otp").await;
    let id = instance_of(&p, "tenant-a", "pool-1").await;
    // A second one shares it (concurrency 2): no second launch.
    p.create_taskrun("tenant-b", "pool-2", "linux/arm64", json!({}))
        .await
        .unwrap();
    let s2 = secret_with(&p, "tenant-b", "pool-2", "otp").await;
    assert_eq!(instance_of(&p, "tenant-b", "pool-2").await, id);
    let user2 = contract::remote_user_name("pool-2", "tenant-b");
    assert_eq!(s2["host"], format!("{user2}@127.0.2.4"));
    p.build("tenant-a", "pool-1").await;
    p.build("tenant-b", "pool-2").await;
    // Its users are removed, the instance stays for the next TaskRun, which reuses it.
    released(&p, &[("tenant-a", "pool-1"), ("tenant-b", "pool-2")]).await;
    assert_eq!(instance_state(&moto, &id).await.as_deref(), Some("running"));
    p.create_taskrun("tenant-a", "pool-3", "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-a", "pool-3", "otp").await;
    assert_eq!(instance_of(&p, "tenant-a", "pool-3").await, id);
    p.build("tenant-a", "pool-3").await;
    assert_clean(&p, &[("tenant-a", "pool-3")]).await;
    // Idle past the timeout: reaped. Only one instance was ever launched.
    terminated(&p, &moto, &id).await;
    let all = moto
        .ec2("us-east-1")
        .describe_instances()
        .send()
        .await
        .unwrap();
    let launched = all
        .reservations()
        .iter()
        .flat_map(|r| r.instances())
        .count();
    assert_eq!(launched, 1, "{}", p.logs());
}
