//! Fault injection driven by tests: fail the next N matching requests with a chosen status, or
//! delay matching requests.

use std::sync::Mutex;
use std::time::Duration;

use super::status::ApiError;

/// Request verbs, as Kubernetes names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verb {
    /// GET of one object.
    Get,
    /// GET of a collection.
    List,
    /// GET with `watch=true`.
    Watch,
    /// POST.
    Create,
    /// PUT.
    Update,
    Patch,
    /// DELETE of one object.
    Delete,
    /// DELETE of a collection.
    DeleteCollection,
}

impl Verb {
    /// The lowercase name used in discovery and audit logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::List => "list",
            Self::Watch => "watch",
            Self::Create => "create",
            Self::Update => "update",
            Self::Patch => "patch",
            Self::Delete => "delete",
            Self::DeleteCollection => "deletecollection",
        }
    }
}

/// Which requests a fault applies to; unset fields match anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestMatch {
    pub verb: Option<Verb>,
    /// Resource, optionally with subresource: `configmaps`, `taskruns/status`.
    pub resource: Option<String>,
    pub namespace: Option<String>,
    /// Object name.
    pub name: Option<String>,
    /// Client (its bearer token, as the request log names it).
    pub user: Option<String>,
}

impl RequestMatch {
    /// Matches every resource request.
    pub fn any() -> Self {
        Self::default()
    }

    /// Matches one verb on one resource (`"taskruns"`, `"taskruns/status"`).
    pub fn on(verb: Verb, resource: &str) -> Self {
        Self {
            verb: Some(verb),
            resource: Some(resource.to_owned()),
            ..Self::default()
        }
    }

    /// Restricts to one namespace.
    pub fn in_namespace(mut self, ns: &str) -> Self {
        self.namespace = Some(ns.to_owned());
        self
    }

    /// Restricts to one object name.
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Restricts to one client (the bearer token of its kubeconfig).
    pub fn by(mut self, user: &str) -> Self {
        self.user = Some(user.to_owned());
        self
    }

    /// Whether a request matches.
    pub fn matches(&self, req: &RequestFacts) -> bool {
        self.verb.is_none_or(|v| v == req.verb)
            && self.resource.as_deref().is_none_or(|r| {
                r == req.resource
                    || req
                        .subresource
                        .as_deref()
                        .is_some_and(|s| format!("{}/{s}", req.resource) == r)
            })
            && self
                .namespace
                .as_deref()
                .is_none_or(|n| req.namespace.as_deref() == Some(n))
            && self
                .name
                .as_deref()
                .is_none_or(|n| req.name.as_deref() == Some(n))
            && self.user.as_deref().is_none_or(|u| u == req.user)
    }
}

/// What a fault rule sees of a request.
#[derive(Debug, Clone)]
pub struct RequestFacts {
    pub verb: Verb,
    /// Resource (plural).
    pub resource: String,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// Client, as the request log names it.
    pub user: String,
}

#[derive(Debug)]
struct FailRule {
    matcher: RequestMatch,
    code: u16,
    remaining: usize,
}

#[derive(Debug)]
struct DelayRule {
    matcher: RequestMatch,
    delay: Duration,
}

/// The fault rules of one server.
#[derive(Debug, Default)]
pub struct Faults {
    fail: Mutex<Vec<FailRule>>,
    delay: Mutex<Vec<DelayRule>>,
    injected: std::sync::atomic::AtomicU64,
}

impl Faults {
    /// Fails the next `times` requests matching `matcher` with `code` (500, 409, 429, 503, 504 or
    /// any other status).
    pub fn fail_next(&self, matcher: RequestMatch, code: u16, times: usize) {
        self.fail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(FailRule {
                matcher,
                code,
                remaining: times,
            });
    }

    /// Delays every request matching `matcher` by `delay` (until [`Faults::clear`]).
    pub fn add_latency(&self, matcher: RequestMatch, delay: Duration) {
        self.delay
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(DelayRule { matcher, delay });
    }

    /// Removes every rule.
    pub fn clear(&self) {
        self.fail.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.delay.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// How many requests were failed on purpose so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The delay and the injected error (if any) for a request; consumes one use of the rule.
    pub fn check(&self, req: &RequestFacts) -> (Duration, Option<ApiError>) {
        let delay = self
            .delay
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|r| r.matcher.matches(req))
            .map(|r| r.delay)
            .sum();
        let mut fail = self.fail.lock().unwrap_or_else(|e| e.into_inner());
        let err = fail
            .iter_mut()
            .find(|r| r.remaining > 0 && r.matcher.matches(req))
            .map(|r| {
                r.remaining -= 1;
                error_for(r.code, req)
            });
        fail.retain(|r| r.remaining > 0);
        if err.is_some() {
            self.injected
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        (delay, err)
    }
}

fn error_for(code: u16, req: &RequestFacts) -> ApiError {
    let what = format!("injected fault for {} {}", req.verb.as_str(), req.resource);
    match code {
        409 => ApiError::with_code(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {:?}: {what}",
                req.resource,
                req.name.clone().unwrap_or_default()
            ),
        ),
        429 => ApiError::too_many_requests(format!("{what}: too many requests"), 1),
        500 => ApiError::internal(what),
        503 => ApiError::with_code(503, "ServiceUnavailable", what),
        504 => ApiError::timeout(what),
        c => ApiError::with_code(c, "", what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(verb: Verb, resource: &str, sub: Option<&str>) -> RequestFacts {
        RequestFacts {
            verb,
            resource: resource.into(),
            subresource: sub.map(Into::into),
            namespace: Some("ns".into()),
            name: Some("x".into()),
            user: "mpc".into(),
        }
    }

    #[test]
    fn fails_exactly_n_matching_requests() {
        let f = Faults::default();
        f.fail_next(RequestMatch::on(Verb::Patch, "taskruns/status"), 500, 2);
        assert!(f.check(&facts(Verb::Patch, "taskruns", None)).1.is_none());
        assert!(
            f.check(&facts(Verb::Get, "taskruns", Some("status")))
                .1
                .is_none()
        );
        let e = f
            .check(&facts(Verb::Patch, "taskruns", Some("status")))
            .1
            .unwrap();
        assert_eq!(e.code, 500);
        assert!(
            f.check(&facts(Verb::Patch, "taskruns", Some("status")))
                .1
                .is_some()
        );
        assert!(
            f.check(&facts(Verb::Patch, "taskruns", Some("status")))
                .1
                .is_none()
        );
        assert_eq!(f.injected(), 2);
        f.fail_next(RequestMatch::any().in_namespace("other"), 429, 1);
        assert!(f.check(&facts(Verb::Get, "pods", None)).1.is_none());
        f.add_latency(
            RequestMatch::on(Verb::Get, "pods"),
            Duration::from_millis(5),
        );
        assert_eq!(
            f.check(&facts(Verb::Get, "pods", None)).0,
            Duration::from_millis(5)
        );
        f.clear();
        assert_eq!(f.check(&facts(Verb::Get, "pods", None)).0, Duration::ZERO);
        f.add_latency(RequestMatch::any().by("other"), Duration::from_secs(60));
        assert_eq!(f.check(&facts(Verb::Get, "pods", None)).0, Duration::ZERO);
        f.add_latency(
            RequestMatch::on(Verb::Update, "leases").by("mpc"),
            Duration::from_secs(60),
        );
        assert_eq!(
            f.check(&facts(Verb::Update, "leases", None)).0,
            Duration::from_secs(60)
        );
        assert_eq!(f.check(&facts(Verb::Get, "leases", None)).0, Duration::ZERO);
    }
}
