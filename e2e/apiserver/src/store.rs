//! In-memory object storage with one global resourceVersion counter and a bounded event history
//! (what etcd plus the watch cache give the apiserver). Events older than the history's start are
//! compacted: watching or reading from before that answers 410 Gone.
//!
//! Every object version is kept encoded (JSON bytes, as etcd keeps kube-apiserver's encoded
//! objects) and decoded on read: a stored version costs its encoded size, not a tree of
//! allocations several times larger, so a test can hold 100,000 large objects. Readers that hold
//! the store lock take [`Encoded`] handles (reference-counted, cheap to clone) and decode after
//! releasing it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::Arc;

use serde_json::{Value, json};

/// `(namespace, name)`; the namespace is empty for cluster-scoped objects.
pub type ObjKey = (String, String);

/// Watch event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Object created.
    Added,
    /// Object changed.
    Modified,
    /// Object removed.
    Deleted,
}

impl EventType {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One stored object version: its JSON encoding (map keys sorted, so equal objects have equal
/// bytes) and its resourceVersion.
#[derive(Clone, PartialEq, Eq)]
pub struct Encoded {
    rv: u64,
    bytes: Arc<[u8]>,
}

impl std::fmt::Debug for Encoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Encoded(rv {}, {} bytes)", self.rv, self.bytes.len())
    }
}

/// Only the `metadata` member of an object; the rest is skipped without being built.
#[derive(serde::Deserialize)]
struct MetadataOnly {
    #[serde(default)]
    metadata: Value,
}

impl Encoded {
    fn new(obj: &Value) -> Self {
        Self {
            rv: rv_of(obj),
            // Serialising a `Value` cannot fail (its map keys are strings).
            bytes: serde_json::to_vec(obj).unwrap_or_default().into(),
        }
    }

    /// The object.
    pub fn decode(&self) -> Value {
        // The bytes were produced from a `Value`, so they parse.
        serde_json::from_slice(&self.bytes).unwrap_or(Value::Null)
    }

    /// `{"metadata": …}` of the object: enough for labels, owners, finalizers, at a fraction of
    /// a full decode.
    pub fn metadata(&self) -> Value {
        let m = serde_json::from_slice::<MetadataOnly>(&self.bytes)
            .map(|m| m.metadata)
            .unwrap_or(Value::Null);
        json!({ "metadata": m })
    }

    /// The encoding itself.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The object's resourceVersion.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    /// Size of the encoding in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the encoding is empty (never, for a stored object).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// One change, in resourceVersion order.
#[derive(Debug, Clone)]
pub struct Event {
    /// The resourceVersion the change produced.
    pub rv: u64,
    /// Storage key of the resource (`core/pods`).
    pub storage: Arc<str>,
    /// Object key.
    pub key: ObjKey,
    /// Change type.
    pub kind: EventType,
    /// The object after the change (for deletions: the last state, at the deletion's rv).
    pub object: Encoded,
    /// The object before the change (`None` for additions).
    pub prev: Option<Encoded>,
}

/// Storage failures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// No such object.
    NotFound,
    /// The name is taken.
    AlreadyExists,
    /// The precondition resourceVersion is not the stored one.
    Conflict,
    /// The requested resourceVersion is newer than the store's.
    Future {
        /// The version asked for.
        requested: u64,
        /// The latest version.
        current: u64,
    },
    /// The requested resourceVersion was compacted; carries the oldest still available.
    Gone {
        /// The version asked for.
        requested: u64,
        /// The oldest version still served.
        oldest: u64,
    },
}

/// Objects by storage key, the global revision and the event history.
#[derive(Debug)]
pub struct Store {
    rv: u64,
    objects: HashMap<String, BTreeMap<ObjKey, Encoded>>,
    history: VecDeque<Event>,
    capacity: usize,
    compacted: u64,
    uids: HashMap<String, (String, ObjKey)>,
}

fn rv_of(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn uid_of(obj: &Value) -> Option<String> {
    obj["metadata"]["uid"].as_str().map(str::to_owned)
}

impl Store {
    /// An empty store keeping at most `capacity` events of history.
    pub fn new(capacity: usize) -> Self {
        Self {
            rv: 1,
            objects: HashMap::new(),
            history: VecDeque::new(),
            capacity: capacity.max(1),
            compacted: 1,
            uids: HashMap::new(),
        }
    }

    /// The latest resourceVersion.
    pub fn current_rv(&self) -> u64 {
        self.rv
    }

    /// The oldest resourceVersion a watch or snapshot can start from.
    pub fn oldest_rv(&self) -> u64 {
        self.compacted
    }

    /// Reads one object (decoding it: with the store locked, prefer [`Store::get_encoded`]).
    pub fn get(&self, storage: &str, key: &ObjKey) -> Option<Arc<Value>> {
        self.get_encoded(storage, key).map(|e| Arc::new(e.decode()))
    }

    /// Reads one object's stored encoding.
    pub fn get_encoded(&self, storage: &str, key: &ObjKey) -> Option<Encoded> {
        self.objects.get(storage)?.get(key).cloned()
    }

    /// Whether the object exists.
    pub fn contains(&self, storage: &str, key: &ObjKey) -> bool {
        self.objects
            .get(storage)
            .is_some_and(|m| m.contains_key(key))
    }

    /// The current objects of a resource in key order, optionally in one namespace, decoded.
    pub fn list(&self, storage: &str, namespace: Option<&str>) -> Vec<(ObjKey, Arc<Value>)> {
        self.list_encoded(storage, namespace)
            .into_iter()
            .map(|(k, e)| (k, Arc::new(e.decode())))
            .collect()
    }

    /// The current objects of a resource in key order, optionally in one namespace, encoded.
    pub fn list_encoded(&self, storage: &str, namespace: Option<&str>) -> Vec<(ObjKey, Encoded)> {
        let Some(m) = self.objects.get(storage) else {
            return Vec::new();
        };
        match namespace {
            Some(ns) => m
                .range((ns.to_owned(), String::new())..)
                .take_while(|((n, _), _)| n == ns)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            None => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        }
    }

    /// Number of objects of a resource in a namespace (or everywhere).
    pub fn count(&self, storage: &str, namespace: Option<&str>) -> usize {
        let Some(m) = self.objects.get(storage) else {
            return 0;
        };
        match namespace {
            Some(ns) => m
                .range((ns.to_owned(), String::new())..)
                .take_while(|((n, _), _)| n == ns)
                .count(),
            None => m.len(),
        }
    }

    /// Where the object with this uid lives, if it exists.
    pub fn locate_uid(&self, uid: &str) -> Option<(String, ObjKey)> {
        self.uids.get(uid).cloned()
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, ev: Event) {
        self.history.push_back(ev);
        while self.history.len() > self.capacity {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
    }

    fn stamp(obj: &mut Value, rv: u64) {
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
    }

    /// Stores a new object; fails if the key is taken.
    pub fn create(
        &mut self,
        storage: &str,
        key: ObjKey,
        mut obj: Value,
    ) -> Result<Arc<Value>, StoreError> {
        if self.contains(storage, &key) {
            return Err(StoreError::AlreadyExists);
        }
        let rv = self.next_rv();
        Self::stamp(&mut obj, rv);
        let enc = Encoded::new(&obj);
        if let Some(uid) = uid_of(&obj) {
            self.uids.insert(uid, (storage.to_owned(), key.clone()));
        }
        self.objects
            .entry(storage.to_owned())
            .or_default()
            .insert(key.clone(), enc.clone());
        self.record(Event {
            rv,
            storage: storage.into(),
            key,
            kind: EventType::Added,
            object: enc,
            prev: None,
        });
        Ok(Arc::new(obj))
    }

    /// Replaces an object if its stored resourceVersion is `expected_rv` (when given). An update
    /// that changes nothing keeps the resourceVersion and emits no event, as in Kubernetes.
    pub fn update(
        &mut self,
        storage: &str,
        key: &ObjKey,
        mut obj: Value,
        expected_rv: Option<u64>,
    ) -> Result<Arc<Value>, StoreError> {
        let old = self.get_encoded(storage, key).ok_or(StoreError::NotFound)?;
        if expected_rv.is_some_and(|e| e != old.rv) {
            return Err(StoreError::Conflict);
        }
        Self::stamp(&mut obj, old.rv);
        // Sorted map keys: equal objects encode to equal bytes.
        if Encoded::new(&obj) == old {
            return Ok(Arc::new(obj));
        }
        let rv = self.next_rv();
        Self::stamp(&mut obj, rv);
        let enc = Encoded::new(&obj);
        self.objects
            .entry(storage.to_owned())
            .or_default()
            .insert(key.clone(), enc.clone());
        self.record(Event {
            rv,
            storage: storage.into(),
            key: key.clone(),
            kind: EventType::Modified,
            object: enc,
            prev: Some(old),
        });
        Ok(Arc::new(obj))
    }

    /// Removes an object (if its resourceVersion is `expected_rv`, when given). `last` is the final
    /// state reported in the DELETED event (default: the stored object).
    pub fn delete(
        &mut self,
        storage: &str,
        key: &ObjKey,
        last: Option<Value>,
        expected_rv: Option<u64>,
    ) -> Result<Arc<Value>, StoreError> {
        let old = self.get_encoded(storage, key).ok_or(StoreError::NotFound)?;
        if expected_rv.is_some_and(|e| e != old.rv) {
            return Err(StoreError::Conflict);
        }
        let rv = self.next_rv();
        let old_value = old.decode();
        let mut obj = last.unwrap_or_else(|| old_value.clone());
        Self::stamp(&mut obj, rv);
        if let Some(m) = self.objects.get_mut(storage) {
            m.remove(key);
        }
        if let Some(uid) = uid_of(&old_value) {
            self.uids.remove(&uid);
        }
        self.record(Event {
            rv,
            storage: storage.into(),
            key: key.clone(),
            kind: EventType::Deleted,
            object: Encoded::new(&obj),
            prev: Some(old),
        });
        Ok(Arc::new(obj))
    }

    /// Events after `rv` (exclusive), oldest first, or `Gone` if some were compacted away.
    pub fn events_after(&self, rv: u64) -> Result<Vec<Event>, StoreError> {
        if rv < self.compacted {
            return Err(StoreError::Gone {
                requested: rv,
                oldest: self.compacted,
            });
        }
        let start = self.history.partition_point(|e| e.rv <= rv);
        Ok(self.history.range(start..).cloned().collect())
    }

    /// The objects of a resource as of revision `rv`, in key order, optionally in one namespace.
    pub fn snapshot(
        &self,
        storage: &str,
        namespace: Option<&str>,
        rv: u64,
    ) -> Result<Vec<(ObjKey, Arc<Value>)>, StoreError> {
        Ok(self
            .snapshot_after(storage, namespace, rv, None)?
            .into_iter()
            .map(|(k, e)| (k, Arc::new(e.decode())))
            .collect())
    }

    /// The objects of a resource as of revision `rv`, in key order, after the key `after`,
    /// encoded, read in one go (see [`Cursor`] to read them a chunk at a time).
    pub fn snapshot_after(
        &self,
        storage: &str,
        namespace: Option<&str>,
        rv: u64,
        after: Option<&ObjKey>,
    ) -> Result<Vec<(ObjKey, Encoded)>, StoreError> {
        let mut cursor = self.cursor(storage, namespace, rv, after)?;
        let mut out = Vec::new();
        loop {
            let chunk = cursor.next_chunk(self, usize::MAX)?;
            if chunk.is_empty() {
                return Ok(out);
            }
            out.extend(chunk);
        }
    }

    /// A read of a resource as of revision `rv` after the key `after` (optionally in one
    /// namespace), taken a chunk at a time with [`Cursor::next_chunk`].
    pub fn cursor(
        &self,
        storage: &str,
        namespace: Option<&str>,
        rv: u64,
        after: Option<&ObjKey>,
    ) -> Result<Cursor, StoreError> {
        if rv > self.rv {
            return Err(StoreError::Future {
                requested: rv,
                current: self.rv,
            });
        }
        if rv < self.rv && rv < self.compacted {
            return Err(StoreError::Gone {
                requested: rv,
                oldest: self.compacted,
            });
        }
        let ns_start = namespace.map(|ns| (ns.to_owned(), String::new()));
        let lower = match (after, ns_start) {
            (Some(a), Some(n)) if *a < n => Bound::Included(n),
            (Some(a), _) => Bound::Excluded(a.clone()),
            (None, Some(n)) => Bound::Included(n),
            (None, None) => Bound::Unbounded,
        };
        Ok(Cursor {
            storage: storage.into(),
            namespace: namespace.map(str::to_owned),
            rv,
            lower,
            rewound: BTreeMap::new(),
            seen: rv,
            done: false,
        })
    }
    /// Drops all history: every earlier resourceVersion becomes too old.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    /// Drops history up to and including `rv`.
    pub fn compact_to(&mut self, rv: u64) {
        while self.history.front().is_some_and(|e| e.rv <= rv) {
            self.history.pop_front();
        }
        self.compacted = self.compacted.max(rv.min(self.rv));
    }

    /// Number of events kept.
    pub fn history_len(&self) -> usize {
        self.history.len()
    }
}

/// A read of one resource as of a revision, taken a chunk at a time so that the store is free for
/// writers between chunks: kube-apiserver serves a list from a snapshot of its watch cache while
/// writes go on, and a Lease renewal is not queued behind 100,000 objects. The state at the
/// revision is the current state with every key changed since then read as it was before its
/// first later change; the cursor follows the history as it goes, so it needs every event after
/// the revision to stay in the history until it is done (otherwise `Gone`, as a compacted etcd
/// revision).
#[derive(Debug)]
pub struct Cursor {
    storage: Arc<str>,
    namespace: Option<String>,
    rv: u64,
    /// Where the next chunk starts (keys before it were read).
    lower: Bound<ObjKey>,
    /// Keys after `lower` changed since `rv`: their state at `rv` (`None`: absent then).
    rewound: BTreeMap<ObjKey, Option<Encoded>>,
    /// The history has been followed up to this revision.
    seen: u64,
    done: bool,
}

impl Cursor {
    /// The revision read.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    fn after_lower(&self, k: &ObjKey) -> bool {
        match &self.lower {
            Bound::Included(b) => k >= b,
            Bound::Excluded(b) => k > b,
            Bound::Unbounded => true,
        }
    }

    fn in_namespace(&self, k: &ObjKey) -> bool {
        self.namespace.as_deref().is_none_or(|n| n == k.0)
    }

    /// Takes in the history since the last chunk: the first change after `rv` of each key still
    /// to be read records its state at `rv`.
    fn follow(&mut self, store: &Store) -> Result<(), StoreError> {
        if self.seen == store.rv {
            return Ok(());
        }
        if self.seen < store.compacted {
            return Err(StoreError::Gone {
                requested: self.rv,
                oldest: store.compacted,
            });
        }
        let start = store.history.partition_point(|e| e.rv <= self.seen);
        for ev in store.history.range(start..) {
            if *ev.storage != *self.storage
                || !self.after_lower(&ev.key)
                || !self.in_namespace(&ev.key)
                || self.rewound.contains_key(&ev.key)
            {
                continue;
            }
            let before = match ev.kind {
                EventType::Added => None,
                EventType::Modified | EventType::Deleted => ev.prev.clone(),
            };
            self.rewound.insert(ev.key.clone(), before);
        }
        self.seen = store.rv;
        Ok(())
    }

    /// The next (at most) `n` objects in key order; empty when the read is complete. `store`
    /// must be the store the cursor was taken from.
    pub fn next_chunk(
        &mut self,
        store: &Store,
        n: usize,
    ) -> Result<Vec<(ObjKey, Encoded)>, StoreError> {
        if self.done {
            return Ok(Vec::new());
        }
        self.follow(store)?;
        let mut current = store
            .objects
            .get(&*self.storage)
            .into_iter()
            .flat_map(|m| m.range((self.lower.clone(), Bound::Unbounded)))
            .peekable();
        let mut rewound = self
            .rewound
            .range((self.lower.clone(), Bound::Unbounded))
            .peekable();
        let mut out = Vec::new();
        let mut last = None;
        while out.len() < n {
            let from_rewound = match (current.peek(), rewound.peek()) {
                (None, None) => break,
                (Some(_), None) => false,
                (None, Some(_)) => true,
                (Some((c, _)), Some((r, _))) => match (*c).cmp(*r) {
                    std::cmp::Ordering::Less => false,
                    std::cmp::Ordering::Greater => true,
                    std::cmp::Ordering::Equal => {
                        current.next();
                        true
                    }
                },
            };
            let (k, v) = if from_rewound {
                match rewound.next() {
                    Some((k, v)) => (k, v.as_ref()),
                    None => break,
                }
            } else {
                match current.next() {
                    Some((k, v)) => (k, Some(v)),
                    None => break,
                }
            };
            if !self.in_namespace(k) {
                // Keys are ordered by namespace first: nothing further is in it.
                self.done = true;
                break;
            }
            last = Some(k);
            if let Some(v) = v {
                out.push((k.clone(), v.clone()));
            }
        }
        match last {
            Some(k) => self.lower = Bound::Excluded(k.clone()),
            None => self.done = true,
        }
        if let Bound::Excluded(l) = &self.lower {
            // What was read no longer needs its old state.
            let rest = self.rewound.split_off(l);
            self.rewound = rest;
            self.rewound.remove(l);
        }
        Ok(out)
    }

    /// How many objects are left to read, without reading them.
    pub fn count_rest(&mut self, store: &Store) -> Result<usize, StoreError> {
        self.follow(store)?;
        if self.done {
            return Ok(0);
        }
        let in_range = |k: &ObjKey| self.in_namespace(k);
        let current = store
            .objects
            .get(&*self.storage)
            .into_iter()
            .flat_map(|m| m.range((self.lower.clone(), Bound::Unbounded)))
            .take_while(|(k, _)| in_range(k))
            .count();
        let m = store.objects.get(&*self.storage);
        let mut n = current as isize;
        for (k, then) in self.rewound.range((self.lower.clone(), Bound::Unbounded)) {
            let now = m.is_some_and(|m| m.contains_key(k));
            n += isize::from(then.is_some()) - isize::from(now);
        }
        Ok(n.max(0) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        // Heap bytes allocated minus freed by this thread: a test measures what it keeps alive
        // without seeing other tests' threads.
        static LIVE: Cell<isize> = const { Cell::new(0) };
    }

    fn count(delta: isize) {
        let _ = LIVE.try_with(|c| c.set(c.get() + delta));
    }

    struct Counting;

    // SAFETY: every call is forwarded unchanged to the system allocator.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            let p = unsafe { System.alloc(l) };
            if !p.is_null() {
                count(l.size() as isize);
            }
            p
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            let p = unsafe { System.alloc_zeroed(l) };
            if !p.is_null() {
                count(l.size() as isize);
            }
            p
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            unsafe { System.dealloc(p, l) };
            count(-(l.size() as isize));
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            let q = unsafe { System.realloc(p, l, new) };
            if !q.is_null() {
                count(new as isize - l.size() as isize);
            }
            q
        }
    }

    #[global_allocator]
    static ALLOC: Counting = Counting;

    fn live() -> isize {
        LIVE.with(Cell::get)
    }

    /// A TaskRun-like object: a resolved spec of many small maps and strings, as Tekton writes.
    fn big_object(i: usize) -> Value {
        let steps: Vec<Value> = (0..12)
            .map(|s| {
                json!({
                    "name": format!("step-{s}"),
                    "image": "quay.io/konflux-ci/buildah-task:latest@sha256:0123456789abcdef",
                    "env": (0..20).map(|e| json!({"name": format!("ENV_{e}"), "value": format!("$(params.P{e})")})).collect::<Vec<_>>(),
                    "volumeMounts": (0..6).map(|v| json!({"name": format!("vol-{v}"), "mountPath": format!("/mnt/{v}")})).collect::<Vec<_>>(),
                    "computeResources": {"limits": {"memory": "4Gi"}, "requests": {"cpu": "1", "memory": "4Gi"}},
                })
            })
            .collect();
        json!({
            "apiVersion": "tekton.dev/v1", "kind": "TaskRun",
            "metadata": {"name": format!("tr-{i}"), "namespace": "ns", "uid": format!("uid-{i}"),
                         "labels": {"app": "x", "tekton.dev/task": "buildah-remote-oci-ta"}},
            "spec": {"params": (0..40).map(|p| json!({"name": format!("P{p}"), "value": "v"})).collect::<Vec<_>>()},
            "status": {"taskSpec": {"steps": steps}},
        })
    }

    #[test]
    fn a_stored_version_costs_about_its_encoded_size() {
        const N: usize = 100;
        let mut s = Store::new(10_000);
        let mut encoded = 0;
        let before = live();
        for i in 0..N {
            let key = k("ns", &format!("tr-{i}"));
            let created = s.create("tekton.dev/taskruns", key.clone(), big_object(i));
            let mut obj = (*created.unwrap()).clone();
            encoded += serde_json::to_vec(&obj).unwrap().len();
            obj["status"]["podName"] = json!(format!("tr-{i}-pod"));
            let updated = s.update("tekton.dev/taskruns", &key, obj, None).unwrap();
            encoded += serde_json::to_vec(&*updated).unwrap().len();
        }
        // Both versions of each object are kept (the current one and the history's previous).
        assert_eq!(s.history_len(), 2 * N);
        let kept = (live() - before) as usize;
        let per_version = kept as f64 / encoded as f64;
        assert!(
            per_version < 1.3,
            "{kept} bytes live for {encoded} bytes of encoded versions ({per_version:.2}x)"
        );
        drop(s);
    }

    fn k(ns: &str, n: &str) -> ObjKey {
        (ns.into(), n.into())
    }

    #[test]
    fn create_update_delete_and_history() {
        let mut s = Store::new(100);
        let a = s
            .create(
                "core/cm",
                k("ns", "a"),
                json!({"metadata": {"name": "a", "uid": "u1"}, "data": {"x": "1"}}),
            )
            .unwrap();
        let rv1 = rv_of(&a);
        assert_eq!(
            s.create("core/cm", k("ns", "a"), json!({})),
            Err(StoreError::AlreadyExists)
        );
        let mut b = (*a).clone();
        b["data"]["x"] = json!("2");
        assert_eq!(
            s.update("core/cm", &k("ns", "a"), b.clone(), Some(rv1 - 1)),
            Err(StoreError::Conflict)
        );
        let b = s.update("core/cm", &k("ns", "a"), b, Some(rv1)).unwrap();
        assert!(rv_of(&b) > rv1);
        // A no-op update keeps the version and records nothing.
        let n = s.history_len();
        let same = s
            .update("core/cm", &k("ns", "a"), (*b).clone(), None)
            .unwrap();
        assert_eq!(rv_of(&same), rv_of(&b));
        assert_eq!(s.history_len(), n);
        assert_eq!(s.locate_uid("u1"), Some(("core/cm".into(), k("ns", "a"))));
        let d = s.delete("core/cm", &k("ns", "a"), None, None).unwrap();
        assert!(rv_of(&d) > rv_of(&b));
        assert!(s.locate_uid("u1").is_none());
        let evs = s.events_after(rv1).unwrap();
        assert_eq!(
            evs.iter().map(|e| e.kind).collect::<Vec<_>>(),
            [EventType::Modified, EventType::Deleted]
        );
    }

    #[test]
    fn snapshots_rewind_history() {
        let mut s = Store::new(100);
        s.create("r", k("a", "1"), json!({"v": 1})).unwrap();
        let at = s.current_rv();
        s.create("r", k("a", "2"), json!({"v": 2})).unwrap();
        s.update("r", &k("a", "1"), json!({"v": 10}), None).unwrap();
        s.delete("r", &k("a", "1"), None, None).unwrap();
        s.create("other", k("a", "9"), json!({})).unwrap();
        let snap = s.snapshot("r", None, at).unwrap();
        assert_eq!(snap.len(), 1);
        assert_eq!(snap[0].1["v"], 1);
        assert_eq!(s.snapshot("r", Some("b"), at).unwrap().len(), 0);
        let now = s.snapshot("r", None, s.current_rv()).unwrap();
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].0, k("a", "2"));
    }

    #[test]
    fn snapshots_after_a_key_resume_in_order_and_rewind() {
        let mut s = Store::new(100);
        for (ns, name) in [("a", "1"), ("a", "3"), ("b", "1"), ("b", "2"), ("c", "1")] {
            s.create("r", k(ns, name), json!({"v": format!("{ns}{name}")}))
                .unwrap();
        }
        let at = s.current_rv();
        s.update("r", &k("b", "2"), json!({"v": "new"}), None)
            .unwrap();
        s.delete("r", &k("a", "3"), None, None).unwrap();
        s.create("r", k("b", "0"), json!({"v": "later"})).unwrap();
        let keys = |it: Vec<(ObjKey, Encoded)>| {
            it.into_iter()
                .map(|((ns, n), v)| format!("{ns}/{n}={}", v.decode()["v"].as_str().unwrap()))
                .collect::<Vec<_>>()
        };
        let after = |ns: Option<&str>, from: ObjKey| {
            keys(s.snapshot_after("r", ns, at, Some(&from)).unwrap())
        };
        // As of `at`: a/3 back, b/2 as it was, b/0 not yet there; strictly after the key.
        assert_eq!(
            after(None, k("a", "1")),
            ["a/3=a3", "b/1=b1", "b/2=b2", "c/1=c1"]
        );
        assert_eq!(after(Some("b"), k("b", "1")), ["b/2=b2"]);
        // A key before the namespace starts at the namespace; one past it yields nothing.
        assert_eq!(after(Some("b"), k("a", "9")), ["b/1=b1", "b/2=b2"]);
        assert!(after(Some("b"), k("c", "0")).is_empty());
        let now = s.snapshot_after("r", None, s.current_rv(), Some(&k("a", "1")));
        assert_eq!(
            keys(now.unwrap()),
            ["b/0=later", "b/1=b1", "b/2=new", "c/1=c1"]
        );
    }

    #[test]
    fn a_cursor_reads_one_revision_while_writes_go_on_between_chunks() {
        let mut s = Store::new(1_000);
        for i in 0..10 {
            s.create("r", k("a", &format!("{i:02}")), json!({"v": i}))
                .unwrap();
        }
        s.create("r", k("b", "x"), json!({"v": "b"})).unwrap();
        let at = s.current_rv();
        let mut c = s.cursor("r", Some("a"), at, None).unwrap();
        let read = |c: &mut Cursor, s: &Store, n| {
            c.next_chunk(s, n)
                .unwrap()
                .into_iter()
                .map(|((_, name), v)| format!("{name}={}", v.decode()["v"]))
                .collect::<Vec<_>>()
        };
        assert_eq!(read(&mut c, &s, 3), ["00=0", "01=1", "02=2"]);
        assert_eq!(c.count_rest(&s).unwrap(), 7);
        // Between chunks: a read key changes, unread ones change, go, and a new one comes.
        s.update("r", &k("a", "01"), json!({"v": 100}), None)
            .unwrap();
        s.update("r", &k("a", "04"), json!({"v": 400}), None)
            .unwrap();
        s.update("r", &k("a", "04"), json!({"v": 401}), None)
            .unwrap();
        s.delete("r", &k("a", "05"), None, None).unwrap();
        s.create("r", k("a", "055"), json!({"v": "new"})).unwrap();
        s.create("r", k("a", "99"), json!({"v": "new"})).unwrap();
        assert_eq!(c.count_rest(&s).unwrap(), 7);
        assert_eq!(read(&mut c, &s, 3), ["03=3", "04=4", "05=5"]);
        s.delete("r", &k("a", "09"), None, None).unwrap();
        assert_eq!(
            read(&mut c, &s, 100),
            ["06=6", "07=7", "08=8", "09=9"],
            "nothing from after the revision, nothing of namespace b"
        );
        assert!(read(&mut c, &s, 100).is_empty());
        assert_eq!(c.count_rest(&s).unwrap(), 0);
        // A read that falls behind the history fails as a compacted revision does.
        let mut c = s.cursor("r", None, s.current_rv(), None).unwrap();
        assert_eq!(read(&mut c, &s, 2).len(), 2);
        s.update("r", &k("a", "08"), json!({"v": 0}), None).unwrap();
        s.compact();
        assert!(matches!(c.next_chunk(&s, 2), Err(StoreError::Gone { .. })));
    }

    #[test]
    fn bounded_history_compacts() {
        let mut s = Store::new(3);
        for i in 0..10 {
            s.create("r", k("", &i.to_string()), json!({})).unwrap();
        }
        assert_eq!(s.history_len(), 3);
        assert!(matches!(s.events_after(2), Err(StoreError::Gone { .. })));
        assert_eq!(s.events_after(s.oldest_rv()).unwrap().len(), 3);
        s.compact();
        assert!(matches!(
            s.events_after(s.current_rv() - 1),
            Err(StoreError::Gone { .. })
        ));
        assert!(s.events_after(s.current_rv()).unwrap().is_empty());
    }

    #[test]
    fn namespace_listing_is_exact() {
        let mut s = Store::new(10);
        for (ns, n) in [("a", "x"), ("ab", "y"), ("a", "z"), ("", "c")] {
            s.create("r", k(ns, n), json!({})).unwrap();
        }
        let names: Vec<_> = s
            .list("r", Some("a"))
            .into_iter()
            .map(|(k, _)| k.1)
            .collect();
        assert_eq!(names, ["x", "z"]);
        assert_eq!(s.count("r", None), 4);
    }
}
