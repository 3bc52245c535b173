//! Build users shared by name. The Go-compatible user name is `u-` + md5(name + namespace) with
//! no separator, so `build-x1` in `team-a` and `build-x` in `1team-a` get the same user: on one
//! host they would share a home, keys and processes, and the first one's cleanup would remove
//! the second one's user. The name stays (the Go scripts and adopted allocations rely on it);
//! placement keeps such TaskRuns apart instead: a TaskRun is not placed on a host or instance
//! where another TaskRun with its user name is, nor where a removal of that user is in flight.
//! It waits until the other one is cleaned up.
//!
//! Costs: one md5 and one ordered-set range per placement; the per-target checks run only when
//! a same-named TaskRun or a removal of the name exists (never, unless names collide).

use std::sync::Arc;

use super::arena::Key;
use super::{HostId, Scheduler, State};

/// A place a build user lives.
#[derive(Clone, Copy)]
pub(super) enum Target {
    Host(HostId),
    Instance(Key),
}

/// What keeps a TaskRun's user name off some hosts; `None` from [`Scheduler::user_guard`] when
/// nothing does.
pub(super) struct UserGuard {
    /// Other tracked TaskRuns with the same user name.
    rivals: Vec<Key>,
    /// Hosts or instances (by name) where a removal of the user is in flight.
    cleaning: Vec<Arc<str>>,
}

impl Scheduler {
    /// What keeps `key`'s user name off some hosts, if anything.
    pub(in crate::scheduler) fn user_guard(&self, key: Key) -> Option<UserGuard> {
        let user = self.taskruns.get(key)?.user();
        let rivals: Vec<Key> = self.taskruns.same_user(&user, key).collect();
        let cleaning = self.cleaning.get(&user).cloned().unwrap_or_default();
        (!rivals.is_empty() || !cleaning.is_empty()).then_some(UserGuard { rivals, cleaning })
    }

    /// True when the guard keeps its TaskRun off `target`.
    pub(in crate::scheduler) fn user_blocked(&self, guard: &UserGuard, target: Target) -> bool {
        let name = match target {
            Target::Host(h) => Some(self.hosts[h].name.clone()),
            Target::Instance(i) => self.instances.get(i).and_then(|i| i.id().cloned()),
        };
        if name.is_some_and(|n| guard.cleaning.contains(&n)) {
            return true;
        }
        guard.rivals.iter().any(|&k| {
            match (self.taskruns.get(k).map(|t| &t.state), target) {
                (Some(State::OnHost { host, .. }), Target::Host(h)) => *host == h,
                (Some(State::OnInstance { inst, .. }), Target::Instance(i)) => *inst == i,
                // Its user may still be created (a compensated provisioning) wherever it was.
                (Some(State::Cleanup { pending }), _) => *pending > 0,
                _ => false,
            }
        })
    }

    /// A removal of `user` on `host` (a host name or instance id) was asked for.
    pub(in crate::scheduler) fn cleaning_started(&mut self, user: String, host: &str) {
        self.cleaning.entry(user).or_default().push(host.into());
    }
}
