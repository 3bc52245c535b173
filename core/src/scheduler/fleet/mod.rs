//! Cloud instances: dynamic (one instance per TaskRun) and dynamic pools (shared up to
//! `concurrency`). Launch with retries, probe until reachable, provision, terminate; the
//! `max-instances` ledger counts every instance from its launch request until its termination is
//! acknowledged, so booting and terminating instances count too.
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

use std::sync::Arc;

use super::arena::Key;
use super::{
    Action, DynamicPlatform, DynamicPool, Extra, HostRef, Instance, LaunchId, LaunchOwner,
    NO_PLATFORM, Op, Phase, Placement, PlatformId, RemoteUser, Scheduler, State, messages,
};

use pool::POOL_INSTANCE_FAILURES;

impl Scheduler {
    /// Error secret after too many instances failed for this TaskRun.
    pub(super) fn fail_instances(&mut self, key: Key, p: PlatformId, out: &mut Vec<Action>) {
        let msg = messages::instances_failed(
            &self.platforms[p as usize].platform,
            &self.failed_list(key),
        );
        self.fail(key, msg, out);
    }

    /// A counted instance entry, not launched yet.
    pub(super) fn new_instance(
        &mut self,
        p: PlatformId,
        template: Arc<DynamicPlatform>,
        pool: Option<Arc<DynamicPool>>,
    ) -> Key {
        self.instances
            .insert(Instance::new(p, template, pool, self.now))
    }

    /// Instances counted against the platform's `max-instances`: the ledger's and the foreign
    /// ones the last listing showed. An unlisted platform's are unknown: it counts as full, so
    /// nothing is launched for it (every launch decision compares this with the limit).
    pub(super) fn occupied(&self, p: PlatformId) -> u32 {
        let ps = &self.platforms[p as usize];
        if ps.unlisted {
            return u32::MAX;
        }
        self.instances.counted(p) + ps.foreign
    }

    /// The identity of a launch for a TaskRun: its UID, Tekton retry, and one more than the
    /// instances that failed for it (all three survive a restart: the UID and retry count on the
    /// TaskRun, the failures in its `failed-hosts` annotation).
    pub(super) fn launch_id_for(&self, key: Key) -> Option<LaunchId> {
        let taskrun = self.taskrun_ref(key)?;
        let t = self.taskruns.get(key)?;
        Some(LaunchId {
            owner: LaunchOwner::TaskRun(taskrun),
            retry: t.retries,
            attempt: self.failures(key) + 1,
        })
    }

    /// A dynamic instance's TaskRun leaves it, to be terminated, without finishing (it failed, or
    /// moves on to another instance): its finalizer waits for that termination all the same (what
    /// was made for it goes before it does), until acknowledged, given up as leaked, or the
    /// instance is handed to another TaskRun. A pool instance has no owner: nothing changes.
    pub(super) fn abandon(&mut self, inst: Key) {
        let Some(owner) = self.instances.get_mut(inst).and_then(|i| i.owner.take()) else {
            return;
        };
        if self.taskruns.get(owner).is_some() {
            self.instances.await_termination(inst, owner);
        }
    }

    /// A finished TaskRun leaves its instance. Returns the cleanups its finalizer waits for
    /// besides instance terminations (those are counted by the fleet, see
    /// [`Scheduler::set_cleanup_pending`]).
    pub(super) fn leave_instance(
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
        let host = self.instance_host(inst);
        self.detach(inst, key);
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

    fn instance_host(&self, inst: Key) -> Option<HostRef> {
        let i = self.instances.get(inst)?;
        Some(HostRef::Instance {
            id: i.id().cloned()?,
            address: i.address.clone()?,
            template: i.template.clone(),
        })
    }

    /// Provisions a TaskRun on a reachable instance.
    fn start_provision(&mut self, key: Key, inst: Key, out: &mut Vec<Action>) {
        let Some(host) = self.instance_host(inst) else {
            return;
        };
        // A new attempt of a TaskRun that had its secret re-provisions: no new allocation.
        let reprovision = matches!(
            self.taskruns.get(key).map(|t| &t.state),
            Some(State::OnInstance {
                phase: Phase::Ready(_),
                ..
            })
        );
        if !reprovision {
            let launched = self.instances.get(inst).map(|i| i.created);
            self.observe_allocated(key, launched, out);
        }
        let op = self.provision_op(key, &host);
        let i = self.instances.get_mut(inst).expect("resolved above");
        i.used = true;
        let annotations = match (&i.pool, &host) {
            (None, HostRef::Instance { id, address, .. }) => Some((id.clone(), address.clone())),
            _ => None,
        };
        if let Some(t) = self.taskruns.get_mut(key) {
            t.state = State::OnInstance {
                inst,
                phase: Phase::Provisioning(op),
            };
        }
        self.emit_provision(key, op, host, annotations, out);
    }

    /// A Ready TaskRun starts a new attempt: provision a fresh key on the same instance.
    pub(super) fn reprovision_on_instance(&mut self, key: Key, inst: Key, out: &mut Vec<Action>) {
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
    pub(super) fn give_up_instance(&mut self, key: Key, inst: Key, out: &mut Vec<Action>) {
        let host = self.instance_host(inst);
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        let p = i.platform();
        if i.pool.is_none() {
            // It counts until terminated; the count goes when that is acknowledged.
            self.abandon(inst);
            self.terminate(inst, "its TaskRun's secret was refused", out);
            return;
        }
        self.detach(inst, key);
        if let (Some(host), Some(r)) = (host, self.taskrun_ref(key)) {
            self.deprovision(None, p, RemoteUser::Of(r), host, out);
        }
        self.settle(inst, out);
        self.capacity_freed(p, out);
    }

    pub(super) fn provision_failed_on_instance(
        &mut self,
        key: Key,
        inst: Key,
        host: HostRef,
        out: &mut Vec<Action>,
    ) {
        let Some(i) = self.instances.get_mut(inst) else {
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
        i.provision_failures += 1;
        if i.provision_failures >= POOL_INSTANCE_FAILURES {
            i.draining = true;
        }
        self.detach(inst, key);
        if let Some(r) = self.taskrun_ref(key) {
            self.deprovision(None, p, RemoteUser::Of(r), host, out);
        }
        self.enqueue(key, true, out);
        self.settle(inst, out);
        self.capacity_freed(p, out);
    }

    /// Records a dynamic TaskRun's instance on it.
    pub(super) fn record_instance(&mut self, key: Key, inst: Key, out: &mut Vec<Action>) {
        let (Some(r), Some(i), Some(t)) = (
            self.taskrun_ref(key),
            self.instances.get(inst),
            self.taskruns.get(key),
        ) else {
            return;
        };
        let placement = Placement {
            assigned_host: i.id().cloned(),
            waiting_for_platform: None,
            failed_hosts: super::lifecycle::failed_hosts(t),
            instance_id: i.id().cloned(),
            instance_address: i.address.clone(),
        };
        if let Some(t) = self.taskruns.get_mut(key) {
            t.labels.write();
        }
        out.push(Action::Record {
            taskrun: r,
            placement,
        });
    }
}
