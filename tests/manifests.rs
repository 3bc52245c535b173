//! The deployment renders with the real `kubectl kustomize` (base, the three certificate routes,
//! the example installation, monitoring), and the rendered objects hang together: names, ports,
//! mounted paths, RBAC, NetworkPolicies, certificates. The alerts pass their `promtool test rules`
//! cases; the Grafana dashboard ships as a sidecar-labelled ConfigMap and is well formed. (Their
//! metric names are checked against the running binaries in e2e/tests/monitoring.rs.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine as _;
use serde::Deserialize;
use serde_norway::{Mapping, Value};

mod support;
use support::{kubectl, promtool};

const NAMESPACE: &str = "multi-platform-controller";
const CONTROLLER: &str = "Deployment/multi-platform-controller";
const OTP: &str = "Deployment/mpc-otp-server";

/// Every kustomization in the repository, relative to its root.
const KUSTOMIZATIONS: [&str; 6] = [
    "manifests",
    "manifests/monitoring",
    "webhook-certs/mpc-certs",
    "webhook-certs/cert-manager",
    "webhook-certs/openshift",
    "examples",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
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

/// A copy of the deployment trees with the files an operator creates before applying: `mpc certs`
/// output for both services and the OTP server's secrets. Generated keys never land in the
/// checkout.
struct Staged {
    dir: tempfile::TempDir,
}

impl Staged {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        for t in ["manifests", "webhook-certs", "examples"] {
            copy_tree(&repo().join(t), &dir.path().join(t));
        }
        for service in ["webhook", "otp"] {
            mpc::certs::run(&mpc::certs::CertsArgs {
                service: format!("mpc-{service}"),
                namespace: NAMESPACE.into(),
                out: dir.path().join("webhook-certs/mpc-certs/out").join(service),
                days: 30,
                extra_sans: Vec::new(),
            })
            .unwrap();
        }
        let secrets = dir.path().join("examples/secrets");
        std::fs::write(secrets.join("otp-seal-key"), "a".repeat(64)).unwrap();
        std::fs::write(secrets.join("otp-store-token"), "store-token").unwrap();
        Self { dir }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn render(&self, rel: &str) -> Objects {
        render(&self.path(rel))
    }
}

/// Rendered objects keyed by `Kind/name`.
type Objects = BTreeMap<String, Value>;

fn render(dir: &Path) -> Objects {
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

fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map_or(&[], |q| q.as_slice())
}

fn strings(v: &Value) -> Vec<&str> {
    seq(v).iter().map(s).collect()
}

fn kinds(objects: &Objects) -> Vec<&str> {
    let mut k: Vec<&str> = objects.values().map(|o| s(&o["kind"])).collect();
    k.sort_unstable();
    k
}

fn pod_spec(o: &Objects, deployment: &str) -> Value {
    o[deployment]["spec"]["template"]["spec"].clone()
}

/// A pod's first container's `--flag=value` arguments.
fn flags(pod: &Value) -> BTreeMap<String, String> {
    strings(&pod["containers"][0]["args"])
        .iter()
        .filter_map(|a| a.strip_prefix("--")?.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Mount path → volume of a pod's first container.
fn mounts(pod: &Value) -> BTreeMap<String, Value> {
    seq(&pod["containers"][0]["volumeMounts"])
        .iter()
        .map(|m| {
            let volume = seq(&pod["volumes"])
                .iter()
                .find(|v| v["name"] == m["name"])
                .unwrap_or_else(|| panic!("no volume for {m:?}"));
            (s(&m["mountPath"]).to_owned(), volume.clone())
        })
        .collect()
}

/// The volume mounted at the directory holding `file`.
fn volume_of(pod: &Value, file: &str) -> Value {
    let dir = Path::new(file).parent().unwrap().to_str().unwrap();
    mounts(pod)
        .remove(dir)
        .unwrap_or_else(|| panic!("{file} is not in a mounted directory"))
}

fn container_ports(pod: &Value) -> BTreeMap<String, u64> {
    seq(&pod["containers"][0]["ports"])
        .iter()
        .map(|p| {
            (
                s(&p["name"]).to_owned(),
                p["containerPort"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Bytes of a Kubernetes quantity (`64Mi`) or millicores of a CPU quantity (`100m`, `1`).
fn quantity(q: &str) -> u64 {
    let (n, scale) = [("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10), ("m", 1)]
        .iter()
        .find_map(|(suffix, scale)| Some((q.strip_suffix(suffix)?, *scale)))
        .unwrap_or((q, 1000));
    n.parse::<u64>().unwrap() * scale
}

fn assert_hardened(pod: &Value, what: &str) {
    assert_eq!(
        pod["securityContext"]["runAsNonRoot"].as_bool(),
        Some(true),
        "{what}"
    );
    assert_eq!(
        s(&pod["securityContext"]["seccompProfile"]["type"]),
        "RuntimeDefault"
    );
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true), "{what}");
    assert_eq!(
        sc["allowPrivilegeEscalation"].as_bool(),
        Some(false),
        "{what}"
    );
    assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{what}");
    assert!(
        s(&c["image"]).starts_with("quay.io/"),
        "{what}: kustomize image mapping applied"
    );
    for r in ["cpu", "memory"] {
        let req = quantity(s(&c["resources"]["requests"][r]));
        let lim = quantity(s(&c["resources"]["limits"][r]));
        assert!(
            0 < req && req <= lim,
            "{what}: {r} request {req} > limit {lim}"
        );
    }
    // Probes hit the plain-HTTP admin port.
    assert_eq!(
        s(&c["readinessProbe"]["httpGet"]["port"]),
        "admin",
        "{what}"
    );
    assert_eq!(s(&c["readinessProbe"]["httpGet"]["path"]), "/readyz");
    assert_eq!(s(&c["livenessProbe"]["httpGet"]["port"]), "admin", "{what}");
    assert_eq!(s(&c["livenessProbe"]["httpGet"]["path"]), "/healthz");
    assert!(container_ports(pod).contains_key("admin"), "{what}");
}

#[test]
fn base_renders_the_controller_and_otp_server_consistently() {
    let o = Staged::new().render("manifests");
    assert_eq!(
        kinds(&o),
        [
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Deployment",
            "Deployment",
            "FlowSchema",
            "MutatingWebhookConfiguration",
            "Namespace",
            "NetworkPolicy",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Service",
            "Service",
            "ServiceAccount",
            "ServiceAccount",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding",
        ],
        "the base carries no host-config (it would overwrite a real one) and no secrets"
    );
    for (key, obj) in &o {
        let kind = s(&obj["kind"]);
        if !["Namespace", "MutatingWebhookConfiguration"].contains(&kind)
            && !kind.starts_with("Cluster")
        {
            assert_eq!(s(&obj["metadata"]["namespace"]), NAMESPACE, "{key}");
        }
    }

    let dep = &o[CONTROLLER];
    assert_eq!(dep["spec"]["replicas"].as_u64(), Some(2));
    let pod = pod_spec(&o, CONTROLLER);
    assert_hardened(&pod, "controller");
    assert_eq!(s(&pod["serviceAccountName"]), "multi-platform-controller");
    assert_eq!(strings(&pod["containers"][0]["args"])[0], "controller");
    assert_eq!(
        container_ports(&pod).keys().collect::<Vec<_>>(),
        ["admin", "webhook"]
    );
    let f = flags(&pod);
    assert_eq!(f["config-map"], mpc::contract::HOST_CONFIG_NAME);
    let lease_names: Vec<String> = rules(&o["Role/multi-platform-controller"])
        .into_iter()
        .filter(|(_, res, names, _)| res == "leases" && !names.is_empty())
        .map(|(_, _, names, _)| names)
        .collect();
    assert_eq!(
        lease_names,
        [f["lease-name"].clone()],
        "RBAC names the Lease"
    );
    assert!(
        !f.contains_key("config"),
        "host-config is watched through the API, not mounted"
    );
    assert_eq!(
        s(&volume_of(&pod, &format!("{}/tls.crt", f["cert-dir"]))["secret"]["secretName"]),
        "mpc-webhook-certs"
    );
    // The OTP CA and store token are mounted where the flags point.
    let ca = volume_of(&pod, &f["otp-ca-file"]);
    assert_eq!(s(&ca["secret"]["secretName"]), "mpc-otp-tls");
    let ca_item = &ca["secret"]["items"][0];
    assert_eq!(
        (s(&ca_item["key"]), s(&ca_item["path"])),
        ("ca.crt", file_name(&f["otp-ca-file"]))
    );
    assert_eq!(
        s(&volume_of(&pod, &f["otp-store-token-file"])["secret"]["secretName"]),
        "mpc-otp-store-token"
    );
    // Namespace and identity from the downward API.
    let env: BTreeMap<&str, &str> = seq(&pod["containers"][0]["env"])
        .iter()
        .filter_map(|e| {
            Some((
                s(&e["name"]),
                e["valueFrom"]["fieldRef"]["fieldPath"].as_str()?,
            ))
        })
        .collect();
    assert_eq!(env["MPC_NAMESPACE"], "metadata.namespace");
    assert_eq!(env["POD_NAME"], "metadata.name");
    // Every writable path is a volume.
    let m = mounts(&pod);
    assert!(m.contains_key("/tmp") && m.contains_key("/home/mpc"));

    // The OTP URL names the OTP Service, whose 443 reaches the server's HTTPS port.
    let otp_svc = &o["Service/mpc-otp"];
    assert_eq!(
        f["otp-url"],
        format!(
            "https://{}.{NAMESPACE}.svc",
            s(&otp_svc["metadata"]["name"])
        )
    );
    let otp_pod = pod_spec(&o, OTP);
    let https = &seq(&otp_svc["spec"]["ports"])[0];
    assert_eq!(https["port"].as_u64(), Some(443));
    assert_eq!(
        container_ports(&otp_pod)[s(&https["targetPort"])],
        8443,
        "443 → 8443"
    );

    // Services reach named container ports of the pods they select.
    for (svc, dep) in [
        ("Service/mpc-webhook", CONTROLLER),
        ("Service/mpc-otp", OTP),
    ] {
        let p = pod_spec(&o, dep);
        let labels = &o[dep]["spec"]["template"]["metadata"]["labels"];
        for (k, v) in o[svc]["spec"]["selector"].as_mapping().unwrap() {
            assert_eq!(&labels[s(k)], v, "{svc} selects {dep}");
        }
        let ports = container_ports(&p);
        for sp in seq(&o[svc]["spec"]["ports"]) {
            assert!(ports.contains_key(s(&sp["targetPort"])), "{svc}: {sp:?}");
        }
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
    assert_eq!(strings(&wh["admissionReviewVersions"]), ["v1"]);
    let rule = &wh["rules"][0];
    assert_eq!(strings(&rule["operations"]), ["CREATE"]);
    assert_eq!(strings(&rule["apiGroups"]), ["tekton.dev"]);
    assert_eq!(strings(&rule["apiVersions"]), ["v1", "v1beta1"]);
    assert_eq!(strings(&rule["resources"]), ["taskruns"]);
    let excluded = strings(&wh["namespaceSelector"]["matchExpressions"][0]["values"]);
    for ns in ["kube-system", NAMESPACE] {
        assert!(excluded.contains(&ns), "{ns} not excluded");
    }
    let conditions: String = seq(&wh["matchConditions"])
        .iter()
        .map(|c| s(&c["expression"]).to_owned())
        .collect();
    assert!(conditions.contains("'PLATFORM'"));
    assert!(conditions.contains(mpc::contract::TASK_TYPE_LABEL));
}

fn file_name(path: &str) -> &str {
    Path::new(path).file_name().unwrap().to_str().unwrap()
}

#[test]
fn otp_server_is_one_writer_on_its_own_volume_without_an_api_token() {
    let o = Staged::new().render("manifests");
    let dep = &o[OTP];
    assert_eq!(dep["spec"]["replicas"].as_u64(), Some(1));
    assert_eq!(s(&dep["spec"]["strategy"]["type"]), "Recreate");
    let pod = pod_spec(&o, OTP);
    assert_hardened(&pod, "otp-server");
    assert_eq!(strings(&pod["containers"][0]["args"])[0], "otp-server");

    let sa = s(&pod["serviceAccountName"]);
    assert_eq!(pod["automountServiceAccountToken"].as_bool(), Some(false));
    assert_eq!(
        o[&format!("ServiceAccount/{sa}")]["automountServiceAccountToken"].as_bool(),
        Some(false)
    );
    for (key, obj) in &o {
        if key.contains("Binding/") {
            for subject in seq(&obj["subjects"]) {
                assert_ne!(
                    s(&subject["name"]),
                    sa,
                    "{key} grants the OTP server rights"
                );
            }
        }
    }

    let f = flags(&pod);
    let ports = container_ports(&pod);
    for (flag, port) in [("listen", "https"), ("admin-listen", "admin")] {
        let addr: std::net::SocketAddr = f[flag].parse().unwrap();
        assert_eq!(u64::from(addr.port()), ports[port], "--{flag}");
    }
    let claim = volume_of(&pod, &f["db"]);
    let claim = s(&claim["persistentVolumeClaim"]["claimName"]);
    let pvc = &o[&format!("PersistentVolumeClaim/{claim}")];
    assert_eq!(strings(&pvc["spec"]["accessModes"]), ["ReadWriteOnce"]);
    assert_eq!(
        s(&volume_of(&pod, &format!("{}/tls.crt", f["tls-dir"]))["secret"]["secretName"]),
        "mpc-otp-tls"
    );
    assert_eq!(
        s(&volume_of(&pod, &f["seal-key-file"])["secret"]["secretName"]),
        "mpc-otp-seal"
    );
    // The same store token as the controller's.
    let controller = pod_spec(&o, CONTROLLER);
    assert_eq!(
        volume_of(&pod, &f["store-token-file"])["secret"],
        volume_of(&controller, &flags(&controller)["otp-store-token-file"])["secret"]
    );
    assert_eq!(
        file_name(&f["store-token-file"]),
        file_name(&flags(&controller)["otp-store-token-file"])
    );
    // Design: the TTL is a safety net that outlasts any pod start (24 h).
    assert_eq!(
        mpc::duration::parse_nonzero(&f["ttl"]).unwrap().as_secs(),
        24 * 3600
    );
}

/// Every string in `v`, recursively (keys too).
fn all_strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
    match v {
        Value::String(x) => out.push(x),
        Value::Sequence(q) => q.iter().for_each(|i| all_strings(i, out)),
        Value::Mapping(m) => m.iter().for_each(|(k, i)| {
            all_strings(k, out);
            all_strings(i, out);
        }),
        Value::Tagged(t) => all_strings(&t.value, out),
        _ => {}
    }
}

/// Paths (`a.b.0.c`) of every `namespace:` field in `v` whose value is `ns`.
fn namespace_fields(v: &Value, ns: &str, path: &str, out: &mut Vec<String>) {
    match v {
        Value::Sequence(q) => {
            for (i, item) in q.iter().enumerate() {
                namespace_fields(item, ns, &format!("{path}.{i}"), out);
            }
        }
        Value::Mapping(m) => {
            for (k, item) in m {
                let key = k.as_str().unwrap_or_default();
                if key == "namespace" && item.as_str() == Some(ns) {
                    out.push(format!("{path}.{key}"));
                }
                namespace_fields(item, ns, &format!("{path}.{key}"), out);
            }
        }
        _ => {}
    }
}

/// The CEL expressions of a ValidatingAdmissionPolicy: matchConditions, variables, validations.
fn policy_expressions(policy: &Value) -> Vec<&str> {
    ["matchConditions", "variables", "validations"]
        .iter()
        .flat_map(|k| seq(&policy["spec"][*k]))
        .map(|e| s(&e["expression"]))
        .collect()
}

#[test]
fn an_overlay_with_another_namespace_leaves_nothing_naming_the_base_namespace() {
    // tests/fixtures/namespace-overlay sets only `namespace: build-hosts`.
    let o = render(&repo().join("tests/fixtures/namespace-overlay"));
    let ns = "build-hosts";
    let pod = pod_spec(&o, CONTROLLER);
    let sa = s(&pod["serviceAccountName"]);
    assert_eq!(
        s(&o[&format!("ServiceAccount/{sa}")]["metadata"]["namespace"]),
        ns
    );
    let controller = format!("'system:serviceaccount:{ns}:{sa}'");
    for policy in [
        "ValidatingAdmissionPolicy/multi-platform-controller-taskruns",
        "ValidatingAdmissionPolicy/multi-platform-controller-secrets",
    ] {
        let exprs = policy_expressions(&o[policy]);
        let naming: Vec<&&str> = exprs
            .iter()
            .filter(|e| e.contains("system:serviceaccount:"))
            .collect();
        assert!(!naming.is_empty(), "{policy} names no ServiceAccount");
        for e in naming {
            assert!(e.contains(&controller), "{policy}: {e}");
        }
        for e in &exprs {
            assert!(
                !e.contains(&format!(":{NAMESPACE}:")) && !e.contains("$("),
                "{policy}: {e}"
            );
        }
    }
    // The webhook leaves the controller's own namespace alone, and the controller reaches the
    // OTP Service in it.
    let excluded = &seq(
        &o["MutatingWebhookConfiguration/multi-platform-controller"]["webhooks"][0]["namespaceSelector"]
            ["matchExpressions"],
    )[0];
    assert_eq!(s(&excluded["operator"]), "NotIn");
    let values = strings(&excluded["values"]);
    assert!(
        values.contains(&ns) && !values.contains(&NAMESPACE),
        "{values:?}"
    );
    assert_eq!(flags(&pod)["otp-url"], format!("https://mpc-otp.{ns}.svc"));
    // The controller's bindings still name its ServiceAccount, where it now is; the webhook's
    // Service is found there too.
    for binding in [
        "ClusterRoleBinding/multi-platform-controller",
        "RoleBinding/multi-platform-controller",
    ] {
        let subject = &seq(&o[binding]["subjects"])[0];
        assert_eq!(
            (s(&subject["name"]), s(&subject["namespace"])),
            (sa, ns),
            "{binding}"
        );
    }
    let service = &o["MutatingWebhookConfiguration/multi-platform-controller"]["webhooks"][0]["clientConfig"]
        ["service"];
    assert_eq!(s(&service["namespace"]), ns);
    assert!(o.contains_key(&format!("Service/{}", s(&service["name"]))));
    assert_nothing_names_the_base_namespace(&o);
}

/// The certificates routes follow an overlay's namespace too: the serving certificates name the
/// Services where they now are, and cert-manager injects the CA from there.
#[test]
fn the_certificate_routes_follow_an_overlays_namespace() {
    let o = render(&repo().join("tests/fixtures/namespace-overlay-cert-manager"));
    for (cert, svc) in [
        ("Certificate/mpc-webhook", "mpc-webhook"),
        ("Certificate/mpc-otp", "mpc-otp"),
    ] {
        let spec = &o[cert]["spec"];
        assert_eq!(s(&spec["commonName"]), format!("{svc}.build-hosts.svc"));
        assert_eq!(
            strings(&spec["dnsNames"]),
            [
                svc.to_owned(),
                format!("{svc}.build-hosts"),
                format!("{svc}.build-hosts.svc"),
                format!("{svc}.build-hosts.svc.cluster.local"),
            ]
        );
    }
    assert_eq!(
        s(
            &o["MutatingWebhookConfiguration/multi-platform-controller"]["metadata"]["annotations"]
                ["cert-manager.io/inject-ca-from"]
        ),
        "build-hosts/mpc-webhook"
    );
    assert_nothing_names_the_base_namespace(&o);
    let o = render(&repo().join("tests/fixtures/namespace-overlay-openshift"));
    assert_eq!(
        s(&o["ConfigMap/mpc-otp-ca"]["metadata"]["namespace"]),
        "build-hosts"
    );
    assert_nothing_names_the_base_namespace(&o);
}

/// The base's namespace name survives only as object names (the Lease among them), and no var is
/// left unresolved.
fn assert_nothing_names_the_base_namespace(o: &Objects) {
    for (key, obj) in o {
        let mut found = Vec::new();
        all_strings(obj, &mut found);
        for text in found {
            assert!(!text.contains("$(MPC_"), "{key}: unresolved var in {text}");
            for pattern in [format!(":{NAMESPACE}:"), format!(".{NAMESPACE}.svc")] {
                assert!(!text.contains(&pattern), "{key}: {text}");
            }
        }
        let mut left = Vec::new();
        namespace_fields(obj, NAMESPACE, "", &mut left);
        assert!(left.is_empty(), "{key} still names {NAMESPACE} at {left:?}");
    }
}

/// The controller's Lease requests, and only they, go to the `leader-election` priority level:
/// every verb its Role grants on leases, from its ServiceAccount, in its namespace, also under an
/// overlay that moves it.
#[test]
fn the_controllers_lease_requests_get_the_leader_election_priority_level() {
    for (dir, ns) in [
        (repo().join("manifests"), NAMESPACE),
        (
            repo().join("tests/fixtures/namespace-overlay"),
            "build-hosts",
        ),
    ] {
        let o = render(&dir);
        let fs = &o["FlowSchema/multi-platform-controller-leader-election"];
        assert_eq!(s(&fs["apiVersion"]), "flowcontrol.apiserver.k8s.io/v1");
        let spec = &fs["spec"];
        assert_eq!(
            s(&spec["priorityLevelConfiguration"]["name"]),
            "leader-election"
        );
        // After the built-in schemas for kube-system's components (system-leader-election 100,
        // workload-leader-election 200), before the catch-all ones a ServiceAccount falls into
        // (service-accounts 9000, global-default 9900).
        let precedence = spec["matchingPrecedence"].as_u64().unwrap();
        assert!((201..9000).contains(&precedence), "{precedence}");
        let pod = pod_spec(&o, CONTROLLER);
        let sa = s(&pod["serviceAccountName"]);
        let rules = seq(&spec["rules"]);
        assert_eq!(rules.len(), 1);
        let subjects = seq(&rules[0]["subjects"]);
        assert_eq!(subjects.len(), 1, "only the controller");
        let subject = &subjects[0]["serviceAccount"];
        assert_eq!((s(&subject["name"]), s(&subject["namespace"])), (sa, ns));
        assert!(rules[0]["nonResourceRules"].is_null());
        let resource_rules = seq(&rules[0]["resourceRules"]);
        assert_eq!(resource_rules.len(), 1, "leases only");
        let r = &resource_rules[0];
        assert_eq!(strings(&r["apiGroups"]), ["coordination.k8s.io"]);
        assert_eq!(strings(&r["resources"]), ["leases"]);
        assert_eq!(strings(&r["namespaces"]), [ns]);
        let granted: BTreeSet<&str> = seq(&o["Role/multi-platform-controller"]["rules"])
            .iter()
            .filter(|rule| strings(&rule["resources"]).contains(&"leases"))
            .flat_map(|rule| strings(&rule["verbs"]))
            .collect();
        let matched: BTreeSet<&str> = strings(&r["verbs"]).into_iter().collect();
        assert_eq!(granted, matched, "every Lease verb the controller uses");
    }
}

/// `(apiGroup, resource, resourceNames, verbs)` of every rule of a Role or ClusterRole.
fn rules(role: &Value) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    for r in seq(&role["rules"]) {
        for g in strings(&r["apiGroups"]) {
            for res in strings(&r["resources"]) {
                out.insert((
                    g.to_owned(),
                    res.to_owned(),
                    strings(&r["resourceNames"]).join(","),
                    strings(&r["verbs"]).join(","),
                ));
            }
        }
    }
    out
}

fn rule(g: &str, res: &str, names: &str, verbs: &str) -> (String, String, String, String) {
    (g.into(), res.into(), names.into(), verbs.into())
}

#[test]
fn no_kustomization_lets_anyone_list_or_watch_secrets_cluster_wide() {
    let staged = Staged::new();
    let mut cluster_roles = 0;
    for k in KUSTOMIZATIONS {
        for (key, obj) in staged.render(k) {
            if s(&obj["kind"]) != "ClusterRole" {
                continue;
            }
            cluster_roles += 1;
            for r in seq(&obj["rules"]) {
                let groups = strings(&r["apiGroups"]);
                let resources = strings(&r["resources"]);
                let verbs = strings(&r["verbs"]);
                let core = groups.iter().any(|g| g.is_empty() || *g == "*");
                let secrets = resources.iter().any(|x| *x == "secrets" || *x == "*");
                let reads_all = verbs.iter().any(|v| ["list", "watch", "*"].contains(v));
                assert!(
                    !(core && secrets && reads_all),
                    "{k}: {key} lists or watches Secrets cluster-wide: {r:?}"
                );
            }
        }
    }
    assert!(
        cluster_roles >= 5,
        "every overlay but monitoring has the ClusterRole"
    );
}

#[test]
fn network_policies_admit_builds_to_the_otp_port_and_metrics_only_from_monitoring() {
    let staged = Staged::new();
    for (k, monitoring) in [
        ("manifests", ("kubernetes.io/metadata.name", "monitoring")),
        (
            "webhook-certs/openshift",
            ("network.openshift.io/policy-group", "monitoring"),
        ),
    ] {
        let o = staged.render(k);
        for (policy, dep, open_port) in [
            ("NetworkPolicy/mpc-otp-server", OTP, "https"),
            (
                "NetworkPolicy/multi-platform-controller",
                CONTROLLER,
                "webhook",
            ),
        ] {
            let np = &o[policy]["spec"];
            let labels = &o[dep]["spec"]["template"]["metadata"]["labels"];
            for (key, v) in np["podSelector"]["matchLabels"].as_mapping().unwrap() {
                assert_eq!(&labels[s(key)], v, "{k}: {policy} selects {dep}");
            }
            assert_eq!(strings(&np["policyTypes"]), ["Ingress"]);
            let ingress = seq(&np["ingress"]);
            assert_eq!(ingress.len(), 2, "{k}: {policy}");
            let ports = container_ports(&pod_spec(&o, dep));
            let port_of = |r: &Value| s(&r["ports"][0]["port"]).to_owned();
            // Rule 0: the serving port, from any namespace (OTP: build pods and the
            // controller) or from anywhere (webhook: the API server is not a pod).
            assert_eq!(port_of(&ingress[0]), open_port);
            assert!(ports.contains_key(open_port));
            match seq(&ingress[0]["from"]) {
                [] => assert_eq!(open_port, "webhook", "only the webhook is open to all"),
                [peer] => {
                    assert_eq!(peer["namespaceSelector"], Value::Mapping(Mapping::new()));
                    assert!(peer.get("podSelector").is_none(), "every pod may connect");
                }
                other => panic!("{policy}: {other:?}"),
            }
            // Rule 1: the admin (metrics) port, only from the monitoring namespace.
            assert_eq!(port_of(&ingress[1]), "admin");
            let selector = &seq(&ingress[1]["from"])[0]["namespaceSelector"]["matchLabels"];
            let pairs: Vec<(&str, &str)> = selector
                .as_mapping()
                .unwrap()
                .iter()
                .map(|(a, b)| (s(a), s(b)))
                .collect();
            assert_eq!(pairs, [monitoring], "{k}: {policy}");
        }
    }
}

#[test]
fn cert_manager_route_issues_both_mounted_secrets_and_injects_the_webhook_ca() {
    let o = Staged::new().render("webhook-certs/cert-manager");
    for (cert, service, secret) in [
        ("mpc-webhook", "mpc-webhook", "mpc-webhook-certs"),
        ("mpc-otp", "mpc-otp", "mpc-otp-tls"),
    ] {
        let c = &o[&format!("Certificate/{cert}")];
        assert_eq!(s(&c["spec"]["secretName"]), secret);
        assert_eq!(
            strings(&c["spec"]["dnsNames"]),
            mpc::certs::service_sans(service, NAMESPACE)
        );
        assert!(o.contains_key(&format!("Service/{service}")));
        let issuer = s(&c["spec"]["issuerRef"]["name"]);
        let issuer = &o[&format!("Issuer/{issuer}")];
        let ca = &o[&format!("Certificate/{}", s(&issuer["spec"]["ca"]["secretName"]))];
        assert_eq!(ca["spec"]["isCA"].as_bool(), Some(true));
    }
    // cert-manager puts the issuing CA into each Secret as ca.crt, which the base mounts.
    let controller = pod_spec(&o, CONTROLLER);
    let ca = volume_of(&controller, &flags(&controller)["otp-ca-file"]);
    assert_eq!(s(&ca["secret"]["secretName"]), "mpc-otp-tls");
    let mwc = &o["MutatingWebhookConfiguration/multi-platform-controller"];
    assert_eq!(
        s(&mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]),
        format!("{NAMESPACE}/mpc-webhook")
    );
}

#[test]
fn openshift_route_uses_the_service_ca_and_gets_the_pods_admitted() {
    let o = Staged::new().render("webhook-certs/openshift");
    for (svc, secret) in [
        ("mpc-webhook", "mpc-webhook-certs"),
        ("mpc-otp", "mpc-otp-tls"),
    ] {
        assert_eq!(
            s(
                &o[&format!("Service/{svc}")]["metadata"]["annotations"]["service.beta.openshift.io/serving-cert-secret-name"]
            ),
            secret
        );
    }
    let inject = "service.beta.openshift.io/inject-cabundle";
    let mwc = &o["MutatingWebhookConfiguration/multi-platform-controller"];
    assert_eq!(s(&mwc["metadata"]["annotations"][inject]), "true");
    // The controller reads the injected service CA as its OTP CA.
    let controller = pod_spec(&o, CONTROLLER);
    let f = flags(&controller);
    let ca = volume_of(&controller, &f["otp-ca-file"]);
    assert!(ca.get("secret").is_none(), "{ca:?}");
    let cm = s(&ca["configMap"]["name"]);
    assert_eq!(
        s(&o[&format!("ConfigMap/{cm}")]["metadata"]["annotations"][inject]),
        "true"
    );
    let item = &ca["configMap"]["items"][0];
    assert_eq!(
        (s(&item["key"]), s(&item["path"])),
        ("service-ca.crt", file_name(&f["otp-ca-file"]))
    );

    // restricted-v2 assigns UIDs: the OTP server drops its fixed one; the controller (ssh needs
    // its passwd entry) keeps it and may use nonroot-v2.
    let otp = pod_spec(&o, OTP);
    for k in ["runAsUser", "runAsGroup", "fsGroup"] {
        assert!(
            otp["securityContext"].get(k).is_none(),
            "OTP pod still sets {k}"
        );
    }
    assert_eq!(otp["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_eq!(
        controller["securityContext"]["runAsUser"].as_u64(),
        Some(65532)
    );
    assert_eq!(
        s(
            &o[CONTROLLER]["spec"]["template"]["metadata"]["annotations"]["openshift.io/required-scc"]
        ),
        "nonroot-v2"
    );
    let role = &o["Role/mpc-scc-nonroot-v2"];
    assert_eq!(s(&role["metadata"]["namespace"]), NAMESPACE);
    assert_eq!(
        rules(role),
        BTreeSet::from([rule(
            "security.openshift.io",
            "securitycontextconstraints",
            "nonroot-v2",
            "use"
        )])
    );
    let binding = &o["RoleBinding/mpc-scc-nonroot-v2"];
    assert_eq!(s(&binding["roleRef"]["name"]), "mpc-scc-nonroot-v2");
    assert_eq!(
        s(&seq(&binding["subjects"])[0]["name"]),
        s(&controller["serviceAccountName"])
    );
}

fn b64(v: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(s(v).replace('\n', ""))
        .unwrap()
}

#[test]
fn mpc_certs_route_carries_the_generated_secrets_and_ca_bundle() {
    let staged = Staged::new();
    let o = staged.render("webhook-certs/mpc-certs");
    let out = staged.path("webhook-certs/mpc-certs/out");
    let read = |f: &str| std::fs::read(out.join(f)).unwrap();
    let webhook = &o["Secret/mpc-webhook-certs"];
    assert_eq!(s(&webhook["type"]), "kubernetes.io/tls");
    assert_eq!(s(&webhook["metadata"]["namespace"]), NAMESPACE);
    assert_eq!(b64(&webhook["data"]["tls.crt"]), read("webhook/tls.crt"));
    assert_eq!(b64(&webhook["data"]["tls.key"]), read("webhook/tls.key"));
    let mwc = &o["MutatingWebhookConfiguration/multi-platform-controller"];
    assert_eq!(
        b64(&mwc["webhooks"][0]["clientConfig"]["caBundle"]),
        read("webhook/ca.crt")
    );
    let otp = &o["Secret/mpc-otp-tls"];
    assert_eq!(s(&otp["metadata"]["namespace"]), NAMESPACE);
    assert_eq!(b64(&otp["data"]["tls.crt"]), read("otp/tls.crt"));
    assert_eq!(b64(&otp["data"]["ca.crt"]), read("otp/ca.crt"));
    assert_ne!(read("otp/ca.crt"), read("webhook/ca.crt"));
}

#[test]
fn example_installation_is_complete_and_its_host_config_valid() {
    let o = Staged::new().render("examples");
    // Everything a pod mounts exists in the rendered installation.
    for dep in [CONTROLLER, OTP] {
        for v in seq(&pod_spec(&o, dep)["volumes"]) {
            let wanted = if let Some(name) = v["secret"]["secretName"].as_str() {
                format!("Secret/{name}")
            } else if let Some(name) = v["configMap"]["name"].as_str() {
                format!("ConfigMap/{name}")
            } else if let Some(name) = v["persistentVolumeClaim"]["claimName"].as_str() {
                format!("PersistentVolumeClaim/{name}")
            } else {
                continue;
            };
            let obj = o
                .get(&wanted)
                .unwrap_or_else(|| panic!("{dep} mounts {wanted}, which is not rendered"));
            assert_eq!(s(&obj["metadata"]["namespace"]), NAMESPACE, "{wanted}");
            for item in seq(&v["secret"]["items"]) {
                assert!(
                    !obj["data"][s(&item["key"])].is_null(),
                    "{wanted} lacks {item:?}"
                );
            }
        }
    }
    assert_eq!(
        b64(&o["Secret/mpc-otp-store-token"]["data"]["token"]),
        b"store-token"
    );
    assert!(!o["Secret/mpc-otp-seal"]["data"]["key"].is_null());
    // Images by digest, never by a tag that can be moved to other content.
    for dep in [CONTROLLER, OTP] {
        let pod = pod_spec(&o, dep);
        for c in seq(&pod["containers"])
            .iter()
            .chain(seq(&pod["initContainers"]))
        {
            let image = s(&c["image"]);
            let digest = image.split_once("@sha256:").map(|(_, d)| d);
            assert!(
                digest.is_some_and(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit())),
                "{dep}: image {image} is not pinned by digest"
            );
        }
    }

    let cm = &o["ConfigMap/host-config"];
    assert_eq!(s(&cm["metadata"]["namespace"]), NAMESPACE);
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

/// Fills in `exp_annotations` of expected alerts from the rules, with `{{ $labels.x }}` taken
/// from `exp_labels`.
fn fill_annotations(tests: &mut Value, annotations: &BTreeMap<String, Mapping>) {
    for case in tests["tests"].as_sequence_mut().unwrap() {
        for check in case["alert_rule_test"].as_sequence_mut().unwrap() {
            let alert = s(&check["alertname"]).to_owned();
            let Some(expected) = check["exp_alerts"].as_sequence_mut() else {
                continue;
            };
            for e in expected {
                if e.get("exp_annotations").is_some() {
                    continue;
                }
                let mut filled = Mapping::new();
                for (k, v) in &annotations[&alert] {
                    let mut text = s(v).to_owned();
                    while let Some(start) = text.find("{{ $labels.") {
                        let end = start + text[start..].find(" }}").unwrap() + 3;
                        let label = &text[start + "{{ $labels.".len()..end - 3];
                        let value = s(&e["exp_labels"][label]).to_owned();
                        text.replace_range(start..end, &value);
                    }
                    assert!(
                        !text.contains("{{"),
                        "{alert}: give exp_annotations for {text}"
                    );
                    filled.insert(k.clone(), Value::String(text));
                }
                e["exp_annotations"] = Value::Mapping(filled);
            }
        }
    }
}

fn promtool_ok(args: &[&str], dir: &Path) {
    let out = Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (installed by e2e/setup.sh; MPC_PROMTOOL overrides the path)");
    assert!(
        out.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn monitoring_scrapes_both_components_and_every_alert_passes_its_promtool_cases() {
    let staged = Staged::new();
    let base = staged.render("manifests");
    let o = staged.render("manifests/monitoring");
    assert_eq!(kinds(&o), ["ConfigMap", "PrometheusRule", "ServiceMonitor"]);

    // The ServiceMonitor selects both Services by the label it uses as `job`, and scrapes their
    // metrics port, which is each pod's admin port.
    let sm = &o["ServiceMonitor/multi-platform-controller"]["spec"];
    let job_label = s(&sm["jobLabel"]);
    let selector = &seq(&sm["selector"]["matchExpressions"])[0];
    assert_eq!(
        (s(&selector["key"]), s(&selector["operator"])),
        (job_label, "In")
    );
    let jobs: BTreeSet<&str> = strings(&selector["values"]).into_iter().collect();
    let port = s(&sm["endpoints"][0]["port"]);
    for (svc, dep) in [
        ("Service/mpc-webhook", CONTROLLER),
        ("Service/mpc-otp", OTP),
    ] {
        let job = s(&base[svc]["metadata"]["labels"][job_label]);
        assert!(jobs.contains(job), "{svc} not scraped");
        let sp = seq(&base[svc]["spec"]["ports"])
            .iter()
            .find(|p| p["name"] == port)
            .unwrap_or_else(|| panic!("{svc} has no {port} port"));
        assert_eq!(s(&sp["targetPort"]), "admin", "{dep}");
    }

    // Every metric an alert names is checked against what the running binaries export in
    // e2e/tests/monitoring.rs.
    let rules = o["PrometheusRule/multi-platform-controller"]["spec"].clone();
    let mut annotations = BTreeMap::new();
    for group in seq(&rules["groups"]) {
        for r in seq(&group["rules"]) {
            let alert = s(&r["alert"]).to_owned();
            let severity = s(&r["labels"]["severity"]);
            assert!(["warning", "critical"].contains(&severity), "{alert}");
            for a in ["summary", "description"] {
                assert!(r["annotations"][a].is_string(), "{alert} lacks {a}");
            }
            annotations.insert(alert, r["annotations"].as_mapping().unwrap().clone());
        }
    }

    // Every alert has a case where it fires and one where it stays quiet.
    let mut tests: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo().join("manifests/monitoring/alerts.test.yaml")).unwrap(),
    )
    .unwrap();
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for case in seq(&tests["tests"]) {
        for check in seq(&case["alert_rule_test"]) {
            let name = s(&check["alertname"]).to_owned();
            if seq(&check["exp_alerts"]).is_empty() {
                quiet.insert(name);
            } else {
                fires.insert(name);
            }
        }
    }
    let alerts: BTreeSet<String> = annotations.keys().cloned().collect();
    assert_eq!(fires, alerts, "alerts without a firing case");
    assert_eq!(quiet, alerts, "alerts without a quiet case");
    fill_annotations(&mut tests, &annotations);

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_norway::to_string(&rules).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("alerts.test.yaml"),
        serde_norway::to_string(&tests).unwrap(),
    )
    .unwrap();
    promtool_ok(&["check", "rules", "rules.yaml"], dir.path());
    promtool_ok(&["test", "rules", "alerts.test.yaml"], dir.path());
}

/// Every panel of a dashboard, rows' collapsed panels included.
fn dashboard_panels(d: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().into_iter().flatten() {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

#[test]
fn grafana_dashboard_ships_to_the_sidecar_and_is_well_formed() {
    let o = Staged::new().render("manifests/monitoring");
    let cm = &o["ConfigMap/multi-platform-controller-dashboard"];
    assert_eq!(s(&cm["metadata"]["labels"]["grafana_dashboard"]), "1");
    let file = "grafana-dashboard.json";
    let text = std::fs::read_to_string(repo().join("manifests/monitoring").join(file)).unwrap();
    assert_eq!(s(&cm["data"][file]), text, "the ConfigMap carries the file");
    let d: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(!d["uid"].as_str().unwrap_or_default().is_empty());
    assert!(!d["title"].as_str().unwrap_or_default().is_empty());

    // One datasource variable, of Prometheus type, that every panel and query uses.
    let vars = d["templating"]["list"].as_array().unwrap();
    let ds: Vec<_> = vars.iter().filter(|v| v["type"] == "datasource").collect();
    assert_eq!(ds.len(), 1, "{vars:?}");
    assert_eq!(ds[0]["query"], "prometheus");
    let uid = format!("${{{}}}", s_json(&ds[0]["name"]));
    for v in vars.iter().filter(|v| v["type"] == "query") {
        assert_eq!(
            v["datasource"]["uid"],
            uid.as_str(),
            "variable {}",
            v["name"]
        );
    }

    let mut ids = BTreeSet::new();
    let mut cells = BTreeSet::new();
    for p in dashboard_panels(&d) {
        let title = s_json(&p["title"]);
        let id = p["id"].as_u64().unwrap_or_else(|| panic!("{title}: no id"));
        assert!(ids.insert(id), "panel id {id} used twice ({title})");
        // Panels stay on the 24-column grid and do not overlap.
        let g = &p["gridPos"];
        let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| g[k].as_u64().unwrap());
        assert!(w > 0 && h > 0 && x + w <= 24, "{title}: {g}");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(
                    cells.insert((cx, cy)),
                    "{title} overlaps another panel at {cx},{cy}"
                );
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert!(
            !s_json(&p["description"]).is_empty(),
            "{title}: no description"
        );
        assert_eq!(p["datasource"]["uid"], uid.as_str(), "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no queries");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(refs.insert(s_json(&t["refId"])), "{title}: refId twice");
            assert_eq!(t["datasource"]["uid"], uid.as_str(), "{title}");
            assert!(
                !s_json(&t["expr"]).trim().is_empty(),
                "{title}: empty query"
            );
        }
    }
}

fn s_json(v: &serde_json::Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v}"))
}
