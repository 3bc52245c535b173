//! `mpc simulate`: the real scheduler core on a workload trace with a virtual clock.

/// Errors from a simulation run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// Not built yet.
    #[error("the simulator is not built yet")]
    NotBuilt,
}

/// `mpc simulate` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {}

/// Runs `mpc simulate`.
pub fn run(_args: &SimulateArgs) -> Result<(), SimulateError> {
    Err(SimulateError::NotBuilt)
}
