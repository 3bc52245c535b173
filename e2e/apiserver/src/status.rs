//! API errors rendered as `Status` objects with the code, reason and message the apiserver uses.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use serde_json::{Value, json};

use super::resources::ResourceDef;

/// An error answered as a `metav1.Status`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status code.
    pub code: u16,
    /// `StatusReason`.
    pub reason: String,
    /// Human message.
    pub message: String,
    /// `details` (name, group, kind, causes).
    pub details: Option<Value>,
    /// `Retry-After` seconds (429).
    pub retry_after: Option<u64>,
    /// `metadata.continue` of the Status: where an expired paged list can go on, inconsistently.
    pub list_continue: Option<Box<str>>,
}

fn details(def: &ResourceDef, name: &str) -> Value {
    let mut d = json!({"name": name, "kind": def.plural});
    if !def.group.is_empty() {
        d["group"] = json!(def.group);
    }
    d
}

impl ApiError {
    fn new(code: u16, reason: &str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.to_owned(),
            message: message.into(),
            details: None,
            retry_after: None,
            list_continue: None,
        }
    }

    /// 404 for an object.
    pub fn not_found(def: &ResourceDef, name: &str) -> Self {
        Self {
            details: Some(details(def, name)),
            ..Self::new(
                404,
                "NotFound",
                format!("{} {name:?} not found", def.qualified()),
            )
        }
    }

    /// 404 for a path that serves nothing.
    pub fn no_route(path: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    }

    /// 404 for an apiVersion/kind this server does not serve.
    pub fn not_found_kind(api_version: &str, kind: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!(
                "the server could not find the requested resource: no matches for kind {kind:?} in version {api_version:?}"
            ),
        )
    }

    /// 409 AlreadyExists.
    pub fn already_exists(def: &ResourceDef, name: &str) -> Self {
        Self {
            details: Some(details(def, name)),
            ..Self::new(
                409,
                "AlreadyExists",
                format!("{} {name:?} already exists", def.qualified()),
            )
        }
    }

    /// 409 Conflict on a stale resourceVersion.
    pub fn conflict(def: &ResourceDef, name: &str) -> Self {
        Self::conflict_msg(
            def,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 409 Conflict with a specific cause.
    pub fn conflict_msg(def: &ResourceDef, name: &str, why: &str) -> Self {
        Self {
            details: Some(details(def, name)),
            ..Self::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} {name:?}: {why}",
                    def.qualified()
                ),
            )
        }
    }

    /// 422 Invalid with field causes (`field`, `message`).
    pub fn invalid(def: &ResourceDef, name: &str, causes: &[(String, String)]) -> Self {
        let msgs: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        let message = if msgs.len() == 1 {
            format!("{} {name:?} is invalid: {}", def.kind, msgs[0])
        } else {
            format!("{} {name:?} is invalid: [{}]", def.kind, msgs.join(", "))
        };
        let mut d = details(def, name);
        d["kind"] = json!(def.kind);
        d["causes"] = causes
            .iter()
            .map(|(f, m)| {
                let reason = if m.starts_with("Required value") {
                    "FieldValueRequired"
                } else if m.starts_with("Forbidden") {
                    "FieldValueForbidden"
                } else if m.starts_with("Unsupported value") {
                    "FieldValueNotSupported"
                } else {
                    "FieldValueInvalid"
                };
                json!({"reason": reason, "message": m, "field": f})
            })
            .collect();
        Self {
            details: Some(d),
            ..Self::new(422, "Invalid", message)
        }
    }

    /// 422 without field causes (e.g. a JSON patch `test` that failed).
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(422, "Invalid", message)
    }

    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 403 Forbidden.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(403, "Forbidden", message)
    }

    /// 405 MethodNotAllowed.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(405, "MethodNotAllowed", message)
    }

    /// 406 NotAcceptable.
    pub fn not_acceptable(message: impl Into<String>) -> Self {
        Self::new(406, "NotAcceptable", message)
    }

    /// 410 Expired (too old resourceVersion or continue token).
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 415 UnsupportedMediaType.
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(415, "UnsupportedMediaType", message)
    }

    /// 429 TooManyRequests.
    pub fn too_many_requests(message: impl Into<String>, retry_after: u64) -> Self {
        Self {
            retry_after: Some(retry_after),
            details: Some(json!({"retryAfterSeconds": retry_after})),
            ..Self::new(429, "TooManyRequests", message)
        }
    }

    /// 500 InternalError.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            500,
            "InternalError",
            format!("Internal error occurred: {}", message.into()),
        )
    }

    /// 504 Timeout.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(504, "Timeout", message)
    }

    /// 504 for a read or watch at a resourceVersion the server has not reached (after waiting
    /// for it): the watch cache's "Too large resource version", with the `ResourceVersionTooLarge`
    /// cause clients look for and a one-second `Retry-After`.
    pub fn too_large_resource_version(requested: u64, current: u64) -> Self {
        Self {
            retry_after: Some(1),
            details: Some(json!({
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1,
            })),
            ..Self::new(
                504,
                "Timeout",
                format!("Timeout: Too large resource version: {requested}, current: {current}"),
            )
        }
    }

    /// An error with an arbitrary code (injected faults, webhook denials).
    pub fn with_code(code: u16, reason: &str, message: impl Into<String>) -> Self {
        Self::new(code, reason, message)
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        if let Some(c) = &self.list_continue {
            s["metadata"]["continue"] = json!(&**c);
        }
        s
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (code, axum::Json(self.to_status())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// A `Status` of success (immediate deletions, deletecollection).
pub fn success(details: Option<Value>) -> Value {
    let mut s = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"});
    if let Some(d) = details {
        s["details"] = d;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Registry;

    #[test]
    fn messages_match_the_apiserver() {
        let reg = Registry::with_builtins();
        let cm = reg.get("", "v1", "configmaps").unwrap();
        let lease = reg.get("coordination.k8s.io", "v1", "leases").unwrap();
        assert_eq!(
            ApiError::not_found(&cm, "x").message,
            "configmaps \"x\" not found"
        );
        let e = ApiError::conflict(&lease, "l").to_status();
        assert_eq!(e["code"], 409);
        assert_eq!(e["reason"], "Conflict");
        assert_eq!(e["details"]["group"], "coordination.k8s.io");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .starts_with("Operation cannot be fulfilled on leases.coordination.k8s.io \"l\"")
        );
        let inv = ApiError::invalid(
            &cm,
            "x",
            &[("metadata.name".into(), "Required value".into())],
        );
        assert_eq!(inv.code, 422);
        assert_eq!(
            inv.to_status()["details"]["causes"][0]["reason"],
            "FieldValueRequired"
        );
    }
}
