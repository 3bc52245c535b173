//! The recovery snapshot of a new term: what the ledger is rebuilt from, beyond the TaskRun
//! index the loop keeps (docs/architecture.md, "The controller shell").

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;

use super::Input;
use crate::config::HostConfig;
use crate::controller::execute::{self, Context};
use crate::scheduler::{SecretKind, Snapshot, TaskRunRecord, TaskRunRef, Uid};

/// Loads the host keys other replicas learned, then collects the snapshot of term `term` and
/// sends it to the loop; nothing when the term ends first.
pub async fn run(
    ctx: Context,
    term: u64,
    records: Vec<(TaskRunRecord, bool)>,
    config: std::sync::Arc<HostConfig>,
    tx: mpsc::Sender<Input>,
) {
    // Host keys other replicas learned, before any SSH connection of this term.
    loop {
        match ctx.known_hosts.load(&ctx).await {
            Ok(n) => {
                tracing::debug!(hosts = n, "known host keys loaded");
                break;
            }
            Err(error) => {
                tracing::warn!(%error, "loading known host keys; retrying");
                tokio::select! {
                    () = ctx.cancel.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        }
    }
    let snapshot = collect_snapshot(&ctx, records, &config).await;
    if let Some(snapshot) = snapshot {
        let _ = tx.send(Input::Recovered { term, snapshot }).await;
    }
}

/// Looks up what the snapshot needs beyond the index: whether the Secret of each TaskRun whose
/// state depends on it exists (a dry-run create, a few at a time: tenants' Secrets are never
/// read), whether the TaskRun carries our proof for its allocation, and the cloud's instances.
/// `None` when cancelled.
async fn collect_snapshot(
    ctx: &Context,
    records: Vec<(TaskRunRecord, bool)>,
    config: &HostConfig,
) -> Option<Snapshot> {
    let lookups = futures::stream::iter(records.into_iter().map(|(mut rec, matters)| async move {
        if matters {
            let r = TaskRunRef::new(&rec.namespace, &rec.name, Uid::new(&rec.uid));
            loop {
                match execute::kube::secret_exists(ctx, &r).await {
                    Ok(exists) => {
                        let host = rec.assigned_host.as_deref();
                        rec.secret = exists.then(|| SecretKind::for_assigned_host(host));
                        rec.secret_proven = exists
                            && ctx.secret_proof.verify_allocation(&r, host, rec.proof.as_ref());
                        break;
                    }
                    Err(execute::kube::ApiError::Cancelled) => return None,
                    Err(error) => {
                        tracing::warn!(taskrun = %r, uid = %r.uid(), %error, "probing the TaskRun's secret for recovery; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }
        Some(rec)
    }))
    .buffer_unordered(16)
    .collect::<Vec<_>>()
    .await;
    let taskruns: Option<Vec<TaskRunRecord>> = lookups.into_iter().collect();
    let (instances, unlisted) = super::instances::list_all(ctx, config).await?;
    Some(Snapshot {
        taskruns: taskruns?,
        instances,
        unlisted,
    })
}
