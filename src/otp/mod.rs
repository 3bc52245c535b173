//! `mpc otp-server`: hands each build its SSH private key exactly once (docs/architecture.md, "The
//! key hand-off and retries").
//!
//! The controller stores a key (`POST /store-key`, bearer token from a mounted Secret) and puts the
//! returned one-time token into the TaskRun's secret; the build step redeems it
//! (`POST /otp` with the token as body, as Konflux's `curl --cacert /ssh/otp-ca -XPOST -d @/ssh/otp
//! "$(cat /ssh/otp-server)"` does) and gets the key; any later attempt gets a 4xx.
//!
//! For the controller's retries and TaskRun retry attempts (docs/architecture.md, "The key hand-off
//! and retries"), a store may name its owner (the TaskRun UID) and request: retries of a request
//! get the same token and entry, a later request may re-arm the owner's used token (named by the
//! token, or as the owner's latest) with a new key, and a redeem of a used token whose TaskRun has
//! a retry to come waits ([`hold`]) for that re-arm. `POST /revoke` deletes an owner's entries when
//! its TaskRun ends.
//!
//! - Storage: [`store`] (redb on a volume, group-committed; a restart loses nothing and the redeem
//!   is one atomic transaction). Only the SHA-256 of a token is stored and every key is sealed with
//!   AES-256-GCM ([`seal`]) under a key from a mounted Secret, so the database file alone yields
//!   nothing.
//! - Entries expire after a TTL (default 24 h: only a safety net behind revoke, and it must outlast
//!   any pod start and a failed attempt before its retry re-arms); a background task purges them.
//! - Ports: HTTPS (`/store-key`, `/otp`, `/revoke`, `/healthz`) with the certificate re-read when
//!   the mounted files change; plain-HTTP admin port (`/healthz`, `/readyz`, `/metrics`) kept off
//!   the port that build pods reach.
//! - Logs never contain tokens or keys; entries appear as a short hash-of-hash id.
//! - [`client`] is the controller's side, with retries that cannot create duplicates.

pub mod client;
pub mod hold;
pub mod metrics;
pub mod seal;
pub mod secret_file;
pub mod server;
pub mod store;
pub mod token;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::serve::{BodyDeadline, ServeOptions, serve_plain, serve_tls_reserving};
use crate::tls::{CertPaths, ReloadingCert, TlsError};

pub use client::{OtpClient, OtpClientError, Rearm};
pub use store::{Clock, SystemClock};

/// Errors that stop the OTP server.
#[derive(Debug, thiserror::Error)]
pub enum OtpError {
    /// The serving certificate could not be loaded.
    #[error("TLS: {0}")]
    Tls(#[from] TlsError),
    /// A sealing secret is unusable.
    #[error("sealing secret {path}: {source}")]
    Seal {
        /// The secret file.
        path: PathBuf,
        /// Why.
        source: seal::SealError,
    },
    /// A secret file could not be read.
    #[error("reading {path}: {source}")]
    ReadSecret {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The database could not be opened.
    #[error("OTP database: {0}")]
    Store(#[from] store::StoreError),
    /// A listener could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An argument is invalid.
    #[error("{0}")]
    Config(String),
}

/// `mpc otp-server` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct OtpServerArgs {
    /// HTTPS address for `/store-key`, `/otp`, `/revoke` and `/healthz`.
    #[arg(long, env = "MPC_OTP_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// Plain-HTTP admin address for `/healthz`, `/readyz` and `/metrics`.
    #[arg(long, env = "MPC_OTP_ADMIN_LISTEN", default_value = "0.0.0.0:8081")]
    pub admin_listen: SocketAddr,
    /// Directory with `tls.crt` and `tls.key` (a mounted `kubernetes.io/tls` Secret); re-read on
    /// change.
    #[arg(long, env = "MPC_OTP_TLS_DIR", default_value = "/etc/mpc/otp-tls")]
    pub tls_dir: PathBuf,
    /// The database file (on a persistent volume).
    #[arg(long, env = "MPC_OTP_DB", default_value = "/var/lib/mpc-otp/otp.redb")]
    pub db: PathBuf,
    /// File holding the secret that seals stored keys (at least 32 random bytes). Repeat to
    /// rotate: the first seals new entries, every one opens existing entries.
    #[arg(
        long = "seal-key-file",
        env = "MPC_OTP_SEAL_KEY_FILE",
        value_delimiter = ',',
        default_value = "/etc/mpc/otp-seal/key"
    )]
    pub seal_key_files: Vec<PathBuf>,
    /// File holding the bearer token `/store-key` and `/revoke` require (re-read on change).
    #[arg(
        long,
        env = "MPC_OTP_STORE_TOKEN_FILE",
        default_value = "/etc/mpc/otp-store-token/token"
    )]
    pub store_token_file: PathBuf,
    /// How long a stored key stays redeemable, and a used one re-armable.
    #[arg(long, env = "MPC_OTP_TTL", default_value = "24h", value_parser = crate::duration::parse_nonzero)]
    pub ttl: Duration,
    /// How long a redeem of a used token waits for its owner to re-arm it. Tekton starts a retry
    /// pod as soon as an attempt fails, while the controller still has to see the failure,
    /// provision a fresh key over SSH (a cold connection may take its 15 s connect timeout, and
    /// the executor retries) and re-arm: 90 s covers that with room, and a build whose re-arm is
    /// not coming still fails within a minute and a half.
    #[arg(long, env = "MPC_OTP_REARM_WAIT", default_value = "90s", value_parser = crate::duration::parse_nonzero)]
    pub rearm_wait: Duration,
    /// Most redeems waiting for a re-arm at once (each holds a connection); more are answered 503
    /// at once. Retries arrive one pod per failed attempt, so this is far above normal need. Only
    /// a token whose TaskRun has a retry to come waits; it holds at most one place (a newer
    /// redeem of it takes the older one's), and only for one `--rearm-wait` per re-arm, so a
    /// tenant redeeming its own used token cannot fill it.
    #[arg(long, env = "MPC_OTP_MAX_HELD_REDEEMS", default_value_t = 256)]
    pub max_held_redeems: usize,
    /// How often expired entries are purged.
    #[arg(long, default_value = "1m", value_parser = crate::duration::parse_nonzero)]
    pub purge_interval: Duration,
    /// Largest private key accepted, in bytes.
    #[arg(long, default_value_t = 64 * 1024)]
    pub max_key_bytes: usize,
    /// Longest time a request may take.
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_nonzero)]
    pub request_timeout: Duration,
    /// How often the certificate files are checked for changes.
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_nonzero)]
    pub cert_reload_interval: Duration,
    /// Most open HTTPS connections; at the cap a new one replaces the longest idle one. A build
    /// pod's redeem and each waiting redeem hold one; the controller keeps a few.
    #[arg(long, env = "MPC_OTP_MAX_CONNECTIONS", default_value_t = OTP_LIMITS.max_connections)]
    pub max_connections: usize,
    /// Most HTTPS requests handled at once, waiting redeems included (more are answered 503 at
    /// once). Must exceed `--max-held-redeems`.
    #[arg(long, env = "MPC_OTP_MAX_IN_FLIGHT", default_value_t = OTP_LIMITS.max_in_flight)]
    pub max_in_flight: usize,
    /// Most of `--max-in-flight` one client address may hold at once (more of its requests are
    /// answered 503 at once), so one pod cannot take every place. A build pod redeems once; set
    /// it to `--max-in-flight` if clients reach the server through a NAT that gives them one
    /// address.
    #[arg(long, env = "MPC_OTP_MAX_IN_FLIGHT_PER_PEER", default_value_t = OTP_LIMITS.max_in_flight_per_peer, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_in_flight_per_peer: usize,
    /// Places beyond `--max-in-flight` kept for the controller's calls (`/store-key` and
    /// `/revoke` with the valid bearer token, checked before anything else of the request is
    /// read): a client without the token never takes one. Past them the controller's calls share
    /// the other places.
    #[arg(long, env = "MPC_OTP_RESERVED_IN_FLIGHT", default_value_t = OTP_LIMITS.reserved_in_flight)]
    pub reserved_in_flight: usize,
    /// Time a request body has for its first bytes: the whole body must arrive within this plus
    /// its size at `--min-body-rate` (a token: about this; the largest key: a second more),
    /// separately from `--request-timeout`, so a stalled body holds its place briefly.
    #[arg(long, env = "MPC_OTP_BODY_TIMEOUT", default_value = "500ms", value_parser = crate::duration::parse_nonzero)]
    pub body_timeout: Duration,
    /// Slowest body upload accepted, in bytes a second (see `--body-timeout`).
    #[arg(long, env = "MPC_OTP_MIN_BODY_RATE", default_value_t = OTP_LIMITS.body.min_rate, value_parser = clap::value_parser!(u64).range(1..))]
    pub min_body_rate: u64,
    /// Longest time from accepting a connection to its first request.
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_nonzero)]
    pub first_request_timeout: Duration,
    /// Longest time a connection stays open with no request running.
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse_nonzero)]
    pub idle_timeout: Duration,
}

/// The HTTPS listener's limits. Unauthenticated clients can reach the port, so what one can
/// hold is small: no body is read before its request is authorised (or, for `/otp`, beyond a
/// token's size), a body has about half a second, and connections and requests are capped. Many
/// tenants' pods reach the port directly, each from its own address, so one address gets a share
/// of the places (64: a pod redeems once), and the controller's calls have places of their own
/// (64: its SSH parallelism of 32 provisions plus revokes).
pub const OTP_LIMITS: ServeOptions = ServeOptions {
    handshake_timeout: Duration::from_secs(5),
    first_request_timeout: Duration::from_secs(10),
    idle_timeout: Duration::from_secs(30),
    header_read_timeout: Duration::from_secs(10),
    max_connections: 1024,
    max_in_flight: 512,
    max_in_flight_per_peer: 64,
    reserved_in_flight: 64,
    body: BodyDeadline {
        grace: Duration::from_millis(500),
        min_rate: 64 * 1024,
    },
    drain_timeout: Duration::from_secs(20),
};

impl OtpServerArgs {
    /// Arguments with every default, for the given files (used by tests and embedding).
    pub fn with_paths(
        tls_dir: PathBuf,
        db: PathBuf,
        seal_key_file: PathBuf,
        store_token_file: PathBuf,
    ) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tls_dir,
            db,
            seal_key_files: vec![seal_key_file],
            store_token_file,
            ttl: Duration::from_secs(24 * 3600),
            rearm_wait: Duration::from_secs(90),
            max_held_redeems: 256,
            purge_interval: Duration::from_secs(60),
            max_key_bytes: 64 * 1024,
            request_timeout: Duration::from_secs(10),
            cert_reload_interval: Duration::from_secs(10),
            max_connections: OTP_LIMITS.max_connections,
            max_in_flight: OTP_LIMITS.max_in_flight,
            max_in_flight_per_peer: OTP_LIMITS.max_in_flight_per_peer,
            reserved_in_flight: OTP_LIMITS.reserved_in_flight,
            body_timeout: OTP_LIMITS.body.grace,
            min_body_rate: OTP_LIMITS.body.min_rate,
            first_request_timeout: OTP_LIMITS.first_request_timeout,
            idle_timeout: OTP_LIMITS.idle_timeout,
        }
    }
}

/// A started OTP server.
pub struct RunningServer {
    /// The HTTPS address actually bound.
    pub addr: SocketAddr,
    /// The admin address actually bound.
    pub admin_addr: SocketAddr,
    /// The metrics (also served on the admin port).
    pub metrics: metrics::OtpMetrics,
    cancel: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    state: Option<Arc<server::AppState>>,
    writer: Option<store::StoreThread>,
}

impl std::fmt::Debug for RunningServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningServer")
            .field("addr", &self.addr)
            .field("admin_addr", &self.admin_addr)
            .finish_non_exhaustive()
    }
}

impl RunningServer {
    /// Starts the server with the system clock.
    pub async fn start(args: &OtpServerArgs) -> Result<Self, OtpError> {
        Self::start_with_clock(args, Arc::new(SystemClock)).await
    }

    /// Starts the server with `clock` deciding expiry.
    pub async fn start_with_clock(
        args: &OtpServerArgs,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, OtpError> {
        if args.max_key_bytes == 0 {
            return Err(OtpError::Config("--max-key-bytes must be positive".into()));
        }
        if args.max_held_redeems == 0 {
            return Err(OtpError::Config(
                "--max-held-redeems must be positive".into(),
            ));
        }
        if args.max_connections == 0 || args.max_in_flight <= args.max_held_redeems {
            return Err(OtpError::Config(
                "--max-connections must be positive and --max-in-flight above --max-held-redeems"
                    .into(),
            ));
        }
        if args.max_in_flight_per_peer == 0 || args.min_body_rate == 0 {
            return Err(OtpError::Config(
                "--max-in-flight-per-peer and --min-body-rate must be positive".into(),
            ));
        }
        let mut secrets = Vec::new();
        for path in &args.seal_key_files {
            let bytes = std::fs::read(path).map_err(|source| OtpError::ReadSecret {
                path: path.clone(),
                source,
            })?;
            secrets.push(zeroize::Zeroizing::new(bytes));
        }
        let sealer = Arc::new(
            seal::Sealer::new(&secrets).map_err(|source| OtpError::Seal {
                path: args.seal_key_files.first().cloned().unwrap_or_default(),
                source,
            })?,
        );
        drop(secrets);
        if let Some(parent) = args.db.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| OtpError::Config(format!("creating {}: {e}", parent.display())))?;
        }
        let (store, writer) = store::Store::open(&args.db, Arc::clone(&sealer), clock)?;
        let metrics = metrics::OtpMetrics::new();
        // Purging first also sets the pending gauge from what survived a restart.
        let purged = store.purge().await?;
        metrics.expired.inc_by(purged.expired);
        metrics.pending.set(purged.pending as i64);
        metrics.entries.set(purged.entries as i64);

        let cert = ReloadingCert::load(CertPaths::in_dir(&args.tls_dir))?;
        let tls = cert.server_config(&[b"h2", b"http/1.1"]);
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|source| OtpError::Bind {
                addr: args.listen,
                source,
            })?;
        let admin = tokio::net::TcpListener::bind(args.admin_listen)
            .await
            .map_err(|source| OtpError::Bind {
                addr: args.admin_listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| OtpError::Bind {
            addr: args.listen,
            source,
        })?;
        let admin_addr = admin.local_addr().map_err(|source| OtpError::Bind {
            addr: args.admin_listen,
            source,
        })?;

        let cancel = CancellationToken::new();
        let state = Arc::new(server::AppState {
            store: store.clone(),
            sealer,
            store_token: secret_file::SecretFile::new(
                args.store_token_file.clone(),
                Duration::from_secs(1),
            ),
            ttl: args.ttl,
            max_key_bytes: args.max_key_bytes,
            request_timeout: args.request_timeout,
            body_deadline: BodyDeadline {
                grace: args.body_timeout,
                min_rate: args.min_body_rate,
            },
            rearm_wait: args.rearm_wait,
            holds: hold::Holds::new(args.max_held_redeems, args.rearm_wait, metrics.held.clone()),
            shutdown: cancel.clone(),
            metrics: metrics.clone(),
        });
        let opts = ServeOptions {
            max_connections: args.max_connections,
            max_in_flight: args.max_in_flight,
            max_in_flight_per_peer: args.max_in_flight_per_peer,
            reserved_in_flight: args.reserved_in_flight,
            body: BodyDeadline {
                grace: args.body_timeout,
                min_rate: args.min_body_rate,
            },
            first_request_timeout: args.first_request_timeout,
            idle_timeout: args.idle_timeout,
            ..OTP_LIMITS
        };
        let admin_opts = ServeOptions {
            first_request_timeout: args.first_request_timeout,
            idle_timeout: args.idle_timeout,
            ..ServeOptions::admin(OTP_LIMITS.drain_timeout)
        };
        let mut tasks = vec![
            cert.spawn_reloader(args.cert_reload_interval, cancel.clone()),
            tokio::spawn(serve_tls_reserving(
                listener,
                tls,
                server::router(Arc::clone(&state)),
                cancel.clone(),
                opts,
                Some(Arc::new(server::ControllerCalls(Arc::clone(&state)))),
            )),
            tokio::spawn(serve_plain(
                admin,
                server::admin_router(metrics.clone()),
                cancel.clone(),
                admin_opts,
            )),
        ];
        tasks.push(tokio::spawn(purge_loop(
            store,
            metrics.clone(),
            args.purge_interval,
            cancel.clone(),
        )));
        tracing::info!(
            %addr,
            %admin_addr,
            db = %args.db.display(),
            ttl_s = args.ttl.as_secs_f64(),
            rearm_wait_s = args.rearm_wait.as_secs_f64(),
            pending = purged.pending,
            "OTP server listening"
        );
        Ok(Self {
            addr,
            admin_addr,
            metrics,
            cancel,
            tasks,
            state: Some(state),
            writer: Some(writer),
        })
    }

    /// Stops accepting, drains in-flight requests, and waits for the store to finish.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        self.state.take();
        if let Some(w) = self.writer.take() {
            // The writer ends once the last handle is gone; a connection dropped after the drain
            // deadline may still hold one, so do not wait forever (every commit is durable anyway).
            let join = tokio::task::spawn_blocking(move || w.join());
            if tokio::time::timeout(Duration::from_secs(5), join)
                .await
                .is_err()
            {
                tracing::warn!("OTP store writer still busy at shutdown");
            }
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn purge_loop(
    store: store::Store,
    metrics: metrics::OtpMetrics,
    every: Duration,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        match store.purge().await {
            Ok(p) => {
                metrics.expired.inc_by(p.expired);
                metrics.pending.set(p.pending as i64);
                metrics.entries.set(p.entries as i64);
                if p.expired > 0 || p.tombstones > 0 || p.owners > 0 {
                    tracing::info!(
                        expired = p.expired,
                        tombstones = p.tombstones,
                        revoked_owners = p.owners,
                        pending = p.pending,
                        "purged OTP entries"
                    );
                }
            }
            Err(error) => tracing::warn!(%error, "purging OTP entries failed"),
        }
    }
}

/// Runs `mpc otp-server` until SIGTERM or Ctrl-C.
pub async fn run_server(args: OtpServerArgs) -> Result<(), OtpError> {
    let server = RunningServer::start(&args).await?;
    shutdown_signal().await;
    tracing::info!("shutting down");
    server.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
