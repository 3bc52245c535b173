//! TaskRun state transitions: the only code that writes a TaskRun's state and the relations
//! other owners keep about it (a static host's load, a pool instance's attached TaskRuns, a
//! dynamic instance's owner, the cleanups a finished TaskRun waits for). Each transition keeps
//! every such relation in step with the state in one call, so `check()`'s cross-owner
//! invariants (`HostLoad`, `PoolAttached`, `Cleanups`) hold after it. It emits nothing and calls
//! nothing above it.

use std::sync::Arc;

use super::arena::Key;
use super::{DynamicPlatform, DynamicPool, HostId, Instance, Phase, PlatformId, Scheduler, State};

/// Where a state puts a TaskRun: the static host or the instance it holds a slot on.
fn place_of(state: &State) -> (Option<HostId>, Option<Key>) {
    match state {
        State::OnHost { host, .. } => (Some(*host), None),
        State::OnInstance { inst, .. } => (None, Some(*inst)),
        _ => (None, None),
    }
}

impl Scheduler {
    /// Moves TaskRun `key` to `to` and returns the state it left. What other owners hold about it
    /// follows in the same call: a static host's load counts exactly the TaskRuns on it (taken
    /// when it arrives, given back when it leaves); a pool instance's attached list holds exactly
    /// the TaskRuns on it, in arrival order (an instance joined is not idle); a dynamic instance
    /// arrived on is owned by it. Leaving a dynamic instance is [`Scheduler::abandon`] or
    /// [`Scheduler::disown`]: its finalizer may wait for that instance's termination.
    pub(in crate::scheduler) fn set_state(&mut self, key: Key, to: State) -> Option<State> {
        let t = self.taskruns.get_mut(key)?;
        let (host, inst) = place_of(&to);
        let from = std::mem::replace(&mut t.state, to);
        let (was_host, was_inst) = place_of(&from);
        if was_host != host {
            if let Some(h) = was_host {
                self.hosts.release(h);
            }
            if let Some(h) = host {
                self.hosts.add_load(h);
            }
        }
        if was_inst != inst {
            if let Some(i) = was_inst {
                self.instances.update(i, |i| {
                    if i.pool.is_some() {
                        i.attached.retain(|&k| k != key);
                    }
                });
            }
            if let Some(i) = inst {
                self.instances.update(i, |i| {
                    if i.pool.is_some() {
                        i.attached.push(key);
                        i.idle_since = None;
                    } else {
                        i.owner = Some(key);
                    }
                });
            }
        }
        Some(from)
    }

    /// The phase of a TaskRun on a host or instance moves on (nothing else changes).
    pub(in crate::scheduler) fn set_phase(&mut self, key: Key, to: Phase) {
        if let Some(t) = self.taskruns.get_mut(key)
            && let State::OnHost { phase, .. } | State::OnInstance { phase, .. } = &mut t.state
        {
            *phase = to;
        }
    }

    /// A waiter is served before the fair queue from now on (its lane is the caller's to change).
    pub(in crate::scheduler) fn mark_retry(&mut self, key: Key) {
        if let Some(t) = self.taskruns.get_mut(key)
            && let State::Waiting { retry, .. } = &mut t.state
        {
            *retry = true;
        }
    }

    /// One cleanup a finished TaskRun waits for is over: true when none is left.
    pub(in crate::scheduler) fn cleanup_one_done(&mut self, key: Key) -> bool {
        if let Some(t) = self.taskruns.get_mut(key)
            && let State::Cleanup { pending } = &mut t.state
        {
            *pending = pending.saturating_sub(1);
            return *pending == 0;
        }
        false
    }

    /// A dynamic instance's TaskRun leaves it for good (it finished on it, or the instance is
    /// about to be handed on or dropped): the instance has no owner, and its TaskRuns, owner and
    /// attached, are returned for the caller to move on in this step.
    pub(in crate::scheduler) fn disown(&mut self, inst: Key) -> Vec<Key> {
        self.instances
            .update(inst, |i| {
                i.owner
                    .take()
                    .into_iter()
                    .chain(i.attached.drain(..))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A dynamic instance's TaskRun leaves it, to be terminated, without finishing (it failed, or
    /// moves on to another instance): its finalizer waits for that termination all the same (what
    /// was made for it goes before it does), until acknowledged, given up as leaked, or the
    /// instance is handed to another TaskRun. A pool instance has no owner: nothing changes.
    pub(in crate::scheduler) fn abandon(&mut self, inst: Key) {
        let Some(owner) = self.instances.update(inst, |i| i.owner.take()).flatten() else {
            return;
        };
        if self.taskruns.get(owner).is_some() {
            self.instances.await_termination(inst, owner);
        }
    }

    /// Records how many cleanups a finished TaskRun's finalizer waits for: `pending` of its own
    /// (user removals), and the terminations of the instances it was launched for or finished on
    /// (counted by the fleet).
    pub(in crate::scheduler) fn set_cleanup_pending(&mut self, key: Key, pending: u32) {
        let terminations = self.instances.awaited(key);
        if let Some(t) = self.taskruns.get_mut(key)
            && let State::Cleanup { pending: slot } = &mut t.state
        {
            *slot = pending + terminations;
        }
    }

    /// A counted instance entry, not launched yet.
    pub(in crate::scheduler) fn new_instance(
        &mut self,
        p: PlatformId,
        template: Arc<DynamicPlatform>,
        pool: Option<Arc<DynamicPool>>,
    ) -> Key {
        self.instances
            .insert(Instance::new(p, template, pool, self.now), false)
    }

    /// A counted instance entry for an instance that already runs (recovered from a listing or a
    /// TaskRun's record, or an orphan a listing shows): tracked whatever its capacity groups' room,
    /// since it exists.
    pub(in crate::scheduler) fn track_instance(
        &mut self,
        p: PlatformId,
        template: Arc<DynamicPlatform>,
        pool: Option<Arc<DynamicPool>>,
    ) -> Key {
        self.instances
            .insert(Instance::new(p, template, pool, self.now), true)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{H, dynamic_pairs, launches, provisions, static_pairs};
    use super::super::{Key, Phase, Platform, State, Uid};

    fn key(h: &H, name: &str) -> Key {
        h.s.taskruns
            .find(&Uid::new(&format!("uid-ns-{name}")))
            .expect("tracked")
    }

    fn waiting() -> State {
        State::Waiting {
            ticket: 999,
            retry: false,
        }
    }

    #[test]
    fn a_static_hosts_load_follows_the_taskruns_on_it() {
        let mut h = H::new(&static_pairs(&[("h1", 2)]));
        assert_eq!(provisions(&h.submit("ns", "a", "linux/s390x")).len(), 1);
        let a = key(&h, "a");
        let hid = h.s.hosts.id("h1").expect("configured");
        assert_eq!(h.s.hosts[hid].load(), 1);
        h.s.set_state(a, waiting());
        assert_eq!(h.s.hosts[hid].load(), 0, "left the host");
        let def = h.s.hosts[hid].def.clone();
        let on = |phase| State::OnHost {
            host: hid,
            def: def.clone(),
            phase,
        };
        h.s.set_state(a, on(Phase::Reserved));
        assert_eq!(h.s.hosts[hid].load(), 1, "arrived");
        h.s.set_state(a, on(Phase::Ready(h.now)));
        assert_eq!(h.s.hosts[hid].load(), 1, "a phase change moves nothing");
        h.s.set_state(a, State::Cleanup { pending: 0 });
        assert_eq!(h.s.hosts[hid].load(), 0, "left for cleanup");
        // Only the relation under test: the provisioning this test cut short is left in flight.
        let broken: Vec<_> = h.s.violations().into_iter().map(|e| e.invariant).collect();
        assert!(
            !broken.contains(&crate::scheduler::Invariant::HostLoad),
            "load matches the TaskRuns on the host: {broken:?}"
        );
    }

    #[test]
    fn a_pool_instances_attached_list_follows_the_taskruns_on_it() {
        let mut h = H::new(&dynamic_pairs(2, Some((3, 60))));
        assert_eq!(launches(&h.submit("ns", "a", "linux/arm64")).len(), 1);
        assert!(launches(&h.submit("ns", "b", "linux/arm64")).is_empty());
        let (a, b) = (key(&h, "a"), key(&h, "b"));
        let p = h.s.platform_ids[&Platform::parse("linux/arm64").unwrap()];
        let inst = *h.s.instances.members(p).first().expect("launched");
        assert_eq!(h.s.instances.get(inst).unwrap().attached, vec![a, b]);
        h.s.set_state(a, State::Failed);
        assert_eq!(h.s.instances.get(inst).unwrap().attached, vec![b]);
        h.s.set_state(
            a,
            State::OnInstance {
                inst,
                phase: Phase::Reserved,
            },
        );
        assert_eq!(
            h.s.instances.get(inst).unwrap().attached,
            vec![b, a],
            "in arrival order"
        );
        h.s.check()
            .expect("attached matches the TaskRuns on the instance");
        // The pool index follows too: three slots, two taken.
        let (_, booting) = h.s.instances.with_room(p);
        assert_eq!(booting.iter().next().map(|e| e.0), Some(1));
    }

    #[test]
    fn a_dynamic_instance_arrived_on_is_owned_and_disown_returns_its_taskrun() {
        let mut h = H::new(&dynamic_pairs(2, None));
        assert_eq!(launches(&h.submit("ns", "a", "linux/arm64")).len(), 1);
        let a = key(&h, "a");
        let p = h.s.platform_ids[&Platform::parse("linux/arm64").unwrap()];
        let inst = *h.s.instances.members(p).first().expect("launched");
        assert_eq!(h.s.instances.get(inst).unwrap().owner, Some(a));
        assert_eq!(h.s.disown(inst), vec![a]);
        assert_eq!(h.s.instances.get(inst).unwrap().owner, None);
        // Leaving a dynamic instance is disown's or abandon's: the state alone keeps no owner.
        h.s.set_state(a, State::Failed);
        assert_eq!(h.s.instances.get(inst).unwrap().owner, None);
        h.s.set_state(
            a,
            State::OnInstance {
                inst,
                phase: Phase::Reserved,
            },
        );
        assert_eq!(h.s.instances.get(inst).unwrap().owner, Some(a));
    }
}
