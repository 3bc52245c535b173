//! Dynamic instances: one per TaskRun, launched when it is placed, terminated when it finishes
//! (or handed, unused, to the next waiter of the same platform).

use super::super::Scheduler;

impl Scheduler {}
