//! The resource types served: built-in ones and those registered by CustomResourceDefinitions, with
//! the discovery documents kubectl and kube-rs map resources from.

use std::sync::Arc;

use serde_json::{Value, json};

use super::jsonpath;

/// How a served version converts to and from the stored form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conversion {
    /// Same schema in every version; only `apiVersion` changes (CRD `strategy: None`).
    None,
    /// `events.k8s.io/v1` Event stored as a core `v1` Event (field renames).
    EventsV1,
}

/// A table column (`kubectl get` without `-o`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Header.
    pub name: String,
    /// OpenAPI type: `string`, `integer`, `date`, ...
    pub kind: String,
    /// Where the cell comes from.
    pub source: CellSource,
    /// 0 = shown by default, >0 = only with `-o wide`.
    pub priority: i64,
}

/// How a table cell is computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CellSource {
    /// `metadata.name`.
    Name,
    /// Time since `metadata.creationTimestamp`.
    Age,
    /// A JSONPath subset (`.a.b`, `[0]`, `[?(@.k=="v")]`).
    Path(String),
    /// Number of entries of the maps or lists at these top-level fields.
    Count(&'static [&'static str]),
}

/// One resource at one served version.
#[derive(Debug, Clone)]
pub struct ResourceDef {
    /// API group (`""` for core).
    pub group: String,
    /// Served version.
    pub version: String,
    /// Resource name in URLs (plural).
    pub plural: String,
    /// Singular name.
    pub singular: String,
    pub kind: String,
    /// Kind of the list.
    pub list_kind: String,
    /// kubectl short names.
    pub short_names: Vec<String>,
    /// kubectl categories (`all`).
    pub categories: Vec<String>,
    /// Namespaced (else cluster-scoped).
    pub namespaced: bool,
    /// Has a `status` subresource (writes to the main resource ignore `.status` and vice versa).
    pub status_subresource: bool,
    /// Storage identity shared by all versions (and by both Event APIs), e.g. `tekton.dev/taskruns`.
    pub storage: String,
    /// `apiVersion` of the stored form.
    pub storage_api_version: String,
    /// How this version converts.
    pub conversion: Conversion,
    /// Defined by a CRD (custom resource semantics: no strategic merge, `resourceVersion` required
    /// on update, delete returns the object).
    pub custom: bool,
    /// `metadata.generation` is maintained (bumped on spec changes).
    pub generation: bool,
    /// Table columns.
    pub columns: Vec<Column>,
}

impl ResourceDef {
    /// `group/version`, or `v1` for core.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `plural` or `plural.group`, as used in error messages.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// Converts a stored object into this version's form.
    pub fn to_version(&self, mut obj: Value) -> Value {
        match self.conversion {
            Conversion::None => {
                obj["apiVersion"] = json!(self.api_version());
                obj["kind"] = json!(self.kind);
            }
            Conversion::EventsV1 => obj = event_core_to_v1(obj),
        }
        obj
    }

    /// Converts an object of this version into the stored form.
    pub fn to_storage(&self, mut obj: Value) -> Value {
        match self.conversion {
            Conversion::None => {
                obj["apiVersion"] = json!(self.storage_api_version);
                obj["kind"] = json!(self.kind);
            }
            Conversion::EventsV1 => obj = event_v1_to_core(obj),
        }
        obj
    }

    /// The value of a field-selector field, or `Err` if the resource does not support the field.
    #[allow(clippy::result_unit_err)]
    pub fn field_value(&self, obj: &Value, field: &str) -> Result<Option<String>, ()> {
        let s = |v: &Value| match v {
            Value::String(s) => Some(s.clone()),
            Value::Null => None,
            other => Some(other.to_string()),
        };
        let path = |p: &str| {
            let mut cur = obj;
            for part in p.split('.') {
                cur = cur.get(part)?;
            }
            s(cur)
        };
        let allowed: &[&str] = match (self.storage.as_str(), field) {
            (_, "metadata.name" | "metadata.namespace") => return Ok(path(field)),
            ("core/events", _) => &[
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "involvedObject.apiVersion",
                "involvedObject.resourceVersion",
                "involvedObject.fieldPath",
                "reason",
                "reportingComponent",
                "source",
                "type",
            ],
            ("core/secrets", _) => &["type"],
            ("core/namespaces", _) => &["status.phase"],
            ("core/pods", _) => &[
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ],
            _ => &[],
        };
        if !allowed.contains(&field) {
            return Err(());
        }
        if self.conversion == Conversion::EventsV1 {
            // The selector names fields of the stored (core) form.
            return Ok(path(field));
        }
        if field == "source" {
            return Ok(path("source.component"));
        }
        Ok(path(field))
    }

    fn discovery_entry(&self) -> Value {
        json!({
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            "shortNames": self.short_names,
            "categories": self.categories,
        })
    }
}

/// Field renames between core `v1` Events and `events.k8s.io/v1` Events (core name first).
const EVENT_FIELDS: [(&str, &str); 7] = [
    ("involvedObject", "regarding"),
    ("message", "note"),
    ("reportingComponent", "reportingController"),
    ("source", "deprecatedSource"),
    ("firstTimestamp", "deprecatedFirstTimestamp"),
    ("lastTimestamp", "deprecatedLastTimestamp"),
    ("count", "deprecatedCount"),
];

/// core `v1` Event → `events.k8s.io/v1` Event.
fn event_core_to_v1(o: Value) -> Value {
    rename_event(o, false, "events.k8s.io/v1")
}

/// `events.k8s.io/v1` Event → core `v1` Event.
fn event_v1_to_core(o: Value) -> Value {
    rename_event(o, true, "v1")
}

fn rename_event(mut o: Value, to_core: bool, api_version: &str) -> Value {
    let Some(m) = o.as_object_mut() else { return o };
    for (core, v1) in EVENT_FIELDS {
        let (from, to) = if to_core { (v1, core) } else { (core, v1) };
        if let Some(v) = m.remove(from) {
            m.insert(to.to_owned(), v);
        }
    }
    m.insert("apiVersion".into(), json!(api_version));
    m.insert("kind".into(), json!("Event"));
    o
}

fn col(name: &str, kind: &str, source: CellSource) -> Column {
    Column {
        name: name.into(),
        kind: kind.into(),
        source,
        priority: 0,
    }
}

#[allow(clippy::too_many_arguments)]
fn builtin(
    group: &str,
    version: &str,
    plural: &str,
    kind: &str,
    short: &[&str],
    namespaced: bool,
    status: bool,
    extra_columns: Vec<Column>,
) -> ResourceDef {
    let storage_group = if group.is_empty() { "core" } else { group };
    let mut columns = vec![col("Name", "string", CellSource::Name)];
    columns.extend(extra_columns);
    columns.push(col("Age", "string", CellSource::Age));
    ResourceDef {
        group: group.into(),
        version: version.into(),
        plural: plural.into(),
        singular: kind.to_lowercase(),
        kind: kind.into(),
        list_kind: format!("{kind}List"),
        short_names: short.iter().map(|s| (*s).to_owned()).collect(),
        categories: if matches!(plural, "pods") {
            vec!["all".into()]
        } else {
            vec![]
        },
        namespaced,
        status_subresource: status,
        storage: format!("{storage_group}/{plural}"),
        storage_api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        conversion: Conversion::None,
        custom: false,
        generation: matches!(
            plural,
            "mutatingwebhookconfigurations" | "customresourcedefinitions" | "pods"
        ),
        columns,
    }
}

/// The built-in resources.
pub fn builtins() -> Vec<ResourceDef> {
    let p = |s: &str| CellSource::Path(s.into());
    let mut v = vec![
        builtin(
            "",
            "v1",
            "namespaces",
            "Namespace",
            &["ns"],
            false,
            true,
            vec![col("Status", "string", p(".status.phase"))],
        ),
        builtin(
            "",
            "v1",
            "configmaps",
            "ConfigMap",
            &["cm"],
            true,
            false,
            vec![col(
                "Data",
                "integer",
                CellSource::Count(&["data", "binaryData"]),
            )],
        ),
        builtin(
            "",
            "v1",
            "secrets",
            "Secret",
            &[],
            true,
            false,
            vec![
                col("Type", "string", p(".type")),
                col("Data", "integer", CellSource::Count(&["data"])),
            ],
        ),
        builtin(
            "",
            "v1",
            "pods",
            "Pod",
            &["po"],
            true,
            true,
            vec![col("Status", "string", p(".status.phase"))],
        ),
        builtin(
            "",
            "v1",
            "events",
            "Event",
            &["ev"],
            true,
            false,
            vec![
                col("Type", "string", p(".type")),
                col("Reason", "string", p(".reason")),
                col("Object", "string", p(".involvedObject.name")),
                col("Message", "string", p(".message")),
            ],
        ),
        builtin(
            "",
            "v1",
            "serviceaccounts",
            "ServiceAccount",
            &["sa"],
            true,
            false,
            vec![],
        ),
        builtin(
            "coordination.k8s.io",
            "v1",
            "leases",
            "Lease",
            &[],
            true,
            false,
            vec![col("Holder", "string", p(".spec.holderIdentity"))],
        ),
        builtin(
            "admissionregistration.k8s.io",
            "v1",
            "mutatingwebhookconfigurations",
            "MutatingWebhookConfiguration",
            &[],
            false,
            false,
            vec![col("Webhooks", "integer", CellSource::Count(&["webhooks"]))],
        ),
        builtin(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicies",
            "ValidatingAdmissionPolicy",
            &[],
            false,
            true,
            vec![],
        ),
        builtin(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicybindings",
            "ValidatingAdmissionPolicyBinding",
            &[],
            false,
            false,
            vec![],
        ),
        builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "roles",
            "Role",
            &[],
            true,
            false,
            vec![],
        ),
        builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "rolebindings",
            "RoleBinding",
            &[],
            true,
            false,
            vec![col("Role", "string", p(".roleRef.name"))],
        ),
        builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "clusterroles",
            "ClusterRole",
            &[],
            false,
            false,
            vec![],
        ),
        builtin(
            "rbac.authorization.k8s.io",
            "v1",
            "clusterrolebindings",
            "ClusterRoleBinding",
            &[],
            false,
            false,
            vec![col("Role", "string", p(".roleRef.name"))],
        ),
        builtin(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            &["crd", "crds"],
            false,
            true,
            vec![col("Created At", "date", p(".metadata.creationTimestamp"))],
        ),
    ];
    let mut ev = builtin(
        "events.k8s.io",
        "v1",
        "events",
        "Event",
        &[],
        true,
        false,
        vec![
            col("Type", "string", p(".type")),
            col("Reason", "string", p(".reason")),
            col("Object", "string", p(".regarding.name")),
        ],
    );
    ev.storage = "core/events".into();
    ev.storage_api_version = "v1".into();
    ev.conversion = Conversion::EventsV1;
    v.push(ev);
    v.extend(deployed_kinds());
    v
}

/// The other kinds the shipped manifests contain, stored and served as written (no controller
/// acts on them here), so `kubectl apply -k` of an installation works against this server (the
/// RBAC kinds are served above, for the authorizer).
fn deployed_kinds() -> Vec<ResourceDef> {
    let replicas = |p: &str| CellSource::Path(p.into());
    [
        (
            "apps",
            "deployments",
            "Deployment",
            &["deploy"][..],
            true,
            true,
        ),
        ("", "services", "Service", &["svc"][..], true, true),
        (
            "",
            "persistentvolumeclaims",
            "PersistentVolumeClaim",
            &["pvc"][..],
            true,
            true,
        ),
        (
            "policy",
            "poddisruptionbudgets",
            "PodDisruptionBudget",
            &["pdb"][..],
            true,
            true,
        ),
        (
            "networking.k8s.io",
            "networkpolicies",
            "NetworkPolicy",
            &["netpol"][..],
            true,
            false,
        ),
        (
            "flowcontrol.apiserver.k8s.io",
            "flowschemas",
            "FlowSchema",
            &[][..],
            false,
            true,
        ),
    ]
    .into_iter()
    .map(|(group, plural, kind, short, namespaced, status)| {
        let columns = if kind == "Deployment" {
            vec![col("Replicas", "integer", replicas(".spec.replicas"))]
        } else {
            vec![]
        };
        builtin(
            group, "v1", plural, kind, short, namespaced, status, columns,
        )
    })
    .collect()
}

/// Parses a CustomResourceDefinition into one [`ResourceDef`] per served version, or the list of
/// problems (`field: message`) that make it invalid.
pub fn from_crd(crd: &Value) -> Result<Vec<ResourceDef>, Vec<(String, String)>> {
    let mut errs = Vec::new();
    let spec = &crd["spec"];
    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let group = s(&spec["group"]);
    let names = &spec["names"];
    let plural = s(&names["plural"]);
    let kind = s(&names["kind"]);
    let singular = names["singular"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| kind.to_lowercase());
    let list_kind = names["listKind"]
        .as_str()
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{kind}List"));
    if group.is_empty() || !group.contains('.') {
        errs.push((
            "spec.group".into(),
            format!("Invalid value: {group:?}: should be a domain with at least one dot"),
        ));
    }
    if plural.is_empty() {
        errs.push(("spec.names.plural".into(), "Required value".into()));
    }
    if kind.is_empty() {
        errs.push(("spec.names.kind".into(), "Required value".into()));
    }
    let name = crd["metadata"]["name"].as_str().unwrap_or_default();
    if !plural.is_empty() && name != format!("{plural}.{group}") {
        errs.push((
            "metadata.name".into(),
            format!("Invalid value: {name:?}: must be spec.names.plural+\".\"+spec.group"),
        ));
    }
    let namespaced = match spec["scope"].as_str() {
        Some("Namespaced") => true,
        Some("Cluster") => false,
        other => {
            errs.push((
                "spec.scope".into(),
                format!(
                    "Unsupported value: {other:?}: supported values: \"Cluster\", \"Namespaced\""
                ),
            ));
            true
        }
    };
    let versions = spec["versions"].as_array().cloned().unwrap_or_default();
    if versions.is_empty() {
        errs.push(("spec.versions".into(), "Required value".into()));
    }
    let storage: Vec<String> = versions
        .iter()
        .filter(|v| v["storage"].as_bool() == Some(true))
        .map(|v| s(&v["name"]))
        .collect();
    if storage.len() != 1 {
        errs.push((
            "spec.versions".into(),
            "Invalid value: must have exactly one version marked as storage version".into(),
        ));
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    let mut defs = Vec::new();
    for v in versions
        .iter()
        .filter(|v| v["served"].as_bool() == Some(true))
    {
        let mut columns = vec![col("Name", "string", CellSource::Name)];
        let mut age = true;
        for c in v["additionalPrinterColumns"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let path = s(&c["jsonPath"]);
            if path == ".metadata.creationTimestamp" {
                age = false;
                columns.push(col(&s(&c["name"]), "string", CellSource::Age));
                continue;
            }
            columns.push(Column {
                name: s(&c["name"]),
                kind: s(&c["type"]),
                source: CellSource::Path(path),
                priority: c["priority"].as_i64().unwrap_or(0),
            });
        }
        if age {
            columns.push(col("Age", "string", CellSource::Age));
        }
        defs.push(ResourceDef {
            group: group.clone(),
            version: s(&v["name"]),
            plural: plural.clone(),
            singular: singular.clone(),
            kind: kind.clone(),
            list_kind: list_kind.clone(),
            short_names: str_list(&names["shortNames"]),
            categories: str_list(&names["categories"]),
            namespaced,
            status_subresource: v["subresources"].get("status").is_some(),
            storage: format!("{group}/{plural}"),
            storage_api_version: format!("{group}/{}", storage[0]),
            conversion: Conversion::None,
            custom: true,
            generation: true,
            columns,
        });
    }
    Ok(defs)
}

fn str_list(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// Kubernetes version priority: GA > beta > alpha, then higher major, then higher minor; others last.
pub fn version_priority(v: &str) -> (u8, u64, u64, String) {
    let parse = |s: &str| -> Option<(u8, u64, u64)> {
        let rest = s.strip_prefix('v')?;
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let major: u64 = digits.parse().ok()?;
        let tail = &rest[digits.len()..];
        if tail.is_empty() {
            return Some((3, major, 0));
        }
        for (label, rank) in [("beta", 2), ("alpha", 1)] {
            if let Some(n) = tail.strip_prefix(label) {
                let minor: u64 = n.parse().ok()?;
                return Some((rank, major, minor));
            }
        }
        None
    };
    match parse(v) {
        Some((r, a, b)) => (r, a, b, String::new()),
        None => (0, 0, 0, v.to_owned()),
    }
}

/// Every resource served, looked up by group, version and plural.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    defs: Vec<Arc<ResourceDef>>,
}

impl Registry {
    /// The built-in resources only.
    pub fn with_builtins() -> Self {
        Self {
            defs: builtins().into_iter().map(Arc::new).collect(),
        }
    }

    /// Every resource at every served version.
    pub fn all(&self) -> impl Iterator<Item = &Arc<ResourceDef>> {
        self.defs.iter()
    }

    /// Finds a resource by group, version and plural.
    pub fn get(&self, group: &str, version: &str, plural: &str) -> Option<Arc<ResourceDef>> {
        self.defs
            .iter()
            .find(|d| d.group == group && d.version == version && d.plural == plural)
            .cloned()
    }

    /// Finds a resource by group, version and kind.
    pub fn find_kind(&self, group: &str, version: &str, kind: &str) -> Option<Arc<ResourceDef>> {
        self.defs
            .iter()
            .find(|d| d.group == group && d.version == version && d.kind == kind)
            .cloned()
    }

    /// Every version served of the resource stored at `storage`.
    pub fn versions_of(&self, storage: &str) -> Vec<Arc<ResourceDef>> {
        self.defs
            .iter()
            .filter(|d| d.storage == storage && d.conversion == Conversion::None)
            .cloned()
            .collect()
    }

    /// The preferred version of the resource stored at `storage` (native for Events).
    pub fn preferred(&self, storage: &str) -> Option<Arc<ResourceDef>> {
        self.versions_of(storage)
            .into_iter()
            .max_by_key(|d| version_priority(&d.version))
    }

    /// All distinct storage keys.
    pub fn storages(&self) -> Vec<String> {
        let mut v: Vec<String> = self.defs.iter().map(|d| d.storage.clone()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// Replaces the versions registered for a CRD's storage key with `defs` (empty: unregister).
    pub fn set_custom(&mut self, storage: &str, defs: Vec<ResourceDef>) {
        self.defs.retain(|d| !(d.custom && d.storage == storage));
        self.defs.extend(defs.into_iter().map(Arc::new));
    }

    /// Whether a built-in resource uses this group (CRDs may not take over built-in groups).
    pub fn is_builtin_group(&self, group: &str) -> bool {
        self.defs.iter().any(|d| !d.custom && d.group == group)
    }

    fn groups(&self) -> Vec<(String, Vec<String>)> {
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        for d in &self.defs {
            if d.group.is_empty() {
                continue;
            }
            match out.iter_mut().find(|(g, _)| *g == d.group) {
                Some((_, vs)) => {
                    if !vs.contains(&d.version) {
                        vs.push(d.version.clone());
                    }
                }
                None => out.push((d.group.clone(), vec![d.version.clone()])),
            }
        }
        for (_, vs) in &mut out {
            vs.sort_by_key(|v| std::cmp::Reverse(version_priority(v)));
        }
        out
    }

    /// `GET /api`.
    pub fn api_versions(&self, server_address: &str) -> Value {
        json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
        })
    }

    fn group_doc(name: &str, versions: &[String]) -> Value {
        let gv = |v: &String| json!({"groupVersion": format!("{name}/{v}"), "version": v});
        json!({
            "name": name,
            "versions": versions.iter().map(gv).collect::<Vec<_>>(),
            "preferredVersion": gv(&versions[0]),
        })
    }

    /// `GET /apis`.
    pub fn api_group_list(&self) -> Value {
        let groups: Vec<Value> = self
            .groups()
            .iter()
            .map(|(g, vs)| Self::group_doc(g, vs))
            .collect();
        json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
    }

    /// `GET /apis/<group>`.
    pub fn api_group(&self, group: &str) -> Option<Value> {
        let (g, vs) = self.groups().into_iter().find(|(g, _)| g == group)?;
        let mut doc = Self::group_doc(&g, &vs);
        doc["kind"] = json!("APIGroup");
        doc["apiVersion"] = json!("v1");
        Some(doc)
    }

    /// `GET /api/v1` or `GET /apis/<group>/<version>`.
    pub fn resource_list(&self, group: &str, version: &str) -> Option<Value> {
        let defs: Vec<&Arc<ResourceDef>> = self
            .defs
            .iter()
            .filter(|d| d.group == group && d.version == version)
            .collect();
        if defs.is_empty() {
            return None;
        }
        let mut resources = Vec::new();
        for d in defs {
            resources.push(d.discovery_entry());
            if d.status_subresource {
                resources.push(json!({
                    "name": format!("{}/status", d.plural),
                    "singularName": "",
                    "namespaced": d.namespaced,
                    "kind": d.kind,
                    "verbs": ["get", "patch", "update"],
                }));
            }
        }
        let gv = if group.is_empty() {
            version.to_owned()
        } else {
            format!("{group}/{version}")
        };
        Some(json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": gv,
            "resources": resources,
        }))
    }

    /// Renders one table cell of `obj` (in this version's form).
    pub fn cell(column: &Column, obj: &Value, now: time::OffsetDateTime) -> Value {
        match &column.source {
            CellSource::Name => obj["metadata"]["name"].clone(),
            CellSource::Age => {
                let created = obj["metadata"]["creationTimestamp"].as_str().and_then(|s| {
                    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
                        .ok()
                });
                match created {
                    Some(c) => json!(human_duration((now - c).whole_seconds().max(0))),
                    None => json!("<unknown>"),
                }
            }
            CellSource::Count(fields) => {
                let n: usize = fields
                    .iter()
                    .map(|f| match &obj[*f] {
                        Value::Object(m) => m.len(),
                        Value::Array(a) => a.len(),
                        _ => 0,
                    })
                    .sum();
                json!(n)
            }
            CellSource::Path(p) => {
                let v = jsonpath::eval(obj, p).unwrap_or(Value::Null);
                // Date columns are shown as an age, as the apiserver's CRD table convertor does.
                let date = (column.kind == "date")
                    .then(|| v.as_str())
                    .flatten()
                    .and_then(|s| {
                        time::OffsetDateTime::parse(
                            s,
                            &time::format_description::well_known::Rfc3339,
                        )
                        .ok()
                    });
                match date {
                    Some(d) => json!(human_duration((now - d).whole_seconds().max(0))),
                    None => v,
                }
            }
        }
    }
}

/// `kubectl`-style short duration: `45s`, `12m`, `3h`, `5d`.
pub fn human_duration(secs: i64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 3600 * 2 => format!("{}m", s / 60),
        s if s < 86400 * 2 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tekton_crd() -> Value {
        crate::parse_documents(crate::TEKTON_CRDS)
            .unwrap()
            .remove(0)
    }

    #[test]
    fn version_ordering() {
        let mut v = vec!["v1beta1", "v1", "v2alpha1", "v1alpha1", "v2", "foo"];
        v.sort_by_key(|s| std::cmp::Reverse(version_priority(s)));
        assert_eq!(v, ["v2", "v1", "v1beta1", "v2alpha1", "v1alpha1", "foo"]);
    }

    #[test]
    fn crd_rejects_two_storage_versions() {
        let crd = json!({"metadata": {"name": "things.example.com"}, "spec": {
            "group": "example.com", "scope": "Namespaced",
            "names": {"plural": "things", "kind": "Thing"},
            "versions": [{"name": "v1", "served": true, "storage": true}, {"name": "v2", "served": true, "storage": true}]}});
        let errs = from_crd(&crd).unwrap_err();
        assert!(errs.iter().any(|(f, _)| f == "spec.versions"), "{errs:?}");
    }

    #[test]
    fn tekton_crd_file_registers_both_versions() {
        let crd = tekton_crd();
        assert!(
            crd.is_object(),
            "the first document of crds/tekton.yaml is a CRD"
        );
        let defs = from_crd(&crd).unwrap();
        let versions: Vec<_> = defs.iter().map(|d| d.version.as_str()).collect();
        assert!(versions.contains(&"v1") && versions.contains(&"v1beta1"));
        assert!(defs.iter().all(|d| d.status_subresource && d.namespaced));
        assert!(
            defs.iter()
                .all(|d| d.storage_api_version == "tekton.dev/v1")
        );
    }

    #[test]
    fn events_convert_both_ways() {
        let reg = Registry::with_builtins();
        let v1 = reg.get("events.k8s.io", "v1", "events").unwrap();
        let core = json!({"apiVersion": "v1", "kind": "Event", "involvedObject": {"name": "x"}, "message": "m", "count": 2});
        let e = v1.to_version(core.clone());
        assert_eq!(e["regarding"]["name"], "x");
        assert_eq!(e["note"], "m");
        assert_eq!(e["deprecatedCount"], 2);
        assert_eq!(v1.to_storage(e), core);
    }

    #[test]
    fn discovery_lists_status_subresource() {
        let reg = Registry::with_builtins();
        let l = reg.resource_list("", "v1").unwrap();
        let names: Vec<_> = l["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap().to_owned())
            .collect();
        assert!(names.contains(&"pods/status".to_owned()));
        assert!(names.contains(&"configmaps".to_owned()));
        assert!(reg.api_group("events.k8s.io").is_some());
        assert!(reg.resource_list("nope", "v1").is_none());
    }
}
