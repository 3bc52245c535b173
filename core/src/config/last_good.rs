//! Keeping the last good host-config: how a readable update with entry errors is merged with the
//! config served so far (pure; the shell's config source applies the result).

use std::collections::BTreeSet;

use super::{Diagnostic, HostConfig, Severity, Strategy};

/// Result of [`keep_last_good`].
#[derive(Debug, Clone, PartialEq)]
pub struct Merged {
    /// The config to serve.
    pub config: HostConfig,
    /// What kept its previous definition, one message each.
    pub kept: Vec<String>,
    /// Set when the update must not be applied at all.
    pub rejected: Option<String>,
}

/// Merges a readable update with the config served so far, so that entry errors never take away
/// something that worked (pure):
/// - a platform that `previous` served and `next` disables keeps its previous definition;
/// - a static host whose entry now has errors keeps its previous definition, if its platform is
///   still served by static hosts;
/// - a global setting whose new value is invalid keeps its previous value;
/// - an invalid global `instance-tag` rejects the update: instance ownership (and so cleanup of
///   leaked instances) depends on it, so a fallback to the default tag is never applied.
///
/// Deliberate removals (a platform or host no longer named at all) are applied as written.
pub fn keep_last_good(
    previous: &HostConfig,
    next: HostConfig,
    diagnostics: &[Diagnostic],
) -> Merged {
    let mut next = next;
    let mut kept = Vec::new();
    let errors: Vec<&Diagnostic> = diagnostics
        .iter()
        .filter(|d| d.severity == Severity::Error)
        .collect();

    if errors.iter().any(|d| d.key == "instance-tag") {
        return Merged {
            config: previous.clone(),
            kept,
            rejected: Some(
                "instance-tag is invalid; instance ownership depends on it, so the whole update is held back"
                    .into(),
            ),
        };
    }

    let disabled: Vec<_> = next.disabled.keys().cloned().collect();
    for p in disabled {
        let strategy = previous.resolve(&p);
        if matches!(strategy, Strategy::Disabled(_) | Strategy::Unknown) {
            continue;
        }
        next.local.remove(&p);
        next.dynamic.remove(&p);
        next.pools.remove(&p);
        next.static_pools.remove(&p);
        match strategy {
            Strategy::Local => {
                next.local.insert(p.clone());
            }
            Strategy::Dynamic(d) => {
                next.dynamic.insert(p.clone(), d.clone());
            }
            Strategy::DynamicPool(d) => {
                next.pools.insert(p.clone(), d.clone());
            }
            Strategy::Static(s) => {
                next.static_pools.insert(p.clone(), s.clone());
            }
            Strategy::Disabled(_) | Strategy::Unknown => {}
        }
        let reason = next.disabled.remove(&p).unwrap_or_default();
        kept.push(format!(
            "platform {p} keeps its previous definition (the update would disable it: {reason})"
        ));
    }

    let mut hosts_seen = BTreeSet::new();
    for d in &errors {
        let Some((name, _field)) = d
            .key
            .strip_prefix("host.")
            .and_then(|rest| rest.rsplit_once('.'))
        else {
            continue;
        };
        if !hosts_seen.insert(name) {
            continue;
        }
        let in_next = next
            .static_pools
            .values()
            .any(|pool| pool.hosts.iter().any(|h| h.name == name));
        let Some(prev) = previous
            .static_pools
            .values()
            .flat_map(|pool| &pool.hosts)
            .find(|h| h.name == name)
        else {
            continue;
        };
        if in_next {
            continue;
        }
        if let Some(pool) = next.static_pools.get_mut(&prev.platform) {
            pool.hosts.push(prev.clone());
            pool.hosts.sort_by(|a, b| a.name.cmp(&b.name));
            kept.push(format!(
                "static host {name} keeps its previous definition (its new entry has errors: {d})"
            ));
        }
    }

    // A capacity group whose new keys have errors keeps its previous definition (a limit that
    // held must not vanish through a typo), with the previous members the update still serves.
    for d in &errors {
        let Some((name, _field)) = d
            .key
            .strip_prefix("capacity-group.")
            .and_then(|rest| rest.rsplit_once('.'))
        else {
            continue;
        };
        if next.capacity_groups.contains_key(name) {
            continue;
        }
        let Some(prev) = previous.capacity_groups.get(name) else {
            continue;
        };
        let mut group = prev.clone();
        group
            .members
            .retain(|p| next.dynamic.contains_key(p) || next.pools.contains_key(p));
        next.capacity_groups.insert(name.to_owned(), group);
        kept.push(format!(
            "capacity group {name} keeps its previous definition (its new keys have errors: {d})"
        ));
    }

    for d in &errors {
        let restored = match d.key.as_str() {
            "gate-pending" => {
                next.gate_pending = previous.gate_pending;
                true
            }
            "reject-unknown-platforms" => {
                next.reject_unknown_platforms = previous.reject_unknown_platforms;
                true
            }
            "otp-server-url" => {
                next.otp_server_url.clone_from(&previous.otp_server_url);
                true
            }
            "additional-instance-tags" => {
                next.additional_instance_tags
                    .clone_from(&previous.additional_instance_tags);
                true
            }
            _ => false,
        };
        if restored && !kept.iter().any(|k| k.starts_with(&format!("{} ", d.key))) {
            kept.push(format!("{} keeps its previous value ({d})", d.key));
        }
    }

    Merged {
        config: next,
        kept,
        rejected: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{self, ConfigData};
    use crate::platform::Platform;

    fn data(pairs: &[(&str, &str)]) -> ConfigData {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn dynamic(label: &str, max: &str) -> Vec<(String, String)> {
        [
            ("type", "aws"),
            ("region", "us-east-1"),
            ("ami", "ami-1"),
            ("instance-type", "m6g.large"),
            ("aws-secret", "aws"),
            ("ssh-secret", "ssh"),
            ("max-instances", max),
        ]
        .iter()
        .map(|(f, v)| (format!("dynamic.{label}.{f}"), (*v).to_owned()))
        .collect()
    }

    fn host(name: &str, platform: &str, concurrency: &str) -> Vec<(String, String)> {
        [
            ("address", "10.0.0.1"),
            ("platform", platform),
            ("user", "builder"),
            ("secret", "ssh"),
            ("concurrency", concurrency),
        ]
        .iter()
        .map(|(f, v)| (format!("host.{name}.{f}"), (*v).to_owned()))
        .collect()
    }

    fn base() -> ConfigData {
        let mut d = data(&[
            ("local-platforms", "linux/amd64"),
            ("dynamic-platforms", "linux/arm64"),
            ("gate-pending", "true"),
        ]);
        d.extend(dynamic("linux-arm64", "4"));
        d.extend(host("p1", "linux/ppc64le", "2"));
        d.extend(host("p2", "linux/ppc64le", "3"));
        d
    }

    fn p(s: &str) -> Platform {
        Platform::parse(s).unwrap()
    }

    fn merge(prev: &ConfigData, next: &ConfigData) -> Merged {
        let prev = config::parse(prev).config;
        let parsed = config::parse(next);
        keep_last_good(&prev, parsed.config, &parsed.diagnostics)
    }

    #[test]
    fn platform_disabled_by_an_error_keeps_its_previous_definition() {
        let prev = base();
        let mut next = base();
        next.insert("dynamic.linux-arm64.max-instances".into(), "lots".into());
        next.insert("dynamic.linux-arm64.region".into(), "eu-west-1".into());
        let m = merge(&prev, &next);
        let d = &m.config.dynamic[&p("linux/arm64")];
        assert_eq!(d.max_instances, 4);
        assert_eq!(
            d.region, "us-east-1",
            "the whole previous definition is kept"
        );
        assert!(m.config.disabled.is_empty());
        assert_eq!(m.kept.len(), 1);
        assert!(m.kept[0].contains("linux/arm64"), "{:?}", m.kept);
        assert!(m.kept[0].contains("max-instances"), "{:?}", m.kept);
    }

    #[test]
    fn valid_changes_and_removals_are_applied() {
        let prev = base();
        let mut next = base();
        next.insert("dynamic.linux-arm64.max-instances".into(), "9".into());
        next.insert("local-platforms".into(), "".into());
        let m = merge(&prev, &next);
        assert_eq!(m.config.dynamic[&p("linux/arm64")].max_instances, 9);
        assert!(m.config.local.is_empty(), "a deliberate removal is applied");
        assert!(m.kept.is_empty());
        // Moving a platform out of every list removes it even though its keys stay.
        let mut next = base();
        next.insert("dynamic-platforms".into(), "".into());
        let m = merge(&prev, &next);
        assert!(m.config.dynamic.is_empty());
        assert!(m.kept.is_empty());
    }

    #[test]
    fn platform_never_served_stays_disabled() {
        let prev = data(&[]);
        let mut next = base();
        next.insert("dynamic.linux-arm64.max-instances".into(), "0".into());
        let m = merge(&prev, &next);
        assert!(matches!(
            m.config.resolve(&p("linux/arm64")),
            Strategy::Disabled(_)
        ));
        assert!(m.kept.is_empty());
    }

    #[test]
    fn broken_static_host_keeps_its_previous_entry() {
        let prev = base();
        let mut next = base();
        next.insert("host.p2.concurrency".into(), "99".into());
        let m = merge(&prev, &next);
        let pool = &m.config.static_pools[&p("linux/ppc64le")];
        let names: Vec<_> = pool.hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["p1", "p2"]);
        assert_eq!(pool.hosts[1].concurrency, 3);
        assert!(m.kept[0].contains("static host p2"), "{:?}", m.kept);

        // Every host broken: the platform is disabled, so the previous pool is kept whole.
        next.insert("host.p1.concurrency".into(), "nine".into());
        let m = merge(&prev, &next);
        assert_eq!(m.config.static_pools[&p("linux/ppc64le")].capacity(), 5);
    }

    #[test]
    fn removed_static_host_is_not_resurrected() {
        let prev = base();
        let next: ConfigData = base()
            .into_iter()
            .filter(|(k, _)| !k.starts_with("host.p2."))
            .collect();
        let m = merge(&prev, &next);
        assert_eq!(m.config.static_pools[&p("linux/ppc64le")].hosts.len(), 1);
    }

    #[test]
    fn invalid_global_settings_keep_their_previous_values() {
        let prev = base();
        let mut next = base();
        next.insert("gate-pending".into(), "maybe".into());
        let m = merge(&prev, &next);
        assert!(m.config.gate_pending);
        assert!(m.kept.iter().any(|k| k.starts_with("gate-pending keeps")));

        let mut next = base();
        next.insert("instance-tag".into(), "two words".into());
        let m = merge(&prev, &next);
        assert!(m.rejected.is_some());
        assert_eq!(m.config, config::parse(&prev).config);
    }
}
