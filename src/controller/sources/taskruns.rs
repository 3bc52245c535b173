//! The TaskRun watch and its index: every replica watches the TaskRuns carrying the platform
//! label ([`watch`]) and the loop applies each event to a [`TaskRunIndex`], which keeps what
//! recovery rebuilds the ledger from and says what each event means for the scheduler.

use std::collections::{HashMap, HashSet};

use futures::StreamExt;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Input;
use crate::config::{HostConfig, Strategy};
use crate::controller::execute::Job;
use crate::controller::meaning::{self, Meaning, MountMemo};
use crate::controller::taskrun::TaskRun;
use crate::platform::Platform;
use crate::scheduler::{Action, TaskRunRecord, TaskRunRef, TaskRunSpec, Uid};

/// TaskRuns per page of the (re)list. A page is held whole, as JSON and decoded, on top of
/// everything already indexed: with Konflux TaskRuns (~57 KB each with the resolved
/// `buildah-remote-oci-ta` spec) a page of 100 was the controller's heap peak once recovery's
/// jobs were capped (heap profile: the HTTP read buffer and its contiguous copy, 5 MB each;
/// BENCHMARKS.md). 50 halves that for 400 requests per 20,000 TaskRuns. Streaming lists would
/// avoid pages altogether but need the `WatchList` feature, which not every supported cluster
/// has on.
const TASKRUN_LIST_PAGE: u32 = 50;

/// Forwards TaskRun watch events to the loop, with kube-runtime's back-off on errors (a relist
/// follows a 410 or a broken watch). Runs until `stop`.
pub async fn watch(client: kube::Client, tx: mpsc::Sender<Input>, stop: CancellationToken) {
    use kube::runtime::WatchStreamExt;
    let api: kube::Api<TaskRun> = kube::Api::all(client);
    let config = watcher::Config::default()
        .labels(crate::contract::TARGET_PLATFORM_LABEL)
        .page_size(TASKRUN_LIST_PAGE);
    let mut stream = watcher(api, config).default_backoff().boxed();
    loop {
        let next = tokio::select! {
            () = stop.cancelled() => return,
            n = stream.next() => n,
        };
        match next {
            Some(Ok(ev)) => {
                if let watcher::Event::Apply(tr) = &ev {
                    tracing::debug!(
                        target: crate::controller::execute::TIMING,
                        namespace = tr.metadata.namespace.as_deref(),
                        taskrun = tr.metadata.name.as_deref(),
                        "TaskRun event received"
                    );
                }
                if tx.send(Input::TaskRuns(Box::new(ev))).await.is_err() {
                    return;
                }
            }
            Some(Err(error)) => tracing::warn!(%error, "TaskRun watch error; retrying"),
            None => return,
        }
    }
}

/// One entry of the index: what recovery needs of a live TaskRun.
struct Entry {
    record: TaskRunRecord,
    /// Recovery must know whether its Secret exists to know its state.
    secret_matters: bool,
}

/// The controller's own writes one TaskRun needs.
struct Wanted {
    taskrun: TaskRunRef,
    finalizer: bool,
    ungate: bool,
}

/// What a watch event means for the loop, in the order the loop must act on it.
#[derive(Debug, Clone)]
pub enum Found {
    /// A TaskRun that needs or holds a host: [`Event::TaskRun`](crate::scheduler::Event::TaskRun).
    Active(TaskRunSpec),
    /// A TaskRun that is done (or only released, when `released`); when `tracked_only`, only of
    /// interest if the scheduler tracks it.
    Done {
        taskrun: TaskRunRef,
        tracked_only: bool,
        released: bool,
    },
    /// A write of the controller's own to submit in the TaskRun's lane (only while leading).
    Write(Job),
}

/// The TaskRun index every replica keeps from the watch (pure: events in, [`Found`] out).
///
/// Guarantees:
/// - it holds what recovery rebuilds the ledger from, for every live TaskRun the watch listed;
/// - after a relist (`Init` … `InitDone`: a 410 or a reconnect), TaskRuns it held that the list
///   no longer has are reported done, and their wanted writes forgotten;
/// - the writes a TaskRun wants (our finalizer, clearing the gate) are kept whether or not this
///   replica leads, reported once per term while leading, and again in a later term if the
///   watch has not shown them landed.
#[derive(Default)]
pub struct TaskRunIndex {
    index: HashMap<Uid, Entry>,
    memo: MountMemo,
    /// UIDs seen since the watch's last `Init` (a relist in progress).
    relist: Option<HashSet<Uid>>,
    synced: bool,
    /// The controller's own writes the watched TaskRuns still need, by UID.
    wanted: HashMap<Uid, Wanted>,
    /// Writes of `wanted` reported in the current term, so repeated watch events do not repeat
    /// them.
    finalizing: HashSet<Uid>,
    ungating: HashSet<Uid>,
}

impl TaskRunIndex {
    /// Whether the watch has listed everything at least once (recovery may start).
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// Live TaskRuns indexed.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no live TaskRun is indexed.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// What recovery needs: each live TaskRun's record and whether its Secret must be probed.
    pub fn records(&self) -> Vec<(TaskRunRecord, bool)> {
        self.index
            .values()
            .map(|e| (e.record.clone(), e.secret_matters))
            .collect()
    }

    /// Applies one watch event under `config` (unknown platforms count as remote while it is
    /// unset); `leading`: a term runs, so wanted writes are reported.
    pub fn apply(
        &mut self,
        ev: watcher::Event<TaskRun>,
        config: Option<&HostConfig>,
        leading: bool,
        out: &mut Vec<Found>,
    ) {
        match ev {
            watcher::Event::Init => self.relist = Some(HashSet::new()),
            watcher::Event::InitApply(tr) | watcher::Event::Apply(tr) => {
                self.on_taskrun(&tr, config, leading, out)
            }
            watcher::Event::Delete(tr) => {
                if let Some(taskrun) = tr.reference() {
                    self.index.remove(taskrun.uid());
                    self.wanted.remove(taskrun.uid());
                    out.push(done(taskrun, true, false));
                }
            }
            watcher::Event::InitDone => {
                if let Some(seen) = self.relist.take() {
                    let vanished: Vec<Uid> = self
                        .index
                        .keys()
                        .filter(|uid| !seen.contains(*uid))
                        .cloned()
                        .collect();
                    self.wanted.retain(|uid, _| seen.contains(uid));
                    for uid in vanished {
                        if let Some(e) = self.index.remove(&uid) {
                            let r = e.record;
                            out.push(done(
                                TaskRunRef::new(&r.namespace, &r.name, uid),
                                true,
                                false,
                            ));
                        }
                    }
                }
                if !self.synced {
                    tracing::info!(live = self.index.len(), "TaskRun watch synced");
                }
                self.synced = true;
            }
        }
    }

    fn on_taskrun(
        &mut self,
        tr: &TaskRun,
        config: Option<&HostConfig>,
        leading: bool,
        out: &mut Vec<Found>,
    ) {
        let Some(taskrun) = tr.reference() else {
            tracing::warn!(name = ?tr.metadata.name, "TaskRun without namespace, name or uid ignored");
            return;
        };
        let uid = taskrun.uid();
        if let Some(seen) = &mut self.relist {
            seen.insert(uid.clone());
        }
        if tr.has_finalizer() {
            self.finalizing.remove(uid);
        }
        if !tr.is_gated() {
            self.ungating.remove(uid);
        }
        let m = meaning::of(tr, &mut self.memo);
        // What recovery would rebuild from this TaskRun: the same reading the model test uses.
        match meaning::recovery_entry(tr, &m) {
            Some((record, secret_matters)) => {
                self.index.insert(
                    uid.clone(),
                    Entry {
                        record,
                        secret_matters,
                    },
                );
            }
            None => {
                self.index.remove(uid);
            }
        }
        let finalizer = matches!(&m, Meaning::Active { spec, needs_finalizer: true }
            if is_remote(config, &spec.platform));
        let ungate = matches!(
            m,
            Meaning::Done { ungate: true, .. } | Meaning::Undecided { ungate: true }
        );
        if finalizer || ungate {
            self.wanted.insert(
                uid.clone(),
                Wanted {
                    taskrun: taskrun.clone(),
                    finalizer,
                    ungate,
                },
            );
            if leading {
                self.writes(uid, out);
            }
        } else {
            self.wanted.remove(uid);
        }
        match m {
            Meaning::Ignore | Meaning::Undecided { .. } => {}
            Meaning::Active { spec, .. } => out.push(Found::Active(spec)),
            Meaning::Done {
                taskrun,
                tracked_only,
                released,
                ..
            } => out.push(done(taskrun, tracked_only, released)),
        }
    }

    /// Reports the writes `uid` wants that this term has not reported yet.
    fn writes(&mut self, uid: &Uid, out: &mut Vec<Found>) {
        let Some(w) = self.wanted.get(uid) else {
            return;
        };
        if w.finalizer && self.finalizing.insert(uid.clone()) {
            out.push(Found::Write(Job::AddFinalizer(w.taskrun.clone())));
        }
        if w.ungate && self.ungating.insert(uid.clone()) {
            out.push(Found::Write(Job::Action(Action::Ungate {
                taskrun: w.taskrun.clone(),
            })));
        }
    }

    /// A term started: what the TaskRuns seen while following still need (nothing of it was
    /// submitted in this term).
    pub fn term_started(&mut self, out: &mut Vec<Found>) {
        self.term_ended();
        let wanted: Vec<Uid> = self.wanted.keys().cloned().collect();
        for uid in wanted {
            self.writes(&uid, out);
        }
    }

    /// The term ended: its submitted writes may not have landed.
    pub fn term_ended(&mut self) {
        self.finalizing.clear();
        self.ungating.clear();
    }
}

fn done(taskrun: TaskRunRef, tracked_only: bool, released: bool) -> Found {
    Found::Done {
        taskrun,
        tracked_only,
        released,
    }
}

/// A remote (not local) platform under `config`; unknown and malformed ones count as remote
/// (they get an error secret, behind the finalizer).
fn is_remote(config: Option<&HostConfig>, platform: &str) -> bool {
    let Some(cfg) = config else {
        return true;
    };
    match Platform::parse(platform) {
        Ok(p) => !matches!(cfg.resolve(&p), Strategy::Local),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::contract;

    fn taskrun(uid: &str) -> Value {
        json!({
            "metadata": {"name": format!("b-{uid}"), "namespace": "t1", "uid": uid,
                         "labels": {contract::TARGET_PLATFORM_LABEL: "linux-arm64"},
                         "annotations": {contract::ALLOCATION_START_TIME_ANNOTATION: "1767323100"},
                         "finalizers": [contract::FINALIZER],
                         "creationTimestamp": "2026-01-02T03:04:05Z"},
            "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}],
                     "taskSpec": {"volumes": [{"name": "ssh", "secret":
                        {"secretName": "multi-platform-ssh-$(context.taskRun.name)"}}]}},
            "status": {}
        })
    }

    fn tr(v: Value) -> TaskRun {
        serde_json::from_value(v).unwrap()
    }

    fn apply(ix: &mut TaskRunIndex, ev: watcher::Event<TaskRun>, leading: bool) -> Vec<Found> {
        let mut out = Vec::new();
        ix.apply(ev, None, leading, &mut out);
        out
    }

    fn list(ix: &mut TaskRunIndex, uids: &[&str]) -> Vec<Found> {
        let mut out = apply(ix, watcher::Event::Init, false);
        for uid in uids {
            out.extend(apply(
                ix,
                watcher::Event::InitApply(tr(taskrun(uid))),
                false,
            ));
        }
        out.extend(apply(ix, watcher::Event::InitDone, false));
        out
    }

    fn active(out: &[Found]) -> Vec<&str> {
        out.iter()
            .filter_map(|f| match f {
                Found::Active(spec) => Some(spec.uid.as_str()),
                _ => None,
            })
            .collect()
    }

    fn done_uids(out: &[Found]) -> Vec<String> {
        out.iter()
            .filter_map(|f| match f {
                Found::Done { taskrun, .. } => Some(taskrun.uid().to_string()),
                _ => None,
            })
            .collect()
    }

    fn writes(out: &[Found]) -> Vec<String> {
        out.iter()
            .filter_map(|f| match f {
                Found::Write(j) => Some(format!("{} {}", j.kind(), job_uid(j))),
                _ => None,
            })
            .collect()
    }

    fn job_uid(j: &Job) -> String {
        match j {
            Job::AddFinalizer(r) | Job::Action(Action::Ungate { taskrun: r }) => {
                r.uid().to_string()
            }
            other => panic!("not a controller write: {other:?}"),
        }
    }

    #[test]
    fn the_first_list_indexes_every_live_taskrun_and_then_syncs() {
        let mut ix = TaskRunIndex::default();
        let mut out = apply(&mut ix, watcher::Event::Init, false);
        out.extend(apply(
            &mut ix,
            watcher::Event::InitApply(tr(taskrun("u1"))),
            false,
        ));
        assert!(!ix.synced(), "not before the list is complete");
        out.extend(apply(
            &mut ix,
            watcher::Event::InitApply(tr(taskrun("u2"))),
            false,
        ));
        out.extend(apply(&mut ix, watcher::Event::InitDone, false));
        assert!(ix.synced());
        assert_eq!(active(&out), ["u1", "u2"]);
        assert!(done_uids(&out).is_empty());
        let mut uids: Vec<String> = ix.records().into_iter().map(|(r, _)| r.uid).collect();
        uids.sort();
        assert_eq!(uids, ["u1", "u2"]);
        // Live, not queued: recovery must probe its Secret.
        assert!(ix.records().iter().all(|(_, matters)| *matters));
    }

    /// A TaskRun deleted while the watch was down (a 410, a reconnect) is never seen deleted:
    /// the relist that misses it ends it.
    #[test]
    fn a_relist_ends_the_taskruns_it_no_longer_has() {
        let mut ix = TaskRunIndex::default();
        list(&mut ix, &["u1", "u2", "u3"]);
        let out = list(&mut ix, &["u2"]);
        let mut gone = done_uids(&out);
        gone.sort();
        assert_eq!(gone, ["u1", "u3"]);
        assert!(out.iter().all(|f| match f {
            Found::Done {
                tracked_only,
                released,
                ..
            } => *tracked_only && !*released,
            _ => true,
        }));
        assert_eq!(ix.len(), 1);
        // A relist in progress ends nothing until it is complete.
        assert!(apply(&mut ix, watcher::Event::Init, false).is_empty());
        assert_eq!(ix.len(), 1);
    }

    #[test]
    fn a_deleted_taskrun_is_done_and_unindexed() {
        let mut ix = TaskRunIndex::default();
        list(&mut ix, &["u1", "u2"]);
        let out = apply(&mut ix, watcher::Event::Delete(tr(taskrun("u1"))), false);
        assert_eq!(done_uids(&out), ["u1"]);
        assert_eq!(ix.len(), 1);
        // Finished: done, and kept for recovery only while our finalizer is on it.
        let mut v = taskrun("u2");
        v["status"]["conditions"] = json!([{"type": "Succeeded", "status": "True"}]);
        let out = apply(&mut ix, watcher::Event::Apply(tr(v.clone())), false);
        assert_eq!(done_uids(&out), ["u2"]);
        assert_eq!(ix.len(), 1, "finalizer still on: recovery must clean it up");
        v["metadata"]["finalizers"] = json!([]);
        apply(&mut ix, watcher::Event::Apply(tr(v)), false);
        assert!(ix.is_empty());
    }

    /// The finalizer a TaskRun lacks is added by the leader only, once per term, before its
    /// scheduling event; a follower remembers it for the term it may start.
    #[test]
    fn wanted_writes_wait_for_a_term_and_are_reported_once_per_term() {
        let mut ix = TaskRunIndex::default();
        list(&mut ix, &[]);
        let mut bare = taskrun("u1");
        bare["metadata"]["finalizers"] = json!([]);
        let out = apply(&mut ix, watcher::Event::Apply(tr(bare.clone())), false);
        assert!(writes(&out).is_empty(), "a follower writes nothing");
        assert_eq!(active(&out), ["u1"]);
        let mut out = Vec::new();
        ix.term_started(&mut out);
        assert_eq!(writes(&out), ["add_finalizer u1"]);
        let out = apply(&mut ix, watcher::Event::Apply(tr(bare.clone())), true);
        assert!(writes(&out).is_empty(), "submitted already in this term");
        // A new term does it again: the old term's write may not have landed.
        ix.term_ended();
        let mut out = Vec::new();
        ix.term_started(&mut out);
        assert_eq!(writes(&out), ["add_finalizer u1"]);
        // Landed: nothing more, in this term or the next.
        let out = apply(&mut ix, watcher::Event::Apply(tr(taskrun("u1"))), true);
        assert!(writes(&out).is_empty());
        let mut out = Vec::new();
        ix.term_started(&mut out);
        assert!(writes(&out).is_empty());
        // Seen while leading: written at once, before the scheduler hears of it.
        let mut gated = taskrun("u2");
        gated["metadata"]["finalizers"] = json!([]);
        gated["spec"]["status"] = json!("TaskRunPending");
        let out = apply(&mut ix, watcher::Event::Apply(tr(gated)), true);
        assert_eq!(writes(&out), ["add_finalizer u2"]);
        assert!(matches!(out.last(), Some(Found::Active(_))));
    }

    #[test]
    fn a_relist_forgets_the_writes_of_taskruns_it_no_longer_has() {
        let mut ix = TaskRunIndex::default();
        let mut bare = taskrun("u1");
        bare["metadata"]["finalizers"] = json!([]);
        apply(&mut ix, watcher::Event::Init, false);
        apply(&mut ix, watcher::Event::InitApply(tr(bare)), false);
        apply(&mut ix, watcher::Event::InitDone, false);
        list(&mut ix, &[]);
        let mut out = Vec::new();
        ix.term_started(&mut out);
        assert!(writes(&out).is_empty());
    }
}
