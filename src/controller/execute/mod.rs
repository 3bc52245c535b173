//! The executor: runs scheduler actions against the API server, build hosts, the OTP server and
//! the cloud, and turns their outcomes into events (docs/architecture.md, "The controller shell").
//!
//! Contract kept (see `scheduler/action.rs`): every action with an `OpId` yields exactly one
//! result event, also on timeout or error; actions without one yield nothing, or
//! `TaskRunDone` when the TaskRun turned out to be gone, or `SecretRefused` when the API server
//! refused a secret (or it did not land in time). Work is bounded by semaphores per class (API
//! requests, SSH operations, cloud launches and terminations; sized by [`Limits`]; Events by
//! their outbox, `super::events`), never by the result channel, which is unbounded so the loop ↔
//! executor cycle cannot deadlock. Every action has a time limit ([`Limits`] too), but a
//! finalizer removal is tried again after a refusal or a timeout until it lands: its job ends and
//! hands the loop the next attempt with its back-off ([`Outcome::again`]), so removals refused
//! for good hold no job's place while they wait. A cancelled context (leadership lost) stops work
//! at once and reports nothing: the scheduler it would report to is gone.

pub mod cloud;
pub mod kube;
pub mod ssh;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::events::{EventSink, Note};
use super::metrics::ControllerMetrics;
use super::patch::{OtpEndpoint, SecretProof};
use crate::otp::OtpClientError;
use crate::provision::Provisioner;
use crate::scheduler::{Action, Event, LaunchOwner, RemoteUser, TaskRunRef};
use kube::{ApiError, within};

/// Where private keys go: the OTP server (docs/architecture.md, "The key hand-off and retries").
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
    ) -> BoxFuture<'a, Result<String, OtpClientError>>;

    /// Removes every entry of `owner` (its TaskRun ended).
    fn revoke<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Result<(), OtpClientError>>;
}

/// Concurrency bounds per class of work and time limits per kind of action (`mpc controller`
/// flags; the defaults and their trade-offs are in the README's flags section).
#[derive(Debug)]
pub struct Limits {
    /// API requests in flight.
    pub api: Semaphore,
    /// SSH operations in flight, all hosts together (each host also caps its own sessions).
    pub ssh: Semaphore,
    /// Cloud launches, terminations and retags in flight (probes are batched apart).
    pub cloud: Semaphore,
    /// One API request; a request that takes longer is abandoned and retried.
    pub request_timeout: Duration,
    /// One TaskRun or secret write, its retries included; then it is given up (and counted in
    /// `action_failures`), except a finalizer removal, which starts over.
    pub write_timeout: Duration,
    /// One provisioning or build-user removal, waiting for a permit included.
    pub ssh_timeout: Duration,
    /// A new term's lookups of TaskRuns' secrets, all together, from the first: a secret not
    /// learnt about by then is unknown, and the term starts scheduling.
    pub recovery_deadline: Duration,
}

/// The flags' values as [`Limits`]; see [`Limits::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitSettings {
    pub api: usize,
    pub ssh: usize,
    pub cloud: usize,
    pub events: usize,
    pub request_timeout: Duration,
    pub write_timeout: Duration,
    pub ssh_timeout: Duration,
    pub recovery_deadline: Duration,
}

impl Default for LimitSettings {
    fn default() -> Self {
        LimitSettings {
            api: 32,
            ssh: 32,
            cloud: 16,
            events: 4,
            request_timeout: Duration::from_secs(15),
            write_timeout: Duration::from_secs(600),
            ssh_timeout: Duration::from_secs(300),
            recovery_deadline: Duration::from_secs(120),
        }
    }
}

impl Limits {
    /// Bounds from settings; a zero count is taken as one (no class of work may stall).
    pub fn new(s: LimitSettings) -> Self {
        Limits {
            api: Semaphore::new(s.api.max(1)),
            ssh: Semaphore::new(s.ssh.max(1)),
            cloud: Semaphore::new(s.cloud.max(1)),
            request_timeout: s.request_timeout,
            write_timeout: s.write_timeout,
            ssh_timeout: s.ssh_timeout,
            recovery_deadline: s.recovery_deadline,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::new(LimitSettings::default())
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
    pub events: EventSink,
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
    /// Remove our finalizer again: an earlier attempt (of `Action::RemoveFinalizer`, then of
    /// this job; `failed` of them) did not land.
    RemoveFinalizer {
        taskrun: TaskRunRef,
        failed: u32,
    },
}

/// What a job leaves for the loop.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Events for the scheduler.
    pub events: Vec<Event>,
    /// A job to run after a wait: the next attempt of a finalizer removal that did not land.
    /// Its TaskRun's lane stays taken meanwhile (later writes about it keep their order), but
    /// it holds no job's place.
    pub again: Option<(Job, Duration)>,
}

impl From<Vec<Event>> for Outcome {
    fn from(events: Vec<Event>) -> Self {
        Outcome {
            events,
            again: None,
        }
    }
}

impl Job {
    /// Metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Job::AddFinalizer(_) => "add_finalizer",
            Job::RemoveFinalizer { .. } => "remove_finalizer",
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

/// Target of the per-step timing lines (debug level): where a TaskRun's time goes, for the
/// controller benchmark's breakdown; off in production's `info`.
pub const TIMING: &str = "mpc::timing";

impl Job {
    /// The TaskRun the job is about, if any.
    pub fn taskrun(&self) -> Option<&TaskRunRef> {
        match self {
            Job::AddFinalizer(t) | Job::RemoveFinalizer { taskrun: t, .. } => Some(t),
            Job::Action(a) => match a {
                Action::Record { taskrun, .. }
                | Action::Provision { taskrun, .. }
                | Action::WriteSecret { taskrun, .. }
                | Action::DeleteSecret { taskrun }
                | Action::Ungate { taskrun }
                | Action::RemoveFinalizer { taskrun, .. }
                | Action::Deprovision {
                    user: RemoteUser::Of(taskrun),
                    ..
                } => Some(taskrun),
                Action::Launch { launch, .. } | Action::Retag { launch, .. } => {
                    match &launch.owner {
                        LaunchOwner::TaskRun(taskrun) => Some(taskrun),
                        LaunchOwner::Warm(_) => None,
                    }
                }
                Action::Notify { taskrun, .. } => taskrun.as_ref(),
                _ => None,
            },
        }
    }

    /// The scheduler's operation id, for the jobs whose result it waits for.
    pub fn op(&self) -> Option<u64> {
        match self {
            Job::Action(
                Action::Provision { op, .. }
                | Action::Deprovision { op, .. }
                | Action::Launch { op, .. }
                | Action::Probe { op, .. }
                | Action::Terminate { op, .. },
            ) => Some(op.0),
            _ => None,
        }
    }

    /// The cloud instance the job is about, if any.
    pub fn instance(&self) -> Option<&str> {
        match self {
            Job::Action(
                Action::Probe { instance_id, .. }
                | Action::Terminate { instance_id, .. }
                | Action::Retag { instance_id, .. },
            ) => Some(instance_id),
            _ => None,
        }
    }

    /// The span the job runs in: its kind, the TaskRun (`namespace`, `taskrun` for its name, `uid`;
    /// `name` is the span's own in the JSON logs), the op id and the cloud instance, so
    /// that one filter on the JSON logs reads a TaskRun's story (docs/architecture.md, "The
    /// controller shell").
    pub fn span(&self) -> tracing::Span {
        use tracing::field::{Empty, display};
        let span = tracing::info_span!(
            "job",
            kind = self.kind(),
            namespace = Empty,
            taskrun = Empty,
            uid = Empty,
            op = Empty,
            instance = Empty
        );
        if let Some(t) = self.taskrun() {
            span.record("namespace", t.namespace());
            span.record("taskrun", t.name());
            span.record("uid", display(t.uid()));
        }
        if let Some(op) = self.op() {
            span.record("op", op);
        }
        if let Some(id) = self.instance() {
            span.record("instance", id);
        }
        span
    }
}

/// What the loop runs its jobs with (docs/architecture.md, "The controller shell"): the live
/// one is [`Context`] (the cluster, build hosts, OTP server, cloud); the loop's unit tests script
/// one, so its guarantees are checked without any of those.
pub trait Executor: Send + Sync + 'static {
    /// This executor for one leadership term: its jobs stop when `cancel` fires.
    fn for_term(&self, cancel: CancellationToken) -> Self
    where
        Self: Sized;

    /// Runs one job; returns what it leaves for the loop (nothing once the term's token fired).
    fn run(&self, job: Job) -> BoxFuture<'static, Outcome>;
}

impl Executor for Context {
    fn for_term(&self, cancel: CancellationToken) -> Self {
        Context {
            cancel,
            ..self.clone()
        }
    }

    fn run(&self, job: Job) -> BoxFuture<'static, Outcome> {
        let ctx = self.clone();
        Box::pin(async move { run(&ctx, job).await })
    }
}

/// Runs a job in its [`Job::span`]; returns the events to feed back to the scheduler and the job
/// to run again later, if any (nothing when cancelled).
pub async fn run(ctx: &Context, job: Job) -> Outcome {
    use tracing::Instrument;
    let kind = job.kind();
    let about = tracing::enabled!(target: TIMING, tracing::Level::DEBUG)
        .then(|| job.taskrun().cloned())
        .flatten();
    let started = std::time::Instant::now();
    let span = job.span();
    ctx.metrics.in_flight(kind, 1);
    let out = async {
        tokio::select! {
            () = ctx.cancel.cancelled() => Outcome::default(),
            out = dispatch(ctx, job) => out,
        }
    }
    .instrument(span)
    .await;
    ctx.metrics.in_flight(kind, -1);
    if let Some(tr) = about {
        tracing::debug!(
            target: TIMING,
            kind,
            namespace = tr.namespace(),
            taskrun = tr.name(),
            elapsed_us = started.elapsed().as_micros() as u64,
            "job finished"
        );
    }
    out
}

fn gone(tr: &TaskRunRef) -> Vec<Event> {
    vec![Event::TaskRunDone {
        taskrun: tr.clone(),
    }]
}

/// Outcome of a TaskRun write as events, with failures counted and logged.
fn written(ctx: &Context, kind: &str, tr: &TaskRunRef, r: Result<(), ApiError>) -> Vec<Event> {
    match r {
        Ok(()) | Err(ApiError::Cancelled) => Vec::new(),
        Err(ApiError::Gone) => gone(tr),
        Err(ApiError::TimedOut(limit)) => {
            ctx.metrics.failed(kind);
            tracing::error!(taskrun = %tr, kind, ?limit, "write did not land in time");
            Vec::new()
        }
        Err(error) => {
            ctx.metrics.failed(kind);
            tracing::error!(taskrun = %tr, kind, %error, "API refused a write");
            Vec::new()
        }
    }
}

/// First and longest wait between attempts to remove a finalizer.
const FINALIZER_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(60));

/// The wait before the next attempt at a finalizer removal after `failed` failed ones.
fn finalizer_retry_in(failed: u32) -> Duration {
    let (first, longest) = FINALIZER_RETRY;
    first
        .saturating_mul(1 << failed.saturating_sub(1).min(16))
        .min(longest)
}

/// One attempt at removing our finalizer; when it does not land (and neither the TaskRun nor
/// the term is gone) the next one is handed back to the loop, to be run after a back-off, until
/// it lands (or the term ends: the next leader's recovery finds the finalizer again). The
/// scheduler forgets a TaskRun once it asked for this, so a write given up on would leave a
/// TaskRun nobody can delete; and an attempt that waited inside its job would hold the job's
/// place while it waits, so that removals refused for good would fill every place.
async fn remove_finalizer(ctx: &Context, taskrun: TaskRunRef, failed: u32) -> Outcome {
    let error = match within(
        ctx.limits.write_timeout,
        kube::remove_finalizer(ctx, &taskrun),
    )
    .await
    {
        Ok(()) | Err(ApiError::Gone | ApiError::Cancelled) => return Outcome::default(),
        Err(error) => error,
    };
    let failed = failed.saturating_add(1);
    let delay = finalizer_retry_in(failed);
    ctx.metrics.failed("remove_finalizer");
    tracing::error!(taskrun = %taskrun, %error, failed, retry_in = ?delay, "finalizer not removed; retrying");
    Outcome {
        events: Vec::new(),
        again: Some((Job::RemoveFinalizer { taskrun, failed }, delay)),
    }
}

async fn dispatch(ctx: &Context, job: Job) -> Outcome {
    let kind = job.kind();
    let action = match job {
        Job::AddFinalizer(tr) => {
            let r = within(ctx.limits.write_timeout, kube::add_finalizer(ctx, &tr)).await;
            return written(ctx, kind, &tr, r).into();
        }
        Job::RemoveFinalizer { taskrun, failed } => {
            return remove_finalizer(ctx, taskrun, failed).await;
        }
        Job::Action(Action::RemoveFinalizer { taskrun, revoke }) => {
            // The key of a TaskRun that ended must not stay redeemable (the TTL is a safety net).
            if revoke && let Err(error) = ctx.keys.revoke(&taskrun.uid().to_string()).await {
                ctx.metrics.failed("otp_revoke");
                tracing::warn!(taskrun = %taskrun, %error, "could not revoke the TaskRun's OTP entries");
            }
            return remove_finalizer(ctx, taskrun, 0).await;
        }
        Job::Action(a) => a,
    };
    act(ctx, kind, action).await.into()
}

/// Runs a scheduler action (but a finalizer removal); returns its events.
async fn act(ctx: &Context, kind: &'static str, action: Action) -> Vec<Event> {
    let (write_limit, ssh_limit) = (ctx.limits.write_timeout, ctx.limits.ssh_timeout);
    match action {
        Action::Record { taskrun, placement } => {
            let r = within(write_limit, kube::record(ctx, &taskrun, &placement)).await;
            written(ctx, kind, &taskrun, r)
        }
        Action::WriteSecret { taskrun, secret } => {
            let r = within(write_limit, kube::write_secret(ctx, &taskrun, &secret)).await;
            // A refusal is the scheduler's to decide on (write again, or free the host).
            let error = match r {
                Err(
                    e @ (ApiError::Refused(_) | ApiError::TimedOut(_) | ApiError::KeptChanging),
                ) => e.to_string(),
                r => return written(ctx, kind, &taskrun, r),
            };
            ctx.metrics.failed(kind);
            tracing::warn!(taskrun = %taskrun, %error, "API refused the TaskRun's secret");
            vec![Event::SecretRefused {
                taskrun,
                secret,
                error,
            }]
        }
        Action::DeleteSecret { taskrun } => {
            let r = within(write_limit, kube::delete_secret(ctx, &taskrun)).await;
            written(ctx, kind, &taskrun, r)
        }
        Action::Ungate { taskrun } => {
            let r = within(write_limit, kube::ungate(ctx, &taskrun)).await;
            written(ctx, kind, &taskrun, r)
        }
        Action::RemoveFinalizer { .. } => unreachable!("`dispatch` runs finalizer removals"),
        Action::Provision {
            op,
            taskrun,
            host,
            rearm,
        } => {
            let limit = ssh::provision_limit(&host, ssh_limit);
            let r = tokio::time::timeout(limit, ssh::provision(ctx, op.0, &taskrun, &host, rearm))
                .await
                .unwrap_or(Err(ssh::ProvisionFailure::TimedOut(limit)));
            match r {
                Ok(otp) => vec![Event::Provisioned { op, otp }],
                Err(failure) => {
                    ctx.metrics.failed(kind);
                    let blame = failure.blame();
                    tracing::warn!(taskrun = %taskrun, host = host.name(), error = %failure, ?blame, "provisioning failed");
                    vec![Event::ProvisionFailed {
                        op,
                        error: failure.to_string(),
                        blame,
                    }]
                }
            }
        }
        Action::Deprovision { op, user, host } => {
            let r = tokio::time::timeout(ssh_limit, ssh::deprovision(ctx, &user, &host))
                .await
                .unwrap_or(Err(ssh::HostError::TimedOut(ssh_limit)));
            if let Err(error) = &r {
                ctx.metrics.failed(kind);
                tracing::warn!(user = %user.name(), host = host.name(), %error, "build user removal failed");
            }
            vec![Event::Deprovisioned {
                op,
                error: r.err().map(|e| e.to_string()),
            }]
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
            ctx.events.submit(Note {
                reference,
                warning,
                reason,
                message,
            });
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

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;

    use serde_json::Value;

    use super::*;
    use crate::config::StaticHost;
    use crate::scheduler::{HostRef, OpId, Uid};

    /// Log lines as the binary writes them with `--log-format json`.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    struct NoKeys;

    impl KeyStore for NoKeys {
        fn store<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
            _: bool,
            _: u32,
            _: &'a [u8],
        ) -> BoxFuture<'a, Result<String, OtpClientError>> {
            Box::pin(async { Err(OtpClientError::InvalidUrl("unused".into())) })
        }
        fn revoke<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<(), OtpClientError>> {
            Box::pin(async { Err(OtpClientError::InvalidUrl("unused".into())) })
        }
    }

    /// A context whose API server refuses connections (a closed loopback port): every read is
    /// retried until the job's limit.
    fn context(state: &std::path::Path) -> Context {
        let registry = prometheus::Registry::new();
        let config = ::kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = ::kube::Client::try_from(config).unwrap();
        let recorder = ::kube::runtime::events::Recorder::new(
            client.clone(),
            ::kube::runtime::events::Reporter {
                controller: "test".into(),
                instance: None,
            },
        );
        let cancel = CancellationToken::new();
        Context {
            client,
            namespace: "mpc".into(),
            otp: OtpEndpoint {
                url: "https://otp.invalid/otp".into(),
                ca_pem: String::new(),
            },
            secret_proof: Arc::new(SecretProof::from_store_token(b"t")),
            keys: Arc::new(NoKeys),
            provisioner: Arc::new(
                Provisioner::new(crate::provision::SshOptions::new(state)).unwrap(),
            ),
            known_hosts: Arc::new(ssh::KnownHosts::new("known".into())),
            config: crate::config_source::ConfigSource::new(None),
            cloud: Arc::new(cloud::CloudExec::new(
                crate::cloud::ClusterId::new("test").unwrap(),
                None,
                crate::cloud::metrics::CloudMetrics::new(&registry).unwrap(),
            )),
            events: EventSink::start(
                recorder,
                super::super::events::OutboxLimits::default(),
                1,
                super::super::events::dropped_counter(&registry).unwrap(),
                cancel.clone(),
            ),
            metrics: ControllerMetrics::register(&registry).unwrap(),
            limits: Arc::new(Limits::new(LimitSettings {
                ssh_timeout: Duration::from_millis(300),
                ..LimitSettings::default()
            })),
            cancel,
        }
    }

    /// What a job logs carries the TaskRun and the op id in its span, in the JSON shape the
    /// binary writes, so `select(.span.uid == $uid or any(.spans[]?; .uid == $uid))` finds it.
    #[tokio::test]
    async fn a_jobs_log_lines_carry_its_taskrun_and_op() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_writer(move || writer.clone())
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let state = std::env::temp_dir().join(format!("mpc-span-{}", std::process::id()));
        let ctx = context(&state);
        let taskrun = TaskRunRef::new("tenant-1", "build-arm64", Uid::new("uid-42"));
        let host = StaticHost {
            name: "h1".into(),
            address: "127.0.0.1".into(),
            user: "admin".into(),
            platform: crate::platform::Platform::parse("linux/arm64").unwrap(),
            secret: "h1-admin".into(),
            concurrency: 1,
            host_key: None,
            drained: false,
        };
        let job = Job::Action(Action::Deprovision {
            op: OpId(7),
            user: RemoteUser::Of(taskrun),
            host: HostRef::Static(Arc::new(host)),
        });
        let events = run(&ctx, job).await.events;
        assert!(
            matches!(&events[..], [Event::Deprovisioned { error: Some(_), .. }]),
            "{events:?}"
        );
        drop(_default);
        let _ = std::fs::remove_dir_all(&state);
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let logged: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let failed = logged
            .iter()
            .find(|l| l["message"] == "build user removal failed")
            .unwrap_or_else(|| panic!("the job's warning is logged: {text}"));
        for (field, want) in [
            ("name", Value::from("job")),
            ("kind", "deprovision".into()),
            ("namespace", "tenant-1".into()),
            ("taskrun", "build-arm64".into()),
            ("uid", "uid-42".into()),
            ("op", 7.into()),
        ] {
            assert_eq!(failed["span"][field], want, "span.{field}: {failed}");
            assert_eq!(
                failed["spans"][0][field], want,
                "spans[0].{field}: {failed}"
            );
        }
        assert_eq!(failed["host"], "h1");
    }
}
