//! Events: what the controller tells the core. Results of actions echo the action's [`OpId`].

use std::time::Duration;

use super::action::SecretData;
use super::ids::{OpId, TaskRunRef, Uid};
use super::snapshot::{InstanceRecord, InstanceState};
use super::time::Time;
use crate::config::HostConfig;
use crate::platform::Platform;

/// Who is at fault for a failed provisioning, which decides whether the host's health pays for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    /// The host is unreachable, misconfigured or failing: the failure counts toward its back-off.
    Host,
    /// The request (or the configuration it came from) is at fault: any host fails the same way.
    Request,
    /// The controller could not do its part (the admin-key Secret, the OTP server, local files):
    /// nothing is known about the host.
    Controller,
}

/// Something that happened. Feed each one to [`Scheduler::handle`](super::Scheduler::handle) with
/// the current time. Every event may be delivered more than once; duplicates are ignored.
#[derive(Debug, Clone)]
pub enum Event {
    /// A TaskRun that needs a build host and is not done was seen (created or updated). Send
    /// it on every watch event; it is idempotent. A rising `retries` is a new attempt. Late or
    /// reordered copies arriving after [`Event::TaskRunDone`] are ignored for an hour.
    TaskRun(TaskRunSpec),
    /// The TaskRun finished (`Succeeded` ≠ `Unknown` and not being retried) or was deleted.
    TaskRunDone { taskrun: TaskRunRef },
    /// The TaskRun needs no host after all, though it has not finished: its resolved Task does
    /// not mount the secret (a remembered answer for its Task was wrong), it became internal, or
    /// it lost its platform. What it holds is freed and the finalizer removed as for
    /// [`Event::TaskRunDone`], but its UID is not remembered as finished: when a later
    /// [`Event::TaskRun`] says it needs a host after all, it is served (and its finalizer, added
    /// again by the controller, removed when it is done).
    TaskRunReleased { taskrun: TaskRunRef },
    /// [`Action::WriteSecret`](super::Action::WriteSecret) was refused for a reason retrying the
    /// request cannot fix (403: a quota, an admission policy), or did not land in time. The core
    /// writes it again after a back-off, [`Policy::secret_attempts`](super::Policy) times in
    /// all; then the TaskRun's host is freed and it gets an error: a Warning Event, and the error
    /// secret when that can be written.
    SecretRefused {
        taskrun: TaskRunRef,
        /// The refused content.
        secret: SecretData,
        /// The API server's answer.
        error: String,
    },
    /// [`Action::Provision`](super::Action::Provision) succeeded: the user exists with a fresh key
    /// and the private key is stored in the OTP server under `otp`.
    Provisioned {
        /// The provisioning action.
        op: OpId,
        /// One-time token that redeems the private key.
        otp: String,
    },
    /// [`Action::Provision`](super::Action::Provision) failed. The TaskRun is retried either way;
    /// only a failure whose `blame` is [`Blame::Host`] counts toward the host's back-off.
    ProvisionFailed {
        /// The provisioning action.
        op: OpId,
        /// What went wrong (shown to the user if every host fails).
        error: String,
        /// Whose fault it was.
        blame: Blame,
    },
    /// [`Action::Deprovision`](super::Action::Deprovision) finished.
    Deprovisioned {
        /// The deprovisioning action.
        op: OpId,
        /// `Some` when it failed.
        error: Option<String>,
    },
    /// [`Action::Launch`](super::Action::Launch) created an instance, or found the live one an
    /// earlier try of the same launch created.
    Launched {
        /// The launch action.
        op: OpId,
        instance_id: String,
    },
    /// [`Action::Launch`](super::Action::Launch) found that an earlier try of the same launch
    /// created an instance that is gone (shutting down, stopped or terminated): that attempt is
    /// spent. The instance counts as failed for its TaskRun, which launches its next attempt.
    LaunchSpent {
        /// The launch action.
        op: OpId,
        /// The spent instance.
        instance_id: String,
        /// Its state.
        state: InstanceState,
    },
    /// [`Action::Launch`](super::Action::Launch) failed.
    LaunchFailed {
        /// The launch action.
        op: OpId,
        /// The cloud's message.
        error: String,
        /// False for errors a retry cannot fix (bad AMI, denied, invalid parameter).
        retryable: bool,
    },
    /// [`Action::Probe`](super::Action::Probe) finished.
    Probed {
        /// The probe action.
        op: OpId,
        /// What was found.
        result: ProbeResult,
    },
    /// [`Action::Terminate`](super::Action::Terminate) finished.
    Terminated {
        /// The terminate action.
        op: OpId,
        /// `Some` when it failed (an instance that no longer exists is a success).
        error: Option<String>,
    },
    /// An instance stopped existing or failed outside our control (spot reclaim, manual
    /// termination), as seen by a watch or a listing.
    InstanceGone { instance_id: String },
    /// Periodic listing: every instance with `platform`'s instance tag that its credentials and
    /// region can see, whoever launched it. This cluster's instances of `platform` that no
    /// TaskRun owns are terminated once past the grace period; the live ones nobody here tracks
    /// (other clusters', the Go controller's, other platforms sharing the tag) count toward
    /// `platform`'s `max-instances` until the next listing.
    InstancesListed {
        /// Whose config (credentials, region) listed them.
        platform: Platform,
        instances: Vec<InstanceRecord>,
    },
    /// Periodic sweep: the build users present on a static host (the shell lists them over SSH). Users
    /// no allocation owns and known to be older than [`Policy::host_user_grace`](super::Policy)
    /// are removed.
    HostUsersListed {
        /// Static host name.
        host: String,
        /// Users found, with their ages.
        users: Vec<HostUser>,
    },
    /// A new valid configuration replaced the old one. Applies to new work only.
    ConfigReplaced(Box<HostConfig>),
    /// Time passed; fires due timers. Send it at [`Scheduler::next_deadline`](super::Scheduler::next_deadline).
    Tick,
}

/// What the core needs to know about a TaskRun.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRunSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The `PLATFORM` param as written (validated by the core).
    pub platform: String,
    /// `allocation-start-time` (or creation time when absent): the start of the wait.
    pub since: Time,
    /// Number of retries Tekton has started (`status.retriesStatus` length).
    pub retries: u32,
    /// `spec.status` is `TaskRunPending` (gated by the webhook).
    pub gated: bool,
}

impl TaskRunSpec {
    /// The UID in its compact form.
    pub fn uid(&self) -> Uid {
        Uid::new(&self.uid)
    }
}

/// Result of probing a booting instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeResult {
    /// Still starting, no address yet.
    Pending,
    /// Has an address but does not answer SSH yet.
    Booting { address: String },
    /// Answers SSH at this address.
    Reachable { address: String },
    /// Stopped, terminated, or failed to start.
    Failed {
        /// What the cloud says.
        reason: String,
    },
}

/// A build user found on a static host by the periodic sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostUser {
    /// `u-<28 hex>`.
    pub name: String,
    /// How old the user is at least, on the host's clock: since its home directory last changed
    /// (else since its shadow entry's day); `None` when neither exists.
    pub age: Option<Duration>,
}

impl HostUser {
    /// Known to be at least `grace` old: the only users a sweep may remove.
    pub fn older_than(&self, grace: Duration) -> bool {
        self.age.is_some_and(|a| a >= grace)
    }
}
