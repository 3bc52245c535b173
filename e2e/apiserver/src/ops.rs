//! The verbs: get, list, create, update, patch, delete, with optimistic concurrency, admission
//! and the registry rules of [`super::meta`].

use std::sync::Arc;

use serde_json::{Value, json};

use super::auth::UserInfo;
use super::meta::{self, UpdateTarget};
use super::patch::{self, PatchError, PatchType};
use super::resources::{self, ResourceDef};
use super::selector::{FieldSelector, LabelSelector};
use super::status::{self, ApiError};
use super::store::{Encoded, ObjKey, StoreError};
use super::{Shared, admission, policy};

/// Options common to writes.
#[derive(Debug, Clone, Default)]
pub(crate) struct WriteOpts {
    /// `dryRun=All`: everything but persisting.
    pub dry_run: bool,
    /// Skip admission webhooks and policies (writes by the server's own controllers).
    pub skip_admission: bool,
    /// Who writes, for admission policies; `None` for the harness's own helpers.
    pub user: Option<UserInfo>,
}

impl WriteOpts {
    pub(crate) fn internal() -> Self {
        Self {
            dry_run: false,
            skip_admission: true,
            user: None,
        }
    }

    /// Runs the validating admission policies on one write, unless admission is skipped.
    fn validate(&self, shared: &Shared, attempt: PolicyAttempt<'_>) -> Result<(), ApiError> {
        if self.skip_admission {
            return Ok(());
        }
        let harness = UserInfo::harness();
        let (def, sub, ns, name, op, object, old) = attempt;
        policy::validate(
            shared,
            &policy::Attempt {
                def,
                sub,
                ns,
                name,
                op,
                object,
                old,
                user: self.user.as_ref().unwrap_or(&harness),
                dry_run: self.dry_run,
            },
        )
    }
}

/// `(def, subresource, namespace, name, operation, object, old object)`, objects in storage form.
type PolicyAttempt<'a> = (
    &'a Arc<ResourceDef>,
    Option<&'a str>,
    Option<&'a str>,
    &'a str,
    &'a str,
    Option<&'a Value>,
    Option<&'a Value>,
);

/// `DeleteOptions`.
#[derive(Debug, Clone, Default)]
pub(crate) struct DeleteOpts {
    pub propagation: Option<String>,
    pub orphan_dependents: Option<bool>,
    pub precondition_uid: Option<String>,
    pub precondition_rv: Option<String>,
}

/// Result of a delete.
pub(crate) enum Deleted {
    /// Removed now; the last state.
    Now(Value),
    /// Waiting for finalizers; the current state.
    Pending(Value),
}

/// A page of a list: the objects as stored, the list's resourceVersion, continue token and
/// remaining item count.
#[derive(Debug)]
pub(crate) struct ListPage {
    pub items: Vec<Encoded>,
    pub rv: u64,
    pub cont: Option<String>,
    pub remaining: Option<usize>,
}

/// kube-apiserver's messages for a continuation of a compacted revision (`etcd3/store.go`).
const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.";
const INCONSISTENT_CONTINUE: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.";

/// Selection and paging of a list.
#[derive(Debug, Clone, Default)]
pub(crate) struct ListOpts {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
    pub resource_version: Option<String>,
    pub rv_match: Option<String>,
}

fn key(ns: Option<&str>, name: &str) -> ObjKey {
    (ns.unwrap_or_default().to_owned(), name.to_owned())
}

/// A `resourceVersion` parameter: unset, empty and `0` mean "any" (`None`).
pub(crate) fn parse_rv(rv: Option<&str>) -> Result<Option<u64>, ApiError> {
    match rv {
        None | Some("") | Some("0") => Ok(None),
        Some(s) => s
            .parse()
            .map(Some)
            .map_err(|_| ApiError::bad_request(format!("invalid resource version {s:?}"))),
    }
}

/// Whether an object passes label and field selectors (in the stored form).
pub(crate) fn selected(
    def: &ResourceDef,
    obj: &Value,
    labels: &LabelSelector,
    fields: &FieldSelector,
) -> bool {
    labels.matches(obj["metadata"].get("labels"))
        && fields.matches(|f| def.field_value(obj, f).ok().flatten())
}

/// [`selected`] on a stored object, decoding no more of it than the selectors need: nothing
/// without selectors, the metadata for label selectors alone.
pub(crate) fn selected_encoded(
    def: &ResourceDef,
    obj: &Encoded,
    labels: &LabelSelector,
    fields: &FieldSelector,
) -> bool {
    if fields.terms.is_empty() {
        labels.is_empty() || labels.matches(obj.metadata()["metadata"].get("labels"))
    } else {
        selected(def, &obj.decode(), labels, fields)
    }
}

/// Checks a field selector against the fields the resource supports.
pub(crate) fn check_fields(def: &ResourceDef, fields: &FieldSelector) -> Result<(), ApiError> {
    for t in &fields.terms {
        if def.field_value(&json!({}), &t.field).is_err() {
            return Err(ApiError::bad_request(format!(
                "field label not supported: {}",
                t.field
            )));
        }
    }
    Ok(())
}

/// kube-apiserver's continue token (`k8s.io/apiserver/pkg/storage`): the list's revision and the
/// key to resume after, relative to the list's key prefix (`name` in one namespace,
/// `namespace/name` across namespaces), with `\0` appended so the range starts just after it,
/// as unpadded URL-safe base64 of JSON. A revision of -1 continues at the latest one (the token
/// an expired continuation offers).
#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    v: String,
    rv: i64,
    start: String,
}

/// The key prefix a list ranges over: `true` when keys are relative to one namespace (or the
/// resource is cluster-scoped), `false` for `namespace/name`.
fn relative_to_namespace(def: &ResourceDef, ns: Option<&str>) -> bool {
    !def.namespaced || ns.is_some()
}

fn encode_continue(def: &ResourceDef, ns: Option<&str>, rv: i64, last: &ObjKey) -> String {
    use base64::Engine;
    let start = if relative_to_namespace(def, ns) {
        format!("{}\u{0}", last.1)
    } else {
        format!("{}/{}\u{0}", last.0, last.1)
    };
    let t = ContinueToken {
        v: "meta.k8s.io/v1".into(),
        rv,
        start,
    };
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(&t).unwrap_or_default())
}

/// A token's revision (`None`: the latest) and the key to resume after; refused as
/// kube-apiserver refuses it (`storage.DecodeContinue`, answered with 400 "invalid continue
/// token").
fn decode_continue(
    def: &ResourceDef,
    ns: Option<&str>,
    s: &str,
) -> Result<(Option<u64>, ObjKey), ApiError> {
    use base64::Engine;
    let invalid = |why: String| ApiError::bad_request(format!("invalid continue token: {why}"));
    let generic = "continue key is not valid";
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s.trim_end_matches('='))
        .map_err(|e| invalid(format!("{generic}: {e}")))?;
    let t: ContinueToken =
        serde_json::from_slice(&raw).map_err(|e| invalid(format!("{generic}: {e}")))?;
    if t.v != "meta.k8s.io/v1" {
        return Err(invalid(format!(
            "{generic}: server does not recognize this encoded version {}",
            t.v
        )));
    }
    if t.rv == 0 {
        return Err(invalid(format!(
            "{generic}: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
        )));
    }
    if t.start.is_empty() {
        return Err(invalid(format!(
            "{generic}: encoded start key empty (version meta.k8s.io/v1)"
        )));
    }
    // As `path.Clean` leaves it, so a token cannot range outside the list's prefix.
    let key = t.start.strip_prefix('/').unwrap_or(&t.start);
    if key
        .split('/')
        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(invalid(format!("{generic}: {}", t.start)));
    }
    // Tokens end in `\0` (resume after the key); one without it resumes after the key too, a
    // difference only a hand-made token could see.
    let key = key.strip_suffix('\u{0}').unwrap_or(key);
    let key = if relative_to_namespace(def, ns) {
        (
            ns.filter(|_| def.namespaced).unwrap_or_default().to_owned(),
            key.to_owned(),
        )
    } else {
        let (n, name) = key
            .split_once('/')
            .ok_or_else(|| invalid(format!("{generic}: {}", t.start)))?;
        (n.to_owned(), name.to_owned())
    };
    let rv = match t.rv {
        -1 => None,
        rv => Some(u64::try_from(rv).map_err(|_| {
            invalid(format!(
                "{generic}: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
            ))
        })?),
    };
    Ok((rv, key))
}

/// How many objects a list reads from the store per lock: writers wait at most for one chunk.
const LIST_CHUNK: usize = 500;

impl Shared {
    fn namespace_check(
        &self,
        def: &ResourceDef,
        ns: Option<&str>,
        name: &str,
    ) -> Result<(), ApiError> {
        let Some(ns) = ns.filter(|_| def.namespaced) else {
            return Ok(());
        };
        let store = self.lock();
        match store.get("core/namespaces", &key(None, ns)) {
            None => Err(ApiError {
                details: Some(json!({"name": ns, "kind": "namespaces"})),
                ..ApiError::with_code(404, "NotFound", format!("namespaces {ns:?} not found"))
            }),
            Some(n) if meta::is_deleting(&n) => Err(ApiError::forbidden(format!(
                "{} {:?} is forbidden: unable to create new content in namespace {ns} because it is being terminated",
                def.qualified(),
                name
            ))),
            Some(_) => Ok(()),
        }
    }

    /// Reads one object in `def`'s version.
    pub(crate) fn get(
        &self,
        def: &ResourceDef,
        ns: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let obj = self
            .lock()
            .get_encoded(&def.storage, &key(ns, name))
            .ok_or_else(|| ApiError::not_found(def, name))?;
        Ok(def.to_version(obj.decode()))
    }

    /// Lists objects as stored (decoded, converted and written out by the caller, without the
    /// store). The store is read a chunk at a time ([`Cursor`]): a list of 100,000 objects holds
    /// the lock no longer than a write does, and every page reads the revision of the first.
    pub(crate) async fn list(
        &self,
        def: &ResourceDef,
        ns: Option<&str>,
        opts: &ListOpts,
    ) -> Result<ListPage, ApiError> {
        check_fields(def, &opts.fields)?;
        let token = opts
            .continue_token
            .as_deref()
            .map(|t| decode_continue(def, ns, t))
            .transpose()?;
        let resumed = token.as_ref().map(|(_, k)| k.clone());
        let mut cursor = {
            let store = self.lock();
            let current = store.current_rv();
            let (at, after) = match token {
                Some((rv, start)) => (rv.unwrap_or(current), Some(start)),
                None => {
                    let requested = parse_rv(opts.resource_version.as_deref())?;
                    match (requested, opts.rv_match.as_deref()) {
                        (Some(rv), Some("Exact")) => (rv, None),
                        // Callers wait for the revision first (`Shared::wait_for_rv`).
                        (Some(rv), _) if rv > current => {
                            return Err(ApiError::too_large_resource_version(rv, current));
                        }
                        (None, Some("Exact")) => {
                            return Err(ApiError::bad_request(
                                "resourceVersionMatch \"Exact\" requires a resourceVersion",
                            ));
                        }
                        _ => (current, None),
                    }
                }
            };
            store
                .cursor(&def.storage, ns, at, after.as_ref())
                .map_err(|e| self.list_error(def, ns, opts, after.as_ref(), e))?
        };
        let unfiltered = opts.labels.is_empty() && opts.fields.terms.is_empty();
        let limit = opts.limit.filter(|l| *l > 0);
        // Without selectors a page needs one object more than it holds, to know there are more.
        let chunk = match limit {
            Some(l) if unfiltered => (l + 1).min(LIST_CHUNK),
            _ => LIST_CHUNK,
        };
        let mut page = Vec::new();
        let mut last: Option<ObjKey> = None;
        let mut more = None;
        'read: loop {
            let objs = {
                let store = self.lock();
                cursor.next_chunk(&store, chunk)
            }
            .map_err(|e| self.list_error(def, ns, opts, last.as_ref().or(resumed.as_ref()), e))?;
            if objs.is_empty() {
                break;
            }
            let n = objs.len();
            for (i, (k, o)) in objs.into_iter().enumerate() {
                if !selected_encoded(def, &o, &opts.labels, &opts.fields) {
                    continue;
                }
                if limit.is_some_and(|l| page.len() >= l) {
                    // One more exists: the page is full. Only an unselective list counts the rest
                    // (`remainingItemCount`), as kube-apiserver does.
                    more = Some((unfiltered, n - i));
                    break 'read;
                }
                last = Some(k);
                page.push(o);
            }
            // Other requests get the worker between chunks.
            tokio::task::yield_now().await;
        }
        let rv = cursor.rv();
        let Some((count, in_chunk)) = more else {
            return Ok(ListPage {
                items: page,
                rv,
                cont: None,
                remaining: None,
            });
        };
        let remaining = if count {
            let rest = cursor
                .count_rest(&self.lock())
                .map_err(|e| self.list_error(def, ns, opts, last.as_ref(), e))?;
            Some(in_chunk + rest)
        } else {
            None
        };
        let last = last.unwrap_or_default();
        Ok(ListPage {
            items: page,
            rv,
            cont: Some(encode_continue(def, ns, rv as i64, &last)),
            remaining,
        })
    }

    /// What a failed read of a list answers: a continuation whose revision was compacted gets
    /// 410 with a token to go on at the latest revision, as kube-apiserver answers it.
    fn list_error(
        &self,
        def: &ResourceDef,
        ns: Option<&str>,
        opts: &ListOpts,
        last: Option<&ObjKey>,
        e: StoreError,
    ) -> ApiError {
        match e {
            StoreError::Gone { .. } if opts.continue_token.is_some() => match last {
                Some(last) => ApiError {
                    list_continue: Some(encode_continue(def, ns, -1, last).into()),
                    ..ApiError::expired(INCONSISTENT_CONTINUE)
                },
                None => ApiError::expired(CONTINUE_EXPIRED),
            },
            StoreError::Future { requested, current } => {
                ApiError::too_large_resource_version(requested, current)
            }
            StoreError::Gone { requested, oldest } => {
                ApiError::expired(format!("too old resource version: {requested} ({oldest})"))
            }
            _ => ApiError::internal("snapshot failed"),
        }
    }

    pub(crate) fn commit_create(
        &self,
        def: &ResourceDef,
        k: ObjKey,
        stored: Value,
    ) -> Result<Value, ApiError> {
        let name = k.1.clone();
        let mut store = self.lock();
        let obj = store
            .create(&def.storage, k, stored)
            .map_err(|_| ApiError::already_exists(def, &name))?;
        let rv = store.current_rv();
        drop(store);
        self.after_write(def, Some(&obj));
        self.notify(rv);
        Ok(def.to_version((*obj).clone()))
    }

    /// Creates an object (`obj` in `def`'s version) in `ns`.
    pub(crate) async fn create(
        self: &Arc<Self>,
        def: &Arc<ResourceDef>,
        ns: Option<&str>,
        mut obj: Value,
        opts: &WriteOpts,
    ) -> Result<Value, ApiError> {
        check_type(def, &obj)?;
        if def.namespaced {
            let ns =
                ns.ok_or_else(|| ApiError::method_not_allowed("create requires a namespace"))?;
            match obj["metadata"]["namespace"].as_str() {
                Some(n) if !n.is_empty() && n != ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => {
                    meta::meta_mut(&mut obj).insert("namespace".into(), json!(ns));
                }
            }
        } else {
            meta::meta_mut(&mut obj).remove("namespace");
        }
        if obj["metadata"]["resourceVersion"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
        {
            return Err(ApiError::internal(
                "resourceVersion should not be set on objects to be created",
            ));
        }
        let requested_name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        self.namespace_check(def, ns, &requested_name)?;
        if !opts.skip_admission {
            obj = admission::admit(self, def, ns, "CREATE", obj, None, opts.dry_run).await?;
        }
        // Name generation and system fields come after admission, as in the apiserver.
        if obj["metadata"]["name"].as_str().is_none_or(str::is_empty)
            && let Some(prefix) = obj["metadata"]["generateName"]
                .as_str()
                .filter(|p| !p.is_empty())
        {
            let n = meta::generate_name(prefix);
            meta::meta_mut(&mut obj).insert("name".into(), json!(n));
        }
        let mut stored = def.to_storage(obj);
        meta::prepare_create(def, &mut stored, time::OffsetDateTime::now_utc());
        let name = stored["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let errs = meta::validate(def, &stored, None);
        if !errs.is_empty() {
            return Err(ApiError::invalid(def, &name, &errs));
        }
        // Validating admission sees the object as it will be stored (creationTimestamp, uid).
        opts.validate(self, (def, None, ns, &name, "CREATE", Some(&stored), None))?;
        if def.storage == "apiextensions.k8s.io/customresourcedefinitions" {
            let group = stored["spec"]["group"].as_str().unwrap_or_default();
            if self.registry().is_builtin_group(group) {
                return Err(ApiError::invalid(
                    def,
                    &name,
                    &[(
                        "spec.group".into(),
                        format!("Invalid value: {group:?}: is a built-in API group"),
                    )],
                ));
            }
        }
        if opts.dry_run {
            if self.lock().contains(&def.storage, &key(ns, &name)) {
                return Err(ApiError::already_exists(def, &name));
            }
            return Ok(def.to_version(stored));
        }
        self.commit_create(def, key(ns, &name), stored)
    }

    /// Replaces an object (`PUT`), `obj` in `def`'s version.
    pub(crate) async fn update(
        self: &Arc<Self>,
        def: &Arc<ResourceDef>,
        ns: Option<&str>,
        name: &str,
        obj: Value,
        target: UpdateTarget,
        opts: &WriteOpts,
    ) -> Result<Value, ApiError> {
        check_type(def, &obj)?;
        if obj["metadata"]["name"].as_str().is_some_and(|n| n != name) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                obj["metadata"]["name"].as_str().unwrap_or_default()
            )));
        }
        if let Some(n) = obj["metadata"]["namespace"].as_str()
            && def.namespaced
            && !n.is_empty()
            && Some(n) != ns
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let requested_rv = obj["metadata"]["resourceVersion"]
            .as_str()
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
        if requested_rv.is_none() && def.custom {
            return Err(ApiError::invalid(
                def,
                name,
                &[(
                    "metadata.resourceVersion".into(),
                    "Invalid value: 0x0: must be specified for an update".into(),
                )],
            ));
        }
        let body = obj;
        self.write_existing(def, ns, name, target, opts, move |_old| Ok(body.clone()))
            .await
    }

    /// Patches an object.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn patch(
        self: &Arc<Self>,
        def: &Arc<ResourceDef>,
        ns: Option<&str>,
        name: &str,
        ptype: PatchType,
        body: &[u8],
        target: UpdateTarget,
        opts: &WriteOpts,
    ) -> Result<Value, ApiError> {
        match ptype {
            PatchType::Apply => {
                return Err(ApiError::unsupported_media_type(
                    "server-side apply (application/apply-patch+yaml) is not supported by this test API server",
                ));
            }
            PatchType::Strategic if def.custom => {
                return Err(ApiError::unsupported_media_type(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
                ));
            }
            _ => {}
        }
        let body = body.to_vec();
        self.write_existing(def, ns, name, target, opts, move |old| {
            let mut doc = old.clone();
            let r = match ptype {
                PatchType::Merge => patch::apply_merge_patch(&mut doc, &body),
                PatchType::Json => patch::apply_json_patch(&mut doc, &body),
                PatchType::Strategic => patch::apply_strategic_merge_patch(&mut doc, &body),
                PatchType::Apply => unreachable!("refused above"),
            };
            match r {
                Ok(()) => Ok(doc),
                Err(PatchError::BadRequest(m)) => Err(ApiError::bad_request(m)),
                Err(PatchError::Unprocessable(m)) => Err(ApiError::unprocessable(m)),
            }
        })
        .await
    }

    /// Read-modify-write with optimistic concurrency. `compute` turns the current object (in
    /// `def`'s version) into the requested one; a `resourceVersion` in the result is a
    /// precondition. Without one, a concurrent write makes the server retry, as the apiserver does.
    async fn write_existing(
        self: &Arc<Self>,
        def: &Arc<ResourceDef>,
        ns: Option<&str>,
        name: &str,
        target: UpdateTarget,
        opts: &WriteOpts,
        compute: impl Fn(&Value) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        let k = key(ns, name);
        for _attempt in 0..20 {
            let old = self
                .lock()
                .get_encoded(&def.storage, &k)
                .ok_or_else(|| ApiError::not_found(def, name))?;
            let old_rv = old.rv();
            let old = Arc::new(old.decode());
            let old_view = def.to_version((*old).clone());
            let mut new_view = compute(&old_view)?;
            check_type(def, &new_view)?;
            let precondition = match new_view["metadata"]["resourceVersion"].as_str() {
                Some(s) if !s.is_empty() => Some(s.parse::<u64>().map_err(|_| {
                    ApiError::bad_request(format!("invalid resourceVersion {s:?}"))
                })?),
                _ => None,
            };
            if precondition.is_some_and(|p| p != old_rv) {
                return Err(ApiError::conflict(def, name));
            }
            if !opts.skip_admission {
                let sub = (target == UpdateTarget::Status).then_some("status");
                new_view = admission::admit_sub(
                    self,
                    def,
                    sub,
                    ns,
                    "UPDATE",
                    new_view,
                    Some(&old_view),
                    opts.dry_run,
                )
                .await?;
            }
            let requested = def.to_storage(new_view);
            let prepared = meta::prepare_update(def, &old, &requested, target);
            let errs = meta::validate(def, &prepared, Some(&old));
            if !errs.is_empty() {
                return Err(ApiError::invalid(def, name, &errs));
            }
            let sub = (target == UpdateTarget::Status).then_some("status");
            opts.validate(
                self,
                (def, sub, ns, name, "UPDATE", Some(&prepared), Some(&old)),
            )?;
            if opts.dry_run {
                return Ok(def.to_version(prepared));
            }
            let finished = meta::is_deleting(&prepared)
                && meta::finalizers(&prepared).is_empty()
                && !namespace_still_finalizing(def, &prepared);
            let mut store = self.lock();
            let r = if finished {
                store.delete(&def.storage, &k, Some(prepared), Some(old_rv))
            } else {
                store.update(&def.storage, &k, prepared, Some(old_rv))
            };
            match r {
                Ok(obj) => {
                    let rv = store.current_rv();
                    drop(store);
                    self.after_write(def, (!finished).then_some(&obj));
                    if finished && def.storage == "apiextensions.k8s.io/customresourcedefinitions" {
                        self.unregister_crd(&obj);
                    }
                    self.notify(rv);
                    return Ok(def.to_version((*obj).clone()));
                }
                // Re-run `compute` on the new state: an explicit resourceVersion then fails the
                // precondition above; otherwise the write is retried, as the apiserver does.
                Err(StoreError::Conflict) => continue,
                Err(StoreError::NotFound) => return Err(ApiError::not_found(def, name)),
                Err(e) => return Err(ApiError::internal(format!("{e:?}"))),
            }
        }
        Err(ApiError::conflict_msg(
            def,
            name,
            "too many concurrent writes",
        ))
    }

    /// Deletes an object (graceful: finalizers keep it until they are removed).
    pub(crate) async fn delete(
        self: &Arc<Self>,
        def: &Arc<ResourceDef>,
        ns: Option<&str>,
        name: &str,
        dopts: &DeleteOpts,
        opts: &WriteOpts,
    ) -> Result<Deleted, ApiError> {
        let k = key(ns, name);
        let policy = match (dopts.propagation.as_deref(), dopts.orphan_dependents) {
            (Some(p @ ("Orphan" | "Background" | "Foreground")), _) => p.to_owned(),
            (Some(p), _) => {
                return Err(ApiError::invalid(
                    def,
                    name,
                    &[(
                        "propagationPolicy".into(),
                        format!(
                            "Unsupported value: {p:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
                        ),
                    )],
                ));
            }
            (None, Some(true)) => "Orphan".into(),
            (None, _) => "Background".into(),
        };
        for _attempt in 0..20 {
            let old = self
                .lock()
                .get_encoded(&def.storage, &k)
                .ok_or_else(|| ApiError::not_found(def, name))?;
            let old_rv = old.rv();
            let old = Arc::new(old.decode());
            if let Some(uid) = &dopts.precondition_uid
                && old["metadata"]["uid"].as_str() != Some(uid)
            {
                return Err(ApiError::conflict_msg(
                    def,
                    name,
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                        old["metadata"]["uid"].as_str().unwrap_or_default()
                    ),
                ));
            }
            if let Some(rv) = &dopts.precondition_rv
                && old["metadata"]["resourceVersion"].as_str() != Some(rv)
            {
                return Err(ApiError::conflict_msg(
                    def,
                    name,
                    &format!(
                        "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {old_rv}"
                    ),
                ));
            }
            if meta::is_deleting(&old) {
                return Ok(Deleted::Pending(def.to_version((*old).clone())));
            }
            opts.validate(self, (def, None, ns, name, "DELETE", None, Some(&old)))?;
            let mut fins = meta::finalizers(&old);
            let extra = match policy.as_str() {
                "Orphan" => Some(meta::ORPHAN_FINALIZER),
                "Foreground" => Some(meta::FOREGROUND_FINALIZER),
                _ => None,
            };
            if let Some(f) = extra
                && !fins.iter().any(|x| x == f)
            {
                fins.push(f.to_owned());
            }
            let is_ns = def.storage == "core/namespaces";
            let mut store = self.lock();
            if fins.is_empty() && !is_ns {
                if opts.dry_run {
                    return Ok(Deleted::Now(def.to_version((*old).clone())));
                }
                match store.delete(&def.storage, &k, None, Some(old_rv)) {
                    Ok(obj) => {
                        let rv = store.current_rv();
                        drop(store);
                        self.after_write(def, None);
                        if def.storage == "apiextensions.k8s.io/customresourcedefinitions" {
                            self.unregister_crd(&obj);
                        }
                        self.notify(rv);
                        return Ok(Deleted::Now(def.to_version((*obj).clone())));
                    }
                    Err(StoreError::Conflict) => continue,
                    Err(_) => return Err(ApiError::not_found(def, name)),
                }
            }
            let mut new = (*old).clone();
            let now = time::OffsetDateTime::now_utc();
            {
                let m = meta::meta_mut(&mut new);
                m.insert("deletionTimestamp".into(), json!(meta::timestamp(now)));
                m.insert("deletionGracePeriodSeconds".into(), json!(0));
                if def.generation {
                    let g = m.get("generation").and_then(Value::as_i64).unwrap_or(0) + 1;
                    m.insert("generation".into(), json!(g));
                }
            }
            meta::set_finalizers(&mut new, &fins);
            if is_ns {
                new["status"]["phase"] = json!("Terminating");
            }
            if def.storage == "apiextensions.k8s.io/customresourcedefinitions" {
                crd_terminating(&mut new, now);
            }
            if opts.dry_run {
                return Ok(Deleted::Pending(def.to_version(new)));
            }
            match store.update(&def.storage, &k, new, Some(old_rv)) {
                Ok(obj) => {
                    let rv = store.current_rv();
                    drop(store);
                    self.notify(rv);
                    return Ok(Deleted::Pending(def.to_version((*obj).clone())));
                }
                Err(StoreError::Conflict) => continue,
                Err(_) => return Err(ApiError::not_found(def, name)),
            }
        }
        Err(ApiError::conflict_msg(
            def,
            name,
            "too many concurrent writes",
        ))
    }

    /// Keeps the registry in step with stored CRDs.
    fn after_write(&self, def: &ResourceDef, obj: Option<&Arc<Value>>) {
        if def.storage != "apiextensions.k8s.io/customresourcedefinitions" {
            return;
        }
        if let Some(crd) = obj
            && let Ok(defs) = resources::from_crd(crd)
            && let Some(first) = defs.first()
        {
            let storage = first.storage.clone();
            self.registry
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .set_custom(&storage, defs);
        }
    }

    fn unregister_crd(&self, crd: &Value) {
        let group = crd["spec"]["group"].as_str().unwrap_or_default();
        let plural = crd["spec"]["names"]["plural"].as_str().unwrap_or_default();
        self.registry
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .set_custom(&format!("{group}/{plural}"), Vec::new());
    }

    /// Internal read-modify-write of the main resource (no admission), for the built-in
    /// controllers.
    pub(crate) async fn update_with(
        self: &Arc<Self>,
        def: &Arc<ResourceDef>,
        ns: Option<&str>,
        name: &str,
        compute: impl Fn(&Value) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        self.write_existing(
            def,
            ns,
            name,
            UpdateTarget::Main,
            &WriteOpts::internal(),
            compute,
        )
        .await
    }

    /// Deletes every object of a list selection; returns how many were deleted.
    pub(crate) async fn delete_collection(
        self: &Arc<Self>,
        def: &Arc<ResourceDef>,
        ns: Option<&str>,
        lopts: &ListOpts,
        dopts: &DeleteOpts,
        opts: &WriteOpts,
    ) -> Result<usize, ApiError> {
        let page = self
            .list(
                def,
                ns,
                &ListOpts {
                    limit: None,
                    continue_token: None,
                    ..lopts.clone()
                },
            )
            .await?;
        let mut n = 0;
        for item in page.items.iter().map(Encoded::metadata) {
            let name = item["metadata"]["name"].as_str().unwrap_or_default();
            let ns = item["metadata"]["namespace"].as_str();
            match self.delete(def, ns, name, dopts, opts).await {
                Ok(_) => n += 1,
                Err(e) if e.code == 404 => {}
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }
}

/// A terminating namespace stays until its `spec.finalizers` are gone too.
fn namespace_still_finalizing(def: &ResourceDef, obj: &Value) -> bool {
    def.storage == "core/namespaces"
        && obj["spec"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty())
}

fn crd_terminating(crd: &mut Value, now: time::OffsetDateTime) {
    let cond = json!({"type": "Terminating", "status": "True", "reason": "InstanceDeletionPending",
        "message": "CustomResourceDefinition marked for deletion; CustomResource deletion will begin soon",
        "lastTransitionTime": meta::timestamp(now)});
    if let Some(conds) = crd["status"]["conditions"].as_array_mut() {
        conds.retain(|c| c["type"] != "Terminating");
        conds.push(cond);
    }
}

/// The object's `apiVersion` and `kind`, when given, must be those of the endpoint.
fn check_type(def: &ResourceDef, obj: &Value) -> Result<(), ApiError> {
    if !obj.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    if let Some(av) = obj["apiVersion"].as_str()
        && av != def.api_version()
    {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({av}) does not match the expected API version ({})",
            def.api_version()
        )));
    }
    if let Some(k) = obj["kind"].as_str()
        && k != def.kind
    {
        return Err(ApiError::bad_request(format!(
            "the kind in the data ({k}) does not match the expected kind ({})",
            def.kind
        )));
    }
    Ok(())
}

/// The `Status` of an immediate deletion.
pub(crate) fn deleted_status(def: &ResourceDef, obj: &Value) -> Value {
    let mut d =
        json!({"name": obj["metadata"]["name"], "kind": def.plural, "uid": obj["metadata"]["uid"]});
    if !def.group.is_empty() {
        d["group"] = json!(def.group);
    }
    status::success(Some(d))
}
