//! What the scheduler writes out: secrets, error secrets, placement records, provisioning and
//! removal requests, launches, observations. Each state change it makes goes through the
//! transitions (`transition.rs`); it calls nothing that places or hands off.

use super::view::failed_hosts;
use std::sync::Arc;

use super::arena::Key;
use super::ledger::{Labels, Token};
use super::{
    Action, HostId, HostRef, InstState, LaunchId, LaunchOwner, Mode, NO_PLATFORM, Observation, Op,
    OpId, Phase, Placement, PlatformId, RemoteUser, Scheduler, SecretData, State, StaticHost,
    Timer, messages,
};

impl Scheduler {
    /// Writes the error secret; the TaskRun then runs and fails with the message.
    pub(in crate::scheduler) fn fail(&mut self, key: Key, message: String, out: &mut Vec<Action>) {
        self.clear_placement(key, out);
        self.set_state(key, State::Failed);
        let Some(t) = self.taskruns.get(key) else {
            return;
        };
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
    pub(in crate::scheduler) fn clear_placement(&mut self, key: Key, out: &mut Vec<Action>) {
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
    pub(in crate::scheduler) fn write_secret(
        &mut self,
        key: Key,
        secret: SecretData,
        out: &mut Vec<Action>,
    ) {
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

    pub(in crate::scheduler) fn delete_secret(&mut self, key: Key, out: &mut Vec<Action>) {
        if let Some(taskrun) = self.taskrun_ref(key) {
            out.push(Action::DeleteSecret { taskrun });
        }
    }

    /// Records the placement and asks for provisioning under `op` (from
    /// [`Scheduler::provision_op`]).
    pub(in crate::scheduler) fn emit_provision(
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
    pub(in crate::scheduler) fn provision_op(&mut self, key: Key, host: &HostRef) -> OpId {
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

    /// Asks for a user's removal; `tr` (a finished TaskRun) waits for the result.
    pub(in crate::scheduler) fn deprovision(
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
    pub(in crate::scheduler) fn reissue(&mut self, op: Op, out: &mut Vec<Action>) {
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

    /// Time spent queued, observed when a waiter leaves the queue for a placement. From here on
    /// `queued` is when the allocation started (see [`Scheduler::observe_allocated`]).
    pub(in crate::scheduler) fn observe_wait(&mut self, key: Key, out: &mut Vec<Action>) {
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
    pub(in crate::scheduler) fn observe_allocated(
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

    /// The build that got its secret `at` finished.
    pub(in crate::scheduler) fn observe_ran(
        &self,
        p: PlatformId,
        at: super::Time,
        out: &mut Vec<Action>,
    ) {
        out.push(Action::Observe(Observation::Built {
            platform: self.platforms[p as usize].platform.clone(),
            took: self.now.since(at),
        }));
    }

    pub(in crate::scheduler) fn mark_waiting(
        &mut self,
        key: Key,
        ahead: usize,
        out: &mut Vec<Action>,
    ) {
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

    /// Records a dynamic TaskRun's instance on it.
    pub(in crate::scheduler) fn record_instance(
        &mut self,
        key: Key,
        inst: Key,
        out: &mut Vec<Action>,
    ) {
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
            failed_hosts: failed_hosts(t),
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

    /// Sends (or re-sends) the launch request. Its identity is fixed by the first request, so
    /// a retry after a cloud error cannot launch a second instance.
    pub(in crate::scheduler) fn launch(&mut self, inst: Key, out: &mut Vec<Action>) {
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
                self.instances.update(inst, |i| i.launch = Some(id.clone()));
                id
            }
        };
        let op = self.ops.insert(Op::Launch { inst });
        let (template, p) = self
            .instances
            .update(inst, |i| {
                i.state = InstState::Launching(op);
                i.launches += 1;
                (i.template.clone(), i.platform())
            })
            .expect("checked above");
        out.push(Action::Launch {
            op,
            platform: self.platforms[p as usize].platform.clone(),
            template,
            launch,
            additional_tags: self.additional_tags.clone(),
        });
    }

    /// Provisions a TaskRun on a reachable instance.
    pub(in crate::scheduler) fn start_provision(
        &mut self,
        key: Key,
        inst: Key,
        out: &mut Vec<Action>,
    ) {
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
        let annotations = self
            .instances
            .update(inst, |i| {
                i.used = true;
                match (&i.pool, &host) {
                    (None, HostRef::Instance { id, address, .. }) => {
                        Some((id.clone(), address.clone()))
                    }
                    _ => None,
                }
            })
            .expect("resolved above");
        self.set_state(
            key,
            State::OnInstance {
                inst,
                phase: Phase::Provisioning(op),
            },
        );
        self.emit_provision(key, op, host, annotations, out);
    }

    /// Moves `key` onto static host `hid` (which counts it from now on) and asks for
    /// provisioning.
    pub(in crate::scheduler) fn start_static_provisioning(
        &mut self,
        key: Key,
        hid: HostId,
        def: Arc<StaticHost>,
        out: &mut Vec<Action>,
    ) {
        let host = HostRef::Static(def.clone());
        let op = self.provision_op(key, &host);
        self.set_state(
            key,
            State::OnHost {
                host: hid,
                def: Some(def),
                phase: Phase::Provisioning(op),
            },
        );
        self.emit_provision(key, op, host, None, out);
    }

    /// Provisioning failed: after repeated failures the host sits out a back-off period that
    /// doubles each time it trips again without a success in between.
    pub(in crate::scheduler) fn host_failed(&mut self, hid: HostId, out: &mut Vec<Action>) {
        let Some(b) = self.policy.host_backoff else {
            return;
        };
        let Some(off) = self.hosts.failed(hid, b, self.now) else {
            return;
        };
        let name = self.hosts[hid].name.clone();
        self.timers.arm(off.until, Timer::HostBack(hid, off.level));
        out.push(Action::Notify {
            taskrun: None,
            warning: true,
            reason: "HostBackedOff",
            message: format!(
                "host {name} failed provisioning {} times in a row; no new builds go to it for {} s",
                b.after_failures,
                off.period.as_secs()
            ),
        });
    }

    /// Provisioning worked: the host is healthy.
    pub(in crate::scheduler) fn provision_ok_on(&mut self, key: Key, _out: &mut Vec<Action>) {
        match self.taskruns.get(key).map(|t| &t.state) {
            Some(State::OnHost { host, .. }) => self.hosts.succeeded(*host),
            Some(&State::OnInstance { inst, .. }) => {
                self.instances.update(inst, |i| i.provision_failures = 0);
            }
            _ => {}
        }
    }
}
