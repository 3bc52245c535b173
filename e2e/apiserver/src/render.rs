//! Response formats chosen by `Accept`: plain JSON, `Table` (kubectl's human output) and
//! `PartialObjectMetadata` (kube-rs metadata watches).

use serde_json::{Value, json};

use super::resources::{Registry, ResourceDef};
use super::status::ApiError;

/// What the row `object` of a Table holds (`includeObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Include {
    None,
    Metadata,
    Object,
}

/// The representation a client asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Json,
    Table(Include),
    Metadata,
}

/// Picks the first media range of `Accept` this server can produce.
pub(crate) fn negotiate(accept: Option<&str>, include: Option<&str>) -> Result<Format, ApiError> {
    let include = match include {
        Some("None") => Include::None,
        Some("Object") => Include::Object,
        _ => Include::Metadata,
    };
    let Some(accept) = accept.filter(|a| !a.trim().is_empty()) else {
        return Ok(Format::Json);
    };
    for range in accept.split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default();
        if !matches!(media, "application/json" | "*/*" | "application/*") {
            continue;
        }
        let mut as_ = None;
        let mut g = None;
        for p in parts {
            match p.split_once('=') {
                Some(("as", v)) => as_ = Some(v),
                Some(("g", v)) => g = Some(v),
                _ => {}
            }
        }
        match (as_, g) {
            (None, _) => return Ok(Format::Json),
            (Some("Table"), Some("meta.k8s.io")) => return Ok(Format::Table(include)),
            (Some("PartialObjectMetadata" | "PartialObjectMetadataList"), Some("meta.k8s.io")) => {
                return Ok(Format::Metadata);
            }
            _ => {}
        }
    }
    Err(ApiError::not_acceptable(format!(
        "only the following media types are accepted: application/json, application/json;as=Table;g=meta.k8s.io;v=v1, application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1 (asked for {accept})"
    )))
}

fn partial(obj: &Value) -> Value {
    json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]})
}

/// A Table of `items` (already in `def`'s version).
pub(crate) fn table(
    def: &ResourceDef,
    items: &[Value],
    rv: Option<u64>,
    cont: Option<&str>,
    include: Include,
) -> Value {
    let now = time::OffsetDateTime::now_utc();
    let columns: Vec<Value> = def
        .columns
        .iter()
        .map(|c| {
            let mut v = json!({"name": c.name, "type": c.kind, "format": "", "description": c.name, "priority": c.priority});
            if c.name == "Name" {
                v["format"] = json!("name");
                v["description"] = json!("Name must be unique within a namespace.");
            }
            v
        })
        .collect();
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let cells: Vec<Value> = def
                .columns
                .iter()
                .map(|c| Registry::cell(c, o, now))
                .collect();
            let mut row = json!({"cells": cells});
            match include {
                Include::None => {}
                Include::Metadata => row["object"] = partial(o),
                Include::Object => row["object"] = o.clone(),
            }
            row
        })
        .collect();
    let mut meta = json!({});
    if let Some(rv) = rv {
        meta["resourceVersion"] = json!(rv.to_string());
    }
    if let Some(c) = cont {
        meta["continue"] = json!(c);
    }
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
           "columnDefinitions": columns, "rows": rows})
}

/// One object in the requested format.
pub(crate) fn item(def: &ResourceDef, obj: Value, fmt: Format) -> Value {
    match fmt {
        Format::Json => obj,
        Format::Metadata => partial(&obj),
        Format::Table(inc) => table(def, std::slice::from_ref(&obj), None, None, inc),
    }
}

/// One object of a list in the requested format (not a Table: those are built whole).
pub(crate) fn list_item(obj: Value, fmt: Format) -> Value {
    match fmt {
        Format::Metadata => partial(&obj),
        _ => obj,
    }
}

/// A list in the requested format.
pub(crate) fn list(
    def: &ResourceDef,
    items: Vec<Value>,
    rv: u64,
    cont: Option<String>,
    remaining: Option<usize>,
    fmt: Format,
) -> Value {
    if let Format::Table(inc) = fmt {
        return table(def, &items, Some(rv), cont.as_deref(), inc);
    }
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if let Some(c) = cont {
        meta["continue"] = json!(c);
    }
    if let Some(r) = remaining {
        meta["remainingItemCount"] = json!(r);
    }
    let (kind, av, items) = match fmt {
        Format::Metadata => (
            "PartialObjectMetadataList".to_owned(),
            "meta.k8s.io/v1".to_owned(),
            items.iter().map(partial).collect(),
        ),
        _ => (def.list_kind.clone(), def.api_version(), items),
    };
    json!({"kind": kind, "apiVersion": av, "metadata": meta, "items": items})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_follows_accept_order() {
        let kubectl = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
        assert_eq!(
            negotiate(Some(kubectl), None).unwrap(),
            Format::Table(Include::Metadata)
        );
        assert_eq!(
            negotiate(Some(kubectl), Some("Object")).unwrap(),
            Format::Table(Include::Object)
        );
        assert_eq!(
            negotiate(Some("application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"), None).unwrap(),
            Format::Metadata
        );
        assert_eq!(
            negotiate(
                Some("application/vnd.kubernetes.protobuf, application/json"),
                None
            )
            .unwrap(),
            Format::Json
        );
        assert_eq!(negotiate(None, None).unwrap(), Format::Json);
        assert_eq!(
            negotiate(Some("application/vnd.kubernetes.protobuf"), None)
                .unwrap_err()
                .code,
            406
        );
    }

    #[test]
    fn tables_render_name_and_age() {
        let reg = Registry::with_builtins();
        let cm = reg.get("", "v1", "configmaps").unwrap();
        let o = json!({"metadata": {"name": "a", "creationTimestamp": "2020-01-01T00:00:00Z"}, "data": {"x": "1", "y": "2"}});
        let t = table(&cm, &[o], Some(5), None, Include::Metadata);
        assert_eq!(t["rows"][0]["cells"][0], "a");
        assert_eq!(t["rows"][0]["cells"][1], 2);
        assert!(t["rows"][0]["cells"][2].as_str().unwrap().ends_with('d'));
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
        assert_eq!(t["metadata"]["resourceVersion"], "5");
    }
}
