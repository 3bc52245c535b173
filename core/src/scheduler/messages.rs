//! Human messages for error secrets and Events: what failed, and what to do about it.

use std::sync::Arc;

use crate::config::HostConfig;
use crate::platform::Platform;

/// The `PLATFORM` param does not parse.
pub(super) fn bad_platform(raw: &str, reason: &str) -> String {
    format!(
        "The PLATFORM parameter {raw:?} is not valid: {reason}. Set it to a platform such as \
         linux/arm64."
    )
}

/// The platform's host-config entry is broken.
pub(super) fn disabled(platform: &Platform, reason: &str) -> String {
    format!(
        "No build host can be allocated for platform {platform}: its entry in the host-config \
         ConfigMap is invalid ({reason}). Ask the cluster's platform team to fix the host-config, \
         then retry the build."
    )
}

/// Nothing serves the platform.
pub(super) fn unknown_platform(platform: &Platform, config: &HostConfig) -> String {
    let known: Vec<&str> = config
        .platforms()
        .into_iter()
        .filter(|p| !config.disabled.contains_key(*p))
        .map(Platform::as_str)
        .collect();
    let shown = if known.is_empty() {
        "none".to_owned()
    } else if known.len() > 12 {
        format!("{}, … ({} in all)", known[..12].join(", "), known.len())
    } else {
        known.join(", ")
    };
    format!(
        "Platform {platform} is not configured on this cluster (configured: {shown}). Set the \
         PLATFORM parameter to a configured platform, or ask the cluster's platform team to add \
         {platform} to the host-config ConfigMap."
    )
}

/// Queued for capacity.
pub(super) fn waiting(platform: &Platform, ahead_in_namespace: usize) -> String {
    if ahead_in_namespace == 0 {
        format!("All {platform} build hosts are busy; waiting for the next free one.")
    } else {
        format!(
            "All {platform} build hosts are busy; waiting behind {ahead_in_namespace} earlier \
             build(s) from this namespace."
        )
    }
}

fn list_failures(failed: &[(Arc<str>, String)]) -> String {
    failed
        .iter()
        .map(|(h, e)| format!("{h}: {e}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every static host failed provisioning for this TaskRun.
pub(super) fn all_hosts_failed(platform: &Platform, failed: &[(Arc<str>, String)]) -> String {
    format!(
        "Could not prepare a build user on any {platform} host ({}). The hosts may be down or \
         unreachable; retry the build later, and if it keeps failing report it to the cluster's \
         platform team.",
        list_failures(failed)
    )
}

/// Too many instances failed for this TaskRun.
pub(super) fn instances_failed(platform: &Platform, failed: &[(Arc<str>, String)]) -> String {
    format!(
        "Could not prepare a {platform} cloud instance for this build after {} attempt(s) ({}). \
         Retry the build; if it keeps failing report it to the cluster's platform team.",
        failed.len(),
        list_failures(failed)
    )
}

/// The cloud refused to launch.
pub(super) fn launch_failed(
    platform: &Platform,
    attempts: u32,
    error: &str,
    retryable: bool,
) -> String {
    let hint = if retryable {
        "The cloud may be out of capacity; retry the build later."
    } else {
        "The platform's cloud configuration looks wrong; report it to the cluster's platform team."
    };
    format!(
        "Could not launch a {platform} cloud instance after {attempts} attempt(s): {error}. {hint}"
    )
}

/// A dynamic instance did not become reachable in time.
pub(super) fn timed_out(
    platform: &Platform,
    secs: u64,
    instance: Option<&str>,
    last_error: Option<&str>,
) -> String {
    let what = match instance {
        Some(id) => format!("instance {id}"),
        None => "the instance".to_owned(),
    };
    let extra = last_error
        .map(|e| format!(" Last launch error: {e}."))
        .unwrap_or_default();
    format!(
        "Timed out after {secs} s waiting for {what} ({platform}) to accept SSH connections.{extra} \
         Retry the build; if it keeps happening the platform team may need to raise \
         allocation-timeout or check the instance image."
    )
}

/// A user could not be removed.
pub(super) fn cleanup_failed(user: &str, host: &str, error: &str) -> String {
    format!(
        "Could not remove build user {user} from {host}: {error}. The periodic host sweep will \
         retry."
    )
}

/// An instance could not be terminated.
pub(super) fn terminate_failed(id: &str, error: &str) -> String {
    format!("Could not terminate instance {id}: {error}. The controller keeps retrying.")
}
