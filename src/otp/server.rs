//! The HTTP side of the OTP server: `POST /store-key`, `POST /otp`, `/healthz` on the TLS port;
//! `/healthz` and `/metrics` on a separate plain-HTTP admin port, so the port build pods can reach
//! exposes nothing but the two endpoints they need.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use zeroize::Zeroizing;

use super::metrics::OtpMetrics;
use super::seal::Sealer;
use super::secret_file::SecretFile;
use super::store::{Redeemed, Refusal, Store, StoreConflict, StoreError, Stored};
use super::token::Token;

/// Header carrying a client-chosen idempotency key on `/store-key`.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Longest idempotency key accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 128;
/// Largest `/otp` body (a token plus whitespace).
const MAX_TOKEN_BODY: usize = 1024;

/// Shared state of the handlers.
pub struct AppState {
    /// Durable entries.
    pub store: Store,
    /// Seals keys and derives idempotent tokens.
    pub sealer: Arc<Sealer>,
    /// Bearer token required on `/store-key`.
    pub store_token: SecretFile,
    /// Entry lifetime.
    pub ttl: Duration,
    /// Largest private key accepted.
    pub max_key_bytes: usize,
    /// Metrics.
    pub metrics: OtpMetrics,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// The TLS port's routes.
pub fn router(state: Arc<AppState>, request_timeout: Duration) -> Router {
    Router::new()
        .route("/store-key", post(store_key))
        .route("/otp", post(redeem))
        .route("/healthz", get(|| async { "ok" }))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            request_timeout,
        ))
        .with_state(state)
}

/// The admin port's routes.
pub fn admin_router(metrics: OtpMetrics) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(move || {
                let body = crate::metrics::encode(&metrics.registry);
                async move { ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], body) }
            }),
        )
}

fn text(status: StatusCode, body: impl Into<Body>) -> Response {
    let mut r = (status, body.into()).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn refuse(
    state: &AppState,
    reason: &'static str,
    status: StatusCode,
    msg: &'static str,
) -> Response {
    state.metrics.reject(reason);
    tracing::info!(reason, status = status.as_u16(), "OTP request refused");
    text(status, format!("{msg}\n"))
}

fn unavailable(state: &AppState, e: &StoreError) -> Response {
    tracing::error!(error = %e, "OTP store failed");
    refuse(
        state,
        "unavailable",
        StatusCode::SERVICE_UNAVAILABLE,
        "storage unavailable, retry later",
    )
}

/// Reads at most `limit` bytes of body; `None` if it is larger (or the client broke off).
async fn read_body(body: Body, limit: usize) -> Option<Zeroizing<Vec<u8>>> {
    axum::body::to_bytes(body, limit)
        .await
        .ok()
        .map(|b| Zeroizing::new(b.to_vec()))
}

fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(expected) = state.store_token.current() else {
        return false;
    };
    let Some(presented) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
    else {
        return false;
    };
    aws_lc_rs::constant_time::verify_slices_are_equal(presented.trim_ascii(), &expected).is_ok()
}

async fn store_key(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let response = store_key_inner(&state, &headers, body).await;
    state
        .metrics
        .duration
        .with_label_values(&["store"])
        .observe(started.elapsed().as_secs_f64());
    response
}

async fn store_key_inner(state: &AppState, headers: &HeaderMap, body: Body) -> Response {
    // The (bounded) body is read before answering even a refusal: HTTP/2 clients such as curl
    // report an unread request body as a stream error instead of showing the status.
    let body = read_body(body, state.max_key_bytes).await;
    if !authorized(state, headers) {
        let mut r = refuse(
            state,
            "unauthorized",
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        );
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    let Some(key) = body else {
        return refuse(
            state,
            "too_large",
            StatusCode::PAYLOAD_TOO_LARGE,
            "key too large",
        );
    };
    let idempotency = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(v) => {
            let b = v.as_bytes();
            if b.is_empty() || b.len() > MAX_IDEMPOTENCY_KEY || !b.iter().all(u8::is_ascii_graphic)
            {
                return refuse(
                    state,
                    "malformed",
                    StatusCode::BAD_REQUEST,
                    "idempotency-key must be 1-128 visible ASCII characters",
                );
            }
            Some(b.to_vec())
        }
    };
    if key.trim_ascii().is_empty() {
        return refuse(state, "malformed", StatusCode::BAD_REQUEST, "empty key");
    }
    let token = idempotency
        .as_deref()
        .map_or_else(Token::random, |k| state.sealer.token_for(k));
    let hash = token.hash();
    let sealed = state.sealer.seal(&hash.0, &key);
    match state.store.store(hash, sealed, key, state.ttl).await {
        Ok(Ok(stored)) => {
            let status = match stored {
                Stored::Created => {
                    state.metrics.stored.inc();
                    state.metrics.pending.inc();
                    StatusCode::CREATED
                }
                Stored::Replayed => {
                    state.metrics.store_replayed.inc();
                    StatusCode::OK
                }
            };
            tracing::info!(entry = %hash.log_id(), replayed = (stored == Stored::Replayed), "key stored");
            text(status, token.as_str().to_owned())
        }
        Ok(Err(StoreConflict::DifferentKey)) => refuse(
            state,
            "conflict",
            StatusCode::CONFLICT,
            "idempotency-key already used for a different key",
        ),
        Ok(Err(StoreConflict::AlreadyRedeemed)) => refuse(
            state,
            "conflict",
            StatusCode::CONFLICT,
            "this request's key was already redeemed",
        ),
        Err(e) => unavailable(state, &e),
    }
}

async fn redeem(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let started = Instant::now();
    let response = redeem_inner(&state, body).await;
    state
        .metrics
        .duration
        .with_label_values(&["redeem"])
        .observe(started.elapsed().as_secs_f64());
    response
}

async fn redeem_inner(state: &AppState, body: Body) -> Response {
    let Some(body) = read_body(body, MAX_TOKEN_BODY).await else {
        return refuse(
            state,
            "too_large",
            StatusCode::PAYLOAD_TOO_LARGE,
            "body too large",
        );
    };
    let Ok(token) = Token::parse(&body) else {
        return refuse(
            state,
            "malformed",
            StatusCode::BAD_REQUEST,
            "malformed token",
        );
    };
    let hash = token.hash();
    match state.store.redeem(hash).await {
        Ok(Redeemed::Key(key)) => {
            state.metrics.redeemed.inc();
            state.metrics.pending.dec();
            tracing::info!(entry = %hash.log_id(), "key redeemed");
            text(StatusCode::OK, key.to_vec())
        }
        Ok(Redeemed::Refused(Refusal::Unknown)) => {
            refuse(state, "unknown", StatusCode::NOT_FOUND, "unknown token")
        }
        Ok(Redeemed::Refused(Refusal::Used)) => {
            refuse(state, "used", StatusCode::GONE, "token already used")
        }
        Ok(Redeemed::Refused(Refusal::Expired)) => {
            refuse(state, "expired", StatusCode::GONE, "token expired")
        }
        Err(e) => unavailable(state, &e),
    }
}
