//! `mpc-simulate`: `mpc simulate` without the controller's I/O stack, so a fresh checkout builds
//! it in a fraction of the time. Same arguments, same output.

use std::process::ExitCode;

use clap::Parser;
use mpc_core::simulate::{self, SimulateArgs};

/// Run the scheduler core on a workload trace with a virtual clock (no cluster needed).
#[derive(Parser)]
#[command(name = "mpc-simulate", version)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match simulate::run(&cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // As `mpc` reports it: the error and its causes.
            eprintln!("mpc-simulate: {:#}", anyhow::Error::from(error));
            ExitCode::FAILURE
        }
    }
}
