//! The scheduler's metric families (docs/metrics.md; `platform_pool_size`, `platform_capacity` and
//! `config_errors` belong to the config source), under the Go controller's names, labels, buckets
//! and meaning, plus ours: queue wait, time to a ready host, build time, queue length and age,
//! actions in flight and failed, leadership. `docs/metrics.md` gives each family's exact start
//! and end; the values come from the scheduler's [`Observation`]s.
//!
//! Go registers one unlabelled histogram per platform with a constant `platform` label; the
//! exposition is the same as a vector labelled `platform`, which is what this is. Counters carry
//! no `_total`. Gauges of the ledger are set from [`Gauges`] on every pass, so a platform or
//! namespace that emptied reads zero rather than its last value.

use prometheus::{
    Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use crate::metrics::name;
use crate::platform::Platform;
use crate::scheduler::{Gauges, Invariant, Observation, Time};

/// Go's buckets for allocation and wait times.
const SMALL_BUCKETS: &[f64] = &[
    1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
];
/// Go's buckets for task run times.
const BIG_BUCKETS: &[f64] = &[
    20.0, 40.0, 60.0, 90.0, 120.0, 300.0, 600.0, 1200.0, 2400.0, 4800.0, 6000.0, 7200.0, 8400.0,
    9600.0,
];
/// Queue waits: most are zero or sub-second while there is room.
const QUEUE_BUCKETS: &[f64] = &[
    0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];
/// Creation to a ready host: seconds on a free static host, minutes through a cloud boot.
const READY_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
];

/// The controller's families.
#[derive(Clone)]
pub struct ControllerMetrics {
    allocation_time: HistogramVec,
    wait_time: HistogramVec,
    task_run_time: HistogramVec,
    queue_wait: HistogramVec,
    host_ready: HistogramVec,
    build_time: HistogramVec,
    provisioning_failures: IntCounterVec,
    provisioning_successes: IntCounterVec,
    cleanup_failures: IntCounterVec,
    host_allocation_failures: IntCounterVec,
    available: IntGaugeVec,
    unlisted: IntGaugeVec,
    running_tasks: IntGaugeVec,
    waiting_tasks: IntGaugeVec,
    queue_length: IntGaugeVec,
    queue_oldest: GaugeVec,
    instances: IntGaugeVec,
    scrub_held: IntGaugeVec,
    actions_in_flight: IntGaugeVec,
    action_failures: IntCounterVec,
    state_violations: IntCounterVec,
    leader: Gauge,
    group_limit: IntGaugeVec,
    group_in_use: IntGaugeVec,
    group_waiting: IntGaugeVec,
}

impl ControllerMetrics {
    /// Creates and registers every family.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let histogram = |n: &str, help: &str, buckets: &[f64]| {
            HistogramVec::new(
                HistogramOpts::new(name(n), help).buckets(buckets.to_vec()),
                &["platform"],
            )
        };
        let counter = |n: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name(n), help), labels)
        };
        let gauge = |n: &str, help: &str, labels: &[&str]| {
            IntGaugeVec::new(Opts::new(name(n), help), labels)
        };
        let m = ControllerMetrics {
            allocation_time: histogram(
                "host_allocation_time",
                "The time in seconds it takes to allocate a host, excluding wait time. In practice this is the amount of time it takes a cloud provider to start an instance",
                SMALL_BUCKETS,
            )?,
            wait_time: histogram(
                "wait_time",
                "The time in seconds a task has spent waiting for a host to become available, excluding the host allocation time",
                SMALL_BUCKETS,
            )?,
            task_run_time: histogram(
                "task_run_time",
                "The total time taken by a task, including wait and allocation time",
                BIG_BUCKETS,
            )?,
            queue_wait: histogram(
                "queue_wait_seconds",
                "Time in seconds each TaskRun needing a host spent in the platform's queue, from joining it to its placement (zero when placed at once)",
                QUEUE_BUCKETS,
            )?,
            host_ready: histogram(
                "host_ready_seconds",
                "Time in seconds from a TaskRun's creation to its secret naming a provisioned host (queue, instance boot and provisioning)",
                READY_BUCKETS,
            )?,
            build_time: histogram(
                "build_time_seconds",
                "Time in seconds from a TaskRun's secret naming a host to the TaskRun finishing",
                BIG_BUCKETS,
            )?,
            provisioning_failures: counter(
                "provisioning_failures",
                "The number of times a provisioning task has failed",
                &["platform"],
            )?,
            provisioning_successes: counter(
                "provisioning_successes",
                "The number of times a provisioning task has succeeded",
                &["platform"],
            )?,
            cleanup_failures: counter(
                "cleanup_failures",
                "The number of times a cleanup task has failed",
                &["platform"],
            )?,
            host_allocation_failures: counter(
                "host_allocation_failures",
                "The number of times host allocation has failed",
                &["platform"],
            )?,
            available: gauge(
                "available",
                "The availability of the multi platform controller",
                &["platform"],
            )?,
            running_tasks: gauge(
                "running_tasks",
                "The number of currently running tasks on this platform",
                &["platform", "taskrun_namespace"],
            )?,
            waiting_tasks: gauge(
                "waiting_tasks",
                "The number of tasks waiting for an executor to be available to run",
                &["platform", "taskrun_namespace"],
            )?,
            queue_length: gauge(
                "queue_length",
                "TaskRuns queued for capacity on the platform",
                &["platform"],
            )?,
            queue_oldest: GaugeVec::new(
                Opts::new(
                    name("queue_oldest_seconds"),
                    "Age in seconds of the longest-waiting queued TaskRun of the platform (0 when none waits)",
                ),
                &["platform"],
            )?,
            instances: gauge(
                "scheduler_instances",
                "Cloud instances in the scheduler's ledger by state (booting, ready, terminating; leaked: termination kept failing, still counted against max-instances and retried)",
                &["platform", "state"],
            )?,
            scrub_held: gauge(
                "scrub_held_slots",
                "max-instances slots held for terminated instances whose Mac dedicated host is still being scrubbed (host-scrub): launches onto it would be refused; no series while none is held",
                &["platform"],
            )?,
            unlisted: gauge(
                "platform_unlisted",
                "1 while the platform's cloud listing has failed since recovery: its recorded TaskRuns are held and nothing is launched, terminated or finalized for it until a listing succeeds (no series otherwise)",
                &["platform"],
            )?,
            actions_in_flight: gauge(
                "actions_in_flight",
                "Scheduler actions being executed, by kind",
                &["kind"],
            )?,
            action_failures: counter(
                "action_failures",
                "Scheduler actions that failed, by kind (provisioning, cloud and API errors)",
                &["kind"],
            )?,
            state_violations: counter(
                "scheduler_state_violations",
                "Broken invariants of the scheduler's state found by --check-state, by invariant (a bug: always 0)",
                &["invariant"],
            )?,
            leader: Gauge::with_opts(Opts::new(
                name("leader"),
                "Whether this replica holds the Lease and schedules (1) or not (0)",
            ))?,
            group_limit: gauge(
                "capacity_group_limit",
                "The capacity group's max (capacity-group.<group>.max): instances its member platforms may hold together",
                &["group"],
            )?,
            group_in_use: gauge(
                "capacity_group_in_use",
                "Instances the capacity group's members hold, from launch request to acknowledged termination (with scope account, plus the other clusters' instances of the members as last listed); above the limit only after the limit was lowered or instances were recovered",
                &["group"],
            )?,
            group_waiting: gauge(
                "capacity_group_waiting",
                "TaskRuns queued for the capacity group's member platforms, whatever holds each back",
                &["group"],
            )?,
        };
        for c in m.collectors() {
            registry.register(c)?;
        }
        Ok(m)
    }

    fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.allocation_time.clone()),
            Box::new(self.wait_time.clone()),
            Box::new(self.task_run_time.clone()),
            Box::new(self.queue_wait.clone()),
            Box::new(self.host_ready.clone()),
            Box::new(self.build_time.clone()),
            Box::new(self.provisioning_failures.clone()),
            Box::new(self.provisioning_successes.clone()),
            Box::new(self.cleanup_failures.clone()),
            Box::new(self.host_allocation_failures.clone()),
            Box::new(self.available.clone()),
            Box::new(self.unlisted.clone()),
            Box::new(self.running_tasks.clone()),
            Box::new(self.waiting_tasks.clone()),
            Box::new(self.queue_length.clone()),
            Box::new(self.queue_oldest.clone()),
            Box::new(self.instances.clone()),
            Box::new(self.scrub_held.clone()),
            Box::new(self.actions_in_flight.clone()),
            Box::new(self.action_failures.clone()),
            Box::new(self.state_violations.clone()),
            Box::new(self.leader.clone()),
            Box::new(self.group_limit.clone()),
            Box::new(self.group_in_use.clone()),
            Box::new(self.group_waiting.clone()),
        ]
    }

    /// Records one scheduler measurement.
    pub fn observe(&self, o: &Observation) {
        match o {
            Observation::Waited {
                platform,
                wait,
                waited,
                ..
            } => {
                let l = [platform.label_value()];
                self.queue_wait
                    .with_label_values(&l)
                    .observe(wait.as_secs_f64());
                if let Some(waited) = waited {
                    self.wait_time
                        .with_label_values(&l)
                        .observe(waited.as_secs_f64());
                }
            }
            Observation::Allocated { platform, took } => self
                .allocation_time
                .with_label_values(&[&platform.label_value()])
                .observe(took.as_secs_f64()),
            Observation::Ran { platform, took } => self
                .task_run_time
                .with_label_values(&[&platform.label_value()])
                .observe(took.as_secs_f64()),
            Observation::Served { platform, took } => self
                .host_ready
                .with_label_values(&[&platform.label_value()])
                .observe(took.as_secs_f64()),
            Observation::Built { platform, took } => self
                .build_time
                .with_label_values(&[&platform.label_value()])
                .observe(took.as_secs_f64()),
            Observation::ProvisionSucceeded(p) => self
                .provisioning_successes
                .with_label_values(&[&p.label_value()])
                .inc(),
            Observation::ProvisionFailed(p) => self
                .provisioning_failures
                .with_label_values(&[&p.label_value()])
                .inc(),
            Observation::AllocationFailed(p) => self
                .host_allocation_failures
                .with_label_values(&[&p.label_value()])
                .inc(),
            Observation::CleanupFailed(p) => self
                .cleanup_failures
                .with_label_values(&[&p.label_value()])
                .inc(),
        }
    }

    /// Creates the per-platform series of every configured platform at zero, as the Go controller
    /// does when it first sees a platform: a rate or `increase()` then counts the first failure
    /// too, and a dashboard lists the platform before anything happened on it.
    pub fn configured<'a>(&self, platforms: impl IntoIterator<Item = &'a Platform>) {
        for p in platforms {
            let value = p.label_value();
            let l = [value.as_str()];
            for h in [
                &self.allocation_time,
                &self.wait_time,
                &self.task_run_time,
                &self.queue_wait,
                &self.host_ready,
                &self.build_time,
            ] {
                h.with_label_values(&l);
            }
            for c in [
                &self.provisioning_failures,
                &self.provisioning_successes,
                &self.cleanup_failures,
                &self.host_allocation_failures,
            ] {
                c.with_label_values(&l);
            }
        }
    }

    /// Sets the ledger gauges from a pass over the scheduler; series of platforms or namespaces
    /// that emptied are reset to zero.
    pub fn set_gauges(&self, g: &Gauges, now: Time) {
        self.running_tasks.reset();
        self.waiting_tasks.reset();
        for ((platform, ns), (waiting, running)) in &g.by_namespace {
            let label = crate::platform::label_value(platform);
            self.waiting_tasks
                .with_label_values(&[&label, ns])
                .set(i64::from(*waiting));
            self.running_tasks
                .with_label_values(&[&label, ns])
                .set(i64::from(*running));
        }
        self.queue_length.reset();
        self.queue_oldest.reset();
        self.available.reset();
        self.instances.reset();
        self.scrub_held.reset();
        self.unlisted.reset();
        for gauge in [&self.group_limit, &self.group_in_use, &self.group_waiting] {
            gauge.reset();
        }
        for (group, c) in &g.groups {
            let l = [group.as_str()];
            self.group_limit
                .with_label_values(&l)
                .set(i64::from(c.limit));
            self.group_in_use
                .with_label_values(&l)
                .set(i64::from(c.in_use));
            self.group_waiting
                .with_label_values(&l)
                .set(i64::from(c.waiting));
        }
        for (platform, p) in &g.platforms {
            let label = crate::platform::label_value(platform);
            self.queue_length
                .with_label_values(&[&label])
                .set(i64::from(p.waiting));
            self.queue_oldest
                .with_label_values(&[&label])
                .set(p.oldest_queued.map_or(0.0, |t| now.since(t).as_secs_f64()));
            if let Some(capacity) = p.capacity {
                self.available
                    .with_label_values(&[&label])
                    .set(i64::from(capacity > 0));
            }
            if p.unlisted {
                self.unlisted.with_label_values(&[&label]).set(1);
            }
            if p.scrubbing > 0 {
                self.scrub_held
                    .with_label_values(&[&label])
                    .set(i64::from(p.scrubbing));
            }
            if p.instances > 0 || p.leaked > 0 {
                let ready = p.instances.saturating_sub(p.booting + p.terminating);
                for (state, n) in [
                    ("booting", p.booting),
                    ("ready", ready),
                    ("terminating", p.terminating),
                    ("leaked", p.leaked),
                ] {
                    self.instances
                        .with_label_values(&[&label, state])
                        .set(i64::from(n));
                }
            }
        }
    }

    /// Leadership.
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(if leading { 1.0 } else { 0.0 });
    }

    /// An action of `kind` started (`+1`) or ended (`-1`).
    pub fn in_flight(&self, kind: &str, delta: i64) {
        self.actions_in_flight.with_label_values(&[kind]).add(delta);
    }

    /// An action of `kind` failed.
    pub fn failed(&self, kind: &str) {
        self.action_failures.with_label_values(&[kind]).inc();
    }

    /// A check of the scheduler's state found `invariant` broken.
    pub fn state_broken(&self, invariant: Invariant) {
        self.state_violations
            .with_label_values(&[&format!("{invariant:?}")])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_invariant_is_counted_under_its_name() {
        let registry = Registry::new();
        let m = ControllerMetrics::register(&registry).unwrap();
        m.state_broken(Invariant::HostLoad);
        m.state_broken(Invariant::HostLoad);
        m.state_broken(Invariant::ProbeOps);
        let text = crate::metrics::encode(&registry);
        for series in [
            "multi_platform_controller_scheduler_state_violations{invariant=\"HostLoad\"} 2",
            "multi_platform_controller_scheduler_state_violations{invariant=\"ProbeOps\"} 1",
        ] {
            assert!(text.lines().any(|l| l == series), "{series} in\n{text}");
        }
    }

    #[test]
    fn configured_platforms_have_their_series_at_zero_before_anything_happens() {
        let registry = Registry::new();
        let m = ControllerMetrics::register(&registry).unwrap();
        let text = crate::metrics::encode(&registry);
        assert!(!text.contains("linux-arm64"), "{text}");
        m.configured([&Platform::parse("linux/arm64").unwrap()]);
        let text = crate::metrics::encode(&registry);
        for series in [
            "multi_platform_controller_provisioning_failures{platform=\"linux-arm64\"} 0",
            "multi_platform_controller_provisioning_successes{platform=\"linux-arm64\"} 0",
            "multi_platform_controller_cleanup_failures{platform=\"linux-arm64\"} 0",
            "multi_platform_controller_host_allocation_failures{platform=\"linux-arm64\"} 0",
            "multi_platform_controller_wait_time_count{platform=\"linux-arm64\"} 0",
            "multi_platform_controller_host_allocation_time_count{platform=\"linux-arm64\"} 0",
            "multi_platform_controller_task_run_time_count{platform=\"linux-arm64\"} 0",
        ] {
            assert!(text.lines().any(|l| l == series), "{series} in\n{text}");
        }
    }
    /// Each capacity group has its limit, in-use and waiting series, with HELP text; a group the
    /// config dropped loses its series.
    #[test]
    fn capacity_groups_have_their_limit_in_use_and_waiting() {
        use crate::scheduler::{Gauges, GroupGauges, Time};
        let registry = Registry::new();
        let m = ControllerMetrics::register(&registry).unwrap();
        let mut g = Gauges::default();
        g.groups.insert(
            "aws-ip".into(),
            GroupGauges {
                limit: 500,
                in_use: 498,
                waiting: 7,
            },
        );
        m.set_gauges(&g, Time::from_secs(0));
        let text = crate::metrics::encode(&registry);
        for line in [
            "multi_platform_controller_capacity_group_limit{group=\"aws-ip\"} 500",
            "multi_platform_controller_capacity_group_in_use{group=\"aws-ip\"} 498",
            "multi_platform_controller_capacity_group_waiting{group=\"aws-ip\"} 7",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        for family in ["limit", "in_use", "waiting"] {
            assert!(
                text.contains(&format!(
                    "# HELP multi_platform_controller_capacity_group_{family} "
                )),
                "{text}"
            );
        }
        m.set_gauges(&Gauges::default(), Time::from_secs(0));
        assert!(!crate::metrics::encode(&registry).contains("aws-ip"));
    }

    /// An unlisted platform has its series, at 1, only while unlisted: the alert keys on it.
    #[test]
    fn an_unlisted_platform_has_its_series_only_while_unlisted() {
        use crate::scheduler::{Gauges, PlatformGauges, Time};
        let registry = Registry::new();
        let m = ControllerMetrics::register(&registry).unwrap();
        let series = "multi_platform_controller_platform_unlisted{platform=\"linux-arm64\"} 1";
        let mut g = Gauges::default();
        let unlisted = PlatformGauges {
            unlisted: true,
            held: 3,
            ..Default::default()
        };
        g.platforms.insert("linux/arm64".into(), unlisted);
        g.platforms
            .insert("linux/s390x".into(), PlatformGauges::default());
        m.set_gauges(&g, Time::from_secs(0));
        let text = crate::metrics::encode(&registry);
        assert!(text.lines().any(|l| l == series), "{text}");
        assert!(
            !text.contains("platform_unlisted{platform=\"linux-s390x\""),
            "{text}"
        );
        g.platforms.get_mut("linux/arm64").unwrap().unlisted = false;
        m.set_gauges(&g, Time::from_secs(0));
        let text = crate::metrics::encode(&registry);
        assert!(!text.contains("platform_unlisted{"), "{text}");
    }

    /// Slots held for scrubbed Mac hosts have their series while any is held.
    #[test]
    fn slots_held_for_scrubbed_hosts_have_their_series_while_held() {
        use crate::scheduler::{Gauges, PlatformGauges, Time};
        let registry = Registry::new();
        let m = ControllerMetrics::register(&registry).unwrap();
        let mut g = Gauges::default();
        let held = PlatformGauges {
            scrubbing: 2,
            ..Default::default()
        };
        g.platforms.insert("macos-m2/arm64".into(), held);
        m.set_gauges(&g, Time::from_secs(0));
        let text = crate::metrics::encode(&registry);
        let series = "multi_platform_controller_scrub_held_slots{platform=\"macos-m2-arm64\"} 2";
        assert!(text.lines().any(|l| l == series), "{text}");
        g.platforms.get_mut("macos-m2/arm64").unwrap().scrubbing = 0;
        m.set_gauges(&g, Time::from_secs(0));
        let text = crate::metrics::encode(&registry);
        assert!(!text.contains("scrub_held_slots{"), "{text}");
    }

    /// Each observation lands in its family with its value: Go's families keep Go's meaning
    /// (`wait_time` only for TaskRuns that waited), ours get every placement.
    #[test]
    fn observations_land_in_their_families_with_their_values() {
        use std::sync::Arc;
        use std::time::Duration;

        use crate::scheduler::{TaskRunRef, Uid};
        let registry = Registry::new();
        let m = ControllerMetrics::register(&registry).unwrap();
        let p = Arc::new(Platform::parse("linux/arm64").unwrap());
        let taskrun = TaskRunRef::new("ns", "a", Uid::new("u"));
        let secs = Duration::from_secs_f64;
        for o in [
            Observation::Waited {
                platform: p.clone(),
                wait: Duration::ZERO,
                waited: None,
                taskrun: taskrun.clone(),
            },
            Observation::Waited {
                platform: p.clone(),
                wait: secs(2.5),
                waited: Some(secs(4.0)),
                taskrun,
            },
            Observation::Allocated {
                platform: p.clone(),
                took: secs(21.0),
            },
            Observation::Served {
                platform: p.clone(),
                took: secs(23.0),
            },
            Observation::Built {
                platform: p.clone(),
                took: secs(100.0),
            },
            Observation::Ran {
                platform: p.clone(),
                took: secs(125.0),
            },
        ] {
            m.observe(&o);
        }
        let text = crate::metrics::encode(&registry);
        let l = "{platform=\"linux-arm64\"}";
        for (family, count, sum) in [
            ("queue_wait_seconds", 2, "2.5"),
            ("wait_time", 1, "4"),
            ("host_allocation_time", 1, "21"),
            ("host_ready_seconds", 1, "23"),
            ("build_time_seconds", 1, "100"),
            ("task_run_time", 1, "125"),
        ] {
            for series in [
                format!("multi_platform_controller_{family}_count{l} {count}"),
                format!("multi_platform_controller_{family}_sum{l} {sum}"),
            ] {
                assert!(text.lines().any(|x| x == series), "{series} in\n{text}");
            }
        }
        // The zero wait is in the lowest bucket.
        let first = "multi_platform_controller_queue_wait_seconds_bucket{platform=\"linux-arm64\",le=\"0.1\"} 1";
        assert!(text.lines().any(|x| x == first), "{text}");
    }
}
