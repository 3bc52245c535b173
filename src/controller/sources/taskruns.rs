//! The TaskRun watch: every replica watches the TaskRuns carrying the platform label and hands
//! each event to the loop, which keeps the index recovery rebuilds the ledger from.

use futures::StreamExt;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Input;
use crate::controller::taskrun::TaskRun;

/// TaskRuns per page of the (re)list. A page is held whole, as JSON and decoded, on top of
/// everything already indexed: with Konflux TaskRuns (~57 KB each with the resolved
/// `buildah-remote-oci-ta` spec) a page of 100 was the controller's heap peak once recovery's
/// jobs were capped (heap profile: the HTTP read buffer and its contiguous copy, 5 MB each;
/// BENCHMARKS.md). 50 halves that for 400 requests per 20,000 TaskRuns. Streaming lists would
/// avoid pages altogether but need the `WatchList` feature, which not every supported cluster
/// has on.
const TASKRUN_LIST_PAGE: u32 = 50;

/// Forwards TaskRun watch events to the loop, with kube-runtime's back-off on errors (a relist
/// follows a 410 or a broken watch). Runs until `stop`.
pub async fn watch(
    client: kube::Client,
    tx: mpsc::Sender<Input>,
    stop: CancellationToken,
) {
    use kube::runtime::WatchStreamExt;
    let api: kube::Api<TaskRun> = kube::Api::all(client);
    let config = watcher::Config::default()
        .labels(crate::contract::TARGET_PLATFORM_LABEL)
        .page_size(TASKRUN_LIST_PAGE);
    let mut stream = watcher(api, config).default_backoff().boxed();
    loop {
        let next = tokio::select! {
            () = stop.cancelled() => return,
            n = stream.next() => n,
        };
        match next {
            Some(Ok(ev)) => {
                if tx.send(Input::TaskRuns(Box::new(ev))).await.is_err() {
                    return;
                }
            }
            Some(Err(error)) => tracing::warn!(%error, "TaskRun watch error; retrying"),
            None => return,
        }
    }
}
