//! Cloud instances: dynamic (one instance per TaskRun) and dynamic pools (shared up to
//! `concurrency`). Launch with retries, probe until reachable, provision, terminate; the
//! `max-instances` ledger counts every instance from its launch request until its termination is
//! acknowledged, so booting and terminating instances count too.
//!
//! This file holds what a TaskRun leaves on an instance (finished, given up, failed there, a new
//! attempt) and the hand-over of an unused dynamic instance to a waiter; the strategies are
//! `dynamic` and `pool`, the instance events `launch`, the warm launches `warm`, the listing's
//! strangers `orphans`.
//!
//! A dynamic instance is made for one TaskRun, and that TaskRun's finalizer waits for its
//! termination whether the TaskRun finished on it or left it earlier (timed out, its secret
//! refused, the instance failed, moved on to another): until the termination is acknowledged, the
//! instance is seen gone, its termination is given up as leaked, or it is handed unused to
//! another TaskRun. The fleet counts the terminations each TaskRun awaits. A pool instance is
//! nobody's own: only a TaskRun's user on it is waited for.

mod dynamic;
mod launch;
mod orphans;
mod pool;
mod warm;

use super::{
    Action, Extra, HostRef, InstState, Mode, NO_PLATFORM, Op, Phase, RemoteUser, Scheduler, State,
};

use super::arena::Key;

use pool::POOL_INSTANCE_FAILURES;

impl Scheduler {
    /// A finished TaskRun leaves its instance. Returns the cleanups its finalizer waits for
    /// besides instance terminations (those are counted by the fleet, see
    /// [`Scheduler::set_cleanup_pending`]).
    pub(in crate::scheduler) fn leave_instance(
        &mut self,
        key: Key,
        inst: Key,
        phase: Phase,
        out: &mut Vec<Action>,
    ) -> u32 {
        let p = self.taskruns.get(key).map_or(NO_PLATFORM, |t| t.platform);
        if let Phase::Ready(at) = phase {
            self.observe_ran(p, at, out);
        }
        // Provisioning: a retry's re-provisioning, the first attempt's secret stands.
        if matches!(phase, Phase::Ready(_) | Phase::Provisioning(_)) {
            self.delete_secret(key, out);
        }
        let Some(i) = self.instances.get(inst) else {
            // The instance is gone already; nothing left to clean.
            return 0;
        };
        if i.pool.is_none() {
            return self.leave_dynamic(key, inst, phase, out);
        }
        // Detached already: it left the instance as it entered cleanup.
        let host = self.instance_host(inst);
        let pending = match phase {
            Phase::Reserved => 0,
            Phase::Provisioning(op) => match self.ops.get_mut(op) {
                Some(Op::Provision { compensate, .. }) => {
                    *compensate = true;
                    1
                }
                _ => 0,
            },
            Phase::Ready(_) => match (host, self.taskrun_ref(key)) {
                (Some(host), Some(r)) => {
                    self.deprovision(Some(key), p, RemoteUser::Of(r), host, out);
                    1
                }
                _ => 0,
            },
        };
        // Before the freed room is handed out: a TaskRun with the same user name must see this
        // one's cleanup as pending (see `user_blocked`).
        self.set_cleanup_pending(key, pending);
        if self.policy.pool_idle_timeout.is_none() {
            self.pool_traffic(p, out);
        }
        self.settle(inst, out);
        self.capacity_freed(p, out);
        pending
    }

    /// A Ready TaskRun starts a new attempt: provision a fresh key on the same instance.
    pub(in crate::scheduler) fn reprovision_on_instance(
        &mut self,
        key: Key,
        inst: Key,
        out: &mut Vec<Action>,
    ) {
        if self.instance_host(inst).is_some() {
            self.start_provision(key, inst, out);
            return;
        }
        // The instance is gone: treat like a failed instance.
        if let Some(t) = self.taskruns.get_mut(key) {
            t.extra
                .get_or_insert_with(Box::<Extra>::default)
                .failed
                .push(("instance".into(), "the instance no longer exists".into()));
        }
        self.enqueue(key, true, out);
    }

    /// A TaskRun gives its instance up without finishing (its secret could not be written): a
    /// dynamic instance is terminated (its finalizer waits for that, see [`Scheduler::abandon`]),
    /// a pool instance loses the TaskRun's user (nothing waits for that: the instance is not its
    /// own, and the host sweep removes a user left behind).
    pub(in crate::scheduler) fn give_up_instance(
        &mut self,
        key: Key,
        inst: Key,
        out: &mut Vec<Action>,
    ) {
        let host = self.instance_host(inst);
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let p = i.platform();
        if i.pool.is_none() {
            // It counts until terminated; the count goes when that is acknowledged.
            self.abandon(inst);
            self.terminate(inst, "its TaskRun's secret was refused", out);
            return;
        }
        // Off the instance now, so its slot is handed on below; its error secret follows.
        self.set_state(key, State::Failed);
        if let (Some(host), Some(r)) = (host, self.taskrun_ref(key)) {
            self.deprovision(None, p, RemoteUser::Of(r), host, out);
        }
        self.settle(inst, out);
        self.capacity_freed(p, out);
    }

    pub(in crate::scheduler) fn provision_failed_on_instance(
        &mut self,
        key: Key,
        inst: Key,
        host: HostRef,
        out: &mut Vec<Action>,
    ) {
        let Some(i) = self.instances.get(inst) else {
            self.enqueue(key, true, out);
            return;
        };
        let p = i.platform();
        if i.pool.is_none() {
            // A fresh instance rather than a second try on a suspect one.
            self.abandon(inst);
            self.terminate(inst, "provisioning failed", out);
            self.enqueue(key, true, out);
            return;
        }
        self.instances.update(inst, |i| {
            i.provision_failures += 1;
            if i.provision_failures >= POOL_INSTANCE_FAILURES {
                i.draining = true;
            }
        });
        if let Some(r) = self.taskrun_ref(key) {
            self.deprovision(None, p, RemoteUser::Of(r), host, out);
        }
        // Requeued: it leaves the instance (and its slot) as it starts waiting.
        self.enqueue(key, true, out);
        self.settle(inst, out);
        self.capacity_freed(p, out);
    }

    /// Hands an unused dynamic instance whose TaskRun went away to the next waiter of the same
    /// platform (same template): a finalizer waiting for its termination no longer does. True
    /// when adopted.
    pub(in crate::scheduler) fn adopt(&mut self, inst: Key, out: &mut Vec<Action>) -> bool {
        if !self.policy.adopt_instances {
            return false;
        }
        let Some(i) = self.instances.get(inst) else {
            return false;
        };
        let p = i.platform();
        let current = matches!(&self.platforms[p as usize].mode, Mode::Dynamic(t) if **t == *i.template && !t.drained);
        let usable = matches!(
            i.state,
            InstState::Launching(_) | InstState::Booting | InstState::Ready
        );
        if i.used || !usable || !current || i.overdue {
            return false;
        }
        let Some(w) = self.take_waiter(p) else {
            return false;
        };
        self.observe_wait(w, out);
        let launch = self.launch_id_for(w);
        // The waiter's identity from now on: a launch still in flight keeps the request's (its
        // result is matched by op), but listings and recovery find the instance under the new
        // owner once retagged.
        let Some((id, state, template)) = self.instances.update(inst, |i| {
            if launch.is_some() {
                i.launch = launch.clone();
                i.retag = i.id().is_none();
            }
            (i.id().cloned(), i.state, i.template.clone())
        }) else {
            return false;
        };
        self.set_state(
            w,
            State::OnInstance {
                inst,
                phase: Phase::Reserved,
            },
        );
        if let (Some(id), Some(launch)) = (id, launch) {
            out.push(Action::Retag {
                instance_id: id.clone(),
                template,
                launch,
            });
            self.record_instance(w, inst, out);
        }
        if state == InstState::Ready {
            self.start_provision(w, inst, out);
        }
        if let Some(tr) = self.instances.release_waiter(inst) {
            self.cleanup_done(tr, out);
        }
        true
    }

    pub(in crate::scheduler) fn leave_dynamic(
        &mut self,
        key: Key,
        inst: Key,
        phase: Phase,
        out: &mut Vec<Action>,
    ) -> u32 {
        self.disown(inst);
        if phase == Phase::Reserved && self.adopt(inst, out) {
            return 0;
        }
        let Some(i) = self.instances.get(inst) else {
            return 0;
        };
        // Its finalizer waits for the termination: counted by the fleet, not returned.
        match i.state {
            InstState::LaunchWait => self.drop_instance(inst, out),
            InstState::Launching(_) => {
                // Terminated (or adopted) when the launch result arrives.
                self.instances.await_termination(inst, key);
            }
            InstState::Booting | InstState::Ready => {
                self.instances.await_termination(inst, key);
                self.terminate(inst, "its TaskRun finished", out);
            }
            // Terminated for it already (it left the instance earlier): awaited already.
            InstState::Terminating(_) | InstState::TerminateWait => {
                self.instances.await_termination(inst, key);
            }
        }
        0
    }
}
