//! Who a request comes from, and (opt-in, [`Options::rbac`](super::Options::rbac)) whether RBAC
//! lets them do it.
//!
//! There is no authentication: the bearer token is the user name ([`audit`](super::audit)). The
//! groups are derived as kube-apiserver's authenticators set them: a service account token's
//! user `system:serviceaccount:<ns>:<name>` is in `system:serviceaccounts`,
//! `system:serviceaccounts:<ns>` and `system:authenticated`; the harness's own users
//! ([`KUBECONFIG_USER`](super::KUBECONFIG_USER), [`HARNESS_USER`](super::HARNESS_USER)) are
//! cluster administrators (`system:masters`); any other token is an ordinary authenticated user,
//! and `<user>;groups=<g1>,<g2>` one in those groups too (as an OIDC or OpenShift OAuth
//! authenticator would say); no token is `system:anonymous` in `system:unauthenticated`.
//!
//! The authorizer evaluates the Roles, ClusterRoles and their bindings in the store per request,
//! as the RBAC authorizer does (no aggregation rules, no non-resource URLs), and answers 403 with
//! kube-apiserver's message.

use serde_json::{Value, json};

use super::audit::ANONYMOUS;
use super::status::ApiError;
use super::store::Store;

/// Members are allowed everything, by RBAC and by the policies that exempt administrators.
pub const MASTERS: &str = "system:masters";

/// The identity of a request, as admission and authorization see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserInfo {
    pub username: String,
    pub groups: Vec<String>,
}

impl UserInfo {
    /// The user a bearer token names, with the groups kube-apiserver would give it.
    pub fn from_token(user: &str) -> Self {
        if let Some((name, groups)) = user.split_once(";groups=") {
            let mut info = Self::from_token(name);
            let given = groups.split(',').filter(|g| !g.is_empty() && *g != MASTERS);
            info.groups.extend(given.map(str::to_owned));
            return info;
        }
        let groups: Vec<&str> = if user == ANONYMOUS {
            vec!["system:unauthenticated"]
        } else if let Some((ns, _)) = user
            .strip_prefix("system:serviceaccount:")
            .and_then(|rest| rest.split_once(':'))
        {
            return Self {
                username: user.to_owned(),
                groups: vec![
                    "system:serviceaccounts".into(),
                    format!("system:serviceaccounts:{ns}"),
                    "system:authenticated".into(),
                ],
            };
        } else if user == super::KUBECONFIG_USER || user == super::HARNESS_USER {
            vec![MASTERS, "system:authenticated"]
        } else {
            vec!["system:authenticated"]
        };
        Self {
            username: user.to_owned(),
            groups: groups.into_iter().map(str::to_owned).collect(),
        }
    }

    /// The user of writes made through [`ApiServer`](super::ApiServer)'s own helpers.
    pub fn harness() -> Self {
        Self::from_token(super::HARNESS_USER)
    }

    pub fn is_admin(&self) -> bool {
        self.groups.iter().any(|g| g == MASTERS)
    }
}

/// What is asked, as the RBAC authorizer reads a resource request.
#[derive(Debug, Clone, Copy)]
pub struct Attributes<'a> {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`.
    pub verb: &'a str,
    pub group: &'a str,
    pub resource: &'a str,
    pub subresource: Option<&'a str>,
    pub namespace: Option<&'a str>,
    pub name: Option<&'a str>,
}

fn strings(v: &Value) -> impl Iterator<Item = &str> {
    v.as_array().into_iter().flatten().filter_map(Value::as_str)
}

fn subject_matches(subject: &Value, user: &UserInfo) -> bool {
    let name = subject["name"].as_str().unwrap_or_default();
    match subject["kind"].as_str() {
        Some("User") => name == user.username,
        Some("Group") => user.groups.iter().any(|g| g == name),
        Some("ServiceAccount") => {
            let ns = subject["namespace"].as_str().unwrap_or_default();
            user.username == format!("system:serviceaccount:{ns}:{name}")
        }
        _ => false,
    }
}

/// Whether one PolicyRule allows the request (the RBAC authorizer's `RuleAllows`).
fn rule_allows(rule: &Value, a: &Attributes<'_>) -> bool {
    let verb_ok = strings(&rule["verbs"]).any(|v| v == "*" || v == a.verb);
    let group_ok = strings(&rule["apiGroups"]).any(|g| g == "*" || g == a.group);
    let combined = match a.subresource {
        Some(s) => format!("{}/{s}", a.resource),
        None => a.resource.to_owned(),
    };
    let resource_ok = strings(&rule["resources"]).any(|r| {
        r == "*"
            || r == combined
            || a.subresource
                .is_some_and(|s| r.strip_prefix("*/").is_some_and(|rs| rs == s))
    });
    let names: Vec<&str> = strings(&rule["resourceNames"]).collect();
    let name_ok = names.is_empty() || a.name.is_some_and(|n| names.contains(&n));
    verb_ok && group_ok && resource_ok && name_ok
}

/// Whether RBAC objects in `store` allow `user` the request.
pub fn allowed(store: &Store, user: &UserInfo, a: &Attributes<'_>) -> bool {
    Grants::of(store, user, a.namespace.as_slice()).allow(a)
}

/// The RBAC rules that grant `user` anything, read out of the store once: what the CEL
/// `authorizer` asks, after the store's lock is released.
#[derive(Debug, Clone, Default)]
pub struct Grants {
    admin: bool,
    cluster: Vec<Value>,
    /// (namespace, rules of a RoleBinding there).
    namespaced: Vec<(String, Vec<Value>)>,
}

impl Grants {
    /// `user`'s rules from every ClusterRoleBinding and from the RoleBindings in `namespaces`.
    pub fn of(store: &Store, user: &UserInfo, namespaces: &[&str]) -> Self {
        if user.is_admin() {
            return Self {
                admin: true,
                ..Self::default()
            };
        }
        let role_rules = |kind: &str, ns: Option<&str>, name: &str| -> Vec<Value> {
            let (storage, key_ns) = match kind {
                "ClusterRole" => ("rbac.authorization.k8s.io/clusterroles", String::new()),
                "Role" => match ns {
                    Some(ns) => ("rbac.authorization.k8s.io/roles", ns.to_owned()),
                    None => return Vec::new(),
                },
                _ => return Vec::new(),
            };
            store
                .get(storage, &(key_ns, name.to_owned()))
                .and_then(|r| r["rules"].as_array().cloned())
                .unwrap_or_default()
        };
        let binds = |b: &Value| {
            b["subjects"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|s| subject_matches(s, user))
        };
        let mut grants = Self::default();
        for (_, b) in store.list("rbac.authorization.k8s.io/clusterrolebindings", None) {
            if binds(&b) && b["roleRef"]["kind"] == "ClusterRole" {
                grants.cluster.extend(role_rules(
                    "ClusterRole",
                    None,
                    b["roleRef"]["name"].as_str().unwrap_or_default(),
                ));
            }
        }
        let bindings = namespaces
            .iter()
            .flat_map(|ns| store.list("rbac.authorization.k8s.io/rolebindings", Some(ns)));
        for ((ns, _), b) in bindings {
            if binds(&b) {
                let rules = role_rules(
                    b["roleRef"]["kind"].as_str().unwrap_or_default(),
                    Some(&ns),
                    b["roleRef"]["name"].as_str().unwrap_or_default(),
                );
                grants.namespaced.push((ns, rules));
            }
        }
        grants
    }

    /// Whether these rules allow the request (a RoleBinding's only in its own namespace).
    pub fn allow(&self, a: &Attributes<'_>) -> bool {
        self.admin
            || self.cluster.iter().any(|r| rule_allows(r, a))
            || self
                .namespaced
                .iter()
                .filter(|(ns, _)| Some(ns.as_str()) == a.namespace)
                .any(|(_, rules)| rules.iter().any(|r| rule_allows(r, a)))
    }
}

/// `Ok` when allowed, else kube-apiserver's 403 for the request.
pub fn authorize(store: &Store, user: &UserInfo, a: &Attributes<'_>) -> Result<(), ApiError> {
    if allowed(store, user, a) {
        return Ok(());
    }
    let resource = match a.subresource {
        Some(s) => format!("{}/{s}", a.resource),
        None => a.resource.to_owned(),
    };
    let why = match a.namespace {
        Some(ns) => format!(
            "User {:?} cannot {} resource {resource:?} in API group {:?} in the namespace {ns:?}",
            user.username, a.verb, a.group
        ),
        None => format!(
            "User {:?} cannot {} resource {resource:?} in API group {:?} at the cluster scope",
            user.username, a.verb, a.group
        ),
    };
    let qualified = if a.group.is_empty() {
        a.resource.to_owned()
    } else {
        format!("{}.{}", a.resource, a.group)
    };
    let name = a.name.unwrap_or_default();
    let message = if name.is_empty() {
        format!("{qualified} is forbidden: {why}")
    } else {
        format!("{qualified} {name:?} is forbidden: {why}")
    };
    let mut details = json!({"name": name, "kind": a.resource});
    if !a.group.is_empty() {
        details["group"] = json!(a.group);
    }
    Err(ApiError {
        details: Some(details),
        ..ApiError::forbidden(message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_derived_as_the_authenticators_do() {
        let sa = UserInfo::from_token("system:serviceaccount:mpc:ctl");
        assert_eq!(
            sa.groups,
            [
                "system:serviceaccounts",
                "system:serviceaccounts:mpc",
                "system:authenticated"
            ]
        );
        assert!(!sa.is_admin());
        assert!(!UserInfo::from_token("alice").is_admin());
        let admin = UserInfo::from_token("kube:admin;groups=system:cluster-admins,system:masters");
        assert_eq!(admin.username, "kube:admin");
        assert_eq!(
            admin.groups,
            ["system:authenticated", "system:cluster-admins"],
            "never system:masters from a token"
        );
        assert!(UserInfo::harness().is_admin());
        assert_eq!(
            UserInfo::from_token(ANONYMOUS).groups,
            ["system:unauthenticated"]
        );
    }

    #[test]
    fn rules_match_as_the_rbac_authorizer() {
        let a = Attributes {
            verb: "get",
            group: "",
            resource: "pods",
            subresource: Some("log"),
            namespace: Some("ns"),
            name: Some("p"),
        };
        let rule = |res: &str, names: &[&str]| json!({"apiGroups": [""], "resources": [res], "verbs": ["get"], "resourceNames": names});
        assert!(rule_allows(&rule("pods/log", &[]), &a));
        assert!(rule_allows(&rule("*/log", &[]), &a));
        assert!(rule_allows(&rule("*", &["p"]), &a));
        assert!(!rule_allows(&rule("pods", &[]), &a));
        assert!(!rule_allows(&rule("pods/log", &["q"]), &a));
        let create = Attributes {
            verb: "create",
            subresource: None,
            name: None,
            ..a
        };
        let c = json!({"apiGroups": ["*"], "resources": ["pods"], "verbs": ["create"], "resourceNames": ["p"]});
        assert!(
            !rule_allows(&c, &create),
            "resourceNames never match a request without a name"
        );
    }
}
