//! Writes that fail must not strand a TaskRun or its host (issue 24 §2), with the real
//! `mpc controller`, the test API server's fault layer and a real sshd:
//! - a TaskRun released on a remembered answer about its Task (no secret mounted) whose resolved
//!   Task mounts the secret after all is served, and its finalizer removed when it goes;
//! - a secret the API server keeps refusing (a used-up Secret quota: 403) frees the host for the
//!   next TaskRun after a few tries, and the user reads why in the TaskRun's Events;
//! - finalizer removals refused for good (issue 31 §7), more of them than the executor runs jobs
//!   at once, do not stall the other TaskRuns' writes, and land once the refusal ends.

use std::time::Duration;

use e2e::apiserver::faults::{RequestMatch, Verb};
use e2e::product::Product;
use e2e::sshd::user_exists;
use e2e::tekton;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Secret};
use kube::api::{Api, DynamicObject, ListParams};
use mpc::contract;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn has_our_finalizer(tr: &Value) -> bool {
    tr["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == contract::FINALIZER))
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

/// Task `tenant-a/flips`, whose pod mounts the TaskRun's secret or not.
fn task_yaml(mounts: bool) -> String {
    let (volume, mount) = if mounts {
        (
            "  volumes:\n  - name: ssh\n    secret:\n      secretName: multi-platform-ssh-$(context.taskRun.name)\n",
            "    volumeMounts:\n    - name: ssh\n      mountPath: /ssh\n      readOnly: true\n",
        )
    } else {
        ("", "")
    };
    format!(
        "apiVersion: tekton.dev/v1\nkind: Task\nmetadata:\n  name: flips\n  namespace: tenant-a\nspec:\n  params:\n  - name: PLATFORM\n    type: string\n{volume}  steps:\n  - name: build\n    image: quay.io/konflux-ci/buildah-task:latest\n    script: \"true\"\n{mount}"
    )
}

/// `Reason: note` of the Events about a TaskRun.
async fn events_of(p: &Product, ns: &str, name: &str) -> Vec<String> {
    let events: Api<CoreEvent> = Api::namespaced(p.client.clone(), ns);
    let selector = format!("involvedObject.name={name}");
    events
        .list(&ListParams::default().fields(&selector))
        .await
        .map(|l| {
            l.items
                .into_iter()
                .map(|e| {
                    format!(
                        "{}: {}",
                        e.reason.unwrap_or_default(),
                        e.message.unwrap_or_default()
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The controller learns that Task `flips` mounts no secret; the Task then changes to mount it.
/// The next TaskRun of it is decided on the remembered answer before Tekton resolves it (its
/// status write is slowed down), so it is released: finalizer removed. Once resolved it needs a
/// host after all: it gets its finalizer back, is served, and its finalizer goes when deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taskrun_released_on_a_remembered_answer_that_flips_is_served_and_finalized() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    p.start_controller("c1").await.unwrap();
    let ns = "tenant-a";
    p.api.create_yaml(&task_yaml(false)).await.unwrap();
    let by_ref = json!({"spec": {"taskSpec": null, "taskRef": {"name": "flips"}}});
    p.create_taskrun(ns, "teach", "linux/arm64", by_ref.clone())
        .await
        .unwrap();
    p.wait(T, "teach resolved", || async {
        p.taskrun(ns, "teach")
            .await
            .filter(|t| t["status"]["taskSpec"].is_object())
            .map(|_| ())
    })
    .await;
    p.cleaned_up(ns, "teach").await;

    let tasks: Api<DynamicObject> =
        Api::namespaced_with(p.client.clone(), ns, &tekton::task_resource());
    tasks.delete("flips", &Default::default()).await.unwrap();
    p.api.create_yaml(&task_yaml(true)).await.unwrap();
    let user = contract::remote_user_name("flipped", ns);
    p.hosts[0].sshd.track_user(&user);
    let resolution = RequestMatch::on(Verb::Update, "taskruns/status")
        .in_namespace(ns)
        .named("flipped");
    p.api
        .faults()
        .add_latency(resolution, Duration::from_secs(8));
    let created = p
        .create_taskrun(ns, "flipped", "linux/arm64", by_ref)
        .await
        .unwrap();
    assert!(has_our_finalizer(&created), "{created:#}");
    p.wait(T, "flipped released on the remembered answer", || async {
        p.taskrun(ns, "flipped")
            .await
            .filter(|t| !has_our_finalizer(t) && t["status"]["taskSpec"].is_null())
            .map(|_| ())
    })
    .await;
    p.api.faults().clear();
    p.wait(T, "flipped resolved", || async {
        p.taskrun(ns, "flipped")
            .await
            .filter(|t| t["status"]["taskSpec"].is_object())
            .map(|_| ())
    })
    .await;
    secret_with(&p, ns, "flipped", "otp").await;
    p.wait(T, "flipped finalized again", || async {
        p.taskrun(ns, "flipped")
            .await
            .filter(has_our_finalizer)
            .map(|_| ())
    })
    .await;
    assert!(user_exists(&user), "served on h1");
    p.delete_taskrun(ns, "flipped").await;
    p.wait(T, "flipped deleted", || async {
        p.taskrun(ns, "flipped").await.is_none().then_some(())
    })
    .await;
    p.cleaned_up(ns, "flipped").await;
    p.wait(T, "flipped's user removed", || async {
        (!user_exists(&user)).then_some(())
    })
    .await;
}

/// Every Secret create in `tenant-a` is refused (403), as a used-up ResourceQuota refuses it.
/// The TaskRun there holds the only slot of h1 for a few tries, then the slot goes to the
/// TaskRun waiting in `tenant-b`; the refused one's user is removed and its Events say why
/// (its error secret is refused too). Deleted, it leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_secret_frees_the_host_for_the_next_taskrun_and_tells_the_user() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    p.start_controller("c1").await.unwrap();
    let (refused, next) = (("tenant-a", "over-quota"), ("tenant-b", "next"));
    for (ns, n) in [refused, next] {
        p.hosts[0]
            .sshd
            .track_user(&contract::remote_user_name(n, ns));
    }
    let quota = RequestMatch::on(Verb::Create, "secrets").in_namespace(refused.0);
    p.api.faults().fail_next(quota, 403, usize::MAX);
    p.create_taskrun(refused.0, refused.1, "linux/arm64", json!({}))
        .await
        .unwrap();
    let refused_user = contract::remote_user_name(refused.1, refused.0);
    p.wait(T, "over-quota provisioned on h1", || async {
        user_exists(&refused_user).then_some(())
    })
    .await;
    p.create_taskrun(next.0, next.1, "linux/arm64", json!({}))
        .await
        .unwrap();
    secret_with(&p, next.0, next.1, "otp").await;
    assert!(p.secret(refused.0, refused.1).await.is_none());
    p.wait(T, "over-quota's user removed", || async {
        (!user_exists(&refused_user)).then_some(())
    })
    .await;
    // Events of one reason make one series: one object per reason.
    let events = p
        .wait(T, "over-quota's AllocationFailed Event", || async {
            let e = events_of(&p, refused.0, refused.1).await;
            e.iter()
                .any(|e| e.starts_with("AllocationFailed:"))
                .then_some(e)
        })
        .await;
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("AllocationFailed:") && e.contains("refused")),
        "{events:#?}"
    );
    assert!(
        events.iter().any(|e| e.starts_with("SecretRefused:")),
        "{events:#?}"
    );

    p.api.faults().clear();
    p.build(next.0, next.1).await;
    p.cleaned_up(next.0, next.1).await;
    p.delete_taskrun(refused.0, refused.1).await;
    p.wait(T, "over-quota deleted", || async {
        p.taskrun(refused.0, refused.1)
            .await
            .is_none()
            .then_some(())
    })
    .await;
}

/// How many TaskRun secrets in `ns` hold `key`.
async fn secrets_in(p: &Product, ns: &str, key: &str) -> usize {
    let api: Api<Secret> = Api::namespaced(p.client.clone(), ns);
    api.list(&ListParams::default())
        .await
        .map(|l| {
            l.items
                .iter()
                .filter(|s| {
                    s.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("multi-platform-ssh-"))
                        && s.data.as_ref().is_some_and(|d| d.contains_key(key))
                })
                .count()
        })
        .unwrap_or(0)
}

/// Every finalizer removal of the controller in `tenant-a` is refused (403) for more TaskRuns
/// than the executor runs jobs at once: each refused removal waits for its next attempt without
/// holding a job's place, so a TaskRun in `tenant-b` is still served; once the refusal ends
/// every removal lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalizer_removals_refused_for_good_do_not_stall_other_writes() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    p.user_per_replica = true;
    p.start_controller("c1").await.unwrap();
    let n = mpc::controller::lanes::JOBS_IN_FLIGHT + 8;
    let names: Vec<String> = (0..n).map(|i| format!("stuck-{i}")).collect();
    // Served in their pods (a local platform: cheap), with our finalizer, which the controller
    // removes when they end (the webhook adds none for a local platform: it is there from
    // creation, as on a TaskRun labelled by the Go controller).
    let finalized = json!({"metadata": {"finalizers": [contract::FINALIZER]}});
    for name in &names {
        p.create_taskrun("tenant-a", name, "linux/amd64", finalized.clone())
            .await
            .unwrap();
    }
    p.wait(T, "every stuck TaskRun served", || async {
        (secrets_in(&p, "tenant-a", "host").await == n).then_some(())
    })
    .await;
    let first = p.taskrun("tenant-a", &names[0]).await.unwrap();
    assert!(has_our_finalizer(&first), "{first:#}");
    let faults = p.api.faults();
    let removals = RequestMatch::on(Verb::Patch, "taskruns")
        .in_namespace("tenant-a")
        .by("c1");
    faults.fail_next(removals, 403, usize::MAX);
    for name in &names {
        p.delete_taskrun("tenant-a", name).await;
    }
    p.wait(T, "every removal refused once", || async {
        (faults.injected() >= n as u64).then_some(())
    })
    .await;
    p.create_taskrun("tenant-b", "next", "linux/amd64", json!({}))
        .await
        .unwrap();
    secret_with(&p, "tenant-b", "next", "host").await;

    faults.clear();
    let taskruns: Api<DynamicObject> =
        Api::namespaced_with(p.client.clone(), "tenant-a", &tekton::taskrun_resource());
    // The longest wait between attempts is a minute.
    p.wait(
        Duration::from_secs(120),
        "every stuck TaskRun gone",
        || async {
            taskruns
                .list(&ListParams::default())
                .await
                .ok()
                .filter(|l| l.items.is_empty())
                .map(|_| ())
        },
    )
    .await;
    assert!(
        p.controllers[0]
            .log_text()
            .contains("finalizer not removed; retrying"),
        "{}",
        p.logs()
    );
}
