//! Chaos soak of the whole product: the real `mpc controller` (two replicas) and `mpc otp-server`
//! against the test API server, the Tekton stand-in, loopback sshd build hosts and moto behind the
//! fault-injecting EC2 proxy.
//!
//! `SOAK_TASKRUNS` TaskRuns (default 48) over three namespaces and every strategy (local, static,
//! dynamic, dynamic pool) run with at most `SOAK_PARALLEL` (default 10) in flight; some are retried,
//! cancelled or deleted, before or after they got their secret. Meanwhile a fault schedule (one
//! fault every `SOAK_FAULT_EVERY_MS`, default 3000) cycles through: leader `kill -9` (restarted
//! after the Lease expired), follower `kill -9`, API 409/500/429 bursts, dropped watches, compacted
//! history (410), an API server restart, a static sshd host down and back, EC2 throttling and 5xx,
//! and the OTP server `kill -9`.
//!
//! Cloud instances are simulated on loopback: when moto lists an instance with an address in the
//! soak's subnet, an sshd starts there with the image's admin key (the instance booted); when the
//! instance is terminated its sshd stops and the users made on it go with it. All the machines
//! share this one's `/etc/passwd`, so the harness removes those users itself: the ones whose
//! TaskRun the monitor saw on the instance when it goes, and, once every instance is gone, any
//! other cloud TaskRun's user (one that came and went while the monitor could not list).
//!
//! Checked all along (every ~150 ms): no host (static host, dynamic instance, pool instance) holds
//! more TaskRuns than its concurrency (a TaskRun that has not ended holds its `assigned-host` while
//! its remote secret or its build user exists; the scheduler hands a slot over when the TaskRun
//! ends, while its user is still being removed, so those overlaps are counted and reported); never more running+pending instances per platform tag than
//! `max-instances`; every remote secret names the TaskRun's own build user at the address of the
//! host its `assigned-host` label names. After every build that succeeded its token is redeemed a
//! second time, which must fail (no key is handed out twice).
//!
//! Bound: every TaskRun is done (finished or deleted, no secret and no finalizer of ours left; a
//! local TaskRun's owner-referenced secret may be left to the garbage collector, counted) within
//! [`DONE_BOUND`] of its creation, then pruned; one that is not is a violation, and is then cancelled
//! and pruned (as Tekton's timeout would end it) so that it does not hold its host for the rest of
//! the run. Every harness API request is bounded ([`CALL_LIMIT`]). At the end: no build user, no running instance, no secret,
//! no finalizer, no OTP store entry. The summary (faults per kind, outcomes, p50/p99 time to done,
//! most TaskRuns seen on a host, most instances seen) is printed (`--nocapture`).
//!
//! Full size (see RELIABILITY.md): `SOAK_TASKRUNS=2000 SOAK_PARALLEL=12 cargo test -p e2e --test
//! soak -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use e2e::apiserver::faults::{RequestMatch, Verb};
use e2e::ec2_proxy::{Ec2Proxy, Fault};
use e2e::moto::Moto;
use e2e::product::{NS, Product};
use e2e::sshd::{AdminKey, HostSetup, SshdHost};
use e2e::tekton::{self, Outcome, RunOptions};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams};
use mpc::contract::{self, FINALIZER};
use serde_json::{Value, json};

/// Longest a TaskRun may take from creation to done, queueing and faults included.
const DONE_BOUND: Duration = Duration::from_secs(180);
/// Longest one harness API request may take. The harness's kube client has no read timeout (kube's
/// default), so a request caught in an API server restart could otherwise stall its driver for good.
const CALL_LIMIT: Duration = Duration::from_secs(15);
const NAMESPACES: [&str; 3] = ["tenant-a", "tenant-b", "tenant-c"];
/// Static hosts and their concurrency.
const HOSTS: [(&str, u32); 2] = [("h1", 2), ("h2", 1)];
const DYNAMIC: &str = "linux/s390x";
const POOL: &str = "linux/ppc64le";
const DYNAMIC_TAG: &str = "soak-s390x";
const POOL_TAG: &str = "soak-ppc64le";
const DYNAMIC_MAX: usize = 3;
const POOL_MAX: usize = 2;
const POOL_CONCURRENCY: usize = 2;
/// Instances get addresses here, away from the 127.0.0.x static hosts and other tests' subnets.
const SUBNET: &str = "127.0.16.0/20";
/// Kinds of fault in the schedule.
const FAULT_KINDS: usize = 11;

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A deterministic pseudo-random number for (`seed`, `i`) (splitmix64).
fn mix(seed: u64, i: u64) -> u64 {
    let mut z = seed
        .wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    Local,
    Static,
    Dynamic,
    Pool,
}

impl Strategy {
    fn of(i: usize) -> Self {
        [Self::Local, Self::Static, Self::Dynamic, Self::Pool][i % 4]
    }
    fn platform(self) -> &'static str {
        match self {
            Self::Local => "linux/amd64",
            Self::Static => "linux/arm64",
            Self::Dynamic => DYNAMIC,
            Self::Pool => POOL,
        }
    }
}

/// What the user does with a TaskRun.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Runs the build.
    Build,
    /// The first attempt fails after redeeming the key; the retry builds.
    Retry,
    /// Cancelled before it got its secret (`early`) or after.
    Cancel { early: bool },
    /// Deleted before it got its secret (`early`) or after.
    Delete { early: bool },
}

impl Plan {
    fn of(seed: u64, i: usize) -> Self {
        let r = mix(seed, i as u64);
        let early = (r >> 32).is_multiple_of(2);
        match r % 100 {
            0..60 => Self::Build,
            60..75 => Self::Retry,
            75..87 => Self::Cancel { early },
            _ => Self::Delete { early },
        }
    }
}

/// How one TaskRun went.
#[derive(Debug)]
struct Record {
    id: String,
    outcome: String,
    /// Creation to done; `None`: not done within the bound.
    done_after: Option<Duration>,
}

/// A live instance as moto lists it.
#[derive(Debug, Clone)]
struct Instance {
    ip: Option<Ipv4Addr>,
    tag: String,
    /// Owner, attempt, `Name` and launch time: what a leftover's report needs to be traced.
    about: String,
}

/// The simulated machines behind moto's instances.
#[derive(Default)]
struct Cloud {
    /// Instance id → its sshd while it runs, and its instance tag.
    booted: HashMap<String, (SshdHost, String)>,
    /// Instance id → private address.
    ip_of: HashMap<String, Ipv4Addr>,
    /// Instance id → build users of TaskRuns assigned to it.
    users_on: HashMap<String, BTreeSet<String>>,
    /// Address → build users of remote secrets seen pointing there (a TaskRun may come and go
    /// between two monitor ticks: its driver saw the secret).
    users_at: HashMap<String, BTreeSet<String>>,
    /// Instances whose sshd is starting.
    booting: BTreeSet<String>,
    /// Instances whose machine went away.
    gone: BTreeSet<String>,
    /// Users still present on a pool instance when it was terminated.
    pool_users_lost: u64,
    /// Users of cloud TaskRuns removed at the end because the monitor never saw which instance
    /// they were on (their machines are gone by then).
    unattributed_users: u64,
}

struct Soak {
    p: Product,
    moto: Moto,
    proxy: Ec2Proxy,
    admin: AdminKey,
    cloud: Mutex<Cloud>,
    violations: Mutex<Vec<String>>,
    faults: Mutex<BTreeMap<&'static str, u64>>,
    /// Most TaskRuns seen holding one host, per host kind (`h1`, `dynamic`, `pool`).
    max_held: Mutex<BTreeMap<String, usize>>,
    /// Most running+pending instances seen, per instance tag.
    max_instances: Mutex<BTreeMap<String, usize>>,
    /// Monitor ticks where a host had more users (ended TaskRuns' included) than its concurrency,
    /// and the most users over it.
    overlaps: Mutex<(u64, usize)>,
    /// Second redeems of served tokens (all must fail).
    second_redeems: Mutex<u64>,
    /// The workload is over: faults stop (after a full cycle).
    stop: AtomicBool,
    /// The final checks are over: the monitor and the cloud simulation stop.
    done: AtomicBool,
    began: Instant,
    /// Local TaskRuns whose secret was still there 10 s after they finished.
    local_secrets_left: AtomicUsize,
    /// TaskRuns driven to the end; a progress line every `progress_every`.
    finished: AtomicUsize,
    progress_every: usize,
    /// Harness API requests given up after [`CALL_LIMIT`] (then retried or read as "no answer").
    calls_timed_out: AtomicUsize,
}

impl Soak {
    fn violation(&self, v: String) {
        eprintln!("VIOLATION: {v}");
        self.violations.lock().unwrap().push(v);
    }

    /// Remembers where a remote secret sends its build user.
    fn saw_secret(&self, secret: &BTreeMap<String, String>) {
        if let Some((user, addr)) = secret
            .get("host")
            .filter(|_| secret.contains_key("otp"))
            .and_then(|h| h.split_once('@'))
        {
            let mut c = self.cloud.lock().unwrap();
            c.users_at
                .entry(addr.to_owned())
                .or_default()
                .insert(user.to_owned());
        }
    }

    fn count_fault(&self, kind: &'static str) {
        *self.faults.lock().unwrap().entry(kind).or_default() += 1;
    }

    fn taskruns(&self, ns: &str) -> Api<DynamicObject> {
        Api::namespaced_with(self.p.client.clone(), ns, &tekton::taskrun_resource())
    }

    fn secrets(&self, ns: &str) -> Api<Secret> {
        Api::namespaced(self.p.client.clone(), ns)
    }
}

fn finalized(tr: &Value) -> bool {
    tr["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| f.iter().any(|f| f == FINALIZER))
}

fn label<'a>(tr: &'a Value, key: &str) -> Option<&'a str> {
    tr["metadata"]["labels"][key].as_str()
}

fn secret_text(s: &Secret) -> BTreeMap<String, String> {
    s.data
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned()))
        .collect()
}

/// `call`, given up after [`CALL_LIMIT`] (counted).
async fn bounded<T, E: std::fmt::Display>(
    s: &Soak,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    match tokio::time::timeout(CALL_LIMIT, call).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => {
            s.calls_timed_out.fetch_add(1, Ordering::Relaxed);
            Err(format!("no answer within {CALL_LIMIT:?}"))
        }
    }
}

/// A TaskRun as stored: `Ok(None)` once deleted, `Err` when the API did not answer (faults).
async fn get_taskrun(s: &Soak, ns: &str, name: &str) -> Result<Option<Value>, String> {
    Ok(bounded(s, s.taskruns(ns).get_opt(name))
        .await?
        .map(|o| serde_json::to_value(o).expect("serialisable")))
}

async fn get_secret(
    s: &Soak,
    ns: &str,
    name: &str,
) -> Result<Option<BTreeMap<String, String>>, String> {
    Ok(
        bounded(s, s.secrets(ns).get_opt(&contract::secret_name(name)))
            .await?
            .map(|s| secret_text(&s)),
    )
}

/// Retries `op` through injected API faults and restarts until it succeeds or `limit` passes;
/// an attempt that does not answer within [`CALL_LIMIT`] counts as failed.
async fn retrying<T, F, Fut>(s: &Soak, limit: Duration, mut op: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match bounded(s, op()).await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(a) if a.code == code)
}

/// Waits for the TaskRun's secret in any of its forms (`otp`, `host`, `error`); `None` when the
/// TaskRun is gone or done first, or at the deadline.
async fn wait_secret(
    s: &Soak,
    ns: &str,
    name: &str,
    deadline: Instant,
) -> Option<BTreeMap<String, String>> {
    while Instant::now() < deadline {
        if let Ok(Some(sec)) = get_secret(s, ns, name).await
            && ["otp", "host", "error"]
                .iter()
                .any(|k| sec.contains_key(*k))
        {
            s.saw_secret(&sec);
            return Some(sec);
        }
        match get_taskrun(s, ns, name).await {
            Ok(None) => return None,
            Ok(Some(tr)) if tekton::is_done(&tr) => return None,
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

async fn cancel(s: &Soak, ns: &str, name: &str) {
    let api = s.taskruns(ns);
    let _ = retrying(s, Duration::from_secs(30), || async {
        match api
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"status": "TaskRunCancelled"}})),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

async fn delete(s: &Soak, ns: &str, name: &str) {
    let api = s.taskruns(ns);
    let _ = retrying(s, Duration::from_secs(30), || async {
        match api.delete(name, &Default::default()).await {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

/// Ends the current attempt, through API faults; an attempt already ended is left alone, one
/// whose pod has not started yet is waited for.
async fn finish(s: &Soak, ns: &str, name: &str, outcome: Outcome) {
    let _ = retrying(s, Duration::from_secs(30), || async {
        match s.p.tekton.finish(ns, name, outcome.clone()).await {
            Ok(_) => Ok(()),
            Err(tekton::Error::State(_, why)) if why.contains("already finished") => Ok(()),
            Err(tekton::Error::Kube(e)) if is_status(&e, 404) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

/// One attempt of a build that got `secret`: runs the steps; after a success with a key, redeems
/// the key's token again while the attempt ends, which must fail (a check pushed on `checks`, so
/// a redeem waiting for a re-arm does not delay the TaskRun).
async fn build_attempt(
    s: &Arc<Soak>,
    ns: &str,
    name: &str,
    secret: &BTreeMap<String, String>,
    checks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> &'static str {
    let opts = RunOptions {
        finish: false,
        step_timeout: Duration::from_secs(60),
        ..RunOptions::default()
    };
    // Its own requests are bounded only by its steps' timeout: the whole attempt is bounded too.
    let run = tokio::time::timeout(
        Duration::from_secs(150),
        s.p.tekton.run_steps(ns, name, opts),
    )
    .await
    .map_err(|_| "the attempt did not end within 150 s".to_owned())
    .and_then(|r| r.map_err(|e| e.to_string()));
    let ok = run.as_ref().is_ok_and(|r| r.exit_code == 0);
    let outcome = if ok {
        Outcome::Succeeded
    } else {
        let why = match &run {
            Ok(r) => format!("exit {}: {}", r.exit_code, r.stderr.trim()),
            Err(e) => e.clone(),
        };
        Outcome::Failed {
            message: why.chars().take(300).collect(),
        }
    };
    if let Some(token) = secret.get("otp").filter(|_| ok) {
        let (s, token, id) = (s.clone(), token.clone(), format!("{ns}/{name}"));
        checks.push(tokio::spawn(async move {
            let again = s.p.otp_redeem(&token).await;
            *s.second_redeems.lock().unwrap() += 1;
            if again.is_ok() {
                s.violation(format!("{id}: a served token was redeemed a second time"));
            }
        }));
    }
    finish(s, ns, name, outcome).await;
    match (ok, secret.contains_key("error")) {
        (true, _) => "succeeded",
        (false, true) => "error-secret",
        (false, false) => "build-failed",
    }
}

/// Drives TaskRun `i` from creation to done.
async fn drive(s: Arc<Soak>, seed: u64, i: usize) -> Record {
    let ns = NAMESPACES[i % NAMESPACES.len()];
    let strategy = Strategy::of(i);
    let plan = Plan::of(seed, i);
    let name = format!("soak-{i}");
    let id = format!("{ns}/{name} {strategy:?} {plan:?}");
    let user = contract::remote_user_name(&name, ns);
    s.p.hosts[0].sshd.track_user(&user);
    let extra = match plan {
        Plan::Retry => json!({"spec": {"retries": 1}}),
        _ => json!({}),
    };
    let created = retrying(&s, Duration::from_secs(60), || async {
        match s
            .p
            .create_taskrun(ns, &name, strategy.platform(), extra.clone())
            .await
        {
            Ok(_) => Ok(()),
            // The create went through but its answer was lost (API restart).
            Err(e) if e.to_string().contains("already exists") => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    let start = Instant::now();
    if let Err(e) = created {
        s.violation(format!("{id}: could not be created: {e}"));
        return Record {
            id,
            outcome: "not-created".into(),
            done_after: None,
        };
    }
    let deadline = start + DONE_BOUND;
    let mut checks = Vec::new();
    let pause = Duration::from_millis(mix(seed ^ 0xfeed, i as u64) % 1500);
    let outcome: &str = match plan {
        Plan::Cancel { early: true } => {
            tokio::time::sleep(pause).await;
            cancel(&s, ns, &name).await;
            "cancelled"
        }
        Plan::Delete { early: true } => {
            tokio::time::sleep(pause).await;
            delete(&s, ns, &name).await;
            "deleted"
        }
        Plan::Cancel { early: false } | Plan::Delete { early: false } => {
            let got = wait_secret(&s, ns, &name, deadline).await;
            tokio::time::sleep(pause / 3).await;
            if matches!(plan, Plan::Cancel { .. }) {
                cancel(&s, ns, &name).await;
            } else {
                delete(&s, ns, &name).await;
            }
            match (got, plan) {
                (None, _) => "ended-before-secret",
                (Some(_), Plan::Cancel { .. }) => "cancelled-after-secret",
                (Some(_), _) => "deleted-after-secret",
            }
        }
        Plan::Build | Plan::Retry => {
            let attempts = if plan == Plan::Retry { 2 } else { 1 };
            let mut last = "no-secret";
            for attempt in 0..attempts {
                let Some(secret) = wait_secret(&s, ns, &name, deadline).await else {
                    break;
                };
                if plan == Plan::Retry && attempt == 0 && secret.contains_key("otp") {
                    // The first attempt's pod redeems the key, then the attempt fails.
                    let _ = s.p.otp_redeem(&secret["otp"]).await;
                    finish(
                        &s,
                        ns,
                        &name,
                        Outcome::Failed {
                            message: "flaky".into(),
                        },
                    )
                    .await;
                    last = "first-attempt-failed";
                    continue;
                }
                last = build_attempt(&s, ns, &name, &secret, &mut checks).await;
                if last == "succeeded" {
                    break;
                }
            }
            if plan == Plan::Retry && last == "succeeded" {
                "retried-succeeded"
            } else {
                last
            }
        }
    };
    // Done: gone, or finished with no secret and no finalizer of ours. A local TaskRun's secret
    // (`host: localhost`, owner-referenced, no finalizer) may be left to the garbage collector:
    // counted, and it must be gone once the TaskRun is pruned (final checks).
    let mut done_after = None;
    let mut local_left_since: Option<Instant> = None;
    while Instant::now() < deadline {
        let tr = get_taskrun(&s, ns, &name).await;
        let sec = get_secret(&s, ns, &name).await;
        let done = match (tr, sec) {
            (Ok(None), Ok(None)) => true,
            (Ok(Some(tr)), Ok(None)) => tekton::is_done(&tr) && !finalized(&tr),
            (Ok(Some(tr)), Ok(Some(_))) if strategy == Strategy::Local && tekton::is_done(&tr) => {
                let since = *local_left_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(10) {
                    s.local_secrets_left.fetch_add(1, Ordering::Relaxed);
                    true
                } else {
                    false
                }
            }
            _ => false,
        };
        if done {
            done_after = Some(start.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Pruned once done, as clusters prune finished TaskRuns.
    if done_after.is_some() {
        delete(&s, ns, &name).await;
    }
    for c in checks {
        c.await.expect("second redeem task");
    }
    let n = s.finished.fetch_add(1, Ordering::Relaxed) + 1;
    if n.is_multiple_of(s.progress_every) {
        println!(
            "soak progress: {n} TaskRuns done in {:.0} s; {} violations; faults {:?}",
            s.began.elapsed().as_secs_f64(),
            s.violations.lock().unwrap().len(),
            s.faults.lock().unwrap().values().sum::<u64>()
        );
    }
    if done_after.is_none() {
        let tr = get_taskrun(&s, ns, &name).await.ok().flatten();
        s.violation(format!(
            "{id}: not done within {DONE_BOUND:?} ({outcome}); now {}",
            tr.map(|t| json!({"labels": t["metadata"]["labels"], "finalizers": t["metadata"]["finalizers"],
                               "annotations": t["metadata"]["annotations"], "status": t["status"]["conditions"]}))
                .unwrap_or(Value::Null)
        ));
        // Ended as Tekton's timeout would end it and pruned, so one late TaskRun does not hold
        // its host (or its platform's last instance) for the rest of the run; the final checks
        // still see whatever its cleanup leaves.
        cancel(&s, ns, &name).await;
        delete(&s, ns, &name).await;
    }
    Record {
        id,
        outcome: outcome.to_owned(),
        done_after,
    }
}

/// Moto's pending and running instances by id (terminated ones pile up: not listed).
async fn instances(s: &Soak) -> Option<HashMap<String, Instance>> {
    let out = s
        .moto
        .ec2("us-east-1")
        .describe_instances()
        .filters(
            aws_sdk_ec2::types::Filter::builder()
                .name("instance-state-name")
                .values("pending")
                .values("running")
                .build(),
        )
        .send()
        .await
        .ok()?;
    let mut map = HashMap::new();
    for i in out.reservations().iter().flat_map(|r| r.instances()) {
        let Some(id) = i.instance_id() else { continue };
        let tag = i
            .tags()
            .iter()
            .find(|t| t.key() == Some("multi-platform-instance"))
            .and_then(|t| t.value())
            .unwrap_or_default()
            .to_owned();
        let about = i
            .tags()
            .iter()
            .filter(|t| {
                matches!(
                    t.key(),
                    Some("multi-platform-owner" | "multi-platform-attempt" | "Name")
                )
            })
            .map(|t| {
                format!(
                    "{}={}",
                    t.key().unwrap_or_default(),
                    t.value().unwrap_or_default()
                )
            })
            .chain(i.launch_time().map(|t| format!("launched {t}")))
            .collect::<Vec<_>>()
            .join(", ");
        map.insert(
            id.to_owned(),
            Instance {
                ip: i.private_ip_address().and_then(|a| a.parse().ok()),
                tag,
                about,
            },
        );
    }
    Some(map)
}

/// Boots and retires the machines behind moto's instances; checks `max-instances`.
async fn cloud_loop(s: Arc<Soak>) {
    let limits = BTreeMap::from([(DYNAMIC_TAG, DYNAMIC_MAX), (POOL_TAG, POOL_MAX)]);
    while !s.done.load(Ordering::Relaxed) {
        let Some(all) = instances(&s).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        for (tag, max) in &limits {
            let n = all.values().filter(|i| i.tag == *tag).count();
            let mut seen = s.max_instances.lock().unwrap();
            let e = seen.entry((*tag).to_owned()).or_default();
            *e = (*e).max(n);
            if n > *max {
                drop(seen);
                s.violation(format!("{n} live {tag} instances (max-instances {max})"));
            }
        }
        // Machines boot and go away independently of each other, as real ones do: one slow
        // sshd start or user removal must not hold up the others.
        for (id, inst) in &all {
            let Some(ip) = inst.ip else { continue };
            let boot = {
                let mut c = s.cloud.lock().unwrap();
                c.ip_of.insert(id.clone(), ip);
                let new = !c.booted.contains_key(id) && !c.gone.contains(id);
                new && c.booting.insert(id.clone())
            };
            if boot {
                let (s, id, tag) = (s.clone(), id.clone(), inst.tag.clone());
                tokio::spawn(async move {
                    let admin = s.admin.clone();
                    let host = tokio::task::spawn_blocking(move || {
                        SshdHost::start_with(HostSetup {
                            address: Some(ip),
                            port: Some(22),
                            admin_key: Some(admin),
                            ..HostSetup::default()
                        })
                    })
                    .await
                    .expect("sshd start task");
                    let mut c = s.cloud.lock().unwrap();
                    c.booting.remove(&id);
                    match host {
                        // Gone while booting: dropped here (its sshd stops).
                        Ok(_) if c.gone.contains(&id) => {}
                        Ok(h) => {
                            c.booted.insert(id, (h, tag));
                        }
                        Err(e) => {
                            drop(c);
                            s.violation(format!("instance {id} at {ip}: sshd: {e:#}"));
                        }
                    }
                });
            }
        }
        let retired: Vec<String> = {
            let c = s.cloud.lock().unwrap();
            c.booted
                .keys()
                .filter(|id| !all.contains_key(*id))
                .cloned()
                .collect()
        };
        for id in retired {
            let (booted, users) = {
                let mut c = s.cloud.lock().unwrap();
                c.gone.insert(id.clone());
                let mut users = c.users_on.get(&id).cloned().unwrap_or_default();
                if let Some(ip) = c.ip_of.get(&id).map(ToString::to_string) {
                    users.extend(c.users_at.get(&ip).into_iter().flatten().cloned());
                }
                (c.booted.remove(&id), users)
            };
            let Some((host, tag)) = booted else { continue };
            // The machine and its disk go away: its sshd and the users made on it.
            let s = s.clone();
            tokio::spawn(async move {
                let lost = tokio::task::spawn_blocking(move || {
                    drop(host);
                    let lost = users.iter().filter(|u| e2e::sshd::user_exists(u)).count();
                    for u in &users {
                        e2e::sshd::remove_user(u);
                    }
                    lost
                })
                .await
                .expect("instance retire task");
                if tag == POOL_TAG {
                    s.cloud.lock().unwrap().pool_users_lost += lost as u64;
                }
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn passwd_users() -> BTreeSet<String> {
    std::fs::read_to_string("/etc/passwd")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(':').next())
        .filter(|n| n.starts_with("u-"))
        .map(str::to_owned)
        .collect()
}

/// Checks host concurrency and every secret's host, every ~150 ms.
async fn monitor_loop(s: Arc<Soak>) {
    let static_addr: BTreeMap<String, String> =
        s.p.hosts
            .iter()
            .map(|h| (h.name.clone(), h.sshd.address()))
            .collect();
    let trs: Api<DynamicObject> = Api::all_with(s.p.client.clone(), &tekton::taskrun_resource());
    let secrets: Api<Secret> = Api::all(s.p.client.clone());
    while !s.done.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let Ok(list) = bounded(&s, trs.list(&ListParams::default())).await else {
            continue;
        };
        let secret_list = ListParams::default()
            .labels(&format!("{}=true", contract::MULTI_PLATFORM_SECRET_LABEL));
        let Ok(secs) = bounded(&s, secrets.list(&secret_list)).await else {
            continue;
        };
        let users = passwd_users();
        let live_secrets: BTreeMap<(String, String), BTreeMap<String, String>> = secs
            .items
            .iter()
            .filter_map(|x| {
                Some((
                    (x.metadata.namespace.clone()?, x.metadata.name.clone()?),
                    secret_text(x),
                ))
            })
            .collect();
        let mut held: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut present: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut limit_of: BTreeMap<String, (String, usize)> = BTreeMap::new();
        for o in list.items {
            let tr = serde_json::to_value(&o).expect("serialisable");
            let (Some(ns), Some(name)) = (o.metadata.namespace.clone(), o.metadata.name.clone())
            else {
                continue;
            };
            let Some(host) = label(&tr, contract::ASSIGNED_HOST_LABEL) else {
                continue;
            };
            if host == "localhost" {
                continue;
            }
            let user = contract::remote_user_name(&name, &ns);
            let platform = label(&tr, contract::TARGET_PLATFORM_LABEL).unwrap_or_default();
            let secret = live_secrets.get(&(ns.clone(), contract::secret_name(&name)));
            if let Some(sec) = secret {
                s.saw_secret(sec);
            }
            let (kind, limit, address) = match static_addr.get(host) {
                Some(a) => {
                    let c = HOSTS.iter().find(|(n, _)| *n == host).map_or(1, |h| h.1);
                    (host.to_owned(), c as usize, Some(a.clone()))
                }
                None => {
                    let mut c = s.cloud.lock().unwrap();
                    c.users_on
                        .entry(host.to_owned())
                        .or_default()
                        .insert(user.clone());
                    let ip = c.ip_of.get(host).map(ToString::to_string);
                    if platform == "linux-ppc64le" {
                        ("pool".to_owned(), POOL_CONCURRENCY, ip)
                    } else {
                        ("dynamic".to_owned(), 1, ip)
                    }
                }
            };
            limit_of.insert(host.to_owned(), (kind, limit));
            if let Some(sec) = secret.filter(|x| x.contains_key("otp")) {
                let want = address.map(|a| format!("{user}@{a}"));
                if want.as_ref().is_some_and(|w| sec.get("host") != Some(w)) {
                    s.violation(format!(
                        "{ns}/{name}: secret host {:?}, but assigned to {host} ({want:?})",
                        sec.get("host")
                    ));
                }
            }
            let holds = secret.is_some_and(|x| x.contains_key("otp")) || users.contains(&user);
            let ended = tekton::is_done(&tr) || tr["metadata"]["deletionTimestamp"].is_string();
            if holds {
                let who = format!("{ns}/{name}");
                if !ended {
                    held.entry(host.to_owned()).or_default().push(who.clone());
                }
                present.entry(host.to_owned()).or_default().push(who);
            }
        }
        // Users of ended TaskRuns still being removed while their slot already serves the next.
        for (host, users) in &present {
            let limit = limit_of[host].1;
            if users.len() > limit {
                let mut o = s.overlaps.lock().unwrap();
                o.0 += 1;
                o.1 = o.1.max(users.len() - limit);
            }
        }
        for (host, holders) in held {
            let (kind, limit) = limit_of[&host].clone();
            {
                let mut m = s.max_held.lock().unwrap();
                let e = m.entry(kind).or_default();
                *e = (*e).max(holders.len());
            }
            if holders.len() > limit {
                s.violation(format!(
                    "host {host} holds {} TaskRuns (concurrency {limit}): {holders:?}",
                    holders.len()
                ));
            }
        }
    }
}

/// Index of the replica that leads now, if one answers as leader.
async fn leader(s: &Soak) -> Option<usize> {
    for (i, c) in s.p.controllers.iter().enumerate() {
        if c.alive()
            && c.metrics()
                .await
                .lines()
                .any(|l| l == "multi_platform_controller_leader 1")
        {
            return Some(i);
        }
    }
    None
}

/// `kill -9` of controller replica `i`, restarted after `down`.
async fn crash(s: &Soak, i: usize, kind: &'static str, down: Duration) {
    s.p.controllers[i].kill();
    s.count_fault(kind);
    tokio::time::sleep(down).await;
    s.p.controllers[i]
        .restart()
        .expect("restarting the controller");
}

/// Injects one fault every `every`, cycling through the kinds, until the workload is over and
/// every kind happened at least once.
async fn fault_loop(s: Arc<Soak>, every: Duration) {
    let faults = s.p.api.faults();
    let mut k = 0usize;
    loop {
        tokio::time::sleep(every).await;
        if s.stop.load(Ordering::Relaxed) && k >= FAULT_KINDS {
            return;
        }
        match k % FAULT_KINDS {
            0 => {
                let i = leader(&s).await.unwrap_or(0);
                // Back after the Lease expired: the other replica took over meanwhile.
                crash(&s, i, "controller leader kill -9", Duration::from_secs(4)).await;
            }
            1 => {
                faults.fail_next(RequestMatch::on(Verb::Patch, "taskruns"), 409, 5);
                s.count_fault("API 409 burst (5 taskrun patches)");
            }
            2 => {
                faults.fail_next(RequestMatch::on(Verb::Create, "secrets"), 500, 3);
                faults.fail_next(RequestMatch::on(Verb::Patch, "taskruns"), 500, 3);
                s.count_fault("API 500 burst (3 secret creates, 3 taskrun patches)");
            }
            3 => {
                faults.fail_next(RequestMatch::on(Verb::Patch, "taskruns"), 429, 4);
                faults.fail_next(RequestMatch::on(Verb::Delete, "secrets"), 429, 2);
                s.count_fault("API 429 burst (4 taskrun patches, 2 secret deletes)");
            }
            4 => {
                s.p.api.drop_watches();
                s.count_fault("watches dropped");
            }
            5 => {
                s.p.api.compact();
                s.p.api.drop_watches();
                s.count_fault("history compacted + watches dropped (410)");
            }
            6 => {
                s.p.api.restart(true).await.expect("API server restart");
                s.count_fault("API server restart (compacted)");
            }
            7 => {
                let h = &s.p.hosts[1].sshd;
                h.kill();
                s.count_fault("static sshd host h2 down 3 s");
                tokio::time::sleep(Duration::from_secs(3)).await;
                h.start_again().expect("h2 back");
            }
            8 => {
                s.proxy.inject(Fault::throttle("RunInstances", 3));
                s.proxy.inject(Fault::status("DescribeInstances", 500, 3));
                s.proxy.inject(Fault::throttle("TerminateInstances", 2));
                s.count_fault("EC2 burst (3 RunInstances throttled, 3 DescribeInstances 500, 2 TerminateInstances throttled)");
            }
            9 => {
                s.p.otp.kill();
                s.count_fault("OTP server kill -9 (back after 1 s)");
                tokio::time::sleep(Duration::from_secs(1)).await;
                s.p.restart_otp().expect("OTP server back");
            }
            _ => {
                let l = leader(&s).await;
                let i = (0..s.p.controllers.len())
                    .find(|i| Some(*i) != l)
                    .unwrap_or(0);
                crash(
                    &s,
                    i,
                    "controller follower kill -9",
                    Duration::from_millis(500),
                )
                .await;
            }
        }
        k += 1;
    }
}

/// The product with two replicas, static hosts, and a dynamic and a pool platform on moto behind
/// the fault proxy.
async fn start(progress_every: usize) -> Soak {
    let p = Product::start(e2e::mpc_binary!(), &HOSTS).await.unwrap();
    p.create_namespace("tenant-c").await.unwrap();
    // EC2 stops listing a terminated instance after about an hour; the soak runs hours of
    // instance turnover in minutes, so moto forgets them after one.
    let moto = Moto::start_forgetting_terminated_after(Duration::from_secs(60))
        .await
        .unwrap();
    let fx = moto
        .fixture_in("us-east-1", "127.0.0.0/16", SUBNET)
        .await
        .unwrap();
    let proxy = Ec2Proxy::start(moto.addr()).await.unwrap();
    let admin = AdminKey::generate().unwrap();
    p.put_moto_credentials("aws-account").await.unwrap();
    p.put_secret(
        NS,
        "instance-key",
        &[("id_rsa", admin.private().as_slice())],
    )
    .await
    .unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(p.client.clone(), NS);
    let current = cms.get(contract::HOST_CONFIG_NAME).await.unwrap();
    let mut cfg: Vec<(String, String)> = current.data.unwrap_or_default().into_iter().collect();
    for (platform, tag, max) in [
        (DYNAMIC, DYNAMIC_TAG, DYNAMIC_MAX),
        (POOL, POOL_TAG, POOL_MAX),
    ] {
        let key = platform.replace('/', "-");
        let max = max.to_string();
        let mut fields = vec![
            ("type", "aws"),
            ("region", "us-east-1"),
            ("ami", fx.ami.as_str()),
            ("instance-type", "t3.micro"),
            ("aws-secret", "aws-account"),
            ("ssh-secret", "instance-key"),
            ("subnet-id", fx.subnet_id.as_str()),
            ("user", "root"),
            ("max-instances", max.as_str()),
            ("instance-tag", tag),
            ("check-interval", "1"),
            ("allocation-timeout", "120"),
        ];
        if platform == POOL {
            fields.push(("concurrency", "2"));
            fields.push(("max-age", "1"));
        }
        cfg.extend(
            fields
                .into_iter()
                .map(|(k, v)| (format!("dynamic.{key}.{k}"), v.to_owned())),
        );
    }
    cfg.push(("dynamic-platforms".into(), DYNAMIC.into()));
    cfg.push(("dynamic-pool-platforms".into(), POOL.into()));
    p.set_config(&cfg).await.unwrap();
    let mut p = p;
    p.controller_flags = vec![
        "--ec2-endpoint".into(),
        proxy.endpoint(),
        "--instance-list-interval".into(),
        "2s".into(),
    ];
    p.start_controller("replica-a").await.unwrap();
    p.start_controller("replica-b").await.unwrap();
    Soak {
        p,
        moto,
        proxy,
        admin,
        cloud: Mutex::default(),
        violations: Mutex::default(),
        faults: Mutex::default(),
        max_held: Mutex::default(),
        max_instances: Mutex::default(),
        second_redeems: Mutex::default(),
        overlaps: Mutex::default(),
        stop: AtomicBool::new(false),
        done: AtomicBool::new(false),
        began: Instant::now(),
        local_secrets_left: AtomicUsize::new(0),
        finished: AtomicUsize::new(0),
        progress_every,
        calls_timed_out: AtomicUsize::new(0),
    }
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i]
}

/// What is left behind at the end; empty when nothing leaked.
async fn leftovers(s: &Soak, names: &[(String, String)]) -> Vec<String> {
    let mut left = Vec::new();
    for ns in NAMESPACES {
        let labelled = ListParams::default()
            .labels(&format!("{}=true", contract::MULTI_PLATFORM_SECRET_LABEL));
        match bounded(s, s.secrets(ns).list(&labelled)).await {
            Ok(l) => left.extend(l.items.iter().map(|x| {
                format!(
                    "secret {ns}/{}",
                    x.metadata.name.clone().unwrap_or_default()
                )
            })),
            Err(e) => left.push(format!("listing secrets: {e}")),
        }
        match bounded(s, s.taskruns(ns).list(&ListParams::default())).await {
            Ok(l) => left.extend(l.items.iter().filter_map(|o| {
                let tr = serde_json::to_value(o).ok()?;
                let name = o.metadata.name.clone()?;
                finalized(&tr).then(|| format!("finalizer on {ns}/{name}"))
            })),
            Err(e) => left.push(format!("listing taskruns: {e}")),
        }
    }
    let users = passwd_users();
    let running = instances(s).await;
    let cloud_machines_gone = running.as_ref().is_some_and(|all| {
        all.values()
            .all(|i| i.tag != DYNAMIC_TAG && i.tag != POOL_TAG)
    }) && s.cloud.lock().unwrap().booted.is_empty();
    for (i, (ns, name)) in names.iter().enumerate() {
        let u = contract::remote_user_name(name, ns);
        if !users.contains(&u) {
            continue;
        }
        match Strategy::of(i) {
            // All the machines share this one's /etc/passwd: a user made on an instance the
            // monitor never saw its TaskRun assigned to (it came and went while the API server
            // was down) was not removed when that instance went. With every instance gone, so
            // is every machine such a user could be on.
            Strategy::Dynamic | Strategy::Pool if cloud_machines_gone => {
                let user = u.clone();
                tokio::task::spawn_blocking(move || e2e::sshd::remove_user(&user))
                    .await
                    .expect("user removal task");
                s.cloud.lock().unwrap().unattributed_users += 1;
            }
            _ => left.push(format!("user {u}")),
        }
    }
    match running {
        Some(all) => left.extend(
            all.iter()
                .filter(|(_, i)| i.tag == DYNAMIC_TAG || i.tag == POOL_TAG)
                .map(|(id, i)| format!("instance {id} ({}) running: {}", i.tag, i.about)),
        ),
        None => left.push("moto did not answer".into()),
    }
    match s.p.otp_entries().await {
        Some(0) => {}
        n => left.push(format!("OTP store entries: {n:?}")),
    }
    left
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_soak_every_strategy_under_faults_keeps_the_invariants() {
    let total = env_or("SOAK_TASKRUNS", 48) as usize;
    let parallel = env_or("SOAK_PARALLEL", 10) as usize;
    let every = Duration::from_millis(env_or("SOAK_FAULT_EVERY_MS", 3000));
    let seed = env_or("SOAK_SEED", 1);
    let began = Instant::now();
    let s = Arc::new(start((total / 20).max(10)).await);
    let monitor = tokio::spawn(monitor_loop(s.clone()));
    let cloud = tokio::spawn(cloud_loop(s.clone()));
    let chaos = tokio::spawn(fault_loop(s.clone(), every));

    let gate = Arc::new(tokio::sync::Semaphore::new(parallel));
    let drivers: Vec<_> = (0..total)
        .map(|i| {
            let (s, gate) = (s.clone(), gate.clone());
            tokio::spawn(async move {
                let _permit = gate.acquire_owned().await.expect("semaphore");
                // Every wait in a driver is bounded; this catches one that is not.
                let limit = DONE_BOUND + Duration::from_secs(300);
                match tokio::time::timeout(limit, drive(s.clone(), seed, i)).await {
                    Ok(r) => r,
                    Err(_) => {
                        let ns = NAMESPACES[i % NAMESPACES.len()];
                        s.violation(format!(
                            "{ns}/soak-{i}: its driver did not return in {limit:?}"
                        ));
                        Record {
                            id: format!("{ns}/soak-{i}"),
                            outcome: "driver-stuck".into(),
                            done_after: None,
                        }
                    }
                }
            })
        })
        .collect();
    let mut records = Vec::new();
    for d in drivers {
        records.push(d.await.expect("driver task"));
    }
    let workload = began.elapsed();

    // Faults stop; everything that was down is up again for the final checks.
    s.stop.store(true, Ordering::Relaxed);
    chaos.await.expect("fault task");
    for (i, c) in s.p.controllers.iter().enumerate() {
        if !c.alive() {
            c.restart().expect("controller back");
            s.p.wait_ready(i).await.unwrap();
        }
    }
    if !s.p.otp.alive() {
        s.p.restart_otp().unwrap();
    }
    let names: Vec<(String, String)> = (0..total)
        .map(|i| {
            (
                NAMESPACES[i % NAMESPACES.len()].to_owned(),
                format!("soak-{i}"),
            )
        })
        .collect();
    // Pool instances are terminated once idle past `max-age` (1 minute).
    let settle = Instant::now();
    let mut left = leftovers(&s, &names).await;
    while !left.is_empty() && settle.elapsed() < Duration::from_secs(150) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        left = leftovers(&s, &names).await;
    }
    s.done.store(true, Ordering::Relaxed);
    monitor.await.expect("monitor task");
    cloud.await.expect("cloud task");

    // Summary.
    let mut times: Vec<Duration> = records.iter().filter_map(|r| r.done_after).collect();
    times.sort();
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &records {
        *outcomes.entry(r.outcome.as_str()).or_default() += 1;
    }
    let ec2_faults = s
        .proxy
        .requests()
        .iter()
        .filter(|r| r.fault.is_some())
        .count();
    println!(
        "soak: {total} TaskRuns ({parallel} in flight), workload {:.1} s, settle {:.1} s, seed {seed}",
        workload.as_secs_f64(),
        settle.elapsed().as_secs_f64()
    );
    for (kind, n) in s.faults.lock().unwrap().iter() {
        println!("soak fault: {kind}: {n}");
    }
    println!(
        "soak fault: API requests failed on purpose: {}",
        s.p.api.faults().injected()
    );
    println!("soak fault: EC2 requests answered with a fault: {ec2_faults}");
    println!(
        "soak: done {} of {total}; time to done p50 {:.1} s, p99 {:.1} s, max {:.1} s (bound {} s)",
        times.len(),
        percentile(&times, 0.5).as_secs_f64(),
        percentile(&times, 0.99).as_secs_f64(),
        times.last().copied().unwrap_or_default().as_secs_f64(),
        DONE_BOUND.as_secs()
    );
    for strategy in [
        Strategy::Local,
        Strategy::Static,
        Strategy::Dynamic,
        Strategy::Pool,
    ] {
        // The record's id names its strategy as its second word.
        let word = format!("{strategy:?}");
        let mut of: Vec<Duration> = records
            .iter()
            .filter(|r| r.id.split(' ').nth(1) == Some(word.as_str()))
            .filter_map(|r| r.done_after)
            .collect();
        of.sort();
        println!(
            "soak: {word}: done {}; time to done p50 {:.1} s, p99 {:.1} s, max {:.1} s",
            of.len(),
            percentile(&of, 0.5).as_secs_f64(),
            percentile(&of, 0.99).as_secs_f64(),
            of.last().copied().unwrap_or_default().as_secs_f64(),
        );
    }
    println!("soak outcomes: {outcomes:?}");
    println!(
        "soak: most TaskRuns on one host: {:?} (concurrency h1 2, h2 1, dynamic 1, pool {POOL_CONCURRENCY})",
        s.max_held.lock().unwrap()
    );
    println!(
        "soak: most live instances: {:?} (max-instances {DYNAMIC_TAG} {DYNAMIC_MAX}, {POOL_TAG} {POOL_MAX})",
        s.max_instances.lock().unwrap()
    );
    {
        let c = s.cloud.lock().unwrap();
        println!(
            "soak: instances seen running {}, retired {}, users on terminated pool instances {}, cloud users never seen on an instance (removed at the end) {}; second redeems refused {}",
            c.ip_of.len(),
            c.gone.len(),
            c.pool_users_lost,
            c.unattributed_users,
            s.second_redeems.lock().unwrap()
        );
    }
    let (ticks, worst) = *s.overlaps.lock().unwrap();
    println!(
        "soak: monitor ticks with a finished TaskRun's user still on a host whose slot already serves the next: {ticks} (at most {worst} over concurrency)"
    );
    println!(
        "soak: local TaskRuns whose secret outlived them until pruning (garbage collector): {}",
        s.local_secrets_left.load(Ordering::Relaxed)
    );
    println!(
        "soak: harness API requests given up after {CALL_LIMIT:?}: {}",
        s.calls_timed_out.load(Ordering::Relaxed)
    );
    println!("soak: leftovers {left:?}");
    for r in records.iter().filter(|r| r.done_after.is_none()) {
        println!("soak: not done: {} ({})", r.id, r.outcome);
    }
    let mut slow: Vec<&Record> = records.iter().filter(|r| r.done_after.is_some()).collect();
    slow.sort_by_key(|r| std::cmp::Reverse(r.done_after));
    for r in slow.iter().take(3) {
        println!(
            "soak: slow: {} ({}) done after {:.1} s",
            r.id,
            r.outcome,
            r.done_after.unwrap_or_default().as_secs_f64()
        );
    }
    // What the processes logged about the slowest one.
    if let Some(r) = slow
        .first()
        .filter(|r| r.done_after > Some(Duration::from_secs(60)))
    {
        let name = r.id.split([' ', '/']).nth(1).unwrap_or_default();
        let needle = format!("\"{name}\"");
        for p in s.p.controllers.iter().chain(std::iter::once(&s.p.otp)) {
            for l in p
                .log_text()
                .lines()
                .filter(|l| l.contains(&needle))
                .take(30)
            {
                println!("soak: log {}: {l}", p.name);
            }
        }
    }

    // The full logs outlive the run when asked for (the product's directory does not).
    if let Ok(dir) = std::env::var("SOAK_LOG_DIR") {
        std::fs::create_dir_all(&dir).expect("SOAK_LOG_DIR");
        for p in s.p.controllers.iter().chain(std::iter::once(&s.p.otp)) {
            let to = std::path::Path::new(&dir).join(format!("{}.log", p.name));
            std::fs::write(&to, p.log_text()).expect("copying a log");
        }
        println!("soak: logs kept in {dir}");
    }

    let violations = s.violations.lock().unwrap().clone();
    assert!(
        violations.is_empty() && left.is_empty(),
        "{} violations:\n{}\nleftovers: {left:#?}\n{}",
        violations.len(),
        violations.join("\n"),
        s.p.logs()
    );
    assert_eq!(
        s.faults.lock().unwrap().len(),
        FAULT_KINDS,
        "every kind of fault happened"
    );
    assert_eq!(times.len(), total);
}
