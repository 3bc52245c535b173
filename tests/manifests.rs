//! The kustomize base and the three certificate overlays render with the real `kubectl kustomize`,
//! and the rendered objects hang together (names, ports, namespaces, webhook settings, config).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_norway::Value;

const NAMESPACE: &str = "multi-platform-controller";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn kubectl() -> PathBuf {
    std::env::var_os("MPC_KUBECTL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("kubectl"))
}

/// Renders a kustomization and returns its objects keyed by `Kind/name`.
fn render(dir: &Path) -> BTreeMap<String, Value> {
    let out = Command::new(kubectl())
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("kubectl (installed by e2e/setup.sh; MPC_KUBECTL overrides the path)");
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut objects = BTreeMap::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc).unwrap();
        let key = format!("{}/{}", s(&v["kind"]), s(&v["metadata"]["name"]));
        assert!(objects.insert(key.clone(), v).is_none(), "duplicate {key}");
    }
    objects
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

fn kinds(objects: &BTreeMap<String, Value>) -> Vec<&str> {
    let mut k: Vec<&str> = objects.values().map(|o| s(&o["kind"])).collect();
    k.sort_unstable();
    k
}

#[test]
fn base_renders_the_expected_objects_consistently() {
    let o = render(&repo().join("manifests"));
    assert_eq!(
        kinds(&o),
        [
            "ConfigMap",
            "Deployment",
            "MutatingWebhookConfiguration",
            "Namespace",
            "PodDisruptionBudget",
            "Service",
            "ServiceAccount",
        ]
    );
    for (key, obj) in &o {
        if !key.starts_with("Namespace/") && !key.starts_with("MutatingWebhookConfiguration/") {
            assert_eq!(s(&obj["metadata"]["namespace"]), NAMESPACE, "{key}");
        }
    }

    let dep = &o["Deployment/multi-platform-controller"];
    assert_eq!(dep["spec"]["replicas"].as_u64(), Some(2));
    let pod = &dep["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(
        s(&pod["serviceAccountName"]),
        s(&o["ServiceAccount/multi-platform-controller"]["metadata"]["name"])
    );
    let c = &pod["containers"][0];
    assert!(
        s(&c["image"]).starts_with("quay.io/"),
        "kustomize image mapping applied"
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    for r in ["requests", "limits"] {
        assert!(c["resources"][r]["memory"].is_string(), "{r}");
        assert!(c["resources"][r]["cpu"].is_string(), "{r}");
    }
    // Probes hit the admin port.
    let ports: Vec<&str> = c["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| s(&p["name"]))
        .collect();
    assert_eq!(ports, ["webhook", "admin"]);
    assert_eq!(s(&c["readinessProbe"]["httpGet"]["port"]), "admin");
    assert_eq!(s(&c["readinessProbe"]["httpGet"]["path"]), "/readyz");
    assert_eq!(s(&c["livenessProbe"]["httpGet"]["path"]), "/healthz");
    // Every writable path is a mounted volume; the args name the mounted paths.
    let args: Vec<&str> = c["args"].as_sequence().unwrap().iter().map(s).collect();
    let mounts: BTreeMap<&str, &str> = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| (s(&m["mountPath"]), s(&m["name"])))
        .collect();
    assert_eq!(args[0], "controller");
    for a in &args[1..] {
        if let Some(path) = a
            .strip_prefix("--config=")
            .or(a.strip_prefix("--cert-dir="))
        {
            assert!(mounts.contains_key(path), "{a} is not a mounted path");
        }
    }
    assert!(mounts.contains_key("/tmp") && mounts.contains_key("/home/mpc"));
    let volumes = pod["volumes"].as_sequence().unwrap();
    let secret_of = |name: &str| {
        volumes
            .iter()
            .find(|v| s(&v["name"]) == name)
            .map(|v| v["secret"]["secretName"].clone())
    };
    assert_eq!(
        secret_of("webhook-certs").as_ref().map(s),
        Some("mpc-webhook-certs")
    );

    // Service → named container ports; the webhook points at the Service.
    let svc = &o["Service/mpc-webhook"];
    for p in svc["spec"]["ports"].as_sequence().unwrap() {
        assert!(ports.contains(&s(&p["targetPort"])), "{p:?}");
    }
    let mwc = &o["MutatingWebhookConfiguration/multi-platform-controller"];
    let wh = &mwc["webhooks"][0];
    assert_eq!(s(&wh["clientConfig"]["service"]["name"]), "mpc-webhook");
    assert_eq!(s(&wh["clientConfig"]["service"]["namespace"]), NAMESPACE);
    assert_eq!(s(&wh["clientConfig"]["service"]["path"]), "/mutate-taskrun");
    assert_eq!(wh["clientConfig"]["service"]["port"].as_u64(), Some(443));
    assert_eq!(s(&wh["sideEffects"]), "None");
    assert_eq!(wh["timeoutSeconds"].as_u64(), Some(5));
    assert_eq!(s(&wh["reinvocationPolicy"]), "IfNeeded");
    assert!(["Fail", "Ignore"].contains(&s(&wh["failurePolicy"])));
    let v1: Vec<&str> = wh["admissionReviewVersions"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(s)
        .collect();
    assert_eq!(v1, ["v1"]);
    let rule = &wh["rules"][0];
    let list = |v: &Value| -> Vec<String> {
        v.as_sequence()
            .unwrap()
            .iter()
            .map(|x| s(x).to_owned())
            .collect()
    };
    assert_eq!(list(&rule["operations"]), ["CREATE"]);
    assert_eq!(list(&rule["apiGroups"]), ["tekton.dev"]);
    assert_eq!(list(&rule["apiVersions"]), ["v1", "v1beta1"]);
    assert_eq!(list(&rule["resources"]), ["taskruns"]);
    let excluded = list(&wh["namespaceSelector"]["matchExpressions"][0]["values"]);
    for ns in ["kube-system", NAMESPACE] {
        assert!(excluded.iter().any(|e| e == ns), "{ns} not excluded");
    }
    let conditions: String = wh["matchConditions"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|c| s(&c["expression"]).to_owned())
        .collect();
    assert!(conditions.contains("'PLATFORM'"));
    assert!(conditions.contains(mpc::contract::TASK_TYPE_LABEL));

    // The example host-config is valid as shipped.
    let cm = &o["ConfigMap/host-config"];
    let data: mpc::config::ConfigData = cm["data"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| (s(k).to_owned(), s(v).to_owned()))
        .collect();
    let parsed = mpc::config::parse(&data);
    let errors: Vec<_> = parsed.of(mpc::config::Severity::Error).collect();
    assert!(errors.is_empty(), "{errors:?}");
    assert!(!parsed.config.dynamic.is_empty());
    assert!(!parsed.config.local.is_empty());
}

#[test]
fn cert_manager_overlay_issues_the_mounted_secret_and_injects_its_ca() {
    let o = render(&repo().join("webhook-certs/cert-manager"));
    let cert = &o["Certificate/mpc-webhook"];
    assert_eq!(s(&cert["spec"]["secretName"]), "mpc-webhook-certs");
    let names: Vec<&str> = cert["spec"]["dnsNames"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(s)
        .collect();
    assert_eq!(names, mpc::certs::service_sans("mpc-webhook", NAMESPACE));
    let issuer = s(&cert["spec"]["issuerRef"]["name"]);
    assert!(o.contains_key(&format!("Issuer/{issuer}")));
    let mwc = &o["MutatingWebhookConfiguration/multi-platform-controller"];
    assert_eq!(
        s(&mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]),
        format!("{NAMESPACE}/mpc-webhook")
    );
}

#[test]
fn openshift_overlay_annotates_service_and_webhook() {
    let o = render(&repo().join("webhook-certs/openshift"));
    let svc = &o["Service/mpc-webhook"];
    assert_eq!(
        s(&svc["metadata"]["annotations"]["service.beta.openshift.io/serving-cert-secret-name"]),
        "mpc-webhook-certs"
    );
    let mwc = &o["MutatingWebhookConfiguration/multi-platform-controller"];
    assert_eq!(
        s(&mwc["metadata"]["annotations"]["service.beta.openshift.io/inject-cabundle"]),
        "true"
    );
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[test]
fn mpc_certs_overlay_carries_the_generated_secret_and_ca_bundle() {
    // A copy of the tree, so generated keys never land in the checkout.
    let tmp = tempfile::tempdir().unwrap();
    copy_tree(&repo().join("manifests"), &tmp.path().join("manifests"));
    copy_tree(
        &repo().join("webhook-certs/mpc-certs"),
        &tmp.path().join("webhook-certs/mpc-certs"),
    );
    let out = tmp.path().join("webhook-certs/mpc-certs/out");
    mpc::certs::run(&mpc::certs::CertsArgs {
        service: "mpc-webhook".into(),
        namespace: NAMESPACE.into(),
        out: out.clone(),
        days: 30,
        extra_sans: Vec::new(),
    })
    .unwrap();
    let o = render(&tmp.path().join("webhook-certs/mpc-certs"));
    let secret = &o["Secret/mpc-webhook-certs"];
    assert_eq!(s(&secret["type"]), "kubernetes.io/tls");
    assert_eq!(s(&secret["metadata"]["namespace"]), NAMESPACE);
    use base64::Engine as _;
    let b64 = |v: &Value| {
        base64::engine::general_purpose::STANDARD
            .decode(s(v).replace('\n', ""))
            .unwrap()
    };
    assert_eq!(
        b64(&secret["data"]["tls.crt"]),
        std::fs::read(out.join("tls.crt")).unwrap()
    );
    let mwc = &o["MutatingWebhookConfiguration/multi-platform-controller"];
    assert_eq!(
        b64(&mwc["webhooks"][0]["clientConfig"]["caBundle"]),
        std::fs::read(out.join("ca.crt")).unwrap()
    );
}
