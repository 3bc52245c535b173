//! Cloud actions: launch, probe, terminate, retag (design §5).

use super::Context;
use crate::scheduler::{Action, Event, ProbeResult};

/// Runs one cloud action; exactly one result event for those with an `OpId`.
pub async fn run(_ctx: &Context, action: Action) -> Vec<Event> {
    let error = "cloud actions are not wired into the controller yet".to_owned();
    match action {
        Action::Launch { op, .. } => vec![Event::LaunchFailed {
            op,
            error,
            retryable: false,
        }],
        Action::Probe { op, .. } => vec![Event::Probed {
            op,
            result: ProbeResult::Failed { reason: error },
        }],
        Action::Terminate { op, .. } => vec![Event::Terminated {
            op,
            error: Some(error),
        }],
        _ => Vec::new(),
    }
}

/// Every instance the dynamic platforms' credentials can see (recovery's listing).
pub async fn list_all(
    _ctx: &Context,
    _config: &crate::config::HostConfig,
) -> Option<Vec<crate::scheduler::InstanceRecord>> {
    Some(Vec::new())
}

/// The cloud provider and its helpers.
#[derive(Debug)]
pub struct CloudExec {
    pub cluster_id: String,
    pub endpoint: Option<String>,
}

impl CloudExec {
    /// A provider tagging instances with `cluster_id`.
    pub fn new(cluster_id: String, endpoint: Option<String>) -> Self {
        Self {
            cluster_id,
            endpoint,
        }
    }
}
