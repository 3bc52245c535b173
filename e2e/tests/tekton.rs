//! The Tekton stand-in against the test API server: spec resolution, pending and cancelled
//! TaskRuns, pods, outcomes, retries, and steps that consume the secret for real.

use std::sync::Arc;
use std::time::Duration;

use e2e::apiserver::testing::eventually;
use e2e::apiserver::{ApiServer, Options, RequestMatch, TEKTON_CRDS, Verb};
use e2e::tekton::{self, Outcome, RunOptions, Tekton};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(10);

struct Env {
    _server: ApiServer,
    client: kube::Client,
    tekton: Tekton,
}

async fn env() -> Env {
    let server = ApiServer::start(Options::default()).await.unwrap();
    server.create_yaml(TEKTON_CRDS).await.unwrap();
    let client = server.client().await.unwrap();
    let tekton = Tekton::start(client.clone());
    Env {
        _server: server,
        client,
        tekton,
    }
}

impl Env {
    fn trs(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), "default", &tekton::taskrun_resource())
    }
    async fn create(&self, v: Value) -> Value {
        let o: DynamicObject = serde_json::from_value(v).unwrap();
        serde_json::to_value(self.trs().create(&PostParams::default(), &o).await.unwrap()).unwrap()
    }
    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), "default")
    }
}

fn taskrun(name: &str, extra: Value) -> Value {
    let mut tr = json!({"apiVersion": "tekton.dev/v1", "kind": "TaskRun", "metadata": {"name": name},
        "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}],
                 "taskSpec": {"params": [{"name": "PLATFORM", "type": "string"}],
                              "steps": [{"name": "build", "image": "busybox", "script": "echo $(params.PLATFORM)"}]}}});
    json_patch::merge(&mut tr, &extra);
    tr
}

fn started(t: &Value) -> bool {
    t["status"]["podName"]
        .as_str()
        .is_some_and(|p| !p.is_empty())
}

#[tokio::test]
async fn inline_spec_pod_and_success() {
    let e = env().await;
    let affinity = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]}]}}});
    let created = e
        .create(taskrun(
            "tr1",
            json!({"spec": {"podTemplate": {"affinity": affinity}}}),
        ))
        .await;
    let tr = e
        .tekton
        .wait_for("default", "tr1", T, started)
        .await
        .unwrap();
    assert_eq!(tr["status"]["taskSpec"]["steps"][0]["name"], "build");
    assert_eq!(
        tekton::condition(&tr),
        Some(("Unknown".into(), "Running".into()))
    );
    let pod = e.pods().get("tr1-pod").await.unwrap();
    let owner = &pod.metadata.owner_references.unwrap()[0];
    assert_eq!(owner.uid, created["metadata"]["uid"].as_str().unwrap());
    assert_eq!(owner.controller, Some(true));
    assert_eq!(
        serde_json::to_value(pod.spec.unwrap().affinity).unwrap(),
        affinity
    );
    let done = e
        .tekton
        .finish("default", "tr1", Outcome::Succeeded)
        .await
        .unwrap();
    assert_eq!(
        tekton::condition(&done),
        Some(("True".into(), "Succeeded".into()))
    );
    assert!(done["status"]["completionTime"].is_string());
    eventually(T, "pod Succeeded", || async {
        (e.pods().get("tr1-pod").await.ok()?.status?.phase? == "Succeeded").then_some(())
    })
    .await;
    assert!(
        e.tekton
            .finish("default", "tr1", Outcome::Succeeded)
            .await
            .is_err(),
        "already finished"
    );
}

#[tokio::test]
async fn task_ref_resolution_and_missing_task() {
    let e = env().await;
    let tasks: Api<DynamicObject> =
        Api::namespaced_with(e.client.clone(), "default", &tekton::task_resource());
    let task: DynamicObject = serde_json::from_value(json!({"apiVersion": "tekton.dev/v1", "kind": "Task",
        "metadata": {"name": "buildah-remote"},
        "spec": {"params": [{"name": "PLATFORM", "default": "linux/amd64"}], "steps": [{"name": "b", "image": "x", "script": "true"}]}}))
    .unwrap();
    tasks.create(&PostParams::default(), &task).await.unwrap();
    let mut tr = taskrun("by-ref", json!({}));
    tr["spec"] = json!({"taskRef": {"name": "buildah-remote"}});
    e.create(tr).await;
    let got = e
        .tekton
        .wait_for("default", "by-ref", T, started)
        .await
        .unwrap();
    assert_eq!(
        got["status"]["taskSpec"]["params"][0]["default"],
        "linux/amd64"
    );
    let mut missing = taskrun("no-task", json!({}));
    missing["spec"] = json!({"taskRef": {"name": "nope"}});
    e.create(missing).await;
    let failed = e
        .tekton
        .wait_for("default", "no-task", T, tekton::is_done)
        .await
        .unwrap();
    assert_eq!(
        tekton::condition(&failed),
        Some(("False".into(), "CouldntGetTask".into()))
    );
}

#[tokio::test]
async fn pending_gate_and_cancellation() {
    let e = env().await;
    e.create(taskrun(
        "gated",
        json!({"spec": {"status": "TaskRunPending"}}),
    ))
    .await;
    let tr = e
        .tekton
        .wait_for("default", "gated", T, |t| {
            tekton::condition(t).is_some_and(|c| c.1 == "TaskRunPending")
        })
        .await
        .unwrap();
    assert!(
        tr["status"]["taskSpec"].is_object(),
        "the spec is resolved while pending"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        e.pods().get_opt("gated-pod").await.unwrap().is_none(),
        "no pod while pending"
    );
    // Clearing spec.status starts it (JSON patch, as a scheduler would).
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/status", "value": "TaskRunPending"},
        {"op": "remove", "path": "/spec/status"}]))
    .unwrap();
    e.trs()
        .patch("gated", &PatchParams::default(), &Patch::<()>::Json(ops))
        .await
        .unwrap();
    e.tekton
        .wait_for("default", "gated", T, started)
        .await
        .unwrap();
    assert!(e.pods().get_opt("gated-pod").await.unwrap().is_some());
    e.trs()
        .patch(
            "gated",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"status": "TaskRunCancelled"}})),
        )
        .await
        .unwrap();
    let c = e
        .tekton
        .wait_for("default", "gated", T, tekton::is_done)
        .await
        .unwrap();
    assert_eq!(
        tekton::condition(&c),
        Some(("False".into(), "TaskRunCancelled".into()))
    );
}

#[tokio::test]
async fn retries_keep_the_uid_and_grow_retries_status() {
    let e = env().await;
    let created = e
        .create(taskrun("flaky", json!({"spec": {"retries": 1}})))
        .await;
    e.tekton
        .wait_for("default", "flaky", T, started)
        .await
        .unwrap();
    let retrying = e
        .tekton
        .finish(
            "default",
            "flaky",
            Outcome::Failed {
                message: "host went away".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        tekton::condition(&retrying),
        Some(("Unknown".into(), "ToBeRetried".into()))
    );
    assert_eq!(
        retrying["status"]["retriesStatus"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        retrying["status"]["retriesStatus"][0]["conditions"][0]["status"],
        "False"
    );
    let second = e
        .tekton
        .wait_for("default", "flaky", T, |t| {
            t["status"]["podName"] == "flaky-pod-retry1"
        })
        .await
        .unwrap();
    assert_eq!(second["metadata"]["uid"], created["metadata"]["uid"]);
    assert!(
        e.pods()
            .get_opt("flaky-pod-retry1")
            .await
            .unwrap()
            .is_some()
    );
    let done = e
        .tekton
        .finish(
            "default",
            "flaky",
            Outcome::Failed {
                message: "again".into(),
            },
        )
        .await
        .unwrap();
    assert_eq!(
        tekton::condition(&done),
        Some(("False".into(), "Failed".into()))
    );
}

/// Found by the chaos soak: a retry pod whose status write failed (an API error) was never
/// started, because the stand-in reconciled only on the next change of the TaskRun. Like
/// Tekton's work queue, it retries a failed reconciliation.
#[tokio::test]
async fn a_failed_reconciliation_is_retried_without_a_new_event() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    server.create_yaml(TEKTON_CRDS).await.unwrap();
    let client = server.client().await.unwrap();
    let tekton = Tekton::start(client.clone());
    let trs: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), "default", &tekton::taskrun_resource());
    let o: DynamicObject =
        serde_json::from_value(taskrun("flaky", json!({"spec": {"retries": 1}}))).unwrap();
    trs.create(&PostParams::default(), &o).await.unwrap();
    tekton
        .wait_for("default", "flaky", T, started)
        .await
        .unwrap();
    let failed = Outcome::Failed {
        message: "host went away".into(),
    };
    // Starting the retry pod fails twice; nothing changes the TaskRun after that.
    server.faults().fail_next(
        RequestMatch::on(Verb::Create, "pods").in_namespace("default"),
        500,
        2,
    );
    tekton.finish("default", "flaky", failed).await.unwrap();
    let retried = tekton
        .wait_for("default", "flaky", T, |t| {
            t["status"]["podName"] == "flaky-pod-retry1"
        })
        .await
        .unwrap();
    assert_eq!(tekton::condition(&retried).unwrap().1, "Running");
    assert_eq!(server.faults().injected(), 2);
}

/// A consumer step written the way Konflux tasks consume the secret (docs/architecture.md, "The
/// contract with the Go controller").
const CONSUMER: &str = r#"set -eu
mkdir -p ~/.ssh
if [ -e "/ssh/error" ]; then
  echo "Error provisioning VM"; cat /ssh/error; exit 1
elif [ "$(cat /ssh/host)" = "localhost" ]; then
  echo "building locally for $(params.PLATFORM)"; exit 0
elif [ -e "/ssh/otp" ]; then
  curl --fail --cacert /ssh/otp-ca -XPOST -d @/ssh/otp "$(cat /ssh/otp-server)" > ~/.ssh/id_rsa
  echo "" >> ~/.ssh/id_rsa
else
  cp /ssh/id_rsa ~/.ssh
fi
chmod 0400 ~/.ssh/id_rsa
echo "host=$(cat /ssh/host) dir=$(cat /ssh/user-dir) key=$(head -c 9 ~/.ssh/id_rsa)"
"#;

fn consumer_run(name: &str) -> Value {
    taskrun(
        name,
        json!({"spec": {"taskSpec": {
        "volumes": [{"name": "ssh", "secret": {"secretName": format!("multi-platform-ssh-{name}")}}],
        "steps": [{"name": "build", "image": "quay.io/x", "script": CONSUMER, "volumeMounts": [{"name": "ssh", "mountPath": "/ssh"}]}]}}}),
    )
}

async fn secret(e: &Env, name: &str, data: Value) {
    let s: Secret = serde_json::from_value(json!({"metadata": {"name": format!("multi-platform-ssh-{name}"),
        "labels": {"build.appstudio.redhat.com/multi-platform-secret": "true"}}, "stringData": data}))
    .unwrap();
    Api::<Secret>::namespaced(e.client.clone(), "default")
        .create(&PostParams::default(), &s)
        .await
        .unwrap();
}

/// A one-shot key server on loopback (the OTP server's `/otp` contract, for the consumer step).
async fn otp_stub(
    token: &'static str,
    key: &'static str,
) -> (String, String, tokio_util::sync::CancellationToken) {
    mpc::tls::install_crypto_provider();
    let b = mpc::certs::generate("otp", &["127.0.0.1".to_owned()], 1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    mpc::certs::write_bundle(&b, dir.path()).unwrap();
    let cert = mpc::tls::ReloadingCert::load(mpc::tls::CertPaths::in_dir(dir.path())).unwrap();
    let tls = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_cert_resolver(cert);
    let used = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app = axum::Router::new().route(
        "/otp",
        axum::routing::post(move |body: String| {
            let used = used.clone();
            async move {
                if body.trim() == token && !used.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    (http::StatusCode::OK, key.to_owned())
                } else {
                    (http::StatusCode::FORBIDDEN, "no".to_owned())
                }
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}/otp", l.local_addr().unwrap());
    let cancel = tokio_util::sync::CancellationToken::new();
    tokio::spawn(mpc::serve::serve_tls(
        l,
        Arc::new(tls),
        app,
        cancel.clone(),
        Default::default(),
    ));
    (url, b.ca_pem, cancel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_consume_the_secret_for_real() {
    let e = env().await;
    let (url, ca, stop) = otp_stub("tok3n", "KEY-BYTES-0123").await;
    secret(&e, "remote", json!({"otp": "tok3n\n", "otp-server": url, "otp-ca": ca, "host": "u-abc@127.0.0.1", "user-dir": "/home/u-abc"})).await;
    e.create(consumer_run("remote")).await;
    let run = e
        .tekton
        .run_steps("default", "remote", RunOptions::default())
        .await
        .unwrap();
    assert_eq!(run.exit_code, 0, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .contains("host=u-abc@127.0.0.1 dir=/home/u-abc key=KEY-BYTES"),
        "{}",
        run.stdout
    );
    let tr = e.tekton.get("default", "remote").await.unwrap();
    assert_eq!(
        tekton::condition(&tr),
        Some(("True".into(), "Succeeded".into()))
    );
    stop.cancel();

    secret(
        &e,
        "broken",
        json!({"error": "no host available for linux/arm64"}),
    )
    .await;
    e.create(consumer_run("broken")).await;
    let run = e
        .tekton
        .run_steps("default", "broken", RunOptions::default())
        .await
        .unwrap();
    assert_eq!(run.exit_code, 1);
    assert!(run.stdout.contains("no host available for linux/arm64"));
    assert!(matches!(run.outcome, Outcome::Failed { .. }));

    secret(&e, "local", json!({"host": "localhost"})).await;
    e.create(consumer_run("local")).await;
    let run = e
        .tekton
        .run_steps("default", "local", RunOptions::default())
        .await
        .unwrap();
    assert!(
        run.stdout.contains("building locally for linux/arm64"),
        "{}",
        run.stdout
    );

    // No secret yet: the pod could not start, and nothing runs.
    e.create(consumer_run("nosecret")).await;
    assert!(
        e.tekton
            .run_steps("default", "nosecret", RunOptions::default())
            .await
            .is_err()
    );
}
