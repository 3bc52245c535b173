//! Timers: what is due when, and the cleanup operations waiting for a retry.
//!
//! Timers fire in (time, arming order); a delayed cleanup is stored under the sequence number
//! of its own [`Timer::Delayed`], so an operation waits exactly as long as its timer stands and
//! the two can only be added or taken together.

use std::collections::{BTreeMap, BTreeSet};

use super::invariant::{Invariant, StateError, ensure};
use super::{Op, Time, Timer};

#[derive(Default)]
pub(super) struct Timers {
    /// (due, sequence, timer): the sequence keeps arming order among timers due together.
    due: BTreeSet<(Time, u64, Timer)>,
    /// Cleanup operations waiting for a retry, by the sequence their timer names.
    delayed: BTreeMap<u64, Op>,
    /// Last sequence number issued.
    seq: u64,
}

impl Timers {
    pub(super) fn arm(&mut self, at: Time, timer: Timer) {
        self.seq += 1;
        self.due.insert((at, self.seq, timer));
    }

    /// Stores `op` and arms the timer that re-issues it at `at`.
    pub(super) fn delay(&mut self, at: Time, op: Op) {
        self.seq += 1;
        let seq = self.seq;
        self.delayed.insert(seq, op);
        self.arm(at, Timer::Delayed(seq));
    }

    /// When the first timer is due.
    pub(super) fn next_deadline(&self) -> Option<Time> {
        self.due.first().map(|t| t.0)
    }

    /// Takes the first timer due at or before `now`.
    pub(super) fn pop_due(&mut self, now: Time) -> Option<Timer> {
        let &(at, _, _) = self.due.first()?;
        if at > now {
            return None;
        }
        self.due.pop_first().map(|(_, _, t)| t)
    }

    /// The operation a fired [`Timer::Delayed`] re-issues.
    pub(super) fn take_delayed(&mut self, seq: u64) -> Option<Op> {
        self.delayed.remove(&seq)
    }

    /// Cleanup operations waiting for a retry, in no meaningful order.
    pub(super) fn delayed_ops(&self) -> impl Iterator<Item = &Op> {
        self.delayed.values()
    }

    /// Armed timers, by due time.
    pub(super) fn iter(&self) -> impl Iterator<Item = (Time, Timer)> + '_ {
        self.due.iter().map(|&(at, _, t)| (at, t))
    }

    /// Sequence numbers are unique and issued; delayed operations and their timers map to each
    /// other.
    pub(super) fn check(&self) -> Result<(), StateError> {
        let mut seqs = BTreeSet::new();
        let mut armed = BTreeSet::new();
        for &(at, seq, t) in &self.due {
            ensure(
                seq <= self.seq && seqs.insert(seq),
                Invariant::Timers,
                || {
                    format!(
                        "timer {t:?} at {at} has sequence {seq} (issued up to {})",
                        self.seq
                    )
                },
            )?;
            if let Timer::Delayed(d) = t {
                armed.insert(d);
            }
        }
        let stored: BTreeSet<u64> = self.delayed.keys().copied().collect();
        ensure(stored == armed, Invariant::Timers, || {
            format!("delayed cleanups {stored:?}, their timers {armed:?}")
        })
    }

    /// Test hook: stores an operation without its timer.
    #[cfg(test)]
    pub(super) fn corrupt_delayed(&mut self, op: Op) {
        self.seq += 1;
        self.delayed.insert(self.seq, op);
    }
}
