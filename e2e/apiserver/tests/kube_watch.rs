//! kube-rs watchers and reflectors against the test API server: they see every change, and
//! recover after a dropped watch, after a 410 Gone, and across a server restart.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e_apiserver::testing::eventually;
use e2e_apiserver::{ApiServer, Options};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;

const T: Duration = Duration::from_secs(10);

fn cm(name: &str, v: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"v": v}})).unwrap()
}

async fn server() -> (ApiServer, kube::Client) {
    let opts = Options {
        // Long: a bookmark would move a watcher past the point a test compacts at.
        bookmark_interval: Duration::from_secs(60),
        ..Options::default()
    };
    let s = ApiServer::start(opts).await.unwrap();
    let c = s.client().await.unwrap();
    (s, c)
}

/// Collects watcher events into a shared log (`kind:name:v`).
fn spawn_log(
    api: Api<ConfigMap>,
    cfg: watcher::Config,
) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let l = log.clone();
    tokio::spawn(async move {
        let mut s = watcher(api, cfg).default_backoff().boxed();
        while let Some(ev) = s.next().await {
            let line = match ev {
                Ok(watcher::Event::Apply(o)) => format!(
                    "apply:{}:{}",
                    o.metadata.name.unwrap(),
                    o.data.unwrap_or_default()["v"]
                ),
                Ok(watcher::Event::Delete(o)) => format!("delete:{}", o.metadata.name.unwrap()),
                Ok(watcher::Event::InitApply(o)) => format!("init:{}", o.metadata.name.unwrap()),
                Ok(watcher::Event::Init) => "init-start".into(),
                Ok(watcher::Event::InitDone) => "init-done".into(),
                Err(e) => format!("error:{e}"),
            };
            l.lock().unwrap().push(line);
        }
    });
    log
}

async fn seen(log: &std::sync::Arc<std::sync::Mutex<Vec<String>>>, line: &str) {
    eventually(T, line, || async {
        log.lock().unwrap().iter().any(|l| l == line).then_some(())
    })
    .await;
}

fn count(log: &std::sync::Arc<std::sync::Mutex<Vec<String>>>, line: &str) -> usize {
    log.lock().unwrap().iter().filter(|l| *l == line).count()
}

#[tokio::test]
async fn watcher_sees_create_modify_delete() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &cm("before", "0"))
        .await
        .unwrap();
    let log = spawn_log(api.clone(), watcher::Config::default());
    seen(&log, "init-done").await;
    assert_eq!(count(&log, "init:before"), 1, "{:?}", log.lock().unwrap());
    api.create(&PostParams::default(), &cm("a", "1"))
        .await
        .unwrap();
    seen(&log, "apply:a:1").await;
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"v": "2"}})),
    )
    .await
    .unwrap();
    seen(&log, "apply:a:2").await;
    api.delete("a", &DeleteParams::default()).await.unwrap();
    seen(&log, "delete:a").await;
}

#[tokio::test]
async fn streaming_list_watcher_gets_initial_events_and_bookmark() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &cm("x", "1"))
        .await
        .unwrap();
    let cfg = watcher::Config::default().streaming_lists();
    let log = spawn_log(api.clone(), cfg);
    seen(&log, "init:x").await;
    seen(&log, "init-done").await;
    api.create(&PostParams::default(), &cm("y", "1"))
        .await
        .unwrap();
    seen(&log, "apply:y:1").await;
}

#[tokio::test]
async fn watcher_recovers_after_dropped_watch() {
    let (s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let log = spawn_log(api.clone(), watcher::Config::default());
    seen(&log, "init-done").await;
    api.create(&PostParams::default(), &cm("a", "1"))
        .await
        .unwrap();
    seen(&log, "apply:a:1").await;
    s.drop_watches();
    api.create(&PostParams::default(), &cm("b", "1"))
        .await
        .unwrap();
    seen(&log, "apply:b:1").await;
    // Resumed from its last resourceVersion: no relist, so `a` is not replayed.
    assert_eq!(count(&log, "init-done"), 1, "{:?}", log.lock().unwrap());
    assert_eq!(count(&log, "apply:a:1"), 1);
}

#[tokio::test]
async fn watcher_relists_after_410_gone() {
    let (s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let log = spawn_log(api.clone(), watcher::Config::default());
    seen(&log, "init-done").await;
    api.create(&PostParams::default(), &cm("a", "1"))
        .await
        .unwrap();
    seen(&log, "apply:a:1").await;
    // Another namespace moves the revision on; then history is compacted and watches are cut,
    // so resuming from the old resourceVersion answers 410 and the watcher must relist.
    let other: Api<ConfigMap> = Api::namespaced(s.client().await.unwrap(), "kube-system");
    other
        .create(&PostParams::default(), &cm("noise", "1"))
        .await
        .unwrap();
    s.compact();
    s.drop_watches();
    api.create(&PostParams::default(), &cm("b", "1"))
        .await
        .unwrap();
    eventually(T, "a relist after 410", || async {
        (count(&log, "init-done") >= 2).then_some(())
    })
    .await;
    let l = log.lock().unwrap().clone();
    assert!(l.iter().any(|x| x == "init:b" || x == "apply:b:1"), "{l:?}");
    assert!(
        l.iter().filter(|x| *x == "init:a").count() >= 1,
        "relist replays existing objects: {l:?}"
    );
}

#[tokio::test]
async fn watcher_survives_restart_with_compaction() {
    let (s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let log = spawn_log(api.clone(), watcher::Config::default());
    seen(&log, "init-done").await;
    api.create(&PostParams::default(), &cm("a", "1"))
        .await
        .unwrap();
    seen(&log, "apply:a:1").await;
    s.restart(true).await.unwrap();
    // Data survived the restart.
    eventually(T, "get after restart", || async {
        api.get_opt("a").await.ok().flatten()
    })
    .await;
    eventually(T, "create after restart", || async {
        api.create(&PostParams::default(), &cm("b", "1")).await.ok()
    })
    .await;
    seen(&log, "apply:b:1").await;
}

#[tokio::test]
async fn reflector_store_converges() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api.clone(), watcher::Config::default()))
        .default_backoff()
        .boxed();
    tokio::spawn(stream.for_each(|_| async {}));
    reader.wait_until_ready().await.unwrap();
    let mut expected = BTreeMap::new();
    for i in 0..30 {
        let n = format!("cm-{i}");
        api.create(&PostParams::default(), &cm(&n, "0"))
            .await
            .unwrap();
        expected.insert(n, "0".to_owned());
    }
    for i in (0..30).step_by(3) {
        let n = format!("cm-{i}");
        api.patch(
            &n,
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"v": "9"}})),
        )
        .await
        .unwrap();
        expected.insert(n, "9".to_owned());
    }
    for i in (1..30).step_by(5) {
        let n = format!("cm-{i}");
        api.delete(&n, &DeleteParams::default()).await.unwrap();
        expected.remove(&n);
    }
    eventually(T, "store == server state", || async {
        let got: BTreeMap<String, String> = reader
            .state()
            .iter()
            .map(|c| {
                (
                    c.metadata.name.clone().unwrap(),
                    c.data.clone().unwrap_or_default()["v"].clone(),
                )
            })
            .collect();
        (got == expected).then_some(())
    })
    .await;
}

#[tokio::test]
async fn label_selected_watch_reports_objects_leaving_as_deleted() {
    let (_s, client) = server().await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    let log = spawn_log(api.clone(), watcher::Config::default().labels("app=x"));
    seen(&log, "init-done").await;
    let mut c = cm("a", "1");
    c.metadata.labels = Some([("app".to_owned(), "x".to_owned())].into());
    api.create(&PostParams::default(), &c).await.unwrap();
    seen(&log, "apply:a:1").await;
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "y"}}})),
    )
    .await
    .unwrap();
    seen(&log, "delete:a").await;
    api.create(&PostParams::default(), &cm("unlabelled", "1"))
        .await
        .unwrap();
    api.patch(
        "unlabelled",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "x"}}})),
    )
    .await
    .unwrap();
    seen(&log, "apply:unlabelled:1").await;
}

/// Raw HTTP against the plain port: kube-rs would retry a 504 on its own and hides headers.
mod raw {
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Empty};
    use serde_json::Value;

    type Client = hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Empty<Bytes>,
    >;

    fn client() -> Client {
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http()
    }

    /// `GET base+path`: status, `Retry-After`, JSON body.
    pub async fn get(base: &str, path: &str) -> (u16, Option<String>, Value) {
        let resp = client()
            .get(format!("{base}{path}").parse().unwrap())
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let retry = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, retry, serde_json::from_slice(&body).unwrap())
    }

    /// Starts a watch; its events arrive on the returned channel, one JSON value per line.
    pub async fn watch(base: &str, path: &str) -> tokio::sync::mpsc::UnboundedReceiver<Value> {
        let resp = client()
            .get(format!("{base}{path}").parse().unwrap())
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200, "watch {path}");
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut body = resp.into_body();
            let mut buf = Vec::new();
            while let Some(Ok(frame)) = body.frame().await {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                buf.extend_from_slice(&data);
                while let Some(i) = buf.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=i).collect();
                    let _ = tx.send(serde_json::from_slice(&line).unwrap());
                }
            }
        });
        rx
    }

    /// The next event, or `None` if none comes within `d`.
    pub async fn next(
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<Value>,
        d: Duration,
    ) -> Option<Value> {
        tokio::time::timeout(d, rx.recv()).await.ok().flatten()
    }
}

async fn quick_server(opts: Options) -> (ApiServer, kube::Client) {
    let s = ApiServer::start(opts).await.unwrap();
    let c = s.client().await.unwrap();
    (s, c)
}

fn secret(name: &str) -> k8s_openapi::api::core::v1::Secret {
    serde_json::from_value(json!({"metadata": {"name": name}})).unwrap()
}

#[tokio::test]
async fn list_at_a_future_resource_version_waits_then_answers_too_large() {
    let (s, client) = quick_server(Options {
        resource_version_wait: Duration::from_millis(800),
        ..Options::default()
    })
    .await;
    let base = s.plain_url();
    let far = s.resource_version() + 1000;
    let started = std::time::Instant::now();
    let (code, retry, body) = raw::get(
        &base,
        &format!("/api/v1/namespaces/default/configmaps?resourceVersion={far}"),
    )
    .await;
    assert!(
        started.elapsed() >= Duration::from_millis(700),
        "waited for the revision first"
    );
    assert_eq!(code, 504, "{body}");
    assert_eq!(body["reason"], "Timeout");
    let current = s.resource_version();
    assert_eq!(
        body["message"],
        format!("Timeout: Too large resource version: {far}, current: {current}")
    );
    assert_eq!(
        body["details"]["causes"][0]["reason"],
        "ResourceVersionTooLarge"
    );
    assert_eq!(body["details"]["retryAfterSeconds"], 1);
    assert_eq!(retry.as_deref(), Some("1"));

    // A revision reached while waiting is served.
    let next = s.resource_version() + 1;
    let pending = tokio::spawn({
        let base = base.clone();
        async move {
            raw::get(
                &base,
                &format!("/api/v1/namespaces/default/configmaps?resourceVersion={next}"),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    api.create(&PostParams::default(), &cm("late", "1"))
        .await
        .unwrap();
    let (code, _, list) = pending.await.unwrap();
    assert_eq!(code, 200, "{list}");
    assert_eq!(list["items"][0]["metadata"]["name"], "late");
    let (code, _, got) = raw::get(
        &base,
        &format!("/api/v1/namespaces/default/configmaps/late?resourceVersion={next}"),
    )
    .await;
    assert_eq!(code, 200, "{got}");
}

#[tokio::test]
async fn watch_from_a_future_resource_version_sends_only_what_comes_after_it() {
    let (s, client) = quick_server(Options::default()).await;
    let start = s.resource_version() + 2;
    let mut rx = raw::watch(
        &s.plain_url(),
        &format!("/api/v1/namespaces/default/configmaps?watch=true&resourceVersion={start}"),
    )
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client, "default");
    for n in ["a", "b", "c"] {
        api.create(&PostParams::default(), &cm(n, "1"))
            .await
            .unwrap();
    }
    let ev = raw::next(&mut rx, T).await.expect("an event");
    assert_eq!(ev["type"], "ADDED");
    assert_eq!(
        ev["object"]["metadata"]["name"], "c",
        "a and b are at or before the requested revision"
    );
    assert_eq!(
        ev["object"]["metadata"]["resourceVersion"],
        (start + 1).to_string()
    );
}

#[tokio::test]
async fn watch_list_at_a_future_resource_version_ends_with_an_error_event() {
    let (s, _client) = quick_server(Options {
        resource_version_wait: Duration::from_millis(300),
        ..Options::default()
    })
    .await;
    let far = s.resource_version() + 50;
    let mut rx = raw::watch(
        &s.plain_url(),
        &format!("/api/v1/namespaces/default/configmaps?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&resourceVersion={far}"),
    )
    .await;
    let ev = raw::next(&mut rx, T).await.expect("an event");
    assert_eq!(ev["type"], "ERROR", "{ev}");
    assert_eq!(ev["object"]["code"], 504);
    assert_eq!(
        ev["object"]["details"]["causes"][0]["reason"],
        "ResourceVersionTooLarge"
    );
    assert!(
        raw::next(&mut rx, Duration::from_millis(500))
            .await
            .is_none(),
        "the watch ends after the error"
    );
}

/// A server with this bookmark interval, a ConfigMap watch with bookmarks from its current
/// revision (plus `query`), and Secrets to move the revision with.
async fn bookmark_watch(
    interval: Duration,
    query: &str,
) -> (
    ApiServer,
    Api<k8s_openapi::api::core::v1::Secret>,
    tokio::sync::mpsc::UnboundedReceiver<serde_json::Value>,
) {
    let (s, client) = quick_server(Options {
        bookmark_interval: interval,
        ..Options::default()
    })
    .await;
    let start = s.resource_version();
    let rx = raw::watch(
        &s.plain_url(),
        &format!("/api/v1/namespaces/default/configmaps?watch=true&allowWatchBookmarks=true&resourceVersion={start}{query}"),
    )
    .await;
    (s, Api::namespaced(client, "default"), rx)
}

#[tokio::test]
async fn bookmarks_carry_the_latest_revision_once_it_moves() {
    let (_s, secrets, mut rx) = bookmark_watch(Duration::from_millis(150), "").await;
    // Nothing newer than what the client already has: no bookmark.
    assert!(
        raw::next(&mut rx, Duration::from_millis(600))
            .await
            .is_none()
    );
    // A write to another resource moves the revision; the next bookmark carries it.
    let written = secrets
        .create(&PostParams::default(), &secret("other"))
        .await
        .unwrap();
    let ev = raw::next(&mut rx, T).await.expect("a bookmark");
    assert_eq!(ev["type"], "BOOKMARK", "{ev}");
    assert_eq!(ev["object"]["kind"], "ConfigMap");
    assert_eq!(
        ev["object"]["metadata"]["resourceVersion"].as_str(),
        written.metadata.resource_version.as_deref()
    );
}

#[tokio::test]
async fn a_bookmark_comes_just_before_the_watch_times_out() {
    let (s, secrets, mut rx) = bookmark_watch(Duration::from_secs(60), "&timeoutSeconds=3").await;
    secrets
        .create(&PostParams::default(), &secret("other"))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let ev = raw::next(&mut rx, Duration::from_secs(5))
        .await
        .expect("a bookmark before the timeout");
    assert_eq!(ev["type"], "BOOKMARK", "{ev}");
    assert!(started.elapsed() < Duration::from_millis(2500));
    assert_eq!(
        ev["object"]["metadata"]["resourceVersion"],
        s.resource_version().to_string()
    );
}

#[tokio::test]
async fn watcher_resumes_from_bookmarks_without_relisting_after_compaction() {
    let (s, client) = quick_server(Options {
        bookmark_interval: Duration::from_millis(100),
        ..Options::default()
    })
    .await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let log = spawn_log(api.clone(), watcher::Config::default());
    seen(&log, "init-done").await;
    api.create(&PostParams::default(), &cm("a", "1"))
        .await
        .unwrap();
    seen(&log, "apply:a:1").await;
    // Writes elsewhere move the revision; bookmarks bring the watcher along.
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client, "default");
    secrets
        .create(&PostParams::default(), &secret("noise"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    s.compact();
    s.drop_watches();
    api.create(&PostParams::default(), &cm("b", "1"))
        .await
        .unwrap();
    seen(&log, "apply:b:1").await;
    assert_eq!(
        count(&log, "init-done"),
        1,
        "resumed from the bookmark's revision, no 410 and relist: {:?}",
        log.lock().unwrap()
    );
}
