//! HTTP routing: discovery, then `/api/v1/...` and `/apis/<group>/<version>/...` resource paths
//! parsed the way the apiserver's RequestInfoFactory does.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode, header};
use serde_json::{Value, json};

use super::Shared;
use super::faults::{RequestFacts, Verb};
use super::meta::UpdateTarget;
use super::openapi;
use super::ops::{DeleteOpts, Deleted, ListOpts, ListPage, WriteOpts, deleted_status, parse_rv};
use super::patch::PatchType;
use super::protobuf;
use super::resources::{Conversion, ResourceDef};
use super::selector::{FieldSelector, LabelSelector};
use super::status::ApiError;
use super::watch::{self, WatchParams};
use super::{conformance, render};

pub(crate) fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(shared)
}

fn json_response(code: StatusCode, v: &Value) -> Response {
    let mut r = (code, serde_json::to_vec(v).unwrap_or_default()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn ok(v: &Value) -> Response {
    json_response(StatusCode::OK, v)
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let watch = Query::parse(req.uri().query()).flag("watch") == Some(true)
        || path.split('/').any(|s| s == "watch");
    let r = route(Arc::clone(&shared), req).await;
    let resp = r.unwrap_or_else(IntoResponse::into_response);
    tracing::debug!(%method, %path, status = resp.status().as_u16(), "request");
    if shared.opts.check_responses {
        checked(shared, format!("{method} {path}"), watch, resp).await
    } else {
        resp
    }
}

/// The response, its JSON body checked against Kubernetes' schemas ([`conformance`]) on the way
/// out; what does not conform is recorded ([`Shared::nonconforming`]), not altered.
async fn checked(shared: Arc<Shared>, request: String, watch: bool, resp: Response) -> Response {
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !json {
        return resp;
    }
    if resp.extensions().get::<CheckedAsWritten>().is_some() {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    if watch {
        use futures::StreamExt;
        // One event per chunk, as the watch writes them.
        let stream = body.into_data_stream().map(move |chunk| {
            if let Ok(bytes) = &chunk {
                for line in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                    let problems = match serde_json::from_slice::<Value>(line) {
                        Ok(event) => conformance::check_event(&event),
                        Err(e) => vec![format!("watch event is not JSON: {e}")],
                    };
                    shared.nonconforming(&request, problems);
                }
            }
            chunk
        });
        return Response::from_parts(parts, axum::body::Body::from_stream(stream));
    }
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return Response::from_parts(parts, axum::body::Body::empty());
    };
    let problems = match serde_json::from_slice::<Value>(&bytes) {
        Ok(v) => conformance::check(&v),
        Err(e) => vec![format!("body is not JSON: {e}")],
    };
    shared.nonconforming(&request, problems);
    Response::from_parts(parts, axum::body::Body::from(bytes))
}

/// Marks a response whose body was checked against the schemas while it was written.
#[derive(Debug, Clone, Copy)]
struct CheckedAsWritten;

/// A list's response, written out an object at a time on a blocking thread as the client reads
/// it: a list of 100,000 objects (gigabytes of JSON) is never held whole, and decoding and
/// encoding it keeps no async worker from other requests (kube-apiserver serves each request on
/// its own goroutine).
fn list_response(
    shared: Arc<Shared>,
    def: Arc<ResourceDef>,
    page: ListPage,
    fmt: render::Format,
    request: String,
) -> Response {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(2);
    tokio::task::spawn_blocking(move || write_list(&shared, &def, page, fmt, &request, &tx));
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let mut r = Response::new(axum::body::Body::from_stream(stream));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r.extensions_mut().insert(CheckedAsWritten);
    r
}

/// Writes a list into `tx` in pieces of about a megabyte; stops when the client is gone.
fn write_list(
    shared: &Shared,
    def: &ResourceDef,
    page: ListPage,
    fmt: render::Format,
    request: &str,
    tx: &tokio::sync::mpsc::Sender<Result<bytes::Bytes, std::io::Error>>,
) {
    const PIECE: usize = 1 << 20;
    let check = shared.opts.check_responses;
    let send = |b: Vec<u8>| tx.blocking_send(Ok(b.into())).is_ok();
    let ListPage {
        items,
        rv,
        cont,
        remaining,
    } = page;
    if let render::Format::Table(_) = fmt {
        // Tables are what kubectl reads a page at a time: built whole.
        let items = items.iter().map(|o| def.to_version(o.decode())).collect();
        let v = render::list(def, items, rv, cont, remaining, fmt);
        if check {
            shared.nonconforming(request, conformance::check(&v));
        }
        send(serde_json::to_vec(&v).unwrap_or_default());
        return;
    }
    let list = render::list(def, Vec::new(), rv, cont, remaining, fmt);
    if check {
        shared.nonconforming(request, conformance::check(&list));
    }
    let envelope = serde_json::to_vec(&list).unwrap_or_default();
    // The objects go between the brackets of the envelope's empty `items`.
    const EMPTY: &[u8] = b"\"items\":[]";
    let Some(at) = envelope.windows(EMPTY.len()).position(|w| w == EMPTY) else {
        send(envelope);
        return;
    };
    let split = at + EMPTY.len() - 1;
    // Objects stored in the version served are written as stored (kube-apiserver's watch cache
    // keeps objects encoded for the same reason); others are decoded and converted.
    let verbatim = fmt == render::Format::Json
        && def.conversion == Conversion::None
        && def.storage_api_version == def.api_version();
    let typed = conformance::typed_list(&list);
    let mut buf = envelope[..split].to_vec();
    for (i, o) in items.iter().enumerate() {
        if i > 0 {
            buf.push(b',');
        }
        if verbatim {
            if check {
                let item = if typed { o.decode() } else { o.metadata() };
                shared.nonconforming(request, conformance::check_list_item(&list, &item, i));
            }
            buf.extend_from_slice(o.as_bytes());
        } else {
            let item = render::list_item(def.to_version(o.decode()), fmt);
            if check {
                shared.nonconforming(request, conformance::check_list_item(&list, &item, i));
            }
            if serde_json::to_writer(&mut buf, &item).is_err() {
                return;
            }
        }
        if buf.len() >= PIECE && !send(std::mem::replace(&mut buf, Vec::with_capacity(PIECE))) {
            return;
        }
    }
    buf.extend_from_slice(&envelope[split..]);
    send(buf);
}

struct Query(HashMap<String, String>);

impl Query {
    fn parse(q: Option<&str>) -> Self {
        Self(
            form_urlencoded::parse(q.unwrap_or_default().as_bytes())
                .into_owned()
                .collect(),
        )
    }
    fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }
    fn flag(&self, k: &str) -> Option<bool> {
        self.get(k).map(|v| v == "true" || v == "1")
    }
}

async fn route(shared: Arc<Shared>, req: Request) -> Result<Response, ApiError> {
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let path = if path.is_empty() {
        "/".to_owned()
    } else {
        path
    };
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let get = req.method() == Method::GET;
    match parts.as_slice() {
        ["version"] if get => {
            return Ok(ok(&json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-e2e", "gitCommit": "", "gitTreeState": "clean",
                "buildDate": "2025-01-01T00:00:00Z", "goVersion": "n/a", "compiler": "rustc", "platform": "linux/amd64",
            })));
        }
        ["healthz" | "livez" | "readyz"] if get => {
            return Ok((StatusCode::OK, "ok").into_response());
        }
        ["api"] if get => {
            return Ok(ok(&shared
                .registry()
                .api_versions(&shared.address.to_string())));
        }
        ["apis"] if get => return Ok(ok(&shared.registry().api_group_list())),
        ["api", "v1"] if get => {
            return shared
                .registry()
                .resource_list("", "v1")
                .map(|v| ok(&v))
                .ok_or_else(|| ApiError::no_route(&path));
        }
        ["apis", g] if get => {
            return shared
                .registry()
                .api_group(g)
                .map(|v| ok(&v))
                .ok_or_else(|| ApiError::no_route(&path));
        }
        ["apis", g, v] if get => {
            return shared
                .registry()
                .resource_list(g, v)
                .map(|v| ok(&v))
                .ok_or_else(|| ApiError::no_route(&path));
        }
        ["openapi", "v2"] if get => {
            let doc = openapi::v2_document(&shared.registry());
            let accept = req
                .headers()
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if accept.contains("com.github.proto-openapi.spec.v2") {
                let mut r = (StatusCode::OK, openapi::v2_protobuf(&doc)).into_response();
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    http::HeaderValue::from_static(openapi::V2_PROTOBUF),
                );
                return Ok(r);
            }
            return Ok(ok(&doc));
        }
        ["openapi", "v3"] if get => return Ok(ok(&openapi::v3_index(&shared.registry()))),
        ["openapi", "v3", "api", v] | ["openapi", "v3", "apis", _, v] if get => {
            let g = if parts[2] == "apis" { parts[3] } else { "" };
            return openapi::v3_document(&shared.registry(), g, v)
                .map(|d| ok(&d))
                .ok_or_else(|| ApiError::no_route(&path));
        }
        _ => {}
    }
    let (group, version, rest) = match parts.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(ApiError::no_route(&path)),
    };
    let mut rest: Vec<&str> = rest.to_vec();
    let mut watch_path = false;
    if rest.first() == Some(&"watch") {
        watch_path = true;
        rest.remove(0);
    }
    let mut namespace = None;
    if rest.first() == Some(&"namespaces") && rest.len() > 1 {
        namespace = Some(rest[1].to_owned());
        if rest.len() > 2 && !matches!(rest[2], "status" | "finalize") {
            rest.drain(0..2);
        }
    }
    let (plural, name, sub) = match rest.as_slice() {
        [r] => (*r, None, None),
        [r, n] => (*r, Some((*n).to_owned()), None),
        [r, n, s] => (*r, Some((*n).to_owned()), Some((*s).to_owned())),
        _ => return Err(ApiError::no_route(&path)),
    };
    if plural == "namespaces" {
        // `/api/v1/namespaces/<name>[/status]` names the namespace itself.
        namespace = None;
    }
    let def = shared
        .registry()
        .get(group, version, plural)
        .ok_or_else(|| ApiError::no_route(&path))?;
    if !def.namespaced && namespace.is_some() {
        return Err(ApiError::no_route(&path));
    }
    if let Some(s) = &sub
        && !(s == "status" && def.status_subresource)
    {
        return Err(ApiError::no_route(&path));
    }
    if def.namespaced && namespace.is_none() && name.is_some() {
        return Err(ApiError::no_route(&path));
    }
    let query = Query::parse(req.uri().query());
    let method = req.method().clone();
    let verb = match (&method, name.is_some()) {
        (&Method::GET, true) if watch_path || query.flag("watch") == Some(true) => Verb::Watch,
        (&Method::GET, true) => Verb::Get,
        (&Method::GET, false) if watch_path || query.flag("watch") == Some(true) => Verb::Watch,
        (&Method::GET, false) => Verb::List,
        (&Method::POST, false) => Verb::Create,
        (&Method::PUT, true) => Verb::Update,
        (&Method::PATCH, true) => Verb::Patch,
        (&Method::DELETE, true) => Verb::Delete,
        (&Method::DELETE, false) => Verb::DeleteCollection,
        _ => {
            return Err(ApiError::method_not_allowed(format!(
                "the server does not allow this method on the requested resource ({method} {path})"
            )));
        }
    };
    if verb == Verb::Create && def.namespaced && namespace.is_none() {
        return Err(ApiError::method_not_allowed(format!(
            "the server does not allow this method on the requested resource ({method} {path})"
        )));
    }
    let user = super::audit::user_of(
        req.headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    );
    let facts = RequestFacts {
        verb,
        resource: def.plural.clone(),
        subresource: sub.clone(),
        namespace: namespace.clone(),
        name: name.clone(),
        user: user.clone(),
    };
    let user = super::audit::user_of(
        req.headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    );
    let user_info = super::auth::UserInfo::from_token(&user);
    shared.requests.record(super::audit::Request {
        user,
        verb,
        group: group.to_owned(),
        resource: def.plural.clone(),
        subresource: sub.clone(),
        namespace: namespace.clone(),
        name: name.clone(),
    });
    let (delay, fault) = shared.faults.check(&facts);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if let Some(e) = fault {
        return Err(e);
    }
    if shared.rbac.load(std::sync::atomic::Ordering::SeqCst) {
        super::auth::authorize(
            &shared.lock(),
            &user_info,
            &super::auth::Attributes {
                verb: verb.as_str(),
                group,
                resource: &def.plural,
                subresource: sub.as_deref(),
                namespace: namespace.as_deref(),
                name: name.as_deref(),
            },
        )?;
    }
    let accept = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_owned();
    let fmt = render::negotiate(accept.as_deref(), query.get("includeObject"))?;
    let body = axum::body::to_bytes(req.into_body(), shared.opts.max_body_bytes)
        .await
        .map_err(|e| {
            ApiError::with_code(413, "RequestEntityTooLarge", format!("request body: {e}"))
        })?;
    let wopts = WriteOpts {
        dry_run: query.get("dryRun") == Some("All"),
        skip_admission: false,
        user: Some(user_info),
    };
    if let Some(d) = query.get("dryRun")
        && d != "All"
    {
        return Err(ApiError::bad_request(format!(
            "dryRun: Unsupported value: {d:?}: supported values: \"All\""
        )));
    }
    let ns = namespace.as_deref();
    let target = if sub.is_some() {
        UpdateTarget::Status
    } else {
        UpdateTarget::Main
    };
    match verb {
        Verb::Get => {
            if let Some(rv) = parse_rv(query.get("resourceVersion"))? {
                shared.wait_for_rv(rv).await?;
            }
            let obj = shared.get(&def, ns, name.as_deref().unwrap_or_default())?;
            Ok(ok(&render::item(&def, obj, fmt)))
        }
        Verb::List => {
            let lopts = list_opts(&query)?;
            // Not-older-than reads wait for a revision the server has not reached yet; exact
            // reads of the future fail at once (etcd has no such revision).
            if lopts.continue_token.is_none()
                && lopts.rv_match.as_deref() != Some("Exact")
                && let Some(rv) = parse_rv(lopts.resource_version.as_deref())?
            {
                shared.wait_for_rv(rv).await?;
            }
            let page = shared.list(&def, ns, &lopts).await?;
            Ok(list_response(
                Arc::clone(&shared),
                def,
                page,
                fmt,
                format!("{method} {path}"),
            ))
        }
        Verb::Watch => {
            let mut lopts = list_opts(&query)?;
            if let Some(n) = &name {
                // Watching one object is a watch with a name field selector.
                lopts.fields.terms.push(super::selector::FieldTerm {
                    field: "metadata.name".into(),
                    value: n.clone(),
                    negated: false,
                });
            }
            let timeout = query
                .get("timeoutSeconds")
                .map(|t| t.parse::<u64>().map(Duration::from_secs))
                .transpose()
                .map_err(|_| ApiError::bad_request("timeoutSeconds must be an integer"))?;
            let p = WatchParams {
                rv: query.get("resourceVersion").map(str::to_owned),
                rv_match: query.get("resourceVersionMatch").map(str::to_owned),
                send_initial_events: query.flag("sendInitialEvents"),
                bookmarks: query.flag("allowWatchBookmarks") == Some(true),
                timeout,
                labels: lopts.labels,
                fields: lopts.fields,
                format: fmt,
            };
            let body = watch::start(Arc::clone(&shared), def, namespace, p)?;
            let mut r = Response::new(body);
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            r.headers_mut().insert(
                header::CACHE_CONTROL,
                http::HeaderValue::from_static("no-cache, private"),
            );
            Ok(r)
        }
        Verb::Create => {
            let obj = parse_body(&body, &content_type)?;
            let created = shared.create(&def, ns, obj, &wopts).await?;
            Ok(json_response(
                StatusCode::CREATED,
                &render::item(&def, created, fmt),
            ))
        }
        Verb::Update => {
            let obj = parse_body(&body, &content_type)?;
            let n = name.as_deref().unwrap_or_default();
            let updated = shared.update(&def, ns, n, obj, target, &wopts).await?;
            Ok(ok(&render::item(&def, updated, fmt)))
        }
        Verb::Patch => {
            let ptype = PatchType::from_content_type(&content_type).ok_or_else(|| {
                ApiError::unsupported_media_type(format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json (got {content_type})"
                ))
            })?;
            let n = name.as_deref().unwrap_or_default();
            let patched = shared
                .patch(&def, ns, n, ptype, &body, target, &wopts)
                .await?;
            Ok(ok(&render::item(&def, patched, fmt)))
        }
        Verb::Delete => {
            let dopts = delete_opts(&query, &body, &content_type)?;
            let n = name.as_deref().unwrap_or_default();
            match shared.delete(&def, ns, n, &dopts, &wopts).await? {
                Deleted::Pending(obj) => {
                    let code = if dopts.orphan_dependents == Some(false) {
                        StatusCode::ACCEPTED
                    } else {
                        StatusCode::OK
                    };
                    Ok(json_response(code, &render::item(&def, obj, fmt)))
                }
                Deleted::Now(obj) if returns_deleted_object(&def) => {
                    Ok(ok(&render::item(&def, obj, fmt)))
                }
                Deleted::Now(obj) => Ok(ok(&deleted_status(&def, &obj))),
            }
        }
        Verb::DeleteCollection => {
            let lopts = list_opts(&query)?;
            let dopts = delete_opts(&query, &body, &content_type)?;
            shared
                .delete_collection(&def, ns, &lopts, &dopts, &wopts)
                .await?;
            Ok(ok(&super::status::success(None)))
        }
    }
}

/// Custom resources and pods answer a deletion with the object; other types with a Status.
fn returns_deleted_object(def: &ResourceDef) -> bool {
    def.custom || def.storage == "core/pods"
}

fn list_opts(q: &Query) -> Result<ListOpts, ApiError> {
    Ok(ListOpts {
        labels: LabelSelector::parse(q.get("labelSelector").unwrap_or_default())
            .map_err(|e| ApiError::bad_request(format!("unable to parse requirement: {e}")))?,
        fields: FieldSelector::parse(q.get("fieldSelector").unwrap_or_default())
            .map_err(ApiError::bad_request)?,
        limit: q
            .get("limit")
            .map(str::parse)
            .transpose()
            .map_err(|_| ApiError::bad_request("limit must be an integer"))?,
        continue_token: q
            .get("continue")
            .filter(|c| !c.is_empty())
            .map(str::to_owned),
        resource_version: q.get("resourceVersion").map(str::to_owned),
        rv_match: q
            .get("resourceVersionMatch")
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
    })
}

fn delete_opts(q: &Query, body: &[u8], content_type: &str) -> Result<DeleteOpts, ApiError> {
    let b: Value = if body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        parse_body(body, content_type).map_err(|e| ApiError {
            message: format!("DeleteOptions: {}", e.message),
            ..e
        })?
    };
    let s = |v: &Value| v.as_str().map(str::to_owned);
    Ok(DeleteOpts {
        propagation: s(&b["propagationPolicy"])
            .or_else(|| q.get("propagationPolicy").map(str::to_owned)),
        orphan_dependents: b["orphanDependents"]
            .as_bool()
            .or_else(|| q.flag("orphanDependents")),
        precondition_uid: s(&b["preconditions"]["uid"]),
        precondition_rv: s(&b["preconditions"]["resourceVersion"]),
    })
}

fn parse_body(body: &[u8], content_type: &str) -> Result<Value, ApiError> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    match media {
        "application/json" | "" | "*/*" => serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}"))),
        "application/yaml" => serde_norway::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid YAML body: {e}"))),
        protobuf::MEDIA_TYPE => protobuf::decode_object(body).map_err(|e| match e {
            protobuf::ProtoError::Malformed(_) => ApiError::bad_request(e.to_string()),
            protobuf::ProtoError::Unsupported(_) => ApiError::unsupported_media_type(e.to_string()),
        }),
        other => Err(ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml, application/vnd.kubernetes.protobuf (got {other})"
        ))),
    }
}
