//! Warm pool instances: launched up to `min-instances` with no TaskRun waiting.

use std::sync::Arc;
use std::time::Duration;

use super::super::{Action, Mode, NO_PLATFORM, PlatformId, Scheduler, Timer};

/// How long warm launches pause after a warm instance could not be launched at all.
pub(super) const WARM_HOLD: Duration = Duration::from_secs(300);

impl Scheduler {
    /// Launches warm instances up to `min-instances`.
    pub(in crate::scheduler) fn ensure_warm(&mut self, p: PlatformId, out: &mut Vec<Action>) {
        if p == NO_PLATFORM || !self.started {
            return;
        }
        let Mode::Pool(pool) = self.platforms[p as usize].mode.clone() else {
            return;
        };
        if pool.min_instances == 0 || self.now < self.platforms[p as usize].warm_hold {
            return;
        }
        let mut active = self.active_pool_instances(p);
        // Warm instances hold group units too: they wait for room like launches for TaskRuns.
        while active < pool.min_instances
            && self.occupied(p) < pool.instance.capacity()
            && self.group_room(p)
        {
            let deadline = self.now + pool.instance.allocation_timeout;
            let inst = self.new_instance(p, Arc::new(pool.instance.clone()), Some(pool.clone()));
            self.timers.arm(deadline, Timer::Deadline(inst));
            self.launch(inst, out);
            active += 1;
        }
    }
}
