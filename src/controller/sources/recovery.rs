//! The recovery snapshot of a new term: what the ledger is rebuilt from, beyond the TaskRun
//! index the loop keeps (docs/architecture.md, "The controller shell").

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tracing::Instrument;

use super::Input;
use crate::config::HostConfig;
use crate::controller::execute::{self, Context};
use crate::controller::patch::SecretProof;
use crate::scheduler::{SecretProbe, Snapshot, TaskRunRecord, TaskRunRef, Uid};

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

/// Lookups of one TaskRun's secret at recovery before its answer counts as unknown, when each
/// fails in a way a retry might fix (their back-off adds up to about 13 s); a refusal no retry
/// can change counts at once.
const PROBE_ATTEMPTS: u32 = 8;

/// Looks up what the snapshot needs beyond the index: whether the Secret of each TaskRun whose
/// state depends on it exists (a dry-run create, a few at a time: tenants' Secrets are never
/// read), whether the TaskRun carries our proof for its allocation, and the cloud's instances.
/// A lookup refused for good, out of attempts, or not answered by the recovery deadline
/// ([`Limits::recovery_deadline`](crate::controller::execute::Limits::recovery_deadline), from
/// the first lookup) leaves that TaskRun's secret unknown, so one namespace cannot hold the
/// whole term in recovery. `None` when cancelled.
async fn collect_snapshot(
    ctx: &Context,
    records: Vec<(TaskRunRecord, bool)>,
    config: &HostConfig,
) -> Option<Snapshot> {
    let deadline = tokio::time::Instant::now() + ctx.limits.recovery_deadline;
    let lookups = futures::stream::iter(records.into_iter().map(|(mut rec, matters)| {
        let r = TaskRunRef::new(&rec.namespace, &rec.name, Uid::new(&rec.uid));
        // Each lookup's lines carry its TaskRun.
        let span = if matters {
            tracing::info_span!(
                "secret_lookup",
                namespace = r.namespace(),
                taskrun = r.name(),
                uid = %r.uid()
            )
        } else {
            tracing::Span::none()
        };
        async move {
            if matters {
                let probe = if tokio::time::Instant::now() >= deadline {
                    None
                } else {
                    tokio::time::timeout_at(deadline, probe(ctx, &r)).await.ok()
                };
                let probe = match probe {
                    Some(Some(probe)) => probe,
                    Some(None) => return None,
                    None => {
                        ctx.metrics.failed("probe_secret");
                        tracing::warn!(taskrun = %r, uid = %r.uid(), deadline = ?ctx.limits.recovery_deadline, "no answer about the TaskRun's secret by the recovery deadline; taking it as unknown");
                        SecretProbe::Unknown
                    }
                };
                learn(&mut rec, &r, probe, &ctx.secret_proof);
            }
            Some(rec)
        }
        .instrument(span)
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

/// The lookup of one TaskRun's secret; `None` when cancelled.
async fn probe(ctx: &Context, r: &TaskRunRef) -> Option<SecretProbe> {
    match execute::kube::secret_exists(ctx, r, PROBE_ATTEMPTS).await {
        Ok(true) => Some(SecretProbe::Taken),
        Ok(false) => Some(SecretProbe::Free),
        Err(execute::kube::ApiError::Cancelled) => None,
        Err(error) => {
            ctx.metrics.failed("probe_secret");
            tracing::warn!(taskrun = %r, uid = %r.uid(), %error, "could not learn whether the TaskRun's secret exists; taking it as unknown");
            Some(SecretProbe::Unknown)
        }
    }
}

/// What the lookup answered, with the verdict on the TaskRun's proof for its `assigned-host`.
fn learn(rec: &mut TaskRunRecord, r: &TaskRunRef, probe: SecretProbe, proof: &SecretProof) {
    let verified = proof.verify_allocation(r, rec.assigned_host.as_deref(), rec.proof.as_ref());
    rec.learn_secret(probe, verified);
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::contract;
    use crate::scheduler::SecretKind;

    /// A TaskRun's record as the index reads it: `assigned-host` and the proof annotation.
    fn record(host: &str, proof: Option<&str>) -> TaskRunRecord {
        let mut rec = TaskRunRecord {
            namespace: "tenant-a".into(),
            name: "build".into(),
            uid: "uid-1".into(),
            ..TaskRunRecord::default()
        };
        let labels = BTreeMap::from([(contract::ASSIGNED_HOST_LABEL.to_owned(), host.to_owned())]);
        let annotations = proof
            .map(|p| {
                (
                    contract::ALLOCATION_PROOF_ANNOTATION.to_owned(),
                    p.to_owned(),
                )
            })
            .into_iter()
            .collect();
        rec.read_metadata(&labels, &annotations);
        rec
    }

    /// Recovery acts on the proof's verdict: a found secret is proven only when the TaskRun
    /// carries the controller's proof for this TaskRun and its `assigned-host`; a forged, absent
    /// or misplaced proof leaves it unproven, and so does an unknown answer whatever the proof.
    #[test]
    fn only_a_valid_proof_makes_a_found_secret_proven() {
        let ours = SecretProof::from_store_token(b"store token");
        let r = TaskRunRef::new("tenant-a", "build", Uid::new("uid-1"));
        let valid = ours.sign_allocation(&r, "h1");
        let other_taskrun = TaskRunRef::new("tenant-a", "build", Uid::new("uid-2"));
        let cases = [
            ("valid", Some(valid.clone()), "h1", true),
            ("signed for another host", Some(valid.clone()), "h2", false),
            (
                "another TaskRun's",
                Some(ours.sign_allocation(&other_taskrun, "h1")),
                "h1",
                false,
            ),
            (
                "another key's",
                Some(SecretProof::from_store_token(b"other").sign_allocation(&r, "h1")),
                "h1",
                false,
            ),
            (
                "forged",
                Some(format!("v1:{}", "ab".repeat(32))),
                "h1",
                false,
            ),
            ("absent", None, "h1", false),
        ];
        for (what, proof, host, proven) in cases {
            let mut rec = record(host, proof.as_deref());
            learn(&mut rec, &r, SecretProbe::Taken, &ours);
            assert_eq!(rec.secret, Some(SecretKind::Remote), "{what}");
            assert_eq!(rec.secret_proven, proven, "{what}");
            let mut rec = record(host, proof.as_deref());
            learn(&mut rec, &r, SecretProbe::Unknown, &ours);
            assert_eq!(rec.secret, Some(SecretKind::Remote), "{what}: unknown");
            assert!(!rec.secret_proven, "{what}: unknown is never proven");
            assert_eq!(rec.secret_probe, SecretProbe::Unknown);
        }
    }
}
