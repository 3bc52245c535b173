//! The server holds its own responses to Kubernetes' published schemas: a shape kube-apiserver
//! would never send is recorded when it goes out, and fails the test when the server is dropped.

use e2e_apiserver::{ApiServer, Options};
use futures::StreamExt;
use kube::api::{Api, DynamicObject, ListParams, WatchEvent, WatchParams};
use serde_json::json;

#[tokio::test]
async fn a_response_kube_apiserver_would_never_send_is_recorded() {
    let s = ApiServer::start(Options::default()).await.unwrap();
    // Written around the API's validation (the harness's own create), as a server bug would.
    s.create(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "odd", "namespace": "default"},
        "data": {"k": "v"}, "spec": {"replicas": 1}}))
        .await
        .unwrap();
    assert!(s.nonconforming_responses().is_empty(), "nothing sent yet");
    let api: Api<DynamicObject> = Api::namespaced_with(
        s.client().await.unwrap(),
        "default",
        &kube::core::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
    );
    // kube-rs tolerates the unknown field; the schema check does not.
    api.get("odd").await.unwrap();
    api.list(&ListParams::default()).await.unwrap();
    let bad = s.nonconforming_responses();
    assert_eq!(bad.len(), 2, "{bad:#?}");
    assert!(
        bad[0].starts_with(
            "GET /api/v1/namespaces/default/configmaps/odd: io.k8s.api.core.v1.ConfigMap"
        ),
        "{bad:#?}"
    );
    assert!(bad[0].contains("spec"), "{bad:#?}");
    assert!(
        bad[1].starts_with(
            "GET /api/v1/namespaces/default/configmaps: io.k8s.api.core.v1.ConfigMapList"
        ),
        "{bad:#?}"
    );
    // Watch events are checked one by one as they stream.
    let mut events = api
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    let first = events.next().await.unwrap().unwrap();
    assert!(matches!(first, WatchEvent::Added(_)));
    let bad = s.nonconforming_responses();
    assert_eq!(bad.len(), 1, "{bad:#?}");
    assert!(bad[0].contains("at object: "), "{bad:#?}");
}

#[tokio::test]
#[should_panic(expected = "response(s) kube-apiserver never would")]
async fn an_unchecked_violation_fails_the_test_when_the_server_is_dropped() {
    let s = ApiServer::start(Options::default()).await.unwrap();
    s.create(json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "odd", "namespace": "default"}, "data": {"k": "v"}, "extra": true}))
        .await
        .unwrap();
    let api: Api<DynamicObject> = Api::namespaced_with(
        s.client().await.unwrap(),
        "default",
        &kube::core::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
    );
    api.get("odd").await.unwrap();
    drop(s);
}
