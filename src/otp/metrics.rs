//! OTP server metrics (`multi_platform_controller_otp_*`), in the server's own registry. Label sets
//! are closed: `reason` takes only [`REASONS`], `endpoint` only `store` and `redeem`.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use crate::metrics::name;

/// Every rejection reason, pre-registered so each series exists from the start.
pub const REASONS: [&str; 8] = [
    "unauthorized",
    "malformed",
    "too_large",
    "unknown",
    "used",
    "expired",
    "conflict",
    "unavailable",
];

/// The OTP server's metrics.
#[derive(Clone)]
pub struct OtpMetrics {
    /// Registry holding them all.
    pub registry: Registry,
    /// Keys stored (new entries).
    pub stored: IntCounter,
    /// Retried stores answered with the existing token.
    pub store_replayed: IntCounter,
    /// Keys handed out.
    pub redeemed: IntCounter,
    /// Entries that expired without being redeemed (counted when purged).
    pub expired: IntCounter,
    /// Refused requests by reason.
    pub rejected: IntCounterVec,
    /// Entries waiting to be redeemed (exact after each purge, tracked in between).
    pub pending: IntGauge,
    /// Request latency by endpoint, seconds.
    pub duration: HistogramVec,
}

impl std::fmt::Debug for OtpMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OtpMetrics").finish_non_exhaustive()
    }
}

impl OtpMetrics {
    /// Creates and registers the metrics.
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |n: &str, help: &str| {
            let c = IntCounter::with_opts(Opts::new(name(n), help)).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let stored = counter("otp_stored", "Private keys stored for one-time redemption.");
        let store_replayed = counter(
            "otp_store_replayed",
            "Retried store requests answered with the token already issued.",
        );
        let redeemed = counter(
            "otp_redeemed",
            "Private keys handed out (each exactly once).",
        );
        let expired = counter(
            "otp_expired",
            "Stored keys that expired without being redeemed.",
        );
        let rejected = IntCounterVec::new(
            Opts::new(name("otp_rejected"), "Refused OTP requests by reason."),
            &["reason"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(rejected.clone()))
            .expect("unique metric");
        for r in REASONS {
            rejected.with_label_values(&[r]);
        }
        let pending = IntGauge::with_opts(Opts::new(
            name("otp_pending"),
            "Stored keys waiting to be redeemed.",
        ))
        .expect("valid metric");
        registry
            .register(Box::new(pending.clone()))
            .expect("unique metric");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                name("otp_request_duration_seconds"),
                "OTP request latency by endpoint.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ]),
            &["endpoint"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(duration.clone()))
            .expect("unique metric");
        for e in ["store", "redeem"] {
            duration.with_label_values(&[e]);
        }
        Self {
            registry,
            stored,
            store_replayed,
            redeemed,
            expired,
            rejected,
            pending,
            duration,
        }
    }

    /// Counts a refusal; `reason` must be one of [`REASONS`].
    pub fn reject(&self, reason: &'static str) {
        debug_assert!(REASONS.contains(&reason));
        self.rejected.with_label_values(&[reason]).inc();
    }
}

impl Default for OtpMetrics {
    fn default() -> Self {
        Self::new()
    }
}
