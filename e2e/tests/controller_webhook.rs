//! The real `mpc controller` webhook behind the shipped manifests: the MutatingWebhookConfiguration
//! from `manifests/` is applied with `kubectl`, the API server calls the controller over TLS (with
//! a certificate from `mpc certs`, verified against the `ca-bundle`), and TaskRuns created with
//! `kubectl` come back mutated, or untouched where the manifest's selectors say so.

use std::path::{Path, PathBuf};

use e2e::apiserver::{ApiServer, Options, TEKTON_CRDS};
use e2e::kubectl::{Kubectl, Out};
use mpc::certs::CertsArgs;
use mpc::contract::{FINALIZER, TARGET_PLATFORM_LABEL};
use mpc::server::{WebhookArgs, WebhookServer};
use serde_json::Value;

const NS: &str = "multi-platform-controller";
const SERVICE: &str = "mpc-webhook";

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

struct Cluster {
    server: ApiServer,
    controller: WebhookServer,
    cli: Kubectl,
    _dir: tempfile::TempDir,
}

impl Cluster {
    async fn start() -> Self {
        let server = ApiServer::start(Options::default()).await.unwrap();
        server.create_yaml(TEKTON_CRDS).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        mpc::certs::run(&CertsArgs {
            service: SERVICE.into(),
            namespace: NS.into(),
            out: certs.clone(),
            days: 1,
            extra_sans: vec![],
        })
        .unwrap();
        let args = WebhookArgs::with_config(repo_file("examples/host-config.yaml"), certs.clone());
        let controller = WebhookServer::start(&args, prometheus::Registry::new())
            .await
            .unwrap();
        // The Service in manifests/service.yaml exposes the webhook on 443.
        server.map_service(NS, SERVICE, 443, controller.webhook_addr());

        let ca_bundle = std::fs::read_to_string(certs.join("ca-bundle")).unwrap();
        let manifest = e2e::kubectl::shipped_webhook_configuration(&ca_bundle);
        let file = dir.path().join("webhook.json");
        std::fs::write(&file, manifest.to_string()).unwrap();

        let server_kubeconfig = server.kubeconfig_path();
        let c = Cluster {
            server,
            controller,
            cli: Kubectl::new(&server_kubeconfig),
            _dir: dir,
        };
        c.kubectl_ok(&["apply", "--validate=false", "-f", file.to_str().unwrap()])
            .await;
        // `kubectl create namespace` would send protobuf, which the test server does not speak.
        for ns in ["builds", "tekton-pipelines"] {
            let yaml = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n");
            let o = c
                .kubectl(&["create", "--validate=false", "-f", "-"], Some(&yaml))
                .await;
            assert!(o.ok, "{}", o.stderr);
        }
        c
    }

    async fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Out {
        self.cli.run(args, stdin).await
    }

    async fn kubectl_ok(&self, args: &[&str]) -> String {
        self.cli.ok(args).await
    }

    /// `kubectl create -f -` of a TaskRun, then the stored object.
    async fn create_taskrun(&self, ns: &str, yaml: &str) -> Value {
        let o = self
            .kubectl(
                &[
                    "create",
                    "--validate=false",
                    "-n",
                    ns,
                    "-f",
                    "-",
                    "-o",
                    "json",
                ],
                Some(yaml),
            )
            .await;
        assert!(o.ok, "create: {}", o.stderr);
        let created: Value = serde_json::from_str(&o.stdout).unwrap();
        let name = created["metadata"]["name"].as_str().unwrap();
        let stored = self
            .kubectl_ok(&["get", "-n", ns, "taskrun.tekton.dev", name, "-o", "json"])
            .await;
        serde_json::from_str(&stored).unwrap()
    }

    /// The controller's webhook request counter, summed over outcomes.
    async fn webhook_calls(&self) -> f64 {
        let url = format!("http://{}/metrics", self.controller.admin_addr());
        let text = http_get(&url).await;
        text.lines()
            .filter(|l| {
                l.starts_with("multi_platform_controller_webhook_requests") && !l.starts_with('#')
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

async fn http_get(url: &str) -> String {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

fn taskrun(name: &str, platform: Option<&str>, labels: &str) -> String {
    let params = platform
        .map(|p| format!("  params:\n    - name: PLATFORM\n      value: {p}\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: tekton.dev/v1\nkind: TaskRun\nmetadata:\n  name: {name}\n{labels}spec:\n{params}  taskRef:\n    name: buildah\n"
    )
}

fn labels(obj: &Value) -> &Value {
    &obj["metadata"]["labels"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifests_route_taskruns_to_the_real_controller_over_tls() {
    let c = Cluster::start().await;

    // Remote (dynamic) platform: allocation label and finalizer.
    let remote = c
        .create_taskrun("builds", &taskrun("arm", Some("linux/arm64"), ""))
        .await;
    assert_eq!(
        labels(&remote)[TARGET_PLATFORM_LABEL],
        "linux-arm64",
        "{remote:#}"
    );
    assert_eq!(remote["metadata"]["finalizers"][0], FINALIZER, "{remote:#}");
    assert!(remote["spec"]["podTemplate"].is_null(), "{remote:#}");

    // Local os/arch platform: required node affinity, no allocation marks.
    let local = c
        .create_taskrun("builds", &taskrun("amd", Some("linux/x86_64"), ""))
        .await;
    let terms = &local["spec"]["podTemplate"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    let exprs = terms[0]["matchExpressions"]
        .as_array()
        .unwrap_or_else(|| panic!("{local:#}"));
    let pairs: Vec<(String, String)> = exprs
        .iter()
        .map(|e| {
            (
                e["key"].as_str().unwrap().to_owned(),
                e["values"][0].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(
        pairs.contains(&("kubernetes.io/arch".into(), "amd64".into())),
        "{pairs:?}"
    );
    assert!(
        pairs.contains(&("kubernetes.io/os".into(), "linux".into())),
        "{pairs:?}"
    );
    // Local TaskRuns are labelled for the controller, which writes `host: localhost`
    // (docs/architecture.md, "One TaskRun, end to end").
    assert_eq!(
        labels(&local)
            .get(TARGET_PLATFORM_LABEL)
            .and_then(|v| v.as_str()),
        Some("linux-x86_64"),
        "{local:#}"
    );
    assert!(local["metadata"]["finalizers"].is_null(), "{local:#}");

    let called = c.webhook_calls().await;
    assert_eq!(called, 2.0, "one webhook call per matching TaskRun");

    // The manifest's matchConditions and namespaceSelector keep these from calling the webhook.
    let plain = c
        .create_taskrun("builds", &taskrun("plain", None, ""))
        .await;
    assert!(
        labels(&plain).get(TARGET_PLATFORM_LABEL).is_none(),
        "{plain:#}"
    );
    let internal = c
        .create_taskrun(
            "builds",
            &taskrun(
                "internal",
                Some("linux/arm64"),
                "  labels:\n    build.appstudio.redhat.com/task-type: clean\n",
            ),
        )
        .await;
    assert!(
        labels(&internal).get(TARGET_PLATFORM_LABEL).is_none(),
        "{internal:#}"
    );
    let system = c
        .create_taskrun("tekton-pipelines", &taskrun("sys", Some("linux/arm64"), ""))
        .await;
    assert!(
        labels(&system).get(TARGET_PLATFORM_LABEL).is_none(),
        "{system:#}"
    );
    assert_eq!(
        c.webhook_calls().await,
        called,
        "no call for excluded TaskRuns"
    );

    // A finalizer the webhook added holds deletion until the scheduler releases the TaskRun.
    let o = c
        .kubectl(
            &[
                "delete",
                "-n",
                "builds",
                "taskrun.tekton.dev",
                "arm",
                "--wait=false",
            ],
            None,
        )
        .await;
    assert!(o.ok, "{}", o.stderr);
    let held: Value = serde_json::from_str(
        &c.kubectl_ok(&[
            "get",
            "-n",
            "builds",
            "taskrun.tekton.dev",
            "arm",
            "-o",
            "json",
        ])
        .await,
    )
    .unwrap();
    assert!(
        held["metadata"]["deletionTimestamp"].is_string(),
        "{held:#}"
    );

    c.controller.shutdown().await;
    c.server.shutdown().await;
}

/// Issue 23 §1: a TaskRun created with the controller's own labels and annotations (from a
/// pipeline task's metadata, say) is stored without them, and with the webhook's
/// `allocation-start-time`, so a leader change cannot rebuild an allocation or a queue position
/// from what its creator wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_only_keys_sent_at_creation_are_not_stored() {
    use mpc::contract::{ALLOCATION_START_TIME_ANNOTATION, CONTROLLER_ONLY_ANNOTATIONS};
    let c = Cluster::start().await;
    let forged = "  labels:\n    build.appstudio.redhat.com/assigned-host: host-1\n    build.appstudio.redhat.com/waiting-for-platform: linux-arm64\n    team: a\n  annotations:\n    build.appstudio.redhat.com/failed-hosts: host-0\n    build.appstudio.redhat.com/cloud-instance-id: i-0aaaabbbbcccc0001\n    build.appstudio.redhat.com/cloud-address: 127.0.0.66\n    build.appstudio.redhat.com/allocation-start-time: \"1\"\n    note: kept\n";
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let stored = c
        .create_taskrun("builds", &taskrun("forged", Some("linux/arm64"), forged))
        .await;
    let meta = &stored["metadata"];
    for key in mpc::contract::CONTROLLER_ONLY_LABELS {
        assert!(meta["labels"].get(key).is_none(), "{key}: {stored:#}");
    }
    for key in CONTROLLER_ONLY_ANNOTATIONS {
        assert!(meta["annotations"].get(key).is_none(), "{key}: {stored:#}");
    }
    let start: u64 = meta["annotations"][ALLOCATION_START_TIME_ANNOTATION]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{stored:#}"));
    assert!(
        start >= before,
        "the webhook's own time: {start} < {before}"
    );
    // Everything else the creator wrote stays, and the TaskRun is marked as usual.
    assert_eq!(meta["labels"]["team"], "a");
    assert_eq!(meta["annotations"]["note"], "kept");
    assert_eq!(labels(&stored)[TARGET_PLATFORM_LABEL], "linux-arm64");
    assert_eq!(meta["finalizers"][0], FINALIZER);
}
