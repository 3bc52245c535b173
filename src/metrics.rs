//! Prometheus plumbing shared by every component: the name prefix and text exposition.
//!
//! Each component defines and registers its own metrics (webhook, scheduler, cloud, OTP) into the
//! process registry; names keep the Go controller's exactly (docs/metrics.md), counters without `_total`.

use prometheus::{Encoder, Registry, TextEncoder};

/// Prefix of every metric name.
pub const PREFIX: &str = "multi_platform_controller_";

/// `PREFIX` + `name`.
pub fn name(name: &str) -> String {
    format!("{PREFIX}{name}")
}

/// Renders a registry in the Prometheus text format (content type [`CONTENT_TYPE`]).
pub fn encode(registry: &Registry) -> String {
    let mut buf = Vec::new();
    // Encoding into a Vec cannot fail for well-formed metric families.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

/// Content type of [`encode`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
