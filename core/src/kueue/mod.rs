//! Kueue quotas from host-config: one source of truth for how many builds of each platform may
//! run (`mpc kueue-quotas`), and the check that a ClusterQueue and the admission policy's allowed
//! annotations agree with it (`mpc check-config --cluster-queue`).
//!
//! Konflux admits PipelineRuns with Kueue: tekton-kueue turns each build platform into a request
//! for a resource named after it (`linux/arm64` → `linux-arm64`), and the ClusterQueue's quota for
//! that resource must match the controller's capacity for the platform. infra-deployments keeps the
//! two in step with `hack/kueue-vm-quotas/update-kueue-vm-quotas.py`; this module renders the same
//! file from the parsed [`HostConfig`](crate::config::HostConfig):
//! - quotas ([`quota`]): dynamic `max-instances`, static hosts' summed `concurrency`, local
//!   platforms 1000; dynamic pools `max-instances × concurrency` (the script counts their
//!   `max-instances` only, which under-counts by the pool's concurrency);
//! - groups ([`queue`]): resources sorted, at most 16 per group, flavors `platform-group-N`,
//!   the other groups (the base group with `tekton.dev/pipelineruns`) kept as they are;
//! - output ([`yaml`]): v1beta2 canonical quantities and PyYAML's layout, so the rendered file is
//!   byte-for-byte the committed one;
//! - capacity groups (`capacity-group.<g>.max`): one resource each in the platform groups, named
//!   after the group, its quota the group's `max`; [`cel`] renders the tekton-kueue expressions
//!   that request it for exactly the member platforms (`--group-cel`). A ClusterQueue that
//!   keeps the resource in its base group (as production keeps `aws-ip` today) is refused with
//!   the overlap error until it is removed from there; `check-config --cluster-queue` compares
//!   its quota wherever it is. Kueue counts one unit per PipelineRun's build-platforms entry,
//!   the controller one per instance (see [`cel`]).
//!
//! Differences from the script, all deliberate: quotas come from the validated config, so a
//! platform the controller does not serve (disabled by an error, listed without keys, or
//! `dynamic.*` keys of an unlisted platform) gets no quota, and a static host that is invalid or
//! shadowed by a dynamic entry adds nothing; hand-made groups other than the base group are kept
//! rather than dropped; new ResourceFlavors take the ClusterQueue's API version; quantities of a
//! million and more are canonical (`1M`, where the script writes `1000k`).
//!
//! Pure code apart from [`run`], which reads the files a caller names.

pub mod cel;
pub mod check;
pub mod queue;
pub mod quota;
pub mod yaml;

use std::path::{Path, PathBuf};

use serde_norway::{Mapping, Value};

use crate::config::{self, ConfigData, Diagnostic, Parsed};
pub use cel::group_cel;
pub use check::{Finding, check, render_findings};
pub use queue::{
    allowed_annotations, format_annotation_list, platform_groups, render_cluster_queue,
    render_groups,
};
pub use quota::{KueueApi, ResourceQuota, Source, canonical_quantity, platform_quotas};

/// Why Kueue objects could not be read or rendered.
#[derive(Debug, thiserror::Error)]
pub enum KueueError {
    /// A file could not be read or written.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not valid YAML.
    #[error("not valid YAML: {0}")]
    Yaml(serde_norway::Error),
    /// The host-config file is neither a ConfigMap nor a data mapping.
    #[error("{path}: {source}")]
    HostConfig {
        /// The file.
        path: String,
        /// Why.
        source: config::ConfigMapError,
    },
    /// The file has no ClusterQueue document.
    #[error("no ClusterQueue document (kind: ClusterQueue) in the file")]
    NoClusterQueue,
    /// Kueue allows at most 16 resource groups.
    #[error(
        "{groups} resource groups, Kueue allows at most 16 (platforms come in groups of 16 after the other groups)"
    )]
    TooManyGroups {
        /// How many there would be.
        groups: usize,
    },
    /// A kept group has more resources than Kueue allows.
    #[error(
        "the resource group of flavor {flavor} covers {resources} resources, Kueue allows at most 16"
    )]
    GroupTooLarge {
        /// Its flavor.
        flavor: String,
        /// How many it covers.
        resources: usize,
    },
    /// A platform resource is already covered by a kept (hand-made) group.
    #[error(
        "resource {resource} is covered by the group of flavor {flavor}, which is kept as it is; a resource may be in one group only: remove it from that group and let the platform groups carry it"
    )]
    Overlap {
        /// The resource.
        resource: String,
        /// The kept group's flavor.
        flavor: String,
    },
    /// The allowed-annotations file holds no list.
    #[error(
        "no allowed-annotations list: expected a ConfigMap with data.allowed-annotations or a list of annotation names"
    )]
    NoAnnotationList,
    /// The rendered YAML would not match the ClusterQueue tooling's.
    #[error(transparent)]
    Unsupported(#[from] yaml::UnsupportedValue),
}

/// Reads a host-config's data: from the rendered ConfigMap YAML, or from a YAML mapping of its
/// `data` alone (`local-platforms: ...`, `dynamic.linux-arm64.max-instances: "250"`, ...), with the
/// same checks and diagnostics.
pub fn read_host_config_data(
    text: &str,
) -> Result<(ConfigData, Vec<Diagnostic>), config::ConfigMapError> {
    let doc: Value = serde_norway::from_str(text)?;
    match doc {
        Value::Mapping(m) if !m.contains_key("kind") => {
            let mut cm = Mapping::new();
            cm.insert("kind".into(), "ConfigMap".into());
            cm.insert("data".into(), Value::Mapping(m));
            config::read_configmap_yaml(&serde_norway::to_string(&Value::Mapping(cm))?)
        }
        _ => config::read_configmap_yaml(text),
    }
}

/// [`read_host_config_data`] and [`config::parse`]: the data (for checks on raw keys) and the
/// parsed config, every diagnostic included.
pub fn read_host_config(text: &str, shown: &str) -> Result<(ConfigData, Parsed), KueueError> {
    let (data, mut diagnostics) =
        read_host_config_data(text).map_err(|source| KueueError::HostConfig {
            path: shown.to_owned(),
            source,
        })?;
    let mut parsed = config::parse(&data);
    diagnostics.append(&mut parsed.diagnostics);
    parsed.diagnostics = diagnostics;
    Ok((data, parsed))
}

/// `mpc kueue-quotas` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct KueueQuotasArgs {
    /// host-config: the rendered ConfigMap YAML, or a YAML mapping of its data.
    #[arg(value_name = "HOST_CONFIG")]
    pub config: PathBuf,
    /// The cluster's ClusterQueue file (with its ResourceFlavors): print it whole, its platform
    /// groups replaced and its other groups kept. Without it, only the platform groups are printed.
    #[arg(long, value_name = "FILE")]
    pub cluster_queue: Option<PathBuf>,
    /// Rewrite the --cluster-queue file in place instead of printing it.
    #[arg(long, requires = "cluster_queue")]
    pub write: bool,
    /// Print the allowed request annotations (the admission policy's `allowed-annotations` list)
    /// of the rendered ClusterQueue instead.
    #[arg(long)]
    pub allowed_annotations: bool,
    /// Print the tekton-kueue CEL expressions that request each capacity group's resource for
    /// its member platforms (to paste under tekton-kueue's `cel.expressions`) instead.
    #[arg(long, conflicts_with_all = ["cluster_queue", "allowed_annotations"])]
    pub group_cel: bool,
    /// Kueue API version of the groups printed without --cluster-queue (with it, the file's own).
    #[arg(long, value_enum, default_value_t = KueueApi::V1beta2)]
    pub api: KueueApi,
}

/// What `mpc kueue-quotas` produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KueueQuotasOutput {
    /// Standard output.
    pub stdout: String,
    /// Notes for standard error: platforms left out and why.
    pub notes: Vec<String>,
}

fn read(path: &Path) -> Result<String, KueueError> {
    std::fs::read_to_string(path).map_err(|source| KueueError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Runs `mpc kueue-quotas`: reads the named files, renders, and writes the ClusterQueue back with
/// `--write`.
pub fn run(args: &KueueQuotasArgs) -> Result<KueueQuotasOutput, KueueError> {
    let shown = args.config.display().to_string();
    let (_, parsed) = read_host_config(&read(&args.config)?, &shown)?;
    let mut notes: Vec<String> = parsed
        .config
        .disabled
        .iter()
        .map(|(p, why)| format!("{p}: no quota, the controller does not serve it: {why}"))
        .collect();
    if args.group_cel {
        if parsed.config.capacity_groups.is_empty() {
            notes.push("host-config defines no capacity group (capacity-group.<name>.max)".into());
        }
        return Ok(KueueQuotasOutput {
            stdout: group_cel(&parsed.config),
            notes,
        });
    }
    let quotas = platform_quotas(&parsed.config);
    let stdout = match &args.cluster_queue {
        Some(path) => {
            let rendered = render_cluster_queue(&read(path)?, &quotas)?;
            if args.allowed_annotations {
                format!(
                    "{}\n",
                    format_annotation_list(&allowed_annotations(&rendered)?)
                )
            } else if args.write {
                std::fs::write(path, &rendered).map_err(|source| KueueError::Io {
                    path: path.clone(),
                    source,
                })?;
                notes.push(format!("updated {}", path.display()));
                String::new()
            } else {
                rendered
            }
        }
        None if args.allowed_annotations => {
            let list: Vec<String> = quotas
                .keys()
                .map(|r| format!("{}{r}", queue::ANNOTATION_PREFIX))
                .collect();
            format!("{}\n", format_annotation_list(&list))
        }
        None => render_groups(&quotas, args.api)?,
    };
    Ok(KueueQuotasOutput { stdout, notes })
}

#[cfg(test)]
mod tests;
