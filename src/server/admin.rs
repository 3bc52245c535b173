//! The plain-HTTP admin port: `/healthz`, `/readyz`, `/metrics`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::Registry;

use crate::config_source::ConfigSource;
use crate::metrics;

/// What `/readyz` reports: ready once the serving certificate and the config are loaded, and
/// not ready again as soon as shutdown begins (so endpoints drop the pod before it stops).
#[derive(Clone, Debug)]
pub struct Readiness {
    cert_loaded: Arc<AtomicBool>,
    stopping: Arc<AtomicBool>,
    config: ConfigSource,
}

impl Readiness {
    /// Not ready until [`Readiness::set_cert_loaded`] and the config source has a config.
    pub fn new(config: ConfigSource) -> Self {
        Self {
            cert_loaded: Arc::new(AtomicBool::new(false)),
            stopping: Arc::new(AtomicBool::new(false)),
            config,
        }
    }

    /// Marks the serving certificate as loaded.
    pub fn set_cert_loaded(&self) {
        self.cert_loaded.store(true, Ordering::Release);
    }

    /// Marks the process as shutting down.
    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// `Ok` when ready, else every reason why not.
    pub fn check(&self) -> Result<(), Vec<&'static str>> {
        let mut why = Vec::new();
        if self.stopping.load(Ordering::Acquire) {
            why.push("shutting down");
        }
        if !self.cert_loaded.load(Ordering::Acquire) {
            why.push("serving certificate not loaded");
        }
        if !self.config.is_loaded() {
            why.push("host-config not loaded");
        }
        if why.is_empty() { Ok(()) } else { Err(why) }
    }
}

/// What the admin handlers need.
#[derive(Clone, Debug)]
pub struct AdminState {
    /// Readiness inputs.
    pub readiness: Readiness,
    /// The registry `/metrics` renders.
    pub registry: Registry,
}

/// The admin router.
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(state)
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    match state.readiness.check() {
        Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", why.join("; ")),
        ),
    }
}

async fn metrics_text(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        metrics::encode(&state.registry),
    )
}
