//! Cloud metrics (`multi_platform_controller_cloud_*`). Every label has a bounded value set:
//! operations and outcomes are fixed enums, platforms come from the config, states from
//! [`InstanceState::ALL`], owners from [`Ownership`], termination reasons are the scheduler's
//! fixed strings.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::cloud::{ErrorClass, Instance, Operation};
use crate::metrics::name;
use crate::scheduler::{InstanceState, Ownership};

/// Outcome label of a successful call.
pub const SUCCESS: &str = "success";

const OWNERS: [Ownership; 3] = [Ownership::Ours, Ownership::Untagged, Ownership::Foreign];

fn owner_label(o: Ownership) -> &'static str {
    match o {
        Ownership::Ours => "ours",
        Ownership::Untagged => "untagged",
        Ownership::Foreign => "foreign",
    }
}

/// The cloud metrics of one process.
#[derive(Clone)]
pub struct CloudMetrics {
    calls: IntCounterVec,
    latency: HistogramVec,
    instances: IntGaugeVec,
    terminations: IntCounterVec,
    spot_fallbacks: IntCounterVec,
    launches: IntCounterVec,
    launch_rejected: IntGaugeVec,
    // The keys each platform's rejection series are set for, so a successful launch clears
    // exactly those.
    rejected_keys: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>,
}

impl std::fmt::Debug for CloudMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CloudMetrics")
    }
}

impl CloudMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self::unregistered()?;
        registry.register(Box::new(m.calls.clone()))?;
        registry.register(Box::new(m.latency.clone()))?;
        registry.register(Box::new(m.instances.clone()))?;
        registry.register(Box::new(m.terminations.clone()))?;
        registry.register(Box::new(m.spot_fallbacks.clone()))?;
        registry.register(Box::new(m.launches.clone()))?;
        registry.register(Box::new(m.launch_rejected.clone()))?;
        Ok(m)
    }

    /// Creates the metrics without registering them (tools and tests that do not export them).
    pub fn unregistered() -> Result<Self, prometheus::Error> {
        Ok(Self {
            calls: IntCounterVec::new(
                Opts::new(
                    name("cloud_api_calls"),
                    "Cloud API calls by operation and outcome (success or error class), retries included",
                ),
                &["operation", "outcome"],
            )?,
            latency: HistogramVec::new(
                HistogramOpts::new(
                    name("cloud_api_latency_seconds"),
                    "Latency of single cloud API calls, by operation",
                )
                .buckets(vec![
                    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                ]),
                &["operation"],
            )?,
            instances: IntGaugeVec::new(
                Opts::new(
                    name("cloud_instances"),
                    "Instances with the platform's instance tag by state and owner (ours, untagged: the Go controller's, foreign: another cluster's), as of the last listing",
                ),
                &["platform", "state", "owner"],
            )?,
            terminations: IntCounterVec::new(
                Opts::new(
                    name("cloud_terminations"),
                    "Instance terminations requested, by reason (orphans included)",
                ),
                &["platform", "reason"],
            )?,
            spot_fallbacks: IntCounterVec::new(
                Opts::new(
                    name("cloud_spot_fallbacks"),
                    "Spot launches refused and retried on-demand",
                ),
                &["platform"],
            )?,
            launches: IntCounterVec::new(
                Opts::new(
                    name("cloud_launches"),
                    "Instances launched, or adopted from an earlier try of the same launch",
                ),
                &["platform", "result"],
            )?,
            launch_rejected: IntGaugeVec::new(
                Opts::new(
                    name("cloud_launch_rejected"),
                    "1 while the platform's last launch was rejected for its configuration (key: the host-config key at fault, such as ami for InvalidAMIID.NotFound), 0 once a launch succeeds",
                ),
                &["platform", "key"],
            )?,
            rejected_keys: Arc::default(),
        })
    }

    /// Records one API call.
    pub(crate) fn call(&self, op: Operation, outcome: Result<(), ErrorClass>, elapsed: Duration) {
        let outcome = match outcome {
            Ok(()) => SUCCESS,
            Err(class) => class.as_str(),
        };
        self.calls.with_label_values(&[op.as_str(), outcome]).inc();
        self.latency
            .with_label_values(&[op.as_str()])
            .observe(elapsed.as_secs_f64());
    }

    /// Sets the per-state and per-owner instance counts of `platform` from a full listing.
    pub(crate) fn set_instances(&self, platform: &str, instances: &[Instance]) {
        for state in InstanceState::ALL {
            for owner in OWNERS {
                let n = instances
                    .iter()
                    .filter(|i| i.state == state && i.ownership == owner)
                    .count();
                self.instances
                    .with_label_values(&[&go_label(platform), state.as_str(), owner_label(owner)])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }

    /// Counts a termination requested for `reason`.
    pub(crate) fn terminated(&self, platform: &str, reason: &str) {
        self.terminations
            .with_label_values(&[&go_label(platform), reason])
            .inc();
    }

    /// Counts a spot launch that fell back to on-demand.
    pub(crate) fn spot_fallback(&self, platform: &str) {
        self.spot_fallbacks
            .with_label_values(&[&go_label(platform)])
            .inc();
    }

    /// Counts a launch (`adopted` when an earlier try's instance was found).
    pub(crate) fn launched(&self, platform: &str, adopted: bool) {
        let result = if adopted { "adopted" } else { "launched" };
        self.launches
            .with_label_values(&[&go_label(platform), result])
            .inc();
    }

    /// A launch of `platform` was rejected for its configuration: `key` is the host-config key at
    /// fault without the `dynamic.<platform>.` prefix (`ami`), `other` when unknown.
    pub(crate) fn launch_rejected(&self, platform: &str, key: &str) {
        let platform = go_label(platform);
        self.launch_rejected
            .with_label_values(&[&platform, key])
            .set(1);
        self.rejected_keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(platform)
            .or_default()
            .insert(key.to_owned());
    }

    /// A launch of `platform` succeeded: its rejection series go back to 0.
    pub(crate) fn launch_accepted(&self, platform: &str) {
        let platform = go_label(platform);
        let keys = self
            .rejected_keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&platform)
            .cloned()
            .unwrap_or_default();
        for key in keys {
            self.launch_rejected
                .with_label_values(&[&platform, &key])
                .set(0);
        }
    }

    /// The rejection gauge of a platform and key.
    pub fn launch_rejection(&self, platform: &str, key: &str) -> i64 {
        self.launch_rejected
            .with_label_values(&[&go_label(platform), key])
            .get()
    }

    /// Calls counted so far for an operation and outcome label (`success` or an error class).
    pub fn calls(&self, op: Operation, outcome: &str) -> u64 {
        self.calls.with_label_values(&[op.as_str(), outcome]).get()
    }

    /// Instances of a platform in a state, whoever launched them, as of the last listing.
    pub fn instances(&self, platform: &str, state: InstanceState) -> i64 {
        OWNERS
            .iter()
            .map(|o| {
                self.instances
                    .with_label_values(&[&go_label(platform), state.as_str(), owner_label(*o)])
                    .get()
            })
            .sum()
    }

    /// Instances of a platform launched by `owner`, in any state, as of the last listing.
    pub fn instances_of(&self, platform: &str, owner: Ownership) -> i64 {
        InstanceState::ALL
            .iter()
            .map(|s| {
                self.instances
                    .with_label_values(&[&go_label(platform), s.as_str(), owner_label(owner)])
                    .get()
            })
            .sum()
    }

    /// Terminations requested for a platform and reason.
    pub fn terminations(&self, platform: &str, reason: &str) -> u64 {
        self.terminations
            .with_label_values(&[&go_label(platform), reason])
            .get()
    }

    /// Spot fallbacks for a platform.
    pub fn spot_fallbacks(&self, platform: &str) -> u64 {
        self.spot_fallbacks
            .with_label_values(&[&go_label(platform)])
            .get()
    }

    /// Launches of a platform: `(launched, adopted)`.
    pub fn launches(&self, platform: &str) -> (u64, u64) {
        (
            self.launches
                .with_label_values(&[&go_label(platform), "launched"])
                .get(),
            self.launches
                .with_label_values(&[&go_label(platform), "adopted"])
                .get(),
        )
    }
}

/// The `platform` label in the Go controller's form (`linux-arm64`), whichever form callers pass,
/// so cloud series join the scheduler's and the config's.
fn go_label(platform: &str) -> String {
    crate::platform::label_value(platform)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejected_launch_sets_its_key_until_a_launch_succeeds() {
        let r = Registry::new();
        let m = CloudMetrics::new(&r).unwrap();
        m.launch_rejected("windows-4xlarge/amd64", "ami");
        m.launch_rejected("linux/arm64", "subnet-id");
        let text = crate::metrics::encode(&r);
        assert!(
            text.contains("multi_platform_controller_cloud_launch_rejected{key=\"ami\",platform=\"windows-4xlarge-amd64\"} 1"),
            "{text}"
        );
        m.launch_accepted("windows-4xlarge/amd64");
        assert_eq!(m.launch_rejection("windows-4xlarge/amd64", "ami"), 0);
        assert_eq!(m.launch_rejection("linux/arm64", "subnet-id"), 1);
    }

    #[test]
    fn registers_and_exports_bounded_series() {
        let r = Registry::new();
        let m = CloudMetrics::new(&r).unwrap();
        m.call(Operation::RunInstances, Ok(()), Duration::from_millis(20));
        m.call(
            Operation::RunInstances,
            Err(ErrorClass::Throttled),
            Duration::from_millis(5),
        );
        m.set_instances("linux/arm64", &[]);
        let text = crate::metrics::encode(&r);
        assert!(text.contains(
            "multi_platform_controller_cloud_api_calls{operation=\"RunInstances\",outcome=\"throttled\"} 1"
        ), "{text}");
        assert!(text.contains(
            "multi_platform_controller_cloud_api_latency_seconds_count{operation=\"RunInstances\"} 2"
        ));
        assert!(text.contains(
            "multi_platform_controller_cloud_instances{owner=\"foreign\",platform=\"linux-arm64\",state=\"stopped\"} 0"
        ), "{text}");
        assert!(
            CloudMetrics::new(&r).is_err(),
            "double registration is refused"
        );
    }
}
