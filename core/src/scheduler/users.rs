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

use std::hash::BuildHasher;
use std::sync::Arc;

use foldhash::quality::FixedState;

use super::arena::Key;
use super::{Action, HostId, NO_PLATFORM, PlatformId, Scheduler, State, TaskRunRef};

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

fn user_hash(user: &str) -> u64 {
    FixedState::default().hash_one(user)
}

fn user_of_path(path: &Arc<str>) -> String {
    TaskRunRef::from_path(path.clone(), super::Uid::new("")).remote_user()
}

/// The user-name index's hash for the TaskRun at `path`.
pub(super) fn user_key(path: &Arc<str>) -> u64 {
    user_hash(&user_of_path(path))
}

impl Scheduler {
    /// Indexes a newly tracked TaskRun by its user name.
    pub(super) fn index_user(&mut self, key: Key) {
        if let Some(t) = self.taskruns.get(key) {
            self.by_user.insert((user_key(&t.path), key));
        }
    }

    /// Forgets a TaskRun that is no longer tracked (`path` was its path); TaskRuns it kept off a
    /// host may go there now.
    pub(super) fn unindex_user(&mut self, key: Key, path: &Arc<str>, out: &mut Vec<Action>) {
        let user = user_of_path(path);
        let h = user_hash(&user);
        self.by_user.remove(&(h, key));
        let freed: Vec<_> = self
            .same_user(h, &user, key)
            .filter_map(|k| self.taskruns.get(k).map(|t| t.platform))
            .collect();
        for p in freed {
            self.pump(p, out);
        }
    }

    fn same_user<'a>(&'a self, h: u64, user: &'a str, me: Key) -> impl Iterator<Item = Key> + 'a {
        let lo = Key {
            index: 0,
            generation: 0,
        };
        let hi = Key {
            index: u32::MAX,
            generation: u32::MAX,
        };
        self.by_user
            .range((h, lo)..=(h, hi))
            .map(|&(_, k)| k)
            .filter(move |&k| {
                k != me
                    && self
                        .taskruns
                        .get(k)
                        .is_some_and(|t| user_of_path(&t.path) == user)
            })
    }

    /// What keeps `key`'s user name off some hosts, if anything.
    pub(super) fn user_guard(&self, key: Key) -> Option<UserGuard> {
        let t = self.taskruns.get(key)?;
        let user = user_of_path(&t.path);
        let rivals: Vec<Key> = self.same_user(user_hash(&user), &user, key).collect();
        let cleaning = self.cleaning.get(&user).cloned().unwrap_or_default();
        (!rivals.is_empty() || !cleaning.is_empty()).then_some(UserGuard { rivals, cleaning })
    }

    /// True when the guard keeps its TaskRun off `target`.
    pub(super) fn user_blocked(&self, guard: &UserGuard, target: Target) -> bool {
        let name = match target {
            Target::Host(h) => Some(self.hosts[h as usize].name.clone()),
            Target::Instance(i) => self.instances.get(i).and_then(|i| i.id.clone()),
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
    pub(super) fn cleaning_started(&mut self, user: String, host: &str) {
        self.cleaning.entry(user).or_default().push(host.into());
    }

    /// A removal of `user` on `host` finished (done or given up); TaskRuns with that user name
    /// of platform `p` may go there now.
    pub(super) fn cleaning_finished(
        &mut self,
        user: &str,
        host: &str,
        p: PlatformId,
        out: &mut Vec<Action>,
    ) {
        if let Some(hosts) = self.cleaning.get_mut(user) {
            if let Some(i) = hosts.iter().position(|h| &**h == host) {
                hosts.swap_remove(i);
            }
            if hosts.is_empty() {
                self.cleaning.remove(user);
            }
        }
        if p != NO_PLATFORM {
            self.pump(p, out);
        }
    }
}
