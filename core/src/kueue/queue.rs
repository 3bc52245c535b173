//! The ClusterQueue side: platform resource groups, the whole ClusterQueue file (its
//! ResourceFlavors included) and the allowed request annotations derived from it.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_norway::{Mapping, Value};

use super::KueueError;
use super::quota::{KueueApi, ResourceQuota};
use super::yaml;

/// The resource tekton-kueue requests for every PipelineRun; its group is the base group.
pub const PIPELINERUNS: &str = "tekton.dev/pipelineruns";
/// Flavors of generated platform groups are `platform-group-1`, `platform-group-2`, ...
pub const FLAVOR_PREFIX: &str = "platform-group-";
/// Kueue's limit on resources per resource group.
pub const MAX_RESOURCES_PER_GROUP: usize = 16;
/// Kueue's limit on resource groups per ClusterQueue.
pub const MAX_RESOURCE_GROUPS: usize = 16;
/// Prefix of the PipelineRun annotations tekton-kueue turns into resource requests.
pub const ANNOTATION_PREFIX: &str = "kueue.konflux-ci.dev/requests-";

/// One generated resource group: up to [`MAX_RESOURCES_PER_GROUP`] platforms, one flavor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlatformGroup {
    /// `platform-group-N`.
    pub flavor: String,
    /// Resource name and nominal quota, sorted by name.
    pub resources: Vec<(String, u64)>,
}

/// Splits the quotas, sorted by resource name, into groups of at most
/// [`MAX_RESOURCES_PER_GROUP`] with flavors `platform-group-1`, `-2`, ...
pub fn platform_groups(quotas: &BTreeMap<String, ResourceQuota>) -> Vec<PlatformGroup> {
    let all: Vec<(String, u64)> = quotas
        .values()
        .map(|q| (q.resource.clone(), q.quota))
        .collect();
    all.chunks(MAX_RESOURCES_PER_GROUP)
        .enumerate()
        .map(|(i, chunk)| PlatformGroup {
            flavor: format!("{FLAVOR_PREFIX}{}", i + 1),
            resources: chunk.to_vec(),
        })
        .collect()
}

/// True for the flavor names of generated groups (`platform-group-<digits>`).
pub fn is_platform_flavor(name: &str) -> bool {
    name.strip_prefix(FLAVOR_PREFIX)
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

fn s(v: &str) -> Value {
    Value::String(v.to_owned())
}

fn map<const N: usize>(entries: [(&str, Value); N]) -> Value {
    let mut m = Mapping::new();
    for (k, v) in entries {
        m.insert(s(k), v);
    }
    Value::Mapping(m)
}

fn group_value(g: &PlatformGroup, api: KueueApi) -> Value {
    map([
        (
            "coveredResources",
            Value::Sequence(g.resources.iter().map(|(r, _)| s(r)).collect()),
        ),
        (
            "flavors",
            Value::Sequence(vec![map([
                ("name", s(&g.flavor)),
                (
                    "resources",
                    Value::Sequence(
                        g.resources
                            .iter()
                            .map(|(r, q)| {
                                map([("name", s(r)), ("nominalQuota", s(&api.format(*q)))])
                            })
                            .collect(),
                    ),
                ),
            ])]),
        ),
    ])
}

/// The platform resource groups alone, as a YAML list to put under `spec.resourceGroups` after
/// the base group.
pub fn render_groups(
    quotas: &BTreeMap<String, ResourceQuota>,
    api: KueueApi,
) -> Result<String, KueueError> {
    let groups = platform_groups(quotas);
    // One group stays for the base resources (tekton.dev/pipelineruns, cpu, memory, ...).
    if groups.len() + 1 > MAX_RESOURCE_GROUPS {
        return Err(KueueError::TooManyGroups {
            groups: groups.len() + 1,
        });
    }
    let list = Value::Sequence(groups.iter().map(|g| group_value(g, api)).collect());
    Ok(yaml::dump_all(&[list])?)
}

/// Parses a multi-document YAML file; empty documents are dropped.
pub fn read_documents(text: &str) -> Result<Vec<Value>, KueueError> {
    let mut docs = Vec::new();
    for d in serde_norway::Deserializer::from_str(text) {
        let v = Value::deserialize(d).map_err(KueueError::Yaml)?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

fn kind(doc: &Value) -> &str {
    doc.get("kind").and_then(Value::as_str).unwrap_or("")
}

fn name(doc: &Value) -> &str {
    doc.get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// The first ClusterQueue of a file's documents.
pub fn find_cluster_queue(docs: &[Value]) -> Result<&Value, KueueError> {
    docs.iter()
        .find(|d| kind(d) == "ClusterQueue")
        .ok_or(KueueError::NoClusterQueue)
}

/// A resource group of an existing ClusterQueue, as far as the checks need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExistingGroup {
    /// `coveredResources`.
    pub covered: Vec<String>,
    /// Per flavor: its name and its resources' `nominalQuota` as written.
    pub flavors: Vec<(String, Vec<(String, String)>)>,
}

impl ExistingGroup {
    /// True when one of its flavors is a generated `platform-group-N`.
    pub fn is_platform_group(&self) -> bool {
        self.flavors.iter().any(|(f, _)| is_platform_flavor(f))
    }
}

fn text_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// The resource groups of a ClusterQueue document.
pub fn existing_groups(queue: &Value) -> Vec<ExistingGroup> {
    let Some(groups) = queue
        .get("spec")
        .and_then(|s| s.get("resourceGroups"))
        .and_then(Value::as_sequence)
    else {
        return Vec::new();
    };
    groups
        .iter()
        .map(|g| ExistingGroup {
            covered: g
                .get("coveredResources")
                .and_then(Value::as_sequence)
                .map(|c| c.iter().filter_map(text_of).collect())
                .unwrap_or_default(),
            flavors: g
                .get("flavors")
                .and_then(Value::as_sequence)
                .map(|fs| {
                    fs.iter()
                        .map(|f| {
                            let name = f.get("name").and_then(text_of).unwrap_or_default();
                            let resources = f
                                .get("resources")
                                .and_then(Value::as_sequence)
                                .map(|rs| {
                                    rs.iter()
                                        .map(|r| {
                                            (
                                                r.get("name").and_then(text_of).unwrap_or_default(),
                                                r.get("nominalQuota")
                                                    .and_then(text_of)
                                                    .unwrap_or_default(),
                                            )
                                        })
                                        .collect()
                                })
                                .unwrap_or_default();
                            (name, resources)
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect()
}

/// Rewrites a ClusterQueue file (the ClusterQueue and its ResourceFlavors, as infra-deployments
/// keeps them) with the platform groups of `quotas`:
/// - every group that does not use a `platform-group-N` flavor is kept as it is, in its place
///   (first of all the base group holding `tekton.dev/pipelineruns`); the generated groups are
///   replaced by new ones after them;
/// - a `platform-group-N` ResourceFlavor is added for each new group that has none (existing
///   flavors stay, as the script leaves them);
/// - quotas are written as the ClusterQueue's API version stores them (`1k` in v1beta2);
/// - documents are sorted by kind and name, keys sorted, in PyYAML's layout: the file then
///   equals what infra-deployments' `update-kueue-vm-quotas.py` writes for the same capacity.
pub fn render_cluster_queue(
    existing: &str,
    quotas: &BTreeMap<String, ResourceQuota>,
) -> Result<String, KueueError> {
    let mut docs = read_documents(existing)?;
    let queue_index = docs
        .iter()
        .position(|d| kind(d) == "ClusterQueue")
        .ok_or(KueueError::NoClusterQueue)?;
    let api_version = docs[queue_index]
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    let api = KueueApi::of_api_version(&api_version);

    let old_groups: Vec<Value> = docs[queue_index]
        .get("spec")
        .and_then(|s| s.get("resourceGroups"))
        .and_then(Value::as_sequence)
        .cloned()
        .unwrap_or_default();
    let parsed = existing_groups(&docs[queue_index]);
    let mut groups: Vec<Value> = Vec::new();
    let mut kept_resources: BTreeMap<String, String> = BTreeMap::new();
    for (value, group) in old_groups.into_iter().zip(&parsed) {
        if group.is_platform_group() {
            continue;
        }
        let flavor = group
            .flavors
            .first()
            .map(|(f, _)| f.clone())
            .unwrap_or_default();
        for r in &group.covered {
            kept_resources.insert(r.clone(), flavor.clone());
        }
        groups.push(value);
    }
    for q in quotas.values() {
        if let Some(flavor) = kept_resources.get(&q.resource) {
            return Err(KueueError::Overlap {
                resource: q.resource.clone(),
                flavor: flavor.clone(),
            });
        }
    }
    let new_groups = platform_groups(quotas);
    if groups.len() + new_groups.len() > MAX_RESOURCE_GROUPS {
        return Err(KueueError::TooManyGroups {
            groups: groups.len() + new_groups.len(),
        });
    }
    for g in parsed.iter().filter(|g| !g.is_platform_group()) {
        if g.covered.len() > MAX_RESOURCES_PER_GROUP {
            return Err(KueueError::GroupTooLarge {
                flavor: g
                    .flavors
                    .first()
                    .map(|(f, _)| f.clone())
                    .unwrap_or_default(),
                resources: g.covered.len(),
            });
        }
    }
    groups.extend(new_groups.iter().map(|g| group_value(g, api)));

    let queue = docs[queue_index]
        .as_mapping_mut()
        .ok_or(KueueError::NoClusterQueue)?;
    let spec = queue
        .entry(s("spec"))
        .or_insert_with(|| Value::Mapping(Mapping::new()));
    let Value::Mapping(spec) = spec else {
        return Err(KueueError::NoClusterQueue);
    };
    spec.insert(s("resourceGroups"), Value::Sequence(groups));

    let flavors: BTreeSet<String> = docs
        .iter()
        .filter(|d| kind(d) == "ResourceFlavor")
        .map(|d| name(d).to_owned())
        .collect();
    for g in &new_groups {
        if !flavors.contains(&g.flavor) {
            // Same API version as the ClusterQueue (the script writes v1beta1 flavors even next
            // to a v1beta2 queue).
            docs.push(map([
                ("apiVersion", s(&api_version)),
                ("kind", s("ResourceFlavor")),
                ("metadata", map([("name", s(&g.flavor))])),
                ("spec", Value::Mapping(Mapping::new())),
            ]));
        }
    }
    // Stable, as Python's sort.
    docs.sort_by(|a, b| (kind(a), name(a)).cmp(&(kind(b), name(b))));
    Ok(yaml::dump_all(&docs)?)
}

/// The request annotations a cluster accepts, derived from its ClusterQueue as infra-deployments'
/// `generate-allowed-annotations.sh` derives them: every covered resource but
/// `tekton.dev/pipelineruns`, prefixed with [`ANNOTATION_PREFIX`], sorted.
pub fn allowed_annotations(queue_file: &str) -> Result<Vec<String>, KueueError> {
    let docs = read_documents(queue_file)?;
    let queue = find_cluster_queue(&docs)?;
    let mut out: Vec<String> = existing_groups(queue)
        .iter()
        .flat_map(|g| g.covered.iter())
        .filter(|r| *r != PIPELINERUNS)
        .map(|r| format!("{ANNOTATION_PREFIX}{r}"))
        .collect();
    out.sort();
    Ok(out)
}

/// The list as the `allowed-annotations` value of the policy's ConfigMap writes it:
/// `["a", "b"]`.
pub fn format_annotation_list(list: &[String]) -> String {
    let items: Vec<String> = list
        .iter()
        .map(|a| serde_json::Value::String(a.clone()).to_string())
        .collect();
    format!("[{}]", items.join(", "))
}

/// Reads an allowed-annotations file: the policy's ConfigMap (its `data.allowed-annotations`
/// JSON list) or the list itself (JSON or YAML).
pub fn read_annotation_list(text: &str) -> Result<Vec<String>, KueueError> {
    let docs = read_documents(text)?;
    let list_of = |v: &Value| -> Option<Vec<String>> {
        v.as_sequence()?
            .iter()
            .map(|i| i.as_str().map(str::to_owned))
            .collect()
    };
    for doc in &docs {
        if let Some(list) = list_of(doc) {
            return Ok(list);
        }
        if kind(doc) == "ConfigMap"
            && let Some(value) = doc
                .get("data")
                .and_then(|d| d.get("allowed-annotations"))
                .and_then(Value::as_str)
        {
            let parsed: Value = serde_norway::from_str(value).map_err(KueueError::Yaml)?;
            return list_of(&parsed).ok_or(KueueError::NoAnnotationList);
        }
    }
    Err(KueueError::NoAnnotationList)
}
