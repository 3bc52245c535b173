//! IBM Cloud VPC API reads the `ibmz` provider needs first: instances of one tag, every page.
//!
//! Counting is by exact name shape (`<tag>-<16 hex>x`), not by prefix as in Go, so `prod-s390x`
//! never counts `prod-s390x-large` instances. Missing or odd fields in an answer make an instance
//! "no address yet", never a panic (Go #985).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use mpc_core::config::ibm::is_instance_name_of;
use serde_json::Value;

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
    #[error("VPC API request failed: {0}")]
    Transport(String),
    #[error("VPC API {path}: HTTP {status}: {body}")]
    Http {
        path: String,
        status: u16,
        body: String,
    },
    #[error("VPC API {path}: answer is not JSON: {reason}")]
    BadAnswer { path: String, reason: String },
    #[error("VPC API instance list did not end after {0} pages")]
    TooManyPages(usize),
}

/// One instance as the provider sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VpcInstance {
    pub id: String,
    pub name: String,
    /// `pending`, `running`, `deleting`, `failed`, ...
    pub status: String,
    /// Private address of the primary network attachment, once it has one.
    pub address: Option<String>,
}

impl VpcInstance {
    /// Counts against `max-instances`: neither being deleted nor failed (those are tracked
    /// for cleanup, not capacity).
    pub fn holds_capacity(&self) -> bool {
        !matches!(self.status.as_str(), "deleting" | "failed")
    }

    fn from_json(v: &Value) -> Option<Self> {
        let s = |v: &Value| v.as_str().map(str::to_owned);
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
            id: s(v.get("id")?)?,
            name: s(v.get("name")?)?,
            status: s(v.get("status")?).unwrap_or_default(),
            address,
        })
    }
}

type Https = hyper_rustls::HttpsConnector<HttpConnector>;

/// A VPC API client for one endpoint (`dynamic.<p>.url`).
pub struct VpcClient {
    base: String,
    iam: Arc<Iam>,
    client: Client<Https, Full<Bytes>>,
    timeout: Duration,
}

impl VpcClient {
    /// A client for `url` (e.g. `https://us-east.iaas.cloud.ibm.com/v1`), with tokens from `iam`.
    pub fn new(url: &str, iam: Arc<Iam>, tls: rustls::ClientConfig) -> Result<Self, VpcError> {
        let base = url.trim_end_matches('/').to_owned();
        let loopback = base
            .strip_prefix("http://")
            .and_then(|r| r.split('/').next())
            .and_then(|h| h.parse::<std::net::SocketAddr>().ok())
            .is_some_and(|a| a.ip().is_loopback());
        if !(base.starts_with("https://") || loopback) {
            return Err(VpcError::InvalidUrl(url.to_owned()));
        }
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(Self {
            base,
            iam,
            client: Client::builder(TokioExecutor::new()).build(https),
            timeout: Duration::from_secs(30),
        })
    }

    /// GET `path_query` (relative to the base, with `version` added), retried once with a fresh
    /// token when the first answer is 401.
    async fn get(&self, path_query: &str) -> Result<Value, VpcError> {
        let sep = if path_query.contains('?') { '&' } else { '?' };
        let url = format!(
            "{}{path_query}{sep}version={API_VERSION}&generation=2",
            self.base
        );
        for attempt in 0..2 {
            let token = self.iam.token().await?;
            let req = http::Request::get(url.as_str())
                .header("authorization", format!("Bearer {}", token.as_str()))
                .header("accept", "application/json")
                .body(Full::new(Bytes::new()))
                .map_err(|e| VpcError::Transport(e.to_string()))?;
            let resp = tokio::time::timeout(self.timeout, self.client.request(req))
                .await
                .map_err(|_| VpcError::Transport("timed out".into()))?
                .map_err(|e| VpcError::Transport(e.to_string()))?;
            let status = resp.status().as_u16();
            let bytes = tokio::time::timeout(self.timeout, resp.into_body().collect())
                .await
                .map_err(|_| VpcError::Transport("timed out reading the answer".into()))?
                .map_err(|e| VpcError::Transport(e.to_string()))?
                .to_bytes();
            if status == 401 && attempt == 0 {
                self.iam.invalidate(token.as_str()).await;
                continue;
            }
            if !(200..300).contains(&status) {
                return Err(VpcError::Http {
                    path: path_query.to_owned(),
                    status,
                    body: String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned(),
                });
            }
            return serde_json::from_slice(&bytes).map_err(|e| VpcError::BadAnswer {
                path: path_query.to_owned(),
                reason: e.to_string(),
            });
        }
        unreachable!("the second attempt returns")
    }

    /// Every instance named `<tag>-<16 hex>x`, across all pages. The `start` token of each
    /// `next.href` is taken, never the link itself, so answers cannot point the client (and its
    /// token) at another host.
    pub async fn instances_of(&self, tag: &str) -> Result<Vec<VpcInstance>, VpcError> {
        let mut out = Vec::new();
        let mut start: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let path = match &start {
                None => format!("/instances?limit={PAGE}"),
                Some(s) => format!("/instances?limit={PAGE}&start={}", encode(s)),
            };
            let page = self.get(&path).await?;
            let items = page
                .get("instances")
                .and_then(Value::as_array)
                .ok_or_else(|| VpcError::BadAnswer {
                    path: path.clone(),
                    reason: "no instances array".into(),
                })?;
            out.extend(
                items
                    .iter()
                    .filter_map(VpcInstance::from_json)
                    .filter(|i| is_instance_name_of(tag, &i.name)),
            );
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
}

fn encode(v: &str) -> String {
    v.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
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
