//! Draining a static build host through the real binaries: the host-config ConfigMap drains a
//! host while a build runs on it. The build keeps running and finishes, its user is removed from
//! the drained host, new TaskRuns of the platform go to the other host or wait (no error
//! secret), the `host_drained` gauge and a `Drained` Event on the ConfigMap say so, and lifting
//! the drain serves the waiter on the host it freed.

use std::time::Duration;

use e2e::product::{NS, Product};
use e2e::sshd::user_exists;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams};
use mpc::contract;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);
const PLATFORM: &str = "linux/arm64";

fn label<'a>(tr: &'a Value, key: &str) -> Option<&'a str> {
    tr["metadata"]["labels"][key].as_str()
}

async fn submit(p: &Product, ns: &str, name: &str) {
    p.hosts[0]
        .sshd
        .track_user(&contract::remote_user_name(name, ns));
    p.create_taskrun(ns, name, PLATFORM, json!({}))
        .await
        .unwrap();
}

/// Waits for the TaskRun's remote secret; returns the host it was assigned.
async fn assigned(p: &Product, ns: &str, name: &str) -> String {
    p.wait(T, &format!("{ns}/{name} served"), || async {
        p.secret(ns, name).await.filter(|s| s.contains_key("otp"))?;
        let tr = p.taskrun(ns, name).await?;
        label(&tr, contract::ASSIGNED_HOST_LABEL).map(str::to_owned)
    })
    .await
}

/// Sets (or, with `None`, removes) one host-config key in a single write: the controller never
/// sees a config without the hosts, as it may between `Product::set_config`'s two writes.
async fn set_key(p: &Product, key: &str, value: Option<&str>) {
    let api: Api<ConfigMap> = Api::namespaced(p.client.clone(), NS);
    api.patch(
        contract::HOST_CONFIG_NAME,
        &PatchParams::default(),
        &Patch::Merge(json!({ "data": { key: value } })),
    )
    .await
    .unwrap();
}

/// The value of the controller's `host_drained` series for `host`.
async fn host_drained(p: &Product, host: &str) -> Option<f64> {
    let series = format!(
        "{}host_drained{{host=\"{host}\",platform=\"linux-arm64\"}} ",
        mpc::metrics::PREFIX
    );
    let text = p.controllers[0].metrics().await;
    text.lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
}

/// The notes of Events with `reason` on the host-config ConfigMap.
async fn config_events(p: &Product, reason: &str) -> Vec<String> {
    let api: Api<Event> = Api::namespaced(p.client.clone(), NS);
    api.list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                    == Some(contract::HOST_CONFIG_NAME)
                && e.type_.as_deref() == Some("Normal")
        })
        .filter_map(|e| e.note)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_host_finishes_its_build_takes_no_new_one_and_serves_again_when_lifted() {
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1), ("h2", 1)])
        .await
        .unwrap();
    p.start_controller("c1").await.unwrap();

    // a runs on h1 (least loaded, first by name).
    submit(&p, "tenant-a", "a").await;
    assert_eq!(assigned(&p, "tenant-a", "a").await, "h1");
    assert_eq!(host_drained(&p, "h1").await, Some(0.0));

    // Drain h1 while a runs there.
    set_key(&p, "host.h1.drain", Some("true")).await;
    p.wait(T, "host_drained{host=h1} = 1", || async {
        (host_drained(&p, "h1").await == Some(1.0)).then_some(())
    })
    .await;
    assert_eq!(host_drained(&p, "h2").await, Some(0.0));
    let notes = p
        .wait(T, "a Drained Event on host-config", || async {
            let n = config_events(&p, "Drained").await;
            (!n.is_empty()).then_some(n)
        })
        .await;
    assert!(
        notes.iter().any(|n| n.contains("host h1 (linux/arm64)")),
        "{notes:?}"
    );
    let user_a = contract::remote_user_name("a", "tenant-a");
    assert!(user_exists(&user_a), "a's user was removed by the drain");

    // New work goes to h2, then waits: no error secret while h1 is drained.
    submit(&p, "tenant-a", "b").await;
    assert_eq!(assigned(&p, "tenant-a", "b").await, "h2");
    submit(&p, "tenant-b", "c").await;
    p.wait(T, "c labelled waiting", || async {
        let tr = p.taskrun("tenant-b", "c").await?;
        (label(&tr, contract::WAITING_FOR_PLATFORM_LABEL) == Some("linux-arm64")).then_some(())
    })
    .await;

    // a's build runs to the end on the drained host; its user is removed from there.
    p.build("tenant-a", "a").await;
    p.cleaned_up("tenant-a", "a").await;
    p.wait(T, "a's user removed from h1", || async {
        (!user_exists(&user_a)).then_some(())
    })
    .await;
    // h1 is free but drained: c still waits, with no secret at all.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(p.secret("tenant-b", "c").await, None, "{}", p.logs());
    let tr = p.taskrun("tenant-b", "c").await.unwrap();
    assert_eq!(label(&tr, contract::ASSIGNED_HOST_LABEL), None);

    // Lifting the drain serves c on h1.
    set_key(&p, "host.h1.drain", None).await;
    assert_eq!(assigned(&p, "tenant-b", "c").await, "h1");
    assert_eq!(host_drained(&p, "h1").await, Some(0.0));
    p.wait(T, "a DrainLifted Event on host-config", || async {
        (!config_events(&p, "DrainLifted").await.is_empty()).then_some(())
    })
    .await;

    for (ns, name) in [("tenant-a", "b"), ("tenant-b", "c")] {
        p.build(ns, name).await;
        p.cleaned_up(ns, name).await;
        let user = contract::remote_user_name(name, ns);
        p.wait(T, &format!("{name}'s user removed"), || async {
            (!user_exists(&user)).then_some(())
        })
        .await;
    }
}
