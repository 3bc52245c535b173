//! UIDs of TaskRuns finished recently: late or reordered events for them are ignored.
//!
//! Two generations (current, previous) rotate every TTL, so a UID is remembered for at least one
//! TTL and at most two, with no per-UID timestamp or expiry queue. Canonical UUIDs (what the API
//! server issues) are kept as their 16 bytes; anything else as text. Never iterated.

use std::collections::HashSet;
use std::time::Duration;

use foldhash::quality::FixedState;

use super::ids::Uid;
use super::time::Time;

#[derive(Default)]
struct Generation {
    uuids: HashSet<[u64; 2], FixedState>,
    texts: HashSet<Box<str>, FixedState>,
}

impl Generation {
    fn contains(&self, uid: &Uid) -> bool {
        match uid.as_uuid() {
            Ok(u) => self.uuids.contains(&u),
            Err(text) => self.texts.contains(text),
        }
    }
}

/// Recently finished UIDs.
#[derive(Default)]
pub(super) struct Tombstones {
    current: Generation,
    previous: Generation,
    /// When the current generation started.
    epoch: Time,
}

impl Tombstones {
    /// Remembers a finished TaskRun's UID.
    pub(super) fn insert(&mut self, uid: &Uid) {
        match uid.as_uuid() {
            Ok(u) => {
                self.current.uuids.insert(u);
            }
            Err(text) => {
                self.current.texts.insert(text.into());
            }
        }
    }

    /// The UID finished within the window.
    pub(super) fn contains(&self, uid: &Uid) -> bool {
        self.current.contains(uid) || self.previous.contains(uid)
    }

    /// Starts a new generation once `ttl` has passed since the current one began.
    pub(super) fn rotate(&mut self, now: Time, ttl: Duration) {
        if self.epoch + ttl > now {
            return;
        }
        self.previous = std::mem::take(&mut self.current);
        if self.epoch + 2 * ttl <= now {
            // A long silence: the previous generation has expired too.
            self.previous = Generation::default();
        }
        self.epoch = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_for_one_to_two_windows_in_both_forms() {
        let ttl = Duration::from_secs(3600);
        let uuid = Uid::new("0f8e2a9c-1b2d-4e3f-8a9b-0c1d2e3f4a5b");
        let text = Uid::new("uid-a");
        let mut t = Tombstones::default();
        t.rotate(Time::from_secs(0), ttl);
        t.insert(&uuid);
        t.insert(&text);
        assert!(t.contains(&uuid) && t.contains(&text));
        assert!(!t.contains(&Uid::new("0f8e2a9c-1b2d-4e3f-8a9b-0c1d2e3f4a5c")));
        assert!(!t.contains(&Uid::new("uid-b")));
        t.rotate(Time::from_secs(3600), ttl);
        assert!(t.contains(&uuid) && t.contains(&text), "one window later");
        t.rotate(Time::from_secs(7200), ttl);
        assert!(
            !t.contains(&uuid) && !t.contains(&text),
            "two windows later"
        );
        t.insert(&uuid);
        t.rotate(Time::from_secs(7200 + 3 * 3600), ttl);
        assert!(
            !t.contains(&uuid),
            "a long silence expires both generations"
        );
    }
}
