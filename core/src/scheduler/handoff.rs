//! The hand-off: routing a TaskRun by its platform's mode, queueing it, placing waiters by the
//! strategies' decisions, and what hands freed capacity on (a slot freed, a cleanup finished, an
//! instance gone or drained). These call each other by nature (a placement may terminate an idle
//! pool instance, whose end frees capacity for the next waiter), so they live in one file, above
//! the strategies, the writes and the transitions, and below the event handlers.

use std::sync::Arc;

use super::arena::Key;
use super::groups::GroupId;
use super::queue::Entry;
use super::{
    Action, HostId, InstState, Mode, NO_PLATFORM, Op, Phase, Placement, PlatformId, Release,
    Scheduler, SecretData, State, StaticHost, TaskRun, Timer, messages,
};

/// A strategy's decision for one waiter (static hosts: [`Scheduler::choose_static`], dynamic:
/// [`Scheduler::choose_dynamic`], dynamic pool: [`Scheduler::choose_pool`]). The strategies only
/// read; [`Scheduler::place`] applies the decision through the transitions.
pub(super) enum Choice {
    /// No room for it now: it keeps waiting.
    NoRoom,
    /// It can go nowhere (every host, or too many instances, failed for it): its error secret.
    Fail(String),
    /// This static host, under its current definition.
    Host(HostId, Arc<StaticHost>),
    /// A pool instance with room: ready (provisioned now) or booting (provisioned once it is).
    Join { inst: Key, ready: bool },
    /// A new instance: the TaskRun's own (dynamic) or the pool's.
    Launch,
}

/// Outcome of trying to place a waiter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Placed {
    /// Placed (or routed to a terminal state: local, error).
    Done,
    /// No room now; keep waiting.
    NoRoom,
}

impl Scheduler {
    /// Routes a TaskRun that needs a host by its platform's current mode.
    pub(in crate::scheduler) fn admit(&mut self, key: Key, retry: bool, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
        let p = t.platform;
        if p == NO_PLATFORM {
            return;
        }
        match self.platforms[p as usize].mode.clone() {
            Mode::Local => {
                self.set_state(key, State::Local);
                let Some(t) = self.taskruns.get_mut(key) else {
                    return;
                };
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
    pub(in crate::scheduler) fn enqueue(&mut self, key: Key, retry: bool, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        let p = t.platform;
        if retry && self.hopeless(p, key, out) {
            return;
        }
        let ticket = self.next_ticket;
        self.next_ticket = self.next_ticket.wrapping_add(1);
        // Off whatever host or instance it held (its load or slot freed) as it starts waiting.
        self.set_state(key, State::Waiting { ticket, retry });
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
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
                    self.timers.arm(at, Timer::Requeue(key, ticket));
                }
            }
        }
        if self.is_waiting(key) {
            self.mark_waiting(key, ahead, out);
        }
    }

    /// Serves waiters while the platform has room (immediate hand-off only).
    pub(in crate::scheduler) fn pump(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        self.pump_up_to(p, u32::MAX, out);
    }

    /// Serves at most `limit` waiters while the platform has room (immediate hand-off only):
    /// how many were placed (or routed to their error).
    fn pump_up_to(&mut self, p: PlatformId, limit: u32, out: &mut Vec<Action>) -> u32 {
        if self.policy.handoff != super::Handoff::Immediate || p == NO_PLATFORM {
            return 0;
        }
        let mut placed = 0;
        // Waiters that failed somewhere first: they have waited longest.
        let mut i = 0;
        while placed < limit && i < self.platforms[p as usize].retry.len() && self.has_room(p) {
            let key = self.platforms[p as usize].retry[i];
            let live = matches!(
                self.taskruns.get(key).map(|t| &t.state),
                Some(State::Waiting { retry: true, .. })
            ) && self.taskruns.get(key).map(|t| t.platform) == Some(p);
            if !live {
                self.platforms[p as usize].retry.remove(i);
            } else if self.place(p, key, out) == Placed::Done {
                self.platforms[p as usize].retry.remove(i);
                placed += 1;
            } else {
                i += 1;
            }
        }
        let mut kept = 0;
        while placed < limit && self.has_room(p) {
            let Some(entry) = self.pop_waiter(p) else {
                break;
            };
            if self.place(p, entry.taskrun, out) == Placed::NoRoom {
                // Every host with room holds a TaskRun with its build user's name: keep it
                // served first, and serve the next waiter.
                self.mark_retry(entry.taskrun);
                self.platforms[p as usize].retry.insert(kept, entry.taskrun);
                kept += 1;
            } else {
                placed += 1;
            }
        }
        placed
    }

    /// Hands a capacity group's room on, round-robin across its member platforms with waiters:
    /// one placement per member per round, starting after the member served last, while the group
    /// has room (immediate hand-off only; polling waiters find room on their own).
    pub(in crate::scheduler) fn serve_group(&mut self, g: GroupId, out: &mut Vec<Action>) {
        let def = self.instances.groups().get(g).def();
        let (members, max) = (def.members.clone(), def.max);
        let n = members.len();
        loop {
            let mut any = false;
            let start = self.instances.groups().get(g).turn();
            for step in 0..n {
                if self.group_in_use(g) >= max {
                    return;
                }
                let idx = (start + step) % n;
                if self.pump_up_to(members[idx], 1, out) > 0 {
                    self.instances.group_served(g, idx);
                    any = true;
                }
            }
            if !any {
                return;
            }
        }
    }

    /// Serves the capacity groups platform `p` is in (see [`Scheduler::serve_group`]).
    pub(in crate::scheduler) fn serve_groups_of(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        let groups = self.instances.groups().of(p).to_vec();
        for g in groups {
            self.serve_group(g, out);
        }
    }

    /// Capacity of `p` was freed: hand it over now, or (polling) wake one waiter.
    pub(in crate::scheduler) fn capacity_freed(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        if p == NO_PLATFORM {
            return;
        }
        match self.policy.handoff {
            super::Handoff::Immediate => {
                // A group's unit goes round the members first: the platform whose instance
                // freed it is not served before the others.
                self.serve_groups_of(p, out);
                self.pump(p, out);
            }
            super::Handoff::Poll { .. } => {
                if self.has_room(p)
                    && let Some(entry) = self.pop_waiter(p)
                {
                    let _ = self.place(p, entry.taskrun, out);
                }
            }
        }
    }

    /// Tries to place one waiter by the platform's current mode.
    pub(in crate::scheduler) fn place(
        &mut self,
        p: PlatformId,
        key: Key,
        out: &mut Vec<Action>,
    ) -> Placed {
        let mode = self.platforms[p as usize].mode.clone();
        let choice = match &mode {
            Mode::Static => self.choose_static(p, key),
            Mode::Dynamic(template) => self.choose_dynamic(p, key, template),
            Mode::Pool(pool) => {
                // Go behaviour: traffic for a pool drains its past-max-age instances (unless the
                // waiter has run out of instances to try: then it only gets its error).
                if self.failures(key) < self.policy.instance_attempts
                    && self.policy.pool_idle_timeout.is_none()
                {
                    self.pool_traffic(p, out);
                }
                self.choose_pool(p, key, pool)
            }
            Mode::Local | Mode::Disabled(_) | Mode::Unknown => {
                self.admit(key, false, out);
                return Placed::Done;
            }
        };
        match choice {
            Choice::NoRoom => return Placed::NoRoom,
            Choice::Fail(message) => self.fail(key, message, out),
            Choice::Host(hid, def) => {
                self.observe_wait(key, out);
                self.observe_allocated(key, None, out);
                self.start_static_provisioning(key, hid, def, out);
            }
            Choice::Join { inst, ready } => {
                self.observe_wait(key, out);
                self.set_state(
                    key,
                    State::OnInstance {
                        inst,
                        phase: Phase::Reserved,
                    },
                );
                if ready {
                    self.start_provision(key, inst, out);
                }
            }
            Choice::Launch => {
                let (template, pool) = match mode {
                    Mode::Dynamic(template) => (template, None),
                    Mode::Pool(pool) => (Arc::new(pool.instance.clone()), Some(pool)),
                    _ => unreachable!("only cloud strategies launch"),
                };
                self.observe_wait(key, out);
                let deadline = self.now + template.allocation_timeout;
                let inst = self.new_instance(p, template, pool);
                self.set_state(
                    key,
                    State::OnInstance {
                        inst,
                        phase: Phase::Reserved,
                    },
                );
                self.timers.arm(deadline, Timer::Deadline(inst));
                self.launch(inst, out);
            }
        }
        Placed::Done
    }

    /// One pending cleanup of a finished TaskRun completed.
    pub(in crate::scheduler) fn cleanup_done(&mut self, key: Key, out: &mut Vec<Action>) {
        if self.cleanup_one_done(key) {
            self.finalize(key, out);
        }
    }

    /// Removes the finalizer and forgets the TaskRun (remembering it as finished unless it was
    /// only released); a released TaskRun that needs a host again is admitted anew instead.
    pub(in crate::scheduler) fn finalize(&mut self, key: Key, out: &mut Vec<Action>) {
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

    /// A TaskRun (`t`, under `key`) is no longer tracked: TaskRuns it kept off a host may go
    /// there now.
    pub(in crate::scheduler) fn user_left(&mut self, key: Key, t: &TaskRun, out: &mut Vec<Action>) {
        let user = t.user();
        let freed: Vec<_> = self
            .taskruns
            .same_user(&user, key)
            .filter_map(|k| self.taskruns.get(k).map(|t| t.platform))
            .collect();
        for p in freed {
            self.pump(p, out);
        }
    }

    /// Asks for termination (once the id is known; a launching instance is terminated when its
    /// launch result arrives).
    pub(in crate::scheduler) fn terminate(
        &mut self,
        inst: Key,
        reason: &'static str,
        out: &mut Vec<Action>,
    ) {
        let Some(i) = self.instances.get(inst) else {
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
        let (template, legacy) = self
            .instances
            .update(inst, |i| {
                i.state = InstState::Terminating(op);
                i.probe_op = None;
                (i.template.clone(), i.legacy)
            })
            .expect("checked above");
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
    pub(in crate::scheduler) fn drop_instance(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let p = i.platform();
        let cleanup_for = i.cleanup_for();
        // A dedicated host that ran it is scrubbed now and takes no launch meanwhile: its slot
        // stays taken until the scrub ends (an instance never launched used no host).
        let scrub = i
            .template
            .dedicated_host
            .as_ref()
            .map(|h| h.scrub)
            .filter(|s| self.policy.hold_scrubbing_hosts && !s.is_zero() && i.id().is_some());
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
        if let Some(scrub) = scrub {
            let until = self.now + scrub;
            self.instances.hold_for_scrub(p, until);
            self.timers.arm(until, Timer::ScrubDone(p));
        }
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

    /// After a pool instance's load changed: terminate it when idle and draining, or start its
    /// idle timer.
    pub(in crate::scheduler) fn settle(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.pool.is_none() || i.state != InstState::Ready {
            return;
        }
        if !i.attached.is_empty() {
            self.instances.update(inst, |i| i.idle_since = None);
            return;
        }
        if i.draining {
            self.terminate(inst, "drained", out);
            return;
        }
        if i.idle_since.is_none()
            && let Some(idle) = self.policy.pool_idle_timeout
        {
            let now = self.now;
            self.instances.update(inst, |i| i.idle_since = Some(now));
            self.timers.arm(now + idle, Timer::Idle(inst, now));
        }
    }

    /// Go behaviour: past-`max-age` instances are noticed (and terminated when idle) only when
    /// traffic for the pool arrives.
    pub(in crate::scheduler) fn pool_traffic(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        let members: Vec<Key> = self.instances.members(p).iter().copied().collect();
        for inst in members {
            let Some(i) = self.instances.get(inst) else {
                continue;
            };
            let Some(pool) = &i.pool else {
                continue;
            };
            if !i.draining && i.created + pool.max_age <= self.now {
                self.instances.update(inst, |i| i.draining = true);
                self.settle(inst, out);
            }
        }
    }

    /// A waiter that already failed everywhere it may go gets its error secret now rather than
    /// when room appears.
    pub(in crate::scheduler) fn hopeless(
        &mut self,
        p: PlatformId,
        key: Key,
        out: &mut Vec<Action>,
    ) -> bool {
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

    /// Gives `key` its error secret when every host of static platform `p` failed for it.
    pub(in crate::scheduler) fn fail_if_all_hosts_failed(
        &mut self,
        p: PlatformId,
        key: Key,
        out: &mut Vec<Action>,
    ) -> bool {
        let all_failed = self.all_hosts_failed(p, key);
        if all_failed {
            let msg = messages::all_hosts_failed(
                &self.platforms[p as usize].platform,
                &self.failed_list(key),
            );
            self.fail(key, msg, out);
        }
        all_failed
    }

    /// Error secret after too many instances failed for this TaskRun.
    pub(in crate::scheduler) fn fail_instances(
        &mut self,
        key: Key,
        p: PlatformId,
        out: &mut Vec<Action>,
    ) {
        let msg = messages::instances_failed(
            &self.platforms[p as usize].platform,
            &self.failed_list(key),
        );
        self.fail(key, msg, out);
    }

    /// Dedicated hosts' scrubs that ended free their slots for the platform's waiters.
    pub(in crate::scheduler) fn scrub_done(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        if self.instances.end_scrubs(p, self.now) > 0 {
            self.capacity_freed(p, out);
        }
    }

    pub(in crate::scheduler) fn host_back_due(
        &mut self,
        hid: HostId,
        level: u32,
        out: &mut Vec<Action>,
    ) {
        let h = &self.hosts[hid];
        if h.backoff_level != level || !h.backing_off() {
            return;
        }
        let p = h.platform;
        self.hosts.end_backoff(hid);
        self.capacity_freed(p, out);
    }

    /// The next waiter of a platform: retry lane first, then the fair queue.
    pub(in crate::scheduler) fn take_waiter(&mut self, p: PlatformId) -> Option<Key> {
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

    /// Next live waiter of the fair queue.
    pub(in crate::scheduler) fn pop_waiter(&mut self, p: PlatformId) -> Option<Entry> {
        let taskruns = &self.taskruns;
        self.platforms[p as usize].queue.pop(|e| {
            matches!(
                taskruns.get(e.taskrun).map(|t| (&t.state, t.platform)),
                Some((State::Waiting { ticket, retry: false }, tp)) if *ticket == e.ticket && tp == p
            )
        })
    }

    /// True when a waiter without failures could be placed now.
    pub(in crate::scheduler) fn has_room(&self, p: PlatformId) -> bool {
        let ps = &self.platforms[p as usize];
        match &ps.mode {
            Mode::Static => self.hosts.has_room(p),
            Mode::Dynamic(t) => self.occupied(p) < t.capacity() && self.group_room(p),
            Mode::Pool(pool) => {
                let (ready, booting) = self.instances.with_room(p);
                !ready.is_empty()
                    || !booting.is_empty()
                    || (self.occupied(p) < pool.instance.capacity() && self.group_room(p))
            }
            // Waiters of these are routed (secret written) by placement.
            Mode::Local | Mode::Disabled(_) | Mode::Unknown => true,
        }
    }
}
