//! Cloud actions (launch, probe, terminate, retag) and the instance listing, through the one path of
//! [`cloud::Runner`](crate::cloud::runner::Runner), with credentials read from the platform's
//! `aws-secret` at use time (a rotated Secret takes effect at once).

use std::sync::Arc;

use super::{Context, kube as k8s};
use crate::cloud::ByProvider;
use crate::cloud::aws::{AwsCloud, AwsOptions};
use crate::cloud::ibm::{IbmCloud, IbmOptions};
use crate::cloud::metrics::CloudMetrics;
use crate::cloud::reach::Direct;
use crate::cloud::runner::{Runner, RunnerOptions};
use crate::cloud::{ClusterId, Credentials};
use crate::config::DynamicPlatform;
use crate::controller::events::Note;
use crate::platform::Platform;
use crate::scheduler::{Action, Event, InstanceRecord, ProbeResult};

/// The cloud provider of this cluster.
#[derive(Debug)]
pub struct CloudExec {
    runner: Runner,
}

/// Endpoint overrides of the IBM provider (an emulator, or another IBM Cloud environment).
#[derive(Debug, Clone, Default)]
pub struct IbmEndpoints {
    pub iam_url: Option<String>,
    pub tagging_url: Option<String>,
}

impl CloudExec {
    /// EC2 (or an EC2-compatible `endpoint`) tagging launches with `cluster`, and IBM Cloud.
    pub fn new(cluster: ClusterId, endpoint: Option<String>, metrics: CloudMetrics) -> Self {
        Self::with_ibm(cluster, endpoint, IbmEndpoints::default(), metrics)
    }

    /// As [`CloudExec::new`], with IBM endpoint overrides.
    pub fn with_ibm(
        cluster: ClusterId,
        endpoint: Option<String>,
        ibm: IbmEndpoints,
        metrics: CloudMetrics,
    ) -> Self {
        let mut ibm_options = IbmOptions::new(cluster.clone());
        if let Some(u) = ibm.iam_url {
            ibm_options.iam_url = u;
        }
        if let Some(u) = ibm.tagging_url {
            ibm_options.tagging_url = u;
        }
        let mut options = AwsOptions::new(cluster);
        options.endpoint = endpoint;
        let aws = AwsCloud::new(options, metrics.clone());
        let ibm = IbmCloud::new(ibm_options, metrics.clone());
        CloudExec {
            runner: Runner::new(
                Arc::new(ByProvider {
                    aws: Arc::new(aws),
                    ibm: Arc::new(ibm),
                }),
                Arc::new(Direct::default()),
                metrics,
                RunnerOptions::default(),
            ),
        }
    }
}

/// The template a cloud action runs with.
fn template(action: &Action) -> Option<&Arc<DynamicPlatform>> {
    match action {
        Action::Launch { template, .. }
        | Action::Probe { template, .. }
        | Action::Terminate { template, .. }
        | Action::Retag { template, .. } => Some(template),
        _ => None,
    }
}

/// Why a platform's cloud credentials could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error(transparent)]
    Secret(#[from] k8s::SecretError),
    #[error("cloud credentials of {platform} (Secret {namespace}/{secret}): {source}")]
    Invalid {
        platform: String,
        namespace: String,
        secret: String,
        source: crate::cloud::CredentialsError,
    },
}

/// Credentials from the platform's `aws-secret` (IBM: `secret`) in the controller namespace;
/// errors name it.
async fn credentials(
    ctx: &Context,
    template: &DynamicPlatform,
) -> Result<Credentials, CredentialsError> {
    let data = k8s::controller_secret(ctx, &template.aws_secret).await?;
    Credentials::from_secret_data(template.cloud, &template.aws_secret, &data).map_err(|source| {
        CredentialsError::Invalid {
            platform: template.platform.to_string(),
            namespace: ctx.namespace.clone(),
            secret: template.aws_secret.clone(),
            source,
        }
    })
}

/// Runs one cloud action; exactly one result event for those with an `OpId`.
pub async fn run(ctx: &Context, action: Action) -> Vec<Event> {
    let Some(t) = template(&action) else {
        return Vec::new();
    };
    let creds = match credentials(ctx, t).await {
        Ok(c) => c,
        Err(error) => {
            ctx.metrics.failed("cloud_credentials");
            tracing::warn!(platform = %t.platform, %error, "cloud action without credentials");
            return match action {
                // A configuration problem: the TaskRun's error secret says which Secret.
                Action::Launch { op, .. } => vec![Event::LaunchFailed {
                    op,
                    error: error.to_string(),
                    retryable: false,
                }],
                // Tried again at the next probe, within the allocation timeout.
                Action::Probe { op, .. } => vec![Event::Probed {
                    op,
                    result: ProbeResult::Pending,
                }],
                Action::Terminate { op, .. } => vec![Event::Terminated {
                    op,
                    error: Some(error.to_string()),
                }],
                _ => Vec::new(),
            };
        }
    };
    let terminated = match &action {
        Action::Terminate { instance_id, .. } => Some(instance_id.clone()),
        _ => None,
    };
    let events: Vec<Event> = {
        // Probes are not counted: their lookups are coalesced into batched calls already, and
        // holding them back would split the batches.
        let _permit = match &action {
            Action::Probe { .. } => None,
            _ => ctx.limits.cloud.acquire().await.ok(),
        };
        ctx.cloud
            .runner
            .run(&action, &creds)
            .await
            .into_iter()
            .collect()
    };
    if let Action::Launch { template, .. } = &action {
        for e in &events {
            if let Event::LaunchFailed {
                error,
                retryable: false,
                ..
            } = e
            {
                rejected(ctx, template, error);
            }
        }
    }
    if let Some(id) = terminated
        && events
            .iter()
            .any(|e| matches!(e, Event::Terminated { error: None, .. }))
    {
        ctx.known_hosts.forget(ctx, &id).await;
    }
    events
}

/// A launch the cloud rejected for good (a deregistered image, a missing subnet, a denied
/// action): every TaskRun of the platform fails the same way until the host-config is fixed, so
/// the operators get a Warning on the host-config too (the TaskRun has its own).
fn rejected(ctx: &Context, template: &DynamicPlatform, error: &str) {
    ctx.events.submit(Note {
        reference: ctx.config_reference(),
        warning: true,
        reason: "LaunchRejected",
        message: format!("{}: {error}", template.platform),
    });
}

/// Lists one platform's instances, `None` on failure (logged).
pub async fn list(
    ctx: &Context,
    platform: &Platform,
    t: &DynamicPlatform,
) -> Option<Vec<InstanceRecord>> {
    let creds = match credentials(ctx, t).await {
        Ok(c) => c,
        Err(error) => {
            tracing::warn!(%platform, %error, "cannot list instances");
            return None;
        }
    };
    match ctx.cloud.runner.list(platform, t, &creds).await {
        Ok(l) => Some(l),
        Err(error) => {
            tracing::warn!(%platform, %error, "listing instances failed");
            None
        }
    }
}
