//! TaskRun state transitions: the only code that writes a TaskRun's state and the relations
//! other owners keep about it (a static host's load, a pool instance's attached TaskRuns, a
//! dynamic instance's owner, the cleanups a finished TaskRun waits for). Each transition keeps
//! every such relation in step with the state in one call, so `check()`'s cross-owner
//! invariants (`HostLoad`, `PoolAttached`, `Cleanups`) hold after it. It emits nothing and calls
//! nothing above it.

use std::sync::Arc;

use super::arena::Key;
use super::{DynamicPlatform, DynamicPool, Instance, Phase, PlatformId, Scheduler, State};

impl Scheduler {
    /// A TaskRun reserves a slot of a pool instance.
    pub(in crate::scheduler) fn attach(&mut self, inst: Key, key: Key) {
        if let Some(i) = self.instances.get_mut(inst) {
            i.attached.push(key);
            i.idle_since = None;
        }
        if let Some(t) = self.taskruns.get_mut(key) {
            t.state = State::OnInstance {
                inst,
                phase: Phase::Reserved,
            };
        }
    }

    pub(in crate::scheduler) fn detach(&mut self, inst: Key, key: Key) {
        if let Some(i) = self.instances.get_mut(inst) {
            i.attached.retain(|&k| k != key);
        }
    }

    /// A dynamic instance's TaskRun leaves it, to be terminated, without finishing (it failed, or
    /// moves on to another instance): its finalizer waits for that termination all the same (what
    /// was made for it goes before it does), until acknowledged, given up as leaked, or the
    /// instance is handed to another TaskRun. A pool instance has no owner: nothing changes.
    pub(in crate::scheduler) fn abandon(&mut self, inst: Key) {
        let Some(owner) = self.instances.get_mut(inst).and_then(|i| i.owner.take()) else {
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
            .insert(Instance::new(p, template, pool, self.now))
    }
}
