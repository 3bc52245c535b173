//! The controller's side of the OTP server: store a key, get the one-time token.
//!
//! Every attempt of one [`OtpClient::store_key`] call carries the same random `Idempotency-Key`,
//! and the server derives the token from it, so a retry after a lost response gets the same token
//! instead of leaving a second redeemable copy of the key behind.

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
    /// The server refused our bearer token.
    #[error("the OTP server refused the store token (401)")]
    Unauthorized,
    /// The server refused the request (a 4xx other than 401); retrying will not help.
    #[error("the OTP server refused the request ({status}): {message}")]
    Rejected {
        /// HTTP status.
        status: StatusCode,
        /// The server's short reason.
        message: String,
    },
    /// Every attempt failed with a transient error.
    #[error("the OTP server is unavailable after {attempts} attempts: {last}")]
    Unavailable {
        /// Attempts made.
        attempts: u32,
        /// The last error.
        last: String,
    },
}

/// HTTPS client for one OTP server.
#[derive(Clone)]
pub struct OtpClient {
    base: String,
    bearer: std::sync::Arc<Zeroizing<String>>,
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// Attempts per store (≥1).
    pub attempts: u32,
    /// Limit per attempt.
    pub attempt_timeout: Duration,
    /// First back-off; doubles per attempt, capped at 2 s.
    pub backoff: Duration,
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
    /// `ca_pem`, authenticating stores with `bearer`.
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
    ) -> Result<(StatusCode, Zeroizing<Vec<u8>>), String> {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/octet-stream");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| format!("building the request: {e}"))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("{e:#}"))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_RESPONSE)
                .collect()
                .await
                .map_err(|e| format!("reading the response: {e}"))?
                .to_bytes();
            Ok((status, Zeroizing::new(body.to_vec())))
        };
        tokio::time::timeout(self.attempt_timeout, fut)
            .await
            .map_err(|_| format!("no response within {:?}", self.attempt_timeout))?
    }

    /// Stores `private_key`; returns the one-time token. Transient failures (connection errors,
    /// timeouts, 408, 429, 5xx) are retried with the same idempotency key, so however many
    /// attempts reach the server, one token redeems the key.
    pub async fn store_key(&self, private_key: &[u8]) -> Result<Token, OtpClientError> {
        let mut raw = [0u8; 16];
        aws_lc_rs::rand::fill(&mut raw).expect("system random number generator failed");
        let idempotency = hex::encode(raw);
        let auth = Zeroizing::new(format!("Bearer {}", self.bearer.as_str()));
        let body = Bytes::copy_from_slice(private_key);
        let attempts = self.attempts.max(1);
        let mut last = String::new();
        for attempt in 1..=attempts {
            if attempt > 1 {
                let exp = self.backoff.saturating_mul(1 << (attempt - 2).min(5));
                tokio::time::sleep(exp.min(Duration::from_secs(2))).await;
            }
            let headers = [
                (header::AUTHORIZATION.as_str(), auth.as_str()),
                (IDEMPOTENCY_KEY, idempotency.as_str()),
            ];
            match self.send("/store-key", body.clone(), &headers).await {
                Ok((status, body)) if status.is_success() => {
                    return Token::parse(&body).map_err(|_| OtpClientError::Rejected {
                        status,
                        message: "the server answered with something that is not a token".into(),
                    });
                }
                Ok((StatusCode::UNAUTHORIZED, _)) => return Err(OtpClientError::Unauthorized),
                Ok((status, body))
                    if status.is_server_error()
                        || status == StatusCode::REQUEST_TIMEOUT
                        || status == StatusCode::TOO_MANY_REQUESTS =>
                {
                    last = format!("{status}: {}", String::from_utf8_lossy(&body).trim());
                }
                Ok((status, body)) => {
                    return Err(OtpClientError::Rejected {
                        status,
                        message: String::from_utf8_lossy(&body).trim().to_owned(),
                    });
                }
                Err(e) => last = e,
            }
            tracing::debug!(attempt, error = %last, "OTP store attempt failed; retrying");
        }
        Err(OtpClientError::Unavailable { attempts, last })
    }

    /// Redeems `token` once (what a build step does; used by tests and tools). Not retried: a
    /// lost response means the key is gone.
    pub async fn redeem(&self, token: &str) -> Result<Zeroizing<Vec<u8>>, OtpClientError> {
        match self
            .send("/otp", Bytes::copy_from_slice(token.as_bytes()), &[])
            .await
        {
            Ok((status, body)) if status.is_success() => Ok(body),
            Ok((status, body)) => Err(OtpClientError::Rejected {
                status,
                message: String::from_utf8_lossy(&body).trim().to_owned(),
            }),
            Err(last) => Err(OtpClientError::Unavailable { attempts: 1, last }),
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
}
