//! The RBAC the manifests grant is what the controller calls: the real `mpc controller` runs
//! through every path that talks to the API (startup without `--cluster-id`, config watch and a
//! config change, the Lease, static TaskRuns end to end on two hosts so the known-hosts ConfigMap is
//! created and then updated, a third that waits and replaces a stale Secret, a local TaskRun,
//! repeated Events from a host nothing answers on, the adopt scan, a graceful stop), the test API
//! server logs
//! each of its requests, and each is held against the ClusterRole and Role rendered by
//! `kubectl kustomize manifests`. Every request must be allowed (namespaced rules only in the
//! controller's namespace) and every granted verb used, or listed below with why it cannot be.
//! The controller runs as its ServiceAccount, with the rendered RBAC objects and admission
//! policies in the API server and its RBAC authorizer on, so every write it makes also passes
//! the policies on TaskRuns and on its Secret writes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use e2e::apiserver::KUBECONFIG_USER;
use e2e::apiserver::audit::Request;
use e2e::product::{NS, Product, static_host};
use mpc::contract;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

/// The controller's ServiceAccount, as its token names it.
const CONTROLLER: &str =
    "system:serviceaccount:multi-platform-controller:multi-platform-controller";

/// Granted `(role kind, apiGroup, resource, verb)` this scenario cannot exercise, and why.
const NOT_EXERCISED: [(&str, &str, &str, &str, &str); 0] = [];

/// One rule of a Role or ClusterRole.
#[derive(Debug, Clone)]
struct Rule {
    /// `ClusterRole` or `Role`.
    kind: String,
    groups: Vec<String>,
    resources: Vec<String>,
    names: Vec<String>,
    verbs: Vec<String>,
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .map(|s| s.as_str().expect("a string").to_owned())
        .collect()
}

/// What `kubectl kustomize manifests` renders.
fn rendered() -> Vec<Value> {
    e2e::kubectl::kustomize(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests"))
}

/// The controller's ClusterRole and Role rules in `docs`, after checking the bindings give them
/// to its ServiceAccount (the Role in its namespace).
fn rendered_rules(docs: &[Value]) -> Vec<Rule> {
    let by_key: BTreeMap<String, &Value> = docs
        .iter()
        .map(|d| {
            (
                format!(
                    "{}/{}",
                    d["kind"].as_str().unwrap(),
                    d["metadata"]["name"].as_str().unwrap()
                ),
                d,
            )
        })
        .collect();
    let mut rules = Vec::new();
    for (binding, kind) in [
        ("ClusterRoleBinding", "ClusterRole"),
        ("RoleBinding", "Role"),
    ] {
        let b = by_key[&format!("{binding}/multi-platform-controller")];
        assert_eq!(b["roleRef"]["kind"], kind);
        let subject = &b["subjects"][0];
        assert_eq!(
            (&subject["kind"], &subject["name"], &subject["namespace"]),
            (
                &json!("ServiceAccount"),
                &json!("multi-platform-controller"),
                &json!(NS)
            )
        );
        if kind == "Role" {
            assert_eq!(b["metadata"]["namespace"], NS);
        }
        let role = by_key[&format!("{kind}/{}", b["roleRef"]["name"].as_str().unwrap())];
        if kind == "Role" {
            assert_eq!(role["metadata"]["namespace"], NS);
        }
        for r in role["rules"].as_array().unwrap() {
            rules.push(Rule {
                kind: kind.to_owned(),
                groups: strings(&r["apiGroups"]),
                resources: strings(&r["resources"]),
                names: strings(&r["resourceNames"]),
                verbs: strings(&r["verbs"]),
            });
        }
    }
    rules
}

/// Whether `rule` allows `req`, as the RBAC authorizer decides: group, resource (with
/// subresource), verb, and resource names (which a request without a name never matches); a
/// Role's rules only in the controller's namespace.
fn allows(rule: &Rule, req: &Request) -> bool {
    let any = |list: &[String], v: &str| list.iter().any(|x| x == "*" || x == v);
    (rule.kind == "ClusterRole" || req.namespace.as_deref() == Some(NS))
        && any(&rule.groups, &req.group)
        && any(&rule.resources, &req.rbac_resource())
        && any(&rule.verbs, req.verb.as_str())
        && (rule.names.is_empty()
            || req
                .name
                .as_ref()
                .is_some_and(|n| rule.names.iter().any(|x| x == n)))
}

/// `(kind, group, resource, verb)` of each verb each rule grants.
fn grants(rules: &[Rule]) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    for r in rules {
        for g in &r.groups {
            for res in &r.resources {
                for v in &r.verbs {
                    out.insert((r.kind.clone(), g.clone(), res.clone(), v.clone()));
                }
            }
        }
    }
    out
}

fn describe(r: &Request) -> String {
    format!(
        "{} {}/{} ns={} name={}",
        r.verb.as_str(),
        if r.group.is_empty() { "core" } else { &r.group },
        r.rbac_resource(),
        r.namespace.as_deref().unwrap_or("(cluster)"),
        r.name.as_deref().unwrap_or("-")
    )
}

/// Runs a static TaskRun's build and waits for its cleanup.
async fn build_and_clean(p: &Product, ns: &str, name: &str) {
    p.build(ns, name).await;
    p.cleaned_up(ns, name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_calls_exactly_what_its_rbac_grants() {
    let docs = rendered();
    let rules = rendered_rules(&docs);
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1), ("h2", 1)])
        .await
        .unwrap();
    p.cluster_id = None;
    let enforced = [
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    for d in docs
        .iter()
        .filter(|d| enforced.contains(&d["kind"].as_str().unwrap()))
    {
        p.api.create(d.clone()).await.unwrap();
    }
    p.api.set_rbac(true);
    p.controller_user = CONTROLLER.to_owned();
    // Two hosts nothing answers on: provisioning fails on one, then on the other, and the
    // TaskRun's ProvisioningFailed Event repeats (a patch of its series).
    let mut cfg = p.base_config();
    for (host, address) in [("dead1", "127.0.3.252"), ("dead2", "127.0.3.253")] {
        let key = p.hosts[0].sshd.admin_key();
        p.put_secret(NS, &format!("{host}-admin"), &[("id_rsa", key.as_slice())])
            .await
            .unwrap();
        cfg.extend(static_host(host, address, 1, "linux/s390x"));
    }
    p.set_config(&cfg).await.unwrap();
    p.start_controller("c1").await.unwrap();
    p.create_taskrun("tenant-a", "rbac-dead", "linux/s390x", json!({}))
        .await
        .unwrap();

    // Two builds at once take both hosts: the first host key learned creates the known-hosts
    // ConfigMap, the second updates it.
    let names = [("tenant-a", "rbac-1"), ("tenant-b", "rbac-2")];
    for (ns, name) in names {
        p.create_taskrun(ns, name, "linux/arm64", json!({}))
            .await
            .unwrap();
        for h in &p.hosts {
            h.sshd.track_user(&contract::remote_user_name(name, ns));
        }
    }
    for (ns, name) in names {
        p.wait(T, &format!("{ns}/{name}'s secret"), || async {
            p.secret(ns, name).await.filter(|s| s.contains_key("otp"))
        })
        .await;
    }
    // A third waits for a host (an Event); a stale Secret of its name, left by an earlier TaskRun
    // of that name, is replaced when it gets one.
    p.put_secret(
        "tenant-a",
        &contract::secret_name("rbac-3"),
        &[("stale", b"1".as_slice())],
    )
    .await
    .unwrap();
    p.create_taskrun("tenant-a", "rbac-3", "linux/arm64", json!({}))
        .await
        .unwrap();
    for h in &p.hosts {
        h.sshd
            .track_user(&contract::remote_user_name("rbac-3", "tenant-a"));
    }
    p.wait(T, "both host keys learned", || async {
        (p.known_hosts().await.len() >= 2).then_some(())
    })
    .await;
    for (ns, name) in names {
        build_and_clean(&p, ns, name).await;
    }
    p.wait(T, "rbac-3's secret", || async {
        p.secret("tenant-a", "rbac-3")
            .await
            .filter(|s| s.contains_key("otp"))
    })
    .await;
    build_and_clean(&p, "tenant-a", "rbac-3").await;
    // A config change reaches the controller through its watch.
    let mut cfg = p.base_config();
    for (k, v) in &mut cfg {
        if k == "local-platforms" {
            v.push_str(",linux/x86_64");
        }
    }
    p.set_config(&cfg).await.unwrap();
    p.create_taskrun("tenant-a", "rbac-local", "linux/x86_64", json!({}))
        .await
        .unwrap();
    p.wait(T, "the local TaskRun's secret", || async {
        p.secret("tenant-a", "rbac-local")
            .await
            .filter(|s| s.get("host").is_some_and(|h| h == "localhost"))
    })
    .await;
    p.delete_taskrun("tenant-a", "rbac-local").await;
    p.wait(T, "the local TaskRun gone", || async {
        p.taskrun("tenant-a", "rbac-local")
            .await
            .is_none()
            .then_some(())
    })
    .await;
    // rbac-dead fails on one dead host, then the other: wait for that repeat's Event (a patch of
    // its series) rather than hope the scenario lasted long enough on a loaded machine.
    p.wait(
        T,
        "rbac-dead's repeated Event (its series patched)",
        || async {
            p.api
                .requests()
                .of(CONTROLLER)
                .keys()
                .any(|r| {
                    describe(r)
                        .starts_with("patch events.k8s.io/events ns=tenant-a name=rbac-dead.")
                })
                .then_some(())
        },
    )
    .await;
    // Adopt scans run every 2 s; leave time for one after the builds, then stop gracefully
    // (the Lease is released).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        p.controllers[0].terminate(Duration::from_secs(20)),
        "{}",
        p.logs()
    );

    let log = p.api.requests().of(CONTROLLER);
    let requests: BTreeSet<Request> = log.keys().cloned().collect();
    assert!(!requests.is_empty(), "the request log saw the controller");
    let mut denied = Vec::new();
    let mut used = BTreeSet::new();
    for req in &requests {
        let allowing: Vec<&Rule> = rules.iter().filter(|r| allows(r, req)).collect();
        if allowing.is_empty() {
            denied.push(describe(req));
        }
        for r in allowing {
            for g in r.groups.iter().filter(|g| **g == req.group || *g == "*") {
                for res in r
                    .resources
                    .iter()
                    .filter(|x| **x == req.rbac_resource() || *x == "*")
                {
                    used.insert((
                        r.kind.clone(),
                        g.clone(),
                        res.clone(),
                        req.verb.as_str().to_owned(),
                    ));
                }
            }
        }
    }
    let all: Vec<String> = requests.iter().map(describe).collect();
    let listed: Vec<String> = log
        .iter()
        .map(|(r, n)| format!("{} (x{n})", describe(r)))
        .collect();
    assert!(
        denied.is_empty(),
        "RBAC would refuse:\n  {}\nall requests:\n  {}",
        denied.join("\n  "),
        listed.join("\n  ")
    );
    let excused: BTreeSet<(String, String, String, String)> = NOT_EXERCISED
        .iter()
        .map(|(k, g, r, v, _)| ((*k).into(), (*g).into(), (*r).into(), (*v).into()))
        .collect();
    let unused: Vec<_> = grants(&rules)
        .into_iter()
        .filter(|g| !used.contains(g) && !excused.contains(g))
        .collect();
    assert!(
        unused.is_empty(),
        "granted but never used (drop them, or list them in NOT_EXERCISED with the reason):\n  {unused:?}\nall requests:\n  {}\n{}",
        listed.join("\n  "),
        p.logs()
    );
    for e in &excused {
        assert!(
            !used.contains(e),
            "{e:?} is used after all: drop it from NOT_EXERCISED"
        );
    }
    // What the scenario had to reach.
    for must in [
        "get core/namespaces ns=(cluster) name=kube-system",
        "update core/secrets ns=tenant-a name=multi-platform-ssh-rbac-3",
        "patch events.k8s.io/events ns=tenant-a name=rbac-dead.",
        "update core/configmaps ns=multi-platform-controller name=mpc-known-hosts",
        "create core/configmaps ns=multi-platform-controller name=-",
    ] {
        assert!(
            all.iter().any(|r| r.starts_with(must)),
            "never: {must}\n  {}",
            all.join("\n  ")
        );
    }
}

/// Acting as the controller's ServiceAccount, with the rendered RBAC and admission policies in
/// force: no Secret outside its own namespace can be read (a kube-system token Secret, or a
/// tenant's), nor a token Secret minted, while what the controller does with its TaskRuns'
/// secrets without reading them passes: learning that a name is taken from a dry-run create
/// (which stores nothing), replacing by an unconditional update, deleting.
#[tokio::test]
async fn the_controller_account_reads_no_secret_outside_its_namespace() {
    use e2e::apiserver::{ApiServer, HARNESS_USER, Options, TEKTON_CRDS};
    use k8s_openapi::api::core::v1::Secret;
    use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
    use kube::core::{ApiResource, GroupVersionKind};

    let tenant = "tenant-a";
    let mut opts = Options {
        rbac: true,
        ..Options::default()
    };
    opts.namespaces.extend([tenant, NS].map(str::to_owned));
    let s = ApiServer::start(opts).await.unwrap();
    s.create_yaml(TEKTON_CRDS).await.unwrap();
    let enforced = [
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    for d in rendered()
        .into_iter()
        .filter(|d| enforced.contains(&d["kind"].as_str().unwrap()))
    {
        s.create(d).await.unwrap();
    }
    let pp = PostParams::default();
    let admin = s.client().await.unwrap();
    let controller = s.client_as(CONTROLLER).await.unwrap();
    let as_admin = |ns: &str| Api::<Secret>::namespaced(admin.clone(), ns);
    let as_controller = |ns: &str| Api::<Secret>::namespaced(controller.clone(), ns);
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tekton.dev", "v1", "TaskRun"),
        "taskruns",
    );
    let tr: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "tekton.dev/v1", "kind": "TaskRun", "metadata": {"name": "tr"},
        "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}]}}))
    .unwrap();
    let tr = Api::<DynamicObject>::namespaced_with(
        s.client_as(HARNESS_USER).await.unwrap(),
        tenant,
        &ar,
    )
    .create(&pp, &tr)
    .await
    .unwrap();
    // Owned by the TaskRun (in its namespace: the garbage collector deletes a Secret whose
    // owner is not found there).
    let secret = |name: &str, type_: &str, data: &str, owned: bool| -> Secret {
        let mut s = json!({"apiVersion": "v1", "kind": "Secret", "type": type_,
            "metadata": {"name": name,
                "labels": {contract::MULTI_PLATFORM_SECRET_LABEL: "true"},
                "annotations": {"kubernetes.io/service-account.name": "clusterrole-aggregation-controller"}},
            "stringData": {"otp": data}});
        if owned {
            s["metadata"]["ownerReferences"] = json!([{"apiVersion": "tekton.dev/v1",
                "kind": "TaskRun", "name": "tr", "uid": tr.metadata.uid.clone().unwrap()}]);
        }
        serde_json::from_value(s).unwrap()
    };
    let refusal = |r: Result<Secret, kube::Error>| match r {
        Err(kube::Error::Api(e)) => (e.code, e.reason, e.message),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let forbidden = |verb: &str, name: &str, ns: &str| {
        (
            403,
            "Forbidden".to_owned(),
            format!(
                "secrets {name:?} is forbidden: User {CONTROLLER:?} cannot {verb} resource \"secrets\" in API group \"\" in the namespace {ns:?}"
            ),
        )
    };

    // A kube-system token Secret, and the TaskRun's secret in a tenant namespace: unreadable.
    as_admin("kube-system")
        .create(
            &pp,
            &secret(
                "root-token",
                "kubernetes.io/service-account-token",
                "t",
                false,
            ),
        )
        .await
        .unwrap();
    let r = as_controller("kube-system").get("root-token").await;
    assert_eq!(refusal(r), forbidden("get", "root-token", "kube-system"));
    let name = contract::secret_name("tr");
    as_admin(tenant)
        .create(&pp, &secret(&name, "Opaque", "tenant's", true))
        .await
        .unwrap();
    let r = as_controller(tenant).get(&name).await;
    assert_eq!(refusal(r), forbidden("get", &name, tenant));
    // Nor can it mint a token Secret to read later.
    let r = as_controller("kube-system")
        .create(
            &pp,
            &secret(
                "multi-platform-ssh-x",
                "kubernetes.io/service-account-token",
                "",
                true,
            ),
        )
        .await;
    let (code, _, message) = refusal(r);
    assert_eq!(code, 422, "{message}");
    assert!(message.contains("only writes Opaque Secrets"), "{message}");

    // Whether the name is taken, from a dry-run create: 409 when it is, nothing stored when not.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let revision = || async {
        as_admin(tenant)
            .list_metadata(&kube::api::ListParams::default())
            .await
            .unwrap()
            .metadata
            .resource_version
    };
    let before = revision().await;
    let r = as_controller(tenant)
        .create(&dry, &secret(&name, "Opaque", "", true))
        .await;
    let (code, reason, message) = refusal(r);
    assert_eq!((code, reason.as_str()), (409, "AlreadyExists"), "{message}");
    assert!(!message.contains("tenant's"));
    let free = contract::secret_name("free");
    as_controller(tenant)
        .create(&dry, &secret(&free, "Opaque", "", true))
        .await
        .unwrap();
    assert!(as_admin(tenant).get_opt(&free).await.unwrap().is_none());
    assert_eq!(
        revision().await,
        before,
        "a dry run writes nothing a watch could see"
    );
    // Replaced without reading (no resourceVersion), then deleted.
    as_controller(tenant)
        .replace(&name, &pp, &secret(&name, "Opaque", "ours", true))
        .await
        .unwrap();
    let stored = as_admin(tenant).get(&name).await.unwrap();
    assert_eq!(stored.data.unwrap()["otp"].0, b"ours");
    as_controller(tenant)
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    // Its own namespace's Secrets (admin keys, cloud credentials) stay readable.
    as_admin(NS)
        .create(&pp, &secret("h1-admin", "Opaque", "k", false))
        .await
        .unwrap();
    as_controller(NS).get("h1-admin").await.unwrap();
}

#[test]
fn allows_follows_the_rbac_authorizer() {
    let req = |verb, group: &str, resource: &str, ns: Option<&str>, name: Option<&str>| Request {
        user: KUBECONFIG_USER.into(),
        verb,
        group: group.into(),
        resource: resource.into(),
        subresource: None,
        namespace: ns.map(Into::into),
        name: name.map(Into::into),
    };
    use e2e::apiserver::Verb::{Create, Get, List, Update};
    let role = Rule {
        kind: "Role".into(),
        groups: vec![String::new()],
        resources: vec!["configmaps".into()],
        names: vec!["mpc-known-hosts".into()],
        verbs: vec!["update".into()],
    };
    let known = Some("mpc-known-hosts");
    assert!(allows(
        &role,
        &req(Update, "", "configmaps", Some(NS), known)
    ));
    // A Role's rules hold in its namespace only; resource names never match a request without a
    // name; group, resource and verb must all match.
    assert!(!allows(
        &role,
        &req(Update, "", "configmaps", Some("tenant-a"), known)
    ));
    assert!(!allows(
        &role,
        &req(Create, "", "configmaps", Some(NS), None)
    ));
    assert!(!allows(
        &role,
        &req(Update, "", "configmaps", Some(NS), Some("other"))
    ));
    assert!(!allows(
        &role,
        &req(Update, "apps", "configmaps", Some(NS), known)
    ));
    assert!(!allows(&role, &req(Update, "", "secrets", Some(NS), known)));
    assert!(!allows(&role, &req(Get, "", "configmaps", Some(NS), known)));
    let cluster = Rule {
        kind: "ClusterRole".into(),
        groups: vec![String::new()],
        resources: vec!["secrets".into()],
        names: vec![],
        verbs: vec!["get".into()],
    };
    assert!(allows(
        &cluster,
        &req(Get, "", "secrets", Some("tenant-a"), Some("s"))
    ));
    assert!(!allows(&cluster, &req(List, "", "secrets", None, None)));
    let status = Request {
        subresource: Some("status".into()),
        ..req(Update, "", "secrets", Some("tenant-a"), Some("s"))
    };
    assert_eq!(status.rbac_resource(), "secrets/status");
}
