//! Runs the scheduler's cloud actions and turns what the cloud says into scheduler events: the
//! one path from [`Action`] to the provider and back. The mapping of results to events is pure
//! ([`launch_event`], [`terminate_event`], [`probe_result`]); [`Runner`] makes the calls.

use std::sync::Arc;
use std::time::Duration;

use crate::cloud::batch::{BatchOptions, ProbeBatcher};
use crate::cloud::metrics::CloudMetrics;
use crate::cloud::reach::{Probe, ResolveAddress, probe_ssh};
use crate::cloud::{
    Cloud, CloudError, Credentials, ErrorClass, Instance, LaunchOutcome, LaunchRequest, Scope,
    Terminated,
};
use crate::config::DynamicPlatform;
use crate::platform::Platform;
use crate::scheduler::{Action, Event, InstanceRecord, OpId, ProbeResult};

/// Tuning of a [`Runner`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerOptions {
    /// How probes' instance lookups are coalesced.
    pub batch: BatchOptions,
    /// How long one SSH readiness dial may take.
    pub ssh_timeout: Duration,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            batch: BatchOptions::default(),
            ssh_timeout: Duration::from_secs(5),
        }
    }
}

/// Executes cloud actions for one cluster (the provider's [`ClusterId`](crate::cloud::ClusterId)).
pub struct Runner {
    cloud: Arc<dyn Cloud>,
    probes: ProbeBatcher,
    resolver: Arc<dyn ResolveAddress>,
    metrics: CloudMetrics,
    ssh_timeout: Duration,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("probes", &self.probes)
            .field("resolver", &self.resolver)
            .finish()
    }
}

impl Runner {
    /// A runner over `cloud`, dialling SSH through `resolver`
    /// ([`Direct`](crate::cloud::reach::Direct) in production). Must be created inside a Tokio
    /// runtime.
    pub fn new(
        cloud: Arc<dyn Cloud>,
        resolver: Arc<dyn ResolveAddress>,
        metrics: CloudMetrics,
        options: RunnerOptions,
    ) -> Self {
        Self {
            probes: ProbeBatcher::new(cloud.clone(), options.batch),
            cloud,
            resolver,
            metrics,
            ssh_timeout: options.ssh_timeout,
        }
    }

    /// Runs one cloud action with the credentials of its template's `aws-secret`. Launch, Probe
    /// and Terminate return their result event (errors included: exactly one per op); Retag
    /// returns none (a failure is logged; the TaskRun's annotation still names the instance).
    /// Any other action is not a cloud action and returns none without doing anything.
    pub async fn run(&self, action: &Action, credentials: &Credentials) -> Option<Event> {
        match action {
            Action::Launch {
                op,
                template,
                launch,
                additional_tags,
                ..
            } => {
                let request = LaunchRequest {
                    scope: Scope {
                        platform: template,
                        credentials,
                    },
                    launch,
                    additional_tags,
                };
                // Start and end with the time taken: the gap between a slot freed and the next
                // instance booting is read from these.
                tracing::debug!(platform = %template.platform, %launch, "launching");
                let began = std::time::Instant::now();
                let result = self.cloud.launch(&request).await;
                let ms = began.elapsed().as_millis() as u64;
                let platform = template.platform.as_str();
                match &result {
                    Ok(_) => {
                        self.metrics.launch_accepted(platform);
                        tracing::debug!(platform = %template.platform, %launch, ms, "launch answered")
                    }
                    Err(e) => {
                        if e.class == ErrorClass::Config {
                            self.metrics.launch_rejected(platform, rejected_key(e));
                        }
                        tracing::warn!(platform = %template.platform, %launch, ms, error = %e, "launch failed")
                    }
                }
                Some(launch_event(*op, result))
            }
            Action::Probe {
                op,
                instance_id,
                template,
            } => {
                let scope = Scope {
                    platform: template,
                    credentials,
                };
                let result = self.probe(scope, instance_id).await;
                Some(Event::Probed { op: *op, result })
            }
            Action::Terminate {
                op,
                instance_id,
                template,
                legacy,
                reason,
            } => {
                let scope = Scope {
                    platform: template,
                    credentials,
                };
                let platform = template.platform.as_str();
                tracing::info!(platform, instance = %instance_id, reason, "terminating");
                let began = std::time::Instant::now();
                let result = self.cloud.terminate(scope, instance_id, *legacy).await;
                let ms = began.elapsed().as_millis() as u64;
                tracing::debug!(platform, instance = %instance_id, ms, ok = result.is_ok(), "termination answered");
                match &result {
                    Ok(Terminated::Requested) => self.metrics.terminated(platform, reason),
                    Ok(Terminated::AlreadyGone) => {}
                    Err(e) if e.class == ErrorClass::Refused => tracing::warn!(
                        platform,
                        instance = %instance_id,
                        error = %e,
                        "not ours to terminate; forgetting it (listings count it while it runs)"
                    ),
                    Err(e) => {
                        tracing::warn!(platform, instance = %instance_id, error = %e, "termination failed")
                    }
                }
                Some(terminate_event(*op, result))
            }
            Action::Retag {
                instance_id,
                template,
                launch,
            } => {
                let scope = Scope {
                    platform: template,
                    credentials,
                };
                if let Err(e) = self.cloud.retag(scope, instance_id, launch).await {
                    tracing::warn!(
                        platform = %template.platform,
                        instance = %instance_id,
                        %launch,
                        error = %e,
                        "could not retag instance"
                    );
                }
                None
            }
            _ => None,
        }
    }

    /// Lists `template`'s instances (every one with its instance tag, whoever launched it) as the
    /// scheduler wants them, for [`Event::InstancesListed`] and the recovery snapshot.
    pub async fn list(
        &self,
        platform: &Platform,
        template: &DynamicPlatform,
        credentials: &Credentials,
    ) -> Result<Vec<InstanceRecord>, CloudError> {
        let scope = Scope {
            platform: template,
            credentials,
        };
        let listed = self.cloud.list(scope).await?;
        Ok(listed
            .iter()
            .map(|i| i.record(platform, template.strict_public_address))
            .collect())
    }

    /// Describes the instance (batched) and dials SSH when it runs with an address.
    async fn probe(&self, scope: Scope<'_>, id: &str) -> ProbeResult {
        let p = scope.platform;
        let described = match self.probes.describe(scope, id).await {
            Ok(d) => d,
            Err(e) => {
                // Retried at the next probe; the allocation timeout bounds how long.
                tracing::warn!(platform = %p.platform, instance = id, error = %e, "probe lookup failed");
                return ProbeResult::Pending;
            }
        };
        let instance = described.as_ref();
        let ssh = match instance.and_then(|i| dial_address(i, p.strict_public_address)) {
            Some(address) => Some(probe_ssh(&*self.resolver, address, self.ssh_timeout).await),
            None => None,
        };
        probe_result(id, instance, p.strict_public_address, ssh.as_ref())
    }
}

/// The address to dial: a running instance's, once it has one.
fn dial_address(i: &Instance, strict_public: bool) -> Option<&str> {
    (i.state == crate::scheduler::InstanceState::Running)
        .then(|| i.address(strict_public))
        .flatten()
}

/// What a probe found: `instance` as described (`None`: unknown to the cloud, or not ours) and
/// the SSH dial of its address, if one was made.
pub fn probe_result(
    id: &str,
    instance: Option<&Instance>,
    strict_public: bool,
    ssh: Option<&Probe>,
) -> ProbeResult {
    let Some(i) = instance else {
        return ProbeResult::Failed {
            reason: format!("instance {id} no longer exists"),
        };
    };
    if i.state.is_gone() {
        return ProbeResult::Failed {
            reason: format!("instance {id} is {}", i.state.as_str()),
        };
    }
    let Some(address) = i.address(strict_public) else {
        return ProbeResult::Pending;
    };
    match ssh {
        Some(p) if p.is_ready() => ProbeResult::Reachable {
            address: address.to_owned(),
        },
        _ => ProbeResult::Booting {
            address: address.to_owned(),
        },
    }
}

/// The event reporting a launch.
pub fn launch_event(op: OpId, result: Result<LaunchOutcome, CloudError>) -> Event {
    match result {
        Ok(LaunchOutcome::Launched(i) | LaunchOutcome::Adopted(i)) => Event::Launched {
            op,
            instance_id: i.id,
        },
        Ok(LaunchOutcome::Spent(i)) => Event::LaunchSpent {
            op,
            instance_id: i.id,
            state: i.state,
        },
        Err(e) => Event::LaunchFailed {
            op,
            retryable: e.is_retryable(),
            error: e.to_string(),
        },
    }
}

/// The `key` label of a launch rejected for its configuration: the host-config key at fault
/// without its `dynamic.<platform>.` prefix.
fn rejected_key(e: &CloudError) -> &str {
    e.config_key
        .as_deref()
        .and_then(|k| k.rsplit_once('.'))
        .map_or("other", |(_, field)| field)
}

/// The event reporting a termination. A refusal (the instance is not this cluster's to
/// terminate) is reported done, so the scheduler stops tracking it; a listing counts it toward
/// `max-instances` while it runs.
pub fn terminate_event(op: OpId, result: Result<Terminated, CloudError>) -> Event {
    match result {
        Ok(_) => Event::Terminated { op, error: None },
        Err(e) if e.class == ErrorClass::Refused => Event::Terminated { op, error: None },
        Err(e) => Event::Terminated {
            op,
            error: Some(e.to_string()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::Operation;
    use crate::cloud::reach::Endpoint;
    use crate::cloud::testing::{instance, platform};
    use crate::scheduler::InstanceState;

    fn error(class: ErrorClass) -> CloudError {
        CloudError::new(
            &platform(),
            Operation::RunInstances,
            class,
            Some("Code".into()),
            "message".into(),
            1,
        )
    }

    #[test]
    fn launch_results_map_to_events() {
        let op = OpId(7);
        let i = instance("i-1");
        for outcome in [
            LaunchOutcome::Launched(i.clone()),
            LaunchOutcome::Adopted(i.clone()),
        ] {
            assert!(matches!(
                launch_event(op, Ok(outcome)),
                Event::Launched { op: OpId(7), instance_id } if instance_id == "i-1"
            ));
        }
        let gone = Instance {
            state: InstanceState::Stopped,
            ..i
        };
        assert!(matches!(
            launch_event(op, Ok(LaunchOutcome::Spent(gone))),
            Event::LaunchSpent { instance_id, state: InstanceState::Stopped, .. } if instance_id == "i-1"
        ));
        assert!(matches!(
            launch_event(op, Err(error(ErrorClass::Capacity))),
            Event::LaunchFailed {
                retryable: true,
                ..
            }
        ));
        assert!(matches!(
            launch_event(op, Err(error(ErrorClass::Config))),
            Event::LaunchFailed {
                retryable: false,
                ..
            }
        ));
    }

    #[test]
    fn refused_terminations_are_forgotten_other_failures_retried() {
        let op = OpId(3);
        for r in [
            Ok(Terminated::Requested),
            Ok(Terminated::AlreadyGone),
            Err(error(ErrorClass::Refused)),
        ] {
            assert!(matches!(
                terminate_event(op, r),
                Event::Terminated { error: None, .. }
            ));
        }
        assert!(matches!(
            terminate_event(op, Err(error(ErrorClass::Throttled))),
            Event::Terminated { error: Some(_), .. }
        ));
    }

    #[test]
    fn probe_results_follow_state_address_and_ssh() {
        let ready = Probe::Ready {
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 22,
            },
            banner: "SSH-2.0-x".into(),
        };
        let not_ready = Probe::NotReady {
            endpoint: Endpoint {
                host: "127.0.0.1".into(),
                port: 22,
            },
            reason: "refused".into(),
        };
        assert!(matches!(
            probe_result("i-1", None, false, None),
            ProbeResult::Failed { reason } if reason.contains("i-1 no longer exists")
        ));
        let mut i = instance("i-1");
        i.state = InstanceState::Stopping;
        assert!(matches!(
            probe_result("i-1", Some(&i), false, None),
            ProbeResult::Failed { reason } if reason.contains("stopping")
        ));
        i.state = InstanceState::Pending;
        assert_eq!(
            dial_address(&i, false),
            None,
            "never dial a booting instance"
        );
        assert!(matches!(
            probe_result("i-1", Some(&i), false, None),
            ProbeResult::Booting { .. }
        ));
        i.state = InstanceState::Running;
        assert_eq!(
            dial_address(&i, true),
            Some("ec2-54-1-2-3.compute-1.amazonaws.com")
        );
        assert!(matches!(
            probe_result("i-1", Some(&i), false, Some(&ready)),
            ProbeResult::Reachable { address } if address == "ec2-54-1-2-3.compute-1.amazonaws.com"
        ));
        assert!(matches!(
            probe_result("i-1", Some(&i), false, Some(&not_ready)),
            ProbeResult::Booting { .. }
        ));
        i.public_dns = None;
        i.public_ip = None;
        assert!(matches!(
            probe_result("i-1", Some(&i), true, None),
            ProbeResult::Pending
        ));
        assert_eq!(dial_address(&i, true), None);
    }
}
