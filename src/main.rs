//! `mpc`: the multi-platform controller binary. Thin: parses arguments and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use mpc::{certs, config, controller, otp, simulate, tls};

#[derive(Parser)]
#[command(
    name = "mpc",
    version,
    about = "Multi-platform build-host broker for Tekton"
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "MPC_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller: admission webhook (TLS), admin port (/healthz, /readyz, /metrics) and,
    /// on the replica holding the Lease, the scheduler that allocates build hosts.
    Controller(Box<controller::ControllerArgs>),
    /// Run the one-time-password key server.
    OtpServer(Box<otp::OtpServerArgs>),
    /// Check host-config ConfigMap files and print each platform's strategy and capacity.
    CheckConfig {
        /// ConfigMap YAML files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Write a CA and a serving certificate for the webhook or OTP Service.
    Certs(certs::CertsArgs),
    /// Run the scheduler core on a workload trace with a virtual clock (no cluster needed).
    Simulate(simulate::SimulateArgs),
}

// mimalloc: the scheduler frees many small, short-lived strings, and glibc's malloc spent ~10 % of
// a queue drain consolidating and unlinking free chunks (BENCHMARKS.md; the webhook is unaffected).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // First thing: every TLS user in the process (kube, AWS SDK, our servers) gets aws-lc-rs.
    tls::install_crypto_provider();
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match run(cli.command) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("mpc: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("MPC_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Controller(args) => runtime()?.block_on(controller::run(*args))?,
        Command::OtpServer(args) => runtime()?.block_on(otp::run_server(*args))?,
        Command::CheckConfig { files } => return check_config(&files),
        Command::Certs(args) => certs::run(&args)?,
        Command::Simulate(args) => simulate::run(&args)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn check_config(files: &[PathBuf]) -> anyhow::Result<ExitCode> {
    let mut failed = false;
    for path in files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let shown = path.display().to_string();
        match config::read_configmap_yaml(&text) {
            Ok((data, mut diagnostics)) => {
                let mut parsed = config::parse(&data);
                diagnostics.append(&mut parsed.diagnostics);
                parsed.diagnostics = diagnostics;
                print!("{}", config::render_report(&shown, &parsed));
                failed |= parsed.has_errors();
            }
            Err(error) => {
                println!("{shown}: error: {error}");
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
