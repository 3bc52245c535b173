//! Periodic sweeps fed by the controller: instances the cloud lists and users found on static
//! hosts. They catch what crashes and lost results leave behind, and listings keep the count of
//! instances others run with a platform's tag (the shared `max-instances` bill guard). Linear in
//! what is listed (and, for users, in tracked TaskRuns); they run every few minutes, not per
//! decision.

use std::collections::{BTreeMap, BTreeSet};

use super::snapshot::{InstanceRecord, InstanceState};
use super::{Action, HostRef, InstState, Mode, Op, PlatformId, RemoteUser, Scheduler, State};
use crate::platform::Platform;

impl Scheduler {
    pub(super) fn on_instances_listed(
        &mut self,
        platform: &Platform,
        listed: &[InstanceRecord],
        out: &mut Vec<Action>,
    ) {
        let p = self.platform_id(platform);
        let template = match &self.platforms[p as usize].mode {
            Mode::Dynamic(t) => t.clone(),
            Mode::Pool(pool) => std::sync::Arc::new(pool.instance.clone()),
            // No credentials to act with.
            _ => return,
        };
        // The first listing of a platform recovery had none of: its held TaskRuns are recovered
        // against it (orphans and the foreign count included).
        if self.list_unlisted(p, listed, out) {
            return;
        }
        let label = self.platforms[p as usize].label.clone();
        self.instances
            .forget_terminated(p, self.now, self.policy.orphan_grace);
        for rec in listed {
            if let Some(inst) = self.instances.find(rec.id.as_str()) {
                let Some(i) = self.instances.get(inst) else {
                    continue;
                };
                let ours_terminating = matches!(
                    i.state,
                    InstState::Terminating(_) | InstState::TerminateWait
                );
                match rec.state {
                    s if s.is_terminating() => self.on_instance_gone(&rec.id, out),
                    // It still exists: whatever it served is lost; terminate it rather than
                    // leave a stopped machine.
                    InstanceState::Stopping | InstanceState::Stopped if !ours_terminating => self
                        .instance_failed(
                            inst,
                            "the instance was stopped outside the controller",
                            true,
                            out,
                        ),
                    _ => {}
                }
                continue;
            }
            // Only this cluster's instances of this platform are ever orphans: other clusters'
            // and the Go controller's are only counted.
            if rec.state.is_terminating()
                || !rec.is_ours_for(&label)
                || rec.instance_tag != template.instance_tag
                || self.instances.was_terminated(rec.id.as_str())
            {
                continue;
            }
            // A launch result may still be on its way for a young one, unless its owner has
            // moved on.
            if rec.launched_at + self.policy.orphan_grace <= self.now || self.owner_moved_on(p, rec)
            {
                self.orphan(p, rec, template.clone(), out);
            }
        }
        self.count_foreign(p, listed.iter(), out);
    }

    /// Sets the platform's foreign count from its listing: live instances the ledger does not
    /// track as the platform's own (other clusters', the Go controller's, other platforms'
    /// sharing the tag, and this cluster's own that nothing here tracks yet: ones younger than
    /// the orphan grace, which the sweep leaves alone), except those a launch in flight may have
    /// started (same owner tag; the ledger counts that launch already) and ours whose termination
    /// the ledger saw acknowledged (the listing predates it or lags it). Serves waiters when it
    /// dropped.
    pub(super) fn count_foreign<'a>(
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

    pub(super) fn on_host_users(
        &mut self,
        host: &str,
        users: &[super::HostUser],
        out: &mut Vec<Action>,
    ) {
        let Some(hid) = self.hosts.id(host) else {
            return;
        };
        let Some(def) = self.hosts[hid].def.clone() else {
            return;
        };
        let mut keep = BTreeSet::new();
        for (key, t) in self.taskruns.iter() {
            let here = matches!(&t.state, State::OnHost { host: h, .. } if *h == hid)
                || matches!(t.state, State::Cleanup { .. });
            if here && let Some(r) = self.taskrun_ref(key) {
                keep.insert(r.remote_user());
            }
        }
        for op in self.ops.values().chain(self.timers.delayed_ops()) {
            match op {
                Op::Deprovision { user, .. } => {
                    keep.insert(user.name());
                }
                Op::Provision { tr, .. } => {
                    if let Some(r) = self.taskrun_ref(*tr) {
                        keep.insert(r.remote_user());
                    }
                }
                _ => {}
            }
        }
        let p = self.hosts[hid].platform;
        let grace = self.policy.host_user_grace;
        for user in users {
            // Only our users' shape, and only old ones: a young one may be an allocation whose
            // result is still on its way, or the Go controller's during a switch.
            if crate::contract::is_remote_user_name(&user.name)
                && user.older_than(grace)
                && !keep.contains(&user.name)
            {
                self.deprovision(
                    None,
                    p,
                    RemoteUser::Named(user.name.clone()),
                    HostRef::Static(def.clone()),
                    out,
                );
            }
        }
    }
}
