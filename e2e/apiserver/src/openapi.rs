//! The OpenAPI documents kubectl downloads before `apply`/`create` (client-side validation, the
//! `fieldValidation` check, the patch type): v3 (`/openapi/v3` index, one document per
//! group-version) and v2 (`/openapi/v2`, JSON or the gnostic protobuf kubectl asks for).
//!
//! The server keeps no schemas (objects are stored as sent), so every kind's schema is an open
//! object (`x-kubernetes-preserve-unknown-fields`) carrying the `x-kubernetes-group-version-kind`
//! clients look kinds up by. PATCH operations list JSON and merge patches: kubectl then computes
//! strategic merge patches for built-in kinds from its compiled-in types, which carry the real
//! patch strategies, and merge patches for custom resources, as against a real cluster. No
//! operation lists the `fieldValidation` parameter: the server does not validate fields.

use serde_json::{Map, Value, json};

use super::protobuf::Writer;
use super::resources::{Registry, ResourceDef};

const OBJECT_META: &str = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta";

/// The media type of the protobuf v2 document (clients ask for `...spec.v2@v1.0+protobuf`; the
/// apiserver answers with this spelling, which Go's MIME parser accepts).
pub const V2_PROTOBUF: &str = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf";

/// Definition name of a kind, as the apiserver names them (`io.k8s.api.core.v1.ConfigMap`,
/// `dev.tekton.v1.TaskRun` for custom resources).
fn definition_name(def: &ResourceDef, kind: &str) -> String {
    if def.custom {
        let rev: Vec<&str> = def.group.split('.').rev().collect();
        return format!("{}.{}.{kind}", rev.join("."), def.version);
    }
    let pkg = match def.group.as_str() {
        "" => "io.k8s.api.core".to_owned(),
        "apiextensions.k8s.io" => {
            "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions".to_owned()
        }
        g => format!("io.k8s.api.{}", g.trim_end_matches(".k8s.io")),
    };
    format!("{pkg}.{}.{kind}", def.version)
}

fn gvk(def: &ResourceDef, kind: &str) -> Value {
    json!({"group": def.group, "version": def.version, "kind": kind})
}

/// Schemas of a group-version's kinds and their lists.
fn schemas(defs: &[&ResourceDef]) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert(
        OBJECT_META.into(),
        json!({"type": "object", "description": "Standard object metadata.",
               "x-kubernetes-preserve-unknown-fields": true}),
    );
    for def in defs {
        for kind in [&def.kind, &def.list_kind] {
            out.insert(
                definition_name(def, kind),
                json!({
                    "type": "object",
                    "description": format!("{kind} ({}). The test API server keeps no schema: any fields are accepted.", def.api_version()),
                    "x-kubernetes-preserve-unknown-fields": true,
                    "x-kubernetes-group-version-kind": [gvk(def, kind)],
                }),
            );
        }
    }
    out
}

/// The operations of one resource: `(path, method, action, kind)`.
fn operations(def: &ResourceDef) -> Vec<(String, &'static str, &'static str, String)> {
    let root = if def.group.is_empty() {
        format!("/api/{}", def.version)
    } else {
        format!("/apis/{}/{}", def.group, def.version)
    };
    let collection = if def.namespaced {
        format!("{root}/namespaces/{{namespace}}/{}", def.plural)
    } else {
        format!("{root}/{}", def.plural)
    };
    let item = format!("{collection}/{{name}}");
    let (k, l) = (def.kind.clone(), def.list_kind.clone());
    let mut ops = vec![
        (collection.clone(), "get", "list", l.clone()),
        (collection.clone(), "post", "post", k.clone()),
        (collection, "delete", "deletecollection", k.clone()),
        (item.clone(), "get", "get", k.clone()),
        (item.clone(), "put", "put", k.clone()),
        (item.clone(), "patch", "patch", k.clone()),
        (item.clone(), "delete", "delete", k.clone()),
    ];
    if def.namespaced {
        ops.push((format!("{root}/{}", def.plural), "get", "list", l));
    }
    if def.status_subresource {
        for (m, a) in [("get", "get"), ("put", "put"), ("patch", "patch")] {
            ops.push((format!("{item}/status"), m, a, k.clone()));
        }
    }
    ops
}

const PATCH_TYPES: [&str; 2] = [
    "application/json-patch+json",
    "application/merge-patch+json",
];

fn paths(defs: &[&ResourceDef], v3: bool) -> Map<String, Value> {
    let mut paths = Map::new();
    for def in defs {
        for (path, method, action, kind) in operations(def) {
            let mut op = json!({
                "operationId": format!("{method}{}{}", def.kind, if action == "list" { "List" } else { "" }),
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk(def, &kind),
            });
            let consumes: Vec<&str> = match method {
                "patch" => PATCH_TYPES.to_vec(),
                "post" | "put" => vec!["application/json", "application/yaml"],
                _ => vec![],
            };
            let schema = json!({"$ref": format!("{}{}", if v3 { "#/components/schemas/" } else { "#/definitions/" }, definition_name(def, &kind))});
            if v3 {
                if !consumes.is_empty() {
                    let content: Map<String, Value> = consumes
                        .iter()
                        .map(|c| ((*c).to_owned(), json!({"schema": schema})))
                        .collect();
                    op["requestBody"] = json!({"content": content, "required": true});
                }
                op["responses"] = json!({"200": {"description": "OK",
                    "content": {"application/json": {"schema": schema}}}});
            } else {
                if !consumes.is_empty() {
                    op["consumes"] = json!(consumes);
                }
                op["produces"] = json!(["application/json"]);
            }
            let entry = paths.entry(path).or_insert_with(|| json!({}));
            entry[method] = op;
        }
    }
    paths
}

fn served(reg: &Registry) -> Vec<ResourceDef> {
    reg.all().map(|d| (**d).clone()).collect()
}

/// `GET /openapi/v3`: the group-versions and where their documents are.
pub fn v3_index(reg: &Registry) -> Value {
    let mut gvs: Vec<(String, String)> = served(reg)
        .iter()
        .map(|d| (d.group.clone(), d.version.clone()))
        .collect();
    gvs.sort();
    gvs.dedup();
    let mut paths = Map::new();
    for (g, v) in gvs {
        let key = if g.is_empty() {
            format!("api/{v}")
        } else {
            format!("apis/{g}/{v}")
        };
        let doc = v3_document(reg, &g, &v).unwrap_or_default();
        let hash = fnv_hex(&serde_json::to_vec(&doc).unwrap_or_default());
        paths.insert(
            key.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{key}?hash={hash}")}),
        );
    }
    json!({"paths": paths})
}

/// `GET /openapi/v3/api/v1` or `/openapi/v3/apis/<group>/<version>`.
pub fn v3_document(reg: &Registry, group: &str, version: &str) -> Option<Value> {
    let all = served(reg);
    let defs: Vec<&ResourceDef> = all
        .iter()
        .filter(|d| d.group == group && d.version == version)
        .collect();
    if defs.is_empty() {
        return None;
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0-e2e"},
        "paths": paths(&defs, true),
        "components": {"schemas": schemas(&defs)},
    }))
}

/// `GET /openapi/v2` as JSON.
pub fn v2_document(reg: &Registry) -> Value {
    let all = served(reg);
    let defs: Vec<&ResourceDef> = all.iter().collect();
    json!({
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": "v1.33.0-e2e"},
        "paths": paths(&defs, false),
        "definitions": schemas(&defs),
    })
}

/// A stable content hash for the v3 index (clients treat it as opaque).
fn fnv_hex(b: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in b {
        h ^= u64::from(*x);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016X}")
}

/// Vendor extensions (`x-*` keys) as gnostic `NamedAny` entries with a YAML value (JSON is YAML).
fn extensions(w: &mut Writer, field: u32, obj: &Map<String, Value>) {
    for (k, v) in obj.iter().filter(|(k, _)| k.starts_with("x-")) {
        let mut any = Writer::default();
        any.string(2, &v.to_string());
        let mut named = Writer::default();
        named.string(1, k);
        named.message(2, any);
        w.message(field, named);
    }
}

fn strings(w: &mut Writer, field: u32, v: &Value) {
    for s in v.as_array().into_iter().flatten().filter_map(Value::as_str) {
        w.string(field, s);
    }
}

/// gnostic `Schema` (the subset [`schemas`] produces).
fn encode_schema(s: &Map<String, Value>) -> Writer {
    let mut w = Writer::default();
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        w.string(1, r);
    }
    if let Some(d) = s.get("description").and_then(Value::as_str) {
        w.string(4, d);
    }
    if let Some(t) = s.get("type").and_then(Value::as_str) {
        let mut ty = Writer::default();
        ty.string(1, t);
        w.message(22, ty);
    }
    extensions(&mut w, 31, s);
    w
}

/// gnostic `Operation`.
fn encode_operation(op: &Map<String, Value>) -> Writer {
    let mut w = Writer::default();
    if let Some(id) = op.get("operationId").and_then(Value::as_str) {
        w.string(5, id);
    }
    strings(&mut w, 6, &op["produces"]);
    strings(&mut w, 7, op.get("consumes").unwrap_or(&Value::Null));
    extensions(&mut w, 13, op);
    w
}

/// `GET /openapi/v2` as the gnostic `openapi_v2.Document` protobuf kubectl asks for.
pub fn v2_protobuf(doc: &Value) -> Vec<u8> {
    let mut w = Writer::default();
    w.string(1, doc["swagger"].as_str().unwrap_or("2.0"));
    let mut info = Writer::default();
    info.string(1, doc["info"]["title"].as_str().unwrap_or_default());
    info.string(2, doc["info"]["version"].as_str().unwrap_or_default());
    w.message(2, info);
    let mut paths = Writer::default();
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        let mut pi = Writer::default();
        for (method, field) in [
            ("get", 2),
            ("put", 3),
            ("post", 4),
            ("delete", 5),
            ("patch", 8),
        ] {
            if let Some(op) = item.get(method).and_then(Value::as_object) {
                pi.message(field, encode_operation(op));
            }
        }
        let mut named = Writer::default();
        named.string(1, path);
        named.message(2, pi);
        paths.message(2, named);
    }
    w.message(8, paths);
    let mut defs = Writer::default();
    for (name, schema) in doc["definitions"].as_object().into_iter().flatten() {
        let mut named = Writer::default();
        named.string(1, name);
        named.message(2, encode_schema(schema.as_object().unwrap_or(&Map::new())));
        defs.message(1, named);
    }
    w.message(9, defs);
    w.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_found_by_group_version_kind() {
        let reg = Registry::with_builtins();
        let doc = v3_document(&reg, "", "v1").unwrap();
        let cm = &doc["components"]["schemas"]["io.k8s.api.core.v1.ConfigMap"];
        assert_eq!(
            cm["x-kubernetes-group-version-kind"],
            json!([{"group": "", "version": "v1", "kind": "ConfigMap"}])
        );
        let patch = &doc["paths"]["/api/v1/namespaces/{namespace}/configmaps/{name}"]["patch"];
        assert_eq!(
            patch["x-kubernetes-group-version-kind"]["kind"],
            "ConfigMap"
        );
        let content = patch["requestBody"]["content"].as_object().unwrap();
        assert!(content.contains_key("application/merge-patch+json"));
        assert!(!content.contains_key("application/strategic-merge-patch+json"));
        assert!(v3_document(&reg, "nope.io", "v1").is_none());
        let index = v3_index(&reg);
        let url = index["paths"]["apis/coordination.k8s.io/v1"]["serverRelativeURL"]
            .as_str()
            .unwrap();
        assert!(
            url.starts_with("/openapi/v3/apis/coordination.k8s.io/v1?hash="),
            "{url}"
        );
        let v2 = v2_document(&reg);
        assert!(v2["definitions"].as_object().unwrap().contains_key(
            "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.v1.CustomResourceDefinition"
        ));
    }

    #[test]
    fn protobuf_document_holds_definitions_and_extensions() {
        let reg = Registry::with_builtins();
        let bytes = v2_protobuf(&v2_document(&reg));
        let find = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        assert!(find(b"io.k8s.api.core.v1.ConfigMap"));
        assert!(find(b"x-kubernetes-group-version-kind"));
        assert!(find(br#"[{"group":"","kind":"ConfigMap","version":"v1"}]"#));
        assert!(bytes.starts_with(b"\x0a\x032.0"), "swagger = 1");
    }
}
