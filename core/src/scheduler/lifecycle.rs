//! TaskRun events and timers: a TaskRun seen, done or released; provisioning and removal
//! results; a refused secret; a Tekton retry's new attempt and its re-provisioning. Routing,
//! queueing and placement are `handoff`'s; what is written out is `emit`'s.

use super::handoff::Placed;
use super::view::backoff;
use std::sync::Arc;

use super::arena::Key;
use super::ledger::Token;
use super::{
    Action, Blame, Extra, HostId, HostRef, Mode, NO_PLATFORM, Observation, Op, OpId, Phase,
    PlatformId, Release, RemoteUser, Scheduler, SecretData, State, StaticHost, TaskRun, TaskRunRef,
    TaskRunSpec, Timer, messages,
};
use crate::platform::Platform;

impl Scheduler {
    pub(in crate::scheduler) fn on_taskrun(&mut self, spec: TaskRunSpec, out: &mut Vec<Action>) {
        let uid = spec.uid();
        if self.taskruns.finished(&uid) {
            return;
        }
        if let Some(key) = self.taskruns.find(&uid) {
            let Some(t) = self.taskruns.get_mut(key) else {
                return;
            };
            if !spec.gated {
                t.gated = false;
            }
            if matches!(t.state, State::Cleanup { .. })
                && t.platform != NO_PLATFORM
                && let Some(e) = t.extra.as_mut().filter(|e| e.release != Release::No)
            {
                // Released, and needing a host after all: served once the cleanup is over.
                e.release = Release::Revived;
                return;
            }
            if spec.retries > t.retries {
                t.retries = spec.retries;
                self.new_attempt(key, out);
            }
            return;
        }
        let ns = self.taskruns.intern_ns(&spec.namespace);
        let parsed = Platform::parse(&spec.platform);
        let platform = match &parsed {
            Ok(p) => self.platform_id(p),
            Err(_) => NO_PLATFORM,
        };
        let mut t = TaskRun::new(
            uid,
            TaskRunRef::path_of(&spec.namespace, &spec.name),
            ns,
            platform,
            spec.since,
        );
        t.retries = spec.retries;
        t.gated = spec.gated;
        t.queued = self.now.max(spec.since);
        let key = self.taskruns.insert(t);
        match parsed {
            Err(e) => {
                let msg = messages::bad_platform(&spec.platform, &e.to_string());
                self.fail(key, msg, out);
            }
            Ok(_) => self.admit(key, false, out),
        }
    }

    pub(in crate::scheduler) fn requeue_due(
        &mut self,
        key: Key,
        ticket: u32,
        out: &mut Vec<Action>,
    ) {
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
        if !matches!(t.state, State::Waiting { ticket: tk, .. } if tk == ticket) {
            return;
        }
        let p = t.platform;
        if self.place(p, key, out) == Placed::NoRoom
            && let super::Handoff::Poll { requeue } = self.policy.handoff
        {
            let at = self.now + requeue;
            self.timers.arm(at, Timer::Requeue(key, ticket));
        }
    }

    /// The API server refused a secret ([`Event::SecretRefused`](super::Event::SecretRefused)):
    /// written again after a back-off; after [`Policy::secret_attempts`](super::Policy) refusals
    /// the host is freed and the TaskRun gets an error secret (one try: a refused error secret
    /// leaves the Warning Event as the only word to the user).
    pub(in crate::scheduler) fn on_secret_refused(
        &mut self,
        taskrun: &TaskRunRef,
        secret: SecretData,
        error: &str,
        out: &mut Vec<Action>,
    ) {
        let Some(key) = self.taskruns.find(taskrun.uid()) else {
            return;
        };
        if !self.secret_current(key, &secret) {
            // Written for an earlier state: nothing of it is served any more.
            return;
        }
        let (attempts, base) = (self.policy.secret_attempts, self.policy.secret_backoff);
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        let e = t.extra.get_or_insert_with(Box::<Extra>::default);
        e.secret_refusals += 1;
        let n = e.secret_refusals;
        let name = taskrun.secret_name();
        if n < attempts {
            e.refused_secret = Some(secret);
            let at = self.now + backoff(base, n - 1);
            self.timers.arm(at, Timer::SecretRetry(key, n));
            if n == 1 {
                out.push(Action::Notify {
                    taskrun: Some(taskrun.clone()),
                    warning: true,
                    reason: "SecretRefused",
                    message: format!(
                        "the API server refused the Secret {name}: {error}; trying again"
                    ),
                });
            }
            return;
        }
        e.refused_secret = None;
        if let SecretData::Error(_) = secret {
            out.push(Action::Notify {
                taskrun: Some(taskrun.clone()),
                warning: true,
                reason: "SecretRefused",
                message: format!(
                    "the API server refused the error Secret {name} too: {error}; the TaskRun \
                     cannot get a build host until it can write Secrets in its namespace"
                ),
            });
            return;
        }
        self.give_up_placement(key, out);
        let message = format!(
            "the API server refused the Secret {name} {n} times (last: {error}); the build host \
             was freed. Check the namespace's Secret quota and admission policies, then re-run."
        );
        self.fail(key, message, out);
    }

    /// Whether `secret` is what the TaskRun's current state was served.
    pub(in crate::scheduler) fn secret_current(&self, key: Key, secret: &SecretData) -> bool {
        let Some(t) = self.taskruns.get(key) else {
            return false;
        };
        match (secret, &t.state) {
            (
                SecretData::Remote { host, .. },
                State::OnHost {
                    host: hid,
                    phase: Phase::Ready(_),
                    ..
                },
            ) => *self.hosts[*hid].name == *host.name(),
            (
                SecretData::Remote { host, .. },
                State::OnInstance {
                    inst,
                    phase: Phase::Ready(_),
                },
            ) => self.instances.get(*inst).and_then(|i| i.id().map(|s| &**s)) == Some(host.name()),
            (SecretData::Localhost, State::Local) | (SecretData::Error(_), State::Failed) => true,
            _ => false,
        }
    }

    /// Writes a refused secret again, unless something newer was written meanwhile.
    pub(in crate::scheduler) fn secret_retry_due(
        &mut self,
        key: Key,
        n: u32,
        out: &mut Vec<Action>,
    ) {
        let Some(e) = self.taskruns.get_mut(key).and_then(|t| t.extra.as_mut()) else {
            return;
        };
        if e.secret_refusals != n {
            return;
        }
        let Some(secret) = e.refused_secret.take() else {
            return;
        };
        if !self.secret_current(key, &secret) {
            return;
        }
        if let Some(taskrun) = self.taskrun_ref(key) {
            out.push(Action::WriteSecret { taskrun, secret });
        }
    }

    /// Frees what the TaskRun holds without finishing it (nothing waits for the cleanup).
    pub(in crate::scheduler) fn give_up_placement(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
        let p = t.platform;
        match &t.state {
            State::OnHost { host, def, .. } => {
                let (host, def) = (*host, def.clone());
                // Off the host now, so the slot is handed on below; its error secret follows.
                self.set_state(key, State::Failed);
                if let (Some(def), Some(r)) = (
                    def.or_else(|| self.hosts[host].def.clone()),
                    self.taskrun_ref(key),
                ) {
                    self.deprovision(None, p, RemoteUser::Of(r), HostRef::Static(def), out);
                }
                self.capacity_freed(p, out);
            }
            State::OnInstance { inst, .. } => {
                let inst = *inst;
                self.give_up_instance(key, inst, out);
            }
            _ => {}
        }
    }

    /// Tekton started another attempt: the previous key was consumed, so hand out a fresh one.
    pub(in crate::scheduler) fn new_attempt(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        match &t.state {
            // A malformed PLATFORM param stays malformed: the error secret stands.
            State::Failed if t.platform == NO_PLATFORM => {}
            State::Failed => {
                // A new attempt gets a new chance (the error may have been transient).
                t.extra = None;
                self.delete_secret(key, out);
                self.admit(key, false, out);
            }
            State::OnHost {
                host,
                def,
                phase: Phase::Ready(_),
            } => {
                let host = *host;
                let def = def.clone();
                // The retry's pod already mounted the secret: keep it, re-arm its token (unless
                // the token is not one our key server issued).
                t.token.new_attempt();
                let def = def.or_else(|| self.hosts[host].def.clone());
                self.rearm_on_host(key, host, def, "the host is no longer configured", out);
            }
            State::OnInstance {
                inst,
                phase: Phase::Ready(_),
            } => {
                let inst = *inst;
                t.token.new_attempt();
                self.reprovision_on_instance(key, inst, out);
            }
            // Nothing handed out yet (or nothing to hand out): the next secret is fresh anyway.
            _ => {}
        }
    }

    /// Tries a retry's failed re-provisioning on its host again (see
    /// [`Policy::rearm_attempts`](super::Policy::rearm_attempts)).
    pub(in crate::scheduler) fn rearm_due(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
        let State::OnHost {
            host,
            phase: Phase::Reserved,
            ..
        } = t.state
        else {
            return;
        };
        if t.token != Token::Rearm {
            return;
        }
        // As configured now: a host removed, given to another platform, drained or shrunk below
        // its load meanwhile takes no new user, not even this one.
        let platform = &self.platforms[t.platform as usize].platform;
        let h = &self.hosts[host];
        let def = h
            .def
            .clone()
            .filter(|d| d.platform == **platform && h.load() <= d.capacity());
        self.rearm_on_host(key, host, def, "the host can no longer take it", out);
    }

    /// Provisions a retry attempt on its static host again, re-arming the token its pod mounted;
    /// with no `def` (the host cannot take it, `why`) it goes elsewhere, and the secret naming
    /// this host goes first (the next host's provisioning writes a new one).
    pub(in crate::scheduler) fn rearm_on_host(
        &mut self,
        key: Key,
        host: HostId,
        def: Option<Arc<StaticHost>>,
        why: &str,
        out: &mut Vec<Action>,
    ) {
        let Some(def) = def else {
            let name = self.hosts[host].name.clone();
            let Some(t) = self.taskruns.get_mut(key) else {
                return;
            };
            t.token.consume_rearm();
            t.extra
                .get_or_insert_with(Box::<Extra>::default)
                .failed
                .push((name, why.to_owned()));
            let p = t.platform;
            self.delete_secret(key, out);
            // Requeued: it leaves the host (and its load) as it starts waiting.
            self.enqueue(key, true, out);
            self.capacity_freed(p, out);
            return;
        };
        let target = HostRef::Static(def.clone());
        let op = self.provision_op(key, &target);
        self.set_state(
            key,
            State::OnHost {
                host,
                def: Some(def),
                phase: Phase::Provisioning(op),
            },
        );
        self.emit_provision(key, op, target, None, out);
    }

    pub(in crate::scheduler) fn on_provisioned(
        &mut self,
        op: OpId,
        result: Result<String, (String, Blame)>,
        out: &mut Vec<Action>,
    ) {
        let Some(Op::Provision {
            tr,
            host,
            compensate,
            rearm,
        }) = self.take_op(op, |o| matches!(o, Op::Provision { .. }))
        else {
            return;
        };
        if compensate {
            // The TaskRun went away while its user was being created: remove the user.
            let p = self.taskruns.get(tr).map_or(NO_PLATFORM, |t| t.platform);
            if let Some(r) = self.taskrun_ref(tr) {
                self.deprovision(Some(tr), p, RemoteUser::Of(r), host, out);
            }
            return;
        }
        let Some(t) = self.taskruns.get(tr) else {
            return;
        };
        let current = match &t.state {
            State::OnHost { phase, .. } | State::OnInstance { phase, .. } => {
                *phase == Phase::Provisioning(op)
            }
            _ => false,
        };
        if !current {
            return;
        }
        let p = t.platform;
        let platform = self.platforms[p as usize].platform.clone();
        match result {
            Ok(otp) => {
                let since = t.since;
                self.set_phase(tr, Phase::Ready(self.now));
                self.provision_ok_on(tr, out);
                self.write_secret(tr, SecretData::Remote { otp, host }, out);
                out.push(Action::Observe(Observation::ProvisionSucceeded(
                    platform.clone(),
                )));
                out.push(Action::Observe(Observation::Served {
                    platform,
                    took: self.now.since(since),
                }));
            }
            Err((error, blame)) => {
                // Only the host's own failures count against its health; the TaskRun is retried
                // the same way whoever is at fault.
                let host_at_fault = blame == Blame::Host;
                out.push(Action::Observe(Observation::ProvisionFailed(platform)));
                let name: Arc<str> = host.name().into();
                if let Some(r) = self.taskrun_ref(tr) {
                    out.push(Action::Notify {
                        taskrun: Some(r),
                        warning: true,
                        reason: "ProvisioningFailed",
                        message: format!("provisioning on {name} failed: {error}; trying again"),
                    });
                }
                let t = self.taskruns.get_mut(tr).expect("checked above");
                let failed = &mut t.extra.get_or_insert_with(Box::<Extra>::default).failed;
                failed.push((name.clone(), error));
                let tries = failed.iter().filter(|(n, _)| *n == name).count() as u32;
                if rearm {
                    if let State::OnHost { host: hid, .. } = &t.state
                        && tries < self.policy.rearm_attempts
                    {
                        // Keep the slot; the same host again shortly (the pod is pointed at it).
                        let hid = *hid;
                        t.token = Token::Rearm;
                        self.set_phase(tr, Phase::Reserved);
                        if host_at_fault {
                            self.host_failed(hid, out);
                        }
                        let at = self.now + backoff(self.policy.rearm_backoff, tries - 1);
                        self.timers.arm(at, Timer::Rearm(tr));
                        return;
                    }
                    // Moving on: the secret the pod was given names this host, which no longer
                    // has its user; the next host's provisioning writes a new one.
                    self.delete_secret(tr, out);
                }
                let t = self.taskruns.get_mut(tr).expect("checked above");
                match t.state {
                    State::OnHost { host: hid, .. } => {
                        let r = self.taskrun_ref(tr).expect("live");
                        self.deprovision(None, p, RemoteUser::Of(r), host, out);
                        if host_at_fault {
                            self.host_failed(hid, out);
                        }
                        // Requeued: it leaves the host (and its load) as it starts waiting.
                        self.enqueue(tr, true, out);
                        self.capacity_freed(p, out);
                    }
                    State::OnInstance { inst, .. } => {
                        self.provision_failed_on_instance(tr, inst, host, out);
                    }
                    _ => {}
                }
            }
        }
    }

    pub(in crate::scheduler) fn on_deprovisioned(
        &mut self,
        op: OpId,
        error: Option<String>,
        out: &mut Vec<Action>,
    ) {
        let Some(Op::Deprovision {
            tr,
            platform,
            user,
            host,
            attempt,
        }) = self.take_op(op, |o| matches!(o, Op::Deprovision { .. }))
        else {
            return;
        };
        // A machine whose termination was acknowledged took its users with it: a removal that
        // failed there (the host stopped answering) has nothing left to do.
        let went_with_its_machine =
            matches!(&host, HostRef::Instance { id, .. } if self.instances.was_terminated(id));
        if let Some(error) = error.filter(|_| !went_with_its_machine) {
            if attempt + 1 < self.policy.cleanup_attempts {
                let at = self.now + backoff(self.policy.cleanup_backoff, attempt);
                self.timers.delay(
                    at,
                    Op::Deprovision {
                        tr,
                        platform,
                        user,
                        host,
                        attempt: attempt + 1,
                    },
                );
                return;
            }
            if platform != NO_PLATFORM {
                out.push(Action::Observe(Observation::CleanupFailed(
                    self.platforms[platform as usize].platform.clone(),
                )));
            }
            out.push(Action::Notify {
                taskrun: tr.and_then(|k| self.taskrun_ref(k)),
                warning: true,
                reason: "CleanupFailed",
                message: messages::cleanup_failed(&user.name(), host.name(), &error),
            });
        }
        // Given up or done: a same-named TaskRun may go there (a user left behind after the
        // last attempt is the host sweep's to remove).
        self.cleaning_finished(&user.name(), host.name(), platform, out);
        if let Some(tr) = tr {
            self.cleanup_done(tr, out);
        }
    }

    /// The TaskRun finished (or was deleted), or, when `released`, needs no host after all
    /// ([`Event::TaskRunReleased`](super::Event::TaskRunReleased)).
    pub(in crate::scheduler) fn on_done(
        &mut self,
        taskrun: &TaskRunRef,
        released: bool,
        out: &mut Vec<Action>,
    ) {
        let uid = taskrun.uid();
        let Some(key) = self.taskruns.find(uid) else {
            if self.taskruns.finished(uid) {
                return;
            }
            // Never seen (finished before we caught up, or released before it was decided):
            // nothing allocated, just let it go.
            out.push(Action::DeleteSecret {
                taskrun: taskrun.clone(),
            });
            out.push(Action::RemoveFinalizer {
                taskrun: taskrun.clone(),
                revoke: !released,
            });
            if !released {
                self.taskruns.bury(uid);
            }
            return;
        };
        self.observe_finished(key, out);
        let t = self.taskruns.get_mut(key).expect("indexed TaskRuns exist");
        let p = t.platform;
        if let State::Cleanup { .. } = t.state {
            if let Some(e) = t.extra.as_mut() {
                if released {
                    // Released again: whatever revived it no longer holds.
                    if e.release == Release::Revived {
                        e.release = Release::Released;
                    }
                } else {
                    // Finished while a release was being cleaned up: it is over for good.
                    e.release = Release::No;
                }
            }
            // Keep waiting for what is pending.
            return;
        }
        if released {
            let e = t.extra.get_or_insert_with(Box::default);
            if e.release == Release::No {
                e.release = Release::Released;
            }
        }
        // Off its host or instance as it enters cleanup (what it leaves there follows below).
        let state = self
            .set_state(key, State::Cleanup { pending: 0 })
            .expect("indexed TaskRuns exist");
        let pending = match state {
            State::Cleanup { pending } => {
                // Handled above; kept whole.
                self.set_state(key, State::Cleanup { pending });
                return;
            }
            State::Waiting { .. } => 0,
            State::Local | State::Failed => {
                self.delete_secret(key, out);
                0
            }
            State::OnHost { host, def, phase } => {
                let pending = match phase {
                    // Reserved on a host is a retry's re-provisioning waiting to try again: the
                    // first attempt's user is still there, so it is removed as after a build.
                    Phase::Ready(_) | Phase::Reserved => {
                        if let Phase::Ready(at) = phase {
                            self.observe_ran(p, at, out);
                        }
                        self.delete_secret(key, out);
                        let r = self.taskrun_ref(key).expect("live");
                        match def.or_else(|| self.hosts[host].def.clone()) {
                            Some(def) => {
                                self.deprovision(
                                    Some(key),
                                    p,
                                    RemoteUser::Of(r),
                                    HostRef::Static(def),
                                    out,
                                );
                                1
                            }
                            None => {
                                // No address or credentials: the host sweep cleans up if it returns.
                                let host = self.hosts[host].name.clone();
                                out.push(Action::Notify {
                                    taskrun: Some(r.clone()),
                                    warning: true,
                                    reason: "CleanupFailed",
                                    message: messages::cleanup_failed(
                                        &r.remote_user(),
                                        &host,
                                        "the host is no longer in the host-config",
                                    ),
                                });
                                0
                            }
                        }
                    }
                    Phase::Provisioning(op) => {
                        // A retry's re-provisioning: the first attempt's secret stands.
                        self.delete_secret(key, out);
                        if let Some(Op::Provision { compensate, .. }) = self.ops.get_mut(op) {
                            *compensate = true;
                            1
                        } else {
                            0
                        }
                    }
                };
                // Before the freed slot is handed out: a TaskRun with the same user name must
                // see this one's cleanup as pending (see `user_blocked`).
                self.set_cleanup_pending(key, pending);
                self.capacity_freed(p, out);
                pending
            }
            State::OnInstance { inst, phase } => self.leave_instance(key, inst, phase, out),
        };
        self.set_cleanup_pending(key, pending);
        let waits = self.taskruns.get(key).map(|t| &t.state);
        if matches!(waits, Some(State::Cleanup { pending: 0 })) {
            self.finalize(key, out);
        }
    }

    /// A TaskRun finished: Go's `task_run_time` counts those it finalizes (given a host, an
    /// instance, `localhost` or an error secret), from their creation. A duplicate report finds
    /// it in cleanup and counts nothing.
    pub(in crate::scheduler) fn observe_finished(&self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
        let served = matches!(
            t.state,
            State::OnHost { .. } | State::OnInstance { .. } | State::Local | State::Failed
        );
        let p = t.platform;
        if !served || p == NO_PLATFORM || self.platforms[p as usize].mode == Mode::Unknown {
            return;
        }
        out.push(Action::Observe(Observation::Ran {
            platform: self.platforms[p as usize].platform.clone(),
            took: self.now.since(t.since),
        }));
    }

    /// A removal of `user` on `host` finished (done or given up); TaskRuns with that user name
    /// of platform `p` may go there now.
    pub(in crate::scheduler) fn cleaning_finished(
        &mut self,
        user: &str,
        host: &str,
        p: PlatformId,
        out: &mut Vec<Action>,
    ) {
        if let Some(hosts) = self.cleaning.get_mut(user) {
            if let Some(i) = hosts.iter().position(|h| &**h == host) {
                hosts.swap_remove(i);
            }
            if hosts.is_empty() {
                self.cleaning.remove(user);
            }
        }
        if p != NO_PLATFORM {
            self.pump(p, out);
        }
    }
}
