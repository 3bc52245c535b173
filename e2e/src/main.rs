//! `e2e`: runs the test API server (and optionally the Tekton stand-in) until interrupted, and
//! prints a kubeconfig for it, so `kubectl` or the controller can be pointed at it by hand; or
//! (`e2e try`) the whole product on this machine.

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
    /// Start the whole product on this machine (test API server with the Tekton stand-in, the
    /// OTP server, a controller, loopback sshd build hosts) and print a kubeconfig and what to
    /// try; runs until Ctrl-C. Needs root (the build hosts' sshd listens on port 22 and adds
    /// build users).
    Try {
        /// The `mpc` binary to run (default: `mpc-e2e` or `mpc` next to this program; build it
        /// with `cargo build -p e2e`).
        #[arg(long)]
        mpc: Option<PathBuf>,
        /// Static linux/arm64 build hosts to start, each serving one TaskRun at a time.
        #[arg(long, default_value_t = 1)]
        hosts: usize,
        /// Also copy the kubeconfig to this file.
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
    },
    /// Start the IBM Cloud emulator (IAM, VPC, Power VS) and print its VPC, Power VS and IAM URLs
    /// and the API key it accepts, one per line; runs until Ctrl-C.
    IbmEmulator {
        /// Loopback address to listen on.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
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
        Cli::IbmEmulator { listen } => {
            let emu = e2e::ibm_emulator::IbmEmulator::start(listen, Default::default())
                .await
                .context("starting the IBM emulator")?;
            println!("{}", emu.vpc_url());
            println!("{}", emu.power_url());
            println!("{}", emu.iam_url());
            println!("{}", e2e::ibm_emulator::API_KEY);
            tokio::signal::ctrl_c().await?;
        }
        Cli::Try {
            mpc,
            hosts,
            kubeconfig,
        } => try_it(mpc, hosts, kubeconfig).await?,
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

/// `e2e try`: the product through the harness the end-to-end tests use.
async fn try_it(
    mpc: Option<PathBuf>,
    hosts: usize,
    kubeconfig: Option<PathBuf>,
) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::MetadataExt as _;
    // /proc/self belongs to the effective user.
    anyhow::ensure!(
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0),
        "e2e try needs root: the build hosts' sshd listens on port 22 and adds a user per build"
    );
    let mpc = match mpc {
        Some(p) => p,
        None => beside_me(&["mpc-e2e", "mpc"])?,
    };
    let names: Vec<String> = (1..=hosts).map(|i| format!("host-{i}")).collect();
    let specs: Vec<(&str, u32)> = names.iter().map(|n| (n.as_str(), 1)).collect();
    let mut product = e2e::product::Product::start(&mpc, &specs)
        .await
        .context("starting the product")?;
    product
        .start_controller("try")
        .await
        .context("starting the controller")?;
    let path = product.api.kubeconfig_path();
    if let Some(copy) = &kubeconfig {
        std::fs::copy(&path, copy).with_context(|| format!("writing {}", copy.display()))?;
    }
    let shown = kubeconfig.as_deref().unwrap_or(&path);
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/taskrun.yaml")
        .canonicalize()
        .context("examples/taskrun.yaml")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "kubeconfig: {}", shown.display())?;
    writeln!(out, "example TaskRun: {}", example.display())?;
    writeln!(out, "logs: {}", product.dir.path().display())?;
    writeln!(
        out,
        "platforms: linux/arm64 on {} loopback sshd host(s), one build each; linux/amd64 and local build in the pod",
        names.len()
    )?;
    writeln!(
        out,
        "\nTry (the Tekton stand-in starts TaskRuns but does not run their steps):\n  \
         export KUBECONFIG={k}\n  \
         kubectl create namespace demo\n  \
         kubectl apply -n demo -f {e}\n  \
         kubectl get taskruns -n demo -w -L build.appstudio.redhat.com/assigned-host\n  \
         kubectl get secret -n demo multi-platform-ssh-try-build -o yaml\n  \
         kubectl describe taskrun -n demo try-build\n  \
         kubectl events -n demo\n  \
         kubectl delete taskrun -n demo try-build\n\
         Ctrl-C stops everything and removes what it created.",
        k = shown.display(),
        e = example.display()
    )?;
    writeln!(out, "ready")?;
    out.flush()?;
    drop(out);
    wait_for_stop().await?;
    tracing::info!("stopping: deleting TaskRuns so the controller removes their build users");
    remove_taskruns(&product.client, std::time::Duration::from_secs(30)).await;
    for c in &mut product.controllers {
        c.terminate(std::time::Duration::from_secs(10));
    }
    product.otp.terminate(std::time::Duration::from_secs(5));
    let e2e::product::Product { api, tekton, .. } = product;
    tekton.shutdown().await;
    api.shutdown().await;
    Ok(())
}

/// The first of `names` in this program's directory (cargo builds the package's binaries there).
fn beside_me(names: &[&str]) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating this program")?;
    let dir = exe.parent().context("this program's directory")?;
    names
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "no {} in {}: build it with `cargo build -p e2e`, or pass --mpc",
                names.join(" or "),
                dir.display()
            )
        })
}

/// Ctrl-C (SIGINT) or SIGTERM.
async fn wait_for_stop() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}

/// Deletes every TaskRun and waits (up to `limit`) until they are gone: the controller's finalizer
/// holds each until its build user is removed from the host.
async fn remove_taskruns(client: &kube::Client, limit: std::time::Duration) {
    use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &e2e::tekton::taskrun_resource());
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let left = match api.list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(error) => {
                tracing::warn!(%error, "listing TaskRuns");
                return;
            }
        };
        if left.is_empty() {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                left = left.len(),
                "TaskRuns still held by their finalizer; their build users may remain"
            );
            return;
        }
        for tr in &left {
            if tr.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let (Some(ns), Some(name)) = (&tr.metadata.namespace, &tr.metadata.name) else {
                continue;
            };
            let api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), ns, &e2e::tekton::taskrun_resource());
            if let Err(error) = api.delete(name, &DeleteParams::default()).await {
                tracing::warn!(%error, taskrun = %name, "deleting");
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
