//! Helpers for tests against the test API server: a small HTTPS admission webhook whose answers
//! the test scripts, and polling.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// RFC 3339 with seconds, as the API server writes timestamps.
pub use crate::meta::timestamp;

/// Decides a webhook's answer from the AdmissionReview `request`: returns the `response` fields
/// other than `uid` (e.g. `{"allowed": true, "patch": [..JSON patch..]}`; a `patch` given as a
/// JSON array is base64-encoded for you).
pub type Decide = dyn Fn(&Value) -> Value + Send + Sync;

struct HookState {
    decide: Box<Decide>,
    seen: Mutex<Vec<Value>>,
    delay: Mutex<Duration>,
}

/// An HTTPS admission webhook on 127.0.0.1 with its own CA.
pub struct TestWebhook {
    addr: SocketAddr,
    ca_pem: String,
    state: Arc<HookState>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for TestWebhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestWebhook")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

async fn review(State(st): State<Arc<HookState>>, body: axum::Json<Value>) -> axum::Json<Value> {
    let req = body.0["request"].clone();
    st.seen
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(req.clone());
    let delay = *st.delay.lock().unwrap_or_else(|e| e.into_inner());
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut resp = (st.decide)(&req);
    resp["uid"] = req["uid"].clone();
    if resp["patch"].is_array() {
        use base64::Engine;
        let p = serde_json::to_vec(&resp["patch"]).unwrap_or_default();
        resp["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(p));
        resp["patchType"] = json!("JSONPatch");
    }
    axum::Json(
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}),
    )
}

impl TestWebhook {
    /// Starts the webhook (certificate for `127.0.0.1` and `localhost`); `decide` answers each
    /// review.
    pub async fn start(
        decide: impl Fn(&Value) -> Value + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        Self::start_with_names(&["127.0.0.1", "localhost"], decide).await
    }

    /// Like [`TestWebhook::start`] with a certificate for `names` (e.g. a Service's
    /// `name.namespace.svc`).
    pub async fn start_with_names(
        names: &[&str],
        decide: impl Fn(&Value) -> Value + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        mpc::tls::install_crypto_provider();
        let sans: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let bundle =
            mpc::certs::generate("e2e-webhook", &sans, 1).map_err(std::io::Error::other)?;
        let dir = tempfile::tempdir()?;
        mpc::certs::write_bundle(&bundle, dir.path()).map_err(std::io::Error::other)?;
        let cert = mpc::tls::ReloadingCert::load(mpc::tls::CertPaths::in_dir(dir.path()))
            .map_err(std::io::Error::other)?;
        let mut tls = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_cert_resolver(cert);
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(HookState {
            decide: Box::new(decide),
            seen: Mutex::new(Vec::new()),
            delay: Mutex::new(Duration::ZERO),
        });
        let app = axum::Router::new()
            .fallback(axum::routing::post(review))
            .with_state(Arc::clone(&state));
        let cancel = CancellationToken::new();
        tokio::spawn(mpc::serve::serve_tls(
            listener,
            Arc::new(tls),
            app,
            cancel.clone(),
            mpc::serve::ServeOptions::default(),
        ));
        Ok(Self {
            addr,
            ca_pem: bundle.ca_pem,
            state,
            cancel,
        })
    }

    /// `https://127.0.0.1:<port>/mutate`.
    pub fn url(&self) -> String {
        format!("https://{}/mutate", self.addr)
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The CA that signed the webhook's certificate (PEM).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Every AdmissionReview `request` received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.state
            .seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes every later answer wait this long.
    pub fn set_delay(&self, d: Duration) {
        *self.state.delay.lock().unwrap_or_else(|e| e.into_inner()) = d;
    }
}

impl Drop for TestWebhook {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Polls `check` every 20 ms until it returns `Some`, or panics with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
