//! Platform capacity as Kueue resources: what each platform may run at once, under the resource
//! name tekton-kueue requests for it.

use std::collections::BTreeMap;
use std::fmt;

use crate::config::{HostConfig, Strategy};
use crate::platform::Platform;

/// Quota of a local platform: builds on cluster nodes are not limited by the controller, so the
/// quota only has to be larger than any real demand (the value infra-deployments uses).
pub const LOCAL_QUOTA: u64 = 1000;

/// Where a platform's share of a resource's quota comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `local-platforms`: [`LOCAL_QUOTA`].
    Local,
    /// `dynamic-platforms`: one TaskRun per instance.
    Dynamic {
        /// `max-instances`.
        max_instances: u32,
    },
    /// `dynamic-pool-platforms`: `concurrency` TaskRuns per instance.
    Pool {
        /// `max-instances`.
        max_instances: u32,
        /// TaskRuns per instance.
        concurrency: u32,
    },
    /// Static hosts: the sum of their `concurrency`, drained hosts counting 0.
    Static {
        /// Number of hosts.
        hosts: usize,
        /// Their summed concurrency, drained hosts left out.
        slots: u32,
        /// How many of them are drained (`drain: "true"` or `concurrency: "0"`).
        drained: usize,
    },
    /// A drained dynamic platform or pool (`dynamic.<p>.drain: "true"`): nothing new is
    /// launched, so it carries no quota until the drain is lifted.
    Drained {
        /// What it would carry undrained.
        capacity: u32,
    },
    /// A member of a capacity group, whose resource (named after the group) carries the group's
    /// `max` once, whatever the number of members.
    GroupMember {
        /// The group's `max`.
        max: u32,
    },
}

impl Source {
    /// Concurrent TaskRuns this source contributes.
    pub fn quota(&self) -> u64 {
        match *self {
            Source::Local => LOCAL_QUOTA,
            Source::Dynamic { max_instances } => u64::from(max_instances),
            Source::Pool {
                max_instances,
                concurrency,
            } => u64::from(max_instances) * u64::from(concurrency),
            Source::Static { slots, .. } => u64::from(slots),
            Source::GroupMember { max } => u64::from(max),
            Source::Drained { .. } => 0,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Source::Local => write!(f, "local platform, fixed quota {LOCAL_QUOTA}"),
            Source::Dynamic { max_instances } => {
                write!(f, "dynamic, max-instances {max_instances}")
            }
            Source::Pool {
                max_instances,
                concurrency,
            } => write!(
                f,
                "dynamic pool, max-instances {max_instances} × concurrency {concurrency}"
            ),
            Source::Static {
                hosts,
                slots,
                drained,
            } => {
                write!(f, "static, {hosts} host(s) with {slots} slots in total")?;
                if drained > 0 {
                    write!(f, " ({drained} drained, counted 0)")?;
                }
                Ok(())
            }
            Source::GroupMember { max } => write!(f, "capacity group member, max {max}"),
            Source::Drained { capacity } => write!(
                f,
                "drained: nothing new is launched, counted 0 ({capacity} once the drain is lifted)"
            ),
        }
    }
}

/// One Kueue resource and the platforms whose capacity it carries (usually one; two only when
/// their names collide after normalisation, and then their quotas add up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceQuota {
    /// Kueue resource name.
    pub resource: String,
    /// Nominal quota: concurrent PipelineRuns requesting this platform.
    pub quota: u64,
    /// The platforms behind it.
    pub platforms: Vec<(Platform, Source)>,
}

impl ResourceQuota {
    /// `linux/arm64 (dynamic, max-instances 250)`, platforms joined by ` + `; a capacity group:
    /// `capacity group aws-ip, max 500 instances of linux/amd64, linux/arm64`.
    pub fn describe(&self) -> String {
        if let Some((_, Source::GroupMember { max })) = self.platforms.first() {
            let members: Vec<&str> = self.platforms.iter().map(|(p, _)| p.as_str()).collect();
            return format!(
                "capacity group {}, max {max} instances of {}",
                self.resource,
                members.join(", ")
            );
        }
        self.platforms
            .iter()
            .map(|(p, s)| format!("{p} ({s})"))
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// The Kueue resource name of a platform. Local platforms: `/` and `_` become `-`
/// (`linux/x86_64` → `linux-x86-64`); the others keep `_` (`/` → `-`, their config-key label).
/// These are the names tekton-kueue's requests use in infra-deployments.
pub fn resource_name(platform: &Platform, local: bool) -> String {
    let name = platform.label_value();
    if local { name.replace('_', "-") } else { name }
}

/// Every platform the controller serves, and every capacity group (named after the group, its
/// quota the group's `max`), as Kueue resources sorted by name. Disabled platforms
/// (config errors, or listed without keys) get no resource: the controller answers their TaskRuns
/// with an error secret, and infra-deployments' script exports none for them either. Drained
/// capacity counts 0 (a drained host adds nothing, a drained dynamic platform or pool exports 0,
/// keeping its resource so its PipelineRuns wait in Kueue as its TaskRuns would in the controller).
pub fn platform_quotas(config: &HostConfig) -> BTreeMap<String, ResourceQuota> {
    let mut out: BTreeMap<String, ResourceQuota> = BTreeMap::new();
    for platform in config.platforms() {
        let source = match config.resolve(platform) {
            Strategy::Local => Source::Local,
            Strategy::Dynamic(d) if d.drained => Source::Drained {
                capacity: d.max_instances,
            },
            Strategy::Dynamic(d) => Source::Dynamic {
                max_instances: d.max_instances,
            },
            Strategy::DynamicPool(p) if p.instance.drained => Source::Drained {
                capacity: p.instance.max_instances * p.concurrency,
            },
            Strategy::DynamicPool(p) => Source::Pool {
                max_instances: p.instance.max_instances,
                concurrency: p.concurrency,
            },
            Strategy::Static(s) => Source::Static {
                hosts: s.hosts.len(),
                slots: s.capacity(),
                drained: s.drained().count(),
            },
            Strategy::Disabled(_) | Strategy::Unknown => continue,
        };
        let resource = resource_name(platform, source == Source::Local);
        let entry = out
            .entry(resource.clone())
            .or_insert_with(|| ResourceQuota {
                resource,
                quota: 0,
                platforms: Vec::new(),
            });
        entry.quota += source.quota();
        entry.platforms.push((platform.clone(), source));
    }
    // Capacity groups: one resource each, its quota the group's max. (The config refuses a group
    // named like a platform's resource, so the two never merge.)
    for g in config.capacity_groups.values() {
        out.insert(
            g.name.clone(),
            ResourceQuota {
                resource: g.name.clone(),
                quota: u64::from(g.max),
                platforms: g
                    .members
                    .iter()
                    .map(|p| (p.clone(), Source::GroupMember { max: g.max }))
                    .collect(),
            },
        );
    }
    out
}

/// Kueue API version of a ClusterQueue, which decides how quantities are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KueueApi {
    /// `kueue.x-k8s.io/v1beta1`: quotas as plain numbers (`'1000'`), as the committed files have
    /// them.
    V1beta1,
    /// `kueue.x-k8s.io/v1beta2`: quotas in resource.Quantity canonical form (`1k`), the form the
    /// API server stores, so that a GitOps sync shows no drift.
    #[default]
    V1beta2,
}

impl KueueApi {
    /// The version of an `apiVersion` value (`kueue.x-k8s.io/v1beta2`); anything but v1beta2 is
    /// written the v1beta1 way, as infra-deployments' script does.
    pub fn of_api_version(api_version: &str) -> Self {
        if api_version.ends_with("/v1beta2") {
            KueueApi::V1beta2
        } else {
            KueueApi::V1beta1
        }
    }

    /// A whole-number quota as this API version's files write it.
    pub fn format(self, n: u64) -> String {
        match self {
            KueueApi::V1beta1 => n.to_string(),
            KueueApi::V1beta2 => canonical_quantity(n),
        }
    }
}

/// Kubernetes `resource.Quantity` canonical form of a whole number (decimal SI): the largest
/// power of 1000 that divides it becomes a suffix (`1000` → `1k`, `2000000` → `2M`, `1500` stays
/// `1500`).
pub fn canonical_quantity(n: u64) -> String {
    const SUFFIXES: [&str; 7] = ["", "k", "M", "G", "T", "P", "E"];
    if n == 0 {
        return "0".to_owned();
    }
    let (mut m, mut e) = (n, 0);
    while m % 1000 == 0 && e + 1 < SUFFIXES.len() {
        m /= 1000;
        e += 1;
    }
    format!("{m}{}", SUFFIXES[e])
}

/// A quantity as a whole number of units: `250`, `1k`, `1.5k`, `2Mi`, `3e2`; `None` when it is not
/// a quantity or not a whole number (`500m`, `1.5`).
pub fn parse_quantity(s: &str) -> Option<u128> {
    let s = s.trim();
    let digits_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits_end);
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return None;
    }
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    // value = mantissa / 10^scale × multiplier
    let mantissa: u128 = format!("{int_part}{frac_part}").parse().ok()?;
    let scale = u32::try_from(frac_part.len()).ok()?;
    let (mul, div): (u128, u128) = match suffix {
        "" => (1, 1),
        "k" => (1000, 1),
        "M" => (1000u128.pow(2), 1),
        "G" => (1000u128.pow(3), 1),
        "T" => (1000u128.pow(4), 1),
        "P" => (1000u128.pow(5), 1),
        "E" => (1000u128.pow(6), 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        "m" => (1, 1000),
        exp => {
            let e: i32 = exp.strip_prefix(['e', 'E'])?.parse().ok()?;
            if e >= 0 {
                (10u128.checked_pow(e.unsigned_abs())?, 1)
            } else {
                (1, 10u128.checked_pow(e.unsigned_abs())?)
            }
        }
    };
    let num = mantissa.checked_mul(mul)?;
    let den = 10u128.checked_pow(scale)?.checked_mul(div)?;
    (num % den == 0).then_some(num / den)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse, read_configmap_yaml};

    #[test]
    fn canonical_quantities_as_the_api_server_stores_them() {
        for (n, s) in [
            (0, "0"),
            (2, "2"),
            (250, "250"),
            (999, "999"),
            (1000, "1k"),
            (1500, "1500"),
            (2000, "2k"),
            (12_000, "12k"),
            (1_000_000, "1M"),
            (1_001_000, "1001k"),
        ] {
            assert_eq!(canonical_quantity(n), s, "{n}");
            assert_eq!(parse_quantity(s), Some(u128::from(n)), "{s}");
        }
        assert_eq!(KueueApi::V1beta1.format(1000), "1000");
        assert_eq!(KueueApi::V1beta2.format(1000), "1k");
        assert_eq!(
            KueueApi::of_api_version("kueue.x-k8s.io/v1beta2"),
            KueueApi::V1beta2
        );
        assert_eq!(
            KueueApi::of_api_version("kueue.x-k8s.io/v1beta1"),
            KueueApi::V1beta1
        );
    }

    #[test]
    fn quantities_that_are_not_whole_numbers_are_refused() {
        assert_eq!(parse_quantity("1.5k"), Some(1500));
        assert_eq!(parse_quantity("2Ki"), Some(2048));
        assert_eq!(parse_quantity("3e2"), Some(300));
        assert_eq!(parse_quantity("500Ti"), Some(500 << 40));
        for bad in ["", "k", "1.5", "500m", "1..2", "abc", "-1", "1x"] {
            assert_eq!(parse_quantity(bad), None, "{bad}");
        }
    }

    fn config(data: &str) -> HostConfig {
        let text = format!("kind: ConfigMap\ndata:\n{data}");
        let (data, _) = read_configmap_yaml(&text).unwrap();
        parse(&data).config
    }

    #[test]
    fn every_strategy_becomes_a_resource_named_like_the_requests() {
        let c = config(
            r#"  local-platforms: "linux/x86_64,local"
  dynamic-platforms: "linux/arm64,linux-g4xlarge/amd64"
  dynamic-pool-platforms: linux/amd64
  dynamic.linux-arm64.type: aws
  dynamic.linux-arm64.region: us-east-1
  dynamic.linux-arm64.ami: ami-1
  dynamic.linux-arm64.instance-type: m6g.large
  dynamic.linux-arm64.aws-secret: aws
  dynamic.linux-arm64.ssh-secret: ssh
  dynamic.linux-arm64.max-instances: "250"
  dynamic.linux-amd64.type: aws
  dynamic.linux-amd64.region: us-east-1
  dynamic.linux-amd64.ami: ami-2
  dynamic.linux-amd64.instance-type: m6a.large
  dynamic.linux-amd64.aws-secret: aws
  dynamic.linux-amd64.ssh-secret: ssh
  dynamic.linux-amd64.max-instances: "10"
  dynamic.linux-amd64.concurrency: "4"
  dynamic.linux-amd64.max-age: "1440"
  host.s1.address: 10.0.0.1
  host.s1.platform: linux/s390x
  host.s1.user: u
  host.s1.secret: s
  host.s1.concurrency: "4"
  host.s2.address: 10.0.0.2
  host.s2.platform: linux/s390x
  host.s2.user: u
  host.s2.secret: s
  host.s2.concurrency: "2"
"#,
        );
        let q = platform_quotas(&c);
        let got: Vec<(&str, u64)> = q.values().map(|r| (r.resource.as_str(), r.quota)).collect();
        assert_eq!(
            got,
            [
                // Pool: max-instances × concurrency, not max-instances alone.
                ("linux-amd64", 40),
                ("linux-arm64", 250),
                ("linux-s390x", 6),
                ("linux-x86-64", 1000),
                ("local", 1000),
            ]
        );
        // Listed without keys: disabled, so no resource.
        assert!(!q.contains_key("linux-g4xlarge-amd64"));
        assert_eq!(
            q["linux-s390x"].describe(),
            "linux/s390x (static, 2 host(s) with 6 slots in total)"
        );
        assert_eq!(
            q["linux-amd64"].describe(),
            "linux/amd64 (dynamic pool, max-instances 10 × concurrency 4)"
        );
    }

    #[test]
    fn drained_capacity_drops_out_of_the_quotas() {
        let c = config(
            r#"  dynamic-platforms: "linux/arm64"
  dynamic-pool-platforms: linux/amd64
  dynamic.linux-arm64.type: aws
  dynamic.linux-arm64.region: us-east-1
  dynamic.linux-arm64.ami: ami-1
  dynamic.linux-arm64.instance-type: m6g.large
  dynamic.linux-arm64.aws-secret: aws
  dynamic.linux-arm64.ssh-secret: ssh
  dynamic.linux-arm64.max-instances: "250"
  dynamic.linux-arm64.drain: "true"
  dynamic.linux-amd64.type: aws
  dynamic.linux-amd64.region: us-east-1
  dynamic.linux-amd64.ami: ami-2
  dynamic.linux-amd64.instance-type: m6a.large
  dynamic.linux-amd64.aws-secret: aws
  dynamic.linux-amd64.ssh-secret: ssh
  dynamic.linux-amd64.max-instances: "10"
  dynamic.linux-amd64.concurrency: "4"
  dynamic.linux-amd64.drain: "true"
  host.s1.address: 10.0.0.1
  host.s1.platform: linux/s390x
  host.s1.user: u
  host.s1.secret: s
  host.s1.concurrency: "4"
  host.s2.address: 10.0.0.2
  host.s2.platform: linux/s390x
  host.s2.user: u
  host.s2.secret: s
  host.s2.concurrency: "0"
  host.s3.address: 10.0.0.3
  host.s3.platform: linux/s390x
  host.s3.user: u
  host.s3.secret: s
  host.s3.concurrency: "2"
  host.s3.drain: "true"
  host.p1.address: 10.0.0.4
  host.p1.platform: linux/ppc64le
  host.p1.user: u
  host.p1.secret: s
  host.p1.drain: "true"
"#,
        );
        let q = platform_quotas(&c);
        let got: Vec<(&str, u64)> = q.values().map(|r| (r.resource.as_str(), r.quota)).collect();
        assert_eq!(
            got,
            [
                ("linux-amd64", 0),
                ("linux-arm64", 0),
                ("linux-ppc64le", 0),
                ("linux-s390x", 4),
            ]
        );
        assert_eq!(
            q["linux-s390x"].describe(),
            "linux/s390x (static, 3 host(s) with 4 slots in total (2 drained, counted 0))"
        );
        assert_eq!(
            q["linux-amd64"].describe(),
            "linux/amd64 (drained: nothing new is launched, counted 0 (40 once the drain is lifted))"
        );
    }

    #[test]
    fn names_only_local_platforms_lose_underscores() {
        let p = Platform::parse("linux/x86_64").unwrap();
        assert_eq!(resource_name(&p, true), "linux-x86-64");
        assert_eq!(resource_name(&p, false), "linux-x86_64");
    }
}
