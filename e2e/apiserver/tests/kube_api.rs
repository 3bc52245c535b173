//! API semantics through kube-rs: optimistic concurrency, patches, finalizers, garbage
//! collection, pagination, selectors, namespaces, CRDs with a status subresource, both Event
//! APIs, and fault injection.

use std::time::Duration;

use e2e_apiserver::testing::eventually;
use e2e_apiserver::{ApiServer, Options, RequestMatch, TEKTON_CRDS, Verb};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, PropagationPolicy,
};
use kube::core::ApiResource;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(10);

async fn server() -> (ApiServer, kube::Client) {
    let s = ApiServer::start(Options::default()).await.unwrap();
    let c = s.client().await.unwrap();
    (s, c)
}

fn cm(v: Value) -> ConfigMap {
    serde_json::from_value(v).unwrap()
}

fn api_code<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> (u16, String) {
    match r {
        Err(kube::Error::Api(e)) => (e.code, e.reason),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn stale_update_is_409_conflict() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let created = api
        .create(
            &PostParams::default(),
            &cm(json!({"metadata": {"name": "c"}, "data": {"a": "1"}})),
        )
        .await
        .unwrap();
    assert!(created.metadata.uid.is_some() && created.metadata.creation_timestamp.is_some());
    let mut first = created.clone();
    first.data = Some([("a".to_owned(), "2".to_owned())].into());
    let updated = api
        .replace("c", &PostParams::default(), &first)
        .await
        .unwrap();
    assert_ne!(
        updated.metadata.resource_version,
        created.metadata.resource_version
    );
    let mut stale = created.clone();
    stale.data = Some([("a".to_owned(), "3".to_owned())].into());
    assert_eq!(
        api_code(api.replace("c", &PostParams::default(), &stale).await),
        (409, "Conflict".into())
    );
    assert_eq!(api.get("c").await.unwrap().data.unwrap()["a"], "2");
    // Same name again.
    let dup = api
        .create(
            &PostParams::default(),
            &cm(json!({"metadata": {"name": "c"}})),
        )
        .await;
    assert_eq!(api_code(dup), (409, "AlreadyExists".into()));
    assert_eq!(api_code(api.get("nope").await), (404, "NotFound".into()));
}

#[tokio::test]
async fn merge_json_and_strategic_patches() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &cm(json!({"metadata": {"name": "p", "labels": {"a": "1"}, "finalizers": ["x.io/f"]}, "data": {"k": "v"}})))
        .await
        .unwrap();
    let pp = PatchParams::default();
    let m = api
        .patch(
            "p",
            &pp,
            &Patch::Merge(json!({"data": {"k": null, "n": "1"}})),
        )
        .await
        .unwrap();
    assert_eq!(m.data.unwrap(), [("n".to_owned(), "1".to_owned())].into());
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/labels/a", "value": "1"},
        {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"}
    ]))
    .unwrap();
    let j = api.patch("p", &pp, &Patch::<()>::Json(ops)).await.unwrap();
    assert_eq!(j.metadata.labels.unwrap()["b/c"], "2");
    let failing: json_patch::Patch = serde_json::from_value(
        json!([{"op": "test", "path": "/metadata/labels/a", "value": "nope"}]),
    )
    .unwrap();
    assert_eq!(
        api_code(api.patch("p", &pp, &Patch::<()>::Json(failing)).await).0,
        422
    );
    // Strategic merge unions finalizers (merge strategy) instead of replacing the list.
    let s = api
        .patch(
            "p",
            &pp,
            &Patch::Strategic(json!({"metadata": {"finalizers": ["y.io/g"]}})),
        )
        .await
        .unwrap();
    assert_eq!(s.metadata.finalizers.unwrap(), ["x.io/f", "y.io/g"]);
    // A patch carrying a stale resourceVersion is a precondition: 409.
    let stale = api
        .patch(
            "p",
            &pp,
            &Patch::Merge(json!({"metadata": {"resourceVersion": "1"}})),
        )
        .await;
    assert_eq!(api_code(stale).0, 409);
    api.patch(
        "p",
        &pp,
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn finalizers_hold_deletion_until_removed() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    api.create(
        &PostParams::default(),
        &cm(json!({"metadata": {"name": "f", "finalizers": ["e2e.io/hold"]}})),
    )
    .await
    .unwrap();
    let r = api.delete("f", &DeleteParams::default()).await.unwrap();
    let pending = r.left().expect("pending deletion returns the object");
    assert!(pending.metadata.deletion_timestamp.is_some());
    assert!(
        api.get("f")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );
    let add = api
        .patch(
            "f",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["e2e.io/hold", "e2e.io/more"]}})),
        )
        .await;
    assert_eq!(api_code(add).0, 422, "no new finalizers once deleting");
    api.patch(
        "f",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": []}})),
    )
    .await
    .unwrap();
    assert_eq!(api_code(api.get("f").await).0, 404);
    // Without finalizers deletion is immediate and answers a Status.
    api.create(
        &PostParams::default(),
        &cm(json!({"metadata": {"name": "g"}})),
    )
    .await
    .unwrap();
    assert!(
        api.delete("g", &DeleteParams::default())
            .await
            .unwrap()
            .is_right()
    );
}

fn owned(name: &str, owner: &ConfigMap, block: bool) -> ConfigMap {
    cm(json!({"metadata": {"name": name, "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": owner.metadata.name, "uid": owner.metadata.uid,
        "blockOwnerDeletion": block}]}}))
}

#[tokio::test]
async fn garbage_collection_background_foreground_orphan() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let pp = PostParams::default();
    // Background: the owner goes at once, the dependent follows.
    let o = api
        .create(&pp, &cm(json!({"metadata": {"name": "owner-b"}})))
        .await
        .unwrap();
    api.create(&pp, &owned("dep-b", &o, false)).await.unwrap();
    api.delete("owner-b", &DeleteParams::background())
        .await
        .unwrap();
    eventually(T, "dep-b collected", || async {
        api.get_opt("dep-b").await.unwrap().is_none().then_some(())
    })
    .await;
    // Foreground: the owner waits (foregroundDeletion finalizer) until blocking dependents are gone.
    let o = api
        .create(&pp, &cm(json!({"metadata": {"name": "owner-f"}})))
        .await
        .unwrap();
    api.create(&pp, &cm(json!({"metadata": {"name": "dep-f", "finalizers": ["e2e.io/slow"], "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner-f", "uid": o.metadata.uid, "blockOwnerDeletion": true}]}})))
        .await
        .unwrap();
    let r = api
        .delete("owner-f", &DeleteParams::foreground())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert!(
        r.metadata
            .finalizers
            .unwrap()
            .contains(&"foregroundDeletion".to_owned())
    );
    eventually(T, "dep-f being deleted", || async {
        api.get("dep-f")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .map(|_| ())
    })
    .await;
    assert!(
        api.get_opt("owner-f").await.unwrap().is_some(),
        "owner blocked by its dependent"
    );
    api.patch(
        "dep-f",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    eventually(T, "owner-f gone", || async {
        api.get_opt("owner-f")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    // Orphan: the dependent stays and loses its owner reference.
    let o = api
        .create(&pp, &cm(json!({"metadata": {"name": "owner-o"}})))
        .await
        .unwrap();
    api.create(&pp, &owned("dep-o", &o, false)).await.unwrap();
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Orphan),
        ..Default::default()
    };
    api.delete("owner-o", &dp).await.unwrap();
    eventually(T, "owner-o gone", || async {
        api.get_opt("owner-o")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let d = api.get("dep-o").await.unwrap();
    assert!(d.metadata.owner_references.unwrap_or_default().is_empty());
}

#[tokio::test]
async fn pagination_is_a_consistent_snapshot() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    for i in 0..10 {
        api.create(&PostParams::default(), &cm(json!({"metadata": {"name": format!("c{i:02}"), "labels": {"even": (i % 2 == 0).to_string()}}})))
            .await
            .unwrap();
    }
    let first = api.list(&ListParams::default().limit(4)).await.unwrap();
    assert_eq!(first.items.len(), 4);
    assert_eq!(first.metadata.remaining_item_count, Some(6));
    // Changes after the first page do not show up in later pages of the same list.
    api.delete("c09", &DeleteParams::default()).await.unwrap();
    api.create(
        &PostParams::default(),
        &cm(json!({"metadata": {"name": "c99"}})),
    )
    .await
    .unwrap();
    let mut names: Vec<String> = first
        .items
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    let mut cont = first.metadata.continue_;
    while let Some(c) = cont.filter(|c| !c.is_empty()) {
        let page = api
            .list(&ListParams::default().limit(4).continue_token(&c))
            .await
            .unwrap();
        assert_eq!(
            page.metadata.resource_version,
            first.metadata.resource_version
        );
        names.extend(page.items.iter().map(|c| c.metadata.name.clone().unwrap()));
        cont = page.metadata.continue_;
    }
    assert_eq!(
        names,
        (0..10).map(|i| format!("c{i:02}")).collect::<Vec<_>>()
    );
    let even = api
        .list(&ListParams::default().labels("even=true"))
        .await
        .unwrap();
    assert_eq!(even.items.len(), 5);
    let notin = api
        .list(&ListParams::default().labels("even notin (true),!missing"))
        .await
        .unwrap();
    assert_eq!(notin.items.len(), 5, "c01..c07 odd plus c99 (no label)");
    let by_name = api
        .list(&ListParams::default().fields("metadata.name=c03"))
        .await
        .unwrap();
    assert_eq!(by_name.items.len(), 1);
    let bad = api.list(&ListParams::default().fields("spec.nope=1")).await;
    assert_eq!(api_code(bad).0, 400);
    let all: Api<ConfigMap> = Api::all(api.clone().into_client());
    assert_eq!(
        all.list(&ListParams::default().fields("metadata.namespace=default"))
            .await
            .unwrap()
            .items
            .len(),
        10
    );
}

#[tokio::test]
async fn namespaces_gate_creation_and_terminate() {
    let (_s, client) = server().await;
    let nss: Api<Namespace> = Api::all(client.clone());
    let missing: Api<ConfigMap> = Api::namespaced(client.clone(), "team-a");
    assert_eq!(
        api_code(
            missing
                .create(
                    &PostParams::default(),
                    &cm(json!({"metadata": {"name": "x"}}))
                )
                .await
        )
        .0,
        404
    );
    let ns = nss
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "team-a"}})).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        ns.metadata.labels.unwrap()["kubernetes.io/metadata.name"],
        "team-a"
    );
    missing
        .create(
            &PostParams::default(),
            &cm(json!({"metadata": {"name": "x", "finalizers": ["e2e.io/f"]}})),
        )
        .await
        .unwrap();
    nss.delete("team-a", &DeleteParams::default())
        .await
        .unwrap();
    let n = nss.get("team-a").await.unwrap();
    assert_eq!(n.status.unwrap().phase.as_deref(), Some("Terminating"));
    let denied = missing
        .create(
            &PostParams::default(),
            &cm(json!({"metadata": {"name": "y"}})),
        )
        .await;
    assert_eq!(api_code(denied).0, 403);
    eventually(T, "content deletion", || async {
        missing
            .get("x")
            .await
            .ok()?
            .metadata
            .deletion_timestamp
            .map(|_| ())
    })
    .await;
    missing
        .patch(
            "x",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    eventually(T, "namespace gone", || async {
        nss.get_opt("team-a").await.unwrap().is_none().then_some(())
    })
    .await;
}

#[tokio::test]
async fn crd_resources_versions_and_status_subresource() {
    let (s, client) = server().await;
    s.create_yaml(TEKTON_CRDS).await.unwrap();
    let v1 = ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("tekton.dev", "v1", "TaskRun"),
        "taskruns",
    );
    let v1b1 = ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("tekton.dev", "v1beta1", "TaskRun"),
        "taskruns",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &v1);
    let old: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &v1b1);
    let tr: DynamicObject = serde_json::from_value(json!({"apiVersion": "tekton.dev/v1", "kind": "TaskRun",
        "metadata": {"generateName": "tr-"}, "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}]},
        "status": {"ignored": true}})).unwrap();
    let created = api.create(&PostParams::default(), &tr).await.unwrap();
    let name = created.metadata.name.clone().unwrap();
    assert!(name.starts_with("tr-") && name.len() == 8);
    assert!(
        created.data.get("status").is_none(),
        "status is dropped on create"
    );
    assert_eq!(created.metadata.generation, Some(1));
    let seen_old = old.get(&name).await.unwrap();
    assert_eq!(seen_old.types.unwrap().api_version, "tekton.dev/v1beta1");
    let pp = PatchParams::default();
    let st = api
        .patch_status(
            &name,
            &pp,
            &Patch::Merge(json!({"spec": {"x": 1}, "status": {"podName": "p"}})),
        )
        .await
        .unwrap();
    assert_eq!(st.data["status"]["podName"], "p");
    assert!(
        st.data["spec"].get("x").is_none(),
        "status writes ignore spec"
    );
    assert_eq!(st.metadata.generation, Some(1));
    let main = api
        .patch(
            &name,
            &pp,
            &Patch::Merge(json!({"spec": {"x": 1}, "status": {"podName": "q"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        main.data["status"]["podName"], "p",
        "main writes ignore status"
    );
    assert_eq!(main.metadata.generation, Some(2));
    // Custom resources refuse strategic merge and an update without resourceVersion.
    assert_eq!(
        api_code(
            api.patch(&name, &pp, &Patch::Strategic(json!({"spec": {}})))
                .await
        )
        .0,
        415
    );
    let mut no_rv = main.clone();
    no_rv.metadata.resource_version = None;
    assert_eq!(
        api_code(api.replace(&name, &PostParams::default(), &no_rv).await).0,
        422
    );
    // Deleting the CRD deletes its resources, then the resource type disappears.
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> = Api::all(client.clone());
    crds.delete("taskruns.tekton.dev", &DeleteParams::default())
        .await
        .unwrap();
    eventually(T, "CRD gone", || async {
        crds.get_opt("taskruns.tekton.dev")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    assert_eq!(api_code(api.get(&name).await).0, 404);
}

#[tokio::test]
async fn core_and_events_v1_share_storage() {
    let (_s, client) = server().await;
    let core: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), "default");
    let ev: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), "default");
    let e: k8s_openapi::api::events::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "e1"}, "eventTime": "2025-01-01T00:00:00.000000Z", "reason": "Allocated",
        "note": "host picked", "type": "Normal", "action": "Allocate", "reportingController": "mpc", "reportingInstance": "mpc-0",
        "regarding": {"kind": "TaskRun", "name": "tr", "namespace": "default"}})).unwrap();
    ev.create(&PostParams::default(), &e).await.unwrap();
    let c = core.get("e1").await.unwrap();
    assert_eq!(c.message.as_deref(), Some("host picked"));
    assert_eq!(c.involved_object.name.as_deref(), Some("tr"));
    let sel = core
        .list(&ListParams::default().fields("involvedObject.name=tr,reason=Allocated"))
        .await
        .unwrap();
    assert_eq!(sel.items.len(), 1);
}

#[tokio::test]
async fn secrets_string_data_and_dry_run() {
    let (_s, client) = server().await;
    let api: Api<Secret> = Api::namespaced(client, "default");
    let s: Secret = serde_json::from_value(
        json!({"metadata": {"name": "s"}, "stringData": {"host": "u@127.0.0.1"}}),
    )
    .unwrap();
    let dry = api
        .create(
            &PostParams {
                dry_run: true,
                ..Default::default()
            },
            &s,
        )
        .await
        .unwrap();
    assert_eq!(dry.data.unwrap()["host"].0, b"u@127.0.0.1");
    assert!(
        api.get_opt("s").await.unwrap().is_none(),
        "dry run persists nothing"
    );
    let created = api.create(&PostParams::default(), &s).await.unwrap();
    assert_eq!(created.type_.as_deref(), Some("Opaque"));
    assert!(created.string_data.is_none());
}

#[tokio::test]
async fn injected_faults_surface_as_api_errors() {
    let (s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    s.faults()
        .fail_next(RequestMatch::on(Verb::Create, "configmaps"), 500, 1);
    let c = cm(json!({"metadata": {"name": "x"}}));
    assert_eq!(
        api_code(api.create(&PostParams::default(), &c).await).0,
        500
    );
    api.create(&PostParams::default(), &c).await.unwrap();
    s.faults().fail_next(
        RequestMatch::on(Verb::Patch, "configmaps").named("x"),
        409,
        1,
    );
    let p = api
        .patch(
            "x",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": "1"}})),
        )
        .await;
    assert_eq!(api_code(p).0, 409);
    // kube-rs's default client retries 429 (with its own backoff): the caller sees success.
    s.faults()
        .fail_next(RequestMatch::on(Verb::Get, "configmaps"), 429, 1);
    api.get("x").await.unwrap();
    s.faults().add_latency(
        RequestMatch::on(Verb::Get, "configmaps"),
        Duration::from_millis(300),
    );
    let t = std::time::Instant::now();
    api.get("x").await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert_eq!(s.faults().injected(), 3);
}

/// Waits until the garbage collector has handled everything written before: a dependent of a
/// missing owner is collected, twice (the second proves the pass that saw earlier writes ended).
async fn gc_settled(api: &Api<ConfigMap>) {
    for n in 0..2 {
        let name = format!("gc-barrier-{n}");
        api.create(&PostParams::default(), &cm(json!({"metadata": {"name": name, "ownerReferences": [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": "nobody", "uid": "00000000-0000-4000-8000-000000000000"}]}})))
            .await
            .unwrap();
        eventually(T, "barrier collected", || async {
            api.get_opt(&name).await.unwrap().is_none().then_some(())
        })
        .await;
    }
}

fn refs_of(c: &ConfigMap) -> Vec<String> {
    c.metadata
        .owner_references
        .iter()
        .flatten()
        .map(|r| format!("{}/{}/{}", r.kind, r.name, r.uid))
        .collect()
}

#[tokio::test]
async fn garbage_collector_matches_owners_by_kind_name_namespace_and_uid() {
    let (_s, client) = server().await;
    let pp = PostParams::default();
    let nss: Api<Namespace> = Api::all(client.clone());
    nss.create(
        &pp,
        &serde_json::from_value(json!({"metadata": {"name": "other"}})).unwrap(),
    )
    .await
    .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let elsewhere: Api<ConfigMap> = Api::namespaced(client.clone(), "other");
    let secrets: Api<Secret> = Api::namespaced(client, "default");
    let owner = api
        .create(&pp, &cm(json!({"metadata": {"name": "owner"}})))
        .await
        .unwrap();
    let uid = owner.metadata.uid.clone().unwrap();
    let other_uid = elsewhere
        .create(&pp, &cm(json!({"metadata": {"name": "owner"}})))
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let reference = |kind: &str, uid: &str| json!({"apiVersion": "v1", "kind": kind, "name": "owner", "uid": uid});
    // The uid exists, but the reference names another kind: no such owner.
    secrets
        .create(
            &pp,
            &serde_json::from_value(json!({"metadata": {"name": "wrong-kind",
                "ownerReferences": [reference("Secret", &uid)]}}))
            .unwrap(),
        )
        .await
        .unwrap();
    // The owner lives in another namespace: not an owner of a namespaced dependent.
    api.create(
        &pp,
        &cm(json!({"metadata": {"name": "wrong-namespace",
        "ownerReferences": [reference("ConfigMap", &other_uid)]}})),
    )
    .await
    .unwrap();
    // One live owner and one in another namespace: the dependent stays, the bad reference goes.
    api.create(
        &pp,
        &cm(json!({"metadata": {"name": "mixed",
        "ownerReferences": [reference("ConfigMap", &uid), reference("ConfigMap", &other_uid)]}})),
    )
    .await
    .unwrap();
    // A kind the server does not serve cannot be judged: the dependent is left alone.
    api.create(&pp, &cm(json!({"metadata": {"name": "unknown-kind", "ownerReferences": [{
        "apiVersion": "example.com/v1", "kind": "Widget", "name": "w", "uid": "11111111-1111-4111-8111-111111111111"}]}})))
        .await
        .unwrap();
    eventually(T, "wrong-kind collected", || async {
        secrets
            .get_opt("wrong-kind")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    eventually(T, "wrong-namespace collected", || async {
        api.get_opt("wrong-namespace")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    gc_settled(&api).await;
    let mixed = api.get("mixed").await.unwrap();
    assert_eq!(refs_of(&mixed), [format!("ConfigMap/owner/{uid}")]);
    assert_eq!(
        refs_of(&api.get("unknown-kind").await.unwrap()).len(),
        1,
        "untouched"
    );
    assert!(
        elsewhere.get_opt("owner").await.unwrap().is_some(),
        "owners are never collected"
    );
}

#[tokio::test]
async fn foreground_deletion_keeps_dependents_with_another_live_owner() {
    let (_s, client) = server().await;
    let pp = PostParams::default();
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let going = api
        .create(&pp, &cm(json!({"metadata": {"name": "going"}})))
        .await
        .unwrap();
    let staying = api
        .create(&pp, &cm(json!({"metadata": {"name": "staying"}})))
        .await
        .unwrap();
    let r = |o: &ConfigMap| json!({"apiVersion": "v1", "kind": "ConfigMap", "name": o.metadata.name, "uid": o.metadata.uid, "blockOwnerDeletion": true});
    api.create(
        &pp,
        &cm(json!({"metadata": {"name": "shared", "ownerReferences": [r(&going), r(&staying)]}})),
    )
    .await
    .unwrap();
    api.create(&pp, &owned("only-going", &going, true))
        .await
        .unwrap();
    api.delete("going", &DeleteParams::foreground())
        .await
        .unwrap();
    eventually(T, "the owner deleted in the foreground is gone", || async {
        api.get_opt("going").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(api.get_opt("only-going").await.unwrap().is_none());
    let shared = api.get("shared").await.unwrap();
    assert_eq!(
        refs_of(&shared),
        [format!(
            "ConfigMap/staying/{}",
            staying.metadata.uid.as_deref().unwrap()
        )]
    );
}
