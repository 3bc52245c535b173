//! Operations in flight, by [`OpId`]. An id names a slot and a serial number, so a lookup is an
//! index instead of a hash probe, and a freed slot is reused first (it is still in cache). A
//! result for an operation that already finished carries a serial its slot no longer holds and
//! finds nothing.

use super::invariant::{Invariant, StateError, ensure};
use super::{Op, OpId};

struct Slot {
    serial: u32,
    op: Option<Op>,
}

/// The operation table. Never iterated where order could matter (the host sweep collects user
/// names into a set).
#[derive(Default)]
pub(super) struct OpTable {
    slots: Vec<Slot>,
    /// Free slot indices, most recently freed last. May hold stale entries (past the end after
    /// a shrink, or duplicates); [`OpTable::insert`] skips them.
    free: Vec<u32>,
    len: usize,
    next_serial: u32,
}

impl OpTable {
    /// Stores an operation under a new id.
    pub(super) fn insert(&mut self, op: Op) -> OpId {
        let serial = self.next_serial;
        // Wrapping: a stale id could only match after 2^32 operations with the same slot still
        // waiting for a result that old.
        self.next_serial = self.next_serial.wrapping_add(1);
        self.len += 1;
        while let Some(index) = self.free.pop() {
            // Entries past a shrink, or for a slot reused meanwhile, are stale: skip them.
            if let Some(slot) = self.slots.get_mut(index as usize)
                && slot.op.is_none()
            {
                *slot = Slot {
                    serial,
                    op: Some(op),
                };
                return id(index, serial);
            }
        }
        let index = u32::try_from(self.slots.len()).expect("fewer than 2^32 operations in flight");
        self.slots.push(Slot {
            serial,
            op: Some(op),
        });
        id(index, serial)
    }

    /// The operation, if still in flight.
    pub(super) fn get(&self, op: OpId) -> Option<&Op> {
        let (index, serial) = parts(op);
        self.slots
            .get(index as usize)
            .filter(|s| s.serial == serial)
            .and_then(|s| s.op.as_ref())
    }

    /// Mutable access.
    pub(super) fn get_mut(&mut self, op: OpId) -> Option<&mut Op> {
        let (index, serial) = parts(op);
        self.slots
            .get_mut(index as usize)
            .filter(|s| s.serial == serial)
            .and_then(|s| s.op.as_mut())
    }

    /// Removes an operation; its id stops resolving. Gives memory back once the table is
    /// mostly empty and its tail is free (a hash table never shrinks by itself).
    pub(super) fn remove(&mut self, op: OpId) -> Option<Op> {
        let (index, serial) = parts(op);
        let slot = self
            .slots
            .get_mut(index as usize)
            .filter(|s| s.serial == serial)?;
        let removed = slot.op.take()?;
        self.len -= 1;
        self.free.push(index);
        if self.len * 4 < self.slots.capacity()
            && self.slots.capacity() > 1024
            && self.slots.last().is_some_and(|s| s.op.is_none())
        {
            self.shrink();
        }
        Some(removed)
    }

    /// Drops the free tail; halves the buffers when that frees at least half (so the work is
    /// amortised over the removals that emptied them).
    fn shrink(&mut self) {
        while self.slots.last().is_some_and(|s| s.op.is_none()) {
            self.slots.pop();
        }
        let end = self.slots.len();
        if end * 2 <= self.slots.capacity() {
            self.free.retain(|&i| (i as usize) < end);
            self.slots.shrink_to((end * 2).max(64));
            self.free.shrink_to((end * 2).max(64));
        }
    }

    /// Operations in flight, in no meaningful order.
    pub(super) fn values(&self) -> impl Iterator<Item = &Op> {
        self.slots.iter().filter_map(|s| s.op.as_ref())
    }

    /// Operations in flight with their ids, in no meaningful order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (OpId, &Op)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((id(i as u32, s.serial), s.op.as_ref()?)))
    }

    /// The count matches the slots in use.
    pub(super) fn check(&self) -> Result<(), StateError> {
        let used = self.slots.iter().filter(|s| s.op.is_some()).count();
        ensure(used == self.len, Invariant::OpTable, || {
            format!("counts {} operations, {used} slots hold one", self.len)
        })
    }

    /// Test hook: counts one operation more than the slots hold.
    #[cfg(test)]
    pub(super) fn corrupt_count(&mut self) {
        self.len += 1;
    }

    /// Number of operations in flight.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated (live or free).
    #[cfg(test)]
    pub(super) fn capacity(&self) -> usize {
        self.slots.capacity()
    }
}

fn id(index: u32, serial: u32) -> OpId {
    OpId(u64::from(serial) << 32 | u64::from(index))
}

fn parts(op: OpId) -> (u32, u32) {
    (op.0 as u32, (op.0 >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::arena::Key;

    fn launch(i: u32) -> Op {
        Op::Launch {
            inst: Key {
                index: i,
                generation: 0,
            },
        }
    }

    fn inst(op: Option<&Op>) -> Option<u32> {
        match op {
            Some(Op::Launch { inst }) => Some(inst.index),
            _ => None,
        }
    }

    #[test]
    fn ids_of_finished_operations_never_resolve_again() {
        let mut t = OpTable::default();
        let a = t.insert(launch(1));
        assert_eq!(inst(t.remove(a).as_ref()), Some(1));
        let b = t.insert(launch(2));
        assert_ne!(a, b, "the slot is reused under a new id");
        assert_eq!(inst(t.get(a)), None);
        assert!(t.remove(a).is_none());
        assert_eq!(inst(t.get(b)), Some(2));
        assert_eq!(t.len(), 1);
        assert!(t.get(OpId(u64::MAX)).is_none());
    }

    #[test]
    fn memory_comes_back_when_the_tail_frees() {
        let mut t = OpTable::default();
        let ids: Vec<OpId> = (0..5000).map(|i| t.insert(launch(i))).collect();
        let peak = t.capacity();
        // One long operation at the front does not pin the table.
        for &op in &ids[1..] {
            t.remove(op);
        }
        assert!(t.capacity() * 8 <= peak, "{} of {peak}", t.capacity());
        assert_eq!(inst(t.get(ids[0])), Some(0));
        let again: Vec<OpId> = (0..100).map(|i| t.insert(launch(i))).collect();
        assert_eq!(t.len(), 101);
        assert!(again.iter().all(|&op| t.get(op).is_some()));
        assert_eq!(t.values().count(), 101);
    }
}
