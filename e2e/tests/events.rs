//! The controller's Event outbox against the test API server, with kube-runtime's real
//! `Recorder`: 100,000 queued TaskRuns each told they wait keep the outbox within its capacity,
//! the Events API sees the configured rate and no more, drops are counted, and a Warning
//! submitted behind the flood is still published.

use std::time::{Duration, Instant};

use e2e::apiserver::testing::eventually;
use e2e::apiserver::{ApiServer, Options};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams};
use kube::runtime::events::{Recorder, Reporter};
use mpc::controller::events::{EventSink, Note, OutboxLimits, dropped_counter};
use tokio_util::sync::CancellationToken;

fn taskrun(name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("tekton.dev/v1".into()),
        kind: Some("TaskRun".into()),
        namespace: Some("team".into()),
        name: Some(name.into()),
        uid: Some(format!("uid-{name}")),
        ..ObjectReference::default()
    }
}

async fn events(api: &Api<Event>) -> Vec<Event> {
    api.list(&ListParams::default()).await.unwrap().items
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_of_100_000_taskruns_publishes_at_the_rate_and_holds_at_most_the_capacity() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    server
        .create_yaml("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: team\n")
        .await
        .unwrap();
    let client = server.client().await.unwrap();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "multi-platform-controller".into(),
            instance: Some("test".into()),
        },
    );
    let registry = prometheus::Registry::new();
    let dropped = dropped_counter(&registry).unwrap();
    let limits = OutboxLimits {
        capacity: 200,
        rate: 100.0,
        burst: 50,
    };
    let stop = CancellationToken::new();
    let sink = EventSink::start(recorder, limits, 4, dropped.clone(), stop.clone());

    let start = Instant::now();
    let n = 100_000;
    let mut most = 0;
    for i in 0..n {
        sink.submit(Note {
            reference: taskrun(&format!("build-{i}")),
            warning: false,
            reason: "WaitingForHost",
            message: format!("waiting for a linux/arm64 host: {i} ahead"),
        });
        most = most.max(sink.waiting());
    }
    let submitted_in = start.elapsed();
    assert!(
        most <= limits.capacity,
        "{most} Events waited at once, capacity {}",
        limits.capacity
    );
    let normal_dropped = dropped.with_label_values(&["Normal"]).get();
    assert!(
        normal_dropped >= (n - limits.capacity) as u64 - 10_000,
        "only {normal_dropped} of {n} dropped in {submitted_in:?}"
    );

    // A Warning behind the flood displaces a waiting Normal Event and is published.
    sink.submit(Note {
        reference: taskrun("build-broken"),
        warning: true,
        reason: "CleanupFailed",
        message: "removing the build user failed".into(),
    });
    let api: Api<Event> = Api::namespaced(client, "team");
    eventually(Duration::from_secs(20), "the Warning's Event", || async {
        events(&api)
            .await
            .iter()
            .any(|e| e.reason.as_deref() == Some("CleanupFailed"))
            .then_some(())
    })
    .await;
    eventually(Duration::from_secs(20), "the outbox to drain", || async {
        (sink.waiting() == 0).then_some(())
    })
    .await;
    let elapsed = start.elapsed().as_secs_f64();
    let published = events(&api).await.len();
    let published_and_dropped = published as u64 + dropped.with_label_values(&["Normal"]).get();
    assert_eq!(
        published_and_dropped,
        n as u64 + 1,
        "every Event is published or counted as dropped"
    );
    let bound = f64::from(limits.burst) + limits.rate * elapsed;
    assert!(
        (published as f64) <= bound,
        "{published} Events in {elapsed:.1} s: more than the rate allows ({bound:.0})"
    );
    assert!(
        published > limits.capacity,
        "the outbox drained: {published} published"
    );
    stop.cancel();
}
