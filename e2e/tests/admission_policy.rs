//! The admission policies and RBAC of `manifests/` (as `kubectl kustomize manifests` renders
//! them), evaluated by the test API server with real user identities: a tenant, Tekton's
//! controller, our controller's ServiceAccount and a cluster administrator.
//!
//! - TaskRuns (taskrun-policy.yaml): at CREATE the keys only the controller writes are refused
//!   and `allocation-start-time` must be the creation time, while what our real mutating webhook
//!   adds passes, and our finalizer needs the `target-platform` label (without it nobody could
//!   ever remove it); on UPDATE only the controller may change its labels, annotations and
//!   finalizer, and Tekton's controller and tenants may change everything else. A stuck
//!   finalizer is removed by a cluster administrator of any kind (an OpenShift cluster-admin is
//!   not in `system:masters`) or a member of the documented break-glass group, never by a
//!   namespace administrator.
//! - Secrets (secret-policy.yaml, rbac.yaml): the controller may write only its own
//!   `multi-platform-ssh-*` Secrets, may not read, list or watch Secrets outside its namespace,
//!   and has no rights its roles do not grant.

use std::time::{SystemTime, UNIX_EPOCH};

use e2e::apiserver::testing::TestWebhook;
use e2e::apiserver::{ApiServer, Options, TEKTON_CRDS, WebhookRule};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use mpc::contract;
use serde_json::{Value, json};

const CONTROLLER: &str =
    "system:serviceaccount:multi-platform-controller:multi-platform-controller";
const TEKTON: &str = "system:serviceaccount:tekton-pipelines:tekton-pipelines-controller";
/// A tenant's own user (not a ServiceAccount, no bindings).
const TENANT: &str = "alice@tenant-a";
/// A tenant's pipeline ServiceAccount.
const TENANT_SA: &str = "system:serviceaccount:tenant-a:pipeline";
const NS: &str = "tenant-a";

/// The documents `kubectl kustomize manifests` renders.
fn rendered() -> Vec<Value> {
    e2e::kubectl::kustomize(
        &std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests"),
    )
}

/// A server with the Tekton CRDs, the tenant and controller namespaces, and the rendered
/// documents of `kinds` created through the API.
async fn server(rbac: bool, kinds: &[&str]) -> ApiServer {
    let mut opts = Options {
        rbac,
        ..Options::default()
    };
    opts.namespaces
        .extend([NS, "multi-platform-controller"].map(str::to_owned));
    let s = ApiServer::start(opts).await.unwrap();
    s.create_yaml(TEKTON_CRDS).await.unwrap();
    let mut found = 0;
    for doc in rendered() {
        if kinds.contains(&doc["kind"].as_str().unwrap()) {
            s.create(doc).await.unwrap();
            found += 1;
        }
    }
    assert!(found > 0, "manifests/ renders none of {kinds:?}");
    s
}

async fn taskruns_as(s: &ApiServer, user: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tekton.dev", "v1", "TaskRun"),
        "taskruns",
    );
    Api::namespaced_with(s.client_as(user).await.unwrap(), NS, &ar)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn taskrun(name: &str, labels: Value, annotations: Value, finalizers: Value) -> DynamicObject {
    serde_json::from_value(json!({"apiVersion": "tekton.dev/v1", "kind": "TaskRun",
        "metadata": {"name": name, "labels": labels, "annotations": annotations,
                     "finalizers": finalizers},
        "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}]}}))
    .unwrap()
}

/// The API's refusal: (code, message).
fn refusal<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> (u16, String) {
    match r {
        Err(kube::Error::Api(s)) => (s.code, s.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn denied_by(policy: &str, resource: &str, name: &str, message: &str) -> String {
    format!(
        "{resource} {name:?} is forbidden: ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: {message}"
    )
}

const TR_POLICY: &str = "multi-platform-controller-taskruns";
const CONTROLLER_LABELS_AT_CREATE: &str = "labels build.appstudio.redhat.com/assigned-host and waiting-for-platform are written only by the multi-platform controller";
const CONTROLLER_ANNOTATIONS_AT_CREATE: &str = "annotations build.appstudio.redhat.com/cloud-instance-id, cloud-address, failed-hosts and multi-platform-proof are written only by the multi-platform controller";
const START_TIME: &str = "annotation build.appstudio.redhat.com/allocation-start-time must be the unix time of the TaskRun's creation (the multi-platform controller's webhook sets it)";
const LABELS_ON_UPDATE: &str = "only the multi-platform controller may change the labels build.appstudio.redhat.com/target-platform, assigned-host and waiting-for-platform";
const ANNOTATIONS_ON_UPDATE: &str = "only the multi-platform controller may change the annotations build.appstudio.redhat.com/cloud-instance-id, cloud-address, failed-hosts, multi-platform-proof and allocation-start-time";
const FINALIZER_ON_UPDATE: &str = "only the multi-platform controller may add or remove the finalizer appstudio.io/multi-platform-finalizer (an administrator removes a stuck one with the verb remove-multi-platform-finalizer on taskruns.tekton.dev, granted cluster-wide)";
const FINALIZER_AT_CREATE: &str = "the finalizer appstudio.io/multi-platform-finalizer needs the label build.appstudio.redhat.com/target-platform, by which the multi-platform controller finds the TaskRuns whose finalizer it removes";

/// Our real webhook (the core's review, with a static linux/arm64 host), on loopback.
async fn real_webhook(s: &ApiServer) -> TestWebhook {
    let data: mpc::config::ConfigData = [
        ("host.h1.address", "127.0.0.1"),
        ("host.h1.user", "root"),
        ("host.h1.platform", "linux/arm64"),
        ("host.h1.secret", "h1-admin"),
        ("host.h1.concurrency", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let config = mpc::config::parse(&data).config;
    let hook = TestWebhook::start(move |req| {
        let review =
            json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req});
        let reviewed =
            mpc::admission::review(&serde_json::to_vec(&review).unwrap(), &config, now()).unwrap();
        let resp: Value = serde_json::from_slice(&reviewed.response).unwrap();
        resp["response"].clone()
    })
    .await
    .unwrap();
    s.register_webhook(
        "multi-platform-controller",
        &hook.url(),
        hook.ca_pem(),
        WebhookRule::create_of("tekton.dev", "taskruns"),
    )
    .await
    .unwrap();
    hook
}

#[tokio::test]
async fn at_create_controller_keys_are_refused_and_webhook_keys_pass() {
    let s = server(
        false,
        &[
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ],
    )
    .await;
    let tekton = taskruns_as(&s, TEKTON).await;
    let tenant = taskruns_as(&s, TENANT_SA).await;
    let pp = PostParams::default();

    // The webhook is down (failurePolicy Ignore): the policy alone holds. Whoever creates the
    // TaskRun (a tenant, or Tekton's controller copying a pipeline task's metadata) cannot set
    // what only the controller writes.
    for api in [&tenant, &tekton] {
        let r = api
            .create(
                &pp,
                &taskrun(
                    "forged-host",
                    json!({contract::ASSIGNED_HOST_LABEL: "h1"}),
                    json!({}),
                    json!([]),
                ),
            )
            .await;
        assert_eq!(
            refusal(r),
            (
                422,
                denied_by(
                    TR_POLICY,
                    "taskruns.tekton.dev",
                    "forged-host",
                    CONTROLLER_LABELS_AT_CREATE
                )
            )
        );
    }
    for key in contract::CONTROLLER_ONLY_ANNOTATIONS {
        let r = tekton
            .create(
                &pp,
                &taskrun("forged-cloud", json!({}), json!({key: "x"}), json!([])),
            )
            .await;
        assert_eq!(
            refusal(r).1,
            denied_by(
                TR_POLICY,
                "taskruns.tekton.dev",
                "forged-cloud",
                CONTROLLER_ANNOTATIONS_AT_CREATE
            ),
            "{key}"
        );
    }
    let r = tenant
        .create(
            &pp,
            &taskrun(
                "forged-queue",
                json!({contract::WAITING_FOR_PLATFORM_LABEL: "linux-arm64"}),
                json!({}),
                json!([]),
            ),
        )
        .await;
    assert_eq!(
        refusal(r).1,
        denied_by(
            TR_POLICY,
            "taskruns.tekton.dev",
            "forged-queue",
            CONTROLLER_LABELS_AT_CREATE
        )
    );
    // Jumping the queue: an allocation start long before the TaskRun existed, or not a number.
    let hour_ago = (now() - 3600).to_string();
    for start in ["1", "1700000000", "soon", hour_ago.as_str()] {
        let r = tenant
            .create(
                &pp,
                &taskrun(
                    "early",
                    json!({}),
                    json!({contract::ALLOCATION_START_TIME_ANNOTATION: start}),
                    json!([]),
                ),
            )
            .await;
        assert_eq!(
            refusal(r).1,
            denied_by(TR_POLICY, "taskruns.tekton.dev", "early", START_TIME),
            "{start}"
        );
    }
    // What the webhook writes, set by hand while it is down, is what it would have written:
    // allowed (the adopt scan marks such TaskRuns the same way).
    tenant
        .create(
            &pp,
            &taskrun(
                "self-marked",
                json!({contract::TARGET_PLATFORM_LABEL: "linux-arm64", "app": "x"}),
                json!({contract::ALLOCATION_START_TIME_ANNOTATION: now().to_string()}),
                json!([contract::FINALIZER]),
            ),
        )
        .await
        .unwrap();

    // Our finalizer without the label the controller finds TaskRuns by: nobody could ever remove
    // it, so the TaskRun could never be deleted. Refused, for a tenant and for Tekton alike.
    for api in [&tenant, &tekton] {
        let r = api
            .create(
                &pp,
                &taskrun(
                    "undeletable",
                    json!({"app": "x"}),
                    json!({}),
                    json!(["example.com/mine", contract::FINALIZER]),
                ),
            )
            .await;
        assert_eq!(
            refusal(r),
            (
                422,
                denied_by(
                    TR_POLICY,
                    "taskruns.tekton.dev",
                    "undeletable",
                    FINALIZER_AT_CREATE
                )
            )
        );
    }
    // A TaskRun with none of our keys passes untouched.
    let plain = tenant
        .create(
            &pp,
            &taskrun(
                "plain",
                json!({"app": "x"}),
                json!({"team": "a"}),
                json!(["example.com/mine"]),
            ),
        )
        .await
        .unwrap();
    assert_eq!(
        plain.metadata.finalizers.unwrap_or_default(),
        ["example.com/mine"]
    );

    // With our real webhook up, the marks it adds to Tekton's TaskRun at CREATE pass the policy
    // (which runs after it); a forged key never reaches it: the webhook removes it.
    let hook = real_webhook(&s).await;
    let created = tekton
        .create(
            &pp,
            &taskrun("marked", json!({"app": "x"}), json!({}), json!([])),
        )
        .await
        .unwrap();
    assert_eq!(hook.requests().len(), 1, "the webhook was called");
    let labels = created.metadata.labels.unwrap_or_default();
    let annotations = created.metadata.annotations.unwrap_or_default();
    assert_eq!(labels[contract::TARGET_PLATFORM_LABEL], "linux-arm64");
    assert!(annotations.contains_key(contract::ALLOCATION_START_TIME_ANNOTATION));
    assert_eq!(
        created.metadata.finalizers.unwrap_or_default(),
        [contract::FINALIZER]
    );
    let r = tekton
        .create(
            &pp,
            &taskrun(
                "marked-forged",
                json!({contract::ASSIGNED_HOST_LABEL: "h1"}),
                json!({}),
                json!([]),
            ),
        )
        .await
        .expect("with the webhook up, a forged key is removed before the policy sees it");
    // Both layers: the webhook strips the controller's keys, the policy refuses what is left.
    let labels = r.metadata.labels.unwrap_or_default();
    assert!(
        !labels.contains_key(contract::ASSIGNED_HOST_LABEL),
        "{labels:?}"
    );
    assert_eq!(labels[contract::TARGET_PLATFORM_LABEL], "linux-arm64");
    // A TaskRun the webhook sees but leaves unmarked (an inline Task that mounts no
    // multi-platform secret) loses our finalizer there, so the policy has nothing to refuse.
    let mut inline = taskrun(
        "unmarked",
        json!({}),
        json!({}),
        json!([contract::FINALIZER, "example.com/mine"]),
    );
    inline.data["spec"]["taskSpec"] = json!({"steps": [{"name": "s", "image": "busybox"}]});
    let r = tenant.create(&pp, &inline).await.unwrap();
    assert_eq!(
        r.metadata.finalizers.unwrap_or_default(),
        ["example.com/mine"]
    );
    assert!(
        !r.metadata
            .labels
            .unwrap_or_default()
            .contains_key(contract::TARGET_PLATFORM_LABEL)
    );
}

/// A merge patch of metadata.
fn meta_patch(metadata: Value) -> Patch<Value> {
    Patch::Merge(json!({"metadata": metadata}))
}

#[tokio::test]
async fn on_update_only_the_controller_changes_its_keys() {
    let s = server(
        false,
        &[
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ],
    )
    .await;
    let tekton = taskruns_as(&s, TEKTON).await;
    let tenant = taskruns_as(&s, TENANT).await;
    let ours = taskruns_as(&s, CONTROLLER).await;
    let pp = PatchParams::default();
    tekton
        .create(
            &PostParams::default(),
            &taskrun(
                "tr",
                json!({contract::TARGET_PLATFORM_LABEL: "linux-arm64"}),
                json!({contract::ALLOCATION_START_TIME_ANNOTATION: now().to_string()}),
                json!([contract::FINALIZER]),
            ),
        )
        .await
        .unwrap();
    let refused = |what: &str| denied_by(TR_POLICY, "taskruns.tekton.dev", "tr", what);

    // Our controller queues the TaskRun, then assigns a host and an instance.
    ours.patch(
        "tr",
        &pp,
        &meta_patch(json!({"labels": {contract::WAITING_FOR_PLATFORM_LABEL: "linux-arm64"}})),
    )
    .await
    .unwrap();
    ours.patch(
        "tr",
        &pp,
        &meta_patch(json!({
            "labels": {contract::ASSIGNED_HOST_LABEL: "h1", contract::WAITING_FOR_PLATFORM_LABEL: null},
            "annotations": {contract::CLOUD_INSTANCE_ID_ANNOTATION: "i-1",
                            contract::CLOUD_ADDRESS_ANNOTATION: "10.0.0.1"}})),
    )
    .await
    .unwrap();

    // A tenant (and Tekton's controller, re-adding a label it read before the controller removed
    // it) may not touch any of it.
    let attempts = [
        (
            json!({"annotations": {contract::CLOUD_ADDRESS_ANNOTATION: "203.0.113.9"}}),
            ANNOTATIONS_ON_UPDATE,
        ),
        (
            json!({"annotations": {contract::CLOUD_INSTANCE_ID_ANNOTATION: null}}),
            ANNOTATIONS_ON_UPDATE,
        ),
        (
            json!({"annotations": {contract::FAILED_HOSTS_ANNOTATION: "h2"}}),
            ANNOTATIONS_ON_UPDATE,
        ),
        (
            json!({"annotations": {contract::ALLOCATION_START_TIME_ANNOTATION: "1"}}),
            ANNOTATIONS_ON_UPDATE,
        ),
        (
            json!({"annotations": {contract::ALLOCATION_PROOF_ANNOTATION: "v1:00"}}),
            ANNOTATIONS_ON_UPDATE,
        ),
        (
            json!({"labels": {contract::ASSIGNED_HOST_LABEL: "h2"}}),
            LABELS_ON_UPDATE,
        ),
        (
            json!({"labels": {contract::TARGET_PLATFORM_LABEL: null}}),
            LABELS_ON_UPDATE,
        ),
        (
            json!({"labels": {contract::WAITING_FOR_PLATFORM_LABEL: "linux-arm64"}}),
            LABELS_ON_UPDATE,
        ),
        (json!({"finalizers": []}), FINALIZER_ON_UPDATE),
    ];
    for (patch, why) in &attempts {
        for api in [&tenant, &tekton] {
            let r = api.patch("tr", &pp, &meta_patch(patch.clone())).await;
            assert_eq!(refusal(r), (422, refused(why)), "{patch}");
        }
    }
    // A JSON patch removing the finalizer, and a whole-object replace without it, too.
    let r = tenant
        .patch(
            "tr",
            &pp,
            &Patch::Json::<()>(
                serde_json::from_value(json!([{"op": "remove", "path": "/metadata/finalizers/0"}]))
                    .unwrap(),
            ),
        )
        .await;
    assert_eq!(refusal(r).1, refused(FINALIZER_ON_UPDATE));
    let mut current = tenant.get("tr").await.unwrap();
    current.metadata.finalizers = None;
    let r = tenant.replace("tr", &PostParams::default(), &current).await;
    assert_eq!(refusal(r).1, refused(FINALIZER_ON_UPDATE));

    // Everything else stays theirs: Tekton's labels and status, a tenant's own annotations.
    tekton
        .patch(
            "tr",
            &pp,
            &meta_patch(json!({"labels": {"tekton.dev/task": "build", "app": "y"}})),
        )
        .await
        .unwrap();
    tekton
        .patch_status(
            "tr",
            &pp,
            &Patch::Merge(json!({"status": {"podName": "tr-pod"}})),
        )
        .await
        .unwrap();
    tenant
        .patch(
            "tr",
            &pp,
            &meta_patch(json!({"annotations": {"team": "a"}, "finalizers": [contract::FINALIZER, "example.com/mine"]})),
        )
        .await
        .unwrap();
    let tr = tenant.get("tr").await.unwrap();
    let labels = tr.metadata.labels.clone().unwrap_or_default();
    let annotations = tr.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(labels[contract::ASSIGNED_HOST_LABEL], "h1");
    assert!(!labels.contains_key(contract::WAITING_FOR_PLATFORM_LABEL));
    assert_eq!(annotations[contract::CLOUD_ADDRESS_ANNOTATION], "10.0.0.1");
    assert_eq!(labels["app"], "y");
    assert_eq!(annotations["team"], "a");
    assert_eq!(tr.data["status"]["podName"], "tr-pod");

    // Deleting is anyone's right; our finalizer then waits for our controller, whose removal is
    // allowed; a cluster administrator removes what is left.
    tenant.delete("tr", &DeleteParams::default()).await.unwrap();
    let r = tenant
        .patch(
            "tr",
            &pp,
            &meta_patch(json!({"finalizers": ["example.com/mine"]})),
        )
        .await;
    assert_eq!(refusal(r).1, refused(FINALIZER_ON_UPDATE));
    ours.patch(
        "tr",
        &pp,
        &meta_patch(json!({"finalizers": ["example.com/mine"]})),
    )
    .await
    .unwrap();
    let admin = taskruns_as(&s, e2e::apiserver::HARNESS_USER).await;
    admin
        .patch("tr", &pp, &meta_patch(json!({"finalizers": null})))
        .await
        .unwrap();
    assert!(admin.get_opt("tr").await.unwrap().is_none());
}

/// A ClusterRole or Role of `rules`, bound (cluster-wide, or in `namespace`) to `subject`.
async fn grant(s: &ApiServer, name: &str, namespace: Option<&str>, rules: Value, subject: Value) {
    let (role, binding) = match namespace {
        None => ("ClusterRole", "ClusterRoleBinding"),
        Some(_) => ("Role", "RoleBinding"),
    };
    let meta = |n: &str| match namespace {
        None => json!({"name": n}),
        Some(ns) => json!({"name": n, "namespace": ns}),
    };
    s.create(
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": role,
        "metadata": meta(name), "rules": rules}),
    )
    .await
    .unwrap();
    s.create(
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": binding,
        "metadata": meta(name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role, "name": name},
        "subjects": [subject]}),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_stuck_finalizer_is_removed_by_cluster_administrators_and_the_documented_group_only() {
    let s = server(
        false,
        &[
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ClusterRole",
            "ClusterRoleBinding",
        ],
    )
    .await;
    // OpenShift's shape: cluster-admin is `*`, bound to the group system:cluster-admins (its
    // kubeadmin, kube:admin, is in it) and, by `oc adm policy add-cluster-role-to-user`, to
    // single users. Neither is in system:masters.
    let everything = json!([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]);
    grant(
        &s,
        "cluster-admin",
        None,
        everything.clone(),
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:cluster-admins"}),
    )
    .await;
    s.create(json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "bob-is-admin"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "bob"}]}))
        .await
        .unwrap();
    // A tenant's namespace administrator may do anything in its namespace.
    grant(
        &s,
        "tenant-admin",
        Some(NS),
        everything,
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TENANT}),
    )
    .await;
    let kubeadmin = taskruns_as(&s, "kube:admin;groups=system:cluster-admins").await;
    let bob = taskruns_as(&s, "bob").await;
    // The group the shipped ClusterRoleBinding names (taskrun-policy.yaml).
    let oncall = taskruns_as(
        &s,
        "carol;groups=multi-platform-controller-finalizer-admins",
    )
    .await;
    let tenant = taskruns_as(&s, TENANT).await;
    let tekton = taskruns_as(&s, TEKTON).await;
    let pp = PatchParams::default();
    let drop_ours = || meta_patch(json!({"finalizers": ["example.com/mine"]}));

    for (name, admin) in [("a", &kubeadmin), ("b", &bob), ("c", &oncall)] {
        tekton
            .create(
                &PostParams::default(),
                &taskrun(
                    name,
                    json!({contract::TARGET_PLATFORM_LABEL: "linux-arm64"}),
                    json!({}),
                    json!([contract::FINALIZER, "example.com/mine"]),
                ),
            )
            .await
            .unwrap();
        tenant.delete(name, &DeleteParams::default()).await.unwrap();
        // The controller is gone: the namespace administrator still cannot remove it.
        let r = tenant.patch(name, &pp, &drop_ours()).await;
        assert_eq!(
            refusal(r),
            (
                422,
                denied_by(TR_POLICY, "taskruns.tekton.dev", name, FINALIZER_ON_UPDATE)
            )
        );
        // A cluster administrator, or a member of the break-glass group, can.
        let left = admin.patch(name, &pp, &drop_ours()).await.unwrap();
        assert_eq!(
            left.metadata.finalizers.unwrap_or_default(),
            ["example.com/mine"],
            "{name}"
        );
    }

    // The break-glass group removes the finalizer, and nothing else of the controller's.
    tekton
        .create(
            &PostParams::default(),
            &taskrun(
                "live",
                json!({contract::TARGET_PLATFORM_LABEL: "linux-arm64"}),
                json!({}),
                json!([]),
            ),
        )
        .await
        .unwrap();
    let refused = |what: &str| denied_by(TR_POLICY, "taskruns.tekton.dev", "live", what);
    let r = oncall
        .patch(
            "live",
            &pp,
            &meta_patch(json!({"finalizers": [contract::FINALIZER]})),
        )
        .await;
    assert_eq!(refusal(r).1, refused(FINALIZER_ON_UPDATE), "adding it");
    let r = oncall
        .patch(
            "live",
            &pp,
            &meta_patch(json!({"labels": {contract::ASSIGNED_HOST_LABEL: "h1"}})),
        )
        .await;
    assert_eq!(refusal(r).1, refused(LABELS_ON_UPDATE));
}

/// A Secret; `owner`: the UID of a TaskRun `tr` owning it (it must exist: the API server's
/// garbage collector deletes a Secret whose owner is gone).
fn secret(name: &str, type_: &str, labelled: bool, owner: Option<&str>) -> Secret {
    let mut s = json!({"apiVersion": "v1", "kind": "Secret", "type": type_,
        "metadata": {"name": name}, "stringData": {"otp": "x"}});
    if labelled {
        s["metadata"]["labels"] = json!({contract::MULTI_PLATFORM_SECRET_LABEL: "true"});
    }
    if let Some(uid) = owner {
        s["metadata"]["ownerReferences"] =
            json!([{"apiVersion": "tekton.dev/v1", "kind": "TaskRun", "name": "tr", "uid": uid}]);
    }
    serde_json::from_value(s).unwrap()
}

const SECRET_POLICY: &str = "multi-platform-controller-secrets";

#[tokio::test]
async fn the_controller_account_writes_only_its_own_secrets() {
    let s = server(
        true,
        &[
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ClusterRole",
            "ClusterRoleBinding",
            "Role",
            "RoleBinding",
        ],
    )
    .await;
    let client = s.client_as(CONTROLLER).await.unwrap();
    let admin = s.client().await.unwrap();
    let pp = PostParams::default();
    let secrets = |ns: &str| Api::<Secret>::namespaced(client.clone(), ns);
    let tr = taskruns_as(&s, e2e::apiserver::HARNESS_USER)
        .await
        .create(&pp, &taskrun("tr", json!({}), json!({}), json!([])))
        .await
        .unwrap();
    let owner = tr.metadata.uid.as_deref();
    Api::<Secret>::namespaced(admin.clone(), "kube-system")
        .create(&pp, &secret("cloud-root", "Opaque", false, None))
        .await
        .unwrap();
    Api::<Secret>::namespaced(admin.clone(), NS)
        .create(&pp, &secret("db-password", "Opaque", false, None))
        .await
        .unwrap();

    // A service-account token Secret for a kube-system account: refused (the controller could
    // read the token back).
    let mut token = secret(
        "multi-platform-ssh-x",
        "kubernetes.io/service-account-token",
        true,
        owner,
    );
    token.metadata.annotations = Some(
        [(
            "kubernetes.io/service-account.name".to_owned(),
            "clusterrole-aggregation-controller".to_owned(),
        )]
        .into(),
    );
    let r = secrets("kube-system").create(&pp, &token).await;
    assert_eq!(
        refusal(r),
        (
            422,
            denied_by(
                SECRET_POLICY,
                "secrets",
                "multi-platform-ssh-x",
                "the multi-platform controller only writes Opaque Secrets"
            )
        )
    );
    let r = secrets("kube-system")
        .create(&pp, &secret("admin-token", "Opaque", true, owner))
        .await;
    assert_eq!(
        refusal(r).1,
        denied_by(
            SECRET_POLICY,
            "secrets",
            "admin-token",
            "the multi-platform controller only writes Secrets named multi-platform-ssh-*"
        )
    );
    // Unlabelled, or owned by nothing: refused.
    let r = secrets(NS)
        .create(&pp, &secret("multi-platform-ssh-x", "Opaque", false, owner))
        .await;
    assert_eq!(refusal(r).0, 422);
    let r = secrets(NS)
        .create(&pp, &secret("multi-platform-ssh-x", "Opaque", true, None))
        .await;
    assert_eq!(
        refusal(r).1,
        denied_by(
            SECRET_POLICY,
            "secrets",
            "multi-platform-ssh-x",
            "the multi-platform controller only writes Secrets owned by a TaskRun"
        )
    );
    // Someone else's Secret can be neither overwritten nor deleted.
    let mut theirs = Api::<Secret>::namespaced(admin.clone(), NS)
        .get("db-password")
        .await
        .unwrap();
    theirs.string_data = Some([("password".to_owned(), "mine now".to_owned())].into());
    let r = secrets(NS).replace("db-password", &pp, &theirs).await;
    assert_eq!(refusal(r).0, 422);
    let r = secrets(NS)
        .delete("db-password", &DeleteParams::default())
        .await;
    assert_eq!(
        refusal(r).1,
        denied_by(
            SECRET_POLICY,
            "secrets",
            "db-password",
            "the multi-platform controller only writes Secrets named multi-platform-ssh-*"
        )
    );

    // Secrets cannot be enumerated anywhere: RBAC refuses list and watch.
    let r = secrets("kube-system").list(&ListParams::default()).await;
    assert_eq!(
        refusal(r),
        (
            403,
            format!(
                "secrets is forbidden: User {CONTROLLER:?} cannot list resource \"secrets\" in API group \"\" in the namespace \"kube-system\""
            )
        )
    );
    let r = Api::<Secret>::all(client.clone())
        .list(&ListParams::default())
        .await;
    assert_eq!(
        refusal(r).1,
        format!(
            "secrets is forbidden: User {CONTROLLER:?} cannot list resource \"secrets\" in API group \"\" at the cluster scope"
        )
    );
    // Nothing its roles do not grant: ConfigMaps only in its own namespace.
    let r = Api::<ConfigMap>::namespaced(client.clone(), NS)
        .get("host-config")
        .await;
    assert_eq!(
        refusal(r).1,
        format!(
            "configmaps \"host-config\" is forbidden: User {CONTROLLER:?} cannot get resource \"configmaps\" in API group \"\" in the namespace \"tenant-a\""
        )
    );
    let r = Api::<ConfigMap>::namespaced(client.clone(), "multi-platform-controller")
        .get("host-config")
        .await;
    assert_eq!(refusal(r).0, 404, "allowed, and absent");
    // A tenant's user, bound to nothing, reads no Secret at all.
    let r = Api::<Secret>::namespaced(s.client_as(TENANT).await.unwrap(), NS)
        .get("db-password")
        .await;
    assert_eq!(refusal(r).0, 403);

    // Its own Secret in a tenant namespace: created, replaced, deleted.
    let mine = secrets(NS)
        .create(&pp, &secret("multi-platform-ssh-x", "Opaque", true, owner))
        .await
        .unwrap();
    let mut next = secret("multi-platform-ssh-x", "Opaque", true, owner);
    next.metadata.resource_version = mine.metadata.resource_version;
    secrets(NS)
        .replace("multi-platform-ssh-x", &pp, &next)
        .await
        .unwrap();
    secrets(NS)
        .delete("multi-platform-ssh-x", &DeleteParams::default())
        .await
        .unwrap();
    // A stale Secret of that name a tenant left behind is replaced by ours (and so becomes
    // ours), unread: the controller may not read it, and updates Secrets unconditionally.
    Api::<Secret>::namespaced(admin.clone(), NS)
        .create(&pp, &secret("multi-platform-ssh-y", "Opaque", false, None))
        .await
        .unwrap();
    let r = secrets(NS).get("multi-platform-ssh-y").await;
    assert_eq!(refusal(r).0, 403);
    secrets(NS)
        .replace(
            "multi-platform-ssh-y",
            &pp,
            &secret("multi-platform-ssh-y", "Opaque", true, owner),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_policy_naming_an_undeclared_cel_function_is_refused_when_written() {
    let s = ApiServer::start(Options::default()).await.unwrap();
    let e = s
        .create(json!({"apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy", "metadata": {"name": "p"},
            "spec": {"matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                        "operations": ["CREATE"], "resources": ["configmaps"]}]},
                     "validations": [{"expression": "object.metadata.name.noSuchFunction() == 'a'"}]}}))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("spec.validations[0].expression"),
        "{e}"
    );
}
