//! Watch streams: newline-delimited JSON events from a resourceVersion on, with the apiserver's
//! semantics for unset/`0` versions, `sendInitialEvents`, bookmarks, selector transitions
//! (an object leaving the selection is reported DELETED) and 410 Gone as an ERROR event.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};

use super::Shared;
use super::ops::{parse_rv, selected_encoded};
use super::render::{self, Format};
use super::resources::ResourceDef;
use super::selector::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::store::{Encoded, EventType, ObjKey, StoreError};

/// Parameters of a watch request.
#[derive(Debug, Clone)]
pub(crate) struct WatchParams {
    pub rv: Option<String>,
    pub rv_match: Option<String>,
    pub send_initial_events: Option<bool>,
    pub bookmarks: bool,
    pub timeout: Option<Duration>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub format: Format,
}

fn error_event(e: &ApiError) -> Value {
    json!({"type": "ERROR", "object": e.to_status()})
}

fn gone(requested: u64, oldest: u64) -> Value {
    error_event(&ApiError::expired(format!(
        "too old resource version: {requested} ({oldest})"
    )))
}

fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

type Tx = tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>;

/// Starts a watch; returns the body stream of the response.
pub(crate) fn start(
    shared: Arc<Shared>,
    def: Arc<ResourceDef>,
    ns: Option<String>,
    p: WatchParams,
) -> Result<axum::body::Body, ApiError> {
    super::ops::check_fields(&def, &p.fields)?;
    let initial_requested = match p.send_initial_events {
        Some(true) => {
            if p.rv_match.as_deref() != Some("NotOlderThan") {
                return Err(ApiError::invalid(&def, "", &[("resourceVersionMatch".into(), "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan".into())]));
            }
            if !p.bookmarks {
                return Err(ApiError::invalid(
                    &def,
                    "",
                    &[(
                        "allowWatchBookmarks".into(),
                        "Forbidden: sendInitialEvents requires setting allowWatchBookmarks to true"
                            .into(),
                    )],
                ));
            }
            true
        }
        Some(false) => false,
        None => matches!(p.rv.as_deref(), None | Some("") | Some("0")),
    };
    let start_rv = parse_rv(p.rv.as_deref())?;
    let kill = shared.watch_token();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    let timeout = p.timeout.unwrap_or(shared.opts.default_watch_timeout);
    tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + timeout;
        let w = Watcher {
            def: &def,
            ns: ns.as_deref(),
            p: &p,
            tx: &tx,
        };
        // A watch-list at a revision the server has not reached waits for it, then fails with an
        // ERROR event, as the watch cache does. A plain watch from such a revision is served and
        // only ever sends what comes after it.
        if p.send_initial_events == Some(true)
            && let Some(rv) = start_rv
            && let Err(e) = shared.wait_for_rv(rv).await
        {
            let _ = tx.send(Ok(line(&error_event(&e)))).await;
            return;
        }
        let mut changed = shared.changed.subscribe();
        changed.borrow_and_update();
        // The starting state is taken under the store lock so nothing falls between it and the
        // stream.
        let start = {
            let store = shared.lock();
            let current = store.current_rv();
            match start_rv {
                Some(rv) if !initial_requested => store.events_after(rv).map(|_| (Vec::new(), rv)),
                _ => {
                    // Decoded and selected after the lock is released.
                    let items: Vec<_> = if initial_requested {
                        store
                            .list_encoded(&def.storage, ns.as_deref())
                            .into_iter()
                            .map(|(_, o)| o)
                            .collect()
                    } else {
                        Vec::new()
                    };
                    Ok((items, start_rv.unwrap_or(current).max(current)))
                }
            }
        };
        let (initial, cursor) = match start {
            Ok(s) => s,
            Err(StoreError::Gone { requested, oldest }) => {
                let _ = tx.send(Ok(line(&gone(requested, oldest)))).await;
                return;
            }
            Err(_) => return,
        };
        for o in initial {
            if !selected_encoded(&def, &o, &p.labels, &p.fields) {
                continue;
            }
            if !w.send(EventType::Added, def.to_version(o.decode())).await {
                return;
            }
        }
        if p.send_initial_events == Some(true) {
            let mut b = w.bookmark(cursor);
            b["object"]["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
            if tx.send(Ok(line(&b))).await.is_err() {
                return;
            }
        }
        w.run(&shared, cursor, &mut changed, &kill, deadline).await;
    });
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    Ok(axum::body::Body::from_stream(stream))
}

struct Watcher<'a> {
    def: &'a ResourceDef,
    ns: Option<&'a str>,
    p: &'a WatchParams,
    tx: &'a Tx,
}

impl Watcher<'_> {
    fn bookmark(&self, rv: u64) -> Value {
        json!({"type": "BOOKMARK", "object": {"kind": self.def.kind, "apiVersion": self.def.api_version(),
               "metadata": {"resourceVersion": rv.to_string()}}})
    }

    async fn send(&self, kind: EventType, obj: Value) -> bool {
        let object = match self.p.format {
            Format::Table(inc) => {
                render::table(self.def, std::slice::from_ref(&obj), None, None, inc)
            }
            f => render::item(self.def, obj, f),
        };
        self.tx
            .send(Ok(line(&json!({"type": kind.as_str(), "object": object}))))
            .await
            .is_ok()
    }

    fn selects(&self, key: &ObjKey, obj: &Encoded) -> bool {
        let in_ns = self.ns.is_none_or(|n| key.0 == n);
        in_ns && selected_encoded(self.def, obj, &self.p.labels, &self.p.fields)
    }

    async fn run(
        &self,
        shared: &Shared,
        mut cursor: u64,
        changed: &mut tokio::sync::watch::Receiver<u64>,
        kill: &tokio_util::sync::CancellationToken,
        deadline: tokio::time::Instant,
    ) {
        // The client already knows `start`; bookmarks only ever tell it something newer.
        let start = cursor;
        let interval = shared.opts.bookmark_interval;
        let mut next_bookmark = next_bookmark_time(tokio::time::Instant::now(), interval, deadline);
        loop {
            changed.borrow_and_update();
            let batch = {
                let store = shared.lock();
                store
                    .events_after(cursor)
                    .map(|evs| (evs, store.current_rv()))
            };
            match batch {
                Err(StoreError::Gone { requested, oldest }) => {
                    let _ = self.tx.send(Ok(line(&gone(requested, oldest)))).await;
                    return;
                }
                Err(_) => return,
                Ok((events, current)) => {
                    for ev in events {
                        if *ev.storage != *self.def.storage {
                            continue;
                        }
                        let now_in =
                            ev.kind != EventType::Deleted && self.selects(&ev.key, &ev.object);
                        let was_in = ev.prev.as_ref().is_some_and(|p| self.selects(&ev.key, p));
                        let kind = match (ev.kind, was_in, now_in) {
                            (EventType::Deleted, true, _) => EventType::Deleted,
                            (EventType::Deleted, false, _) => continue,
                            (_, false, true) => EventType::Added,
                            (_, true, true) => EventType::Modified,
                            (_, true, false) => EventType::Deleted,
                            (_, false, false) => continue,
                        };
                        if !self
                            .send(kind, self.def.to_version(ev.object.decode()))
                            .await
                        {
                            return;
                        }
                    }
                    // Never backwards: a watch from a revision the server has not reached yet
                    // stays there until the server gets past it.
                    cursor = cursor.max(current);
                }
            }
            tokio::select! {
                () = kill.cancelled() => {
                    // An aborted body makes the client see a broken connection, not a clean end.
                    let _ = self.tx.send(Err(std::io::Error::other("watch dropped by fault injection"))).await;
                    return;
                }
                r = changed.changed() => if r.is_err() { return },
                () = sleep_until_some(next_bookmark), if self.p.bookmarks && next_bookmark.is_some() => {
                    next_bookmark = next_bookmark_time(tokio::time::Instant::now(), interval, deadline);
                    if cursor > start && self.tx.send(Ok(line(&self.bookmark(cursor)))).await.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(deadline) => return,
                () = self.tx.closed() => return,
            }
        }
    }
}

/// When the next periodic bookmark is due: every `interval`, and once more 2 s before the watch's
/// deadline so that a client resumes from the latest revision (the watch cache's schedule).
fn next_bookmark_time(
    now: tokio::time::Instant,
    interval: Duration,
    deadline: tokio::time::Instant,
) -> Option<tokio::time::Instant> {
    let heartbeat = now + interval;
    let pre_deadline = deadline.checked_sub(Duration::from_secs(2));
    match pre_deadline {
        Some(p) if p < heartbeat => (p >= now).then_some(p),
        _ => Some(heartbeat),
    }
}

async fn sleep_until_some(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bookmarks_come_every_interval_and_just_before_the_deadline() {
        let now = tokio::time::Instant::now();
        let s = Duration::from_secs;
        assert_eq!(next_bookmark_time(now, s(5), now + s(60)), Some(now + s(5)));
        assert_eq!(next_bookmark_time(now, s(5), now + s(6)), Some(now + s(4)));
        // Past the pre-deadline bookmark: none until the watch ends.
        assert_eq!(next_bookmark_time(now, s(5), now + s(1)), None);
    }
}
