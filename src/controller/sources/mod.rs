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
//! watch channel. Sources never decide: they read the world and report it.

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
use tokio_util::sync::CancellationToken;

use crate::config::HostConfig;
use crate::controller::execute::Context;
use crate::controller::taskrun::TaskRun;
use crate::scheduler::{Event, Snapshot, Time};

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
