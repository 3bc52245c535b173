//! The webhook endpoint (`POST /mutate-taskrun`) and its metrics.
//!
//! Admission is CPU-bound and takes microseconds, so it runs directly in the handler.
//!
//! Every decided review logs inside one `admission_review` span: `review_uid` (the review's
//! `request.uid`), `namespace`, `taskrun` (the TaskRun's name; a field called `name` would be lost
//! in JSON logs, which write the span's own name under that key) and `uid`, the TaskRun's
//! `metadata.uid` when the object has one. A CREATE from the API server has none (the uid is
//! assigned after mutating admission), so a TaskRun's webhook lines are found by namespace and
//! name: `jq 'select(.span.namespace == "ns" and .span.taskrun == "tr")'`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};
use tower_http::timeout::TimeoutLayer;

use crate::admission::{self, Decision};
use crate::config_source::ConfigSource;
use crate::metrics;
use crate::serve::{BodyDeadline, declared_length};

/// Path the MutatingWebhookConfiguration calls.
pub const MUTATE_PATH: &str = "/mutate-taskrun";

/// Outcome label of a request that could not be read (HTTP 400/413).
pub const OUTCOME_BAD_REQUEST: &str = "bad_request";
/// Outcome label of a request answered 503 because no config is loaded yet.
pub const OUTCOME_UNAVAILABLE: &str = "unavailable";

/// `webhook_requests` and `webhook_request_duration_seconds`, by outcome.
#[derive(Clone, Debug)]
pub struct WebhookMetrics {
    /// Each outcome's series, resolved once: a label lookup per request hashes the label and
    /// takes the vector's lock, which showed up at tens of thousands of requests per second.
    series: std::sync::Arc<[(&'static str, IntCounter, Histogram)]>,
}

impl WebhookMetrics {
    /// Creates the webhook metrics and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                metrics::name("webhook_requests"),
                "Admission requests answered, by outcome (local, remote, unknown, denied, ignored, bad_request, unavailable).",
            ),
            &["outcome"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                metrics::name("webhook_request_duration_seconds"),
                "Time to decide one admission request and encode the answer, by outcome.",
            )
            .buckets(vec![
                0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
                0.01, 0.05, 0.25,
            ]),
            &["outcome"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        // Every series exists from the start, so rates and alerts see zeros instead of gaps.
        let series = Decision::OUTCOMES
            .iter()
            .chain(&[OUTCOME_BAD_REQUEST, OUTCOME_UNAVAILABLE])
            .map(|&o| {
                (
                    o,
                    requests.with_label_values(&[o]),
                    duration.with_label_values(&[o]),
                )
            })
            .collect();
        Ok(Self { series })
    }

    fn observe(&self, outcome: &str, started: Instant) {
        if let Some((_, count, took)) = self.series.iter().find(|(o, ..)| *o == outcome) {
            count.inc();
            took.observe(started.elapsed().as_secs_f64());
        }
    }
}

/// Request limits of the webhook endpoint.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest accepted body (413 above it).
    pub max_body_bytes: usize,
    /// Longest time to receive and answer one request (408 after it).
    pub request_timeout: Duration,
    /// How long the body may take to arrive (408 after it), within `request_timeout`.
    pub body: BodyDeadline,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            // See `--max-body-bytes`.
            max_body_bytes: 1536 * 1024 + 64 * 1024,
            request_timeout: Duration::from_secs(10),
            body: super::WEBHOOK_LIMITS.body,
        }
    }
}

/// What the webhook handler needs.
#[derive(Clone, Debug)]
pub struct WebhookState {
    /// The live host-config.
    pub config: ConfigSource,
    /// Metrics, when registered.
    pub metrics: Option<WebhookMetrics>,
    /// Current unix time in seconds (injected so tests can pin `allocation-start-time`).
    pub clock: fn() -> u64,
}

/// Seconds since the Unix epoch from the system clock.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The TLS-side router: `POST /mutate-taskrun` with body limit and timeout.
pub fn router(state: WebhookState, limits: Limits) -> Router {
    Router::new()
        .route(
            MUTATE_PATH,
            post(move |State(state): State<WebhookState>, request: Request| {
                mutate(state, limits, request)
            }),
        )
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            limits.request_timeout,
        ))
        .with_state(state)
}

/// Reads a body of at most `limits.max_body_bytes` within its body deadline; a larger declared
/// `Content-Length` is refused before anything is read.
async fn read_body(request: Request, limits: Limits) -> Result<Bytes, (StatusCode, &'static str)> {
    let too_large = (StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n");
    let max = limits.max_body_bytes;
    if declared_length(request.headers()).is_some_and(|n| n > max as u64) {
        return Err(too_large);
    }
    let deadline = limits.body.for_body(request.headers(), max);
    let read = axum::body::to_bytes(request.into_body(), max);
    let Ok(read) = tokio::time::timeout(deadline, read).await else {
        return Err((
            StatusCode::REQUEST_TIMEOUT,
            "request body not received in time\n",
        ));
    };
    read.map_err(|e| {
        let limit = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if limit {
            too_large
        } else {
            (StatusCode::BAD_REQUEST, "request body not read\n")
        }
    })
}

async fn mutate(state: WebhookState, limits: Limits, request: Request) -> Response {
    let started = Instant::now();
    let observe = |outcome: &str| {
        if let Some(m) = &state.metrics {
            m.observe(outcome, started);
        }
    };
    let body = match read_body(request, limits).await {
        Ok(b) => b,
        Err((status, text)) => {
            tracing::warn!(status = status.as_u16(), "webhook request body not read");
            observe(OUTCOME_BAD_REQUEST);
            return (status, text).into_response();
        }
    };
    let Some(config) = state.config.current() else {
        observe(OUTCOME_UNAVAILABLE);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "host-config is not loaded yet\n",
        )
            .into_response();
    };
    match admission::review(&body, &config, (state.clock)()) {
        Ok(r) => {
            // Made once the review is read, with every field at once: recording fields later
            // would re-serialise the span's JSON per field, on the hottest path there is.
            let span = tracing::info_span!(
                "admission_review",
                review_uid = %r.review_uid,
                namespace = %r.namespace,
                // Not `name`: the JSON log format writes the span's own name under that key.
                taskrun = %r.name,
                uid = r.uid.as_deref(),
            );
            let _review = span.enter();
            observe(r.decision.outcome());
            match r.decision {
                Decision::Denied | Decision::Unknown => tracing::info!(
                    decision = ?r.decision,
                    platform = r.platform.as_deref().unwrap_or(""),
                    "TaskRun with an unusable platform"
                ),
                _ => tracing::debug!(
                    decision = ?r.decision,
                    platform = r.platform.as_deref().unwrap_or(""),
                    patch_ops = r.patch_ops,
                    "TaskRun admitted"
                ),
            }
            ([(header::CONTENT_TYPE, "application/json")], r.response).into_response()
        }
        Err(error) => {
            tracing::warn!(%error, bytes = body.len(), "unreadable admission request");
            observe(OUTCOME_BAD_REQUEST);
            (StatusCode::BAD_REQUEST, format!("{error}\n")).into_response()
        }
    }
}
