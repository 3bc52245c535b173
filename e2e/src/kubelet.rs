//! Runs the pods of rendered Deployments as the kubelet would, with podman, so a test exercises the
//! artifact a cluster runs (image, args, env, user, read-only root, capabilities, volumes, limits,
//! probes) instead of host processes started by the harness.
//!
//! Each pod gets its own network namespace (`ip netns`) with only a loopback interface, so two
//! replicas can bind the same `0.0.0.0` ports as on a cluster. The cluster network around them is
//! made of loopback forwarders that open their sockets inside the right namespace (`setns` on a
//! short-lived thread), so no traffic ever leaves 127.0.0.0/8:
//! - every Service of the pods' namespace gets a virtual IP `127.1.<r>.<i>` in each pod (and on the
//!   host, for build steps and the API server's webhook calls), resolved by the name
//!   `<svc>.<ns>.svc` through the container's `/etc/hosts`, and balanced over the ready endpoints
//!   its selector picks (readiness from the spec's probe, as kube-proxy's endpoints would be);
//! - the `kubernetes` Service (`KUBERNETES_SERVICE_HOST`/`PORT`, what in-cluster clients read) is
//!   `127.0.0.1:443` inside each pod, forwarded to the test API server;
//! - addresses given as egress (build hosts) are reachable from each pod at the same address.
//!
//! Volumes are what the kubelet mounts: Secrets and ConfigMaps from the rendered objects (read-only
//! files owned by `fsGroup`), `emptyDir` as a fresh directory (a size-limited tmpfs for
//! `medium: Memory`), a `persistentVolumeClaim` as a directory kept per claim, and the service
//! account token, CA and namespace when the pod mounts them. Nothing else is writable: the root is
//! mounted read-only without podman's extra tmpfs mounts.
//!
//! podman needs, on the build machines, `--runtime runc` and explicit `--ulimit`s; those are
//! harness settings ([`RUNTIME_FLAGS`]), never part of the manifests.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// podman settings this machine needs (crun refuses its cgroup layout; higher limits are refused).
pub const RUNTIME_FLAGS: [&str; 2] = ["--runtime", "runc"];
const RUN_FLAGS: [&str; 4] = [
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

/// Where in-cluster clients find the service account's token, CA and namespace.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `podman` with the harness's runtime flags.
pub fn podman() -> Command {
    let mut c = Command::new("podman");
    c.args(RUNTIME_FLAGS);
    c
}

/// A network namespace with only `lo` (up), removed on drop.
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn create(name: &str) -> anyhow::Result<Arc<Self>> {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        run(Command::new("ip").args(["netns", "add", name]))?;
        let ns = Arc::new(Self {
            name: name.to_owned(),
        });
        run(Command::new("ip").args(["-n", name, "link", "set", "lo", "up"]))?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// Runs `f` on a thread that has entered this namespace: sockets it creates live there.
    fn enter<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T> {
        let path = self.path();
        std::thread::spawn(move || {
            let fd = std::fs::File::open(&path)?;
            // SAFETY: setns only changes this short-lived thread's network namespace.
            if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            f()
        })
        .join()
        .map_err(|_| std::io::Error::other("netns thread panicked"))?
    }

    /// A listener on `addr` inside the namespace.
    pub fn listen(&self, addr: SocketAddr) -> std::io::Result<TcpListener> {
        let l = self.enter(move || {
            let l = std::net::TcpListener::bind(addr)?;
            l.set_nonblocking(true)?;
            Ok(l)
        })?;
        TcpListener::from_std(l)
    }

    /// A connection to `addr` made inside the namespace.
    pub async fn connect(&self, addr: SocketAddr) -> std::io::Result<TcpStream> {
        let socket = self.enter(tokio::net::TcpSocket::new_v4)?;
        socket.connect(addr).await
    }

    /// The TCP addresses something listens on inside the namespace.
    pub fn listening(&self) -> anyhow::Result<Vec<SocketAddr>> {
        let out = run(Command::new("ip").args(["netns", "exec", &self.name, "ss", "-Hltn4"]))?;
        out.lines()
            .filter_map(|l| l.split_whitespace().nth(3))
            .map(|a| {
                a.replace('*', "0.0.0.0")
                    .parse()
                    .with_context(|| format!("ss printed {a:?}"))
            })
            .collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Where a forwarded connection goes.
#[derive(Clone)]
enum Upstream {
    Host(SocketAddr),
    Service(Arc<Endpoints>),
}

impl Upstream {
    async fn connect(&self) -> std::io::Result<TcpStream> {
        match self {
            Upstream::Host(a) => TcpStream::connect(a).await,
            Upstream::Service(e) => e.connect().await,
        }
    }
}

/// The endpoints of one Service port: `(pod, port)` pairs, used while the pod is ready.
#[derive(Default)]
pub struct Endpoints {
    pods: Mutex<Vec<(Arc<PodNet>, u16)>>,
    next: AtomicUsize,
}

impl Endpoints {
    async fn connect(&self) -> std::io::Result<TcpStream> {
        let ready: Vec<_> = self
            .pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(p, _)| p.ready.load(Ordering::SeqCst))
            .cloned()
            .collect();
        if ready.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "no ready endpoint",
            ));
        }
        let (pod, port) = &ready[self.next.fetch_add(1, Ordering::Relaxed) % ready.len()];
        pod.netns
            .connect(SocketAddr::from((Ipv4Addr::LOCALHOST, *port)))
            .await
    }
}

/// Accepts on `listener` and pipes each connection to `upstream`; stops on drop.
struct Forward(tokio::task::JoinHandle<()>);

impl Forward {
    fn start(listener: TcpListener, upstream: Upstream) -> Self {
        Self(tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    if let Ok(mut up) = upstream.connect().await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
            }
        }))
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A pod's network: its namespace and whether its readiness probe passes.
pub struct PodNet {
    pub netns: Arc<Netns>,
    pub ready: AtomicBool,
}

/// One rendered Service of the namespace, with its virtual IP.
struct ServiceVip {
    name: String,
    vip: Ipv4Addr,
    selector: BTreeMap<String, String>,
    /// `(port, targetPort as written, endpoints)`.
    ports: Vec<(u16, Value, Arc<Endpoints>)>,
}

/// A running pod (one container: the manifests' pods have one each).
pub struct Pod {
    pub name: String,
    pub net: Arc<PodNet>,
    pub log: PathBuf,
    /// The container spec as rendered.
    pub container: Value,
    pub labels: BTreeMap<String, String>,
    /// Liveness probe failures so far (the kubelet restarts the container after
    /// `failureThreshold` in a row; here every failure is counted and tests expect none).
    pub liveness_failures: Arc<AtomicU32>,
    pub termination_grace: Duration,
    child: Mutex<Option<std::process::Child>>,
    mounts: Vec<PathBuf>,
    _forwards: Vec<Forward>,
    probes: Vec<tokio::task::JoinHandle<()>>,
}

impl Pod {
    fn container_name(&self) -> String {
        format!(
            "{}-{}",
            self.name,
            self.container["name"].as_str().unwrap_or("c")
        )
    }

    /// The container's main process on the host, while it runs.
    pub fn pid(&self) -> Option<u32> {
        podman()
            .args([
                "inspect",
                "--format",
                "{{.State.Pid}}",
                &self.container_name(),
            ])
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .filter(|p| *p > 0)
    }

    /// The main process's peak resident memory (VmHWM), in bytes.
    pub fn peak_rss(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    }

    /// The container's memory and CPU limits as the runtime applied them (cgroup v1 or v2).
    pub fn applied_limits(&self) -> anyhow::Result<(u64, f64)> {
        let pid = self.pid().context("container not running")?;
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        let path_of = |controller: &str| {
            cgroups.lines().find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
                ctrls
                    .split(',')
                    .any(|c| c == controller)
                    .then(|| path.to_owned())
            })
        };
        if let (Some(mem), Some(cpu)) = (path_of("memory"), path_of("cpu")) {
            let read = |p: String| -> anyhow::Result<String> {
                Ok(std::fs::read_to_string(&p)
                    .with_context(|| p.clone())?
                    .trim()
                    .to_owned())
            };
            let limit = read(format!("/sys/fs/cgroup/memory{mem}/memory.limit_in_bytes"))?;
            let quota: f64 = read(format!("/sys/fs/cgroup/cpu{cpu}/cpu.cfs_quota_us"))?.parse()?;
            let period: f64 =
                read(format!("/sys/fs/cgroup/cpu{cpu}/cpu.cfs_period_us"))?.parse()?;
            return Ok((limit.parse()?, quota / period));
        }
        let path = cgroups
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .context("no cgroup")?;
        let max = std::fs::read_to_string(format!("/sys/fs/cgroup{path}/memory.max"))?;
        let cpu = std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cpu.max"))?;
        let mut cpu = cpu.split_whitespace();
        let (q, p) = (cpu.next().unwrap_or("max"), cpu.next().unwrap_or("100000"));
        Ok((max.trim().parse()?, q.parse::<f64>()? / p.parse::<f64>()?))
    }

    /// Whether the container was killed for exceeding its memory limit.
    pub fn oom_killed(&self) -> bool {
        podman()
            .args([
                "inspect",
                "--format",
                "{{.State.OOMKilled}}",
                &self.container_name(),
            ])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "true")
    }

    /// Still running.
    pub fn alive(&self) -> bool {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn ready(&self) -> bool {
        self.net.ready.load(Ordering::SeqCst)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// What the kubelet does on pod deletion: SIGTERM, then SIGKILL after the grace period.
    /// Returns the exit code, `None` if it had to be killed.
    pub fn terminate(&self) -> Option<i32> {
        let _ = podman()
            .args([
                "stop",
                "--time",
                &self.termination_grace.as_secs().to_string(),
                &self.container_name(),
            ])
            .output();
        let mut child = self
            .child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        let status = child.wait().ok()?;
        status.code().filter(|c| *c != 137)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for p in &self.probes {
            p.abort();
        }
        let _ = podman()
            .args(["rm", "-f", "-t", "0", &self.container_name()])
            .output();
        if let Some(mut c) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for m in &self.mounts {
            let _ = Command::new("umount").arg(m).output();
        }
    }
}

/// What a pod may reach besides Services and the API server.
pub struct ClusterNet {
    /// The test API server's HTTPS address and CA (the `kubernetes` Service).
    pub api: SocketAddr,
    pub api_ca_pem: String,
    /// Addresses (build hosts) reachable from every pod at the same address.
    pub egress: Vec<SocketAddr>,
}

/// The kubelet of one namespace's rendered objects.
pub struct Kubelet {
    namespace: String,
    objects: Vec<Value>,
    net: ClusterNet,
    services: Vec<ServiceVip>,
    dir: PathBuf,
    _tmp: tempfile::TempDir,
    run_id: String,
    /// Host-side listeners of the Services' virtual IPs.
    _host_forwards: Vec<Forward>,
    pods_started: usize,
}

/// A Kubernetes quantity as bytes (`512Mi`, `1G`, `128974848`).
pub fn parse_bytes(q: &str) -> anyhow::Result<u64> {
    let units: [(&str, u64); 10] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("K", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("", 1),
    ];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix)
            && let Ok(n) = n.parse::<f64>()
        {
            return Ok((n * mult as f64) as u64);
        }
    }
    bail!("not a quantity: {q:?}")
}

/// A CPU quantity in cores (`100m`, `1`, `0.5`).
pub fn parse_cpu(q: &str) -> anyhow::Result<f64> {
    match q.strip_suffix('m') {
        Some(m) => Ok(m.parse::<f64>()? / 1000.0),
        None => Ok(q.parse()?),
    }
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect()
}

/// The containerPort a probe's or Service's port (number or name) means in `container`.
pub fn resolve_port(container: &Value, port: &Value) -> anyhow::Result<u16> {
    if let Some(n) = port.as_u64() {
        return Ok(u16::try_from(n)?);
    }
    let name = port.as_str().context("port is neither number nor name")?;
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .map(|n| n as u16)
        .with_context(|| {
            format!(
                "container {} declares no port named {name:?}",
                container["name"]
            )
        })
}

/// Service links the kubelet injects (`enableServiceLinks`, on by default) for a Service.
fn service_env(name: &str, vip: Ipv4Addr, ports: &[(String, u16)]) -> Vec<(String, String)> {
    let prefix = name.to_uppercase().replace('-', "_");
    let mut env = Vec::new();
    let Some((_, first)) = ports.first() else {
        return env;
    };
    env.push((format!("{prefix}_SERVICE_HOST"), vip.to_string()));
    env.push((format!("{prefix}_SERVICE_PORT"), first.to_string()));
    env.push((format!("{prefix}_PORT"), format!("tcp://{vip}:{first}")));
    for (pname, port) in ports {
        if !pname.is_empty() {
            env.push((
                format!(
                    "{prefix}_SERVICE_PORT_{}",
                    pname.to_uppercase().replace('-', "_")
                ),
                port.to_string(),
            ));
        }
        let p = format!("{prefix}_PORT_{port}_TCP");
        env.push((p.clone(), format!("tcp://{vip}:{port}")));
        env.push((format!("{p}_PROTO"), "tcp".into()));
        env.push((format!("{p}_PORT"), port.to_string()));
        env.push((format!("{p}_ADDR"), vip.to_string()));
    }
    env
}

/// One HTTP GET as the kubelet's probe does it (plain HTTP); the status code.
async fn http_get(netns: &Netns, port: u16, path: &str) -> anyhow::Result<u16> {
    let mut s = tokio::time::timeout(
        Duration::from_secs(1),
        netns.connect(SocketAddr::from((Ipv4Addr::LOCALHOST, port))),
    )
    .await??;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: kube-probe/1.33\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(1), s.read_to_end(&mut buf)).await??;
    let line = String::from_utf8_lossy(&buf);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("not an HTTP response: {:?}", line.lines().next()))
}

/// The status code of `GET path` on a pod's port (what a probe sees).
pub async fn get(pod: &Pod, port: u16, path: &str) -> anyhow::Result<u16> {
    http_get(&pod.net.netns, port, path).await
}

impl Kubelet {
    /// A kubelet for the objects of `namespace` among `objects` (a rendered kustomization).
    /// Every Service of the namespace gets its virtual IP now, reachable from the host too.
    pub fn new(namespace: &str, objects: Vec<Value>, net: ClusterNet) -> anyhow::Result<Self> {
        let tmp = tempfile::Builder::new().prefix("mpc-kubelet-").tempdir()?;
        let dir = tmp.path().to_owned();
        let r: u8 = rand::random::<u8>().max(1);
        let run_id = format!("{:06x}", rand::random::<u32>() & 0xff_ffff);
        let mut services = Vec::new();
        let mut host_forwards = Vec::new();
        for (i, svc) in objects
            .iter()
            .filter(|o| o["kind"] == "Service" && o["metadata"]["namespace"] == namespace)
            .enumerate()
        {
            let vip = Ipv4Addr::new(127, 1, r, u8::try_from(i + 1)?);
            let mut ports = Vec::new();
            for p in svc["spec"]["ports"].as_array().into_iter().flatten() {
                let port = u16::try_from(p["port"].as_u64().context("service port")?)?;
                let target = if p["targetPort"].is_null() {
                    Value::from(port)
                } else {
                    p["targetPort"].clone()
                };
                let eps = Arc::new(Endpoints::default());
                let l = std::net::TcpListener::bind((vip, port))
                    .with_context(|| format!("binding {vip}:{port} on the host"))?;
                l.set_nonblocking(true)?;
                host_forwards.push(Forward::start(
                    TcpListener::from_std(l)?,
                    Upstream::Service(eps.clone()),
                ));
                ports.push((port, target, eps));
            }
            services.push(ServiceVip {
                name: svc["metadata"]["name"]
                    .as_str()
                    .context("service name")?
                    .to_owned(),
                vip,
                selector: string_map(&svc["spec"]["selector"]),
                ports,
            });
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            objects,
            net,
            services,
            dir,
            _tmp: tmp,
            run_id,
            _host_forwards: host_forwards,
            pods_started: 0,
        })
    }

    /// The host address of Service `name`'s port `port` (its virtual IP).
    pub fn service_addr(&self, name: &str, port: u16) -> Option<SocketAddr> {
        self.services
            .iter()
            .find(|s| s.name == name)
            .filter(|s| s.ports.iter().any(|(p, _, _)| *p == port))
            .map(|s| SocketAddr::from((s.vip, port)))
    }

    /// The rendered object `kind/name` of the namespace (or cluster-scoped).
    pub fn object(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects.iter().find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && (o["metadata"]["namespace"].is_null()
                    || o["metadata"]["namespace"] == self.namespace.as_str())
        })
    }

    /// Starts every replica of Deployment `name`.
    pub fn start_deployment(&mut self, name: &str) -> anyhow::Result<Vec<Pod>> {
        let d = self
            .object("Deployment", name)
            .with_context(|| format!("no Deployment {name} in the rendered objects"))?
            .clone();
        let replicas = d["spec"]["replicas"].as_u64().unwrap_or(1);
        let template = &d["spec"]["template"];
        // The ReplicaSet's pod-template-hash, as pod names carry it.
        let hash = format!("{:x}", md5_like(&template.to_string()));
        (0..replicas)
            .map(|_| {
                let suffix = format!("{:05x}", rand::random::<u32>() & 0xf_ffff);
                self.start_pod(&format!("{name}-{}-{suffix}", &hash[..8]), template)
            })
            .collect()
    }

    fn start_pod(&mut self, pod_name: &str, template: &Value) -> anyhow::Result<Pod> {
        let spec = &template["spec"];
        let containers = spec["containers"].as_array().context("no containers")?;
        ensure!(
            containers.len() == 1,
            "one container per pod is supported, {pod_name} has {}",
            containers.len()
        );
        let container = containers[0].clone();
        let labels = string_map(&template["metadata"]["labels"]);
        self.pods_started += 1;
        let netns = Netns::create(&format!("mpc-{}-{}", self.run_id, self.pods_started))?;
        let net = Arc::new(PodNet {
            netns: netns.clone(),
            ready: AtomicBool::new(false),
        });
        let pod_dir = self.dir.join(pod_name);
        std::fs::create_dir_all(&pod_dir)?;

        // The network around the pod: the API server, Services, build hosts.
        let mut forwards = Vec::new();
        forwards.push(Forward::start(
            netns.listen(SocketAddr::from((Ipv4Addr::LOCALHOST, 443)))?,
            Upstream::Host(self.net.api),
        ));
        for a in &self.net.egress {
            forwards.push(Forward::start(netns.listen(*a)?, Upstream::Host(*a)));
        }
        let mut env: Vec<(String, String)> = vec![
            ("KUBERNETES_SERVICE_HOST".into(), "127.0.0.1".into()),
            ("KUBERNETES_SERVICE_PORT".into(), "443".into()),
            ("KUBERNETES_SERVICE_PORT_HTTPS".into(), "443".into()),
            ("KUBERNETES_PORT".into(), "tcp://127.0.0.1:443".into()),
            (
                "KUBERNETES_PORT_443_TCP".into(),
                "tcp://127.0.0.1:443".into(),
            ),
            ("KUBERNETES_PORT_443_TCP_PROTO".into(), "tcp".into()),
            ("KUBERNETES_PORT_443_TCP_PORT".into(), "443".into()),
            ("KUBERNETES_PORT_443_TCP_ADDR".into(), "127.0.0.1".into()),
        ];
        let mut hosts = Vec::new();
        // A Service port that is also one of the pod's own container ports is not forwarded in
        // this pod: a real virtual IP is a NAT rule, not a socket, but here the forwarder's
        // socket would keep the container from binding 0.0.0.0 on that port.
        let own_ports: Vec<u64> = container["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["containerPort"].as_u64())
            .collect();
        for s in &mut self.services {
            let mut named = Vec::new();
            for (port, target, eps) in &s.ports {
                if !own_ports.contains(&u64::from(*port)) {
                    forwards.push(Forward::start(
                        netns.listen(SocketAddr::from((s.vip, *port)))?,
                        Upstream::Service(eps.clone()),
                    ));
                }
                let pname = self
                    .objects
                    .iter()
                    .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == s.name.as_str())
                    .and_then(|o| {
                        o["spec"]["ports"]
                            .as_array()?
                            .iter()
                            .find(|p| p["port"] == *port)?["name"]
                            .as_str()
                            .map(str::to_owned)
                    })
                    .unwrap_or_default();
                named.push((pname, *port));
                if !s.selector.is_empty()
                    && s.selector.iter().all(|(k, v)| labels.get(k) == Some(v))
                {
                    let tp = resolve_port(&container, target)?;
                    eps.pods
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((net.clone(), tp));
                }
            }
            if spec["enableServiceLinks"] != false {
                env.extend(service_env(&s.name, s.vip, &named));
            }
            for h in [
                format!("{}.{}.svc", s.name, self.namespace),
                format!("{}.{}.svc.cluster.local", s.name, self.namespace),
                format!("{}.{}", s.name, self.namespace),
                s.name.clone(),
            ] {
                hosts.push(format!("{h}:{}", s.vip));
            }
        }

        let pod_sc = &spec["securityContext"];
        let sc = &container["securityContext"];
        let pick = |k: &str| {
            if sc[k].is_null() {
                pod_sc[k].clone()
            } else {
                sc[k].clone()
            }
        };
        let fs_group = pod_sc["fsGroup"].as_u64().map(|g| g as u32);

        let mut args: Vec<String> = Vec::new();
        let cname = format!(
            "{pod_name}-{}",
            container["name"].as_str().context("container name")?
        );
        args.extend(
            [
                "run",
                "--rm",
                "--pull=never",
                "--name",
                &cname,
                "--hostname",
                pod_name,
            ]
            .map(str::to_owned),
        );
        args.extend(RUN_FLAGS.map(str::to_owned));
        args.push("--network".into());
        args.push(format!("ns:{}", netns.path().display()));
        for h in hosts {
            args.push("--add-host".into());
            args.push(h);
        }
        let uid = pick("runAsUser").as_u64();
        let gid = pick("runAsGroup").as_u64();
        if let Some(uid) = uid {
            args.push("--user".into());
            args.push(match gid {
                Some(g) => format!("{uid}:{g}"),
                None => uid.to_string(),
            });
        }
        if pick("runAsNonRoot") == true {
            ensure!(
                uid.is_some_and(|u| u != 0),
                "{pod_name}: runAsNonRoot without a non-zero runAsUser (the kubelet would check the image's user)"
            );
        }
        if let Some(g) = fs_group {
            args.push("--group-add".into());
            args.push(g.to_string());
        }
        for g in pod_sc["supplementalGroups"]
            .as_array()
            .into_iter()
            .flatten()
        {
            args.push("--group-add".into());
            args.push(g.to_string());
        }
        if sc["readOnlyRootFilesystem"] == true {
            // Without podman's own tmpfs on /tmp, /var/tmp and /run: only declared volumes are
            // writable, as on a cluster.
            args.extend(["--read-only", "--read-only-tmpfs=false"].map(str::to_owned));
        }
        if sc["allowPrivilegeEscalation"] == false {
            args.extend(["--security-opt", "no-new-privileges"].map(str::to_owned));
        }
        for c in sc["capabilities"]["drop"].as_array().into_iter().flatten() {
            args.push("--cap-drop".into());
            args.push(c.as_str().unwrap_or_default().to_owned());
        }
        for c in sc["capabilities"]["add"].as_array().into_iter().flatten() {
            args.push("--cap-add".into());
            args.push(c.as_str().unwrap_or_default().to_owned());
        }
        match pick("seccompProfile")["type"].as_str() {
            None | Some("RuntimeDefault") => {}
            Some("Unconfined") => {
                args.extend(["--security-opt", "seccomp=unconfined"].map(str::to_owned))
            }
            Some(other) => bail!("seccompProfile {other} is not supported by this harness"),
        }
        let limits = &container["resources"]["limits"];
        if let Some(m) = limits["memory"].as_str() {
            args.push("--memory".into());
            args.push(parse_bytes(m)?.to_string());
            // Kubernetes gives a container no swap.
            args.push("--memory-swap".into());
            args.push(parse_bytes(m)?.to_string());
        }
        if let Some(c) = limits["cpu"].as_str() {
            args.push("--cpus".into());
            args.push(parse_cpu(c)?.to_string());
        }

        // Volumes.
        let mut mounts = Vec::new();
        let mut volume_dirs: BTreeMap<String, (PathBuf, bool)> = BTreeMap::new();
        for v in spec["volumes"].as_array().into_iter().flatten() {
            let vname = v["name"].as_str().context("volume name")?.to_owned();
            let host = pod_dir.join("volumes").join(&vname);
            let read_only = if let Some(s) = v.get("secret") {
                let name = s["secretName"].as_str().context("secretName")?;
                let obj = self.object("Secret", name).with_context(|| {
                    format!("{pod_name}: Secret {name} of volume {vname} is not in the rendered objects (the pod would never start)")
                })?;
                let data = decoded_data(obj)?;
                write_files(
                    &host,
                    &data,
                    &s["items"],
                    s["defaultMode"].as_u64(),
                    fs_group,
                )?;
                true
            } else if let Some(c) = v.get("configMap") {
                let name = c["name"].as_str().context("configMap name")?;
                let obj = self.object("ConfigMap", name).with_context(|| {
                    format!("{pod_name}: ConfigMap {name} of volume {vname} is not in the rendered objects")
                })?;
                let data = string_map(&obj["data"])
                    .into_iter()
                    .map(|(k, v)| (k, v.into_bytes()))
                    .collect();
                write_files(
                    &host,
                    &data,
                    &c["items"],
                    c["defaultMode"].as_u64(),
                    fs_group,
                )?;
                true
            } else if let Some(e) = v.get("emptyDir") {
                std::fs::create_dir_all(&host)?;
                if e["medium"] == "Memory" {
                    // A tmpfs sized by sizeLimit (else by the node's memory), as the kubelet mounts.
                    let size = match e["sizeLimit"].as_str() {
                        Some(s) => parse_bytes(s)?.to_string(),
                        None => "50%".to_owned(),
                    };
                    run(Command::new("mount")
                        .args([
                            "-t",
                            "tmpfs",
                            "-o",
                            &format!("size={size},mode=0777"),
                            "tmpfs",
                        ])
                        .arg(&host))?;
                    mounts.push(host.clone());
                }
                own_volume_dir(&host, fs_group, 0o777)?;
                false
            } else if let Some(c) = v.get("persistentVolumeClaim") {
                let claim = c["claimName"].as_str().context("claimName")?;
                ensure!(
                    self.object("PersistentVolumeClaim", claim).is_some(),
                    "{pod_name}: PersistentVolumeClaim {claim} is not in the rendered objects"
                );
                // One directory per claim: it outlives the pod, as a volume does.
                let host = self.dir.join("pv").join(claim);
                std::fs::create_dir_all(&host)?;
                own_volume_dir(&host, fs_group, 0o775)?;
                volume_dirs.insert(vname, (host, c["readOnly"] == true));
                continue;
            } else {
                bail!("{pod_name}: volume {vname} of a type this harness does not mount: {v}");
            };
            volume_dirs.insert(vname, (host, read_only));
        }
        // The service account token, unless the pod opts out (the Deployment's SA has no opt-out).
        if spec["automountServiceAccountToken"] != false {
            let sa = spec["serviceAccountName"].as_str().unwrap_or("default");
            let host = pod_dir.join("volumes/kube-api-access");
            let data = BTreeMap::from([
                (
                    "token".to_owned(),
                    format!("system:serviceaccount:{}:{sa}", self.namespace).into_bytes(),
                ),
                (
                    "ca.crt".to_owned(),
                    self.net.api_ca_pem.clone().into_bytes(),
                ),
                ("namespace".to_owned(), self.namespace.clone().into_bytes()),
            ]);
            write_files(&host, &data, &Value::Null, None, fs_group)?;
            args.push("-v".into());
            args.push(format!("{}:{SERVICE_ACCOUNT_DIR}:ro", host.display()));
        }
        for m in container["volumeMounts"].as_array().into_iter().flatten() {
            let vname = m["name"].as_str().context("volumeMount name")?;
            let (host, ro) = volume_dirs
                .get(vname)
                .with_context(|| format!("{pod_name}: volumeMount {vname} names no volume"))?;
            let mut host = host.clone();
            if let Some(sub) = m["subPath"].as_str() {
                host = host.join(sub);
            }
            let ro = *ro || m["readOnly"] == true;
            args.push("-v".into());
            args.push(format!(
                "{}:{}{}",
                host.display(),
                m["mountPath"].as_str().context("mountPath")?,
                if ro { ":ro" } else { "" }
            ));
        }

        // Environment: the spec's values and field references.
        for e in container["env"].as_array().into_iter().flatten() {
            let name = e["name"].as_str().context("env name")?.to_owned();
            let value = if let Some(v) = e["value"].as_str() {
                v.to_owned()
            } else if let Some(f) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                match f {
                    "metadata.namespace" => self.namespace.clone(),
                    "metadata.name" => pod_name.to_owned(),
                    "status.podIP" | "status.hostIP" => "127.0.0.1".to_owned(),
                    "spec.serviceAccountName" => spec["serviceAccountName"]
                        .as_str()
                        .unwrap_or("default")
                        .to_owned(),
                    other => {
                        bail!("{pod_name}: env {name} references field {other}, not supported")
                    }
                }
            } else {
                bail!("{pod_name}: env {name} has a source this harness does not fill: {e}");
            };
            env.push((name, value));
        }
        for (k, v) in &env {
            args.push("--env".into());
            args.push(format!("{k}={v}"));
        }
        if let Some(cmd) = container["command"].as_array() {
            args.push("--entrypoint".into());
            args.push(serde_json::to_string(cmd)?);
        }
        args.push(container["image"].as_str().context("image")?.to_owned());
        for a in container["args"].as_array().into_iter().flatten() {
            args.push(a.as_str().context("arg")?.to_owned());
        }

        let log = pod_dir.join("container.log");
        let file = std::fs::File::create(&log)?;
        std::fs::write(pod_dir.join("podman-args"), args.join("\n"))?;
        let child = podman()
            .args(&args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .context("starting podman")?;

        let liveness_failures = Arc::new(AtomicU32::new(0));
        let mut probes = Vec::new();
        if let Some(p) = container.get("readinessProbe") {
            let (port, path, period) = probe_target(&container, p)?;
            let net = net.clone();
            probes.push(tokio::spawn(async move {
                loop {
                    let ok = http_get(&net.netns, port, &path)
                        .await
                        .is_ok_and(|c| (200..400).contains(&c));
                    net.ready.store(ok, Ordering::SeqCst);
                    tokio::time::sleep(period).await;
                }
            }));
        } else {
            net.ready.store(true, Ordering::SeqCst);
        }
        if let Some(p) = container.get("livenessProbe") {
            let (port, path, period) = probe_target(&container, p)?;
            let delay = Duration::from_secs(p["initialDelaySeconds"].as_u64().unwrap_or(0));
            let (netns, failures) = (netns.clone(), liveness_failures.clone());
            probes.push(tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                loop {
                    let ok = http_get(&netns, port, &path)
                        .await
                        .is_ok_and(|c| (200..400).contains(&c));
                    if !ok {
                        failures.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(period).await;
                }
            }));
        }
        Ok(Pod {
            name: pod_name.to_owned(),
            net,
            log,
            container,
            labels,
            liveness_failures,
            termination_grace: Duration::from_secs(
                spec["terminationGracePeriodSeconds"].as_u64().unwrap_or(30),
            ),
            child: Mutex::new(Some(child)),
            mounts,
            _forwards: forwards,
            probes,
        })
    }
}

/// Port, path and period of an `httpGet` probe.
fn probe_target(container: &Value, p: &Value) -> anyhow::Result<(u16, String, Duration)> {
    let h = p
        .get("httpGet")
        .context("only httpGet probes are supported")?;
    if h["scheme"].as_str().is_some_and(|s| s != "HTTP") {
        bail!(
            "probe scheme {} is not supported by this harness",
            h["scheme"]
        );
    }
    Ok((
        resolve_port(container, &h["port"])?,
        h["path"].as_str().unwrap_or("/").to_owned(),
        Duration::from_secs(p["periodSeconds"].as_u64().unwrap_or(10)),
    ))
}

/// A Secret's data, decoded.
fn decoded_data(obj: &Value) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    use base64::Engine;
    let mut out = BTreeMap::new();
    for (k, v) in obj["data"].as_object().into_iter().flatten() {
        let b = base64::engine::general_purpose::STANDARD
            // kustomize folds long values over lines; the API's base64 ignores line breaks.
            .decode(v.as_str().unwrap_or_default().replace(['\r', '\n'], ""))
            .with_context(|| format!("data {k} is not base64"))?;
        out.insert(k.clone(), b);
    }
    for (k, v) in string_map(&obj["stringData"]) {
        out.insert(k, v.into_bytes());
    }
    Ok(out)
}

/// Writes a Secret's or ConfigMap's files (all keys, or `items`) as the kubelet does: mode
/// `defaultMode` (0644), group `fsGroup`.
fn write_files(
    dir: &Path,
    data: &BTreeMap<String, Vec<u8>>,
    items: &Value,
    default_mode: Option<u64>,
    fs_group: Option<u32>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let files: Vec<(String, String, Option<u64>)> = match items.as_array() {
        Some(items) => items
            .iter()
            .map(|i| {
                (
                    i["key"].as_str().unwrap_or_default().to_owned(),
                    i["path"].as_str().unwrap_or_default().to_owned(),
                    i["mode"].as_u64(),
                )
            })
            .collect(),
        None => data.keys().map(|k| (k.clone(), k.clone(), None)).collect(),
    };
    for (key, path, mode) in files {
        let bytes = data
            .get(&key)
            .ok_or_else(|| anyhow!("key {key} is not in the object"))?;
        let file = dir.join(&path);
        if let Some(parent) = file.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&file, bytes)?;
        let mode = mode.or(default_mode).unwrap_or(0o644) as u32;
        let mode = if fs_group.is_some() {
            mode | 0o040
        } else {
            mode
        };
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode))?;
        if let Some(g) = fs_group {
            std::os::unix::fs::chown(&file, Some(0), Some(g))?;
        }
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Ownership the kubelet gives a writable volume: root, group `fsGroup` with setgid, `mode`.
fn own_volume_dir(dir: &Path, fs_group: Option<u32>, mode: u32) -> anyhow::Result<()> {
    match fs_group {
        Some(g) => {
            std::os::unix::fs::chown(dir, Some(0), Some(g))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o2000 | mode))?;
        }
        None => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))?,
    }
    Ok(())
}

/// A short stable hash of a string (the pod-template-hash in pod names; any stable hash will do).
fn md5_like(s: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn quantities_parse_as_kubernetes_writes_them() {
        assert_eq!(parse_bytes("512Mi").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1G").unwrap(), 1_000_000_000);
        assert_eq!(parse_bytes("64").unwrap(), 64);
        assert!(parse_bytes("lots").is_err());
        assert_eq!(parse_cpu("100m").unwrap(), 0.1);
        assert_eq!(parse_cpu("1").unwrap(), 1.0);
    }

    #[test]
    fn named_ports_resolve_to_the_container_port() {
        let c = json!({"name": "c", "ports": [{"name": "admin", "containerPort": 8080}]});
        assert_eq!(resolve_port(&c, &json!("admin")).unwrap(), 8080);
        assert_eq!(resolve_port(&c, &json!(9443)).unwrap(), 9443);
        assert!(resolve_port(&c, &json!("webhook")).is_err());
    }

    #[test]
    fn service_links_follow_the_kubelets_names() {
        let env: BTreeMap<_, _> = service_env(
            "mpc-otp",
            Ipv4Addr::new(127, 1, 2, 3),
            &[("https".into(), 443), ("metrics".into(), 8081)],
        )
        .into_iter()
        .collect();
        assert_eq!(env["MPC_OTP_SERVICE_HOST"], "127.1.2.3");
        assert_eq!(env["MPC_OTP_SERVICE_PORT"], "443");
        assert_eq!(env["MPC_OTP_SERVICE_PORT_METRICS"], "8081");
        assert_eq!(env["MPC_OTP_PORT"], "tcp://127.1.2.3:443");
        assert_eq!(env["MPC_OTP_PORT_8081_TCP_ADDR"], "127.1.2.3");
    }
}
