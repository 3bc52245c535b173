//! Kubernetes writes: TaskRun patches, the TaskRun's secret, Events, and the Secrets the
//! controller reads (admin keys, cloud credentials, in its own namespace only).
//!
//! Tenants' Secrets are never read (the controller's RBAC has no `get` on them): the TaskRun's
//! secret is created, or replaced by an unconditional update (no resourceVersion: Secrets allow
//! it); whether it exists is learnt from a dry-run create (409 when the name is taken, nothing
//! stored); a delete is for the TaskRun that is still there (see [`delete_secret`]).
//!
//! Transient failures (connection errors, timeouts, 409, 429, 5xx) are retried with back-off until
//! the write lands, the TaskRun turns out to be gone, or the action is cancelled (leadership lost).
//! A failed `test /metadata/uid` (422) or a 404 means the TaskRun is gone, confirmed by a read.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Secret};
use kube::api::{Api, DeleteParams, PostParams};

use super::Context;
use crate::controller::patch::{self, Maps};
use crate::controller::taskrun::TaskRun;
use crate::scheduler::{Placement, SecretData, TaskRunRef};

/// Why a write did not land.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The TaskRun (or the object) no longer exists, or is another object of the same name.
    #[error("gone")]
    Gone,
    /// The API refused the write for a reason a retry cannot fix.
    #[error("{0}")]
    Refused(String),
    /// Cancelled before it landed (leadership lost, shutdown).
    #[error("cancelled")]
    Cancelled,
}

/// How one API error is handled.
enum Class {
    Gone,
    Invalid,
    Transient,
    Permanent,
}

fn classify(e: &kube::Error) -> Class {
    match e {
        kube::Error::Api(s) => match s.code {
            404 | 410 => Class::Gone,
            // Handed back: a failed `test` op, or a create of a name that exists.
            422 => Class::Invalid,
            409 if s.reason == "AlreadyExists" => Class::Invalid,
            409 | 429 | 408 => Class::Transient,
            c if c >= 500 => Class::Transient,
            _ => Class::Permanent,
        },
        // Connection refused or cut, TLS, timeouts, a body that did not decode mid-restart.
        _ => Class::Transient,
    }
}

/// Longest wait between retries of one write.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Runs `f` until it succeeds or fails for good; `Ok(Err(e))` hands a 422 back to the caller.
async fn retrying<T, F, Fut>(
    ctx: &Context,
    what: &str,
    mut f: F,
) -> Result<Result<T, kube::Error>, WriteError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            let _permit = ctx.limits.api.acquire().await;
            tokio::time::timeout(ctx.limits.request_timeout, f()).await
        };
        let result = tokio::select! {
            () = ctx.cancel.cancelled() => return Err(WriteError::Cancelled),
            r = attempt => r,
        };
        let error = match result {
            Ok(Ok(v)) => return Ok(Ok(v)),
            Ok(Err(e)) => e,
            Err(_) => {
                tracing::debug!(what, "API request timed out; retrying");
                sleep_or_cancel(ctx, &mut delay).await?;
                continue;
            }
        };
        match classify(&error) {
            Class::Gone => return Err(WriteError::Gone),
            Class::Invalid => return Ok(Err(error)),
            Class::Permanent => return Err(WriteError::Refused(error.to_string())),
            Class::Transient => {
                tracing::debug!(what, %error, "API write failed; retrying");
                sleep_or_cancel(ctx, &mut delay).await?;
            }
        }
    }
}

async fn sleep_or_cancel(ctx: &Context, delay: &mut Duration) -> Result<(), WriteError> {
    tokio::select! {
        () = ctx.cancel.cancelled() => return Err(WriteError::Cancelled),
        () = tokio::time::sleep(*delay) => {}
    }
    *delay = (*delay * 2).min(MAX_BACKOFF);
    Ok(())
}

fn taskruns(ctx: &Context, ns: &str) -> Api<TaskRun> {
    Api::namespaced(ctx.client.clone(), ns)
}

/// The TaskRun if it still exists with this UID.
pub async fn current(ctx: &Context, tr: &TaskRunRef) -> Result<TaskRun, WriteError> {
    let api = taskruns(ctx, tr.namespace());
    let uid = tr.uid().to_string();
    let got = retrying(ctx, "read TaskRun", || api.get_opt(tr.name())).await?;
    match got {
        Ok(Some(t)) if t.metadata.uid.as_deref() == Some(uid.as_str()) => Ok(t),
        Ok(_) => Err(WriteError::Gone),
        Err(e) => Err(WriteError::Refused(e.to_string())),
    }
}

/// One JSON Patch on a TaskRun; `Ok(Err(_))` when the API answered 422.
async fn json_patch(
    ctx: &Context,
    tr: &TaskRunRef,
    ops: &patch::TaskRunPatch,
) -> Result<Result<(), kube::Error>, WriteError> {
    let path = format!(
        "/apis/tekton.dev/v1/namespaces/{}/taskruns/{}",
        tr.namespace(),
        tr.name()
    );
    let body = serde_json::to_vec(ops).expect("JSON values serialise");
    retrying(ctx, "patch TaskRun", || {
        let req = http::Request::patch(&path)
            .header(http::header::CONTENT_TYPE, "application/json-patch+json")
            .body(body.clone())
            .expect("valid request");
        // The answer is the whole patched TaskRun (tens of KB with its resolved spec): checked
        // to be JSON, never built.
        async {
            ctx.client
                .request::<serde::de::IgnoredAny>(req)
                .await
                .map(|_| ())
        }
    })
    .await
}

/// Patches with `build(maps)`; on a 422 re-reads the TaskRun (gone, or which maps it lacks) and
/// tries once more with what it really has.
async fn patch_taskrun(
    ctx: &Context,
    tr: &TaskRunRef,
    build: impl Fn(Maps) -> patch::TaskRunPatch,
) -> Result<(), WriteError> {
    match json_patch(ctx, tr, &build(Maps::MARKED)).await? {
        Ok(()) => Ok(()),
        Err(_) => {
            let t = current(ctx, tr).await?;
            let maps = Maps {
                labels: t.metadata.labels.is_some(),
                annotations: t.metadata.annotations.is_some(),
            };
            match json_patch(ctx, tr, &build(maps)).await? {
                Ok(()) => Ok(()),
                Err(e) => {
                    // Changed again in between, or the UID no longer matches.
                    current(ctx, tr).await?;
                    Err(WriteError::Refused(e.to_string()))
                }
            }
        }
    }
}

/// `Action::Record`.
pub async fn record(
    ctx: &Context,
    tr: &TaskRunRef,
    placement: &Placement,
) -> Result<(), WriteError> {
    let uid = tr.uid().to_string();
    // Recovery trusts the recorded host only with this proof (it does not read the secret).
    let proof = placement
        .assigned_host
        .as_deref()
        .map(|host| ctx.secret_proof.sign_allocation(tr, host));
    patch_taskrun(ctx, tr, |maps| {
        patch::record_proven(&uid, placement, proof.as_deref(), maps)
    })
    .await
}

/// `Action::Ungate`: fine when already un-gated.
pub async fn ungate(ctx: &Context, tr: &TaskRunRef) -> Result<(), WriteError> {
    let uid = tr.uid().to_string();
    match json_patch(ctx, tr, &patch::ungate(&uid)).await? {
        Ok(()) => Ok(()),
        Err(_) => {
            let t = current(ctx, tr).await?;
            if !t.is_gated() {
                return Ok(());
            }
            match json_patch(ctx, tr, &patch::ungate(&uid)).await? {
                Ok(()) => Ok(()),
                Err(e) => Err(WriteError::Refused(e.to_string())),
            }
        }
    }
}

/// Adds our finalizer (a TaskRun that lacks it); fine when present.
pub async fn add_finalizer(ctx: &Context, tr: &TaskRunRef) -> Result<(), WriteError> {
    let uid = tr.uid().to_string();
    let t = current(ctx, tr).await?;
    let Some(ops) = patch::add_finalizer(&uid, t.metadata.finalizers.as_deref()) else {
        return Ok(());
    };
    match json_patch(ctx, tr, &ops).await? {
        Ok(()) => Ok(()),
        Err(e) => Err(WriteError::Refused(e.to_string())),
    }
}

/// `Action::RemoveFinalizer`: reads the list (the patch names an index), removes ours; retried
/// when the list changed in between; fine when absent or the TaskRun is gone.
pub async fn remove_finalizer(ctx: &Context, tr: &TaskRunRef) -> Result<(), WriteError> {
    let uid = tr.uid().to_string();
    for _ in 0..5 {
        let t = match current(ctx, tr).await {
            Ok(t) => t,
            Err(WriteError::Gone) => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(ops) =
            patch::remove_finalizer(&uid, t.metadata.finalizers.as_deref().unwrap_or_default())
        else {
            return Ok(());
        };
        match json_patch(ctx, tr, &ops).await {
            Ok(Ok(())) | Err(WriteError::Gone) => return Ok(()),
            Ok(Err(_)) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(WriteError::Refused(
        "the finalizer list kept changing under five attempts".into(),
    ))
}

fn secrets(ctx: &Context, ns: &str) -> Api<Secret> {
    Api::namespaced(ctx.client.clone(), ns)
}

/// `Action::WriteSecret`: create, or replace whatever has the name (a stale secret of a deleted
/// TaskRun of the same name included: it is re-owned by this one) without reading it.
pub async fn write_secret(
    ctx: &Context,
    tr: &TaskRunRef,
    data: &SecretData,
) -> Result<(), WriteError> {
    let api = secrets(ctx, tr.namespace());
    let desired = patch::secret(tr, data, &ctx.otp, &ctx.secret_proof);
    let name = tr.secret_name();
    let pp = PostParams::default();
    loop {
        // Conditional on the TaskRun's UID, as every write about it: a late write for a TaskRun
        // that is gone must not replace the secret of a namesake created since. (A TaskRun
        // deleted after this check leaves a secret its ownerReference lets the GC delete.)
        current(ctx, tr).await?;
        let created = retrying(ctx, "create secret", || api.create(&pp, &desired)).await;
        match created {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(kube::Error::Api(s))) if s.reason == "AlreadyExists" => {}
            Ok(Err(e)) => return Err(WriteError::Refused(e.to_string())),
            // 404: the namespace is gone, and the TaskRun with it.
            Err(e) => return Err(e),
        }
        // No resourceVersion: an unconditional update, which Secrets allow.
        match retrying(ctx, "replace secret", || api.replace(&name, &pp, &desired)).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => return Err(WriteError::Refused(e.to_string())),
            // Deleted in between: create it again.
            Err(WriteError::Gone) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Whether the TaskRun's secret exists, without reading it: a dry-run create is refused with
/// 409 AlreadyExists when the name is taken, and stores nothing either way.
pub async fn secret_exists(ctx: &Context, tr: &TaskRunRef) -> Result<bool, WriteError> {
    let api = secrets(ctx, tr.namespace());
    let probe = patch::secret_probe(tr);
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match retrying(ctx, "probe secret", || api.create(&pp, &probe)).await {
        Ok(Ok(_)) => Ok(false),
        Ok(Err(kube::Error::Api(s))) if s.reason == "AlreadyExists" => Ok(true),
        Ok(Err(e)) => Err(WriteError::Refused(e.to_string())),
        // The namespace is gone: no secret.
        Err(WriteError::Gone) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `Action::DeleteSecret`, without reading the secret. The owner check is the TaskRun's: while a
/// TaskRun of this UID exists (our finalizer keeps it until cleanup, which deletes the secret
/// first), no namesake can own a Secret of this name, so what has it is this TaskRun's or a
/// stale one. For a TaskRun already gone nothing is deleted: a namesake's secret may have the
/// name now, and the GC deletes the old one through its ownerReference. The admission policy
/// on the controller's Secret writes lets it delete only Secrets it could have written.
pub async fn delete_secret(ctx: &Context, tr: &TaskRunRef) -> Result<(), WriteError> {
    match current(ctx, tr).await {
        Ok(_) => {}
        Err(WriteError::Gone) => return Ok(()),
        Err(e) => return Err(e),
    }
    let api = secrets(ctx, tr.namespace());
    let name = tr.secret_name();
    let dp = DeleteParams::default();
    match retrying(ctx, "delete secret", || api.delete(&name, &dp)).await {
        Ok(_) | Err(WriteError::Gone) => Ok(()),
        Err(e) => Err(e),
    }
}

/// A Secret of the controller's namespace as bytes per key (admin keys, cloud credentials), read
/// at use time so a rotated Secret takes effect at once. Errors name the Secret.
pub async fn controller_secret(
    ctx: &Context,
    name: &str,
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    let api = secrets(ctx, &ctx.namespace);
    match retrying(ctx, "read controller secret", || api.get_opt(name)).await {
        Ok(Ok(Some(s))) => Ok(s
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect()),
        Ok(Ok(None)) | Err(WriteError::Gone) => {
            Err(format!("Secret {}/{name} does not exist", ctx.namespace))
        }
        Ok(Err(e)) => Err(format!("Secret {}/{name}: {e}", ctx.namespace)),
        Err(e) => Err(format!("Secret {}/{name}: {e}", ctx.namespace)),
    }
}

/// A reference to a TaskRun for Events.
pub fn taskrun_reference(tr: &TaskRunRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("tekton.dev/v1".into()),
        kind: Some("TaskRun".into()),
        name: Some(tr.name().into()),
        namespace: Some(tr.namespace().into()),
        uid: Some(tr.uid().to_string()),
        ..ObjectReference::default()
    }
}
