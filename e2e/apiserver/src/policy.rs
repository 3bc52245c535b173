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

use super::admission::matched_def;
use super::auth::{self, Attributes, UserInfo};
use super::resources::ResourceDef;
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
        let view = |o: &Value| target.from_storage(o.clone());
        let request = json!({
            "kind": {"group": target.group, "version": target.version, "kind": target.kind},
            "resource": {"group": target.group, "version": target.version, "resource": target.plural},
            "subResource": a.sub,
            "name": a.name,
            "namespace": a.ns,
            "operation": a.op,
            "userInfo": a.user.to_json(),
            "dryRun": a.dry_run,
        });
        let mut vars = vec![
            ("object", a.object.map(view).unwrap_or(Value::Null)),
            ("oldObject", a.old.map(view).unwrap_or(Value::Null)),
            ("request", request),
            (
                "namespaceObject",
                ns_object.as_deref().cloned().unwrap_or(Value::Null),
            ),
            ("params", Value::Null),
        ];
        evaluate(shared, a, pspec, &names, &mut vars)?;
    }
    Ok(())
}

struct Names<'a> {
    policy: &'a str,
    binding: &'a str,
}

fn evaluate(
    shared: &Shared,
    a: &Attempt<'_>,
    spec: &Value,
    names: &Names<'_>,
    vars: &mut Vec<(&'static str, Value)>,
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
    let authorize = |c: &cel::Check| {
        let attributes = Attributes {
            verb: &c.verb,
            group: &c.group,
            resource: &c.resource,
            subresource: c.subresource.as_deref(),
            namespace: c.namespace.as_deref(),
            name: c.name.as_deref(),
        };
        auth::allowed(&shared.lock(), a.user, &attributes)
    };
    let eval =
        |expr: &cel::Expr, vars: &[(&str, Value)]| cel::eval_with(expr, vars, Some(&authorize));
    let eval_bool = |expr: &cel::Expr, vars: &[(&str, Value)]| {
        eval(expr, vars).and_then(|v| {
            v.as_bool()
                .ok_or_else(|| format!("no such overload: expected bool, got {v}"))
        })
    };
    let compile = |src: &str| {
        cel::parse(src).map_err(|e| {
            ApiError::internal(format!(
                "ValidatingAdmissionPolicy '{}': compilation failed for {src:?}: {e}",
                names.policy
            ))
        })
    };
    for mc in spec["matchConditions"].as_array().into_iter().flatten() {
        let expr = compile(mc["expression"].as_str().unwrap_or_default())?;
        match eval_bool(&expr, vars) {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                return failed(format!(
                    "failed to evaluate match condition {:?}: {e}",
                    mc["name"].as_str().unwrap_or_default()
                ));
            }
        }
    }
    // Each variable sees the ones before it. One that fails is left out, so an expression that
    // uses it fails with it (kube-apiserver evaluates variables lazily, with the same effect).
    let mut variables = serde_json::Map::new();
    for v in spec["variables"].as_array().into_iter().flatten() {
        let expr = compile(v["expression"].as_str().unwrap_or_default())?;
        vars.retain(|(n, _)| *n != "variables");
        vars.push(("variables", Value::Object(variables.clone())));
        if let Ok(value) = eval(&expr, vars) {
            variables.insert(v["name"].as_str().unwrap_or_default().to_owned(), value);
        }
    }
    vars.retain(|(n, _)| *n != "variables");
    vars.push(("variables", Value::Object(variables)));
    for v in spec["validations"].as_array().into_iter().flatten() {
        let src = v["expression"].as_str().unwrap_or_default();
        let expr = compile(src)?;
        let reason = v["reason"].as_str().unwrap_or_default();
        match eval_bool(&expr, vars) {
            Ok(true) => {}
            Ok(false) => {
                let message = match (v["messageExpression"].as_str(), v["message"].as_str()) {
                    (Some(me), _) => match eval(&compile(me)?, vars) {
                        Ok(Value::String(m)) if !m.trim().is_empty() => m,
                        _ => format!("failed expression: {src}"),
                    },
                    (None, Some(m)) if !m.is_empty() => m.to_owned(),
                    _ => format!("failed expression: {src}"),
                };
                return deny(message, reason);
            }
            Err(e) => return failed(format!("expression '{src}' resulted in error: {e}")),
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
