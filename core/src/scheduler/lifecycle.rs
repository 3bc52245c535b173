//! TaskRun lifecycle: admission, queueing, hand-off, provisioning results, completion, retries,
//! error secrets and finalizers. Strategy-specific placement lives in `hosts` and `fleet`.

use std::sync::Arc;

use super::arena::Key;
use super::ledger::{Labels, Token};
use super::queue::Entry;
use super::{
    Action, Blame, Extra, HostId, HostRef, Mode, NO_PLATFORM, Observation, Op, OpId, Phase,
    Placement, PlatformId, Release, RemoteUser, Scheduler, SecretData, State, StaticHost, TaskRun,
    TaskRunRef, TaskRunSpec, Timer, Uid, messages,
};
use crate::platform::Platform;

/// Outcome of trying to place a waiter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Placed {
    /// Placed (or routed to a terminal state: local, error).
    Done,
    /// No room now; keep waiting.
    NoRoom,
}

impl Scheduler {
    pub(super) fn on_taskrun(&mut self, spec: TaskRunSpec, out: &mut Vec<Action>) {
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

    /// Routes a TaskRun that needs a host by its platform's current mode.
    pub(super) fn admit(&mut self, key: Key, retry: bool, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
        let p = t.platform;
        if p == NO_PLATFORM {
            return;
        }
        match self.platforms[p as usize].mode.clone() {
            Mode::Local => {
                let Some(t) = self.taskruns.get_mut(key) else {
                    return;
                };
                t.state = State::Local;
                // As the Go controller does: `assigned-host=localhost` once the secret exists.
                // But labels of an earlier placement (waiting, or a host) go first: a crash
                // between the two writes must not leave a secret under a waiting label, which
                // recovery reads no secret for (it would serve the TaskRun again).
                let relabel_first = t.labels.write();
                let record = self.taskrun_ref(key).map(|taskrun| Action::Record {
                    taskrun,
                    placement: Placement {
                        assigned_host: Some(crate::contract::LOCALHOST.into()),
                        ..Placement::default()
                    },
                });
                if relabel_first {
                    out.extend(record.clone());
                }
                self.write_secret(key, SecretData::Localhost, out);
                if !relabel_first {
                    out.extend(record);
                }
            }
            Mode::Disabled(reason) => {
                let msg = messages::disabled(&self.platforms[p as usize].platform, &reason);
                self.fail(key, msg, out);
            }
            Mode::Unknown => {
                let msg =
                    messages::unknown_platform(&self.platforms[p as usize].platform, &self.config);
                self.fail(key, msg, out);
            }
            Mode::Static | Mode::Dynamic(_) | Mode::Pool(_) => self.enqueue(key, retry, out),
        }
    }

    /// Queues a TaskRun and serves the platform. Marks it waiting only when it could not be
    /// placed at once.
    pub(super) fn enqueue(&mut self, key: Key, retry: bool, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        let p = t.platform;
        if retry && self.hopeless(p, key, out) {
            return;
        }
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        let ticket = self.next_ticket;
        self.next_ticket = self.next_ticket.wrapping_add(1);
        t.state = State::Waiting { ticket, retry };
        t.queued = self.now;
        let ns = t.ns;
        let mut ahead = 0;
        match self.policy.handoff {
            super::Handoff::Immediate => {
                if retry {
                    self.platforms[p as usize].retry.push(key);
                } else {
                    ahead = self.platforms[p as usize].queue.push(
                        ns,
                        Entry {
                            taskrun: key,
                            ticket,
                        },
                    );
                }
                self.pump(p, out);
            }
            super::Handoff::Poll { requeue } => {
                // A TaskRun that finds room takes it, whoever waits (Go behaviour).
                if self.place(p, key, out) == Placed::NoRoom {
                    if !retry {
                        ahead = self.platforms[p as usize].queue.push(
                            ns,
                            Entry {
                                taskrun: key,
                                ticket,
                            },
                        );
                    }
                    let at = self.now + requeue;
                    self.arm(at, Timer::Requeue(key, ticket));
                }
            }
        }
        if self.is_waiting(key) {
            self.mark_waiting(key, ahead, out);
        }
    }

    /// A waiter that already failed everywhere it may go gets its error secret now rather than
    /// when room appears.
    fn hopeless(&mut self, p: PlatformId, key: Key, out: &mut Vec<Action>) -> bool {
        match self.platforms[p as usize].mode {
            Mode::Static => self.fail_if_all_hosts_failed(p, key, out),
            Mode::Dynamic(_) | Mode::Pool(_) => {
                let exhausted = self.failures(key) >= self.policy.instance_attempts;
                if exhausted {
                    self.fail_instances(key, p, out);
                }
                exhausted
            }
            _ => false,
        }
    }

    fn mark_waiting(&mut self, key: Key, ahead: usize, out: &mut Vec<Action>) {
        let (Some(taskrun), Some(t)) = (self.taskrun_ref(key), self.taskruns.get(key)) else {
            return;
        };
        if t.labels == Labels::Announced {
            // A new leader re-admitting what the last one queued: the label and the Event
            // stand (without this, a failover re-sent both for every waiter: 20,000 actions
            // for 10,000 waiters, the largest part of the recovery's memory peak).
            if let Some(t) = self.taskruns.get_mut(key) {
                t.labels.settle();
            }
            return;
        }
        let ps = &self.platforms[t.platform as usize];
        let label = ps.label.clone();
        let message = messages::waiting(&ps.platform, ahead);
        let failed = failed_hosts(t);
        if let Some(t) = self.taskruns.get_mut(key) {
            // The waiting label is a placement too: an error secret must clear it, or a
            // restart (which reads no secret of a TaskRun labelled waiting) serves it again.
            t.labels.write();
        }
        out.push(Action::Record {
            taskrun: taskrun.clone(),
            placement: Placement {
                waiting_for_platform: Some(label),
                failed_hosts: failed,
                ..Placement::default()
            },
        });
        out.push(Action::Notify {
            taskrun: Some(taskrun),
            warning: false,
            reason: "WaitingForHost",
            message,
        });
    }

    pub(super) fn is_waiting(&self, key: Key) -> bool {
        matches!(
            self.taskruns.get(key).map(|t| &t.state),
            Some(State::Waiting { .. })
        )
    }

    /// Serves waiters while the platform has room (immediate hand-off only).
    pub(super) fn pump(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        if self.policy.handoff != super::Handoff::Immediate || p == NO_PLATFORM {
            return;
        }
        // Waiters that failed somewhere first: they have waited longest.
        let mut i = 0;
        while i < self.platforms[p as usize].retry.len() && self.has_room(p) {
            let key = self.platforms[p as usize].retry[i];
            let live = matches!(
                self.taskruns.get(key).map(|t| &t.state),
                Some(State::Waiting { retry: true, .. })
            ) && self.taskruns.get(key).map(|t| t.platform) == Some(p);
            if !live || self.place(p, key, out) == Placed::Done {
                self.platforms[p as usize].retry.remove(i);
            } else {
                i += 1;
            }
        }
        let mut kept = 0;
        while self.has_room(p) {
            let Some(entry) = self.pop_waiter(p) else {
                break;
            };
            if self.place(p, entry.taskrun, out) == Placed::NoRoom {
                // Every host with room holds a TaskRun with its build user's name: keep it
                // served first, and serve the next waiter.
                if let Some(State::Waiting { retry, .. }) =
                    self.taskruns.get_mut(entry.taskrun).map(|t| &mut t.state)
                {
                    *retry = true;
                }
                self.platforms[p as usize].retry.insert(kept, entry.taskrun);
                kept += 1;
            }
        }
    }

    /// Next live waiter of the fair queue.
    pub(super) fn pop_waiter(&mut self, p: PlatformId) -> Option<Entry> {
        let taskruns = &self.taskruns;
        self.platforms[p as usize].queue.pop(|e| {
            matches!(
                taskruns.get(e.taskrun).map(|t| (&t.state, t.platform)),
                Some((State::Waiting { ticket, retry: false }, tp)) if *ticket == e.ticket && tp == p
            )
        })
    }

    /// Capacity of `p` was freed: hand it over now, or (polling) wake one waiter.
    pub(super) fn capacity_freed(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        if p == NO_PLATFORM {
            return;
        }
        match self.policy.handoff {
            super::Handoff::Immediate => self.pump(p, out),
            super::Handoff::Poll { .. } => {
                if self.has_room(p)
                    && let Some(entry) = self.pop_waiter(p)
                {
                    let _ = self.place(p, entry.taskrun, out);
                }
            }
        }
    }

    pub(super) fn requeue_due(&mut self, key: Key, ticket: u32, out: &mut Vec<Action>) {
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
            self.arm(at, Timer::Requeue(key, ticket));
        }
    }

    /// True when a waiter without failures could be placed now.
    pub(super) fn has_room(&mut self, p: PlatformId) -> bool {
        self.instances.flush();
        let ps = &self.platforms[p as usize];
        match &ps.mode {
            Mode::Static => self.hosts.has_room(p),
            Mode::Dynamic(t) => self.occupied(p) < t.max_instances,
            Mode::Pool(pool) => {
                let (ready, booting) = self.instances.with_room(p);
                !ready.is_empty()
                    || !booting.is_empty()
                    || self.occupied(p) < pool.instance.max_instances
            }
            // Waiters of these are routed (secret written) by placement.
            Mode::Local | Mode::Disabled(_) | Mode::Unknown => true,
        }
    }

    /// Tries to place one waiter by the platform's current mode.
    pub(super) fn place(&mut self, p: PlatformId, key: Key, out: &mut Vec<Action>) -> Placed {
        match self.platforms[p as usize].mode.clone() {
            Mode::Static => self.place_static(p, key, out),
            Mode::Dynamic(template) => self.place_dynamic(p, key, template, out),
            Mode::Pool(pool) => self.place_pool(p, key, pool, out),
            Mode::Local | Mode::Disabled(_) | Mode::Unknown => {
                self.admit(key, false, out);
                Placed::Done
            }
        }
    }

    /// Time spent queued, observed when a waiter leaves the queue for a placement. From here on
    /// `queued` is when the allocation started (see [`Scheduler::observe_allocated`]).
    pub(super) fn observe_wait(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(taskrun) = self.taskrun_ref(key) else {
            return;
        };
        let now = self.now;
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        // Joined the queue before this instant: it was labelled waiting (the label is written
        // when a TaskRun that joined the queue could not be placed at once).
        let labelled = t.queued < now;
        let (queued, since) = (t.queued, t.since);
        t.queued = now;
        out.push(Action::Observe(Observation::Waited {
            platform: self.platforms[t.platform as usize].platform.clone(),
            wait: now.since(queued),
            waited: labelled.then(|| now.since(since)),
            taskrun,
        }));
    }

    /// The host of a new placement is reachable and provisioning is asked for: the allocation
    /// took from its start (leaving the queue, or `launched` when the instance was launched
    /// later) to now.
    pub(super) fn observe_allocated(
        &self,
        key: Key,
        launched: Option<super::Time>,
        out: &mut Vec<Action>,
    ) {
        if let Some(t) = self.taskruns.get(key) {
            let start = launched.map_or(t.queued, |l| l.max(t.queued));
            out.push(Action::Observe(Observation::Allocated {
                platform: self.platforms[t.platform as usize].platform.clone(),
                took: self.now.since(start),
            }));
        }
    }

    /// Writes the error secret; the TaskRun then runs and fails with the message.
    pub(super) fn fail(&mut self, key: Key, message: String, out: &mut Vec<Action>) {
        self.clear_placement(key, out);
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        t.state = State::Failed;
        let p = t.platform;
        if p != NO_PLATFORM && self.platforms[p as usize].mode != Mode::Unknown {
            out.push(Action::Observe(Observation::AllocationFailed(
                self.platforms[p as usize].platform.clone(),
            )));
        }
        if let Some(r) = self.taskrun_ref(key) {
            out.push(Action::Notify {
                taskrun: Some(r),
                warning: true,
                reason: "AllocationFailed",
                message: message.clone(),
            });
        }
        self.write_secret(key, SecretData::Error(message), out);
    }

    /// Clears allocation labels left from an earlier placement (keeping `failed-hosts`).
    pub(super) fn clear_placement(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        if !t.labels.clear() {
            return;
        }
        let failed = failed_hosts(t);
        if let Some(taskrun) = self.taskrun_ref(key) {
            out.push(Action::Record {
                taskrun,
                placement: Placement {
                    failed_hosts: failed,
                    ..Placement::default()
                },
            });
        }
    }

    /// Writes the secret and un-gates the TaskRun.
    pub(super) fn write_secret(&mut self, key: Key, secret: SecretData, out: &mut Vec<Action>) {
        let Some(taskrun) = self.taskrun_ref(key) else {
            return;
        };
        let gated = self.taskruns.get_mut(key).is_some_and(|t| {
            t.token.written();
            if let Some(e) = t.extra.as_mut() {
                // Superseded: a refused earlier secret is not written again.
                e.refused_secret = None;
            }
            std::mem::take(&mut t.gated)
        });
        if gated {
            out.push(Action::WriteSecret {
                taskrun: taskrun.clone(),
                secret,
            });
            out.push(Action::Ungate { taskrun });
        } else {
            out.push(Action::WriteSecret { taskrun, secret });
        }
    }

    /// The API server refused a secret ([`Event::SecretRefused`](super::Event::SecretRefused)):
    /// written again after a back-off; after [`Policy::secret_attempts`](super::Policy) refusals
    /// the host is freed and the TaskRun gets an error secret (one try: a refused error secret
    /// leaves the Warning Event as the only word to the user).
    pub(super) fn on_secret_refused(
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
            self.arm(at, Timer::SecretRetry(key, n));
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
    fn secret_current(&self, key: Key, secret: &SecretData) -> bool {
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
    pub(super) fn secret_retry_due(&mut self, key: Key, n: u32, out: &mut Vec<Action>) {
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
    fn give_up_placement(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
        let p = t.platform;
        match &t.state {
            State::OnHost { host, def, .. } => {
                let (host, def) = (*host, def.clone());
                self.hosts.release(host);
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
    fn new_attempt(&mut self, key: Key, out: &mut Vec<Action>) {
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
    pub(super) fn rearm_due(&mut self, key: Key, out: &mut Vec<Action>) {
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
        // As configured now: a host removed, given to another platform or shrunk below its
        // load meanwhile takes no new user, not even this one.
        let platform = &self.platforms[t.platform as usize].platform;
        let h = &self.hosts[host];
        let def = h
            .def
            .clone()
            .filter(|d| d.platform == **platform && h.load() <= d.concurrency);
        self.rearm_on_host(key, host, def, "the host can no longer take it", out);
    }

    /// Provisions a retry attempt on its static host again, re-arming the token its pod mounted;
    /// with no `def` (the host cannot take it, `why`) it goes elsewhere, and the secret naming
    /// this host goes first (the next host's provisioning writes a new one).
    fn rearm_on_host(
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
            self.hosts.release(host);
            self.enqueue(key, true, out);
            self.capacity_freed(p, out);
            return;
        };
        let target = HostRef::Static(def.clone());
        let op = self.provision_op(key, &target);
        if let Some(t) = self.taskruns.get_mut(key) {
            t.state = State::OnHost {
                host,
                def: Some(def),
                phase: Phase::Provisioning(op),
            };
        }
        self.emit_provision(key, op, target, None, out);
    }

    pub(super) fn delete_secret(&mut self, key: Key, out: &mut Vec<Action>) {
        if let Some(taskrun) = self.taskrun_ref(key) {
            out.push(Action::DeleteSecret { taskrun });
        }
    }

    /// Records the placement and asks for provisioning under `op` (from
    /// [`Scheduler::provision_op`]).
    pub(super) fn emit_provision(
        &mut self,
        key: Key,
        op: OpId,
        host: HostRef,
        instance_annotations: Option<(Arc<str>, Arc<str>)>,
        out: &mut Vec<Action>,
    ) {
        let Some(taskrun) = self.taskrun_ref(key) else {
            self.ops.remove(op);
            return;
        };
        let failed = self.taskruns.get(key).and_then(failed_hosts);
        if let Some(t) = self.taskruns.get_mut(key) {
            t.labels.write();
            // Consumed: the op carries it from here (see `provision_op`).
            t.token.consume_rearm();
        }
        let rearm = matches!(self.ops.get(op), Some(Op::Provision { rearm: true, .. }));
        let assigned: Arc<str> = match (&host, self.taskruns.get(key).map(|t| &t.state)) {
            // The host table's shared name (the table is keyed by it): no allocation per placement.
            (HostRef::Static(_), Some(State::OnHost { host: hid, .. })) => {
                self.hosts[*hid].name.clone()
            }
            (HostRef::Static(h), _) => h.name.as_str().into(),
            (HostRef::Instance { id, .. }, _) => id.clone(),
        };
        let (instance_id, instance_address) = match instance_annotations {
            Some((id, addr)) => (Some(id), Some(addr)),
            None => (None, None),
        };
        out.push(Action::Record {
            taskrun: taskrun.clone(),
            placement: Placement {
                assigned_host: Some(assigned),
                waiting_for_platform: None,
                failed_hosts: failed,
                instance_id,
                instance_address,
            },
        });
        out.push(Action::Provision {
            op,
            taskrun,
            host,
            rearm,
        });
    }

    /// Registers a provisioning of `key` on `host` (re-arming when the TaskRun says so); emit it
    /// with [`Scheduler::emit_provision`].
    pub(super) fn provision_op(&mut self, key: Key, host: &HostRef) -> OpId {
        let rearm = self
            .taskruns
            .get(key)
            .is_some_and(|t| t.token == Token::Rearm);
        self.ops.insert(Op::Provision {
            tr: key,
            host: host.clone(),
            compensate: false,
            rearm,
        })
    }

    pub(super) fn on_provisioned(
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
                match &mut self.taskruns.get_mut(tr).expect("checked above").state {
                    State::OnHost { phase, .. } | State::OnInstance { phase, .. } => {
                        *phase = Phase::Ready(self.now);
                    }
                    _ => {}
                }
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
                    if let State::OnHost { host: hid, def, .. } = &t.state
                        && tries < self.policy.rearm_attempts
                    {
                        // Keep the slot; the same host again shortly (the pod is pointed at it).
                        let (hid, def) = (*hid, def.clone());
                        t.state = State::OnHost {
                            host: hid,
                            def,
                            phase: Phase::Reserved,
                        };
                        t.token = Token::Rearm;
                        if host_at_fault {
                            self.host_failed(hid, out);
                        }
                        let at = self.now + backoff(self.policy.rearm_backoff, tries - 1);
                        self.arm(at, Timer::Rearm(tr));
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
                        self.hosts.release(hid);
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

    /// Removes an op if it is of the expected kind (a result echoing another kind's id is bogus
    /// and changes nothing).
    pub(super) fn take_op(&mut self, op: OpId, kind: impl Fn(&Op) -> bool) -> Option<Op> {
        if !self.ops.get(op).is_some_and(kind) {
            return None;
        }
        self.ops.remove(op)
    }

    /// Asks for a user's removal; `tr` (a finished TaskRun) waits for the result.
    pub(super) fn deprovision(
        &mut self,
        tr: Option<Key>,
        platform: PlatformId,
        user: RemoteUser,
        host: HostRef,
        out: &mut Vec<Action>,
    ) {
        let op = Op::Deprovision {
            tr,
            platform,
            user,
            host,
            attempt: 0,
        };
        self.reissue(op, out);
    }

    /// Issues (or re-issues after a delay) a cleanup operation under a new id.
    pub(super) fn reissue(&mut self, op: Op, out: &mut Vec<Action>) {
        if let Op::Deprovision {
            user,
            host,
            attempt,
            ..
        } = &op
        {
            let (user, host) = (user.clone(), host.clone());
            if *attempt == 0 {
                self.cleaning_started(user.name(), host.name());
            }
            let op = self.ops.insert(op);
            out.push(Action::Deprovision { op, user, host });
        }
    }

    pub(super) fn on_deprovisioned(
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

    /// One pending cleanup of a finished TaskRun completed.
    pub(super) fn cleanup_done(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        if let State::Cleanup { pending } = &mut t.state {
            *pending = pending.saturating_sub(1);
            if *pending == 0 {
                self.finalize(key, out);
            }
        }
    }

    /// Removes the finalizer and forgets the TaskRun (remembering it as finished unless it was
    /// only released); a released TaskRun that needs a host again is admitted anew instead.
    pub(super) fn finalize(&mut self, key: Key, out: &mut Vec<Action>) {
        let (released, revived) = self
            .taskruns
            .get(key)
            .and_then(|t| t.extra.as_ref())
            .map_or((false, false), |e| {
                (e.release != Release::No, e.release == Release::Revived)
            });
        if revived {
            if let Some(e) = self.taskruns.get_mut(key).and_then(|t| t.extra.as_mut()) {
                e.release = Release::No;
            }
            // Its finalizer stays: it is served from here as if new.
            self.admit(key, false, out);
            return;
        }
        if let Some(taskrun) = self.taskrun_ref(key) {
            out.push(Action::RemoveFinalizer {
                taskrun,
                revoke: !released,
            });
        }
        if let Some(t) = self.taskruns.remove(key, !released) {
            self.user_left(key, &t, out);
        }
    }

    /// The TaskRun finished (or was deleted), or, when `released`, needs no host after all
    /// ([`Event::TaskRunReleased`](super::Event::TaskRunReleased)).
    pub(super) fn on_done(
        &mut self,
        ns: &str,
        name: &str,
        uid: &str,
        released: bool,
        out: &mut Vec<Action>,
    ) {
        let uid = Uid::new(uid);
        let Some(key) = self.taskruns.find(&uid) else {
            if self.taskruns.finished(&uid) {
                return;
            }
            // Never seen (finished before we caught up, or released before it was decided):
            // nothing allocated, just let it go.
            let taskrun = TaskRunRef::new(ns, name, uid.clone());
            out.push(Action::DeleteSecret {
                taskrun: taskrun.clone(),
            });
            out.push(Action::RemoveFinalizer {
                taskrun,
                revoke: !released,
            });
            if !released {
                self.taskruns.bury(&uid);
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
        let state = std::mem::replace(&mut t.state, State::Cleanup { pending: 0 });
        let pending = match state {
            State::Cleanup { pending } => {
                // Handled above; kept whole.
                t.state = State::Cleanup { pending };
                return;
            }
            State::Waiting { .. } => 0,
            State::Local | State::Failed => {
                self.delete_secret(key, out);
                0
            }
            State::OnHost { host, def, phase } => {
                self.hosts.release(host);
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

    /// Records how many cleanups a finished TaskRun's finalizer waits for: `pending` of its own
    /// (user removals), and the terminations of the instances it was launched for or finished on
    /// (counted by the fleet).
    pub(super) fn set_cleanup_pending(&mut self, key: Key, pending: u32) {
        let terminations = self.instances.awaited(key);
        if let Some(t) = self.taskruns.get_mut(key)
            && let State::Cleanup { pending: slot } = &mut t.state
        {
            *slot = pending + terminations;
        }
    }

    /// The build that got its secret `at` finished.
    pub(super) fn observe_ran(&self, p: PlatformId, at: super::Time, out: &mut Vec<Action>) {
        out.push(Action::Observe(Observation::Built {
            platform: self.platforms[p as usize].platform.clone(),
            took: self.now.since(at),
        }));
    }

    /// A TaskRun finished: Go's `task_run_time` counts those it finalizes (given a host, an
    /// instance, `localhost` or an error secret), from their creation. A duplicate report finds
    /// it in cleanup and counts nothing.
    fn observe_finished(&self, key: Key, out: &mut Vec<Action>) {
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

    /// Number of provisioning failures recorded for a TaskRun.
    pub(super) fn failures(&self, key: Key) -> u32 {
        self.taskruns
            .get(key)
            .and_then(|t| t.extra.as_ref())
            .map_or(0, |e| e.failed.len() as u32)
    }

    /// True when `name` failed for this TaskRun.
    pub(super) fn failed_on(&self, key: Key, name: &str) -> bool {
        self.taskruns
            .get(key)
            .and_then(|t| t.extra.as_ref())
            .is_some_and(|e| e.failed.iter().any(|(n, _)| &**n == name))
    }

    /// Hosts or instances that failed for this TaskRun, for its error message.
    pub(super) fn failed_list(&self, key: Key) -> Vec<(Arc<str>, String)> {
        self.taskruns
            .get(key)
            .and_then(|t| t.extra.as_ref())
            .map(|e| e.failed.clone())
            .unwrap_or_default()
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
