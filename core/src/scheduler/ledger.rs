//! The TaskRun ledger: the tracked TaskRuns and every index over them (by UID, by build user,
//! namespaces interned), and the UIDs of TaskRuns finished recently.
//!
//! A TaskRun's identity (UID and `<namespace>/<name>`) is fixed when it enters the ledger and is
//! private to this module, and the indexes change only in [`Ledger::insert`] and
//! [`Ledger::remove`]: every tracked TaskRun is found by its UID and its user name, and the
//! indexes hold nothing else. Everything else of a TaskRun is its owner's to change through
//! [`Ledger::get_mut`].

use std::collections::{BTreeMap, BTreeSet};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use foldhash::quality::FixedState;

use super::arena::{Arena, Key};
use super::invariant::{Invariant, StateError, ensure};
use super::queue::NsId;
use super::tombstones::Tombstones;
use super::uid_index::{HasUid, UidIndex};
use super::{Extra, PlatformId, State, TaskRunRef, Time, Uid};

/// A tracked TaskRun. Kept small: this is the per-TaskRun cost of the ledger.
pub(super) struct TaskRun {
    uid: Uid,
    /// `<namespace>/<name>`, shared with every [`TaskRunRef`] handed out.
    path: Arc<str>,
    pub(super) ns: NsId,
    /// `NO_PLATFORM` for TaskRuns whose platform did not parse.
    pub(super) platform: PlatformId,
    pub(super) retries: u32,
    pub(super) gated: bool,
    /// What its placement labels say.
    pub(super) labels: Labels,
    /// What the next provisioning does with the token of its remote secret.
    pub(super) token: Token,
    /// Start of the allocation (`allocation-start-time`).
    pub(super) since: Time,
    /// When it last joined a queue.
    pub(super) queued: Time,
    pub(super) state: State,
    /// Failure history; absent for the common case of none.
    pub(super) extra: Option<Box<Extra>>,
}

impl TaskRun {
    /// A TaskRun not yet served (state `Failed` until admission routes it), queued from `since`.
    pub(super) fn new(
        uid: Uid,
        path: Arc<str>,
        ns: NsId,
        platform: PlatformId,
        since: Time,
    ) -> Self {
        TaskRun {
            uid,
            path,
            ns,
            platform,
            retries: 0,
            gated: false,
            labels: Labels::Clear,
            token: Token::Fresh,
            since,
            queued: since,
            state: State::Failed,
            extra: None,
        }
    }

    pub(super) fn uid(&self) -> &Uid {
        &self.uid
    }

    /// `<namespace>/<name>`.
    pub(super) fn path(&self) -> &Arc<str> {
        &self.path
    }

    /// The reference actions carry.
    pub(super) fn reference(&self) -> TaskRunRef {
        TaskRunRef::from_path(self.path.clone(), self.uid.clone())
    }

    /// The build user's name (`u-<md5>`).
    pub(super) fn user(&self) -> String {
        user_of_path(&self.path)
    }
}

/// A TaskRun's placement labels, as this scheduler wrote or found them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Labels {
    /// None of ours stand: nothing to clear.
    Clear,
    /// They name a host or instance, or the platform it waits for: a later outcome without a
    /// new placement must clear them.
    Written,
    /// Recovered labelled waiting (with no failed hosts) and not yet re-admitted: the label
    /// and its `WaitingForHost` Event stand, so re-admission writes and announces nothing.
    Announced,
}

impl Labels {
    /// Labels are being written; returns whether some stood already.
    pub(super) fn write(&mut self) -> bool {
        let stood = *self != Labels::Clear;
        if !stood {
            *self = Labels::Written;
        }
        stood
    }

    /// The labels are being cleared; returns whether some stood.
    pub(super) fn clear(&mut self) -> bool {
        std::mem::replace(self, Labels::Clear) != Labels::Clear
    }

    /// Re-admission is over: an announced wait is a label like any other from now on.
    pub(super) fn settle(&mut self) {
        if *self == Labels::Announced {
            *self = Labels::Written;
        }
    }
}

/// What the next provisioning of a TaskRun does with the token of its remote secret.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Token {
    /// No secret to keep: the next one carries a fresh token.
    Fresh,
    /// A remote secret was handed to an earlier attempt: the next provisioning re-arms its
    /// token (the pod mounted it already).
    Rearm,
    /// Its remote secret was found at recovery without our proof (the Go controller's, or
    /// forged): a new attempt replaces it with a fresh token instead of re-arming its token.
    /// Until we write one.
    Foreign,
}

impl Token {
    /// A new attempt's pod mounted the secret: re-arm its token, unless it is not ours.
    pub(super) fn new_attempt(&mut self) {
        if *self != Token::Foreign {
            *self = Token::Rearm;
        }
    }

    /// The re-arming was handed to a provisioning (or given up): nothing left to re-arm.
    pub(super) fn consume_rearm(&mut self) {
        if *self == Token::Rearm {
            *self = Token::Fresh;
        }
    }

    /// We wrote the secret: whatever was in it before is replaced.
    pub(super) fn written(&mut self) {
        if *self == Token::Foreign {
            *self = Token::Fresh;
        }
    }
}

fn user_of_path(path: &Arc<str>) -> String {
    TaskRunRef::from_path(path.clone(), Uid::new("")).remote_user()
}

fn user_hash(user: &str) -> u64 {
    FixedState::default().hash_one(user)
}

impl HasUid for TaskRun {
    fn uid(&self) -> &Uid {
        &self.uid
    }
}

/// Tracked TaskRuns with their indexes, and recently finished UIDs.
#[derive(Default)]
pub(super) struct Ledger {
    taskruns: Arena<TaskRun>,
    by_uid: UidIndex,
    /// UIDs of TaskRuns finished recently, in two generations (current, previous) that rotate
    /// every TTL: late or reordered events for them are ignored for at least that long.
    /// Rotating whole sets keeps no per-UID timestamp or expiry queue.
    tombstones: Tombstones,
    /// Tracked TaskRuns by a hash of their build user's name (see `users`).
    by_user: BTreeSet<(u64, Key)>,
    namespaces: Vec<Arc<str>>,
    ns_ids: BTreeMap<Arc<str>, NsId>,
}

impl Ledger {
    pub(super) fn get(&self, key: Key) -> Option<&TaskRun> {
        self.taskruns.get(key)
    }

    pub(super) fn get_mut(&mut self, key: Key) -> Option<&mut TaskRun> {
        self.taskruns.get_mut(key)
    }

    /// Tracked TaskRuns in key order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (Key, &TaskRun)> {
        self.taskruns.iter()
    }

    pub(super) fn len(&self) -> usize {
        self.taskruns.len()
    }

    /// The tracked TaskRun with this UID.
    pub(super) fn find(&self, uid: &Uid) -> Option<Key> {
        self.by_uid.get(uid, &self.taskruns)
    }

    /// Tracks a TaskRun (its UID must not be tracked yet) and indexes it.
    pub(super) fn insert(&mut self, t: TaskRun) -> Key {
        let user = user_hash(&t.user());
        let key = self.taskruns.insert(t);
        self.by_uid.insert(key, &self.taskruns);
        self.by_user.insert((user, key));
        key
    }

    /// Forgets a TaskRun; when `finished`, its UID is remembered as finished.
    pub(super) fn remove(&mut self, key: Key, finished: bool) -> Option<TaskRun> {
        let t = self.taskruns.remove(key)?;
        self.by_uid.remove(&t.uid, key);
        self.by_user.remove(&(user_hash(&t.user()), key));
        if finished {
            self.tombstones.insert(&t.uid);
        }
        Some(t)
    }

    /// The TaskRun with this UID finished recently.
    pub(super) fn finished(&self, uid: &Uid) -> bool {
        self.tombstones.contains(uid)
    }

    /// Remembers an untracked TaskRun's UID as finished.
    pub(super) fn bury(&mut self, uid: &Uid) {
        self.tombstones.insert(uid);
    }

    /// Starts a new generation of finished UIDs once `ttl` has passed since the current one.
    pub(super) fn rotate(&mut self, now: Time, ttl: Duration) {
        self.tombstones.rotate(now, ttl);
    }

    /// The id of a namespace, interned on first use.
    pub(super) fn intern_ns(&mut self, ns: &str) -> NsId {
        if let Some(&id) = self.ns_ids.get(ns) {
            return id;
        }
        let id = self.namespaces.len() as NsId;
        let name: Arc<str> = ns.into();
        self.namespaces.push(name.clone());
        self.ns_ids.insert(name, id);
        id
    }

    pub(super) fn namespace(&self, ns: NsId) -> &Arc<str> {
        &self.namespaces[ns as usize]
    }

    /// Tracked TaskRuns other than `me` whose build user is `user`.
    pub(super) fn same_user<'a>(
        &'a self,
        user: &'a str,
        me: Key,
    ) -> impl Iterator<Item = Key> + 'a {
        let lo = Key {
            index: 0,
            generation: 0,
        };
        let hi = Key {
            index: u32::MAX,
            generation: u32::MAX,
        };
        let h = user_hash(user);
        self.by_user
            .range((h, lo)..=(h, hi))
            .map(|&(_, k)| k)
            .filter(move |&k| k != me && self.taskruns.get(k).is_some_and(|t| t.user() == user))
    }

    /// Tracked TaskRuns whose build user's hash they share with another, grouped by it (a
    /// group may still hold different names: hashes collide).
    pub(super) fn sharing_a_user_hash(&self) -> Vec<Vec<Key>> {
        let mut groups: Vec<Vec<Key>> = Vec::new();
        let mut last = None;
        for &(h, k) in &self.by_user {
            match groups.last_mut() {
                Some(g) if last == Some(h) => g.push(k),
                _ => groups.push(vec![k]),
            }
            last = Some(h);
        }
        groups.retain(|g| g.len() > 1);
        groups
    }

    /// Bytes held by the TaskRun slots.
    pub(super) fn capacity_bytes(&self) -> usize {
        self.taskruns.capacity_bytes()
    }

    /// Bytes of the UID index's buffer.
    pub(super) fn uid_index_bytes(&self) -> usize {
        self.by_uid.allocation_size()
    }

    /// Every index holds exactly the tracked TaskRuns; none of them is remembered as finished.
    pub(super) fn check(&self) -> Result<(), StateError> {
        use Invariant::*;
        let n = self.taskruns.len();
        ensure(self.by_uid.len() == n, UidIndex, || {
            format!("{} entries for {n} TaskRuns", self.by_uid.len())
        })?;
        ensure(self.by_user.len() == n, UserIndex, || {
            format!("{} entries for {n} TaskRuns", self.by_user.len())
        })?;
        ensure(
            self.ns_ids.len() == self.namespaces.len(),
            Namespaces,
            || {
                format!(
                    "{} ids for {} names",
                    self.ns_ids.len(),
                    self.namespaces.len()
                )
            },
        )?;
        for (i, ns) in self.namespaces.iter().enumerate() {
            ensure(
                self.ns_ids.get(ns) == Some(&(i as NsId)),
                Namespaces,
                || format!("{ns} is not id {i}"),
            )?;
        }
        for (k, t) in self.taskruns.iter() {
            ensure(self.find(&t.uid) == Some(k), UidIndex, || {
                format!("{} ({k:?}) is not found by its UID", t.path)
            })?;
            ensure(!self.tombstones.contains(&t.uid), Tombstones, || {
                format!("{} is tracked and remembered as finished", t.path)
            })?;
            ensure(
                self.by_user.contains(&(user_hash(&t.user()), k)),
                UserIndex,
                || format!("{} ({k:?}) is not indexed by its user", t.path),
            )?;
            ensure((t.ns as usize) < self.namespaces.len(), Namespaces, || {
                format!("{} has namespace id {}", t.path, t.ns)
            })?;
        }
        Ok(())
    }

    /// Test hook: drops a TaskRun from the UID index only.
    #[cfg(test)]
    pub(super) fn corrupt_uid_index(&mut self, key: Key) {
        let uid = self.taskruns.get(key).expect("tracked").uid.clone();
        self.by_uid.remove(&uid, key);
    }

    /// Test hook: drops a TaskRun from the user index only.
    #[cfg(test)]
    pub(super) fn corrupt_user_index(&mut self, key: Key) {
        let user = user_hash(&self.taskruns.get(key).expect("tracked").user());
        self.by_user.remove(&(user, key));
    }
}
