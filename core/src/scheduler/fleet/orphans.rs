//! Orphans: instances carrying this cluster's identity that no TaskRun owns (a leader died
//! between its launch call and recording the result, or the TaskRun moved on). They are tracked
//! and terminated once past the grace period, or at once when no result can still claim them.
//! And the other side of a listing: live instances with the platform's tag that the ledger does
//! not track count against `max-instances` as foreign.

use std::collections::{BTreeMap, BTreeSet};
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
        let inst = self.track_instance(p, template, None);
        self.instances.update(inst, |i| {
            i.created = rec.launched_at;
            i.launches = 1;
            i.state = InstState::Ready;
            i.used = true;
        });
        self.instances.set_id(inst, rec.id.as_str().into());
        let at = rec.launched_at + self.policy.orphan_grace;
        if at <= self.now || moved_on {
            self.orphan_due(inst, out);
        } else {
            self.timers.arm(at, Timer::Orphan(inst));
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

    /// Sets the platform's foreign count from its listing: live instances the ledger does not
    /// track as the platform's own (other clusters', the Go controller's, other platforms'
    /// sharing the tag, and this cluster's own that nothing here tracks yet: ones younger than
    /// the orphan grace, which the sweep leaves alone), except those a launch in flight may have
    /// started (same owner tag; the ledger counts that launch already) and ours whose termination
    /// the ledger saw acknowledged (the listing predates it or lags it). Serves waiters when it
    /// dropped.
    pub(in crate::scheduler) fn count_foreign<'a>(
        &mut self,
        p: PlatformId,
        listed: impl Iterator<Item = &'a InstanceRecord>,
        out: &mut Vec<Action>,
    ) {
        let label = self.platforms[p as usize].label.clone();
        let mut in_flight: BTreeMap<String, u32> = BTreeMap::new();
        for i in self
            .instances
            .members(p)
            .iter()
            .filter_map(|k| self.instances.get(*k))
        {
            if i.id().is_none()
                && let Some(l) = &i.launch
            {
                *in_flight.entry(l.owner_key()).or_default() += 1;
            }
        }
        let mut seen = BTreeSet::new();
        let mut n = 0u32;
        for rec in listed {
            if !rec.state.counts_toward_limit() || !seen.insert(rec.id.as_str()) {
                continue;
            }
            let tracked = self
                .instances
                .find(rec.id.as_str())
                .and_then(|k| self.instances.get(k))
                .is_some_and(|i| i.platform() == p);
            // Ours and terminated already: the listing predates the termination (or lags it).
            // Counting it would hold the slot its termination freed until the next listing.
            if tracked
                || (rec.is_ours_for(&label) && self.instances.was_terminated(rec.id.as_str()))
            {
                continue;
            }
            if rec.is_ours_for(&label)
                && let Some(left) = rec
                    .owner
                    .as_ref()
                    .and_then(|o| in_flight.get_mut(o))
                    .filter(|left| **left > 0)
            {
                *left -= 1;
                continue;
            }
            n += 1;
        }
        let ps = &mut self.platforms[p as usize];
        let dropped = n < ps.foreign;
        ps.foreign = n;
        if dropped {
            self.capacity_freed(p, out);
            self.ensure_warm(p, out);
        }
    }
}
