//! Pure: what a watched TaskRun means for the scheduler (docs/architecture.md, "One TaskRun, end to
//! end" and "The contract with the Go controller"; docs/architecture.md, "The controller shell").
//!
//! [`of`] turns one slim TaskRun into its [`Meaning`]: a TaskRun that needs (or holds) a
//! host, one that is done (finished, deleted, or released because its Task never mounts the
//! secret), or one that cannot be decided yet. The secret-mount rule: only TaskRuns whose pod
//! mounts `multi-platform-ssh-*` get a host. An inline Task answers at once; a `taskRef` answers
//! once Tekton copied the resolved spec into `status.taskSpec`; [`MountMemo`] remembers the answer
//! per Task identity so later TaskRuns of the same Task are decided at once. Nothing is allocated
//! on a guess: undecided TaskRuns wait (un-gated, so Tekton resolves them).
//!
//! [`record`] builds the [`TaskRunRecord`] recovery rebuilds the ledger from, with the same
//! reading of labels and annotations the scheduler's snapshot uses.

use std::collections::HashMap;

use super::taskrun::{TaskRun, TaskSpec};
use crate::contract;
use crate::scheduler::{TaskRunRecord, TaskRunRef, TaskRunSpec, Time};

/// What a TaskRun needs from the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub enum Meaning {
    /// Nothing to do: not ours, or finished and already cleaned up.
    Ignore,
    /// Needs or holds a build host: send [`Event::TaskRun`](crate::scheduler::Event::TaskRun).
    Active {
        spec: TaskRunSpec,
        /// Our finalizer is missing (a TaskRun labelled by hand or by an older webhook): add it
        /// before anything is allocated for a remote platform.
        needs_finalizer: bool,
    },
    /// Finished, deleted, or released: send
    /// [`Event::TaskRunDone`](crate::scheduler::Event::TaskRunDone).
    Done {
        taskrun: TaskRunRef,
        /// Only when the scheduler tracks it (no finalizer of ours: nothing to clean otherwise).
        tracked_only: bool,
        /// Still gated: clear the gate so Tekton runs (and fails or succeeds) it.
        ungate: bool,
        /// Not finished, only needing no host (its Task does not mount the secret, it is
        /// internal, or has no platform): send
        /// [`Event::TaskRunReleased`](crate::scheduler::Event::TaskRunReleased) instead, since a
        /// later answer may say it needs one after all.
        released: bool,
    },
    /// Its Task is not resolved yet; decided when `status.taskSpec` appears.
    Undecided {
        /// Gated: un-gate it so Tekton resolves the Task (its pod waits for the secret if it
        /// mounts it).
        ungate: bool,
    },
}

/// Answers of the secret-mount rule per Task identity (resolver + params, bundle + name, or
/// Task name). Bounded: cleared when full (a miss only delays a decision until Tekton resolves).
#[derive(Debug, Default)]
pub struct MountMemo {
    answers: HashMap<String, bool>,
}

/// Most Task identities remembered.
const MEMO_CAPACITY: usize = 4096;

impl MountMemo {
    /// The remembered answer for a Task identity.
    pub fn get(&self, identity: &str) -> Option<bool> {
        self.answers.get(identity).copied()
    }

    /// Records (or corrects) an answer.
    pub fn record(&mut self, identity: String, mounts: bool) {
        if self.answers.len() >= MEMO_CAPACITY && !self.answers.contains_key(&identity) {
            self.answers.clear();
        }
        self.answers.insert(identity, mounts);
    }

    /// Identities remembered.
    pub fn len(&self) -> usize {
        self.answers.len()
    }

    /// Nothing remembered.
    pub fn is_empty(&self) -> bool {
        self.answers.is_empty()
    }
}

/// Decides what a TaskRun (a watch event's object) means; records mount answers in `memo`.
pub fn of(tr: &TaskRun, memo: &mut MountMemo) -> Meaning {
    let Some(taskrun) = tr.reference() else {
        return Meaning::Ignore;
    };
    let has_finalizer = tr.has_finalizer();
    let finished = tr.is_deleting() || tr.is_finished();
    let done = |ungate: bool| Meaning::Done {
        taskrun: taskrun.clone(),
        tracked_only: !has_finalizer,
        ungate,
        released: !finished,
    };
    if finished {
        return done(false);
    }
    // Internal TaskRuns are never allocated (the webhook skips them; a label added later
    // releases whatever was allocated).
    if tr.label(contract::TASK_TYPE_LABEL).is_some() {
        return done(tr.is_gated());
    }
    let Some(platform) = platform(tr) else {
        return done(tr.is_gated());
    };
    match mounts_secret(tr, memo) {
        Some(true) => {}
        Some(false) => return done(tr.is_gated()),
        None => {
            return Meaning::Undecided {
                ungate: tr.is_gated(),
            };
        }
    }
    // Never before its creation: the annotation is the tenant's to write, and an early one would
    // put the TaskRun ahead of older ones.
    let annotated = tr
        .annotation(contract::ALLOCATION_START_TIME_ANNOTATION)
        .and_then(|v| v.trim().parse::<u64>().ok());
    let since = match (annotated, tr.created_unix()) {
        (Some(a), Some(created)) => a.max(created),
        (a, created) => a.or(created).unwrap_or(0),
    };
    Meaning::Active {
        spec: TaskRunSpec {
            namespace: taskrun.namespace().to_owned(),
            name: taskrun.name().to_owned(),
            uid: taskrun.uid().to_string(),
            platform,
            since: Time::from_secs(since),
            retries: tr.status.retries,
            gated: tr.is_gated(),
        },
        needs_finalizer: !has_finalizer,
    }
}

/// The `PLATFORM` value: the TaskRun's param, else the Task's default (inline or resolved), by the
/// reading the webhook shares ([`crate::platform::requested`]). A value that is not a string is
/// passed on as its JSON text (the scheduler then writes an error secret saying it is malformed).
pub fn platform(tr: &TaskRun) -> Option<String> {
    let params = tr
        .spec
        .params
        .iter()
        .map(|p| (p.name.as_str(), Some(&p.value)));
    let task_specs = [tr.spec.task_spec.as_ref(), tr.status.task_spec.as_ref()]
        .into_iter()
        .flatten()
        .map(|ts| {
            ts.params
                .iter()
                .map(|p| (p.name.as_str(), p.default.as_ref()))
        });
    crate::platform::requested(params, task_specs).map(|v| v.text().into_owned())
}

/// Whether the TaskRun's pod mounts the secret: from the inline Task, the resolved Task (which
/// also teaches the memo), or the memo; `None` when not known yet.
fn mounts_secret(tr: &TaskRun, memo: &mut MountMemo) -> Option<bool> {
    if let Some(ts) = &tr.spec.task_spec {
        return Some(has_ssh_volume(ts));
    }
    let identity = task_identity(tr);
    if let Some(ts) = &tr.status.task_spec {
        let answer = has_ssh_volume(ts);
        if let Some(id) = identity {
            memo.record(id, answer);
        }
        return Some(answer);
    }
    identity.and_then(|id| memo.get(&id))
}

fn has_ssh_volume(ts: &TaskSpec) -> bool {
    ts.volumes.iter().any(|v| {
        v.secret
            .as_ref()
            .and_then(|s| s.secret_name.as_deref())
            .is_some_and(|n| n.starts_with(contract::SECRET_PREFIX))
    })
}

/// A stable name for the Task a `taskRef` points at: resolver and its params (sorted), bundle and
/// name, or kind and name (namespaced Tasks include the namespace).
pub fn task_identity(tr: &TaskRun) -> Option<String> {
    let r = tr.spec.task_ref.as_ref()?;
    if let Some(resolver) = &r.resolver {
        let mut params: Vec<String> = r
            .params
            .iter()
            .map(|p| format!("{}={}", p.name, p.value))
            .collect();
        params.sort();
        return Some(format!("resolver:{resolver}:{}", params.join("&")));
    }
    let name = r.name.as_deref()?;
    let kind = r.kind.as_deref().unwrap_or("Task");
    if let Some(bundle) = &r.bundle {
        return Some(format!("bundle:{bundle}:{kind}:{name}"));
    }
    match kind {
        "Task" => Some(format!(
            "task:{}/{name}",
            tr.metadata.namespace.as_deref().unwrap_or("")
        )),
        other => Some(format!("{other}:{name}")),
    }
}

/// The TaskRun as recovery reads it (docs/architecture.md, "One TaskRun, end to end"): allocation
/// labels and annotations, whether it is finished. `secret` is left for the caller, which looks the
/// Secret up only where it matters.
pub fn record(tr: &TaskRun, spec: Option<&TaskRunSpec>) -> Option<TaskRunRecord> {
    let taskrun = tr.reference()?;
    let mut rec = TaskRunRecord {
        namespace: taskrun.namespace().to_owned(),
        name: taskrun.name().to_owned(),
        uid: taskrun.uid().to_string(),
        platform: spec
            .map(|s| s.platform.clone())
            .or_else(|| platform(tr))
            .unwrap_or_default(),
        since: spec.map_or_else(
            || Time::from_secs(tr.created_unix().unwrap_or(0)),
            |s| s.since,
        ),
        retries: tr.status.retries,
        gated: tr.is_gated(),
        finished: spec.is_none(),
        ..TaskRunRecord::default()
    };
    let empty = Default::default();
    rec.read_metadata(
        tr.metadata.labels.as_ref().unwrap_or(&empty),
        tr.metadata.annotations.as_ref().unwrap_or(&empty),
    );
    Some(rec)
}

/// What recovery keeps of a watched TaskRun, given what it [`Meaning`] is: its record and
/// whether its Secret must be read ([`secret_matters`]); `None` when recovery has nothing to
/// rebuild for it (ignored, undecided, or done without our finalizer).
pub fn recovery_entry(tr: &TaskRun, meaning: &Meaning) -> Option<(TaskRunRecord, bool)> {
    match meaning {
        Meaning::Active { spec, .. } => {
            let rec = record(tr, Some(spec))?;
            let matters = secret_matters(&rec, tr);
            Some((rec, matters))
        }
        Meaning::Done {
            tracked_only: false,
            ..
        } => Some((record(tr, None)?, false)),
        Meaning::Done { .. } | Meaning::Ignore | Meaning::Undecided { .. } => None,
    }
}

/// Whether recovery must look the TaskRun's Secret up to know its state: it is live and not
/// merely queued (a queued TaskRun has no secret; a finished one gets its secret deleted anyway).
pub fn secret_matters(rec: &TaskRunRecord, tr: &TaskRun) -> bool {
    !rec.finished && tr.label(contract::WAITING_FOR_PLATFORM_LABEL).is_none()
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    fn tr(v: Value) -> TaskRun {
        serde_json::from_value(v).unwrap()
    }

    fn base() -> Value {
        serde_json::json!({
            "metadata": {"name": "b1", "namespace": "t1", "uid": "u1",
                         "labels": {contract::TARGET_PLATFORM_LABEL: "linux-arm64"},
                         "annotations": {contract::ALLOCATION_START_TIME_ANNOTATION: "1767323100"},
                         "finalizers": [contract::FINALIZER],
                         "creationTimestamp": "2026-01-02T03:04:05Z"},
            "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}],
                     "taskRef": {"resolver": "bundles", "params": [
                        {"name": "bundle", "value": "quay.io/b@sha256:1"}, {"name": "name", "value": "buildah"}]}},
            "status": {}
        })
    }

    fn resolved(mounts: bool) -> Value {
        let name = if mounts {
            "multi-platform-ssh-$(context.taskRun.name)"
        } else {
            "other"
        };
        serde_json::json!({"volumes": [{"name": "ssh", "secret": {"secretName": name}}]})
    }

    #[test]
    fn task_ref_waits_for_resolution_then_memo_decides_at_once() {
        let mut memo = MountMemo::default();
        let mut v = base();
        assert_eq!(
            of(&tr(v.clone()), &mut memo),
            Meaning::Undecided { ungate: false }
        );
        v["status"]["taskSpec"] = resolved(true);
        let Meaning::Active {
            spec,
            needs_finalizer,
        } = of(&tr(v), &mut memo)
        else {
            panic!("resolved Task mounts the secret")
        };
        assert_eq!(spec.platform, "linux/arm64");
        assert_eq!(spec.since, Time::from_secs(1_767_323_100));
        assert!(!needs_finalizer);
        // Same Task (params in another order), another TaskRun, not resolved yet: decided.
        let mut w = base();
        w["metadata"]["uid"] = "u2".into();
        w["spec"]["taskRef"]["params"] = serde_json::json!([
            {"name": "name", "value": "buildah"}, {"name": "bundle", "value": "quay.io/b@sha256:1"}]);
        assert!(matches!(of(&tr(w), &mut memo), Meaning::Active { .. }));
    }

    #[test]
    fn a_task_that_never_mounts_the_secret_is_released() {
        let mut memo = MountMemo::default();
        let mut v = base();
        v["spec"]["status"] = "TaskRunPending".into();
        v["status"]["taskSpec"] = resolved(false);
        assert_eq!(
            of(&tr(v.clone()), &mut memo),
            Meaning::Done {
                taskrun: TaskRunRef::new("t1", "b1", crate::scheduler::Uid::new("u1")),
                tracked_only: false,
                ungate: true,
                released: true,
            }
        );
        // Once the finalizer is gone, nothing more to do unless the scheduler still tracks it.
        v["metadata"]["finalizers"] = serde_json::json!([]);
        assert!(matches!(
            of(&tr(v), &mut memo),
            Meaning::Done {
                tracked_only: true,
                ..
            }
        ));
    }

    #[test]
    fn gated_undecided_is_ungated_and_inline_tasks_decide_at_once() {
        let mut memo = MountMemo::default();
        let mut v = base();
        v["spec"]["status"] = "TaskRunPending".into();
        assert_eq!(
            of(&tr(v.clone()), &mut memo),
            Meaning::Undecided { ungate: true }
        );
        v["spec"]["taskRef"] = Value::Null;
        v["spec"]["taskSpec"] = resolved(true);
        assert!(matches!(
            of(&tr(v), &mut memo),
            Meaning::Active { spec, .. } if spec.gated
        ));
    }

    #[test]
    fn finished_deleted_retrying_and_internal() {
        let mut memo = MountMemo::default();
        let mut v = base();
        v["status"]["taskSpec"] = resolved(true);
        v["status"]["conditions"] = serde_json::json!([{"type": "Succeeded", "status": "Unknown", "reason": "ToBeRetried"}]);
        v["status"]["retriesStatus"] = serde_json::json!([{}]);
        assert!(matches!(
            of(&tr(v.clone()), &mut memo),
            Meaning::Active { spec, .. } if spec.retries == 1
        ));
        v["status"]["conditions"][0]["status"] = "False".into();
        assert!(matches!(
            of(&tr(v.clone()), &mut memo),
            Meaning::Done {
                tracked_only: false,
                ..
            }
        ));
        let mut d = base();
        d["metadata"]["deletionTimestamp"] = "2026-01-02T03:04:06Z".into();
        assert!(matches!(of(&tr(d), &mut memo), Meaning::Done { .. }));
        let mut i = base();
        i["metadata"]["labels"][contract::TASK_TYPE_LABEL] = "internal".into();
        assert!(matches!(of(&tr(i), &mut memo), Meaning::Done { .. }));
    }

    #[test]
    fn platform_from_param_default_and_malformed_values() {
        let mut v = base();
        v["spec"]["params"] = serde_json::json!([]);
        v["status"]["taskSpec"] =
            serde_json::json!({"params": [{"name": "PLATFORM", "default": "linux/s390x"}]});
        assert_eq!(platform(&tr(v)).as_deref(), Some("linux/s390x"));
        let mut w = base();
        w["spec"]["params"][0]["value"] = serde_json::json!(["linux/arm64"]);
        assert_eq!(platform(&tr(w)).as_deref(), Some(r#"["linux/arm64"]"#));
        let mut x = base();
        x["spec"]["params"] = serde_json::json!([]);
        assert_eq!(platform(&tr(x)), None);
    }

    #[test]
    fn recovery_keeps_live_and_finalizing_taskruns_only() {
        let mut memo = MountMemo::default();
        let mut v = base();
        v["status"]["taskSpec"] = resolved(true);
        // Queued: rebuilt, no Secret to read.
        v["metadata"]["labels"][contract::WAITING_FOR_PLATFORM_LABEL] = "linux-arm64".into();
        let t = tr(v.clone());
        let (rec, matters) = recovery_entry(&t, &of(&t, &mut memo)).unwrap();
        assert!(!rec.finished && !matters);
        // Placed: its Secret says whether it was served.
        v["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove(contract::WAITING_FOR_PLATFORM_LABEL);
        let t = tr(v.clone());
        assert!(recovery_entry(&t, &of(&t, &mut memo)).unwrap().1);
        // Finished with our finalizer: cleanup is due. Without it: nothing to rebuild.
        v["status"]["conditions"] = serde_json::json!([{"type": "Succeeded", "status": "True"}]);
        let t = tr(v.clone());
        let (rec, matters) = recovery_entry(&t, &of(&t, &mut memo)).unwrap();
        assert!(rec.finished && !matters);
        v["metadata"]["finalizers"] = serde_json::json!([]);
        let t = tr(v);
        assert_eq!(recovery_entry(&t, &of(&t, &mut memo)), None);
    }

    #[test]
    fn records_read_allocation_evidence() {
        let mut v = base();
        v["metadata"]["labels"][contract::ASSIGNED_HOST_LABEL] = "host-1".into();
        v["metadata"]["annotations"][contract::FAILED_HOSTS_ANNOTATION] = "a, b".into();
        let t = tr(v);
        let rec = record(&t, None).unwrap();
        assert!(rec.finished);
        assert_eq!(rec.assigned_host.as_deref(), Some("host-1"));
        assert_eq!(rec.failed_hosts, vec!["a", "b"]);
        assert_eq!(rec.since, Time::from_secs(1_767_323_100));
        assert!(!secret_matters(&rec, &t));
    }

    /// `allocation-start-time: 1` (written by the tenant, e.g. while the webhook was down) must
    /// not order the TaskRun before older ones: never earlier than its creation, live or recovered.
    #[test]
    fn an_allocation_start_time_before_creation_does_not_jump_the_queue() {
        let created = Time::from_secs(1_767_323_045);
        let mut memo = MountMemo::default();
        let mut v = base();
        v["status"]["taskSpec"] = resolved(true);
        v["metadata"]["annotations"][contract::ALLOCATION_START_TIME_ANNOTATION] = "1".into();
        let t = tr(v.clone());
        let meaning = of(&t, &mut memo);
        let Meaning::Active { spec, .. } = &meaning else {
            panic!("active: {meaning:?}")
        };
        assert_eq!(spec.since, created);
        let (rec, _) = recovery_entry(&t, &meaning).unwrap();
        assert_eq!(rec.since, created);
        // Finished: recovery reads the annotation itself.
        v["status"]["conditions"] = serde_json::json!([{"type": "Succeeded", "status": "True"}]);
        let t = tr(v);
        let (rec, _) = recovery_entry(&t, &of(&t, &mut memo)).unwrap();
        assert!(rec.finished);
        assert_eq!(rec.since, created);
    }

    #[test]
    fn task_identities() {
        let mut v = base();
        v["spec"]["taskRef"] = serde_json::json!({"name": "buildah"});
        assert_eq!(
            task_identity(&tr(v.clone())).as_deref(),
            Some("task:t1/buildah")
        );
        v["spec"]["taskRef"] = serde_json::json!({"name": "buildah", "bundle": "q/b:1"});
        assert_eq!(
            task_identity(&tr(v.clone())).as_deref(),
            Some("bundle:q/b:1:Task:buildah")
        );
        v["spec"]["taskRef"] = serde_json::json!({"name": "buildah", "kind": "ClusterTask"});
        assert_eq!(
            task_identity(&tr(v)).as_deref(),
            Some("ClusterTask:buildah")
        );
    }

    /// The webhook and the controller read a TaskRun's `PLATFORM` alike (one function): for
    /// every way the value can be written, the platform the webhook logs and marks by is the one
    /// the controller hands the scheduler. TaskRuns as written at CREATE (no status: a resolved
    /// Task default is only the controller's to see).
    #[test]
    fn the_webhook_and_the_controller_read_the_same_platform() {
        let volume = r#""volumes":[{"name":"ssh","secret":{"secretName":"multi-platform-ssh-x"}}]"#;
        let specs = [
            r#""params":[{"name":"PLATFORM","value":"linux/arm64"}]"#.to_owned(),
            r#""params":[{"name":"PLATFORM","value":"linux\/arm64 \u0041"}]"#.to_owned(),
            // Not strings: the same JSON text on both sides, whatever the spacing.
            r#""params":[{"name":"PLATFORM","value":[ "linux/s390x",  "linux/ppc64le" ]}]"#.to_owned(),
            r#""params":[{"name":"PLATFORM","value":{ "os" : "linux" }}]"#.to_owned(),
            r#""params":[{"name":"PLATFORM","value":1.50}]"#.to_owned(),
            r#""params":[{"name":"PLATFORM","value":true}]"#.to_owned(),
            // None: the param set to null or without a value (no Task default fills it in).
            format!(
                r#""params":[{{"name":"PLATFORM","value":null}}],"taskSpec":{{"params":[{{"name":"PLATFORM","default":"linux/amd64"}}],{volume}}}"#
            ),
            r#""params":[{"name":"PLATFORM"}]"#.to_owned(),
            // The first of two.
            r#""params":[{"name":"PLATFORM","value":"linux/arm64"},{"name":"PLATFORM","value":"linux/amd64"}]"#.to_owned(),
            // The inline Task's default, unless it has none.
            format!(r#""taskSpec":{{"params":[{{"name":"PLATFORM","default":"linux/amd64"}}],{volume}}}"#),
            format!(r#""taskSpec":{{"params":[{{"name":"PLATFORM","default":[1, 2]}}],{volume}}}"#),
            format!(r#""taskSpec":{{"params":[{{"name":"PLATFORM"}}],{volume}}}"#),
            format!(r#""params":[],"taskSpec":{{"params":[{{"name":"OTHER","default":"x"}}],{volume}}}"#),
        ];
        let config = crate::config::HostConfig::default();
        let mut seen = Vec::new();
        for spec in &specs {
            let json = format!(
                r#"{{"metadata":{{"name":"b1","namespace":"t1","uid":"u1"}},"spec":{{{spec}}}}}"#
            );
            let view = crate::admission::TaskRunView::from_json(&json).unwrap();
            let webhook = crate::admission::decide(&view, &config, 0).platform;
            let controller = platform(&serde_json::from_str::<TaskRun>(&json).unwrap());
            assert_eq!(webhook, controller, "{spec}");
            seen.push(controller);
        }
        assert_eq!(
            seen.iter().map(Option::as_deref).collect::<Vec<_>>(),
            [
                Some("linux/arm64"),
                Some("linux/arm64 A"),
                Some(r#"["linux/s390x","linux/ppc64le"]"#),
                Some(r#"{"os":"linux"}"#),
                Some("1.5"),
                Some("true"),
                None,
                None,
                Some("linux/arm64"),
                Some("linux/amd64"),
                Some("[1,2]"),
                None,
                None,
            ]
        );
    }
}
