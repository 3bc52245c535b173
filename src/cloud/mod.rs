//! Cloud instances for dynamic platforms and dynamic pools (design §4 dynamic keys, §5).
//!
//! The scheduler core decides; this module executes cloud actions and reports what the cloud says.
//! [`Cloud`] is the provider interface (an IBM provider can implement it later); [`aws::AwsCloud`]
//! is the EC2 implementation, the only module that touches the AWS SDK.
//!
//! Pure parts (no I/O): [`instance`] (state mapping, address choice), [`launch`] (tags, idempotency
//! tokens), [`error`] (classification of cloud errors, naming the config key at fault), [`retry`]
//! (back-off schedule), [`credentials`] (the `aws-secret` data), [`sweep::select_orphans`].
//! Shell: [`aws`], [`reach`] (SSH readiness probes through an address-resolution step), [`sweep::sweep`].

pub mod aws;
pub mod credentials;
pub mod error;
pub mod instance;
pub mod launch;
pub mod metrics;
pub mod reach;
pub mod retry;
pub mod sweep;

use futures::future::BoxFuture;

use crate::config::DynamicPlatform;

pub use credentials::{Credentials, CredentialsError};
pub use error::{CloudError, ErrorClass, Operation};
pub use instance::{Instance, InstanceState, count_toward_limit};
pub use launch::{LaunchRequest, Launched, Owner};

/// Which platform's instances an operation concerns, and the account to reach them with.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    /// The platform's instance template (region, instance tag, launch keys).
    pub platform: &'a DynamicPlatform,
    /// Credentials read from the platform's `aws-secret`.
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

/// A cloud provider. Every method is safe to retry: launches are idempotent per
/// (owner, attempt), terminations succeed when the instance is already gone.
pub trait Cloud: Send + Sync {
    /// Launches the instance for `request`, or adopts the one an earlier try of the same
    /// (owner, attempt) already launched. An adopted instance may be gone (see its `state`):
    /// launch the next attempt then.
    fn launch<'a>(
        &'a self,
        request: &'a LaunchRequest<'a>,
    ) -> BoxFuture<'a, Result<Launched, CloudError>>;

    /// Every instance of the scope's platform that is not terminated (all pages), whatever its
    /// state: the caller sees the truth, including stopped or shutting-down instances.
    fn list<'a>(&'a self, scope: Scope<'a>) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>>;

    /// One of our instances by id; `None` when the cloud does not know it or it is not ours.
    fn describe<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Instance>, CloudError>>;

    /// Terminates one of our instances. Idempotent; refuses instances that do not carry our tags.
    fn terminate<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Terminated, CloudError>>;
}

#[cfg(test)]
mod testing;
