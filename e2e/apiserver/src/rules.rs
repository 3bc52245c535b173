//! Which resources an admission rule selects (webhooks' and policies' `matchConstraints` rules),
//! shared by the webhook caller and the policy evaluator.

use std::sync::Arc;

use serde_json::Value;

use super::Shared;
use super::resources::ResourceDef;

fn list_has(v: &Value, want: &str) -> bool {
    v.as_array()
        .into_iter()
        .flatten()
        .any(|x| x.as_str() == Some("*") || x.as_str() == Some(want))
}

fn resource_matches(rule: &Value, plural: &str, sub: Option<&str>) -> bool {
    rule["resources"].as_array().into_iter().flatten().any(|r| {
        let r = r.as_str().unwrap_or_default();
        match (r.split_once('/'), sub) {
            (None, None) => r == "*" || r == plural,
            (None, Some(_)) => false,
            (Some((res, s)), Some(want)) => {
                (res == "*" || res == plural) && (s == "*" || s == want)
            }
            (Some((res, s)), None) => res == "*" && s == "*",
        }
    })
}

pub(crate) fn rule_matches(rule: &Value, def: &ResourceDef, sub: Option<&str>, op: &str) -> bool {
    let scope_ok = match rule["scope"].as_str().unwrap_or("*") {
        "Cluster" => !def.namespaced,
        "Namespaced" => def.namespaced,
        _ => true,
    };
    scope_ok
        && list_has(&rule["operations"], op)
        && list_has(&rule["apiGroups"], &def.group)
        && list_has(&rule["apiVersions"], &def.version)
        && resource_matches(rule, &def.plural, sub)
}

/// The version a webhook is called with: the request's if a rule matches it, else (matchPolicy
/// Equivalent) another served version of the same resource.
pub(crate) fn matched_def(
    shared: &Shared,
    hook: &Value,
    def: &Arc<ResourceDef>,
    sub: Option<&str>,
    op: &str,
) -> Option<Arc<ResourceDef>> {
    let rules: Vec<&Value> = hook["rules"].as_array().into_iter().flatten().collect();
    if rules.iter().any(|r| rule_matches(r, def, sub, op)) {
        return Some(Arc::clone(def));
    }
    if hook["matchPolicy"].as_str() == Some("Exact") {
        return None;
    }
    shared
        .registry()
        .versions_of(&def.storage)
        .into_iter()
        .find(|d| rules.iter().any(|r| rule_matches(r, d, sub, op)))
}
