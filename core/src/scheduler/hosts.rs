//! Static host pools: least-loaded placement, per-host load accounting and health back-off.
//!
//! Hosts with room sit in an ordered set keyed by (load / concurrency, rank by name), so the
//! least-loaded host (ties: by name) is the first entry: O(log hosts) per decision.
//!
//! A host is in that set exactly when it is configured for a platform, not backing off and below
//! its concurrency. Its load and back-off live in a [`Room`] that only the methods of the private
//! `room` module change, and each of them re-indexes the host in the same call: no path (a
//! release, a retry's re-provisioning, a back-off tripping or ending) can leave a full or
//! backing-off host taking new work.

use std::sync::Arc;

use super::arena::Key;
use super::lifecycle::Placed;
use super::users::Target;
use super::{Action, HostId, HostRef, Phase, PlatformId, Scheduler, State, Timer, messages};
use crate::config::StaticHost;

pub(super) use room::Room;

mod room {
    use super::super::{HostId, NO_PLATFORM, PlatformId, Scheduler, Time};
    use crate::config::StaticHost;

    /// Least common multiple of 1..=8 (the concurrency range): load / concurrency scaled by it
    /// is an exact integer, so hosts of different sizes compare by true load ratio.
    const RATIO_SCALE: u32 = 840;

    /// What decides whether a host takes new work. Its fields are private to this module: they
    /// change only through the methods below, which re-index the host before returning.
    #[derive(Default)]
    pub(in crate::scheduler) struct Room {
        load: u32,
        backoff_until: Option<Time>,
        indexed: Option<(u32, u32, HostId)>,
    }

    impl Room {
        /// TaskRuns holding a slot on the host.
        pub(in crate::scheduler) fn load(&self) -> u32 {
            self.load
        }

        /// The host sits out a back-off period.
        pub(in crate::scheduler) fn backing_off(&self) -> bool {
            self.backoff_until.is_some()
        }

        /// When the back-off ends, if the host backs off.
        pub(in crate::scheduler) fn backoff_until(&self) -> Option<Time> {
            self.backoff_until
        }

        /// The key the host is indexed under now.
        pub(in crate::scheduler) fn indexed(&self) -> Option<(u32, u32, HostId)> {
            self.indexed
        }

        /// The key the host belongs under in its platform's set of hosts with room (`None`:
        /// not in it), given its definition, platform and rank.
        pub(in crate::scheduler) fn wanted_key(
            &self,
            hid: HostId,
            def: Option<&StaticHost>,
            platform: PlatformId,
            rank: u32,
        ) -> Option<(u32, u32, HostId)> {
            let def = def?;
            if platform == NO_PLATFORM
                || self.backoff_until.is_some()
                || self.load >= def.concurrency
            {
                return None;
            }
            Some((self.load * RATIO_SCALE / def.concurrency.max(1), rank, hid))
        }
    }

    impl Scheduler {
        /// A TaskRun takes a slot on the host.
        pub(in crate::scheduler) fn add_load(&mut self, hid: HostId) {
            self.hosts[hid as usize].room.load += 1;
            self.reindex_host(hid);
        }

        /// A TaskRun left the host.
        pub(in crate::scheduler) fn release_host(&mut self, hid: HostId) {
            let r = &mut self.hosts[hid as usize].room;
            r.load = r.load.saturating_sub(1);
            self.reindex_host(hid);
        }

        /// Starts (`Some(until)`) or ends (`None`) the host's back-off.
        pub(in crate::scheduler) fn set_backoff(&mut self, hid: HostId, until: Option<Time>) {
            self.hosts[hid as usize].room.backoff_until = until;
            self.reindex_host(hid);
        }

        /// Puts the host in (or takes it out of) its platform's set of hosts with room, from its
        /// room and its current definition, platform and rank (after a config change).
        pub(in crate::scheduler) fn reindex_host(&mut self, hid: HostId) {
            let h = &mut self.hosts[hid as usize];
            if let Some(k) = h.room.indexed.take()
                && h.platform != NO_PLATFORM
            {
                self.platforms[h.platform as usize].avail.remove(&k);
            }
            let Some(k) = h.room.wanted_key(hid, h.def.as_deref(), h.platform, h.rank) else {
                return;
            };
            h.room.indexed = Some(k);
            self.platforms[h.platform as usize].avail.insert(k);
        }
    }
}

impl Scheduler {
    pub(super) fn place_static(
        &mut self,
        p: PlatformId,
        key: Key,
        out: &mut Vec<Action>,
    ) -> Placed {
        let guard = self.user_guard(key);
        let mut chosen = None;
        let mut kept_off = false;
        for &(_, _, hid) in &self.platforms[p as usize].avail {
            if self.failed_on(key, &self.hosts[hid as usize].name) {
                continue;
            }
            if guard
                .as_ref()
                .is_some_and(|g| self.user_blocked(g, Target::Host(hid)))
            {
                kept_off = true;
                continue;
            }
            chosen = Some(hid);
            break;
        }
        let Some(hid) = chosen else {
            if kept_off {
                return Placed::NoRoom;
            }
            if self.fail_if_all_hosts_failed(p, key, out) {
                return Placed::Done;
            }
            return Placed::NoRoom;
        };
        let def = self.hosts[hid as usize]
            .def
            .clone()
            .expect("only configured hosts are indexed");
        self.add_load(hid);
        self.observe_wait(key, out);
        self.observe_allocated(key, None, out);
        self.start_static_provisioning(key, hid, def, out);
        Placed::Done
    }

    /// Moves `key` onto static host `hid` (load already counted) and asks for provisioning.
    pub(super) fn start_static_provisioning(
        &mut self,
        key: Key,
        hid: HostId,
        def: Arc<StaticHost>,
        out: &mut Vec<Action>,
    ) {
        let host = HostRef::Static(def.clone());
        let op = self.provision_op(key, &host);
        if let Some(t) = self.taskruns.get_mut(key) {
            t.state = State::OnHost {
                host: hid,
                def: Some(def),
                phase: Phase::Provisioning(op),
            };
        }
        self.emit_provision(key, op, host, None, out);
    }

    /// Gives `key` its error secret when every host of static platform `p` failed for it.
    pub(super) fn fail_if_all_hosts_failed(
        &mut self,
        p: PlatformId,
        key: Key,
        out: &mut Vec<Action>,
    ) -> bool {
        let hosts = &self.platforms[p as usize].hosts;
        let all_failed = !hosts.is_empty()
            && hosts
                .iter()
                .all(|&h| self.failed_on(key, &self.hosts[h as usize].name));
        if all_failed {
            let msg = messages::all_hosts_failed(
                &self.platforms[p as usize].platform,
                &self.failed_list(key),
            );
            self.fail(key, msg, out);
        }
        all_failed
    }

    /// A host entry for a name the config does not have (an allocation found after a restart).
    pub(super) fn retired_host(&mut self, name: &str) -> HostId {
        if let Some(&h) = self.host_ids.get(name) {
            return h;
        }
        let h = self.hosts.len() as HostId;
        let name: std::sync::Arc<str> = name.into();
        self.hosts.push(super::Host {
            name: name.clone(),
            def: None,
            platform: super::NO_PLATFORM,
            rank: u32::MAX,
            room: Room::default(),
            failures: 0,
            backoff_level: 0,
        });
        self.host_ids.insert(name, h);
        h
    }

    /// Provisioning worked: the host is healthy.
    pub(super) fn provision_ok_on(&mut self, key: Key, _out: &mut Vec<Action>) {
        match self.taskruns.get(key).map(|t| &t.state) {
            Some(State::OnHost { host, .. }) => {
                let h = &mut self.hosts[*host as usize];
                h.failures = 0;
                h.backoff_level = 0;
            }
            Some(State::OnInstance { inst, .. }) => {
                if let Some(i) = self.instances.get_mut(*inst) {
                    i.provision_failures = 0;
                }
            }
            _ => {}
        }
    }

    /// Provisioning failed: after repeated failures the host sits out a back-off period that
    /// doubles each time it trips again without a success in between.
    pub(super) fn host_failed(&mut self, hid: HostId, out: &mut Vec<Action>) {
        let Some(b) = self.policy.host_backoff else {
            return;
        };
        let h = &mut self.hosts[hid as usize];
        h.failures += 1;
        if h.failures < b.after_failures || h.room.backing_off() {
            return;
        }
        // One more failure after the back-off trips it again (half-open).
        h.failures = b.after_failures.saturating_sub(1);
        let d = b
            .base
            .checked_mul(1u32 << h.backoff_level.min(16))
            .unwrap_or(b.max)
            .min(b.max);
        h.backoff_level += 1;
        let until = self.now + d;
        let level = h.backoff_level;
        let name = h.name.clone();
        self.set_backoff(hid, Some(until));
        self.arm(until, Timer::HostBack(hid, level));
        out.push(Action::Notify {
            taskrun: None,
            warning: true,
            reason: "HostBackedOff",
            message: format!(
                "host {name} failed provisioning {} times in a row; no new builds go to it for {} s",
                b.after_failures,
                d.as_secs()
            ),
        });
    }

    pub(super) fn host_back_due(&mut self, hid: HostId, level: u32, out: &mut Vec<Action>) {
        let h = &self.hosts[hid as usize];
        if h.backoff_level != level || !h.room.backing_off() {
            return;
        }
        let p = h.platform;
        self.set_backoff(hid, None);
        self.capacity_freed(p, out);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{H, provision_op, provisions, static_pairs};
    use super::super::{Blame, Event, Policy};

    const P: &str = "linux/s390x";

    /// `a` served on `h1` (concurrency 4), then retried: the retry's re-provisioning on `h1` is
    /// in flight (its op returned).
    fn retry_on_h1() -> (H, super::super::OpId) {
        let mut h = H::new(&static_pairs(&[("h1", 4)]));
        let op = provision_op(&h.submit("ns", "a", P), "a");
        h.send(Event::Provisioned {
            op,
            otp: "first".into(),
        });
        let mut spec = H::spec("ns", "a", P);
        spec.retries = 1;
        let op = provision_op(&h.send(Event::TaskRun(spec)), "a");
        (h, op)
    }

    /// A retry's re-provisioning keeps its slot and tries its host again (no release, no
    /// re-queueing): when those failures trip the host's back-off, the host must still leave the
    /// index of hosts with room, or it keeps taking new work while backing off.
    #[test]
    fn a_host_backing_off_on_a_retrys_re_provisioning_takes_no_new_work() {
        let (mut h, mut op) = retry_on_h1();
        let trips = Policy::mpc()
            .host_backoff
            .expect("mpc backs off")
            .after_failures;
        assert!(
            trips < Policy::mpc().rearm_attempts,
            "trips on the retry path"
        );
        for n in 1..=trips {
            let a = h.send(Event::ProvisionFailed {
                op,
                error: "connection refused".into(),
                blame: Blame::Host,
            });
            assert!(provisions(&a).is_empty(), "{a:#?}");
            let backed_off = a.iter().any(|x| {
                matches!(
                    x,
                    super::super::Action::Notify {
                        reason: "HostBackedOff",
                        ..
                    }
                )
            });
            assert_eq!(backed_off, n == trips, "failure {n}: {a:#?}");
            if n < trips {
                let a = h.wait(Policy::mpc().rearm_backoff.as_secs() * 4);
                op = provision_op(&a, "a");
            }
        }
        // h1 has room (1 of 4) but backs off: new work waits.
        let b = h.submit("ns", "b", P);
        assert!(
            provisions(&b).is_empty(),
            "a host backing off took new work: {b:#?}"
        );
        // Back after the back-off: b goes there.
        let base = Policy::mpc().host_backoff.unwrap().base.as_secs();
        let a = h.wait(base + 1);
        assert!(
            provisions(&a)
                .iter()
                .any(|(_, n, host)| n == "b" && host == "h1"),
            "{a:#?}"
        );
    }

    fn backed_off(a: &[super::super::Action]) -> bool {
        a.iter().any(|x| {
            matches!(
                x,
                super::super::Action::Notify {
                    reason: "HostBackedOff",
                    ..
                }
            )
        })
    }

    /// A failure that is not the host's (the admin-key Secret is missing, the request is bad)
    /// says nothing about the host: however many there are, the host keeps taking new work.
    #[test]
    fn failures_not_blamed_on_the_host_do_not_back_it_off() {
        let trips = Policy::mpc()
            .host_backoff
            .expect("mpc backs off")
            .after_failures;
        for blame in [Blame::Controller, Blame::Request] {
            let mut h = H::new(&static_pairs(&[("h1", 8)]));
            for n in 0..=trips {
                let name = format!("a{n}");
                let op = provision_op(&h.submit("ns", &name, P), &name);
                let a = h.send(Event::ProvisionFailed {
                    op,
                    error: "Secret mpc/host-key not found".into(),
                    blame,
                });
                assert!(
                    !backed_off(&a),
                    "{blame:?} failure {n} backed h1 off: {a:#?}"
                );
            }
            let b = h.submit("ns", "b", P);
            assert!(
                provisions(&b)
                    .iter()
                    .any(|(_, n, host)| n == "b" && host == "h1"),
                "{blame:?}: h1 took no new work: {b:#?}"
            );
        }
    }

    /// The same on a retry's re-provisioning, which keeps its slot on the host.
    #[test]
    fn a_retrys_failures_not_blamed_on_the_host_do_not_back_it_off() {
        let (mut h, mut op) = retry_on_h1();
        let trips = Policy::mpc().host_backoff.unwrap().after_failures;
        for n in 1..=trips {
            let a = h.send(Event::ProvisionFailed {
                op,
                error: "Secret mpc/host-key not found".into(),
                blame: Blame::Controller,
            });
            assert!(!backed_off(&a), "failure {n} backed h1 off: {a:#?}");
            if n < trips {
                let a = h.wait(Policy::mpc().rearm_backoff.as_secs() * 4);
                op = provision_op(&a, "a");
            }
        }
        let b = h.submit("ns", "b", P);
        assert!(
            provisions(&b)
                .iter()
                .any(|(_, n, host)| n == "b" && host == "h1"),
            "h1 took no new work: {b:#?}"
        );
    }
}
