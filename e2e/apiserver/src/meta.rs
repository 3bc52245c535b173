//! Object metadata rules applied on every write: system fields, generation, validation, the
//! per-type preparation the apiserver's registry strategies do (Secret `stringData`, Namespace
//! phase, CRD conditions, webhook defaults).

use rand::Rng;
use serde_json::{Map, Value, json};

use super::resources::{self, ResourceDef};
use super::selector::{
    LabelSelector, is_dns_label, is_dns_subdomain, validate_label_key, validate_label_value,
};

/// A validation failure: `(field path, message)`.
pub type Cause = (String, String);

/// The finalizer a CRD holds until its custom resources are gone.
pub const CRD_CLEANUP_FINALIZER: &str = "customresourcecleanup.apiextensions.k8s.io";
/// Deletion with `propagationPolicy: Orphan`.
pub const ORPHAN_FINALIZER: &str = "orphan";
/// Deletion with `propagationPolicy: Foreground`.
pub const FOREGROUND_FINALIZER: &str = "foregroundDeletion";

/// RFC 3339 UTC timestamp with second precision (`metav1.Time`).
pub fn timestamp(t: time::OffsetDateTime) -> String {
    let t = t.replace_nanosecond(0).unwrap_or(t);
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// A random version-4 UUID.
pub fn new_uid() -> String {
    let b: [u8; 16] = rand::thread_rng().r#gen();
    let mut b = b;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// `generateName` plus five random characters from the apiserver's alphabet.
pub fn generate_name(prefix: &str) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::thread_rng();
    // The prefix is truncated so the result stays within 63 characters.
    let prefix: String = prefix.chars().take(58).collect();
    let suffix: String = (0..5)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect();
    format!("{prefix}{suffix}")
}

/// The object's `metadata` map, created if missing.
pub fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = json!({});
    }
    if !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    obj["metadata"].as_object_mut().expect("set above")
}

/// `metadata.finalizers` as strings.
pub fn finalizers(obj: &Value) -> Vec<String> {
    obj["metadata"]["finalizers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect()
}

/// Replaces `metadata.finalizers` (removing the field when empty).
pub fn set_finalizers(obj: &mut Value, f: &[String]) {
    let m = meta_mut(obj);
    if f.is_empty() {
        m.remove("finalizers");
    } else {
        m.insert("finalizers".into(), json!(f));
    }
}

/// Whether the object has a `deletionTimestamp`.
pub fn is_deleting(obj: &Value) -> bool {
    obj["metadata"]["deletionTimestamp"].is_string()
}

/// Everything but `metadata` and `status`: what a `generation` bump tracks.
fn spec_part(obj: &Value, ignore_status: bool) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("apiVersion");
        m.remove("kind");
        if ignore_status {
            m.remove("status");
        }
    }
    o
}

/// Prepares a new object for storage after admission: system fields, defaults, status reset.
pub fn prepare_create(def: &ResourceDef, obj: &mut Value, now: time::OffsetDateTime) {
    let m = meta_mut(obj);
    m.insert("uid".into(), json!(new_uid()));
    m.insert("creationTimestamp".into(), json!(timestamp(now)));
    m.remove("deletionTimestamp");
    m.remove("deletionGracePeriodSeconds");
    m.remove("managedFields");
    m.remove("selfLink");
    if def.generation {
        m.insert("generation".into(), json!(1));
    } else {
        m.remove("generation");
    }
    if def.status_subresource && def.custom {
        // Custom resources with a status subresource drop status on create.
        if let Some(o) = obj.as_object_mut() {
            o.remove("status");
        }
    }
    match def.storage.as_str() {
        "core/namespaces" => {
            let name = obj["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let m = meta_mut(obj);
            let labels = m.entry("labels").or_insert_with(|| json!({}));
            labels["kubernetes.io/metadata.name"] = json!(name);
            obj["spec"] = json!({"finalizers": ["kubernetes"]});
            obj["status"] = json!({"phase": "Active"});
        }
        "core/pods" => {
            obj["status"] = json!({"phase": "Pending", "qosClass": "BestEffort"});
        }
        "core/secrets" => prepare_secret(obj),
        "apiextensions.k8s.io/customresourcedefinitions" => {
            let mut f = finalizers(obj);
            if !f.iter().any(|x| x == CRD_CLEANUP_FINALIZER) {
                f.push(CRD_CLEANUP_FINALIZER.into());
            }
            set_finalizers(obj, &f);
            crd_status(obj, now);
        }
        "admissionregistration.k8s.io/mutatingwebhookconfigurations" => default_webhooks(obj),
        _ => {}
    }
}

fn crd_status(obj: &mut Value, now: time::OffsetDateTime) {
    let ts = timestamp(now);
    let names = obj["spec"]["names"].clone();
    let mut accepted = names.clone();
    if accepted["singular"].is_null() {
        accepted["singular"] = json!(names["kind"].as_str().unwrap_or_default().to_lowercase());
    }
    if accepted["listKind"].is_null() {
        accepted["listKind"] = json!(format!(
            "{}List",
            names["kind"].as_str().unwrap_or_default()
        ));
    }
    let stored: Vec<Value> = obj["spec"]["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["storage"].as_bool() == Some(true))
        .map(|v| v["name"].clone())
        .collect();
    obj["status"] = json!({
        "acceptedNames": accepted,
        "storedVersions": stored,
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": ts},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": ts},
        ],
    });
}

/// Secret `stringData` is merged into base64 `data` on write; `type` defaults to `Opaque`.
fn prepare_secret(obj: &mut Value) {
    use base64::Engine;
    let Some(o) = obj.as_object_mut() else { return };
    if let Some(Value::Object(sd)) = o.remove("stringData") {
        let data = o.entry("data").or_insert_with(|| json!({}));
        if !data.is_object() {
            *data = json!({});
        }
        for (k, v) in sd {
            let s = v.as_str().unwrap_or_default();
            data[&k] = json!(base64::engine::general_purpose::STANDARD.encode(s));
        }
    }
    // `data` is `[]byte` in the API: Go's base64 decoding skips line breaks (kustomize folds
    // long values), and the value is stored and served re-encoded on one line.
    if let Some(Value::Object(data)) = o.get_mut("data") {
        for v in data.values_mut() {
            if let Some(s) = v.as_str().filter(|s| s.contains(['\r', '\n'])) {
                let joined: String = s.chars().filter(|c| !matches!(c, '\r' | '\n')).collect();
                if let Ok(b) = base64::engine::general_purpose::STANDARD.decode(&joined) {
                    *v = json!(base64::engine::general_purpose::STANDARD.encode(b));
                }
            }
        }
    }
    if o.get("type").is_none_or(Value::is_null) {
        o.insert("type".into(), json!("Opaque"));
    }
}

fn default_webhooks(obj: &mut Value) {
    for w in obj["webhooks"].as_array_mut().into_iter().flatten() {
        let defaults = [
            ("failurePolicy", json!("Fail")),
            ("matchPolicy", json!("Equivalent")),
            ("namespaceSelector", json!({})),
            ("objectSelector", json!({})),
            ("timeoutSeconds", json!(10)),
            ("reinvocationPolicy", json!("Never")),
        ];
        for (k, v) in defaults {
            if w.get(k).is_none_or(Value::is_null) {
                w[k] = v;
            }
        }
        for r in w["rules"].as_array_mut().into_iter().flatten() {
            if r.get("scope").is_none_or(Value::is_null) {
                r["scope"] = json!("*");
            }
        }
        if let Some(cc) = w.get_mut("clientConfig")
            && let Some(svc) = cc.get_mut("service")
            && svc.get("port").is_none_or(Value::is_null)
        {
            svc["port"] = json!(443);
        }
    }
}

/// Which part of the object an update may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateTarget {
    /// The main resource (status ignored when the resource has a status subresource).
    Main,
    /// The `status` subresource (only `.status` changes).
    Status,
}

/// Builds the object to store from the stored `old` and the requested `new` (both in storage form):
/// keeps system fields, applies the subresource split, bumps `generation`.
pub fn prepare_update(def: &ResourceDef, old: &Value, new: &Value, target: UpdateTarget) -> Value {
    let mut out = match target {
        UpdateTarget::Status => {
            let mut o = old.clone();
            match new.get("status") {
                Some(s) => o["status"] = s.clone(),
                None => {
                    if let Some(m) = o.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
            o
        }
        UpdateTarget::Main => {
            let mut o = new.clone();
            if def.status_subresource {
                match old.get("status") {
                    Some(s) => o["status"] = s.clone(),
                    None => {
                        if let Some(m) = o.as_object_mut() {
                            m.remove("status");
                        }
                    }
                }
            }
            o
        }
    };
    for k in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
        "name",
        "namespace",
    ] {
        let m = meta_mut(&mut out);
        match old["metadata"].get(k) {
            Some(v) => {
                m.insert(k.into(), v.clone());
            }
            None => {
                m.remove(k);
            }
        }
    }
    meta_mut(&mut out).remove("managedFields");
    if def.storage == "core/secrets" {
        prepare_secret(&mut out);
    }
    if def.storage == "admissionregistration.k8s.io/mutatingwebhookconfigurations" {
        default_webhooks(&mut out);
    }
    if def.storage == "core/namespaces" && target == UpdateTarget::Main {
        // spec.finalizers only changes through the finalize subresource.
        out["spec"] = old["spec"].clone();
        let name = old["metadata"]["name"].clone();
        let m = meta_mut(&mut out);
        let labels = m.entry("labels").or_insert_with(|| json!({}));
        if !labels.is_object() {
            *labels = json!({});
        }
        labels["kubernetes.io/metadata.name"] = name;
    }
    if def.generation {
        let ignore_status = def.status_subresource || !def.custom;
        if spec_part(old, ignore_status) != spec_part(&out, ignore_status) {
            let g = old["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
            meta_mut(&mut out).insert("generation".into(), json!(g));
        }
    }
    out
}

/// Rules every write must satisfy; `old` is the stored object on update.
pub fn validate(def: &ResourceDef, obj: &Value, old: Option<&Value>) -> Vec<Cause> {
    let mut errs: Vec<Cause> = Vec::new();
    let meta = &obj["metadata"];
    let name = meta["name"].as_str().unwrap_or_default();
    if name.is_empty() {
        errs.push((
            "metadata.name".into(),
            "Required value: name or generateName is required".into(),
        ));
    } else {
        let ok = if def.storage == "core/namespaces" {
            is_dns_label(name)
        } else {
            is_dns_subdomain(name)
        };
        if !ok {
            errs.push((
                "metadata.name".into(),
                format!("Invalid value: {name:?}: a lowercase RFC 1123 {} must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                    if def.storage == "core/namespaces" { "label" } else { "subdomain" }),
            ));
        }
    }
    for (k, v) in meta["labels"].as_object().into_iter().flatten() {
        if let Err(e) = validate_label_key(k) {
            errs.push((
                "metadata.labels".into(),
                format!("Invalid value: {k:?}: {e}"),
            ));
        }
        match v.as_str() {
            Some(v) => {
                if let Err(e) = validate_label_value(v) {
                    errs.push((
                        "metadata.labels".to_owned(),
                        format!("Invalid value: {v:?}: {e}"),
                    ));
                }
            }
            None => errs.push((
                "metadata.labels".into(),
                format!("Invalid value: {v}: must be a string"),
            )),
        }
    }
    for (k, v) in meta["annotations"].as_object().into_iter().flatten() {
        if validate_label_key(k).is_err() {
            errs.push(("metadata.annotations".into(), format!("Invalid value: {k:?}: name part must consist of alphanumeric characters, '-', '_' or '.'")));
        }
        if !v.is_string() {
            errs.push((
                "metadata.annotations".into(),
                format!("Invalid value: {v}: must be a string"),
            ));
        }
    }
    let fins = finalizers(obj);
    for f in &fins {
        if validate_label_key(f).is_err() {
            errs.push((
                "metadata.finalizers".into(),
                format!("Invalid value: {f:?}: a finalizer must be a qualified name"),
            ));
        }
    }
    if let Some(old) = old
        && is_deleting(old)
    {
        let before = finalizers(old);
        let added: Vec<&String> = fins.iter().filter(|f| !before.contains(f)).collect();
        if !added.is_empty() {
            errs.push((
                "metadata.finalizers".into(),
                format!("Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {added:?}"),
            ));
        }
    }
    for (i, r) in meta["ownerReferences"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        for f in ["apiVersion", "kind", "name", "uid"] {
            if r[f].as_str().is_none_or(str::is_empty) {
                errs.push((
                    format!("metadata.ownerReferences[{i}].{f}"),
                    "Required value".into(),
                ));
            }
        }
    }
    match def.storage.as_str() {
        "core/secrets" => validate_secret(obj, old, &mut errs),
        "core/configmaps" => {
            for k in obj["data"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, _)| k)
            {
                if !valid_config_key(k) {
                    errs.push((format!("data[{k}]"), format!("Invalid value: {k:?}: a valid config key must consist of alphanumeric characters, '-', '_' or '.'")));
                }
            }
        }
        "admissionregistration.k8s.io/mutatingwebhookconfigurations" => {
            validate_webhooks(obj, &mut errs)
        }
        "admissionregistration.k8s.io/validatingadmissionpolicies" => {
            validate_policy_expressions(obj, &mut errs)
        }
        "apiextensions.k8s.io/customresourcedefinitions" => {
            if let Err(e) = resources::from_crd(obj) {
                errs.extend(e);
            }
            if let Some(old) = old {
                for f in ["group", "names", "scope"] {
                    let field = if f == "names" { "names.plural" } else { f };
                    let get = |o: &Value| {
                        let mut v = &o["spec"];
                        for p in field.split('.') {
                            v = &v[p];
                        }
                        v.clone()
                    };
                    if get(old) != get(obj) {
                        errs.push((
                            format!("spec.{field}"),
                            "Invalid value: field is immutable".into(),
                        ));
                    }
                }
            }
        }
        _ => {}
    }
    errs
}

fn valid_config_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 253
        && k != "."
        && k != ".."
        && k.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
}

fn validate_secret(obj: &Value, old: Option<&Value>, errs: &mut Vec<Cause>) {
    use base64::Engine;
    for (k, v) in obj["data"].as_object().into_iter().flatten() {
        if !valid_config_key(k) {
            errs.push((format!("data[{k}]"), format!("Invalid value: {k:?}: a valid config key must consist of alphanumeric characters, '-', '_' or '.'")));
        }
        let ok = v
            .as_str()
            .is_some_and(|s| base64::engine::general_purpose::STANDARD.decode(s).is_ok());
        if !ok {
            errs.push((
                format!("data[{k}]"),
                "Invalid value: must be base64-encoded bytes".into(),
            ));
        }
    }
    if let Some(old) = old
        && old["type"] != obj["type"]
    {
        errs.push(("type".into(), "Invalid value: field is immutable".into()));
    }
}

fn validate_webhooks(obj: &Value, errs: &mut Vec<Cause>) {
    let mut names = Vec::new();
    for (i, w) in obj["webhooks"].as_array().into_iter().flatten().enumerate() {
        let f = |s: &str| format!("webhooks[{i}].{s}");
        let name = w["name"].as_str().unwrap_or_default();
        if name.split('.').count() < 3 || !is_dns_subdomain(name) {
            errs.push((f("name"), format!("Invalid value: {name:?}: should be a domain with at least three segments separated by dots")));
        }
        if names.contains(&name) {
            errs.push((f("name"), format!("Duplicate value: {name:?}")));
        }
        names.push(name);
        match w["sideEffects"].as_str() {
            Some("None" | "NoneOnDryRun") => {}
            None => errs.push((f("sideEffects"), "Required value".into())),
            Some(o) => errs.push((
                f("sideEffects"),
                format!("Unsupported value: {o:?}: supported values: \"None\", \"NoneOnDryRun\""),
            )),
        }
        let versions = w["admissionReviewVersions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if versions.is_empty() {
            errs.push((
                f("admissionReviewVersions"),
                "Required value: must specify one of v1, v1beta1".into(),
            ));
        } else if !versions.iter().any(|v| v == "v1") {
            // v1beta1 AdmissionReview is not spoken by this server.
            errs.push((
                f("admissionReviewVersions"),
                "Unsupported value: this server sends AdmissionReview v1 only".into(),
            ));
        }
        let cc = &w["clientConfig"];
        match (cc.get("url"), cc.get("service")) {
            (Some(_), Some(_)) | (None, None) => errs.push((
                f("clientConfig"),
                "Required value: exactly one of url or service is required".into(),
            )),
            (Some(u), None) if !u.as_str().is_some_and(|u| u.starts_with("https://")) => {
                errs.push((
                    f("clientConfig.url"),
                    "Invalid value: 'https' is the only allowed URL scheme".into(),
                ));
            }
            _ => {}
        }
        for (k, v) in [
            ("failurePolicy", &["Fail", "Ignore"][..]),
            ("matchPolicy", &["Exact", "Equivalent"]),
            ("reinvocationPolicy", &["Never", "IfNeeded"]),
        ] {
            if let Some(s) = w[k].as_str()
                && !v.contains(&s)
            {
                errs.push((
                    f(k),
                    format!("Unsupported value: {s:?}: supported values: {v:?}"),
                ));
            }
        }
        if let Some(t) = w["timeoutSeconds"].as_i64()
            && !(1..=30).contains(&t)
        {
            errs.push((
                f("timeoutSeconds"),
                format!("Invalid value: {t}: the timeout value must be between 1 and 30 seconds"),
            ));
        }
        for sel in ["namespaceSelector", "objectSelector"] {
            if let Err(e) = LabelSelector::from_object(w.get(sel)) {
                errs.push((f(sel), format!("Invalid value: {e}")));
            }
        }
        for (j, mc) in w["matchConditions"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let expr = mc["expression"].as_str().unwrap_or_default();
            if let Err(e) = super::cel::compile(expr) {
                errs.push((
                    format!("webhooks[{i}].matchConditions[{j}].expression"),
                    format!("Invalid value: {expr:?}: {e}"),
                ));
            }
        }
    }
}

/// Every CEL expression of a ValidatingAdmissionPolicy must compile (parse, and name only declared
/// variables and functions), as kube-apiserver refuses a policy that does not.
fn validate_policy_expressions(obj: &Value, errs: &mut Vec<Cause>) {
    for (list, fields) in [
        ("matchConditions", &["expression"][..]),
        ("variables", &["expression"][..]),
        ("validations", &["expression", "messageExpression"][..]),
    ] {
        for (i, item) in obj["spec"][list]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            for field in fields {
                let Some(expr) = item[*field].as_str() else {
                    continue;
                };
                if let Err(e) = super::cel::compile(expr) {
                    errs.push((
                        format!("spec.{list}[{i}].{field}"),
                        format!("Invalid value: {expr:?}: compilation failed: {e}"),
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Registry;

    #[test]
    fn uids_and_names() {
        let u = new_uid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_ne!(u, new_uid());
        let n = generate_name("tr-");
        assert!(n.starts_with("tr-") && n.len() == 8);
        assert!(
            timestamp(time::macros::datetime!(2024-01-02 03:04:05.678 UTC))
                == "2024-01-02T03:04:05Z"
        );
    }

    #[test]
    fn secrets_merge_string_data() {
        let reg = Registry::with_builtins();
        let def = reg.get("", "v1", "secrets").unwrap();
        let mut s =
            json!({"metadata": {"name": "s"}, "data": {"a": "eA=="}, "stringData": {"b": "y"}});
        prepare_create(&def, &mut s, time::OffsetDateTime::now_utc());
        assert_eq!(s["data"], json!({"a": "eA==", "b": "eQ=="}));
        assert_eq!(s["type"], "Opaque");
        assert!(s.get("stringData").is_none());
        let mut bad = s.clone();
        bad["data"]["c"] = json!("%%%");
        bad["type"] = json!("kubernetes.io/tls");
        let errs = validate(&def, &bad, Some(&s));
        assert!(errs.iter().any(|(f, _)| f == "data[c]"));
        assert!(errs.iter().any(|(f, _)| f == "type"));
    }

    #[test]
    fn secret_data_folded_over_lines_is_stored_on_one_line() {
        let mut s = json!({"metadata": {"name": "s"}, "data": {"a": "eHl6\neHl6\n", "b": "e"}});
        prepare_secret(&mut s);
        assert_eq!(s["data"]["a"], "eHl6eHl6");
        // Not base64: left for validation to refuse.
        assert_eq!(s["data"]["b"], "e");
    }

    #[test]
    fn updates_keep_system_fields_and_split_status() {
        let reg = Registry::with_builtins();
        let mut crd: Value = serde_norway::from_str(
            "{metadata: {name: things.example.com}, spec: {group: example.com, scope: Namespaced, names: {plural: things, kind: Thing}, versions: [{name: v1, served: true, storage: true, subresources: {status: {}}}]}}",
        )
        .unwrap();
        let crd_def = reg
            .get("apiextensions.k8s.io", "v1", "customresourcedefinitions")
            .unwrap();
        prepare_create(&crd_def, &mut crd, time::OffsetDateTime::now_utc());
        assert!(validate(&crd_def, &crd, None).is_empty());
        let def = resources::from_crd(&crd).unwrap().remove(0);
        let old = json!({"metadata": {"name": "a", "uid": "u", "generation": 1}, "spec": {"x": 1}, "status": {"s": 1}});
        let new = json!({"metadata": {"name": "a", "uid": "other", "labels": {"l": "v"}}, "spec": {"x": 2}, "status": {"s": 2}});
        let main = prepare_update(&def, &old, &new, UpdateTarget::Main);
        assert_eq!(main["metadata"]["uid"], "u");
        assert_eq!(
            main["status"]["s"], 1,
            "status ignored on the main resource"
        );
        assert_eq!(main["metadata"]["generation"], 2);
        let st = prepare_update(&def, &old, &new, UpdateTarget::Status);
        assert_eq!(st["spec"]["x"], 1, "spec ignored on the status subresource");
        assert_eq!(st["status"]["s"], 2);
        assert!(st["metadata"].get("labels").is_none());
        assert_eq!(st["metadata"]["generation"], 1);
    }

    #[test]
    fn no_new_finalizers_while_deleting() {
        let reg = Registry::with_builtins();
        let def = reg.get("", "v1", "configmaps").unwrap();
        let old =
            json!({"metadata": {"name": "a", "deletionTimestamp": "x", "finalizers": ["a/b"]}});
        let new = json!({"metadata": {"name": "a", "deletionTimestamp": "x", "finalizers": ["a/b", "c/d"]}});
        let errs = validate(&def, &new, Some(&old));
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].1.starts_with("Forbidden"));
        let fewer = json!({"metadata": {"name": "a", "finalizers": []}});
        assert!(validate(&def, &fewer, Some(&old)).is_empty());
    }

    #[test]
    fn webhook_configurations_are_defaulted_and_checked() {
        let reg = Registry::with_builtins();
        let def = reg
            .get(
                "admissionregistration.k8s.io",
                "v1",
                "mutatingwebhookconfigurations",
            )
            .unwrap();
        let mut w = json!({"metadata": {"name": "w"}, "webhooks": [{"name": "a.b.c", "sideEffects": "None",
            "admissionReviewVersions": ["v1"], "clientConfig": {"url": "https://127.0.0.1:1/x"},
            "rules": [{"operations": ["CREATE"], "apiGroups": ["tekton.dev"], "apiVersions": ["*"], "resources": ["taskruns"]}]}]});
        prepare_create(&def, &mut w, time::OffsetDateTime::now_utc());
        assert_eq!(w["webhooks"][0]["failurePolicy"], "Fail");
        assert_eq!(w["webhooks"][0]["rules"][0]["scope"], "*");
        assert!(validate(&def, &w, None).is_empty());
        w["webhooks"][0]["timeoutSeconds"] = json!(31);
        w["webhooks"][0]["clientConfig"]["url"] = json!("http://x");
        assert_eq!(validate(&def, &w, None).len(), 2);
    }
}
