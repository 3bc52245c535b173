//! Actions: what the core asks the controller to do.
//!
//! Execution rules (the controller's side of the contract):
//! - Actions about the same TaskRun run in the order returned; others may run concurrently.
//! - Every action is idempotent: after a crash, re-executing any of them is safe (patches, secret
//!   create-or-replace, launch with its client token, terminate/deprovision of something gone).
//! - Actions carrying an [`OpId`] must report exactly one result event echoing it; actions
//!   without one report nothing (retry transient API errors; a TaskRun that is gone is reported
//!   as [`Event::TaskRunDone`](super::Event::TaskRunDone); a secret the API server refuses, or
//!   that does not land in time, as [`Event::SecretRefused`](super::Event::SecretRefused)).
//! - Writes about a TaskRun are conditional on its UID (a recreated TaskRun with the same name is
//!   a different TaskRun).
//! - Cloud actions ([`Action::Launch`], [`Action::Probe`], [`Action::Terminate`],
//!   [`Action::Retag`]) run through the shell's cloud runner (`mpc::cloud::Runner::run`) with the
//!   credentials of the template's `aws-secret`; it makes the calls and returns the result event.
//!   Listings for [`Event::InstancesListed`](super::Event::InstancesListed) and the recovery
//!   snapshot come from `mpc::cloud::Runner::list`.

use std::sync::Arc;
use std::time::Duration;

use super::ids::{LaunchId, OpId, TaskRunRef};
use crate::config::{DynamicPlatform, StaticHost};
use crate::platform::Platform;

/// Something the controller must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Merge-patch the TaskRun's allocation labels and annotations to exactly these values
    /// (`None` removes the key).
    Record {
        taskrun: TaskRunRef,
        /// The values.
        placement: Placement,
    },
    /// Create the TaskRun's user on a host with a fresh key pair and store the private key in
    /// the OTP server. Result: [`Event::Provisioned`](super::Event::Provisioned) or
    /// [`Event::ProvisionFailed`](super::Event::ProvisionFailed).
    Provision {
        /// Echoed by the result.
        op: OpId,
        /// The TaskRun (the user name is [`TaskRunRef::remote_user`]).
        taskrun: TaskRunRef,
        /// Where.
        host: HostRef,
        /// A retry attempt of a TaskRun whose secret already holds a (consumed) token: the retry's
        /// pod mounted that secret as it was, so the new key must be stored under the same token
        /// (re-armed) rather than a new one (docs/architecture.md, "The key hand-off and retries").
        rearm: bool,
    },
    /// Create or replace `multi-platform-ssh-<name>` (owner: the TaskRun). A refusal is reported
    /// as [`Event::SecretRefused`](super::Event::SecretRefused).
    WriteSecret {
        taskrun: TaskRunRef,
        /// The content.
        secret: SecretData,
    },
    /// Delete the TaskRun's secret if its owner is this TaskRun (UID).
    DeleteSecret { taskrun: TaskRunRef },
    /// Clear `spec.status: TaskRunPending` so the TaskRun starts.
    Ungate { taskrun: TaskRunRef },
    /// Remove our finalizer; the last action about a TaskRun.
    RemoveFinalizer {
        taskrun: TaskRunRef,
        /// Revoke its one-time keys too (the key server then refuses new ones for it): it
        /// ended. False for a TaskRun only released
        /// ([`Event::TaskRunReleased`](super::Event::TaskRunReleased)): it may need a host again;
        /// its build user is removed and its secret deleted, so a key left to its TTL opens
        /// nothing.
        revoke: bool,
    },
    /// Remove a user from a host: kill its processes, `userdel -r`, remove what provisioning
    /// created. Result: [`Event::Deprovisioned`](super::Event::Deprovisioned).
    Deprovision {
        /// Echoed by the result.
        op: OpId,
        /// Which user.
        user: RemoteUser,
        /// Where.
        host: HostRef,
    },
    /// Launch the instance `launch` names from `template` (or adopt the live instance an earlier
    /// try of the same `launch` started), tagged with our cluster identity, the compat tags,
    /// `launch`'s owner and attempt, and `additional_tags`. Result:
    /// [`Event::Launched`](super::Event::Launched),
    /// [`Event::LaunchSpent`](super::Event::LaunchSpent) or
    /// [`Event::LaunchFailed`](super::Event::LaunchFailed).
    Launch {
        /// Echoed by the result.
        op: OpId,
        platform: Arc<Platform>,
        /// Instance template (region, credentials, AMI, type, ...).
        template: Arc<DynamicPlatform>,
        /// The launch's identity: the cloud's idempotency token and ownership tags come from it,
        /// so a retry (or a restarted controller) cannot launch twice.
        launch: LaunchId,
        /// `additional-instance-tags` of the config in force.
        additional_tags: Arc<[(String, String)]>,
    },
    /// Describe the instance and, when it has an address, try an SSH connection (with a short
    /// timeout). Result: [`Event::Probed`](super::Event::Probed). Probes of many instances in one
    /// account and region are meant to share one describe call.
    Probe {
        /// Echoed by the result.
        op: OpId,
        instance_id: Arc<str>,
        /// Region and credentials.
        template: Arc<DynamicPlatform>,
    },
    /// Terminate an instance: only one carrying our cluster identity, or, when `legacy`, one
    /// carrying none (never another cluster's). Result:
    /// [`Event::Terminated`](super::Event::Terminated).
    Terminate {
        /// Echoed by the result.
        op: OpId,
        instance_id: Arc<str>,
        /// Region and credentials.
        template: Arc<DynamicPlatform>,
        /// The instance was adopted through a TaskRun that names it (`cloud-instance-id`, or
        /// `assigned-host` of a pool) and may lack our cluster tag (launched by the Go controller).
        legacy: bool,
        /// Why (for the log; a bounded set, fit for a metric label).
        reason: &'static str,
    },
    /// Set the ownership tags (`taskRunID`, owner, attempt, `Name`) of an instance handed to
    /// another TaskRun, so listings and recovery find it under its new owner. Only instances
    /// carrying our cluster identity are retagged. No result: a failure is logged. While the
    /// scheduler runs it tracks the instance, and no listing orphans a tracked one; after a
    /// restart the new owner's proven allocation still names it (see `recovery`).
    Retag {
        instance_id: Arc<str>,
        /// Region and credentials.
        template: Arc<DynamicPlatform>,
        /// The new owner's launch identity.
        launch: LaunchId,
    },
    /// Emit a Kubernetes Event (on the TaskRun when set).
    Notify {
        /// The TaskRun, if the event is about one.
        taskrun: Option<TaskRunRef>,
        /// Normal or Warning.
        warning: bool,
        /// CamelCase reason.
        reason: &'static str,
        /// Human text.
        message: String,
    },
    /// A measurement for the metrics (docs/metrics.md).
    Observe(Observation),
}

/// Allocation labels and annotations of a TaskRun (docs/architecture.md, "The contract with the Go
/// controller").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// `assigned-host` label.
    pub assigned_host: Option<Arc<str>>,
    /// `waiting-for-platform` label (platform label value).
    pub waiting_for_platform: Option<Arc<str>>,
    /// `failed-hosts` annotation (comma-joined; `None` when empty).
    pub failed_hosts: Option<String>,
    /// `cloud-instance-id` annotation.
    pub instance_id: Option<Arc<str>>,
    /// `cloud-address` annotation.
    pub instance_address: Option<Arc<str>>,
}

/// A build host: a static host or a cloud instance.
#[derive(Debug, Clone, PartialEq)]
pub enum HostRef {
    /// A static host as configured when the allocation was made.
    Static(Arc<StaticHost>),
    /// A cloud instance.
    Instance {
        /// Instance id.
        id: Arc<str>,
        /// SSH address.
        address: Arc<str>,
        /// Its template (login user, SSH secret, sudo commands, host-key policy).
        template: Arc<DynamicPlatform>,
    },
}

impl HostRef {
    /// Host name or instance id (the `assigned-host` value).
    pub fn name(&self) -> &str {
        match self {
            HostRef::Static(h) => &h.name,
            HostRef::Instance { id, .. } => id,
        }
    }

    /// SSH address.
    pub fn address(&self) -> &str {
        match self {
            HostRef::Static(h) => &h.address,
            HostRef::Instance { address, .. } => address,
        }
    }
}

/// A user on a build host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteUser {
    /// The user of a TaskRun ([`TaskRunRef::remote_user`]).
    Of(TaskRunRef),
    /// A user found by a sweep that no allocation owns.
    Named(String),
}

impl RemoteUser {
    /// The user name.
    pub fn name(&self) -> String {
        match self {
            RemoteUser::Of(t) => t.remote_user(),
            RemoteUser::Named(n) => n.clone(),
        }
    }
}

/// Content of the TaskRun's secret (docs/architecture.md, "The contract with the Go controller").
#[derive(Debug, Clone, PartialEq)]
pub enum SecretData {
    /// A remote user: keys `otp`, `host` ([`SecretData::login`]) and `user-dir`
    /// ([`SecretData::user_dir`]); the controller adds `otp-server` and `otp-ca`. The user is the
    /// TaskRun's ([`TaskRunRef::remote_user`]) and the host is kept as a reference: the controller
    /// formats the strings when it writes the secret (it derives the same user name for the
    /// provisioning anyway), so deciding costs no hashing or formatting.
    Remote {
        /// One-time token.
        otp: String,
        /// Where the user lives.
        host: HostRef,
    },
    /// `host: localhost`.
    Localhost,
    /// `error`: what failed and what to do.
    Error(String),
}

impl SecretData {
    /// `user@address` (the `host` key) of a remote secret written for `taskrun`.
    pub fn login(&self, taskrun: &TaskRunRef) -> Option<String> {
        match self {
            SecretData::Remote { host, .. } => {
                Some(format!("{}@{}", taskrun.remote_user(), host.address()))
            }
            _ => None,
        }
    }

    /// `/home/<user>` (the `user-dir` key) of a remote secret written for `taskrun`.
    pub fn user_dir(&self, taskrun: &TaskRunRef) -> Option<String> {
        match self {
            SecretData::Remote { .. } => Some(format!("/home/{}", taskrun.remote_user())),
            _ => None,
        }
    }
}

/// A measurement (docs/metrics.md; the metric families, with the exact start and end of each, are in
/// `docs/metrics.md`). Times are the scheduler's clock; "creation" is the TaskRun's
/// [`since`](super::TaskRunSpec::since) (its creation, or a later `allocation-start-time`).
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// A TaskRun left the queue for a placement (a host, a launch, an instance).
    Waited {
        platform: Arc<Platform>,
        /// `queue_wait_seconds`: from joining the queue to leaving it (zero when placed at once).
        wait: Duration,
        /// `wait_time` (Go's measure): from creation to leaving the queue, for a TaskRun that
        /// was labelled waiting; `None` when it was placed without waiting.
        waited: Option<Duration>,
        /// Who left the queue (the order of these is the queue's service order).
        taskrun: TaskRunRef,
    },
    /// `host_allocation_time` (Go's measure): from the placement that ended the wait (for an
    /// instance: its launch, if later) to the host being reachable and provisioning asked for.
    /// Zero for a static host or a ready pool instance; a cloud boot for a launch.
    Allocated {
        platform: Arc<Platform>,
        /// Duration.
        took: Duration,
    },
    /// `host_ready_seconds`: from creation to the TaskRun's remote secret (queue, boot and
    /// provisioning: all the build waited for).
    Served {
        platform: Arc<Platform>,
        /// Duration.
        took: Duration,
    },
    /// `task_run_time` (Go's measure): from creation to the TaskRun finishing, for every TaskRun
    /// that was given a host, an instance, `localhost` or an error secret.
    Ran {
        platform: Arc<Platform>,
        /// Duration.
        took: Duration,
    },
    /// `build_time_seconds`: from the TaskRun's remote secret to its finishing (the time its
    /// build used the host).
    Built {
        platform: Arc<Platform>,
        /// Duration.
        took: Duration,
    },
    /// `provisioning_successes`.
    ProvisionSucceeded(Arc<Platform>),
    /// `provisioning_failures`.
    ProvisionFailed(Arc<Platform>),
    /// `host_allocation_failures`: the TaskRun got an error secret.
    AllocationFailed(Arc<Platform>),
    /// `cleanup_failures`.
    CleanupFailed(Arc<Platform>),
}
