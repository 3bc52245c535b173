//! `mpc check-config --cluster-queue`: where a ClusterQueue (and the admission policy's allowed
//! annotations) disagree with the host-config.

use std::collections::BTreeMap;
use std::fmt;

use super::KueueError;
use super::queue::{
    ANNOTATION_PREFIX, allowed_annotations, existing_groups, find_cluster_queue,
    read_annotation_list, read_documents,
};
use super::quota::{KueueApi, ResourceQuota, parse_quantity, platform_quotas};
use crate::config::{ConfigData, HostConfig, Strategy, values};
use crate::platform::{Platform, label_value};

/// One disagreement between host-config and the Kueue objects derived from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// The ClusterQueue's quota is not the platform's capacity.
    QuotaDiffers {
        /// Kueue resource.
        resource: String,
        /// The platforms behind it, with their capacity.
        platforms: String,
        /// Capacity from host-config.
        expected: u64,
        /// How the expected quota is written in this queue's API version.
        expected_text: String,
        /// The quota in the ClusterQueue, as written (summed over flavors).
        actual: String,
    },
    /// A platform the controller serves has no quota at all.
    NoQuota {
        /// Kueue resource.
        resource: String,
        /// The platforms behind it, with their capacity.
        platforms: String,
        /// How the expected quota is written in this queue's API version.
        expected_text: String,
    },
    /// A generated platform group holds a resource no served platform has.
    UnknownResource {
        /// Kueue resource.
        resource: String,
        /// Its flavor.
        flavor: String,
        /// Why host-config has no such platform.
        why: String,
    },
    /// Listed in a dynamic platform list without any `dynamic.<label>.*` key.
    ListedWithoutKeys {
        /// The platform.
        platform: Platform,
        /// `dynamic-platforms` or `dynamic-pool-platforms`.
        list: &'static str,
    },
    /// The ClusterQueue covers a resource whose request annotation is not allowed.
    AnnotationMissing {
        /// The annotation.
        annotation: String,
    },
    /// An allowed request annotation names a resource the ClusterQueue does not cover.
    AnnotationWithoutResource {
        /// The annotation.
        annotation: String,
    },
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::QuotaDiffers {
                resource,
                platforms,
                expected,
                expected_text,
                actual,
            } => match parse_quantity(actual) {
                Some(n) => write!(
                    f,
                    "{resource}: ClusterQueue quota {actual} ({n}) but host-config allows {expected} concurrent builds: {platforms}; set nominalQuota to {expected_text}"
                ),
                None => write!(
                    f,
                    "{resource}: ClusterQueue quota {actual:?} is not a whole-number quantity; host-config allows {expected} concurrent builds: {platforms}; set nominalQuota to {expected_text}"
                ),
            },
            Finding::NoQuota {
                resource,
                platforms,
                expected_text,
            } => write!(
                f,
                "{resource}: no quota in the ClusterQueue, so Kueue never admits PipelineRuns that request it; host-config serves {platforms}; add it with nominalQuota {expected_text}"
            ),
            Finding::UnknownResource {
                resource,
                flavor,
                why,
            } => write!(
                f,
                "{resource} (flavor {flavor}): {why}; PipelineRuns requesting it are admitted for builds the controller cannot run; remove it"
            ),
            Finding::ListedWithoutKeys { platform, list } => write!(
                f,
                "{platform}: listed in {list} but no dynamic.{}.* key exists, so it has no capacity and no Kueue quota, and the Go controller answers its TaskRuns with an error secret; add its keys or remove it from {list}",
                label_value(platform.as_str())
            ),
            Finding::AnnotationMissing { annotation } => write!(
                f,
                "{annotation}: not in the allowed annotations although the ClusterQueue covers {}; the admission policy denies PipelineRuns that request it",
                annotation.trim_start_matches(ANNOTATION_PREFIX)
            ),
            Finding::AnnotationWithoutResource { annotation } => write!(
                f,
                "{annotation}: allowed, but the ClusterQueue covers no {}; PipelineRuns that request it pass the admission policy and are never admitted by Kueue",
                annotation.trim_start_matches(ANNOTATION_PREFIX)
            ),
        }
    }
}

/// Platforms named in `dynamic-platforms` / `dynamic-pool-platforms` that have no
/// `dynamic.<label>.*` key at all (and are not served another way).
pub fn listed_without_keys(data: &ConfigData, config: &HostConfig) -> Vec<Finding> {
    let mut out = Vec::new();
    for list in ["dynamic-platforms", "dynamic-pool-platforms"] {
        let Some(v) = data.get(list) else { continue };
        for item in values::split_list(v) {
            let Ok(platform) = Platform::parse(item) else {
                continue;
            };
            let prefix = format!("dynamic.{}.", platform.label_value());
            let has_keys = data
                .range(prefix.clone()..)
                .next()
                .is_some_and(|(k, _)| k.starts_with(&prefix));
            if !has_keys
                && matches!(config.resolve(&platform), Strategy::Disabled(_))
                && !out.iter().any(|f| matches!(f, Finding::ListedWithoutKeys { platform: p, .. } if *p == platform))
            {
                out.push(Finding::ListedWithoutKeys { platform, list });
            }
        }
    }
    out
}

/// Why host-config has no platform behind `resource`.
fn why_unknown(resource: &str, data: &ConfigData, config: &HostConfig) -> String {
    for p in config.platforms() {
        let named = p.label_value() == resource || p.label_value().replace('_', "-") == resource;
        if named && let Strategy::Disabled(reason) = config.resolve(p) {
            return format!("{p} is disabled in host-config ({reason})");
        }
    }
    let group = format!("capacity-group.{resource}.");
    if data.keys().any(|k| k.starts_with(&group)) {
        return format!(
            "host-config's capacity group {resource} is left out by an error (see mpc check-config)"
        );
    }
    let prefix = format!("dynamic.{resource}.");
    if data.keys().any(|k| k.starts_with(&prefix)) {
        return format!(
            "host-config has {prefix}* keys but lists no such platform in dynamic-platforms or dynamic-pool-platforms, so the controller does not serve it"
        );
    }
    "host-config has no such platform".to_owned()
}

/// Compares a ClusterQueue file (and optionally the allowed-annotations file) with host-config.
/// Returns every finding; an empty list means they agree.
pub fn check(
    data: &ConfigData,
    config: &HostConfig,
    queue_file: &str,
    annotations_file: Option<&str>,
) -> Result<Vec<Finding>, KueueError> {
    let docs = read_documents(queue_file)?;
    let queue = find_cluster_queue(&docs)?;
    let api = KueueApi::of_api_version(
        queue
            .get("apiVersion")
            .and_then(serde_norway::Value::as_str)
            .unwrap_or(""),
    );
    let groups = existing_groups(queue);
    let expected: BTreeMap<String, ResourceQuota> = platform_quotas(config);

    // Resource → quotas as written, over every group and flavor.
    let mut actual: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for g in &groups {
        for (_, resources) in &g.flavors {
            for (r, q) in resources {
                actual.entry(r).or_default().push(q);
            }
        }
    }

    let mut findings = listed_without_keys(data, config);
    for q in expected.values() {
        let expected_text = api.format(q.quota);
        match actual.get(q.resource.as_str()) {
            None => findings.push(Finding::NoQuota {
                resource: q.resource.clone(),
                platforms: q.describe(),
                expected_text,
            }),
            Some(written) => {
                let sum: Option<u128> = written.iter().map(|w| parse_quantity(w)).sum();
                if sum != Some(u128::from(q.quota)) {
                    findings.push(Finding::QuotaDiffers {
                        resource: q.resource.clone(),
                        platforms: q.describe(),
                        expected: q.quota,
                        expected_text,
                        actual: written.join(" + "),
                    });
                }
            }
        }
    }
    for g in groups.iter().filter(|g| g.is_platform_group()) {
        let flavor = g
            .flavors
            .iter()
            .map(|(f, _)| f.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        for r in &g.covered {
            if !expected.contains_key(r) {
                findings.push(Finding::UnknownResource {
                    resource: r.clone(),
                    flavor: flavor.clone(),
                    why: why_unknown(r, data, config),
                });
            }
        }
    }

    if let Some(text) = annotations_file {
        let allowed = read_annotation_list(text)?;
        let derived = allowed_annotations(queue_file)?;
        for a in &derived {
            if !allowed.contains(a) {
                findings.push(Finding::AnnotationMissing {
                    annotation: a.clone(),
                });
            }
        }
        for a in &allowed {
            if a.starts_with(ANNOTATION_PREFIX) && !derived.contains(a) {
                findings.push(Finding::AnnotationWithoutResource {
                    annotation: a.clone(),
                });
            }
        }
    }
    Ok(findings)
}

/// The findings as `mpc check-config` prints them: a title line, then one `error:` line each.
pub fn render_findings(title: &str, findings: &[Finding]) -> String {
    let mut out = format!("{title}: {} problem(s)\n", findings.len());
    for f in findings {
        out.push_str(&format!("  error: {f}\n"));
    }
    out
}
