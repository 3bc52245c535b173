//! Dynamic pools: instances shared up to `concurrency`, most loaded first; idle and
//! past-`max-age` instances drain and are terminated once empty.

use super::super::Scheduler;

/// Provisioning failures in a row after which a pool instance takes no new work.
pub(super) const POOL_INSTANCE_FAILURES: u32 = 2;

impl Scheduler {}
