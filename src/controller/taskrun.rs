//! A slim view of a Tekton `TaskRun`: only what allocation decisions read.
//!
//! TaskRuns carry resolved task specs, step statuses and `managedFields`, tens of KB each. The
//! watch deserialises straight into this view, so the rest of an object is skipped by the parser
//! and never allocated, and nothing holds whole TaskRuns (design §10: memory is per tracked
//! TaskRun, not per byte of its YAML).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::contract;

/// `tekton.dev/v1` TaskRun, slim. Implements [`kube::Resource`] so the kube-runtime watcher and
/// `Api` can use it directly.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct TaskRun {
    #[serde(default, deserialize_with = "slim_meta")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Spec,
    #[serde(default)]
    pub status: Status,
}

/// `spec`: the params, the gate, and how the Task is named or given.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Spec {
    pub params: Vec<Param>,
    /// `TaskRunPending` while gated, `TaskRunCancelled` when cancelled.
    pub status: Option<String>,
    pub task_ref: Option<TaskRef>,
    pub task_spec: Option<TaskSpec>,
    /// How many retries Tekton may start after a failed attempt.
    pub retries: u32,
}

/// A param: its value may be a string, an array or an object.
#[derive(Clone, Debug, Deserialize)]
pub struct Param {
    pub name: String,
    #[serde(default)]
    pub value: Value,
}

/// `spec.taskRef`: a Task by name (namespaced or cluster), a bundle, or a resolver with params.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct TaskRef {
    pub name: Option<String>,
    pub kind: Option<String>,
    pub bundle: Option<String>,
    pub resolver: Option<String>,
    pub params: Vec<Param>,
}

/// The parts of a Task spec that matter here: param defaults and secret volumes.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct TaskSpec {
    pub params: Vec<ParamSpec>,
    pub volumes: Vec<Volume>,
}

/// A declared param with its default.
#[derive(Clone, Debug, Deserialize)]
pub struct ParamSpec {
    pub name: String,
    #[serde(default)]
    pub default: Option<Value>,
}

/// A pod volume; only secret volumes are read.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Volume {
    pub secret: Option<SecretVolume>,
}

/// `secret` volume source.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SecretVolume {
    pub secret_name: Option<String>,
}

/// `status`: conditions, the resolved Task spec and the number of retries started.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Status {
    pub conditions: Vec<Condition>,
    pub task_spec: Option<TaskSpec>,
    /// Length of `status.retriesStatus` (each entry is a whole attempt's status: only counted).
    #[serde(rename = "retriesStatus", deserialize_with = "count_seq")]
    pub retries: u32,
}

/// A status condition.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: Option<String>,
}

impl TaskRun {
    /// Namespace, name and UID, when all three are present.
    pub fn identity(&self) -> Option<(&str, &str, &str)> {
        let m = &self.metadata;
        Some((
            m.namespace.as_deref()?,
            m.name.as_deref()?,
            m.uid.as_deref()?,
        ))
    }

    /// A label's value.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.metadata.labels.as_ref()?.get(key).map(String::as_str)
    }

    /// An annotation's value.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.metadata
            .annotations
            .as_ref()?
            .get(key)
            .map(String::as_str)
    }

    /// Carries our finalizer.
    pub fn has_finalizer(&self) -> bool {
        self.metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|f| f == contract::FINALIZER))
    }

    /// `deletionTimestamp` is set.
    pub fn is_deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    /// Gated by the webhook (`spec.status: TaskRunPending`).
    pub fn is_gated(&self) -> bool {
        self.spec.status.as_deref() == Some(crate::admission::PENDING_STATUS)
    }

    /// The `Succeeded` condition.
    pub fn succeeded(&self) -> Option<&Condition> {
        self.status
            .conditions
            .iter()
            .find(|c| c.type_ == "Succeeded")
    }

    /// Finished: `Succeeded` is True or False. A failed attempt that Tekton retries reports
    /// `Unknown`/`ToBeRetried`, so it is not finished.
    pub fn is_finished(&self) -> bool {
        self.succeeded()
            .is_some_and(|c| c.status == "True" || c.status == "False")
    }

    /// Creation time in unix seconds.
    pub fn created_unix(&self) -> Option<u64> {
        let t: &Time = self.metadata.creation_timestamp.as_ref()?;
        u64::try_from(t.0.as_second()).ok()
    }
}

impl kube::Resource for TaskRun {
    type DynamicType = ();
    type Scope = kube::core::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "TaskRun".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "tekton.dev".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "taskruns".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The metadata fields decisions read; `managedFields`, `ownerReferences` and the rest are
/// skipped by the parser.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SlimMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    finalizers: Option<Vec<String>>,
    deletion_timestamp: Option<Time>,
    creation_timestamp: Option<Time>,
}

fn slim_meta<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = SlimMeta::deserialize(d)?;
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        uid: m.uid,
        resource_version: m.resource_version,
        labels: m.labels,
        annotations: m.annotations,
        finalizers: m.finalizers,
        deletion_timestamp: m.deletion_timestamp,
        creation_timestamp: m.creation_timestamp,
        ..ObjectMeta::default()
    })
}

/// Counts a JSON array's elements without building them (`null` counts as empty).
fn count_seq<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    struct Count;
    impl<'de> Visitor<'de> for Count {
        type Value = u32;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an array")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u32, A::Error> {
            let mut n = 0u32;
            while seq.next_element::<IgnoredAny>()?.is_some() {
                n = n.saturating_add(1);
            }
            Ok(n)
        }
        fn visit_unit<E>(self) -> Result<u32, E> {
            Ok(0)
        }
        fn visit_none<E>(self) -> Result<u32, E> {
            Ok(0)
        }
    }
    d.deserialize_any(Count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_only_what_decisions_need() {
        let json = serde_json::json!({
            "apiVersion": "tekton.dev/v1",
            "kind": "TaskRun",
            "metadata": {
                "name": "b1", "namespace": "t1", "uid": "u1", "resourceVersion": "7",
                "labels": {"a": "b"}, "finalizers": [contract::FINALIZER],
                "managedFields": [{"manager": "x", "fieldsV1": {"f:spec": {}}}],
                "creationTimestamp": "2026-01-02T03:04:05Z"
            },
            "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}], "status": "TaskRunPending",
                     "taskRef": {"resolver": "bundles", "params": [{"name": "name", "value": "buildah"}]}},
            "status": {
                "conditions": [{"type": "Succeeded", "status": "Unknown", "reason": "ToBeRetried"}],
                "retriesStatus": [{"podName": "p", "steps": [{"name": "s"}]}, {"podName": "q"}],
                "taskSpec": {"volumes": [{"name": "ssh", "secret": {"secretName": "multi-platform-ssh-$(context.taskRun.name)"}}],
                             "steps": [{"name": "build", "script": "x"}]}
            }
        });
        let tr: TaskRun = serde_json::from_value(json).unwrap();
        assert_eq!(tr.identity(), Some(("t1", "b1", "u1")));
        assert!(tr.has_finalizer() && tr.is_gated() && !tr.is_finished());
        assert_eq!(tr.status.retries, 2);
        assert!(tr.metadata.managed_fields.is_none());
        assert_eq!(tr.created_unix(), Some(1_767_323_045));
        assert_eq!(
            tr.spec.task_ref.unwrap().resolver.as_deref(),
            Some("bundles")
        );
    }

    #[test]
    fn bookmarks_and_null_fields_parse() {
        let tr: TaskRun = serde_json::from_value(serde_json::json!({
            "metadata": {"resourceVersion": "9"}, "status": {"retriesStatus": null}
        }))
        .unwrap();
        assert_eq!(tr.identity(), None);
        assert_eq!(tr.status.retries, 0);
    }
}
