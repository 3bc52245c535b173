//! The IBM Cloud VPC API calls of the `ibmz` provider: instances (create, list every page, get,
//! delete) and the VPC, subnet and key a platform names.
//!
//! Counting is by exact name shape (`<tag>-<16 hex>x`), not by prefix as in Go, so `prod-s390x`
//! never counts `prod-s390x-large` instances. Missing or odd fields in an answer make an instance
//! "no address yet", never a panic (Go #985).

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use mpc_core::config::ibm::is_instance_name_of;
use serde_json::Value;

use super::http::{CallError, Http, encode, endpoint_ok};
use super::iam::{Iam, IamError};

/// The VPC API version this client speaks (`version=` of every call).
pub const API_VERSION: &str = "2024-11-12";
/// Page size of list calls.
const PAGE: u32 = 50;
/// Pages followed at most (50 000 instances): a server that keeps answering `next` is cut off.
const MAX_PAGES: usize = 1000;

/// Why a VPC call failed.
#[derive(Debug, thiserror::Error)]
pub enum VpcError {
    #[error(transparent)]
    Iam(#[from] IamError),
    #[error("VPC API URL {0:?} is not https (plain http is allowed on loopback only)")]
    InvalidUrl(String),
    #[error("VPC API {path}: {source}")]
    Call {
        path: String,
        #[source]
        source: CallError,
    },
    #[error("VPC API {path}: answer is not what the API documents: {reason}")]
    BadAnswer { path: String, reason: String },
    #[error("VPC API instance list did not end after {0} pages")]
    TooManyPages(usize),
    #[error("VPC API: no {kind} named {name:?} (dynamic.<platform>.{field})")]
    NoSuchName {
        kind: &'static str,
        name: String,
        field: &'static str,
    },
}

impl VpcError {
    /// IBM's error code and the HTTP status, when the API answered with one.
    pub fn code_and_status(&self) -> (Option<&str>, Option<u16>) {
        match self {
            Self::Call {
                source: CallError::Http { status, code, .. },
                ..
            } => (code.as_deref(), Some(*status)),
            Self::Call {
                source: CallError::Iam(IamError::Refused { status, .. }),
                ..
            }
            | Self::Iam(IamError::Refused { status, .. }) => (None, Some(*status)),
            _ => (None, None),
        }
    }
}

/// One instance as the provider sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VpcInstance {
    pub id: String,
    pub name: String,
    /// The instance's CRN (what user tags are attached to).
    pub crn: Option<String>,
    /// `pending`, `running`, `deleting`, `failed`, ...
    pub status: String,
    /// Private address of the primary network attachment, once it has one.
    pub address: Option<String>,
    /// Profile name.
    pub profile: Option<String>,
    /// RFC 3339 creation time.
    pub created_at: Option<String>,
}

impl VpcInstance {
    /// Counts against `max-instances`: neither being deleted nor failed (those are tracked
    /// for cleanup, not capacity).
    pub fn holds_capacity(&self) -> bool {
        !matches!(self.status.as_str(), "deleting" | "failed")
    }

    /// The instance in an answer; `None` when it lacks an id or name (never a panic, Go #985).
    pub fn from_json(v: &Value) -> Option<Self> {
        let s = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_owned);
        let address = v
            .pointer("/primary_network_attachment/primary_ip/address")
            .or_else(|| v.pointer("/primary_network_interface/primary_ip/address"))
            .and_then(|a| a.as_str())
            .filter(|a| {
                a.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| !ip.is_unspecified())
            })
            .map(str::to_owned);
        Some(Self {
            id: s(v.get("id")).filter(|i| !i.is_empty())?,
            name: s(v.get("name"))?,
            crn: s(v.get("crn")),
            status: s(v.get("status")).unwrap_or_default(),
            address,
            profile: s(v.pointer("/profile/name")),
            created_at: s(v.get("created_at")),
        })
    }
}

/// A VPC API client for one endpoint (`dynamic.<p>.url`).
pub struct VpcClient {
    base: String,
    iam: Arc<Iam>,
    http: Http,
}

impl VpcClient {
    /// A client for `url` (e.g. `https://us-east.iaas.cloud.ibm.com/v1`), with tokens from `iam`.
    pub fn new(url: &str, iam: Arc<Iam>, tls: rustls::ClientConfig) -> Result<Self, VpcError> {
        Self::with_http(url, iam, Http::new(tls, Duration::from_secs(30)))
    }

    /// A client over a shared [`Http`].
    pub fn with_http(url: &str, iam: Arc<Iam>, http: Http) -> Result<Self, VpcError> {
        let base = url.trim_end_matches('/').to_owned();
        if !endpoint_ok(&base) {
            return Err(VpcError::InvalidUrl(url.to_owned()));
        }
        Ok(Self { base, iam, http })
    }

    async fn call(
        &self,
        method: Method,
        path_query: &str,
        body: Option<&Value>,
    ) -> Result<Value, VpcError> {
        let sep = if path_query.contains('?') { '&' } else { '?' };
        let url = format!(
            "{}{path_query}{sep}version={API_VERSION}&generation=2",
            self.base
        );
        self.http
            .call(&self.iam, method, &url, &[], body)
            .await
            .map_err(|source| match source {
                CallError::Iam(e) => VpcError::Iam(e),
                source => VpcError::Call {
                    path: path_query.to_owned(),
                    source,
                },
            })
    }

    /// Every item of a collection (`vpcs`, `subnets`, `keys`, `instances`), across all pages,
    /// with `query` (e.g. `name=...`). The `start` token of each `next.href` is taken, never the
    /// link itself, so answers cannot point the client (and its token) at another host.
    async fn collect(&self, kind: &str, query: &str) -> Result<Vec<Value>, VpcError> {
        let mut out = Vec::new();
        let mut start: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let mut path = format!("/{kind}?limit={PAGE}");
            if !query.is_empty() {
                path.push('&');
                path.push_str(query);
            }
            if let Some(s) = &start {
                path.push_str(&format!("&start={}", encode(s)));
            }
            let page = self.call(Method::GET, &path, None).await?;
            let items =
                page.get(kind)
                    .and_then(Value::as_array)
                    .ok_or_else(|| VpcError::BadAnswer {
                        path: path.clone(),
                        reason: format!("no {kind} array"),
                    })?;
            out.extend(items.iter().cloned());
            start = page
                .pointer("/next/href")
                .and_then(Value::as_str)
                .and_then(start_param);
            if start.is_none() {
                return Ok(out);
            }
        }
        Err(VpcError::TooManyPages(MAX_PAGES))
    }

    /// Every instance named `<tag>-<16 hex>x`, across all pages.
    pub async fn instances_of(&self, tag: &str) -> Result<Vec<VpcInstance>, VpcError> {
        Ok(self
            .collect("instances", "")
            .await?
            .iter()
            .filter_map(VpcInstance::from_json)
            .filter(|i| is_instance_name_of(tag, &i.name))
            .collect())
    }

    /// Every instance, across all pages.
    pub async fn all_instances(&self) -> Result<Vec<VpcInstance>, VpcError> {
        Ok(self
            .collect("instances", "")
            .await?
            .iter()
            .filter_map(VpcInstance::from_json)
            .collect())
    }

    /// The instance named `name` (names are unique per region).
    pub async fn instance_named(&self, name: &str) -> Result<Option<VpcInstance>, VpcError> {
        Ok(self
            .collect("instances", &format!("name={}", encode(name)))
            .await?
            .iter()
            .filter_map(VpcInstance::from_json)
            .find(|i| i.name == name))
    }

    /// One instance by id; `None` when the API does not know it.
    pub async fn instance(&self, id: &str) -> Result<Option<VpcInstance>, VpcError> {
        match self
            .call(Method::GET, &format!("/instances/{}", encode(id)), None)
            .await
        {
            Ok(v) => Ok(VpcInstance::from_json(&v)),
            Err(e) if e.code_and_status().1 == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The VPC, subnet or key (`kind`: `vpcs`, `subnets`, `keys`) named `name`, as the API
    /// describes it.
    pub async fn named(
        &self,
        kind: &'static str,
        name: &str,
        field: &'static str,
    ) -> Result<Value, VpcError> {
        self.collect(kind, "")
            .await?
            .into_iter()
            .find(|v| v.get("name").and_then(Value::as_str) == Some(name))
            .ok_or_else(|| VpcError::NoSuchName {
                kind,
                name: name.to_owned(),
                field,
            })
    }

    /// `POST /instances`; the created instance.
    pub async fn create(&self, prototype: &Value) -> Result<VpcInstance, VpcError> {
        let v = self
            .call(Method::POST, "/instances", Some(prototype))
            .await?;
        VpcInstance::from_json(&v).ok_or_else(|| VpcError::BadAnswer {
            path: "/instances".into(),
            reason: "the created instance has no id or name".into(),
        })
    }

    /// `DELETE /instances/{id}`; false when the API does not know it.
    pub async fn delete(&self, id: &str) -> Result<bool, VpcError> {
        match self
            .call(Method::DELETE, &format!("/instances/{}", encode(id)), None)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.code_and_status().1 == Some(404) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// The `start` query parameter of a `next.href`, percent-decoded.
fn start_param(href: &str) -> Option<String> {
    let query = href.split_once('?')?.1;
    let raw = query.split('&').find_map(|kv| kv.strip_prefix("start="))?;
    let mut out = Vec::with_capacity(raw.len());
    let b = raw.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok().filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_is_taken_from_next_href() {
        assert_eq!(
            start_param("https://evil.example/v1/instances?limit=50&start=r%3A1").as_deref(),
            Some("r:1")
        );
        assert_eq!(start_param("https://x/v1/instances?limit=50"), None);
        assert_eq!(start_param("https://x/v1/instances?start=%zz"), None);
    }

    #[test]
    fn odd_instances_have_no_address_and_never_panic() {
        let i = VpcInstance::from_json(&serde_json::json!({
            "id": "i", "name": "t-0123456789abcdefx", "status": "running",
            "primary_network_attachment": {"primary_ip": {"address": "0.0.0.0"}}
        }))
        .unwrap();
        assert_eq!(i.address, None);
        assert!(VpcInstance::from_json(&serde_json::json!({"name": 3})).is_none());
        let failed = VpcInstance {
            status: "failed".into(),
            ..i.clone()
        };
        assert!(!failed.holds_capacity());
        assert!(i.holds_capacity());
    }
}
