//! Dynamic pools: instances shared up to `concurrency`, most loaded first; idle and
//! past-`max-age` instances drain and are terminated once empty.

use std::sync::Arc;

use super::super::arena::Key;
use super::super::instances::PoolSet;
use super::super::lifecycle::Placed;
use super::super::users::Target;
use super::super::{Action, DynamicPool, InstState, Phase, PlatformId, Scheduler, State, Timer};

/// Provisioning failures in a row after which a pool instance takes no new work.
pub(super) const POOL_INSTANCE_FAILURES: u32 = 2;

impl Scheduler {
    pub(in crate::scheduler) fn place_pool(
        &mut self,
        p: PlatformId,
        key: Key,
        pool: Arc<DynamicPool>,
        out: &mut Vec<Action>,
    ) -> Placed {
        if self.failures(key) >= self.policy.instance_attempts {
            self.fail_instances(key, p, out);
            return Placed::Done;
        }
        if self.policy.pool_idle_timeout.is_none() {
            self.pool_traffic(p, out);
        }
        // A ready instance with room (most loaded first, so idle ones can drain), else a
        // booting one, else launch.
        let guard = self.user_guard(key);
        self.instances.flush();
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
        let (ready, booting) = (pick(ready), pick(booting));
        let full = self.occupied(p) >= pool.instance.max_instances;
        if let Some(inst) = ready {
            self.observe_wait(key, out);
            self.attach(inst, key);
            self.start_provision(key, inst, out);
            return Placed::Done;
        }
        if let Some(inst) = booting {
            self.observe_wait(key, out);
            self.attach(inst, key);
            return Placed::Done;
        }
        if full {
            return Placed::NoRoom;
        }
        self.observe_wait(key, out);
        let deadline = self.now + pool.instance.allocation_timeout;
        let inst = self.new_instance(p, Arc::new(pool.instance.clone()), Some(pool.clone()));
        self.attach(inst, key);
        self.arm(deadline, Timer::Deadline(inst));
        self.launch(inst, out);
        Placed::Done
    }

    /// A TaskRun reserves a slot of a pool instance.
    pub(super) fn attach(&mut self, inst: Key, key: Key) {
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

    pub(super) fn detach(&mut self, inst: Key, key: Key) {
        if let Some(i) = self.instances.get_mut(inst) {
            i.attached.retain(|&k| k != key);
        }
    }

    /// A booted pool instance failed a probe: it takes no new work and its waiting TaskRuns go
    /// back to the queue (counting a failure), but builds running on it keep it until they
    /// finish; it is terminated once idle. Terminating it now would kill them, and one failed
    /// SSH connection does not prove it is gone (a listing or a termination seen outside tells).
    pub(super) fn instance_unhealthy(&mut self, inst: Key, reason: &str, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        // Probed no more: settled like a ready instance from now on.
        i.state = InstState::Ready;
        let p = i.platform();
        let running = self.requeue_waiting(inst, reason, out);
        let name = self.instance_name(inst);
        out.push(Action::Notify {
            taskrun: None,
            warning: true,
            reason: "InstanceUnhealthy",
            message: format!(
                "instance {name} failed a probe ({reason}): it takes no new builds and is \
                 terminated once its {} running build(s) finish",
                running.len()
            ),
        });
        self.settle(inst, out);
        self.capacity_freed(p, out);
    }

    /// After a pool instance's load changed: terminate it when idle and draining, or start its
    /// idle timer.
    pub(in crate::scheduler) fn settle(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        if i.pool.is_none() || i.state != InstState::Ready {
            return;
        }
        if !i.attached.is_empty() {
            i.idle_since = None;
            return;
        }
        if i.draining {
            self.terminate(inst, "drained", out);
            return;
        }
        if i.idle_since.is_none()
            && let Some(idle) = self.policy.pool_idle_timeout
        {
            i.idle_since = Some(self.now);
            let at = self.now + idle;
            let now = self.now;
            self.arm(at, Timer::Idle(inst, now));
        }
    }

    pub(in crate::scheduler) fn idle_due(
        &mut self,
        inst: Key,
        since: super::super::Time,
        out: &mut Vec<Action>,
    ) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.idle_since != Some(since) || !i.attached.is_empty() || i.state != InstState::Ready {
            return;
        }
        let p = i.platform();
        let min = i.pool.as_ref().map_or(0, |pl| pl.min_instances);
        if self.active_pool_instances(p) > min {
            self.terminate(inst, "idle", out);
        }
    }

    pub(in crate::scheduler) fn max_age_due(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        let Some(pool) = &i.pool else {
            return;
        };
        if i.created + pool.max_age > self.now {
            // max-age was raised since the timer was set.
            let at = i.created + pool.max_age;
            self.arm(at, Timer::MaxAge(inst));
            return;
        }
        if matches!(
            i.state,
            InstState::Terminating(_) | InstState::TerminateWait
        ) {
            return;
        }
        i.draining = true;
        let p = i.platform();
        self.settle(inst, out);
        self.ensure_warm(p, out);
    }

    /// Go behaviour: past-`max-age` instances are noticed (and terminated when idle) only when
    /// traffic for the pool arrives.
    pub(super) fn pool_traffic(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        let members: Vec<Key> = self.instances.members(p).iter().copied().collect();
        for inst in members {
            let Some(i) = self.instances.get_mut(inst) else {
                continue;
            };
            let Some(pool) = &i.pool else {
                continue;
            };
            if !i.draining && i.created + pool.max_age <= self.now {
                i.draining = true;
                self.settle(inst, out);
            }
        }
    }

    /// Pool instances that take work (not draining or terminating).
    pub(in crate::scheduler) fn active_pool_instances(&self, p: PlatformId) -> u32 {
        self.instances
            .members(p)
            .iter()
            .filter_map(|k| self.instances.get(*k))
            .filter(|i| {
                i.pool.is_some()
                    && !i.draining
                    && !matches!(
                        i.state,
                        InstState::Terminating(_) | InstState::TerminateWait
                    )
            })
            .count() as u32
    }
}
