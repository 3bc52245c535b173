//! The discrete-event simulation: the real [`Scheduler`] driven by a virtual clock, with a
//! simulated cluster and cloud answering its actions after seeded-random latencies. Pure: no
//! I/O, no wall clock; the same inputs give the same outcome.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::latency::{Latencies, lognormal};
use super::workload::Workload;
use crate::config::{HostConfig, HostOs, Strategy};
use crate::platform::Platform;
use crate::scheduler::{
    Action, Blame, Event, HostRef, Policy, ProbeResult, Scheduler, SecretData, Snapshot,
    StateError, TaskRunRef, TaskRunSpec, Time, Uid,
};

/// Settings of one run.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// Scheduler policy.
    pub policy: Policy,
    /// Seed of the latency model.
    pub seed: u64,
    /// Latency model.
    pub latencies: Latencies,
    /// Chart sampling period.
    pub sample_every: Duration,
    /// Check the scheduler's state ([`Scheduler::check`]) after every this many events and at
    /// the end; `None`: never. A broken invariant stops the run.
    pub check_every: Option<u64>,
    /// Sets of platforms whose peak of instances alive at once is reported as a group's
    /// ([`Outcome::group_peaks`]), by name, beside the config's own capacity groups: how a run
    /// without a group shows the peak the group would have capped.
    pub watch_groups: Vec<(String, Vec<String>)>,
}

impl SimSettings {
    /// Defaults for a policy.
    pub fn new(policy: Policy, seed: u64) -> Self {
        SimSettings {
            policy,
            seed,
            latencies: Latencies::default(),
            sample_every: Duration::from_secs(300),
            check_every: None,
            watch_groups: Vec::new(),
        }
    }
}

/// How a platform is served, for the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Pods on cluster nodes.
    Local,
    /// Static hosts.
    Static,
    /// One instance per TaskRun.
    Dynamic,
    /// Shared instances.
    Pool,
    /// Disabled or unknown.
    Unserved,
}

impl Kind {
    /// Short label.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Local => "local",
            Kind::Static => "static",
            Kind::Dynamic => "dynamic",
            Kind::Pool => "pool",
            Kind::Unserved => "none",
        }
    }
}

/// Results for one platform.
#[derive(Debug, Clone)]
pub struct PlatformStats {
    /// How it is served.
    pub kind: Kind,
    /// TaskRuns that arrived.
    pub taskruns: u64,
    /// Arrival → secret, seconds, one per TaskRun that got a secret.
    pub waits: Vec<f64>,
    /// Error secrets.
    pub errors: u64,
    /// Seconds of builds run.
    pub build_secs: f64,
    /// Instance-seconds (launch to termination or end of run).
    pub instance_secs: f64,
    /// Most instances alive at once.
    pub peak_instances: u32,
    /// Static slots, or per-instance concurrency of a pool.
    pub slots: u32,
    /// The dedicated hosts of a macOS platform; `None` for every other platform.
    pub mac: Option<MacHostStats>,
}

/// What the dedicated hosts of a macOS platform cost. EC2 Mac instances run on dedicated hosts,
/// one instance per host at a time; the host resource group allocates a host when no free one
/// can take a launch (up to the platform's `max-instances` here), each host is billed from its
/// allocation for at least 24 h, and after an instance terminates its host is scrubbed (~50 min)
/// before it takes another. Modelled: a host is released as soon as it is idle past its 24 h.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MacHostStats {
    /// Hosts allocated during the run.
    pub hosts: u32,
    /// Host-seconds billed, the 24 h minimum and any time past the end of the run included.
    pub billed_secs: f64,
    /// Launches refused because every host was busy or being scrubbed (the cloud's
    /// `InsufficientInstanceCapacity`; the scheduler backs off and launches again).
    pub refused: u64,
}

/// One dedicated Mac host: allocated at `allocated`, running an instance while `busy`, free for
/// the next from `free_at` (scrub done), gone from `released`.
struct MacHost {
    allocated: f64,
    busy: bool,
    free_at: f64,
    released: Option<f64>,
}

impl MacHost {
    /// Seconds billed for it when the run ends at `end`.
    fn billed(&self, end: f64, min: f64) -> f64 {
        let until = match self.released {
            Some(t) => t,
            None if self.busy => end,
            None => self.free_at,
        };
        (until - self.allocated).max(min)
    }
}

/// One chart sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Seconds from the start.
    pub t: f64,
    /// TaskRuns that arrived and have no secret yet.
    pub waiting: u32,
    /// Cloud instances alive.
    pub instances: u32,
}

/// Results of one run.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Policy name.
    pub policy: &'static str,
    /// By platform.
    pub platforms: BTreeMap<String, PlatformStats>,
    /// Chart series.
    pub samples: Vec<Sample>,
    /// Simulated seconds.
    pub end: f64,
    /// Scheduler events processed.
    pub events: u64,
    /// Times the scheduler's state was checked ([`SimSettings::check_every`]).
    pub checks: u64,
    /// The first broken invariant found, if any (the run stopped there).
    pub violation: Option<Violation>,
    /// By capacity group: most of its members' instances alive at once.
    pub group_peaks: BTreeMap<String, u32>,
}

/// A broken invariant of the scheduler's state, found by a sampled check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Scheduler events processed when it was found.
    pub event: u64,
    /// Simulated time, in milliseconds from the start.
    pub at_ms: u64,
    /// What is broken.
    pub error: StateError,
}

enum SimEvent {
    Arrive(u32),
    // Boxed: events can be large (a whole config), and heap items are moved on every sift.
    Deliver(Box<Event>),
    BuildDone(u32),
    Tick,
    Sample,
}

struct Item {
    at: u64,
    seq: u64,
    ev: SimEvent,
}

impl PartialEq for Item {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Item {}
impl PartialOrd for Item {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Item {
    // Reversed: BinaryHeap is a max-heap, we want the earliest first.
    fn cmp(&self, o: &Self) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

struct JobState {
    secret: bool,
    running: bool,
}

struct CloudInstance {
    platform: String,
    /// The dedicated host it runs on (macOS).
    host: Option<usize>,
    launched: f64,
    address_at: f64,
    ready_at: f64,
    alive: bool,
}

struct Sim<'a> {
    sched: Scheduler,
    workload: &'a Workload,
    settings: &'a SimSettings,
    rng: StdRng,
    heap: BinaryHeap<Item>,
    seq: u64,
    now_ms: u64,
    next_tick: u64,
    jobs: Vec<JobState>,
    cloud: BTreeMap<String, CloudInstance>,
    mac_hosts: BTreeMap<String, Vec<MacHost>>,
    live: BTreeMap<String, u32>,
    live_total: u32,
    launched: u64,
    stats: BTreeMap<String, PlatformStats>,
    waiting: u32,
    done: usize,
    samples: Vec<Sample>,
    events: u64,
    out: Vec<Action>,
    checks: u64,
    violation: Option<Violation>,
    /// Capacity groups: name, member platforms, most members' instances alive at once.
    groups: Vec<(String, Vec<String>, u32)>,
}

fn ms(secs: f64) -> u64 {
    (secs * 1000.0).round().max(0.0) as u64
}

/// Runs the workload through the scheduler core.
pub fn simulate(config: &HostConfig, workload: &Workload, settings: &SimSettings) -> Outcome {
    let mut stats = BTreeMap::new();
    for j in &workload.jobs {
        stats.entry(j.platform.clone()).or_insert_with(|| {
            let (kind, slots, mac) = match Platform::parse(&j.platform) {
                Ok(p) => match config.resolve(&p) {
                    Strategy::Local => (Kind::Local, 0, None),
                    Strategy::Static(s) => (Kind::Static, s.capacity(), None),
                    Strategy::Dynamic(d) => (
                        Kind::Dynamic,
                        1,
                        (d.os == HostOs::MacOs).then(MacHostStats::default),
                    ),
                    Strategy::DynamicPool(p) => (Kind::Pool, p.concurrency, None),
                    Strategy::Disabled(_) | Strategy::Unknown => (Kind::Unserved, 0, None),
                },
                Err(_) => (Kind::Unserved, 0, None),
            };
            PlatformStats {
                kind,
                taskruns: 0,
                waits: Vec::new(),
                errors: 0,
                build_secs: 0.0,
                instance_secs: 0.0,
                peak_instances: 0,
                slots,
                mac,
            }
        });
    }
    let mut groups: Vec<(String, Vec<String>, u32)> = config
        .capacity_groups
        .values()
        .map(|g| {
            let members = g.members.iter().map(|m| m.as_str().to_owned()).collect();
            (g.name.clone(), members, 0)
        })
        .collect();
    for (name, members) in &settings.watch_groups {
        if !groups.iter().any(|g| g.0 == *name) {
            groups.push((name.clone(), members.clone(), 0));
        }
    }
    let mut sim = Sim {
        groups,
        sched: Scheduler::new(config.clone(), settings.policy.clone()),
        workload,
        settings,
        rng: StdRng::seed_from_u64(settings.seed),
        heap: BinaryHeap::new(),
        seq: 0,
        now_ms: 0,
        next_tick: u64::MAX,
        jobs: workload
            .jobs
            .iter()
            .map(|_| JobState {
                secret: false,
                running: false,
            })
            .collect(),
        cloud: BTreeMap::new(),
        mac_hosts: BTreeMap::new(),
        live: BTreeMap::new(),
        live_total: 0,
        launched: 0,
        stats,
        waiting: 0,
        done: 0,
        samples: Vec::new(),
        events: 0,
        out: Vec::new(),
        checks: 0,
        violation: None,
    };
    let mut out = Vec::new();
    sim.sched.recover(Time::ZERO, Snapshot::default(), &mut out);
    sim.run_actions(out);
    sim.schedule_tick();
    for (i, j) in workload.jobs.iter().enumerate() {
        sim.push(ms(j.at), SimEvent::Arrive(i as u32));
    }
    sim.push(0, SimEvent::Sample);
    sim.run();
    if settings.check_every.is_some() && sim.violation.is_none() {
        sim.check();
    }
    sim.finish()
}

impl Sim<'_> {
    fn push(&mut self, at: u64, ev: SimEvent) {
        self.seq += 1;
        self.heap.push(Item {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn after(&mut self, secs: f64, ev: SimEvent) {
        let at = self.now_ms + ms(secs).max(1);
        self.push(at, ev);
    }

    fn now(&self) -> f64 {
        self.now_ms as f64 / 1000.0
    }

    fn run(&mut self) {
        let span = ms(self.workload.span());
        let limit = span + ms(48.0 * 3600.0);
        while let Some(item) = self.heap.pop() {
            if item.at > limit || self.violation.is_some() {
                break;
            }
            self.now_ms = self.now_ms.max(item.at);
            match item.ev {
                SimEvent::Arrive(i) => {
                    let j = &self.workload.jobs[i as usize];
                    self.waiting += 1;
                    if let Some(s) = self.stats.get_mut(&j.platform) {
                        s.taskruns += 1;
                    }
                    let spec = TaskRunSpec {
                        namespace: j.namespace.clone(),
                        name: format!("b{i}"),
                        uid: format!("00000000-0000-4000-8000-{i:012x}"),
                        platform: j.platform.clone(),
                        since: Time::from_millis(self.now_ms),
                        retries: 0,
                        gated: false,
                    };
                    self.deliver(Event::TaskRun(spec));
                }
                SimEvent::Deliver(e) => self.deliver(*e),
                SimEvent::BuildDone(i) => {
                    self.done += 1;
                    let j = &self.workload.jobs[i as usize];
                    let e = Event::TaskRunDone {
                        taskrun: TaskRunRef::new(
                            &j.namespace,
                            &format!("b{i}"),
                            Uid::new(&format!("00000000-0000-4000-8000-{i:012x}")),
                        ),
                    };
                    self.deliver(e);
                }
                SimEvent::Tick => {
                    if item.at >= self.next_tick {
                        self.next_tick = u64::MAX;
                    }
                    self.deliver(Event::Tick);
                }
                SimEvent::Sample => {
                    self.samples.push(Sample {
                        t: self.now(),
                        waiting: self.waiting,
                        instances: self.live_total,
                    });
                    let finished = self.done == self.workload.jobs.len();
                    if !(finished && self.now_ms >= span) {
                        let every = self.settings.sample_every.as_secs_f64();
                        self.after(every, SimEvent::Sample);
                    }
                }
            }
            if self.done == self.workload.jobs.len() && self.now_ms >= span {
                break;
            }
        }
    }

    fn deliver(&mut self, e: Event) {
        self.events += 1;
        let mut out = std::mem::take(&mut self.out);
        self.sched
            .handle(Time::from_millis(self.now_ms), e, &mut out);
        let actions = std::mem::take(&mut out);
        self.out = out;
        self.run_actions(actions);
        self.schedule_tick();
        if let Some(n) = self.settings.check_every
            && self.events.is_multiple_of(n.max(1))
        {
            self.check();
        }
    }

    /// Checks the scheduler's state; a broken invariant is kept and stops the run.
    fn check(&mut self) {
        self.checks += 1;
        if let Err(error) = self.sched.check() {
            self.violation = Some(Violation {
                event: self.events,
                at_ms: self.now_ms,
                error,
            });
        }
    }

    fn schedule_tick(&mut self) {
        if let Some(d) = self.sched.next_deadline() {
            let at = d.as_millis().max(self.now_ms);
            if at < self.next_tick {
                self.next_tick = at;
                self.push(at, SimEvent::Tick);
            }
        }
    }

    fn job_of(name: &str) -> Option<usize> {
        name.strip_prefix('b')?.parse().ok()
    }

    fn run_actions(&mut self, mut actions: Vec<Action>) {
        let lat = self.settings.latencies.clone();
        for a in actions.drain(..) {
            match a {
                Action::Provision { op, host, .. } => {
                    let median = match host {
                        HostRef::Static(_) => lat.provision_static,
                        HostRef::Instance { .. } => lat.provision_instance,
                    };
                    let d = lognormal(&mut self.rng, median, 0.3);
                    let ev = if self.rng.r#gen::<f64>() < lat.provision_failure_rate {
                        Event::ProvisionFailed {
                            op,
                            error: "simulated provisioning failure".into(),
                            blame: Blame::Host,
                        }
                    } else {
                        Event::Provisioned {
                            op,
                            otp: String::new(),
                        }
                    };
                    self.after(d, SimEvent::Deliver(Box::new(ev)));
                }
                Action::WriteSecret { taskrun, secret } => {
                    let Some(i) = Self::job_of(taskrun.name()) else {
                        continue;
                    };
                    let now = self.now();
                    let job = &self.workload.jobs[i];
                    let st = &mut self.jobs[i];
                    let stats = self.stats.get_mut(&job.platform);
                    if !st.secret {
                        st.secret = true;
                        self.waiting -= 1;
                        if let Some(s) = stats {
                            s.waits.push(now - job.at);
                            if matches!(secret, SecretData::Error(_)) {
                                s.errors += 1;
                            } else {
                                s.build_secs += job.duration;
                            }
                        }
                    }
                    if !st.running {
                        st.running = true;
                        // A failed allocation fails the build at once.
                        let d = match secret {
                            SecretData::Error(_) => 1.0,
                            _ => job.duration,
                        };
                        self.after(d, SimEvent::BuildDone(i as u32));
                    }
                }
                Action::Launch {
                    op,
                    platform,
                    template,
                    ..
                } if template.os == HostOs::MacOs => {
                    self.launch_on_mac_host(op, platform.as_str(), template.max_instances);
                }
                Action::Launch { op, platform, .. } => {
                    let api = lognormal(&mut self.rng, lat.launch_api, 0.3);
                    if self.rng.r#gen::<f64>() < lat.launch_failure_rate {
                        let ev = Event::LaunchFailed {
                            op,
                            error: "InsufficientInstanceCapacity (simulated)".into(),
                            retryable: true,
                        };
                        self.after(api, SimEvent::Deliver(Box::new(ev)));
                        continue;
                    }
                    self.launched += 1;
                    let id = format!("i-{:017x}", self.launched);
                    let boot = lognormal(&mut self.rng, lat.boot, 0.25);
                    let start = self.now() + api;
                    let p = platform.as_str().to_owned();
                    self.cloud.insert(
                        id.clone(),
                        CloudInstance {
                            platform: p.clone(),
                            host: None,
                            launched: start,
                            address_at: start + boot * 0.4,
                            ready_at: start + boot,
                            alive: true,
                        },
                    );
                    let live = self.live.entry(p.clone()).or_default();
                    *live += 1;
                    let live = *live;
                    self.live_total += 1;
                    if let Some(s) = self.stats.get_mut(&p) {
                        s.peak_instances = s.peak_instances.max(live);
                    }
                    self.note_groups(&p);
                    self.after(
                        api,
                        SimEvent::Deliver(Box::new(Event::Launched {
                            op,
                            instance_id: id,
                        })),
                    );
                }
                Action::Probe {
                    op, instance_id, ..
                } => {
                    let t = self.now() + 0.3;
                    let result = match self.cloud.get(&*instance_id) {
                        Some(i) if !i.alive => ProbeResult::Failed {
                            reason: "terminated".into(),
                        },
                        Some(i) if t >= i.ready_at => ProbeResult::Reachable {
                            address: "192.0.2.1".into(),
                        },
                        Some(i) if t >= i.address_at => ProbeResult::Booting {
                            address: "192.0.2.1".into(),
                        },
                        Some(_) => ProbeResult::Pending,
                        None => ProbeResult::Failed {
                            reason: "unknown instance".into(),
                        },
                    };
                    self.after(
                        0.3,
                        SimEvent::Deliver(Box::new(Event::Probed { op, result })),
                    );
                }
                Action::Terminate {
                    op, instance_id, ..
                } => {
                    let now = self.now();
                    if let Some(i) = self.cloud.get_mut(&*instance_id)
                        && i.alive
                    {
                        i.alive = false;
                        let secs = now - i.launched;
                        let p = i.platform.clone();
                        if let Some(h) = i.host
                            && let Some(host) =
                                self.mac_hosts.get_mut(&p).and_then(|v| v.get_mut(h))
                        {
                            host.busy = false;
                            host.free_at = now + lognormal(&mut self.rng, lat.mac_scrub, 0.1);
                        }
                        if let Some(s) = self.stats.get_mut(&p) {
                            s.instance_secs += secs.max(0.0);
                        }
                        if let Some(l) = self.live.get_mut(&p) {
                            *l -= 1;
                        }
                        self.live_total -= 1;
                    }
                    self.after(
                        1.0,
                        SimEvent::Deliver(Box::new(Event::Terminated { op, error: None })),
                    );
                }
                Action::Deprovision { op, .. } => {
                    self.after(
                        1.5,
                        SimEvent::Deliver(Box::new(Event::Deprovisioned { op, error: None })),
                    );
                }
                Action::Record { .. }
                | Action::DeleteSecret { .. }
                | Action::Ungate { .. }
                | Action::RemoveFinalizer { .. }
                | Action::Retag { .. }
                | Action::Notify { .. }
                | Action::Observe(_) => {}
            }
        }
        self.out = actions;
    }

    /// A launch of a macOS platform: on a free dedicated host (scrubbed, not released), else on a
    /// new one while the group has fewer than `limit`, else refused as EC2 refuses it.
    fn launch_on_mac_host(&mut self, op: crate::scheduler::OpId, platform: &str, limit: u32) {
        let lat = &self.settings.latencies;
        let (boot_median, (boot_min, boot_max), min_billing) =
            (lat.mac_boot, lat.mac_boot_range, lat.mac_min_billing);
        let api = lognormal(&mut self.rng, lat.launch_api, 0.3);
        let start = self.now() + api;
        let hosts = self.mac_hosts.entry(platform.to_owned()).or_default();
        // Hosts idle past their 24 h minimum were released when that came.
        for h in hosts.iter_mut().filter(|h| h.released.is_none() && !h.busy) {
            let release = h.free_at.max(h.allocated + min_billing);
            if release <= start {
                h.released = Some(release);
            }
        }
        let free = hosts
            .iter()
            .position(|h| h.released.is_none() && !h.busy && h.free_at <= start);
        let active = hosts.iter().filter(|h| h.released.is_none()).count();
        let host = match free {
            Some(h) => h,
            None if active < limit as usize => {
                hosts.push(MacHost {
                    allocated: start,
                    busy: false,
                    free_at: start,
                    released: None,
                });
                if let Some(m) = self.stats.get_mut(platform).and_then(|s| s.mac.as_mut()) {
                    m.hosts += 1;
                }
                hosts.len() - 1
            }
            None => {
                if let Some(m) = self.stats.get_mut(platform).and_then(|s| s.mac.as_mut()) {
                    m.refused += 1;
                }
                let ev = Event::LaunchFailed {
                    op,
                    error: "InsufficientInstanceCapacity: every dedicated host is busy or being \
                            scrubbed (simulated)"
                        .into(),
                    retryable: true,
                };
                self.after(api, SimEvent::Deliver(Box::new(ev)));
                return;
            }
        };
        hosts[host].busy = true;
        self.launched += 1;
        let id = format!("i-{:017x}", self.launched);
        let boot = lognormal(&mut self.rng, boot_median, 0.3).clamp(boot_min, boot_max);
        self.cloud.insert(
            id.clone(),
            CloudInstance {
                platform: platform.to_owned(),
                host: Some(host),
                launched: start,
                address_at: start + boot * 0.4,
                ready_at: start + boot,
                alive: true,
            },
        );
        let live = self.live.entry(platform.to_owned()).or_default();
        *live += 1;
        let live = *live;
        self.live_total += 1;
        if let Some(s) = self.stats.get_mut(platform) {
            s.peak_instances = s.peak_instances.max(live);
        }
        self.note_groups(platform);
        self.after(
            api,
            SimEvent::Deliver(Box::new(Event::Launched {
                op,
                instance_id: id,
            })),
        );
    }

    /// An instance of `platform` was launched: the peaks of its capacity groups.
    fn note_groups(&mut self, platform: &str) {
        for (_, members, peak) in &mut self.groups {
            if members.iter().any(|m| m == platform) {
                let live: u32 = members.iter().filter_map(|m| self.live.get(m)).sum();
                *peak = (*peak).max(live);
            }
        }
    }

    fn finish(mut self) -> Outcome {
        let end = self.now();
        for i in self.cloud.values().filter(|i| i.alive) {
            if let Some(s) = self.stats.get_mut(&i.platform) {
                s.instance_secs += (end - i.launched).max(0.0);
            }
        }
        let min = self.settings.latencies.mac_min_billing;
        for (p, hosts) in &self.mac_hosts {
            if let Some(m) = self.stats.get_mut(p).and_then(|s| s.mac.as_mut()) {
                m.billed_secs = hosts.iter().map(|h| h.billed(end, min)).sum();
            }
        }
        Outcome {
            policy: self.settings.policy.name,
            platforms: self.stats,
            samples: self.samples,
            end,
            events: self.events,
            checks: self.checks,
            violation: self.violation,
            group_peaks: self
                .groups
                .into_iter()
                .map(|(name, _, peak)| (name, peak))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::workload::Job;

    fn cfg() -> HostConfig {
        let text = include_str!("example-host-config.yaml");
        let (data, _) = crate::config::read_configmap_yaml(text).unwrap();
        let parsed = crate::config::parse(&data);
        assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
        parsed.config
    }

    fn burst(platform: &str, n: usize, duration: f64) -> Workload {
        Workload {
            jobs: (0..n)
                .map(|i| Job {
                    at: i as f64 * 0.1,
                    namespace: format!("t{}", i % 3),
                    platform: platform.into(),
                    duration,
                })
                .collect(),
            description: String::new(),
        }
    }

    #[test]
    fn static_burst_queues_behind_capacity_and_every_taskrun_finishes() {
        // 24 s390x slots, 48 builds of 10 minutes: the second half waits about one build.
        let w = burst("linux/s390x", 48, 600.0);
        let o = simulate(&cfg(), &w, &SimSettings::new(Policy::mpc(), 1));
        let s = &o.platforms["linux/s390x"];
        assert_eq!(s.kind, Kind::Static);
        assert_eq!(s.taskruns, 48);
        assert_eq!(s.waits.len(), 48);
        let mut waits = s.waits.clone();
        waits.sort_by(f64::total_cmp);
        assert!(waits[0] < 10.0, "first ones start at once: {}", waits[0]);
        assert!(
            (600.0..700.0).contains(&waits[47]),
            "last waits ~one build: {}",
            waits[47]
        );
        assert!(o.end >= 1200.0);
    }

    #[test]
    fn go_policy_waits_longer_on_the_same_trace() {
        let w = burst("linux/amd64", 120, 300.0);
        let mpc = simulate(&cfg(), &w, &SimSettings::new(Policy::mpc(), 3));
        let go = simulate(&cfg(), &w, &SimSettings::new(Policy::mpc_go(), 3));
        let mean = |o: &Outcome| {
            let v = &o.platforms["linux/amd64"].waits;
            v.iter().sum::<f64>() / v.len() as f64
        };
        assert_eq!(mpc.platforms["linux/amd64"].waits.len(), 120);
        assert_eq!(go.platforms["linux/amd64"].waits.len(), 120);
        assert!(
            mean(&go) > mean(&mpc) + 30.0,
            "{} vs {}",
            mean(&go),
            mean(&mpc)
        );
        assert!(mpc.platforms["linux/amd64"].peak_instances <= 60);
        assert!(go.platforms["linux/amd64"].peak_instances <= 60);
    }

    const MAC: &str = "macos-mac2metal/arm64";

    /// The production Windows and macOS platforms (max-instances 5 each).
    fn prod_mac() -> HostConfig {
        let text =
            include_str!("../../tests/fixtures/configmaps/stone-prod-p02-windows-macos.yaml");
        let (data, _) = crate::config::read_configmap_yaml(text).unwrap();
        let parsed = crate::config::parse(&data);
        assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
        parsed.config
    }

    fn job(at: f64, duration: f64) -> Job {
        Job {
            at,
            namespace: "team".into(),
            platform: MAC.into(),
            duration,
        }
    }

    #[test]
    fn mac_hosts_are_reused_after_their_scrub_and_billed_for_24_hours_each() {
        // One build, another long after its host was scrubbed: one host, reused.
        let w = Workload {
            jobs: vec![job(0.0, 1200.0), job(4.0 * 3600.0, 1200.0)],
            description: String::new(),
        };
        let o = simulate(&prod_mac(), &w, &SimSettings::new(Policy::mpc(), 1));
        let s = &o.platforms[MAC];
        let m = s
            .mac
            .as_ref()
            .expect("a macOS platform has dedicated hosts");
        assert_eq!(m.hosts, 1, "{m:?}");
        assert_eq!(m.refused, 0);
        assert_eq!(s.errors, 0);
        // Billed for the 24 h minimum, though instances ran under two hours.
        assert_eq!(m.billed_secs, 24.0 * 3600.0);
        assert!(s.instance_secs < 2.0 * 3600.0, "{}", s.instance_secs);
        // Boots take 6-20 minutes: no TaskRun waits less than 6.
        assert!(s.waits.iter().all(|w| *w >= 360.0), "{:?}", s.waits);
        assert!(s.waits.iter().all(|w| *w < 1300.0), "{:?}", s.waits);
    }

    #[test]
    fn a_burst_past_the_free_mac_hosts_is_refused_while_they_scrub() {
        // Seven builds for five hosts: two wait for a host; when the first build ends its host is
        // scrubbed for ~50 min. Freeing the slot at the termination (Go) launches into hosts still
        // scrubbed, which EC2 refuses (InsufficientInstanceCapacity); holding it for the scrub
        // (mpc) launches when a host is free again. Neither gets a sixth host.
        let w = Workload {
            jobs: (0..7).map(|i| job(f64::from(i), 1200.0)).collect(),
            description: String::new(),
        };
        let run = |policy| {
            let o = simulate(&prod_mac(), &w, &SimSettings::new(policy, 2));
            o.platforms[MAC].clone()
        };
        let (go, mpc) = (run(Policy::mpc_go()), run(Policy::mpc()));
        for s in [&go, &mpc] {
            let m = s.mac.as_ref().unwrap();
            assert_eq!(m.hosts, 5, "{m:?}");
            assert_eq!(m.billed_secs, 5.0 * 24.0 * 3600.0);
            assert_eq!(s.waits.len(), 7);
        }
        let refused = |s: &PlatformStats| s.mac.as_ref().unwrap().refused;
        assert!(refused(&go) > 0, "{go:?}");
        assert!(refused(&mpc) < refused(&go), "{mpc:?} vs {go:?}");
        assert_eq!(mpc.errors, 0, "{mpc:?}");
        // Other platforms have no hosts to report.
        let w = burst("linux/amd64", 3, 60.0);
        let o = simulate(&cfg(), &w, &SimSettings::new(Policy::mpc(), 1));
        assert!(o.platforms["linux/amd64"].mac.is_none());
    }

    #[test]
    fn an_idle_mac_host_is_released_after_24_hours_and_a_later_build_gets_a_new_one() {
        let w = Workload {
            jobs: vec![job(0.0, 600.0), job(30.0 * 3600.0, 600.0)],
            description: String::new(),
        };
        let o = simulate(&prod_mac(), &w, &SimSettings::new(Policy::mpc(), 3));
        let m = o.platforms[MAC].mac.clone().unwrap();
        assert_eq!(m.hosts, 2, "{m:?}");
        assert_eq!(m.billed_secs, 2.0 * 24.0 * 3600.0);
    }

    #[test]
    fn deterministic_for_a_seed() {
        let w = super::super::workload::bursty_day(800, 5);
        let a = simulate(&cfg(), &w, &SimSettings::new(Policy::mpc(), 9));
        let b = simulate(&cfg(), &w, &SimSettings::new(Policy::mpc(), 9));
        assert_eq!(a.samples, b.samples);
        assert_eq!(a.events, b.events);
    }

    #[test]
    fn a_checked_run_checks_every_n_events_and_at_the_end_and_changes_nothing_else() {
        let w = super::super::workload::bursty_day(300, 2);
        for policy in [Policy::mpc(), Policy::mpc_go()] {
            let plain = simulate(&cfg(), &w, &SimSettings::new(policy.clone(), 4));
            let settings = SimSettings {
                check_every: Some(7),
                ..SimSettings::new(policy, 4)
            };
            let checked = simulate(&cfg(), &w, &settings);
            assert_eq!(plain.checks, 0);
            assert_eq!(checked.violation, None);
            assert_eq!(checked.checks, checked.events / 7 + 1);
            assert_eq!(checked.events, plain.events);
            assert_eq!(checked.samples, plain.samples);
            assert_eq!(
                format!("{:?}", checked.platforms),
                format!("{:?}", plain.platforms)
            );
        }
    }
}
