//! Cloud instances: dynamic (one instance per TaskRun) and dynamic pools (shared up to
//! `concurrency`). Launch with retries, probe until reachable, provision, terminate; the
//! `max-instances` ledger counts every instance from its launch request until its termination is
//! acknowledged, so booting and terminating instances count too.

use std::sync::Arc;
use std::time::Duration;

use super::arena::Key;
use super::instances::PoolSet;
use super::lifecycle::{Placed, backoff};
use super::users::Target;
use super::{
    Action, DynamicPlatform, DynamicPool, Extra, HostRef, InstState, Instance, InstanceState,
    LaunchId, LaunchOwner, Mode, NO_PLATFORM, Op, OpId, Phase, Placement, PlatformId, ProbeResult,
    RemoteUser, Scheduler, State, Timer, messages,
};

/// How long warm launches pause after a warm instance could not be launched at all.
const WARM_HOLD: Duration = Duration::from_secs(300);
/// Provisioning failures in a row after which a pool instance takes no new work.
const POOL_INSTANCE_FAILURES: u32 = 2;

impl Scheduler {
    pub(super) fn place_dynamic(
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

    pub(super) fn place_pool(
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

    /// Error secret after too many instances failed for this TaskRun.
    pub(super) fn fail_instances(&mut self, key: Key, p: PlatformId, out: &mut Vec<Action>) {
        let msg = messages::instances_failed(
            &self.platforms[p as usize].platform,
            &self.failed_list(key),
        );
        self.fail(key, msg, out);
    }

    /// A TaskRun reserves a slot of a pool instance.
    fn attach(&mut self, inst: Key, key: Key) {
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

    fn detach(&mut self, inst: Key, key: Key) {
        if let Some(i) = self.instances.get_mut(inst) {
            i.attached.retain(|&k| k != key);
        }
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
    /// ones the last listing showed.
    pub(super) fn occupied(&self, p: PlatformId) -> u32 {
        self.instances.counted(p) + self.platforms[p as usize].foreign
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

    /// Sends (or re-sends) the launch request. Its identity is fixed by the first request, so
    /// a retry after a cloud error cannot launch a second instance.
    fn launch(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let launch = match &i.launch {
            Some(l) => l.clone(),
            None => {
                let requester = i.owner.or_else(|| i.attached.first().copied());
                let (created, index) = (i.created, inst.index);
                let id = requester
                    .and_then(|k| self.launch_id_for(k))
                    .unwrap_or_else(|| LaunchId {
                        // Unique rather than stable: see `LaunchOwner::Warm`.
                        owner: LaunchOwner::Warm(
                            format!("warm-{}-{index}", created.as_millis()).into(),
                        ),
                        retry: 0,
                        attempt: 1,
                    });
                self.instances.get_mut(inst).expect("checked above").launch = Some(id.clone());
                id
            }
        };
        let op = self.ops.insert(Op::Launch { inst });
        let i = self.instances.get_mut(inst).expect("checked above");
        i.state = InstState::Launching(op);
        i.launches += 1;
        let template = i.template.clone();
        let p = i.platform();
        out.push(Action::Launch {
            op,
            platform: self.platforms[p as usize].platform.clone(),
            template,
            launch,
            additional_tags: self.additional_tags.clone(),
        });
    }

    /// A finished TaskRun leaves its instance. Returns the cleanups its finalizer waits for.
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
        if self.policy.pool_idle_timeout.is_none() {
            self.pool_traffic(p, out);
        }
        self.settle(inst, out);
        self.capacity_freed(p, out);
        pending
    }

    fn leave_dynamic(&mut self, key: Key, inst: Key, phase: Phase, out: &mut Vec<Action>) -> u32 {
        if let Some(i) = self.instances.get_mut(inst) {
            i.owner = None;
        }
        if phase == Phase::Reserved && self.adopt(inst, out) {
            return 0;
        }
        let Some(i) = self.instances.get_mut(inst) else {
            return 0;
        };
        match i.state {
            InstState::LaunchWait => {
                self.drop_instance(inst, out);
                0
            }
            InstState::Launching(_) => {
                // Terminated (or adopted) when the launch result arrives.
                i.cleanup_for = Some(key);
                1
            }
            InstState::Booting | InstState::Ready => {
                i.cleanup_for = Some(key);
                self.terminate(inst, "its TaskRun finished", out);
                1
            }
            InstState::Terminating(_) | InstState::TerminateWait => {
                i.cleanup_for = Some(key);
                1
            }
        }
    }

    /// Hands an unused dynamic instance whose TaskRun went away to the next waiter of the same
    /// platform (same template). True when adopted.
    fn adopt(&mut self, inst: Key, out: &mut Vec<Action>) -> bool {
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
        true
    }

    /// The next waiter of a platform: retry lane first, then the fair queue.
    fn take_waiter(&mut self, p: PlatformId) -> Option<Key> {
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
            t.recorded = true;
        }
        out.push(Action::Record {
            taskrun: r,
            placement,
        });
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
    /// dynamic instance is terminated, a pool instance loses the TaskRun's user. Nothing waits for
    /// that cleanup: the TaskRun gets an error and may finish at any time.
    pub(super) fn give_up_instance(&mut self, key: Key, inst: Key, out: &mut Vec<Action>) {
        let host = self.instance_host(inst);
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        let p = i.platform();
        if i.pool.is_none() {
            // It counts until terminated; the count goes when that is acknowledged.
            i.owner = None;
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
            i.owner = None;
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

    /// Asks for termination (once the id is known; a launching instance is terminated when its
    /// launch result arrives).
    pub(super) fn terminate(&mut self, inst: Key, reason: &'static str, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        let Some(id) = i.id().cloned() else {
            if i.state == InstState::LaunchWait {
                self.drop_instance(inst, out);
            }
            return;
        };
        if matches!(i.state, InstState::Terminating(_)) {
            return;
        }
        let op = self.ops.insert(Op::Terminate { inst });
        i.state = InstState::Terminating(op);
        i.probe_op = None;
        let (template, legacy) = (i.template.clone(), i.legacy);
        out.push(Action::Terminate {
            op,
            instance_id: id,
            template,
            legacy,
            reason,
        });
    }

    /// Forgets an instance that no longer exists; frees its count. TaskRuns still waiting for
    /// it go back to the queue, first in line.
    pub(super) fn drop_instance(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let p = i.platform();
        let cleanup_for = i.cleanup_for;
        let stranded: Vec<Key> = i
            .owner
            .into_iter()
            .chain(i.attached.iter().copied())
            .filter(|k| {
                matches!(
                    self.taskruns.get(*k).map(|t| &t.state),
                    Some(State::OnInstance { inst: x, phase: Phase::Reserved | Phase::Provisioning(_) }) if *x == inst
                )
            })
            .collect();
        self.instances.remove(inst);
        if let Some(tr) = cleanup_for {
            self.cleanup_done(tr, out);
        }
        for k in stranded {
            self.enqueue(k, true, out);
        }
        self.capacity_freed(p, out);
        self.ensure_warm(p, out);
    }

    /// The instance a launch result is for, when the core still waits for it.
    fn take_launch(&mut self, op: OpId) -> Option<Key> {
        let Some(Op::Launch { inst }) = self.take_op(op, |o| matches!(o, Op::Launch { .. })) else {
            return None;
        };
        self.instances
            .get(inst)
            .is_some_and(|i| i.state == InstState::Launching(op))
            .then_some(inst)
    }

    pub(super) fn on_launched(
        &mut self,
        op: OpId,
        result: Result<String, (String, bool)>,
        out: &mut Vec<Action>,
    ) {
        let Some(inst) = self.take_launch(op) else {
            return;
        };
        match result {
            Ok(id) => {
                let id: Arc<str> = id.into();
                if let Some(other) = self.instances.find(&id)
                    && other != inst
                {
                    self.launched_known(inst, other, out);
                    return;
                }
                let i = self
                    .instances
                    .get_mut(inst)
                    .expect("checked by take_launch");
                i.state = InstState::Booting;
                i.probes = 0;
                let (overdue, pool, created) = (i.overdue, i.pool.clone(), i.created);
                let owner = i.owner;
                self.instances.set_id(inst, id);
                let first = self.now + self.policy.first_probe;
                self.arm(first, Timer::Probe(inst, 0));
                if let Some(pool) = &pool
                    && self.policy.pool_idle_timeout.is_some()
                {
                    self.arm(created + pool.max_age, Timer::MaxAge(inst));
                }
                if overdue {
                    self.timed_out(inst, out);
                    return;
                }
                if pool.is_none() {
                    let owned = owner.is_some_and(|o| {
                        matches!(self.taskruns.get(o).map(|t| &t.state), Some(State::OnInstance { inst: k, .. }) if *k == inst)
                    });
                    if owned {
                        let i = self.instances.get_mut(inst).expect("resolved above");
                        if std::mem::take(&mut i.retag)
                            && let Some(launch) = i.launch.clone()
                        {
                            out.push(Action::Retag {
                                instance_id: i.id().cloned().expect("set above"),
                                template: i.template.clone(),
                                launch,
                            });
                        }
                        self.record_instance(owner.expect("checked"), inst, out);
                    } else if let Some(i) = self.instances.get_mut(inst) {
                        i.owner = None;
                        let waiting = i.cleanup_for;
                        if self.adopt(inst, out) {
                            if let Some(tr) = waiting {
                                if let Some(i) = self.instances.get_mut(inst) {
                                    i.cleanup_for = None;
                                }
                                self.cleanup_done(tr, out);
                            }
                        } else {
                            self.terminate(inst, "its TaskRun went away during launch", out);
                        }
                    }
                }
            }
            Err((error, retryable)) => {
                let i = self
                    .instances
                    .get_mut(inst)
                    .expect("checked by take_launch");
                i.last_error = Some(error.clone());
                let wanted = if i.pool.is_some() {
                    true
                } else {
                    i.owner.is_some()
                };
                if !wanted {
                    self.drop_instance(inst, out);
                    return;
                }
                if retryable && i.launches < self.policy.launch_attempts && !i.overdue {
                    i.state = InstState::LaunchWait;
                    let n = i.launches;
                    let at = self.now + backoff(self.policy.launch_backoff, n - 1);
                    self.arm(at, Timer::LaunchRetry(inst, n));
                    return;
                }
                let p = i.platform();
                let launches = i.launches;
                let users: Vec<Key> = i.owner.into_iter().chain(i.attached.clone()).collect();
                if users.is_empty() {
                    self.platforms[p as usize].warm_hold = self.now + WARM_HOLD;
                    let at = self.now + WARM_HOLD;
                    self.arm(at, Timer::Warm(p));
                }
                let msg = messages::launch_failed(
                    &self.platforms[p as usize].platform,
                    launches,
                    &error,
                    retryable,
                );
                for k in users {
                    self.fail(k, msg.clone(), out);
                }
                self.drop_instance(inst, out);
            }
        }
    }

    /// A launch returned an instance we already track (the cloud deduplicated a client token):
    /// keep one entry. An unowned dynamic instance goes to the TaskRun that asked; otherwise the
    /// requesters go back to the queue, first in line.
    fn launched_known(&mut self, inst: Key, other: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        let users: Vec<Key> = i.owner.into_iter().chain(i.attached.drain(..)).collect();
        let (platform, dynamic) = (i.platform(), i.pool.is_none());
        i.owner = None;
        self.drop_instance(inst, out);
        let reusable = self.instances.get(other).is_some_and(|o| {
            o.owner.is_none()
                && o.pool.is_none()
                && dynamic
                && o.platform() == platform
                && matches!(o.state, InstState::Booting | InstState::Ready)
        });
        let live = |s: &Self, k: Key| matches!(s.taskruns.get(k).map(|t| &t.state), Some(State::OnInstance { inst: x, .. }) if *x == inst);
        if reusable && users.len() == 1 && live(self, users[0]) {
            let owner = users[0];
            let o = self.instances.get_mut(other).expect("checked");
            o.owner = Some(owner);
            if o.address.is_none() && o.state == InstState::Ready {
                // Known only from a listing: probe before use.
                o.state = InstState::Booting;
            }
            let booting = o.state == InstState::Booting;
            let n = o.probes;
            if let Some(t) = self.taskruns.get_mut(owner) {
                t.state = State::OnInstance {
                    inst: other,
                    phase: Phase::Reserved,
                };
            }
            self.record_instance(owner, other, out);
            if booting {
                let now = self.now;
                self.arm(now, Timer::Probe(other, n));
            } else {
                self.start_provision(owner, other, out);
            }
            return;
        }
        // The launch's identity maps to an instance in other use: count it as failed for them,
        // so their next launch is a new attempt rather than the same answer again.
        let name = self.instances.get(other).and_then(|o| o.id().cloned());
        for k in users {
            if live(self, k) {
                if let Some(t) = self.taskruns.get_mut(k) {
                    t.extra
                        .get_or_insert_with(Box::<Extra>::default)
                        .failed
                        .push((
                            name.clone().unwrap_or_else(|| "instance".into()),
                            "the cloud returned this launch's instance, already in other use"
                                .into(),
                        ));
                }
                self.enqueue(k, true, out);
            }
        }
    }

    /// The launch found its identity's instance gone: that attempt is spent. The instance counts
    /// as failed for whoever waits on the launch (so their next launch is the next attempt); a
    /// warm launch is simply replaced.
    pub(super) fn on_launch_spent(
        &mut self,
        op: OpId,
        id: &str,
        state: InstanceState,
        out: &mut Vec<Action>,
    ) {
        let Some(inst) = self.take_launch(op) else {
            return;
        };
        // Named for the failure record only: not tracked (a gone instance needs no termination).
        self.instances.name_only(inst, id.into());
        let reason = format!(
            "an earlier try of this launch started it and it is {}",
            state.as_str()
        );
        self.instance_failed(inst, &reason, false, out);
    }

    pub(super) fn launch_retry_due(&mut self, inst: Key, n: u32, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.state != InstState::LaunchWait || i.launches != n {
            return;
        }
        if i.pool.is_none() && i.owner.is_none() {
            self.drop_instance(inst, out);
            return;
        }
        // The config may have shrunk (or changed) since this slot was reserved: relaunch only
        // within the current max-instances, otherwise give the slot up and requeue its users.
        let p = i.platform();
        let cap = match &self.platforms[p as usize].mode {
            Mode::Dynamic(t) if **t == *i.template => t.max_instances,
            Mode::Pool(pool) if pool.instance == *i.template => pool.instance.max_instances,
            _ => 0,
        };
        if self.occupied(p) > cap {
            let users: Vec<Key> = i.owner.into_iter().chain(i.attached.clone()).collect();
            if let Some(i) = self.instances.get_mut(inst) {
                i.owner = None;
                i.attached.clear();
            }
            self.drop_instance(inst, out);
            for k in users {
                if matches!(self.taskruns.get(k).map(|t| &t.state), Some(State::OnInstance { inst: x, .. }) if *x == inst)
                {
                    self.enqueue(k, true, out);
                }
            }
            return;
        }
        self.launch(inst, out);
    }

    pub(super) fn probe_due(&mut self, inst: Key, n: u32, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.state != InstState::Booting || i.probes != n || i.probe_op.is_some() {
            return;
        }
        let (Some(id), template) = (i.id().cloned(), i.template.clone()) else {
            return;
        };
        let op = self.ops.insert(Op::Probe { inst });
        self.instances.get_mut(inst).expect("resolved").probe_op = Some(op);
        out.push(Action::Probe {
            op,
            instance_id: id,
            template,
        });
    }

    pub(super) fn on_probed(&mut self, op: OpId, result: ProbeResult, out: &mut Vec<Action>) {
        let Some(Op::Probe { inst }) = self.take_op(op, |o| matches!(o, Op::Probe { .. })) else {
            return;
        };
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        if i.state != InstState::Booting || i.probe_op != Some(op) {
            return;
        }
        i.probe_op = None;
        match result {
            ProbeResult::Pending | ProbeResult::Booting { .. } => {
                let mut period = self.policy.probe_every;
                if let ProbeResult::Booting { address } = result {
                    i.address = Some(address.into());
                    period = self.policy.ssh_probe_every.or(period);
                }
                i.probes += 1;
                let every = match period {
                    Some(d) => d.min(i.template.check_interval),
                    None => i.template.check_interval,
                };
                let n = i.probes;
                let at = self.now + every;
                self.arm(at, Timer::Probe(inst, n));
            }
            ProbeResult::Reachable { address } => {
                i.address = Some(address.into());
                i.state = InstState::Ready;
                self.became_ready(inst, out);
            }
            ProbeResult::Failed { reason } if i.booted => {
                self.instance_unhealthy(inst, &reason, out);
            }
            ProbeResult::Failed { reason } => {
                self.instance_failed(inst, &reason, true, out);
            }
        }
    }

    /// The instance answers SSH: provision whoever waits for it.
    fn became_ready(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let p = i.platform();
        if i.pool.is_none() {
            let owner = i.owner.filter(|o| {
                matches!(self.taskruns.get(*o).map(|t| &t.state), Some(State::OnInstance { inst: k, phase: Phase::Reserved }) if *k == inst)
            });
            match owner {
                Some(o) => self.start_provision(o, inst, out),
                None => {
                    if !self.adopt(inst, out) {
                        self.terminate(inst, "no TaskRun needs it", out);
                    }
                }
            }
            return;
        }
        let waiting: Vec<Key> = i
            .attached
            .iter()
            .copied()
            .filter(|k| {
                matches!(self.taskruns.get(*k).map(|t| &t.state), Some(State::OnInstance { inst: x, phase: Phase::Reserved }) if *x == inst)
            })
            .collect();
        for k in waiting {
            self.start_provision(k, inst, out);
        }
        self.settle(inst, out);
        self.capacity_freed(p, out);
    }

    /// The instance will not serve: its waiting TaskRuns go back to the queue (counting a
    /// failure); it is terminated (or forgotten when already gone).
    pub(super) fn instance_failed(
        &mut self,
        inst: Key,
        reason: &str,
        terminate: bool,
        out: &mut Vec<Action>,
    ) {
        let Some(p) = self.instances.get(inst).map(|i| i.platform()) else {
            return;
        };
        let running = self.requeue_waiting(inst, reason, out);
        let name = self.instance_name(inst);
        for k in running {
            out.push(Action::Notify {
                taskrun: self.taskrun_ref(k),
                warning: true,
                reason: "InstanceLost",
                message: format!("build host {name} stopped while the build ran: {reason}"),
            });
        }
        if let Some(i) = self.instances.get_mut(inst) {
            i.owner = None;
        }
        if terminate {
            self.terminate(inst, "it failed", out);
        } else {
            self.drop_instance(inst, out);
        }
        self.capacity_freed(p, out);
    }

    /// A booted pool instance failed a probe: it takes no new work and its waiting TaskRuns go
    /// back to the queue (counting a failure), but builds running on it keep it until they
    /// finish; it is terminated once idle. Terminating it now would kill them, and one failed
    /// SSH connection does not prove it is gone (a listing or a termination seen outside tells).
    fn instance_unhealthy(&mut self, inst: Key, reason: &str, out: &mut Vec<Action>) {
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

    fn instance_name(&self, inst: Key) -> Arc<str> {
        self.instances
            .get(inst)
            .and_then(|i| i.id().cloned())
            .unwrap_or_else(|| "instance".into())
    }

    /// Takes an instance out of service: its TaskRuns not running yet go back to the queue,
    /// first in line, with the instance counted as failed for them. Returns the running ones.
    fn requeue_waiting(&mut self, inst: Key, reason: &str, out: &mut Vec<Action>) -> Vec<Key> {
        let Some(i) = self.instances.get(inst) else {
            return Vec::new();
        };
        let name = self.instance_name(inst);
        let users: Vec<Key> = i.owner.into_iter().chain(i.attached.clone()).collect();
        let pool = i.pool.is_some();
        // Out of the index first, so the requeued TaskRuns cannot land on it again.
        if let Some(i) = self.instances.get_mut(inst) {
            i.draining = true;
        }
        let mut running = Vec::new();
        for k in users {
            let Some(t) = self.taskruns.get_mut(k) else {
                continue;
            };
            let State::OnInstance { inst: on, phase } = t.state else {
                continue;
            };
            if on != inst {
                continue;
            }
            match phase {
                Phase::Reserved | Phase::Provisioning(_) => {
                    t.extra
                        .get_or_insert_with(Box::<Extra>::default)
                        .failed
                        .push((name.clone(), reason.to_owned()));
                    if pool {
                        self.detach(inst, k);
                    }
                    self.enqueue(k, true, out);
                }
                Phase::Ready(_) => running.push(k),
            }
        }
        running
    }

    pub(super) fn deadline_due(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        match i.state {
            InstState::Launching(_) => i.overdue = true,
            // A recovered pool instance with recorded allocations served builds before: they
            // may still run on it, so it only stops taking work (as a failed probe does).
            InstState::Booting if i.booted => {
                self.instance_unhealthy(inst, "not reachable within allocation-timeout", out);
            }
            InstState::LaunchWait | InstState::Booting => self.timed_out(inst, out),
            _ => {}
        }
    }

    /// Not reachable within `allocation-timeout`: a dynamic TaskRun gets an error secret (as
    /// with the Go controller); a pool instance is replaced.
    fn timed_out(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let secs = i.template.allocation_timeout.as_secs();
        if i.pool.is_some() {
            let reason = format!("not reachable over SSH within {secs} s");
            self.instance_failed(inst, &reason, true, out);
            return;
        }
        let p = i.platform();
        let owner = i.owner.filter(|o| {
            matches!(self.taskruns.get(*o).map(|t| &t.state), Some(State::OnInstance { inst: k, phase: Phase::Reserved }) if *k == inst)
        });
        let id = i.id().cloned();
        let last_error = i.last_error.clone();
        if let Some(o) = owner {
            let msg = messages::timed_out(
                &self.platforms[p as usize].platform,
                secs,
                id.as_deref(),
                last_error.as_deref(),
            );
            self.fail(o, msg, out);
        }
        if let Some(i) = self.instances.get_mut(inst) {
            i.owner = None;
        }
        self.terminate(inst, "allocation timed out", out);
    }

    pub(super) fn on_terminated(&mut self, op: OpId, error: Option<String>, out: &mut Vec<Action>) {
        let Some(Op::Terminate { inst }) = self.take_op(op, |o| matches!(o, Op::Terminate { .. }))
        else {
            return;
        };
        let Some(i) = self.instances.get_mut(inst) else {
            return;
        };
        if i.state != InstState::Terminating(op) {
            return;
        }
        let Some(error) = error else {
            self.drop_instance(inst, out);
            return;
        };
        i.terminate_attempts += 1;
        i.state = InstState::TerminateWait;
        let n = i.terminate_attempts;
        let at = self.now + backoff(self.policy.cleanup_backoff, n - 1);
        let p = i.platform();
        let id = i.id().cloned().unwrap_or_else(|| "?".into());
        // Leaked at the bound, once: it stops counting against `max-instances` (a refusal that
        // lasts must not block the platform for good) and its termination keeps being retried
        // every few minutes (the back-off's cap) until it lands or a listing shows it gone.
        let give_up = n == self.policy.cleanup_attempts.max(1) && !i.leaked();
        let waiting = if give_up { i.cleanup_for.take() } else { None };
        if give_up {
            self.instances.leak(inst);
        }
        self.arm(at, Timer::TerminateRetry(inst, n));
        if give_up {
            let ps = &self.platforms[p as usize];
            out.push(Action::Observe(super::Observation::CleanupFailed(
                ps.platform.clone(),
            )));
            out.push(Action::Notify {
                taskrun: waiting.and_then(|k| self.taskrun_ref(k)),
                warning: true,
                reason: "CleanupFailed",
                message: messages::terminate_failed(&id, &error),
            });
            out.push(Action::Notify {
                taskrun: None,
                warning: true,
                reason: "InstanceLeaked",
                message: format!(
                    "instance {id} could not be terminated after {n} attempts (last: {error}); it \
                     no longer counts against max-instances and its termination is retried every \
                     few minutes: terminate it by hand if it stays"
                ),
            });
            if let Some(k) = waiting {
                self.cleanup_done(k, out);
            }
            self.capacity_freed(p, out);
            self.ensure_warm(p, out);
        }
    }

    pub(super) fn terminate_retry_due(&mut self, inst: Key, n: u32, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.state == InstState::TerminateWait && i.terminate_attempts == n {
            self.terminate(inst, "retrying termination", out);
        }
    }

    pub(super) fn on_instance_gone(&mut self, id: &str, out: &mut Vec<Action>) {
        let Some(inst) = self.instances.find(id) else {
            return;
        };
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        match i.state {
            InstState::Terminating(_) | InstState::TerminateWait => self.drop_instance(inst, out),
            _ => self.instance_failed(
                inst,
                "the instance was terminated outside the controller",
                false,
                out,
            ),
        }
    }

    /// After a pool instance's load changed: terminate it when idle and draining, or start its
    /// idle timer.
    pub(super) fn settle(&mut self, inst: Key, out: &mut Vec<Action>) {
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

    pub(super) fn idle_due(&mut self, inst: Key, since: super::Time, out: &mut Vec<Action>) {
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

    pub(super) fn max_age_due(&mut self, inst: Key, out: &mut Vec<Action>) {
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
    fn pool_traffic(&mut self, p: PlatformId, out: &mut Vec<Action>) {
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
    pub(super) fn active_pool_instances(&self, p: PlatformId) -> u32 {
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

    /// Launches warm instances up to `min-instances`.
    pub(super) fn ensure_warm(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        if p == NO_PLATFORM || !self.started {
            return;
        }
        let Mode::Pool(pool) = self.platforms[p as usize].mode.clone() else {
            return;
        };
        if pool.min_instances == 0 || self.now < self.platforms[p as usize].warm_hold {
            return;
        }
        let mut active = self.active_pool_instances(p);
        while active < pool.min_instances && self.occupied(p) < pool.instance.max_instances {
            let deadline = self.now + pool.instance.allocation_timeout;
            let inst = self.new_instance(p, Arc::new(pool.instance.clone()), Some(pool.clone()));
            self.arm(deadline, Timer::Deadline(inst));
            self.launch(inst, out);
            active += 1;
        }
    }
}
