//! The validated configuration: what [`super::parse`] produces and the rest of the crate reads.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use super::BuildUsers;
use crate::platform::Platform;

/// ConfigMap `data`: key → string value.
pub type ConfigData = BTreeMap<String, String>;

/// Instance tag used when neither `instance-tag` nor `dynamic.<p>.instance-tag` is set.
pub const DEFAULT_INSTANCE_TAG: &str = "multi-platform-controller";
/// Login user on dynamic instances unless `dynamic.<p>.user` says otherwise (Amazon Linux, RHEL).
pub const DEFAULT_INSTANCE_USER: &str = "ec2-user";
/// Root disk size of dynamic instances, GB.
pub const DEFAULT_DISK_GB: u32 = 40;
/// How long a dynamic allocation may take before the TaskRun gets an error secret.
pub const DEFAULT_ALLOCATION_TIMEOUT: Duration = Duration::from_secs(600);
/// How often a booting instance is checked.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(60);
/// Dynamic pool instances stop taking work after this age unless `max-age` says otherwise.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(24 * 60 * 60);
/// How long AWS scrubs a Mac dedicated host after an instance on it terminates (about 50 min).
pub const DEFAULT_HOST_SCRUB: Duration = Duration::from_secs(50 * 60);
/// Largest per-host / per-instance concurrency.
pub const MAX_CONCURRENCY: u32 = 8;
/// AWS limit on raw user-data.
pub const MAX_USER_DATA_BYTES: usize = 16 * 1024;

/// How bad a diagnostic is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Works, but probably not as meant.
    Warning,
    /// The entry (host, platform or item) is disabled.
    Error,
}

/// One problem found in the ConfigMap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// Warning or error.
    pub severity: Severity,
    /// The ConfigMap key.
    pub key: String,
    /// The offending value, when there is one.
    pub value: Option<String>,
    /// What is wrong and, where useful, what to do.
    pub message: String,
}

impl Diagnostic {
    /// The problem without its severity: `key = "value": message`.
    pub fn detail(&self) -> String {
        match &self.value {
            Some(v) => {
                let shown: String = if v.chars().count() > 80 {
                    format!("{}…", v.chars().take(80).collect::<String>())
                } else {
                    v.clone()
                };
                format!("{} = {shown:?}: {}", self.key, self.message)
            }
            None => format!("{}: {}", self.key, self.message),
        }
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Warning => "warning",
            Severity::Error => "error",
        };
        write!(f, "{sev}: {}", self.detail())
    }
}

/// Cloud provider of a dynamic platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloudKind {
    /// Amazon EC2 (or an EC2-compatible endpoint).
    Aws,
    /// IBM Cloud: VPC (`type: ibmz`) or Power Virtual Server (`type: ibmp`); the service and its
    /// keys are in [`DynamicPlatform::ibm`].
    Ibm,
}

/// How SSH host keys of dynamic instances are trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostKeyPolicy {
    /// Record the key on first contact with each instance; refuse any later change.
    #[default]
    TrustOnFirstUse,
}

/// Instance metadata service (IMDS) options of launched instances. The default requires IMDSv2
/// session tokens with a PUT response hop limit of 1: a build container behind a bridge (one hop
/// more) or a request forgery on the instance (a GET) cannot read the instance role's
/// credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImdsOptions {
    /// `imds-tokens`: `required` (IMDSv2 only, the default) or `optional` (IMDSv1 allowed).
    pub tokens_required: bool,
    /// `imds-hop-limit`: 1..=64, default 1.
    pub hop_limit: u32,
}

impl Default for ImdsOptions {
    fn default() -> Self {
        Self {
            tokens_required: true,
            hop_limit: 1,
        }
    }
}

/// Operating system of a dynamic platform's instances, told by the platform name as the Go
/// controller tells it (`windows*`, `macos*`, anything else is Linux).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HostOs {
    /// Build users are created and removed over SSH with POSIX scripts.
    #[default]
    Linux,
    /// The operator's user-data creates `konflux-builder` and leaves its private key at
    /// `C:\Users\Administrator\konflux-builder`; the controller hands that key out.
    Windows,
    /// Like Windows, on a dedicated host; the key is at `/Users/ec2-user/konflux-builder`.
    MacOs,
}

impl HostOs {
    /// The OS of `platform`'s instances.
    pub fn of(platform: &Platform) -> Self {
        let p = platform.as_str();
        if p.starts_with("windows") {
            Self::Windows
        } else if p.starts_with("macos") {
            Self::MacOs
        } else {
            Self::Linux
        }
    }

    /// True when the instance's user-data makes the build user and its key, which the
    /// controller only hands out (no build user is created or removed).
    pub fn hands_off_key(self) -> bool {
        self != Self::Linux
    }

    /// The login the controller uses with the platform's `ssh-secret`; `None` for Linux (the
    /// `user` key decides).
    pub fn admin_user(self) -> Option<&'static str> {
        match self {
            Self::Linux => None,
            Self::Windows => Some("Administrator"),
            Self::MacOs => Some("ec2-user"),
        }
    }

    /// Lower-case name, for reports and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Linux => "linux",
            Self::Windows => "windows",
            Self::MacOs => "macos",
        }
    }
}

/// Where macOS instances are placed: a dedicated host of a host resource group, licensed by a
/// License Manager configuration (`tenancy`, `host-resource-group-arn`,
/// `license-configuration-arn`, all three or none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedicatedHost {
    /// `Placement.Tenancy` (`host`).
    pub tenancy: String,
    /// `Placement.HostResourceGroupArn`.
    pub host_resource_group_arn: String,
    /// `LicenseSpecifications[0].LicenseConfigurationArn`.
    pub license_configuration_arn: String,
    /// How long a host is scrubbed after each instance terminates (`host-scrub`, minutes, ours;
    /// default [`DEFAULT_HOST_SCRUB`]): the instance's `max-instances` slot stays taken as long,
    /// since a launch onto a host still scrubbing is refused.
    pub scrub: Duration,
}

/// A dynamic platform: one cloud instance per TaskRun (also the instance template of a pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicPlatform {
    /// The platform served.
    pub platform: Platform,
    /// Cloud provider (`type`).
    pub cloud: CloudKind,
    /// Cloud region. IBM: the API endpoint (`url`), which names the region: instance lookups of
    /// one endpoint and API key are batched together.
    pub region: String,
    /// Machine image.
    pub ami: String,
    pub instance_type: String,
    /// Cloud key pair whose private half is in `ssh_secret`.
    pub key_name: Option<String>,
    /// Secret with the cloud credentials: AWS `access-key-id`, `secret-access-key`, optional
    /// `session-token`; IBM `api-key` (the platform's `secret` key).
    pub aws_secret: String,
    /// Secret with `id_rsa` to log in to instances.
    pub ssh_secret: String,
    /// Login user on the instance (`user`, ours; default `ec2-user`).
    pub user: String,
    /// Security group name.
    pub security_group: Option<String>,
    pub security_group_id: Option<String>,
    pub subnet_id: Option<String>,
    /// Instance profile by name.
    pub instance_profile_name: Option<String>,
    /// Instance profile by ARN.
    pub instance_profile_arn: Option<String>,
    /// Only ever use a public address.
    pub strict_public_address: bool,
    /// Root disk, GB (gp3).
    pub disk_gb: u32,
    /// Root disk IOPS.
    pub iops: Option<u32>,
    /// Root disk throughput, MiB/s.
    pub throughput: Option<u32>,
    /// Raw user-data (base64-encoded at launch).
    pub user_data: Option<String>,
    /// Most instances at once, booting ones included.
    pub max_instances: u32,
    /// Effective instance tag (per platform, else global, else the default).
    pub instance_tag: String,
    /// Longest time from request to secret.
    pub allocation_timeout: Duration,
    /// Interval between readiness checks of a booting instance.
    pub check_interval: Duration,
    /// Commands the build user may run with sudo.
    pub sudo_commands: Vec<String>,
    /// Launch as spot, falling back to on-demand when spot capacity is refused.
    pub spot: bool,
    /// Host key trust policy.
    pub host_key_policy: HostKeyPolicy,
    /// Instance metadata service options.
    pub imds: ImdsOptions,
    /// Operating system of the instances (from the platform name).
    pub os: HostOs,
    /// Dedicated-host placement (macOS only).
    pub dedicated_host: Option<DedicatedHost>,
    /// The IBM service and its keys, for [`CloudKind::Ibm`] (the EC2 fields above then carry
    /// what they can: image, profile or system, key, disk, user-data).
    pub ibm: Option<super::ibm_service::IbmService>,
    /// `drain: true` (ours): nothing new is launched, and a pool's instances take no new
    /// TaskRuns (idle ones are terminated); what runs finishes. Its capacity counts as 0.
    pub drained: bool,
}

impl DynamicPlatform {
    /// Concurrent TaskRuns it may start now: `max-instances`, or 0 while drained.
    pub fn capacity(&self) -> u32 {
        if self.drained { 0 } else { self.max_instances }
    }
}

impl DynamicPool {
    /// Concurrent TaskRuns it may serve now: `max-instances × concurrency`, or 0 while drained.
    pub fn capacity(&self) -> u32 {
        self.instance.capacity() * self.concurrency
    }
}

/// A dynamic pool: instances shared by up to `concurrency` TaskRuns each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicPool {
    /// The instance template and limits.
    pub instance: DynamicPlatform,
    /// TaskRuns per instance.
    pub concurrency: u32,
    /// Instances older than this take no new work and are terminated when idle.
    pub max_age: Duration,
    /// Instances kept warm even when idle (ours).
    pub min_instances: u32,
}

/// A static build host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticHost {
    /// Name from `host.<name>.*` (may contain dots); the `assigned-host` label value.
    pub name: String,
    /// IP address or DNS name.
    pub address: String,
    /// Admin login user.
    pub user: String,
    /// Platform served.
    pub platform: Platform,
    /// Secret with the admin user's `id_rsa`.
    pub secret: String,
    /// Concurrent TaskRuns as configured (0 only when drained by `concurrency: "0"`).
    pub concurrency: u32,
    /// Pinned host key (`<alg> <base64>`), if given.
    pub host_key: Option<String>,
    /// Drained (`drain: "true"` or `concurrency: "0"`, ours): takes no new TaskRun; the builds
    /// on it finish and their users are removed from it.
    pub drained: bool,
}

impl StaticHost {
    /// TaskRuns it may hold now: its `concurrency`, or 0 while drained.
    pub fn capacity(&self) -> u32 {
        if self.drained { 0 } else { self.concurrency }
    }
}

/// The static hosts serving one platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticPool {
    /// The platform served.
    pub platform: Platform,
    /// Hosts, sorted by name.
    pub hosts: Vec<StaticHost>,
}

impl StaticPool {
    /// Total concurrent TaskRuns over all hosts (drained hosts count 0).
    pub fn capacity(&self) -> u32 {
        self.hosts.iter().map(StaticHost::capacity).sum()
    }

    /// The drained hosts, by name.
    pub fn drained(&self) -> impl Iterator<Item = &StaticHost> {
        self.hosts.iter().filter(|h| h.drained)
    }
}

/// How a platform is served, after resolution (local → dynamic → dynamic pool → static).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy<'a> {
    /// In-cluster nodes (or the pod itself for `local`/`localhost`).
    Local,
    /// One instance per TaskRun.
    Dynamic(&'a DynamicPlatform),
    /// Shared instances.
    DynamicPool(&'a DynamicPool),
    /// Static hosts.
    Static(&'a StaticPool),
    /// Configured, but disabled by errors; the string says why.
    Disabled(&'a str),
    /// Not configured at all.
    Unknown,
}

/// Largest accepted `max`.
pub const MAX_GROUP_LIMIT: u32 = 100_000;

/// What counts against a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GroupScope {
    /// This cluster's instances of the members.
    #[default]
    Cluster,
    /// Also the members' foreign instances in their accounts (the `max-instances` bill guard's
    /// count), so clusters sharing an account and subnet share the limit.
    Account,
}

impl GroupScope {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupScope::Cluster => "cluster",
            GroupScope::Account => "account",
        }
    }
}

/// A capacity group (`capacity-group.<name>.*`) and the platforms that name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityGroup {
    /// Also its Kueue resource name.
    pub name: String,
    /// Units (instances) its members may hold together.
    pub max: u32,
    pub scope: GroupScope,
    /// Dynamic platforms and pools in it (served ones only).
    pub members: BTreeSet<Platform>,
}

/// The whole validated configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostConfig {
    /// Platforms built on in-cluster nodes.
    pub local: BTreeSet<Platform>,
    /// One instance per TaskRun.
    pub dynamic: BTreeMap<Platform, DynamicPlatform>,
    /// Shared instance pools.
    pub pools: BTreeMap<Platform, DynamicPool>,
    /// Static host pools by platform.
    pub static_pools: BTreeMap<Platform, StaticPool>,
    /// Platforms named by the config but disabled by errors, with the reason.
    pub disabled: BTreeMap<Platform, String>,
    /// Global instance tag (`instance-tag`).
    pub instance_tag: String,
    /// Extra tags on every instance.
    pub additional_instance_tags: Vec<(String, String)>,
    /// Webhook sets `spec.status: TaskRunPending` on remote TaskRuns.
    pub gate_pending: bool,
    /// Webhook denies unknown platforms with HTTP 422.
    pub reject_unknown_platforms: bool,
    /// URL of the OTP server's `/otp` endpoint as seen from build pods.
    pub otp_server_url: Option<String>,
    /// How build users are set up (key type, slice caps) per static host and dynamic platform.
    pub build_users: BuildUsers,
    /// Limits shared by several dynamic platforms and pools, by name (`capacity-group.<g>.*`).
    pub capacity_groups: BTreeMap<String, CapacityGroup>,
}

impl HostConfig {
    /// Resolves a platform: local → dynamic → dynamic pool → static; disabled entries keep their
    /// place in that order (a broken dynamic entry does not silently fall through to static hosts).
    pub fn resolve(&self, platform: &Platform) -> Strategy<'_> {
        if self.local.contains(platform) {
            return Strategy::Local;
        }
        if let Some(reason) = self.disabled.get(platform) {
            return Strategy::Disabled(reason);
        }
        if let Some(d) = self.dynamic.get(platform) {
            return Strategy::Dynamic(d);
        }
        if let Some(p) = self.pools.get(platform) {
            return Strategy::DynamicPool(p);
        }
        if let Some(s) = self.static_pools.get(platform) {
            return Strategy::Static(s);
        }
        Strategy::Unknown
    }

    /// Every platform the config names, in order.
    pub fn platforms(&self) -> BTreeSet<&Platform> {
        self.local
            .iter()
            .chain(self.dynamic.keys())
            .chain(self.pools.keys())
            .chain(self.static_pools.keys())
            .chain(self.disabled.keys())
            .collect()
    }

    /// The capacity groups `platform` is a member of, by name.
    pub fn groups_of<'a>(
        &'a self,
        platform: &'a Platform,
    ) -> impl Iterator<Item = &'a CapacityGroup> + 'a {
        self.capacity_groups
            .values()
            .filter(move |g| g.members.contains(platform))
    }

    /// The platform takes no new work because of a drain: a drained dynamic platform or pool,
    /// or static hosts that are all drained.
    pub fn is_drained(&self, platform: &Platform) -> bool {
        match self.resolve(platform) {
            Strategy::Dynamic(d) => d.drained,
            Strategy::DynamicPool(p) => p.instance.drained,
            Strategy::Static(s) => s.hosts.iter().all(|h| h.drained),
            _ => false,
        }
    }

    /// Every drained static host of a served static platform.
    pub fn drained_hosts(&self) -> impl Iterator<Item = &StaticHost> {
        self.static_pools.values().flat_map(StaticPool::drained)
    }

    /// Concurrent TaskRuns a platform can serve (`platform_pool_size`; drained capacity counts
    /// 0); `None` for local/unknown.
    pub fn capacity(&self, platform: &Platform) -> Option<u32> {
        match self.resolve(platform) {
            Strategy::Dynamic(d) => Some(d.capacity()),
            Strategy::DynamicPool(p) => Some(p.capacity()),
            Strategy::Static(s) => Some(s.capacity()),
            Strategy::Disabled(_) => Some(0),
            Strategy::Local | Strategy::Unknown => None,
        }
    }
}

/// Result of parsing: the usable config plus every problem found.
#[derive(Debug, Clone, Default)]
pub struct Parsed {
    /// The configuration, with bad entries left out.
    pub config: HostConfig,
    /// Warnings and errors, in key order within each phase.
    pub diagnostics: Vec<Diagnostic>,
}

impl Parsed {
    /// True when any diagnostic is an error.
    pub fn has_errors(&self) -> bool {
        self.diagnostics
            .iter()
            .any(|d| d.severity == Severity::Error)
    }

    /// Diagnostics of one severity.
    pub fn of(&self, severity: Severity) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics
            .iter()
            .filter(move |d| d.severity == severity)
    }
}
