//! Mutating admission webhooks called over HTTPS by the test API server.

use std::time::Duration;

use e2e_apiserver::testing::TestWebhook;
use e2e_apiserver::{ApiServer, Options, TEKTON_CRDS, WebhookRule};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

async fn server() -> (ApiServer, kube::Client) {
    let s = ApiServer::start(Options::default()).await.unwrap();
    s.create_yaml(TEKTON_CRDS).await.unwrap();
    let c = s.client().await.unwrap();
    (s, c)
}

fn taskruns(client: &kube::Client, version: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("tekton.dev", version, "TaskRun"),
        "taskruns",
    );
    Api::namespaced_with(client.clone(), "default", &ar)
}

fn tr(name: &str, version: &str) -> DynamicObject {
    serde_json::from_value(json!({"apiVersion": format!("tekton.dev/{version}"), "kind": "TaskRun",
        "metadata": {"name": name}, "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}]}}))
    .unwrap()
}

fn label_patch(key: &str, value: &str) -> Value {
    json!({"allowed": true, "patch": [
        {"op": "add", "path": format!("/metadata/labels/{}", key.replace('/', "~1")), "value": value}]})
}

fn ensure_labels(req: &Value) -> Vec<Value> {
    if req["object"]["metadata"]["labels"].is_object() {
        vec![]
    } else {
        vec![json!({"op": "add", "path": "/metadata/labels", "value": {}})]
    }
}

#[tokio::test]
async fn webhook_mutates_with_json_patch_and_sees_a_full_review() {
    let (s, client) = server().await;
    let hook = TestWebhook::start(|req| {
        let mut ops = ensure_labels(req);
        ops.extend(
            label_patch("e2e.io/platform", "linux-arm64")["patch"]
                .as_array()
                .unwrap()
                .clone(),
        );
        json!({"allowed": true, "patch": ops})
    })
    .await
    .unwrap();
    s.register_webhook(
        "mpc",
        &hook.url(),
        hook.ca_pem(),
        WebhookRule::create_of("tekton.dev", "taskruns"),
    )
    .await
    .unwrap();
    let created = taskruns(&client, "v1")
        .create(&PostParams::default(), &tr("a", "v1"))
        .await
        .unwrap();
    assert_eq!(
        created.metadata.labels.unwrap()["e2e.io/platform"],
        "linux-arm64"
    );
    let reqs = hook.requests();
    assert_eq!(reqs.len(), 1);
    let r = &reqs[0];
    assert_eq!(r["operation"], "CREATE");
    assert_eq!(r["namespace"], "default");
    assert_eq!(
        r["kind"],
        json!({"group": "tekton.dev", "version": "v1", "kind": "TaskRun"})
    );
    assert!(
        r["object"]["metadata"].get("uid").is_none(),
        "admission runs before the uid is set"
    );
    // Updates are not in the rule: no call.
    taskruns(&client, "v1")
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(hook.requests().len(), 1);
}

#[tokio::test]
async fn equivalent_match_policy_converts_versions() {
    let (s, client) = server().await;
    let hook = TestWebhook::start(|req| {
        let mut ops = ensure_labels(req);
        ops.push(json!({"op": "add", "path": "/metadata/labels/seen-as", "value": req["kind"]["version"]}));
        json!({"allowed": true, "patch": ops})
    })
    .await
    .unwrap();
    let mut rule = WebhookRule::create_of("tekton.dev", "taskruns");
    rule.operations.push("UPDATE".into());
    let created = s
        .register_webhook("conv", &hook.url(), hook.ca_pem(), rule)
        .await
        .unwrap();
    // Narrow the rule to v1 only; a v1beta1 request is sent to the webhook as v1.
    let mut cfg = created.clone();
    cfg["webhooks"][0]["rules"][0]["apiVersions"] = json!(["v1"]);
    let cfgs: Api<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration> =
        Api::all(client.clone());
    cfgs.replace(
        "conv",
        &PostParams::default(),
        &serde_json::from_value(cfg).unwrap(),
    )
    .await
    .unwrap();
    let created = taskruns(&client, "v1beta1")
        .create(&PostParams::default(), &tr("b", "v1beta1"))
        .await
        .unwrap();
    assert_eq!(created.types.unwrap().api_version, "tekton.dev/v1beta1");
    assert_eq!(created.metadata.labels.unwrap()["seen-as"], "v1");
    let r = &hook.requests()[0];
    assert_eq!(r["requestKind"]["version"], "v1beta1");
    assert_eq!(r["object"]["apiVersion"], "tekton.dev/v1");
}

#[tokio::test]
async fn denial_failure_policy_and_timeouts() {
    let (s, client) = server().await;
    let deny = TestWebhook::start(
        |_| json!({"allowed": false, "status": {"code": 422, "message": "unknown platform"}}),
    )
    .await
    .unwrap();
    s.register_webhook(
        "deny",
        &deny.url(),
        deny.ca_pem(),
        WebhookRule::create_of("", "configmaps"),
    )
    .await
    .unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let c: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
    match cms.create(&PostParams::default(), &c).await {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422);
            assert!(
                e.message.contains(
                    "admission webhook \"deny.e2e.test\" denied the request: unknown platform"
                ),
                "{}",
                e.message
            );
        }
        other => panic!("{other:?}"),
    }
    let cfgs: Api<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration> =
        Api::all(client.clone());
    cfgs.delete("deny", &Default::default()).await.unwrap();

    // A webhook that is down: Fail rejects with 500, Ignore lets the request through.
    let dead_url = {
        let h = TestWebhook::start(|_| json!({"allowed": true}))
            .await
            .unwrap();
        (h.url(), h.ca_pem().to_owned())
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.register_webhook(
        "down",
        &dead_url.0,
        &dead_url.1,
        WebhookRule::create_of("", "configmaps"),
    )
    .await
    .unwrap();
    match cms.create(&PostParams::default(), &c).await {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 500);
            assert!(
                e.message
                    .contains("failed calling webhook \"down.e2e.test\""),
                "{}",
                e.message
            );
        }
        other => panic!("{other:?}"),
    }
    cfgs.patch(
        "down",
        &PatchParams::default(),
        &Patch::Json::<()>(
            serde_json::from_value(json!([
        {"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Ignore"}]))
            .unwrap(),
        ),
    )
    .await
    .unwrap();
    cms.create(&PostParams::default(), &c).await.unwrap();
    cfgs.delete("down", &Default::default()).await.unwrap();

    // A slow webhook hits timeoutSeconds.
    let slow = TestWebhook::start(|_| json!({"allowed": true}))
        .await
        .unwrap();
    slow.set_delay(Duration::from_secs(3));
    let mut rule = WebhookRule::create_of("", "configmaps");
    rule.timeout_seconds = 1;
    s.register_webhook("slow", &slow.url(), slow.ca_pem(), rule)
        .await
        .unwrap();
    let t = std::time::Instant::now();
    let c2: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "y"}})).unwrap();
    match cms.create(&PostParams::default(), &c2).await {
        Err(kube::Error::Api(e)) => assert!(
            e.message.contains("context deadline exceeded"),
            "{}",
            e.message
        ),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(slow.requests().len() == 1);
}

#[tokio::test]
async fn wrong_ca_bundle_fails_tls_verification() {
    let (s, client) = server().await;
    let hook = TestWebhook::start(|_| json!({"allowed": true}))
        .await
        .unwrap();
    let other = TestWebhook::start(|_| json!({"allowed": true}))
        .await
        .unwrap();
    s.register_webhook(
        "tls",
        &hook.url(),
        other.ca_pem(),
        WebhookRule::create_of("", "configmaps"),
    )
    .await
    .unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(client, "default");
    let c: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "x"}})).unwrap();
    assert!(cms.create(&PostParams::default(), &c).await.is_err());
    assert!(hook.requests().is_empty());
}

#[tokio::test]
async fn selectors_and_match_conditions_filter_calls() {
    let (s, client) = server().await;
    let hook = TestWebhook::start(|_| json!({"allowed": true}))
        .await
        .unwrap();
    let mut rule = WebhookRule::create_of("tekton.dev", "taskruns");
    rule.object_selector = Some(
        json!({"matchExpressions": [{"key": "build.appstudio.redhat.com/task-type", "operator": "DoesNotExist"}]}),
    );
    rule.namespace_selector =
        Some(json!({"matchLabels": {"kubernetes.io/metadata.name": "default"}}));
    rule.match_conditions = vec![
        "has(object.spec.params) && object.spec.params.exists(p, p.name == 'PLATFORM')".into(),
    ];
    s.register_webhook("sel", &hook.url(), hook.ca_pem(), rule)
        .await
        .unwrap();
    let api = taskruns(&client, "v1");
    api.create(&PostParams::default(), &tr("with-platform", "v1"))
        .await
        .unwrap();
    assert_eq!(hook.requests().len(), 1);
    let mut internal = tr("internal", "v1");
    internal.metadata.labels = Some(
        [(
            "build.appstudio.redhat.com/task-type".to_owned(),
            "x".to_owned(),
        )]
        .into(),
    );
    api.create(&PostParams::default(), &internal).await.unwrap();
    let no_platform: DynamicObject =
        serde_json::from_value(json!({"apiVersion": "tekton.dev/v1", "kind": "TaskRun",
        "metadata": {"name": "plain"}, "spec": {"params": [{"name": "OTHER", "value": "x"}]}}))
        .unwrap();
    api.create(&PostParams::default(), &no_platform)
        .await
        .unwrap();
    assert_eq!(
        hook.requests().len(),
        1,
        "object selector and match condition excluded the others"
    );
    // An expression naming a function CEL does not have is refused when registered.
    let mut bad = WebhookRule::create_of("tekton.dev", "taskruns");
    bad.match_conditions = vec!["object.metadata.name.noSuchFunction() == 'a'".into()];
    let e = s
        .register_webhook("bad", &hook.url(), hook.ca_pem(), bad)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("matchConditions"), "{e}");
}

#[tokio::test]
async fn if_needed_webhooks_are_reinvoked_after_later_changes() {
    let (s, client) = server().await;
    // "a-first" copies label x to label y (IfNeeded); "b-second" sets x afterwards.
    let first = TestWebhook::start(|req| {
        let x = req["object"]["metadata"]["labels"]["x"].clone();
        let mut ops = ensure_labels(req);
        if x.is_string() {
            ops.push(json!({"op": "add", "path": "/metadata/labels/y", "value": x}));
        }
        json!({"allowed": true, "patch": ops})
    })
    .await
    .unwrap();
    let second = TestWebhook::start(|req| {
        let mut ops = ensure_labels(req);
        ops.push(json!({"op": "add", "path": "/metadata/labels/x", "value": "set"}));
        json!({"allowed": true, "patch": ops})
    })
    .await
    .unwrap();
    let mut r1 = WebhookRule::create_of("tekton.dev", "taskruns");
    r1.reinvocation_policy = "IfNeeded".into();
    s.register_webhook("a-first", &first.url(), first.ca_pem(), r1)
        .await
        .unwrap();
    s.register_webhook(
        "b-second",
        &second.url(),
        second.ca_pem(),
        WebhookRule::create_of("tekton.dev", "taskruns"),
    )
    .await
    .unwrap();
    let created = taskruns(&client, "v1")
        .create(&PostParams::default(), &tr("r", "v1"))
        .await
        .unwrap();
    let labels = created.metadata.labels.unwrap();
    assert_eq!(labels["x"], "set");
    assert_eq!(
        labels["y"], "set",
        "the IfNeeded webhook ran again and saw x"
    );
    assert_eq!(first.requests().len(), 2);
    assert_eq!(second.requests().len(), 1);
}

fn service_webhook_config(ca_pem: &str) -> Value {
    use base64::Engine;
    json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "svc"}, "webhooks": [{"name": "svc.e2e.test", "sideEffects": "None",
        "admissionReviewVersions": ["v1"], "failurePolicy": "Fail",
        "clientConfig": {"service": {"namespace": "mpc", "name": "mpc-webhook", "path": "/mutate"},
                         "caBundle": base64::engine::general_purpose::STANDARD.encode(ca_pem)},
        "rules": [{"operations": ["CREATE"], "apiGroups": ["tekton.dev"], "apiVersions": ["v1"], "resources": ["taskruns"]}]}]})
}

fn label_via(req: &Value) -> Value {
    let mut ops = ensure_labels(req);
    ops.push(json!({"op": "add", "path": "/metadata/labels/via", "value": "service"}));
    json!({"allowed": true, "patch": ops})
}

#[tokio::test]
async fn service_references_route_to_mapped_addresses() {
    let (s, client) = server().await;
    let hook = TestWebhook::start_with_names(&["mpc-webhook.mpc.svc"], label_via)
        .await
        .unwrap();
    s.map_service("mpc", "mpc-webhook", 443, hook.addr());
    s.create(service_webhook_config(hook.ca_pem()))
        .await
        .unwrap();
    let created = taskruns(&client, "v1")
        .create(&PostParams::default(), &tr("svc", "v1"))
        .await
        .unwrap();
    assert_eq!(created.metadata.labels.unwrap()["via"], "service");
    assert!(hook.requests()[0]["uid"].is_string());
}

#[tokio::test]
async fn service_certificate_must_name_the_service() {
    let (s, client) = server().await;
    // A certificate for 127.0.0.1 only: TLS verification against mpc-webhook.mpc.svc fails, as
    // it would in a cluster.
    let hook = TestWebhook::start(label_via).await.unwrap();
    s.map_service("mpc", "mpc-webhook", 443, hook.addr());
    s.create(service_webhook_config(hook.ca_pem()))
        .await
        .unwrap();
    let e = taskruns(&client, "v1")
        .create(&PostParams::default(), &tr("svc", "v1"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("failed calling webhook"), "{e}");
    assert!(hook.requests().is_empty());
}
