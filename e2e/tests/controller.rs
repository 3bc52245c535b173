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

/// Waits until the TaskRun is cleaned up: no secret, no finalizer of ours.
async fn cleaned_up(p: &Product, ns: &str, name: &str) {
    let what = format!("cleanup of {ns}/{name}");
    p.wait(T, &what, || async {
        let tr = p.taskrun(ns, name).await;
        let gone = tr
            .as_ref()
            .is_none_or(|t| !finalizers(t).iter().any(|f| f == FINALIZER));
        (gone && p.secret(ns, name).await.is_none()).then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_host_end_to_end_as_the_build_user_then_everything_is_gone() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)]).await.unwrap();
    p.start_controller("c1").await.unwrap();
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
    assert_eq!(run.exit_code, 0, "{}\n{}\n{}", run.stdout, run.stderr, p.logs());
    assert!(
        run.stdout.contains(&format!(
            "built-by={user} in=/home/{user} source=source of build-1"
        )),
        "{}",
        run.stdout
    );
    assert_eq!(run.outcome, Outcome::Succeeded);

    cleaned_up(&p, "tenant-a", "build-1").await;
    p.wait(T, "the build user removed from the host", || async {
        (!user_exists(&user)).then_some(())
    })
    .await;
    // The token was redeemed once; it never works again.
    let again = p.otp_redeem(&s["otp"]).await;
    assert!(again.is_err(), "a redeemed token redeemed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_platform_gets_localhost_and_the_build_runs_in_the_pod() {
    let mut p = Product::start(e2e::mpc_binary!(), &[]).await.unwrap();
    p.start_controller("c1").await.unwrap();
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
    assert!(finalizers(&tr).is_empty(), "local TaskRuns get no finalizer");
    let run = p
        .tekton
        .run_steps("tenant-a", "local-1", RunOptions::default())
        .await
        .unwrap();
    assert_eq!(run.exit_code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("built-in-pod"));
    p.wait(T, "local secret deleted", || async {
        p.secret("tenant-a", "local-1").await.is_none().then_some(())
    })
    .await;
}
