//! Orphans: instances carrying this cluster's identity that no TaskRun owns (a leader died
//! between its launch call and recording the result, or the TaskRun moved on). They are tracked
//! and terminated once past the grace period, or at once when no result can still claim them.

use std::sync::Arc;

use super::super::arena::Key;
use super::super::snapshot::InstanceRecord;
use super::super::{Action, DynamicPlatform, InstState, PlatformId, Scheduler, Timer, Uid};

impl Scheduler {
    /// Tracks an unowned instance of this cluster; terminated once past the grace period, or at
    /// once when its owner tag says no result can still claim it ([`Scheduler::owner_moved_on`]).
    pub(in crate::scheduler) fn orphan(
        &mut self,
        p: PlatformId,
        rec: &InstanceRecord,
        template: Arc<DynamicPlatform>,
        out: &mut Vec<Action>,
    ) {
        let moved_on = self.owner_moved_on(p, rec);
        let inst = self.new_instance(p, template, None);
        let i = self.instances.get_mut(inst).expect("just created");
        let id: Arc<str> = rec.id.as_str().into();
        i.created = rec.launched_at;
        i.launches = 1;
        i.state = InstState::Ready;
        i.used = true;
        self.instances.set_id(inst, id);
        let at = rec.launched_at + self.policy.orphan_grace;
        if at <= self.now || moved_on {
            self.orphan_due(inst, out);
        } else {
            self.arm(at, Timer::Orphan(inst));
        }
    }

    /// An untracked instance of ours whose owner tag names a TaskRun this ledger knows (live, in
    /// cleanup, or finalized and remembered) with no launch of that owner in flight: a leader
    /// that died between its launch call and recording the result left it, and the TaskRun has
    /// moved on (its claims were all recovered, so this instance is not among them). Waiting out
    /// the grace period would only hold a `max-instances` place, and, when the TaskRun is
    /// finished, outlive everything else of it. An owner the ledger does not know keeps the
    /// grace: its TaskRun may not be indexed yet.
    pub(in crate::scheduler) fn owner_moved_on(&self, p: PlatformId, rec: &InstanceRecord) -> bool {
        let Some(owner) = rec.owner.as_deref() else {
            return false;
        };
        let launching = self
            .instances
            .members(p)
            .iter()
            .filter_map(|&k| self.instances.get(k))
            .any(|i| i.id().is_none() && i.launch.as_ref().is_some_and(|l| l.owner_key() == owner));
        if launching {
            return false;
        }
        let uid = Uid::new(owner);
        self.taskruns.finished(&uid) || self.taskruns.find(&uid).is_some()
    }

    pub(in crate::scheduler) fn orphan_due(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.owner.is_some() || i.pool.is_some() || i.state != InstState::Ready {
            return;
        }
        let id = i.id().cloned().unwrap_or_else(|| "?".into());
        out.push(Action::Notify {
            taskrun: None,
            warning: true,
            reason: "OrphanInstance",
            message: format!(
                "instance {id} carries our tags but no TaskRun owns it; terminating it"
            ),
        });
        self.terminate(inst, "orphan: no TaskRun owns it", out);
    }
}
