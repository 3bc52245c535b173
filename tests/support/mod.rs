//! External tools the integration tests run. Each is installed by `e2e/setup.sh`; a test that
//! needs one fails when it is missing. Each test crate uses the ones it needs.

use std::path::PathBuf;

fn tool(env: &str, name: &str) -> PathBuf {
    std::env::var_os(env).map_or_else(|| PathBuf::from(name), PathBuf::from)
}

/// `promtool` (`MPC_PROMTOOL` overrides the path).
#[allow(dead_code)]
pub fn promtool() -> PathBuf {
    tool("MPC_PROMTOOL", "promtool")
}

/// `kubectl` (`MPC_KUBECTL` overrides the path).
#[allow(dead_code)]
pub fn kubectl() -> PathBuf {
    tool("MPC_KUBECTL", "kubectl")
}
