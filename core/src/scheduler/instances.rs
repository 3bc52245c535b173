//! The fleet of cloud instances this cluster tracks, with every index over them: by instance
//! id, each platform's members, its `max-instances` count, and its pool instances with room
//! (ready or booting).
//!
//! Nothing outside this module can change an instance's indexed facts without the index
//! following: the facts the id index, the members and the count hang on (platform, id) are
//! private and change only through [`Fleet`]'s methods (so is the TaskRun a termination is
//! awaited for, behind the count of terminations each TaskRun awaits), and an instance is
//! changed only inside [`Fleet::update`], which re-indexes it in its platform's pool sets in the
//! same call: a caller never re-indexes by hand, and no index is ever read half-updated.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::arena::{Arena, Key};
use super::groups::{GroupDef, GroupId, Groups};
use super::invariant::{Invariant, StateError, ensure};
use super::{DynamicPlatform, DynamicPool, InstState, LaunchId, OpId, PlatformId, Time};

/// A pool's set of instances with room: (free slots, newest first, key).
pub(super) type PoolSet = BTreeSet<(u32, u64, Key)>;

static NO_INSTANCES: PoolSet = BTreeSet::new();
static NO_MEMBERS: BTreeSet<Key> = BTreeSet::new();

pub(super) struct Instance {
    platform: PlatformId,
    pub(super) template: Arc<DynamicPlatform>,
    /// Pool parameters; `None` for a dynamic (one TaskRun) instance.
    pub(super) pool: Option<Arc<DynamicPool>>,
    id: Option<Arc<str>>,
    pub(super) address: Option<Arc<str>>,
    /// The launch's identity, fixed at the first launch request (retries reuse it).
    pub(super) launch: Option<LaunchId>,
    /// Adopted through a TaskRun that names it; may lack our cluster tag.
    pub(super) legacy: bool,
    /// Handed to another TaskRun while its launch was in flight: retag it once its id is known.
    pub(super) retag: bool,
    /// First launch request.
    pub(super) created: Time,
    pub(super) state: InstState,
    pub(super) launches: u32,
    pub(super) last_error: Option<String>,
    /// Dynamic: the TaskRun it serves. Pool: unused.
    pub(super) owner: Option<Key>,
    /// Pool: TaskRuns on it in any phase, in arrival order (the launching one first); its
    /// load.
    pub(super) attached: Vec<Key>,
    /// A user was provisioned on it (never handed to another dynamic TaskRun).
    pub(super) used: bool,
    /// Its address was reached before (a recovered instance that holds a recorded allocation):
    /// a failed probe means unhealthy, not failed to boot.
    pub(super) booted: bool,
    pub(super) draining: bool,
    /// The allocation deadline passed while the launch was in flight.
    pub(super) overdue: bool,
    pub(super) provision_failures: u32,
    pub(super) terminate_attempts: u32,
    /// Termination kept failing (reported once: the `leaked` gauge and an Event). It still runs
    /// and is billed, so it still counts against `max-instances`; its termination is retried
    /// until it lands.
    leaked: bool,
    pub(super) probes: u32,
    pub(super) probe_op: Option<OpId>,
    pub(super) idle_since: Option<Time>,
    /// The TaskRun whose finalizer waits for this instance's termination: one that finished on
    /// it, or one it was launched for that left it to be terminated (failed or moved on).
    cleanup_for: Option<Key>,
    /// Where it is indexed among its platform's pool instances with room.
    indexed: Option<(bool, (u32, u64, Key))>,
}

impl Instance {
    /// An instance entry not launched yet, created (first launch request) at `created`.
    pub(super) fn new(
        platform: PlatformId,
        template: Arc<DynamicPlatform>,
        pool: Option<Arc<DynamicPool>>,
        created: Time,
    ) -> Self {
        Instance {
            platform,
            template,
            pool,
            id: None,
            address: None,
            launch: None,
            legacy: false,
            retag: false,
            created,
            state: InstState::LaunchWait,
            launches: 0,
            last_error: None,
            owner: None,
            attached: Vec::new(),
            used: false,
            booted: false,
            draining: false,
            overdue: false,
            provision_failures: 0,
            terminate_attempts: 0,
            leaked: false,
            probes: 0,
            probe_op: None,
            idle_since: None,
            cleanup_for: None,
            indexed: None,
        }
    }

    pub(super) fn platform(&self) -> PlatformId {
        self.platform
    }

    /// The cloud's instance id, once known.
    pub(super) fn id(&self) -> Option<&Arc<str>> {
        self.id.as_ref()
    }

    /// Its termination kept failing (it still counts against `max-instances`).
    pub(super) fn leaked(&self) -> bool {
        self.leaked
    }

    /// The TaskRun whose finalizer waits for this instance's termination.
    pub(super) fn cleanup_for(&self) -> Option<Key> {
        self.cleanup_for
    }

    /// Where it belongs in its platform's sets of pool instances with room: (ready, key), or
    /// `None` when it takes no work (dynamic, draining, full, terminating).
    fn pool_key(&self, key: Key) -> Option<(bool, (u32, u64, Key))> {
        let pool = self.pool.as_ref()?;
        let load = self.attached.len() as u32;
        if self.draining || load >= pool.concurrency {
            return None;
        }
        let ready = match self.state {
            InstState::Ready => true,
            InstState::LaunchWait | InstState::Launching(_) | InstState::Booting => false,
            InstState::Terminating(_) | InstState::TerminateWait => return None,
        };
        // Most loaded first (fewest free slots), then newest.
        Some((
            ready,
            (
                pool.concurrency - load,
                u64::MAX - self.created.as_millis(),
                key,
            ),
        ))
    }
}

#[derive(Default)]
struct PerPlatform {
    /// Instances counted against `max-instances`: every one, leaked ones included.
    counted: u32,
    /// All instance entries of the platform.
    members: BTreeSet<Key>,
    /// Pool instances with room, ready and booting.
    ready: PoolSet,
    booting: PoolSet,
    /// Slots of terminated instances whose dedicated host is still scrubbed: when each scrub
    /// ends, with how many end then.
    scrubbing: BTreeMap<Time, u32>,
}

/// Tracked instances and their indexes.
#[derive(Default)]
pub(super) struct Fleet {
    instances: Arena<Instance>,
    ids: BTreeMap<Arc<str>, Key>,
    /// By platform id; platforms past the end have no instances.
    platforms: Vec<PerPlatform>,
    /// Ids of instances whose termination was acknowledged (no longer tracked), with their
    /// platform and when: a listing made before that, or a lagging one, may still show them
    /// running, and must neither count them nor terminate them again.
    terminated: BTreeMap<Arc<str>, (PlatformId, Time)>,
    /// TaskRuns that instances' terminations are awaited for (`cleanup_for`), with how many.
    awaited: BTreeMap<Key, u32>,
    /// Capacity groups, counting the instances of their members with `counted`.
    groups: Groups,
}

impl Fleet {
    /// Remembers an acknowledged termination (see [`Fleet::was_terminated`]).
    pub(super) fn terminated(&mut self, id: Arc<str>, platform: PlatformId, at: Time) {
        self.terminated.insert(id, (platform, at));
    }

    /// The instance's termination was acknowledged recently.
    pub(super) fn was_terminated(&self, id: &str) -> bool {
        self.terminated.contains_key(id)
    }

    /// Forgets acknowledged terminations of `platform` made `grace` or longer before `now`: an
    /// instance listed running that long after its termination was acknowledged is treated as
    /// any other again (terminated as an orphan, counted), in case the termination did not take.
    /// Ones a listing shows gone are kept as long: a removal of a user from that machine may
    /// still be retried, and fails for a reason that no longer matters.
    pub(super) fn forget_terminated(
        &mut self,
        platform: PlatformId,
        now: Time,
        grace: std::time::Duration,
    ) {
        self.terminated
            .retain(|_, &mut (of, at)| of != platform || at + grace > now);
    }

    pub(super) fn get(&self, key: Key) -> Option<&Instance> {
        self.instances.get(key)
    }

    /// Changes the instance with `f` and re-indexes it in the same call (`f` cannot reach the
    /// fleet's indexes meanwhile); `None` when it is not tracked.
    pub(super) fn update<R>(&mut self, key: Key, f: impl FnOnce(&mut Instance) -> R) -> Option<R> {
        let r = f(self.instances.get_mut(key)?);
        self.reindex(key);
        Some(r)
    }

    /// Tracked instances in key order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (Key, &Instance)> {
        self.instances.iter()
    }

    /// The instance with this cloud id.
    pub(super) fn find(&self, id: &str) -> Option<Key> {
        self.ids.get(id).copied()
    }

    /// Tracks an instance: it counts against its platform's `max-instances` and its capacity
    /// groups from now on. `existing`: it already runs (recovered, adopted, an orphan), so it may
    /// be above a group's limit; otherwise it is a launch, which the strategies made only with
    /// room.
    pub(super) fn insert(&mut self, i: Instance, existing: bool) -> Key {
        let p = i.platform;
        let key = self.instances.insert(i);
        let pp = self.platform_mut(p);
        pp.counted += 1;
        pp.members.insert(key);
        self.groups.counted_up(p, existing);
        self.reindex(key);
        key
    }

    /// Forgets an instance: it no longer counts, and its id no longer resolves to it.
    pub(super) fn remove(&mut self, key: Key) -> Option<Instance> {
        let i = self.instances.remove(key)?;
        if let Some(id) = &i.id
            && self.ids.get(id) == Some(&key)
        {
            self.ids.remove(id);
        }
        if let Some(tr) = i.cleanup_for {
            self.unawait(tr);
        }
        let pp = self.platform_mut(i.platform);
        if let Some((ready, k)) = i.indexed {
            if ready {
                pp.ready.remove(&k);
            } else {
                pp.booting.remove(&k);
            }
        }
        pp.counted = pp.counted.saturating_sub(1);
        pp.members.remove(&key);
        self.groups.counted_down(i.platform);
        Some(i)
    }

    /// The instance's cloud id is known: it resolves to it from now on.
    pub(super) fn set_id(&mut self, key: Key, id: Arc<str>) {
        if let Some(i) = self.instances.get_mut(key) {
            i.id = Some(id.clone());
            self.ids.insert(id, key);
        }
    }

    /// Names an instance that is about to be forgotten (for the failure record only): its id
    /// does not resolve to it.
    pub(super) fn name_only(&mut self, key: Key, id: Arc<str>) {
        if let Some(i) = self.instances.get_mut(key) {
            i.id = Some(id);
        }
    }

    /// The instance's termination kept failing: reported leaked. It keeps counting against
    /// `max-instances`: a refusal that lasts must cost at most `max-instances` instances, not one
    /// per TaskRun.
    pub(super) fn leak(&mut self, key: Key) {
        if let Some(i) = self.instances.get_mut(key) {
            i.leaked = true;
        }
    }

    /// `tr`'s finalizer waits for the instance's termination (unless it already does, or
    /// another TaskRun's does: then nothing changes). True when it now waits.
    pub(super) fn await_termination(&mut self, key: Key, tr: Key) -> bool {
        let Some(i) = self.instances.get_mut(key) else {
            return false;
        };
        if i.cleanup_for.is_some() {
            return false;
        }
        i.cleanup_for = Some(tr);
        *self.awaited.entry(tr).or_default() += 1;
        true
    }

    /// Nobody waits for the instance's termination any more (done, given up, or handed to
    /// another TaskRun): the TaskRun that did, if any.
    pub(super) fn release_waiter(&mut self, key: Key) -> Option<Key> {
        let tr = self.instances.get_mut(key)?.cleanup_for.take()?;
        self.unawait(tr);
        Some(tr)
    }

    fn unawait(&mut self, tr: Key) {
        if let Some(n) = self.awaited.get_mut(&tr) {
            *n -= 1;
            if *n == 0 {
                self.awaited.remove(&tr);
            }
        }
    }

    /// How many instances' terminations `tr`'s finalizer waits for.
    pub(super) fn awaited(&self, tr: Key) -> u32 {
        self.awaited.get(&tr).copied().unwrap_or(0)
    }

    /// Instances of platform `p` counted against its `max-instances`.
    pub(super) fn counted(&self, p: PlatformId) -> u32 {
        self.platforms.get(p as usize).map_or(0, |pp| pp.counted)
    }

    /// The capacity groups, with their counts.
    pub(super) fn groups(&self) -> &Groups {
        &self.groups
    }

    /// Installs a config's capacity groups, counted anew from the instances tracked now.
    pub(super) fn configure_groups(&mut self, defs: Vec<GroupDef>) {
        let counted: Vec<u32> = self.platforms.iter().map(|pp| pp.counted).collect();
        self.groups
            .configure(defs, |p| counted.get(p as usize).copied().unwrap_or(0));
    }

    /// Group `g`'s member at index `member` was served: the next turn starts after it.
    pub(super) fn group_served(&mut self, g: GroupId, member: usize) {
        self.groups.served(g, member);
    }

    /// A terminated instance's dedicated host is scrubbed until `until`: its slot of platform
    /// `p` stays taken till then.
    pub(super) fn hold_for_scrub(&mut self, p: PlatformId, until: Time) {
        *self.platform_mut(p).scrubbing.entry(until).or_default() += 1;
    }

    /// Ends the scrubs of platform `p` due by `now`; returns how many slots that frees.
    pub(super) fn end_scrubs(&mut self, p: PlatformId, now: Time) -> u32 {
        let Some(pp) = self.platforms.get_mut(p as usize) else {
            return 0;
        };
        let later = pp
            .scrubbing
            .split_off(&(now + std::time::Duration::from_millis(1)));
        let ended = std::mem::replace(&mut pp.scrubbing, later);
        ended.values().sum()
    }

    /// Slots of platform `p` held for dedicated hosts being scrubbed.
    pub(super) fn scrubbing(&self, p: PlatformId) -> u32 {
        self.platforms
            .get(p as usize)
            .map_or(0, |pp| pp.scrubbing.values().sum())
    }

    /// When platform `p`'s scrubs end.
    pub(super) fn scrub_ends(&self, p: PlatformId) -> impl Iterator<Item = Time> + '_ {
        self.platforms
            .get(p as usize)
            .into_iter()
            .flat_map(|pp| pp.scrubbing.keys().copied())
    }

    /// Every instance entry of platform `p`.
    pub(super) fn members(&self, p: PlatformId) -> &BTreeSet<Key> {
        self.platforms
            .get(p as usize)
            .map_or(&NO_MEMBERS, |pp| &pp.members)
    }

    /// Pool instances of platform `p` with room, (ready, booting), each most loaded first,
    /// then newest.
    pub(super) fn with_room(&self, p: PlatformId) -> (&PoolSet, &PoolSet) {
        self.platforms
            .get(p as usize)
            .map_or((&NO_INSTANCES, &NO_INSTANCES), |pp| {
                (&pp.ready, &pp.booting)
            })
    }

    fn platform_mut(&mut self, p: PlatformId) -> &mut PerPlatform {
        let i = p as usize;
        if self.platforms.len() <= i {
            self.platforms.resize_with(i + 1, PerPlatform::default);
        }
        &mut self.platforms[i]
    }

    /// Puts the instance in (or takes it out of) its platform's sets of pool instances with
    /// room.
    fn reindex(&mut self, key: Key) {
        let Some(i) = self.instances.get_mut(key) else {
            return;
        };
        let old = i.indexed.take();
        let new = i.pool_key(key);
        if old == new {
            i.indexed = new;
            return;
        }
        i.indexed = new;
        let p = i.platform;
        let pp = self.platform_mut(p);
        if let Some((ready, k)) = old {
            if ready {
                pp.ready.remove(&k);
            } else {
                pp.booting.remove(&k);
            }
        }
        if let Some((ready, k)) = new {
            if ready {
                pp.ready.insert(k);
            } else {
                pp.booting.insert(k);
            }
        }
    }

    /// Ids resolve to exactly the instances that carry them; each platform's members, count
    /// and pool sets match its instances.
    pub(super) fn check(&self, platforms: usize) -> Result<(), StateError> {
        use Invariant::*;
        let n = self.platforms.len().max(platforms);
        let mut members = vec![BTreeSet::new(); n];
        let mut counted = vec![0u32; n];
        let mut ready = vec![PoolSet::new(); n];
        let mut booting = vec![PoolSet::new(); n];
        let mut with_id = 0;
        let mut awaited: BTreeMap<Key, u32> = BTreeMap::new();
        for (k, i) in self.instances.iter() {
            if let Some(tr) = i.cleanup_for {
                *awaited.entry(tr).or_default() += 1;
            }
            ensure((i.platform as usize) < platforms, Platforms, || {
                format!("instance {k:?} has platform id {}", i.platform)
            })?;
            let p = i.platform as usize;
            members[p].insert(k);
            counted[p] += 1;
            if let Some(id) = &i.id {
                with_id += 1;
                ensure(self.ids.get(id) == Some(&k), InstanceIds, || {
                    format!("instance {id} ({k:?}) is indexed as {:?}", self.ids.get(id))
                })?;
            }
            let want = i.pool_key(k);
            ensure(i.indexed == want, PoolIndex, || {
                format!(
                    "instance {k:?} is indexed as {:?}, its state says {want:?}",
                    i.indexed
                )
            })?;
            match want {
                Some((true, key)) => ready[p].insert(key),
                Some((false, key)) => booting[p].insert(key),
                None => false,
            };
        }
        ensure(self.ids.len() == with_id, InstanceIds, || {
            format!("{} ids for {with_id} instances with one", self.ids.len())
        })?;
        ensure(self.awaited == awaited, AwaitedTerminations, || {
            format!("counted {:?}, instances name {awaited:?}", self.awaited)
        })?;
        for p in 0..n {
            let pid = p as PlatformId;
            ensure(*self.members(pid) == members[p], InstanceMembers, || {
                format!(
                    "platform {p}: members {:?}, instances say {:?}",
                    self.members(pid),
                    members[p]
                )
            })?;
            ensure(self.counted(pid) == counted[p], InstanceCount, || {
                format!(
                    "platform {p}: counts {}, has {} instances",
                    self.counted(pid),
                    counted[p]
                )
            })?;
            let (have_ready, have_booting) = self.with_room(pid);
            ensure(
                *have_ready == ready[p] && *have_booting == booting[p],
                PoolIndex,
                || {
                    format!(
                        "platform {p}: ready {have_ready:?} booting {have_booting:?}, instances \
                         say {:?} {:?}",
                        ready[p], booting[p]
                    )
                },
            )?;
        }
        Ok(())
    }

    /// Test hook: the capacity groups, to corrupt.
    #[cfg(test)]
    pub(super) fn groups_mut(&mut self) -> &mut Groups {
        &mut self.groups
    }

    /// Test hook: miscounts platform `p`'s instances.
    #[cfg(test)]
    pub(super) fn corrupt_count(&mut self, p: PlatformId) {
        self.platform_mut(p).counted += 1;
    }

    /// Test hook: counts one more termination awaited for `tr`.
    #[cfg(test)]
    pub(super) fn corrupt_awaited(&mut self, tr: Key) {
        *self.awaited.entry(tr).or_default() += 1;
    }

    /// Test hook: drops an instance from its platform's members only.
    #[cfg(test)]
    pub(super) fn corrupt_members(&mut self, key: Key) {
        let p = self.instances.get(key).expect("tracked").platform;
        self.platform_mut(p).members.remove(&key);
    }

    /// Test hook: empties platform `p`'s set of booting pool instances.
    #[cfg(test)]
    pub(super) fn corrupt_booting(&mut self, p: PlatformId) {
        self.platform_mut(p).booting.clear();
    }
}
