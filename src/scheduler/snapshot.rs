//! The state the core is rebuilt from after a restart: TaskRun labels and annotations (design
//! §2) and the instances the cloud lists with our tags. Plain data.

use std::collections::BTreeMap;

use super::time::Time;
use crate::contract;
use crate::platform::Platform;

/// Everything needed to rebuild the ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Every TaskRun labelled `target-platform` (or otherwise ours) that still has our finalizer or
    /// is not done.
    pub taskruns: Vec<TaskRunRecord>,
    /// Every instance listed with our tags, per dynamic platform's credentials.
    pub instances: Vec<InstanceRecord>,
}

/// One TaskRun as recorded on the cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskRunRecord {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// The `PLATFORM` param.
    pub platform: String,
    /// `allocation-start-time` (or creation time).
    pub since: Time,
    /// Retries started.
    pub retries: u32,
    /// Still `TaskRunPending`.
    pub gated: bool,
    /// Done or being deleted (cleanup is due).
    pub finished: bool,
    /// `assigned-host` label.
    pub assigned_host: Option<String>,
    /// `failed-hosts` annotation.
    pub failed_hosts: Vec<String>,
    /// `cloud-instance-id` annotation.
    pub instance_id: Option<String>,
    /// `cloud-address` annotation.
    pub instance_address: Option<String>,
    /// What the TaskRun's secret holds, if it exists.
    pub secret: Option<SecretKind>,
}

impl TaskRunRecord {
    /// Fills the allocation fields from the TaskRun's labels and annotations.
    pub fn read_metadata(
        &mut self,
        labels: &BTreeMap<String, String>,
        annotations: &BTreeMap<String, String>,
    ) {
        let nonempty = |v: Option<&String>| v.filter(|s| !s.is_empty()).cloned();
        self.assigned_host = nonempty(labels.get(contract::ASSIGNED_HOST_LABEL));
        self.instance_id = nonempty(annotations.get(contract::CLOUD_INSTANCE_ID_ANNOTATION));
        self.instance_address = nonempty(annotations.get(contract::CLOUD_ADDRESS_ANNOTATION));
        self.failed_hosts = annotations
            .get(contract::FAILED_HOSTS_ANNOTATION)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        if let Some(secs) = annotations
            .get(contract::ALLOCATION_START_TIME_ANNOTATION)
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            self.since = Time::from_secs(secs);
        }
    }
}

/// Which of the secret's forms exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// `otp`/`host`/`user-dir`.
    Remote,
    /// `host: localhost`.
    Localhost,
    /// `error`.
    Error,
}

/// One listed cloud instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceRecord {
    /// Instance id.
    pub id: String,
    /// The platform whose config (credentials, region) listed it.
    pub platform: Platform,
    /// `multi-platform-instance` tag.
    pub instance_tag: String,
    /// `taskRunID` tag (`<namespace>:<name>`).
    pub taskrun_id: Option<String>,
    /// Launch time.
    pub launched_at: Time,
    /// Lifecycle state.
    pub state: InstanceState,
    /// SSH address, when it has one.
    pub address: Option<String>,
}

/// Cloud lifecycle state of an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceState {
    /// Starting.
    Pending,
    /// Running.
    Running,
    /// Stopping or stopped: not usable.
    Stopped,
    /// Shutting down or terminated: gone.
    Terminated,
}

impl InstanceState {
    /// Gone or going.
    pub fn is_gone(self) -> bool {
        self == InstanceState::Terminated
    }
}
