//! The whole product on this machine: the test API server with the Tekton stand-in, the real
//! `mpc otp-server` and `mpc controller` processes (the `mpc-e2e` binary is the product's own
//! `main.rs`, see [`mpc_binary!`](crate::mpc_binary)), the webhook registered from the shipped manifest, and loopback sshd build hosts.
//!
//! Processes log to files in the product's directory; a test that fails prints them
//! ([`Product::logs`]). Everything stops on drop.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret};
use kube::api::{Api, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::apiserver::{ApiServer, Options, TEKTON_CRDS};
use crate::sshd::SshdHost;
use crate::tekton::{self, Tekton};

/// The controller's namespace in tests (as in the manifests).
pub const NS: &str = "multi-platform-controller";
const WEBHOOK_SERVICE: &str = "mpc-webhook";

/// The `mpc` binary under test: tests pass `env!("CARGO_BIN_EXE_mpc-e2e")` (only integration
/// tests see that variable).
#[macro_export]
macro_rules! mpc_binary {
    () => {
        std::path::Path::new(env!("CARGO_BIN_EXE_mpc-e2e"))
    };
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// How a [`Proc`] is started, again after a kill if need be.
type Launcher = Box<dyn Fn() -> std::io::Result<Child> + Send + Sync>;

/// A child process, killed on drop; [`Proc::restart`] starts it again with the same command (same
/// ports, files and identity), as a supervisor would after a crash.
pub struct Proc {
    child: std::sync::Mutex<Option<Child>>,
    launch: Launcher,
    pub log: PathBuf,
    pub admin: SocketAddr,
    pub name: String,
}

impl Proc {
    fn spawn(
        make: impl Fn() -> Command + Send + Sync + 'static,
        log: PathBuf,
        admin: SocketAddr,
        name: &str,
    ) -> anyhow::Result<Self> {
        let path = log.clone();
        let launch: Launcher = Box::new(move || {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)?;
            let mut cmd = make();
            // Its own process group: a terminal's Ctrl-C reaches the harness (which stops the
            // product in order, see `e2e try`), not every process at once.
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
            cmd.stdout(Stdio::null())
                .stderr(file)
                // Benchmarks log less (`MPC_E2E_LOG`), as a production deployment would.
                .env(
                    "MPC_LOG",
                    std::env::var("MPC_E2E_LOG")
                        .unwrap_or_else(|_| "info,mpc=debug,kube=warn".into()),
                );
            cmd.spawn()
        });
        let child = launch().with_context(|| format!("starting {name}"))?;
        Ok(Proc {
            child: std::sync::Mutex::new(Some(child)),
            launch,
            log,
            admin,
            name: name.to_owned(),
        })
    }

    fn take(&self) -> Option<Child> {
        self.child.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// SIGKILL: no shutdown, no Lease release.
    pub fn kill(&self) {
        if let Some(mut c) = self.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the process again with its original command (killing it first if it runs).
    pub fn restart(&self) -> anyhow::Result<()> {
        self.kill();
        let child = (self.launch)().with_context(|| format!("restarting {}", self.name))?;
        *self.child.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
        Ok(())
    }

    /// SIGTERM, then wait up to `limit` for a graceful exit.
    pub fn terminate(&self, limit: Duration) -> bool {
        let Some(mut c) = self.take() else {
            return true;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
        false
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|c| c.id())
    }

    /// Still running.
    pub fn alive(&self) -> bool {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    fn started(&self) -> bool {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The process's `/metrics`.
    pub async fn metrics(&self) -> String {
        let url = format!("http://{}/metrics", self.admin);
        let out = tokio::process::Command::new("curl")
            .args(["-s", "--max-time", "5", &url])
            .output()
            .await;
        out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A controller that found its scheduler's state broken (`--check-state`, on in every product
/// test) fails the test when its process is dropped: the invariants are the scheduler's, whatever
/// the test was about.
impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            return;
        }
        let log = self.log_text();
        if let Some(line) = log.lines().find(|l| l.contains("scheduler state broken")) {
            panic!("{}: the scheduler's state broke: {line}", self.name);
        }
    }
}

/// A static build host served by a loopback sshd on port 22.
pub struct BuildHost {
    pub name: String,
    pub sshd: SshdHost,
}

/// The running product.
pub struct Product {
    pub api: ApiServer,
    pub client: kube::Client,
    pub tekton: Tekton,
    pub dir: tempfile::TempDir,
    pub otp: Proc,
    pub otp_port: u16,
    pub controllers: Vec<Proc>,
    pub hosts: Vec<BuildHost>,
    /// Extra flags for every controller started from now on.
    pub controller_flags: Vec<String>,
    /// Controllers started from now on talk to the API server as their identity (the request
    /// log and fault rules tell replicas apart) instead of as `KUBECONFIG_USER`.
    pub user_per_replica: bool,
    /// `--cluster-id` of controllers started from now on; `None` leaves it unset, so the
    /// controller reads the `kube-system` namespace's UID as a cluster does.
    pub cluster_id: Option<String>,
    /// The user (bearer token) of controllers started from now on: by default
    /// [`KUBECONFIG_USER`](crate::apiserver::KUBECONFIG_USER), a cluster administrator; a
    /// ServiceAccount's `system:serviceaccount:<ns>:<name>` to run under its RBAC and policies.
    pub controller_user: String,
    mpc: PathBuf,
    webhook_certs: PathBuf,
    webhook_port: u16,
}

/// Short lease and adoption timings, so failover tests run in seconds; a flag of the same name in
/// [`Product::controller_flags`] replaces its default (clap refuses a flag given twice).
const TEST_TIMINGS: &[(&str, &str)] = &[
    ("--lease-duration", "3s"),
    ("--lease-renew-deadline", "2s"),
    ("--lease-retry-period", "300ms"),
    ("--adopt-interval", "2s"),
    // Every product test checks the scheduler's state after every event; a broken invariant
    // fails the test when the controller's process is dropped.
    ("--check-state", "1"),
];

/// `defaults` as arguments, without those whose flag `flags` gives itself (as `--name value` or
/// `--name=value`).
fn with_overrides(defaults: &[(&str, &str)], flags: &[String]) -> Vec<String> {
    let given = |name: &str| {
        flags.iter().any(|f| {
            f.strip_prefix(name)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
        })
    };
    defaults
        .iter()
        .filter(|(name, _)| !given(name))
        .flat_map(|(name, value)| [(*name).to_owned(), (*value).to_owned()])
        .collect()
}

/// A value from a ConfigMap-style `key: value` list.
pub type ConfigPairs = Vec<(String, String)>;

impl Product {
    /// Starts the API server, Tekton stand-in, OTP server and the webhook registration, with
    /// `hosts` static build hosts; no controller yet ([`Product::start_controller`]).
    pub async fn start(mpc: &Path, hosts: &[(&str, u32)]) -> anyhow::Result<Self> {
        Self::start_with(mpc, hosts, crate::sshd::HostSetup::default()).await
    }

    /// [`Product::start`] with build hosts set up as `host` says (on port 22 whatever it says):
    /// e.g. each with its own user database ([`HostSetup::own_users`](crate::sshd::HostSetup)).
    pub async fn start_with(
        mpc: &Path,
        hosts: &[(&str, u32)],
        host: crate::sshd::HostSetup,
    ) -> anyhow::Result<Self> {
        mpc::tls::install_crypto_provider();
        let api = ApiServer::start(Options::default()).await?;
        api.create_yaml(TEKTON_CRDS).await?;
        let client = api.client().await?;
        let dir = tempfile::Builder::new().prefix("mpc-product-").tempdir()?;
        for ns in [NS, "tenant-a", "tenant-b"] {
            create_namespace(&client, ns).await?;
        }

        // OTP server with its own CA, reachable at https://127.0.0.1:<port>.
        let otp_dir = dir.path().join("otp");
        std::fs::create_dir_all(otp_dir.join("tls"))?;
        let bundle = mpc::certs::generate("otp", &["127.0.0.1".into(), "localhost".into()], 2)?;
        mpc::certs::write_bundle(&bundle, &otp_dir.join("tls"))?;
        std::fs::write(otp_dir.join("ca.pem"), &bundle.ca_pem)?;
        let bearer = format!("bearer-{}", mpc::otp::token::Token::random().as_str());
        std::fs::write(otp_dir.join("store-token"), format!("{bearer}\n"))?;
        std::fs::write(
            otp_dir.join("seal-key"),
            format!("seal-{}", mpc::otp::token::Token::random().as_str()),
        )?;
        let otp_port = free_port();
        let otp_admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let otp = start_otp(
            mpc,
            &otp_dir,
            otp_port,
            otp_admin,
            &dir.path().join("otp.log"),
        )?;

        // Webhook certificates for the Service the manifest names.
        let webhook_certs = dir.path().join("webhook-certs");
        mpc::certs::run(&mpc::certs::CertsArgs {
            service: WEBHOOK_SERVICE.into(),
            namespace: NS.into(),
            out: webhook_certs.clone(),
            days: 1,
            extra_sans: vec![],
        })?;
        let webhook_port = free_port();
        api.map_service(
            NS,
            WEBHOOK_SERVICE,
            443,
            SocketAddr::from(([127, 0, 0, 1], webhook_port)),
        );
        let ca_bundle = std::fs::read_to_string(webhook_certs.join("ca-bundle"))?;
        let manifest = crate::kubectl::shipped_webhook_configuration(&ca_bundle);
        api.create_yaml(&manifest.to_string()).await?;

        let tekton = Tekton::start(client.clone());
        let mut product = Product {
            api,
            client,
            tekton,
            dir,
            otp,
            otp_port,
            controllers: Vec::new(),
            hosts: Vec::new(),
            controller_flags: Vec::new(),
            user_per_replica: false,
            cluster_id: Some("e2e-cluster".into()),
            controller_user: crate::apiserver::KUBECONFIG_USER.to_owned(),
            mpc: mpc.to_owned(),
            webhook_certs,
            webhook_port,
        };
        for (name, _) in hosts {
            let sshd = SshdHost::start_with(crate::sshd::HostSetup {
                port: Some(22),
                ..host.clone()
            })?;
            product
                .put_secret(
                    NS,
                    &format!("{name}-admin"),
                    &[("id_rsa", sshd.admin_key().as_slice())],
                )
                .await?;
            product.hosts.push(BuildHost {
                name: (*name).to_owned(),
                sshd,
            });
        }
        let mut cfg = ConfigPairs::new();
        for ((name, concurrency), h) in hosts.iter().zip(&product.hosts) {
            cfg.extend(static_host(
                name,
                &h.sshd.address(),
                *concurrency,
                "linux/arm64",
            ));
        }
        cfg.push(("local-platforms".into(), "linux/amd64,local".into()));
        product.set_config(&cfg).await?;
        Ok(product)
    }

    /// The host-config as the product started with it (static hosts and local platforms).
    pub fn base_config(&self) -> ConfigPairs {
        let mut cfg = ConfigPairs::new();
        for h in &self.hosts {
            let c = 1;
            cfg.extend(static_host(&h.name, &h.sshd.address(), c, "linux/arm64"));
        }
        cfg.push(("local-platforms".into(), "linux/amd64,local".into()));
        cfg
    }

    /// Replaces the host-config ConfigMap's data.
    pub async fn set_config(&self, pairs: &ConfigPairs) -> anyhow::Result<()> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), NS);
        let data: BTreeMap<String, String> = pairs.iter().cloned().collect();
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some(mpc::contract::HOST_CONFIG_NAME.into()),
                labels: Some(BTreeMap::from([(
                    mpc::contract::MULTI_PLATFORM_CONFIG_LABEL.into(),
                    "hosts".into(),
                )])),
                ..ObjectMeta::default()
            },
            data: Some(data),
            ..ConfigMap::default()
        };
        match api.get_opt(mpc::contract::HOST_CONFIG_NAME).await? {
            None => {
                api.create(&PostParams::default(), &cm).await?;
            }
            Some(_) => {
                api.patch(
                    mpc::contract::HOST_CONFIG_NAME,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"data": null})),
                )
                .await?;
                api.patch(
                    mpc::contract::HOST_CONFIG_NAME,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"data": cm.data})),
                )
                .await?;
            }
        }
        Ok(())
    }

    /// Creates or replaces an Opaque Secret.
    pub async fn put_secret(
        &self,
        ns: &str,
        name: &str,
        data: &[(&str, &[u8])],
    ) -> anyhow::Result<()> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), ns);
        let s = Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.to_vec())))
                    .collect(),
            ),
            ..Secret::default()
        };
        let _ = api.delete(name, &Default::default()).await;
        api.create(&PostParams::default(), &s).await?;
        Ok(())
    }

    /// Creates the controller-namespace Secret `name` holding moto's test credentials, as the
    /// `aws-secret` of a dynamic platform names it.
    pub async fn put_moto_credentials(&self, name: &str) -> anyhow::Result<()> {
        self.put_secret(
            NS,
            name,
            &[
                ("access-key-id", crate::moto::ACCESS_KEY_ID.as_bytes()),
                (
                    "secret-access-key",
                    crate::moto::SECRET_ACCESS_KEY.as_bytes(),
                ),
            ],
        )
        .await
    }

    /// Starts an `mpc controller` replica named `identity` and waits until it is ready; returns
    /// its index.
    pub async fn start_controller(&mut self, identity: &str) -> anyhow::Result<usize> {
        let i = self.spawn_controller(identity)?;
        self.wait_ready(i).await?;
        Ok(i)
    }

    /// Starts an `mpc controller` replica without waiting for it.
    pub fn spawn_controller(&mut self, identity: &str) -> anyhow::Result<usize> {
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()));
        // Every replica serves the webhook; tests route the Service to the first one's port.
        let webhook_port = if self
            .controllers
            .iter()
            .any(|c| c.name == "webhook" && c.started())
        {
            free_port()
        } else {
            self.webhook_port
        };
        let otp_dir = self.dir.path().join("otp");
        let ssh_dir = self.dir.path().join(format!("ssh-{identity}"));
        let user = if self.user_per_replica {
            identity
        } else {
            self.controller_user.as_str()
        };
        let kubeconfig = if user == crate::apiserver::KUBECONFIG_USER {
            self.api.kubeconfig_path()
        } else {
            let path = self.dir.path().join(format!("kubeconfig-{identity}"));
            std::fs::write(&path, self.api.kubeconfig_yaml_as(user))?;
            path
        };
        let mpc = self.mpc.clone();
        let (otp_port, certs) = (self.otp_port, self.webhook_certs.clone());
        let (identity_arg, flags) = (identity.to_owned(), self.controller_flags.clone());
        let cluster_id = self.cluster_id.clone();
        let make = move || {
            let mut cmd = Command::new(&mpc);
            cmd.arg("controller")
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(["--namespace", NS])
                .args(["--otp-url", &format!("https://127.0.0.1:{otp_port}")])
                .arg("--otp-ca-file")
                .arg(otp_dir.join("ca.pem"))
                .arg("--otp-store-token-file")
                .arg(otp_dir.join("store-token"))
                .args(["--identity", &identity_arg])
                .args(with_overrides(TEST_TIMINGS, &flags))
                .arg("--ssh-state-dir")
                .arg(&ssh_dir)
                .arg("--cert-dir")
                .arg(&certs)
                .args(["--webhook-addr", &format!("127.0.0.1:{webhook_port}")])
                .args(["--admin-addr", &admin.to_string()])
                .args(["--shutdown-delay", "0s", "--reload-interval", "500ms"])
                .args(&flags);
            if let Some(id) = &cluster_id {
                cmd.args(["--cluster-id", id]);
            }
            cmd
        };
        let log = self.dir.path().join(format!("controller-{identity}.log"));
        let mut p = Proc::spawn(make, log, admin, identity)?;
        if webhook_port == self.webhook_port {
            // Serves the webhook Service; the identity stays in the log file name.
            p.name = "webhook".into();
        }
        self.controllers.push(p);
        Ok(self.controllers.len() - 1)
    }

    /// Waits until controller `i` answers `/readyz` (config and certificate loaded).
    pub async fn wait_ready(&self, i: usize) -> anyhow::Result<()> {
        let url = format!("http://{}/readyz", self.controllers[i].admin);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let out = tokio::process::Command::new("curl")
                .args([
                    "-s",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "--max-time",
                    "2",
                    &url,
                ])
                .output()
                .await?;
            if out.stdout == b"200" {
                return Ok(());
            }
            anyhow::ensure!(
                self.controllers[i].alive() && tokio::time::Instant::now() < deadline,
                "controller {} not ready:\n{}",
                self.controllers[i].name,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls `check` every 50 ms until it returns `Some`; panics after `timeout` naming `what`,
    /// with every process's log as it is then.
    pub async fn wait<T, F, Fut>(&self, timeout: Duration, what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Creates a TaskRun of `platform` whose inline Task mounts the secret and runs the consumer
    /// script of docs/architecture.md, "The contract with the Go controller" (or `script`).
    pub async fn create_taskrun(
        &self,
        ns: &str,
        name: &str,
        platform: &str,
        extra: Value,
    ) -> anyhow::Result<Value> {
        let mut tr = json!({
            "apiVersion": "tekton.dev/v1", "kind": "TaskRun",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "params": [{"name": "PLATFORM", "value": platform}],
                "taskSpec": {
                    "params": [{"name": "PLATFORM", "type": "string"}],
                    "volumes": [{"name": "ssh", "secret": {"secretName": "multi-platform-ssh-$(context.taskRun.name)", "optional": false}}],
                    "steps": [{"name": "build", "image": "quay.io/konflux-ci/buildah-task:latest",
                               "script": CONSUMER_SCRIPT,
                               "volumeMounts": [{"name": "ssh", "mountPath": "/ssh", "readOnly": true}]}]
                }
            }
        });
        json_patch::merge(&mut tr, &extra);
        let o: DynamicObject = serde_json::from_value(tr)?;
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), ns, &tekton::taskrun_resource());
        let created = api.create(&PostParams::default(), &o).await?;
        Ok(serde_json::to_value(created)?)
    }

    /// Deletes a TaskRun (it stays while finalizers hold it).
    pub async fn delete_taskrun(&self, ns: &str, name: &str) {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), ns, &tekton::taskrun_resource());
        api.delete(name, &Default::default())
            .await
            .expect("deleting the TaskRun");
    }

    /// A TaskRun as stored, `None` once deleted.
    pub async fn taskrun(&self, ns: &str, name: &str) -> Option<Value> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), ns, &tekton::taskrun_resource());
        api.get_opt(name)
            .await
            .ok()
            .flatten()
            .map(|o| serde_json::to_value(o).expect("serialisable"))
    }

    /// The TaskRun's secret data as text, `None` while it does not exist.
    pub async fn secret(&self, ns: &str, taskrun: &str) -> Option<BTreeMap<String, String>> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), ns);
        let s = api
            .get_opt(&mpc::contract::secret_name(taskrun))
            .await
            .ok()
            .flatten()?;
        Some(
            s.data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
                .collect(),
        )
    }

    /// Redeems a token the way build steps do (`curl --fail`, form body); the key, or curl's error.
    pub async fn otp_redeem(&self, token: &str) -> Result<String, String> {
        let ca = self.dir.path().join("otp/ca.pem");
        let out = tokio::process::Command::new("curl")
            .args(["--fail", "--silent", "--show-error", "--max-time", "120"])
            .arg("--cacert")
            .arg(&ca)
            .args(["-XPOST", "-d", token])
            .arg(format!("https://127.0.0.1:{}/otp", self.otp_port))
            .output()
            .await
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// Restarts the OTP server (SIGKILL, then the same port, store and keys) and waits until it
    /// listens.
    pub fn restart_otp(&self) -> anyhow::Result<()> {
        self.otp.restart()?;
        otp_listening(&self.otp, self.otp_port)
    }

    /// Creates namespace `name`.
    pub async fn create_namespace(&self, name: &str) -> anyhow::Result<()> {
        create_namespace(&self.client, name).await
    }

    /// Entries in the OTP server's store (waiting keys and tombstones of redeemed ones), from its
    /// `otp_entries` gauge; `None` when the server does not answer.
    pub async fn otp_entries(&self) -> Option<u64> {
        let text = self.otp.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix("multi_platform_controller_otp_entries "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map(|v| v as u64)
    }

    /// Runs a started TaskRun's steps on this machine (its build reaches the host); panics with
    /// the output and every log unless they exit 0.
    pub async fn build(&self, ns: &str, name: &str) {
        let run = self
            .tekton
            .run_steps(ns, name, crate::tekton::RunOptions::default())
            .await
            .expect("running the steps");
        assert_eq!(
            run.exit_code,
            0,
            "{ns}/{name}: {}\n{}\n{}",
            run.stdout,
            run.stderr,
            self.logs()
        );
    }

    /// Waits until the TaskRun is cleaned up: no secret, no finalizer of ours.
    pub async fn cleaned_up(&self, ns: &str, name: &str) {
        let what = format!("cleanup of {ns}/{name}");
        self.wait(Duration::from_secs(60), &what, || async {
            let ours = |t: &Value| {
                t["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| f.iter().any(|x| x == mpc::contract::FINALIZER))
            };
            let gone = self.taskrun(ns, name).await.is_none_or(|t| !ours(&t));
            (gone && self.secret(ns, name).await.is_none()).then_some(())
        })
        .await;
    }

    /// Stores moto's AWS credentials (Secret `aws-account`) and `ssh_key` (Secret
    /// `aws-ssh-key`), and returns the host-config entries of dynamic `platform` in `fx`'s subnet:
    /// at most two instances tagged `tag`, user root.
    pub async fn moto_platform(
        &self,
        fx: &crate::moto::Fixture,
        platform: &str,
        ssh_key: &[u8],
        tag: &str,
    ) -> anyhow::Result<ConfigPairs> {
        self.put_moto_credentials("aws-account").await?;
        self.put_secret(NS, "aws-ssh-key", &[("id_rsa", ssh_key)])
            .await?;
        let (ami, instance_type) = if platform.ends_with("arm64") {
            (fx.arm64_ami.as_str(), "t4g.micro")
        } else {
            (fx.ami.as_str(), "m5.large")
        };
        let key = platform.replace('/', "-");
        let mut cfg: ConfigPairs = [
            ("type", "aws"),
            ("region", fx.region.as_str()),
            ("ami", ami),
            ("instance-type", instance_type),
            ("aws-secret", "aws-account"),
            ("ssh-secret", "aws-ssh-key"),
            ("subnet-id", fx.subnet_id.as_str()),
            ("user", "root"),
            ("max-instances", "2"),
            ("instance-tag", tag),
        ]
        .into_iter()
        .map(|(k, v)| (format!("dynamic.{key}.{k}"), v.to_owned()))
        .collect();
        cfg.push(("dynamic-platforms".into(), platform.to_owned()));
        Ok(cfg)
    }

    /// The learned host keys the controller keeps (ConfigMap `mpc-known-hosts`).
    pub async fn known_hosts(&self) -> BTreeMap<String, String> {
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), NS);
        api.get_opt("mpc-known-hosts")
            .await
            .ok()
            .flatten()
            .and_then(|c| c.data)
            .unwrap_or_default()
    }

    /// Every process log, for a failing test's message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for p in self.controllers.iter().chain(std::iter::once(&self.otp)) {
            let text = p.log_text();
            out.push_str(&format!("==== {} ({})\n", p.name, p.log.display()));
            let text = strip_ansi(&text);
            let tail: Vec<&str> = text.lines().rev().take(80).collect();
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

/// The consumer script Konflux build steps use (docs/architecture.md, "The contract with the Go
/// controller"): error, localhost, or redeem the key from the OTP server and run a command on the
/// host as the build user, with rsync into its directory.
pub const CONSUMER_SCRIPT: &str = r#"#!/bin/bash
set -eu
if [ -e /ssh/error ]; then
  cat /ssh/error
  exit 1
fi
if [ "$(cat /ssh/host)" = localhost ]; then
  echo "built-in-pod"
  exit 0
fi
mkdir -p ~/.ssh
curl --fail --silent --show-error --cacert /ssh/otp-ca -XPOST -d @/ssh/otp "$(cat /ssh/otp-server)" > ~/.ssh/id_rsa
echo "" >> ~/.ssh/id_rsa
chmod 0400 ~/.ssh/id_rsa
SSH="ssh -i $HOME/.ssh/id_rsa -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes"
echo "source of $(context.taskRun.name)" > "$HOME/source.txt"
rsync -e "$SSH" "$HOME/source.txt" "$(cat /ssh/host):$(cat /ssh/user-dir)/"
$SSH "$(cat /ssh/host)" 'echo "built-by=$(whoami) in=$(pwd) source=$(cat source.txt)"'
"#;

/// host-config entries of static host `name` at `address` (user root, admin key in Secret
/// `<name>-admin`).
pub fn static_host(name: &str, address: &str, concurrency: u32, platform: &str) -> ConfigPairs {
    [
        ("address", address.to_owned()),
        ("user", "root".to_owned()),
        ("platform", platform.to_owned()),
        ("secret", format!("{name}-admin")),
        ("concurrency", concurrency.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (format!("host.{name}.{k}"), v))
    .collect()
}

async fn create_namespace(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    api.create(&PostParams::default(), &ns).await?;
    Ok(())
}

fn start_otp(
    mpc: &Path,
    dir: &Path,
    port: u16,
    admin: SocketAddr,
    log: &Path,
) -> anyhow::Result<Proc> {
    let (mpc, dir_) = (mpc.to_owned(), dir.to_owned());
    let make = move || {
        let mut cmd = Command::new(&mpc);
        cmd.arg("otp-server")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--admin-listen", &admin.to_string()])
            .arg("--tls-dir")
            .arg(dir_.join("tls"))
            .arg("--db")
            .arg(dir_.join("otp.redb"))
            .arg("--seal-key-file")
            .arg(dir_.join("seal-key"))
            .arg("--store-token-file")
            .arg(dir_.join("store-token"));
        cmd
    };
    let p = Proc::spawn(make, log.to_owned(), admin, "otp-server")?;
    otp_listening(&p, port)?;
    Ok(p)
}

/// Waits until the OTP server accepts connections on `port`.
fn otp_listening(p: &Proc, port: u16) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "otp-server did not listen: {}",
            p.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Log text without terminal colour codes.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_flags_replace_the_test_timings_of_the_same_name() {
        let flags: Vec<String> = ["--lease-duration", "30s", "--lease-renew-deadline=20s"]
            .map(str::to_owned)
            .to_vec();
        assert_eq!(
            with_overrides(TEST_TIMINGS, &flags),
            [
                "--lease-retry-period",
                "300ms",
                "--adopt-interval",
                "2s",
                "--check-state",
                "1"
            ]
        );
        // A flag that only starts with a default's name is another flag.
        let other = vec!["--lease-duration-max".to_owned(), "1s".to_owned()];
        assert_eq!(with_overrides(TEST_TIMINGS, &other).len(), 10);
    }
}
