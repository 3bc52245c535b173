//! Lookups across the owners (a TaskRun's reference and failures, a platform's id and instance
//! count, an instance's name and address) and small pure helpers: the bottom of the call graph
//! with the transitions.

use super::queue::FairQueue;
use super::{PlatformState, Time, mode_of};
use std::sync::Arc;

use super::arena::Key;
use super::{
    HostRef, InstState, LaunchId, LaunchOwner, Op, OpId, Platform, PlatformId, Scheduler, State,
    TaskRun, TaskRunRef,
};

impl Scheduler {
    pub(in crate::scheduler) fn taskrun_ref(&self, key: Key) -> Option<TaskRunRef> {
        Some(self.taskruns.get(key)?.reference())
    }

    /// The platform's id, creating its entry (resolved against the current config) if new.
    pub(in crate::scheduler) fn platform_id(&mut self, platform: &Platform) -> PlatformId {
        if let Some(&id) = self.platform_ids.get(platform) {
            return id;
        }
        let id = self.platforms.len() as PlatformId;
        let mode = mode_of(&self.config, platform);
        self.platforms.push(PlatformState {
            platform: Arc::new(platform.clone()),
            label: platform.label_value().into(),
            mode,
            queue: FairQueue::default(),
            retry: Vec::new(),
            foreign: 0,
            unlisted: false,
            warm_hold: Time::ZERO,
        });
        self.platform_ids.insert(platform.clone(), id);
        id
    }

    /// Number of provisioning failures recorded for a TaskRun.
    pub(in crate::scheduler) fn failures(&self, key: Key) -> u32 {
        self.taskruns
            .get(key)
            .and_then(|t| t.extra.as_ref())
            .map_or(0, |e| e.failed.len() as u32)
    }

    /// True when `name` failed for this TaskRun.
    pub(in crate::scheduler) fn failed_on(&self, key: Key, name: &str) -> bool {
        self.taskruns
            .get(key)
            .and_then(|t| t.extra.as_ref())
            .is_some_and(|e| e.failed.iter().any(|(n, _)| &**n == name))
    }

    /// Hosts or instances that failed for this TaskRun, for its error message.
    pub(in crate::scheduler) fn failed_list(&self, key: Key) -> Vec<(Arc<str>, String)> {
        self.taskruns
            .get(key)
            .and_then(|t| t.extra.as_ref())
            .map(|e| e.failed.clone())
            .unwrap_or_default()
    }

    /// Units group `g` holds: its members' instances, and with `scope: account` their foreign
    /// ones as their last listings showed (the `max-instances` bill guard's count).
    pub(in crate::scheduler) fn group_in_use(&self, g: super::groups::GroupId) -> u32 {
        let group = self.instances.groups().get(g);
        let foreign = match group.def().scope {
            crate::config::GroupScope::Cluster => 0,
            crate::config::GroupScope::Account => group
                .def()
                .members
                .iter()
                .map(|&m| self.platforms[m as usize].foreign)
                .sum(),
        };
        group.in_use() + foreign
    }

    /// Every capacity group of platform `p` has room for one more instance (true when it is in
    /// none). Read by every launch decision, beside `max-instances`. A group with an unlisted
    /// member has none: what that member runs is unknown (it tracks no instance until its
    /// listing arrives), as an unlisted platform has no room of its own.
    pub(in crate::scheduler) fn group_room(&self, p: PlatformId) -> bool {
        let groups = self.instances.groups();
        groups.of(p).iter().all(|&g| {
            let def = groups.get(g).def();
            !def.members
                .iter()
                .any(|&m| self.platforms[m as usize].unlisted)
                && self.group_in_use(g) < def.max
        })
    }

    /// Instances counted against the platform's `max-instances`: the ledger's, the foreign
    /// ones the last listing showed, and the slots of terminated instances whose dedicated host
    /// is still scrubbed. An unlisted platform's are unknown: it counts as full, so nothing is
    /// launched for it (every launch decision compares this with the limit).
    pub(in crate::scheduler) fn occupied(&self, p: PlatformId) -> u32 {
        let ps = &self.platforms[p as usize];
        if ps.unlisted {
            return u32::MAX;
        }
        self.instances.counted(p) + ps.foreign + self.instances.scrubbing(p)
    }

    /// The identity of a launch for a TaskRun: its UID, Tekton retry, and one more than the
    /// instances that failed for it (all three survive a restart: the UID and retry count on the
    /// TaskRun, the failures in its `failed-hosts` annotation).
    pub(in crate::scheduler) fn launch_id_for(&self, key: Key) -> Option<LaunchId> {
        let taskrun = self.taskrun_ref(key)?;
        let t = self.taskruns.get(key)?;
        Some(LaunchId {
            owner: LaunchOwner::TaskRun(taskrun),
            retry: t.retries,
            attempt: self.failures(key) + 1,
        })
    }

    pub(in crate::scheduler) fn instance_name(&self, inst: Key) -> Arc<str> {
        self.instances
            .get(inst)
            .and_then(|i| i.id().cloned())
            .unwrap_or_else(|| "instance".into())
    }

    pub(in crate::scheduler) fn instance_host(&self, inst: Key) -> Option<HostRef> {
        let i = self.instances.get(inst)?;
        Some(HostRef::Instance {
            id: i.id().cloned()?,
            address: i.address.clone()?,
            template: i.template.clone(),
        })
    }

    pub(in crate::scheduler) fn is_waiting(&self, key: Key) -> bool {
        matches!(
            self.taskruns.get(key).map(|t| &t.state),
            Some(State::Waiting { .. })
        )
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

    /// Removes an op if it is of the expected kind (a result echoing another kind's id is bogus
    /// and changes nothing).
    pub(in crate::scheduler) fn take_op(
        &mut self,
        op: OpId,
        kind: impl Fn(&Op) -> bool,
    ) -> Option<Op> {
        if !self.ops.get(op).is_some_and(kind) {
            return None;
        }
        self.ops.remove(op)
    }
}

/// The `failed-hosts` annotation value.
pub(super) fn failed_hosts(t: &TaskRun) -> Option<String> {
    let e = t.extra.as_ref()?;
    if e.failed.is_empty() {
        return None;
    }
    let mut names: Vec<&str> = e.failed.iter().map(|(n, _)| &**n).collect();
    names.dedup();
    Some(names.join(","))
}

/// `base * 2^attempt`, at most five minutes.
pub(super) fn backoff(base: std::time::Duration, attempt: u32) -> std::time::Duration {
    let max = std::time::Duration::from_secs(300);
    base.checked_mul(1u32 << attempt.min(16))
        .unwrap_or(max)
        .min(max)
}
