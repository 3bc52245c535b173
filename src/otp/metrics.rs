//! OTP server metrics (`multi_platform_controller_otp_*`), in the server's own registry. Label sets
//! are closed: `reason` takes only [`REASONS`], `endpoint` only [`ENDPOINTS`], `outcome` only
//! [`HOLD_OUTCOMES`].

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

use crate::metrics::name;

/// Every rejection reason, pre-registered so each series exists from the start.
pub const REASONS: [&str; 12] = [
    "unauthorized",
    "malformed",
    "too_large",
    "unknown",
    "used",
    "expired",
    "conflict",
    "forbidden",
    "revoked",
    "busy",
    "unavailable",
    "slow_body",
];

/// Endpoints whose latency is measured (a redeem that waited for a re-arm is measured in
/// `otp_hold_duration_seconds` instead).
pub const ENDPOINTS: [&str; 3] = ["store", "redeem", "revoke"];

/// How a redeem that waited for a re-arm ended.
pub const HOLD_OUTCOMES: [&str; 7] = [
    "served",
    "superseded",
    "revoked",
    "expired",
    "timed_out",
    "shutdown",
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
    /// Tokens re-armed with a new key for a retry attempt.
    pub rearmed: IntCounter,
    /// Entries deleted by revoking their owner.
    pub revoked: IntCounter,
    /// Redeems waiting for a re-arm now.
    pub held: IntGauge,
    /// Time redeems waited for a re-arm, by outcome, seconds.
    pub hold_duration: HistogramVec,
    /// Refused requests by reason.
    pub rejected: IntCounterVec,
    /// Entries waiting to be redeemed (exact after each purge, tracked in between).
    pub pending: IntGauge,
    /// Entries in the store, tombstones of redeemed keys included (exact after each purge,
    /// tracked in between): zero once every owner is revoked, so a leak shows here.
    pub entries: IntGauge,
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
            register(&registry, c)
        };
        let gauge = |n: &str, help: &str| {
            let g = IntGauge::with_opts(Opts::new(name(n), help)).expect("valid metric");
            register(&registry, g)
        };
        // Every series of a closed label set exists from the start.
        let histogram = |n: &str, help: &str, buckets: Vec<f64>, label: &str, values: &[&str]| {
            let opts = HistogramOpts::new(name(n), help).buckets(buckets);
            let h = register(
                &registry,
                HistogramVec::new(opts, &[label]).expect("valid metric"),
            );
            for v in values {
                h.with_label_values(&[v]);
            }
            h
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
        let rearmed = counter(
            "otp_rearmed",
            "Used tokens re-armed with a new key for a TaskRun retry attempt.",
        );
        let revoked = counter(
            "otp_revoked",
            "Entries deleted because their TaskRun ended (revoked by owner).",
        );
        let rejected = register(
            &registry,
            IntCounterVec::new(
                Opts::new(name("otp_rejected"), "Refused OTP requests by reason."),
                &["reason"],
            )
            .expect("valid metric"),
        );
        for r in REASONS {
            rejected.with_label_values(&[r]);
        }
        let pending = gauge("otp_pending", "Stored keys waiting to be redeemed.");
        let entries = gauge(
            "otp_entries",
            "Entries in the store, including tombstones of redeemed keys.",
        );
        let held = gauge(
            "otp_held",
            "Redeems of a used token waiting for its re-arm (a TaskRun retry attempt).",
        );
        let duration = histogram(
            "otp_request_duration_seconds",
            "OTP request latency by endpoint.",
            vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0],
            "endpoint",
            &ENDPOINTS,
        );
        let hold_duration = histogram(
            "otp_hold_duration_seconds",
            "Time a redeem of a used token waited for its re-arm, by outcome.",
            vec![0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 90.0, 120.0],
            "outcome",
            &HOLD_OUTCOMES,
        );
        Self {
            registry,
            stored,
            store_replayed,
            redeemed,
            expired,
            rearmed,
            revoked,
            held,
            hold_duration,
            rejected,
            pending,
            entries,
            duration,
        }
    }

    /// Counts a refusal; `reason` must be one of [`REASONS`].
    pub fn reject(&self, reason: &'static str) {
        debug_assert!(REASONS.contains(&reason));
        self.rejected.with_label_values(&[reason]).inc();
    }

    /// Records how a waiting redeem ended; `outcome` must be one of [`HOLD_OUTCOMES`].
    pub fn hold_ended(&self, outcome: &'static str, waited: std::time::Duration) {
        debug_assert!(HOLD_OUTCOMES.contains(&outcome));
        self.hold_duration
            .with_label_values(&[outcome])
            .observe(waited.as_secs_f64());
    }
}

fn register<M: prometheus::core::Collector + Clone + 'static>(registry: &Registry, m: M) -> M {
    registry
        .register(Box::new(m.clone()))
        .expect("unique metric");
    m
}

impl Default for OtpMetrics {
    fn default() -> Self {
        Self::new()
    }
}
