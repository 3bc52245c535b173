//! The walk over the whole ConfigMap: groups keys by section, reads the globals and platform
//! lists, hands each `dynamic.<label>.*` and `host.<name>.*` group to its parser and assembles the
//! [`HostConfig`].

use std::collections::{BTreeMap, BTreeSet};

use super::capacity_group::{self, GroupKeys};
use super::dynamic::parse_dynamic;
use super::entry::{DynKind, Sink};
use super::static_host::parse_host;
use super::{
    BuildUserSettings, ConfigData, DEFAULT_INSTANCE_TAG, Diagnostic, DynamicPool, HostConfig,
    Parsed, Severity, StaticHost, StaticPool, values,
};
use crate::platform::{Platform, label_value};

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

/// Parses ConfigMap data into a [`HostConfig`] and diagnostics. Never fails as a whole.
pub fn parse(data: &ConfigData) -> Parsed {
    let mut sink = Sink::default();
    let mut cfg = HostConfig::default();

    // Group keys by section.
    let mut dyn_groups: BTreeMap<&str, BTreeMap<&str, &str>> = BTreeMap::new();
    let mut host_groups: BTreeMap<&str, BTreeMap<&str, &str>> = BTreeMap::new();
    let mut capacity_keys: GroupKeys = BTreeMap::new();
    let mut memberships: Vec<(&str, &str, &str)> = Vec::new();
    for (key, value) in data {
        if let Some(rest) = key.strip_prefix("dynamic.") {
            match rest.split_once('.') {
                Some((p, capacity_group::MEMBER_FIELD)) if !p.is_empty() => {
                    memberships.push((p, key, value));
                }
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
                Some((name, capacity_group::MEMBER_FIELD)) if !name.is_empty() => {
                    capacity_group::static_member(key, value, &mut sink);
                }
                Some((name, field)) if !name.is_empty() && !field.is_empty() => {
                    host_groups.entry(name).or_default().insert(field, value);
                }
                _ => sink.warn(key, None, "unknown key (expected host.<name>.<field>)"),
            }
        } else if let Some(rest) = key.strip_prefix("capacity-group.") {
            match rest.rsplit_once('.') {
                Some((name, field)) if !name.is_empty() && !field.is_empty() => {
                    capacity_keys.entry(name).or_default().insert(field, value);
                }
                _ => sink.warn(
                    key,
                    None,
                    "unknown key (expected capacity-group.<name>.<field>)",
                ),
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
        // `drain` (ours) applies alike to every cloud: read here, kept from the entry parsers.
        let mut fields = fields.clone();
        let drain = fields.remove("drain");
        let parsed = parse_dynamic(
            &platform,
            &prefix,
            &fields,
            kind,
            global_tag.as_deref(),
            &mut sink,
        );
        let drained = match drain {
            None => false,
            Some(v) => match values::parse_bool(v) {
                Ok(b) => b,
                Err(e) => {
                    sink.error(
                        &format!("{prefix}.drain"),
                        Some(v),
                        format!("{e}; platform disabled"),
                    );
                    disable_for_error(&mut cfg, &platform, &sink, before);
                    continue;
                }
            },
        };
        if drained {
            sink.warn(
                &format!("{prefix}.drain"),
                Some(drain.unwrap_or_default()),
                format!(
                    "{platform} is drained: nothing new is launched{}, what runs finishes, and its TaskRuns wait; the Go controller ignores drain and would launch again",
                    if kind == DynKind::Pool { " and its instances take no new TaskRun (idle ones are terminated)" } else { "" }
                ),
            );
        }
        match parsed {
            Some((mut d, pool, build_user)) => {
                d.drained = drained;
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
            None => disable_for_error(&mut cfg, &platform, &sink, before),
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

    // Capacity groups and their dynamic members.
    let mut groups = capacity_group::parse_groups(&capacity_keys, &mut sink);
    for (label, key, value) in memberships {
        let served = cfg
            .dynamic
            .keys()
            .chain(cfg.pools.keys())
            .find(|p| label_value(p.as_str()) == label)
            .cloned();
        match served {
            Some(p) => capacity_group::join(&mut groups, &capacity_keys, &p, key, value, &mut sink),
            None if used_groups.contains(label) => {} // disabled: reported at its own keys
            None => sink.warn(
                key,
                Some(value),
                format!(
                    "unused: no platform with label value {label} is listed in dynamic-platforms \
                     or dynamic-pool-platforms"
                ),
            ),
        }
    }
    capacity_group::warn_empty(&groups, &mut sink);
    cfg.capacity_groups = groups;

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

    let mut groups = std::mem::take(&mut cfg.capacity_groups);
    capacity_group::refuse_platform_names(&mut groups, &cfg.platforms(), &mut sink);
    cfg.capacity_groups = groups;

    Parsed {
        config: cfg,
        diagnostics: sink.0,
    }
}

/// Disables a dynamic platform for the first error its entry reported.
fn disable_for_error(cfg: &mut HostConfig, platform: &Platform, sink: &Sink, before: usize) {
    let reason = first_error_since(sink, before)
        .map(|d| {
            format!(
                "{platform} is disabled by a configuration error: {}",
                d.detail()
            )
        })
        .unwrap_or_else(|| format!("{platform} is disabled by a configuration error"));
    cfg.disabled.insert(platform.clone(), reason);
}

fn first_error_since(sink: &Sink, from: usize) -> Option<&Diagnostic> {
    sink.0[from..]
        .iter()
        .find(|d| d.severity == Severity::Error)
}
