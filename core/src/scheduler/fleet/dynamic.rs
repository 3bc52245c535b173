//! Dynamic instances: one per TaskRun, launched when it is placed, terminated when it finishes
//! (or handed, unused, to the next waiter of the same platform).

use std::sync::Arc;

use super::super::arena::Key;
use super::super::lifecycle::Placed;
use super::super::{
    Action, DynamicPlatform, InstState, Mode, Phase, PlatformId, Scheduler, State, Timer,
};

impl Scheduler {
    pub(in crate::scheduler) fn place_dynamic(
        &mut self,
        p: PlatformId,
        key: Key,
        template: Arc<DynamicPlatform>,
        out: &mut Vec<Action>,
    ) -> Placed {
        if self.failures(key) >= self.policy.instance_attempts {
            self.fail_instances(key, p, out);
            return Placed::Done;
        }
        if self.occupied(p) >= template.max_instances {
            return Placed::NoRoom;
        }
        self.observe_wait(key, out);
        let deadline = self.now + template.allocation_timeout;
        let inst = self.new_instance(p, template, None);
        if let Some(i) = self.instances.get_mut(inst) {
            i.owner = Some(key);
        }
        if let Some(t) = self.taskruns.get_mut(key) {
            t.state = State::OnInstance {
                inst,
                phase: Phase::Reserved,
            };
        }
        self.arm(deadline, Timer::Deadline(inst));
        self.launch(inst, out);
        Placed::Done
    }

    pub(super) fn leave_dynamic(
        &mut self,
        key: Key,
        inst: Key,
        phase: Phase,
        out: &mut Vec<Action>,
    ) -> u32 {
        if let Some(i) = self.instances.get_mut(inst) {
            i.owner = None;
        }
        if phase == Phase::Reserved && self.adopt(inst, out) {
            return 0;
        }
        let Some(i) = self.instances.get_mut(inst) else {
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

    /// Hands an unused dynamic instance whose TaskRun went away to the next waiter of the same
    /// platform (same template): a finalizer waiting for its termination no longer does. True
    /// when adopted.
    pub(super) fn adopt(&mut self, inst: Key, out: &mut Vec<Action>) -> bool {
        if !self.policy.adopt_instances {
            return false;
        }
        let Some(i) = self.instances.get(inst) else {
            return false;
        };
        let p = i.platform();
        let current =
            matches!(&self.platforms[p as usize].mode, Mode::Dynamic(t) if **t == *i.template);
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
        let Some(i) = self.instances.get_mut(inst) else {
            return false;
        };
        i.owner = Some(w);
        // The waiter's identity from now on: a launch still in flight keeps the request's (its
        // result is matched by op), but listings and recovery find the instance under the new
        // owner once retagged.
        if launch.is_some() {
            i.launch = launch.clone();
            i.retag = i.id().is_none();
        }
        let (id, state, template) = (i.id().cloned(), i.state, i.template.clone());
        if let Some(t) = self.taskruns.get_mut(w) {
            t.state = State::OnInstance {
                inst,
                phase: Phase::Reserved,
            };
        }
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

    /// The next waiter of a platform: retry lane first, then the fair queue.
    pub(super) fn take_waiter(&mut self, p: PlatformId) -> Option<Key> {
        let ps = &mut self.platforms[p as usize];
        while !ps.retry.is_empty() {
            let k = ps.retry.remove(0);
            let t = self.taskruns.get(k);
            if matches!(t.map(|t| (&t.state, t.platform)), Some((State::Waiting { retry: true, .. }, tp)) if tp == p)
                && t.and_then(|t| t.extra.as_ref())
                    .map_or(0, |e| e.failed.len() as u32)
                    < self.policy.instance_attempts
            {
                return Some(k);
            }
        }
        self.pop_waiter(p).map(|e| e.taskrun)
    }
}
