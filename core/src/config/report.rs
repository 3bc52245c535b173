//! The human-readable summary `mpc check-config` prints.

use std::fmt::Write;

use super::{BuildUserSettings, DynamicPlatform, HostConfig, HostOs, Parsed, Severity, Strategy};
use crate::platform::{Platform, label_value};

/// One platform's strategy and capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlatformSummary {
    pub platform: Platform,
    /// `local`, `dynamic`, `dynamic-pool`, `static` or `disabled`.
    pub strategy: &'static str,
    /// Capacity in words (hosts × concurrency, max-instances, ...).
    pub capacity: String,
}

impl HostConfig {
    /// Strategy and capacity of every platform the config names.
    pub fn summaries(&self) -> Vec<PlatformSummary> {
        self.platforms()
            .into_iter()
            .map(|p| {
                let (strategy, capacity) = match self.resolve(p) {
                    Strategy::Local => (
                        "local",
                        match p.node_os_arch() {
                            Some((os, arch)) => format!(
                                "in-cluster nodes (kubernetes.io/os={os}, kubernetes.io/arch={arch})"
                            ),
                            None => "in the build pod".to_owned(),
                        },
                    ),
                    Strategy::Dynamic(d) => (
                        "dynamic",
                        format!(
                            "{}max-instances {} ({} in {}, 1 TaskRun per instance){}{}",
                            drained_note(d),
                            d.max_instances,
                            d.instance_type,
                            d.region,
                            os_note(d),
                            ibm_note(d)
                        ),
                    ),
                    Strategy::DynamicPool(pool) => (
                        "dynamic-pool",
                        format!(
                            "{}max-instances {} × concurrency {} = {} slots ({} in {}, max-age {} min{}){}",
                            drained_note(&pool.instance),
                            pool.instance.max_instances,
                            pool.concurrency,
                            pool.instance.max_instances * pool.concurrency,
                            pool.instance.instance_type,
                            pool.instance.region,
                            pool.max_age.as_secs() / 60,
                            if pool.min_instances > 0 {
                                format!(", {} warm", pool.min_instances)
                            } else {
                                String::new()
                            },
                            ibm_note(&pool.instance)
                        ),
                    ),
                    Strategy::Static(s) => {
                        let n = s.hosts.len();
                        let first = s.hosts[0].concurrency;
                        let mut capacity = if s.hosts.iter().all(|h| h.concurrency == first) {
                            format!("{n} host(s) × concurrency {first} = {} slots", s.capacity())
                        } else {
                            format!("{n} host(s), {} slots in total", s.capacity())
                        };
                        let drained: Vec<&str> = s.drained().map(|h| h.name.as_str()).collect();
                        if !drained.is_empty() {
                            let _ = write!(
                                capacity,
                                "; drained: {} (no new TaskRuns, counted 0)",
                                drained.join(", ")
                            );
                        }
                        ("static", capacity)
                    }
                    Strategy::Disabled(why) => ("disabled", why.to_owned()),
                    Strategy::Unknown => ("unknown", String::new()),
                };
                let capacity = capacity + &group_note(self, p);
                PlatformSummary {
                    platform: p.clone(),
                    strategy,
                    capacity,
                }
            })
            .collect()
    }
}

/// The capacity groups a platform is in, for its report row.
fn group_note(config: &HostConfig, p: &Platform) -> String {
    let groups: Vec<String> = config
        .groups_of(p)
        .map(|g| format!("{} (max {})", g.name, g.max))
        .collect();
    if groups.is_empty() {
        String::new()
    } else {
        format!(
            "; launches only while capacity group(s) {} have room",
            groups.join(", ")
        )
    }
}

/// What each capacity group means for its members.
fn render_groups(out: &mut String, config: &HostConfig) {
    if config.capacity_groups.is_empty() {
        return;
    }
    let _ = writeln!(out, "capacity groups: {}", config.capacity_groups.len());
    for g in config.capacity_groups.values() {
        let members: Vec<String> = g
            .members
            .iter()
            .map(|m| match config.resolve(m) {
                Strategy::Dynamic(d) => format!("{m} (max-instances {})", d.max_instances),
                Strategy::DynamicPool(pool) => format!(
                    "{m} (pool, max-instances {}, concurrency {})",
                    pool.instance.max_instances, pool.concurrency
                ),
                _ => m.to_string(),
            })
            .collect();
        let own: u64 = g
            .members
            .iter()
            .map(|m| match config.resolve(m) {
                Strategy::Dynamic(d) => u64::from(d.max_instances),
                Strategy::DynamicPool(pool) => u64::from(pool.instance.max_instances),
                _ => 0,
            })
            .sum();
        let counted = match g.scope {
            super::GroupScope::Cluster => "this cluster's instances of its members",
            super::GroupScope::Account => {
                "its members' instances in their accounts (this cluster's, and other clusters' \
                 with the same instance tag as last listed)"
            }
        };
        let binding = if own <= u64::from(g.max) {
            format!("; never binding: its members' max-instances add up to {own}, at most its max")
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "  {}: max {} instances, counting {counted}, from launch request to acknowledged \
             termination; each member launches only while the group holds fewer (a pool \
             instance is one unit however many builds share it; joining one takes none){binding}; \
             members: {}; Kueue resource {} (mpc kueue-quotas --group-cel)",
            g.name,
            g.max,
            if members.is_empty() {
                "none".to_owned()
            } else {
                members.join(", ")
            },
            g.name
        );
    }
}

impl HostConfig {
    /// What the config drains, in words and sorted: `host h1 (linux/s390x)` for each drained
    /// static host, `linux/arm64 (dynamic)` or `(dynamic pool)` for each drained cloud platform.
    pub fn drained_summary(&self) -> Vec<String> {
        let hosts = self
            .drained_hosts()
            .map(|h| format!("host {} ({})", h.name, h.platform));
        let dynamic = self
            .dynamic
            .values()
            .filter(|d| d.drained)
            .map(|d| format!("{} (dynamic)", d.platform));
        let pools = self
            .pools
            .values()
            .filter(|p| p.instance.drained)
            .map(|p| format!("{} (dynamic pool)", p.instance.platform));
        let mut all: Vec<String> = hosts.chain(dynamic).chain(pools).collect();
        all.sort();
        all
    }
}

/// How an IBM Cloud platform's instances are reached and named, for its report row.
fn ibm_note(d: &DynamicPlatform) -> String {
    match &d.ibm {
        None => String::new(),
        Some(s) => format!(
            "; IBM Cloud {}: private addresses only (no floating IPs), login {}, instances named {}-<16 hex>x",
            match s.kind() {
                super::ibm_service::IbmKind::Vpc => "VPC",
                super::ibm_service::IbmKind::Power => "Power VS",
            },
            d.user,
            d.instance_tag
        ),
    }
}

/// A drained platform's prefix for its report row.
fn drained_note(d: &DynamicPlatform) -> &'static str {
    if d.drained {
        "drained (nothing new is launched, counted 0); "
    } else {
        ""
    }
}

/// What a windows or macOS platform does differently, for its report row.
fn os_note(d: &DynamicPlatform) -> String {
    match d.os {
        HostOs::Linux => String::new(),
        HostOs::Windows => "; windows: no build user, the key the user-data leaves at \
             C:\\Users\\Administrator\\konflux-builder is read as Administrator, removed and handed out"
            .to_owned(),
        HostOs::MacOs => {
            let placement = match &d.dedicated_host {
                Some(h) => format!(
                    "dedicated hosts of {} (tenancy {}, licence {}; an instance's max-instances slot \
                     stays taken {} min after it terminates, while its host is scrubbed: host-scrub)",
                    h.host_resource_group_arn,
                    h.tenancy,
                    h.license_configuration_arn,
                    h.scrub.as_secs() / 60
                ),
                None => "no dedicated-host keys (the account's own host placement applies)".to_owned(),
            };
            let n = d.max_instances;
            format!(
                "; macos: {placement}; no build user, the key at /Users/ec2-user/konflux-builder is \
                 read as ec2-user, removed and handed out; each host is billed for at least 24 h and \
                 scrubbed ~50 min after every instance, so max-instances {n} can keep {n} hosts \
                 billed: a burst of {n} builds costs at least {} host-hours ({n} x 24 h) however \
                 short the builds, and a host takes no build for ~50 min after each one \
                 (`mpc simulate` shows the host-hours of a trace)",
                u64::from(n) * 24
            )
        }
    }
}

/// Renders the per-platform table followed by every warning and error.
pub fn render_report(source: &str, parsed: &Parsed) -> String {
    let mut out = String::new();
    let rows = parsed.config.summaries();
    let _ = writeln!(out, "{source}: {} platform(s)", rows.len());
    let width = rows
        .iter()
        .map(|r| r.platform.as_str().len())
        .max()
        .unwrap_or(8)
        .max(8);
    let _ = writeln!(
        out,
        "  {:<width$}  {:<12}  capacity",
        "platform", "strategy"
    );
    for r in &rows {
        let _ = writeln!(
            out,
            "  {:<width$}  {:<12}  {}",
            r.platform.as_str(),
            r.strategy,
            r.capacity
        );
    }
    render_groups(&mut out, &parsed.config);
    render_build_users(&mut out, &parsed.config);
    for (sev, title) in [(Severity::Warning, "warnings"), (Severity::Error, "errors")] {
        let items: Vec<_> = parsed.of(sev).collect();
        let _ = writeln!(out, "{title}: {}", items.len());
        for d in items {
            let _ = writeln!(out, "  {d}");
        }
    }
    out
}

/// The build-user setup (key type, slice caps) wherever it differs from the default.
fn render_build_users(out: &mut String, config: &HostConfig) {
    let b = &config.build_users;
    let default = BuildUserSettings::DEFAULT.describe();
    if b.hosts.is_empty() && b.platforms.is_empty() {
        let _ = writeln!(out, "build users: {default}, no slice, everywhere");
        return;
    }
    let _ = writeln!(out, "build users: {default}, no slice, except:");
    for (p, s) in &b.platforms {
        let _ = writeln!(
            out,
            "  dynamic.{}.*: {}",
            label_value(p.as_str()),
            s.describe()
        );
    }
    for (name, s) in &b.hosts {
        let _ = writeln!(out, "  host.{name}.*: {}", s.describe());
    }
}
