//! Kubernetes Events, published from a bounded outbox at a bounded rate.
//!
//! A mass rebuild can queue 100,000 TaskRuns in minutes, and the scheduler tells each one
//! "waiting for a host". Published one task per Event, they would all sit in memory at once (as
//! tasks waiting for a publish slot) and then flood the Events API; kube-runtime's `Recorder`
//! also caches every Event it sent for six minutes. So Events go through an [`Outbox`] (pure;
//! time is passed in) and leave it at a steady rate:
//! - an Event about the same object with the same reason as one still waiting replaces it (the
//!   newer note is the true one: "3 ahead" supersedes "40 ahead");
//! - at most `capacity` Events wait; when the outbox is full a Normal Event is dropped, and a
//!   Warning takes the place of the oldest waiting Normal one (or is dropped when every waiting
//!   Event is a Warning);
//! - Events leave at `rate` per second with bursts of `burst`.
//!
//! Dropping is safe: everything an Event says is also in the TaskRun's labels or secret, or in a
//! metric; Events are for people reading `kubectl describe`. Drops are counted
//! (`multi_platform_controller_events_dropped{type}`). The memory this holds is bounded by
//! `capacity`, and the `Recorder`'s cache by `rate` × its six minutes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder};
use prometheus::{IntCounterVec, Opts, Registry};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

/// One Event to publish.
#[derive(Clone, Debug, PartialEq)]
pub struct Note {
    pub reference: ObjectReference,
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Note {
    /// What a newer Event replaces: the same object and reason.
    fn key(&self) -> NoteKey {
        let r = &self.reference;
        NoteKey {
            object: [&r.kind, &r.namespace, &r.name, &r.uid]
                .map(|s| s.clone().unwrap_or_default())
                .join("\u{0}"),
            reason: self.reason,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct NoteKey {
    object: String,
    reason: &'static str,
}

/// How the outbox bounds memory and the Events API's load.
#[derive(Clone, Copy, Debug)]
pub struct OutboxLimits {
    /// Events waiting at most.
    pub capacity: usize,
    /// Events per second, on average.
    pub rate: f64,
    /// Events that may leave at once after a quiet spell.
    pub burst: u32,
}

impl Default for OutboxLimits {
    /// 20/s is 7,200 Events in the `Recorder`'s six-minute cache at most (a few MiB); a waiting
    /// TaskRun's Event is seconds late at worst while the outbox drains.
    fn default() -> Self {
        OutboxLimits {
            capacity: 1000,
            rate: 20.0,
            burst: 50,
        }
    }
}

/// What [`Outbox::push`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pushed {
    Queued,
    /// Replaced a waiting Event about the same object and reason.
    Coalesced,
    /// The outbox was full: this Event (Normal, or a Warning among Warnings) was dropped.
    Dropped {
        warning: bool,
    },
    /// Queued in place of the oldest waiting Normal Event, which was dropped.
    Evicted,
}

/// What [`Outbox::pop`] gives.
#[derive(Clone, Debug, PartialEq)]
pub enum Popped {
    Note(Note),
    /// Nothing may leave before this much time has passed.
    Wait(Duration),
    Empty,
}

/// The pure policy: a bounded, coalescing queue with a token bucket. See the module docs.
#[derive(Debug)]
pub struct Outbox {
    limits: OutboxLimits,
    /// Waiting Events by arrival order.
    order: BTreeMap<u64, Note>,
    /// Arrival number of the waiting Event per key.
    by_key: HashMap<NoteKey, u64>,
    /// Arrival numbers of the waiting Normal Events (the ones a Warning may displace).
    normal: BTreeSet<u64>,
    next: u64,
    tokens: f64,
    refilled: Instant,
}

impl Outbox {
    pub fn new(limits: OutboxLimits, now: Instant) -> Self {
        Outbox {
            limits,
            order: BTreeMap::new(),
            by_key: HashMap::new(),
            normal: BTreeSet::new(),
            next: 0,
            tokens: f64::from(limits.burst),
            refilled: now,
        }
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub fn push(&mut self, note: Note) -> Pushed {
        let key = note.key();
        if let Some(&seq) = self.by_key.get(&key) {
            // Keeps its place in line: a TaskRun told "waiting" again is not pushed back.
            if note.warning {
                self.normal.remove(&seq);
            } else {
                self.normal.insert(seq);
            }
            self.order.insert(seq, note);
            return Pushed::Coalesced;
        }
        let mut pushed = Pushed::Queued;
        if self.order.len() >= self.limits.capacity {
            if !note.warning {
                return Pushed::Dropped { warning: false };
            }
            let Some(oldest) = self.normal.pop_first() else {
                return Pushed::Dropped { warning: true };
            };
            self.remove(oldest);
            pushed = Pushed::Evicted;
        }
        let seq = self.next;
        self.next += 1;
        if !note.warning {
            self.normal.insert(seq);
        }
        self.by_key.insert(key, seq);
        self.order.insert(seq, note);
        pushed
    }

    pub fn pop(&mut self, now: Instant) -> Popped {
        if self.order.is_empty() {
            return Popped::Empty;
        }
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.limits.rate).min(f64::from(self.limits.burst));
        self.refilled = now;
        // The epsilon keeps float rounding from asking for a wait of nothing, again and again.
        if self.tokens < 1.0 - 1e-9 {
            return Popped::Wait(Duration::from_secs_f64(
                (1.0 - self.tokens) / self.limits.rate,
            ));
        }
        self.tokens = (self.tokens - 1.0).max(0.0);
        let Some((&seq, _)) = self.order.first_key_value() else {
            return Popped::Empty;
        };
        match self.remove(seq) {
            Some(note) => Popped::Note(note),
            None => Popped::Empty,
        }
    }

    fn remove(&mut self, seq: u64) -> Option<Note> {
        let note = self.order.remove(&seq)?;
        self.normal.remove(&seq);
        self.by_key.remove(&note.key());
        Some(note)
    }

    /// Every index agrees with the waiting Events (tests call it).
    pub fn check(&self) {
        assert!(self.order.len() <= self.limits.capacity, "over capacity");
        assert_eq!(self.by_key.len(), self.order.len(), "key index out of step");
        for (seq, note) in &self.order {
            assert_eq!(
                self.by_key.get(&note.key()),
                Some(seq),
                "key index points elsewhere"
            );
            assert_eq!(
                self.normal.contains(seq),
                !note.warning,
                "normal index out of step"
            );
        }
        assert!(self.normal.iter().all(|s| self.order.contains_key(s)));
    }
}

/// Publishes Events through a [`Recorder`] from an [`Outbox`]: [`EventSink::submit`] never
/// waits, one task drains the outbox with at most `parallel` publishes in flight.
#[derive(Clone)]
pub struct EventSink {
    shared: Arc<Shared>,
}

struct Shared {
    outbox: Mutex<Outbox>,
    wake: Notify,
    dropped: IntCounterVec,
}

/// How long one publish may take before it is given up.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

impl EventSink {
    /// Starts the drain task; it stops with `stop`.
    pub fn start(
        recorder: Recorder,
        limits: OutboxLimits,
        parallel: usize,
        dropped: IntCounterVec,
        stop: CancellationToken,
    ) -> Self {
        let shared = Arc::new(Shared {
            outbox: Mutex::new(Outbox::new(limits, Instant::now())),
            wake: Notify::new(),
            dropped,
        });
        tokio::spawn(drain(shared.clone(), recorder, parallel.max(1), stop));
        EventSink { shared }
    }

    /// Queues an Event (or drops it, per the outbox's policy).
    pub fn submit(&self, note: Note) {
        let pushed = self.outbox().push(note);
        match pushed {
            Pushed::Dropped { warning } => {
                self.count_drop(warning);
                return;
            }
            Pushed::Evicted => self.count_drop(false),
            Pushed::Queued | Pushed::Coalesced => {}
        }
        self.shared.wake.notify_one();
    }

    /// Events waiting to be published.
    pub fn waiting(&self) -> usize {
        self.outbox().len()
    }

    fn count_drop(&self, warning: bool) {
        let kind = if warning { "Warning" } else { "Normal" };
        self.shared.dropped.with_label_values(&[kind]).inc();
        tracing::debug!(kind, "event dropped: the outbox is full");
    }

    fn outbox(&self) -> std::sync::MutexGuard<'_, Outbox> {
        // A panic while holding the lock leaves a consistent outbox (every method finishes its
        // index updates before anything that can panic), so a poisoned lock is still usable.
        self.shared
            .outbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The `events_dropped` counter, registered.
pub fn dropped_counter(registry: &Registry) -> Result<IntCounterVec, prometheus::Error> {
    let c = IntCounterVec::new(
        Opts::new(
            crate::metrics::name("events_dropped"),
            "Kubernetes Events not published because the outbox was full (their content is also in labels, secrets or metrics)",
        ),
        &["type"],
    )?;
    registry.register(Box::new(c.clone()))?;
    Ok(c)
}

async fn drain(shared: Arc<Shared>, recorder: Recorder, parallel: usize, stop: CancellationToken) {
    let slots = Arc::new(Semaphore::new(parallel));
    loop {
        // Registered before looking, so a submit between the look and the wait is not missed.
        let woken = shared.wake.notified();
        let popped = shared
            .outbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop(Instant::now());
        match popped {
            Popped::Note(note) => {
                let permit = tokio::select! {
                    () = stop.cancelled() => return,
                    p = slots.clone().acquire_owned() => p,
                };
                let Ok(permit) = permit else { return };
                let recorder = recorder.clone();
                tokio::spawn(async move {
                    publish(&recorder, &note).await;
                    drop(permit);
                });
            }
            Popped::Wait(d) => tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(d) => {}
            },
            Popped::Empty => tokio::select! {
                () = stop.cancelled() => return,
                () = woken => {}
            },
        }
    }
}

/// Publishes one Event now (best effort: a lost Event is logged at debug, never retried).
pub async fn publish(recorder: &Recorder, note: &Note) {
    let ev = KubeEvent {
        type_: if note.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: note.reason.to_owned(),
        // The Events API caps notes at 1 kB.
        note: Some(truncate(&note.message, 1000)),
        action: "Allocate".to_owned(),
        secondary: None,
    };
    let reason = note.reason;
    let sent = tokio::time::timeout(PUBLISH_TIMEOUT, recorder.publish(&ev, &note.reference)).await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::debug!(%error, reason, "event not recorded"),
        Err(_) => tracing::debug!(reason, "event not recorded: timed out"),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(name: &str, warning: bool, reason: &'static str, message: &str) -> Note {
        Note {
            reference: ObjectReference {
                kind: Some("TaskRun".into()),
                namespace: Some("ns".into()),
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectReference::default()
            },
            warning,
            reason,
            message: message.into(),
        }
    }

    fn limits(capacity: usize) -> OutboxLimits {
        OutboxLimits {
            capacity,
            rate: 10.0,
            burst: 2,
        }
    }

    /// Pops everything, letting time pass whenever the rate says to wait.
    fn drain(o: &mut Outbox, mut now: Instant) -> Vec<Note> {
        let mut notes = Vec::new();
        loop {
            match o.pop(now) {
                Popped::Note(n) => notes.push(n),
                Popped::Wait(d) => now += d,
                Popped::Empty => return notes,
            }
        }
    }

    #[test]
    fn a_newer_event_about_the_same_object_and_reason_replaces_the_waiting_one_in_place() {
        let t = Instant::now();
        let mut o = Outbox::new(limits(10), t);
        assert_eq!(
            o.push(note("a", false, "WaitingForHost", "40 ahead")),
            Pushed::Queued
        );
        assert_eq!(
            o.push(note("b", false, "WaitingForHost", "41 ahead")),
            Pushed::Queued
        );
        assert_eq!(
            o.push(note("a", false, "WaitingForHost", "3 ahead")),
            Pushed::Coalesced
        );
        assert_eq!(
            o.push(note("a", true, "AllocationFailed", "no host")),
            Pushed::Queued
        );
        o.check();
        let popped: Vec<String> = drain(&mut o, t)
            .into_iter()
            .map(|n| format!("{}:{}", n.reference.name.unwrap(), n.message))
            .collect();
        assert_eq!(popped, ["a:3 ahead", "b:41 ahead", "a:no host"]);
    }

    #[test]
    fn a_full_outbox_drops_normal_events_and_lets_warnings_displace_them() {
        let t = Instant::now();
        let mut o = Outbox::new(limits(2), t);
        o.push(note("a", false, "WaitingForHost", ""));
        o.push(note("b", true, "ProvisioningFailed", ""));
        assert_eq!(
            o.push(note("c", false, "WaitingForHost", "")),
            Pushed::Dropped { warning: false }
        );
        assert_eq!(
            o.push(note("d", true, "CleanupFailed", "")),
            Pushed::Evicted
        );
        assert_eq!(
            o.push(note("e", true, "CleanupFailed", "")),
            Pushed::Dropped { warning: true }
        );
        o.check();
        let left: Vec<String> = drain(&mut o, t)
            .into_iter()
            .map(|n| n.reference.name.unwrap())
            .collect();
        assert_eq!(left, ["b", "d"]);
    }

    #[test]
    fn events_leave_at_the_configured_rate_after_the_burst() {
        let t = Instant::now();
        let mut o = Outbox::new(limits(100), t);
        for i in 0..10 {
            o.push(note(&format!("t{i}"), false, "WaitingForHost", ""));
        }
        assert!(matches!(o.pop(t), Popped::Note(_)));
        assert!(matches!(o.pop(t), Popped::Note(_)));
        let Popped::Wait(d) = o.pop(t) else {
            panic!("the burst of 2 is spent")
        };
        assert!(
            d > Duration::ZERO && d <= Duration::from_millis(100),
            "{d:?}"
        );
        // One second later ten per second have come back, capped at the burst of two.
        let later = t + Duration::from_secs(1);
        assert!(matches!(o.pop(later), Popped::Note(_)));
        assert!(matches!(o.pop(later), Popped::Note(_)));
        assert!(matches!(o.pop(later), Popped::Wait(_)));
    }

    /// A mass rebuild: 100,000 TaskRuns queued, each told it waits (some twice, as the queue
    /// moves), with warnings among them. What waits stays within capacity, the warnings that fit
    /// are kept, and draining at the rate takes the time the rate says.
    #[test]
    fn a_queue_of_100_000_taskruns_keeps_the_outbox_bounded() {
        let t = Instant::now();
        let lim = OutboxLimits::default();
        let mut o = Outbox::new(lim, t);
        let (mut dropped, mut warnings_dropped) = (0, 0);
        for i in 0..100_000 {
            let warning = i % 1000 == 0;
            let reason = if warning {
                "ProvisioningFailed"
            } else {
                "WaitingForHost"
            };
            for message in ["100 ahead", "50 ahead"] {
                match o.push(note(&format!("t{i}"), warning, reason, message)) {
                    Pushed::Dropped { warning: true } => warnings_dropped += 1,
                    Pushed::Dropped { warning: false } | Pushed::Evicted => dropped += 1,
                    Pushed::Queued | Pushed::Coalesced => {}
                }
                assert!(o.len() <= lim.capacity);
            }
        }
        o.check();
        assert_eq!(o.len(), lim.capacity);
        assert_eq!(warnings_dropped, 0, "100 warnings fit in 1,000 places");
        // Every Normal Event either waits, or was dropped once per push after the outbox filled.
        let waiting_warnings = o.order.values().filter(|n| n.warning).count();
        assert_eq!(waiting_warnings, 100);
        assert!(dropped > 190_000, "{dropped}");
        // Draining: the burst at once, then one per 1/rate seconds.
        let mut now = t;
        let mut sent = 0;
        loop {
            match o.pop(now) {
                Popped::Note(_) => sent += 1,
                Popped::Wait(d) => now += d,
                Popped::Empty => break,
            }
        }
        assert_eq!(sent, lim.capacity);
        let took = now.duration_since(t).as_secs_f64();
        let expected = (lim.capacity as f64 - f64::from(lim.burst)) / lim.rate;
        assert!(
            (took - expected).abs() < 1.0,
            "{took} s, expected {expected} s"
        );
    }
}
