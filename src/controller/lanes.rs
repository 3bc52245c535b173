//! Pure: when a job may start (docs/architecture.md, "The controller shell").
//!
//! Two rules, kept in one type, [`Lanes`], so that no job can be counted by one and not the
//! other:
//! - **lanes**: actions about one TaskRun run in the order the scheduler returned them, one at a
//!   time; so do actions about one instance or one user on one host ([`lane_of`] says which
//!   lane an action is in). Actions of different lanes run concurrently; actions without a lane
//!   start at once.
//! - **caps**: at most so many jobs of each [`Class`] run at once ([`Caps`]); the rest wait as
//!   plain values, first in first out per class. A job first takes its lane, then a place.
//!
//! A job that ends but will run again later (a finalizer removal that did not land) gives its
//! place back and keeps its lane ([`Lanes::pause`], [`Lanes::resume`]): it waits outside the
//! caps, and later jobs of its lane keep their order behind it.
//!
//! [`lane_of`] is also the model test's lane rule (`tests/scheduler_model.rs`), so the model
//! executes the scheduler's actions in the order the controller does.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::scheduler::{Action, TaskRunRef};

/// What a job is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LaneKey {
    /// A TaskRun, by UID.
    TaskRun(Arc<str>),
    /// A cloud instance, by id.
    Instance(Arc<str>),
    /// A user on a host: `(host, user)`.
    HostUser(Arc<str>, String),
}

impl LaneKey {
    /// The lane of the writes about `taskrun`.
    pub fn taskrun(taskrun: &TaskRunRef) -> Self {
        LaneKey::TaskRun(taskrun.uid().to_string().into())
    }
}

/// The lane an action runs in; `None`: it starts at once (a launch has no instance yet; Events
/// and observations are about nothing that could be reordered).
pub fn lane_of(action: &Action) -> Option<LaneKey> {
    match action {
        // A user on a host: its creation is ordered with its removals (a compensation, or a
        // failed attempt's cleanup on the host the retry lands on again).
        Action::Provision { taskrun, host, .. } => {
            Some(LaneKey::HostUser(host.name().into(), taskrun.remote_user()))
        }
        Action::Record { taskrun, .. }
        | Action::WriteSecret { taskrun, .. }
        | Action::DeleteSecret { taskrun }
        | Action::Ungate { taskrun }
        | Action::RemoveFinalizer { taskrun, .. } => Some(LaneKey::taskrun(taskrun)),
        Action::Deprovision { user, host, .. } => {
            Some(LaneKey::HostUser(host.name().into(), user.name()))
        }
        // A retag goes after the probe or termination before it: an instance is handed on
        // only in the order the scheduler decided.
        Action::Probe { instance_id, .. }
        | Action::Terminate { instance_id, .. }
        | Action::Retag { instance_id, .. } => Some(LaneKey::Instance(instance_id.clone())),
        Action::Launch { .. } | Action::Notify { .. } | Action::Observe(_) => None,
    }
}

/// Which cap a job counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Kubernetes Events: published a few at a time, so waiting ones must not fill every place
    /// while writes queue behind them.
    Notify,
    /// Provisionings and removals: they wait seconds for SSH permits when hosts are slow.
    Ssh,
    /// Everything else (API writes, cloud calls).
    Other,
}

impl Class {
    /// The class of a scheduler action.
    pub fn of(action: &Action) -> Self {
        match action {
            Action::Notify { .. } => Class::Notify,
            Action::Provision { .. } | Action::Deprovision { .. } => Class::Ssh,
            _ => Class::Other,
        }
    }

    fn slot(self) -> usize {
        match self {
            Class::Other => 0,
            Class::Notify => 1,
            Class::Ssh => 2,
        }
    }
}

/// Jobs of each class running at once (a zero is taken as one: no class may stall).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub other: usize,
    pub notify: usize,
    pub ssh: usize,
}

impl Caps {
    /// The controller's: see [`JOBS_IN_FLIGHT`], [`NOTIFY_IN_FLIGHT`], [`SSH_IN_FLIGHT`].
    pub const CONTROLLER: Caps = Caps {
        other: JOBS_IN_FLIGHT,
        notify: NOTIFY_IN_FLIGHT,
        ssh: SSH_IN_FLIGHT,
    };
}

/// Jobs running at once. Well above what the executor's own limits let proceed together (API,
/// SSH and Event permits), so a cap this size costs no throughput; it bounds what waits for them.
/// A spawned job is kilobytes (its future, a clone of the context, then the API's answer), an
/// action at most 128 B, and recovering 10,000 queued TaskRuns dispatches a label write and an
/// Event for each at once: spawned together they were the controller's memory peak
/// (BENCHMARKS.md, "Memory").
pub const JOBS_IN_FLIGHT: usize = 256;
/// Of those, Events, counted apart ([`Class::Notify`]).
pub const NOTIFY_IN_FLIGHT: usize = 16;
/// Provisionings and removals, counted apart: in the shared cap they held every place while
/// provisioned TaskRuns' secret writes queued behind them (a 100/s burst: 6.5 s on average;
/// BENCHMARKS.md, "Burst"). Twice the default SSH parallelism keeps the SSH permits busy.
pub const SSH_IN_FLIGHT: usize = 64;

/// Where a started job stands: handed out with it, handed back when it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    pub lane: Option<LaneKey>,
    pub class: Class,
}

/// Jobs per lane and per cap: which run, which wait (see the module docs).
#[derive(Debug)]
pub struct Lanes<J> {
    /// Taken lanes, with the jobs queued behind the one holding each.
    taken: HashMap<LaneKey, VecDeque<(Class, J)>>,
    running: [usize; 3],
    /// Jobs holding their lane (if any) and waiting for a place.
    waiting: [VecDeque<(Option<LaneKey>, J)>; 3],
    caps: [usize; 3],
}

impl<J> Lanes<J> {
    pub fn new(caps: Caps) -> Self {
        Lanes {
            taken: HashMap::new(),
            running: [0; 3],
            waiting: Default::default(),
            caps: [caps.other.max(1), caps.notify.max(1), caps.ssh.max(1)],
        }
    }

    /// Offers a job; appends to `start` what starts now (this job, or nothing: it waits behind
    /// its lane or for a place).
    pub fn submit(
        &mut self,
        lane: Option<LaneKey>,
        class: Class,
        job: J,
        start: &mut Vec<(Ticket, J)>,
    ) {
        if let Some(key) = &lane {
            match self.taken.get_mut(key) {
                Some(queue) => return queue.push_back((class, job)),
                None => {
                    self.taken.insert(key.clone(), VecDeque::new());
                }
            }
        }
        self.place(lane, class, job, start);
    }

    /// A started job ended: its place and its lane are free. Appends what starts now (the next
    /// job waiting for a place of its class, the next of its lane).
    pub fn finish(&mut self, ticket: Ticket, start: &mut Vec<(Ticket, J)>) {
        self.pause(ticket.class, start);
        let Some(key) = ticket.lane else {
            return;
        };
        let Some(queue) = self.taken.get_mut(&key) else {
            return;
        };
        match queue.pop_front() {
            Some((class, next)) => self.place(Some(key), class, next, start),
            None => {
                self.taken.remove(&key);
            }
        }
    }

    /// A started job ended and will run again ([`Lanes::resume`]): its place is free, its lane
    /// stays taken. Appends what starts now.
    pub fn pause(&mut self, class: Class, start: &mut Vec<(Ticket, J)>) {
        let i = class.slot();
        match self.waiting[i].pop_front() {
            Some((lane, next)) => start.push((Ticket { lane, class }, next)),
            None => self.running[i] = self.running[i].saturating_sub(1),
        }
    }

    /// A paused job runs again, in the lane it kept, when a place is free; appends what starts.
    pub fn resume(&mut self, ticket: Ticket, job: J, start: &mut Vec<(Ticket, J)>) {
        self.place(ticket.lane, ticket.class, job, start);
    }

    fn place(&mut self, lane: Option<LaneKey>, class: Class, job: J, start: &mut Vec<(Ticket, J)>) {
        let i = class.slot();
        if self.running[i] < self.caps[i] {
            self.running[i] += 1;
            start.push((Ticket { lane, class }, job));
        } else {
            self.waiting[i].push_back((lane, job));
        }
    }

    /// Jobs of `class` running.
    pub fn running(&self, class: Class) -> usize {
        self.running[class.slot()]
    }

    /// Lanes taken (by a running, waiting or paused job).
    pub fn taken(&self) -> usize {
        self.taken.len()
    }

    /// Jobs queued behind their lane.
    pub fn queued(&self) -> usize {
        self.taken.values().map(VecDeque::len).sum()
    }

    /// Jobs holding their lane and waiting for a place.
    pub fn waiting(&self) -> usize {
        self.waiting.iter().map(VecDeque::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::Uid;

    const WIDE: Caps = Caps {
        other: 100,
        notify: 100,
        ssh: 100,
    };

    fn submit<J>(l: &mut Lanes<J>, lane: Option<&LaneKey>, class: Class, job: J) -> Vec<J> {
        let mut out = Vec::new();
        l.submit(lane.cloned(), class, job, &mut out);
        out.into_iter().map(|(_, j)| j).collect()
    }

    fn ticket(lane: Option<&LaneKey>, class: Class) -> Ticket {
        Ticket {
            lane: lane.cloned(),
            class,
        }
    }

    fn finish<J>(l: &mut Lanes<J>, lane: Option<&LaneKey>, class: Class) -> Vec<J> {
        let mut out = Vec::new();
        l.finish(ticket(lane, class), &mut out);
        out.into_iter().map(|(_, j)| j).collect()
    }

    #[test]
    fn one_job_per_lane_in_order_others_concurrently() {
        let mut l = Lanes::new(WIDE);
        let a = LaneKey::TaskRun("a".into());
        let b = LaneKey::Instance("i-1".into());
        let o = Class::Other;
        assert_eq!(submit(&mut l, Some(&a), o, 1), [1]);
        assert!(submit(&mut l, Some(&a), o, 2).is_empty());
        assert!(submit(&mut l, Some(&a), o, 3).is_empty());
        assert_eq!(submit(&mut l, Some(&b), o, 10), [10]);
        assert_eq!(submit(&mut l, None, o, 20), [20]);
        assert_eq!((l.taken(), l.queued(), l.running(o)), (2, 2, 3));
        assert_eq!(finish(&mut l, Some(&a), o), [2]);
        assert!(finish(&mut l, Some(&b), o).is_empty());
        assert_eq!(submit(&mut l, Some(&b), o, 11), [11]);
        assert_eq!(finish(&mut l, Some(&a), o), [3]);
        assert!(finish(&mut l, Some(&a), o).is_empty());
        assert_eq!(submit(&mut l, Some(&a), o, 4), [4]);
        let stranger = LaneKey::HostUser("h".into(), "u".into());
        assert!(finish(&mut l, Some(&stranger), o).is_empty());
    }

    /// Recovery of 10,000 queued TaskRuns submits a write and an Event for each at once: only
    /// the caps run, the rest start one per finished job of their class, in order.
    #[test]
    fn a_burst_runs_under_the_caps_in_order() {
        let mut l = Lanes::new(Caps::CONTROLLER);
        let mut started = Vec::new();
        for i in 0..10_000 {
            let lane = LaneKey::TaskRun(format!("u{i}").into());
            started.extend(submit(&mut l, Some(&lane), Class::Other, ("write", i)));
            started.extend(submit(&mut l, None, Class::Notify, ("event", i)));
        }
        let count = |v: &[(&str, i32)], what: &str| v.iter().filter(|(w, _)| *w == what).count();
        assert_eq!(count(&started, "write"), JOBS_IN_FLIGHT);
        assert_eq!(count(&started, "event"), NOTIFY_IN_FLIGHT);
        assert_eq!(l.waiting(), 20_000 - JOBS_IN_FLIGHT - NOTIFY_IN_FLIGHT);
        assert_eq!(l.taken(), 10_000, "a waiting job holds its lane");
        // Events publishing slowly do not hold writes back: a finished write starts the next.
        let lane0 = LaneKey::TaskRun("u0".into());
        assert_eq!(
            finish(&mut l, Some(&lane0), Class::Other),
            [("write", JOBS_IN_FLIGHT as i32)]
        );
        assert_eq!(
            finish(&mut l, None, Class::Notify),
            [("event", NOTIFY_IN_FLIGHT as i32)]
        );
        let mut next = JOBS_IN_FLIGHT as i32 + 1;
        for i in 1.. {
            let lane = LaneKey::TaskRun(format!("u{i}").into());
            match finish(&mut l, Some(&lane), Class::Other)[..] {
                [(_, n)] => assert_eq!(n, next, "submission order"),
                [] => break,
                ref more => panic!("one place freed, {} started", more.len()),
            }
            next += 1;
        }
        assert_eq!(next, 10_000);
        // Drained: every place is free again, and new work starts at once.
        for i in 10_000 - JOBS_IN_FLIGHT + 1..10_000 {
            let lane = LaneKey::TaskRun(format!("u{i}").into());
            assert!(finish(&mut l, Some(&lane), Class::Other).is_empty());
        }
        assert_eq!((l.running(Class::Other), l.taken()), (0, 0));
        assert_eq!(submit(&mut l, None, Class::Other, ("write", 0)).len(), 1);
    }

    /// Provisionings waiting for slow hosts fill their own cap, not the places of the API
    /// writes (a provisioned TaskRun's secret) behind them.
    #[test]
    fn ssh_work_does_not_hold_writes_back() {
        let mut l = Lanes::new(Caps::CONTROLLER);
        let write = Action::Ungate {
            taskrun: TaskRunRef::new("ns", "tr", Uid::new("u")),
        };
        assert_eq!(Class::of(&write), Class::Other);
        for i in 0..1_000 {
            let lane = LaneKey::HostUser("h".into(), format!("u{i}"));
            submit(&mut l, Some(&lane), Class::Ssh, ("provision", i));
        }
        assert_eq!(l.waiting(), 1_000 - SSH_IN_FLIGHT);
        assert_eq!(
            submit(&mut l, None, Class::Other, ("write", 0)),
            [("write", 0)]
        );
        let lane0 = LaneKey::HostUser("h".into(), "u0".into());
        assert_eq!(
            finish(&mut l, Some(&lane0), Class::Ssh),
            [("provision", SSH_IN_FLIGHT as i32)]
        );
    }

    /// A paused job frees its place at once but keeps its lane until it ran again and
    /// finished: the place goes to another lane's job, its own lane's next job waits.
    #[test]
    fn a_paused_job_keeps_its_lane_and_frees_its_place() {
        let caps = Caps { other: 1, ..WIDE };
        let mut l = Lanes::new(caps);
        let a = LaneKey::TaskRun("a".into());
        let b = LaneKey::TaskRun("b".into());
        let o = Class::Other;
        assert_eq!(submit(&mut l, Some(&a), o, "a1"), ["a1"]);
        assert!(submit(&mut l, Some(&a), o, "a2").is_empty(), "behind a1");
        assert!(submit(&mut l, Some(&b), o, "b1").is_empty(), "no place");
        let mut out = Vec::new();
        l.pause(o, &mut out);
        assert_eq!(out, [(ticket(Some(&b), o), "b1")], "a1's place");
        assert_eq!(l.taken(), 2);
        // a1 again: waits for b1's place, still ahead of a2.
        let mut out = Vec::new();
        l.resume(ticket(Some(&a), o), "a1 again", &mut out);
        assert!(out.is_empty());
        assert_eq!(finish(&mut l, Some(&b), o), ["a1 again"]);
        assert_eq!(finish(&mut l, Some(&a), o), ["a2"]);
        assert!(finish(&mut l, Some(&a), o).is_empty());
        assert_eq!((l.taken(), l.running(o)), (0, 0));
    }

    /// Every action with something to reorder has a lane: a TaskRun's writes share one, an
    /// instance's calls (its retag too) another, a user's creation and removal a third.
    #[test]
    fn each_action_goes_in_the_lane_of_what_it_is_about() {
        use crate::scheduler::{HostRef, OpId, RemoteUser};
        let tr = TaskRunRef::new("ns", "tr", Uid::new("u1"));
        let host = HostRef::Static(Arc::new(crate::config::StaticHost {
            name: "h1".into(),
            address: "127.0.0.1".into(),
            user: "admin".into(),
            platform: crate::platform::Platform::parse("linux/arm64").unwrap(),
            secret: "s".into(),
            concurrency: 1,
            host_key: None,
            drained: false,
        }));
        let user = LaneKey::HostUser("h1".into(), tr.remote_user());
        assert_eq!(
            lane_of(&Action::Provision {
                op: OpId(1),
                taskrun: tr.clone(),
                host: host.clone(),
                rearm: false,
            }),
            Some(user.clone())
        );
        assert_eq!(
            lane_of(&Action::Deprovision {
                op: OpId(2),
                user: RemoteUser::Of(tr.clone()),
                host,
            }),
            Some(user)
        );
        assert_eq!(
            lane_of(&Action::Ungate {
                taskrun: tr.clone()
            }),
            Some(LaneKey::TaskRun("u1".into()))
        );
        assert_eq!(
            lane_of(&Action::Notify {
                taskrun: Some(tr),
                warning: false,
                reason: "X",
                message: String::new(),
            }),
            None
        );
    }
}
