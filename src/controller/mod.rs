//! `mpc controller`: brokers build hosts in a cluster (docs/architecture.md, "The controller
//! shell").
//!
//! Every replica serves the admission webhook and runs the [`sources`] that watch TaskRuns and
//! the `host-config` ConfigMap and elect a leader; the replica holding the Lease also runs the
//! scheduling loop ([`driver`]), which owns the pure [`Scheduler`](crate::scheduler::Scheduler)
//! and hands its actions to the executors ([`execute`]). Data flows one way, sources → loop →
//! executors, and no module imports one above it (`tests/module_graph.rs` checks it). Pure parts:
//! [`meaning`] (what a TaskRun means: scheduler events and recovery records), the TaskRun index
//! ([`sources::taskruns::TaskRunIndex`]), leadership terms ([`sources::lease::Terms`]), [`patch`]
//! (the writes), [`lanes`] (when a job may start: per-key order, per-class caps).

pub mod driver;
pub mod events;
pub mod execute;
pub mod lanes;
pub mod meaning;
pub mod metrics;
pub mod patch;
pub mod sources;
pub mod store_token;
pub mod taskrun;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::events::{Recorder, Reporter};
use prometheus::Registry;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config_source::{ConfigMetrics, ConfigSource};
use crate::otp::{OtpClientError, Rearm};
use crate::provision::{Provisioner, SshOptions};
use crate::scheduler::Policy;
use crate::server::{self, WebhookArgs, WebhookServer};
use driver::Driver;
use execute::{Context, KeyStore, LimitSettings, Limits};
use metrics::ControllerMetrics;
use sources::Input;

/// Errors that stop the controller before it runs.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// No usable kubeconfig or in-cluster configuration.
    #[error("Kubernetes client: {0}")]
    Kube(#[from] ClientError),
    /// A file named by a flag could not be read.
    #[error("reading {path}: {error}")]
    File {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The OTP server flags are missing.
    #[error(
        "OTP server settings: --otp-url, --otp-ca-file and --otp-store-token-file are required"
    )]
    OtpFlags,
    /// The OTP store token could not be read or used.
    #[error(transparent)]
    StoreToken(#[from] store_token::StoreTokenError),
    /// The cluster identity could not be determined.
    #[error("cluster identity: {0} (set --cluster-id, or allow get on the kube-system namespace)")]
    ClusterId(#[source] ClusterIdError),
    /// The SSH state directory could not be prepared.
    #[error("SSH: {0}")]
    Ssh(#[source] crate::provision::ProvisionError),
    /// The webhook server failed to start.
    #[error(transparent)]
    Server(#[from] server::ServerError),
    /// The Lease timings cannot keep one leader at a time.
    #[error("leader election: {0}")]
    Lease(#[from] sources::lease::TimingError),
}

/// `mpc controller` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ControllerArgs {
    #[command(flatten)]
    pub webhook: WebhookArgs,
    /// kubeconfig file; unset: `KUBECONFIG`, then the in-cluster service account.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The controller's namespace: host-config, admin-key and cloud Secrets, the Lease.
    #[arg(
        long,
        env = "MPC_NAMESPACE",
        default_value = "multi-platform-controller"
    )]
    pub namespace: String,
    /// Name of the host-config ConfigMap (watched unless `--config` names a file).
    #[arg(long, env = "MPC_CONFIG_MAP", default_value = crate::contract::HOST_CONFIG_NAME)]
    pub config_map: String,
    /// Serve the webhook only: never take the Lease or schedule (no OTP settings needed).
    #[arg(long)]
    pub webhook_only: bool,
    /// OTP server base URL the controller stores keys at (`https://...`).
    #[arg(long, env = "MPC_OTP_URL", required_unless_present = "webhook_only")]
    pub otp_url: Option<String>,
    /// PEM CA that verifies the OTP server (also written into each secret as `otp-ca`).
    #[arg(
        long,
        env = "MPC_OTP_CA_FILE",
        required_unless_present = "webhook_only"
    )]
    pub otp_ca_file: Option<PathBuf>,
    /// File with the bearer token `/store-key` requires.
    #[arg(
        long,
        env = "MPC_OTP_STORE_TOKEN_FILE",
        required_unless_present = "webhook_only"
    )]
    pub otp_store_token_file: Option<PathBuf>,
    /// This cluster's identity, tagged on every instance it launches; default: the UID of the
    /// `kube-system` namespace.
    #[arg(long, env = "MPC_CLUSTER_ID")]
    pub cluster_id: Option<String>,
    /// Name of the Lease that elects the scheduling replica.
    #[arg(
        long,
        env = "MPC_LEASE_NAME",
        default_value = "multi-platform-controller"
    )]
    pub lease_name: String,
    /// This replica's identity in the Lease (the pod name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Lease duration: a follower takes the Lease once its record has not changed for this long
    /// (by the follower's own clock); at least 1s.
    #[arg(long, default_value = "15s", value_parser = crate::duration::parse_nonzero)]
    pub lease_duration: Duration,
    /// The holder stops scheduling when it could not renew for this long; shorter than
    /// `--lease-duration` and longer than 1.2 × `--lease-retry-period` (checked at start).
    #[arg(long, default_value = "10s", value_parser = crate::duration::parse_nonzero)]
    pub lease_renew_deadline: Duration,
    /// How often the Lease is renewed or retried.
    #[arg(long, default_value = "2s", value_parser = crate::duration::parse_nonzero)]
    pub lease_retry_period: Duration,
    /// ConfigMap (controller namespace) that keeps static hosts' learned SSH host keys.
    #[arg(
        long,
        env = "MPC_KNOWN_HOSTS_CONFIG_MAP",
        default_value = "mpc-known-hosts"
    )]
    pub known_hosts_config_map: String,
    /// Directory for SSH state (known hosts, control sockets).
    #[arg(long, env = "MPC_SSH_STATE_DIR", default_value = "/var/lib/mpc/ssh")]
    pub ssh_state_dir: PathBuf,
    /// How often the leader scans for TaskRuns the webhook missed (it also scans on taking the
    /// Lease).
    #[arg(long, env = "MPC_ADOPT_INTERVAL", default_value = "5m", value_parser = crate::duration::parse_nonzero)]
    pub adopt_interval: Duration,
    /// How often the leader lists each dynamic platform's instances (orphans, instances gone
    /// behind its back, other clusters' instances counted against `max-instances`).
    #[arg(long, env = "MPC_INSTANCE_LIST_INTERVAL", default_value = "60s", value_parser = crate::duration::parse_nonzero)]
    pub instance_list_interval: Duration,
    /// How often the leader lists the build users of each static host; users no allocation owns
    /// that are older than a day are removed (leftovers of a crash or of the Go controller).
    #[arg(long, env = "MPC_HOST_USER_SWEEP_INTERVAL", default_value = "10m", value_parser = crate::duration::parse_nonzero)]
    pub host_user_sweep_interval: Duration,
    /// How long a dynamic pool instance may sit without a TaskRun before it is terminated;
    /// `min-instances` are kept regardless.
    #[arg(long, env = "MPC_POOL_IDLE_TIMEOUT", default_value = "10m", value_parser = crate::duration::parse_nonzero)]
    pub pool_idle_timeout: Duration,
    /// EC2 endpoint override (an EC2-compatible cloud).
    #[arg(long, env = "MPC_EC2_ENDPOINT")]
    pub ec2_endpoint: Option<String>,
    /// IBM Cloud IAM endpoint override (default https://iam.cloud.ibm.com), for `ibmz` and
    /// `ibmp` platforms. Plain http only on loopback.
    #[arg(long, env = "MPC_IBM_IAM_URL")]
    pub ibm_iam_url: Option<String>,
    /// IBM Cloud Global Tagging endpoint override (default
    /// https://tags.global-search-tagging.cloud.ibm.com), where IBM instances' ownership tags live.
    #[arg(long, env = "MPC_IBM_TAGGING_URL")]
    pub ibm_tagging_url: Option<String>,
    /// API requests the leader's executor has in flight at once (TaskRun and secret writes and
    /// the reads they need). More drains a burst of creations sooner; each one is load on the
    /// API server and its priority-and-fairness queue.
    #[arg(long, env = "MPC_API_PARALLELISM", default_value_t = LimitSettings::default().api, value_parser = positive)]
    pub api_parallelism: usize,
    /// SSH operations (provisioning, build-user removal, host user listings) in flight at once,
    /// all hosts together. Bounds the controller's ssh processes and memory.
    #[arg(long, env = "MPC_SSH_PARALLELISM", default_value_t = LimitSettings::default().ssh, value_parser = positive)]
    pub ssh_parallelism: usize,
    /// SSH commands in flight on one build host, over its one multiplexed connection; keep it
    /// under the host sshd's `MaxSessions` (10 by default).
    #[arg(long, env = "MPC_SSH_SESSIONS_PER_HOST", default_value_t = SshOptions::new("").max_sessions_per_host, value_parser = positive)]
    pub ssh_sessions_per_host: usize,
    /// Cloud launches, terminations and retags in flight at once (probes are batched apart).
    /// Lower it when the account's API rate limits throttle the calls.
    #[arg(long, env = "MPC_CLOUD_PARALLELISM", default_value_t = LimitSettings::default().cloud, value_parser = positive)]
    pub cloud_parallelism: usize,
    /// Kubernetes Events being published at once. Best effort: they wait in a bounded outbox
    /// that lets 20 a second leave (`controller::events`; drops are counted in `events_dropped`).
    #[arg(long, env = "MPC_EVENT_PARALLELISM", default_value_t = LimitSettings::default().events, value_parser = positive)]
    pub event_parallelism: usize,
    /// Longest time one API request of the executor may take before it is abandoned and retried.
    #[arg(long, env = "MPC_API_REQUEST_TIMEOUT", default_value = "15s", value_parser = crate::duration::parse_nonzero)]
    pub api_request_timeout: Duration,
    /// Longest time one TaskRun or secret write may take, retries included, before it is given
    /// up and counted in `action_failures` (a finalizer removal starts over instead).
    #[arg(long, env = "MPC_API_WRITE_TIMEOUT", default_value = "10m", value_parser = crate::duration::parse_nonzero)]
    pub api_write_timeout: Duration,
    /// Longest time one provisioning or build-user removal may take, waiting for an SSH slot
    /// included; a provisioning that takes longer counts as failed and the TaskRun moves on.
    #[arg(long, env = "MPC_SSH_TIMEOUT", default_value = "5m", value_parser = crate::duration::parse_nonzero)]
    pub ssh_timeout: Duration,
    /// Longest time a new leader spends learning whether live TaskRuns' secrets exist before it
    /// schedules anything. A TaskRun whose lookup has no answer by then (or is refused for good,
    /// a 403 from a namespace being deleted or a full Secret quota) is recovered without that
    /// knowledge: its allocation counts as unproven and its token is not re-armed.
    #[arg(long, env = "MPC_RECOVERY_DEADLINE", default_value = "2m", value_parser = crate::duration::parse_nonzero)]
    pub recovery_deadline: Duration,
    /// Debug: check the scheduler's state invariants after every N events it handles; each
    /// broken one is logged (error) and counted in `scheduler_state_violations`, and nothing else
    /// changes. A check walks the whole state (about 2 ms with 20,000 TaskRuns tracked). 0: never.
    #[arg(long, env = "MPC_CHECK_STATE", default_value_t = 0, value_name = "N")]
    pub check_state: u64,
}

/// Why a Kubernetes client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error(transparent)]
    Infer(#[from] kube::config::InferConfigError),
    #[error(transparent)]
    Client(#[from] kube::Error),
}

/// Why the cluster identity could not be determined.
#[derive(Debug, thiserror::Error)]
pub enum ClusterIdError {
    #[error(transparent)]
    Read(#[from] kube::Error),
    #[error("kube-system has no uid")]
    NoUid,
    #[error("{id:?}: {source}")]
    Invalid {
        id: String,
        source: crate::cloud::ClusterIdError,
    },
}

/// A count flag that is not a positive number.
#[derive(Debug, thiserror::Error)]
enum CountError {
    #[error("must be at least 1")]
    Zero,
    #[error(transparent)]
    NotANumber(#[from] std::num::ParseIntError),
}

/// A count of at least one.
fn positive(s: &str) -> Result<usize, CountError> {
    match s.parse::<usize>()? {
        0 => Err(CountError::Zero),
        n => Ok(n),
    }
}

impl ControllerArgs {
    /// The executor's bounds as the flags set them.
    pub fn limits(&self) -> LimitSettings {
        LimitSettings {
            api: self.api_parallelism,
            ssh: self.ssh_parallelism,
            cloud: self.cloud_parallelism,
            events: self.event_parallelism,
            request_timeout: self.api_request_timeout,
            write_timeout: self.api_write_timeout,
            ssh_timeout: self.ssh_timeout,
            recovery_deadline: self.recovery_deadline,
        }
    }

    /// The Lease timings, refused when they cannot keep one leader at a time.
    pub fn lease_timing(&self) -> Result<sources::lease::Timing, sources::lease::TimingError> {
        sources::lease::Timing::new(
            self.lease_duration,
            self.lease_renew_deadline,
            self.lease_retry_period,
        )
    }
}

/// The OTP server as the executor's key store.
struct OtpKeys(Arc<store_token::StoreToken>);

impl KeyStore for OtpKeys {
    fn store<'a>(
        &'a self,
        owner: &'a str,
        request: &'a str,
        rearm: bool,
        rearms_left: u32,
        key: &'a [u8],
    ) -> BoxFuture<'a, Result<String, OtpClientError>> {
        Box::pin(async move {
            let left = Some(rearms_left);
            let how = if rearm { Rearm::Latest } else { Rearm::No };
            let client = self.0.client();
            match client.store_key_owned(owner, request, how, left, key).await {
                Ok(t) => Ok(t.as_str().to_owned()),
                // The mounted token is unknown or expired: a fresh token (the secret is replaced
                // with it; a pod that already mounted the old one fails and Tekton retries).
                Err(e)
                    if rearm
                        && e.status()
                            .is_some_and(|s| s.as_u16() == 404 || s.as_u16() == 410) =>
                {
                    tracing::warn!(%owner, error = %e, "re-arm refused; storing under a fresh token");
                    client
                        .store_key_owned(owner, request, Rearm::No, left, key)
                        .await
                        .map(|t| t.as_str().to_owned())
                }
                Err(e) => Err(e),
            }
        })
    }

    fn revoke<'a>(&'a self, owner: &'a str) -> BoxFuture<'a, Result<(), OtpClientError>> {
        Box::pin(async move { self.0.client().revoke(owner).await.map(|_| ()) })
    }
}

/// The client of the leader's requests (Lease, writes, reads, lists; watches use their own):
/// each gets an answer within the renew deadline or fails by itself. One of the two mechanisms
/// that end a term's work on time, each enough alone: this one, and the term's cancellation
/// (`sources::lease::Elector`), which abandons whatever the term still has in flight.
async fn leader_client(args: &ControllerArgs) -> Result<kube::Client, ControllerError> {
    kube_client(args, Some(args.lease_renew_deadline)).await
}

/// A client for `args`; `read_timeout` bounds each response (unset for watches, which stay idle
/// between events).
async fn kube_client(
    args: &ControllerArgs,
    read_timeout: Option<Duration>,
) -> Result<kube::Client, ControllerError> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let at = |source| ClientError::Kubeconfig {
                path: path.clone(),
                source,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(at)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(at)?
        }
        None => kube::Config::infer().await.map_err(ClientError::from)?,
    };
    if read_timeout.is_some() {
        config.read_timeout = read_timeout;
        // Counted from each request, not from when its pooled connection went idle.
        config.reset_reader_on_write = true;
    }
    Ok(kube::Client::try_from(config).map_err(ClientError::from)?)
}

fn read(path: &PathBuf) -> Result<Vec<u8>, ControllerError> {
    std::fs::read(path).map_err(|error| ControllerError::File {
        path: path.clone(),
        error,
    })
}

/// The default cluster identity: the `kube-system` namespace's UID (stable for the cluster's
/// life, distinct between clusters).
async fn cluster_id(
    client: &kube::Client,
    args: &ControllerArgs,
) -> Result<String, ControllerError> {
    if let Some(id) = &args.cluster_id {
        return Ok(id.clone());
    }
    let api: kube::Api<Namespace> = kube::Api::all(client.clone());
    let ns = api
        .get("kube-system")
        .await
        .map_err(|e| ControllerError::ClusterId(e.into()))?;
    ns.metadata
        .uid
        .ok_or(ControllerError::ClusterId(ClusterIdError::NoUid))
}

/// A running controller.
pub struct Controller {
    webhook: WebhookServer,
    stop: CancellationToken,
    inputs: Option<mpsc::Sender<Input>>,
    tasks: tokio::task::JoinSet<()>,
}

impl Controller {
    /// Starts every part: webhook server, config watch, TaskRun watch, election, loop.
    pub async fn start(args: &ControllerArgs, registry: Registry) -> Result<Self, ControllerError> {
        let timing = args.lease_timing()?;
        let config = ConfigSource::new(Some(ConfigMetrics::register(&registry)?));
        let stop = CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        let client = if args.webhook_only && args.webhook.config.is_some() {
            None
        } else {
            Some(kube_client(args, None).await?)
        };
        let recorder = |client: &kube::Client, instance: &str| {
            Recorder::new(
                client.clone(),
                Reporter {
                    controller: "multi-platform-controller".into(),
                    instance: Some(instance.to_owned()),
                },
            )
        };
        let identity = args
            .identity
            .clone()
            .unwrap_or_else(|| format!("{}-{}", hostname(), std::process::id()));
        if let (Some(client), None) = (&client, &args.webhook.config) {
            tasks.spawn(
                sources::config::watch_config_map(
                    client.clone(),
                    args.namespace.clone(),
                    recorder(client, &identity),
                    args.config_map.clone(),
                    config.clone(),
                    stop.clone(),
                )
                .instrument(sources::span("config_map")),
            );
        }
        if args.webhook_only {
            let webhook = WebhookServer::start_with(&args.webhook, registry, config).await?;
            return Ok(Controller {
                webhook,
                stop,
                inputs: None,
                tasks,
            });
        }
        let client = client.expect("created unless webhook-only with a file");
        let requests = leader_client(args).await?;
        let metrics = ControllerMetrics::register(&registry)?;
        let registry_for_cloud = registry.clone();
        let events_dropped = events::dropped_counter(&registry)?;
        let webhook = WebhookServer::start_with(&args.webhook, registry, config.clone()).await?;

        let required = |v: &Option<PathBuf>| v.clone().ok_or(ControllerError::OtpFlags);
        let ca_pem = read(&required(&args.otp_ca_file)?)?;
        let url = args.otp_url.clone().unwrap_or_default();
        // Followed like the OTP server does: a rotated token needs no restart.
        let token_file = required(&args.otp_store_token_file)?;
        let store_token = Arc::new(store_token::StoreToken::load(token_file, &url, &ca_pem)?);
        tasks.spawn(
            store_token
                .clone()
                .follow(Duration::from_secs(1), stop.clone()),
        );
        let secret_proof = store_token.proof();
        let otp_endpoint = patch::OtpEndpoint {
            url: store_token.client().otp_url(),
            ca_pem: String::from_utf8_lossy(&ca_pem).into_owned(),
        };
        let cluster = cluster_id(&client, args).await?;
        let cluster_id_checked = crate::cloud::ClusterId::new(&cluster).map_err(|source| {
            ControllerError::ClusterId(ClusterIdError::Invalid {
                id: cluster.clone(),
                source,
            })
        })?;
        let mut ssh = SshOptions::new(&args.ssh_state_dir);
        ssh.max_sessions_per_host = args.ssh_sessions_per_host;
        let provisioner = Provisioner::new(ssh).map_err(ControllerError::Ssh)?;
        let ctx = Context {
            client: requests.clone(),
            namespace: args.namespace.clone(),
            otp: otp_endpoint,
            secret_proof,
            keys: Arc::new(OtpKeys(store_token)),
            provisioner: Arc::new(provisioner),
            known_hosts: Arc::new(execute::ssh::KnownHosts::new(
                args.known_hosts_config_map.clone(),
            )),
            config: config.clone(),
            cloud: Arc::new(execute::cloud::CloudExec::with_ibm(
                cluster_id_checked.clone(),
                args.ec2_endpoint.clone(),
                execute::cloud::IbmEndpoints {
                    iam_url: args.ibm_iam_url.clone(),
                    tagging_url: args.ibm_tagging_url.clone(),
                },
                crate::cloud::metrics::CloudMetrics::new(&registry_for_cloud)?,
            )),
            events: events::EventSink::start(
                recorder(&requests, &identity),
                events::OutboxLimits::default(),
                args.event_parallelism,
                events_dropped,
                stop.clone(),
            ),
            metrics: metrics.clone(),
            limits: Arc::new(Limits::new(args.limits())),
            cancel: stop.child_token(),
        };
        tracing::info!(%identity, cluster = %cluster, namespace = %args.namespace, "controller starting");

        let (tx, rx) = mpsc::channel(1024);
        let (lead_tx, lead_rx) = watch::channel(None);
        let every = sources::Intervals {
            adopt: args.adopt_interval,
            instances: args.instance_list_interval,
            host_users: args.host_user_sweep_interval,
        };
        let term_sources = sources::Live {
            base: ctx.clone(),
            config: config.subscribe(),
            every,
        };
        let policy = Policy {
            pool_idle_timeout: Some(args.pool_idle_timeout),
            ..Policy::mpc()
        };
        let driver = Driver::new(ctx, term_sources, metrics, policy, tx.clone(), lead_rx)
            .check_state(args.check_state);
        tasks.spawn(driver.run(rx));
        tasks.spawn(
            sources::taskruns::watch(client.clone(), tx.clone(), stop.clone())
                .instrument(sources::span("taskruns")),
        );
        tasks.spawn(
            sources::config::forward(config.subscribe(), tx.clone(), stop.clone())
                .instrument(sources::span("config")),
        );

        let elector = sources::lease::Elector::new(
            kube::Api::namespaced(requests, &args.namespace),
            args.lease_name.clone(),
            identity,
            timing,
        );
        tasks.spawn(
            elector
                .run(lead_tx, stop.clone())
                .instrument(sources::span("lease")),
        );
        Ok(Controller {
            webhook,
            stop,
            inputs: Some(tx),
            tasks,
        })
    }

    /// The webhook server (addresses, readiness).
    pub fn webhook(&self) -> &WebhookServer {
        &self.webhook
    }

    /// Graceful shutdown: unready, stop scheduling (in-flight work is cancelled; the next leader
    /// recovers it), release the Lease, drain the webhook.
    pub async fn shutdown(mut self) {
        if let Some(inputs) = &self.inputs {
            let _ = inputs.send(Input::Shutdown).await;
        }
        self.stop.cancel();
        self.webhook.shutdown().await;
        while self.tasks.join_next().await.is_some() {}
        tracing::info!("controller stopped");
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "mpc".into())
}

/// Runs `mpc controller` until SIGTERM or SIGINT, then shuts down gracefully.
pub async fn run(args: ControllerArgs) -> Result<(), ControllerError> {
    let controller = Controller::start(&args, prometheus::default_registry().clone()).await?;
    let signal = server::shutdown_signal().await;
    controller.shutdown().await;
    Ok(signal?)
}

impl From<prometheus::Error> for ControllerError {
    fn from(e: prometheus::Error) -> Self {
        ControllerError::Server(server::ServerError::Metrics(e))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ControllerArgs,
    }

    fn parse(extra: &[&str]) -> Result<ControllerArgs, clap::Error> {
        let argv = ["mpc", "--webhook-only"].iter().chain(extra);
        Cli::try_parse_from(argv).map(|c| c.args)
    }

    /// The leader's requests give up by the renew deadline by themselves, whatever the term's
    /// cancellation does: an API server that accepts connections and never answers.
    #[tokio::test]
    async fn the_leaders_requests_give_up_by_the_renew_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                open.push(conn);
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        let config = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: t\n"
        );
        std::fs::write(&kubeconfig, config).unwrap();
        let args = parse(&[
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--lease-duration=2s",
            "--lease-renew-deadline=1s",
            "--lease-retry-period=200ms",
        ])
        .unwrap();
        let client = leader_client(&args).await.unwrap();
        let leases: kube::Api<k8s_openapi::api::coordination::v1::Lease> =
            kube::Api::namespaced(client, "ns");
        let started = std::time::Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(10), leases.get_opt("lease"))
            .await
            .expect("a request of the leader hung past 10 s");
        assert!(answer.is_err(), "{answer:?}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(1) && took < Duration::from_millis(1500),
            "gave up after {took:?}"
        );
        held.abort();
    }

    #[test]
    fn executor_limits_come_from_the_flags() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.limits(), LimitSettings::default());
        assert_eq!(args.ssh_sessions_per_host, 8);
        let args = parse(&[
            "--api-parallelism=64",
            "--ssh-parallelism=16",
            "--ssh-sessions-per-host=4",
            "--cloud-parallelism=2",
            "--event-parallelism=1",
            "--api-request-timeout=5s",
            "--api-write-timeout=2m",
            "--ssh-timeout=90s",
            "--recovery-deadline=30s",
        ])
        .unwrap();
        assert_eq!(
            args.limits(),
            LimitSettings {
                api: 64,
                ssh: 16,
                cloud: 2,
                events: 1,
                request_timeout: Duration::from_secs(5),
                write_timeout: Duration::from_secs(120),
                ssh_timeout: Duration::from_secs(90),
                recovery_deadline: Duration::from_secs(30),
            }
        );
        assert_eq!(args.ssh_sessions_per_host, 4);
        assert_eq!(args.lease_timing(), Ok(sources::lease::Timing::default()));
        for bad in [
            &["--lease-duration=10s", "--lease-renew-deadline=10s"][..],
            &["--lease-renew-deadline=20s"],
            &["--lease-retry-period=9s"],
        ] {
            let args = parse(bad).unwrap();
            assert!(args.lease_timing().is_err(), "{bad:?} is refused");
        }
        for bad in [
            "--api-parallelism=0",
            "--ssh-timeout=0s",
            "--cloud-parallelism=x",
        ] {
            assert!(parse(&[bad]).is_err(), "{bad} is refused");
        }
    }
}
