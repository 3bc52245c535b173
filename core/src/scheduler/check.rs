//! [`Scheduler::check`]: every cross-index invariant of the scheduler's state, checked from
//! scratch. Linear in the state (it rebuilds each index and compares; about 1.5 ms at 20,000
//! TaskRuns), so it is not asserted in `handle`: the unit-test harness and the model test call it
//! after every step, and the drivers sample it on request (`mpc simulate --check`, every
//! `--check-every` events and at the end; the controller's `--check-state N`, every N events,
//! logging and counting what it finds).
//!
//! Operations whose result the core no longer waits for stay in the table until the result
//! arrives and is ignored; the reverse relations (an operation in flight to the state that names
//! it) allow exactly those, and only where ignoring the result is harmless.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::arena::Key;
use super::invariant::{Invariant, StateError, ensure};
use super::{
    Handoff, HostRef, InstState, Mode, NO_PLATFORM, Op, OpId, Phase, Scheduler, State, TaskRun,
    Timer, mode_of,
};

/// One group of checks: its first finding.
type Check = fn(&Scheduler) -> Result<(), StateError>;

impl Scheduler {
    /// Checks every cross-index invariant of the state (see [`Invariant`]); the first broken one
    /// is returned. Linear in the state: meant for tests after every step, and for drivers that
    /// sample it (`mpc simulate --check`, the controller's `--check-state`).
    pub fn check(&self) -> Result<(), StateError> {
        match self.violations().into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Every broken invariant: each group of checks reports its first finding, and the groups
    /// run independently, so one corruption shows as exactly the invariants it breaks.
    pub fn violations(&self) -> Vec<StateError> {
        const CHECKS: &[Check] = &[
            |s| s.taskruns.check(),
            Scheduler::check_platforms,
            |s| s.hosts.check(s.platforms.len()),
            Scheduler::check_host_load,
            Scheduler::check_host_backoff,
            Scheduler::check_drained_hosts,
            |s| s.instances.check(s.platforms.len()),
            Scheduler::check_scrub_holds,
            Scheduler::check_taskrun_instances,
            Scheduler::check_attached,
            Scheduler::check_owners,
            Scheduler::check_instance_ops,
            Scheduler::check_probe_ops,
            Scheduler::check_termination_retried,
            Scheduler::check_provision_ops,
            Scheduler::check_queues,
            Scheduler::check_waiters,
            |s| s.ops.check(),
            Scheduler::check_cleanups,
            Scheduler::check_cleaning,
            Scheduler::check_unlisted,
            Scheduler::check_unlisted_modes,
            Scheduler::check_modes,
            Scheduler::check_user_guard,
            |s| s.timers.check(),
        ];
        let mut found: Vec<StateError> = CHECKS.iter().filter_map(|c| c(self).err()).collect();
        let want = self.group_defs();
        found.extend(
            self.instances
                .groups()
                .check(&want, |p| self.instances.counted(p)),
        );
        found
    }

    /// Platform ids and platforms map to each other; every TaskRun's platform resolves.
    fn check_platforms(&self) -> Result<(), StateError> {
        use Invariant::*;
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

    /// A host's load is the number of TaskRuns on it, and every TaskRun on a host is on a known
    /// one.
    fn check_host_load(&self) -> Result<(), StateError> {
        use Invariant::*;
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
            hid += 1;
        }
        ensure(load.is_empty(), HostIds, || {
            format!("TaskRuns on unknown host ids: {load:?}")
        })
    }

    fn check_host_backoff(&self) -> Result<(), StateError> {
        let mut hid = 0;
        while let Some(h) = self.hosts.get(hid) {
            if let Some(until) = h.backoff_until() {
                let armed = self
                    .timers
                    .iter()
                    .any(|(at, t)| at == until && t == Timer::HostBack(hid, h.backoff_level));
                ensure(armed, Invariant::HostBackoff, || {
                    format!(
                        "host {} backs off until {until} (level {}) with no timer",
                        h.name, h.backoff_level
                    )
                })?;
            }
            hid += 1;
        }
        Ok(())
    }

    /// No first allocation is provisioned under a drained host definition.
    fn check_drained_hosts(&self) -> Result<(), StateError> {
        for (_, t) in self.taskruns.iter() {
            if let State::OnHost {
                host,
                def: Some(def),
                phase: Phase::Provisioning(_) | Phase::Reserved,
            } = &t.state
            {
                ensure(
                    !def.drained || t.retries > 0,
                    Invariant::DrainedHost,
                    || {
                        format!(
                            "{} is being provisioned on host {} (id {host}) under a drained definition",
                            t.path(),
                            def.name
                        )
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Each slot held for a scrubbed dedicated host ends with a timer.
    fn check_scrub_holds(&self) -> Result<(), StateError> {
        for p in 0..self.platforms.len() as super::PlatformId {
            for until in self.instances.scrub_ends(p) {
                let armed = self
                    .timers
                    .iter()
                    .any(|(at, t)| at == until && t == Timer::ScrubDone(p));
                ensure(armed, Invariant::ScrubHold, || {
                    format!(
                        "{} holds a slot for a host scrubbed until {until} with no timer",
                        self.platforms[p as usize].platform
                    )
                })?;
            }
        }
        Ok(())
    }

    /// A TaskRun on an instance is on one the fleet tracks, of its own platform.
    fn check_taskrun_instances(&self) -> Result<(), StateError> {
        for (_, t) in self.taskruns.iter() {
            if let State::OnInstance { inst, .. } = t.state {
                let platform = self.instances.get(inst).map(|i| i.platform());
                ensure(
                    platform == Some(t.platform),
                    Invariant::TaskRunInstance,
                    || {
                        format!(
                            "{} is on instance {inst:?}, which the fleet tracks as of platform \
                         {platform:?} (the TaskRun's is {})",
                            t.path(),
                            t.platform
                        )
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Who is on each instance, from the TaskRuns' side.
    fn on_instances(&self) -> BTreeMap<Key, BTreeSet<Key>> {
        let mut on: BTreeMap<Key, BTreeSet<Key>> = BTreeMap::new();
        for (k, t) in self.taskruns.iter() {
            if let State::OnInstance { inst, .. } = t.state {
                on.entry(inst).or_default().insert(k);
            }
        }
        on
    }

    fn check_attached(&self) -> Result<(), StateError> {
        let mut on = self.on_instances();
        for (k, i) in self.instances.iter() {
            let attached: BTreeSet<Key> = i.attached.iter().copied().collect();
            let here = on.remove(&k).unwrap_or_default();
            if i.pool.is_some() {
                ensure(
                    attached.len() == i.attached.len() && attached == here,
                    Invariant::PoolAttached,
                    || {
                        format!(
                            "pool instance {k:?} has {:?} attached, TaskRuns on it: {here:?}",
                            i.attached
                        )
                    },
                )?;
            } else {
                ensure(i.attached.is_empty(), Invariant::PoolAttached, || {
                    format!("dynamic instance {k:?} has {:?} attached", i.attached)
                })?;
            }
        }
        Ok(())
    }

    /// A dynamic instance's owner is a TaskRun on it, and a TaskRun on a dynamic instance is its
    /// owner (at most one); a pool instance has none.
    fn check_owners(&self) -> Result<(), StateError> {
        let on = self.on_instances();
        for (k, i) in self.instances.iter() {
            let here = on.get(&k);
            let ok = if i.pool.is_some() {
                i.owner.is_none()
            } else {
                match i.owner {
                    Some(o) => here.is_some_and(|h| h.len() == 1 && h.contains(&o)),
                    None => here.is_none(),
                }
            };
            ensure(ok, Invariant::InstanceOwner, || {
                format!(
                    "{} instance {k:?} is owned by {:?}, TaskRuns on it: {here:?}",
                    if i.pool.is_some() { "pool" } else { "dynamic" },
                    i.owner
                )
            })?;
        }
        Ok(())
    }

    /// An instance's launch or termination is in flight for it, and each launch or termination
    /// in flight is the one its instance's state names.
    fn check_instance_ops(&self) -> Result<(), StateError> {
        use Invariant::InstanceOps;
        for (k, i) in self.instances.iter() {
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
        }
        for (id, op) in self.ops.iter() {
            let (inst, want) = match *op {
                Op::Launch { inst } => (inst, InstState::Launching(id)),
                Op::Terminate { inst } => (inst, InstState::Terminating(id)),
                _ => continue,
            };
            let state = self.instances.get(inst).map(|i| i.state);
            ensure(state == Some(want), InstanceOps, || {
                format!("{id} is {want:?} of instance {inst:?}, which is {state:?}")
            })?;
        }
        Ok(())
    }

    /// An instance's probe in flight is in the table, for it, while it boots; each probe in
    /// flight is its instance's.
    fn check_probe_ops(&self) -> Result<(), StateError> {
        use Invariant::ProbeOps;
        for (k, i) in self.instances.iter() {
            if let Some(op) = i.probe_op {
                let ok = i.state == InstState::Booting
                    && matches!(self.ops.get(op), Some(Op::Probe { inst }) if *inst == k);
                ensure(ok, ProbeOps, || {
                    format!(
                        "instance {k:?} is {:?} and probed under {op} with no such probe",
                        i.state
                    )
                })?;
            }
        }
        // A probe whose instance stopped booting (terminated, gone) is left to be answered and
        // ignored; one for a booting instance is the probe it waits for.
        for (id, op) in self.ops.iter() {
            if let Op::Probe { inst } = *op
                && let Some(i) = self.instances.get(inst)
                && i.state == InstState::Booting
            {
                ensure(i.probe_op == Some(id), ProbeOps, || {
                    format!(
                        "{id} probes booting instance {inst:?}, which waits for {:?}",
                        i.probe_op
                    )
                })?;
            }
        }
        Ok(())
    }

    fn check_termination_retried(&self) -> Result<(), StateError> {
        for (k, i) in self.instances.iter() {
            let retried = match i.state {
                InstState::Terminating(_) => true,
                InstState::TerminateWait => self
                    .timers
                    .iter()
                    .any(|(_, t)| t == Timer::TerminateRetry(k, i.terminate_attempts)),
                _ => !i.leaked(),
            };
            ensure(retried, Invariant::TerminationRetried, || {
                format!(
                    "instance {k:?} is {:?} (leaked: {}) with no termination retry armed",
                    i.state,
                    i.leaked()
                )
            })?;
        }
        Ok(())
    }

    /// A TaskRun being provisioned has its provisioning in flight, for it; each provisioning in
    /// flight (not compensating) is its TaskRun's current one.
    fn check_provision_ops(&self) -> Result<(), StateError> {
        use Invariant::ProvisionOps;
        for (k, t) in self.taskruns.iter() {
            if let Some(op) = provisioning(&t.state) {
                let ok = matches!(
                    self.ops.get(op),
                    Some(Op::Provision { tr, compensate: false, .. }) if *tr == k
                );
                ensure(ok, ProvisionOps, || {
                    format!(
                        "{} is provisioning under {op} with no such operation",
                        t.path()
                    )
                })?;
            }
        }
        // One its TaskRun no longer waits for is answered and ignored: harmless only where the
        // user it creates goes with the machine (a dynamic instance, or one being terminated or
        // gone); on a static host or a pool instance still in service it must compensate.
        for (id, op) in self.ops.iter() {
            let Op::Provision {
                tr,
                host,
                compensate: false,
                ..
            } = op
            else {
                continue;
            };
            let current = self.taskruns.get(*tr).and_then(|t| provisioning(&t.state));
            let ok = current == Some(id)
                || match host {
                    HostRef::Static(_) => false,
                    HostRef::Instance { id, .. } => self
                        .instances
                        .find(id)
                        .and_then(|k| self.instances.get(k))
                        .is_none_or(|i| {
                            i.pool.is_none()
                                || matches!(
                                    i.state,
                                    InstState::Terminating(_) | InstState::TerminateWait
                                )
                        }),
                };
            ensure(ok, ProvisionOps, || {
                let on = self
                    .instances
                    .find(host.name())
                    .and_then(|k| self.instances.get(k))
                    .map(|i| i.state);
                format!(
                    "{id} provisions on {} ({on:?}) for {tr:?}, whose provisioning is \
                     {current:?}, and does not compensate",
                    host.name()
                )
            })?;
        }
        Ok(())
    }

    fn check_queues(&self) -> Result<(), StateError> {
        for ps in &self.platforms {
            ps.queue.check().map_err(|e| StateError {
                detail: format!("{}: {}", ps.platform, e.detail),
                ..e
            })?;
        }
        Ok(())
    }

    fn check_waiters(&self) -> Result<(), StateError> {
        let mut queued: BTreeSet<(u32, u32, Key, u32)> = BTreeSet::new();
        let mut retry: BTreeSet<(u32, Key)> = BTreeSet::new();
        for (p, ps) in self.platforms.iter().enumerate() {
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
            ensure(ok, Invariant::Waiters, || {
                format!(
                    "{} waits (ticket {ticket}, retry {r}) but is not queued for it",
                    t.path()
                )
            })?;
        }
        Ok(())
    }

    /// A TaskRun in cleanup waits for exactly the cleanups that name it; a live one for none.
    fn check_cleanups(&self) -> Result<(), StateError> {
        use Invariant::CleanupPending;
        let mut waits: BTreeMap<Key, u32> = BTreeMap::new();
        for op in self.ops.values().chain(self.timers.delayed_ops()) {
            match op {
                Op::Deprovision { tr: Some(k), .. } => *waits.entry(*k).or_default() += 1,
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
        })
    }

    /// User removals in progress are exactly those in flight or delayed.
    fn check_cleaning(&self) -> Result<(), StateError> {
        use Invariant::Cleaning;
        let mut removals: BTreeMap<(String, String), u32> = BTreeMap::new();
        for op in self.ops.values().chain(self.timers.delayed_ops()) {
            if let Op::Deprovision { user, host, .. } = op {
                *removals
                    .entry((user.name(), host.name().to_owned()))
                    .or_default() += 1;
            }
        }
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

    /// An unlisted platform is one a listing will come for: served from the cloud.
    fn check_unlisted_modes(&self) -> Result<(), StateError> {
        for ps in &self.platforms {
            ensure(
                !ps.unlisted || matches!(ps.mode, Mode::Dynamic(_) | Mode::Pool(_)),
                Invariant::Unlisted,
                || {
                    format!(
                        "{} is unlisted and served as {}",
                        ps.platform,
                        mode_name(&ps.mode)
                    )
                },
            )?;
        }
        Ok(())
    }

    /// Where a TaskRun's build user lives while it is live: a host or instance name.
    fn target(&self, t: &TaskRun) -> Option<Arc<str>> {
        match t.state {
            State::OnHost { host, .. } => self.hosts.get(host).map(|h| h.name.clone()),
            State::OnInstance { inst, .. } => {
                let i = self.instances.get(inst)?;
                // Not launched yet: no user can be there; named by its key so two still count.
                Some(
                    i.id()
                        .cloned()
                        .unwrap_or_else(|| format!("{inst:?}").into()),
                )
            }
            _ => None,
        }
    }

    fn check_user_guard(&self) -> Result<(), StateError> {
        use Invariant::UserGuard;
        // Only TaskRuns whose user hash is shared can share a name: no name is computed else.
        for group in self.taskruns.sharing_a_user_hash() {
            let mut seen: BTreeMap<(String, Arc<str>), Key> = BTreeMap::new();
            for k in group {
                let Some(t) = self.taskruns.get(k) else {
                    continue;
                };
                let Some(target) = self.target(t) else {
                    continue;
                };
                if let Some(other) = seen.insert((t.user(), target.clone()), k) {
                    return Err(StateError {
                        invariant: UserGuard,
                        detail: format!(
                            "{} and {other:?} share user {} on {target}",
                            t.path(),
                            t.user()
                        ),
                    });
                }
            }
        }
        for (user, hosts) in &self.cleaning {
            let none = Key {
                index: u32::MAX,
                generation: u32::MAX,
            };
            for k in self.taskruns.same_user(user, none) {
                let Some(t) = self.taskruns.get(k) else {
                    continue;
                };
                if let Some(target) = self.target(t) {
                    ensure(!hosts.contains(&target), UserGuard, || {
                        format!(
                            "{} is on {target}, where its user {user} is being removed",
                            t.path()
                        )
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Each platform's cached mode and label are what the config in force gives it.
    fn check_modes(&self) -> Result<(), StateError> {
        for ps in &self.platforms {
            let want = mode_of(&self.config, &ps.platform);
            ensure(ps.mode == want, Invariant::PlatformMode, || {
                format!(
                    "{} is served as {}, the config says {}",
                    ps.platform,
                    mode_name(&ps.mode),
                    mode_name(&want)
                )
            })?;
            ensure(
                *ps.label == *ps.platform.label_value(),
                Invariant::PlatformMode,
                || format!("{} is labelled {}", ps.platform, ps.label),
            )?;
        }
        Ok(())
    }
}

/// The provisioning a TaskRun's state says is in flight for it.
fn provisioning(state: &State) -> Option<OpId> {
    match state {
        State::OnHost {
            phase: Phase::Provisioning(op),
            ..
        }
        | State::OnInstance {
            phase: Phase::Provisioning(op),
            ..
        } => Some(*op),
        _ => None,
    }
}

fn mode_name(mode: &Mode) -> &'static str {
    match mode {
        Mode::Local => "local",
        Mode::Static => "static",
        Mode::Dynamic(_) => "dynamic",
        Mode::Pool(_) => "dynamic pool",
        Mode::Disabled(_) => "disabled",
        Mode::Unknown => "unknown",
    }
}
