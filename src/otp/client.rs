//! The controller's side of the OTP server.
//!
//! [`OtpClient::store_key_for`] is what the controller uses: the owner (TaskRun UID) and request
//! id make every attempt the same request, so a retry after a lost answer gets the same token and
//! entry, and with `rearm` the owner's used token redeems once more with a new key (a TaskRun retry
//! attempt, docs/architecture.md, "The key hand-off and retries"). [`OtpClient::store_key`] speaks
//! the Go controller's protocol with a random `Idempotency-Key` per call, to the same effect.
//! Stores and revokes are retried on transient failures; [`OtpClientError::is_retryable`] tells
//! whether trying later can help.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use zeroize::Zeroizing;

use super::server::IDEMPOTENCY_KEY;
use super::token::Token;
use crate::tls::TlsError;

/// Client failures.
#[derive(Debug, thiserror::Error)]
pub enum OtpClientError {
    /// The base URL is unusable.
    #[error("invalid OTP server URL {0:?} (expected https://host[:port][/prefix])")]
    InvalidUrl(String),
    /// The CA bundle is unusable.
    #[error("OTP server CA: {0}")]
    Tls(#[from] TlsError),
    /// The server answered with an error status (on the last attempt, for a transient one).
    #[error("the OTP server answered {status}: {message}")]
    Status {
        /// HTTP status.
        status: StatusCode,
        /// The server's message.
        message: String,
    },
    /// No answer: connection refused or cut, name resolution, or no answer in time.
    #[error("the OTP server is unreachable: {0}")]
    Unreachable(String),
    /// The TLS handshake failed, e.g. the server's certificate is not signed by the configured CA.
    #[error("TLS with the OTP server failed: {0}")]
    Handshake(String),
    /// A success status with a body that is not what the endpoint answers.
    #[error("the OTP server's answer is not {0}")]
    UnexpectedAnswer(&'static str),
}

impl OtpClientError {
    /// Whether the same request may succeed later: no answer, or a transient status (5xx, 408,
    /// 429). Stores and revokes are idempotent, so retrying them is always safe; a redeem whose
    /// answer was lost may have consumed the key.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Status { status, .. } => transient(*status),
            Self::Unreachable(_) => true,
            Self::InvalidUrl(_) | Self::Tls(_) | Self::Handshake(_) | Self::UnexpectedAnswer(_) => {
                false
            }
        }
    }

    /// The HTTP status, if the server answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

fn transient(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
}

/// A failed request without an answer: [`OtpClientError::Handshake`] if TLS failed anywhere in
/// the error chain, else [`OtpClientError::Unreachable`].
fn transport_error(e: &(dyn std::error::Error + 'static)) -> OtpClientError {
    let mut parts: Vec<String> = Vec::new();
    let mut tls = false;
    let mut cur = Some(e);
    while let Some(err) = cur {
        tls |= err.is::<rustls::Error>();
        let part = err.to_string();
        if parts.last() != Some(&part) {
            parts.push(part);
        }
        // The TLS connector reports a failed handshake as io::Errors wrapping the rustls error,
        // and io::Error::source skips the wrapped error itself: step into it.
        let wrapped = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref);
        cur = match wrapped {
            Some(w) => Some(w as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    let msg = parts.join(": ");
    if tls {
        OtpClientError::Handshake(msg)
    } else {
        OtpClientError::Unreachable(msg)
    }
}

/// Percent-encodes a query value: everything but RFC 3986's unreserved characters.
fn query_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Which token an owner's store re-arms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rearm<'a> {
    /// None: a first store (a new token).
    No,
    /// This token, which the owner holds.
    Token(&'a str),
    /// The owner's latest token (the one its first store of the latest request created).
    Latest,
}

/// HTTPS client for one OTP server.
#[derive(Clone)]
pub struct OtpClient {
    base: String,
    bearer: std::sync::Arc<Zeroizing<String>>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// Attempts per store or revoke (≥1).
    pub attempts: u32,
    /// Limit per attempt.
    pub attempt_timeout: Duration,
    /// First back-off; doubles per attempt, capped at 2 s.
    pub backoff: Duration,
    /// Limit for a redeem, which the server may hold while it waits for a re-arm.
    pub redeem_timeout: Duration,
}

impl std::fmt::Debug for OtpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtpClient")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

/// Largest response body read (a key or a short message).
const MAX_RESPONSE: usize = 256 * 1024;

impl OtpClient {
    /// A client for the server at `base_url` (`https://host[:port][/prefix]`), trusting only
    /// `ca_pem`, authenticating stores and revokes with `bearer`.
    pub fn new(
        base_url: &str,
        ca_pem: &[u8],
        bearer: Zeroizing<String>,
    ) -> Result<Self, OtpClientError> {
        let base = base_url.trim_end_matches('/').to_owned();
        let ok = base
            .strip_prefix("https://")
            .is_some_and(|rest| !rest.is_empty() && !rest.contains(['?', '#', ' ']));
        if !ok || format!("{base}/otp").parse::<http::Uri>().is_err() {
            return Err(OtpClientError::InvalidUrl(base_url.to_owned()));
        }
        // hyper-rustls sets ALPN itself from the enabled HTTP versions.
        let tls = crate::tls::client_config_trusting(ca_pem, &[])?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .build();
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(https);
        Ok(Self {
            base,
            bearer: std::sync::Arc::new(bearer),
            client,
            attempts: 5,
            attempt_timeout: Duration::from_secs(10),
            backoff: Duration::from_millis(100),
            redeem_timeout: Duration::from_secs(120),
        })
    }

    /// The URL build steps POST their token to (the secret's `otp-server`), when they reach the
    /// server at the same address as the controller.
    pub fn otp_url(&self) -> String {
        format!("{}/otp", self.base)
    }

    async fn send(
        &self,
        path: &str,
        body: Bytes,
        headers: &[(&str, &str)],
        limit: Duration,
    ) -> Result<(StatusCode, Zeroizing<Vec<u8>>), OtpClientError> {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/octet-stream");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        // Only a header value from the caller can be invalid here.
        let req = req
            .body(Full::new(body))
            .map_err(|_| OtpClientError::InvalidUrl(format!("{}{path}", self.base)))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| transport_error(&e))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_RESPONSE)
                .collect()
                .await
                .map_err(|e| {
                    OtpClientError::Unreachable(format!("reading the answer ({status}): {e}"))
                })?
                .to_bytes();
            Ok((status, Zeroizing::new(body.to_vec())))
        };
        tokio::time::timeout(limit, fut)
            .await
            .map_err(|_| OtpClientError::Unreachable(format!("no answer within {limit:?}")))?
    }

    /// POSTs `body` to `path` with the bearer token, retrying transient failures with back-off;
    /// the success status and body.
    async fn call(
        &self,
        path: &str,
        body: Bytes,
        idempotency: Option<&str>,
    ) -> Result<(StatusCode, Zeroizing<Vec<u8>>), OtpClientError> {
        let auth = Zeroizing::new(format!("Bearer {}", self.bearer.as_str()));
        let mut headers = vec![(header::AUTHORIZATION.as_str(), auth.as_str())];
        if let Some(k) = idempotency {
            headers.push((IDEMPOTENCY_KEY, k));
        }
        let attempts = self.attempts.max(1);
        let mut attempt = 1;
        loop {
            let err = match self
                .send(path, body.clone(), &headers, self.attempt_timeout)
                .await
            {
                Ok((status, body)) if status.is_success() => return Ok((status, body)),
                Ok((status, body)) => OtpClientError::Status {
                    status,
                    message: String::from_utf8_lossy(&body).trim().to_owned(),
                },
                Err(e) => e,
            };
            if attempt >= attempts || !err.is_retryable() {
                return Err(match err {
                    OtpClientError::Unreachable(last) if attempt > 1 => {
                        OtpClientError::Unreachable(format!("{last} (after {attempt} attempts)"))
                    }
                    other => other,
                });
            }
            tracing::debug!(attempt, error = %err, "OTP request failed; retrying");
            let exp = self.backoff.saturating_mul(1 << (attempt - 1).min(5));
            tokio::time::sleep(exp.min(Duration::from_secs(2))).await;
            attempt += 1;
        }
    }

    async fn call_for_token(
        &self,
        path: &str,
        private_key: &[u8],
        idempotency: Option<&str>,
    ) -> Result<Token, OtpClientError> {
        let (_, body) = self
            .call(path, Bytes::copy_from_slice(private_key), idempotency)
            .await?;
        Token::parse(&body).map_err(|_| OtpClientError::UnexpectedAnswer("a token"))
    }

    /// Stores `private_key` the Go controller's way; returns the one-time token. Every attempt
    /// carries the same random idempotency key, so however many reach the server, one token
    /// redeems the key.
    pub async fn store_key(&self, private_key: &[u8]) -> Result<Token, OtpClientError> {
        let mut raw = [0u8; 16];
        aws_lc_rs::rand::fill(&mut raw).expect("system random number generator failed");
        let idempotency = hex::encode(raw);
        self.call_for_token("/store-key", private_key, Some(&idempotency))
            .await
    }

    /// Stores `private_key` for `owner` (the TaskRun UID) under `request_id` (the controller's id
    /// for this provisioning, stable across its retries: the same owner and request always get
    /// the same token and entry, across server restarts too). With `rearm` (a token this owner
    /// holds, e.g. the one a failed attempt used), that token redeems once more, with this key;
    /// the answer is that same token. Owner and request id: 1-128 visible ASCII characters.
    pub async fn store_key_for(
        &self,
        owner: &str,
        request_id: &str,
        rearm: Option<&str>,
        private_key: &[u8],
    ) -> Result<Token, OtpClientError> {
        let rearm = rearm.map_or(Rearm::No, Rearm::Token);
        self.store_key_owned(owner, request_id, rearm, None, private_key)
            .await
    }

    /// [`Self::store_key_for`] with the re-arm named by owner ([`Rearm::Latest`]: the token of
    /// the owner's latest first store, so the caller need not know it) and `rearms_left`: how
    /// many more times the owner may re-arm this token (the TaskRun's retries not yet started).
    /// A used token with none left is refused at once when redeemed again; without the
    /// parameter (older callers) a used owned token may always wait for a re-arm.
    pub async fn store_key_owned(
        &self,
        owner: &str,
        request_id: &str,
        rearm: Rearm<'_>,
        rearms_left: Option<u32>,
        private_key: &[u8],
    ) -> Result<Token, OtpClientError> {
        let mut path = format!(
            "/store-key?owner={}&request={}",
            query_value(owner),
            query_value(request_id)
        );
        match rearm {
            Rearm::No => {}
            Rearm::Token(t) => {
                path.push_str("&rearm=");
                path.push_str(&query_value(t.trim()));
            }
            Rearm::Latest => path.push_str("&rearm=latest"),
        }
        if let Some(n) = rearms_left {
            path.push_str(&format!("&rearms={n}"));
        }
        let token = self.call_for_token(&path, private_key, None).await?;
        if let Rearm::Token(t) = rearm
            && t.trim() != token.as_str()
        {
            return Err(OtpClientError::UnexpectedAnswer("the re-armed token"));
        }
        Ok(token)
    }

    /// Deletes every entry of `owner` (when its TaskRun ended); a redeem waiting on one of them
    /// is refused at once, and later stores for the owner are refused. Idempotent. Returns how
    /// many entries were deleted.
    pub async fn revoke(&self, owner: &str) -> Result<u64, OtpClientError> {
        let path = format!("/revoke?owner={}", query_value(owner));
        let (_, body) = self.call(&path, Bytes::new(), None).await?;
        std::str::from_utf8(&body)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or(OtpClientError::UnexpectedAnswer("a count"))
    }

    /// Redeems `token` once (what a build step does; used by tests and tools). Not retried: a
    /// lost answer means the key is gone.
    pub async fn redeem(&self, token: &str) -> Result<Zeroizing<Vec<u8>>, OtpClientError> {
        let (status, body) = self
            .send(
                "/otp",
                Bytes::copy_from_slice(token.as_bytes()),
                &[],
                self.redeem_timeout,
            )
            .await?;
        if status.is_success() {
            Ok(body)
        } else {
            Err(OtpClientError::Status {
                status,
                message: String::from_utf8_lossy(&body).trim().to_owned(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_validated() {
        crate::tls::install_crypto_provider();
        let ca = crate::certs::generate("otp", &["localhost".into()], 1)
            .unwrap()
            .ca_pem;
        let ok = |u: &str| OtpClient::new(u, ca.as_bytes(), Zeroizing::new("t".into()));
        assert_eq!(
            ok("https://otp.ns.svc:8443/").unwrap().otp_url(),
            "https://otp.ns.svc:8443/otp"
        );
        assert!(matches!(
            ok("http://otp"),
            Err(OtpClientError::InvalidUrl(_))
        ));
        assert!(matches!(ok("https://"), Err(OtpClientError::InvalidUrl(_))));
        assert!(matches!(
            ok("https://a b"),
            Err(OtpClientError::InvalidUrl(_))
        ));
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(query_value("uid-1_a.b~c"), "uid-1_a.b~c");
        assert_eq!(query_value("a b&c=d/é"), "a%20b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn retryable_errors() {
        let status = |s: u16| OtpClientError::Status {
            status: StatusCode::from_u16(s).unwrap(),
            message: String::new(),
        };
        for s in [500, 502, 503, 408, 429] {
            assert!(status(s).is_retryable(), "{s}");
        }
        for s in [400, 401, 403, 404, 409, 410, 413] {
            assert!(!status(s).is_retryable(), "{s}");
        }
        assert_eq!(status(410).status(), Some(StatusCode::GONE));
        assert!(OtpClientError::Unreachable("refused".into()).is_retryable());
        assert!(!OtpClientError::Handshake("bad certificate".into()).is_retryable());
        assert!(!OtpClientError::UnexpectedAnswer("a token").is_retryable());
    }

    #[test]
    fn tls_failures_are_told_apart_from_unreachable_servers() {
        // As the connector reports it: an io::Error wrapping tokio-rustls's io::Error.
        let wrapped = std::io::Error::other(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        ));
        let e = transport_error(&wrapped);
        assert!(
            matches!(&e, OtpClientError::Handshake(m) if m.contains("UnknownIssuer")),
            "{e:?}"
        );
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(matches!(
            transport_error(&refused),
            OtpClientError::Unreachable(_)
        ));
    }
}
