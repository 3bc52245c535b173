//! IBM Cloud dynamic platforms: `type: ibmz` (VPC virtual servers, s390x) and `type: ibmp`
//! (Power Virtual Server, ppc64le), plus the Go controller's instance-tag and IBM ssh-secret rules
//! and the IBM instance-name shape.
//!
//! Every key the Go controller reads is parsed here, with its default. Where Go silently falls
//! back on a bad value (`cores: abc` becomes 0.25) this parser reports an error instead: a typo
//! in a host-config should be seen, not guessed around.

use std::collections::BTreeMap;

pub use super::ibm_service::{
    CrnError, IbmKind, IbmPowerPlatform, IbmService, IbmVpcPlatform, PowerCrn,
};

use super::entry::{DynKind, PoolFields, Sink};
use super::{MAX_CONCURRENCY, build_user, values};
use crate::platform::Platform;

/// Longest `instance-tag` on s390x: VPC instance names stop at 63 characters and a name is
/// `<tag>-<16 hex>x` (the tag plus 18).
pub const MAX_TAG_LEN_S390X: usize = 45;
/// Longest `instance-tag` on ppc64le: Power VS instance names stop at 47 characters.
pub const MAX_TAG_LEN_PPC64LE: usize = 29;
/// VPC boot volume, GB, unless `disk` says otherwise.
pub const DEFAULT_IBMZ_DISK_GB: u32 = 100;
/// Smallest Power VS boot volume, GB; smaller `disk` values are raised to it (as Go does).
pub const MIN_IBMP_DISK_GB: u32 = 100;
/// Power VS processors unless `cores` says otherwise.
pub const DEFAULT_IBMP_CORES: f64 = 0.25;
/// Power VS memory, GB, unless `memory` says otherwise.
pub const DEFAULT_IBMP_MEMORY_GB: f64 = 2.0;
/// Login user on IBM instances unless `user` says otherwise (Go logs in as root).
pub const DEFAULT_IBM_USER: &str = "root";

/// The keys a kind reads besides [`COMMON_FIELDS`].
fn fields(kind: IbmKind) -> &'static [&'static str] {
    match kind {
        IbmKind::Vpc => &IBMZ_FIELDS,
        IbmKind::Power => &IBMP_FIELDS,
    }
}

/// Keys both IBM kinds read.
const COMMON_FIELDS: [&str; 15] = [
    "type",
    "url",
    "key",
    "secret",
    "ssh-secret",
    "user",
    "disk",
    "max-instances",
    "instance-tag",
    "allocation-timeout",
    "check-interval",
    "sudo-commands",
    "concurrency",
    "max-age",
    "min-instances",
];
const IBMZ_FIELDS: [&str; 6] = [
    "region",
    "vpc",
    "subnet",
    "image-id",
    "profile",
    "private-ip",
];
const IBMP_FIELDS: [&str; 7] = [
    "crn",
    "image",
    "network",
    "system",
    "cores",
    "memory",
    "user-data",
];
const POOL_ONLY_FIELDS: [&str; 3] = ["concurrency", "max-age", "min-instances"];

/// A parsed IBM dynamic platform or pool template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IbmPlatform {
    pub platform: Platform,
    pub service: IbmService,
    /// Secret in the controller namespace whose `api-key` is the IAM API key.
    pub api_key_secret: String,
    /// Secret with `id_rsa` to log in to instances.
    pub ssh_secret: String,
    /// Login user.
    pub user: String,
    pub max_instances: u32,
    /// Effective instance tag (per platform, else global, else the default).
    pub instance_tag: String,
    pub allocation_timeout_secs: u32,
    pub check_interval_secs: u32,
    pub sudo_commands: Vec<String>,
    /// `(concurrency, max-age minutes, min-instances)` of a pool.
    pub pool: Option<(u32, u32, u32)>,
    /// Build-user keys and slice.
    pub build_user: super::BuildUserSettings,
}

impl IbmPlatform {
    /// The common dynamic template: the EC2-shaped fields carry what they can (`region` the
    /// endpoint, with the workspace for Power VS: [`IbmService::scope`], `ami` the image, `instance_type` the profile or system, `aws_secret` the API key
    /// Secret), and [`DynamicPlatform::ibm`](super::DynamicPlatform::ibm) the service itself.
    pub(super) fn into_dynamic(
        self,
    ) -> (
        super::DynamicPlatform,
        Option<PoolFields>,
        super::BuildUserSettings,
    ) {
        let (ami, instance_type, key, disk_gb, user_data) = match &self.service {
            IbmService::Vpc(v) => (
                v.image_id.clone(),
                v.profile.clone(),
                v.key.clone(),
                v.disk_gb,
                None,
            ),
            IbmService::Power(p) => (
                p.image.clone(),
                p.system.clone(),
                p.key.clone(),
                p.disk_gb,
                p.user_data.clone(),
            ),
        };
        let pool = self
            .pool
            .map(|(c, age, min)| (c, std::time::Duration::from_secs(u64::from(age) * 60), min));
        let d = super::DynamicPlatform {
            os: super::HostOs::of(&self.platform),
            platform: self.platform,
            cloud: super::CloudKind::Ibm,
            region: self.service.scope(),
            ami,
            instance_type,
            key_name: Some(key),
            aws_secret: self.api_key_secret,
            ssh_secret: self.ssh_secret,
            user: self.user,
            security_group: None,
            security_group_id: None,
            subnet_id: None,
            instance_profile_name: None,
            instance_profile_arn: None,
            strict_public_address: false,
            disk_gb,
            iops: None,
            throughput: None,
            user_data,
            max_instances: self.max_instances,
            instance_tag: self.instance_tag,
            allocation_timeout: std::time::Duration::from_secs(self.allocation_timeout_secs.into()),
            check_interval: std::time::Duration::from_secs(self.check_interval_secs.into()),
            sudo_commands: self.sudo_commands,
            spot: false,
            host_key_policy: super::HostKeyPolicy::TrustOnFirstUse,
            imds: super::ImdsOptions::default(),
            dedicated_host: None,
            ibm: Some(self.service),
            drained: false,
        };
        (d, pool, self.build_user)
    }
}

/// Why a per-platform `instance-tag` disagrees with its platform (Go's `validateDynamicInstanceTag`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstanceTagError {
    #[error("invalid platform config name: no dashes found in '{0}'")]
    KeyShape(String),
    #[error(
        "invalid value format: must be '<prefix>-<platform>' or '<prefix>-<platform>-<instance_type>'"
    )]
    ValueShape,
    #[error("platform mismatch: key has '{key}', value has '{value}'")]
    Platform { key: String, value: String },
    #[error("instance type mismatch: key has '{key}', value has '{value}'")]
    InstanceType { key: String, value: String },
    #[error("instance tag too long for {arch} platform: {len} characters (max {max})")]
    TooLong {
        arch: &'static str,
        len: usize,
        max: usize,
    },
}

fn sorted_join(parts: &[&str]) -> String {
    let mut p = parts.to_vec();
    p.sort_unstable();
    p.join("-")
}

/// Go's rule for a per-platform `instance-tag` on every dynamic platform and pool, whatever the
/// cloud. `config_name` is the platform with `/` replaced by `-` (`linux-m2xlarge-arm64`): its last
/// part is the platform, the parts between the first and last are the instance type. The tag is
/// `<prefix>-<platform>[-<instance type parts>]`. Both instance types compare with their parts
/// sorted. Tags for ppc64le and s390x are also limited in length.
pub fn validate_instance_tag(config_name: &str, tag: &str) -> Result<(), InstanceTagError> {
    let (Some(first), Some(last)) = (config_name.find('-'), config_name.rfind('-')) else {
        return Err(InstanceTagError::KeyShape(config_name.to_owned()));
    };
    let key_platform = &config_name[last + 1..];
    let key_type = if first == last {
        String::new()
    } else {
        sorted_join(&config_name[first + 1..last].split('-').collect::<Vec<_>>())
    };
    let parts: Vec<&str> = tag.split('-').collect();
    if parts.len() < 2 {
        return Err(InstanceTagError::ValueShape);
    }
    let value_platform = parts[1];
    let value_type = sorted_join(&parts[2..]);
    if key_platform != value_platform {
        return Err(InstanceTagError::Platform {
            key: key_platform.to_owned(),
            value: value_platform.to_owned(),
        });
    }
    if key_type != value_type {
        return Err(InstanceTagError::InstanceType {
            key: key_type,
            value: value_type,
        });
    }
    tag_length(key_platform, tag)
}

/// The IBM instance-name length limit on `tag` for `arch` (`ppc64le`, `s390x`; others unlimited).
pub fn tag_length(arch: &str, tag: &str) -> Result<(), InstanceTagError> {
    let (arch, max) = match arch {
        "ppc64le" => ("ppc64le", MAX_TAG_LEN_PPC64LE),
        "s390x" => ("s390x", MAX_TAG_LEN_S390X),
        _ => return Ok(()),
    };
    if tag.len() > max {
        return Err(InstanceTagError::TooLong {
            arch,
            len: tag.len(),
            max,
        });
    }
    Ok(())
}

/// Go's IBM ssh-secret rule: the platform and the secret name must both contain `s390x`, or
/// both `ppc64le`.
pub fn ibm_ssh_secret_matches(platform: &str, secret: &str) -> bool {
    ["s390x", "ppc64le"]
        .iter()
        .any(|a| platform.contains(a) && secret.contains(a))
}

/// Why an instance tag cannot name an IBM instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "instance tag {0:?} contains invalid characters, only alphanumeric characters, hyphens, and underscores are allowed"
)]
pub struct InstanceNameError(pub String);

fn tag_chars_ok(tag: &str) -> bool {
    !tag.is_empty()
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The IBM instance name for `tag` and 64 random bits: `<tag>-<16 hex>x`, lower-case, `_` → `-`.
pub fn instance_name(tag: &str, random: u64) -> Result<String, InstanceNameError> {
    if !tag_chars_ok(tag) {
        return Err(InstanceNameError(tag.to_owned()));
    }
    Ok(format!("{}-{random:016x}x", normalized_tag(tag)))
}

fn normalized_tag(tag: &str) -> String {
    tag.to_ascii_lowercase().replace('_', "-")
}

/// True when `name` is exactly an [`instance_name`] of `tag`. A prefix match (Go) would count
/// `prod-ppc64le-large-…` as a `prod-ppc64le` instance.
pub fn is_instance_name_of(tag: &str, name: &str) -> bool {
    let Some(rest) = name.strip_prefix(normalized_tag(tag).as_str()) else {
        return false;
    };
    let Some(hex) = rest.strip_prefix('-').and_then(|r| r.strip_suffix('x')) else {
        return false;
    };
    hex.len() == 16 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn url_ok(v: &str) -> bool {
    let rest = v
        .strip_prefix("https://")
        .or_else(|| v.strip_prefix("http://"));
    rest.is_some_and(|r| !r.is_empty() && !r.starts_with('/'))
}

/// Parses the IBM platform `platform` of a whole ConfigMap (its `dynamic.<label>.*` keys and the
/// global `instance-tag`), for the IBM provider and for tests. `None` with the reasons when the
/// group is not an IBM platform or is misconfigured.
pub fn parse_platform(
    platform: &Platform,
    data: &super::ConfigData,
    pool: bool,
) -> (Option<IbmPlatform>, Vec<super::Diagnostic>) {
    let prefix = format!("dynamic.{}", platform.label_value());
    let fields: BTreeMap<&str, &str> = data
        .iter()
        .filter_map(|(k, v)| {
            let field = k.strip_prefix(prefix.as_str())?.strip_prefix('.')?;
            Some((field, v.as_str()))
        })
        .collect();
    let mut sink = Sink::default();
    let Some(ibm) = fields.get("type").and_then(|t| IbmKind::from_type(t)) else {
        sink.error(
            &format!("{prefix}.type"),
            fields.get("type").copied(),
            "not ibmz or ibmp",
        );
        return (None, sink.0);
    };
    let kind = if pool {
        DynKind::Pool
    } else {
        DynKind::Dynamic
    };
    let global_tag = data.get("instance-tag").map(|t| t.trim());
    let p = parse_ibm(platform, &prefix, &fields, kind, ibm, global_tag, &mut sink);
    (p, sink.0)
}

/// Parses one `dynamic.<label>.*` group of `type: ibmz` / `type: ibmp`. Reports every problem to
/// `sink`; `None` when one disables the platform.
pub(super) fn parse_ibm(
    platform: &Platform,
    prefix: &str,
    f: &BTreeMap<&str, &str>,
    kind: DynKind,
    ibm: IbmKind,
    global_tag: Option<&str>,
    sink: &mut Sink,
) -> Option<IbmPlatform> {
    let key = |field: &str| format!("{prefix}.{field}");
    let mut ok = true;
    let arch = platform.as_str().rsplit('/').next().unwrap_or_default();

    for (field, value) in f {
        if *field == "max-retries" {
            sink.warn(
                &key(field),
                Some(value),
                "ignored: retries are bounded by the scheduler",
            );
        } else if !COMMON_FIELDS.contains(field)
            && !fields(ibm).contains(field)
            && !build_user::FIELDS.contains(field)
        {
            let msg = if *field == "user-data" {
                format!("ignored: {ibm} instances get no user-data (as in the Go controller)")
            } else {
                format!("not a {ibm} field, ignored")
            };
            sink.warn(&key(field), Some(value), msg);
        } else if kind == DynKind::Dynamic && POOL_ONLY_FIELDS.contains(field) {
            sink.warn(
                &key(field),
                Some(value),
                format!(
                    "ignored: {field} applies only to platforms listed in dynamic-pool-platforms"
                ),
            );
        }
    }
    if !matches!(
        (ibm, arch),
        (IbmKind::Vpc, "s390x") | (IbmKind::Power, "ppc64le")
    ) {
        let expected = match ibm {
            IbmKind::Vpc => "s390x",
            IbmKind::Power => "ppc64le",
        };
        sink.warn(
            &key("type"),
            f.get("type").copied(),
            format!("{ibm} serves {expected} instances, but the platform is {platform}"),
        );
    }

    let mut required = |field: &str, sink: &mut Sink| -> Option<String> {
        let Some(v) = f.get(field) else {
            sink.error(
                &key(field),
                None,
                format!("required for {ibm} platform {platform}"),
            );
            ok = false;
            return None;
        };
        match values::single_token(v) {
            Ok(t) => Some(t.to_owned()),
            Err(e) => {
                sink.error(&key(field), Some(v), e);
                ok = false;
                None
            }
        }
    };
    let url = required("url", sink);
    let api_key_secret = required("secret", sink);
    let ssh_secret = required("ssh-secret", sink);
    let ibm_key = required("key", sink);
    let (vpc_fields, power_fields) = match ibm {
        IbmKind::Vpc => (
            Some((
                required("region", sink),
                required("vpc", sink),
                required("subnet", sink),
                required("image-id", sink),
                required("profile", sink),
            )),
            None,
        ),
        IbmKind::Power => (
            None,
            Some((
                required("crn", sink),
                required("image", sink),
                required("system", sink),
            )),
        ),
    };
    let max_instances = match f.get("max-instances") {
        None => {
            sink.error(
                &key("max-instances"),
                None,
                format!("required for dynamic platform {platform} (at least 1)"),
            );
            ok = false;
            None
        }
        Some(v) => match values::parse_u32_in(v, 1, 100_000) {
            Ok(n) => Some(n),
            Err(e) => {
                sink.error(&key("max-instances"), Some(v), e);
                ok = false;
                None
            }
        },
    };

    let mut num = |field: &str, min: u32, max: u32, sink: &mut Sink| -> Option<u32> {
        let v = f.get(field)?;
        match values::parse_u32_in(v, min, max) {
            Ok(n) => Some(n),
            Err(e) => {
                sink.error(&key(field), Some(v), e);
                ok = false;
                None
            }
        }
    };
    let allocation_timeout_secs = num("allocation-timeout", 1, 86_400, sink).unwrap_or(600);
    let check_interval_secs = num("check-interval", 1, 3_600, sink).unwrap_or(60);
    let disk = num("disk", 1, 65_536, sink);
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
        let max_age = num("max-age", 1, 1_440, sink).unwrap_or(1_440);
        let min = num("min-instances", 0, 100_000, sink).unwrap_or(0);
        concurrency.map(|c| (c, max_age, min))
    } else {
        None
    };

    if let (Some(url), Some(v)) = (&url, f.get("url"))
        && !url_ok(url)
    {
        sink.error(
            &key("url"),
            Some(v),
            "not an http(s) URL of the IBM Cloud API endpoint",
        );
        ok = false;
    }
    if let Some(s) = &api_key_secret
        && let Err(e) = values::object_name(s)
    {
        sink.error(&key("secret"), Some(s), e);
        ok = false;
    }
    // Go's rule: an IBM ssh-secret must name the platform's architecture.
    if let Some(s) = &ssh_secret
        && !ibm_ssh_secret_matches(platform.as_str(), s)
    {
        sink.error(
            &key("ssh-secret"),
            Some(s),
            format!("invalid ssh-secret '{s}': host secret key and value must contain matching platform substring (the Go controller rejects it; name the secret after the architecture, e.g. ibm-{arch}-ssh-key)"),
        );
        ok = false;
    }

    let user = match f.get("user") {
        None => DEFAULT_IBM_USER.to_owned(),
        Some(v) => match values::posix_user(v) {
            Ok(u) => u.to_owned(),
            Err(e) => {
                sink.error(&key("user"), Some(v), e);
                ok = false;
                String::new()
            }
        },
    };
    if ibm == IbmKind::Vpc && user == "root" {
        sink.warn(
            &key("user"),
            f.get("user").copied(),
            "logging in as root: IBM Cloud VPC no longer puts SSH keys on root for instances created since 2026-01-19; set user (e.g. cloud-user) to the image's login user",
        );
    }
    let sudo_commands = match f.get("sudo-commands") {
        None => Vec::new(),
        Some(v) => values::sudo_commands(v).unwrap_or_else(|e| {
            sink.error(&key("sudo-commands"), Some(v), e);
            ok = false;
            Vec::new()
        }),
    };
    let build_user = super::BuildUserSettings::parse(
        |field| f.get(field).copied(),
        |field, value, message| sink.error(&key(field), Some(value), message),
    );
    ok &= build_user.is_ok();

    // Instance tag: Go's shape rule for a per-platform tag; IBM name rules for the effective one.
    let own_tag = f.get("instance-tag").map(|t| t.trim());
    if let Some(t) = own_tag
        && let Err(e) = validate_instance_tag(&platform.label_value(), t)
    {
        sink.error(
            &key("instance-tag"),
            Some(t),
            format!("invalid instance-tag '{t}': {e}"),
        );
        ok = false;
    }
    let instance_tag = own_tag
        .or(global_tag)
        .unwrap_or(super::DEFAULT_INSTANCE_TAG)
        .to_owned();
    let tag_key = if own_tag.is_some() {
        key("instance-tag")
    } else {
        "instance-tag".to_owned()
    };
    if let Err(e) = instance_name(&instance_tag, 0) {
        sink.error(&tag_key, Some(&instance_tag), e);
        ok = false;
    } else if own_tag.is_none()
        && let Err(e) = tag_length(arch, &instance_tag)
    {
        sink.error(
            &tag_key,
            Some(&instance_tag),
            format!("{e}: {platform}'s instance names would not fit; set {prefix}.instance-tag"),
        );
        ok = false;
    }

    let service = match (vpc_fields, power_fields) {
        (Some((zone, vpc, subnet, image_id, profile)), _) => {
            let private_ip = match f.get("private-ip") {
                None => false,
                Some(v) => values::parse_bool(v).unwrap_or_else(|e| {
                    sink.error(&key("private-ip"), Some(v), e);
                    ok = false;
                    false
                }),
            };
            if !private_ip {
                sink.warn(
                    &key("private-ip"),
                    f.get("private-ip").copied(),
                    "floating IPs are not supported: instances are always reached on their private address, as if private-ip were true (the controller must run where that subnet is routed)",
                );
            }
            IbmService::Vpc(IbmVpcPlatform {
                url: url.clone()?,
                zone: zone?,
                vpc: vpc?,
                subnet: subnet?,
                key: ibm_key.clone()?,
                image_id: image_id?,
                profile: profile?,
                private_ip,
                disk_gb: disk.unwrap_or(DEFAULT_IBMZ_DISK_GB),
            })
        }
        (None, Some((crn, image, system))) => {
            let crn = crn.and_then(|c| match PowerCrn::parse(&c) {
                Ok(c) => Some(c),
                Err(e) => {
                    sink.error(&key("crn"), Some(&c), e);
                    ok = false;
                    None
                }
            });
            let networks: Vec<String> = match f.get("network") {
                None => {
                    sink.error(
                        &key("network"),
                        None,
                        format!(
                            "required for ibmp platform {platform} (comma-separated network ids)"
                        ),
                    );
                    ok = false;
                    Vec::new()
                }
                Some(v) => {
                    let n: Vec<String> = values::split_commas(v).map(str::to_owned).collect();
                    if n.is_empty() || n.iter().any(|x| values::single_token(x).is_err()) {
                        sink.error(
                            &key("network"),
                            Some(v),
                            "expected comma-separated network ids",
                        );
                        ok = false;
                    }
                    n
                }
            };
            let mut float = |field: &str, default: f64, sink: &mut Sink| -> f64 {
                let Some(v) = f.get(field) else {
                    return default;
                };
                match v.trim().parse::<f64>() {
                    Ok(x) if x.is_finite() && x > 0.0 => x,
                    _ => {
                        sink.error(
                            &key(field),
                            Some(v),
                            format!("not a positive number (default {default})"),
                        );
                        ok = false;
                        default
                    }
                }
            };
            let cores = float("cores", DEFAULT_IBMP_CORES, sink);
            let memory_gb = float("memory", DEFAULT_IBMP_MEMORY_GB, sink);
            let disk_gb = match disk {
                Some(d) if d < MIN_IBMP_DISK_GB => {
                    sink.warn(
                        &key("disk"),
                        f.get("disk").copied(),
                        format!("raised to {MIN_IBMP_DISK_GB} GB, the smallest boot volume used for ibmp (as in the Go controller)"),
                    );
                    MIN_IBMP_DISK_GB
                }
                Some(d) => d,
                None => MIN_IBMP_DISK_GB,
            };
            let user_data = f
                .get("user-data")
                .filter(|v| !v.trim().is_empty())
                .map(|v| (*v).to_owned());
            IbmService::Power(IbmPowerPlatform {
                url: url.clone()?,
                crn: crn?,
                key: ibm_key.clone()?,
                image: image?,
                networks,
                system: system?,
                cores,
                memory_gb,
                disk_gb,
                user_data,
            })
        }
        (None, None) => return None,
    };
    if kind == DynKind::Pool && pool.is_none() {
        ok = false;
    }
    if !ok {
        return None;
    }
    Some(IbmPlatform {
        platform: platform.clone(),
        service,
        api_key_secret: api_key_secret?,
        ssh_secret: ssh_secret?,
        user,
        max_instances: max_instances?,
        instance_tag,
        allocation_timeout_secs,
        check_interval_secs,
        sudo_commands,
        pool,
        build_user: build_user.ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_instance_tag_rule() {
        assert_eq!(validate_instance_tag("linux-arm64", "prod-arm64"), Ok(()));
        assert_eq!(
            validate_instance_tag("linux-m2xlarge-arm64", "prod-arm64-m2xlarge"),
            Ok(())
        );
        assert_eq!(
            validate_instance_tag("linux-d160-m4xlarge-arm64", "prod-arm64-m4xlarge-d160"),
            Ok(())
        );
        assert_eq!(
            validate_instance_tag("linux-arm64", "prod-amd64")
                .unwrap_err()
                .to_string(),
            "platform mismatch: key has 'arm64', value has 'amd64'"
        );
        assert_eq!(
            validate_instance_tag("linux-m2xlarge-arm64", "prod-arm64-mxlarge")
                .unwrap_err()
                .to_string(),
            "instance type mismatch: key has 'm2xlarge', value has 'mxlarge'"
        );
        assert_eq!(
            validate_instance_tag("linux-arm64", "prod"),
            Err(InstanceTagError::ValueShape)
        );
        assert!(validate_instance_tag("linux", "prod-linux").is_err());
        let long = format!("p-ppc64le-{}", "a".repeat(20));
        assert_eq!(
            validate_instance_tag("linux-a-ppc64le", &long),
            Err(InstanceTagError::InstanceType {
                key: "a".into(),
                value: "a".repeat(20)
            })
        );
        let tag = format!("{}-ppc64le", "p".repeat(22));
        assert_eq!(tag.len(), 30);
        assert_eq!(
            validate_instance_tag("linux-ppc64le", &tag)
                .unwrap_err()
                .to_string(),
            "instance tag too long for ppc64le platform: 30 characters (max 29)"
        );
        let tag = format!("{}-ppc64le", "p".repeat(21));
        assert_eq!(validate_instance_tag("linux-ppc64le", &tag), Ok(()));
        let tag = format!("{}-s390x", "p".repeat(40));
        assert_eq!(tag.len(), 46);
        assert!(validate_instance_tag("linux-s390x", &tag).is_err());
        assert!(validate_instance_tag("linux-s390x", &tag[1..]).is_ok());
    }

    #[test]
    fn names_fit_and_match_exactly() {
        let n = instance_name("Prod_PPC64LE", 0xdead_beef).unwrap();
        assert_eq!(n, "prod-ppc64le-00000000deadbeefx");
        assert!(is_instance_name_of("Prod_PPC64LE", &n));
        assert!(is_instance_name_of("prod-ppc64le", &n));
        let large = instance_name("prod-ppc64le-large", u64::MAX).unwrap();
        assert!(!is_instance_name_of("prod-ppc64le", &large));
        assert!(is_instance_name_of("prod-ppc64le-large", &large));
        assert!(!is_instance_name_of("prod", "prod-0123456789abcdefy"));
        assert!(!is_instance_name_of("prod", "prod-0123456789ABCDEFx"));
        assert!(instance_name("bad tag", 1).is_err());
        let tag = "p".repeat(MAX_TAG_LEN_PPC64LE);
        assert_eq!(instance_name(&tag, 1).unwrap().len(), 47);
        let tag = "z".repeat(MAX_TAG_LEN_S390X);
        assert_eq!(instance_name(&tag, 1).unwrap().len(), 63);
    }

    #[test]
    fn crn_rules() {
        let c = PowerCrn::parse(
            "crn:v1:bluemix:public:power-iaas:wdc06:a/5cb0704ee6304413bd0b171372c0fd77:4e9dc638-7a78-4e7c-b432-e83b7010c531::",
        )
        .unwrap();
        assert_eq!(
            c.cloud_instance_id(),
            "4e9dc638-7a78-4e7c-b432-e83b7010c531"
        );
        assert_eq!(PowerCrn::parse("crm:v1"), Err(CrnError::Prefix));
        assert_eq!(PowerCrn::parse("crn:v1:a"), Err(CrnError::Segments(3)));
        assert_eq!(
            PowerCrn::parse("crn:v1:bluemix:public:is:wdc06:a/x:id::"),
            Err(CrnError::Service("is".into()))
        );
        assert_eq!(
            PowerCrn::parse("crn:v1:bluemix:public:power-iaas:global:a/x:id::"),
            Err(CrnError::Global)
        );
        assert_eq!(
            PowerCrn::parse("crn:v1:bluemix:public:power-iaas:wdc06:a/x:::"),
            Err(CrnError::NoInstance)
        );
    }

    #[test]
    fn ssh_secret_rule() {
        assert!(ibm_ssh_secret_matches("linux/s390x", "ibm-s390x-ssh"));
        assert!(!ibm_ssh_secret_matches(
            "linux/s390x",
            "internal-prod-ibm-ssh-key"
        ));
        assert!(!ibm_ssh_secret_matches("linux/ppc64le", "ibm-s390x-ssh"));
    }
}
