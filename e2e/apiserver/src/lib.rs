//! A Kubernetes API server for tests: in-memory, on loopback, spoken to by the real `kubectl` and
//! kube-rs. It follows the documented API semantics (resourceVersions, watches, finalizers,
//! patches, admission webhooks, garbage collection); `e2e/README.md` lists exactly what is covered.
//!
//! Test infrastructure only.

mod admission;
pub mod audit;
mod auth;
mod cel;
mod conformance;
mod controllers;
pub mod faults;
mod http;
mod jsonpath;
pub mod kubectl;
mod meta;
mod openapi;
mod ops;
mod patch;
mod policy;
mod protobuf;
mod render;
mod resources;
mod rules;
mod selector;
mod status;
// Public only for the raw-store benchmark (benches/apiserver.rs).
#[doc(hidden)]
pub mod store;
pub mod testing;
mod watch;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use faults::{Faults, RequestMatch, Verb};
pub use status::ApiError;

use resources::Registry;
use store::Store;

/// Why the server could not start or a request helper failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Binding or I/O.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// Certificates.
    #[error("certificates: {0}")]
    Certs(#[from] mpc::certs::CertsError),
    /// TLS configuration.
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    /// A kube client could not be built.
    #[error("kube client: {0}")]
    Kube(String),
    /// A manifest could not be parsed.
    #[error("manifest: {0}")]
    Manifest(String),
    /// The server refused a request made through a helper.
    #[error("{}", .0.message)]
    Api(ApiError),
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// Events kept for watches; older resourceVersions answer 410 Gone.
    pub history_capacity: usize,
    /// How often watches that asked for bookmarks get one.
    pub bookmark_interval: Duration,
    /// Watch duration when the client sets no `timeoutSeconds` (the apiserver uses 30-60 min).
    pub default_watch_timeout: Duration,
    /// Namespaces that exist from the start.
    pub namespaces: Vec<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// How long a read or watch at a resourceVersion newer than the server's waits for it before
    /// answering "Too large resource version" (the watch cache waits 3 s).
    pub resource_version_wait: Duration,
    /// Authorize every request with the RBAC objects in the store ([`auth`]). Off by default:
    /// most tests' users have no bindings. [`ApiServer::set_rbac`] switches it later.
    pub rbac: bool,
    /// Check every JSON response (objects, lists, Statuses, watch events) against Kubernetes'
    /// published schemas; what does not conform is recorded
    /// ([`ApiServer::nonconforming_responses`]) and fails the test when the server is dropped.
    /// On by default; benchmarks turn it off.
    pub check_responses: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            history_capacity: 10_000,
            bookmark_interval: Duration::from_secs(5),
            default_watch_timeout: Duration::from_secs(1800),
            namespaces: ["default", "kube-system", "kube-public", "kube-node-lease"]
                .map(str::to_owned)
                .to_vec(),
            max_body_bytes: 3 * 1024 * 1024,
            resource_version_wait: Duration::from_secs(3),
            rbac: false,
            check_responses: true,
        }
    }
}

/// State shared by request handlers, watches and the built-in controllers.
pub(crate) struct Shared {
    pub(crate) store: Mutex<Store>,
    pub(crate) registry: RwLock<Registry>,
    pub(crate) changed: tokio::sync::watch::Sender<u64>,
    pub(crate) faults: Faults,
    pub(crate) requests: audit::RequestLog,
    pub(crate) watch_kill: Mutex<CancellationToken>,
    pub(crate) services: Mutex<HashMap<(String, String, u16), SocketAddr>>,
    /// RBAC authorization on ([`Options::rbac`]).
    pub(crate) rbac: std::sync::atomic::AtomicBool,
    /// Responses that did not conform to the schemas ([`Options::check_responses`]).
    pub(crate) nonconforming: Mutex<Vec<String>>,
    pub(crate) opts: Options,
    pub(crate) address: SocketAddr,
}

impl Shared {
    pub(crate) fn registry(&self) -> std::sync::RwLockReadGuard<'_, Registry> {
        self.registry.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes watches and controllers after a write.
    pub(crate) fn notify(&self, rv: u64) {
        self.changed.send_replace(rv);
    }

    /// Waits until the store has reached `rv`, as the watch cache does for reads at a
    /// resourceVersion it has not seen yet; then gives up with "Too large resource version".
    pub(crate) async fn wait_for_rv(&self, rv: u64) -> Result<(), ApiError> {
        // Subscribed before reading the revision, so no write falls between the two.
        let mut changed = self.changed.subscribe();
        let deadline = tokio::time::Instant::now() + self.opts.resource_version_wait;
        loop {
            changed.borrow_and_update();
            let current = self.lock().current_rv();
            if current >= rv {
                return Ok(());
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() {
                    return Err(ApiError::too_large_resource_version(rv, current));
                },
                () = tokio::time::sleep_until(deadline) => {
                    let current = self.lock().current_rv();
                    return Err(ApiError::too_large_resource_version(rv, current));
                }
            }
        }
    }

    /// Records what a response to `request` got wrong.
    pub(crate) fn nonconforming(&self, request: &str, problems: Vec<String>) {
        if problems.is_empty() {
            return;
        }
        for p in &problems {
            tracing::error!(request, problem = %p, "response does not conform to the Kubernetes API schemas");
        }
        self.nonconforming
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(problems.into_iter().map(|p| format!("{request}: {p}")));
    }

    pub(crate) fn watch_token(&self) -> CancellationToken {
        self.watch_kill
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

struct Serving {
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// A running test API server. Dropping it stops serving.
pub struct ApiServer {
    shared: Arc<Shared>,
    tls: Arc<rustls::ServerConfig>,
    https: SocketAddr,
    plain: SocketAddr,
    ca_pem: String,
    serving: tokio::sync::Mutex<Option<Serving>>,
    controllers: CancellationToken,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("https", &self.https)
            .field("plain", &self.plain)
            .finish_non_exhaustive()
    }
}

/// The user (bearer token) of [`ApiServer::kubeconfig_yaml`] and [`ApiServer::kubeconfig_path`].
pub const KUBECONFIG_USER: &str = "e2e-test-token";
/// The user of [`ApiServer::client`].
pub const HARNESS_USER: &str = "e2e-harness";

/// The built-in Tekton CRDs (`tekton.dev` TaskRun and Task, `v1` stored, `v1beta1` served).
pub const TEKTON_CRDS: &str = include_str!("../crds/tekton.yaml");

/// Parses a multi-document YAML (or a single JSON document) into objects, skipping empty ones.
pub fn parse_documents(text: &str) -> Result<Vec<Value>, Error> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).map_err(|e| Error::Manifest(e.to_string()))?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

impl ApiServer {
    /// Starts a server on random 127.0.0.1 ports (HTTPS and plain HTTP).
    pub async fn start(opts: Options) -> Result<Self, Error> {
        mpc::tls::install_crypto_provider();
        let bundle = mpc::certs::generate(
            "e2e-apiserver",
            &["127.0.0.1".to_owned(), "localhost".to_owned()],
            30,
        )?;
        let certs = mpc::tls::parse_certs(bundle.cert_pem.as_bytes(), Path::new("apiserver.crt"))
            .map_err(|e| Error::Manifest(e.to_string()))?;
        use rustls::pki_types::pem::PemObject;
        let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(bundle.key_pem.as_bytes())
            .map_err(|e| Error::Manifest(e.to_string()))?;
        let mut tls = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tls = Arc::new(tls);

        let https_listener = TcpListener::bind("127.0.0.1:0").await?;
        let plain_listener = TcpListener::bind("127.0.0.1:0").await?;
        let https = https_listener.local_addr()?;
        let plain = plain_listener.local_addr()?;

        let (changed, _) = tokio::sync::watch::channel(1);
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(opts.history_capacity)),
            registry: RwLock::new(Registry::with_builtins()),
            changed,
            faults: Faults::default(),
            requests: audit::RequestLog::default(),
            watch_kill: Mutex::new(CancellationToken::new()),
            services: Mutex::new(HashMap::new()),
            rbac: std::sync::atomic::AtomicBool::new(opts.rbac),
            nonconforming: Mutex::new(Vec::new()),
            opts,
            address: https,
        });
        for ns in shared.opts.namespaces.clone() {
            let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            let def = shared
                .registry()
                .get("", "v1", "namespaces")
                .expect("built-in");
            shared
                .create(&def, None, obj, &ops::WriteOpts::internal())
                .await
                .map_err(Error::Api)?;
        }
        let controllers = CancellationToken::new();
        tokio::spawn(controllers::run(Arc::clone(&shared), controllers.clone()));

        let dir = tempfile::Builder::new()
            .prefix("e2e-apiserver-")
            .tempdir()?;
        let server = Self {
            shared,
            tls,
            https,
            plain,
            ca_pem: bundle.ca_pem,
            serving: tokio::sync::Mutex::new(None),
            controllers,
            dir,
        };
        std::fs::write(server.kubeconfig_path(), server.kubeconfig_yaml())?;
        server.serve(https_listener, plain_listener).await;
        Ok(server)
    }

    async fn serve(&self, https: TcpListener, plain: TcpListener) {
        let cancel = CancellationToken::new();
        let app = http::router(Arc::clone(&self.shared));
        let opts = mpc::serve::ServeOptions {
            drain_timeout: Duration::from_millis(500),
            ..Default::default()
        };
        let tasks = vec![
            tokio::spawn(mpc::serve::serve_tls(
                https,
                Arc::clone(&self.tls),
                app.clone(),
                cancel.clone(),
                opts,
            )),
            tokio::spawn(mpc::serve::serve_plain(plain, app, cancel.clone(), opts)),
        ];
        *self.serving.lock().await = Some(Serving { cancel, tasks });
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("https://{}", self.https)
    }

    /// `http://127.0.0.1:<port>` (same API without TLS).
    pub fn plain_url(&self) -> String {
        format!("http://{}", self.plain)
    }

    /// The CA that signed the serving certificate (PEM).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A kubeconfig for this server (TLS, CA embedded, namespace `default`) with the user
    /// [`KUBECONFIG_USER`]: the one [`ApiServer::kubeconfig_path`] holds.
    pub fn kubeconfig_yaml(&self) -> String {
        self.kubeconfig_yaml_as(KUBECONFIG_USER)
    }

    /// Like [`ApiServer::kubeconfig_yaml`], whose bearer token names `user` in the request log.
    pub fn kubeconfig_yaml_as(&self, user: &str) -> String {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(&self.ca_pem);
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: {}\n    certificate-authority-data: {ca}\ncontexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: e2e\n    namespace: default\ncurrent-context: e2e\nusers:\n- name: e2e\n  user:\n    token: {user}\n",
            self.url()
        )
    }

    /// Path of a file holding [`ApiServer::kubeconfig_yaml`] (removed with the server).
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// A kube-rs client for this server, as the user [`HARNESS_USER`] (so the request log tells
    /// the harness's own requests from those of processes given [`ApiServer::kubeconfig_path`]).
    pub async fn client(&self) -> Result<kube::Client, Error> {
        self.client_as(HARNESS_USER).await
    }

    /// A kube-rs client whose bearer token is `user` (a ServiceAccount's is
    /// `system:serviceaccount:<ns>:<name>`): the identity admission policies and, with
    /// [`Options::rbac`], the authorizer see ([`auth`]).
    pub async fn client_as(&self, user: &str) -> Result<kube::Client, Error> {
        let kc = kube::config::Kubeconfig::from_yaml(&self.kubeconfig_yaml_as(user))
            .map_err(|e| Error::Kube(e.to_string()))?;
        let cfg =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Kube(e.to_string()))?;
        kube::Client::try_from(cfg).map_err(|e| Error::Kube(e.to_string()))
    }

    /// Turns RBAC authorization of every request on or off ([`Options::rbac`]).
    pub fn set_rbac(&self, on: bool) {
        self.shared
            .rbac
            .store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Every distinct resource request served so far (with its count), by user.
    pub fn requests(&self) -> &audit::RequestLog {
        &self.shared.requests
    }

    /// Takes what responses so far got wrong against Kubernetes' schemas
    /// ([`Options::check_responses`]); a test that expects some takes them, so the drop check
    /// passes.
    pub fn nonconforming_responses(&self) -> Vec<String> {
        std::mem::take(
            &mut *self
                .shared
                .nonconforming
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Fault injection rules.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// Aborts every open watch connection (clients see the stream break and re-watch).
    pub fn drop_watches(&self) {
        let mut t = self
            .shared
            .watch_kill
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        t.cancel();
        *t = CancellationToken::new();
    }

    /// Drops the whole event history: watches from any earlier resourceVersion get 410 Gone.
    pub fn compact(&self) {
        self.shared.lock().compact();
    }

    /// The latest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().current_rv()
    }

    /// Stops serving (connections and watches are cut), optionally compacts the history, and
    /// serves the same data again on the same ports.
    pub async fn restart(&self, compact: bool) -> Result<(), Error> {
        self.stop_serving().await;
        if compact {
            self.compact();
        }
        let https = bind_again(self.https).await?;
        let plain = bind_again(self.plain).await?;
        self.serve(https, plain).await;
        Ok(())
    }

    async fn stop_serving(&self) {
        let serving = self.serving.lock().await.take();
        self.drop_watches();
        if let Some(s) = serving {
            s.cancel.cancel();
            for t in s.tasks {
                let _ = t.await;
            }
        }
    }

    /// Stops the server and its controllers.
    pub async fn shutdown(self) {
        self.stop_serving().await;
        self.controllers.cancel();
    }

    /// Routes webhook calls for Service `namespace/name:port` to `addr` (the TLS name checked is
    /// still `name.namespace.svc`, as in a cluster).
    pub fn map_service(&self, namespace: &str, name: &str, port: u16, addr: SocketAddr) {
        self.shared
            .services
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((namespace.to_owned(), name.to_owned(), port), addr);
    }

    /// Creates every object of a multi-document YAML through the API (admission included), in
    /// order; returns the created objects.
    pub async fn create_yaml(&self, yaml: &str) -> Result<Vec<Value>, Error> {
        let mut out = Vec::new();
        for doc in parse_documents(yaml)? {
            out.push(self.create(doc).await?);
        }
        Ok(out)
    }

    /// Creates one object (its `apiVersion`, `kind` and `metadata.namespace` say where).
    pub async fn create(&self, obj: Value) -> Result<Value, Error> {
        let def = self.def_for(&obj)?;
        let ns = if def.namespaced {
            Some(
                obj["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_owned(),
            )
        } else {
            None
        };
        self.shared
            .create(&def, ns.as_deref(), obj, &ops::WriteOpts::default())
            .await
            .map_err(Error::Api)
    }

    /// Creates one object and then writes its `status` through the status subresource: the
    /// writes a client makes (`POST`, then `PUT …/status` with the version it read, again from
    /// the newer version after a 409 when another writer, e.g. a controller, came between), with
    /// their resourceVersions and watch events, admission included, without the HTTP round trips.
    /// Loads many objects that already ran (benchmarks) in a fraction of the time. Returns the
    /// stored object.
    pub async fn create_with_status(&self, mut obj: Value) -> Result<Value, Error> {
        let status = obj.as_object_mut().and_then(|o| o.remove("status"));
        let def = self.def_for(&obj)?;
        let mut current = self.create(obj).await?;
        let Some(status) = status else {
            return Ok(current);
        };
        let ns = current["metadata"]["namespace"].as_str().map(str::to_owned);
        let name = current["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        loop {
            let mut put = current;
            put["status"] = status.clone();
            match self
                .shared
                .update(
                    &def,
                    ns.as_deref(),
                    &name,
                    put,
                    meta::UpdateTarget::Status,
                    &ops::WriteOpts::default(),
                )
                .await
            {
                Err(e) if e.code == 409 => {
                    current = self
                        .shared
                        .get(&def, ns.as_deref(), &name)
                        .map_err(Error::Api)?;
                }
                r => return r.map_err(Error::Api),
            }
        }
    }

    /// Stores an object that went through admission elsewhere (the caller applied what the
    /// mutating webhooks would), with its `status`: the stored form, system fields (uid,
    /// creationTimestamp, generation), validation and an ADDED event, as
    /// [`ApiServer::create_with_status`] stores it but in one write and without admission.
    /// Benchmarks load 100,000 large objects this way in seconds. Returns the stored object.
    pub fn restore(&self, mut obj: Value) -> Result<Value, Error> {
        let def = self.def_for(&obj)?;
        let status = obj.as_object_mut().and_then(|o| o.remove("status"));
        let ns = def.namespaced.then(|| {
            obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_owned()
        });
        let mut stored = def.to_storage(obj);
        meta::prepare_create(&def, &mut stored, time::OffsetDateTime::now_utc());
        let name = stored["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let errs = meta::validate(&def, &stored, None);
        if !errs.is_empty() {
            return Err(Error::Api(ApiError::invalid(&def, &name, &errs)));
        }
        if let Some(st) = status {
            stored["status"] = st;
        }
        self.shared
            .commit_create(&def, (ns.unwrap_or_default(), name), stored)
            .map_err(Error::Api)
    }

    /// Reads one object: `get("tekton.dev/v1", "taskruns", Some("ns"), "name")`.
    pub fn get(
        &self,
        api_version: &str,
        plural: &str,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, Error> {
        let (g, v) = split_api_version(api_version);
        let def = self
            .shared
            .registry()
            .get(g, v, plural)
            .ok_or_else(|| Error::Api(ApiError::no_route(plural)))?;
        self.shared.get(&def, namespace, name).map_err(Error::Api)
    }

    /// Registers a MutatingWebhookConfiguration named `name` with one webhook calling `url`
    /// (HTTPS, verified against `ca_pem`) for `operations` on `group/resources` in every version.
    pub async fn register_webhook(
        &self,
        name: &str,
        url: &str,
        ca_pem: &str,
        rule: WebhookRule,
    ) -> Result<Value, Error> {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
        let mut hook = json!({
            "name": format!("{name}.e2e.test"),
            "clientConfig": {"url": url, "caBundle": ca},
            "rules": [{
                "operations": rule.operations,
                "apiGroups": [rule.group],
                "apiVersions": ["*"],
                "resources": rule.resources,
            }],
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "failurePolicy": rule.failure_policy,
            "reinvocationPolicy": rule.reinvocation_policy,
            "timeoutSeconds": rule.timeout_seconds,
        });
        if let Some(s) = rule.object_selector {
            hook["objectSelector"] = s;
        }
        if let Some(s) = rule.namespace_selector {
            hook["namespaceSelector"] = s;
        }
        if !rule.match_conditions.is_empty() {
            hook["matchConditions"] = rule
                .match_conditions
                .iter()
                .enumerate()
                .map(|(i, e)| json!({"name": format!("c{i}"), "expression": e}))
                .collect();
        }
        self.create(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [hook],
        }))
        .await
    }

    fn def_for(&self, obj: &Value) -> Result<Arc<resources::ResourceDef>, Error> {
        let av = obj["apiVersion"].as_str().unwrap_or_default();
        let kind = obj["kind"].as_str().unwrap_or_default();
        let (g, v) = split_api_version(av);
        self.shared
            .registry()
            .find_kind(g, v, kind)
            .ok_or_else(|| Error::Api(ApiError::not_found_kind(av, kind)))
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.controllers.cancel();
        self.drop_watches();
        if let Ok(mut s) = self.serving.try_lock()
            && let Some(s) = s.take()
        {
            s.cancel.cancel();
        }
        let bad = self.nonconforming_responses();
        // A test already failing says why itself; a second panic would abort.
        if !bad.is_empty() && !std::thread::panicking() {
            panic!(
                "the test API server sent {} response(s) kube-apiserver never would:\n{}",
                bad.len(),
                bad.join("\n")
            );
        }
    }
}

async fn bind_again(addr: SocketAddr) -> Result<TcpListener, Error> {
    // The old listener is closed; its port may linger briefly in the kernel.
    let mut last = None;
    for _ in 0..50 {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Err(Error::Io(last.expect("tried at least once")))
}

/// `group/version` → (group, version); `v1` → ("", "v1").
pub fn split_api_version(av: &str) -> (&str, &str) {
    av.rsplit_once('/').unwrap_or(("", av))
}

/// What [`ApiServer::register_webhook`] registers.
#[derive(Debug, Clone)]
pub struct WebhookRule {
    /// API group (`tekton.dev`).
    pub group: String,
    /// Resources (`taskruns`).
    pub resources: Vec<String>,
    /// `CREATE`, `UPDATE`.
    pub operations: Vec<String>,
    /// `Fail` or `Ignore`.
    pub failure_policy: String,
    /// `Never` or `IfNeeded`.
    pub reinvocation_policy: String,
    /// 1..=30.
    pub timeout_seconds: u32,
    /// `objectSelector`.
    pub object_selector: Option<Value>,
    /// `namespaceSelector`.
    pub namespace_selector: Option<Value>,
    /// `matchConditions` expressions.
    pub match_conditions: Vec<String>,
}

impl WebhookRule {
    /// CREATE of `group/resource`, failurePolicy Fail, 10 s.
    pub fn create_of(group: &str, resource: &str) -> Self {
        Self {
            group: group.to_owned(),
            resources: vec![resource.to_owned()],
            operations: vec!["CREATE".to_owned()],
            failure_policy: "Fail".to_owned(),
            reinvocation_policy: "Never".to_owned(),
            timeout_seconds: 10,
            object_selector: None,
            namespace_selector: None,
            match_conditions: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn create_with_status_is_a_create_then_a_status_write() {
        let api = ApiServer::start(Options::default()).await.unwrap();
        api.create_yaml(TEKTON_CRDS).await.unwrap();
        let before = api.resource_version();
        let stored = api
            .create_with_status(json!({
                "apiVersion": "tekton.dev/v1", "kind": "TaskRun",
                "metadata": {"name": "t", "namespace": "default"},
                "spec": {"taskRef": {"name": "x"}},
                "status": {"podName": "t-pod", "conditions": [{"type": "Succeeded", "status": "True"}]},
            }))
            .await
            .unwrap();
        assert_eq!(stored["status"]["podName"], "t-pod");
        assert_eq!(
            stored["metadata"]["resourceVersion"],
            json!((before + 2).to_string())
        );
        assert!(stored["metadata"]["uid"].is_string());
        let events = api.shared.lock().events_after(before).unwrap();
        let kinds: Vec<_> = events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, [store::EventType::Added, store::EventType::Modified]);
        // As a CREATE of a resource with a status subresource: no status until the second write.
        assert!(events[0].object.decode()["status"].is_null());
        assert_eq!(events[1].object.decode()["status"]["podName"], "t-pod");
        assert_eq!(
            api.get("tekton.dev/v1", "taskruns", Some("default"), "t")
                .unwrap()["status"],
            stored["status"]
        );
    }
}
