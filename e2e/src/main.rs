//! `e2e`: runs the test API server (and optionally the Tekton stand-in) until interrupted, and
//! prints a kubeconfig for it, so `kubectl` or the controller can be pointed at it by hand.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "e2e",
    about = "Kubernetes test API server for end-to-end tests"
)]
enum Cli {
    /// Start the test API server and print its kubeconfig on stdout.
    Apiserver {
        /// Also write the kubeconfig to this file.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// Register the built-in Tekton CRDs (tekton.dev TaskRun and Task).
        #[arg(long)]
        tekton_crds: bool,
        /// Run the Tekton stand-in controller (implies --tekton-crds).
        #[arg(long)]
        tekton: bool,
        /// Create the objects of these YAML files at start (CRDs, namespaces, ...).
        #[arg(long = "apply")]
        apply: Vec<PathBuf>,
        /// Watch event history kept (older resourceVersions answer 410 Gone).
        #[arg(long, default_value_t = 10_000)]
        history: usize,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse() {
        Cli::Apiserver {
            kubeconfig,
            tekton_crds,
            tekton,
            apply,
            history,
        } => {
            let opts = e2e::apiserver::Options {
                history_capacity: history,
                ..Default::default()
            };
            let server = e2e::apiserver::ApiServer::start(opts)
                .await
                .context("starting the test API server")?;
            if tekton_crds || tekton {
                server
                    .create_yaml(e2e::apiserver::TEKTON_CRDS)
                    .await
                    .context("registering the Tekton CRDs")?;
            }
            for f in &apply {
                let text = std::fs::read_to_string(f)
                    .with_context(|| format!("reading {}", f.display()))?;
                server
                    .create_yaml(&text)
                    .await
                    .with_context(|| format!("creating the objects of {}", f.display()))?;
            }
            if let Some(path) = &kubeconfig {
                std::fs::write(path, server.kubeconfig_yaml())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            print!("{}", server.kubeconfig_yaml());
            tracing::info!(url = %server.url(), plain = %server.plain_url(), "test API server running; Ctrl-C stops it");
            let tekton = if tekton {
                Some(e2e::tekton::Tekton::start(server.client().await?))
            } else {
                None
            };
            tokio::signal::ctrl_c().await?;
            if let Some(t) = tekton {
                t.shutdown().await;
            }
            server.shutdown().await;
        }
    }
    Ok(())
}
