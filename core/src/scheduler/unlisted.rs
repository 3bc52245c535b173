//! Platforms whose cloud listing failed at recovery ([`Snapshot::unlisted`](super::Snapshot)).
//!
//! What runs on such a platform is unknown, and guessing either way costs: taken as empty, its
//! running instances look like orphans and its builds like waiters (relaunched, then their
//! instances terminated under them); taken as full, nothing is lost but nothing new runs. So until
//! a listing of it arrives: its recorded TaskRuns are held as recorded (not in the ledger: nothing
//! is allocated, moved, relaunched or cleaned up for them, and no instance of the platform is
//! tracked, so none is orphaned), it counts as full (nothing is launched for it; new TaskRuns
//! wait), and what the watch says of a held TaskRun meanwhile is kept. The first listing of it
//! recovers the held TaskRuns against that listing as [`Scheduler::recover`] would have, then
//! applies what was kept. A platform that stops being a dynamic one (no listing will come) is
//! recovered at once without one, as a platform without instances.

use super::snapshot::{InstanceRecord, TaskRunRecord};
use super::{Action, Event, Mode, PlatformId, Scheduler, TaskRunSpec, Uid};

/// A TaskRun held until its platform is listed.
pub(super) struct Held {
    pub(super) platform: PlatformId,
    /// As recorded, `finished` once the watch said so.
    pub(super) record: TaskRunRecord,
    /// It ended by a release ([`Event::TaskRunReleased`]): not remembered as finished.
    pub(super) released: bool,
    /// The latest spec the watch sent of it since (none once it ended).
    pub(super) spec: Option<TaskRunSpec>,
}

impl Scheduler {
    /// Keeps what the watch says of a held TaskRun for when its platform is recovered; any other
    /// event is returned to be handled.
    pub(super) fn hold(&mut self, event: Event) -> Option<Event> {
        if self.held.is_empty() {
            return Some(event);
        }
        let uid = match &event {
            Event::TaskRun(spec) => spec.uid(),
            Event::TaskRunDone { taskrun } | Event::TaskRunReleased { taskrun } => {
                taskrun.uid().clone()
            }
            _ => return Some(event),
        };
        let Some(h) = self.held.get_mut(&uid) else {
            return Some(event);
        };
        // Ended: recovered as finished (nothing new is allocated for it), cleaned up as a
        // release or for good; what was said of it before no longer matters.
        let ended = match &event {
            Event::TaskRunDone { .. } => Some(false),
            Event::TaskRunReleased { .. } => Some(true),
            _ => None,
        };
        if let Some(released) = ended {
            h.released = released && (h.released || !h.record.finished);
            h.record.finished = true;
            h.spec = None;
            return None;
        }
        if let Event::TaskRun(spec) = event {
            h.spec = Some(spec);
        }
        None
    }

    /// The platform's listing arrived: its held TaskRuns are recovered against it, then what the
    /// watch said of them meanwhile is applied. False when the platform was not unlisted.
    pub(super) fn list_unlisted(
        &mut self,
        p: PlatformId,
        listed: &[InstanceRecord],
        out: &mut Vec<Action>,
    ) -> bool {
        if !self.platforms[p as usize].unlisted {
            return false;
        }
        let uids: Vec<Uid> = self
            .held
            .iter()
            .filter(|(_, h)| h.platform == p)
            .map(|(u, _)| u.clone())
            .collect();
        let mut records = Vec::with_capacity(uids.len());
        let mut released = std::collections::BTreeSet::new();
        let mut specs = Vec::new();
        for uid in uids {
            let h = self.held.remove(&uid).expect("listed above");
            if h.released {
                released.insert(uid);
            }
            records.push(h.record);
            specs.extend(h.spec);
        }
        // Still full while its TaskRuns are rebuilt: a TaskRun that finished frees nothing for a
        // waiter before the listing's count of others' instances is in.
        self.rebuild(&records, listed, Some(p), &released, out);
        self.platforms[p as usize].unlisted = false;
        // Its groups held every member's launches while it was unlisted.
        self.serve_groups_of(p, out);
        self.pump(p, out);
        self.ensure_warm(p, out);
        for spec in specs {
            self.on_taskrun(spec, out);
        }
        true
    }

    /// Unlisted platforms the config no longer serves from the cloud will never be listed:
    /// recovered now, as platforms without instances.
    pub(super) fn unlist_unlistable(&mut self, out: &mut Vec<Action>) {
        for p in 0..self.platforms.len() as PlatformId {
            let ps = &self.platforms[p as usize];
            if ps.unlisted && !matches!(ps.mode, Mode::Dynamic(_) | Mode::Pool(_)) {
                self.list_unlisted(p, &[], out);
            }
        }
    }

    /// Held TaskRuns are tracked nowhere else and belong to an unlisted platform; an unlisted
    /// platform tracks no instance (none was recovered or launched for it).
    pub(super) fn check_unlisted(&self) -> Result<(), super::StateError> {
        use super::Invariant::Unlisted;
        use super::invariant::ensure;
        for (uid, h) in &self.held {
            ensure(
                self.platforms
                    .get(h.platform as usize)
                    .is_some_and(|ps| ps.unlisted),
                Unlisted,
                || format!("{uid} is held for platform {} (not unlisted)", h.platform),
            )?;
            ensure(
                self.taskruns.find(uid).is_none() && !self.taskruns.finished(uid),
                Unlisted,
                || format!("{uid} is held and tracked"),
            )?;
        }
        for (p, ps) in self.platforms.iter().enumerate() {
            ensure(
                !ps.unlisted || self.instances.members(p as PlatformId).is_empty(),
                Unlisted,
                || format!("unlisted {} tracks instances", ps.platform),
            )?;
        }
        Ok(())
    }
}
