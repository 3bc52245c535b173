//! Waiters of one platform: FIFO within a namespace, round-robin across namespaces, so one
//! tenant's burst cannot starve another. O(1) per operation (expected: lanes are found by
//! hashing the namespace id; they are never iterated where order could matter).
//!
//! Entries are not removed when a waiter leaves early (placed by a poll, finished, re-routed):
//! each carries the ticket it was queued with, and [`FairQueue::pop`] skips entries whose
//! TaskRun no longer waits with that ticket.

use std::collections::{BTreeSet, HashMap, VecDeque};

use foldhash::quality::FixedState;

use super::arena::Key;
use super::invariant::{Invariant, StateError, ensure};

/// Namespace id (interned).
pub(crate) type NsId = u32;

/// One queued waiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) taskrun: Key,
    pub(crate) ticket: u32,
}

/// FIFO per namespace, round-robin across namespaces.
#[derive(Default)]
pub(crate) struct FairQueue {
    lanes: HashMap<NsId, VecDeque<Entry>, FixedState>,
    /// Namespaces with entries, in turn order.
    turn: VecDeque<NsId>,
    /// Entries held, including ones that went stale.
    held: usize,
}

impl FairQueue {
    /// Appends a waiter; returns the number of entries ahead of it in its namespace (an upper
    /// bound: some may be stale).
    pub(crate) fn push(&mut self, ns: NsId, entry: Entry) -> usize {
        self.held += 1;
        let lane = self.lanes.entry(ns).or_default();
        if lane.is_empty() {
            self.turn.push_back(ns);
        }
        lane.push_back(entry);
        lane.len() - 1
    }

    /// Takes the next live waiter: the head of the namespace whose turn it is. `live` says
    /// whether an entry still stands; dead ones are dropped without costing their namespace its
    /// turn.
    pub(crate) fn pop(&mut self, mut live: impl FnMut(&Entry) -> bool) -> Option<Entry> {
        while let Some(ns) = self.turn.pop_front() {
            let Some(lane) = self.lanes.get_mut(&ns) else {
                continue;
            };
            let mut found = None;
            while let Some(e) = lane.pop_front() {
                self.held -= 1;
                if live(&e) {
                    found = Some(e);
                    break;
                }
            }
            if lane.is_empty() {
                self.lanes.remove(&ns);
            } else {
                self.turn.push_back(ns);
            }
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// Removes and returns every entry in service order (live or not).
    pub(crate) fn drain_all(&mut self) -> Vec<Entry> {
        let mut out = Vec::with_capacity(self.held);
        while let Some(e) = self.pop(|_| true) {
            out.push(e);
        }
        out
    }

    /// Entries held (live or stale) with their namespace, in no meaningful order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (NsId, &Entry)> {
        self.lanes
            .iter()
            .flat_map(|(&ns, lane)| lane.iter().map(move |e| (ns, e)))
    }

    /// The entry count and turn order match the lanes.
    pub(crate) fn check(&self) -> Result<(), StateError> {
        let held: usize = self.lanes.values().map(VecDeque::len).sum();
        ensure(held == self.held, Invariant::Queue, || {
            format!("counts {} entries, lanes hold {held}", self.held)
        })?;
        let turn: BTreeSet<NsId> = self.turn.iter().copied().collect();
        let lanes: BTreeSet<NsId> = self
            .lanes
            .iter()
            .filter(|(_, l)| !l.is_empty())
            .map(|(&ns, _)| ns)
            .collect();
        ensure(
            turn.len() == self.turn.len() && turn == lanes && lanes.len() == self.lanes.len(),
            Invariant::Queue,
            || format!("turn {:?}, namespaces with entries {lanes:?}", self.turn),
        )
    }

    /// Test hook: counts one entry more than the lanes hold.
    #[cfg(test)]
    pub(crate) fn corrupt_count(&mut self) {
        self.held += 1;
    }

    /// True when no entries are held (live or stale).
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// Bytes held by lane buffers (for memory accounting).
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.lanes
            .values()
            .map(|l| l.capacity() * std::mem::size_of::<Entry>())
            .sum::<usize>()
            + self.turn.capacity() * std::mem::size_of::<NsId>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(i: u32) -> Entry {
        Entry {
            taskrun: Key {
                index: i,
                generation: 0,
            },
            ticket: i,
        }
    }

    #[test]
    fn round_robin_across_namespaces_fifo_within() {
        let mut q = FairQueue::default();
        // Namespace 1 bursts 4 entries before namespace 2 queues 2.
        for i in 0..4 {
            q.push(1, e(i));
        }
        q.push(2, e(10));
        q.push(2, e(11));
        let order: Vec<u32> = std::iter::from_fn(|| q.pop(|_| true))
            .map(|x| x.ticket)
            .collect();
        assert_eq!(order, vec![0, 10, 1, 11, 2, 3]);
        assert!(q.is_empty());
    }

    #[test]
    fn stale_entries_are_skipped_without_losing_the_turn() {
        let mut q = FairQueue::default();
        q.push(1, e(0));
        q.push(1, e(1));
        q.push(2, e(10));
        // Entry 0 is stale: namespace 1 still serves entry 1 on its turn.
        let first = q.pop(|x| x.ticket != 0).unwrap();
        assert_eq!(first.ticket, 1);
        assert_eq!(q.pop(|_| true).unwrap().ticket, 10);
        assert_eq!(q.pop(|_| true), None);
    }
}
