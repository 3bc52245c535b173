//! The controller through its real binaries: the optimised `mpc` (as `mpc-e2e`, built from the
//! same `src/main.rs`), the OTP server, the test API server with the Tekton stand-in, loopback
//! sshd build hosts and moto. Needs root and what `e2e/setup.sh` installs.
//!
//! ```sh
//! cargo bench -p e2e --bench controller                        # every phase but `memory`, `burst`
//! MPC_BENCH=burst,throughput cargo bench -p e2e --bench controller
//! MPC_BENCH=memory MPC_BENCH_TASKRUNS=20000,100000 cargo bench -p e2e --bench controller
//! ```
//!
//! Phases (`MPC_BENCH`, comma-separated; default `latency,handoff,dynamic,throughput`):
//! - `latency`: TaskRun CREATE → its secret with a token, one at a time, static host.
//! - `handoff`: one slot, one TaskRun holding it and one queued behind it; the holder finishes →
//!   the waiter's secret, and the same minus the waiter's provisioning (the controller's log).
//! - `dynamic`: a moto instance whose SSH daemon starts late; SSH answering → secret.
//! - `throughput`: `MPC_BENCH_N` (1,000) TaskRuns through 20 static slots with builds of
//!   0.5–1.5 s; wall time against the sum of build times over 20 slots.
//! - `burst`: `MPC_BENCH_BURST_N` (1,000) TaskRuns created at `MPC_BENCH_BURST_RATE` (100) a
//!   second, paced by the clock (open loop), into 200 static slots (`MPC_BENCH_BURST_HOSTS`, 25
//!   sshd hosts on their own 127.0.0.x addresses, `MPC_BENCH_BURST_CONCURRENCY` 8 each), each
//!   build holding its slot `MPC_BENCH_BURST_BUILD_MS` (1,000) after its secret, so slots stay
//!   free; after one warm-up TaskRun per host, CREATE → secret of those sent while fewer than
//!   the slots were in flight, and where that time goes: the bench's own clock (CREATE sent and
//!   answered, the secret's watch event) against the controller's debug lines of target
//!   `mpc::timing` (watch event received, each job's duration, provisioning's steps).
//!
//! The sshd hosts of every phase but `memory` and `dynamic` each have their own user database
//! (`MPC_BENCH_HOST_USERS`): `memory` (default) a copy of this machine's `/etc` and an empty
//! `/home` on tmpfs, in the host's own mount, PID and IPC namespaces, as a real host has its own
//! (no host waits for another's `/etc/.pwd.lock` or fsyncs, and the cleanup's `/proc` scans see
//! only that host's processes); `disk` the same on this machine's disk (each `useradd` pays its
//! fsyncs, but all hosts share the one disk); `shared` this machine's own, as every host had
//! before (one lock and one disk for all: the disk sets the rate). `MPC_BENCH_HOST_NICE=<n>`
//! runs the hosts at that niceness: they still do all their work (and their CPU is counted), but
//! the controller, the OTP server and the API server, which in production have cores of their
//! own, are served first on this machine's.
//!
//! `latency`, `throughput` and `burst` also print the CPU time (user + system) each party spent
//! per TaskRun, provisioning and removal included: the controller, its SSH master connections,
//! the OTP server, the sshd hosts (sessions and the scripts they ran) and this process (the API
//! server and the Tekton stand-in), from `/proc/<pid>/stat` (valid while other work runs on the
//! machine), and the TaskRun rate this machine's cores could sustain at that cost.
//! - `memory`: `MPC_BENCH_TASKRUNS` Konflux-shaped TaskRuns in the API server (the resolved
//!   `buildah-remote-oci-ta` spec in `status.taskSpec`, ~57 KB each as JSON), half finished, half
//!   queued for the one slot of one host; then the controller starts, lists them, rebuilds its
//!   ledger and serves the oldest queued one; its resident memory 10 s later (VmRSS, and VmHWM
//!   the peak), the CPU time it spent (per 1,000 TaskRuns) and the load average then. The
//!   TaskRuns are loaded in-process before the controller starts, as the API stores them (the
//!   first two through the CREATE and status write a client makes, the rest compared with those
//!   and stored in one write each: `ApiServer::restore`), so the controller lists what it would
//!   have after them; 100,000 in about a minute in a release build. The
//!   controller runs with the shipped lease timings (15 s duration, 10 s renew deadline, 2 s
//!   retry, adoption every 5 min), which replace the harness's short ones through
//!   `Product::controller_flags`: under load the test API server misses 2 s renew deadlines,
//!   and each lost Lease would re-run recovery. `MPC_BENCH_TASK=<Task YAML>` uses that Task's spec instead of the built-in one
//!   of the same shape; `MPC_BENCH_BIN` runs another `mpc` binary (e.g. a wrapper that starts it
//!   under a heap profiler).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};
use e2e::product::Product;
use e2e::sshd::OwnUsers;
use e2e::tekton::Outcome;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::{WatchStreamExt as _, watcher};
use mpc::contract;
use serde_json::{Value, json};
use tokio::sync::Notify;

const MPC: &str = env!("CARGO_BIN_EXE_mpc-e2e");
const PLATFORM: &str = "linux/arm64";

fn main() -> anyhow::Result<()> {
    // Benchmarks log what production would.
    if std::env::var_os("MPC_E2E_LOG").is_none() {
        // SAFETY: before any thread starts.
        unsafe { std::env::set_var("MPC_E2E_LOG", "info,kube=warn") };
    }
    // SAFETY: as above; the controller's log is read back as JSON lines.
    unsafe { std::env::set_var("MPC_LOG_FORMAT", "json") };
    // The controller's environment as the shipped Deployment sets it (freed pages go back to the
    // kernel at once), unless the caller compares another setting.
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: as above.
        unsafe { std::env::set_var("MIMALLOC_PURGE_DELAY", "0") };
    }
    let phases =
        std::env::var("MPC_BENCH").unwrap_or_else(|_| "latency,handoff,dynamic,throughput".into());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        for phase in phases.split(',').map(str::trim) {
            match phase {
                "latency" => latency(env_num("MPC_BENCH_LATENCY_N", 200)).await?,
                "handoff" => handoff(env_num("MPC_BENCH_HANDOFF_N", 50)).await?,
                "dynamic" => dynamic(env_num("MPC_BENCH_DYNAMIC_N", 5)).await?,
                "throughput" => throughput(env_num("MPC_BENCH_N", 1000)).await?,
                "burst" => burst(BurstSetup::from_env()).await?,
                "memory" => {
                    let sizes =
                        std::env::var("MPC_BENCH_TASKRUNS").unwrap_or_else(|_| "20000".into());
                    for n in sizes.split(',') {
                        memory(n.trim().parse().context("MPC_BENCH_TASKRUNS")?).await?;
                    }
                }
                other => bail!("unknown phase {other:?}"),
            }
        }
        Ok(())
    })
}

fn env_num(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// p50, p99 and max of `v`, in ms.
fn summary(v: &mut [Duration]) -> String {
    v.sort();
    let q = |p: f64| v[((v.len() as f64 - 1.0) * p).round() as usize];
    format!(
        "n={} p50={:.1} ms p90={:.1} ms p99={:.1} ms max={:.1} ms",
        v.len(),
        ms(q(0.5)),
        ms(q(0.9)),
        ms(q(0.99)),
        ms(q(1.0))
    )
}

/// When each TaskRun's secret got its token and when it was deleted, from a watch on the
/// product's secrets (what a kubelet would see), with the most held at once by builds still
/// running. A finished build stops holding its slot when the bench ends it ([`Secrets::finished`]):
/// the controller frees the slot in the step that sees the end, while its secret's deletion may
/// land after the next TaskRun's secret (so counting undeleted secrets overstates by those).
#[derive(Default)]
struct Secrets {
    state: Mutex<SecretState>,
    changed: Notify,
}

#[derive(Default)]
struct SecretState {
    served: HashMap<String, Instant>,
    deleted: HashMap<String, Instant>,
    /// Builds the bench ended: no longer holding a slot.
    finished: std::collections::HashSet<String>,
    holding: usize,
    max_holding: usize,
}

impl Secrets {
    fn watch(client: kube::Client) -> Arc<Self> {
        let this = Arc::new(Secrets::default());
        let weak = Arc::downgrade(&this);
        let api: kube::Api<Secret> = kube::Api::all(client);
        let cfg = watcher::Config::default()
            .labels(&format!("{}=true", contract::MULTI_PLATFORM_SECRET_LABEL));
        tokio::spawn(async move {
            // Backing off: once the phase's API server is gone, an immediate retry loop would
            // spin a worker and keep the runtime from shutting down.
            let mut s = watcher(api, cfg).default_backoff().boxed();
            while let Some(ev) = s.next().await {
                // The phase is over.
                let Some(me) = weak.upgrade() else {
                    break;
                };
                let now = Instant::now();
                let (seen, gone) = match ev {
                    Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) => (Some(s), None),
                    Ok(watcher::Event::Delete(s)) => (None, Some(s)),
                    _ => (None, None),
                };
                let mut st = me.state.lock().unwrap();
                if let Some(s) = seen {
                    let has_otp = s.data.as_ref().is_some_and(|d| d.contains_key("otp"));
                    let key = key_of(&s);
                    if has_otp && !st.served.contains_key(&key) {
                        st.served.insert(key, now);
                        st.holding += 1;
                        st.max_holding = st.max_holding.max(st.holding);
                    }
                }
                if let Some(s) = gone {
                    let key = key_of(&s);
                    if st.served.contains_key(&key)
                        && !st.deleted.contains_key(&key)
                        && !st.finished.contains(&key)
                    {
                        st.holding -= 1;
                    }
                    st.deleted.insert(key, now);
                }
                drop(st);
                me.changed.notify_waiters();
            }
        });
        this
    }

    async fn wait(&self, key: &str, deleted: bool, timeout: Duration) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            {
                let st = self.state.lock().unwrap();
                let map = if deleted { &st.deleted } else { &st.served };
                if let Some(t) = map.get(key) {
                    return Ok(*t);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("timed out waiting for the secret of {key} (deleted: {deleted})");
            }
            let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), notified).await;
        }
    }

    /// The bench ended `key`'s build: its slot is free whatever its secret's deletion does.
    fn finished(&self, key: &str) {
        let mut st = self.state.lock().unwrap();
        if st.served.contains_key(key)
            && !st.deleted.contains_key(key)
            && st.finished.insert(key.to_owned())
        {
            st.holding -= 1;
        }
    }

    fn max_holding(&self) -> usize {
        self.state.lock().unwrap().max_holding
    }
}

fn key_of(s: &Secret) -> String {
    let ns = s.metadata.namespace.clone().unwrap_or_default();
    let name = s.metadata.name.clone().unwrap_or_default();
    let tr = name.strip_prefix(contract::SECRET_PREFIX).unwrap_or(&name);
    format!("{ns}/{tr}")
}

/// Starts the product with `hosts` and one controller; the users of `names` are removed from
/// the machine when the product stops, whatever happens.
async fn product(hosts: &[(&str, u32)]) -> anyhow::Result<(Product, Arc<Secrets>)> {
    let own_users = host_users()?;
    let nice = std::env::var("MPC_BENCH_HOST_NICE")
        .ok()
        .map(|n| n.parse::<i32>())
        .transpose()
        .context("MPC_BENCH_HOST_NICE")?;
    println!(
        "hosts' user databases: {} (MPC_BENCH_HOST_USERS); hosts' niceness {} \
         (MPC_BENCH_HOST_NICE); load average {}",
        match own_users {
            None => "shared (this machine's /etc, /home)",
            Some(OwnUsers::Disk) => "each its own, on this machine's disk",
            Some(OwnUsers::Memory) => "each its own, on tmpfs",
        },
        nice.unwrap_or(0),
        loadavg()
    );
    let setup = e2e::sshd::HostSetup {
        own_users,
        nice,
        ..Default::default()
    };
    let mut p = Product::start_with(std::path::Path::new(MPC), hosts, setup).await?;
    p.start_controller("c1").await?;
    let secrets = Secrets::watch(p.client.clone());
    Ok((p, secrets))
}

/// `MPC_BENCH_HOST_USERS`: `memory` (default: each host its own `/etc` and `/home` on tmpfs, so
/// hosts never wait for each other's locks or disk), `disk` (its own, on this machine's disk:
/// real fsyncs, but the hosts share one disk) or `shared` (this machine's, as before: every
/// host's `useradd` takes the one `/etc/.pwd.lock`).
fn host_users() -> anyhow::Result<Option<OwnUsers>> {
    match std::env::var("MPC_BENCH_HOST_USERS").as_deref() {
        Err(_) => Ok(Some(OwnUsers::Memory)),
        Ok("shared") => Ok(None),
        Ok(other) => other.parse().map(Some).context("MPC_BENCH_HOST_USERS"),
    }
}

/// `/proc/loadavg`'s three averages, for the record beside each figure.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn track(p: &Product, ns: &str, name: &str) {
    for h in &p.hosts {
        h.sshd.track_user(&contract::remote_user_name(name, ns));
    }
}

async fn latency(n: usize) -> anyhow::Result<()> {
    let (p, secrets) = product(&[("h1", 2)]).await?;
    let mut times = Vec::new();
    let idle = idle_rate("latency", &p, Duration::from_secs(5)).await;
    let cpu = CpuSample::take(&p);
    // CPU per party from CREATE to the secret (provisioning) and from the finish to the cleanup
    // (removal), after the warm-up.
    let (mut provisioning, mut removal) = ([0.0; 5], [0.0; 5]);
    for i in 0..n + 5 {
        let name = format!("lat-{i}");
        track(&p, "tenant-a", &name);
        let s0 = CpuSample::take(&p);
        let t0 = Instant::now();
        p.create_taskrun("tenant-a", &name, PLATFORM, json!({}))
            .await?;
        let t1 = secrets
            .wait(&format!("tenant-a/{name}"), false, Duration::from_secs(30))
            .await?;
        let s1 = CpuSample::take(&p);
        p.tekton
            .finish("tenant-a", &name, Outcome::Succeeded)
            .await?;
        secrets
            .wait(&format!("tenant-a/{name}"), true, Duration::from_secs(30))
            .await?;
        p.cleaned_up("tenant-a", &name).await;
        // The first few warm connections and caches up.
        if i >= 5 {
            times.push(t1 - t0);
            let s2 = CpuSample::take(&p);
            for (sum, x) in provisioning.iter_mut().zip(s1.since(&s0)) {
                *sum += x;
            }
            for (sum, x) in removal.iter_mut().zip(s2.since(&s1)) {
                *sum += x;
            }
        }
    }
    println!(
        "latency: static TaskRun CREATE -> secret with token: {}",
        summary(&mut times)
    );
    // Each TaskRun was cleaned up (its user removed) before the next.
    CpuSample::take(&p).report("latency", &cpu, n + 5, Some(idle));
    println!("latency: CPU per TaskRun, CREATE -> secret / finish -> cleaned up ({n} TaskRuns):");
    for (i, name) in PARTIES.iter().enumerate() {
        println!(
            "latency:   {name:<32} {:>8.2} ms / {:>8.2} ms",
            provisioning[i] * 1e3 / n.max(1) as f64,
            removal[i] * 1e3 / n.max(1) as f64
        );
    }
    Ok(())
}

/// The controller's logged `elapsed_ms` of every `message` line.
fn logged_ms(p: &Product, message: &str) -> Vec<Duration> {
    let text = std::fs::read_to_string(&p.controllers[0].log).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == message)
        .filter_map(|v| v["elapsed_ms"].as_u64())
        .map(Duration::from_millis)
        .collect()
}

/// The controller's own provisioning time of `taskrun` (its log's `elapsed_ms`).
fn provisioning_ms(p: &Product, taskrun: &str) -> Option<u64> {
    let text = std::fs::read_to_string(&p.controllers[0].log).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "build user provisioned" && v["taskrun"] == taskrun)
        .and_then(|v| v["elapsed_ms"].as_u64())
}

async fn handoff(n: usize) -> anyhow::Result<()> {
    let (p, secrets) = product(&[("h1", 1)]).await?;
    let (mut total, mut net) = (Vec::new(), Vec::new());
    let first = "ho-0";
    track(&p, "tenant-a", first);
    p.create_taskrun("tenant-a", first, PLATFORM, json!({}))
        .await?;
    secrets
        .wait(&format!("tenant-a/{first}"), false, Duration::from_secs(30))
        .await?;
    let mut holder = first.to_owned();
    for i in 1..=n + 2 {
        let next = format!("ho-{i}");
        let ns = if i % 2 == 0 { "tenant-a" } else { "tenant-b" };
        track(&p, ns, &next);
        p.create_taskrun(ns, &next, PLATFORM, json!({})).await?;
        p.wait(Duration::from_secs(30), "the TaskRun queued", || async {
            p.taskrun(ns, &next).await.filter(|t| {
                t["metadata"]["labels"][contract::WAITING_FOR_PLATFORM_LABEL].is_string()
            })
        })
        .await;
        let holder_ns = if (i - 1) % 2 == 0 {
            "tenant-a"
        } else {
            "tenant-b"
        };
        let t0 = Instant::now();
        p.tekton
            .finish(holder_ns, &holder, Outcome::Succeeded)
            .await?;
        let t1 = secrets
            .wait(&format!("{ns}/{next}"), false, Duration::from_secs(30))
            .await?;
        if i > 2 {
            total.push(t1 - t0);
            let prov = provisioning_ms(&p, &next).context("no provisioning time logged")?;
            net.push((t1 - t0).saturating_sub(Duration::from_millis(prov)));
        }
        p.cleaned_up(holder_ns, &holder).await;
        holder = next;
    }
    println!(
        "handoff: holder finished -> next waiter's secret: {}",
        summary(&mut total)
    );
    println!(
        "handoff: the same minus the waiter's provisioning: {}",
        summary(&mut net)
    );
    Ok(())
}

async fn dynamic(n: usize) -> anyhow::Result<()> {
    use e2e::moto::Moto;
    use e2e::sshd::SshdHost;
    const SUBNET: u8 = 7;
    let mut p = Product::start(std::path::Path::new(MPC), &[]).await?;
    let moto = Moto::start().await?;
    let fx = moto.loopback_subnet("us-east-1", SUBNET).await?;
    // The template's admin key pair, shared by its instances.
    let admin = e2e::sshd::AdminKey::generate()?;
    let mut cfg = p.base_config();
    cfg.extend(
        p.moto_platform(&fx, PLATFORM, &admin.private(), "bench-arm64")
            .await?,
    );
    p.set_config(&cfg).await?;
    p.controller_flags = vec!["--ec2-endpoint".into(), moto.endpoint()];
    p.start_controller("c1").await?;
    let secrets = Secrets::watch(p.client.clone());
    let mut times = Vec::new();
    for i in 0..n {
        let name = format!("dyn-{i}");
        p.create_taskrun("tenant-a", &name, PLATFORM, json!({}))
            .await?;
        let id = p
            .wait(Duration::from_secs(60), "the instance launched", || async {
                p.taskrun("tenant-a", &name).await.and_then(|t| {
                    t["metadata"]["annotations"][contract::CLOUD_INSTANCE_ID_ANNOTATION]
                        .as_str()
                        .map(str::to_owned)
                })
            })
            .await;
        // The daemon comes up after the first probe found the instance running (20 s after
        // launch), somewhere inside a probe period.
        tokio::time::sleep(Duration::from_millis(22_000 + 137 * i as u64)).await;
        let at = std::net::Ipv4Addr::new(127, 0, SUBNET, 4 + i as u8);
        let host = SshdHost::start_with(e2e::sshd::HostSetup {
            address: Some(at),
            port: Some(22),
            admin_key: Some(admin.clone()),
            ..Default::default()
        })?;
        host.track_user(&contract::remote_user_name(&name, "tenant-a"));
        let t0 = Instant::now();
        let t1 = secrets
            .wait(&format!("tenant-a/{name}"), false, Duration::from_secs(60))
            .await?;
        times.push(t1 - t0);
        p.tekton
            .finish("tenant-a", &name, Outcome::Succeeded)
            .await?;
        p.cleaned_up("tenant-a", &name).await;
        println!("  dynamic {name} on {id}: {:.0} ms", ms(t1 - t0));
        drop(host);
    }
    println!("dynamic: SSH answers -> secret: {}", summary(&mut times));
    Ok(())
}

async fn throughput(n: usize) -> anyhow::Result<()> {
    let hosts = [("h1", 5), ("h2", 5), ("h3", 5), ("h4", 5)];
    let slots = 20u32;
    let (p, secrets) = product(&hosts).await?;
    let p = Arc::new(p);
    let names: Vec<(String, String, Duration)> = (0..n)
        .map(|i| {
            let ns = ["tenant-a", "tenant-b"][i % 2].to_owned();
            // 0.5-1.5 s, deterministic.
            let build = Duration::from_millis(500 + (i as u64 * 7919) % 1000);
            (ns, format!("tp-{i}"), build)
        })
        .collect();
    for (ns, name, _) in &names {
        track(&p, ns, name);
    }
    let total_build: Duration = names.iter().map(|(_, _, b)| *b).sum();
    let removed = users_removed(&p);
    let idle = idle_rate("throughput", &p, Duration::from_secs(5)).await;
    let cpu = CpuSample::take(&p);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (ns, name, build) in names.clone() {
        let (p, secrets) = (Arc::clone(&p), Arc::clone(&secrets));
        tasks.spawn(async move {
            let created = Instant::now();
            p.create_taskrun(&ns, &name, PLATFORM, json!({})).await?;
            let key = format!("{ns}/{name}");
            let served = secrets.wait(&key, false, Duration::from_secs(900)).await?;
            tokio::time::sleep(build).await;
            // Before the write: once it lands the controller may hand the slot on.
            secrets.finished(&key);
            finish(&p, &ns, &name).await?;
            secrets.wait(&key, true, Duration::from_secs(900)).await?;
            anyhow::Ok(served - created)
        });
    }
    let mut waits = Vec::new();
    while let Some(r) = tasks.join_next().await {
        waits.push(r??);
    }
    let wall = started.elapsed();
    removals_done(&p, removed + n, Duration::from_secs(300)).await;
    let cpu_after = CpuSample::take(&p);
    let ideal = total_build / slots;
    println!(
        "throughput: {n} TaskRuns through {slots} slots: wall {:.1} s, sum of builds {:.1} s \
         (/{slots} = {:.1} s ideal), efficiency {:.0} %, most secrets held at once {}",
        wall.as_secs_f64(),
        total_build.as_secs_f64(),
        ideal.as_secs_f64(),
        100.0 * ideal.as_secs_f64() / wall.as_secs_f64(),
        secrets.max_holding()
    );
    println!(
        "throughput: CREATE -> secret (queueing included): {}",
        summary(&mut waits)
    );
    for (what, message) in [
        ("provisioning", "build user provisioned"),
        ("removal", "build users removed"),
    ] {
        let mut v = logged_ms(&p, message);
        if !v.is_empty() {
            println!("throughput: {what} over SSH as logged: {}", summary(&mut v));
        }
    }
    cpu_after.report("throughput", &cpu, n, Some(idle));
    if secrets.max_holding() > slots as usize {
        bail!("more secrets held at once than slots");
    }
    Ok(())
}

/// The `burst` phase's shape (`MPC_BENCH_BURST_*`).
struct BurstSetup {
    /// TaskRuns measured.
    n: usize,
    /// TaskRuns created per second.
    rate: f64,
    hosts: usize,
    concurrency: u32,
    /// How long each build holds its slot after its secret.
    build: Duration,
}

impl BurstSetup {
    fn from_env() -> Self {
        BurstSetup {
            n: env_num("MPC_BENCH_BURST_N", 1000),
            rate: env_num("MPC_BENCH_BURST_RATE", 100) as f64,
            // 200 slots: a host's concurrency is at most 8 (the host-config's bound).
            hosts: env_num("MPC_BENCH_BURST_HOSTS", 25),
            concurrency: env_num("MPC_BENCH_BURST_CONCURRENCY", 8) as u32,
            build: Duration::from_millis(env_num("MPC_BENCH_BURST_BUILD_MS", 1000) as u64),
        }
    }
}

/// When one burst TaskRun's CREATE was sent and answered, and how many TaskRuns were in flight
/// (created, secret not yet deleted) when it was sent.
struct Sent {
    key: String,
    sent: SystemTime,
    answered: SystemTime,
    in_flight: usize,
}

/// TaskRuns created at `rate` per second (open loop: paced by the clock, not by answers) into
/// `hosts × concurrency` static slots, each finishing `build` after its secret; CREATE → secret
/// while slots are free, and where that time goes ([`breakdown`]).
async fn burst(setup: BurstSetup) -> anyhow::Result<()> {
    // The controller's per-step timing lines (debug, target `mpc::timing`) for the breakdown.
    let log = std::env::var("MPC_E2E_LOG").unwrap_or_default();
    if !log.contains("mpc::timing") {
        // SAFETY: the controller is spawned after this; the variable is only read at spawns.
        unsafe { std::env::set_var("MPC_E2E_LOG", format!("{log},mpc::timing=debug")) };
    }
    let names: Vec<String> = (1..=setup.hosts).map(|i| format!("b{i}")).collect();
    let hosts: Vec<(&str, u32)> = names
        .iter()
        .map(|n| (n.as_str(), setup.concurrency))
        .collect();
    let slots = setup.hosts * setup.concurrency as usize;
    let (p, secrets) = product(&hosts).await?;
    let p = Arc::new(p);
    let addresses: std::collections::BTreeSet<String> =
        p.hosts.iter().map(|h| h.sshd.address()).collect();
    if addresses.len() != setup.hosts {
        bail!("{} sshd hosts share addresses", setup.hosts);
    }
    // One TaskRun per host first, together: every host's SSH master is up, as it is on a
    // controller that has been serving (masters stay up 10 minutes idle).
    let mut warm = tokio::task::JoinSet::new();
    for i in 0..setup.hosts {
        let (p, secrets) = (Arc::clone(&p), Arc::clone(&secrets));
        let name = format!("bw-{i}");
        track(&p, "tenant-a", &name);
        warm.spawn(async move {
            p.create_taskrun("tenant-a", &name, PLATFORM, json!({}))
                .await?;
            let key = format!("tenant-a/{name}");
            secrets.wait(&key, false, Duration::from_secs(120)).await?;
            // Before the write: once it lands the controller may hand the slot on.
            secrets.finished(&key);
            finish(&p, "tenant-a", &name).await?;
            secrets.wait(&key, true, Duration::from_secs(120)).await?;
            anyhow::Ok(())
        });
    }
    while let Some(r) = warm.join_next().await {
        r??;
    }
    let connected = p.controllers[0]
        .log_text()
        .matches("SSH master connected")
        .count();
    println!(
        "burst: {} warm-up TaskRuns served ({connected} SSH masters connected)",
        setup.hosts
    );
    // The warm-up's removals stay out of the burst's CPU figures.
    removals_done(&p, setup.hosts, Duration::from_secs(120)).await;
    let removed = users_removed(&p);
    let idle = idle_rate("burst", &p, Duration::from_secs(5)).await;
    let cpu = CpuSample::take(&p);

    let in_flight = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let every = Duration::from_secs_f64(1.0 / setup.rate);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..setup.n {
        tokio::time::sleep_until((started + every * i as u32).into()).await;
        let ns = ["tenant-a", "tenant-b"][i % 2];
        let name = format!("bu-{i}");
        track(&p, ns, &name);
        let (p, secrets) = (Arc::clone(&p), Arc::clone(&secrets));
        let (in_flight, most) = (Arc::clone(&in_flight), Arc::clone(&most));
        let build = setup.build;
        tasks.spawn(async move {
            use std::sync::atomic::Ordering::SeqCst;
            let now = in_flight.fetch_add(1, SeqCst);
            most.fetch_max(now + 1, SeqCst);
            let (created, sent) = (Instant::now(), SystemTime::now());
            p.create_taskrun(ns, &name, PLATFORM, json!({})).await?;
            let answered = SystemTime::now();
            let key = format!("{ns}/{name}");
            let served = secrets.wait(&key, false, Duration::from_secs(300)).await?;
            tokio::time::sleep(build).await;
            // Before the write: once it lands the controller may hand the slot on.
            secrets.finished(&key);
            finish(&p, ns, &name).await?;
            secrets.wait(&key, true, Duration::from_secs(300)).await?;
            in_flight.fetch_sub(1, SeqCst);
            let sent = Sent {
                key,
                sent,
                answered,
                in_flight: now,
            };
            anyhow::Ok((sent, served - created))
        });
    }
    let created_in = started.elapsed();
    let mut runs = Vec::new();
    while let Some(r) = tasks.join_next().await {
        runs.push(r??);
    }
    let wall = started.elapsed();
    removals_done(&p, removed + setup.n, Duration::from_secs(300)).await;
    let cpu_after = CpuSample::take(&p);
    let most = most.load(std::sync::atomic::Ordering::SeqCst);
    let mut free: Vec<Duration> = runs
        .iter()
        .filter(|(s, _)| s.in_flight < slots)
        .map(|(_, d)| *d)
        .collect();
    println!(
        "burst: {} TaskRuns created at {}/s (all sent in {:.1} s) into {slots} slots on {} \
         hosts, builds of {} ms; done in {:.1} s; most in flight at once {most}, most secrets \
         held at once {}",
        setup.n,
        setup.rate,
        created_in.as_secs_f64(),
        setup.hosts,
        setup.build.as_millis(),
        wall.as_secs_f64(),
        secrets.max_holding()
    );
    println!(
        "burst: CREATE -> secret with token, slots free: {}",
        summary(&mut free)
    );
    let anchor = (Instant::now(), SystemTime::now());
    let sent: Vec<Sent> = runs.into_iter().map(|(s, _)| s).collect();
    breakdown(&p, &secrets, &sent, anchor)?;
    cpu_after.report("burst", &cpu, setup.n, Some(idle));
    if secrets.max_holding() > slots {
        bail!("more secrets held at once than slots");
    }
    Ok(())
}

/// One step of [`breakdown`]: its name and each TaskRun's time in it.
type Step = (&'static str, Vec<Duration>);

/// Where CREATE → secret goes, per TaskRun, from the bench's own clock (CREATE sent and
/// answered, the secret seen by its watch) and the controller's timing lines (target
/// `mpc::timing`: the TaskRun's watch event received, each job's duration, provisioning's
/// steps) and its "build user provisioned" line (the SSH command's parts). Steps in order; the
/// Record patch runs beside provisioning (the secret write waits for it).
fn breakdown(
    p: &Product,
    secrets: &Secrets,
    sent: &[Sent],
    (now, wall_now): (Instant, SystemTime),
) -> anyhow::Result<()> {
    use time::format_description::well_known::Rfc3339;
    let wall = |i: Instant| wall_now - now.saturating_duration_since(i);
    // Per TaskRun key: when it was logged (the first line of each kind) and the line.
    let mut lines: HashMap<(String, String), (SystemTime, Value)> = HashMap::new();
    for l in p.controllers[0].log_text().lines() {
        let Ok(v) = serde_json::from_str::<Value>(l) else {
            continue;
        };
        let (Some(ns), Some(name), Some(ts)) = (
            v["namespace"].as_str(),
            v["taskrun"].as_str(),
            v["timestamp"].as_str(),
        ) else {
            continue;
        };
        let Ok(at) = time::OffsetDateTime::parse(ts, &Rfc3339) else {
            continue;
        };
        let what = match (v["message"].as_str(), v["kind"].as_str()) {
            (Some("job finished"), Some(kind)) => kind.to_owned(),
            (Some(m), _) => m.to_owned(),
            _ => continue,
        };
        lines
            .entry((format!("{ns}/{name}"), what))
            .or_insert((SystemTime::from(at), v));
    }
    let us = |v: &Value, f: &str| v[f].as_u64().map(Duration::from_micros);
    let since = |a: SystemTime, b: SystemTime| a.duration_since(b).unwrap_or_default();
    let mut steps: Vec<Step> = [
        "CREATE answered (admission webhook, store)",
        "watch event reaches the controller",
        "loop: event -> provisioning starts (job caps)",
        "  admin key Secret read",
        "  SSH permit (all hosts)",
        "  key generation",
        "  host session permit",
        "  SSH master check / connect",
        "  provisioning script",
        "  host key record",
        "  TaskRun read (retries)",
        "  OTP store",
        "provisioning job (sum of the above)",
        "loop: result -> secret write starts (caps, Record)",
        "secret write (TaskRun read, create)",
        "secret reaches the bench's watch",
        "Record patch (beside provisioning)",
    ]
    .into_iter()
    .map(|n| (n, Vec::new()))
    .collect();
    // Per TaskRun: the controller's side is everything but the provisioning script on the host
    // (admission, watch, job caps, SSH permits, master check, OTP store, secret write, the
    // watch back); the waits for an SSH job's place and permits are shown apart too, since
    // hosts slower than the rate fill them.
    let mut sums: Vec<Step> = [
        "CREATE -> secret",
        "controller side (all but the provisioning script)",
        "  of which waiting for an SSH job place and permits",
        "  the rest: the controller's own steps",
        "hosts' share: the provisioning script",
    ]
    .into_iter()
    .map(|n| (n, Vec::new()))
    .collect();
    let mut missing = 0;
    for s in sent {
        let get = |what: &str| lines.get(&(s.key.clone(), what.to_owned()));
        let (
            Some((received, _)),
            Some((prov_end, prov)),
            Some((_, stepv)),
            Some((_, user)),
            Some((ws_end, ws)),
            Some((_, rec)),
            Some(served),
        ) = (
            get("TaskRun event received"),
            get("provision"),
            get("provisioning steps"),
            get("build user provisioned"),
            get("write_secret"),
            get("record"),
            secrets.state.lock().unwrap().served.get(&s.key).copied(),
        )
        else {
            missing += 1;
            continue;
        };
        let prov_job = us(prov, "elapsed_us").unwrap_or_default();
        let prov_start = *prov_end - prov_job;
        let ws_job = us(ws, "elapsed_us").unwrap_or_default();
        let ws_start = *ws_end - ws_job;
        let total = since(wall(served), s.sent);
        let script = us(user, "script_us").unwrap_or_default();
        let prov_job_us = us(prov, "elapsed_us").unwrap_or_default();
        // A place among the SSH jobs, then the permits: taken by jobs waiting for the hosts.
        let permits = since(*prov_end - prov_job_us, *received)
            + us(stepv, "ssh_permit_us").unwrap_or_default()
            + us(user, "permit_us").unwrap_or_default();
        sums[0].1.push(total);
        sums[1].1.push(total.saturating_sub(script));
        sums[2].1.push(permits);
        sums[3].1.push(total.saturating_sub(script + permits));
        sums[4].1.push(script);
        let vals = [
            Some(since(s.answered, s.sent)),
            Some(since(*received, s.answered)),
            Some(since(prov_start, *received)),
            us(stepv, "admin_key_us"),
            us(stepv, "ssh_permit_us"),
            us(user, "keygen_us"),
            us(user, "permit_us"),
            us(user, "session_us"),
            us(user, "script_us"),
            us(stepv, "known_host_us"),
            us(stepv, "taskrun_read_us"),
            us(stepv, "otp_us"),
            Some(prov_job),
            Some(since(ws_start, *prov_end)),
            Some(ws_job),
            Some(since(wall(served), *ws_end)),
            us(rec, "elapsed_us"),
        ];
        for ((_, v), x) in steps.iter_mut().zip(vals) {
            v.extend(x);
        }
    }
    println!(
        "burst: where CREATE -> secret goes ({} TaskRuns; {missing} without every timing line):",
        sent.len() - missing
    );
    for (name, v) in &mut steps {
        if !v.is_empty() {
            let mean = v.iter().sum::<Duration>() / v.len() as u32;
            println!("burst:   {name:<56} mean={:.1} ms {}", ms(mean), summary(v));
        }
    }
    println!("burst: per TaskRun, the controller's side against the hosts':");
    for (name, v) in &mut sums {
        if !v.is_empty() {
            let mean = v.iter().sum::<Duration>() / v.len() as u32;
            println!("burst:   {name:<56} mean={:.1} ms {}", ms(mean), summary(v));
        }
    }
    Ok(())
}

/// The parties whose CPU time the bench accounts, in [`CpuSample::parties`]'s order.
const PARTIES: [&str; 5] = [
    "controller (mpc controller)",
    "its SSH masters (ssh -f)",
    "OTP server",
    "sshd hosts (sessions, scripts)",
    "bench (API server, Tekton)",
];

/// The sampler's own CPU time so far (ns), which lands in the bench's figure and is taken out.
static SAMPLER_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64
}

/// CPU time (user + system) each party has spent so far, from `/proc/<pid>/stat`: per-process
/// accounting stays valid while other work runs on the machine, which whole-machine `/proc/stat`
/// deltas do not. A party is a process tree summed over its members' own time plus their reaped
/// children's (`cutime`, `cstime`): a session or script that exited counts once a member reaped
/// it, a live one by itself, so the difference of two samples is what the tree spent in between
/// (less what exited unreaped by a member, e.g. a daemon).
#[derive(Clone, Copy)]
struct CpuSample {
    at: Instant,
    /// Seconds of CPU per party ([`PARTIES`]): the controllers and their child processes; their
    /// SSH master connections (`ssh -f` detaches from the controller's tree, so they are found by
    /// their command line, which names the product's directory); the OTP server; every sshd host
    /// (the listener, its connection and session processes, the scripts run); this process alone
    /// (threads included: the test API server, the Tekton stand-in and the bench's clients,
    /// without the sampler's own time).
    parties: [f64; 5],
    /// Busy seconds of the whole machine (every CPU), whatever runs on it: context only.
    machine: f64,
}

/// One process's line of `/proc/<pid>/stat`.
struct ProcTicks {
    comm: String,
    ppid: u32,
    /// utime + stime.
    own: u64,
    /// cutime + cstime: reaped descendants.
    reaped: u64,
}

fn proc_ticks(pid: u32) -> Option<ProcTicks> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is parenthesised and may contain spaces: fields follow the last ')'.
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|s| s.parse::<u64>().ok());
    // After the name: state, ppid, ..., utime (11), stime (12), cutime (13), cstime (14).
    Some(ProcTicks {
        comm,
        ppid: n(1)? as u32,
        own: n(11)? + n(12)?,
        reaped: n(13)? + n(14)?,
    })
}

fn machine_busy_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| cpu.get(i)).sum()
}

impl CpuSample {
    fn take(p: &Product) -> Self {
        let started = thread_cpu_ns();
        let mut table = HashMap::new();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            if let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok())
                && let Some(t) = proc_ticks(pid)
            {
                table.insert(pid, t);
            }
        }
        let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
        for (&pid, t) in &table {
            children.entry(t.ppid).or_default().push(pid);
        }
        let mut counted = std::collections::HashSet::new();
        let mut tree = |root: u32| {
            let mut sum = 0;
            let mut todo = vec![root];
            while let Some(pid) = todo.pop() {
                if !counted.insert(pid) {
                    continue;
                }
                if let Some(t) = table.get(&pid) {
                    sum += t.own + t.reaped;
                }
                todo.extend(children.get(&pid).into_iter().flatten());
            }
            sum
        };
        let controller: u64 = p
            .controllers
            .iter()
            .filter_map(|c| c.pid())
            .map(&mut tree)
            .sum();
        let dir = p.dir.path().to_string_lossy().into_owned();
        let masters: Vec<u32> = table
            .iter()
            .filter(|(_, t)| t.comm == "ssh")
            .map(|(&pid, _)| pid)
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(dir.as_str()))
            })
            .collect();
        let masters: u64 = masters.into_iter().map(&mut tree).sum();
        let otp = p.otp.pid().map(&mut tree).unwrap_or(0);
        let sshd: u64 = p
            .hosts
            .iter()
            .filter_map(|h| h.sshd.pid())
            .map(&mut tree)
            .sum();
        let machine = machine_busy_ticks();
        // Every sampler's time up to this read is in the bench's ticks: taken out.
        use std::sync::atomic::Ordering::SeqCst;
        let read = thread_cpu_ns();
        let sampler = SAMPLER_NS.fetch_add(read - started, SeqCst) + (read - started);
        let bench = proc_ticks(std::process::id()).map_or(0, |t| t.own);
        SAMPLER_NS.fetch_add(thread_cpu_ns() - read, SeqCst);
        let hz = clock_ticks_per_s();
        let s = |t: u64| t as f64 / hz;
        CpuSample {
            at: Instant::now(),
            parties: [
                s(controller),
                s(masters),
                s(otp),
                s(sshd),
                s(bench) - sampler as f64 / 1e9,
            ],
            machine: s(machine),
        }
    }

    /// What each party spent from `before` to `self`.
    fn since(&self, before: &CpuSample) -> [f64; 5] {
        std::array::from_fn(|i| (self.parties[i] - before.parties[i]).max(0.0))
    }

    /// Prints what each party spent per TaskRun between `before` and `self` (and that less its
    /// `idle` rate over the window, when known: the cost the TaskRuns added), and the rate of
    /// TaskRuns this machine's cores could sustain at that cost.
    fn report(&self, phase: &str, before: &CpuSample, taskruns: usize, idle: Option<[f64; 5]>) {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let wall = (self.at - before.at).as_secs_f64();
        let spent = self.since(before);
        let per: Vec<f64> = spent
            .iter()
            .map(|s| s * 1e3 / taskruns.max(1) as f64)
            .collect();
        let total: f64 = per.iter().sum();
        println!(
            "{phase}: CPU per TaskRun (user + system, /proc/<pid>/stat), {taskruns} TaskRuns \
             over {wall:.1} s:"
        );
        for (i, (name, v)) in PARTIES.iter().zip(&per).enumerate() {
            let net = idle.map_or(String::new(), |idle| {
                let added = (spent[i] - idle[i] * wall).max(0.0);
                format!(
                    ", {:.2} ms above idle",
                    added * 1e3 / taskruns.max(1) as f64
                )
            });
            println!(
                "{phase}:   {name:<32} {v:>8.2} ms  ({:.2} cores over the window{net})",
                v * taskruns as f64 / 1e3 / wall
            );
        }
        let sustain = |ms_per: f64, cores: f64| cores * 1e3 / ms_per;
        println!(
            "{phase}:   {:<32} {total:>8.2} ms  -> {cores:.0} cores sustain at most {:.1} \
             TaskRuns/s",
            "total",
            sustain(total, cores)
        );
        let side = per[0] + per[1] + per[2];
        println!(
            "{phase}:   controller side (controller, SSH masters, OTP) {side:.2} ms -> {:.1} \
             TaskRuns/s per core; sshd hosts {:.2} ms -> {:.1} TaskRuns/s per host core",
            sustain(side, 1.0),
            per[3],
            sustain(per[3], 1.0)
        );
        println!(
            "{phase}:   whole machine over the window: {:.2} of {cores:.0} cores busy (anything \
             else running included); load average now {}",
            (self.machine - before.machine) / wall,
            loadavg()
        );
    }
}

/// CPU seconds per second each party spends with nothing in flight, over `span`.
async fn idle_rate(phase: &str, p: &Product, span: Duration) -> [f64; 5] {
    let before = CpuSample::take(p);
    tokio::time::sleep(span).await;
    let after = CpuSample::take(p);
    let wall = (after.at - before.at).as_secs_f64();
    let rate = after.since(&before).map(|s| s / wall);
    let text: Vec<String> = PARTIES
        .iter()
        .zip(rate)
        .map(|(name, r)| format!("{name} {:.1}", r * 1e3))
        .collect();
    println!(
        "{phase}: idle CPU ({:.0} s, nothing in flight), ms per s: {}",
        wall,
        text.join(", ")
    );
    rate
}

/// Build users the controller has logged as removed so far.
fn users_removed(p: &Product) -> usize {
    p.controllers[0]
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["message"] == "build users removed")
        .map(|v| match &v["users"] {
            Value::Array(a) => a.len(),
            // A `?users` field: the Debug text of the list.
            Value::String(s) => s.matches("u-").count(),
            _ => 0,
        })
        .sum()
}

/// Waits (up to `limit`) until the controller has removed `n` build users in all, so a CPU
/// sample taken next includes the removals; says so when it gives up.
async fn removals_done(p: &Product, n: usize, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let done = users_removed(p);
        if done >= n {
            return;
        }
        if Instant::now() > deadline {
            println!("  (only {done} of {n} build users removed after {limit:?})");
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Ends the TaskRun's attempt once the Tekton stand-in has started its pod (with a thousand
/// TaskRuns created at once, it may start one after the controller served it).
async fn finish(p: &Product, ns: &str, name: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        match p.tekton.finish(ns, name, Outcome::Succeeded).await {
            Ok(_) => return Ok(()),
            Err(e @ e2e::tekton::Error::State(..)) if Instant::now() > deadline => {
                return Err(e.into());
            }
            Err(e2e::tekton::Error::State(..)) => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// VmRSS, VmHWM (its peak) and RssAnon (the heap and stacks, without the mapped binary) of `pid`,
/// in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<(u64, u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("{k} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?, field("RssAnon:")?))
}

/// Loads `n` Konflux-shaped TaskRuns ([`konflux`]): even ones finished, odd ones started and
/// waiting for their secret, queued for `PLATFORM` (as a previous leader left them: labelled, with
/// their finalizer). Returns the JSON size of the largest and the queued ones' `(namespace, name)`.
///
/// The first two go through the API as a client writes them (CREATE with admission, then the
/// status write: [`e2e_apiserver::ApiServer::create_with_status`]; the product's webhook is not
/// up yet, and its registration ignores failures, so admission leaves them as they are). The rest
/// are stored as those were, in one write each ([`e2e_apiserver::ApiServer::restore`]); the two
/// written through the API are rebuilt the same way and compared, so the shortcut stores what
/// the API stores. 100,000 then load in about a minute instead of half an hour.
async fn load_konflux(
    p: &Product,
    n: usize,
    task_spec: &Value,
) -> anyhow::Result<(usize, Vec<(String, String)>)> {
    let admitted = |i: usize| -> anyhow::Result<(konflux::TaskRun, Value)> {
        let tr = konflux::TaskRun::new(i, i % 2 == 1, PLATFORM);
        let mut obj = tr.object();
        obj["status"] = tr.status(task_spec);
        Ok((tr, obj))
    };
    // What differs between two stores of the same TaskRun: its identity and times.
    let comparable = |mut v: Value| {
        let m = &mut v["metadata"];
        for f in [
            "uid",
            "creationTimestamp",
            "resourceVersion",
            "managedFields",
        ] {
            m.as_object_mut().map(|m| m.remove(f));
        }
        v
    };
    let (mut largest, mut queued) = (0, Vec::new());
    let started = Instant::now();
    for i in 0..n {
        if i > 0 && i % 20_000 == 0 {
            println!(
                "memory: {i} TaskRuns loaded after {:.0} s",
                started.elapsed().as_secs_f64()
            );
        }
        let (tr, obj) = admitted(i)?;
        let stored = if i < 2 {
            let mut through_api = tr.object();
            through_api["status"] = tr.status(task_spec);
            let stored = p.api.create_with_status(through_api).await?;
            let mut rebuilt = obj;
            rebuilt["apiVersion"] = stored["apiVersion"].clone();
            rebuilt["kind"] = stored["kind"].clone();
            for f in ["generation", "namespace"] {
                rebuilt["metadata"][f] = stored["metadata"][f].clone();
            }
            if comparable(stored.clone()) != comparable(rebuilt.clone()) {
                bail!(
                    "TaskRun {i} as admission stored it differs from its rebuilt form:\n{}\n{}",
                    comparable(stored),
                    comparable(rebuilt)
                );
            }
            stored
        } else {
            p.api.restore(obj)?
        };
        largest = largest.max(serde_json::to_vec(&stored)?.len());
        if tr.queued {
            queued.push((tr.namespace, tr.name));
        }
    }
    Ok((largest, queued))
}

/// The Task spec the memory phase's TaskRuns carry as resolved: `MPC_BENCH_TASK` names a Task
/// YAML file (e.g. `buildah-remote-oci-ta` from konflux-ci/build-definitions), else
/// [`konflux::buildah_remote_task_spec`], a Task of the same shape.
fn memory_task_spec() -> anyhow::Result<Value> {
    match std::env::var_os("MPC_BENCH_TASK") {
        Some(path) => {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.to_string_lossy()))?;
            let task: Value = serde_norway::from_str(&text).context("MPC_BENCH_TASK")?;
            let spec = task["spec"].clone();
            if !spec.is_object() {
                bail!("MPC_BENCH_TASK: no spec");
            }
            Ok(spec)
        }
        None => Ok(konflux::buildah_remote_task_spec()),
    }
}

async fn memory(n: usize) -> anyhow::Result<()> {
    let bin = std::env::var("MPC_BENCH_BIN").unwrap_or_else(|_| MPC.to_owned());
    let mut p = Product::start(std::path::Path::new(&bin), &[("h1", 1)]).await?;
    // The shipped lease and adoption timings, not the harness's short ones: a loaded test API
    // server misses 2 s renewal deadlines, and every lost Lease re-runs recovery.
    p.controller_flags = [
        "--lease-duration=15s",
        "--lease-renew-deadline=10s",
        "--lease-retry-period=2s",
        "--adopt-interval=5m",
    ]
    .map(str::to_owned)
    .to_vec();
    let task_spec = memory_task_spec()?;
    let loaded = Instant::now();
    let (largest, queued) = load_konflux(&p, n, &task_spec).await?;
    println!(
        "memory: {n} Konflux-shaped TaskRuns loaded in {:.0} s ({} queued; resolved Task spec {} \
         bytes, largest TaskRun {largest} bytes as JSON)",
        loaded.elapsed().as_secs_f64(),
        queued.len(),
        serde_json::to_vec(&task_spec)?.len(),
    );
    let secrets = Secrets::watch(p.client.clone());
    let started = Instant::now();
    let i = p.start_controller("c1").await?;
    let pid = p.controllers[i].pid().context("controller pid")?;
    // Listed, indexed, ledger rebuilt (and with TaskRuns queued, the oldest got the host's slot).
    let log = p.controllers[i].log.clone();
    let deadline = Instant::now() + Duration::from_secs(900);
    let served = loop {
        let served: Vec<String> = secrets
            .state
            .lock()
            .unwrap()
            .served
            .keys()
            .cloned()
            .collect();
        let rebuilt = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("ledger rebuilt; scheduling");
        if rebuilt && (queued.is_empty() || !served.is_empty()) {
            break served;
        }
        if Instant::now() > deadline {
            bail!("the controller was not serving within 900 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let ready = started.elapsed();
    // Its build user is removed when the host stops (the others never got one).
    for key in &served {
        let (ns, name) = key.split_once('/').context("secret key")?;
        track(&p, ns, name);
    }
    let cpu = |pid| proc_ticks(pid).map_or(0.0, |t| t.own as f64 / clock_ticks_per_s());
    let cpu_serving = cpu(pid);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (rss, hwm, anon) = rss_kib(pid)?;
    let cpu_steady = cpu(pid);
    let mib = |k: u64| k as f64 / 1024.0;
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "memory: {n} TaskRuns: controller serving after {:.1} s; VmRSS {:.1} MiB (RssAnon {:.1} \
         MiB), peak (VmHWM) {:.1} MiB; CPU (user+system) {:.2} s to serving ({:.3} s per 1,000 \
         TaskRuns), {:.2} s in the 10 s after; load average {}",
        ready.as_secs_f64(),
        mib(rss),
        mib(anon),
        mib(hwm),
        cpu_serving,
        cpu_serving / (n as f64 / 1000.0),
        cpu_steady - cpu_serving,
        loadavg.trim(),
    );
    if served.len() != usize::from(!queued.is_empty()) {
        bail!("{} TaskRuns served on a host with one slot", served.len());
    }
    Ok(())
}

/// TaskRuns as Konflux creates them for a `buildah-remote-oci-ta` build: a PipelineRun's task
/// (labels and annotations from Pipelines as Code, Tekton, Chains and Results), params from the
/// pipeline, the Task from a bundle, and the resolved spec in `status.taskSpec`.
mod konflux {
    use std::fmt::Write as _;

    use mpc::contract;
    use serde_json::{Map, Value, json};

    /// The Task's params: name, array-typed, default.
    const PARAMS: &[(&str, bool, Option<&str>)] = &[
        ("ACTIVATION_KEY", false, Some("activation-key")),
        ("ADDITIONAL_BASE_IMAGES", true, None),
        ("ADDITIONAL_SECRET", false, Some("does-not-exist")),
        ("ADD_CAPABILITIES", false, Some("")),
        ("ALLOW_CROSS_PLATFORM_IMAGES", false, Some("false")),
        ("ANNOTATIONS", true, None),
        ("ANNOTATIONS_FILE", false, Some("")),
        ("BUILDAH_FORMAT", false, Some("oci")),
        ("BUILD_ARGS", true, None),
        ("BUILD_ARGS_FILE", false, Some("")),
        ("BUILD_TIMESTAMP", false, Some("")),
        ("CACHI2_ARTIFACT", false, Some("")),
        ("COMMIT_SHA", false, Some("")),
        ("CONTEXT", false, Some(".")),
        ("CONTEXTUALIZE_SBOM", false, Some("true")),
        ("DOCKERFILE", false, Some("./Dockerfile")),
        ("ENTITLEMENT_SECRET", false, Some("etc-pki-entitlement")),
        ("ENV_VARS", true, None),
        ("HERMETIC", false, Some("false")),
        ("HTTP_PROXY", false, Some("")),
        ("ICM_KEEP_COMPAT_LOCATION", false, Some("true")),
        ("IMAGE", false, None),
        ("IMAGE_EXPIRES_AFTER", false, Some("")),
        ("INHERIT_BASE_IMAGE_LABELS", false, Some("true")),
        ("LABELS", true, None),
        ("LOG_LEVEL", false, Some("info")),
        ("NO_PROXY", false, Some("")),
        ("OMIT_HISTORY", false, Some("false")),
        ("PREFETCH_INPUT", false, Some("")),
        ("PRIVILEGED_NESTED", false, Some("false")),
        (
            "PROXY_CA_TRUST_CONFIG_MAP_KEY",
            false,
            Some("ca-bundle.crt"),
        ),
        (
            "PROXY_CA_TRUST_CONFIG_MAP_NAME",
            false,
            Some("caching-ca-bundle"),
        ),
        ("REWRITE_TIMESTAMP", false, Some("false")),
        ("RHSM_MOUNT_CA_CERTS", false, Some("auto")),
        ("SBOM_SKIP_VALIDATION", false, Some("true")),
        ("SBOM_SOURCE_SCAN_ENABLED", false, Some("true")),
        ("SBOM_SYFT_SELECT_CATALOGERS", false, Some("")),
        ("SBOM_TYPE", false, Some("spdx")),
        ("SKIP_INJECTIONS", false, Some("false")),
        ("SKIP_SBOM_GENERATION", false, Some("false")),
        ("SKIP_UNUSED_STAGES", false, Some("true")),
        ("SOURCE_ARTIFACT", false, None),
        ("SOURCE_DATE_EPOCH", false, Some("")),
        ("SOURCE_URL", false, Some("")),
        ("SQUASH", false, Some("false")),
        ("STORAGE_DRIVER", false, Some("overlay")),
        ("TARGET_STAGE", false, Some("")),
        ("TLSVERIFY", false, Some("true")),
        ("WORKINGDIR_MOUNT", false, Some("")),
        ("YUM_REPOS_D_FETCHED", false, Some("fetched.repos.d")),
        ("YUM_REPOS_D_SRC", false, Some("repos.d")),
        ("YUM_REPOS_D_TARGET", false, Some("/etc/yum.repos.d")),
        ("caTrustConfigMapKey", false, Some("ca-bundle.crt")),
        ("caTrustConfigMapName", false, Some("trusted-ca")),
        ("PLATFORM", false, None),
        ("IMAGE_APPEND_PLATFORM", false, Some("false")),
    ];

    /// A step: name, script bytes, script lines, volume mounts (volume, path).
    type StepShape = (
        &'static str,
        usize,
        usize,
        &'static [(&'static str, &'static str)],
    );

    /// The steps, with the production Task's script sizes.
    const STEPS: &[StepShape] = &[
        (
            "use-trusted-artifact",
            0,
            0,
            &[("trusted-ca", "/etc/pki/tls/certs/ca-custom-bundle.crt")],
        ),
        (
            "build",
            14_911,
            348,
            &[
                ("varlibcontainers", "/var/lib/containers"),
                ("etc-pki-entitlement", "/entitlement"),
                ("activation-key", "/activation-key"),
                ("additional-secret", "/additional-secret"),
                ("trusted-ca", "/mnt/trusted-ca"),
                ("proxy-ca-bundle", "/mnt/proxy-ca-bundle"),
                ("ssh", "/ssh"),
            ],
        ),
        (
            "push",
            5_173,
            154,
            &[
                ("varlibcontainers", "/var/lib/containers"),
                ("trusted-ca", "/mnt/trusted-ca"),
                ("oidc-token", "/var/run/sigstore/cosign"),
            ],
        ),
        (
            "sbom-syft-generate",
            1_380,
            52,
            &[
                ("varlibcontainers", "/var/lib/containers"),
                ("shared", "/shared"),
                ("trusted-ca", "/etc/pki/tls/certs/ca-custom-bundle.crt"),
            ],
        ),
        ("prepare-sboms", 2_240, 85, &[]),
        (
            "upload-sbom",
            2_564,
            73,
            &[
                ("trusted-ca", "/mnt/trusted-ca"),
                ("oidc-token", "/var/run/sigstore/cosign"),
            ],
        ),
    ];

    /// Deterministic hex of `len` digits from `seed`.
    fn hex(seed: u64, len: usize) -> String {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut s = String::with_capacity(len);
        while s.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let _ = write!(s, "{x:016x}");
        }
        s.truncate(len);
        s
    }

    /// A generateName-style suffix (5 of `[a-z0-9]`), distinct for every `i` below 36^5: a
    /// multiplication by a constant prime to 36 permutes the residues (hex digits of a hash
    /// collided within 20,000 TaskRuns).
    fn suffix(i: usize) -> String {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
        const SPACE: u64 = 36u64.pow(5);
        let mut x = (i as u64 % SPACE) * 48_271 % SPACE;
        let mut s = String::with_capacity(5);
        for _ in 0..5 {
            s.push(char::from(ALPHABET[(x % 36) as usize]));
            x /= 36;
        }
        s
    }

    fn image(repo: &str, seed: u64) -> String {
        format!("quay.io/konflux-ci/{repo}:latest@sha256:{}", hex(seed, 64))
    }

    /// Prose of `len` bytes (descriptions).
    fn prose(seed: usize, len: usize) -> String {
        const WORDS: &[&str] = &[
            "the", "image", "build", "path", "to", "when", "secret", "is", "used", "for", "SBOM",
            "registry", "of", "a", "value", "empty", "means", "default", "and",
        ];
        let mut s = String::with_capacity(len + 12);
        let mut i = seed;
        while s.len() < len {
            if !s.is_empty() {
                s.push(' ');
            }
            s.push_str(WORDS[i % WORDS.len()]);
            i = i.wrapping_mul(31).wrapping_add(7);
        }
        s.truncate(len);
        s
    }

    /// A shell script of `len` bytes over `lines` lines, quoting and expanding as the real ones
    /// do (escapes in JSON cost the parser what the real scripts cost it).
    fn script(step: &str, len: usize, lines: usize) -> String {
        if len == 0 {
            return String::new();
        }
        let mut s = String::with_capacity(len + 128);
        s.push_str("#!/bin/bash\nset -euo pipefail\n");
        let per_line = len / lines.max(1);
        let mut i = 0usize;
        while s.len() < len {
            let mut line = format!(
                "echo \"[$(date --utc -Ins)] {step} {i}: ${{PARAM_{}}}\" >>\"$LOG\" # ",
                i % 17
            );
            let pad = per_line.saturating_sub(line.len() + 1).max(1);
            line.push_str(&prose(i, pad));
            s.push_str(&line);
            s.push('\n');
            i += 1;
        }
        s.truncate(len);
        s
    }

    /// A resolved Task spec shaped like `buildah-remote-oci-ta` 0.10 of konflux-ci/build-definitions
    /// (~44 KB as JSON): its 56 params with defaults and descriptions, 4 results, a step
    /// template with 34 env entries, 6 steps whose scripts have the real ones' sizes, and its 10
    /// volumes, the multi-platform secret among them. Text is filler; the structure and sizes are
    /// what the controller's parser sees.
    pub fn buildah_remote_task_spec() -> Value {
        let params: Vec<Value> = PARAMS
            .iter()
            .enumerate()
            .map(|(i, (name, array, default))| {
                let mut p = json!({
                    "name": name,
                    "description": prose(i, 40 + (i * 37) % 130),
                    "type": if *array { "array" } else { "string" },
                });
                if *array {
                    p["default"] = json!([]);
                } else if let Some(d) = default {
                    p["default"] = json!(d);
                }
                p
            })
            .collect();
        let env: Vec<Value> = PARAMS
            .iter()
            .take(33)
            .map(|(name, _, _)| json!({"name": name, "value": format!("$(params.{name})")}))
            .chain([json!({"name": "BUILDER_IMAGE", "value": image("konflux-build-cli", 1)})])
            .collect();
        let steps: Vec<Value> = STEPS
            .iter()
            .enumerate()
            .map(|(i, (name, len, lines, mounts))| {
                let mut s = json!({
                    "name": name,
                    "image": image(if i == 0 { "build-trusted-artifacts" } else { "konflux-build-cli" }, 2 + i as u64),
                    "computeResources": {"limits": {"cpu": "4600m", "memory": "8Gi"},
                                         "requests": {"cpu": "4600m", "memory": "8Gi"}},
                    "securityContext": {"capabilities": {"add": ["SETFCAP"]}, "runAsUser": 0},
                    "workingDir": "/var/workdir",
                    "volumeMounts": mounts.iter().map(|(n, path)| json!({"name": n, "mountPath": path, "readOnly": true})).collect::<Vec<_>>(),
                });
                if *len > 0 {
                    s["script"] = json!(script(name, *len, *lines));
                    s["env"] = json!([{"name": "HOME", "value": "/root"},
                                      {"name": "COMMIT_SHA", "value": "$(params.COMMIT_SHA)"},
                                      {"name": "DOCKERFILE", "value": "$(params.DOCKERFILE)"}]);
                } else {
                    s["args"] = json!(["use", "$(params.SOURCE_ARTIFACT)=/var/workdir/source",
                                       "$(params.CACHI2_ARTIFACT)=/var/workdir/cachi2"]);
                }
                s
            })
            .collect();
        let secret = |name: &str, param: &str| json!({"name": name, "secret": {"optional": true, "secretName": format!("$(params.{param})")}});
        let config_map = |name: &str, key: &str, cm: &str| {
            json!({"name": name, "configMap": {"items": [{"key": format!("$(params.{key})"), "path": "ca-bundle.crt"}],
                                               "name": format!("$(params.{cm})"), "optional": true}})
        };
        json!({
            "description": prose(99, 378),
            "params": params,
            "results": [
                {"name": "IMAGE_DIGEST", "description": "Digest of the image just built"},
                {"name": "IMAGE_REF", "description": "Image reference of the built image"},
                {"name": "IMAGE_URL", "description": "Image repository and tag where the built image was pushed"},
                {"name": "SBOM_BLOB_URL", "type": "string", "description": prose(7, 80)},
            ],
            "stepTemplate": {
                "computeResources": {"limits": {"memory": "4Gi"}, "requests": {"cpu": "1", "memory": "4Gi"}},
                "env": env,
                "imagePullPolicy": "IfNotPresent",
                "volumeMounts": [{"mountPath": "/shared", "name": "shared"},
                                 {"mountPath": "/var/workdir", "name": "workdir"}],
            },
            "steps": steps,
            "volumes": [
                secret("activation-key", "ACTIVATION_KEY"),
                secret("additional-secret", "ADDITIONAL_SECRET"),
                secret("etc-pki-entitlement", "ENTITLEMENT_SECRET"),
                {"name": "oidc-token", "projected": {"sources": [{"serviceAccountToken":
                    {"audience": "sigstore", "expirationSeconds": 600, "path": "oidc-token"}}]}},
                config_map("proxy-ca-bundle", "PROXY_CA_TRUST_CONFIG_MAP_KEY", "PROXY_CA_TRUST_CONFIG_MAP_NAME"),
                {"name": "shared", "emptyDir": {}},
                config_map("trusted-ca", "caTrustConfigMapKey", "caTrustConfigMapName"),
                {"name": "varlibcontainers", "emptyDir": {}},
                {"name": "workdir", "emptyDir": {}},
                {"name": "ssh", "secret": {"optional": false,
                    "secretName": format!("{}$(context.taskRun.name)", contract::SECRET_PREFIX)}},
            ],
        })
    }

    /// One TaskRun of the load.
    pub struct TaskRun {
        pub namespace: String,
        pub name: String,
        /// Started, waiting for its secret, queued by the controller; else finished.
        pub queued: bool,
        component: String,
        pipeline_run: String,
        sha: String,
        seed: u64,
        platform: String,
    }

    impl TaskRun {
        /// The `i`th TaskRun: 200 components over two namespaces.
        pub fn new(i: usize, queued: bool, platform: &str) -> Self {
            let namespace = ["tenant-a", "tenant-b"][i % 2].to_owned();
            let component = format!("component-{:03}", (i / 2) % 200);
            let seed = i as u64 + 1;
            let pipeline_run = format!("{component}-on-push-{}", suffix(i));
            TaskRun {
                name: format!("{pipeline_run}-build-images-0"),
                namespace,
                queued,
                component,
                pipeline_run,
                sha: hex(seed << 8, 40),
                seed,
                platform: platform.to_owned(),
            }
        }

        fn uuid(&self, salt: u64) -> String {
            let h = hex(self.seed ^ (salt << 32), 32);
            format!(
                "{}-{}-{}-{}-{}",
                &h[..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..]
            )
        }

        /// The object as created: metadata, and the spec the PipelineRun gave it.
        pub fn object(&self) -> Value {
            let (ns, comp, pr, sha) = (
                &self.namespace,
                &self.component,
                &self.pipeline_run,
                &self.sha,
            );
            let platform_label = self.platform.replace('/', "-");
            let mut labels: Map<String, Value> = [
                (
                    "app.kubernetes.io/managed-by",
                    "tekton-pipelines".to_owned(),
                ),
                ("app.kubernetes.io/version", "0.10".to_owned()),
                (
                    "appstudio.openshift.io/application",
                    format!("app-{}", &comp[10..]),
                ),
                ("appstudio.openshift.io/component", comp.clone()),
                ("build.appstudio.redhat.com/build_type", "docker".to_owned()),
                ("build.appstudio.redhat.com/commit_sha", sha.clone()),
                (
                    "build.appstudio.redhat.com/target_branch",
                    "main".to_owned(),
                ),
                ("pipelines.appstudio.openshift.io/type", "build".to_owned()),
                ("pipelines.openshift.io/runtime", "generic".to_owned()),
                ("pipelines.openshift.io/strategy", "docker".to_owned()),
                ("pipelines.openshift.io/used-by", "build-cloud".to_owned()),
                ("pipelinesascode.tekton.dev/branch", "main".to_owned()),
                (
                    "pipelinesascode.tekton.dev/check-run-id",
                    format!("{}", 30_000_000_000 + self.seed),
                ),
                ("pipelinesascode.tekton.dev/event-type", "push".to_owned()),
                (
                    "pipelinesascode.tekton.dev/git-provider",
                    "github".to_owned(),
                ),
                (
                    "pipelinesascode.tekton.dev/original-prname",
                    format!("{comp}-on-push"),
                ),
                ("pipelinesascode.tekton.dev/repository", comp.clone()),
                (
                    "pipelinesascode.tekton.dev/sender",
                    "konflux-bot".to_owned(),
                ),
                ("pipelinesascode.tekton.dev/sha", sha.clone()),
                (
                    "pipelinesascode.tekton.dev/state",
                    if self.queued { "started" } else { "completed" }.to_owned(),
                ),
                (
                    "pipelinesascode.tekton.dev/url-org",
                    "example-org".to_owned(),
                ),
                ("pipelinesascode.tekton.dev/url-repository", comp.clone()),
                ("tekton.dev/memberOf", "tasks".to_owned()),
                ("tekton.dev/pipeline", pr.clone()),
                ("tekton.dev/pipelineRun", pr.clone()),
                ("tekton.dev/pipelineRunUID", self.uuid(1)),
                ("tekton.dev/pipelineTask", "build-images".to_owned()),
                ("tekton.dev/task", "buildah-remote-oci-ta".to_owned()),
                (contract::TARGET_PLATFORM_LABEL, platform_label.clone()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), json!(v)))
            .collect();
            if self.queued {
                labels.insert(
                    contract::WAITING_FOR_PLATFORM_LABEL.into(),
                    json!(platform_label),
                );
            }
            let repo = format!("https://github.com/example-org/{comp}");
            let results = format!("{ns}/results/{}", self.uuid(2));
            let mut annotations: Map<String, Value> = [
                ("build.appstudio.openshift.io/repo", format!("{repo}?rev={sha}")),
                ("build.appstudio.redhat.com/bundle", format!(
                    "quay.io/konflux-ci/tekton-catalog/pipeline-docker-build-multi-platform-oci-ta:devel@sha256:{}",
                    hex(3, 64))),
                ("build.appstudio.redhat.com/commit_sha", sha.clone()),
                ("build.appstudio.redhat.com/target_branch", "main".to_owned()),
                ("pipelinesascode.tekton.dev/cancel-in-progress", "false".to_owned()),
                ("pipelinesascode.tekton.dev/controller-info",
                 r#"{"name":"default","configmap":"pipelines-as-code","secret":"pipelines-as-code-secret", "gRepo": "pipelines-as-code"}"#.to_owned()),
                ("pipelinesascode.tekton.dev/git-auth-secret", format!("pac-gitauth-{}", hex(self.seed << 4, 6))),
                ("pipelinesascode.tekton.dev/installation-id", "51234567".to_owned()),
                ("pipelinesascode.tekton.dev/log-url", format!(
                    "https://konflux-ui.apps.stone-prd-rh01.example.com/ns/{ns}/pipelinerun/{pr}")),
                ("pipelinesascode.tekton.dev/max-keep-runs", "3".to_owned()),
                ("pipelinesascode.tekton.dev/on-cel-expression", format!(
                    "event == \"push\" && target_branch == \"main\" && ( \"{comp}/***\".pathChanged() || \
                     \".tekton/{comp}-push.yaml\".pathChanged() || \"Containerfile\".pathChanged() )")),
                ("pipelinesascode.tekton.dev/repo-url", repo.clone()),
                ("pipelinesascode.tekton.dev/sha-title", "chore(deps): update konflux references".to_owned()),
                ("pipelinesascode.tekton.dev/sha-url", format!("{repo}/commit/{sha}")),
                ("results.tekton.dev/log", format!("{results}/logs/{}", self.uuid(3))),
                ("results.tekton.dev/record", format!("{results}/records/{}", self.uuid(3))),
                ("results.tekton.dev/result", results.clone()),
                ("tekton.dev/categories", "Image Build, Security".to_owned()),
                ("tekton.dev/pipelines.minVersion", "0.12.1".to_owned()),
                ("tekton.dev/tags", "image-build, konflux".to_owned()),
                (contract::ALLOCATION_START_TIME_ANNOTATION, "1764000000".to_owned()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), json!(v)))
            .collect();
            if !self.queued {
                annotations.insert("chains.tekton.dev/signed".into(), json!("true"));
            }
            let artifact = |what: &str| {
                format!(
                    "oci:quay.io/redhat-user-workloads/{ns}/{comp}@sha256:{}",
                    hex(self.seed ^ what.len() as u64, 64)
                )
            };
            let finalizers: Vec<&str> = if self.queued {
                vec![contract::FINALIZER]
            } else {
                vec![]
            };
            json!({
                "apiVersion": "tekton.dev/v1",
                "kind": "TaskRun",
                "metadata": {
                    "name": self.name,
                    "namespace": ns,
                    "labels": labels,
                    "annotations": annotations,
                    "finalizers": finalizers,
                    "ownerReferences": [{"apiVersion": "tekton.dev/v1", "kind": "PipelineRun", "name": pr,
                                         "uid": self.uuid(1), "controller": true, "blockOwnerDeletion": true}],
                },
                "spec": {
                    "params": [
                        {"name": "IMAGE", "value": format!("quay.io/redhat-user-workloads/{ns}/{comp}:{sha}")},
                        {"name": "DOCKERFILE", "value": "Containerfile"},
                        {"name": "CONTEXT", "value": "."},
                        {"name": "HERMETIC", "value": "true"},
                        {"name": "PREFETCH_INPUT", "value": "[{\"type\": \"gomod\"}, {\"type\": \"rpm\"}]"},
                        {"name": "IMAGE_EXPIRES_AFTER", "value": ""},
                        {"name": "COMMIT_SHA", "value": sha},
                        {"name": "BUILD_ARGS", "value": []},
                        {"name": "BUILD_ARGS_FILE", "value": ""},
                        {"name": "PRIVILEGED_NESTED", "value": "false"},
                        {"name": "SOURCE_URL", "value": repo},
                        {"name": "BUILDAH_FORMAT", "value": "oci"},
                        {"name": "SOURCE_ARTIFACT", "value": artifact("source")},
                        {"name": "CACHI2_ARTIFACT", "value": artifact("cachi2")},
                        {"name": "IMAGE_APPEND_PLATFORM", "value": "true"},
                        {"name": contract::PLATFORM_PARAM, "value": self.platform},
                    ],
                    "serviceAccountName": format!("build-pipeline-{comp}"),
                    "taskRef": {"resolver": "bundles", "params": [
                        {"name": "name", "value": "buildah-remote-oci-ta"},
                        {"name": "bundle", "value": format!(
                            "quay.io/konflux-ci/tekton-catalog/task-buildah-remote-oci-ta:0.10@sha256:{}", hex(4, 64))},
                        {"name": "kind", "value": "task"},
                    ]},
                    "timeout": "2h0m0s",
                },
            })
        }

        /// The status Tekton wrote: finished (succeeded, with step states and results) or
        /// started with its pod waiting for the secret volume.
        pub fn status(&self, task_spec: &Value) -> Value {
            let t = |s: u32| format!("2026-11-25T10:{:02}:{:02}Z", (s / 60) % 60, s % 60);
            let steps: Vec<Value> = STEPS
                .iter()
                .enumerate()
                .map(|(i, (name, ..))| {
                    let mut s = json!({"name": name, "container": format!("step-{name}")});
                    if self.queued {
                        s["waiting"] = json!({"reason": "PodInitializing"});
                    } else {
                        s["imageID"] = json!(image("konflux-build-cli", 2 + i as u64));
                        s["terminated"] = json!({
                            "containerID": format!("cri-o://{}", hex(self.seed ^ (i as u64) << 40, 64)),
                            "exitCode": 0, "reason": "Completed",
                            "startedAt": t(60 + 100 * i as u32), "finishedAt": t(150 + 100 * i as u32)});
                        s["terminationReason"] = json!("Completed");
                    }
                    s
                })
                .collect();
            let flags: Map<String, Value> = [
                "awaitSidecarReadiness",
                "coschedule",
                "disableAffinityAssistant",
                "disableCredsInit",
                "disableInlineSpec",
                "enableAPIFields",
                "enableArtifacts",
                "enableCELInWhenExpression",
                "enableConciseResolverSyntax",
                "enableKeepPodOnCancel",
                "enableParamEnum",
                "enableProvenanceInStatus",
                "enableStepActions",
                "enforceNonfalsifiability",
                "maxResultSize",
                "requireGitSSHSecretKnownHosts",
                "resultExtractionMethod",
                "runningInEnvWithInjectedSidecars",
                "sendCloudEventsForRuns",
                "setSecurityContext",
                "verificationNoMatchPolicy",
            ]
            .iter()
            .enumerate()
            .map(|(i, k)| {
                (
                    (*k).to_owned(),
                    if i % 3 == 0 {
                        json!(true)
                    } else {
                        json!("alpha")
                    },
                )
            })
            .collect();
            let mut status = json!({
                "podName": format!("{}-pod", self.name),
                "startTime": t(10),
                "steps": steps,
                "provenance": {
                    "featureFlags": flags,
                    "refSource": {"uri": "quay.io/konflux-ci/tekton-catalog/task-buildah-remote-oci-ta",
                                  "digest": {"sha256": hex(4, 64)}, "entryPoint": "buildah-remote-oci-ta"},
                },
                "spanContext": {"traceparent": format!("00-{}-{}-01", hex(self.seed, 32), hex(self.seed << 1, 16))},
                "taskSpec": task_spec,
            });
            if self.queued {
                status["conditions"] = json!([{"type": "Succeeded", "status": "Unknown", "reason": "Pending",
                    "message": "pod status \"Initialized\":\"False\"; message: \"containers with incomplete status: [prepare place-scripts]\"",
                    "lastTransitionTime": t(12)}]);
            } else {
                let (ns, comp) = (&self.namespace, &self.component);
                let url = format!(
                    "quay.io/redhat-user-workloads/{ns}/{comp}:{}-linux-arm64",
                    self.sha
                );
                let digest = format!("sha256:{}", hex(self.seed << 2, 64));
                status["conditions"] = json!([{"type": "Succeeded", "status": "True", "reason": "Succeeded",
                    "message": "All Steps have completed executing", "lastTransitionTime": t(700)}]);
                status["completionTime"] = json!(t(700));
                status["results"] = json!([
                    {"name": "IMAGE_DIGEST", "type": "string", "value": digest},
                    {"name": "IMAGE_URL", "type": "string", "value": url},
                    {"name": "IMAGE_REF", "type": "string", "value": format!("{url}@{digest}")},
                    {"name": "SBOM_BLOB_URL", "type": "string", "value": format!(
                        "quay.io/redhat-user-workloads/{ns}/{comp}@sha256:{}", hex(self.seed << 3, 64))},
                ]);
                status["artifacts"] = json!({});
            }
            status
        }
    }
}
