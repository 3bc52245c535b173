//! The three patch formats the apiserver accepts on `PATCH`: JSON merge patch (RFC 7386), JSON patch
//! (RFC 6902, including `test`) and strategic merge patch for built-in types.

use serde_json::{Map, Value};

/// A patch format, from the request's `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchType {
    /// `application/merge-patch+json`.
    Merge,
    /// `application/json-patch+json`.
    Json,
    /// `application/strategic-merge-patch+json`.
    Strategic,
    /// `application/apply-patch+yaml` (server-side apply; not implemented).
    Apply,
}

impl PatchType {
    /// Maps a `Content-Type` (parameters ignored) to a patch type.
    pub fn from_content_type(ct: &str) -> Option<Self> {
        match ct.split(';').next().unwrap_or("").trim() {
            "application/merge-patch+json" => Some(Self::Merge),
            "application/json-patch+json" => Some(Self::Json),
            "application/strategic-merge-patch+json" => Some(Self::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => Some(Self::Apply),
            _ => None,
        }
    }
}

/// Why a patch could not be applied; `BadRequest` is a malformed patch (400), `Unprocessable` a
/// well-formed one that does not apply (422, e.g. a failed `test`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PatchError {
    /// The patch document is malformed.
    BadRequest(String),
    /// The patch does not apply to the object.
    Unprocessable(String),
}

/// Applies a JSON patch document (an array of operations) to `doc`.
pub fn apply_json_patch(doc: &mut Value, patch: &[u8]) -> Result<(), PatchError> {
    let ops: json_patch::Patch =
        serde_json::from_slice(patch).map_err(|e| PatchError::BadRequest(e.to_string()))?;
    json_patch::patch(doc, &ops).map_err(|e| PatchError::Unprocessable(e.to_string()))
}

/// Applies a JSON merge patch to `doc`.
pub fn apply_merge_patch(doc: &mut Value, patch: &[u8]) -> Result<(), PatchError> {
    let p: Value =
        serde_json::from_slice(patch).map_err(|e| PatchError::BadRequest(e.to_string()))?;
    if !p.is_object() {
        return Err(PatchError::BadRequest(
            "a merge patch must be a JSON object".into(),
        ));
    }
    json_patch::merge(doc, &p);
    Ok(())
}

/// How a list field of a built-in type merges under a strategic merge patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListStrategy {
    /// The patch's list replaces the original (the default for lists without a patch strategy).
    Replace,
    /// Items are objects merged by the value of this key.
    MergeKey(&'static str),
    /// A set of scalars: union, keeping the original order first.
    MergePrimitives,
}

/// The `patchStrategy: merge` lists of the built-in types this server serves, by field name and
/// the name of the field that holds it (`parent`). Lists not listed here are replaced, as in the
/// apiserver for fields without a patch strategy.
fn list_strategy(parent: Option<&str>, field: &str) -> ListStrategy {
    use ListStrategy::*;
    match (parent, field) {
        (Some("metadata"), "finalizers") => MergePrimitives,
        (Some("metadata"), "ownerReferences") => MergeKey("uid"),
        (
            _,
            "containers"
            | "initContainers"
            | "ephemeralContainers"
            | "volumes"
            | "imagePullSecrets"
            | "env"
            | "schedulingGates"
            | "resourceClaims"
            | "webhooks"
            | "secrets",
        ) => MergeKey("name"),
        (_, "ports") => MergeKey("containerPort"),
        (_, "volumeMounts") => MergeKey("mountPath"),
        (_, "volumeDevices") => MergeKey("devicePath"),
        (_, "hostAliases") => MergeKey("ip"),
        (_, "topologySpreadConstraints") => MergeKey("topologyKey"),
        (Some("status"), "conditions") => MergeKey("type"),
        _ => Replace,
    }
}

/// Applies a strategic merge patch to a built-in object. Supports `null` deletion, merge-by-key and
/// primitive-set lists, `$patch: replace|delete|merge`, `$deleteFromPrimitiveList/<field>` and
/// `$retainKeys`; `$setElementOrder/<field>` is accepted and ignored (the merged order is original
/// items first, then new ones).
pub fn apply_strategic_merge_patch(doc: &mut Value, patch: &[u8]) -> Result<(), PatchError> {
    let p: Value =
        serde_json::from_slice(patch).map_err(|e| PatchError::BadRequest(e.to_string()))?;
    let Value::Object(p) = p else {
        return Err(PatchError::BadRequest(
            "a strategic merge patch must be a JSON object".into(),
        ));
    };
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    let Value::Object(d) = doc else {
        unreachable!("set above")
    };
    merge_map(d, &p, None)
}

fn merge_map(
    orig: &mut Map<String, Value>,
    patch: &Map<String, Value>,
    parent: Option<&str>,
) -> Result<(), PatchError> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            let mut clean = patch.clone();
            clean.remove("$patch");
            *orig = clean;
            return Ok(());
        }
        Some("delete") => {
            orig.clear();
            return Ok(());
        }
        Some("merge") | None => {}
        Some(other) => {
            return Err(PatchError::BadRequest(format!(
                "unknown patch type: {other:?} in map"
            )));
        }
    }
    if let Some(keep) = patch.get("$retainKeys") {
        let keep: Vec<&str> = keep
            .as_array()
            .ok_or_else(|| PatchError::BadRequest("$retainKeys must be a list".into()))?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        orig.retain(|k, _| keep.contains(&k.as_str()));
    }
    for (k, pv) in patch {
        if k == "$patch" || k == "$retainKeys" || k.starts_with("$setElementOrder/") {
            continue;
        }
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            let remove = pv
                .as_array()
                .ok_or_else(|| PatchError::BadRequest(format!("{k} must be a list of values")))?;
            if let Some(Value::Array(items)) = orig.get_mut(field) {
                items.retain(|i| !remove.contains(i));
            }
            continue;
        }
        if pv.is_null() {
            orig.remove(k);
            continue;
        }
        match (orig.get_mut(k), pv) {
            (Some(Value::Object(o)), Value::Object(p)) => merge_map(o, p, Some(k))?,
            (Some(Value::Array(o)), Value::Array(p)) => merge_list(o, p, parent, k)?,
            (_, Value::Object(p)) => {
                let mut fresh = Map::new();
                merge_map(&mut fresh, p, Some(k))?;
                if p.get("$patch").and_then(Value::as_str) != Some("delete") {
                    orig.insert(k.clone(), Value::Object(fresh));
                } else {
                    orig.remove(k);
                }
            }
            (_, Value::Array(p)) => {
                let mut fresh = Vec::new();
                merge_list(&mut fresh, p, parent, k)?;
                orig.insert(k.clone(), Value::Array(fresh));
            }
            (_, v) => {
                orig.insert(k.clone(), v.clone());
            }
        }
    }
    Ok(())
}

fn merge_list(
    orig: &mut Vec<Value>,
    patch: &[Value],
    parent: Option<&str>,
    field: &str,
) -> Result<(), PatchError> {
    // `[{"$patch": "replace"}, ...]` replaces the list with the remaining items.
    if patch
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"))
    {
        *orig = patch
            .iter()
            .filter(|i| i.get("$patch").is_none())
            .cloned()
            .collect();
        return Ok(());
    }
    match list_strategy(parent, field) {
        ListStrategy::Replace => *orig = patch.to_vec(),
        ListStrategy::MergePrimitives => {
            for item in patch {
                if !orig.contains(item) {
                    orig.push(item.clone());
                }
            }
        }
        ListStrategy::MergeKey(key) => {
            for item in patch {
                let Value::Object(pi) = item else {
                    return Err(PatchError::BadRequest(format!(
                        "{field}: items must be objects with merge key {key:?}"
                    )));
                };
                let kv = pi.get(key).ok_or_else(|| {
                    PatchError::BadRequest(format!(
                        "map: {pi:?} does not contain declared merge key: {key}"
                    ))
                })?;
                let pos = orig.iter().position(|o| o.get(key) == Some(kv));
                if pi.get("$patch").and_then(Value::as_str) == Some("delete") {
                    if let Some(pos) = pos {
                        orig.remove(pos);
                    }
                    continue;
                }
                match pos {
                    Some(pos) => {
                        if let Value::Object(o) = &mut orig[pos] {
                            merge_map(o, pi, Some(field))?;
                        }
                    }
                    None => {
                        let mut fresh = Map::new();
                        merge_map(&mut fresh, pi, Some(field))?;
                        orig.push(Value::Object(fresh));
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn smp(mut doc: Value, patch: Value) -> Value {
        apply_strategic_merge_patch(&mut doc, patch.to_string().as_bytes()).unwrap();
        doc
    }

    #[test]
    fn strategic_labels_and_finalizers() {
        let doc = json!({"metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x"]}});
        let out = smp(
            doc,
            json!({"metadata": {"labels": {"a": null, "c": "3"}, "finalizers": ["y", "x"]}}),
        );
        assert_eq!(out["metadata"]["labels"], json!({"b": "2", "c": "3"}));
        assert_eq!(out["metadata"]["finalizers"], json!(["x", "y"]));
        let out = smp(
            out,
            json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]}}),
        );
        assert_eq!(out["metadata"]["finalizers"], json!(["y"]));
    }

    #[test]
    fn strategic_merge_keys() {
        let doc = json!({"spec": {"containers": [{"name": "a", "image": "i1", "env": [{"name": "X", "value": "1"}]}, {"name": "b", "image": "i2"}],
                         "tolerations": [{"key": "t"}]}});
        let out = smp(
            doc,
            json!({"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}]}, {"name": "b", "$patch": "delete"}, {"name": "c", "image": "i3"}],
                             "tolerations": [{"key": "u"}]}}),
        );
        let c = &out["spec"]["containers"];
        assert_eq!(c.as_array().unwrap().len(), 2);
        assert_eq!(c[0]["image"], "i1");
        assert_eq!(c[0]["env"].as_array().unwrap().len(), 2);
        assert_eq!(c[1]["name"], "c");
        assert_eq!(out["spec"]["tolerations"], json!([{"key": "u"}]));
    }

    #[test]
    fn strategic_directives() {
        let doc = json!({"data": {"a": "1", "b": "2"}, "spec": {"x": 1}});
        let out = smp(
            doc,
            json!({"data": {"$patch": "replace", "c": "3"}, "spec": {"$retainKeys": ["y"], "y": 2}}),
        );
        assert_eq!(out["data"], json!({"c": "3"}));
        assert_eq!(out["spec"], json!({"y": 2}));
        let mut d = json!({});
        assert!(matches!(
            apply_strategic_merge_patch(&mut d, br#"{"a": {"$patch": "bogus"}}"#),
            Err(PatchError::BadRequest(_))
        ));
    }

    #[test]
    fn json_patch_test_failure_is_unprocessable() {
        let mut d = json!({"metadata": {"labels": {"a": "1"}}});
        let ok = br#"[{"op":"test","path":"/metadata/labels/a","value":"1"},{"op":"replace","path":"/metadata/labels/a","value":"2"}]"#;
        apply_json_patch(&mut d, ok).unwrap();
        assert_eq!(d["metadata"]["labels"]["a"], "2");
        let bad = br#"[{"op":"test","path":"/metadata/labels/a","value":"1"}]"#;
        assert!(matches!(
            apply_json_patch(&mut d, bad),
            Err(PatchError::Unprocessable(_))
        ));
        assert!(matches!(
            apply_json_patch(&mut d, b"{}"),
            Err(PatchError::BadRequest(_))
        ));
    }

    #[test]
    fn merge_patch() {
        let mut d = json!({"a": {"b": 1, "c": [1, 2]}});
        apply_merge_patch(&mut d, br#"{"a": {"b": null, "c": [3]}}"#).unwrap();
        assert_eq!(d, json!({"a": {"c": [3]}}));
        assert_eq!(
            PatchType::from_content_type("application/merge-patch+json; charset=utf-8"),
            Some(PatchType::Merge)
        );
    }
}
