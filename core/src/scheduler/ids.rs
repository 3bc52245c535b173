//! Identifiers: TaskRun UIDs (stored compactly), operation ids echoed by result events, and the
//! TaskRun reference carried by actions.

use std::fmt;
use std::sync::Arc;

/// A Kubernetes object UID. Canonical lowercase UUIDs (what the API server issues) are stored in
/// 16 bytes; anything else is kept as text, so any string round-trips exactly.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Uid(Repr);

#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Repr {
    // Two halves rather than a u128: keeps the alignment (and so the struct size) at 8.
    Uuid([u64; 2]),
    Text(Box<str>),
}

impl Uid {
    /// Wraps a UID string.
    pub fn new(s: &str) -> Self {
        match parse_uuid(s) {
            Some(halves) => Uid(Repr::Uuid(halves)),
            None => Uid(Repr::Text(s.into())),
        }
    }

    /// The 16 bytes of a canonical UUID, or the text of any other UID.
    pub(crate) fn as_uuid(&self) -> Result<[u64; 2], &str> {
        match &self.0 {
            Repr::Uuid(halves) => Ok(*halves),
            Repr::Text(s) => Err(s),
        }
    }
}

impl From<&str> for Uid {
    fn from(s: &str) -> Self {
        Uid::new(s)
    }
}

/// Parses `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (lowercase hex only, so formatting round-trips).
fn parse_uuid(s: &str) -> Option<[u64; 2]> {
    let b = s.as_bytes();
    if b.len() != 36 {
        return None;
    }
    let mut v: u128 = 0;
    for (i, &c) in b.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        v = (v << 4) | u128::from(d);
    }
    Some([(v >> 64) as u64, v as u64])
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Repr::Text(s) => f.write_str(s),
            Repr::Uuid([hi, lo]) => {
                let v = (u128::from(*hi) << 64) | u128::from(*lo);
                let h = format!("{v:032x}");
                write!(
                    f,
                    "{}-{}-{}-{}-{}",
                    &h[..8],
                    &h[8..12],
                    &h[12..16],
                    &h[16..20],
                    &h[20..]
                )
            }
        }
    }
}

impl fmt::Debug for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Uid({self})")
    }
}

/// Identifies one action with an outcome; the result event echoes it. Opaque: a slot of the
/// operation table and a serial number, so an id recurs only after 2^32 operations; results for
/// ids the [`Scheduler`](super::Scheduler) no longer waits for are ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId(pub u64);

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op-{}", self.0)
    }
}

/// The TaskRun an action is about. Cheap to clone: one reference count (actions carry it by
/// the million, so it is a single shared string and a UID, small enough to move without a copy
/// loop).
#[derive(Clone, PartialEq, Eq)]
pub struct TaskRunRef {
    /// `<namespace>/<name>`: neither part can contain `/` (a DNS label and a DNS subdomain).
    path: Arc<str>,
    uid: Uid,
}

impl TaskRunRef {
    /// A reference to `namespace/name` with this UID.
    pub fn new(namespace: &str, name: &str, uid: Uid) -> Self {
        TaskRunRef {
            path: Self::path_of(namespace, name),
            uid,
        }
    }

    /// The shared `<namespace>/<name>` string a [`TaskRunRef`] is built from.
    pub(crate) fn path_of(namespace: &str, name: &str) -> Arc<str> {
        let mut s = String::with_capacity(namespace.len() + 1 + name.len());
        s.push_str(namespace);
        s.push('/');
        s.push_str(name);
        s.into()
    }

    /// From a string made by [`TaskRunRef::path_of`].
    pub(crate) fn from_path(path: Arc<str>, uid: Uid) -> Self {
        TaskRunRef { path, uid }
    }

    /// Namespace.
    pub fn namespace(&self) -> &str {
        split_path(&self.path).0
    }

    /// Name.
    pub fn name(&self) -> &str {
        split_path(&self.path).1
    }

    /// UID: patches and secret deletions must be conditional on it (a TaskRun may be deleted and
    /// recreated with the same name).
    pub fn uid(&self) -> &Uid {
        &self.uid
    }

    /// `multi-platform-ssh-<name>`.
    pub fn secret_name(&self) -> String {
        crate::contract::secret_name(self.name())
    }

    /// `<namespace>:<name>`, the `taskRunID` instance tag.
    pub fn id(&self) -> String {
        crate::contract::taskrun_id(self.namespace(), self.name())
    }

    /// The remote user provisioned for this TaskRun (`u-<md5>`).
    pub fn remote_user(&self) -> String {
        crate::contract::remote_user_name(self.name(), self.namespace())
    }
}

/// Who a launch is for and which try of it: the one identity of an instance from the scheduler to
/// the cloud and back. The cloud derives the launch's idempotency token (`ClientToken`) and the
/// instance's ownership tags from it, adopts an earlier try's live instance by it, and listings
/// report it back (the owner tag), which recovery adopts by.
///
/// It is rebuilt from what outlives a restart (the TaskRun's UID, its Tekton retry count and the
/// instances recorded in `failed-hosts`), so a restarted controller relaunching the same TaskRun's
/// same attempt gets the instance the crashed one launched instead of a second one. Retries of one
/// launch (after a cloud error) reuse it; a new instance for the same TaskRun (the previous one
/// failed) has the next `attempt`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchId {
    /// Who the instance is for.
    pub owner: LaunchOwner,
    /// The TaskRun's Tekton retry (`status.retriesStatus` length) the launch serves; 0 for warm
    /// pool instances.
    pub retry: u32,
    /// The instance of that retry, from 1: one more than the instances that failed for it.
    pub attempt: u32,
}

/// Who an instance is launched for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchOwner {
    /// A TaskRun: its own dynamic instance, or the pool instance launched because the pool had no
    /// room for it.
    TaskRun(TaskRunRef),
    /// A warm pool instance (`min-instances`), launched for no TaskRun. Its name is unique (launch
    /// time and slot) rather than stable: a restart that misses it in the listing launches another
    /// one, and the idle reaper terminates the surplus.
    Warm(Arc<str>),
}

impl LaunchId {
    /// The owner tag value: the TaskRun's UID, or the warm instance's name.
    pub fn owner_key(&self) -> String {
        match &self.owner {
            LaunchOwner::TaskRun(t) => t.uid().to_string(),
            LaunchOwner::Warm(name) => name.to_string(),
        }
    }

    /// The attempt tag value: `<retry>.<attempt>`.
    pub fn attempt_tag(&self) -> String {
        format!("{}.{}", self.retry, self.attempt)
    }

    /// The compat `taskRunID` tag value: `<namespace>:<name>`, or the warm instance's name (the Go
    /// controller tags pool instances with their name).
    pub fn taskrun_id(&self) -> String {
        match &self.owner {
            LaunchOwner::TaskRun(t) => t.id(),
            LaunchOwner::Warm(name) => name.to_string(),
        }
    }
}

impl fmt::Display for LaunchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.owner {
            LaunchOwner::TaskRun(t) => write!(f, "{t} ({})", t.uid())?,
            LaunchOwner::Warm(name) => f.write_str(name)?,
        }
        write!(f, " attempt {}", self.attempt_tag())
    }
}

/// `(namespace, name)` of a `<namespace>/<name>` path.
pub(crate) fn split_path(path: &str) -> (&str, &str) {
    // Namespaces are short: a plain scan beats a memchr set-up.
    match path.bytes().position(|b| b == b'/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

impl fmt::Display for TaskRunRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.path)
    }
}

impl fmt::Debug for TaskRunRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskRunRef")
            .field("namespace", &self.namespace())
            .field("name", &self.name())
            .field("uid", &self.uid)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_round_trips_and_is_compact() {
        let s = "0f8e2a9c-1b2d-4e3f-8a9b-0c1d2e3f4a5b";
        let u = Uid::new(s);
        assert!(matches!(u.0, Repr::Uuid(_)));
        assert_eq!(u.to_string(), s);
        assert_eq!(std::mem::size_of::<Uid>(), 24);
    }

    #[test]
    fn taskrun_ref_splits_namespace_and_name() {
        let r = TaskRunRef::new("tenant-a", "build-1-on-push", Uid::new("u1"));
        assert_eq!(r.namespace(), "tenant-a");
        assert_eq!(r.name(), "build-1-on-push");
        assert_eq!(r.to_string(), "tenant-a/build-1-on-push");
        assert_eq!(r.id(), "tenant-a:build-1-on-push");
        assert_eq!(r.secret_name(), "multi-platform-ssh-build-1-on-push");
        assert_ne!(
            r,
            TaskRunRef::new("tenant", "a-build-1-on-push", Uid::new("u1"))
        );
        // Small enough that actions carrying it move without a copy loop.
        assert!(std::mem::size_of::<TaskRunRef>() <= 40);
    }

    #[test]
    fn other_uids_are_kept_verbatim() {
        for s in ["uid-1", "0F8E2A9C-1B2D-4E3F-8A9B-0C1D2E3F4A5B", ""] {
            let u = Uid::new(s);
            assert!(matches!(u.0, Repr::Text(_)), "{s}");
            assert_eq!(u.to_string(), s);
        }
    }
}
