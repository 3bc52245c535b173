//! Pure: per-key ordering of actions (docs/architecture.md, "The controller shell").
//!
//! Actions about one TaskRun run in the order the scheduler returned them; so do actions about
//! one instance or one user on one host. Actions of different keys run concurrently. The driver
//! owns a [`Lanes`]: [`Lanes::submit`] says whether a job may start now or was queued behind its
//! key, [`Lanes::finish`] hands out the key's next job. Jobs without a key start at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// What a job is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LaneKey {
    /// A TaskRun, by UID.
    TaskRun(Arc<str>),
    /// A cloud instance, by id.
    Instance(Arc<str>),
    /// A user on a host: `(host, user)`.
    HostUser(Arc<str>, String),
}

/// Queued jobs per busy key. A key is busy while one of its jobs runs.
#[derive(Debug)]
pub struct Lanes<J> {
    busy: HashMap<LaneKey, VecDeque<J>>,
}

impl<J> Default for Lanes<J> {
    fn default() -> Self {
        Self {
            busy: HashMap::new(),
        }
    }
}

impl<J> Lanes<J> {
    /// Offers a job: returned when it may start now (its key was idle, which is now busy);
    /// `None` when it was queued behind its key.
    pub fn submit(&mut self, key: LaneKey, job: J) -> Option<J> {
        match self.busy.get_mut(&key) {
            Some(queue) => {
                queue.push_back(job);
                None
            }
            None => {
                self.busy.insert(key, VecDeque::new());
                Some(job)
            }
        }
    }

    /// The running job of `key` finished: its next job (the key stays busy), or `None` (the key
    /// is idle again).
    pub fn finish(&mut self, key: &LaneKey) -> Option<J> {
        let queue = self.busy.get_mut(key)?;
        match queue.pop_front() {
            Some(job) => Some(job),
            None => {
                self.busy.remove(key);
                None
            }
        }
    }

    /// Keys with a running job.
    pub fn busy(&self) -> usize {
        self.busy.len()
    }

    /// Jobs waiting behind a running one.
    pub fn queued(&self) -> usize {
        self.busy.values().map(VecDeque::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_job_per_key_in_order_others_concurrently() {
        let mut l = Lanes::default();
        let a = LaneKey::TaskRun("a".into());
        let b = LaneKey::Instance("i-1".into());
        assert_eq!(l.submit(a.clone(), 1), Some(1));
        assert_eq!(l.submit(a.clone(), 2), None);
        assert_eq!(l.submit(a.clone(), 3), None);
        assert_eq!(l.submit(b.clone(), 10), Some(10));
        assert_eq!((l.busy(), l.queued()), (2, 2));
        assert_eq!(l.finish(&a), Some(2));
        assert_eq!(l.finish(&b), None);
        assert_eq!(l.submit(b.clone(), 11), Some(11));
        assert_eq!(l.finish(&a), Some(3));
        assert_eq!(l.finish(&a), None);
        assert_eq!(l.submit(a.clone(), 4), Some(4));
        assert_eq!(l.finish(&LaneKey::HostUser("h".into(), "u".into())), None);
    }
}
