//! The `host-config` ConfigMap (docs/architecture.md, "The contract with the Go controller") as
//! typed, validated configuration.
//!
//! Pure code. [`parse`] never fails as a whole: every problem becomes a [`Diagnostic`] naming the key
//! and the bad value, and a bad entry disables only its own host or platform (recorded in
//! [`HostConfig::disabled`] so TaskRuns for it get an error secret that says why).

mod build_user;
mod configmap;
mod last_good;
mod report;
pub mod values;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

pub use build_user::{BuildUserSettings, BuildUsers, CpuQuota, KeyType, MemoryMax};
pub use configmap::{ConfigMapError, read_configmap_yaml};
pub use last_good::{Merged, keep_last_good};
pub use report::{PlatformSummary, render_report};

use crate::platform::{Platform, label_value};

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

/// A dynamic platform: one cloud instance per TaskRun (also the instance template of a pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamicPlatform {
    /// The platform served.
    pub platform: Platform,
    /// Cloud provider (`type`).
    pub cloud: CloudKind,
    /// Cloud region.
    pub region: String,
    /// Machine image.
    pub ami: String,
    pub instance_type: String,
    /// Cloud key pair whose private half is in `ssh_secret`.
    pub key_name: Option<String>,
    /// Secret with `access-key-id`, `secret-access-key`, optional `session-token`.
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
    /// Concurrent TaskRuns.
    pub concurrency: u32,
    /// Pinned host key (`<alg> <base64>`), if given.
    pub host_key: Option<String>,
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
    /// Total concurrent TaskRuns over all hosts.
    pub fn capacity(&self) -> u32 {
        self.hosts.iter().map(|h| h.concurrency).sum()
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

    /// Concurrent TaskRuns a platform can serve (`platform_pool_size`); `None` for local/unknown.
    pub fn capacity(&self, platform: &Platform) -> Option<u32> {
        match self.resolve(platform) {
            Strategy::Dynamic(d) => Some(d.max_instances),
            Strategy::DynamicPool(p) => Some(p.instance.max_instances * p.concurrency),
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

const GLOBAL_KEYS: [&str; 8] = [
    "local-platforms",
    "dynamic-platforms",
    "dynamic-pool-platforms",
    "instance-tag",
    "additional-instance-tags",
    "gate-pending",
    "reject-unknown-platforms",
    "otp-server-url",
];

const DYNAMIC_FIELDS: [&str; 31] = [
    "type",
    "region",
    "ami",
    "instance-type",
    "key-name",
    "aws-secret",
    "ssh-secret",
    "user",
    "security-group",
    "security-group-id",
    "subnet-id",
    "instance-profile-name",
    "instance-profile-arn",
    "strict-public-address",
    "disk",
    "iops",
    "throughput",
    "user-data",
    "max-instances",
    "instance-tag",
    "allocation-timeout",
    "check-interval",
    "sudo-commands",
    "spot",
    "host-key-policy",
    "imds-tokens",
    "imds-hop-limit",
    // Pool-only.
    "concurrency",
    "max-age",
    "min-instances",
    // Written by some Go deployments; the scheduler does its own back-off.
    "max-retries",
];

const POOL_ONLY_FIELDS: [&str; 3] = ["concurrency", "max-age", "min-instances"];

const HOST_FIELDS: [&str; 7] = [
    "address",
    "user",
    "platform",
    "secret",
    "concurrency",
    "host-key",
    // Go-era key for a per-host sudo list; accepted and ignored with a warning below.
    "sudo-commands",
];

/// Collects diagnostics while parsing.
#[derive(Default)]
struct Sink(Vec<Diagnostic>);

impl Sink {
    fn error(&mut self, key: &str, value: Option<&str>, message: impl Into<String>) {
        self.push(Severity::Error, key, value, message.into());
    }
    fn warn(&mut self, key: &str, value: Option<&str>, message: impl Into<String>) {
        self.push(Severity::Warning, key, value, message.into());
    }
    fn push(&mut self, severity: Severity, key: &str, value: Option<&str>, message: String) {
        self.0.push(Diagnostic {
            severity,
            key: key.to_owned(),
            value: value.map(str::to_owned),
            message,
        });
    }
}

/// Which list named a dynamic platform.
#[derive(Clone, Copy, PartialEq, Eq)]
enum DynKind {
    Dynamic,
    Pool,
}

/// Parses ConfigMap data into a [`HostConfig`] and diagnostics. Never fails as a whole.
pub fn parse(data: &ConfigData) -> Parsed {
    let mut sink = Sink::default();
    let mut cfg = HostConfig::default();

    // Group keys by section.
    let mut dyn_groups: BTreeMap<&str, BTreeMap<&str, &str>> = BTreeMap::new();
    let mut host_groups: BTreeMap<&str, BTreeMap<&str, &str>> = BTreeMap::new();
    for (key, value) in data {
        if let Some(rest) = key.strip_prefix("dynamic.") {
            match rest.split_once('.') {
                Some((p, field)) if !p.is_empty() && !field.is_empty() => {
                    dyn_groups.entry(p).or_default().insert(field, value);
                }
                _ => sink.warn(
                    key,
                    None,
                    "unknown key (expected dynamic.<os-arch>.<field>)",
                ),
            }
        } else if let Some(rest) = key.strip_prefix("host.") {
            // Host names may contain dots: the field is the last component.
            match rest.rsplit_once('.') {
                Some((name, field)) if !name.is_empty() && !field.is_empty() => {
                    host_groups.entry(name).or_default().insert(field, value);
                }
                _ => sink.warn(key, None, "unknown key (expected host.<name>.<field>)"),
            }
        } else if !GLOBAL_KEYS.contains(&key.as_str()) {
            sink.warn(key, None, "unknown key, ignored by this version");
        }
    }

    // Globals.
    let global_tag = data
        .get("instance-tag")
        .and_then(|v| match values::single_token(v) {
            Ok(t) => Some(t.to_owned()),
            Err(e) => {
                sink.error("instance-tag", Some(v), e);
                None
            }
        });
    cfg.instance_tag = global_tag
        .clone()
        .unwrap_or_else(|| DEFAULT_INSTANCE_TAG.to_owned());
    if let Some(v) = data.get("additional-instance-tags") {
        match values::instance_tags(v) {
            Ok(t) => cfg.additional_instance_tags = t,
            Err(bad) => {
                for (item, why) in bad {
                    sink.error(
                        "additional-instance-tags",
                        Some(&item),
                        format!("{why}; this tag is left out"),
                    );
                }
                cfg.additional_instance_tags = values::split_commas(v)
                    .filter_map(|i| values::instance_tags(i).ok())
                    .flatten()
                    .collect();
            }
        }
    }
    for (key, slot) in [
        ("gate-pending", &mut cfg.gate_pending),
        (
            "reject-unknown-platforms",
            &mut cfg.reject_unknown_platforms,
        ),
    ] {
        if let Some(v) = data.get(key) {
            match values::parse_bool(v) {
                Ok(b) => *slot = b,
                Err(e) => sink.error(key, Some(v), format!("{e}; using false")),
            }
        }
    }
    if let Some(v) = data.get("otp-server-url") {
        let v = v.trim();
        if v.starts_with("https://") && values::single_token(v).is_ok() && v.len() > 8 {
            cfg.otp_server_url = Some(v.to_owned());
        } else {
            sink.error(
                "otp-server-url",
                Some(v),
                "must be an https:// URL without spaces",
            );
        }
    }

    // Platform lists, in resolution order; the first list naming a platform wins.
    let mut claimed: BTreeMap<Platform, &str> = BTreeMap::new();
    let mut dyn_listed: Vec<(Platform, DynKind)> = Vec::new();
    for list in [
        "local-platforms",
        "dynamic-platforms",
        "dynamic-pool-platforms",
    ] {
        let Some(v) = data.get(list) else { continue };
        for item in values::split_list(v) {
            let p = match Platform::parse(item) {
                Ok(p) => p,
                Err(e) => {
                    sink.error(list, Some(item), format!("{e}; this platform is left out"));
                    continue;
                }
            };
            if let Some(first) = claimed.get(&p) {
                if *first == list {
                    sink.warn(list, Some(item), "listed twice");
                } else {
                    sink.warn(
                        list,
                        Some(item),
                        format!(
                            "also listed in {first}, which takes precedence; this entry is ignored"
                        ),
                    );
                }
                continue;
            }
            claimed.insert(p.clone(), list);
            match list {
                "local-platforms" => {
                    cfg.local.insert(p);
                }
                "dynamic-platforms" => dyn_listed.push((p, DynKind::Dynamic)),
                _ => dyn_listed.push((p, DynKind::Pool)),
            }
        }
    }

    // Dynamic platforms and pools.
    let mut used_groups: BTreeSet<String> = BTreeSet::new();
    for (platform, kind) in dyn_listed {
        let label = label_value(platform.as_str());
        let prefix = format!("dynamic.{label}");
        used_groups.insert(label.clone());
        let Some(fields) = dyn_groups.get(label.as_str()) else {
            let list = if kind == DynKind::Dynamic {
                "dynamic-platforms"
            } else {
                "dynamic-pool-platforms"
            };
            let reason = format!("{platform} is listed in {list} but has no {prefix}.* keys");
            sink.warn(
                list,
                Some(platform.as_str()),
                format!(
                    "no {prefix}.* keys: platform not configured; its TaskRuns get an error secret"
                ),
            );
            cfg.disabled.insert(platform, reason);
            continue;
        };
        let before = sink.0.len();
        let parsed = parse_dynamic(
            &platform,
            &prefix,
            fields,
            kind,
            global_tag.as_deref(),
            &mut sink,
        );
        match parsed {
            Some((d, pool, build_user)) => {
                if build_user != BuildUserSettings::DEFAULT {
                    cfg.build_users
                        .platforms
                        .insert(platform.clone(), build_user);
                }
                match (kind, pool) {
                    (DynKind::Dynamic, _) => {
                        cfg.dynamic.insert(platform, d);
                    }
                    (DynKind::Pool, Some((concurrency, max_age, min_instances))) => {
                        cfg.pools.insert(
                            platform,
                            DynamicPool {
                                instance: d,
                                concurrency,
                                max_age,
                                min_instances,
                            },
                        );
                    }
                    (DynKind::Pool, None) => unreachable!("pool fields are parsed for pools"),
                }
            }
            None => {
                let reason = first_error_since(&sink, before)
                    .map(|d| {
                        format!(
                            "{platform} is disabled by a configuration error: {}",
                            d.detail()
                        )
                    })
                    .unwrap_or_else(|| format!("{platform} is disabled by a configuration error"));
                cfg.disabled.insert(platform, reason);
            }
        }
    }
    for (label, fields) in &dyn_groups {
        if !used_groups.contains(*label) {
            let first = fields.keys().next().copied().unwrap_or("type");
            sink.warn(
                &format!("dynamic.{label}.{first}"),
                None,
                format!(
                    "dynamic.{label}.* keys are unused: no platform with label value {label} is listed in dynamic-platforms or dynamic-pool-platforms"
                ),
            );
        }
    }

    // Static hosts.
    let mut by_platform: BTreeMap<Platform, Vec<StaticHost>> = BTreeMap::new();
    let mut host_build_users: BTreeMap<String, BuildUserSettings> = BTreeMap::new();
    let mut broken_static: BTreeMap<Platform, String> = BTreeMap::new();
    for (name, fields) in &host_groups {
        let before = sink.0.len();
        match parse_host(name, fields, &mut sink) {
            Ok((h, build_user)) => {
                if build_user != BuildUserSettings::DEFAULT {
                    host_build_users.insert(h.name.clone(), build_user);
                }
                by_platform.entry(h.platform.clone()).or_default().push(h);
            }
            Err(Some(p)) => {
                if let Some(d) = first_error_since(&sink, before) {
                    broken_static.entry(p).or_insert_with(|| d.to_string());
                }
            }
            Err(None) => {}
        }
    }
    for (p, hosts) in by_platform {
        if let Some(first) = claimed.get(&p) {
            sink.warn(
                &format!("host.{}.platform", hosts[0].name),
                Some(p.as_str()),
                format!(
                    "{p} is listed in {first}, which takes precedence; {} static host(s) are unused",
                    hosts.len()
                ),
            );
            continue;
        }
        broken_static.remove(&p);
        for h in &hosts {
            if let Some(b) = host_build_users.remove(&h.name) {
                cfg.build_users.hosts.insert(h.name.clone(), b);
            }
        }
        cfg.static_pools
            .insert(p.clone(), StaticPool { platform: p, hosts });
    }
    for (p, why) in broken_static {
        if !claimed.contains_key(&p) {
            cfg.disabled.insert(
                p.clone(),
                format!("every static host for {p} is misconfigured: {why}"),
            );
        }
    }

    Parsed {
        config: cfg,
        diagnostics: sink.0,
    }
}

fn first_error_since(sink: &Sink, from: usize) -> Option<&Diagnostic> {
    sink.0[from..]
        .iter()
        .find(|d| d.severity == Severity::Error)
}

type PoolFields = (u32, Duration, u32);

/// Parses one `dynamic.<label>.*` group. `None` when an error disables the platform.
fn parse_dynamic(
    platform: &Platform,
    prefix: &str,
    f: &BTreeMap<&str, &str>,
    kind: DynKind,
    global_tag: Option<&str>,
    sink: &mut Sink,
) -> Option<(DynamicPlatform, Option<PoolFields>, BuildUserSettings)> {
    let mut ok = true;
    let key = |field: &str| format!("{prefix}.{field}");

    for (field, value) in f {
        if !DYNAMIC_FIELDS.contains(field) && !build_user::FIELDS.contains(field) {
            sink.warn(
                &key(field),
                Some(value),
                "unknown field, ignored by this version",
            );
        } else if kind == DynKind::Dynamic && POOL_ONLY_FIELDS.contains(field) {
            sink.warn(
                &key(field),
                Some(value),
                format!(
                    "ignored: {field} applies only to platforms listed in dynamic-pool-platforms"
                ),
            );
        } else if *field == "max-retries" {
            sink.warn(
                &key(field),
                Some(value),
                "ignored: retries are bounded by the scheduler",
            );
        }
    }

    let mut required = |field: &str, sink: &mut Sink| -> Option<String> {
        match f.get(field) {
            None => {
                sink.error(
                    &key(field),
                    None,
                    format!("required for dynamic platform {platform}"),
                );
                ok = false;
                None
            }
            Some(v) => match values::single_token(v) {
                Ok(t) => Some(t.to_owned()),
                Err(e) => {
                    sink.error(&key(field), Some(v), e);
                    ok = false;
                    None
                }
            },
        }
    };
    let cloud = match required("type", sink).as_deref() {
        Some("aws") => Some(CloudKind::Aws),
        Some(other) => {
            sink.error(
                &key("type"),
                Some(other),
                "unsupported cloud type (this version supports \"aws\")",
            );
            None
        }
        None => None,
    };
    let region = required("region", sink);
    let ami = required("ami", sink);
    let instance_type = required("instance-type", sink);
    let aws_secret = required("aws-secret", sink);
    let ssh_secret = required("ssh-secret", sink);
    let mut ok = ok && cloud.is_some();

    let mut optional_token = |field: &str, sink: &mut Sink| -> Option<String> {
        let v = f.get(field)?;
        match values::single_token(v) {
            Ok(t) => Some(t.to_owned()),
            Err(e) => {
                sink.error(&key(field), Some(v), e);
                ok = false;
                None
            }
        }
    };
    let key_name = optional_token("key-name", sink);
    let security_group = optional_token("security-group", sink);
    let security_group_id = optional_token("security-group-id", sink);
    let subnet_id = optional_token("subnet-id", sink);
    let instance_profile_name = optional_token("instance-profile-name", sink);
    let instance_profile_arn = optional_token("instance-profile-arn", sink);
    let instance_tag = optional_token("instance-tag", sink);

    let mut check = |field: &str, r: Result<(), String>, sink: &mut Sink| {
        if let Err(e) = r {
            sink.error(&key(field), f.get(field).copied(), e);
            ok = false;
        }
    };
    let mut num = |field: &str, min: u32, max: u32, sink: &mut Sink| -> Option<u32> {
        let v = f.get(field)?;
        let r = values::parse_u32_in(v, min, max);
        let n = r.as_ref().ok().copied();
        check(field, r.map(|_| ()), sink);
        n
    };
    let max_instances = match f.get("max-instances") {
        None => {
            sink.error(
                &key("max-instances"),
                None,
                format!("required for dynamic platform {platform} (at least 1)"),
            );
            None
        }
        Some(_) => num("max-instances", 1, 100_000, sink),
    };
    let disk_gb = num("disk", 1, 65_536, sink).unwrap_or(DEFAULT_DISK_GB);
    let iops = num("iops", 1, 1_000_000, sink);
    let throughput = num("throughput", 1, 100_000, sink);
    let allocation_timeout = num("allocation-timeout", 1, 86_400, sink)
        .map(|s| Duration::from_secs(s.into()))
        .unwrap_or(DEFAULT_ALLOCATION_TIMEOUT);
    let check_interval = num("check-interval", 1, 3_600, sink)
        .map(|s| Duration::from_secs(s.into()))
        .unwrap_or(DEFAULT_CHECK_INTERVAL);
    let imds_hop_limit = num("imds-hop-limit", 1, 64, sink);
    let pool = if kind == DynKind::Pool {
        let concurrency = match f.get("concurrency") {
            None => {
                sink.error(
                    &key("concurrency"),
                    None,
                    format!("required for dynamic pool {platform} (1..={MAX_CONCURRENCY})"),
                );
                None
            }
            Some(_) => num("concurrency", 1, MAX_CONCURRENCY, sink),
        };
        let max_age = num("max-age", 1, 1_440, sink)
            .map(|m| Duration::from_secs(u64::from(m) * 60))
            .unwrap_or(DEFAULT_MAX_AGE);
        let min_instances = num("min-instances", 0, 100_000, sink).unwrap_or(0);
        if let (Some(min), Some(max)) = (f.get("min-instances"), max_instances)
            && min_instances > max
        {
            sink.error(
                &key("min-instances"),
                Some(min),
                format!("larger than max-instances ({max})"),
            );
            ok = false;
        }
        concurrency.map(|c| (c, max_age, min_instances))
    } else {
        None
    };
    if kind == DynKind::Pool && pool.is_none() {
        ok = false;
    }

    let bool_field = |field: &str, sink: &mut Sink, ok: &mut bool| -> bool {
        match f.get(field) {
            None => false,
            Some(v) => values::parse_bool(v).unwrap_or_else(|e| {
                sink.error(&key(field), Some(v), e);
                *ok = false;
                false
            }),
        }
    };
    let strict_public_address = bool_field("strict-public-address", sink, &mut ok);
    let spot = bool_field("spot", sink, &mut ok);

    let user = match f.get("user") {
        None => DEFAULT_INSTANCE_USER.to_owned(),
        Some(v) => match values::posix_user(v) {
            Ok(u) => u.to_owned(),
            Err(e) => {
                sink.error(&key("user"), Some(v), e);
                ok = false;
                String::new()
            }
        },
    };
    let user_data = match f.get("user-data") {
        Some(v) if v.len() > MAX_USER_DATA_BYTES => {
            sink.error(
                &key("user-data"),
                None,
                format!(
                    "{} bytes; the cloud accepts at most {MAX_USER_DATA_BYTES} bytes of user-data",
                    v.len()
                ),
            );
            ok = false;
            None
        }
        Some(v) if v.trim().is_empty() => None,
        Some(v) => Some((*v).to_owned()),
        None => None,
    };
    let sudo_commands = match f.get("sudo-commands") {
        None => Vec::new(),
        Some(v) => values::sudo_commands(v).unwrap_or_else(|e| {
            sink.error(&key("sudo-commands"), Some(v), e);
            ok = false;
            Vec::new()
        }),
    };
    for why in sudo_commands
        .iter()
        .filter_map(|c| values::sudo_grants_root(c))
    {
        sink.warn(
            &key("sudo-commands"),
            f.get("sudo-commands").copied(),
            format!("{why}: every build user of the platform can become root on its instance, and another TaskRun's build on a shared (pool) instance is then theirs"),
        );
    }
    let host_key_policy = match f.get("host-key-policy").map(|v| v.trim()) {
        None | Some("tofu") | Some("trust-on-first-use") => HostKeyPolicy::TrustOnFirstUse,
        Some(other) => {
            sink.error(
                &key("host-key-policy"),
                Some(other),
                "unknown policy (expected \"tofu\": trust each instance's key on first contact)",
            );
            ok = false;
            HostKeyPolicy::TrustOnFirstUse
        }
    };
    let imds_tokens_required = match f.get("imds-tokens").map(|v| v.trim()) {
        None | Some("required") => true,
        Some("optional") => {
            sink.warn(
                &key("imds-tokens"),
                Some("optional"),
                "IMDSv1 allowed: a request forgery on the instance (a plain GET) can read its role's credentials",
            );
            false
        }
        Some(other) => {
            sink.error(
                &key("imds-tokens"),
                Some(other),
                "expected \"required\" (IMDSv2 only, the default) or \"optional\"",
            );
            ok = false;
            true
        }
    };
    let imds = ImdsOptions {
        tokens_required: imds_tokens_required,
        hop_limit: imds_hop_limit.unwrap_or(1),
    };
    let build_user = BuildUserSettings::parse(
        |field| f.get(field).copied(),
        |field, value, message| sink.error(&key(field), Some(value), message),
    );
    ok &= build_user.is_ok();
    if security_group.is_some() && security_group_id.is_some() {
        sink.warn(
            &key("security-group"),
            f.get("security-group").copied(),
            "both security-group and security-group-id are set; security-group-id is used",
        );
    }
    if instance_profile_name.is_some() && instance_profile_arn.is_some() {
        sink.warn(
            &key("instance-profile-name"),
            f.get("instance-profile-name").copied(),
            "both instance-profile-name and instance-profile-arn are set; the ARN is used",
        );
    }
    if key_name.is_none() {
        sink.warn(
            &key("key-name"),
            None,
            "not set: instances get no cloud key pair, so ssh-secret must be authorised by user-data or the image",
        );
    }
    let instance_tag = match instance_tag.or_else(|| global_tag.map(str::to_owned)) {
        Some(t) => t,
        None => {
            sink.warn(
                &key("instance-tag"),
                None,
                format!(
                    "neither instance-tag nor {prefix}.instance-tag is set; using {DEFAULT_INSTANCE_TAG:?} (set one per cluster so clusters sharing an account never sweep each other's instances)"
                ),
            );
            DEFAULT_INSTANCE_TAG.to_owned()
        }
    };

    if !ok || max_instances.is_none() {
        return None;
    }
    Some((
        DynamicPlatform {
            platform: platform.clone(),
            cloud: cloud?,
            region: region?,
            ami: ami?,
            instance_type: instance_type?,
            key_name,
            aws_secret: aws_secret?,
            ssh_secret: ssh_secret?,
            user,
            security_group,
            security_group_id,
            subnet_id,
            instance_profile_name,
            instance_profile_arn,
            strict_public_address,
            disk_gb,
            iops,
            throughput,
            user_data,
            max_instances: max_instances?,
            instance_tag,
            allocation_timeout,
            check_interval,
            sudo_commands,
            spot,
            host_key_policy,
            imds,
        },
        pool,
        build_user.ok()?,
    ))
}

/// Parses one `host.<name>.*` group. On error returns the host's platform when it could be read
/// (so a platform whose every host is broken is reported as disabled, not unknown).
fn parse_host(
    name: &str,
    f: &BTreeMap<&str, &str>,
    sink: &mut Sink,
) -> Result<(StaticHost, BuildUserSettings), Option<Platform>> {
    let key = |field: &str| format!("host.{name}.{field}");
    let mut ok = true;
    for (field, value) in f {
        if !HOST_FIELDS.contains(field) && !build_user::FIELDS.contains(field) {
            sink.warn(
                &key(field),
                Some(value),
                "unknown field, ignored by this version",
            );
        } else if *field == "sudo-commands" {
            sink.warn(
                &key(field),
                Some(value),
                "ignored: sudo-commands applies to dynamic platforms only",
            );
        }
    }
    if !values::is_label_value(name) {
        sink.error(
            &key("address"),
            None,
            format!("host name {name:?} cannot be used as a label value (at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends); host disabled"),
        );
        ok = false;
    }
    let mut req = |field: &str,
                   sink: &mut Sink,
                   check: &dyn Fn(&str) -> Result<String, String>|
     -> Option<String> {
        match f.get(field) {
            None => {
                sink.error(
                    &key(field),
                    None,
                    format!("required for static host {name}; host disabled"),
                );
                ok = false;
                None
            }
            Some(v) => match check(v) {
                Ok(s) => Some(s),
                Err(e) => {
                    sink.error(&key(field), Some(v), format!("{e}; host disabled"));
                    ok = false;
                    None
                }
            },
        }
    };
    let platform = req("platform", sink, &|v| {
        Platform::parse(v)
            .map(|p| p.as_str().to_owned())
            .map_err(|e| e.to_string())
    })
    .and_then(|p| Platform::parse(&p).ok());
    let address = req("address", sink, &|v| {
        values::host_address(v).map(str::to_owned)
    });
    let user = req("user", sink, &|v| values::posix_user(v).map(str::to_owned));
    let secret = req("secret", sink, &|v| {
        values::object_name(v).map(str::to_owned)
    });
    let concurrency = match f.get("concurrency") {
        None => {
            sink.warn(&key("concurrency"), None, "not set; using 1");
            Some(1)
        }
        Some(v) => match values::parse_u32_in(v, 1, MAX_CONCURRENCY) {
            Ok(n) => Some(n),
            Err(e) => {
                sink.error(&key("concurrency"), Some(v), format!("{e}; host disabled"));
                ok = false;
                None
            }
        },
    };
    let host_key = match f.get("host-key") {
        None => {
            sink.warn(
                &key("host-key"),
                None,
                "not set: the host's SSH key is trusted on first contact (then kept in the known-hosts ConfigMap), so whoever answers at the address first is trusted; pin it (`ssh-keyscan -t ed25519 <address>`)",
            );
            None
        }
        Some(v) => match values::host_key(v) {
            Ok(k) => Some(k),
            Err(e) => {
                sink.error(&key("host-key"), Some(v), format!("{e}; host disabled"));
                ok = false;
                None
            }
        },
    };
    let build_user = BuildUserSettings::parse(
        |field| f.get(field).copied(),
        |field, value, message| {
            sink.error(
                &key(field),
                Some(value),
                format!("{message}; host disabled"),
            )
        },
    );
    match (ok, platform, address, user, secret, concurrency, build_user) {
        (
            true,
            Some(platform),
            Some(address),
            Some(user),
            Some(secret),
            Some(concurrency),
            Ok(build_user),
        ) => Ok((
            StaticHost {
                name: name.to_owned(),
                address,
                user,
                platform,
                secret,
                concurrency,
                host_key,
            },
            build_user,
        )),
        (_, platform, ..) => Err(platform),
    }
}

#[cfg(test)]
mod tests;
