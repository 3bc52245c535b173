//! IAM tokens from an API key (`POST /identity/token`, grant type
//! `urn:ibm:params:oauth:grant-type:apikey`), cached and shared.
//!
//! The Go controller builds a new authenticator per call; here one token serves every call until
//! shortly before it expires, concurrent callers wait for one fetch instead of each fetching,
//! and a call answered 401 drops exactly the token it used (callers then fetch once and retry).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use zeroize::Zeroizing;

/// Tokens are refreshed this long before IAM says they expire.
pub const DEFAULT_REFRESH_MARGIN: Duration = Duration::from_secs(300);
const GRANT_TYPE: &str = "urn:ibm:params:oauth:grant-type:apikey";

/// Why no token could be had.
#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("IAM URL {0:?} is not https (plain http is allowed on loopback only)")]
    InvalidUrl(String),
    #[error("IAM request failed: {0}")]
    Transport(String),
    #[error("IAM refused the API key: HTTP {status}: {body}")]
    Refused { status: u16, body: String },
    #[error("IAM answer is not a token: {0}")]
    BadAnswer(String),
}

/// The cached token, pure: time is passed in.
#[derive(Debug, Default)]
pub struct TokenCache {
    token: Option<(Zeroizing<String>, Instant)>,
}

impl TokenCache {
    /// The cached token if it is still good for at least `margin` at `now`.
    pub fn current(&self, now: Instant, margin: Duration) -> Option<&str> {
        self.token
            .as_ref()
            .filter(|(_, exp)| now + margin < *exp)
            .map(|(t, _)| t.as_str())
    }
    /// Keeps `token`, valid for `expires_in` from `now`.
    pub fn store(&mut self, token: String, expires_in: Duration, now: Instant) {
        self.token = Some((Zeroizing::new(token), now + expires_in));
    }
    /// Drops `token` if it is the cached one (a 401 answered a call made with it); a newer token
    /// fetched meanwhile by another caller is kept.
    pub fn invalidate(&mut self, token: &str) {
        if self
            .token
            .as_ref()
            .is_some_and(|(t, _)| t.as_str() == token)
        {
            self.token = None;
        }
    }
}

type Https = hyper_rustls::HttpsConnector<HttpConnector>;

/// An IAM token source for one API key.
pub struct Iam {
    token_url: http::Uri,
    api_key: Zeroizing<String>,
    client: Client<Https, Full<Bytes>>,
    cache: tokio::sync::Mutex<TokenCache>,
    margin: Duration,
    timeout: Duration,
}

fn loopback_http(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `application/x-www-form-urlencoded` encoding of one value (everything but unreserved
/// characters percent-encoded).
fn form_encode(v: &str) -> Zeroizing<String> {
    let mut out = Zeroizing::new(String::with_capacity(v.len() * 3));
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Iam {
    /// A token source for `iam_url` (e.g. `https://iam.cloud.ibm.com`), trusting `tls`.
    pub fn new(
        iam_url: &str,
        api_key: impl Into<Zeroizing<String>>,
        tls: rustls::ClientConfig,
    ) -> Result<Self, IamError> {
        let api_key = api_key.into();
        let base = iam_url.trim_end_matches('/');
        if !(base.starts_with("https://") || loopback_http(base)) {
            return Err(IamError::InvalidUrl(iam_url.to_owned()));
        }
        let token_url = format!("{base}/identity/token")
            .parse()
            .map_err(|_| IamError::InvalidUrl(iam_url.to_owned()))?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(Self {
            token_url,
            api_key,
            client: Client::builder(TokioExecutor::new()).build(https),
            cache: tokio::sync::Mutex::new(TokenCache::default()),
            margin: DEFAULT_REFRESH_MARGIN,
            timeout: Duration::from_secs(30),
        })
    }

    /// Refreshes this long before expiry instead of [`DEFAULT_REFRESH_MARGIN`].
    pub fn with_refresh_margin(mut self, margin: Duration) -> Self {
        self.margin = margin;
        self
    }

    /// A bearer token, from the cache or, when it is missing or about to expire, from IAM (one
    /// fetch however many callers wait).
    pub async fn token(&self) -> Result<Zeroizing<String>, IamError> {
        let mut cache = self.cache.lock().await;
        if let Some(t) = cache.current(Instant::now(), self.margin) {
            return Ok(Zeroizing::new(t.to_owned()));
        }
        let (token, expires_in) = self.fetch().await?;
        cache.store(token.to_string(), expires_in, Instant::now());
        Ok(token)
    }

    /// A call made with `token` was answered 401: forget it.
    pub async fn invalidate(&self, token: &str) {
        self.cache.lock().await.invalidate(token);
    }

    async fn fetch(&self) -> Result<(Zeroizing<String>, Duration), IamError> {
        let body = Zeroizing::new(format!(
            "grant_type={}&apikey={}",
            *form_encode(GRANT_TYPE),
            *form_encode(&self.api_key)
        ));
        let req = http::Request::post(self.token_url.clone())
            .header("content-type", "application/x-www-form-urlencoded")
            .header("accept", "application/json")
            .body(Full::new(Bytes::from(body.as_bytes().to_vec())))
            .map_err(|e| IamError::Transport(e.to_string()))?;
        let resp = tokio::time::timeout(self.timeout, self.client.request(req))
            .await
            .map_err(|_| IamError::Transport("timed out".into()))?
            .map_err(|e| IamError::Transport(e.to_string()))?;
        let status = resp.status();
        let bytes = tokio::time::timeout(self.timeout, resp.into_body().collect())
            .await
            .map_err(|_| IamError::Transport("timed out reading the answer".into()))?
            .map_err(|e| IamError::Transport(e.to_string()))?
            .to_bytes();
        if !status.is_success() {
            let body = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned();
            return Err(IamError::Refused {
                status: status.as_u16(),
                body,
            });
        }
        #[derive(serde::Deserialize)]
        struct Answer {
            access_token: String,
            expires_in: u64,
        }
        let a: Answer =
            serde_json::from_slice(&bytes).map_err(|e| IamError::BadAnswer(e.to_string()))?;
        if a.access_token.is_empty() || a.expires_in == 0 {
            return Err(IamError::BadAnswer("empty token or no lifetime".into()));
        }
        Ok((
            Zeroizing::new(a.access_token),
            Duration::from_secs(a.expires_in),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_refreshes_before_expiry_and_drops_only_the_rejected_token() {
        let t0 = Instant::now();
        let margin = Duration::from_secs(300);
        let mut c = TokenCache::default();
        assert_eq!(c.current(t0, margin), None);
        c.store("a".into(), Duration::from_secs(3600), t0);
        assert_eq!(c.current(t0, margin), Some("a"));
        assert_eq!(c.current(t0 + Duration::from_secs(3299), margin), Some("a"));
        assert_eq!(c.current(t0 + Duration::from_secs(3300), margin), None);
        c.invalidate("old");
        assert_eq!(c.current(t0, margin), Some("a"));
        c.invalidate("a");
        assert_eq!(c.current(t0, margin), None);
    }

    #[test]
    fn form_values_are_percent_encoded() {
        assert_eq!(
            *form_encode("urn:ibm:params:oauth:grant-type:apikey"),
            "urn%3Aibm%3Aparams%3Aoauth%3Agrant-type%3Aapikey"
        );
        assert_eq!(*form_encode("a+b/c=d e"), "a%2Bb%2Fc%3Dd%20e");
    }

    #[test]
    fn only_https_or_loopback_http() {
        assert!(loopback_http("http://127.0.0.1:8080"));
        assert!(loopback_http("http://[::1]:1/x"));
        assert!(!loopback_http("http://iam.cloud.ibm.com"));
        assert!(!loopback_http("http://10.0.0.1"));
    }
}
