//! `mpc`: the multi-platform controller binary. Thin: parses arguments and calls the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use mpc::{certs, config, controller, kueue, otp, simulate, tls};

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
    /// Check host-config ConfigMap files and print each platform's strategy and capacity; with
    /// --cluster-queue, also check the Kueue ClusterQueue's quotas against the host-config.
    CheckConfig {
        /// ConfigMap YAML files (or YAML mappings of their data).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// The cluster's Kueue ClusterQueue file: report every quota that disagrees with the
        /// host-config (one file), platform resources it does not serve and platforms listed
        /// without keys; exit 1 on any.
        #[arg(long, value_name = "FILE")]
        cluster_queue: Option<PathBuf>,
        /// The admission policy's allowed request annotations (its ConfigMap, or the list): report
        /// those that disagree with the ClusterQueue's resources.
        #[arg(long, value_name = "FILE", requires = "cluster_queue")]
        allowed_annotations: Option<PathBuf>,
    },
    /// Render the Kueue ClusterQueue quotas (platform resource groups) of a host-config, or the
    /// whole ClusterQueue file, or its allowed request annotations.
    KueueQuotas(kueue::KueueQuotasArgs),
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
        Command::CheckConfig {
            files,
            cluster_queue,
            allowed_annotations,
        } => {
            return check_config(
                &files,
                cluster_queue.as_deref(),
                allowed_annotations.as_deref(),
            );
        }
        Command::KueueQuotas(args) => {
            let out = kueue::run(&args)?;
            for note in &out.notes {
                eprintln!("mpc kueue-quotas: {note}");
            }
            print!("{}", out.stdout);
        }
        Command::Certs(args) => certs::run(&args)?,
        Command::Simulate(args) => simulate::run(&args)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn check_config(
    files: &[PathBuf],
    cluster_queue: Option<&Path>,
    allowed_annotations: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    if cluster_queue.is_some() && files.len() != 1 {
        anyhow::bail!("--cluster-queue checks one host-config: give exactly one file");
    }
    let mut failed = false;
    for path in files {
        let text = read(path)?;
        let shown = path.display().to_string();
        match kueue::read_host_config_data(&text) {
            Ok((data, mut diagnostics)) => {
                let mut parsed = config::parse(&data);
                diagnostics.append(&mut parsed.diagnostics);
                parsed.diagnostics = diagnostics;
                print!("{}", config::render_report(&shown, &parsed));
                failed |= parsed.has_errors();
                if let Some(queue_path) = cluster_queue {
                    let annotations = allowed_annotations.map(read).transpose()?;
                    let findings = kueue::check(
                        &data,
                        &parsed.config,
                        &read(queue_path)?,
                        annotations.as_deref(),
                    )
                    .with_context(|| format!("checking {}", queue_path.display()))?;
                    let mut title = format!("{}", queue_path.display());
                    if let Some(a) = allowed_annotations {
                        title.push_str(&format!(" and {}", a.display()));
                    }
                    title.push_str(&format!(" against {shown}"));
                    print!("{}", kueue::render_findings(&title, &findings));
                    failed |= !findings.is_empty();
                }
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
