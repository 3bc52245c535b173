//! Conformance as judged by the real `kubectl` (on PATH, or `$KUBECTL`): create/apply, get
//! (JSON and tables), watch, patch (merge, JSON, strategic), label, delete blocked by a
//! finalizer, wait --for=delete, CRD registration then `get taskruns`.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use e2e_apiserver::kubectl::Out;
use e2e_apiserver::testing::eventually;
use e2e_apiserver::{ApiServer, Options};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const T: Duration = Duration::from_secs(20);

struct Kubectl {
    server: ApiServer,
    cli: e2e_apiserver::kubectl::Kubectl,
}

impl Kubectl {
    async fn start() -> Self {
        let server = ApiServer::start(Options::default()).await.unwrap();
        let cli = e2e_apiserver::kubectl::Kubectl::new(&server.kubeconfig_path());
        Self { server, cli }
    }

    fn command(&self, args: &[&str]) -> tokio::process::Command {
        self.cli.command(args)
    }

    async fn run_with(&self, args: &[&str], stdin: Option<&str>) -> Out {
        self.cli.run(args, stdin).await
    }

    async fn ok(&self, args: &[&str]) -> String {
        self.cli.ok(args).await
    }

    async fn ok_stdin(&self, args: &[&str], input: &str) -> String {
        self.cli.ok_stdin(args, input).await
    }

    async fn json(&self, args: &[&str]) -> Value {
        self.cli.json(args).await
    }

    async fn cms(&self) -> Api<ConfigMap> {
        Api::namespaced(self.server.client().await.unwrap(), "default")
    }
}

const CM: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cfg\n  labels:\n    app: e2e\ndata:\n  k: v\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_get_apply_label_patch() {
    let k = Kubectl::start().await;
    assert!(
        k.ok_stdin(&["create", "-f", "-"], CM)
            .await
            .contains("configmap/cfg created")
    );
    let got = k.json(&["get", "configmap", "cfg"]).await;
    assert_eq!(got["data"]["k"], "v");
    assert!(got["metadata"]["uid"].is_string());
    let table = k.ok(&["get", "cm"]).await;
    assert!(table.starts_with("NAME"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("cfg ")), "{table}");
    let applied = k
        .ok_stdin(&["apply", "-f", "-"], &CM.replace("k: v", "k: v2"))
        .await;
    assert!(applied.contains("configmap/cfg configured"), "{applied}");
    assert_eq!(k.json(&["get", "cm", "cfg"]).await["data"]["k"], "v2");
    let fresh = k
        .ok_stdin(
            &["apply", "-f", "-"],
            &CM.replace("name: cfg", "name: other"),
        )
        .await;
    assert!(fresh.contains("configmap/other created"), "{fresh}");
    k.ok(&["label", "cm", "cfg", "team=a"]).await;
    assert_eq!(
        k.ok(&["get", "cm", "-l", "team=a", "-o", "name"])
            .await
            .trim(),
        "configmap/cfg"
    );
    assert_eq!(
        k.ok(&["get", "cm", "-l", "team!=a,app", "-o", "name"])
            .await
            .trim(),
        "configmap/other"
    );
    k.ok(&["label", "cm", "cfg", "team-"]).await;
    assert!(
        k.json(&["get", "cm", "cfg"]).await["metadata"]["labels"]
            .get("team")
            .is_none()
    );
    k.ok(&[
        "patch",
        "cm",
        "cfg",
        "--type",
        "merge",
        "-p",
        r#"{"data":{"m":"1"}}"#,
    ])
    .await;
    k.ok(&["patch", "cm", "cfg", "--type", "json", "-p", r#"[{"op":"test","path":"/data/m","value":"1"},{"op":"replace","path":"/data/k","value":"j"}]"#]).await;
    k.ok(&[
        "patch",
        "cm",
        "cfg",
        "--type",
        "strategic",
        "-p",
        r#"{"metadata":{"finalizers":["e2e.io/x"]}}"#,
    ])
    .await;
    k.ok(&[
        "patch",
        "cm",
        "cfg",
        "--type",
        "strategic",
        "-p",
        r#"{"metadata":{"finalizers":["e2e.io/y"]}}"#,
    ])
    .await;
    let after = k.json(&["get", "cm", "cfg"]).await;
    assert_eq!(after["data"], json!({"k": "j", "m": "1"}));
    assert_eq!(
        after["metadata"]["finalizers"],
        json!(["e2e.io/x", "e2e.io/y"])
    );
    let failed = k
        .run_with(
            &[
                "patch",
                "cm",
                "cfg",
                "--type",
                "json",
                "-p",
                r#"[{"op":"test","path":"/data/m","value":"2"}]"#,
            ],
            None,
        )
        .await;
    assert!(!failed.ok);
    k.ok(&[
        "patch",
        "cm",
        "cfg",
        "--type",
        "merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ])
    .await;
    k.ok(&["annotate", "cm", "cfg", "note=hello"]).await;
    assert_eq!(
        k.json(&["get", "cm", "cfg"]).await["metadata"]["annotations"]["note"],
        "hello"
    );
    let missing = k.run_with(&["get", "cm", "nope"], None).await;
    assert!(!missing.ok);
    assert!(
        missing.stderr.contains("NotFound") && missing.stderr.contains("\"nope\" not found"),
        "{}",
        missing.stderr
    );
    let all = k.ok(&["get", "cm", "-A"]).await;
    assert!(all.starts_with("NAMESPACE"), "{all}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_watch_sees_events() {
    let k = Kubectl::start().await;
    let api = k.cms().await;
    api.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "w0"}})).unwrap(),
    )
    .await
    .unwrap();
    let mut c = k.command(&["get", "cm", "-w", "--output-watch-events", "-o", "json"]);
    c.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = c.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
    tokio::spawn(async move {
        // Watch events come one JSON object per line.
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            if let Ok(v) = serde_json::from_str::<Value>(&l) {
                let _ = tx.send(v);
            }
        }
    });
    let mut events = Vec::new();
    let mut next = async || -> (String, String) {
        let v = tokio::time::timeout(T, rx.recv())
            .await
            .expect("watch event")
            .unwrap();
        (
            v["type"].as_str().unwrap().to_owned(),
            v["object"]["metadata"]["name"].as_str().unwrap().to_owned(),
        )
    };
    events.push(next().await);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "w1"}})).unwrap(),
    )
    .await
    .unwrap();
    events.push(next().await);
    api.patch(
        "w1",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"a": "b"}})),
    )
    .await
    .unwrap();
    events.push(next().await);
    api.delete("w1", &DeleteParams::default()).await.unwrap();
    events.push(next().await);
    let want: Vec<(String, String)> = [
        ("ADDED", "w0"),
        ("ADDED", "w1"),
        ("MODIFIED", "w1"),
        ("DELETED", "w1"),
    ]
    .iter()
    .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
    .collect();
    assert_eq!(events, want);
    child.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_waits_for_finalizer_and_wait_for_delete() {
    let k = Kubectl::start().await;
    k.ok_stdin(
        &["create", "-f", "-"],
        &CM.replace("\ndata:", "\n  finalizers: [e2e.io/hold]\ndata:"),
    )
    .await;
    let mut del = k.command(&["delete", "cm", "cfg", "--timeout=30s"]);
    del.stdout(Stdio::piped()).stderr(Stdio::piped());
    let del = del.spawn().unwrap();
    let mut wait = k.command(&["wait", "--for=delete", "cm/cfg", "--timeout=30s"]);
    wait.stdout(Stdio::piped()).stderr(Stdio::piped());
    let wait = wait.spawn().unwrap();
    let api = k.cms().await;
    eventually(T, "deletionTimestamp", || async {
        api.get("cfg")
            .await
            .ok()?
            .metadata
            .deletion_timestamp
            .map(|_| ())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        api.get_opt("cfg").await.unwrap().is_some(),
        "held by the finalizer"
    );
    k.ok(&[
        "patch",
        "cm",
        "cfg",
        "--type",
        "json",
        "-p",
        r#"[{"op":"remove","path":"/metadata/finalizers"}]"#,
    ])
    .await;
    let d = tokio::time::timeout(T, del.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    assert!(String::from_utf8_lossy(&d.stdout).contains("configmap \"cfg\" deleted"));
    let w = tokio::time::timeout(T, wait.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
}

fn crd_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crds/tekton.yaml")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crd_registration_then_get_taskruns() {
    let k = Kubectl::start().await;
    let before = k.run_with(&["get", "taskruns"], None).await;
    assert!(
        !before.ok
            && before
                .stderr
                .contains("the server doesn't have a resource type"),
        "{}",
        before.stderr
    );
    let crd = crd_file();
    k.ok(&["apply", "-f", crd.to_str().unwrap()]).await;
    k.ok(&[
        "wait",
        "--for=condition=Established",
        "crd/taskruns.tekton.dev",
        "--timeout=10s",
    ])
    .await;
    let tr = "apiVersion: tekton.dev/v1\nkind: TaskRun\nmetadata:\n  name: build-1\nspec:\n  params:\n  - name: PLATFORM\n    value: linux/arm64\n  taskSpec:\n    steps:\n    - name: s\n      image: busybox\n      script: echo hi\n";
    k.ok_stdin(&["create", "-f", "-"], tr).await;
    let table = k.ok(&["get", "taskruns"]).await;
    let header = table.lines().next().unwrap();
    for col in ["NAME", "SUCCEEDED", "REASON", "STARTTIME", "COMPLETIONTIME"] {
        assert!(header.contains(col), "{table}");
    }
    assert!(table.contains("build-1"), "{table}");
    assert_eq!(
        k.ok(&["get", "tr", "-o", "name"]).await.trim(),
        "taskrun.tekton.dev/build-1"
    );
    let v1b1 = k
        .json(&["get", "taskruns.v1beta1.tekton.dev", "build-1"])
        .await;
    assert_eq!(v1b1["apiVersion"], "tekton.dev/v1beta1");
    k.ok(&[
        "patch",
        "tr",
        "build-1",
        "--type",
        "merge",
        "-p",
        r#"{"metadata":{"labels":{"x":"y"}}}"#,
    ])
    .await;
    k.ok(&["label", "tr", "build-1", "z=w"]).await;
    let got = k.json(&["get", "tr", "build-1"]).await;
    assert_eq!(got["metadata"]["labels"], json!({"x": "y", "z": "w"}));
    let strategic = k
        .run_with(
            &[
                "patch",
                "tr",
                "build-1",
                "--type",
                "strategic",
                "-p",
                r#"{"metadata":{"labels":{"a":"b"}}}"#,
            ],
            None,
        )
        .await;
    assert!(!strategic.ok, "custom resources refuse strategic merge");
    k.ok(&["delete", "tr", "build-1"]).await;
    assert!(
        k.ok(&["get", "tr"]).await.is_empty() || !k.ok(&["get", "tr"]).await.contains("build-1")
    );
}

const TASKRUN: &str = "apiVersion: tekton.dev/v1\nkind: TaskRun\nmetadata:\n  name: build-1\nspec:\n  taskSpec:\n    steps:\n    - name: s\n      image: busybox\n      script: echo hi\n";

/// `kubectl apply`/`create` as typed, with client-side validation: kubectl downloads the OpenAPI
/// documents, and computes a strategic merge patch for built-in kinds and a merge patch for
/// custom resources.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_and_create_with_validation() {
    let k = Kubectl::start().await;
    k.server
        .create_yaml(e2e_apiserver::TEKTON_CRDS)
        .await
        .unwrap();
    let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\n  finalizers: [e2e.io/a]\ndata:\n  k: v\n";
    let out = k.run_with(&["apply", "-f", "-"], Some(cm)).await;
    assert!(out.ok, "{}", out.stderr);
    assert!(
        out.stdout.contains("configmap/applied created"),
        "{}",
        out.stdout
    );
    let changed = cm
        .replace("k: v", "k: v2")
        .replace("[e2e.io/a]", "[e2e.io/a, e2e.io/b]");
    let out = k.run_with(&["apply", "-f", "-"], Some(&changed)).await;
    assert!(out.ok && out.stderr.is_empty(), "{}", out.stderr);
    let got = k.json(&["get", "cm", "applied"]).await;
    assert_eq!(got["data"], json!({"k": "v2"}));
    assert_eq!(
        got["metadata"]["finalizers"],
        json!(["e2e.io/a", "e2e.io/b"])
    );
    k.ok(&[
        "patch",
        "cm",
        "applied",
        "--type",
        "merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ])
    .await;

    let out = k
        .run_with(&["create", "--save-config", "-f", "-"], Some(TASKRUN))
        .await;
    assert!(out.ok, "{}", out.stderr);
    let out = k
        .run_with(
            &["apply", "-f", "-"],
            Some(&TASKRUN.replace("echo hi", "echo ho")),
        )
        .await;
    assert!(out.ok && out.stderr.is_empty(), "{}", out.stderr);
    assert!(
        out.stdout.contains("taskrun.tekton.dev/build-1 configured"),
        "{}",
        out.stdout
    );
    let tr = k.json(&["get", "tr", "build-1"]).await;
    assert_eq!(tr["spec"]["taskSpec"]["steps"][0]["script"], "echo ho");
    let explain = k.ok(&["explain", "taskrun"]).await;
    assert!(explain.contains("KIND:       TaskRun"), "{explain}");
}

/// kubectl's typed generators send protobuf bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_generators_create_namespaces_configmaps_secrets() {
    let k = Kubectl::start().await;
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("blob");
    std::fs::write(&bin, [0u8, 0xff, 1, 2]).unwrap();
    k.ok(&["create", "namespace", "team-a"]).await;
    k.ok(&[
        "create",
        "configmap",
        "cfg",
        "-n",
        "team-a",
        "--from-literal=a=b",
        &format!("--from-file=blob={}", bin.display()),
    ])
    .await;
    k.ok(&[
        "create",
        "secret",
        "generic",
        "creds",
        "-n",
        "team-a",
        "--from-literal=user=admin",
    ])
    .await;
    k.ok(&["create", "serviceaccount", "robot", "-n", "team-a"])
        .await;
    let ns = k.json(&["get", "ns", "team-a"]).await;
    assert_eq!(ns["status"]["phase"], "Active");
    let cm = k.json(&["get", "cm", "cfg", "-n", "team-a"]).await;
    assert_eq!(cm["data"], json!({"a": "b"}));
    assert_eq!(cm["binaryData"], json!({"blob": "AP8BAg=="}));
    let s = k.json(&["get", "secret", "creds", "-n", "team-a"]).await;
    assert_eq!(s["type"], "Opaque");
    assert_eq!(s["data"], json!({"user": "YWRtaW4="}));
    let sa = k.json(&["get", "sa", "robot", "-n", "team-a"]).await;
    assert!(sa["metadata"]["uid"].is_string());
    assert!(
        sa["metadata"].get("generateName").is_none(),
        "empty fields stay unset"
    );
}

/// `describe`, `get -w`, `delete`, `events` and `get events` on a custom resource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_watch_delete_and_events_of_taskruns() {
    let k = Kubectl::start().await;
    k.server
        .create_yaml(e2e_apiserver::TEKTON_CRDS)
        .await
        .unwrap();
    let mut watch = k.command(&["get", "taskruns", "-w"]);
    watch.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = watch.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(l)) = lines.next_line().await {
            let _ = tx.send(l);
        }
    });
    let created = k.server.create_yaml(TASKRUN).await.unwrap().remove(0);
    let line = tokio::time::timeout(T, async {
        loop {
            let l = rx.recv().await.expect("kubectl get -w output");
            if l.starts_with("build-1") {
                return l;
            }
        }
    })
    .await
    .expect("the new TaskRun appears in the watch");
    assert!(line.starts_with("build-1 "), "{line}");

    let now = e2e_apiserver::testing::timestamp(time::OffsetDateTime::now_utc());
    k.server
        .create(json!({"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": "build-1.provisioned", "namespace": "default"},
            "involvedObject": {"apiVersion": "tekton.dev/v1", "kind": "TaskRun", "name": "build-1",
                "namespace": "default", "uid": created["metadata"]["uid"]},
            "reason": "Provisioned", "message": "host ready", "type": "Normal",
            "source": {"component": "mpc"}, "firstTimestamp": now, "lastTimestamp": now, "count": 1}))
        .await
        .unwrap();
    let described = k.ok(&["describe", "taskrun", "build-1"]).await;
    assert!(described.contains("Name:         build-1"), "{described}");
    assert!(described.contains("Script:  echo hi"), "{described}");
    let events_section = described.split("Events:").nth(1).unwrap_or_default();
    assert!(
        events_section.contains("Provisioned") && events_section.contains("host ready"),
        "{described}"
    );
    let events = k.ok(&["events"]).await;
    assert!(
        events.contains("Provisioned") && events.contains("TaskRun/build-1"),
        "{events}"
    );
    let for_tr = k.ok(&["events", "--for", "taskrun/build-1"]).await;
    assert!(for_tr.contains("host ready"), "{for_tr}");
    let listed = k.ok(&["get", "events"]).await;
    assert!(
        listed.contains("Provisioned") && listed.contains("host ready"),
        "{listed}"
    );

    let deleted = k.ok(&["delete", "taskrun", "build-1"]).await;
    assert!(
        deleted.contains("taskrun.tekton.dev \"build-1\" deleted"),
        "{deleted}"
    );
    let gone = k.run_with(&["get", "tr", "build-1"], None).await;
    assert!(
        !gone.ok && gone.stderr.contains("NotFound"),
        "{}",
        gone.stderr
    );
    child.kill().await.unwrap();
}
