//! The `host-config` ConfigMap (docs/architecture.md, "The contract with the Go controller") as
//! typed, validated configuration.
//!
//! Pure code. [`parse`] never fails as a whole: every problem becomes a [`Diagnostic`] naming the key
//! and the bad value, and a bad entry disables only its own host or platform (recorded in
//! [`HostConfig::disabled`] so TaskRuns for it get an error secret that says why).
//!
//! Drains (ours): `host.<h>.drain: "true"` or `host.<h>.concurrency: "0"` drains a static host,
//! `dynamic.<p>.drain: "true"` a dynamic platform or pool. A drained entry stays configured
//! (running allocations keep their definition, waiters wait rather than get an error secret) and
//! counts 0 in every capacity ([`StaticHost::capacity`], [`HostConfig::capacity`], the Kueue
//! export). The Go controller rejects `concurrency: 0`, and one invalid host there disables every
//! static platform of the cluster; it ignores `drain`. Both are reported as warnings, so that a
//! rollback to it is a known step.
//!
//! Layout: `types` holds the validated configuration, `parse` the ConfigMap walk (key grouping,
//! globals, platform lists, assembly), `dynamic`, `ibm`, `static_host` and `capacity_group` (limits
//! shared by several platforms: what they count, who can be a member and why static hosts cannot)
//! the per-entry parsers it calls, `entry` what it hands them (the diagnostic sink).

mod build_user;
mod capacity_group;
mod configmap;
mod dynamic;
mod entry;
pub mod ibm;
mod ibm_service;
mod last_good;
mod parse;
mod report;
mod static_host;
mod types;
pub mod values;

pub use build_user::{BuildUserSettings, BuildUsers, CpuQuota, KeyType, MemoryMax};
pub use configmap::{ConfigMapError, read_configmap_yaml};
pub use last_good::{Merged, keep_last_good};
pub use parse::parse;
pub use report::{PlatformSummary, render_report};
pub use types::*;

#[cfg(test)]
mod tests;
