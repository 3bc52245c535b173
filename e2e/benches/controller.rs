//! The controller through its real binaries: the optimised `mpc` (as `mpc-e2e`, built from the
//! same `src/main.rs`), the OTP server, the test API server with the Tekton stand-in, loopback
//! sshd build hosts and moto. Needs root and what `e2e/setup.sh` installs.
//!
//! ```sh
//! cargo bench -p e2e --bench controller                        # every phase but `memory`
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
//! - `memory`: `MPC_BENCH_TASKRUNS` finished TaskRuns in the API server, then the controller starts
//!   and lists them; its resident memory (VmRSS, and VmHWM the peak).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use e2e::product::Product;
use e2e::tekton::Outcome;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::watcher;
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
/// product's secrets (what a kubelet would see), with the most held at once.
#[derive(Default)]
struct Secrets {
    state: Mutex<SecretState>,
    changed: Notify,
}

#[derive(Default)]
struct SecretState {
    served: HashMap<String, Instant>,
    deleted: HashMap<String, Instant>,
    holding: usize,
    max_holding: usize,
}

impl Secrets {
    fn watch(client: kube::Client) -> Arc<Self> {
        let this = Arc::new(Secrets::default());
        let me = Arc::clone(&this);
        let api: kube::Api<Secret> = kube::Api::all(client);
        let cfg = watcher::Config::default()
            .labels(&format!("{}=true", contract::MULTI_PLATFORM_SECRET_LABEL));
        tokio::spawn(async move {
            let mut s = watcher(api, cfg).boxed();
            while let Some(ev) = s.next().await {
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
                    if st.served.contains_key(&key) && !st.deleted.contains_key(&key) {
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
    let mut p = Product::start(std::path::Path::new(MPC), hosts).await?;
    p.start_controller("c1").await?;
    let secrets = Secrets::watch(p.client.clone());
    Ok((p, secrets))
}

fn track(p: &Product, ns: &str, name: &str) {
    for h in &p.hosts {
        h.sshd.track_user(&contract::remote_user_name(name, ns));
    }
}

async fn latency(n: usize) -> anyhow::Result<()> {
    let (p, secrets) = product(&[("h1", 2)]).await?;
    let mut times = Vec::new();
    for i in 0..n + 5 {
        let name = format!("lat-{i}");
        track(&p, "tenant-a", &name);
        let t0 = Instant::now();
        p.create_taskrun("tenant-a", &name, PLATFORM, json!({}))
            .await?;
        let t1 = secrets
            .wait(&format!("tenant-a/{name}"), false, Duration::from_secs(30))
            .await?;
        // The first few warm connections and caches up.
        if i >= 5 {
            times.push(t1 - t0);
        }
        p.tekton
            .finish("tenant-a", &name, Outcome::Succeeded)
            .await?;
        secrets
            .wait(&format!("tenant-a/{name}"), true, Duration::from_secs(30))
            .await?;
        p.cleaned_up("tenant-a", &name).await;
    }
    println!(
        "latency: static TaskRun CREATE -> secret with token: {}",
        summary(&mut times)
    );
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
        p.moto_platform(&fx, PLATFORM, &admin.private(), "bench-dynamic")
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
    if secrets.max_holding() > slots as usize {
        bail!("more secrets held at once than slots");
    }
    Ok(())
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

/// VmRSS and VmHWM of `pid`, in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("{k} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Creates `n` labelled TaskRuns and finishes them; returns the largest one's JSON size.
async fn load_finished(p: &Product, n: usize) -> anyhow::Result<usize> {
    let mut sample = 0usize;
    let loading = futures::stream::iter(0..n)
        .map(|i| async move {
            let ns = ["tenant-a", "tenant-b"][i % 2];
            let name = format!("old-{i}");
            let extra = json!({"metadata": {
                "labels": {contract::TARGET_PLATFORM_LABEL: "linux-arm64"},
                "annotations": {contract::ALLOCATION_START_TIME_ANNOTATION: "1700000000"}}});
            p.create_taskrun(ns, &name, PLATFORM, extra).await?;
            finish(p, ns, &name).await?;
            let done = p.tekton.get(ns, &name).await?;
            anyhow::Ok(serde_json::to_vec(&done)?.len())
        })
        .buffer_unordered(16);
    let mut loading = std::pin::pin!(loading);
    while let Some(len) = loading.next().await {
        sample = sample.max(len?);
    }
    Ok(sample)
}

async fn memory(n: usize) -> anyhow::Result<()> {
    let mut p = Product::start(std::path::Path::new(MPC), &[("h1", 2)]).await?;
    // Finished TaskRuns the webhook labelled, as a busy cluster keeps them (pruned after days).
    let loaded = Instant::now();
    let sample = load_finished(&p, n).await?;
    println!(
        "memory: {n} finished TaskRuns loaded in {:.0} s (largest {sample} bytes as JSON)",
        loaded.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let i = p.start_controller("c1").await?;
    let pid = p.controllers[i].pid().context("controller pid")?;
    // Listed and indexed: a new TaskRun is served.
    track(&p, "tenant-a", "probe");
    p.create_taskrun("tenant-a", "probe", PLATFORM, json!({}))
        .await?;
    p.wait(
        Duration::from_secs(300),
        "the probe TaskRun served",
        || async {
            p.secret("tenant-a", "probe")
                .await
                .filter(|s| s.contains_key("otp"))
        },
    )
    .await;
    let ready = started.elapsed();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (rss, hwm) = rss_kib(pid)?;
    println!(
        "memory: {n} TaskRuns: controller serving after {:.1} s; VmRSS {:.1} MiB, peak (VmHWM) {:.1} MiB",
        ready.as_secs_f64(),
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    p.tekton
        .finish("tenant-a", "probe", Outcome::Succeeded)
        .await?;
    p.cleaned_up("tenant-a", "probe").await;
    Ok(())
}
