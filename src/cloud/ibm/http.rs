//! One JSON call to an IBM Cloud API with a bearer token from [`Iam`]: the token is refreshed once
//! when the API answers 401 (it expired or was revoked mid-flight), and an error answer keeps
//! IBM's error code (`errors[0].code` of VPC and tagging, `error` of Power VS).

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::iam::{Iam, IamError};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(transparent)]
    Iam(#[from] IamError),
    #[error("{0}")]
    Transport(String),
    #[error("HTTP {status}{}: {message}", code.as_deref().map(|c| format!(" {c}")).unwrap_or_default())]
    Http {
        status: u16,
        code: Option<String>,
        message: String,
    },
    #[error("answer is not what the API documents: {0}")]
    BadAnswer(String),
}

impl CallError {
    /// The HTTP status of an error answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Http { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// True for `https://` URLs and for plain `http://` to a loopback address (tests and emulators).
pub fn endpoint_ok(url: &str) -> bool {
    if url.starts_with("https://") {
        return true;
    }
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let host = rest.split(['/', '?']).next().unwrap_or_default();
    let host = match host.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

type Https = hyper_rustls::HttpsConnector<HttpConnector>;

/// The HTTP client every IBM API call goes through.
#[derive(Clone)]
pub struct Http {
    client: Client<Https, Full<Bytes>>,
    timeout: Duration,
}

impl std::fmt::Debug for Http {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Http")
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Percent-encodes a query value (everything but unreserved characters).
pub fn encode(v: &str) -> String {
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

impl Http {
    /// A client trusting `tls`; one call (answer included) may take `timeout`.
    pub fn new(tls: rustls::ClientConfig, timeout: Duration) -> Self {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Self {
            client: Client::builder(TokioExecutor::new()).build(https),
            timeout,
        }
    }

    /// Sends `method url` with a bearer token, `headers` and a JSON `body`; the JSON answer
    /// (`Null` for an empty one). A 401 drops the token and tries once more with a fresh one.
    pub async fn call(
        &self,
        iam: &Iam,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<&Value>,
    ) -> Result<Value, CallError> {
        if !endpoint_ok(url) {
            return Err(CallError::Transport(format!(
                "{url:?} is not https (plain http is allowed on loopback only)"
            )));
        }
        let payload = body.map(|b| b.to_string()).unwrap_or_default();
        for attempt in 0..2 {
            let token = iam.token().await?;
            let mut req = http::Request::builder()
                .method(method.clone())
                .uri(url)
                .header("authorization", format!("Bearer {}", token.as_str()))
                .header("accept", "application/json");
            if body.is_some() {
                req = req.header("content-type", "application/json");
            }
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let req = req
                .body(Full::new(Bytes::from(payload.clone())))
                .map_err(|e| CallError::Transport(e.to_string()))?;
            let resp = tokio::time::timeout(self.timeout, self.client.request(req))
                .await
                .map_err(|_| CallError::Transport("timed out".into()))?
                .map_err(|e| CallError::Transport(e.to_string()))?;
            let status = resp.status().as_u16();
            let bytes = tokio::time::timeout(self.timeout, resp.into_body().collect())
                .await
                .map_err(|_| CallError::Transport("timed out reading the answer".into()))?
                .map_err(|e| CallError::Transport(e.to_string()))?
                .to_bytes();
            if status == 401 && attempt == 0 {
                iam.invalidate(token.as_str()).await;
                continue;
            }
            if !(200..300).contains(&status) {
                return Err(http_error(status, &bytes));
            }
            if bytes.iter().all(u8::is_ascii_whitespace) {
                return Ok(Value::Null);
            }
            return serde_json::from_slice(&bytes).map_err(|e| CallError::BadAnswer(e.to_string()));
        }
        unreachable!("the second attempt returns")
    }
}

/// IBM's code and message from an error answer, whichever API's shape it has.
fn http_error(status: u16, bytes: &[u8]) -> CallError {
    let v: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
    let s = |p: &str| v.pointer(p).and_then(Value::as_str).map(str::to_owned);
    let code = s("/errors/0/code")
        .or_else(|| s("/errorCode"))
        .or_else(|| s("/error"));
    let message = s("/errors/0/message")
        .or_else(|| s("/errorMessage"))
        .or_else(|| s("/description"))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned());
    CallError::Http {
        status,
        code,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_answers_keep_ibms_code_in_each_apis_shape() {
        let vpc =
            br#"{"errors":[{"code":"not_found","message":"Instance not found"}],"trace":"t"}"#;
        assert!(matches!(
            http_error(404, vpc),
            CallError::Http { status: 404, code: Some(c), message } if c == "not_found" && message == "Instance not found"
        ));
        let power = br#"{"description":"volume is busy","error":"conflict"}"#;
        assert!(matches!(
            http_error(409, power),
            CallError::Http { code: Some(c), message, .. } if c == "conflict" && message == "volume is busy"
        ));
        assert!(matches!(
            http_error(502, b"<html>bad gateway</html>"),
            CallError::Http { code: None, message, .. } if message.contains("bad gateway")
        ));
    }

    #[test]
    fn only_https_or_loopback_http() {
        assert!(endpoint_ok("https://us-east.iaas.cloud.ibm.com/v1"));
        assert!(endpoint_ok("http://127.0.0.1:8080/v1/instances?x=1"));
        assert!(endpoint_ok("http://[::1]:1"));
        assert!(!endpoint_ok("http://us-east.iaas.cloud.ibm.com"));
        assert!(!endpoint_ok("http://10.0.0.1/v1"));
        assert_eq!(encode("a b:c/d"), "a%20b%3Ac%2Fd");
    }
}
