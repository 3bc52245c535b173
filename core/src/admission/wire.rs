//! Borrowed views of the parts of an AdmissionReview the webhook reads.
//!
//! Everything else (`managedFields`, Task steps, scripts, `oldObject`, `userInfo`, ...) is skipped
//! with `IgnoredAny`, which scans without allocating, and strings borrow from the request body
//! unless they contain escapes. When `request.kind` and `request.operation` come before `object`
//! (as the API server writes them), an object that will be ignored is skipped in the same pass.
//! When `object` comes first, the eager mode (`EAGER = true`) parses it as a TaskRun view at once,
//! still in one pass; if that fails (an object of another shape), the caller parses again in the
//! lazy mode, which captures the object's text and parses it once `kind` and `operation` are known.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::ops::Deref;

use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::contract;

/// A string borrowed from the request body, or owned when it contains escapes.
pub(super) struct Str<'a>(pub Cow<'a, str>);

impl Deref for Str<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl Default for Str<'_> {
    fn default() -> Self {
        Self(Cow::Borrowed(""))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(PhantomData))
    }
}

/// A JSON object parsed as `T`. Derived struct impls also accept arrays (fields by position);
/// every object the webhook patches into must really be an object, or the patch would not apply.
pub(super) struct Obj<T>(pub T);

impl<T> Deref for Obj<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Default> Default for Obj<T> {
    fn default() -> Self {
        Self(T::default())
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<Self::Value, M::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Obj)
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

/// Top level of an `admission.k8s.io` AdmissionReview; `EAGER` as in the module docs.
#[derive(Deserialize)]
pub(super) struct ReviewIn<'a, const EAGER: bool> {
    #[serde(rename = "apiVersion", borrow, default)]
    pub api_version: Option<Str<'a>>,
    #[serde(borrow, default)]
    pub kind: Option<Str<'a>>,
    #[serde(borrow, default)]
    pub request: Option<RequestIn<'a, EAGER>>,
}

/// `request.kind`.
#[derive(Deserialize, Default)]
pub(super) struct GroupVersionKind<'a> {
    #[serde(borrow, default)]
    pub group: Str<'a>,
    #[serde(borrow, default)]
    pub version: Str<'a>,
    #[serde(borrow, default)]
    pub kind: Str<'a>,
}

impl GroupVersionKind<'_> {
    /// A Tekton TaskRun in a version this webhook understands.
    pub fn is_taskrun(&self) -> bool {
        &*self.group == "tekton.dev"
            && &*self.kind == "TaskRun"
            && matches!(&*self.version, "v1" | "v1beta1")
    }
}

/// `request.object`, parsed as far as needed.
pub(super) enum ObjectIn<'a> {
    /// Absent or null.
    Absent,
    /// Skipped: the request is ignored whatever the object says.
    Skipped,
    /// Parsed TaskRun view.
    TaskRun(Box<Obj<TaskRunIn<'a>>>),
    /// Captured before `kind`/`operation` were known; parsed later if needed.
    Raw(&'a RawValue),
}

/// `request`.
pub(super) struct RequestIn<'a, const EAGER: bool> {
    pub uid: Option<Str<'a>>,
    pub kind: Option<GroupVersionKind<'a>>,
    pub operation: Option<Str<'a>>,
    pub namespace: Option<Str<'a>>,
    pub name: Option<Str<'a>>,
    pub object: ObjectIn<'a>,
}

impl<const EAGER: bool> RequestIn<'_, EAGER> {
    /// True when the object matters: a TaskRun CREATE. `None` while either field is unknown.
    fn wants_object(&self) -> Option<bool> {
        match (&self.kind, &self.operation) {
            (Some(k), Some(op)) => Some(k.is_taskrun() && &**op == "CREATE"),
            _ => None,
        }
    }
}

impl<'de: 'a, 'a, const EAGER: bool> Deserialize<'de> for RequestIn<'a, EAGER> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(RequestVisitor(PhantomData))
    }
}

struct RequestVisitor<'a, const EAGER: bool>(PhantomData<&'a ()>);

impl<'de: 'a, 'a, const EAGER: bool> Visitor<'de> for RequestVisitor<'a, EAGER> {
    type Value = RequestIn<'a, EAGER>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an AdmissionRequest object")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
        let mut req = RequestIn {
            uid: None,
            kind: None,
            operation: None,
            namespace: None,
            name: None,
            object: ObjectIn::Absent,
        };
        while let Some(key) = map.next_key::<Str<'de>>()? {
            match &*key {
                "uid" => req.uid = map.next_value()?,
                "kind" => req.kind = map.next_value()?,
                "operation" => req.operation = map.next_value()?,
                "namespace" => req.namespace = map.next_value()?,
                "name" => req.name = map.next_value()?,
                "object" => {
                    let wanted = match req.wants_object() {
                        None if EAGER => Some(true),
                        known => known,
                    };
                    req.object = match wanted {
                        Some(true) => match map.next_value::<Option<Obj<TaskRunIn<'a>>>>()? {
                            Some(t) => ObjectIn::TaskRun(Box::new(t)),
                            None => ObjectIn::Absent,
                        },
                        Some(false) => {
                            map.next_value::<IgnoredAny>()?;
                            ObjectIn::Skipped
                        }
                        None => match map.next_value::<Option<&'a RawValue>>()? {
                            Some(raw) => ObjectIn::Raw(raw),
                            None => ObjectIn::Absent,
                        },
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(req)
    }
}

/// The parts of a TaskRun the webhook reads.
#[derive(Deserialize, Default)]
pub(super) struct TaskRunIn<'a> {
    #[serde(borrow, default)]
    pub metadata: Option<Obj<MetadataIn<'a>>>,
    #[serde(borrow, default)]
    pub spec: Option<Obj<SpecIn<'a>>>,
}

/// `metadata`: only the keys the webhook reads or writes.
#[derive(Deserialize, Default)]
pub(super) struct MetadataIn<'a> {
    #[serde(borrow, default)]
    pub uid: Option<Str<'a>>,
    #[serde(borrow, default)]
    pub labels: Option<Picked<'a, LabelKeys>>,
    #[serde(borrow, default)]
    pub annotations: Option<Picked<'a, AnnotationKeys>>,
    #[serde(borrow, default)]
    pub finalizers: Option<Vec<Str<'a>>>,
}

/// `spec`.
#[derive(Deserialize, Default)]
pub(super) struct SpecIn<'a> {
    #[serde(borrow, default)]
    pub params: Option<Vec<ParamIn<'a>>>,
    #[serde(rename = "taskSpec", borrow, default)]
    pub task_spec: Option<Obj<TaskSpecIn<'a>>>,
    #[serde(rename = "podTemplate", borrow, default)]
    pub pod_template: Option<Obj<PodTemplateIn<'a>>>,
    #[serde(borrow, default)]
    pub status: Option<&'a RawValue>,
}

/// One `spec.params` entry; the value may be a string, an array or an object.
#[derive(Deserialize)]
pub(super) struct ParamIn<'a> {
    #[serde(borrow, default)]
    pub name: Str<'a>,
    #[serde(borrow, default)]
    pub value: Option<&'a RawValue>,
}

/// An inline `spec.taskSpec`: params (for defaults) and volumes; steps are skipped.
#[derive(Deserialize, Default)]
pub(super) struct TaskSpecIn<'a> {
    #[serde(borrow, default)]
    pub params: Option<Vec<ParamSpecIn<'a>>>,
    #[serde(borrow, default)]
    pub volumes: Option<Vec<VolumeIn<'a>>>,
}

/// One `taskSpec.params` entry.
#[derive(Deserialize)]
pub(super) struct ParamSpecIn<'a> {
    #[serde(borrow, default)]
    pub name: Str<'a>,
    #[serde(borrow, default)]
    pub default: Option<&'a RawValue>,
}

/// One `taskSpec.volumes` entry; only secret volumes matter.
#[derive(Deserialize)]
pub(super) struct VolumeIn<'a> {
    #[serde(borrow, default)]
    pub secret: Option<SecretVolumeIn<'a>>,
}

/// `volumes[].secret`.
#[derive(Deserialize)]
pub(super) struct SecretVolumeIn<'a> {
    #[serde(rename = "secretName", borrow, default)]
    pub secret_name: Option<Str<'a>>,
}

impl VolumeIn<'_> {
    /// Mounts the per-TaskRun SSH secret (`multi-platform-ssh-...`).
    pub fn is_ssh_secret(&self) -> bool {
        self.secret
            .as_ref()
            .and_then(|s| s.secret_name.as_deref())
            .is_some_and(|n| n.starts_with(contract::SECRET_PREFIX))
    }
}

/// `spec.podTemplate`.
#[derive(Deserialize, Default)]
pub(super) struct PodTemplateIn<'a> {
    #[serde(borrow, default)]
    pub affinity: Option<Obj<AffinityIn<'a>>>,
}

/// `podTemplate.affinity`.
#[derive(Deserialize, Default)]
pub(super) struct AffinityIn<'a> {
    #[serde(rename = "nodeAffinity", borrow, default)]
    pub node_affinity: Option<Obj<NodeAffinityIn<'a>>>,
}

/// `affinity.nodeAffinity`.
#[derive(Deserialize, Default)]
pub(super) struct NodeAffinityIn<'a> {
    #[serde(
        rename = "requiredDuringSchedulingIgnoredDuringExecution",
        borrow,
        default
    )]
    pub required: Option<Obj<NodeSelectorIn<'a>>>,
}

/// `nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`.
#[derive(Deserialize, Default)]
pub(super) struct NodeSelectorIn<'a> {
    #[serde(rename = "nodeSelectorTerms", borrow, default)]
    pub terms: Option<Vec<Obj<NodeSelectorTermIn<'a>>>>,
}

/// One node selector term (terms are ORed; requirements inside a term are ANDed).
#[derive(Deserialize, Default)]
pub(super) struct NodeSelectorTermIn<'a> {
    #[serde(rename = "matchExpressions", borrow, default)]
    pub match_expressions: Option<Vec<RequirementIn<'a>>>,
    #[serde(rename = "matchFields", default)]
    pub match_fields: Option<Vec<IgnoredAny>>,
}

impl NodeSelectorTermIn<'_> {
    /// An empty term selects no node, so adding requirements to it would widen it.
    pub fn is_empty(&self) -> bool {
        self.match_expressions.as_ref().is_none_or(Vec::is_empty)
            && self.match_fields.as_ref().is_none_or(Vec::is_empty)
    }

    /// True when the term already requires `key In [value]`.
    pub fn requires(&self, key: &str, value: &str) -> bool {
        self.match_expressions.as_ref().is_some_and(|exprs| {
            exprs.iter().any(|e| {
                e.key.as_deref() == Some(key)
                    && e.operator.as_deref() == Some("In")
                    && e.values
                        .as_deref()
                        .is_some_and(|v| v.len() == 1 && &*v[0] == value)
            })
        })
    }
}

/// One node selector requirement.
#[derive(Deserialize)]
pub(super) struct RequirementIn<'a> {
    #[serde(borrow, default)]
    pub key: Option<Str<'a>>,
    #[serde(borrow, default)]
    pub operator: Option<Str<'a>>,
    #[serde(borrow, default)]
    pub values: Option<Vec<Str<'a>>>,
}

/// The fixed set of keys a [`Picked`] map captures.
pub(super) trait KeySet {
    /// Keys to capture, at most [`MAX_PICKED`].
    const KEYS: &'static [&'static str];
}

/// Most keys one [`Picked`] captures.
pub(super) const MAX_PICKED: usize = 5;

/// Label keys the webhook reads (the controller-only ones to remove them).
pub(super) struct LabelKeys;
impl KeySet for LabelKeys {
    const KEYS: &'static [&'static str] = &[
        contract::TARGET_PLATFORM_LABEL,
        contract::TASK_TYPE_LABEL,
        contract::CONTROLLER_ONLY_LABELS[0],
        contract::CONTROLLER_ONLY_LABELS[1],
    ];
}

/// Annotation keys the webhook reads (the controller-only ones to remove them).
pub(super) struct AnnotationKeys;
impl KeySet for AnnotationKeys {
    const KEYS: &'static [&'static str] = &[
        contract::ALLOCATION_START_TIME_ANNOTATION,
        contract::CONTROLLER_ONLY_ANNOTATIONS[0],
        contract::CONTROLLER_ONLY_ANNOTATIONS[1],
        contract::CONTROLLER_ONLY_ANNOTATIONS[2],
        contract::CONTROLLER_ONLY_ANNOTATIONS[3],
    ];
}

/// A string map (labels, annotations) of which only a few keys are kept; the rest is skipped
/// without building a map.
pub(super) struct Picked<'a, K> {
    found: [Option<Str<'a>>; MAX_PICKED],
    _keys: PhantomData<K>,
}

impl<'a, K: KeySet> Picked<'a, K> {
    /// The value of `key`, which must be one of `K::KEYS`.
    pub fn get(&self, key: &str) -> Option<&str> {
        let i = K::KEYS.iter().position(|k| *k == key)?;
        self.found[i].as_deref()
    }
}

impl<'de: 'a, 'a, K: KeySet> Deserialize<'de> for Picked<'a, K> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a, K>(PhantomData<(&'a (), K)>);
        impl<'de: 'a, 'a, K: KeySet> Visitor<'de> for V<'a, K> {
            type Value = Picked<'a, K>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut found: [Option<Str<'a>>; MAX_PICKED] = [const { None }; MAX_PICKED];
                while let Some(key) = map.next_key::<Str<'de>>()? {
                    match K::KEYS.iter().position(|k| *k == &*key) {
                        Some(i) => found[i] = Some(map.next_value()?),
                        None => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Picked {
                    found,
                    _keys: PhantomData,
                })
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}
