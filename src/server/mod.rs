//! The webhook process of `mpc controller`: the TLS admission webhook and the plain-HTTP admin
//! port. Every replica serves both; the scheduling loop (`crate::controller`) runs beside it.
//!
//! Startup binds both ports, loads the host-config and the serving certificate, and keeps polling
//! both for changes. `/readyz` turns ready once both are loaded; if the certificate is not there
//! yet (a cert-manager Secret still being issued), the webhook port starts serving as soon as it
//! appears. On SIGTERM or SIGINT the pod turns unready, keeps serving for `--shutdown-delay` so
//! endpoints stop sending it traffic, then stops accepting and drains in-flight requests.

pub mod admin;
pub mod webhook;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config_source::{self, ConfigMetrics, ConfigSource};
use crate::serve::{self, BodyDeadline, ServeOptions};
use crate::tls::{CertPaths, ReloadingCert};
use admin::{AdminState, Readiness};
use webhook::{Limits, WebhookMetrics, WebhookState};

/// Errors that stop the webhook server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A port could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Metric registration failed (a name registered twice).
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

/// The webhook listener's limits: the API server opens a few HTTP/2 connections and sends at most
/// a few hundred reviews a second, each answered in microseconds.
///
/// The API server is the only legitimate client, and it calls from one address (one per
/// replica, or a proxy's), so a per-peer share cannot tell tenants apart here: it is half the
/// places, which is far more than the API server ever has in flight and keeps one other address
/// (a pod reaching the port, which the NetworkPolicy cannot close to pods without closing it to
/// an API server outside the pod network) from taking the rest. Against many addresses the
/// defence is the body deadline: a review arrives from the API server in milliseconds, so a
/// stalled body holds its place about a second (1 s plus its size at 1 MiB/s), not the request
/// timeout, and an attacker must keep sending requests to keep places.
pub const WEBHOOK_LIMITS: ServeOptions = ServeOptions {
    handshake_timeout: Duration::from_secs(5),
    first_request_timeout: Duration::from_secs(10),
    idle_timeout: Duration::from_secs(30),
    header_read_timeout: Duration::from_secs(10),
    max_connections: 1024,
    max_in_flight: 128,
    max_in_flight_per_peer: 64,
    reserved_in_flight: 0,
    body: BodyDeadline {
        grace: Duration::from_secs(1),
        min_rate: 1024 * 1024,
    },
    drain_timeout: Duration::from_secs(20),
};

/// Webhook and admin-port arguments of `mpc controller`.
#[derive(Debug, Clone, clap::Args)]
pub struct WebhookArgs {
    /// host-config from a file instead of the API: a ConfigMap YAML file, or the directory the
    /// ConfigMap is mounted at (re-read on change). Unset: the ConfigMap is watched.
    #[arg(long, env = "MPC_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory holding the webhook serving certificate as `tls.crt` and `tls.key` (re-read on change).
    #[arg(
        long,
        env = "MPC_WEBHOOK_CERT_DIR",
        default_value = "/etc/mpc/webhook-certs"
    )]
    pub cert_dir: PathBuf,
    /// Webhook (HTTPS) listen address.
    #[arg(long, env = "MPC_WEBHOOK_ADDR", default_value = "0.0.0.0:9443")]
    pub webhook_addr: SocketAddr,
    /// Admin (plain HTTP: /healthz, /readyz, /metrics) listen address.
    #[arg(long, env = "MPC_ADMIN_ADDR", default_value = "0.0.0.0:8080")]
    pub admin_addr: SocketAddr,
    /// How often the certificate and config files are re-read (e.g. `5s`, `500ms`).
    #[arg(long, default_value = "5s", value_parser = crate::duration::parse)]
    pub reload_interval: Duration,
    /// Largest accepted webhook request body, in bytes. The webhook is called for CREATE only,
    /// whose AdmissionReview carries the TaskRun once (no oldObject); a TaskRun that can be stored
    /// is at most etcd's 1.5 MiB request limit as JSON, and the review around it (user info,
    /// options) adds a few KiB: 1.5 MiB + 64 KiB. A larger review is for an object etcd refuses
    /// anyway. Raise it with etcd's `--max-request-bytes`.
    #[arg(long, default_value_t = Limits::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// Longest time to receive and answer one webhook request.
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse)]
    pub request_timeout: Duration,
    /// Most open webhook connections; at the cap a new one replaces the longest idle one.
    #[arg(long, default_value_t = WEBHOOK_LIMITS.max_connections)]
    pub webhook_max_connections: usize,
    /// Most webhook requests handled at once (more are answered 503 at once). Each may hold a
    /// body of up to `--max-body-bytes`, so this times that bounds their memory: 128 x 1.6 MiB is
    /// 205 MiB, well inside the pod's 512 Mi.
    #[arg(long, default_value_t = WEBHOOK_LIMITS.max_in_flight)]
    pub webhook_max_in_flight: usize,
    /// Most of `--webhook-max-in-flight` one client address may hold at once (more are answered
    /// 503 at once). The API server needs a few at a time; the share keeps one other address (a
    /// pod reaching the port) from taking the rest. Raise it to `--webhook-max-in-flight` if
    /// several API servers reach the webhook through one proxy address under heavy load.
    #[arg(long, env = "MPC_WEBHOOK_MAX_IN_FLIGHT_PER_PEER", default_value_t = WEBHOOK_LIMITS.max_in_flight_per_peer, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub webhook_max_in_flight_per_peer: usize,
    /// Time a review body has for its first bytes: the whole body must arrive within this plus
    /// its size at `--webhook-min-body-rate` (the largest review: 2.6 s), inside
    /// `--request-timeout`, so a stalled body holds its place briefly.
    #[arg(long, env = "MPC_WEBHOOK_BODY_TIMEOUT", default_value = "1s", value_parser = crate::duration::parse_nonzero)]
    pub webhook_body_timeout: Duration,
    /// Slowest review upload accepted, in bytes a second (see `--webhook-body-timeout`).
    #[arg(long, env = "MPC_WEBHOOK_MIN_BODY_RATE", default_value_t = WEBHOOK_LIMITS.body.min_rate, value_parser = clap::value_parser!(u64).range(1..))]
    pub webhook_min_body_rate: u64,
    /// Longest time from accepting a webhook or admin connection to its first request.
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_nonzero)]
    pub first_request_timeout: Duration,
    /// Longest time a webhook or admin connection stays open with no request running.
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse_nonzero)]
    pub idle_timeout: Duration,
    /// After SIGTERM, how long to keep serving while unready, so endpoints drop the pod first.
    #[arg(long, default_value = "5s", value_parser = crate::duration::parse)]
    pub shutdown_delay: Duration,
    /// Then, how long in-flight requests may take to finish.
    #[arg(long, default_value = "20s", value_parser = crate::duration::parse)]
    pub drain_timeout: Duration,
}

impl WebhookArgs {
    /// Defaults for everything but the config path (tests and benchmarks).
    pub fn with_config(config: PathBuf, cert_dir: PathBuf) -> Self {
        let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
        Self {
            config: Some(config),
            cert_dir,
            webhook_addr: loopback,
            admin_addr: loopback,
            reload_interval: Duration::from_secs(5),
            max_body_bytes: Limits::default().max_body_bytes,
            request_timeout: Limits::default().request_timeout,
            webhook_max_connections: WEBHOOK_LIMITS.max_connections,
            webhook_max_in_flight: WEBHOOK_LIMITS.max_in_flight,
            webhook_max_in_flight_per_peer: WEBHOOK_LIMITS.max_in_flight_per_peer,
            webhook_body_timeout: WEBHOOK_LIMITS.body.grace,
            webhook_min_body_rate: WEBHOOK_LIMITS.body.min_rate,
            first_request_timeout: WEBHOOK_LIMITS.first_request_timeout,
            idle_timeout: WEBHOOK_LIMITS.idle_timeout,
            shutdown_delay: Duration::ZERO,
            drain_timeout: Duration::from_secs(20),
        }
    }
}

/// A running webhook server (webhook and admin ports), started by [`WebhookServer::start`].
#[derive(Debug)]
pub struct WebhookServer {
    webhook_addr: SocketAddr,
    admin_addr: SocketAddr,
    readiness: Readiness,
    config: ConfigSource,
    shutdown_delay: Duration,
    stop: CancellationToken,
    tasks: JoinSet<()>,
}

impl WebhookServer {
    /// Binds both ports, loads config (from `args.config`) and certificate, and starts serving.
    /// Registers its metrics in `registry`, which `/metrics` renders.
    pub async fn start(args: &WebhookArgs, registry: Registry) -> Result<Self, ServerError> {
        let config = ConfigSource::new(Some(ConfigMetrics::register(&registry)?));
        Self::start_with(args, registry, config).await
    }

    /// [`WebhookServer::start`] serving `config`, which the caller feeds unless `args.config`
    /// names a file (then it is loaded and watched here).
    pub async fn start_with(
        args: &WebhookArgs,
        registry: Registry,
        config: ConfigSource,
    ) -> Result<Self, ServerError> {
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { addr, source })
        };
        let webhook_listener = bind(args.webhook_addr).await?;
        let admin_listener = bind(args.admin_addr).await?;
        let webhook_addr = local_addr(&webhook_listener, args.webhook_addr)?;
        let admin_addr = local_addr(&admin_listener, args.admin_addr)?;

        let webhook_metrics = WebhookMetrics::register(&registry)?;
        let readiness = Readiness::new(config.clone());
        let stop = CancellationToken::new();
        let admin_opts = ServeOptions {
            first_request_timeout: args.first_request_timeout,
            idle_timeout: args.idle_timeout,
            ..ServeOptions::admin(args.drain_timeout)
        };
        let body = BodyDeadline {
            grace: args.webhook_body_timeout,
            min_rate: args.webhook_min_body_rate.max(1),
        };
        let opts = ServeOptions {
            max_connections: args.webhook_max_connections,
            max_in_flight: args.webhook_max_in_flight,
            max_in_flight_per_peer: args.webhook_max_in_flight_per_peer,
            body,
            first_request_timeout: args.first_request_timeout,
            idle_timeout: args.idle_timeout,
            drain_timeout: args.drain_timeout,
            ..WEBHOOK_LIMITS
        };
        let mut tasks = JoinSet::new();

        if let Some(path) = args.config.clone() {
            let source = config.clone();
            let p = path.clone();
            let _ =
                tokio::task::spawn_blocking(move || config_source::load_path(&source, &p)).await;
            let watcher =
                config_source::watch_path(config.clone(), path, args.reload_interval, stop.clone());
            tasks.spawn(async move {
                let _ = watcher.await;
            });
        }

        let admin_app = admin::router(AdminState {
            readiness: readiness.clone(),
            registry,
        });
        tasks.spawn(serve::serve_plain(
            admin_listener,
            admin_app,
            stop.clone(),
            admin_opts,
        ));

        let webhook_app = webhook::router(
            WebhookState {
                config: config.clone(),
                metrics: Some(webhook_metrics),
                clock: webhook::unix_now,
            },
            Limits {
                max_body_bytes: args.max_body_bytes,
                request_timeout: args.request_timeout,
                body,
            },
        );
        let cert_paths = CertPaths::in_dir(&args.cert_dir);
        let interval = args.reload_interval;
        let (ready, stop2) = (readiness.clone(), stop.clone());
        tasks.spawn(async move {
            let Some(cert) = wait_for_cert(cert_paths, interval, &stop2).await else {
                return;
            };
            ready.set_cert_loaded();
            let reloader = cert.spawn_reloader(interval, stop2.clone());
            let tls = cert.server_config(&[b"h2", b"http/1.1"]);
            serve::serve_tls(webhook_listener, tls, webhook_app, stop2, opts).await;
            let _ = reloader.await;
        });

        tracing::info!(%webhook_addr, %admin_addr, config = ?args.config, "webhook server started");
        Ok(Self {
            webhook_addr,
            admin_addr,
            readiness,
            config,
            shutdown_delay: args.shutdown_delay,
            stop,
            tasks,
        })
    }

    /// The bound webhook (HTTPS) address.
    pub fn webhook_addr(&self) -> SocketAddr {
        self.webhook_addr
    }

    /// The bound admin (HTTP) address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The live config.
    pub fn config(&self) -> &ConfigSource {
        &self.config
    }

    /// Readiness as `/readyz` reports it.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Graceful shutdown: unready, wait the shutdown delay, stop accepting, drain, return.
    pub async fn shutdown(mut self) {
        self.readiness.set_stopping();
        if !self.shutdown_delay.is_zero() {
            tracing::info!(delay = ?self.shutdown_delay, "shutting down: unready, still serving");
            tokio::time::sleep(self.shutdown_delay).await;
        }
        tracing::info!("shutting down: no new connections; draining");
        self.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
        tracing::info!("webhook server stopped");
    }
}

fn local_addr(l: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, ServerError> {
    l.local_addr()
        .map_err(|source| ServerError::Bind { addr, source })
}

/// Loads the serving certificate, retrying every `interval` until it loads or `stop` fires.
async fn wait_for_cert(
    paths: CertPaths,
    interval: Duration,
    stop: &CancellationToken,
) -> Option<Arc<ReloadingCert>> {
    let mut last_error = String::new();
    loop {
        match ReloadingCert::load(paths.clone()) {
            Ok(cert) => {
                tracing::info!(cert = %paths.cert.display(), "serving certificate loaded");
                return Some(cert);
            }
            Err(error) => {
                let e = error.to_string();
                if e != last_error {
                    tracing::warn!(%error, "serving certificate not loadable yet; retrying");
                    last_error = e;
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return None,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn shutdown_signal() -> Result<(), ServerError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(ServerError::Signals)?;
    let mut int = signal(SignalKind::interrupt()).map_err(ServerError::Signals)?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
    Ok(())
}
