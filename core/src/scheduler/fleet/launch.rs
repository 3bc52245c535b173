//! Instance events and timers: launch results and retries, probes until reachable, termination
//! results and retries, a pool instance's idle and max-age timers; and what happens to its
//! TaskRuns when it fails, times out or disappears. The launch and termination requests
//! themselves are `emit`'s and `handoff`'s.

use super::super::view::backoff;
use super::super::{
    Action, Extra, InstState, InstanceState, Mode, Op, OpId, Phase, ProbeResult, Scheduler, State,
    Timer, messages,
};
use std::sync::Arc;

use super::super::arena::Key;
use super::super::ledger::Token;
use super::warm::WARM_HOLD;

impl Scheduler {
    /// The instance a launch result is for, when the core still waits for it.
    pub(in crate::scheduler) fn take_launch(&mut self, op: OpId) -> Option<Key> {
        let Some(Op::Launch { inst }) = self.take_op(op, |o| matches!(o, Op::Launch { .. })) else {
            return None;
        };
        self.instances
            .get(inst)
            .is_some_and(|i| i.state == InstState::Launching(op))
            .then_some(inst)
    }

    pub(in crate::scheduler) fn on_launched(
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
                let i = self.instances.get(inst).expect("checked by take_launch");
                let (overdue, pool, created) = (i.overdue, i.pool.clone(), i.created);
                let owner = i.owner;
                let first_probe = if self.policy.first_probe_capped {
                    self.policy.first_probe.min(i.template.check_interval)
                } else {
                    self.policy.first_probe
                };
                self.instances.update(inst, |i| {
                    i.state = InstState::Booting;
                    i.probes = 0;
                });
                self.instances.set_id(inst, id);
                let first = self.now + first_probe;
                self.timers.arm(first, Timer::Probe(inst, 0));
                if let Some(pool) = &pool
                    && self.policy.pool_idle_timeout.is_some()
                {
                    self.timers.arm(created + pool.max_age, Timer::MaxAge(inst));
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
                        let retag = self
                            .instances
                            .update(inst, |i| {
                                let launch = i.launch.clone().filter(|_| i.retag);
                                i.retag = false;
                                launch.map(|launch| Action::Retag {
                                    instance_id: i.id().cloned().expect("set above"),
                                    template: i.template.clone(),
                                    launch,
                                })
                            })
                            .flatten();
                        out.extend(retag);
                        self.record_instance(owner.expect("checked"), inst, out);
                    } else {
                        self.abandon(inst);
                        if !self.adopt(inst, out) {
                            self.terminate(inst, "its TaskRun went away during launch", out);
                        }
                    }
                }
            }
            Err((error, retryable)) => {
                self.instances
                    .update(inst, |i| i.last_error = Some(error.clone()));
                let i = self.instances.get(inst).expect("checked by take_launch");
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
                    let n = i.launches;
                    self.instances
                        .update(inst, |i| i.state = InstState::LaunchWait);
                    let at = self.now + backoff(self.policy.launch_backoff, n - 1);
                    self.timers.arm(at, Timer::LaunchRetry(inst, n));
                    return;
                }
                let p = i.platform();
                let launches = i.launches;
                let users: Vec<Key> = i.owner.into_iter().chain(i.attached.clone()).collect();
                if users.is_empty() {
                    self.platforms[p as usize].warm_hold = self.now + WARM_HOLD;
                    let at = self.now + WARM_HOLD;
                    self.timers.arm(at, Timer::Warm(p));
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
    pub(in crate::scheduler) fn launched_known(
        &mut self,
        inst: Key,
        other: Key,
        out: &mut Vec<Action>,
    ) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let (platform, dynamic) = (i.platform(), i.pool.is_none());
        // Its TaskRuns are moved on below (to the other entry, or back to the queue).
        let users = self.disown(inst);
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
            let (booting, n) = self
                .instances
                .update(other, |o| {
                    if o.address.is_none() && o.state == InstState::Ready {
                        // Known only from a listing: probe before use.
                        o.state = InstState::Booting;
                    }
                    (o.state == InstState::Booting, o.probes)
                })
                .expect("checked");
            self.set_state(
                owner,
                State::OnInstance {
                    inst: other,
                    phase: Phase::Reserved,
                },
            );
            self.record_instance(owner, other, out);
            if booting {
                let now = self.now;
                self.timers.arm(now, Timer::Probe(other, n));
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
    pub(in crate::scheduler) fn on_launch_spent(
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

    pub(in crate::scheduler) fn launch_retry_due(
        &mut self,
        inst: Key,
        n: u32,
        out: &mut Vec<Action>,
    ) {
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
            // Its TaskRuns go back to the queue below, once it is dropped.
            let users = self.disown(inst);
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

    pub(in crate::scheduler) fn probe_due(&mut self, inst: Key, n: u32, out: &mut Vec<Action>) {
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
        self.instances.update(inst, |i| i.probe_op = Some(op));
        out.push(Action::Probe {
            op,
            instance_id: id,
            template,
        });
    }

    pub(in crate::scheduler) fn on_probed(
        &mut self,
        op: OpId,
        result: ProbeResult,
        out: &mut Vec<Action>,
    ) {
        let Some(Op::Probe { inst }) = self.take_op(op, |o| matches!(o, Op::Probe { .. })) else {
            return;
        };
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.state != InstState::Booting || i.probe_op != Some(op) {
            return;
        }
        let booted = i.booted;
        self.instances.update(inst, |i| i.probe_op = None);
        match result {
            ProbeResult::Pending | ProbeResult::Booting { .. } => {
                let mut period = self.policy.probe_every;
                let mut address = None;
                if let ProbeResult::Booting { address: a } = result {
                    address = Some(a.into());
                    period = self.policy.ssh_probe_every.or(period);
                }
                let (every, n) = self
                    .instances
                    .update(inst, |i| {
                        if address.is_some() {
                            i.address = address;
                        }
                        i.probes += 1;
                        let every = match period {
                            Some(d) => d.min(i.template.check_interval),
                            None => i.template.check_interval,
                        };
                        (every, i.probes)
                    })
                    .expect("checked above");
                let at = self.now + every;
                self.timers.arm(at, Timer::Probe(inst, n));
            }
            ProbeResult::Reachable { address } => {
                self.instances.update(inst, |i| {
                    i.address = Some(address.into());
                    i.state = InstState::Ready;
                });
                self.became_ready(inst, out);
            }
            ProbeResult::Failed { reason } if booted => {
                self.instance_unhealthy(inst, &reason, out);
            }
            ProbeResult::Failed { reason } => {
                self.instance_failed(inst, &reason, true, out);
            }
        }
    }

    /// The instance answers SSH: provision whoever waits for it.
    pub(in crate::scheduler) fn became_ready(&mut self, inst: Key, out: &mut Vec<Action>) {
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

    pub(in crate::scheduler) fn on_terminated(
        &mut self,
        op: OpId,
        error: Option<String>,
        out: &mut Vec<Action>,
    ) {
        let Some(Op::Terminate { inst }) = self.take_op(op, |o| matches!(o, Op::Terminate { .. }))
        else {
            return;
        };
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.state != InstState::Terminating(op) {
            return;
        }
        let Some(error) = error else {
            if let Some(id) = i.id().cloned() {
                let p = i.platform();
                self.instances.terminated(id, p, self.now);
            }
            self.drop_instance(inst, out);
            return;
        };
        let n = self
            .instances
            .update(inst, |i| {
                i.terminate_attempts += 1;
                i.state = InstState::TerminateWait;
                i.terminate_attempts
            })
            .expect("checked above");
        let i = self.instances.get(inst).expect("checked above");
        let at = self.now + backoff(self.policy.cleanup_backoff, n - 1);
        let p = i.platform();
        let id = i.id().cloned().unwrap_or_else(|| "?".into());
        // Leaked at the bound, reported once: the TaskRun whose finalizer waited for it is let
        // go (a refusal that lasts must not hold finalizers for good), but the instance still
        // runs and is billed, so it keeps its `max-instances` place (a lasting refusal costs at
        // most `max-instances` instances, not one per TaskRun) and its termination keeps being
        // retried every few minutes (the back-off's cap) until it lands or a listing shows it
        // gone; the platform launches again then.
        let give_up = n == self.policy.cleanup_attempts.max(1) && !i.leaked();
        let waiting = if give_up {
            self.instances.leak(inst);
            self.instances.release_waiter(inst)
        } else {
            None
        };
        self.timers.arm(at, Timer::TerminateRetry(inst, n));
        if give_up {
            let ps = &self.platforms[p as usize];
            out.push(Action::Observe(super::super::Observation::CleanupFailed(
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
                     still counts against max-instances (the platform launches no more while its \
                     leaked instances fill it) and its termination is retried every few minutes: \
                     terminate it by hand if it stays"
                ),
            });
            if let Some(k) = waiting {
                self.cleanup_done(k, out);
            }
        }
    }

    pub(in crate::scheduler) fn terminate_retry_due(
        &mut self,
        inst: Key,
        n: u32,
        out: &mut Vec<Action>,
    ) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        if i.state == InstState::TerminateWait && i.terminate_attempts == n {
            self.terminate(inst, "retrying termination", out);
        }
    }

    /// The instance will not serve: its waiting TaskRuns go back to the queue (counting a
    /// failure); it is terminated (or forgotten when already gone).
    pub(in crate::scheduler) fn instance_failed(
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
        self.abandon(inst);
        if terminate {
            self.terminate(inst, "it failed", out);
        } else {
            self.drop_instance(inst, out);
        }
        self.capacity_freed(p, out);
    }

    /// Takes an instance out of service: its TaskRuns not running yet go back to the queue,
    /// first in line, with the instance counted as failed for them. Returns the running ones.
    pub(in crate::scheduler) fn requeue_waiting(
        &mut self,
        inst: Key,
        reason: &str,
        out: &mut Vec<Action>,
    ) -> Vec<Key> {
        let Some(i) = self.instances.get(inst) else {
            return Vec::new();
        };
        let name = self.instance_name(inst);
        let users: Vec<Key> = i.owner.into_iter().chain(i.attached.clone()).collect();
        // Out of the index first, so the requeued TaskRuns cannot land on it again.
        self.instances.update(inst, |i| i.draining = true);
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
                    // A retry's re-provisioning moving on: the secret its pod was given names
                    // this instance; the next placement writes a new one (as on a static host).
                    let rearm = t.token == Token::Rearm
                        || matches!(phase, Phase::Provisioning(op)
                            if matches!(self.ops.get(op), Some(Op::Provision { rearm: true, .. })));
                    if rearm {
                        if let Some(t) = self.taskruns.get_mut(k) {
                            t.token.consume_rearm();
                        }
                        self.delete_secret(k, out);
                    }
                    // Requeued: it leaves the instance as it starts waiting.
                    self.enqueue(k, true, out);
                }
                Phase::Ready(_) => running.push(k),
            }
        }
        running
    }

    pub(in crate::scheduler) fn deadline_due(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        match i.state {
            InstState::Launching(_) => {
                self.instances.update(inst, |i| i.overdue = true);
            }
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
    pub(in crate::scheduler) fn timed_out(&mut self, inst: Key, out: &mut Vec<Action>) {
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
        self.abandon(inst);
        self.terminate(inst, "allocation timed out", out);
    }

    pub(in crate::scheduler) fn on_instance_gone(&mut self, id: &str, out: &mut Vec<Action>) {
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

    /// A booted pool instance failed a probe: it takes no new work and its waiting TaskRuns go
    /// back to the queue (counting a failure), but builds running on it keep it until they
    /// finish; it is terminated once idle. Terminating it now would kill them, and one failed
    /// SSH connection does not prove it is gone (a listing or a termination seen outside tells).
    pub(in crate::scheduler) fn instance_unhealthy(
        &mut self,
        inst: Key,
        reason: &str,
        out: &mut Vec<Action>,
    ) {
        // Probed no more: settled like a ready instance from now on.
        let Some(p) = self.instances.update(inst, |i| {
            i.state = InstState::Ready;
            i.platform()
        }) else {
            return;
        };
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

    pub(in crate::scheduler) fn idle_due(
        &mut self,
        inst: Key,
        since: super::super::Time,
        out: &mut Vec<Action>,
    ) {
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

    pub(in crate::scheduler) fn max_age_due(&mut self, inst: Key, out: &mut Vec<Action>) {
        let Some(i) = self.instances.get(inst) else {
            return;
        };
        let Some(pool) = &i.pool else {
            return;
        };
        if i.created + pool.max_age > self.now {
            // max-age was raised since the timer was set.
            let at = i.created + pool.max_age;
            self.timers.arm(at, Timer::MaxAge(inst));
            return;
        }
        if matches!(
            i.state,
            InstState::Terminating(_) | InstState::TerminateWait
        ) {
            return;
        }
        let p = i.platform();
        self.instances.update(inst, |i| i.draining = true);
        self.settle(inst, out);
        self.ensure_warm(p, out);
    }
}
