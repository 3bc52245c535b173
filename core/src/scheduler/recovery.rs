//! Rebuilding the ledger from a [`Snapshot`] after a restart or leader change.
//!
//! Allocations are recognised by their evidence on the cluster, not by the current config:
//! `cloud-instance-id` means a dynamic instance, an `assigned-host` that is a listed pool
//! instance means a pool slot, one that names a configured host means a static slot. A
//! TaskRun whose secret exists is running; one assigned without a secret is provisioned again
//! (a fresh key: the old token was never handed out). Waiters are queued in their original
//! order. Instances carrying this cluster's identity that nothing owns are terminated once older
//! than the grace period. Instances without it are adopted only when a TaskRun names them
//! (`cloud-instance-id`, or a pool's `assigned-host`); another cluster's never, even when named.
//! Every live instance listed that the rebuilt ledger does not track counts toward its
//! platform's `max-instances` until the next listing.
//!
//! A platform whose listing failed ([`Snapshot::unlisted`]) is not taken for one with no
//! instances: that would rebuild its proven builds on a "retired host", relaunch its unproven
//! ones while they run, and have the next listing terminate their instances (a shared pool
//! instance too) as orphans. Its TaskRuns are held as recorded instead, nothing is launched for
//! it, and once a listing of it arrives they are recovered against that listing exactly as here
//! (see `unlisted`).
//!
//! Tenants write their TaskRuns' labels and annotations and the Secrets of their namespace, so
//! every piece of evidence is checked before it counts (the controller learns only whether a
//! TaskRun's secret exists, never what it holds: [`TaskRunRecord::secret`]):
//! - a `cloud-instance-id` only if the listing shows the instance as the TaskRun's
//!   ([`InstanceRecord::belongs_to`]: our owner tag with its UID, or Go's `taskRunID` tag);
//!   addresses come from the listing, never from the `cloud-address` annotation;
//! - a static host only if it serves the TaskRun's platform and has room under its
//!   `concurrency` (a proven, served allocation is kept over a shrunk `concurrency`); a pool instance only if it is the platform's and has room under the pool's;
//!   a host the config dropped only with a proven allocation. What does not fit is queued again;
//! - proven allocations ([`TaskRunRecord::secret_proven`]: the TaskRun carries the controller's
//!   proof for its host, and its secret exists) are rebuilt first, so an unproven claim (Go's,
//!   or forged) never displaces one the controller made; only a proven allocation's token is
//!   re-armed;
//! - `since` is never earlier than the creation time (see [`TaskRunRecord::since`]).

use super::unlisted::Held;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::arena::Key;
use super::ledger::{Labels, Token};
use super::snapshot::{InstanceRecord, Ownership, SecretKind, TaskRunRecord};
use super::{
    Action, Extra, HostRef, InstState, Mode, NO_PLATFORM, Phase, PlatformId, RemoteUser, Scheduler,
    State, TaskRun, TaskRunRef, Timer, Uid,
};
use crate::config::{DynamicPlatform, DynamicPool};
use crate::platform::Platform;

impl Scheduler {
    /// Rebuilds the ledger from TaskRun records and the listings of every platform but the
    /// unlisted ones (or, with `only`, of that platform alone: its held TaskRuns, once its
    /// listing arrived; `released` are the finished ones that ended by a release).
    pub(in crate::scheduler) fn rebuild(
        &mut self,
        taskruns: &[TaskRunRecord],
        instances: &[InstanceRecord],
        only: Option<PlatformId>,
        released: &BTreeSet<Uid>,
        out: &mut Vec<Action>,
    ) {
        let mut listed: BTreeMap<&str, &InstanceRecord> = BTreeMap::new();
        for rec in instances {
            listed.entry(rec.id.as_str()).or_insert(rec);
        }
        let mut claimed: BTreeSet<String> = BTreeSet::new();
        // Go-era pool instances a TaskRun names, with the platforms of the TaskRuns naming them.
        let mut named: BTreeMap<&str, Vec<Platform>> = BTreeMap::new();
        for r in taskruns {
            if let (Some(host), Ok(p)) = (r.assigned_host.as_deref(), Platform::parse(&r.platform))
            {
                named.entry(host).or_default().push(p);
            }
        }
        let pool_members = self.recover_pool_instances(instances, &named, &mut claimed);

        // Proven allocations first: they take the capacity an unproven claim would also want.
        let proven = |r: &TaskRunRecord| r.secret_proven && r.secret == Some(SecretKind::Remote);
        let mut records: Vec<&TaskRunRecord> = taskruns.iter().collect();
        records.sort_by(|a, b| {
            (!proven(a), a.since, &a.namespace, &a.name).cmp(&(
                !proven(b),
                b.since,
                &b.namespace,
                &b.name,
            ))
        });
        // The annotated instance, when the listing confirms it is the TaskRun's.
        let confirmed = |r: &TaskRunRecord| {
            r.instance_id
                .clone()
                .filter(|id| listed.get(id.as_str()).is_some_and(|l| l.claimed_by(r)))
        };
        // Claim instances by annotation first, so tag-based adoption cannot take one that a
        // TaskRun names.
        // An error or localhost secret settles a TaskRun whatever its labels say: its instance,
        // if any is still up, is an orphan.
        let settled = |r: &TaskRunRecord| {
            !r.finished && matches!(r.secret, Some(SecretKind::Error | SecretKind::Localhost))
        };
        for rec in &records {
            if let Some(id) = confirmed(rec)
                && !settled(rec)
            {
                claimed.insert(id);
            }
        }
        // Instances live TaskRuns name: one a finished TaskRun names too was handed over to
        // the live one (an unused dynamic instance goes to the next waiter) and is not the
        // finished one's to terminate.
        let live_named: BTreeSet<String> = records
            .iter()
            .filter(|r| !r.finished && !settled(r))
            .filter_map(|r| confirmed(r))
            .collect();
        // Build users live TaskRuns hold, by host: a finished TaskRun whose (colliding) user name
        // a live one holds on the same host left it there for that one (its own cleanup ran
        // before the restart; only the finalizer's removal was lost), so it is not removed.
        let live_users: BTreeSet<(String, String)> = records
            .iter()
            .filter(|r| !r.finished && !settled(r))
            .filter_map(|r| {
                let host = r.assigned_host.clone()?;
                Some((
                    crate::contract::remote_user_name(&r.name, &r.namespace),
                    host,
                ))
            })
            .collect();
        let mut waiters = Vec::new();
        // Live TaskRuns that had a secret: still gated ones are un-gated once it stands.
        let mut with_secret = Vec::new();
        for rec in records {
            let uid = Uid::new(&rec.uid);
            if self.taskruns.find(&uid).is_some() {
                continue;
            }
            let parsed = Platform::parse(&rec.platform);
            let p = match &parsed {
                Ok(pl) => self.platform_id(pl),
                Err(_) => NO_PLATFORM,
            };
            let ns = self.taskruns.intern_ns(&rec.namespace);
            let extra = (!rec.failed_hosts.is_empty()).then(|| {
                Box::new(Extra {
                    failed: rec
                        .failed_hosts
                        .iter()
                        .map(|h| (Arc::from(h.as_str()), "failed before a restart".to_owned()))
                        .collect(),
                    ..Extra::default()
                })
            });
            let mut t = TaskRun::new(
                uid,
                TaskRunRef::path_of(&rec.namespace, &rec.name),
                ns,
                p,
                rec.since,
            );
            t.retries = rec.retries;
            t.gated = rec.gated;
            t.labels = if rec.waiting && !allocated(rec) && rec.failed_hosts.is_empty() {
                Labels::Announced
            } else if allocated(rec) || rec.waiting {
                Labels::Written
            } else {
                Labels::Clear
            };
            // A secret a pod may have mounted already: its token is re-armed, not replaced.
            // Only the controller's own: another's token (Go's, or a tenant's) is not one
            // our key server issued.
            t.token = if proven(rec) {
                Token::Rearm
            } else if rec.secret == Some(SecretKind::Remote) {
                Token::Foreign
            } else {
                Token::Fresh
            };
            t.extra = extra;
            if released.contains(t.uid()) {
                // Cleaned up as a release: not remembered as finished.
                t.extra.get_or_insert_with(Box::default).release = super::Release::Released;
            }
            let key = self.taskruns.insert(t);
            if rec.finished {
                self.recover_finished(
                    key,
                    rec,
                    (&listed, &pool_members),
                    (&live_named, &live_users),
                    out,
                );
                continue;
            }
            if rec.secret.is_some() {
                with_secret.push(key);
            }
            if let Err(e) = parsed {
                match rec.secret {
                    Some(_) => {}
                    None => {
                        let msg = super::messages::bad_platform(&rec.platform, &e.to_string());
                        self.fail(key, msg, out);
                    }
                }
                continue;
            }
            if !settled(rec)
                && self.recover_allocation(key, p, rec, &listed, &pool_members, &mut claimed, out)
            {
                continue;
            }
            match rec.secret {
                Some(SecretKind::Error) => {}
                Some(SecretKind::Localhost) => {
                    self.set_state(key, State::Local);
                }
                // Not allocated (a remote secret without an allocation is stale: replaced).
                _ => {
                    // Starting over: the old allocation labels no longer hold (a waiting label
                    // is rewritten or cleared by what admission makes of it).
                    if allocated(rec) {
                        self.clear_placement(key, out);
                    }
                    waiters.push(key)
                }
            }
        }
        self.recover_orphans(instances, &claimed, &pool_members, out);
        // In their original order again (proven allocations were taken out of it).
        waiters.sort_by_key(|&k| self.taskruns.get(k).map(|t| (t.since, t.path().clone())));
        for p in 0..self.platforms.len() as PlatformId {
            // An unlisted platform's count is unknown (it counts as full until listed); with
            // `only`, that platform's listing is the one given.
            if only.map_or(self.platforms[p as usize].unlisted, |o| o != p) {
                continue;
            }
            let platform = self.platforms[p as usize].platform.clone();
            let of_p = instances.iter().filter(|r| r.platform == *platform);
            self.count_foreign(p, of_p, out);
        }
        for key in waiters {
            let retry = self.failures(key) > 0;
            self.admit(key, retry, out);
            // Placed at once, or waiting and announced: either way a later wait is new.
            if let Some(t) = self.taskruns.get_mut(key) {
                t.labels.settle();
            }
        }
        for key in with_secret {
            self.ungate_served(key, out);
        }
        for p in 0..self.platforms.len() as PlatformId {
            self.pump(p, out);
            self.ensure_warm(p, out);
        }
    }

    /// A recovered TaskRun still gated although its secret stands (the crash came between the
    /// secret and the un-gating): un-gated now, or it would wait forever. One whose secret is
    /// being replaced is un-gated with the new secret.
    pub(in crate::scheduler) fn ungate_served(&mut self, key: Key, out: &mut Vec<Action>) {
        let Some(t) = self.taskruns.get_mut(key) else {
            return;
        };
        let stands = match &t.state {
            State::Failed | State::Local => true,
            State::OnHost { phase, .. } | State::OnInstance { phase, .. } => {
                matches!(phase, Phase::Ready(_))
            }
            State::Waiting { .. } | State::Cleanup { .. } => false,
        };
        if stands && std::mem::take(&mut t.gated) {
            let taskrun = self.taskrun_ref(key).expect("tracked");
            out.push(Action::Ungate { taskrun });
        }
    }

    /// Creates pool instance entries for listed live instances with a pool's tag: this cluster's
    /// instances of the pool, and untagged ones a TaskRun of the pool's platform names in its
    /// `assigned-host`.
    pub(in crate::scheduler) fn recover_pool_instances(
        &mut self,
        listed: &[InstanceRecord],
        named: &BTreeMap<&str, Vec<Platform>>,
        claimed: &mut BTreeSet<String>,
    ) -> BTreeMap<String, Key> {
        let mut members = BTreeMap::new();
        for rec in listed {
            if rec.state.is_gone()
                || members.contains_key(&rec.id)
                || self.instances.find(rec.id.as_str()).is_some()
            {
                continue;
            }
            let p = self.platform_id(&rec.platform);
            let Mode::Pool(pool) = self.platforms[p as usize].mode.clone() else {
                continue;
            };
            let legacy = rec.ownership == Ownership::Untagged
                && named
                    .get(rec.id.as_str())
                    .is_some_and(|ps| ps.contains(&pool.instance.platform));
            if pool.instance.instance_tag != rec.instance_tag
                || !(legacy || rec.is_ours_for(&self.platforms[p as usize].label))
            {
                continue;
            }
            let inst = self.adopt_listed(p, rec, Arc::new(pool.instance.clone()), Some(pool));
            self.instances.update(inst, |i| i.legacy = legacy);
            claimed.insert(rec.id.clone());
            members.insert(rec.id.clone(), inst);
        }
        members
    }

    /// An entry for a listed running or pending instance, probed at once.
    pub(in crate::scheduler) fn adopt_listed(
        &mut self,
        p: PlatformId,
        rec: &InstanceRecord,
        template: Arc<DynamicPlatform>,
        pool: Option<Arc<DynamicPool>>,
    ) -> Key {
        let timeout = template.allocation_timeout;
        let inst = self.track_instance(p, template, pool.clone());
        let id: Arc<str> = rec.id.as_str().into();
        self.instances.update(inst, |i| {
            i.address = rec.address.as_deref().map(Arc::from);
            i.created = rec.launched_at;
            i.launches = 1;
            i.state = InstState::Booting;
            // Recovered instances may have served builds: never hand them to a dynamic TaskRun.
            i.used = true;
        });
        if let Some(pool) = &pool
            && self.policy.pool_idle_timeout.is_some()
        {
            let at = rec.launched_at + pool.max_age;
            self.timers.arm(at, Timer::MaxAge(inst));
        }
        self.instances.set_id(inst, id);
        let now = self.now;
        self.timers.arm(now, Timer::Probe(inst, 0));
        // Counted from recovery: its launch time says nothing of when it last answered. Without
        // it, a probe answering "pending" forever would hold the slot forever.
        self.timers.arm(now + timeout, Timer::Deadline(inst));
        inst
    }

    /// Rebuilds a live TaskRun's allocation from its evidence; false when it has none.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::scheduler) fn recover_allocation(
        &mut self,
        key: Key,
        p: PlatformId,
        rec: &TaskRunRecord,
        listed: &BTreeMap<&str, &InstanceRecord>,
        pool_members: &BTreeMap<String, Key>,
        claimed: &mut BTreeSet<String>,
        out: &mut Vec<Action>,
    ) -> bool {
        let ready = rec.secret == Some(SecretKind::Remote);
        let phase = if ready {
            Phase::Ready(self.now)
        } else {
            Phase::Reserved
        };
        // Dynamic instance, by annotation or (crash between launch and annotation) by this
        // cluster's owner tag: the latest live one launched for this TaskRun's UID.
        let label = self.platforms[p as usize].label.clone();
        let tagged = || {
            listed
                .values()
                .filter(|l| {
                    l.is_ours_for(&label)
                        && l.owner.as_deref() == Some(rec.uid.as_str())
                        && !l.state.is_gone()
                        && !claimed.contains(&l.id)
                })
                .max_by_key(|l| (l.launched_at, &l.id))
                .map(|l| l.id.clone())
        };
        // Not one a TaskRun rebuilt earlier took: a proven hand-over (rebuilt first) wins over
        // the owner tag its lost retag left naming the previous owner.
        let annotated = self
            .annotated_instance(key, rec, listed, out)
            .filter(|id| self.instances.find(id).is_none());
        // The annotated instance unless the listing says it is gone and another one carries
        // this TaskRun's tag (relaunched just before the crash).
        let annotated_alive = annotated
            .as_deref()
            .is_some_and(|id| listed.get(id).is_some_and(|l| !l.state.is_gone()));
        let by_tag = || {
            matches!(self.platforms[p as usize].mode, Mode::Dynamic(_))
                .then(tagged)
                .flatten()
        };
        let instance_id = if annotated_alive {
            annotated
        } else {
            by_tag().or(annotated)
        };
        if let Some(id) = instance_id {
            claimed.insert(id.clone());
            let template = listed
                .get(id.as_str())
                .and_then(|l| self.dynamic_template(&l.platform))
                .or_else(|| match &self.platforms[p as usize].mode {
                    Mode::Dynamic(t) => Some(t.clone()),
                    _ => None,
                });
            let Some(template) = template else {
                // No credentials to manage it with: the TaskRun keeps its secret, if any.
                return ready;
            };
            let rec_i = listed.get(id.as_str()).copied();
            let inst = self.track_instance(p, template.clone(), None);
            let id: Arc<str> = id.as_str().into();
            self.instances.update(inst, |i| {
                i.address = rec_i.and_then(|l| l.address.as_deref()).map(Arc::from);
                i.created = rec_i.map_or(rec.since, |l| l.launched_at);
                i.launches = 1;
                i.legacy = rec_i.is_none_or(|l| l.ownership != Ownership::Ours);
                i.used = ready;
                i.state = if ready {
                    InstState::Ready
                } else {
                    InstState::Booting
                };
            });
            self.instances.set_id(inst, id.clone());
            // Its owner from now on.
            self.set_state(key, State::OnInstance { inst, phase });
            // Handed over, and the retag was lost: tagged again, so listings (and sweeps) find
            // it under its owner. Should this one fail too, the proof still holds.
            if rec_i.is_some_and(|l| !l.belongs_to(rec) && l.handed_to(rec))
                && let Some(launch) = self.launch_id_for(key)
            {
                out.push(Action::Retag {
                    instance_id: id.clone(),
                    template: template.clone(),
                    launch,
                });
            }
            if !ready {
                let now = self.now;
                self.timers.arm(now, Timer::Probe(inst, 0));
                let at = self.now + template.allocation_timeout;
                self.timers.arm(at, Timer::Deadline(inst));
                if rec.instance_id.as_deref() != Some(&*id_of(self, inst)) {
                    self.record_instance(key, inst, out);
                }
            }
            return true;
        }
        let Some(host) = rec.assigned_host.as_deref() else {
            return false;
        };
        if let Some(&inst) = pool_members.get(host) {
            let fits = self.instances.get(inst).is_some_and(|i| {
                i.platform() == p
                    && i.pool
                        .as_ref()
                        .is_some_and(|pool| i.attached.len() < pool.concurrency as usize)
            });
            if !fits {
                return false;
            }
            self.instances.update(inst, |i| {
                i.used = true;
                // A pool's `assigned-host` is written once the instance was reachable.
                i.booted = true;
            });
            // Attached to it from now on.
            self.set_state(key, State::OnInstance { inst, phase });
            // Not ready: provisioned once the probe finds the instance reachable.
            return true;
        }
        if host == crate::contract::LOCALHOST {
            return false;
        }
        let known = self.hosts.id(host);
        let def = known.and_then(|h| self.hosts[h].def.clone());
        if def.is_none() && !(ready && rec.secret_proven) {
            // Assigned to a host we cannot reach and never served, or not provably by us (the
            // config cannot confirm it): start over.
            return false;
        }
        if let (Some(h), Some(def)) = (known, &def) {
            let host = &self.hosts[h];
            // A proven, served allocation stays where its build runs even when the config shrank
            // the host meanwhile (the host drains, as after a live config change): moving it would
            // hand the attempt a second secret and leave its user behind.
            let keeps = ready && rec.secret_proven;
            // A TaskRun with the same (colliding) user name already rebuilt on this host keeps
            // it: two builds must not share one user, and removing one's would end the other's.
            let rival = self
                .user_guard(key)
                .is_some_and(|g| self.user_blocked(&g, super::users::Target::Host(h)));
            // A drained host has capacity 0: only proven, served allocations stay on it.
            if host.platform != p || (host.load() >= def.capacity() && !keeps) || rival {
                // Not a host of its platform, or full with allocations already rebuilt: the
                // claim is not the controller's (or no longer fits): queued again.
                return false;
            }
        }
        // A running build on a host the config dropped is still counted against it.
        let hid = known.unwrap_or_else(|| self.hosts.retired(host));
        match def {
            Some(def) if !ready => self.start_static_provisioning(key, hid, def, out),
            def => {
                self.set_state(
                    key,
                    State::OnHost {
                        host: hid,
                        def,
                        phase,
                    },
                );
            }
        }
        true
    }

    /// The TaskRun's `cloud-instance-id`, when the listing shows the instance as this TaskRun's
    /// or the TaskRun's proven allocation names it ([`InstanceRecord::claimed_by`]). One the listing shows as another's is never touched, and
    /// the TaskRun is told; one it does not show is gone (or unverifiable): not the TaskRun's.
    pub(in crate::scheduler) fn annotated_instance(
        &self,
        key: Key,
        rec: &TaskRunRecord,
        listed: &BTreeMap<&str, &InstanceRecord>,
        out: &mut Vec<Action>,
    ) -> Option<String> {
        let id = rec.instance_id.as_deref()?;
        let l = listed.get(id)?;
        if l.claimed_by(rec) {
            return Some(id.to_owned());
        }
        let (reason, whose) = if l.ownership == Ownership::Foreign {
            ("ForeignInstance", "another cluster launched")
        } else {
            ("NotItsInstance", "was not launched for this TaskRun")
        };
        out.push(Action::Notify {
            taskrun: self.taskrun_ref(key),
            warning: true,
            reason,
            message: format!("cloud-instance-id names instance {id}, which {whose}; ignoring it"),
        });
        None
    }

    pub(in crate::scheduler) fn dynamic_template(
        &mut self,
        platform: &Platform,
    ) -> Option<Arc<DynamicPlatform>> {
        let p = self.platform_id(platform);
        match &self.platforms[p as usize].mode {
            Mode::Dynamic(t) => Some(t.clone()),
            Mode::Pool(pool) => Some(Arc::new(pool.instance.clone())),
            _ => None,
        }
    }

    /// Cleanup for a TaskRun that finished while we were away.
    pub(in crate::scheduler) fn recover_finished(
        &mut self,
        key: Key,
        rec: &TaskRunRecord,
        (listed, pool_members): (&BTreeMap<&str, &InstanceRecord>, &BTreeMap<String, Key>),
        (live_named, live_users): (&BTreeSet<String>, &BTreeSet<(String, String)>),
        out: &mut Vec<Action>,
    ) {
        self.set_state(key, State::Cleanup { pending: 0 });
        // Unconditionally: recovery does not read a finished TaskRun's secret (`rec.secret` is
        // unknown then), and deleting one that is absent is a no-op.
        self.delete_secret(key, out);
        let p = self.taskruns.get(key).map_or(NO_PLATFORM, |t| t.platform);
        let mut pending = 0;
        let annotated = self.annotated_instance(key, rec, listed, out);
        if annotated.as_ref().is_some_and(|id| live_named.contains(id)) {
            // Handed over, never used by this one: nothing of it to clean.
        } else if let Some(id) = &annotated {
            let l = listed.get(id.as_str()).copied();
            let template = match l {
                Some(l) => self.dynamic_template(&l.platform),
                None if p != NO_PLATFORM => match &self.platforms[p as usize].mode {
                    Mode::Dynamic(t) => Some(t.clone()),
                    _ => None,
                },
                None => None,
            };
            // A stopped instance is still terminated; one going down needs nothing.
            if let (Some(template), false) = (template, l.is_some_and(|l| l.state.is_terminating()))
            {
                let ip = if p == NO_PLATFORM {
                    self.platform_id(&l.expect("template came from the listing").platform)
                } else {
                    p
                };
                let inst = self.track_instance(ip, template, None);
                let id: Arc<str> = id.as_str().into();
                self.instances.update(inst, |i| {
                    i.state = InstState::Ready;
                    i.used = true;
                    i.legacy = l.is_none_or(|l| l.ownership != Ownership::Ours);
                });
                self.instances.set_id(inst, id);
                self.instances.await_termination(inst, key);
                self.terminate(inst, "its TaskRun finished", out);
                pending += 1;
            }
        } else if let Some(host) = rec.assigned_host.as_deref()
            && !live_users.contains(&(
                crate::contract::remote_user_name(&rec.name, &rec.namespace),
                host.to_owned(),
            ))
        {
            let target = if let Some(&inst) = pool_members.get(host) {
                self.instances.get(inst).and_then(|i| {
                    Some(HostRef::Instance {
                        id: i.id().cloned()?,
                        address: i.address.clone()?,
                        template: i.template.clone(),
                    })
                })
            } else {
                self.hosts
                    .id(host)
                    .and_then(|h| self.hosts[h].def.clone())
                    .map(HostRef::Static)
            };
            if let (Some(target), Some(r)) = (target, self.taskrun_ref(key)) {
                self.deprovision(Some(key), p, RemoteUser::Of(r), target, out);
                pending += 1;
            }
        }
        self.set_state(key, State::Cleanup { pending });
        if pending == 0 {
            self.finalize(key, out);
        }
    }

    /// Listed instances of ours nothing claims: counted, and terminated after the grace period
    /// unless a TaskRun turns out to own them.
    pub(in crate::scheduler) fn recover_orphans(
        &mut self,
        listed: &[InstanceRecord],
        claimed: &BTreeSet<String>,
        pool_members: &BTreeMap<String, Key>,
        out: &mut Vec<Action>,
    ) {
        for rec in listed {
            if rec.state.is_gone()
                || claimed.contains(&rec.id)
                || pool_members.contains_key(&rec.id)
                || self.instances.find(rec.id.as_str()).is_some()
            {
                continue;
            }
            let Some(template) = self.dynamic_template(&rec.platform) else {
                continue;
            };
            let p = self.platform_id(&rec.platform);
            // A listing's orphans are this cluster's instances of the listing's platform.
            if template.instance_tag != rec.instance_tag
                || !rec.is_ours_for(&self.platforms[p as usize].label)
            {
                continue;
            }
            self.orphan(p, rec, template, out);
        }
    }

    /// Marks the snapshot's unlisted dynamic platforms and holds their TaskRuns; returns the
    /// others.
    pub(in crate::scheduler) fn hold_unlisted(
        &mut self,
        taskruns: Vec<TaskRunRecord>,
        unlisted: &[Platform],
        out: &mut Vec<Action>,
    ) -> Vec<TaskRunRecord> {
        for platform in unlisted {
            let p = self.platform_id(platform);
            let ps = &mut self.platforms[p as usize];
            // Only a platform the config lists: any other has no listing to wait for.
            if matches!(ps.mode, Mode::Dynamic(_) | Mode::Pool(_)) {
                ps.unlisted = true;
            }
        }
        let mut rest = Vec::with_capacity(taskruns.len());
        let mut held: Vec<u32> = vec![0; self.platforms.len()];
        for rec in taskruns {
            let p = Platform::parse(&rec.platform)
                .ok()
                .and_then(|pl| self.platform_ids.get(&pl).copied())
                .filter(|&p| self.platforms[p as usize].unlisted);
            match p {
                Some(p) => {
                    held[p as usize] += 1;
                    self.held.insert(
                        Uid::new(&rec.uid),
                        Held {
                            platform: p,
                            record: rec,
                            released: false,
                            spec: None,
                        },
                    );
                }
                None => rest.push(rec),
            }
        }
        for (p, ps) in self.platforms.iter().enumerate() {
            if ps.unlisted {
                out.push(Action::Notify {
                    taskrun: None,
                    warning: true,
                    reason: "PlatformUnlisted",
                    message: format!(
                        "the cloud listing of {} failed at startup: its {} TaskRun(s) are held as \
                         recorded and nothing is launched for it until a listing succeeds",
                        ps.platform, held[p]
                    ),
                });
            }
        }
        rest
    }
}

fn id_of(s: &Scheduler, inst: Key) -> Arc<str> {
    s.instances
        .get(inst)
        .and_then(|i| i.id().cloned())
        .unwrap_or_else(|| "".into())
}

/// The record's labels name a host or instance.
fn allocated(rec: &TaskRunRecord) -> bool {
    rec.assigned_host.is_some() || rec.instance_id.is_some()
}
