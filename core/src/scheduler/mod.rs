//! The scheduler core: a pure, deterministic allocation engine for the four strategies (local,
//! static host pool, dynamic instance per TaskRun, dynamic instance pool).
//!
//! Events in ([`Event`]), actions out ([`Action`]). The core never does I/O and never reads a
//! clock: every call to [`Scheduler::handle`] passes `now`, and [`Scheduler::next_deadline`] says
//! when the controller must send [`Event::Tick`]. Given the same events at the same times it
//! returns the same actions (no hash-order iteration anywhere).
//!
//! Guarantees (docs/architecture.md, "What the scheduler guarantees"), whatever the order of
//! events, duplicates, replays or restarts:
//! - a static host never gets more new allocations than its `concurrency`, and a platform never
//!   more launched-or-booting instances than `max-instances` (see the bill guard below), nor a
//!   capacity group more than its `max` over its member platforms (`groups`: counted as
//!   `max-instances` counts, in the fleet's own index; a limit lowered, or instances recovered
//!   above it, are tolerated and only hold launches back; a member whose listing failed holds its
//!   groups' launches until it is listed; room a group gets back goes round-robin across its
//!   members with waiters); a drained host, dynamic platform or pool (`drain: "true"`, a host's
//!   `concurrency: "0"`) gets none: what runs there finishes and is cleaned up there, its waiters
//!   wait (no error secret) and are served in the step a config lifts the drain;
//! - a terminated instance on a Mac dedicated host keeps its `max-instances` slot while the host
//!   is scrubbed (`host-scrub`, [`Policy::hold_scrubbing_hosts`]): EC2 refuses launches onto it;
//! - waiters are served FIFO per platform, round-robin across namespaces, and a freed slot is
//!   handed out in the same step ([`Handoff::Immediate`]);
//! - every result carries the [`OpId`] of its action; results the core no longer waits for are
//!   ignored, or compensated when they created something (a user provisioned for a TaskRun that
//!   went away is removed; an instance launched for one is handed to a waiter or terminated);
//! - an allocation keeps the strategy and host definition it was made with: deallocation never
//!   consults the current config;
//! - after a restart, [`Scheduler::recover`] rebuilds the whole ledger from a [`Snapshot`]
//!   (TaskRun labels and annotations, listed instances) before anything is allocated; a
//!   platform whose listing failed is "unlisted": its TaskRuns are held as recorded (no
//!   orphaning, relaunch or move) and nothing is launched for it until a listing of it arrives,
//!   which recovers them as the restart would have;
//! - every launch carries a [`LaunchId`] rebuilt from what outlives a restart, so relaunching the
//!   same TaskRun's same attempt yields the instance an earlier process launched.
//!
//! Cluster ownership and the bill guard. Clusters share accounts, regions and instance tags.
//! The core acts only on instances it tracks: ones it launched, ones a TaskRun of this cluster
//! names, and listed ones carrying this cluster's identity ([`Ownership::Ours`]); only the latter
//! are ever terminated as orphans. `max-instances` is a bill guard over every live instance with
//! the platform's instance tag in its account and region, whoever launched it: a platform has
//! room while `ledger + foreign < max-instances`, where the ledger counts this cluster's instances
//! strictly (from the launch request until termination is acknowledged) and `foreign` is the
//! number of live instances the platform's last [`Event::InstancesListed`] showed that the ledger
//! does not track (this cluster's own untracked ones included, unless a launch in flight may have
//! started them, or their termination was acknowledged within the orphan grace: a listing made
//! before the acknowledgement must not take back the slot it freed). Launches by others after
//! that listing are unseen until the next one, so across all the clusters (and platforms) sharing
//! a tag, live instances exceed `max-instances` by at most the launches the others made since
//! each one's last listing: with listings every `L`, at most one interval `L`'s worth of
//! launches. No exception for an instance whose
//! termination keeps failing: after [`Policy::cleanup_attempts`] refusals it is leaked (operators
//! see it: `leaked` gauge, an `InstanceLeaked` Event; the TaskRun whose finalizer waited for it
//! is let go), but it still runs and is billed, so it keeps its place under `max-instances`
//! until a termination lands or a listing shows it gone. A refusal that lasts (an IAM or SCP
//! change, termination protection) therefore costs at most `max-instances` instances per
//! platform, not one per TaskRun: once its leaked instances fill it, the platform launches no
//! more and its waiters wait. It is not blocked for good: the termination is retried every few
//! minutes (the back-off's cap) for as long as the instance is tracked, and the first one that
//! lands frees the place and serves the next waiter in the same step ([`Invariant`]
//! `TerminationRetried` holds the retry to that).
//!
//! Refused writes: a secret the API server refuses ([`Event::SecretRefused`]) is written again
//! with back-off, [`Policy::secret_attempts`] times in all; then the TaskRun's host is freed and
//! it gets an error. A TaskRun released because it needs no host ([`Event::TaskRunReleased`]) is
//! not remembered as finished: if it needs one after all, it is served.
//!
//! State. Each part owns its indexes and changes only through methods that keep them right:
//! the TaskRun `Ledger` (by UID, by build user, namespaces, finished UIDs), the static
//! `Hosts` (by name, each platform's hosts with room), the `Fleet` of instances (by id, each
//! platform's members, count and pool instances with room), the `Timers` (with the cleanups
//! they re-issue), the `OpTable` and each platform's queues. [`Scheduler::check`] verifies
//! every index and every invariant across them ([`Invariant`]); the tests call it after every
//! step, and the simulator (`--check`) and the controller (`--check-state`) sample it.
//!
//! Behaviour, in layers that only call downwards (`call_graph.rs` fails on a call cycle between
//! files): this file routes events and timers; `recovery`, `reconfig`, `sweep` and `unlisted`
//! handle restarts, config changes and listings; `lifecycle` (TaskRun events) and
//! `fleet::launch` (instance events) handle results; `handoff` routes, queues and places
//! waiters and hands freed capacity on. The strategies (`hosts` for static hosts,
//! `fleet::dynamic`, `fleet::pool`; local needs none) only read and return a decision, which
//! `handoff` applies. Every change of a TaskRun's state goes through `transition`
//! (`Scheduler::set_state` and its few siblings), which keeps what the other owners hold about
//! the TaskRun in step in the same call: a static host's load, a pool instance's attached
//! TaskRuns, a dynamic instance's owner, the cleanups a finished TaskRun awaits. No other code
//! writes those (a source-text test checks it). `emit` writes the actions; `view` answers
//! lookups.
//!
//! Costs: placing a waiter is O(log hosts) (least-loaded hosts and free pool slots live in
//! ordered sets; waiters in per-namespace queues found by hash); a UID is a hash-table lookup
//! and an operation id an index into a slab (those tables are never iterated where order could
//! matter); no decision scans all TaskRuns. Sweeps and config changes are linear, and rare.

mod action;
mod arena;
#[cfg(test)]
mod call_graph;
mod check;
mod emit;
mod event;
mod fleet;
mod groups;
mod handoff;
mod hosts;
mod ids;
mod instances;
mod invariant;
mod ledger;
mod lifecycle;
mod messages;
mod op_table;
mod policy;
mod queue;
mod reconfig;
mod recovery;
mod snapshot;
mod stats;
mod sweep;
mod time;
mod timers;
mod tombstones;
mod transition;
mod uid_index;
mod unlisted;
mod users;
mod view;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub use action::{Action, HostRef, Observation, Placement, RemoteUser, SecretData};
pub use event::{Blame, Event, HostUser, ProbeResult, TaskRunSpec};
pub use ids::{LaunchId, LaunchOwner, OpId, TaskRunRef, Uid};
pub use invariant::{Invariant, StateError};
pub use policy::{Handoff, HostBackoff, Policy};
pub use snapshot::{
    InstanceRecord, InstanceState, Ownership, ProofTag, SecretKind, SecretProbe, Snapshot,
    TaskRunRecord,
};
pub use stats::{Gauges, GroupGauges, LedgerSize, PlatformGauges};
pub use time::Time;

use crate::config::{DynamicPlatform, DynamicPool, HostConfig, StaticHost};
use crate::platform::Platform;
use arena::Key;
use hosts::Hosts;
use instances::{Fleet, Instance};
use ledger::{Ledger, TaskRun};
use op_table::OpTable;
use queue::FairQueue;
use timers::Timers;

/// Index into the platform table.
type PlatformId = u32;
/// Index into the host table.
type HostId = u32;

/// The scheduler core. See the module docs.
pub struct Scheduler {
    policy: Policy,
    config: HostConfig,
    now: Time,
    next_ticket: u32,
    /// Tracked TaskRuns, their indexes, and the UIDs of TaskRuns finished recently (late events
    /// for them are ignored for at least [`TOMBSTONE_TTL`]).
    taskruns: Ledger,
    platforms: Vec<PlatformState>,
    platform_ids: BTreeMap<Platform, PlatformId>,
    /// Static hosts, with each platform's hosts with room.
    hosts: Hosts,
    /// Cloud instances, by id and by platform, with each pool's instances with room.
    instances: Fleet,
    ops: OpTable,
    /// Timers, and the cleanup operations waiting for a retry.
    timers: Timers,
    /// [`Scheduler::recover`] ran: actions may be issued.
    started: bool,
    /// `additional-instance-tags` of the config in force, shared by every launch.
    additional_tags: Arc<[(String, String)]>,
    /// Removals of a build user in flight or waiting for a retry: user name to the hosts or
    /// instance ids (one entry per removal).
    cleaning: BTreeMap<String, Vec<Arc<str>>>,
    /// TaskRuns of unlisted platforms (see [`Snapshot::unlisted`]), held as recorded until their
    /// platform's listing arrives.
    held: BTreeMap<Uid, unlisted::Held>,
}

const NO_PLATFORM: PlatformId = PlatformId::MAX;

/// A release ([`Event::TaskRunReleased`]) being cleaned up.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
enum Release {
    /// Not released (or finished since).
    #[default]
    No,
    /// Being cleaned up after a release: not finished, so its UID is not remembered as
    /// finished once the cleanup is over.
    Released,
    /// Said to need a host again while that cleanup ran: served once it is over.
    Revived,
}

#[derive(Default)]
struct Extra {
    /// Hosts or instances whose provisioning failed for this TaskRun, with the error.
    failed: Vec<(Arc<str>, String)>,
    /// Whether it is being cleaned up after [`Event::TaskRunReleased`].
    release: Release,
    /// Its secret was refused this many times.
    secret_refusals: u32,
    /// The refused secret, written again when [`Timer::SecretRetry`] fires.
    refused_secret: Option<SecretData>,
}

enum State {
    /// Queued: in the platform's fair queue (or its retry lane when `retry`).
    Waiting { ticket: u32, retry: bool },
    /// On a static host, with the definition it was allocated under (`None` when recovered
    /// onto a host the config no longer has).
    OnHost {
        host: HostId,
        def: Option<Arc<StaticHost>>,
        phase: Phase,
    },
    /// On a cloud instance (dynamic or pool).
    OnInstance { inst: Key, phase: Phase },
    /// Local platform: `host: localhost` written.
    Local,
    /// Error secret written.
    Failed,
    /// Done; waiting for `pending` cleanup results before the finalizer goes.
    Cleanup { pending: u32 },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for its instance to become reachable.
    Reserved,
    /// User being created.
    Provisioning(OpId),
    /// Secret written at this time.
    Ready(Time),
}

/// How a platform is served now.
#[derive(Clone, PartialEq)]
enum Mode {
    Local,
    Static,
    Dynamic(Arc<DynamicPlatform>),
    Pool(Arc<DynamicPool>),
    Disabled(Arc<str>),
    Unknown,
}

struct PlatformState {
    platform: Arc<Platform>,
    label: Arc<str>,
    mode: Mode,
    queue: FairQueue,
    /// Waiters that already failed somewhere (their failed set constrains placement); served
    /// before the fair queue.
    retry: Vec<Key>,
    /// Live instances with the platform's instance tag that the last listing showed and the
    /// ledger does not track (other clusters', the Go controller's, other platforms'): they count
    /// against `max-instances` too.
    foreign: u32,
    /// Its listing failed at recovery and none has arrived since: what runs on it is unknown, so
    /// nothing is launched for it and its recorded TaskRuns are held (see [`Snapshot::unlisted`]).
    unlisted: bool,
    /// No warm launches before this (after warm launches kept failing).
    warm_hold: Time,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum InstState {
    /// Waiting to (re)try a launch.
    LaunchWait,
    Launching(OpId),
    Booting,
    Ready,
    Terminating(OpId),
    /// Waiting to retry a failed termination.
    TerminateWait,
}

/// An action in flight, by its [`OpId`].
enum Op {
    Provision {
        tr: Key,
        host: HostRef,
        /// The TaskRun went away meanwhile: remove whatever the provisioning created.
        compensate: bool,
        /// It re-arms the token of a secret an earlier attempt's pod was given.
        rearm: bool,
    },
    Deprovision {
        /// The finished TaskRun waiting for it, if any.
        tr: Option<Key>,
        platform: PlatformId,
        user: RemoteUser,
        host: HostRef,
        attempt: u32,
    },
    Launch {
        inst: Key,
    },
    Probe {
        inst: Key,
    },
    Terminate {
        inst: Key,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Timer {
    Probe(Key, u32),
    Deadline(Key),
    LaunchRetry(Key, u32),
    TerminateRetry(Key, u32),
    MaxAge(Key),
    Idle(Key, Time),
    HostBack(HostId, u32),
    Requeue(Key, u32),
    /// A retry's re-provisioning on its host, tried again after a failure.
    Rearm(Key),
    /// A refused secret written again (after that many refusals).
    SecretRetry(Key, u32),
    Delayed(u64),
    Warm(PlatformId),
    Orphan(Key),
    /// A dedicated host's scrub ends: the slot its terminated instance held is free.
    ScrubDone(PlatformId),
}

/// How long late events for a finished TaskRun are recognised, at least (at most twice that).
const TOMBSTONE_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

impl Scheduler {
    /// A scheduler with no TaskRuns. Call [`Scheduler::recover`] before feeding events (with an
    /// empty snapshot on a fresh cluster): it also starts warm pool instances.
    pub fn new(config: HostConfig, policy: Policy) -> Self {
        let mut s = Scheduler {
            policy,
            config: HostConfig::default(),
            now: Time::ZERO,
            next_ticket: 0,
            taskruns: Ledger::default(),
            platforms: Vec::new(),
            platform_ids: BTreeMap::new(),
            hosts: Hosts::default(),
            instances: Fleet::default(),
            ops: OpTable::default(),
            timers: Timers::default(),
            started: false,
            additional_tags: Arc::new([]),
            cleaning: BTreeMap::new(),
            held: BTreeMap::new(),
        };
        let mut ignored = Vec::new();
        s.apply_config(config, &mut ignored);
        s
    }

    /// The policy in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The configuration in force.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// The latest time seen.
    pub fn now(&self) -> Time {
        self.now
    }

    /// When the next timer is due; send [`Event::Tick`] then (or earlier, harmlessly).
    pub fn next_deadline(&self) -> Option<Time> {
        self.timers.next_deadline()
    }

    /// Handles one event at `now` (time never goes backwards: an earlier `now` counts as the
    /// latest seen), appending the resulting actions to `out`. Due timers fire first.
    pub fn handle(&mut self, now: Time, event: Event, out: &mut Vec<Action>) {
        self.advance(now, out);
        if let Some(event) = self.hold(event) {
            self.dispatch(event, out);
        }
    }

    fn dispatch(&mut self, event: Event, out: &mut Vec<Action>) {
        match event {
            Event::TaskRun(spec) => self.on_taskrun(spec, out),
            Event::TaskRunDone { taskrun } => self.on_done(&taskrun, false, out),
            Event::TaskRunReleased { taskrun } => self.on_done(&taskrun, true, out),
            Event::SecretRefused {
                taskrun,
                secret,
                error,
            } => self.on_secret_refused(&taskrun, secret, &error, out),
            Event::Provisioned { op, otp } => self.on_provisioned(op, Ok(otp), out),
            Event::ProvisionFailed { op, error, blame } => {
                self.on_provisioned(op, Err((error, blame)), out)
            }
            Event::Deprovisioned { op, error } => self.on_deprovisioned(op, error, out),
            Event::Launched { op, instance_id } => self.on_launched(op, Ok(instance_id), out),
            Event::LaunchSpent {
                op,
                instance_id,
                state,
            } => self.on_launch_spent(op, &instance_id, state, out),
            Event::LaunchFailed {
                op,
                error,
                retryable,
            } => self.on_launched(op, Err((error, retryable)), out),
            Event::Probed { op, result } => self.on_probed(op, result, out),
            Event::Terminated { op, error } => self.on_terminated(op, error, out),
            Event::InstanceGone { instance_id } => self.on_instance_gone(&instance_id, out),
            Event::InstancesListed {
                platform,
                instances,
            } => self.on_instances_listed(&platform, &instances, out),
            Event::HostUsersListed { host, users } => self.on_host_users(&host, &users, out),
            Event::ConfigReplaced(config) => self.apply_config(*config, out),
            Event::Tick => {}
        }
    }

    /// [`Scheduler::handle`] returning a fresh vector.
    pub fn step(&mut self, now: Time, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        self.handle(now, event, &mut out);
        out
    }

    /// Moves the clock and fires every due timer.
    fn advance(&mut self, now: Time, out: &mut Vec<Action>) {
        if now > self.now {
            self.now = now;
        }
        // Rotate first: a TaskRun that a timer finalizes now must land in the fresh generation,
        // not in one this rotation clears after a long silence.
        self.taskruns.rotate(self.now, TOMBSTONE_TTL);
        while let Some(timer) = self.timers.pop_due(self.now) {
            self.fire(timer, out);
        }
    }

    fn fire(&mut self, timer: Timer, out: &mut Vec<Action>) {
        match timer {
            Timer::Probe(inst, n) => self.probe_due(inst, n, out),
            Timer::Deadline(inst) => self.deadline_due(inst, out),
            Timer::LaunchRetry(inst, n) => self.launch_retry_due(inst, n, out),
            Timer::TerminateRetry(inst, n) => self.terminate_retry_due(inst, n, out),
            Timer::MaxAge(inst) => self.max_age_due(inst, out),
            Timer::Idle(inst, since) => self.idle_due(inst, since, out),
            Timer::HostBack(host, level) => self.host_back_due(host, level, out),
            Timer::Requeue(tr, ticket) => self.requeue_due(tr, ticket, out),
            Timer::Rearm(tr) => self.rearm_due(tr, out),
            Timer::SecretRetry(tr, n) => self.secret_retry_due(tr, n, out),
            Timer::Delayed(seq) => {
                if let Some(op) = self.timers.take_delayed(seq) {
                    self.reissue(op, out);
                }
            }
            Timer::Warm(p) => self.ensure_warm(p, out),
            Timer::Orphan(inst) => self.orphan_due(inst, out),
            Timer::ScrubDone(p) => self.scrub_done(p, out),
        }
    }

    /// Loads a snapshot (call once, before any other event) and returns what must happen now:
    /// missing secrets, re-provisioning, cleanup of finished TaskRuns, orphan termination, warm
    /// pool launches, and placement of waiters.
    pub fn recover(&mut self, now: Time, snapshot: Snapshot, out: &mut Vec<Action>) {
        self.advance(now, out);
        self.started = true;
        let Snapshot {
            taskruns,
            instances,
            unlisted,
        } = snapshot;
        let taskruns = self.hold_unlisted(taskruns, &unlisted, out);
        self.rebuild(&taskruns, &instances, None, &BTreeSet::new(), out);
    }
}

/// How the config serves a platform, as owned data.
fn mode_of(config: &HostConfig, platform: &Platform) -> Mode {
    use crate::config::Strategy;
    match config.resolve(platform) {
        Strategy::Local => Mode::Local,
        Strategy::Dynamic(d) => Mode::Dynamic(Arc::new(d.clone())),
        Strategy::DynamicPool(p) => Mode::Pool(Arc::new(p.clone())),
        Strategy::Static(_) => Mode::Static,
        Strategy::Disabled(reason) => Mode::Disabled(reason.into()),
        Strategy::Unknown => Mode::Unknown,
    }
}
