//! Property tests of the scheduler core against a model controller.
//!
//! A randomized executor plays the controller and the world: it creates, finishes and retries
//! TaskRuns, executes actions with random delays (results delivered in random order), lets them
//! fail, replays results, changes the config, crashes the scheduler (in-flight operations either
//! complete unseen or are lost) and rebuilds it from a snapshot of the world. Invariants are
//! checked on every action; after the random phase the world quiesces and must end clean.
//!
//! `MODEL_CASES=20000` searches deeper; `MODEL_TRACE=1` prints every command, event and action.

use std::collections::BTreeMap;
use std::time::Duration;

use mpc::config::{ConfigData, HostConfig};
use mpc::platform::Platform;
use mpc::provision::HostUser;
use mpc::scheduler::{
    Action, Event, InstanceRecord, InstanceState, OpId, Ownership, Policy, ProbeResult, RemoteUser,
    Scheduler, SecretData, SecretKind, Snapshot, TaskRunRecord, TaskRunSpec, Time,
};
use proptest::prelude::*;

const PLATFORMS: [&str; 6] = [
    "linux/s390x",
    "linux/arm64",
    "linux/amd64",
    "linux/x86_64",
    "linux/riscv64",
    "Bad/Platform",
];

fn dynamic(label: &str, ami: &str, max: u32, pool: Option<u32>) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = [
        ("type", "aws"),
        ("region", "us-east-1"),
        ("ami", ami),
        ("instance-type", "m6g.large"),
        ("aws-secret", "aws"),
        ("ssh-secret", "ssh"),
        ("instance-tag", &format!("tag-{label}")),
    ]
    .iter()
    .map(|(f, v)| (format!("dynamic.{label}.{f}"), v.to_string()))
    .collect();
    v.push((format!("dynamic.{label}.max-instances"), max.to_string()));
    if let Some(c) = pool {
        v.push((format!("dynamic.{label}.concurrency"), c.to_string()));
        v.push((format!("dynamic.{label}.max-age"), "30".into()));
    }
    v
}

fn host(name: &str, c: u32) -> Vec<(String, String)> {
    [
        ("address", format!("10.0.0.{}", name.len())),
        ("user", "root".into()),
        ("platform", "linux/s390x".into()),
        ("secret", "s".into()),
        ("concurrency", c.to_string()),
    ]
    .into_iter()
    .map(|(f, v)| (format!("host.{name}.{f}"), v))
    .collect()
}

/// Three configs the run switches between: capacities shrink and grow, a host disappears, a
/// platform turns local, instance templates change.
fn configs() -> Vec<HostConfig> {
    let mut a = vec![
        ("local-platforms".to_owned(), "linux/x86_64".to_owned()),
        ("dynamic-platforms".into(), "linux/arm64".into()),
        ("dynamic-pool-platforms".into(), "linux/amd64".into()),
    ];
    let mut b = a.clone();
    let mut c = vec![
        (
            "local-platforms".to_owned(),
            "linux/x86_64,linux/s390x".to_owned(),
        ),
        ("dynamic-platforms".into(), "linux/arm64".into()),
        ("dynamic-pool-platforms".into(), "linux/amd64".into()),
    ];
    a.extend(host("h1", 2));
    a.extend(host("h22", 1));
    a.extend(dynamic("linux-arm64", "ami-1", 2, None));
    a.extend(dynamic("linux-amd64", "ami-1", 2, Some(2)));
    b.extend(host("h1", 1));
    b.extend(host("h333", 2));
    b.extend(dynamic("linux-arm64", "ami-1", 1, None));
    b.extend(dynamic("linux-amd64", "ami-1", 1, Some(3)));
    c.extend(dynamic("linux-arm64", "ami-2", 3, None));
    c.extend(dynamic("linux-amd64", "ami-2", 2, Some(2)));
    // Used to quiesce: every host the run may have used is configured again, so leftovers of
    // allocations lost with a host's removal (and a restart) can be swept.
    let mut all = a.clone();
    all.extend(host("h333", 2));
    [a, b, c, all]
        .into_iter()
        .map(|pairs| {
            let data: ConfigData = pairs.into_iter().collect();
            let parsed = mpc::config::parse(&data);
            assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
            parsed.config
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Cmd {
    Create { platform: usize, ns: u8 },
    Finish(u16),
    Retry(u16),
    Deliver { pick: u16, ok: bool },
    Duplicate(u16),
    Advance(u16),
    Restart { flush: bool },
    Config(u8),
    Sweep,
}

fn cmd() -> impl Strategy<Value = Cmd> {
    prop_oneof![
        4 => (0..PLATFORMS.len(), 0u8..3).prop_map(|(platform, ns)| Cmd::Create { platform, ns }),
        2 => any::<u16>().prop_map(Cmd::Finish),
        1 => any::<u16>().prop_map(Cmd::Retry),
        8 => (any::<u16>(), prop::bool::weighted(0.8)).prop_map(|(pick, ok)| Cmd::Deliver { pick, ok }),
        1 => any::<u16>().prop_map(Cmd::Duplicate),
        3 => (0u16..200).prop_map(Cmd::Advance),
        1 => any::<bool>().prop_map(|flush| Cmd::Restart { flush }),
        1 => (0u8..3).prop_map(Cmd::Config),
        1 => Just(Cmd::Sweep),
    ]
}

struct WTaskRun {
    spec: TaskRunSpec,
    done: bool,
    finalizer: bool,
    assigned_host: Option<String>,
    failed_hosts: Vec<String>,
    instance_id: Option<String>,
    instance_address: Option<String>,
    secret: Option<SecretKind>,
    /// Secrets written in the current attempt.
    secrets_this_attempt: u32,
    /// A secret was ever written.
    served: bool,
}

struct WInstance {
    platform: String,
    tag: String,
    /// Owner tag: the launch's (or the last retag's) owner key.
    owner: String,
    launched_at: Time,
    alive: bool,
}

/// An action being executed; its world effect and result happen on delivery.
#[derive(Clone, Debug)]
enum Pending {
    Provision {
        op: OpId,
        uid: String,
        user: String,
        host: String,
    },
    Deprovision {
        op: OpId,
        user: String,
        host: String,
    },
    Launch {
        op: OpId,
        platform: String,
        token: String,
        tag: String,
        owner: String,
    },
    Probe {
        op: OpId,
        id: String,
    },
    Terminate {
        op: OpId,
        id: String,
    },
}

struct World {
    cfgs: Vec<HostConfig>,
    cfg: usize,
    policy: Policy,
    sched: Scheduler,
    now: Time,
    taskruns: BTreeMap<String, WTaskRun>,
    /// Users on each host, with when they were created.
    users: BTreeMap<String, BTreeMap<String, Time>>,
    instances: BTreeMap<String, WInstance>,
    tokens: BTreeMap<String, String>,
    pending: Vec<Pending>,
    history: Vec<Event>,
    /// Static host each live allocation holds (from the `assigned-host` label).
    alloc: BTreeMap<String, String>,
    next: u64,
}

impl World {
    fn new(mut policy: Policy) -> Self {
        // Quiescing spans hours of virtual time, not the default day: a shorter grace lets its
        // sweeps reach what failed provisioning left behind.
        policy.host_user_grace = Duration::from_secs(30 * 60);
        let cfgs = configs();
        let sched = Scheduler::new(cfgs[0].clone(), policy.clone());
        let mut w = World {
            cfgs,
            cfg: 0,
            policy,
            sched,
            now: Time::from_secs(1_700_000_000),
            taskruns: BTreeMap::new(),
            users: BTreeMap::new(),
            instances: BTreeMap::new(),
            tokens: BTreeMap::new(),
            pending: Vec::new(),
            history: Vec::new(),
            alloc: BTreeMap::new(),
            next: 0,
        };
        let mut out = Vec::new();
        w.sched.recover(w.now, Snapshot::default(), &mut out);
        w.apply(out);
        w
    }

    fn config(&self) -> &HostConfig {
        &self.cfgs[self.cfg]
    }

    fn send(&mut self, e: Event) {
        if std::env::var_os("MODEL_TRACE").is_some() && !matches!(e, Event::Tick) {
            println!(
                ">> {}",
                format!("{e:?}").chars().take(160).collect::<String>()
            );
        }
        let mut out = Vec::new();
        self.sched.handle(self.now, e, &mut out);
        self.apply(out);
    }

    fn max_instances(&self, platform: &str) -> u32 {
        let p = Platform::parse(platform).unwrap();
        match self.config().resolve(&p) {
            mpc::config::Strategy::Dynamic(d) => d.max_instances,
            mpc::config::Strategy::DynamicPool(d) => d.instance.max_instances,
            _ => 0,
        }
    }

    fn host_concurrency(&self, name: &str) -> Option<u32> {
        self.config()
            .static_pools
            .values()
            .flat_map(|p| &p.hosts)
            .find(|h| h.name == name)
            .map(|h| h.concurrency)
    }

    fn apply(&mut self, actions: Vec<Action>) {
        for a in actions {
            self.apply_one(a);
        }
    }

    fn apply_one(&mut self, a: Action) {
        if std::env::var_os("MODEL_TRACE").is_some() {
            println!("{:?}", a);
        }
        match a {
            Action::Record { taskrun, placement } => {
                let uid = taskrun.uid().to_string();
                let Some(t) = self.taskruns.get_mut(&uid) else {
                    return;
                };
                t.assigned_host = placement.assigned_host.as_deref().map(str::to_owned);
                t.failed_hosts = placement
                    .failed_hosts
                    .map(|f| f.split(',').map(str::to_owned).collect())
                    .unwrap_or_default();
                t.instance_id = placement.instance_id.as_deref().map(str::to_owned);
                t.instance_address = placement.instance_address.as_deref().map(str::to_owned);
                let done = t.done;
                match placement.assigned_host.as_deref() {
                    Some(h) if h.starts_with('h') => {
                        if self.alloc.get(&uid).map(String::as_str) != Some(h) {
                            assert!(!done, "new allocation for a finished TaskRun {uid}");
                            let held = self.alloc.values().filter(|x| *x == h).count() as u32;
                            let limit = self.host_concurrency(h).unwrap_or(0);
                            assert!(
                                held < limit,
                                "host {h} over its concurrency {limit}: {held} held + {uid}"
                            );
                            self.alloc.insert(uid, h.to_owned());
                        }
                    }
                    _ => {
                        self.alloc.remove(&uid);
                    }
                }
            }
            Action::WriteSecret { taskrun, secret } => {
                let uid = taskrun.uid().to_string();
                let t = self
                    .taskruns
                    .get_mut(&uid)
                    .unwrap_or_else(|| panic!("secret for a TaskRun that is gone: {uid}"));
                assert!(!t.done, "secret written after the TaskRun finished: {uid}");
                t.secrets_this_attempt += 1;
                assert_eq!(
                    t.secrets_this_attempt, 1,
                    "two secrets in one attempt: {uid}"
                );
                t.served = true;
                t.secret = Some(match secret {
                    SecretData::Remote { .. } => SecretKind::Remote,
                    SecretData::Localhost => SecretKind::Localhost,
                    SecretData::Error(m) => {
                        assert!(!m.is_empty());
                        self.alloc.remove(&uid);
                        SecretKind::Error
                    }
                });
            }
            Action::DeleteSecret { taskrun } => {
                if let Some(t) = self.taskruns.get_mut(&taskrun.uid().to_string()) {
                    t.secret = None;
                }
            }
            Action::RemoveFinalizer { taskrun } => {
                let uid = taskrun.uid().to_string();
                if let Some(t) = self.taskruns.get_mut(&uid) {
                    t.finalizer = false;
                    if t.done {
                        self.taskruns.remove(&uid);
                    }
                }
            }
            Action::Provision {
                op, taskrun, host, ..
            } => {
                let uid = taskrun.uid().to_string();
                assert!(
                    self.taskruns.get(&uid).is_some_and(|t| !t.done),
                    "provisioning for a finished TaskRun {uid}"
                );
                self.pending.push(Pending::Provision {
                    op,
                    uid,
                    user: taskrun.remote_user(),
                    host: host.name().to_owned(),
                });
            }
            Action::Deprovision { op, user, host } => {
                if let RemoteUser::Named(name) = &user {
                    // A sweep's: never a user younger than the grace period.
                    let created = self.users.get(host.name()).and_then(|u| u.get(name));
                    assert!(
                        created.is_none_or(|c| *c + self.policy.host_user_grace <= self.now),
                        "swept {name} created at {created:?}, now {}",
                        self.now
                    );
                }
                self.pending.push(Pending::Deprovision {
                    op,
                    user: user.name(),
                    host: host.name().to_owned(),
                })
            }
            Action::Launch {
                op,
                platform,
                template,
                launch,
                ..
            } => {
                let p = platform.as_str().to_owned();
                let alive = self
                    .instances
                    .values()
                    .filter(|i| i.alive && i.platform == p)
                    .count();
                let launching = self
                    .pending
                    .iter()
                    .filter(|x| matches!(x, Pending::Launch { platform, .. } if *platform == p))
                    .count();
                let max = self.max_instances(&p) as usize;
                assert!(
                    alive + launching < max,
                    "{p}: {alive} alive + {launching} launching, max {max}: no room for another"
                );
                // The cloud's idempotency token: one per launch identity.
                self.pending.push(Pending::Launch {
                    op,
                    platform: p,
                    token: format!("{}|{}", launch.owner_key(), launch.attempt_tag()),
                    tag: template.instance_tag.clone(),
                    owner: launch.owner_key(),
                });
            }
            Action::Probe {
                op, instance_id, ..
            } => self.pending.push(Pending::Probe {
                op,
                id: instance_id.to_string(),
            }),
            Action::Terminate {
                op, instance_id, ..
            } => self.pending.push(Pending::Terminate {
                op,
                id: instance_id.to_string(),
            }),
            Action::Retag {
                instance_id,
                launch,
                ..
            } => {
                if let Some(i) = self.instances.get_mut(&*instance_id) {
                    i.owner = launch.owner_key();
                }
            }
            Action::Ungate { .. } | Action::Notify { .. } | Action::Observe(_) => {}
        }
    }

    /// Executes a pending action in the world; returns its result event.
    fn execute(&mut self, p: Pending, ok: bool) -> Event {
        match p {
            Pending::Provision {
                op,
                uid,
                user,
                host,
            } => {
                // A terminated instance refuses connections.
                let gone = self.instances.get(&host).is_some_and(|i| !i.alive);
                let ok = ok && !gone;
                if !gone && (ok || self.next.is_multiple_of(2)) {
                    // Failures may leave a half-made user behind.
                    let now = self.now;
                    self.users
                        .entry(host.clone())
                        .or_default()
                        .entry(user)
                        .or_insert(now);
                }
                self.next += 1;
                if ok {
                    Event::Provisioned {
                        op,
                        otp: "token".into(),
                    }
                } else {
                    if self.alloc.get(&uid) == Some(&host) {
                        self.alloc.remove(&uid);
                    }
                    Event::ProvisionFailed {
                        op,
                        error: "simulated".into(),
                    }
                }
            }
            Pending::Deprovision { op, user, host } => {
                if ok {
                    if let Some(u) = self.users.get_mut(&host) {
                        u.remove(&user);
                    }
                    Event::Deprovisioned { op, error: None }
                } else {
                    Event::Deprovisioned {
                        op,
                        error: Some("simulated".into()),
                    }
                }
            }
            Pending::Launch {
                op,
                platform,
                token,
                tag,
                owner,
            } => {
                if !ok {
                    return Event::LaunchFailed {
                        op,
                        error: "simulated".into(),
                        retryable: !self.next.is_multiple_of(3),
                    };
                }
                let id = match self.tokens.get(&token) {
                    // An earlier try's instance: adopted when alive, spent when gone.
                    Some(id) if !self.instances[id].alive => {
                        return Event::LaunchSpent {
                            op,
                            instance_id: id.clone(),
                            state: InstanceState::Terminated,
                        };
                    }
                    Some(id) => id.clone(),
                    None => {
                        self.next += 1;
                        let id = format!("i-{}", self.next);
                        self.tokens.insert(token, id.clone());
                        self.instances.insert(
                            id.clone(),
                            WInstance {
                                platform,
                                tag,
                                owner,
                                launched_at: self.now,
                                alive: true,
                            },
                        );
                        id
                    }
                };
                Event::Launched {
                    op,
                    instance_id: id,
                }
            }
            Pending::Probe { op, id } => {
                let result = match self.instances.get(&id) {
                    Some(i) if i.alive && ok => {
                        if self.now >= i.launched_at + Duration::from_secs(30) {
                            ProbeResult::Reachable {
                                address: format!("addr-{id}"),
                            }
                        } else {
                            ProbeResult::Pending
                        }
                    }
                    _ => ProbeResult::Failed {
                        reason: "simulated".into(),
                    },
                };
                Event::Probed { op, result }
            }
            Pending::Terminate { op, id } => {
                if ok {
                    if let Some(i) = self.instances.get_mut(&id) {
                        i.alive = false;
                    }
                    self.users.remove(&id);
                    Event::Terminated { op, error: None }
                } else {
                    Event::Terminated {
                        op,
                        error: Some("simulated".into()),
                    }
                }
            }
        }
    }

    fn deliver(&mut self, idx: usize, ok: bool) {
        let p = self.pending.remove(idx);
        let e = self.execute(p, ok);
        self.history.push(e.clone());
        self.send(e);
    }

    fn live(&self) -> Vec<String> {
        self.taskruns
            .iter()
            .filter(|(_, t)| !t.done)
            .map(|(u, _)| u.clone())
            .collect()
    }

    fn finish(&mut self, uid: &str) {
        let t = self.taskruns.get_mut(uid).unwrap();
        t.done = true;
        self.alloc.remove(uid);
        let e = Event::TaskRunDone {
            namespace: t.spec.namespace.clone(),
            name: t.spec.name.clone(),
            uid: uid.to_owned(),
        };
        self.history.push(e.clone());
        self.send(e);
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            taskruns: self
                .taskruns
                .values()
                .map(|t| TaskRunRecord {
                    namespace: t.spec.namespace.clone(),
                    name: t.spec.name.clone(),
                    uid: t.spec.uid.clone(),
                    platform: t.spec.platform.clone(),
                    since: t.spec.since,
                    retries: t.spec.retries,
                    gated: false,
                    finished: t.done,
                    assigned_host: t.assigned_host.clone(),
                    failed_hosts: t.failed_hosts.clone(),
                    instance_id: t.instance_id.clone(),
                    instance_address: t.instance_address.clone(),
                    secret: t.secret,
                })
                .collect(),
            instances: self.listed(None),
        }
    }

    fn listed(&self, platform: Option<&str>) -> Vec<InstanceRecord> {
        self.instances
            .iter()
            .filter(|(_, i)| i.alive && platform.is_none_or(|p| p == i.platform))
            .map(|(id, i)| InstanceRecord {
                id: id.clone(),
                platform: Platform::parse(&i.platform).unwrap(),
                instance_tag: i.tag.clone(),
                ownership: Ownership::Ours,
                platform_label: Some(Platform::parse(&i.platform).unwrap().label_value()),
                owner: Some(i.owner.clone()),
                launched_at: i.launched_at,
                state: InstanceState::Running,
                address: Some(format!("addr-{id}")),
            })
            .collect()
    }

    fn restart(&mut self, flush: bool) {
        let pending = std::mem::take(&mut self.pending);
        if flush {
            // In flight at the crash: done in the world, results never seen.
            for p in pending {
                self.execute(p, true);
            }
        }
        // Results still queued (including duplicates) are from the old process: dropped.
        self.history.clear();
        self.sched = Scheduler::new(self.config().clone(), self.policy.clone());
        let mut out = Vec::new();
        let snap = self.snapshot();
        self.sched.recover(self.now, snap, &mut out);
        self.apply(out);
    }

    fn sweep(&mut self) {
        for p in ["linux/arm64", "linux/amd64"] {
            let e = Event::InstancesListed {
                platform: Platform::parse(p).unwrap(),
                instances: self.listed(Some(p)),
            };
            self.send(e);
        }
        let hosts: Vec<String> = self
            .config()
            .static_pools
            .values()
            .flat_map(|p| p.hosts.iter().map(|h| h.name.clone()))
            .collect();
        for h in hosts {
            let now = self.now;
            let users = self
                .users
                .get(&h)
                .into_iter()
                .flatten()
                .map(|(name, created)| HostUser {
                    name: name.clone(),
                    age: Some(now.since(*created)),
                })
                .collect();
            self.send(Event::HostUsersListed { host: h, users });
        }
    }

    fn run(&mut self, c: &Cmd) {
        if std::env::var_os("MODEL_TRACE").is_some() {
            println!("== {c:?} at {}", self.now);
        }
        match *c {
            Cmd::Create { platform, ns } => {
                self.next += 1;
                let spec = TaskRunSpec {
                    namespace: format!("ns{ns}"),
                    name: format!("tr-{}", self.next % 7),
                    uid: format!("uid-{}", self.next),
                    platform: PLATFORMS[platform].to_owned(),
                    since: self.now,
                    retries: 0,
                    gated: self.next.is_multiple_of(2),
                };
                self.taskruns.insert(
                    spec.uid.clone(),
                    WTaskRun {
                        spec: spec.clone(),
                        done: false,
                        finalizer: true,
                        assigned_host: None,
                        failed_hosts: Vec::new(),
                        instance_id: None,
                        instance_address: None,
                        secret: None,
                        secrets_this_attempt: 0,
                        served: false,
                    },
                );
                self.history.push(Event::TaskRun(spec.clone()));
                self.send(Event::TaskRun(spec));
            }
            Cmd::Finish(pick) => {
                let live = self.live();
                if !live.is_empty() {
                    let uid = live[pick as usize % live.len()].clone();
                    self.finish(&uid);
                }
            }
            Cmd::Retry(pick) => {
                let live: Vec<String> = self
                    .live()
                    .into_iter()
                    .filter(|u| self.taskruns[u].secret.is_some())
                    .collect();
                if !live.is_empty() {
                    let uid = live[pick as usize % live.len()].clone();
                    let t = self.taskruns.get_mut(&uid).unwrap();
                    t.spec.retries += 1;
                    t.secrets_this_attempt = 0;
                    let spec = t.spec.clone();
                    self.send(Event::TaskRun(spec));
                }
            }
            Cmd::Deliver { pick, ok } => {
                if !self.pending.is_empty() {
                    let idx = pick as usize % self.pending.len();
                    self.deliver(idx, ok);
                }
            }
            Cmd::Duplicate(pick) => {
                if !self.history.is_empty() {
                    let e = self.history[pick as usize % self.history.len()].clone();
                    // Only results and TaskRun creations are replayed; a replayed creation of a
                    // retried TaskRun would be an older attempt, which the watch never sends.
                    if !matches!(&e, Event::TaskRun(s) if s.retries != self.taskruns.get(&s.uid).map_or(0, |t| t.spec.retries))
                    {
                        self.send(e);
                    }
                }
            }
            Cmd::Advance(secs) => {
                self.now = self.now + Duration::from_secs(u64::from(secs));
                self.send(Event::Tick);
            }
            Cmd::Restart { flush } => self.restart(flush),
            Cmd::Config(which) => {
                self.cfg = which as usize % 3;
                let c = self.config().clone();
                self.send(Event::ConfigReplaced(Box::new(c)));
            }
            Cmd::Sweep => self.sweep(),
        }
    }

    /// No new work; everything succeeds; builds finish once they have a secret. Must reach a
    /// clean state in bounded time.
    fn quiesce(&mut self) {
        self.cfg = 3;
        let c = self.config().clone();
        self.send(Event::ConfigReplaced(Box::new(c)));
        for round in 0..400 {
            while !self.pending.is_empty() {
                self.deliver(0, true);
            }
            let served: Vec<String> = self
                .live()
                .into_iter()
                .filter(|u| self.taskruns[u].secret.is_some())
                .collect();
            for uid in served {
                self.finish(&uid);
            }
            if self.taskruns.is_empty()
                && self.pending.is_empty()
                && self.instances.values().all(|i| !i.alive)
                && self.users.values().all(BTreeMap::is_empty)
            {
                return;
            }
            self.now = self.now + Duration::from_secs(60);
            self.send(Event::Tick);
            if round % 5 == 0 {
                self.sweep();
            }
        }
        let stuck: Vec<_> = self
            .taskruns
            .iter()
            .map(|(u, t)| {
                (
                    u.clone(),
                    t.spec.platform.clone(),
                    t.done,
                    t.secret,
                    t.assigned_host.clone(),
                )
            })
            .collect();
        let alive: Vec<_> = self
            .instances
            .iter()
            .filter(|(_, i)| i.alive)
            .map(|(id, _)| id.clone())
            .collect();
        let users: Vec<_> = self.users.iter().filter(|(_, u)| !u.is_empty()).collect();
        let gauges = self.sched.gauges().platforms;
        panic!(
            "did not quiesce: taskruns {stuck:?}, instances {alive:?}, users {users:?}, scheduler {gauges:?}"
        );
    }
}

/// Case count: the default keeps the suite fast; `MODEL_CASES=5000` runs a deep search.
fn cases(default: u32) -> u32 {
    std::env::var("MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn check(policy: Policy, cmds: &[Cmd]) {
    let mut w = World::new(policy);
    for c in cmds {
        w.run(c);
    }
    w.quiesce();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(96), ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_random_events(cmds in prop::collection::vec(cmd(), 1..160)) {
        check(Policy::mpc(), &cmds);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    #[test]
    fn go_policy_also_keeps_capacity_invariants(cmds in prop::collection::vec(cmd(), 1..120)) {
        let mut w = World::new(Policy::mpc_go());
        for c in &cmds {
            w.run(c);
        }
    }
}

#[test]
fn every_taskrun_that_was_not_cancelled_was_served() {
    // A deterministic busy run: many TaskRuns on every platform, then quiesce.
    let mut w = World::new(Policy::mpc());
    for i in 0..60 {
        w.run(&Cmd::Create {
            platform: i % PLATFORMS.len(),
            ns: (i % 3) as u8,
        });
        w.run(&Cmd::Deliver {
            pick: i as u16,
            ok: i % 7 != 0,
        });
        w.run(&Cmd::Advance(7));
    }
    let uids: Vec<String> = w.taskruns.keys().cloned().collect();
    w.quiesce();
    assert!(w.taskruns.is_empty());
    assert!(!uids.is_empty());
}

/// Found by the property test: TaskRuns requeued while an instance failed must not land on that
/// instance (it was still indexed as booting with free slots) and be stranded when it goes.
#[test]
fn requeued_taskruns_never_land_on_a_failing_instance() {
    use Cmd::*;
    let c = |platform, ns| Create { platform, ns };
    let d = |pick, ok| Deliver { pick, ok };
    let cmds = vec![
        c(2, 0),
        c(1, 0),
        c(3, 0),
        c(2, 0),
        d(0, true),
        c(3, 0),
        c(0, 0),
        c(0, 0),
        Finish(47503),
        Duplicate(0),
        Retry(0),
        c(1, 0),
        c(1, 0),
        Retry(0),
        c(1, 0),
        c(3, 0),
        Finish(35495),
        c(1, 0),
        c(2, 0),
        Advance(30),
        c(1, 0),
        Config(2),
        c(0, 0),
        c(2, 0),
        c(0, 0),
        d(3890, true),
        d(29, true),
        d(5206, true),
        Finish(17332),
        Retry(900),
        Retry(385),
        Retry(35),
        Retry(5650),
        c(0, 0),
        Advance(20),
        d(463, true),
        c(2, 0),
        Retry(27291),
        Retry(6623),
        c(0, 0),
        d(7502, false),
        c(0, 0),
        Finish(22704),
        c(0, 0),
        Restart { flush: true },
        c(0, 0),
        c(0, 0),
        c(0, 0),
        c(0, 0),
        c(0, 0),
        Duplicate(0),
        c(0, 0),
        d(28284, false),
        c(0, 0),
        d(38536, false),
    ];
    check(Policy::mpc(), &cmds);
}
