//! The dynamic pool strategy: instances shared up to `concurrency`, most loaded first, then
//! booting ones, then a launch. Idle and past-`max-age` instances drain and are terminated once
//! empty (`handoff::settle`, and the timers in `launch`). A drained pool (`drain: "true"`)
//! launches nothing and its instances drain: they take no new TaskRun and idle ones are
//! terminated; lifting the drain launches fresh ones (the drained ones do not come back).

use super::super::arena::Key;
use super::super::handoff::Choice;
use super::super::instances::PoolSet;
use super::super::users::Target;
use super::super::{DynamicPool, PlatformId, Scheduler, messages};

/// Provisioning failures in a row after which a pool instance takes no new work.
pub(super) const POOL_INSTANCE_FAILURES: u32 = 2;

impl Scheduler {
    /// Where a waiter of pool platform `p` goes: its error once too many instances failed for
    /// it, else a ready instance with room (most loaded first, so idle ones can drain), else a
    /// booting one, else a new instance while the platform and its capacity groups have room
    /// (joining an instance takes no group unit).
    pub(in crate::scheduler) fn choose_pool(
        &self,
        p: PlatformId,
        key: Key,
        pool: &DynamicPool,
    ) -> Choice {
        if self.failures(key) >= self.policy.instance_attempts {
            return Choice::Fail(messages::instances_failed(
                &self.platforms[p as usize].platform,
                &self.failed_list(key),
            ));
        }
        let guard = self.user_guard(key);
        let pick = |set: &PoolSet| {
            set.iter().map(|e| e.2).find(|&k| {
                let id = self.instances.get(k).and_then(|i| i.id().cloned());
                !id.is_some_and(|id| self.failed_on(key, &id))
                    && !guard
                        .as_ref()
                        .is_some_and(|g| self.user_blocked(g, Target::Instance(k)))
            })
        };
        let (ready, booting) = self.instances.with_room(p);
        if let Some(inst) = pick(ready) {
            return Choice::Join { inst, ready: true };
        }
        if let Some(inst) = pick(booting) {
            return Choice::Join { inst, ready: false };
        }
        // Drained: capacity 0 (its instances drain too: `reconfig.rs`), so it waits.
        if self.occupied(p) >= pool.instance.capacity() || !self.group_room(p) {
            return Choice::NoRoom;
        }
        Choice::Launch
    }
}
