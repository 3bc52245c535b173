//! A new leader's recovery cannot be held by one namespace (issue 31 §2), with the real
//! `mpc controller`, the test API server's fault layer and a real sshd: recovery learns whether
//! each live TaskRun's secret exists with a dry-run create, and a lookup the API refuses for good
//! (403: a namespace being deleted, a full Secret quota) or never answers leaves that secret
//! unknown instead of holding the term in recovery, where nothing is scheduled on any platform
//! and no finalizer is removed.

use std::time::{Duration, Instant};

use e2e::apiserver::faults::{RequestMatch, Verb};
use e2e::product::Product;
use e2e::sshd::user_exists;
use e2e::tekton::Outcome;
use mpc::contract;
use serde_json::json;

const T: Duration = Duration::from_secs(60);

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

/// Secret creates (dry runs included) in `ns`.
fn secret_creates_in(ns: &str) -> RequestMatch {
    RequestMatch::on(Verb::Create, "secrets").in_namespace(ns)
}

/// `tenant-a/<held>` is served on h1 and `tenant-b/finished` in its pod (a local platform); the
/// controller dies; `fault` is set on `tenant-a`; `finished` ends meanwhile; the controller comes
/// back and must lead a term that serves: `finished` cleaned up (secret deleted, finalizer
/// removed) and a new TaskRun of another platform in `tenant-b` served, each within a minute.
/// Returns the product and when the controller was started again. (`held` differs per test:
/// build users are the machine's, shared by tests that run at once.)
async fn restart_with_a_fault_in_tenant_a(
    held: &str,
    flags: &[&str],
    fault: impl FnOnce(&Product),
    held_in_a: &[&str],
) -> (Product, Instant) {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    p.controller_flags = flags.iter().map(|f| (*f).to_owned()).collect();
    p.start_controller("c1").await.unwrap();
    p.hosts[0]
        .sshd
        .track_user(&contract::remote_user_name(held, "tenant-a"));
    p.create_taskrun("tenant-a", held, "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-a", held, "otp").await;
    for name in held_in_a {
        p.create_taskrun("tenant-a", name, "linux/amd64", json!({}))
            .await
            .unwrap();
    }
    for name in held_in_a {
        secret_with(&p, "tenant-a", name, "host").await;
    }
    // With our finalizer from creation (the webhook adds none for a local platform), as a
    // TaskRun the Go controller labelled: its cleanup is the new term's to do.
    let finalized = json!({"metadata": {"finalizers": [contract::FINALIZER]}});
    p.create_taskrun("tenant-b", "finished", "linux/amd64", finalized)
        .await
        .unwrap();
    secret_with(&p, "tenant-b", "finished", "host").await;
    p.tekton
        .wait_for("tenant-b", "finished", T, |t| {
            t["status"]["podName"]
                .as_str()
                .is_some_and(|p| !p.is_empty())
        })
        .await
        .unwrap();

    p.controllers[0].kill();
    fault(&p);
    p.tekton
        .finish("tenant-b", "finished", Outcome::Succeeded)
        .await
        .unwrap();
    let restarted = Instant::now();
    p.controllers[0].restart().unwrap();
    p.wait_ready(0).await.unwrap();
    p.cleaned_up("tenant-b", "finished").await;
    p.create_taskrun("tenant-b", "next", "linux/amd64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-b", "next", "host").await;
    (p, restarted)
}

/// Every Secret create in `tenant-a` is refused (403) for good while the controller restarts:
/// the lookup of `held`'s secret ends at once as unknown, the new term serves `tenant-b`, and
/// `held` keeps its host as it was (its secret and build user untouched: its build may be
/// running).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_lookup_refused_for_good_does_not_hold_the_new_leader_in_recovery() {
    let (p, _) = restart_with_a_fault_in_tenant_a(
        "held",
        &[],
        |p| {
            p.api
                .faults()
                .fail_next(secret_creates_in("tenant-a"), 403, usize::MAX)
        },
        &[],
    )
    .await;
    let log = p.controllers[0].log_text();
    assert!(
        log.contains("could not learn whether the TaskRun's secret exists; taking it as unknown"),
        "{}",
        p.logs()
    );
    assert!(
        p.secret("tenant-a", "held")
            .await
            .is_some_and(|s| s.contains_key("otp")),
        "held's secret stands"
    );
    assert!(user_exists(&contract::remote_user_name("held", "tenant-a")));
    p.api.faults().clear();
    p.build("tenant-a", "held").await;
    p.cleaned_up("tenant-a", "held").await;
}

/// Lookups in `tenant-a` never answer (each request hangs past the client's timeout): 40
/// TaskRuns there would take minutes of attempts 16 at a time; at the recovery deadline (3 s)
/// the rest are unknown and the term serves `tenant-b` well within a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_lookups_that_never_answer_end_at_the_recovery_deadline() {
    let names: Vec<String> = (0..40).map(|i| format!("slow-{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let (p, restarted) = restart_with_a_fault_in_tenant_a(
        "held-too",
        &["--recovery-deadline=3s"],
        |p| {
            p.api
                .faults()
                .add_latency(secret_creates_in("tenant-a"), Duration::from_secs(600))
        },
        &names,
    )
    .await;
    let served = restarted.elapsed();
    assert!(
        served < Duration::from_secs(40),
        "the new term served tenant-b {served:?} after the restart\n{}",
        p.logs()
    );
    let log = p.controllers[0].log_text();
    assert!(
        log.contains("no answer about the TaskRun's secret by the recovery deadline"),
        "{}",
        p.logs()
    );
    p.api.faults().clear();
}
