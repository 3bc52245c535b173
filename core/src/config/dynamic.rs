//! One `dynamic.<label>.*` group: a dynamic platform or the instance template of a dynamic pool.

use std::collections::BTreeMap;
use std::time::Duration;

use super::build_user;
use super::entry::{DynKind, PoolFields, Sink};
use super::{
    BuildUserSettings, CloudKind, DEFAULT_ALLOCATION_TIMEOUT, DEFAULT_CHECK_INTERVAL,
    DEFAULT_DISK_GB, DEFAULT_HOST_SCRUB, DEFAULT_INSTANCE_TAG, DEFAULT_INSTANCE_USER,
    DEFAULT_MAX_AGE, DedicatedHost, DynamicPlatform, HostKeyPolicy, HostOs, ImdsOptions,
    MAX_CONCURRENCY, MAX_USER_DATA_BYTES, values,
};
use crate::platform::Platform;

const DYNAMIC_FIELDS: [&str; 35] = [
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
    // macOS dedicated hosts: all three or none.
    "tenancy",
    "host-resource-group-arn",
    "license-configuration-arn",
    // Ours, with the three above: minutes a host is scrubbed after each instance.
    "host-scrub",
    // Pool-only.
    "concurrency",
    "max-age",
    "min-instances",
    // Written by some Go deployments; the scheduler does its own back-off.
    "max-retries",
];

const POOL_ONLY_FIELDS: [&str; 3] = ["concurrency", "max-age", "min-instances"];

/// The macOS dedicated-host keys, all three or none.
const DEDICATED_HOST_FIELDS: [&str; 3] = [
    "tenancy",
    "host-resource-group-arn",
    "license-configuration-arn",
];

/// The Go controller's words for a partial dedicated-host set, kept so searches for it land here.
pub(super) const PARTIAL_DEDICATED_HOST: &str =
    "MacOS dedicated host configuration requires all three fields";

/// Keys that only shape Linux build users: windows and macOS hosts get none.
const BUILD_USER_ONLY_FIELDS: [&str; 2] = ["user", "sudo-commands"];

/// Parses one `dynamic.<label>.*` group. `None` when an error disables the platform.
pub(super) fn parse_dynamic(
    platform: &Platform,
    prefix: &str,
    f: &BTreeMap<&str, &str>,
    kind: DynKind,
    global_tag: Option<&str>,
    sink: &mut Sink,
) -> Option<(DynamicPlatform, Option<PoolFields>, BuildUserSettings)> {
    if let Some(ibm) = f
        .get("type")
        .and_then(|t| super::ibm_service::IbmKind::from_type(t))
    {
        // IBM keys are not EC2's: parsed with Go's rules, then carried in the common template.
        return super::ibm::parse_ibm(platform, prefix, f, kind, ibm, global_tag, sink)
            .map(super::ibm::IbmPlatform::into_dynamic);
    }
    let mut ok = true;
    let key = |field: &str| format!("{prefix}.{field}");
    let os = HostOs::of(platform);

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
        } else if os.hands_off_key()
            && (BUILD_USER_ONLY_FIELDS.contains(field) || build_user::FIELDS.contains(field))
        {
            sink.warn(
                &key(field),
                Some(value),
                format!(
                    "ignored: {} hosts get no build user (their user-data creates konflux-builder and its key, which is handed out as is; the login is {})",
                    os.as_str(),
                    os.admin_user().unwrap_or_default()
                ),
            );
        } else if os != HostOs::MacOs
            && (DEDICATED_HOST_FIELDS.contains(field) || *field == "host-scrub")
        {
            sink.warn(
                &key(field),
                Some(value),
                format!(
                    "ignored: {field} applies only to macos* platforms (dedicated hosts), as in the Go controller"
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
    // The Go controller's rule for every cloud: the tag names the platform key's parts. Running
    // EC2 platforms (production's among them) break it, so here it warns instead of disabling.
    if let Some(t) = &instance_tag
        && let Err(e) = super::ibm::validate_instance_tag(&platform.label_value(), t)
    {
        sink.warn(
            &key("instance-tag"),
            Some(t),
            format!("invalid instance-tag '{t}': {e} (the Go controller disables this platform for it; this one serves it)"),
        );
    }

    let mut check = |field: &str, r: Result<(), values::ValueError>, sink: &mut Sink| {
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
        _ if os.hands_off_key() => os.admin_user().unwrap_or(DEFAULT_INSTANCE_USER).to_owned(),
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
        _ if os.hands_off_key() => Vec::new(),
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
    if let Some((field, value)) = instance_profile_arn
        .as_ref()
        .map(|v| ("instance-profile-arn", v))
        .or(instance_profile_name
            .as_ref()
            .map(|v| ("instance-profile-name", v)))
    {
        // IMDS answers any process on the instance itself; the hop limit only keeps out
        // containers behind a bridge, so every build can use the role.
        sink.warn(
            &key(field),
            Some(value.as_str()),
            "every build on the instance can use this role's credentials (the metadata service answers processes on the instance itself, whatever the hop limit): grant it nothing a tenant must not have",
        );
    }
    if key_name.is_none() {
        sink.warn(
            &key("key-name"),
            None,
            "not set: instances get no cloud key pair, so ssh-secret must be authorised by user-data or the image",
        );
    }
    if os == HostOs::Linux
        && ami
            .as_deref()
            .is_some_and(|a| a.starts_with("resolve:ssm:"))
    {
        for field in ["disk", "iops", "throughput"] {
            if let Some(v) = f.get(field) {
                sink.warn(
                    &key(field),
                    Some(v),
                    "not applied: the root device of a Linux image resolved from SSM is not known before the launch, so the image's own root disk is used",
                );
            }
        }
    }
    if kind == DynKind::Pool && os.hands_off_key() {
        sink.error(
            "dynamic-pool-platforms",
            Some(platform.as_str()),
            format!(
                "{} hosts cannot be pooled: their one key is handed to one TaskRun and the instance is terminated after it; list the platform in dynamic-platforms",
                os.as_str()
            ),
        );
        ok = false;
    }
    let dedicated_host = if os == HostOs::MacOs {
        match dedicated_host(f, &key, sink) {
            Ok(d) => d,
            Err(()) => {
                ok = false;
                None
            }
        }
    } else {
        None
    };
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
            os,
            dedicated_host,
            ibm: None,
            drained: false,
        },
        pool,
        build_user.ok()?,
    ))
}

/// The macOS dedicated-host keys: all three (checked) or none; `Err` once every problem is
/// reported.
fn dedicated_host(
    f: &BTreeMap<&str, &str>,
    key: &dyn Fn(&str) -> String,
    sink: &mut Sink,
) -> Result<Option<DedicatedHost>, ()> {
    let set: Vec<&str> = DEDICATED_HOST_FIELDS
        .iter()
        .copied()
        .filter(|f_| f.contains_key(f_))
        .collect();
    if set.is_empty() {
        if let Some(v) = f.get("host-scrub") {
            sink.warn(
                &key("host-scrub"),
                Some(v),
                "ignored: host-scrub applies with the dedicated-host keys (tenancy, host-resource-group-arn, license-configuration-arn)",
            );
        }
        return Ok(None);
    }
    if set.len() < DEDICATED_HOST_FIELDS.len() {
        for missing in DEDICATED_HOST_FIELDS.iter().filter(|m| !set.contains(m)) {
            sink.error(
                &key(missing),
                None,
                format!(
                    "{PARTIAL_DEDICATED_HOST} (tenancy, host-resource-group-arn, license-configuration-arn); {} set",
                    set.join(" and ")
                ),
            );
        }
        return Err(());
    }
    let mut ok = true;
    let mut token = |field: &str, sink: &mut Sink| -> String {
        let v = f.get(field).copied().unwrap_or_default();
        match values::single_token(v) {
            Ok(t) => t.to_owned(),
            Err(e) => {
                sink.error(&key(field), Some(v), e);
                ok = false;
                String::new()
            }
        }
    };
    let tenancy = token("tenancy", sink);
    let group = token("host-resource-group-arn", sink);
    let licence = token("license-configuration-arn", sink);
    if ok && tenancy != "host" {
        sink.error(
            &key("tenancy"),
            Some(&tenancy),
            "expected \"host\": mac instances run only on dedicated hosts",
        );
        ok = false;
    }
    for (field, v) in [
        ("host-resource-group-arn", &group),
        ("license-configuration-arn", &licence),
    ] {
        if ok && !v.starts_with("arn:") {
            sink.error(&key(field), Some(v), "expected an ARN (arn:aws:...)");
            ok = false;
        }
    }
    let scrub = match f.get("host-scrub") {
        None => DEFAULT_HOST_SCRUB,
        Some(v) => match values::parse_u32_in(v, 0, 1_440) {
            Ok(m) => Duration::from_secs(u64::from(m) * 60),
            Err(e) => {
                sink.error(&key("host-scrub"), Some(v), e);
                ok = false;
                DEFAULT_HOST_SCRUB
            }
        },
    };
    if !ok {
        return Err(());
    }
    Ok(Some(DedicatedHost {
        tenancy,
        host_resource_group_arn: group,
        license_configuration_arn: licence,
        scrub,
    }))
}
