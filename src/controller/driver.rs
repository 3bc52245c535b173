//! The loop: the single writer of allocation decisions (docs/architecture.md, "The controller
//! shell").
//!
//! One task owns the [`Scheduler`]. The [sources](super::sources) feed it (watch events, periodic
//! listings, the recovery snapshot, config updates, leadership changes), action results come
//! back from the executor, and a timer fires at [`Scheduler::next_deadline`]; actions go out to
//! the [executor](super::execute) as spawned jobs ordered per key by [`Lanes`]. The loop never
//! awaits I/O.
//!
//! Guarantees:
//! - nothing is allocated before the ledger is rebuilt: on leadership gain the TaskRun watch
//!   must have listed everything, then [`Scheduler::recover`] runs on a [`Snapshot`] of the
//!   [`TaskRunIndex`] (with whether each relevant TaskRun's Secret exists, and cloud listings)
//!   before live events flow; events that arrive meanwhile are buffered and replayed;
//! - after a relist (410, reconnect), TaskRuns the index held that the list no longer has are
//!   done ([`TaskRunIndex`]);
//! - losing the Lease cancels every job of the term at once and drops the scheduler: the term's
//!   context is a child of the elector's term token, which the elector cancels itself at the
//!   renew deadline, so in-flight writes of an ended term are abandoned even before this loop
//!   reads the change.
//!
//! - at most [`JOBS_IN_FLIGHT`] jobs run at once, besides [`NOTIFY_IN_FLIGHT`] Events and
//!   [`SSH_IN_FLIGHT`] provisionings and removals, each class capped apart; the
//!   rest wait as plain values, in submission order. A spawned job is kilobytes (its future, a
//!   clone of the context, then the API's answer), an action at most 128 B, and recovering
//!   10,000 queued TaskRuns dispatches a label write and an Event for each at once: spawned
//!   together they were the controller's memory peak (BENCHMARKS.md, "Memory").
//! - a finalizer removal that did not land waits for its next attempt outside the caps, its
//!   TaskRun's lane still taken (later writes about it keep their order): removals the API
//!   refuses for good cannot take the places every other write needs.
//!
//! Assumptions: events are idempotent for the scheduler (it ignores duplicates and late copies),
//! so replays after a buffer or a relist are safe.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::watcher;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::execute::{self, Context, Job};
use super::lanes::{LaneKey, Lanes};
use super::sources::taskruns::{Found, TaskRunIndex};
use super::sources::{self, Input, Intervals, now};
use super::taskrun::TaskRun;
use crate::config::HostConfig;
use crate::scheduler::{Action, Event, Policy, Scheduler, Snapshot, TaskRunRef, Time, Uid};

/// A finished job.
pub struct Completion {
    term: u64,
    lane: Option<LaneKey>,
    class: Class,
    outcome: execute::Outcome,
}

enum Phase {
    /// Collecting the snapshot; scheduler events are buffered.
    Recovering(Vec<Event>),
    Running(Box<Scheduler>),
}

/// A leadership term.
struct Term {
    id: u64,
    ctx: Context,
    phase: Phase,
    lanes: Lanes<Job>,
    running: InFlight<(Option<LaneKey>, Job)>,
    /// Jobs to run again at a time (finalizer removals that did not land), holding their lane
    /// but no place; dropped with the term.
    later: Later<(Option<LaneKey>, Job)>,
}

/// Jobs running at once. Well above what the executor's own limits let proceed together (API,
/// SSH and Event permits), so a cap this size costs no throughput; it bounds what waits for them.
pub const JOBS_IN_FLIGHT: usize = 256;
/// Of those, Events: they are published a few at a time, and jobs waiting for that must not fill
/// every place while writes queue behind them.
pub const NOTIFY_IN_FLIGHT: usize = 16;
/// Provisionings and removals, counted apart: when hosts are slow they wait seconds for SSH
/// permits, and in the shared cap they held every place while provisioned TaskRuns' secret
/// writes queued behind them (a 100/s burst: 6.5 s on average; BENCHMARKS.md, "Burst"). Twice
/// the default SSH parallelism keeps the SSH permits busy.
pub const SSH_IN_FLIGHT: usize = 64;

/// Which cap a job counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Notify,
    Ssh,
    Other,
}

fn class_of(job: &Job) -> Class {
    match job {
        Job::Action(Action::Notify { .. }) => Class::Notify,
        Job::Action(Action::Provision { .. } | Action::Deprovision { .. }) => Class::Ssh,
        _ => Class::Other,
    }
}

/// Admission of jobs under the caps: what does not fit waits, first in first out per class.
struct InFlight<T> {
    running: [usize; 3],
    waiting: [VecDeque<T>; 3],
    caps: [usize; 3],
}

impl<T> InFlight<T> {
    fn new(others: usize, notify: usize, ssh: usize) -> Self {
        InFlight {
            running: [0, 0, 0],
            waiting: [VecDeque::new(), VecDeque::new(), VecDeque::new()],
            caps: [others.max(1), notify.max(1), ssh.max(1)],
        }
    }

    fn slot(class: Class) -> usize {
        match class {
            Class::Other => 0,
            Class::Notify => 1,
            Class::Ssh => 2,
        }
    }

    /// `item` if it may start now (it then counts as running), else `None` and it waits.
    fn submit(&mut self, class: Class, item: T) -> Option<T> {
        let i = Self::slot(class);
        if self.running[i] < self.caps[i] {
            self.running[i] += 1;
            Some(item)
        } else {
            self.waiting[i].push_back(item);
            None
        }
    }

    /// A job of `class` ended: the next waiting one of that class, which now runs.
    fn finish(&mut self, class: Class) -> Option<T> {
        let i = Self::slot(class);
        match self.waiting[i].pop_front() {
            Some(next) => Some(next),
            None => {
                self.running[i] = self.running[i].saturating_sub(1);
                None
            }
        }
    }

    fn waiting(&self) -> usize {
        self.waiting.iter().map(VecDeque::len).sum()
    }
}

/// Jobs waiting for their time, earliest first (submission order among equal times).
struct Later<T> {
    due: std::collections::BTreeMap<(tokio::time::Instant, u64), T>,
    next: u64,
}

impl<T> Default for Later<T> {
    fn default() -> Self {
        Later {
            due: Default::default(),
            next: 0,
        }
    }
}

impl<T> Later<T> {
    fn at(&mut self, when: tokio::time::Instant, item: T) {
        self.due.insert((when, self.next), item);
        self.next += 1;
    }

    fn next_at(&self) -> Option<tokio::time::Instant> {
        self.due.keys().next().map(|(at, _)| *at)
    }

    /// Every item due by `now`, in order.
    fn take_due(&mut self, now: tokio::time::Instant) -> Vec<T> {
        let later = self.due.split_off(&(now, u64::MAX));
        std::mem::replace(&mut self.due, later)
            .into_values()
            .collect()
    }
}

/// Everything the loop owns.
pub struct Driver {
    base: Context,
    policy: Policy,
    /// The served config, for the safety-net scan.
    config_rx: tokio::sync::watch::Receiver<Option<Arc<HostConfig>>>,
    every: Intervals,
    taskruns: TaskRunIndex,
    config: Option<Arc<HostConfig>>,
    /// Leadership as the elector publishes it: the term token while leading.
    leadership: watch::Receiver<Option<CancellationToken>>,
    leading: Option<CancellationToken>,
    term: Option<Term>,
    next_term: u64,
    results_tx: mpsc::UnboundedSender<Completion>,
    results_rx: mpsc::UnboundedReceiver<Completion>,
    inputs_tx: mpsc::Sender<Input>,
    actions: Vec<Action>,
}

impl Driver {
    /// A driver executing with `base` (its `cancel` is the process's; each term gets a child).
    pub fn new(
        base: Context,
        policy: Policy,
        inputs_tx: mpsc::Sender<Input>,
        config_rx: tokio::sync::watch::Receiver<Option<Arc<HostConfig>>>,
        leadership: watch::Receiver<Option<CancellationToken>>,
        every: Intervals,
    ) -> Self {
        let (results_tx, results_rx) = mpsc::unbounded_channel();
        Driver {
            base,
            policy,
            config_rx,
            every,
            taskruns: TaskRunIndex::default(),
            config: None,
            leadership,
            leading: None,
            term: None,
            next_term: 1,
            results_tx,
            results_rx,
            inputs_tx,
            actions: Vec::new(),
        }
    }

    /// Runs until [`Input::Shutdown`] or the input channel closes.
    pub async fn run(mut self, mut inputs: mpsc::Receiver<Input>) {
        let mut gauges = tokio::time::interval(Duration::from_secs(5));
        gauges.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.on_leadership();
        let mut elector_gone = false;
        loop {
            let deadline = self.deadline();
            let again = self.next_again();
            tokio::select! {
                biased;
                // First: a lost Lease must end the term before anything else is dispatched.
                changed = self.leadership.changed(), if !elector_gone => match changed {
                    Ok(()) => self.on_leadership(),
                    Err(_) => {
                        // The elector stopped: nobody renews the Lease any more.
                        elector_gone = true;
                        self.leading = None;
                        self.base.metrics.set_leader(false);
                        self.end_term();
                    }
                },
                Some(done) = self.results_rx.recv() => self.on_completion(done),
                input = inputs.recv() => match input {
                    None | Some(Input::Shutdown) => break,
                    Some(input) => self.on_input(input),
                },
                () = sleep_until(deadline) => self.feed(Event::Tick),
                () = sleep_until_instant(again) => self.run_due(),
                _ = gauges.tick() => self.update_gauges(),
            }
        }
        self.end_term();
    }

    fn deadline(&self) -> Option<Time> {
        match &self.term {
            Some(Term {
                phase: Phase::Running(s),
                ..
            }) => s.next_deadline(),
            _ => None,
        }
    }

    /// When the earliest job waiting to run again is due.
    fn next_again(&self) -> Option<tokio::time::Instant> {
        self.term.as_ref().and_then(|t| t.later.next_at())
    }

    /// Starts the jobs whose wait is over, in their lanes (which they kept).
    fn run_due(&mut self) {
        let Some(term) = &mut self.term else {
            return;
        };
        for (lane, job) in term.later.take_due(tokio::time::Instant::now()) {
            term.start(lane, job, &self.results_tx);
        }
    }

    fn on_input(&mut self, input: Input) {
        match input {
            Input::TaskRuns(ev) => self.on_watch(*ev),
            Input::Config(cfg) => {
                self.base.metrics.configured(cfg.platforms());
                self.config = Some(cfg.clone());
                self.feed(Event::ConfigReplaced(Box::new((*cfg).clone())));
            }
            Input::Recovered { term, snapshot } => self.on_recovered(term, snapshot),
            Input::Sweep(ev) => self.feed(ev),
            Input::Shutdown => {}
        }
        self.maybe_start_term();
    }

    fn on_leadership(&mut self) {
        let leading = self.leadership.borrow_and_update().clone();
        self.base.metrics.set_leader(leading.is_some());
        if leading != self.leading {
            // A new token is a new term even without a gap seen in between.
            self.end_term();
        }
        self.leading = leading;
        self.maybe_start_term();
    }

    fn on_watch(&mut self, ev: watcher::Event<TaskRun>) {
        let mut found = Vec::new();
        let leading = self.term.is_some();
        self.taskruns
            .apply(ev, self.config.as_deref(), leading, &mut found);
        self.on_found(found);
    }

    fn on_found(&mut self, found: Vec<Found>) {
        for f in found {
            match f {
                Found::Active(spec) => self.feed(Event::TaskRun(spec)),
                Found::Done {
                    namespace,
                    name,
                    uid,
                    tracked_only,
                    released,
                } => self.done(namespace, name, uid, tracked_only, released),
                Found::Write(job) => self.controller_job(job),
            }
        }
    }

    /// Tells the scheduler a TaskRun is done, or only released (when it may hold something).
    fn done(
        &mut self,
        namespace: String,
        name: String,
        uid: String,
        tracked_only: bool,
        released: bool,
    ) {
        if tracked_only {
            let tracked = match &self.term {
                Some(Term {
                    phase: Phase::Running(s),
                    ..
                }) => s.tracks(&uid),
                // While recovering, the snapshot decides; a buffered event is harmless.
                Some(Term {
                    phase: Phase::Recovering(_),
                    ..
                }) => true,
                None => false,
            };
            if !tracked {
                return;
            }
        }
        let taskrun = TaskRunRef::new(&namespace, &name, Uid::new(&uid));
        self.feed(if released {
            Event::TaskRunReleased { taskrun }
        } else {
            Event::TaskRunDone { taskrun }
        });
    }

    /// Hands an event to the scheduler (or the recovery buffer) and dispatches its actions.
    fn feed(&mut self, event: Event) {
        let Some(term) = &mut self.term else {
            return;
        };
        match &mut term.phase {
            Phase::Recovering(buffer) => {
                if !matches!(event, Event::Tick) {
                    buffer.push(event);
                }
            }
            Phase::Running(s) => {
                let mut out = std::mem::take(&mut self.actions);
                s.handle(now(), event, &mut out);
                self.dispatch(&mut out);
                self.actions = out;
            }
        }
    }

    /// A write of the controller's own (not the scheduler's): runs in the TaskRun's lane while
    /// leading, so it is ordered with the scheduler's writes.
    fn controller_job(&mut self, job: Job) {
        if self.term.is_none() {
            return;
        }
        let key = match &job {
            Job::AddFinalizer(r) | Job::RemoveFinalizer { taskrun: r, .. } => {
                LaneKey::TaskRun(r.uid().to_string().into())
            }
            Job::Action(a) => match lane_of(a) {
                Some(k) => k,
                None => return,
            },
        };
        self.submit(Some(key), job);
    }

    fn dispatch(&mut self, actions: &mut Vec<Action>) {
        for action in actions.drain(..) {
            match action {
                Action::Observe(o) => self.base.metrics.observe(&o),
                action => {
                    let lane = lane_of(&action);
                    self.submit(lane, Job::Action(action));
                }
            }
        }
    }

    fn submit(&mut self, lane: Option<LaneKey>, job: Job) {
        let Some(term) = &mut self.term else {
            return;
        };
        let start = match &lane {
            Some(k) => term.lanes.submit(k.clone(), job),
            None => Some(job),
        };
        if let Some(job) = start {
            term.start(lane, job, &self.results_tx);
        }
    }

    fn on_completion(&mut self, done: Completion) {
        let Some(term) = &mut self.term else {
            return;
        };
        if term.id != done.term {
            return;
        }
        if let Some((lane, job)) = term.running.finish(done.class) {
            spawn_job(&term.ctx, term.id, lane, job, &self.results_tx);
        }
        if let Some((job, after)) = done.outcome.again {
            // Its place is free; its lane stays taken until it lands.
            term.later
                .at(tokio::time::Instant::now() + after, (done.lane, job));
        } else if let Some(lane) = &done.lane
            && let Some(next) = term.lanes.finish(lane)
        {
            term.start(done.lane.clone(), next, &self.results_tx);
        }
        for ev in done.outcome.events {
            self.feed(ev);
        }
    }

    fn maybe_start_term(&mut self) {
        if self.term.is_some() || !self.taskruns.synced() {
            return;
        }
        let Some(leadership) = self.leading.as_ref().filter(|t| !t.is_cancelled()) else {
            return;
        };
        let Some(config) = self.config.clone() else {
            return;
        };
        let id = self.next_term;
        self.next_term += 1;
        let mut ctx = self.base.clone();
        ctx.cancel = leadership.child_token();
        tracing::info!(
            term = id,
            live = self.taskruns.len(),
            "leading: rebuilding the ledger"
        );
        let records = self.taskruns.records();
        tokio::spawn(sources::recovery::run(
            ctx.clone(),
            id,
            records,
            config,
            self.inputs_tx.clone(),
        ));
        tokio::spawn(sources::adopt::run(
            ctx.clone(),
            self.config_rx.clone(),
            self.every.adopt,
        ));
        tokio::spawn(sources::instances::sweep(
            ctx.clone(),
            self.config_rx.clone(),
            self.inputs_tx.clone(),
            self.every.instances,
        ));
        tokio::spawn(sources::host_users::sweep(
            ctx.clone(),
            self.config_rx.clone(),
            self.inputs_tx.clone(),
            self.every.host_users,
        ));
        self.term = Some(Term {
            id,
            ctx,
            phase: Phase::Recovering(Vec::new()),
            lanes: Lanes::default(),
            running: InFlight::new(JOBS_IN_FLIGHT, NOTIFY_IN_FLIGHT, SSH_IN_FLIGHT),
            later: Later::default(),
        });
        let mut found = Vec::new();
        self.taskruns.term_started(&mut found);
        self.on_found(found);
    }

    fn on_recovered(&mut self, id: u64, snapshot: Snapshot) {
        let Some(config) = self.config.clone() else {
            return;
        };
        let Some(term) = &mut self.term else {
            return;
        };
        if term.id != id {
            return;
        }
        let buffered = match std::mem::replace(&mut term.phase, Phase::Recovering(Vec::new())) {
            Phase::Recovering(b) => b,
            running => {
                term.phase = running;
                return;
            }
        };
        let (n_taskruns, n_instances) = (snapshot.taskruns.len(), snapshot.instances.len());
        let mut scheduler = Box::new(Scheduler::new((*config).clone(), self.policy.clone()));
        let mut out = std::mem::take(&mut self.actions);
        scheduler.recover(now(), snapshot, &mut out);
        term.phase = Phase::Running(scheduler);
        let actions = out.len();
        self.dispatch(&mut out);
        let waiting = self.term.as_ref().map_or(0, |t| t.running.waiting());
        tracing::info!(
            term = id,
            taskruns = n_taskruns,
            instances = n_instances,
            actions,
            waiting,
            replayed = buffered.len(),
            "ledger rebuilt; scheduling"
        );
        self.actions = out;
        for ev in buffered {
            self.feed(ev);
        }
        self.update_gauges();
    }

    fn end_term(&mut self) {
        if let Some(term) = self.term.take() {
            term.ctx.cancel.cancel();
            tracing::info!(
                term = term.id,
                "term ended: executor cancelled, scheduler dropped"
            );
        }
        self.taskruns.term_ended();
    }

    fn update_gauges(&mut self) {
        if let Some(Term {
            phase: Phase::Running(s),
            ..
        }) = &self.term
        {
            self.base.metrics.set_gauges(&s.gauges(), now());
        }
    }
}

/// The lane an action runs in.
fn lane_of(action: &Action) -> Option<LaneKey> {
    let tr = |r: &TaskRunRef| Some(LaneKey::TaskRun(r.uid().to_string().into()));
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
        | Action::RemoveFinalizer { taskrun, .. } => tr(taskrun),
        Action::Deprovision { user, host, .. } => {
            Some(LaneKey::HostUser(host.name().into(), user.name()))
        }
        Action::Probe { instance_id, .. }
        | Action::Terminate { instance_id, .. }
        | Action::Retag { instance_id, .. } => Some(LaneKey::Instance(instance_id.clone())),
        Action::Launch { .. } | Action::Notify { .. } | Action::Observe(_) => None,
    }
}

impl Term {
    /// Runs a job whose lane let it start, when the caps allow; else it waits its turn.
    fn start(
        &mut self,
        lane: Option<LaneKey>,
        job: Job,
        results: &mpsc::UnboundedSender<Completion>,
    ) {
        if let Some((lane, job)) = self.running.submit(class_of(&job), (lane, job)) {
            spawn_job(&self.ctx, self.id, lane, job, results);
        }
    }
}

fn spawn_job(
    ctx: &Context,
    term: u64,
    lane: Option<LaneKey>,
    job: Job,
    results: &mpsc::UnboundedSender<Completion>,
) {
    let (ctx, results) = (ctx.clone(), results.clone());
    let class = class_of(&job);
    tokio::spawn(async move {
        let outcome = execute::run(&ctx, job).await;
        let _ = results.send(Completion {
            term,
            lane,
            class,
            outcome,
        });
    });
}

async fn sleep_until_instant(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Time>) {
    match deadline {
        Some(at) => {
            let wait = Duration::from_millis(at.as_millis().saturating_sub(now().as_millis()));
            tokio::time::sleep(wait).await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recovery of 10,000 queued TaskRuns submits a write and an Event for each at once: only
    /// the caps run, the rest start one per finished job of their class, in order.
    #[test]
    fn a_burst_runs_under_the_caps_in_order() {
        let mut q = InFlight::new(JOBS_IN_FLIGHT, NOTIFY_IN_FLIGHT, SSH_IN_FLIGHT);
        let mut started = Vec::new();
        for i in 0..10_000 {
            started.extend(q.submit(Class::Other, ("write", i)));
            started.extend(q.submit(Class::Notify, ("event", i)));
        }
        let count = |v: &[(&str, i32)], what: &str| v.iter().filter(|(w, _)| *w == what).count();
        assert_eq!(count(&started, "write"), JOBS_IN_FLIGHT);
        assert_eq!(count(&started, "event"), NOTIFY_IN_FLIGHT);
        assert_eq!(q.waiting(), 20_000 - JOBS_IN_FLIGHT - NOTIFY_IN_FLIGHT);
        // Events publishing slowly do not hold writes back: a finished write starts the next.
        assert_eq!(
            q.finish(Class::Other),
            Some(("write", JOBS_IN_FLIGHT as i32))
        );
        assert_eq!(
            q.finish(Class::Notify),
            Some(("event", NOTIFY_IN_FLIGHT as i32))
        );
        let mut next = JOBS_IN_FLIGHT as i32 + 1;
        while let Some((_, i)) = q.finish(Class::Other) {
            assert_eq!(i, next, "submission order");
            next += 1;
        }
        assert_eq!(next, 10_000);
        // Drained: every place is free again, and new work starts at once.
        for _ in 0..JOBS_IN_FLIGHT - 1 {
            assert_eq!(q.finish(Class::Other), None);
        }
        assert_eq!(q.running[0], 0);
        assert!(q.submit(Class::Other, ("write", 0)).is_some());
    }

    /// Jobs to run again come out when due, earliest first, in submission order among equals.
    #[test]
    fn later_jobs_come_out_when_due_in_order() {
        let t0 = tokio::time::Instant::now();
        let s = Duration::from_secs;
        let mut later = Later::default();
        later.at(t0 + s(2), "b");
        later.at(t0 + s(1), "a");
        later.at(t0 + s(2), "c");
        later.at(t0 + s(5), "d");
        assert_eq!(later.next_at(), Some(t0 + s(1)));
        assert!(later.take_due(t0).is_empty());
        assert_eq!(later.take_due(t0 + s(2)), ["a", "b", "c"]);
        assert_eq!(later.next_at(), Some(t0 + s(5)));
        assert_eq!(later.take_due(t0 + s(9)), ["d"]);
        assert_eq!(later.next_at(), None);
    }

    /// Provisionings waiting for slow hosts fill their own cap, not the places of the API
    /// writes (a provisioned TaskRun's secret) behind them.
    #[test]
    fn ssh_work_does_not_hold_writes_back() {
        let mut q = InFlight::new(JOBS_IN_FLIGHT, NOTIFY_IN_FLIGHT, SSH_IN_FLIGHT);
        let write = Job::Action(Action::Ungate {
            taskrun: TaskRunRef::new("ns", "tr", crate::scheduler::Uid::new("u")),
        });
        assert_eq!(class_of(&write), Class::Other);
        for i in 0..1_000 {
            q.submit(Class::Ssh, ("provision", i));
        }
        assert_eq!(q.waiting(), 1_000 - SSH_IN_FLIGHT);
        assert_eq!(q.submit(Class::Other, ("write", 0)), Some(("write", 0)));
        assert_eq!(
            q.finish(Class::Ssh),
            Some(("provision", SSH_IN_FLIGHT as i32))
        );
    }
}
