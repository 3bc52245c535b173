//! TaskRun lookup by UID: a hash table of arena keys whose UIDs live in the arena itself, so
//! each tracked TaskRun costs about nine bytes here instead of a second copy of its UID.
//!
//! Never iterated, so the hash order cannot leak into decisions. Generic over what the arena
//! holds ([`HasUid`]), so the ledger that owns both imports this module and not the reverse.

use std::hash::BuildHasher;

use foldhash::quality::FixedState;
use hashbrown::HashTable;

use super::arena::{Arena, Key};
use super::ids::Uid;

/// An arena entry with the UID it is indexed by.
pub(super) trait HasUid {
    fn uid(&self) -> &Uid;
}

/// Keys of tracked TaskRuns, hashed by UID. Holds exactly the live keys of the arena it is
/// used with (rehashing reads their UIDs).
#[derive(Default)]
pub(super) struct UidIndex {
    table: HashTable<Key>,
}

fn hash(uid: &Uid) -> u64 {
    FixedState::default().hash_one(uid)
}

impl UidIndex {
    /// The TaskRun with this UID.
    pub(super) fn get<T: HasUid>(&self, uid: &Uid, taskruns: &Arena<T>) -> Option<Key> {
        self.table
            .find(hash(uid), |&k| {
                taskruns.get(k).is_some_and(|t| t.uid() == uid)
            })
            .copied()
    }

    /// Indexes `key`, already stored in `taskruns` and not yet indexed.
    pub(super) fn insert<T: HasUid>(&mut self, key: Key, taskruns: &Arena<T>) {
        let uid = taskruns
            .get(key)
            .expect("indexed TaskRuns are stored")
            .uid();
        self.table.insert_unique(hash(uid), key, |&k| {
            hash(taskruns.get(k).expect("indexed TaskRuns are stored").uid())
        });
    }

    /// Drops `key` (whose UID is `uid`); the arena entry may already be gone.
    pub(super) fn remove(&mut self, uid: &Uid, key: Key) {
        if let Ok(entry) = self.table.find_entry(hash(uid), |&k| k == key) {
            entry.remove();
        }
    }

    /// Number of keys indexed.
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// Bytes of the table's buffer.
    pub(super) fn allocation_size(&self) -> usize {
        self.table.allocation_size()
    }
}
