//! Validating admission policies: stored ValidatingAdmissionPolicies and their bindings
//! (`admissionregistration.k8s.io/v1`) evaluated on CREATE, UPDATE (and patch) and DELETE after
//! the mutating webhooks and the object's own validation, as kube-apiserver does: match
//! constraints (resource rules with matchPolicy, exclusions, resource names, namespace and object
//! selectors), the binding's matchResources, matchConditions, variables and validations in CEL
//! ([`cel`]), `failurePolicy`, and only the `Deny` action. A denial is kube-apiserver's: HTTP 422
//! (or the validation's `reason`), `<resource> "<name>" is forbidden: ValidatingAdmissionPolicy
//! '<policy>' with binding '<binding>' denied request: <message>`. Parameters (`paramKind`) are
//! refused rather than ignored. `authorizer` resource checks are answered by the RBAC objects in
//! the store, as on a cluster with RBAC authorization, whether or not
//! [`Options::rbac`](super::Options::rbac) authorizes the requests themselves.

use std::sync::Arc;

use serde_json::{Value, json};

use super::auth::{self, Attributes, UserInfo};
use super::resources::ResourceDef;
use super::rules::matched_def;
use super::selector::LabelSelector;
use super::status::ApiError;
use super::{Shared, cel};

/// One admission request as policies see it. Objects are in storage form.
pub(crate) struct Attempt<'a> {
    pub def: &'a Arc<ResourceDef>,
    pub sub: Option<&'a str>,
    pub ns: Option<&'a str>,
    pub name: &'a str,
    /// `CREATE`, `UPDATE` or `DELETE`.
    pub op: &'a str,
    pub object: Option<&'a Value>,
    pub old: Option<&'a Value>,
    pub user: &'a UserInfo,
    pub dry_run: bool,
}

/// Whether `constraints` (a policy's matchConstraints or a binding's matchResources) select the
/// request; `Some(version)` to evaluate it in when they do.
fn selects(
    shared: &Shared,
    constraints: &Value,
    a: &Attempt<'_>,
    ns_labels: Option<&Value>,
    require_rules: bool,
) -> Option<Arc<ResourceDef>> {
    let rules = constraints["resourceRules"].as_array();
    let target = match rules {
        Some(r) if !r.is_empty() => {
            let hook = json!({"rules": r, "matchPolicy": constraints["matchPolicy"]});
            let target = matched_def(shared, &hook, a.def, a.sub, a.op)?;
            let named = r.iter().any(|rule| {
                let names: Vec<&str> = rule["resourceNames"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                names.is_empty() || names.contains(&a.name)
            });
            if !named {
                return None;
            }
            target
        }
        _ if require_rules => return None,
        _ => Arc::clone(a.def),
    };
    if let Some(ex) = constraints["excludeResourceRules"].as_array()
        && !ex.is_empty()
    {
        let hook = json!({"rules": ex, "matchPolicy": "Exact"});
        if matched_def(shared, &hook, a.def, a.sub, a.op).is_some() {
            return None;
        }
    }
    let ns_sel = LabelSelector::from_object(constraints.get("namespaceSelector")).ok()?;
    let ns_ok = if a.def.storage == "core/namespaces" {
        ns_sel.matches(a.object.or(a.old).and_then(|o| o["metadata"].get("labels")))
    } else if a.def.namespaced {
        ns_sel.matches(ns_labels)
    } else {
        true
    };
    let obj_sel = LabelSelector::from_object(constraints.get("objectSelector")).ok()?;
    let obj_ok = [a.object, a.old]
        .into_iter()
        .flatten()
        .any(|o| obj_sel.matches(o["metadata"].get("labels")));
    (ns_ok && obj_ok).then_some(target)
}

/// Runs every bound policy that matches; the first denial (bindings in name order) is the answer.
pub(crate) fn validate(shared: &Shared, a: &Attempt<'_>) -> Result<(), ApiError> {
    let (policies, bindings, ns_object) = {
        let store = shared.lock();
        let policies = store.list(
            "admissionregistration.k8s.io/validatingadmissionpolicies",
            None,
        );
        if policies.is_empty() {
            return Ok(());
        }
        let bindings = store.list(
            "admissionregistration.k8s.io/validatingadmissionpolicybindings",
            None,
        );
        let ns_object =
            a.ns.and_then(|n| store.get("core/namespaces", &(String::new(), n.to_owned())));
        (policies, bindings, ns_object)
    };
    let ns_labels = ns_object.as_ref().map(|o| o["metadata"]["labels"].clone());
    for (_, binding) in &bindings {
        let bspec = &binding["spec"];
        let Some((_, policy)) = policies
            .iter()
            .find(|(k, _)| bspec["policyName"].as_str() == Some(k.1.as_str()))
        else {
            continue;
        };
        let actions: Vec<&str> = bspec["validationActions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        if !actions.contains(&"Deny") {
            continue;
        }
        let pspec = &policy["spec"];
        let Some(target) = selects(
            shared,
            &pspec["matchConstraints"],
            a,
            ns_labels.as_ref(),
            true,
        ) else {
            continue;
        };
        if let Some(mr) = bspec.get("matchResources")
            && selects(shared, mr, a, ns_labels.as_ref(), false).is_none()
        {
            continue;
        }
        let names = Names {
            policy: policy["metadata"]["name"].as_str().unwrap_or_default(),
            binding: binding["metadata"]["name"].as_str().unwrap_or_default(),
        };
        if pspec.get("paramKind").is_some_and(|p| !p.is_null()) {
            return Err(ApiError::internal(format!(
                "ValidatingAdmissionPolicy '{}': paramKind is not supported by this test API server",
                names.policy
            )));
        }
        let view = |o: &Value| target.to_version(o.clone());
        let request = admission_request(&target, a.def, a);
        let mut vars = cel::Bindings::default()
            .json("object", &a.object.map(view).unwrap_or(Value::Null))
            .json("oldObject", &a.old.map(view).unwrap_or(Value::Null))
            .json("request", &request)
            .json(
                "namespaceObject",
                ns_object.as_deref().unwrap_or(&Value::Null),
            )
            .json("params", &Value::Null);
        evaluate(shared, a, pspec, &names, &mut vars)?;
    }
    Ok(())
}

/// `request` of admission CEL: the AdmissionRequest kube-apiserver builds
/// (`CreateAdmissionRequest`), converted as Go's JSON encoding does, so empty optional strings
/// (`subResource`, `name`, `namespace`, ...) are absent rather than null. `kind`/`resource` are the
/// version the policy matched, `requestKind`/`requestResource` the one the client used.
pub(crate) fn admission_request(
    matched: &ResourceDef,
    requested: &ResourceDef,
    a: &Attempt<'_>,
) -> Value {
    let gvk = |d: &ResourceDef| json!({"group": d.group, "version": d.version, "kind": d.kind});
    let gvr =
        |d: &ResourceDef| json!({"group": d.group, "version": d.version, "resource": d.plural});
    let mut user = json!({"username": a.user.username});
    if !a.user.groups.is_empty() {
        user["groups"] = json!(a.user.groups);
    }
    let mut r = json!({
        "uid": "",
        "kind": gvk(matched),
        "resource": gvr(matched),
        "requestKind": gvk(requested),
        "requestResource": gvr(requested),
        "operation": a.op,
        "userInfo": user,
        "dryRun": a.dry_run,
    });
    let optional = [
        ("subResource", a.sub),
        ("requestSubResource", a.sub),
        ("name", Some(a.name)),
        ("namespace", a.ns),
    ];
    for (key, v) in optional {
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            r[key] = json!(v);
        }
    }
    r
}

struct Names<'a> {
    policy: &'a str,
    binding: &'a str,
}

/// The longest message a messageExpression may produce (`MaxEvaluatedMessageExpressionSizeBytes`).
const MAX_MESSAGE_BYTES: usize = 5 * 1024;

/// One policy's matchConditions and validations, as kube-apiserver's validator weighs them:
/// any matchCondition `false` skips the policy whatever errors the others had; an error is
/// judged by `failurePolicy` (Ignore admits that one expression, and the next ones still run);
/// the first denial wins.
fn evaluate(
    shared: &Shared,
    a: &Attempt<'_>,
    spec: &Value,
    names: &Names<'_>,
    vars: &mut cel::Bindings,
) -> Result<(), ApiError> {
    let fail_closed = spec["failurePolicy"].as_str() != Some("Ignore");
    let deny = |message: String, reason: &str| -> Result<(), ApiError> {
        Err(denial(a, names, &message, reason))
    };
    let failed = |message: String| -> Result<(), ApiError> {
        if fail_closed {
            deny(message, "")
        } else {
            tracing::warn!(policy = names.policy, error = %message, "policy failed; failurePolicy Ignore");
            Ok(())
        }
    };
    let compile = |src: &str| {
        cel::compile(src).map_err(|e| {
            ApiError::internal(format!(
                "ValidatingAdmissionPolicy '{}': compilation failed for {src:?}: {e}",
                names.policy
            ))
        })
    };
    let resulted =
        |src: &str, e: cel::CelError| format!("expression '{src}' resulted in error: {e}");
    let mut errors = Vec::new();
    for mc in spec["matchConditions"].as_array().into_iter().flatten() {
        let src = mc["expression"].as_str().unwrap_or_default();
        match compile(src)?.eval_bool(vars) {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => errors.push(resulted(src, e)),
        }
    }
    match errors.len() {
        0 => {}
        1 => return failed(errors.remove(0)),
        _ => return failed(format!("[{}]", errors.join(", "))),
    }
    // Authorizer checks see the RBAC objects as they are now, read once.
    let grants = {
        let store = shared.lock();
        let namespaces: std::collections::BTreeSet<String> = store
            .list("rbac.authorization.k8s.io/rolebindings", None)
            .into_iter()
            .map(|((ns, _), _)| ns)
            .collect();
        let namespaces: Vec<&str> = namespaces.iter().map(String::as_str).collect();
        auth::Grants::of(&store, a.user, &namespaces)
    };
    let authorizer: cel::Authorizer = Arc::new(move |c: &cel::Check| {
        grants.allow(&Attributes {
            verb: &c.verb,
            group: &c.group,
            resource: &c.resource,
            subresource: c.subresource.as_deref(),
            namespace: c.namespace.as_deref(),
            name: c.name.as_deref(),
        })
    });
    // messageExpressions get no authorizer, as in kube-apiserver.
    let mut plain = vars.clone();
    vars.set_authorizer(authorizer);
    // Each variable sees the ones before it. One that fails is left out, so an expression that
    // uses it fails with it (kube-apiserver evaluates variables lazily, with the same effect).
    let mut variables = Vec::new();
    for v in spec["variables"].as_array().into_iter().flatten() {
        let expr = compile(v["expression"].as_str().unwrap_or_default())?;
        vars.set("variables", cel::map_of(variables.clone()));
        if let Ok(value) = expr.eval(vars) {
            variables.push((v["name"].as_str().unwrap_or_default().to_owned(), value));
        }
    }
    let variables = cel::map_of(variables);
    vars.set("variables", variables.clone());
    plain.set("variables", variables);
    for v in spec["validations"].as_array().into_iter().flatten() {
        let src = v["expression"].as_str().unwrap_or_default();
        let expr = compile(src)?;
        match expr.eval_bool(vars) {
            Ok(true) => {}
            Ok(false) => {
                let evaluated = match v["messageExpression"].as_str() {
                    Some(me) => match compile(me)?.eval(&plain) {
                        Ok(cel::CelValue::String(m)) => Some(m.trim().to_owned()),
                        _ => None,
                    },
                    None => None,
                };
                let message = evaluated
                    .filter(|m| !m.is_empty() && m.len() <= MAX_MESSAGE_BYTES && !m.contains('\n'))
                    .or_else(|| {
                        let m = v["message"].as_str().unwrap_or_default().trim();
                        (!m.is_empty()).then(|| m.to_owned())
                    })
                    .unwrap_or_else(|| format!("failed expression: {}", src.trim()));
                return deny(message, v["reason"].as_str().unwrap_or_default());
            }
            Err(e) => failed(resulted(src, e))?,
        }
    }
    Ok(())
}

/// kube-apiserver's denial: `admission.NewForbidden` with the policy's reason and its code.
fn denial(a: &Attempt<'_>, names: &Names<'_>, message: &str, reason: &str) -> ApiError {
    let why = format!(
        "ValidatingAdmissionPolicy '{}' with binding '{}' denied request: {message}",
        names.policy, names.binding
    );
    let qualified = a.def.qualified();
    let text = if a.name.is_empty() {
        format!("{qualified} is forbidden: {why}")
    } else {
        format!("{qualified} {:?} is forbidden: {why}", a.name)
    };
    let reason = if reason.is_empty() { "Invalid" } else { reason };
    let code = match reason {
        "Unauthorized" => 401,
        "Forbidden" => 403,
        "RequestEntityTooLarge" => 413,
        _ => 422,
    };
    let mut details = json!({"name": a.name, "kind": a.def.plural, "causes": [{"message": why}]});
    if !a.def.group.is_empty() {
        details["group"] = json!(a.def.group);
    }
    ApiError {
        details: Some(details),
        ..ApiError::with_code(code, reason, text)
    }
}
