//! A slim view of a Tekton `TaskRun`: only what allocation decisions read.
//!
//! TaskRuns carry resolved task specs, step statuses and `managedFields`, tens of KB each. The
//! watch deserialises straight into this view, so the rest of an object is skipped by the parser
//! and never allocated, and nothing holds whole TaskRuns (docs/architecture.md, "The controller
//! shell": memory is per tracked TaskRun, not per byte of its YAML).
//!
//! Within the parts it reads, the view keeps only what decisions use, because a page of the
//! initial list and the loop's input queue hold many views at once: labels and annotations
//! under [`KEPT_KEY_PREFIX`] (a Konflux TaskRun has ~50 others, from Pipelines as Code, Tekton,
//! Chains and Results), the `PLATFORM` param of `spec.params` and of a task spec's params (the
//! production Task declares ~56), and only the volumes that mount the multi-platform secret.
//! Whoever reads another key or param must widen the filter here.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::contract;
use crate::scheduler::{TaskRunRef, Uid};

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
    /// The `PLATFORM` param only.
    #[serde(deserialize_with = "platform_only")]
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
    /// The `PLATFORM` param only.
    #[serde(deserialize_with = "platform_only")]
    pub params: Vec<ParamSpec>,
    /// Volumes of the multi-platform secret only.
    #[serde(deserialize_with = "secret_volumes_only")]
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
    /// The reference to it, when namespace, name and UID are all present.
    pub fn reference(&self) -> Option<TaskRunRef> {
        let m = &self.metadata;
        Some(TaskRunRef::new(
            m.namespace.as_deref()?,
            m.name.as_deref()?,
            Uid::new(m.uid.as_deref()?),
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
    #[serde(default, deserialize_with = "kept_map")]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default, deserialize_with = "kept_map")]
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

/// Labels and annotations kept by the view: every contract key is under it.
pub const KEPT_KEY_PREFIX: &str = "build.appstudio.redhat.com/";

/// A string map with only the [`KEPT_KEY_PREFIX`] entries: other keys are read without being
/// copied and their values skipped. A present map stays `Some` even when nothing is kept (patches
/// depend on whether the map exists).
fn kept_map<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    struct Kept;
    impl<'de> Visitor<'de> for Kept {
        type Value = Option<BTreeMap<String, String>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a map of strings")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(key) = map.next_key_seed(KeptKey)? {
                match key {
                    Some(k) => {
                        out.insert(k, map.next_value::<String>()?);
                    }
                    None => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(Some(out))
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(Kept)
}

/// A map key, copied only when it is kept.
struct KeptKey;

impl<'de> DeserializeSeed<'de> for KeptKey {
    type Value = Option<String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl Visitor<'_> for KeptKey {
    type Value = Option<String>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string key")
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.starts_with(KEPT_KEY_PREFIX).then(|| v.to_owned()))
    }
}

/// Anything with a param name.
trait Named {
    fn name(&self) -> &str;
}

impl Named for Param {
    fn name(&self) -> &str {
        &self.name
    }
}

impl Named for ParamSpec {
    fn name(&self) -> &str {
        &self.name
    }
}

/// The `PLATFORM` entries of a params list (`null` counts as empty).
fn platform_only<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Named,
{
    let all: Option<Vec<Filtered<T>>> = Option::deserialize(d)?;
    Ok(all.into_iter().flatten().filter_map(|f| f.0).collect())
}

/// A list element, kept only when it is a `PLATFORM` param: others are skipped by the parser
/// (one element is looked at a time, so the list is never built whole).
struct Filtered<T>(Option<T>);

impl<'de, T: Deserialize<'de> + Named> Deserialize<'de> for Filtered<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = T::deserialize(d)?;
        Ok(Filtered(
            (v.name() == contract::PLATFORM_PARAM).then_some(v),
        ))
    }
}

/// The volumes that mount a multi-platform secret (`null` counts as empty).
fn secret_volumes_only<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Volume>, D::Error> {
    let all: Option<Vec<Volume>> = Option::deserialize(d)?;
    Ok(all
        .into_iter()
        .flatten()
        .filter(Volume::mounts_multi_platform_secret)
        .collect())
}

impl Volume {
    /// A secret volume of the per-TaskRun multi-platform secret.
    pub fn mounts_multi_platform_secret(&self) -> bool {
        self.secret
            .as_ref()
            .and_then(|s| s.secret_name.as_deref())
            .is_some_and(|n| n.starts_with(contract::SECRET_PREFIX))
    }
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
    use serde_json::json;

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
        assert_eq!(
            tr.reference(),
            Some(TaskRunRef::new("t1", "b1", Uid::new("u1")))
        );
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
        assert_eq!(tr.reference(), None);
        assert_eq!(tr.status.retries, 0);
    }
    /// A TaskRun as Konflux has them: dozens of labels, annotations and params around the few
    /// the controller reads.
    #[test]
    fn keeps_only_the_keys_params_and_volumes_decisions_read() {
        let mut labels = serde_json::Map::new();
        let mut annotations = serde_json::Map::new();
        for i in 0..40 {
            labels.insert(format!("tekton.dev/label-{i}"), json!(format!("value-{i}")));
            annotations.insert(
                format!("pipelinesascode.tekton.dev/a-{i}"),
                json!("x".repeat(200)),
            );
        }
        labels.insert(contract::TARGET_PLATFORM_LABEL.into(), json!("linux-arm64"));
        labels.insert(
            contract::WAITING_FOR_PLATFORM_LABEL.into(),
            json!("linux-arm64"),
        );
        annotations.insert(
            contract::ALLOCATION_START_TIME_ANNOTATION.into(),
            json!("1767323100"),
        );
        annotations.insert(contract::FAILED_HOSTS_ANNOTATION.into(), json!("h1,h2"));
        let params: Vec<Value> = (0..55)
            .map(|i| json!({"name": format!("P{i}"), "description": "d".repeat(100), "default": "v"}))
            .chain([json!({"name": "PLATFORM", "type": "string"})])
            .collect();
        let volumes = json!([
            {"name": "activation-key", "secret": {"secretName": "$(params.ACTIVATION_KEY)"}},
            {"name": "shared", "emptyDir": {}},
            {"name": "ssh", "secret": {"secretName": "multi-platform-ssh-$(context.taskRun.name)"}},
        ]);
        let tr: TaskRun = serde_json::from_value(json!({
            "metadata": {"name": "b1", "namespace": "t1", "uid": "u1",
                         "labels": labels, "annotations": annotations},
            "spec": {"params": (0..15).map(|i| json!({"name": format!("S{i}"), "value": "v"}))
                        .chain([json!({"name": "PLATFORM", "value": "linux/arm64"})]).collect::<Vec<_>>()},
            "status": {"taskSpec": {"params": params, "volumes": volumes}},
        }))
        .unwrap();
        let kept = |m: &Option<BTreeMap<String, String>>| {
            m.as_ref().unwrap().keys().cloned().collect::<Vec<_>>()
        };
        assert_eq!(
            kept(&tr.metadata.labels),
            [
                contract::TARGET_PLATFORM_LABEL,
                contract::WAITING_FOR_PLATFORM_LABEL
            ]
        );
        assert_eq!(
            kept(&tr.metadata.annotations),
            [
                contract::ALLOCATION_START_TIME_ANNOTATION,
                contract::FAILED_HOSTS_ANNOTATION
            ]
        );
        assert_eq!(tr.spec.params.len(), 1);
        assert_eq!(tr.spec.params[0].value, json!("linux/arm64"));
        let ts = tr.status.task_spec.as_ref().unwrap();
        assert_eq!(ts.params.len(), 1);
        assert_eq!(ts.params[0].name, "PLATFORM");
        assert_eq!(ts.volumes.len(), 1);
        // A map that is present but keeps nothing is still present (patches depend on it).
        let bare: TaskRun =
            serde_json::from_value(json!({"metadata": {"labels": {"a": "b"}}})).unwrap();
        assert_eq!(bare.metadata.labels, Some(BTreeMap::new()));
        let none: TaskRun = serde_json::from_value(json!({"metadata": {"labels": null}})).unwrap();
        assert_eq!(none.metadata.labels, None);
    }
}
