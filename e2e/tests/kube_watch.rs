//! kube-rs watchers and reflectors against the test API server: they see every change, and
//! recover after a dropped watch, after a 410 Gone, and across a server restart.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::apiserver::testing::eventually;
use e2e::apiserver::{ApiServer, Options};
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
