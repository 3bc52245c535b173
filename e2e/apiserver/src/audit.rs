//! The request log: every resource request as an audit log records it (user, verb, API group,
//! resource and subresource, namespace, name), so a test can hold one client's requests against
//! the RBAC rules it is deployed with. There is no authentication: the bearer token a client sends
//! is its user name here, so clients given different kubeconfigs
//! ([`ApiServer::kubeconfig_yaml_as`](super::ApiServer::kubeconfig_yaml_as)) tell apart.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::faults::Verb;

/// One resource request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Request {
    /// The bearer token, or `system:anonymous` without one.
    pub user: String,
    pub verb: Verb,
    /// API group (`""` for core).
    pub group: String,
    /// Plural resource (`taskruns`).
    pub resource: String,
    /// Subresource (`status`).
    pub subresource: Option<String>,
    /// `None` for cluster-scoped requests and requests across all namespaces.
    pub namespace: Option<String>,
    /// `None` for collection requests (list, watch of all, create).
    pub name: Option<String>,
}

impl Request {
    /// `resource` or `resource/subresource`, as RBAC rules name it.
    pub fn rbac_resource(&self) -> String {
        match &self.subresource {
            Some(s) => format!("{}/{s}", self.resource),
            None => self.resource.clone(),
        }
    }
}

/// The user of a request that sent no bearer token.
pub const ANONYMOUS: &str = "system:anonymous";

/// The log of one server: each distinct request with how often it came (memory stays bounded by
/// the distinct requests, not their number, so long runs and benchmarks can keep it on).
#[derive(Debug, Default)]
pub struct RequestLog(Mutex<HashMap<Request, u64>>);

impl RequestLog {
    pub(crate) fn record(&self, r: Request) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(r)
            .or_default() += 1;
    }

    /// Every distinct request so far, with its count.
    pub fn all(&self) -> BTreeMap<Request, u64> {
        let log = self.0.lock().unwrap_or_else(|e| e.into_inner());
        log.iter().map(|(r, n)| (r.clone(), *n)).collect()
    }

    /// The requests of one user, with their counts.
    pub fn of(&self, user: &str) -> BTreeMap<Request, u64> {
        let mut all = self.all();
        all.retain(|r, _| r.user == user);
        all
    }
}

/// The user a request's `Authorization` header names.
pub(crate) fn user_of(authorization: Option<&str>) -> String {
    authorization
        .and_then(|a| a.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map_or_else(|| ANONYMOUS.to_owned(), str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_counted_per_user() {
        let log = RequestLog::default();
        let r = |user: &str| Request {
            user: user.into(),
            verb: Verb::Get,
            group: String::new(),
            resource: "configmaps".into(),
            subresource: None,
            namespace: Some("ns".into()),
            name: Some("a".into()),
        };
        log.record(r("mpc"));
        log.record(r("mpc"));
        log.record(r("kubectl"));
        assert_eq!(
            log.of("mpc").into_iter().collect::<Vec<_>>(),
            [(r("mpc"), 2)]
        );
        assert_eq!(log.all().len(), 2);
    }

    #[test]
    fn the_bearer_token_names_the_user() {
        assert_eq!(user_of(Some("Bearer mpc-controller")), "mpc-controller");
        assert_eq!(user_of(Some("Basic eDp5")), ANONYMOUS);
        assert_eq!(user_of(Some("Bearer ")), ANONYMOUS);
        assert_eq!(user_of(None), ANONYMOUS);
    }
}
