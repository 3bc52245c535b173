//! Static host pools: the least-loaded placement strategy, per-host load accounting and health
//! back-off. The load follows the TaskRuns on a host through the transitions (`transition.rs`).
//!
//! A drained host (`drain: "true"` or `concurrency: "0"`) has capacity 0: it leaves the index of
//! hosts with room, so it takes no new TaskRun; the TaskRuns on it keep the definition they were
//! allocated under, finish there, and their users are removed from it. A Tekton retry of a build
//! on it is that build: its pod mounted the secret naming the host, so it is re-armed there once
//! (a re-arm that fails goes by the current config, and moves elsewhere). Waiters of a platform whose every host is drained wait (no error
//! secret), and are served when a config lifts the drain (`reconfig.rs` pumps every platform).
//!
//! Hosts with room sit in an ordered set per platform keyed by (load / concurrency, rank by
//! name), so the least-loaded host (ties: by name) is the first entry: O(log hosts) per decision.
//!
//! The hosts, their names and those sets are owned by [`Hosts`] (the private `table` module): a
//! host is in its platform's set exactly when it is configured for the platform, not backing off
//! and below its capacity (its concurrency, 0 while drained). Its definition, load and back-off change only through the table's
//! methods, and each of them re-indexes the host in the same call: no path (a release, a retry's
//! re-provisioning, a back-off tripping or ending, a config change) can leave a full or
//! backing-off host taking new work.

use super::arena::Key;
use super::handoff::Choice;
use super::users::Target;
use super::{PlatformId, Scheduler, messages};

pub(super) use table::Hosts;

mod table {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Arc;

    use super::super::invariant::{Invariant, StateError, ensure};
    use super::super::{HostBackoff, HostId, NO_PLATFORM, PlatformId, Time};
    use crate::config::StaticHost;

    /// Least common multiple of 1..=8 (the concurrency range): load / concurrency scaled by it
    /// is an exact integer, so hosts of different sizes compare by true load ratio.
    const RATIO_SCALE: u32 = 840;

    /// A static host: configured, or retired (an allocation found after a restart names a host
    /// the config no longer has).
    pub(in crate::scheduler) struct Host {
        pub(in crate::scheduler) name: Arc<str>,
        /// Current definition; `None` once removed from the config.
        pub(in crate::scheduler) def: Option<Arc<StaticHost>>,
        pub(in crate::scheduler) platform: PlatformId,
        /// Position by name among all hosts: the tie-break between equally loaded hosts.
        rank: u32,
        /// TaskRuns holding a slot on the host.
        load: u32,
        backoff_until: Option<Time>,
        /// Provisioning failures in a row.
        failures: u32,
        /// Back-offs in a row without a success in between.
        pub(in crate::scheduler) backoff_level: u32,
        /// The key it is indexed under among its platform's hosts with room.
        indexed: Option<(u32, u32, HostId)>,
    }

    impl Host {
        fn new(name: Arc<str>, rank: u32) -> Self {
            Host {
                name,
                def: None,
                platform: NO_PLATFORM,
                rank,
                load: 0,
                backoff_until: None,
                failures: 0,
                backoff_level: 0,
                indexed: None,
            }
        }

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

        /// The key the host belongs under in its platform's set of hosts with room (`None`:
        /// not in it).
        fn wanted_key(&self, hid: HostId) -> Option<(u32, u32, HostId)> {
            let def = self.def.as_ref()?;
            // A drained host has no room (capacity 0), whatever its load.
            if self.platform == NO_PLATFORM
                || self.backoff_until.is_some()
                || self.load >= def.capacity()
            {
                return None;
            }
            Some((
                self.load * RATIO_SCALE / def.capacity().max(1),
                self.rank,
                hid,
            ))
        }
    }

    /// A back-off that just started.
    pub(in crate::scheduler) struct BackedOff {
        pub(in crate::scheduler) until: Time,
        pub(in crate::scheduler) level: u32,
        pub(in crate::scheduler) period: std::time::Duration,
    }

    #[derive(Default)]
    struct PerPlatform {
        /// Hosts with room: (load / concurrency scaled to 840, rank by name, id).
        avail: BTreeSet<(u32, u32, HostId)>,
        /// Hosts configured for the platform, by rank.
        configured: Vec<HostId>,
    }

    /// Static hosts by id and name, with each platform's hosts and hosts with room.
    #[derive(Default)]
    pub(in crate::scheduler) struct Hosts {
        hosts: Vec<Host>,
        ids: BTreeMap<Arc<str>, HostId>,
        /// By platform id; platforms past the end have no hosts.
        platforms: Vec<PerPlatform>,
    }

    impl std::ops::Index<HostId> for Hosts {
        type Output = Host;
        fn index(&self, hid: HostId) -> &Host {
            &self.hosts[hid as usize]
        }
    }

    impl Hosts {
        pub(in crate::scheduler) fn get(&self, hid: HostId) -> Option<&Host> {
            self.hosts.get(hid as usize)
        }

        /// The host with this name.
        pub(in crate::scheduler) fn id(&self, name: &str) -> Option<HostId> {
            self.ids.get(name).copied()
        }

        /// Hosts of platform `p` with room, least loaded first (ties: by name).
        pub(in crate::scheduler) fn with_room(
            &self,
            p: PlatformId,
        ) -> impl Iterator<Item = HostId> + '_ {
            self.platforms
                .get(p as usize)
                .into_iter()
                .flat_map(|pp| pp.avail.iter().map(|&(_, _, h)| h))
        }

        /// Platform `p` has a host with room.
        pub(in crate::scheduler) fn has_room(&self, p: PlatformId) -> bool {
            self.platforms
                .get(p as usize)
                .is_some_and(|pp| !pp.avail.is_empty())
        }

        /// Hosts configured for platform `p`, by rank.
        pub(in crate::scheduler) fn of_platform(&self, p: PlatformId) -> &[HostId] {
            self.platforms
                .get(p as usize)
                .map_or(&[], |pp| pp.configured.as_slice())
        }

        /// A TaskRun takes a slot on the host.
        pub(in crate::scheduler) fn add_load(&mut self, hid: HostId) {
            self.hosts[hid as usize].load += 1;
            self.reindex(hid);
        }

        /// A TaskRun left the host.
        pub(in crate::scheduler) fn release(&mut self, hid: HostId) {
            let h = &mut self.hosts[hid as usize];
            h.load = h.load.saturating_sub(1);
            self.reindex(hid);
        }

        /// Ends the host's back-off.
        pub(in crate::scheduler) fn end_backoff(&mut self, hid: HostId) {
            self.hosts[hid as usize].backoff_until = None;
            self.reindex(hid);
        }

        /// Provisioning on the host worked: it is healthy.
        pub(in crate::scheduler) fn succeeded(&mut self, hid: HostId) {
            let h = &mut self.hosts[hid as usize];
            h.failures = 0;
            h.backoff_level = 0;
        }

        /// Provisioning on the host failed: after `b.after_failures` failures in a row it sits
        /// out a back-off period that doubles each time it trips again without a success in
        /// between. Returns the back-off when one starts.
        pub(in crate::scheduler) fn failed(
            &mut self,
            hid: HostId,
            b: HostBackoff,
            now: Time,
        ) -> Option<BackedOff> {
            let h = &mut self.hosts[hid as usize];
            h.failures += 1;
            if h.failures < b.after_failures || h.backing_off() {
                return None;
            }
            // One more failure after the back-off trips it again (half-open).
            h.failures = b.after_failures.saturating_sub(1);
            let period = b
                .base
                .checked_mul(1u32 << h.backoff_level.min(16))
                .unwrap_or(b.max)
                .min(b.max);
            h.backoff_level += 1;
            let until = now + period;
            h.backoff_until = Some(until);
            let level = h.backoff_level;
            self.reindex(hid);
            Some(BackedOff {
                until,
                level,
                period,
            })
        }

        /// A host entry for a name the config does not have (an allocation found after a
        /// restart).
        pub(in crate::scheduler) fn retired(&mut self, name: &str) -> HostId {
            if let Some(&h) = self.ids.get(name) {
                return h;
            }
            let h = self.hosts.len() as HostId;
            let name: Arc<str> = name.into();
            self.hosts.push(Host::new(name.clone(), u32::MAX));
            self.ids.insert(name, h);
            h
        }

        /// Applies the config's hosts (with their platforms' ids): new ones are added, known ones
        /// take their new definition, others keep their entry without one; ranks and every
        /// platform's sets are rebuilt.
        pub(in crate::scheduler) fn apply(&mut self, defs: Vec<(StaticHost, PlatformId)>) {
            let mut seen = BTreeSet::new();
            for (def, platform) in defs {
                let name: Arc<str> = def.name.as_str().into();
                let hid = match self.ids.get(&name) {
                    Some(&h) => h,
                    None => {
                        let h = self.hosts.len() as HostId;
                        self.hosts.push(Host::new(name.clone(), 0));
                        self.ids.insert(name.clone(), h);
                        h
                    }
                };
                let h = &mut self.hosts[hid as usize];
                if h.def.as_deref() != Some(&def) {
                    h.def = Some(Arc::new(def));
                }
                h.platform = platform;
                seen.insert(hid);
            }
            for (hid, h) in self.hosts.iter_mut().enumerate() {
                if !seen.contains(&(hid as HostId)) {
                    h.def = None;
                    h.platform = NO_PLATFORM;
                }
            }
            for pp in &mut self.platforms {
                pp.avail.clear();
                pp.configured.clear();
            }
            // The ids iterate in name order: that is the tie-break rank.
            let order: Vec<HostId> = self.ids.values().copied().collect();
            for (rank, hid) in order.into_iter().enumerate() {
                let h = &mut self.hosts[hid as usize];
                h.rank = rank as u32;
                // Its old key went with the cleared sets.
                h.indexed = None;
                if h.def.is_some() && h.platform != NO_PLATFORM {
                    let p = h.platform;
                    self.platform_mut(p).configured.push(hid);
                }
                self.reindex(hid);
            }
        }

        fn platform_mut(&mut self, p: PlatformId) -> &mut PerPlatform {
            let i = p as usize;
            if self.platforms.len() <= i {
                self.platforms.resize_with(i + 1, PerPlatform::default);
            }
            &mut self.platforms[i]
        }

        /// Puts the host in (or takes it out of) its platform's set of hosts with room.
        fn reindex(&mut self, hid: HostId) {
            let h = &mut self.hosts[hid as usize];
            let old = h.indexed.take();
            let new = h.wanted_key(hid);
            h.indexed = new;
            let p = h.platform;
            if let Some(k) = old
                && let Some(pp) = self.platforms.get_mut(p as usize)
            {
                pp.avail.remove(&k);
            }
            if let Some(k) = new {
                self.platform_mut(p).avail.insert(k);
            }
        }

        /// Ids and names map to each other; each platform's sets hold exactly its hosts with
        /// room (under the keys their room gives) and its configured hosts by rank.
        pub(in crate::scheduler) fn check(&self, platforms: usize) -> Result<(), StateError> {
            use Invariant::*;
            ensure(self.ids.len() == self.hosts.len(), HostIds, || {
                format!("{} ids for {} hosts", self.ids.len(), self.hosts.len())
            })?;
            let mut avail = vec![BTreeSet::new(); self.platforms.len().max(platforms)];
            let mut configured = vec![Vec::new(); avail.len()];
            for (hid, h) in self.hosts.iter().enumerate() {
                let hid = hid as HostId;
                ensure(self.ids.get(&h.name) == Some(&hid), HostIds, || {
                    format!("{} is not id {hid}", h.name)
                })?;
                ensure(
                    h.platform == NO_PLATFORM || (h.platform as usize) < platforms,
                    Invariant::Platforms,
                    || format!("host {} has platform id {}", h.name, h.platform),
                )?;
                let want = h.wanted_key(hid);
                ensure(h.indexed == want, HostRoom, || {
                    format!(
                        "host {} is indexed as {:?}, its room says {want:?}",
                        h.name, h.indexed
                    )
                })?;
                if let Some(k) = want {
                    avail[h.platform as usize].insert(k);
                }
                if h.def.is_some() && h.platform != NO_PLATFORM {
                    configured[h.platform as usize].push((h.rank, hid));
                }
            }
            for (p, (avail, mut configured)) in avail.into_iter().zip(configured).enumerate() {
                let (have, listed) = self
                    .platforms
                    .get(p)
                    .map_or((BTreeSet::new(), Vec::new()), |pp| {
                        (pp.avail.clone(), pp.configured.clone())
                    });
                ensure(have == avail, HostRoom, || {
                    format!("platform {p}: set {have:?}, hosts say {avail:?}")
                })?;
                configured.sort_unstable();
                let want: Vec<HostId> = configured.into_iter().map(|(_, h)| h).collect();
                ensure(listed == want, PlatformHosts, || {
                    format!("platform {p}: list {listed:?}, hosts say {want:?}")
                })?;
            }
            Ok(())
        }

        /// Test hook: a stale entry in platform `p`'s set of hosts with room.
        #[cfg(test)]
        pub(in crate::scheduler) fn corrupt_avail(&mut self, p: PlatformId, hid: HostId) {
            self.platform_mut(p).avail.insert((0, 0, hid));
        }

        /// Test hook: forgets platform `p`'s list of configured hosts.
        #[cfg(test)]
        pub(in crate::scheduler) fn corrupt_configured(&mut self, p: PlatformId) {
            self.platform_mut(p).configured.clear();
        }
    }
}

impl Scheduler {}

impl Scheduler {
    /// Where a waiter of static platform `p` goes: the least-loaded host with room that has not
    /// failed for it and holds no TaskRun with its user name; its error once every host of the
    /// platform failed for it; else it waits.
    pub(in crate::scheduler) fn choose_static(&self, p: PlatformId, key: Key) -> Choice {
        let guard = self.user_guard(key);
        let mut kept_off = false;
        for hid in self.hosts.with_room(p) {
            if self.failed_on(key, &self.hosts[hid].name) {
                continue;
            }
            if guard
                .as_ref()
                .is_some_and(|g| self.user_blocked(g, Target::Host(hid)))
            {
                kept_off = true;
                continue;
            }
            let def = self.hosts[hid]
                .def
                .clone()
                .expect("only configured hosts are indexed");
            return Choice::Host(hid, def);
        }
        if !kept_off && self.all_hosts_failed(p, key) {
            return Choice::Fail(messages::all_hosts_failed(
                &self.platforms[p as usize].platform,
                &self.failed_list(key),
            ));
        }
        Choice::NoRoom
    }

    /// Every host of static platform `p` failed for `key`.
    pub(in crate::scheduler) fn all_hosts_failed(&self, p: PlatformId, key: Key) -> bool {
        let hosts = self.hosts.of_platform(p);
        !hosts.is_empty()
            && hosts
                .iter()
                .all(|&h| self.failed_on(key, &self.hosts[h].name))
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
