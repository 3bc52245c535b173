//! Sources: every producer of the loop's input (docs/architecture.md, "The controller shell").
//!
//! - [`taskruns`]: the TaskRun watch (every replica), relisted after a 410 or a broken watch;
//! - [`config`]: the host-config ConfigMap watch, published to the webhook and the loop;
//! - [`lease`]: the election, which publishes leadership terms;
//! - per term of the leader: [`recovery`] (the snapshot the ledger is rebuilt from),
//!   [`instances`] (each dynamic platform's instances), [`host_users`] (build users of static
//!   hosts), and [`adopt`] (the safety net that marks TaskRuns the webhook missed: its output
//!   comes back through the TaskRun watch).
//!
//! Everything reaches the loop as an [`Input`] on one channel, or (leadership) on the elector's
//! watch channel. Sources never decide: they read the world and report it. Each runs in a
//! `source` span naming its `kind` (a term's inside the loop's `term` span); recovery looks up
//! each TaskRun's secret in a `secret_lookup` span, and the safety net marks each TaskRun in an
//! `adopt_taskrun` span (both with `namespace`, `taskrun`, `uid`).

pub mod adopt;
pub mod config;
pub mod host_users;
pub mod instances;
pub mod lease;
pub mod recovery;
pub mod taskruns;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::HostConfig;
use crate::controller::execute::Context;
use crate::controller::taskrun::TaskRun;
use crate::scheduler::{Event, Snapshot, TaskRunRecord, Time};

/// What the loop reacts to.
pub enum Input {
    /// A TaskRun watch event (boxed: a slim TaskRun is still a few hundred bytes).
    TaskRuns(Box<watcher::Event<TaskRun>>),
    /// The served config changed.
    Config(Arc<HostConfig>),
    /// A snapshot for the term's recovery is ready.
    Recovered { term: u64, snapshot: Snapshot },
    /// A periodic listing or sweep produced an event for the scheduler.
    Sweep(Event),
    /// Stop.
    Shutdown,
}

/// Milliseconds since the epoch, the scheduler's clock.
pub fn now() -> Time {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    Time::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// The span a source runs in, named by its `kind`; a term's sources open theirs inside the
/// loop's `term` span, so their lines carry the term too.
pub fn span(kind: &'static str) -> tracing::Span {
    tracing::info_span!("source", kind)
}

/// What a term's sources start from.
pub struct TermStart {
    pub term: u64,
    /// Fired when the term ends: every source of the term stops.
    pub cancel: CancellationToken,
    /// Each live TaskRun's recovery record, and whether its Secret must be looked up.
    pub records: Vec<(TaskRunRecord, bool)>,
    pub config: Arc<HostConfig>,
    /// The loop's input.
    pub inputs: mpsc::Sender<Input>,
}

/// The sources of a term, started by the loop when the term starts (docs/architecture.md, "The
/// controller shell"): [`Live`] reads the cluster, the cloud and the build hosts; the loop's unit
/// tests script one.
pub trait Sources: Send + 'static {
    /// Starts the term's sources: [`recovery`], which sends the term's [`Input::Recovered`]
    /// once its snapshot is ready, and the periodic ones; all stop when the term's token fires.
    fn start(&self, term: TermStart);
}

/// The live sources of a term.
pub struct Live {
    /// The executor's context; each term's sources get a copy with the term's token.
    pub base: Context,
    /// The served config, for the periodic listings.
    pub config: tokio::sync::watch::Receiver<Option<Arc<HostConfig>>>,
    pub every: Intervals,
}

impl Sources for Live {
    fn start(&self, t: TermStart) {
        let ctx = Context {
            cancel: t.cancel,
            ..self.base.clone()
        };
        tokio::spawn(
            recovery::run(ctx.clone(), t.term, t.records, t.config, t.inputs.clone())
                .instrument(span("recovery")),
        );
        tokio::spawn(
            adopt::run(ctx.clone(), self.config.clone(), self.every.adopt)
                .instrument(span("adopt")),
        );
        tokio::spawn(
            instances::sweep(
                ctx.clone(),
                self.config.clone(),
                t.inputs.clone(),
                self.every.instances,
            )
            .instrument(span("instances")),
        );
        tokio::spawn(
            host_users::sweep(ctx, self.config.clone(), t.inputs, self.every.host_users)
                .instrument(span("host_users")),
        );
    }
}

/// How often each periodic task of a term runs.
#[derive(Debug, Clone, Copy)]
pub struct Intervals {
    /// The safety-net scan for TaskRuns the webhook missed.
    pub adopt: Duration,
    /// Listing each dynamic platform's instances.
    pub instances: Duration,
    /// Listing the build users of each static host.
    pub host_users: Duration,
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
