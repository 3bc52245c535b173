//! Tunables of the core. [`Policy::mpc`] is the product; [`Policy::mpc_go`] models the Go
//! controller's timing so `mpc simulate` can compare the two on the same trace.

use std::time::Duration;

/// How waiters learn that capacity is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handoff {
    /// A freed slot goes to the next waiter (FIFO per platform, round-robin across namespaces) in
    /// the same step.
    Immediate,
    /// Each waiter re-checks every `requeue`; each completion wakes one waiter (the Go
    /// controller). A new TaskRun that finds free capacity takes it whoever waits.
    Poll {
        /// Requeue period of a waiting TaskRun.
        requeue: Duration,
    },
}

/// Back-off of a static host after repeated provisioning failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBackoff {
    /// Consecutive failures that take the host out.
    pub after_failures: u32,
    /// First back-off; doubles each time the host trips again without a success in between.
    pub base: Duration,
    /// Longest back-off.
    pub max: Duration,
}

/// Default [`Policy::host_user_grace`]: a day, as the Go controller's host cleanup.
const HOST_USER_GRACE: Duration = Duration::from_secs(24 * 60 * 60);

/// Scheduler tunables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Short name shown by `mpc simulate`.
    pub name: &'static str,
    /// How waiters get freed capacity.
    pub handoff: Handoff,
    /// Delay from launch to the first probe of a new instance.
    pub first_probe: Duration,
    /// The platform's `check-interval` caps `first_probe` too (an operator who asks for checks
    /// every few seconds gets them from the start); Go waits its fixed delay whatever the interval.
    pub first_probe_capped: bool,
    /// Probe period after that; the platform's `check-interval` caps it. `None`: exactly
    /// `check-interval`.
    pub probe_every: Option<Duration>,
    /// Probe period once the instance runs with an address and only its SSH daemon is awaited
    /// (booting takes a minute, the daemon's start is the last second of it: a dial is cheap,
    /// and every second saved here is a second of the build's wait). `None`: as `probe_every`.
    pub ssh_probe_every: Option<Duration>,
    /// Idle pool instances (not needed for `min-instances`) are terminated after this. `None`:
    /// only instances past `max-age` are, and only when traffic for the pool arrives (Go).
    pub pool_idle_timeout: Option<Duration>,
    /// Static host health tracking; `None` disables it (Go).
    pub host_backoff: Option<HostBackoff>,
    /// Launch attempts per instance before its TaskRuns get an error secret.
    pub launch_attempts: u32,
    /// Delay before the first launch retry; doubles per attempt.
    pub launch_backoff: Duration,
    /// Instances a dynamic TaskRun may go through (provisioning failure, instance failure) before
    /// it gets an error secret; for pools, instances one TaskRun may fail on.
    pub instance_attempts: u32,
    /// An instance whose TaskRun went away before it was used is handed to a waiter of the same
    /// platform instead of being terminated.
    pub adopt_instances: bool,
    /// Unowned tagged instances younger than this are left alone by the sweep (a launch result
    /// may still be on its way).
    pub orphan_grace: Duration,
    /// Deprovision attempts before giving up (the host sweep removes what is left); terminate
    /// attempts before an instance is reported leaked and the TaskRun waiting for it is let go
    /// (the instance still counts against `max-instances`, and its termination is still retried).
    pub cleanup_attempts: u32,
    /// Delay between cleanup attempts (deprovision, terminate); doubles per attempt up to 5 min.
    pub cleanup_backoff: Duration,
    /// Tries of a retry attempt's re-provisioning (re-arming the token its pod mounted) on the
    /// static host that pod was pointed at, before it moves to another host. The pod's mounted
    /// secret names that host and its redeem waits for the re-arm, so a host that is back within
    /// a few seconds still serves the retry; elsewhere it cannot.
    pub rearm_attempts: u32,
    /// Delay before the first re-try of such a re-provisioning; doubles per try.
    pub rearm_backoff: Duration,
    /// Tries of a TaskRun's secret the API server refuses (403: a quota, a policy) before its
    /// host is freed and it gets an error instead.
    pub secret_attempts: u32,
    /// Delay before the first re-try of a refused secret; doubles per try.
    pub secret_backoff: Duration,
    /// The host sweep removes only build users at least this old: younger ones may belong to an
    /// allocation whose result is still on its way, or to the Go controller during a switch (its
    /// own host cleanup waits a day too).
    pub host_user_grace: Duration,
    /// A terminated instance on a dedicated host (a macOS platform with the dedicated-host keys)
    /// keeps its `max-instances` slot for the host's scrub (`host-scrub`, about 50 min): EC2
    /// refuses launches onto a host still scrubbed, so launching into that slot only spends the
    /// waiter's attempts. False: the slot is free at the termination (the Go controller).
    pub hold_scrubbing_hosts: bool,
}

impl Policy {
    /// The product's behaviour: event-driven hand-off, fast probes, idle reaping, host health.
    pub fn mpc() -> Self {
        Policy {
            name: "mpc",
            handoff: Handoff::Immediate,
            first_probe: Duration::from_secs(20),
            first_probe_capped: true,
            probe_every: Some(Duration::from_secs(5)),
            ssh_probe_every: Some(Duration::from_secs(1)),
            pool_idle_timeout: Some(Duration::from_secs(10 * 60)),
            host_backoff: Some(HostBackoff {
                after_failures: 3,
                base: Duration::from_secs(60),
                max: Duration::from_secs(30 * 60),
            }),
            launch_attempts: 5,
            launch_backoff: Duration::from_secs(10),
            instance_attempts: 3,
            adopt_instances: true,
            orphan_grace: Duration::from_secs(10 * 60),
            cleanup_attempts: 5,
            cleanup_backoff: Duration::from_secs(5),
            rearm_attempts: 4,
            rearm_backoff: Duration::from_secs(2),
            secret_attempts: 4,
            secret_backoff: Duration::from_secs(2),
            host_user_grace: HOST_USER_GRACE,
            hold_scrubbing_hosts: true,
        }
    }

    /// The Go controller's timing: 1-minute requeues with one wake-up per completion, first
    /// address check 2 minutes after launch then every `check-interval` (60 s), no idle reaping,
    /// no host health, three launch attempts 20 s apart, no relaunch or adoption.
    pub fn mpc_go() -> Self {
        Policy {
            name: "mpc-go",
            handoff: Handoff::Poll {
                requeue: Duration::from_secs(60),
            },
            first_probe: Duration::from_secs(120),
            first_probe_capped: false,
            probe_every: None,
            ssh_probe_every: None,
            pool_idle_timeout: None,
            host_backoff: None,
            launch_attempts: 3,
            launch_backoff: Duration::from_secs(20),
            instance_attempts: 1,
            adopt_instances: false,
            orphan_grace: Duration::from_secs(10 * 60),
            cleanup_attempts: 3,
            cleanup_backoff: Duration::from_secs(5),
            // Go hands a retry no new key at all; one try, then elsewhere.
            rearm_attempts: 1,
            rearm_backoff: Duration::from_secs(2),
            secret_attempts: 4,
            secret_backoff: Duration::from_secs(2),
            host_user_grace: HOST_USER_GRACE,
            hold_scrubbing_hosts: false,
        }
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy::mpc()
    }
}
