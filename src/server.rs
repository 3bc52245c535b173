//! `mpc controller`: the TLS admission webhook and the plain-HTTP admin port.

use std::path::PathBuf;

/// Errors that stop the controller.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Not built yet.
    #[error("the controller is not built yet")]
    NotBuilt,
}

/// `mpc controller` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ControllerArgs {
    /// host-config ConfigMap YAML file (reloaded on change).
    #[arg(long)]
    pub config: PathBuf,
}

/// Runs `mpc controller` until SIGTERM.
pub async fn run_controller(_args: ControllerArgs) -> Result<(), ServerError> {
    Err(ServerError::NotBuilt)
}
