//! Throughput of the test API server: raw store writes with history, and list/watch over HTTPS
//! through kube-rs (what a controller under test does).

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use e2e_apiserver::store::Store;
use e2e_apiserver::{ApiServer, Options};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;

fn store_writes(c: &mut Criterion) {
    c.bench_function("store: 1000 creates + 1000 updates (history 10k)", |b| {
        b.iter(|| {
            let mut s = Store::new(10_000);
            for i in 0..1000 {
                let k = ("ns".to_owned(), format!("o{i}"));
                s.create(
                    "core/configmaps",
                    k,
                    json!({"metadata": {"name": i}, "data": {"v": "0"}}),
                )
                .unwrap();
            }
            for i in 0..1000 {
                let k = ("ns".to_owned(), format!("o{i}"));
                s.update(
                    "core/configmaps",
                    &k,
                    json!({"metadata": {"name": i}, "data": {"v": "1"}}),
                    None,
                )
                .unwrap();
            }
            s.current_rv()
        })
    });
}

fn over_https(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (server, api) = rt.block_on(async {
        // Measures serving, not the schema check tests run on every response.
        let opts = Options {
            check_responses: false,
            ..Options::default()
        };
        let s = ApiServer::start(opts).await.unwrap();
        let api: Api<ConfigMap> = Api::namespaced(s.client().await.unwrap(), "default");
        for i in 0..1000 {
            let cm: ConfigMap = serde_json::from_value(
                json!({"metadata": {"name": format!("cm-{i:04}")}, "data": {"k": "v"}}),
            )
            .unwrap();
            api.create(&PostParams::default(), &cm).await.unwrap();
        }
        (s, api)
    });
    let mut g = c.benchmark_group("https");
    g.measurement_time(Duration::from_secs(10));
    g.bench_function("list 1000 configmaps", |b| {
        b.iter(|| {
            rt.block_on(async { api.list(&ListParams::default()).await.unwrap().items.len() })
        })
    });
    g.bench_function("create 100 configmaps, watched", |b| {
        let mut round = 0u64;
        b.iter(|| {
            round += 1;
            rt.block_on(async {
                let rv = api
                    .list(&ListParams::default().limit(1))
                    .await
                    .unwrap()
                    .metadata
                    .resource_version
                    .unwrap();
                let mut w = api
                    .watch(&WatchParams::default(), &rv)
                    .await
                    .unwrap()
                    .boxed();
                for i in 0..100 {
                    let cm: ConfigMap = serde_json::from_value(
                        json!({"metadata": {"name": format!("w-{round}-{i}")}}),
                    )
                    .unwrap();
                    api.create(&PostParams::default(), &cm).await.unwrap();
                }
                let mut seen = 0;
                while seen < 100 {
                    if let Some(Ok(WatchEvent::Added(_))) = w.next().await {
                        seen += 1;
                    }
                }
            })
        })
    });
    g.finish();
    drop(server);
}

criterion_group!(benches, store_writes, over_https);
criterion_main!(benches);
