//! Watch streams: newline-delimited JSON events from a resourceVersion on, with the apiserver's
//! semantics for unset/`0` versions, `sendInitialEvents`, bookmarks, selector transitions
//! (an object leaving the selection is reported DELETED) and 410 Gone as an ERROR event.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};

use super::Shared;
use super::ops::selected;
use super::render::{self, Format};
use super::resources::ResourceDef;
use super::selector::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::store::{EventType, StoreError};

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

fn gone(requested: u64, oldest: u64) -> Value {
    json!({"type": "ERROR", "object": ApiError::expired(format!("too old resource version: {requested} ({oldest})")).to_status()})
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
    let start_rv: Option<u64> = match p.rv.as_deref() {
        None | Some("") | Some("0") => None,
        Some(s) => Some(
            s.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version {s:?}")))?,
        ),
    };
    let kill = shared.watch_token();
    let mut changed = shared.changed.subscribe();
    changed.borrow_and_update();
    // The starting state is taken under the store lock so nothing falls between it and the stream.
    let (initial, cursor, early_gone) = {
        let store = shared.lock();
        let current = store.current_rv();
        match start_rv {
            Some(rv) if !initial_requested => match store.events_after(rv) {
                Ok(_) => (Vec::new(), rv, None),
                Err(StoreError::Gone { requested, oldest }) => {
                    (Vec::new(), rv, Some(gone(requested, oldest)))
                }
                Err(_) => (Vec::new(), rv, None),
            },
            _ => {
                let items = if initial_requested {
                    store
                        .list(&def.storage, ns.as_deref())
                        .into_iter()
                        .filter(|(_, o)| selected(&def, o, &p.labels, &p.fields))
                        .map(|(_, o)| o)
                        .collect()
                } else {
                    Vec::new()
                };
                (items, start_rv.unwrap_or(current).max(current), None)
            }
        }
    };
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
        if let Some(err) = early_gone {
            let _ = tx.send(Ok(line(&err))).await;
            return;
        }
        for o in initial {
            if !w
                .send(EventType::Added, def.from_storage((*o).clone()))
                .await
            {
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

    fn selects(&self, obj: &Value) -> bool {
        let in_ns = self
            .ns
            .is_none_or(|n| obj["metadata"]["namespace"].as_str() == Some(n));
        in_ns && selected(self.def, obj, &self.p.labels, &self.p.fields)
    }

    async fn run(
        &self,
        shared: &Shared,
        mut cursor: u64,
        changed: &mut tokio::sync::watch::Receiver<u64>,
        kill: &tokio_util::sync::CancellationToken,
        deadline: tokio::time::Instant,
    ) {
        let mut tick = tokio::time::interval(shared.opts.bookmark_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
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
                        let now_in = ev.kind != EventType::Deleted && self.selects(&ev.object);
                        let was_in = ev.prev.as_ref().is_some_and(|p| self.selects(p));
                        let kind = match (ev.kind, was_in, now_in) {
                            (EventType::Deleted, true, _) => EventType::Deleted,
                            (EventType::Deleted, false, _) => continue,
                            (_, false, true) => EventType::Added,
                            (_, true, true) => EventType::Modified,
                            (_, true, false) => EventType::Deleted,
                            (_, false, false) => continue,
                        };
                        if !self
                            .send(kind, self.def.from_storage((*ev.object).clone()))
                            .await
                        {
                            return;
                        }
                    }
                    cursor = current;
                }
            }
            tokio::select! {
                () = kill.cancelled() => {
                    // An aborted body makes the client see a broken connection, not a clean end.
                    let _ = self.tx.send(Err(std::io::Error::other("watch dropped by fault injection"))).await;
                    return;
                }
                r = changed.changed() => if r.is_err() { return },
                _ = tick.tick(), if self.p.bookmarks => {
                    let b = self.bookmark(cursor);
                    if self.tx.send(Ok(line(&b))).await.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(deadline) => return,
                () = self.tx.closed() => return,
            }
        }
    }
}
