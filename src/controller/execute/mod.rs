//! The executor: runs scheduler actions against the API server, build hosts, the OTP server and
//! the cloud, and turns their outcomes into events (design §10).
//!
//! Contract kept (see `scheduler/action.rs`): every action with an `OpId` yields exactly one
//! result event, also on timeout or error; actions without one yield nothing, or
//! `TaskRunDone` when the TaskRun turned out to be gone. Work is bounded by semaphores per class
//! (API requests, SSH operations, Events), never by the result channel, which is unbounded so
//! the loop ↔ executor cycle cannot deadlock. Every action has a time limit, but a finalizer
//! removal tries again after a refusal or a timeout until it lands; a cancelled context
//! (leadership lost) stops work at once and reports nothing: the scheduler it would report to is
//! gone.

pub mod cloud;
pub mod kube;
pub mod ssh;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::metrics::ControllerMetrics;
use super::patch::{OtpEndpoint, SecretProof};
use crate::config::HostConfig;
use crate::provision::Provisioner;
use crate::scheduler::{Action, Event, TaskRunRef};

/// Where private keys go: the OTP server (design §7).
pub trait KeyStore: Send + Sync {
    /// Stores `key` for `owner` (a TaskRun UID) under the idempotency id `request`; with `rearm`
    /// the owner's token already handed out (its latest) redeems the new key instead of a new
    /// token being issued. `rearms_left`: the TaskRun's retries not yet started (only a used
    /// token with one to come may hold its redeems). Returns the token.
    fn store<'a>(
        &'a self,
        owner: &'a str,
        request: &'a str,
        rearm: bool,
        rearms_left: u32,
        key: &'a [u8],
    ) -> BoxFuture<'a, Result<String, String>>;

    /// Removes every entry of `owner` (its TaskRun ended).
    fn revoke<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Result<(), String>>;
}

/// Concurrency bounds per class of work.
#[derive(Debug)]
pub struct Limits {
    /// API requests in flight.
    pub api: Semaphore,
    /// SSH operations in flight (each host also caps its own sessions).
    pub ssh: Semaphore,
    /// Events being published.
    pub events: Semaphore,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            api: Semaphore::new(32),
            ssh: Semaphore::new(32),
            events: Semaphore::new(4),
        }
    }
}

/// Everything actions need. Cheap to clone: one per leadership term, with its own `cancel`.
#[derive(Clone)]
pub struct Context {
    pub client: ::kube::Client,
    /// The controller's namespace (admin-key and cloud Secrets, host-config).
    pub namespace: String,
    pub otp: OtpEndpoint,
    /// Signs the secrets we write and recognises them at recovery.
    pub secret_proof: Arc<SecretProof>,
    pub keys: Arc<dyn KeyStore>,
    pub provisioner: Arc<Provisioner>,
    pub known_hosts: Arc<ssh::KnownHosts>,
    /// The served host-config (build-user settings are read from it at use time).
    pub config: crate::config_source::ConfigSource,
    pub cloud: Arc<cloud::CloudExec>,
    pub recorder: ::kube::runtime::events::Recorder,
    pub metrics: ControllerMetrics,
    pub limits: Arc<Limits>,
    /// Cancelled when the term ends (leadership lost, shutdown).
    pub cancel: CancellationToken,
}

/// Work for the executor: a scheduler action, or one of the controller's own TaskRun writes.
#[derive(Debug, Clone)]
pub enum Job {
    Action(Action),
    /// Add our finalizer to a TaskRun that lacks it.
    AddFinalizer(TaskRunRef),
}

impl Job {
    /// Metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Job::AddFinalizer(_) => "add_finalizer",
            Job::Action(a) => match a {
                Action::Record { .. } => "record",
                Action::Provision { .. } => "provision",
                Action::WriteSecret { .. } => "write_secret",
                Action::DeleteSecret { .. } => "delete_secret",
                Action::Ungate { .. } => "ungate",
                Action::RemoveFinalizer { .. } => "remove_finalizer",
                Action::Deprovision { .. } => "deprovision",
                Action::Launch { .. } => "launch",
                Action::Probe { .. } => "probe",
                Action::Terminate { .. } => "terminate",
                Action::Retag { .. } => "retag",
                Action::Notify { .. } => "notify",
                Action::Observe(_) => "observe",
            },
        }
    }
}

/// Time limits per kind of work.
const API_WRITE_LIMIT: Duration = Duration::from_secs(600);
const SSH_LIMIT: Duration = Duration::from_secs(300);

/// Runs a job; returns the events to feed back to the scheduler (empty when cancelled).
pub async fn run(ctx: &Context, job: Job) -> Vec<Event> {
    let kind = job.kind();
    ctx.metrics.in_flight(kind, 1);
    let out = tokio::select! {
        () = ctx.cancel.cancelled() => Vec::new(),
        out = dispatch(ctx, job) => out,
    };
    ctx.metrics.in_flight(kind, -1);
    out
}

fn gone(tr: &TaskRunRef) -> Vec<Event> {
    vec![Event::TaskRunDone {
        namespace: tr.namespace().to_owned(),
        name: tr.name().to_owned(),
        uid: tr.uid().to_string(),
    }]
}

/// Outcome of a TaskRun write as events, with failures counted and logged.
fn written(
    ctx: &Context,
    kind: &str,
    tr: &TaskRunRef,
    r: Result<Result<(), kube::WriteError>, tokio::time::error::Elapsed>,
) -> Vec<Event> {
    match r {
        Ok(Ok(())) => Vec::new(),
        Ok(Err(kube::WriteError::Gone)) => gone(tr),
        Ok(Err(kube::WriteError::Cancelled)) => Vec::new(),
        Ok(Err(kube::WriteError::Refused(error))) => {
            ctx.metrics.failed(kind);
            tracing::error!(taskrun = %tr, kind, %error, "API refused a write");
            Vec::new()
        }
        Err(_) => {
            ctx.metrics.failed(kind);
            tracing::error!(taskrun = %tr, kind, limit = ?API_WRITE_LIMIT, "write did not land in time");
            Vec::new()
        }
    }
}

/// First and longest wait between attempts to remove a finalizer.
const FINALIZER_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(60));

/// Removes our finalizer, attempt after attempt until it is gone (or the TaskRun is, or the term
/// ended: the next leader's recovery finds the finalizer again). The scheduler forgets a TaskRun
/// once it asked for this, so a write given up on here would leave a TaskRun nobody can delete.
async fn remove_finalizer(ctx: &Context, taskrun: &TaskRunRef) {
    let (mut delay, longest) = FINALIZER_RETRY;
    loop {
        let r = tokio::time::timeout(API_WRITE_LIMIT, kube::remove_finalizer(ctx, taskrun)).await;
        let error = match r {
            Ok(Ok(()) | Err(kube::WriteError::Gone | kube::WriteError::Cancelled)) => return,
            Ok(Err(kube::WriteError::Refused(error))) => error,
            Err(_) => format!("did not land within {API_WRITE_LIMIT:?}"),
        };
        ctx.metrics.failed("remove_finalizer");
        tracing::error!(taskrun = %taskrun, %error, retry_in = ?delay, "finalizer not removed; retrying");
        tokio::select! {
            () = ctx.cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(longest);
    }
}

async fn dispatch(ctx: &Context, job: Job) -> Vec<Event> {
    let kind = job.kind();
    let action = match job {
        Job::AddFinalizer(tr) => {
            let r = tokio::time::timeout(API_WRITE_LIMIT, kube::add_finalizer(ctx, &tr)).await;
            return written(ctx, kind, &tr, r);
        }
        Job::Action(a) => a,
    };
    match action {
        Action::Record { taskrun, placement } => {
            let r = tokio::time::timeout(API_WRITE_LIMIT, kube::record(ctx, &taskrun, &placement))
                .await;
            written(ctx, kind, &taskrun, r)
        }
        Action::WriteSecret { taskrun, secret } => {
            let r =
                tokio::time::timeout(API_WRITE_LIMIT, kube::write_secret(ctx, &taskrun, &secret))
                    .await;
            written(ctx, kind, &taskrun, r)
        }
        Action::DeleteSecret { taskrun } => {
            let r = tokio::time::timeout(API_WRITE_LIMIT, kube::delete_secret(ctx, &taskrun)).await;
            written(ctx, kind, &taskrun, r)
        }
        Action::Ungate { taskrun } => {
            let r = tokio::time::timeout(API_WRITE_LIMIT, kube::ungate(ctx, &taskrun)).await;
            written(ctx, kind, &taskrun, r)
        }
        Action::RemoveFinalizer { taskrun } => {
            // The key of a TaskRun that ended must not stay redeemable (the TTL is a safety net).
            if let Err(error) = ctx.keys.revoke(&taskrun.uid().to_string()).await {
                ctx.metrics.failed("otp_revoke");
                tracing::warn!(taskrun = %taskrun, %error, "could not revoke the TaskRun's OTP entries");
            }
            remove_finalizer(ctx, &taskrun).await;
            Vec::new()
        }
        Action::Provision {
            op,
            taskrun,
            host,
            rearm,
        } => {
            let r =
                tokio::time::timeout(SSH_LIMIT, ssh::provision(ctx, op.0, &taskrun, &host, rearm))
                    .await
                    .unwrap_or_else(|_| {
                        Err(format!("provisioning took longer than {SSH_LIMIT:?}"))
                    });
            match r {
                Ok(otp) => vec![Event::Provisioned { op, otp }],
                Err(error) => {
                    ctx.metrics.failed(kind);
                    tracing::warn!(taskrun = %taskrun, host = host.name(), %error, "provisioning failed");
                    vec![Event::ProvisionFailed { op, error }]
                }
            }
        }
        Action::Deprovision { op, user, host } => {
            let r = tokio::time::timeout(SSH_LIMIT, ssh::deprovision(ctx, &user, &host))
                .await
                .unwrap_or_else(|_| Err(format!("removal took longer than {SSH_LIMIT:?}")));
            if let Err(error) = &r {
                ctx.metrics.failed(kind);
                tracing::warn!(user = %user.name(), host = host.name(), %error, "build user removal failed");
            }
            vec![Event::Deprovisioned { op, error: r.err() }]
        }
        Action::Launch { .. }
        | Action::Probe { .. }
        | Action::Terminate { .. }
        | Action::Retag { .. } => cloud::run(ctx, action).await,
        Action::Notify {
            taskrun,
            warning,
            reason,
            message,
        } => {
            let reference = match &taskrun {
                Some(tr) => kube::taskrun_reference(tr),
                None => ctx.config_reference(),
            };
            kube::publish(ctx, reference, warning, reason, &message).await;
            Vec::new()
        }
        Action::Observe(o) => {
            ctx.metrics.observe(&o);
            Vec::new()
        }
    }
}

impl Context {
    /// Events not about a TaskRun go to the host-config ConfigMap.
    fn config_reference(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("ConfigMap".into()),
            name: Some(crate::contract::HOST_CONFIG_NAME.into()),
            namespace: Some(self.namespace.clone()),
            ..Default::default()
        }
    }
}

/// The rounds of a periodic listing: the served config every `every`, until the term ends.
pub struct Rounds {
    cancel: CancellationToken,
    config: tokio::sync::watch::Receiver<Option<Arc<HostConfig>>>,
    every: Duration,
}

impl Rounds {
    /// Rounds of `ctx`'s term.
    pub fn new(
        ctx: &Context,
        config: tokio::sync::watch::Receiver<Option<Arc<HostConfig>>>,
        every: Duration,
    ) -> Self {
        Rounds {
            cancel: ctx.cancel.clone(),
            config,
            every,
        }
    }

    /// The config to list for, after the next period; `None` once the term ended.
    pub async fn next(&mut self) -> Option<Arc<HostConfig>> {
        loop {
            tokio::select! {
                () = self.cancel.cancelled() => return None,
                () = tokio::time::sleep(self.every) => {}
            }
            let current = self.config.borrow().clone();
            if current.is_some() {
                return current;
            }
        }
    }
}
