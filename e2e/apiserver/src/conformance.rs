//! Every JSON response checked against Kubernetes' published API schemas (v1.33, the version
//! the manifests and `k8s-openapi` target; `testdata/README.md` says where they come from), so a
//! shape kube-apiserver would never send fails the test that received it rather than passing
//! because kubectl and kube-rs happen to tolerate it.
//!
//! The schemas are strict (`additionalProperties: false`): an unknown field, a wrong type or a
//! missing required field is a violation. Objects of kinds without a schema here (custom
//! resources such as TaskRuns, Tables) have their `metadata` checked as `ObjectMeta`, and lists of
//! them their `metadata` as `ListMeta`. Watch events are checked event by event.

use std::collections::HashMap;
use std::sync::LazyLock;

use serde_json::Value;

const DOC: &str = include_str!("../testdata/kubernetes-v1.33-schemas.json");
const META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1";

struct Schemas {
    validators: jsonschema::ValidatorMap,
    /// (group, version, kind) → definition name.
    by_gvk: HashMap<(String, String, String), String>,
}

static SCHEMAS: LazyLock<Schemas> = LazyLock::new(|| {
    let doc: Value = serde_json::from_str(DOC).expect("testdata schemas are JSON");
    let validators =
        jsonschema::validator_map_for(&doc).expect("testdata schemas compile (no remote refs)");
    let mut by_gvk = HashMap::new();
    for (name, def) in doc["$defs"].as_object().into_iter().flatten() {
        for gvk in def["x-kubernetes-group-version-kind"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let s = |k: &str| gvk[k].as_str().unwrap_or_default().to_owned();
            by_gvk.insert((s("group"), s("version"), s("kind")), name.clone());
        }
    }
    Schemas { validators, by_gvk }
});

/// What in `v` (a response body: an object, a list or a Status) the schemas refuse; empty when
/// it conforms or no schema applies.
pub(crate) fn check(v: &Value) -> Vec<String> {
    let mut out = Vec::new();
    check_into(v, "", &mut out);
    out
}

/// Whether a list's objects are held to a schema of their own (else only their `metadata`).
pub(crate) fn typed_list(list: &Value) -> bool {
    let (Some(api_version), Some(kind)) = (list["apiVersion"].as_str(), list["kind"].as_str())
    else {
        return false;
    };
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    SCHEMAS
        .by_gvk
        .contains_key(&(group.to_owned(), version.to_owned(), kind.to_owned()))
}

/// What [`check`] of a whole list would report about its `i`th object (`list` is the list with
/// its `items` empty, `item` that object): lists are checked object by object as they are written.
pub(crate) fn check_list_item(list: &Value, item: &Value, i: usize) -> Vec<String> {
    let mut out = Vec::new();
    let (Some(api_version), Some(kind)) = (list["apiVersion"].as_str(), list["kind"].as_str())
    else {
        return out;
    };
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let s = &*SCHEMAS;
    let at = format!("/items/{i}");
    let key = (group.to_owned(), version.to_owned(), kind.to_owned());
    if let Some(def) = s.by_gvk.get(&key) {
        // A typed list's items are its kind without `List`; reported under the list's name.
        let item_def = def.strip_suffix("List").unwrap_or(def);
        if s.validators.get(&format!("#/$defs/{item_def}")).is_some() {
            let mut inner = Vec::new();
            validate(item_def, item, &at, &mut inner);
            out.extend(inner.into_iter().map(|p| p.replacen(item_def, def, 1)));
        }
    } else if kind.ends_with("List") {
        validate(
            &format!("{META}.ObjectMeta"),
            &item["metadata"],
            &format!("{at}/metadata"),
            &mut out,
        );
    }
    out
}

/// Like [`check`] for one watch event (`{"type": ..., "object": ...}`).
pub(crate) fn check_event(e: &Value) -> Vec<String> {
    let mut out = Vec::new();
    match e["type"].as_str() {
        Some("ADDED" | "MODIFIED" | "DELETED" | "BOOKMARK" | "ERROR") => {}
        other => out.push(format!("watch event type {other:?}")),
    }
    if let Some(k) = e
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .find(|k| *k != "type" && *k != "object")
    {
        out.push(format!("watch event field {k:?}"));
    }
    check_into(&e["object"], "object", &mut out);
    out
}

fn check_into(v: &Value, at: &str, out: &mut Vec<String>) {
    let (Some(api_version), Some(kind)) = (v["apiVersion"].as_str(), v["kind"].as_str()) else {
        return;
    };
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    let s = &*SCHEMAS;
    let key = (group.to_owned(), version.to_owned(), kind.to_owned());
    if let Some(def) = s.by_gvk.get(&key) {
        validate(def, v, at, out);
    } else if kind == "Table" && group == "meta.k8s.io" {
        // Server-side printing: no published schema to hold it to.
    } else if let Some(items) = v.get("items").filter(|_| kind.ends_with("List")) {
        validate(&format!("{META}.ListMeta"), &v["metadata"], at, out);
        for (i, item) in items.as_array().into_iter().flatten().enumerate() {
            validate(
                &format!("{META}.ObjectMeta"),
                &item["metadata"],
                &format!("{at}/items/{i}/metadata"),
                out,
            );
        }
    } else if let Some(meta) = v.get("metadata") {
        validate(
            &format!("{META}.ObjectMeta"),
            meta,
            &format!("{at}/metadata"),
            out,
        );
    }
}

fn validate(def: &str, v: &Value, at: &str, out: &mut Vec<String>) {
    let Some(validator) = SCHEMAS.validators.get(&format!("#/$defs/{def}")) else {
        out.push(format!("no schema {def}"));
        return;
    };
    for e in validator.iter_errors(v) {
        out.push(format!("{def} at {at}{}: {e}", e.instance_path()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_lists_statuses_and_events_are_held_to_the_schemas() {
        let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "default", "resourceVersion": "1"},
            "data": {"k": "v"}});
        assert_eq!(check(&cm), Vec::<String>::new());
        let mut bad = cm.clone();
        bad["data"]["k"] = json!(1);
        bad["spec"] = json!({});
        assert_eq!(check(&bad).len(), 2, "{:?}", check(&bad));
        let list = json!({"apiVersion": "v1", "kind": "ConfigMapList",
            "metadata": {"resourceVersion": "2"}, "items": [cm]});
        assert!(check(&list).is_empty(), "{:?}", check(&list));
        let status = json!({"apiVersion": "v1", "kind": "Status", "metadata": {},
            "status": "Failure", "reason": "NotFound", "code": 404, "message": "m",
            "details": {"name": "a", "kind": "configmaps"}});
        assert!(check(&status).is_empty(), "{:?}", check(&status));
        let mut bad_status = status;
        bad_status["code"] = json!("404");
        assert!(!check(&bad_status).is_empty());
        // A custom resource: its metadata is ObjectMeta, the rest is the CRD's business.
        let tr = json!({"apiVersion": "tekton.dev/v1", "kind": "TaskRun",
            "metadata": {"name": "t", "labels": {"a": "b"}}, "spec": {"anything": 1}});
        assert!(check(&tr).is_empty());
        let mut bad_tr = tr;
        bad_tr["metadata"]["labels"]["a"] = json!(true);
        assert!(!check(&bad_tr).is_empty());
        assert!(check_event(&json!({"type": "ADDED", "object": bad_tr})).len() == 1);
        assert!(!check_event(&json!({"type": "CHANGED", "object": {}})).is_empty());
    }
}
