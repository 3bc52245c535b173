//! [`Scheduler::check`]: every cross-index invariant of the scheduler's state, checked from
//! scratch. Linear in the state (it rebuilds each index and compares), so it is for tests: the
//! unit-test harness and the model test call it after every step; the drivers never do.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::arena::Key;
use super::{Handoff, InstState, NO_PLATFORM, Op, Phase, Scheduler, State, Timer};

/// One invariant of the scheduler's state (docs/architecture.md, "The scheduler's state").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invariant {
    /// Every tracked TaskRun is found by its UID, and the index holds nothing else.
    UidIndex,
    /// No tracked TaskRun's UID is remembered as finished.
    Tombstones,
    /// The user-name index holds exactly the tracked TaskRuns, under their build user's hash.
    UserIndex,
    /// Namespace ids and names map to each other; every TaskRun's namespace id is interned.
    Namespaces,
    /// Platform ids and platforms map to each other; every reference to a platform resolves.
    Platforms,
    /// Host ids and names map to each other.
    HostIds,
    /// A host is in its platform's set of hosts with room exactly when it is configured for the
    /// platform, not backing off and below its concurrency, under the key its load gives.
    HostRoom,
    /// A platform's host list holds exactly its configured hosts, by rank.
    PlatformHosts,
    /// A host's load is the number of TaskRuns on it.
    HostLoad,
    /// A host backing off has the timer that ends its back-off.
    HostBackoff,
    /// Instance ids and instance entries map to each other.
    InstanceIds,
    /// A platform's member set holds exactly its instances.
    InstanceMembers,
    /// A platform's instance count is the number of its instances, leaked ones included (they
    /// still run and are billed).
    InstanceCount,
    /// A pool instance is in its platform's ready or booting set exactly when it takes work,
    /// under the key its load and age give.
    PoolIndex,
    /// A pool instance's attached TaskRuns are exactly the TaskRuns on it; a dynamic one has
    /// none attached.
    PoolAttached,
    /// Each TaskRun's count of instance terminations its finalizer waits for is the number of
    /// instances naming it.
    AwaitedTerminations,
    /// A launching or terminating instance's operation is in flight, for it.
    InstanceOps,
    /// An instance waiting to retry its termination has the timer that retries it, and a leaked
    /// one is being terminated or waiting to retry: a termination is never given up.
    TerminationRetried,
    /// A TaskRun being provisioned has its provisioning in flight, for it.
    ProvisionOps,
    /// A waiting TaskRun is in its platform's queue (retry lane when it failed somewhere) with
    /// its ticket, or, when waiters poll, has its requeue timer.
    Waiters,
    /// A queue's own bookkeeping (entry count, turn order) matches its lanes.
    Queue,
    /// A TaskRun in cleanup waits for exactly the cleanups that name it; a live one is named by
    /// no cleanup but instance terminations (of instances it left).
    CleanupPending,
    /// Removals of a build user in progress are exactly the removals in flight or delayed.
    Cleaning,
    /// Delayed cleanups and their timers map to each other; timer sequence numbers are unique
    /// and already issued.
    Timers,
    /// The operation table's count matches its slots.
    OpTable,
    /// TaskRuns held for an unlisted platform's listing are tracked nowhere else and belong to
    /// an unlisted platform; an unlisted platform tracks no instance.
    Unlisted,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Invariant::UidIndex => "UID index",
            Invariant::Tombstones => "tombstones",
            Invariant::UserIndex => "user-name index",
            Invariant::Namespaces => "namespace table",
            Invariant::Platforms => "platform table",
            Invariant::HostIds => "host ids",
            Invariant::HostRoom => "index of hosts with room",
            Invariant::PlatformHosts => "platform host lists",
            Invariant::HostLoad => "host load",
            Invariant::HostBackoff => "host back-off timers",
            Invariant::InstanceIds => "instance ids",
            Invariant::InstanceMembers => "platform instance members",
            Invariant::InstanceCount => "max-instances ledger",
            Invariant::PoolIndex => "index of pool instances with room",
            Invariant::PoolAttached => "pool attachments",
            Invariant::AwaitedTerminations => "awaited instance terminations",
            Invariant::InstanceOps => "instance operations",
            Invariant::TerminationRetried => "termination retries",
            Invariant::ProvisionOps => "provisioning operations",
            Invariant::Waiters => "waiters' queue entries",
            Invariant::Queue => "queue bookkeeping",
            Invariant::CleanupPending => "pending cleanups",
            Invariant::Cleaning => "user removals in progress",
            Invariant::Timers => "timers",
            Invariant::OpTable => "operation table",
            Invariant::Unlisted => "unlisted platforms",
        };
        f.write_str(s)
    }
}

/// A broken invariant, with what was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scheduler state: {invariant} broken: {detail}")]
pub struct StateError {
    /// Which invariant.
    pub invariant: Invariant,
    /// The entry that breaks it and how.
    pub detail: String,
}

/// `Err` naming `invariant` unless `ok`.
pub(super) fn ensure(
    ok: bool,
    invariant: Invariant,
    detail: impl FnOnce() -> String,
) -> Result<(), StateError> {
    if ok {
        Ok(())
    } else {
        Err(StateError {
            invariant,
            detail: detail(),
        })
    }
}

impl Scheduler {
    /// Checks every cross-index invariant of the state (see [`Invariant`]); the first broken one
    /// is returned. Linear in the state: meant for tests, after every step.
    pub fn check(&self) -> Result<(), StateError> {
        self.check_taskruns()?;
        self.check_hosts()?;
        self.check_instances()?;
        self.check_phases()?;
        self.check_waiters()?;
        self.check_cleanups()?;
        self.check_unlisted()?;
        self.check_timers()
    }

    fn check_taskruns(&self) -> Result<(), StateError> {
        use Invariant::*;
        self.taskruns.check()?;
        ensure(
            self.platform_ids.len() == self.platforms.len(),
            Platforms,
            || {
                format!(
                    "{} ids for {} platforms",
                    self.platform_ids.len(),
                    self.platforms.len()
                )
            },
        )?;
        for (i, ps) in self.platforms.iter().enumerate() {
            ensure(
                self.platform_ids.get(&*ps.platform) == Some(&(i as u32)),
                Platforms,
                || format!("{} is not id {i}", ps.platform),
            )?;
        }
        for (_, t) in self.taskruns.iter() {
            ensure(
                t.platform == NO_PLATFORM || (t.platform as usize) < self.platforms.len(),
                Platforms,
                || format!("{} has platform id {}", t.path(), t.platform),
            )?;
        }
        Ok(())
    }

    fn check_hosts(&self) -> Result<(), StateError> {
        use Invariant::*;
        self.hosts.check(self.platforms.len())?;
        let mut load: BTreeMap<u32, u32> = BTreeMap::new();
        for (_, t) in self.taskruns.iter() {
            if let State::OnHost { host, .. } = t.state {
                *load.entry(host).or_default() += 1;
            }
        }
        let mut hid = 0;
        while let Some(h) = self.hosts.get(hid) {
            let n = load.remove(&hid).unwrap_or(0);
            ensure(h.load() == n, HostLoad, || {
                format!("host {} has load {} and {n} TaskRuns", h.name, h.load())
            })?;
            if let Some(until) = h.backoff_until() {
                let armed = self
                    .timers
                    .iter()
                    .any(|(at, t)| at == until && t == Timer::HostBack(hid, h.backoff_level));
                ensure(armed, HostBackoff, || {
                    format!(
                        "host {} backs off until {until} (level {}) with no timer",
                        h.name, h.backoff_level
                    )
                })?;
            }
            hid += 1;
        }
        ensure(load.is_empty(), HostIds, || {
            format!("TaskRuns on unknown host ids: {load:?}")
        })
    }

    fn check_instances(&self) -> Result<(), StateError> {
        use Invariant::*;
        self.instances.check(self.platforms.len())?;
        // Who is on each instance, from the TaskRuns' side.
        let mut on: BTreeMap<Key, BTreeSet<Key>> = BTreeMap::new();
        for (k, t) in self.taskruns.iter() {
            if let State::OnInstance { inst, .. } = t.state {
                on.entry(inst).or_default().insert(k);
            }
        }
        for (k, i) in self.instances.iter() {
            let attached: BTreeSet<Key> = i.attached.iter().copied().collect();
            let here = on.remove(&k).unwrap_or_default();
            if i.pool.is_some() {
                ensure(
                    attached.len() == i.attached.len() && attached == here,
                    PoolAttached,
                    || {
                        format!(
                            "pool instance {k:?} has {:?} attached, TaskRuns on it: {here:?}",
                            i.attached
                        )
                    },
                )?;
            } else {
                ensure(i.attached.is_empty(), PoolAttached, || {
                    format!("dynamic instance {k:?} has {:?} attached", i.attached)
                })?;
            }
            let op_ok = match i.state {
                InstState::Launching(op) => {
                    matches!(self.ops.get(op), Some(Op::Launch { inst }) if *inst == k)
                }
                InstState::Terminating(op) => {
                    matches!(self.ops.get(op), Some(Op::Terminate { inst }) if *inst == k)
                }
                _ => true,
            };
            ensure(op_ok, InstanceOps, || {
                format!(
                    "instance {k:?} is {:?} without its operation in flight",
                    i.state
                )
            })?;
            let retried = match i.state {
                InstState::Terminating(_) => true,
                InstState::TerminateWait => self
                    .timers
                    .iter()
                    .any(|(_, t)| t == Timer::TerminateRetry(k, i.terminate_attempts)),
                _ => !i.leaked(),
            };
            ensure(retried, TerminationRetried, || {
                format!(
                    "instance {k:?} is {:?} (leaked: {}) with no termination retry armed",
                    i.state,
                    i.leaked()
                )
            })?;
        }
        Ok(())
    }

    /// TaskRuns' phases against the operations they wait for.
    fn check_phases(&self) -> Result<(), StateError> {
        for (k, t) in self.taskruns.iter() {
            let phase = match &t.state {
                State::OnHost { phase, .. } | State::OnInstance { phase, .. } => *phase,
                _ => continue,
            };
            if let Phase::Provisioning(op) = phase {
                let ok = matches!(
                    self.ops.get(op),
                    Some(Op::Provision { tr, compensate: false, .. }) if *tr == k
                );
                ensure(ok, Invariant::ProvisionOps, || {
                    format!(
                        "{} is provisioning under {op} with no such operation",
                        t.path()
                    )
                })?;
            }
        }
        Ok(())
    }

    fn check_waiters(&self) -> Result<(), StateError> {
        use Invariant::*;
        let mut queued: BTreeSet<(u32, u32, Key, u32)> = BTreeSet::new();
        let mut retry: BTreeSet<(u32, Key)> = BTreeSet::new();
        for (p, ps) in self.platforms.iter().enumerate() {
            ps.queue.check().map_err(|e| StateError {
                detail: format!("{}: {}", ps.platform, e.detail),
                ..e
            })?;
            for (ns, e) in ps.queue.entries() {
                queued.insert((p as u32, ns, e.taskrun, e.ticket));
            }
            for &k in &ps.retry {
                retry.insert((p as u32, k));
            }
        }
        let requeue: BTreeSet<(Key, u32)> = self
            .timers
            .iter()
            .filter_map(|(_, t)| match t {
                Timer::Requeue(k, ticket) => Some((k, ticket)),
                _ => None,
            })
            .collect();
        for (k, t) in self.taskruns.iter() {
            let State::Waiting { ticket, retry: r } = t.state else {
                continue;
            };
            let ok = match self.policy.handoff {
                Handoff::Poll { .. } => requeue.contains(&(k, ticket)),
                Handoff::Immediate if r => retry.contains(&(t.platform, k)),
                Handoff::Immediate => queued.contains(&(t.platform, t.ns, k, ticket)),
            };
            ensure(ok, Waiters, || {
                format!(
                    "{} waits (ticket {ticket}, retry {r}) but is not queued for it",
                    t.path()
                )
            })?;
        }
        Ok(())
    }

    fn check_cleanups(&self) -> Result<(), StateError> {
        use Invariant::*;
        self.ops.check()?;
        let mut waits: BTreeMap<Key, u32> = BTreeMap::new();
        let mut removals: BTreeMap<(String, String), u32> = BTreeMap::new();
        for op in self.ops.values().chain(self.timers.delayed_ops()) {
            match op {
                Op::Deprovision { tr, user, host, .. } => {
                    if let Some(k) = tr {
                        *waits.entry(*k).or_default() += 1;
                    }
                    *removals
                        .entry((user.name(), host.name().to_owned()))
                        .or_default() += 1;
                }
                Op::Provision {
                    tr,
                    compensate: true,
                    ..
                } => *waits.entry(*tr).or_default() += 1,
                _ => {}
            }
        }
        let mut terminations: BTreeMap<Key, u32> = BTreeMap::new();
        for (_, i) in self.instances.iter() {
            if let Some(k) = i.cleanup_for() {
                *terminations.entry(k).or_default() += 1;
            }
        }
        for (k, t) in self.taskruns.iter() {
            let n = waits.remove(&k).unwrap_or(0);
            let m = terminations.remove(&k).unwrap_or(0);
            match t.state {
                State::Cleanup { pending } => ensure(pending == n + m, CleanupPending, || {
                    format!(
                        "{} waits for {pending} cleanups, {n} and {m} instance(s) name it",
                        t.path()
                    )
                })?,
                _ => ensure(n == 0, CleanupPending, || {
                    format!("{} is live and {n} cleanups name it", t.path())
                })?,
            }
        }
        for (k, m) in terminations {
            *waits.entry(k).or_default() += m;
        }
        ensure(waits.is_empty(), CleanupPending, || {
            format!("cleanups name untracked TaskRuns: {waits:?}")
        })?;
        let mut cleaning: BTreeMap<(String, String), u32> = BTreeMap::new();
        for (user, hosts) in &self.cleaning {
            ensure(!hosts.is_empty(), Cleaning, || {
                format!("{user} is listed with no host")
            })?;
            for h in hosts {
                *cleaning.entry((user.clone(), h.to_string())).or_default() += 1;
            }
        }
        ensure(cleaning == removals, Cleaning, || {
            format!("in progress {cleaning:?}, in flight or delayed {removals:?}")
        })
    }

    fn check_timers(&self) -> Result<(), StateError> {
        self.timers.check()
    }
}
