//! Lists as kube-apiserver serves them from its watch cache: concurrently with writes (a Lease
//! renewal is not queued behind a list of thousands of large objects), and paged with `limit`
//! and `continue` (pages of one revision, disjoint and complete, `remainingItemCount`, the
//! token's encoding, 410 Expired once the revision is compacted), through raw HTTP, kube-rs and
//! `kubectl get --chunk-size`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use base64::Engine as _;
use e2e_apiserver::kubectl::Kubectl;
use e2e_apiserver::{ApiServer, Options};
use http_body_util::BodyExt as _;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};

fn cm(v: Value) -> ConfigMap {
    serde_json::from_value(v).unwrap()
}

/// GET `path` through `client`, whatever the status: `(status, body)`.
async fn get_raw(client: &kube::Client, path: &str) -> (u16, Value) {
    let req = http::Request::get(path).body(Vec::new()).unwrap();
    let resp = client
        .send(req.map(kube::client::Body::from))
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

fn token(t: &str) -> Value {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .unwrap_or_else(|e| panic!("continue token {t:?} is unpadded URL-safe base64: {e}"));
    serde_json::from_slice(&raw).unwrap()
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["metadata"]["namespace"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

/// The server runs on a runtime of its own with two workers (as in the controller bench); the
/// clients on another, so that what is measured is the server. Four clients list 1,500 ConfigMaps
/// of 48 KB each (72 MB of JSON per list) at once while a fifth renews a Lease and writes a
/// ConfigMap every 50 ms: each renewal and write must be answered within a second.
#[test]
fn a_lease_renewal_and_a_write_are_answered_while_large_lists_are_served() {
    const N: usize = 1_500;
    const LISTS: usize = 4;
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = server_rt
        .block_on(ApiServer::start(Options::default()))
        .unwrap();
    let big = "x".repeat(48 * 1024);
    server_rt.block_on(async {
        for i in 0..N {
            server
                .create(json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("big-{i:05}"), "namespace": "default"},
                    "data": {"payload": big}}))
                .await
                .unwrap();
        }
    });
    let client_rt = tokio::runtime::Runtime::new().unwrap();
    let client = client_rt.block_on(server.client()).unwrap();
    let (lists, renewals) = client_rt.block_on(async {
        let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
        let mut lease = leases
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({"metadata": {"name": "leader"},
                    "spec": {"holderIdentity": "c1", "leaseDurationSeconds": 15}}))
                .unwrap(),
            )
            .await
            .unwrap();
        let started = Instant::now();
        let listing: Vec<_> = (0..LISTS)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move {
                    let t = Instant::now();
                    let req = http::Request::get("/api/v1/namespaces/default/configmaps")
                        .body(kube::client::Body::empty())
                        .unwrap();
                    let resp = client.send(req).await.unwrap();
                    assert_eq!(resp.status(), 200);
                    let body = resp.into_body().collect().await.unwrap().to_bytes();
                    assert!(body.len() > N * 48 * 1024, "{} bytes", body.len());
                    t.elapsed()
                })
            })
            .collect();
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
        let mut renewals = Vec::new();
        while listing.iter().any(|l| !l.is_finished())
            && started.elapsed() < Duration::from_secs(120)
        {
            let t = Instant::now();
            lease.spec.as_mut().unwrap().renew_time =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                    k8s_openapi::jiff::Timestamp::now(),
                ));
            lease = leases
                .replace("leader", &PostParams::default(), &lease)
                .await
                .unwrap();
            cms.create(
                &PostParams::default(),
                &cm(json!({"metadata": {"name": format!("w-{}", renewals.len())}})),
            )
            .await
            .unwrap();
            renewals.push((started.elapsed(), t.elapsed()));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut lists = Vec::new();
        for l in listing {
            lists.push(l.await.unwrap());
        }
        (lists, renewals)
    });
    let slowest = renewals.iter().map(|r| r.1).max().unwrap_or_default();
    println!(
        "{LISTS} lists of {N} took {lists:?}; {} renewals and writes, the slowest {slowest:?}",
        renewals.len()
    );
    assert!(
        renewals.len() >= 5,
        "the lists ended before five renewals: {renewals:?}"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "a Lease renewal and a write took {slowest:?} while lists were served: {renewals:?}"
    );
    drop(client_rt);
    drop(server);
    drop(server_rt);
}

/// Pages of one list read the first page's revision, whatever is created, changed or deleted
/// between them; together they hold each object once; `remainingItemCount` counts what is left;
/// the token is kube-apiserver's (unpadded URL-safe base64 of `{"v","rv","start"}`, the start key
/// relative to the list's prefix with `\0` appended); once the revision is compacted, 410 Expired
/// with a token that goes on at the latest revision.
#[tokio::test]
async fn pages_are_one_revision_disjoint_and_complete() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let client = server.client().await.unwrap();
    for ns in ["a", "b"] {
        server
            .create(json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
            .await
            .unwrap();
        for i in 0..10 {
            server
                .create(json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": format!("c{i:02}"), "namespace": ns}, "data": {"v": "0"}}))
                .await
                .unwrap();
        }
    }
    let (code, first) = get_raw(&client, "/api/v1/configmaps?limit=7").await;
    assert_eq!(code, 200, "{first}");
    let rv = first["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    let everything = {
        let (_, all) = get_raw(&client, "/api/v1/configmaps").await;
        names(&all)
    };
    let total = everything.len();
    assert_eq!(
        first["metadata"]["remainingItemCount"],
        json!(total - 7),
        "{}",
        first["metadata"]
    );
    let t = token(first["metadata"]["continue"].as_str().unwrap());
    assert_eq!(t["v"], "meta.k8s.io/v1");
    assert_eq!(t["rv"].to_string(), rv);
    let last = names(&first).pop().unwrap();
    assert_eq!(
        t["start"],
        format!("{last}\u{0}"),
        "across namespaces: namespace/name"
    );

    // Between pages: an unread object changes, one goes, new ones come, in both namespaces.
    let cms_a: Api<ConfigMap> = Api::namespaced(client.clone(), "a");
    let cms_b: Api<ConfigMap> = Api::namespaced(client.clone(), "b");
    cms_b.delete("c05", &DeleteParams::default()).await.unwrap();
    cms_a
        .create(
            &PostParams::default(),
            &cm(json!({"metadata": {"name": "c99"}})),
        )
        .await
        .unwrap();
    cms_b
        .create(
            &PostParams::default(),
            &cm(json!({"metadata": {"name": "c055"}})),
        )
        .await
        .unwrap();
    let mut changed = cms_b.get("c08").await.unwrap();
    changed.data = Some([("v".to_owned(), "1".to_owned())].into());
    cms_b
        .replace("c08", &PostParams::default(), &changed)
        .await
        .unwrap();

    let mut seen = names(&first);
    let mut cont = first["metadata"]["continue"].as_str().map(str::to_owned);
    while let Some(c) = cont {
        let (code, page) =
            get_raw(&client, &format!("/api/v1/configmaps?limit=7&continue={c}")).await;
        assert_eq!(code, 200, "{page}");
        assert_eq!(page["metadata"]["resourceVersion"], json!(rv));
        for o in page["items"].as_array().unwrap() {
            if o["metadata"]["name"] == "c08" {
                assert_eq!(o["data"]["v"], "0", "read as of the first page");
            }
        }
        seen.extend(names(&page));
        cont = page["metadata"]["continue"].as_str().map(str::to_owned);
        match &cont {
            Some(_) => assert_eq!(
                page["metadata"]["remainingItemCount"],
                json!(total - seen.len())
            ),
            None => assert!(page["metadata"].get("remainingItemCount").is_none()),
        }
    }
    assert_eq!(seen, everything, "disjoint, complete, in key order");

    // kube-rs in one namespace: the start key is the name alone.
    let page = cms_a.list(&ListParams::default().limit(4)).await.unwrap();
    let t = token(page.metadata.continue_.as_deref().unwrap());
    assert_eq!(t["start"], "c03\u{0}");
    let mut in_a: Vec<String> = page
        .items
        .iter()
        .map(|c| c.metadata.name.clone().unwrap())
        .collect();
    let mut cont = page.metadata.continue_.clone();
    let rv_a = page.metadata.resource_version.clone();
    cms_a.delete("c09", &DeleteParams::default()).await.unwrap();
    while let Some(c) = cont.filter(|c| !c.is_empty()) {
        let p = cms_a
            .list(&ListParams::default().limit(4).continue_token(&c))
            .await
            .unwrap();
        assert_eq!(p.metadata.resource_version, rv_a);
        in_a.extend(p.items.iter().map(|c| c.metadata.name.clone().unwrap()));
        cont = p.metadata.continue_;
    }
    // As of the first page: c09 still there, c99 (created before it) too.
    let want: BTreeSet<String> = everything
        .iter()
        .filter_map(|k| k.strip_prefix("a/"))
        .map(str::to_owned)
        .chain(["c99".to_owned()])
        .collect();
    assert_eq!(in_a, want.into_iter().collect::<Vec<_>>());

    // The revision compacted: 410 Expired, and a token to go on at the latest revision.
    let page = cms_a.list(&ListParams::default().limit(4)).await.unwrap();
    let c = page.metadata.continue_.unwrap();
    cms_a
        .create(
            &PostParams::default(),
            &cm(json!({"metadata": {"name": "c100"}})),
        )
        .await
        .unwrap();
    server.compact();
    let (code, status) = get_raw(
        &client,
        &format!("/api/v1/namespaces/a/configmaps?limit=4&continue={c}"),
    )
    .await;
    assert_eq!(code, 410, "{status}");
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["status"], "Failure");
    assert_eq!(status["reason"], "Expired");
    assert_eq!(status["code"], 410);
    assert!(
        status["message"].as_str().unwrap().starts_with(
            "The provided continue parameter is too old to display a consistent list result."
        ),
        "{status}"
    );
    let again = status["metadata"]["continue"].as_str().unwrap();
    let t = token(again);
    assert_eq!(t["rv"], -1);
    assert_eq!(t["start"], "c03\u{0}");
    let (code, rest) = get_raw(
        &client,
        &format!("/api/v1/namespaces/a/configmaps?continue={again}"),
    )
    .await;
    assert_eq!(code, 200, "{rest}");
    assert_eq!(
        rest["metadata"]["resourceVersion"],
        json!(server.resource_version().to_string())
    );
    assert!(
        names(&rest).contains(&"a/c100".to_owned()),
        "the latest revision: {rest}"
    );
    assert!(!names(&rest).contains(&"a/c03".to_owned()));
    assert_eq!(
        api_code(
            cms_a
                .list(&ListParams::default().limit(4).continue_token(&c))
                .await
        ),
        410
    );

    // Tokens kube-apiserver refuses.
    for bad in [
        "not base64!".to_owned(),
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"v":"meta.k8s.io/v1","rv":5,"start":"../b/c00\u0000"}"#),
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"v":"meta.k8s.io/v1","rv":0,"start":"c00\u0000"}"#),
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"v":"meta.k8s.io/v2","rv":5,"start":"c00\u0000"}"#),
    ] {
        let q: String = form_urlencoded::byte_serialize(bad.as_bytes()).collect();
        let (code, status) = get_raw(
            &client,
            &format!("/api/v1/namespaces/a/configmaps?limit=4&continue={q}"),
        )
        .await;
        assert_eq!(code, 400, "{bad}: {status}");
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .starts_with("invalid continue token: continue key is not valid"),
            "{status}"
        );
    }
    assert!(server.nonconforming_responses().is_empty());
}

fn api_code<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> u16 {
    match r {
        Err(kube::Error::Api(e)) => e.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// `kubectl get --chunk-size` pages through a list (tables and `-o name`), request by request.
#[tokio::test]
async fn kubectl_pages_with_chunk_size() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    for i in 0..25 {
        server
            .create(json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": format!("k{i:02}"), "namespace": "default"}}))
            .await
            .unwrap();
    }
    let kubectl = Kubectl::new(&server.kubeconfig_path());
    let want: Vec<String> = (0..25).map(|i| format!("configmap/k{i:02}")).collect();
    let out = kubectl
        .run(
            &[
                "get",
                "configmaps",
                "-n",
                "default",
                "--chunk-size=4",
                "-o",
                "name",
                "-v=6",
            ],
            None,
        )
        .await;
    assert!(out.ok, "{}", out.stderr);
    let got: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("configmap/k"))
        .collect();
    assert_eq!(got, want);
    let pages = |stderr: &str| {
        stderr
            .lines()
            .filter(|l| l.contains("/configmaps?") && l.contains("limit=4"))
            .count()
    };
    assert!(pages(&out.stderr) >= 7, "pages of 4: {}", out.stderr);
    assert!(out.stderr.contains("continue="), "{}", out.stderr);
    // The table (kubectl's default output) a page at a time, one header.
    let out = kubectl
        .run(
            &[
                "get",
                "configmaps",
                "-n",
                "default",
                "--chunk-size=4",
                "-v=6",
            ],
            None,
        )
        .await;
    assert!(out.ok, "{}", out.stderr);
    let rows: Vec<&str> = out.stdout.lines().filter(|l| l.starts_with('k')).collect();
    assert_eq!(rows.len(), 25, "{}", out.stdout);
    assert_eq!(
        out.stdout.lines().filter(|l| l.starts_with("NAME")).count(),
        1
    );
    assert!(pages(&out.stderr) >= 7, "{}", out.stderr);
    assert!(server.nonconforming_responses().is_empty());
}
