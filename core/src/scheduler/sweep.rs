//! Periodic sweeps fed by the controller: instances the cloud lists and users found on static
//! hosts. They catch what crashes and lost results leave behind, and listings keep the count of
//! instances others run with a platform's tag (the shared `max-instances` bill guard). Linear in
//! what is listed (and, for users, in tracked TaskRuns); they run every few minutes, not per
//! decision.

use std::collections::BTreeSet;

use super::snapshot::{InstanceRecord, InstanceState};
use super::{Action, HostRef, InstState, Mode, Op, RemoteUser, Scheduler, State};
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
