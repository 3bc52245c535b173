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

/// Why a request about a TaskRun, its secret or a Secret of the controller did not succeed
/// (reads and writes alike).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The TaskRun (or the object) no longer exists, or is another object of the same name.
    #[error("gone")]
    Gone,
    /// The API refused the request for a reason a retry cannot fix.
    #[error(transparent)]
    Refused(Box<kube::Error>),
    /// Our finalizer could not be removed: the list kept changing under every attempt.
    #[error("the finalizer list kept changing under five attempts")]
    KeptChanging,
    /// It did not land within its time limit, retries included.
    #[error("did not land within {0:?}")]
    TimedOut(Duration),
    /// Every one of its attempts failed in a way a retry might fix (a timeout, 5xx, 429):
    /// given up on after this many.
    #[error("no answer in {0} attempts")]
    Unanswered(u32),
    /// Cancelled before it landed (leadership lost, shutdown).
    #[error("cancelled")]
    Cancelled,
}

impl ApiError {
    fn refused(e: kube::Error) -> Self {
        ApiError::Refused(Box::new(e))
    }
}

/// How [`retrying`] fails.
enum Failed {
    /// Answered 422 (a failed `test` op) or 409 AlreadyExists: the caller decides what it means.
    Rejected(kube::Error),
    Api(ApiError),
}

impl From<Failed> for ApiError {
    fn from(f: Failed) -> Self {
        match f {
            Failed::Rejected(e) => ApiError::refused(e),
            Failed::Api(e) => e,
        }
    }
}

impl From<ApiError> for Failed {
    fn from(e: ApiError) -> Self {
        Failed::Api(e)
    }
}

/// `f` within `limit`, retries included; else [`ApiError::TimedOut`].
pub async fn within<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or(Err(ApiError::TimedOut(limit)))
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

/// Runs `f` until it succeeds or fails for good; a 422 is handed back as [`Failed::Rejected`].
async fn retrying<T, F, Fut>(ctx: &Context, what: &str, f: F) -> Result<T, Failed>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    retrying_at_most(ctx, what, u32::MAX, f).await
}

/// [`retrying`], giving up with [`ApiError::Unanswered`] after `attempts` attempts that failed in
/// a way a retry might fix.
async fn retrying_at_most<T, F, Fut>(
    ctx: &Context,
    what: &str,
    attempts: u32,
    mut f: F,
) -> Result<T, Failed>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let mut delay = Duration::from_millis(100);
    let mut attempt = 0u32;
    loop {
        attempt = attempt.saturating_add(1);
        let last = attempt >= attempts;
        let request = async {
            let _permit = ctx.limits.api.acquire().await;
            tokio::time::timeout(ctx.limits.request_timeout, f()).await
        };
        let result = tokio::select! {
            () = ctx.cancel.cancelled() => return Err(ApiError::Cancelled.into()),
            r = request => r,
        };
        let error = match result {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => e,
            Err(_) if last => return Err(ApiError::Unanswered(attempt).into()),
            Err(_) => {
                tracing::debug!(what, "API request timed out; retrying");
                sleep_or_cancel(ctx, &mut delay).await?;
                continue;
            }
        };
        match classify(&error) {
            Class::Gone => return Err(ApiError::Gone.into()),
            Class::Invalid => return Err(Failed::Rejected(error)),
            Class::Permanent => return Err(ApiError::refused(error).into()),
            Class::Transient if last => {
                tracing::debug!(what, %error, attempt, "API request failed; giving up");
                return Err(ApiError::Unanswered(attempt).into());
            }
            Class::Transient => {
                tracing::debug!(what, %error, "API write failed; retrying");
                sleep_or_cancel(ctx, &mut delay).await?;
            }
        }
    }
}

async fn sleep_or_cancel(ctx: &Context, delay: &mut Duration) -> Result<(), ApiError> {
    tokio::select! {
        () = ctx.cancel.cancelled() => return Err(ApiError::Cancelled),
        () = tokio::time::sleep(*delay) => {}
    }
    *delay = (*delay * 2).min(MAX_BACKOFF);
    Ok(())
}

fn taskruns(ctx: &Context, ns: &str) -> Api<TaskRun> {
    Api::namespaced(ctx.client.clone(), ns)
}

/// The TaskRun if it still exists with this UID.
pub async fn current(ctx: &Context, tr: &TaskRunRef) -> Result<TaskRun, ApiError> {
    let api = taskruns(ctx, tr.namespace());
    let uid = tr.uid().to_string();
    match retrying(ctx, "read TaskRun", || api.get_opt(tr.name())).await? {
        Some(t) if t.metadata.uid.as_deref() == Some(uid.as_str()) => Ok(t),
        _ => Err(ApiError::Gone),
    }
}

/// One JSON Patch on a TaskRun; [`Failed::Rejected`] when the API answered 422.
async fn json_patch(
    ctx: &Context,
    tr: &TaskRunRef,
    ops: &patch::TaskRunPatch,
) -> Result<(), Failed> {
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
) -> Result<(), ApiError> {
    match json_patch(ctx, tr, &build(Maps::MARKED)).await {
        Ok(()) => Ok(()),
        Err(Failed::Api(e)) => Err(e),
        Err(Failed::Rejected(_)) => {
            let t = current(ctx, tr).await?;
            let maps = Maps {
                labels: t.metadata.labels.is_some(),
                annotations: t.metadata.annotations.is_some(),
            };
            match json_patch(ctx, tr, &build(maps)).await {
                Ok(()) => Ok(()),
                Err(Failed::Api(e)) => Err(e),
                Err(Failed::Rejected(e)) => {
                    // Changed again in between, or the UID no longer matches.
                    current(ctx, tr).await?;
                    Err(ApiError::refused(e))
                }
            }
        }
    }
}

/// `Action::Record`.
pub async fn record(ctx: &Context, tr: &TaskRunRef, placement: &Placement) -> Result<(), ApiError> {
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
pub async fn ungate(ctx: &Context, tr: &TaskRunRef) -> Result<(), ApiError> {
    let uid = tr.uid().to_string();
    match json_patch(ctx, tr, &patch::ungate(&uid)).await {
        Ok(()) => Ok(()),
        Err(Failed::Api(e)) => Err(e),
        Err(Failed::Rejected(_)) => {
            let t = current(ctx, tr).await?;
            if !t.is_gated() {
                return Ok(());
            }
            Ok(json_patch(ctx, tr, &patch::ungate(&uid)).await?)
        }
    }
}

/// Adds our finalizer (a TaskRun that lacks it); fine when present.
pub async fn add_finalizer(ctx: &Context, tr: &TaskRunRef) -> Result<(), ApiError> {
    let uid = tr.uid().to_string();
    let t = current(ctx, tr).await?;
    let Some(ops) = patch::add_finalizer(&uid, t.metadata.finalizers.as_deref()) else {
        return Ok(());
    };
    Ok(json_patch(ctx, tr, &ops).await?)
}

/// `Action::RemoveFinalizer`: reads the list (the patch names an index), removes ours; retried
/// when the list changed in between; fine when absent or the TaskRun is gone.
pub async fn remove_finalizer(ctx: &Context, tr: &TaskRunRef) -> Result<(), ApiError> {
    let uid = tr.uid().to_string();
    for _ in 0..5 {
        let t = match current(ctx, tr).await {
            Ok(t) => t,
            Err(ApiError::Gone) => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(ops) =
            patch::remove_finalizer(&uid, t.metadata.finalizers.as_deref().unwrap_or_default())
        else {
            return Ok(());
        };
        match json_patch(ctx, tr, &ops).await {
            Ok(()) | Err(Failed::Api(ApiError::Gone)) => return Ok(()),
            Err(Failed::Rejected(_)) => continue,
            Err(Failed::Api(e)) => return Err(e),
        }
    }
    Err(ApiError::KeptChanging)
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
) -> Result<(), ApiError> {
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
            Ok(_) => return Ok(()),
            Err(Failed::Rejected(kube::Error::Api(s))) if s.reason == "AlreadyExists" => {}
            // 404: the namespace is gone, and the TaskRun with it.
            Err(e) => return Err(e.into()),
        }
        // No resourceVersion: an unconditional update, which Secrets allow.
        match retrying(ctx, "replace secret", || api.replace(&name, &pp, &desired)).await {
            Ok(_) => return Ok(()),
            // Deleted in between: create it again.
            Err(Failed::Api(ApiError::Gone)) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Whether the TaskRun's secret exists, without reading it: a dry-run create is refused with
/// 409 AlreadyExists when the name is taken, and stores nothing either way. Asked at most
/// `attempts` times ([`ApiError::Unanswered`] then); a refusal no retry can change (403 from a
/// namespace being deleted, a full Secret quota or an admission policy; 422; any other 4xx but
/// 404, 408, 409 and 429) comes back at once as [`ApiError::Refused`].
pub async fn secret_exists(
    ctx: &Context,
    tr: &TaskRunRef,
    attempts: u32,
) -> Result<bool, ApiError> {
    let api = secrets(ctx, tr.namespace());
    let probe = patch::secret_probe(tr);
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let create = || api.create(&pp, &probe);
    match retrying_at_most(ctx, "probe secret", attempts, create).await {
        Ok(_) => Ok(false),
        Err(Failed::Rejected(kube::Error::Api(s))) if s.reason == "AlreadyExists" => Ok(true),
        // The namespace is gone: no secret.
        Err(Failed::Api(ApiError::Gone)) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `Action::DeleteSecret`, without reading the secret. The owner check is the TaskRun's: while a
/// TaskRun of this UID exists (our finalizer keeps it until cleanup, which deletes the secret
/// first), no namesake can own a Secret of this name, so what has it is this TaskRun's or a
/// stale one. For a TaskRun already gone nothing is deleted: a namesake's secret may have the
/// name now, and the GC deletes the old one through its ownerReference. The admission policy
/// on the controller's Secret writes lets it delete only Secrets it could have written.
pub async fn delete_secret(ctx: &Context, tr: &TaskRunRef) -> Result<(), ApiError> {
    match current(ctx, tr).await {
        Ok(_) => {}
        Err(ApiError::Gone) => return Ok(()),
        Err(e) => return Err(e),
    }
    let api = secrets(ctx, tr.namespace());
    let name = tr.secret_name();
    let dp = DeleteParams::default();
    match retrying(ctx, "delete secret", || api.delete(&name, &dp)).await {
        Ok(_) | Err(Failed::Api(ApiError::Gone)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A Secret of the controller's namespace as bytes per key (admin keys, cloud credentials), read
/// at use time so a rotated Secret takes effect at once. Errors name the Secret.
pub async fn controller_secret(
    ctx: &Context,
    name: &str,
) -> Result<BTreeMap<String, Vec<u8>>, SecretError> {
    let api = secrets(ctx, &ctx.namespace);
    let (namespace, name) = (ctx.namespace.clone(), name.to_owned());
    match retrying(ctx, "read controller secret", || api.get_opt(&name)).await {
        Ok(Some(s)) => Ok(s
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect()),
        Ok(None) | Err(Failed::Api(ApiError::Gone)) => {
            Err(SecretError::Missing { namespace, name })
        }
        Err(e) => Err(SecretError::Unreadable {
            namespace,
            name,
            source: e.into(),
        }),
    }
}

/// Why a Secret of the controller's namespace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("Secret {namespace}/{name} does not exist")]
    Missing { namespace: String, name: String },
    #[error("Secret {namespace}/{name}: {source}")]
    Unreadable {
        namespace: String,
        name: String,
        source: ApiError,
    },
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
