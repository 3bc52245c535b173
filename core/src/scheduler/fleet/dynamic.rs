//! The dynamic strategy: one instance per TaskRun, launched when it is placed (within
//! `max-instances` and the platform's capacity groups), terminated when it finishes or handed,
//! unused, to the next waiter of the same platform (`fleet::adopt`). A drained platform
//! (`drain: "true"`) launches nothing and hands no instance on; what runs finishes, and its
//! waiters wait for the drain to be lifted.

use super::super::arena::Key;
use super::super::handoff::Choice;
use super::super::{DynamicPlatform, PlatformId, Scheduler, messages};

impl Scheduler {
    /// Where a waiter of dynamic platform `p` goes: its error once too many instances failed for
    /// it, else a new instance while the platform has room.
    pub(in crate::scheduler) fn choose_dynamic(
        &self,
        p: PlatformId,
        key: Key,
        template: &DynamicPlatform,
    ) -> Choice {
        if self.failures(key) >= self.policy.instance_attempts {
            return Choice::Fail(messages::instances_failed(
                &self.platforms[p as usize].platform,
                &self.failed_list(key),
            ));
        }
        // Drained: capacity 0, so it waits until the drain is lifted.
        if self.occupied(p) >= template.capacity() || !self.group_room(p) {
            return Choice::NoRoom;
        }
        Choice::Launch
    }
}
