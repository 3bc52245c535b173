//! Cloud instances for dynamic platforms and dynamic pools (docs/architecture.md, "The contract
//! with the Go controller" and "What the scheduler guarantees").
//!
//! The scheduler core decides; this module executes its cloud actions and reports what the
//! cloud says, as scheduler events. [`Cloud`] is the provider interface; [`aws::AwsCloud`] is the
//! EC2 implementation, the only module that touches the AWS SDK, and [`ibm::IbmCloud`] the IBM
//! Cloud one (VPC and Power VS). [`ByProvider`] routes each call by the platform's `type`.
//!
//! How the controller uses it (one path): build one [`Runner`] over the provider at start-up.
//! For every [`Action::Launch`](crate::scheduler::Action::Launch),
//! [`Action::Probe`](crate::scheduler::Action::Probe),
//! [`Action::Terminate`](crate::scheduler::Action::Terminate) and
//! [`Action::Retag`](crate::scheduler::Action::Retag), call [`Runner::run`] with the credentials
//! of the template's `aws-secret` or IBM `secret` ([`Credentials::from_secret_data`]) and feed
//! the returned event
//! to the scheduler. For listings (the recovery [`Snapshot`](crate::scheduler::Snapshot) and the
//! periodic [`Event::InstancesListed`](crate::scheduler::Event::InstancesListed)) call
//! [`Runner::list`] per dynamic platform. Probes of one account and region coalesce into one
//! describe call ([`ProbeBatcher`]), so run them concurrently.
//!
//! Identity. This cluster's [`ClusterId`] is fixed per provider ([`aws::AwsOptions::cluster`]):
//! every launch is tagged with it, and the provider adopts, retags and terminates only instances
//! carrying it, plus (terminate only, when the action says `legacy`) instances without any
//! cluster tag that a TaskRun of this cluster names. Launches are idempotent per
//! [`LaunchId`] (the token and the owner/attempt tags come from it):
//! an earlier try's live instance is adopted, a gone one reported as spent, never adopted.
//!
//! Pure parts (no I/O): [`instance`] (state mapping, addresses, who may act on an instance),
//! [`launch`] (cluster id, tags, idempotency tokens), [`error`] (classification of cloud errors,
//! naming the config key at fault), [`retry`] (back-off schedule), [`credentials`] (the
//! `aws-secret` data), [`runner::probe_result`]. Shell: [`aws`], [`batch`], [`runner`], [`reach`]
//! (SSH readiness probes through an address-resolution step).

pub mod aws;
pub mod batch;
pub mod credentials;
pub mod error;
pub mod ibm;
pub mod instance;
pub mod launch;
pub mod metrics;
pub mod reach;
pub mod retry;
pub mod runner;

use futures::future::BoxFuture;

use crate::config::DynamicPlatform;
use crate::scheduler::LaunchId;

pub use batch::{BatchOptions, ProbeBatcher};
pub use credentials::{AwsCredentials, Credentials, CredentialsError, IbmApiKey};
pub use error::{CloudError, ErrorClass, Operation};
pub use instance::Instance;
pub use launch::{ClusterId, ClusterIdError, LaunchOutcome, LaunchRequest};
pub use runner::Runner;

/// Which platform's instances an operation concerns, and the account to reach them with.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    /// The platform's instance template (region, instance tag, launch keys).
    pub platform: &'a DynamicPlatform,
    /// Credentials read from the platform's `aws-secret` (IBM: `secret`).
    pub credentials: &'a Credentials,
}

/// Outcome of a successful [`Cloud::terminate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Terminated {
    /// Termination was requested now.
    Requested,
    /// The instance was already shutting down, terminated or unknown to the cloud.
    AlreadyGone,
}

/// A cloud provider, acting for one cluster. Every method is safe to retry: launches are
/// idempotent per launch id, terminations succeed when the instance is already gone.
pub trait Cloud: Send + Sync {
    /// Launches the instance `request` names, or finds the one an earlier try of the same launch
    /// id started: adopted when alive, reported spent when gone.
    fn launch<'a>(
        &'a self,
        request: &'a LaunchRequest<'a>,
    ) -> BoxFuture<'a, Result<LaunchOutcome, CloudError>>;

    /// Every instance with the managed tag and the scope's instance tag that is not terminated
    /// (all pages), whoever launched it ([`Instance::ownership`]) and whatever its state.
    fn list<'a>(&'a self, scope: Scope<'a>) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>>;

    /// The instances among `ids` the cloud knows (recently terminated ones included), whatever
    /// their tags: the caller decides what it may act on ([`Instance::may_manage`]). Any number
    /// of ids; unknown ones are left out.
    fn describe<'a>(
        &'a self,
        scope: Scope<'a>,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>>;

    /// Terminates an instance this cluster may manage ([`Instance::may_manage`] with `legacy`);
    /// refuses any other ([`ErrorClass::Refused`]). Idempotent.
    fn terminate<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        legacy: bool,
    ) -> BoxFuture<'a, Result<Terminated, CloudError>>;

    /// Replaces the ownership tags of an instance carrying this cluster's identity (refuses any
    /// other), so listings and recovery find it under `launch`'s owner.
    fn retag<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        launch: &'a LaunchId,
    ) -> BoxFuture<'a, Result<(), CloudError>>;
}

/// Routes every call to the provider of the scope's platform (`type`).
pub struct ByProvider {
    pub aws: std::sync::Arc<dyn Cloud>,
    pub ibm: std::sync::Arc<dyn Cloud>,
}

impl ByProvider {
    fn of(&self, p: &DynamicPlatform) -> &dyn Cloud {
        match p.cloud {
            crate::config::CloudKind::Aws => &*self.aws,
            crate::config::CloudKind::Ibm => &*self.ibm,
        }
    }
}

impl Cloud for ByProvider {
    fn launch<'a>(
        &'a self,
        request: &'a LaunchRequest<'a>,
    ) -> BoxFuture<'a, Result<LaunchOutcome, CloudError>> {
        self.of(request.scope.platform).launch(request)
    }
    fn list<'a>(&'a self, scope: Scope<'a>) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>> {
        self.of(scope.platform).list(scope)
    }
    fn describe<'a>(
        &'a self,
        scope: Scope<'a>,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>> {
        self.of(scope.platform).describe(scope, ids)
    }
    fn terminate<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        legacy: bool,
    ) -> BoxFuture<'a, Result<Terminated, CloudError>> {
        self.of(scope.platform).terminate(scope, id, legacy)
    }
    fn retag<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        launch: &'a LaunchId,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        self.of(scope.platform).retag(scope, id, launch)
    }
}

#[cfg(test)]
pub(crate) mod testing;
