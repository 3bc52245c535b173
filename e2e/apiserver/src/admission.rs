//! Mutating admission: calls the webhooks of stored MutatingWebhookConfigurations over HTTPS with
//! an AdmissionReview v1, as the apiserver does (rules, matchPolicy, namespace and object
//! selectors, matchConditions, timeouts, failurePolicy, JSONPatch responses, reinvocation).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use super::auth::{self, UserInfo};
use super::resources::ResourceDef;
use super::rules::matched_def;
use super::selector::LabelSelector;
use super::status::ApiError;
use super::{Shared, cel, meta, policy};

/// One webhook of a configuration, in call order.
struct Hook {
    name: String,
    spec: Value,
}

fn hooks(shared: &Shared) -> Vec<Hook> {
    let configs = shared.lock().list(
        "admissionregistration.k8s.io/mutatingwebhookconfigurations",
        None,
    );
    let mut out = Vec::new();
    // Configurations are called in name order, their webhooks in list order.
    for (_, cfg) in configs {
        for w in cfg["webhooks"].as_array().into_iter().flatten() {
            out.push(Hook {
                name: w["name"].as_str().unwrap_or_default().to_owned(),
                spec: w.clone(),
            });
        }
    }
    out
}

struct Request<'a> {
    def: &'a Arc<ResourceDef>,
    sub: Option<&'a str>,
    ns: Option<&'a str>,
    op: &'a str,
    old: Option<&'a Value>,
    dry_run: bool,
}

/// Runs every matching mutating webhook on `obj` (in `def`'s version); returns the mutated object.
pub(crate) async fn admit(
    shared: &Arc<Shared>,
    def: &Arc<ResourceDef>,
    ns: Option<&str>,
    op: &str,
    obj: Value,
    old: Option<&Value>,
    dry_run: bool,
) -> Result<Value, ApiError> {
    admit_sub(shared, def, None, ns, op, obj, old, dry_run).await
}

/// [`admit`] for a subresource write (`status`).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn admit_sub(
    shared: &Arc<Shared>,
    def: &Arc<ResourceDef>,
    sub: Option<&str>,
    ns: Option<&str>,
    op: &str,
    mut obj: Value,
    old: Option<&Value>,
    dry_run: bool,
) -> Result<Value, ApiError> {
    let hooks = hooks(shared);
    if hooks.is_empty() {
        return Ok(obj);
    }
    let req = Request {
        def,
        sub,
        ns,
        op,
        old,
        dry_run,
    };
    let ns_labels = ns.and_then(|n| {
        shared
            .lock()
            .get("core/namespaces", &(String::new(), n.to_owned()))
            .map(|o| o["metadata"]["labels"].clone())
    });
    // (hook index, object right after its call) for IfNeeded hooks.
    let mut after_call: Vec<(usize, Value)> = Vec::new();
    for (i, hook) in hooks.iter().enumerate() {
        if let Some(new) = call_if_matching(shared, hook, &req, &obj, ns_labels.as_ref()).await? {
            obj = new;
            if hook.spec["reinvocationPolicy"].as_str() == Some("IfNeeded") {
                after_call.push((i, obj.clone()));
            }
        }
    }
    // One reinvocation of IfNeeded webhooks whose output a later webhook changed.
    for (i, seen) in after_call {
        if seen != obj
            && let Some(new) =
                call_if_matching(shared, &hooks[i], &req, &obj, ns_labels.as_ref()).await?
        {
            obj = new;
        }
    }
    Ok(obj)
}

/// Calls `hook` if it matches; `Ok(None)` when it does not apply or failed open.
async fn call_if_matching(
    shared: &Arc<Shared>,
    hook: &Hook,
    req: &Request<'_>,
    obj: &Value,
    ns_labels: Option<&Value>,
) -> Result<Option<Value>, ApiError> {
    let spec = &hook.spec;
    let Some(target) = matched_def(shared, spec, req.def, req.sub, req.op) else {
        return Ok(None);
    };
    let fail_open = spec["failurePolicy"].as_str() == Some("Ignore");
    let failed = |msg: String| -> Result<Option<Value>, ApiError> {
        if fail_open {
            tracing::warn!(webhook = %hook.name, error = %msg, "webhook failed; failurePolicy Ignore");
            Ok(None)
        } else {
            Err(ApiError::internal(format!(
                "failed calling webhook {:?}: {msg}",
                hook.name
            )))
        }
    };
    // namespaceSelector: the namespace's labels (a Namespace object is matched by its own).
    let ns_sel = LabelSelector::from_object(spec.get("namespaceSelector"))
        .map_err(|e| ApiError::internal(e.clone()))?;
    let ns_ok = if req.def.storage == "core/namespaces" {
        ns_sel.matches(obj["metadata"].get("labels"))
    } else if req.def.namespaced {
        ns_sel.matches(ns_labels)
    } else {
        true
    };
    if !ns_ok {
        return Ok(None);
    }
    let obj_sel = LabelSelector::from_object(spec.get("objectSelector"))
        .map_err(|e| ApiError::internal(e.clone()))?;
    let obj_ok = obj_sel.matches(obj["metadata"].get("labels"))
        || req
            .old
            .is_some_and(|o| obj_sel.matches(o["metadata"].get("labels")));
    if !obj_ok {
        return Ok(None);
    }
    if req.dry_run
        && spec["sideEffects"].as_str() != Some("None")
        && spec["sideEffects"].as_str() != Some("NoneOnDryRun")
    {
        return Err(ApiError::bad_request(format!(
            "admission webhook {:?} has sideEffects other than None or NoneOnDryRun and cannot be called for a dry run",
            hook.name
        )));
    }
    // The object as the matched version sees it.
    let convert = |o: &Value| target.to_version(req.def.to_storage(o.clone()));
    let object = convert(obj);
    let old_object = req.old.map(convert);
    // The identity the review below reports (the harness does not pass the caller's here).
    let user = UserInfo {
        username: "e2e".to_owned(),
        groups: vec![auth::MASTERS.to_owned(), "system:authenticated".to_owned()],
    };
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let attempt = policy::Attempt {
        def: req.def,
        sub: req.sub,
        ns: req.ns,
        name,
        op: req.op,
        object: Some(&object),
        old: old_object.as_ref(),
        user: &user,
        dry_run: req.dry_run,
    };
    let vars = cel::Bindings::default()
        .json("object", &object)
        .json("oldObject", old_object.as_ref().unwrap_or(&Value::Null))
        .json(
            "request",
            &policy::admission_request(&target, req.def, &attempt),
        );
    // kube-apiserver's matcher: any condition false skips the webhook, whatever errors the
    // others had; otherwise an error is judged by failurePolicy.
    let mut errors = Vec::new();
    for mc in spec["matchConditions"].as_array().into_iter().flatten() {
        let expr = mc["expression"].as_str().unwrap_or_default();
        match cel::compile(expr).and_then(|e| e.eval_bool(&vars)) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(e) => errors.push(format!(
                "failed to evaluate match condition {:?}: {e}",
                mc["name"].as_str().unwrap_or_default()
            )),
        }
    }
    match errors.len() {
        0 => {}
        1 => return failed(errors.remove(0)),
        _ => return failed(format!("[{}]", errors.join(", "))),
    }
    let uid = meta::new_uid();
    let gvk = |d: &ResourceDef| json!({"group": d.group, "version": d.version, "kind": d.kind});
    let gvr =
        |d: &ResourceDef| json!({"group": d.group, "version": d.version, "resource": d.plural});
    let mut request = json!({
        "uid": uid,
        "kind": gvk(&target),
        "resource": gvr(&target),
        "requestKind": gvk(req.def),
        "requestResource": gvr(req.def),
        "name": object["metadata"]["name"].as_str().unwrap_or_default(),
        "operation": req.op,
        "userInfo": {"username": "e2e", "groups": ["system:masters", "system:authenticated"]},
        "object": object,
        "oldObject": old_object,
        "dryRun": req.dry_run,
        "options": {"apiVersion": "meta.k8s.io/v1",
                    "kind": if req.op == "CREATE" { "CreateOptions" } else { "UpdateOptions" }},
    });
    if let Some(ns) = req.ns {
        request["namespace"] = json!(ns);
    }
    if let Some(s) = req.sub {
        request["subResource"] = json!(s);
        request["requestSubResource"] = json!(s);
    }
    let review =
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request});
    let timeout = Duration::from_secs(spec["timeoutSeconds"].as_u64().unwrap_or(10).clamp(1, 30));
    let resp = match call(shared, spec, &review, timeout).await {
        Ok(r) => r,
        Err(e) => return failed(e),
    };
    let Some(response) = resp.get("response") else {
        return failed("the webhook response has no .response".into());
    };
    if resp["apiVersion"] != "admission.k8s.io/v1" || resp["kind"] != "AdmissionReview" {
        return failed(format!(
            "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got {}, Kind={}",
            resp["apiVersion"].as_str().unwrap_or_default(),
            resp["kind"].as_str().unwrap_or_default()
        ));
    }
    if response["uid"].as_str() != Some(uid.as_str()) {
        return failed(format!(
            "expected response.uid={uid:?}, got {:?}",
            response["uid"].as_str().unwrap_or_default()
        ));
    }
    if response["allowed"].as_bool() != Some(true) {
        let result = &response["status"];
        let code = result["code"].as_u64().unwrap_or(0).max(400) as u16;
        let denied = format!("admission webhook {:?} denied the request", hook.name);
        let message = match (result["message"].as_str(), result["reason"].as_str()) {
            (Some(m), _) if !m.is_empty() => format!("{denied}: {m}"),
            (_, Some(r)) if !r.is_empty() => format!("{denied}: {r}"),
            _ => format!("{denied} without explanation"),
        };
        return Err(ApiError::with_code(
            code,
            result["reason"].as_str().unwrap_or_default(),
            message,
        ));
    }
    let Some(patch_b64) = response["patch"].as_str() else {
        return Ok(Some(obj.clone()));
    };
    if response["patchType"].as_str() != Some("JSONPatch") {
        return failed(format!(
            "unsupported patchType {:?}; only JSONPatch is allowed",
            response["patchType"]
        ));
    }
    let patch = base64::engine::general_purpose::STANDARD
        .decode(patch_b64)
        .map_err(|e| {
            ApiError::internal(format!("webhook {:?} patch is not base64: {e}", hook.name))
        })?;
    let mut mutated = request_object(&review);
    super::patch::apply_json_patch(&mut mutated, &patch).map_err(|e| {
        ApiError::internal(format!(
            "failed to apply the JSON patch of webhook {:?}: {e:?}",
            hook.name
        ))
    })?;
    if mutated["apiVersion"] != target.api_version().as_str()
        || mutated["kind"] != target.kind.as_str()
    {
        return Err(ApiError::internal(format!(
            "webhook {:?} changed apiVersion or kind",
            hook.name
        )));
    }
    // Back to the version of the request.
    Ok(Some(req.def.to_version(target.to_storage(mutated))))
}

fn request_object(review: &Value) -> Value {
    review["request"]["object"].clone()
}

/// Where a webhook is reached: (address to dial, TLS server name, `Host`, path and query).
fn endpoint(
    shared: &Shared,
    spec: &Value,
    timeout: Duration,
) -> Result<(SocketAddr, String, String, String), String> {
    let cc = &spec["clientConfig"];
    let t = format!("timeout={}s", timeout.as_secs());
    if let Some(url) = cc["url"].as_str() {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("invalid url {url:?}: {e}"))?;
        let host = uri
            .host()
            .ok_or("url has no host")?
            .trim_matches(['[', ']'])
            .to_owned();
        let port = uri.port_u16().unwrap_or(443);
        let addr: SocketAddr = match host.parse::<std::net::IpAddr>() {
            Ok(ip) => SocketAddr::new(ip, port),
            Err(_) if host == "localhost" => SocketAddr::from(([127, 0, 0, 1], port)),
            Err(_) => {
                return Err(format!(
                    "refusing to resolve {host:?}: this test server only calls loopback webhooks"
                ));
            }
        };
        if !addr.ip().is_loopback() {
            return Err(format!(
                "refusing to call {addr}: this test server only calls loopback webhooks"
            ));
        }
        let path = uri.path();
        let pq = match uri.query() {
            Some(q) => format!("{path}?{q}&{t}"),
            None => format!("{path}?{t}"),
        };
        return Ok((
            addr,
            host.clone(),
            uri.authority().map(|a| a.to_string()).unwrap_or(host),
            pq,
        ));
    }
    let svc = &cc["service"];
    let ns = svc["namespace"].as_str().unwrap_or_default();
    let name = svc["name"].as_str().unwrap_or_default();
    let port = svc["port"].as_u64().unwrap_or(443) as u16;
    let host = format!("{name}.{ns}.svc");
    let addr = shared
        .services
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(ns.to_owned(), name.to_owned(), port))
        .copied()
        .ok_or_else(|| format!("service \"{ns}/{name}\" port {port} has no endpoints (map it with ApiServer::map_service)"))?;
    let path = svc["path"].as_str().unwrap_or("/");
    Ok((
        addr,
        host.clone(),
        format!("{host}:{port}"),
        format!("{path}?{t}"),
    ))
}

async fn call(
    shared: &Shared,
    spec: &Value,
    review: &Value,
    timeout: Duration,
) -> Result<Value, String> {
    let (addr, server_name, authority, pq) = endpoint(shared, spec, timeout)?;
    let url = format!("https://{authority}{pq}");
    let ca = base64::engine::general_purpose::STANDARD
        .decode(
            spec["clientConfig"]["caBundle"]
                .as_str()
                .unwrap_or_default(),
        )
        .map_err(|e| format!("caBundle is not base64: {e}"))?;
    let tls = mpc::tls::client_config_trusting(&ca, &[b"http/1.1"])
        .map_err(|e| format!("caBundle: {e}"))?;
    let name = rustls::pki_types::ServerName::try_from(server_name.clone())
        .map_err(|e| format!("bad server name {server_name:?}: {e}"))?;
    let body = serde_json::to_vec(review).map_err(|e| e.to_string())?;
    let fut = async move {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("dial tcp {addr}: {e}"))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("tls: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = http::Request::post(pq.as_str())
            .header(http::header::HOST, authority.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "the server responded with status {status}: {}",
                String::from_utf8_lossy(&bytes)
                    .chars()
                    .take(200)
                    .collect::<String>()
            ));
        }
        serde_json::from_slice::<Value>(&bytes).map_err(|e| format!("bad response body: {e}"))
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map_err(|e| format!("failed to call webhook: Post {url:?}: {e}")),
        Err(_) => Err(format!(
            "failed to call webhook: Post {url:?}: context deadline exceeded"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Registry;
    use crate::rules::rule_matches;

    #[test]
    fn rules_match_resources_and_subresources() {
        let reg = Registry::with_builtins();
        let pods = reg.get("", "v1", "pods").unwrap();
        let r = json!({"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "scope": "*"});
        assert!(rule_matches(&r, &pods, None, "CREATE"));
        assert!(!rule_matches(&r, &pods, None, "UPDATE"));
        assert!(!rule_matches(&r, &pods, Some("status"), "CREATE"));
        let all = json!({"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"], "resources": ["*/*"], "scope": "Namespaced"});
        assert!(rule_matches(&all, &pods, Some("status"), "UPDATE"));
        assert!(rule_matches(&all, &pods, None, "UPDATE"));
        let ns = reg.get("", "v1", "namespaces").unwrap();
        assert!(
            !rule_matches(&all, &ns, None, "CREATE"),
            "scope Namespaced excludes cluster resources"
        );
        let st = json!({"operations": ["UPDATE"], "apiGroups": [""], "apiVersions": ["*"], "resources": ["pods/status"]});
        assert!(rule_matches(&st, &pods, Some("status"), "UPDATE"));
        assert!(!rule_matches(&st, &pods, None, "UPDATE"));
    }
}
