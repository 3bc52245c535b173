//! The loop: the single writer of allocation decisions (docs/architecture.md, "The controller
//! shell").
//!
//! One task owns the [`Scheduler`]. The [sources](super::sources) feed it (watch events, periodic
//! listings, the recovery snapshot, config updates, leadership changes), action results come
//! back from the [executor](super::execute::Executor), and a timer fires at
//! [`Scheduler::next_deadline`]; actions go out to the executor as spawned jobs, started by
//! [`Lanes`] (per-key order and per-class caps). The loop never awaits I/O. The executor and the
//! term's sources are parameters ([`Executor`], [`Sources`]): the guarantees below are unit-tested
//! with scripted ones.
//!
//! Guarantees:
//! - nothing is allocated before the ledger is rebuilt: on leadership gain the TaskRun watch
//!   must have listed everything, then [`Scheduler::recover`] runs on a [`Snapshot`] of the
//!   [`TaskRunIndex`] (with whether each relevant TaskRun's Secret exists, and cloud listings)
//!   before live events flow; events that arrive meanwhile are buffered and replayed in order;
//! - after a relist (410, reconnect), TaskRuns the index held that the list no longer has are
//!   done ([`TaskRunIndex`]);
//! - losing the Lease cancels every job of the term at once and drops the scheduler: the term's
//!   token is a child of the elector's term token, which the elector cancels itself at the
//!   renew deadline, so in-flight writes of an ended term are abandoned even before this loop
//!   reads the change. A new token is a new term, even without a gap seen in between;
//! - nothing of an ended term is applied: its job results, its recovery snapshot, and its jobs
//!   waiting for a place, behind their lane or for their next attempt are dropped with it, so a
//!   result cannot reach the next term's scheduler (whose operation ids start over);
//! - at most [`JOBS_IN_FLIGHT`](super::lanes::JOBS_IN_FLIGHT) jobs run at once, besides
//!   Events and provisionings and removals, each class capped apart ([`Caps`]); the rest wait as
//!   plain values, in submission order;
//! - a finalizer removal that did not land waits for its next attempt outside the caps, its
//!   TaskRun's lane still taken (later writes about it keep their order): removals the API
//!   refuses for good cannot take the places every other write needs.
//!
//! Spans: the loop runs in `loop`, each term's work in `term` (field `term`), the term's
//! sources in `source` (`kind`) inside it, and each job in the executor's `job` span inside the
//! term's; a watch event about a TaskRun is handled in `taskrun_event` (`namespace`, `taskrun`,
//! `uid`).
//!
//! Assumptions: events are idempotent for the scheduler (it ignores duplicates and late copies),
//! so replays after a buffer or a relist are safe.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::watcher;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::execute::{Executor, Job, Outcome};
use super::lanes::{Caps, Class, LaneKey, Lanes, Ticket, lane_of};
use super::metrics::ControllerMetrics;
use super::sources::taskruns::{Found, TaskRunIndex};
use super::sources::{Input, Sources, TermStart, now};
use super::taskrun::TaskRun;
use crate::config::HostConfig;
use crate::scheduler::{Action, Event, Policy, Scheduler, Snapshot, TaskRunRef, Time};

/// A finished job.
pub struct Completion {
    term: u64,
    ticket: Ticket,
    outcome: Outcome,
}

enum Phase {
    /// Collecting the snapshot; scheduler events are buffered.
    Recovering(Vec<Event>),
    Running(Box<Scheduler>),
}

/// A leadership term.
struct Term<E> {
    id: u64,
    /// The executor of the term (its token fires when the term ends).
    exec: E,
    cancel: CancellationToken,
    span: tracing::Span,
    phase: Phase,
    lanes: Lanes<Job>,
    /// Jobs to run again at a time (finalizer removals that did not land), holding their lane
    /// but no place; dropped with the term.
    later: Later<(Ticket, Job)>,
}

/// Where a job of the loop runs: its lane and class.
fn place(job: &Job) -> (Option<LaneKey>, Class) {
    match job {
        Job::AddFinalizer(r) | Job::RemoveFinalizer { taskrun: r, .. } => {
            (Some(LaneKey::taskrun(r)), Class::Other)
        }
        Job::Action(a) => (lane_of(a), Class::of(a)),
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
pub struct Driver<E, S> {
    /// The executor; each term runs with a copy bound to its token.
    exec: E,
    sources: S,
    metrics: ControllerMetrics,
    policy: Policy,
    caps: Caps,
    taskruns: TaskRunIndex,
    config: Option<Arc<HostConfig>>,
    /// Leadership as the elector publishes it: the term token while leading.
    leadership: watch::Receiver<Option<CancellationToken>>,
    leading: Option<CancellationToken>,
    term: Option<Term<E>>,
    next_term: u64,
    results_tx: mpsc::UnboundedSender<Completion>,
    results_rx: mpsc::UnboundedReceiver<Completion>,
    inputs_tx: mpsc::Sender<Input>,
    actions: Vec<Action>,
    started: Vec<(Ticket, Job)>,
    /// Check the scheduler's state after every this many events (`--check-state`); 0: never.
    check_every: u64,
    /// Events handed to a scheduler.
    fed: u64,
}

impl<E: Executor, S: Sources> Driver<E, S> {
    /// A driver running jobs with `exec` and each term's `sources`, which report on `inputs_tx`
    /// (the sender of the channel [`Driver::run`] reads).
    pub fn new(
        exec: E,
        sources: S,
        metrics: ControllerMetrics,
        policy: Policy,
        inputs_tx: mpsc::Sender<Input>,
        leadership: watch::Receiver<Option<CancellationToken>>,
    ) -> Self {
        let (results_tx, results_rx) = mpsc::unbounded_channel();
        Driver {
            exec,
            sources,
            metrics,
            policy,
            caps: Caps::CONTROLLER,
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
            started: Vec::new(),
            check_every: 0,
            fed: 0,
        }
    }

    /// Checks the scheduler's state after every `n` events (0: never); see `--check-state`.
    pub fn check_state(mut self, n: u64) -> Self {
        self.check_every = n;
        self
    }

    /// Other caps than the controller's (tests).
    pub fn with_caps(mut self, caps: Caps) -> Self {
        self.caps = caps;
        self
    }

    /// Runs until [`Input::Shutdown`] or the input channel closes.
    pub async fn run(self, inputs: mpsc::Receiver<Input>) {
        self.run_loop(inputs)
            .instrument(tracing::info_span!("loop"))
            .await
    }

    async fn run_loop(mut self, mut inputs: mpsc::Receiver<Input>) {
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
                        self.metrics.set_leader(false);
                        self.end_term();
                    }
                },
                Some(done) = self.results_rx.recv() => self.in_term(|d| d.on_completion(done)),
                input = inputs.recv() => match input {
                    None | Some(Input::Shutdown) => break,
                    Some(input) => self.in_term(|d| d.on_input(input)),
                },
                () = sleep_until(deadline) => self.in_term(|d| d.feed(Event::Tick)),
                () = sleep_until_instant(again) => self.in_term(Self::run_due),
                _ = gauges.tick() => self.update_gauges(),
            }
        }
        self.end_term();
    }

    /// Runs `f` in the current term's span (if a term runs).
    fn in_term(&mut self, f: impl FnOnce(&mut Self)) {
        let span = self.term.as_ref().map(|t| t.span.clone());
        match span {
            Some(span) => span.in_scope(|| f(self)),
            None => f(self),
        }
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
        for (ticket, job) in term.later.take_due(tokio::time::Instant::now()) {
            term.lanes.resume(ticket, job, &mut self.started);
        }
        self.spawn_started();
    }

    fn on_input(&mut self, input: Input) {
        match input {
            Input::TaskRuns(ev) => self.on_watch(*ev),
            Input::Config(cfg) => {
                self.metrics.configured(cfg.platforms());
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
        self.metrics.set_leader(leading.is_some());
        if leading != self.leading {
            // A new token is a new term even without a gap seen in between.
            self.end_term();
        }
        self.leading = leading;
        self.maybe_start_term();
    }

    fn on_watch(&mut self, ev: watcher::Event<TaskRun>) {
        let span = match &ev {
            watcher::Event::Apply(tr)
            | watcher::Event::InitApply(tr)
            | watcher::Event::Delete(tr) => {
                let m = &tr.metadata;
                tracing::info_span!(
                    "taskrun_event",
                    namespace = m.namespace.as_deref(),
                    taskrun = m.name.as_deref(),
                    uid = m.uid.as_deref()
                )
            }
            watcher::Event::Init | watcher::Event::InitDone => tracing::Span::none(),
        };
        let _entered = span.enter();
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
                    taskrun,
                    tracked_only,
                    released,
                } => self.done(&taskrun, tracked_only, released),
                Found::Write(job) => self.controller_job(job),
            }
        }
    }

    /// Tells the scheduler a TaskRun is done, or only released (when it may hold something).
    fn done(&mut self, taskrun: &TaskRunRef, tracked_only: bool, released: bool) {
        if tracked_only {
            let tracked = match &self.term {
                Some(Term {
                    phase: Phase::Running(s),
                    ..
                }) => s.tracks(&taskrun.uid().to_string()),
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
        let taskrun = taskrun.clone();
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
                self.fed += 1;
                // A debug aid: it observes and counts, and changes nothing (see `--check-state`).
                if self.check_every != 0
                    && self.fed.is_multiple_of(self.check_every)
                    && let Err(e) = s.check()
                {
                    tracing::error!(invariant = ?e.invariant, detail = %e.detail, "scheduler state broken");
                    self.metrics.state_broken(e.invariant);
                }
                self.dispatch(&mut out);
                self.actions = out;
            }
        }
    }

    /// A write of the controller's own (not the scheduler's): runs in the TaskRun's lane while
    /// leading, so it is ordered with the scheduler's writes.
    fn controller_job(&mut self, job: Job) {
        if place(&job).0.is_some() {
            self.submit(job);
        }
    }

    fn dispatch(&mut self, actions: &mut Vec<Action>) {
        for action in actions.drain(..) {
            match action {
                Action::Observe(o) => self.metrics.observe(&o),
                action => self.submit(Job::Action(action)),
            }
        }
    }

    fn submit(&mut self, job: Job) {
        let Some(term) = &mut self.term else {
            return;
        };
        let (lane, class) = place(&job);
        term.lanes.submit(lane, class, job, &mut self.started);
        self.spawn_started();
    }

    /// Spawns the jobs [`Lanes`] let start.
    fn spawn_started(&mut self) {
        let Some(term) = &self.term else {
            self.started.clear();
            return;
        };
        for (ticket, job) in self.started.drain(..) {
            let run = term.exec.run(job);
            let (results, id) = (self.results_tx.clone(), term.id);
            // In the term's span: the job's own span nests in it.
            let job = async move {
                let outcome = run.await;
                let _ = results.send(Completion {
                    term: id,
                    ticket,
                    outcome,
                });
            };
            tokio::spawn(job.instrument(term.span.clone()));
        }
    }

    fn on_completion(&mut self, done: Completion) {
        let Some(term) = &mut self.term else {
            return;
        };
        // A result of an ended term: its scheduler is gone, and this one's op ids start over.
        if term.id != done.term {
            return;
        }
        if let Some((job, after)) = done.outcome.again {
            // Its place is free; its lane stays taken until it lands.
            term.lanes.pause(done.ticket.class, &mut self.started);
            term.later
                .at(tokio::time::Instant::now() + after, (done.ticket, job));
        } else {
            term.lanes.finish(done.ticket, &mut self.started);
        }
        self.spawn_started();
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
        let cancel = leadership.child_token();
        let span = tracing::info_span!("term", term = id);
        let _entered = span.enter();
        tracing::info!(live = self.taskruns.len(), "leading: rebuilding the ledger");
        self.sources.start(TermStart {
            term: id,
            cancel: cancel.clone(),
            records: self.taskruns.records(),
            config,
            inputs: self.inputs_tx.clone(),
        });
        self.term = Some(Term {
            id,
            exec: self.exec.for_term(cancel.clone()),
            cancel,
            span: span.clone(),
            phase: Phase::Recovering(Vec::new()),
            lanes: Lanes::new(self.caps),
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
        // A snapshot of an ended term describes a world this term has not listed.
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
        let waiting = self.term.as_ref().map_or(0, |t| t.lanes.waiting());
        tracing::info!(
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
            term.cancel.cancel();
            term.span.in_scope(|| {
                tracing::info!("term ended: executor cancelled, scheduler dropped");
            });
        }
        self.taskruns.term_ended();
    }

    fn update_gauges(&mut self) {
        if let Some(Term {
            phase: Phase::Running(s),
            ..
        }) = &self.term
        {
            self.metrics.set_gauges(&s.gauges(), now());
        }
    }
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
    use futures::future::BoxFuture;
    use serde_json::{Value, json};
    use tokio::sync::oneshot;

    use super::*;
    use crate::contract;
    use crate::scheduler::{OpId, SecretProbe};

    /// One job the loop started, held by the test until it answers.
    struct Ran {
        job: Job,
        /// The token of the term the job was started in.
        cancel: CancellationToken,
        at: tokio::time::Instant,
        reply: oneshot::Sender<Outcome>,
    }

    impl Ran {
        fn answer(self, outcome: Outcome) {
            let _ = self.reply.send(outcome);
        }

        /// What the job is about: `kind uid` (or `kind` alone).
        fn about(&self) -> String {
            match self.job.taskrun() {
                Some(t) => format!("{} {}", self.job.kind(), t.uid()),
                None => self.job.kind().to_owned(),
            }
        }

        fn op(&self) -> OpId {
            OpId(self.job.op().expect("an operation"))
        }
    }

    /// The scripted executor: hands every job to the test, and never drops one itself when its
    /// term ends (the live one does), so whatever the loop does with a late result shows.
    struct Script {
        jobs: mpsc::UnboundedSender<Ran>,
        cancel: CancellationToken,
    }

    impl Executor for Script {
        fn for_term(&self, cancel: CancellationToken) -> Self {
            Script {
                jobs: self.jobs.clone(),
                cancel,
            }
        }

        fn run(&self, job: Job) -> BoxFuture<'static, Outcome> {
            let (reply, answer) = oneshot::channel();
            let kind = job.kind();
            let _ = self.jobs.send(Ran {
                job,
                cancel: self.cancel.clone(),
                at: tokio::time::Instant::now(),
                reply,
            });
            Box::pin(async move {
                // Logged from inside the job, where the live executor logs.
                tracing::info!(kind, "job running");
                answer.await.unwrap_or_default()
            })
        }
    }

    /// The scripted sources: hand each term's start to the test, which sends its snapshot.
    struct Starts(mpsc::UnboundedSender<TermStart>);

    impl Sources for Starts {
        fn start(&self, term: TermStart) {
            let _ = self.0.send(term);
        }
    }

    /// A loop with a scripted executor and sources, and one static host of concurrency 1.
    struct Harness {
        inputs: mpsc::Sender<Input>,
        lead: Option<watch::Sender<Option<CancellationToken>>>,
        jobs: mpsc::UnboundedReceiver<Ran>,
        terms: mpsc::UnboundedReceiver<TermStart>,
    }

    const WAIT: Duration = Duration::from_secs(600);

    impl Harness {
        fn start(caps: Caps) -> Self {
            let (inputs, rx) = mpsc::channel(64);
            let (lead, leadership) = watch::channel(None);
            let (jobs_tx, jobs) = mpsc::unbounded_channel();
            let (terms_tx, terms) = mpsc::unbounded_channel();
            let exec = Script {
                jobs: jobs_tx,
                cancel: CancellationToken::new(),
            };
            let metrics = ControllerMetrics::register(&prometheus::Registry::new()).unwrap();
            let driver = Driver::new(
                exec,
                Starts(terms_tx),
                metrics,
                Policy::mpc(),
                inputs.clone(),
                leadership,
            )
            .with_caps(caps);
            tokio::spawn(driver.run(rx));
            Harness {
                inputs,
                lead: Some(lead),
                jobs,
                terms,
            }
        }

        async fn send(&self, input: Input) {
            self.inputs.send(input).await.unwrap();
        }

        async fn watch(&self, ev: watcher::Event<TaskRun>) {
            self.send(Input::TaskRuns(Box::new(ev))).await;
        }

        /// Config, a complete first list of `listed`, and leadership: the term it starts.
        async fn lead(&mut self, listed: Vec<TaskRun>) -> (CancellationToken, TermStart) {
            self.send(Input::Config(Arc::new(config()))).await;
            self.watch(watcher::Event::Init).await;
            for tr in listed {
                self.watch(watcher::Event::InitApply(tr)).await;
            }
            self.watch(watcher::Event::InitDone).await;
            self.new_term().await
        }

        /// A new leadership token: the term it starts.
        async fn new_term(&mut self) -> (CancellationToken, TermStart) {
            let token = CancellationToken::new();
            self.lead
                .as_ref()
                .unwrap()
                .send_replace(Some(token.clone()));
            (token, self.term().await)
        }

        async fn term(&mut self) -> TermStart {
            tokio::time::timeout(WAIT, self.terms.recv())
                .await
                .expect("a term starts")
                .unwrap()
        }

        /// The snapshot of `start`'s records, every Secret looked up and absent.
        async fn recovered(&self, start: &TermStart) {
            self.recovered_as(start.term, start).await;
        }

        async fn recovered_as(&self, term: u64, start: &TermStart) {
            let taskruns = start
                .records
                .iter()
                .map(|(r, matters)| {
                    let mut r = r.clone();
                    if *matters {
                        r.learn_secret(SecretProbe::Free, false);
                    }
                    r
                })
                .collect();
            let snapshot = Snapshot {
                taskruns,
                instances: Vec::new(),
                unlisted: Vec::new(),
            };
            self.send(Input::Recovered { term, snapshot }).await;
        }

        async fn job(&mut self) -> Ran {
            tokio::time::timeout(WAIT, self.jobs.recv())
                .await
                .expect("a job starts")
                .unwrap()
        }

        /// The next job about `about`; others on the way are answered with nothing.
        async fn job_about(&mut self, about: &str) -> Ran {
            loop {
                let ran = self.job().await;
                if ran.about() == about {
                    return ran;
                }
                ran.answer(Outcome::default());
            }
        }

        /// Every job started within `d`, unanswered.
        async fn jobs_within(&mut self, d: Duration) -> Vec<Ran> {
            let mut out = Vec::new();
            let until = tokio::time::Instant::now() + d;
            while let Ok(Some(ran)) = tokio::time::timeout_at(until, self.jobs.recv()).await {
                out.push(ran);
            }
            out
        }
    }

    fn config() -> HostConfig {
        let data: crate::config::ConfigData = [
            ("host.h1.address", "127.0.0.1"),
            ("host.h1.user", "admin"),
            ("host.h1.platform", "linux/arm64"),
            ("host.h1.secret", "h1-admin"),
            ("host.h1.concurrency", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let parsed = crate::config::parse(&data);
        assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
        parsed.config
    }

    fn taskrun_json(uid: &str) -> Value {
        json!({
            "metadata": {"name": format!("b-{uid}"), "namespace": "t1", "uid": uid,
                         "labels": {contract::TARGET_PLATFORM_LABEL: "linux-arm64"},
                         "finalizers": [contract::FINALIZER],
                         "creationTimestamp": "2026-01-02T03:04:05Z"},
            "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}],
                     "taskSpec": {"volumes": [{"name": "ssh", "secret":
                        {"secretName": "multi-platform-ssh-$(context.taskRun.name)"}}]}},
            "status": {}
        })
    }

    fn taskrun(uid: &str) -> TaskRun {
        serde_json::from_value(taskrun_json(uid)).unwrap()
    }

    fn succeeded(uid: &str) -> TaskRun {
        let mut v = taskrun_json(uid);
        v["status"]["conditions"] = json!([{"type": "Succeeded", "status": "True"}]);
        serde_json::from_value(v).unwrap()
    }

    fn abouts(jobs: &[Ran]) -> Vec<String> {
        jobs.iter().map(Ran::about).collect()
    }

    /// Nothing is allocated before the ledger is rebuilt, and what arrives meanwhile is
    /// replayed after it, in order: of two TaskRuns for a host of one slot, the first to arrive
    /// gets it. (Not even a term starts before the watch listed everything.)
    #[tokio::test(start_paused = true)]
    async fn events_during_recovery_wait_for_the_ledger_and_replay_in_order() {
        let mut h = Harness::start(Caps::CONTROLLER);
        h.send(Input::Config(Arc::new(config()))).await;
        h.lead
            .as_ref()
            .unwrap()
            .send_replace(Some(CancellationToken::new()));
        h.watch(watcher::Event::Init).await;
        let early = tokio::time::timeout(WAIT, h.terms.recv()).await;
        assert!(
            early.is_err(),
            "a term started before the list was complete"
        );
        h.watch(watcher::Event::InitDone).await;
        let start = h.term().await;
        assert!(start.records.is_empty());
        for uid in ["u2", "u3"] {
            h.watch(watcher::Event::Apply(taskrun(uid))).await;
        }
        let before = h.jobs_within(WAIT).await;
        assert!(
            before.is_empty(),
            "ran before recovery: {:?}",
            abouts(&before)
        );
        h.recovered(&start).await;
        let after = abouts(&h.jobs_within(Duration::from_secs(1)).await);
        assert!(after.contains(&"provision u2".to_owned()), "{after:?}");
        assert!(!after.contains(&"provision u3".to_owned()), "{after:?}");
    }

    /// A term ends at once when its token goes: its jobs are cancelled, and nothing of it is
    /// applied afterwards, neither its snapshot nor its results, even one naming an operation
    /// of the next term (a new scheduler numbers its operations from the start again).
    #[tokio::test(start_paused = true)]
    async fn an_ended_terms_jobs_are_cancelled_and_their_results_ignored() {
        let mut h = Harness::start(Caps::CONTROLLER);
        let (_t1, start1) = h.lead(Vec::new()).await;
        h.recovered(&start1).await;
        h.watch(watcher::Event::Apply(taskrun("u1"))).await;
        let old = h.job_about("provision u1").await;
        assert!(!old.cancel.is_cancelled());
        h.lead.as_ref().unwrap().send_replace(None);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(old.cancel.is_cancelled(), "the term's jobs are cancelled");
        let (_t2, start2) = h.new_term().await;
        assert_eq!((start1.term, start2.term), (1, 2));
        assert!(start1.cancel.is_cancelled(), "the term's sources stop");
        // Term 1's snapshot arriving late would rebuild the ledger from a world term 2 did not
        // list: ignored, term 2 keeps recovering.
        h.recovered_as(start1.term, &start2).await;
        let stale = h.jobs_within(WAIT).await;
        assert!(stale.is_empty(), "{:?}", abouts(&stale));
        h.recovered(&start2).await;
        let new = h.job_about("provision u1").await;
        // The old job answers with the new job's operation: not taken as the new one's result.
        old.answer(
            vec![Event::Provisioned {
                op: new.op(),
                otp: "stale".into(),
            }]
            .into(),
        );
        let after = h.jobs_within(WAIT).await;
        assert!(
            !abouts(&after).contains(&"write_secret u1".to_owned()),
            "an ended term's result was applied: {:?}",
            abouts(&after)
        );
        let op = new.op();
        new.answer(
            vec![Event::Provisioned {
                op,
                otp: "token".into(),
            }]
            .into(),
        );
        h.job_about("write_secret u1").await;
    }

    /// A new token is a new term, even when the change in between was not seen.
    #[tokio::test(start_paused = true)]
    async fn a_new_token_ends_the_term_without_a_gap() {
        let mut h = Harness::start(Caps::CONTROLLER);
        let (_t1, start1) = h.lead(Vec::new()).await;
        let (_t2, start2) = h.new_term().await;
        assert!(start1.cancel.is_cancelled());
        assert!(!start2.cancel.is_cancelled());
        assert_eq!(start2.term, start1.term + 1);
    }

    /// The elector gone, nobody renews the Lease: the term ends, and none starts again.
    #[tokio::test(start_paused = true)]
    async fn the_electors_end_ends_the_term() {
        let mut h = Harness::start(Caps::CONTROLLER);
        let (_t1, start) = h.lead(Vec::new()).await;
        h.lead = None;
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(start.cancel.is_cancelled());
        h.watch(watcher::Event::Apply(taskrun("u1"))).await;
        assert!(tokio::time::timeout(WAIT, h.terms.recv()).await.is_err());
    }

    /// The elector's own token cancelled (the renew deadline passed) ends the work of the term
    /// before the loop hears of it: the term's token is its child.
    #[tokio::test(start_paused = true)]
    async fn the_elector_cancelling_its_token_cancels_the_terms_jobs() {
        let mut h = Harness::start(Caps::CONTROLLER);
        let (t1, start) = h.lead(Vec::new()).await;
        h.recovered(&start).await;
        h.watch(watcher::Event::Apply(taskrun("u1"))).await;
        let job = h.job_about("provision u1").await;
        t1.cancel();
        assert!(job.cancel.is_cancelled());
        assert!(start.cancel.is_cancelled());
    }

    /// A finalizer removal that did not land runs again after its back-off, holding its
    /// TaskRun's lane (a later write about it waits) but not its place (with one place, another
    /// TaskRun's write runs meanwhile).
    #[tokio::test(start_paused = true)]
    async fn a_finalizer_retry_keeps_its_lane_not_its_place() {
        let caps = Caps {
            other: 1,
            notify: 1,
            ssh: 1,
        };
        let mut h = Harness::start(caps);
        let (_t1, start) = h.lead(vec![succeeded("u1")]).await;
        h.recovered(&start).await;
        let first = h.job_about("remove_finalizer u1").await;
        let retry = Job::RemoveFinalizer {
            taskrun: first.job.taskrun().unwrap().clone(),
            failed: 1,
        };
        let failed_at = tokio::time::Instant::now();
        first.answer(Outcome {
            events: Vec::new(),
            again: Some((retry, Duration::from_secs(30))),
        });
        // Another TaskRun's write takes the one place; a write about u1 waits behind the retry.
        h.watch(watcher::Event::Apply(taskrun("u2"))).await;
        let mut ungated = taskrun_json("u1");
        ungated["metadata"]["finalizers"] = json!([]);
        h.watch(watcher::Event::Apply(
            serde_json::from_value(ungated).unwrap(),
        ))
        .await;
        let mut seen = Vec::new();
        let retried = loop {
            let ran = h.job().await;
            let about = ran.about();
            if about == "remove_finalizer u1" {
                break ran;
            }
            assert!(
                !about.ends_with(" u1"),
                "{about} ran while the removal waited for its retry"
            );
            seen.push(about);
            ran.answer(Outcome::default());
        };
        assert!(
            seen.iter().any(|a| a.ends_with(" u2")),
            "the waiting retry held the place: {seen:?}"
        );
        assert_eq!(retried.at - failed_at, Duration::from_secs(30));
        retried.answer(Outcome::default());
        h.job_about("add_finalizer u1").await;
    }

    /// A finalizer removal waiting for its next attempt when its term ends never runs: the next
    /// term's recovery finds the finalizer again.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_retry_dies_with_its_term() {
        let mut h = Harness::start(Caps::CONTROLLER);
        let (_t1, start) = h.lead(vec![succeeded("u1")]).await;
        h.recovered(&start).await;
        let first = h.job_about("remove_finalizer u1").await;
        let retry = Job::RemoveFinalizer {
            taskrun: first.job.taskrun().unwrap().clone(),
            failed: 1,
        };
        first.answer(Outcome {
            events: Vec::new(),
            again: Some((retry, Duration::from_secs(30))),
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (_t2, start2) = h.new_term().await;
        assert_eq!(start2.records.len(), 1, "still finalized: recovered again");
        let ran = h.jobs_within(WAIT).await;
        assert!(ran.is_empty(), "ran after its term: {:?}", abouts(&ran));
    }

    /// Log lines as the binary writes them with `--log-format json`.
    #[derive(Clone, Default)]
    struct Lines(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What the loop logs about a term carries the term, and so does what its jobs log (the
    /// job's own span nests in the term's), and a TaskRun's watch event is handled in a span
    /// naming it: `select(any(.spans[]?; .term == 2))` reads one term's story.
    #[tokio::test(start_paused = true)]
    async fn a_terms_lines_and_its_jobs_lines_carry_the_term() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_writer(move || writer.clone())
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let mut h = Harness::start(Caps::CONTROLLER);
        let (_t1, start) = h.lead(Vec::new()).await;
        h.recovered(&start).await;
        h.watch(watcher::Event::Apply(taskrun("u1"))).await;
        let job = h.job_about("provision u1").await;
        tokio::time::sleep(Duration::from_millis(1)).await;
        drop(job);
        h.lead.as_ref().unwrap().send_replace(None);
        tokio::time::sleep(Duration::from_millis(1)).await;
        drop(_default);
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let logged: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let line = |message: &str| {
            logged
                .iter()
                .find(|l| l["message"] == message)
                .unwrap_or_else(|| panic!("{message:?} is logged: {text}"))
                .clone()
        };
        let names = |l: &Value| -> Vec<String> {
            l["spans"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| s["name"].as_str().unwrap_or_default().to_owned())
                .collect()
        };
        for message in [
            "leading: rebuilding the ledger",
            "ledger rebuilt; scheduling",
            "term ended: executor cancelled, scheduler dropped",
        ] {
            let l = line(message);
            assert_eq!(names(&l), ["loop", "term"], "{l}");
            assert_eq!(l["span"]["term"], 1, "{l}");
        }
        let ran = logged
            .iter()
            .find(|l| l["message"] == "job running" && l["kind"] == "provision")
            .unwrap_or_else(|| panic!("the job logged: {text}"));
        assert_eq!(names(ran), ["loop", "term"], "{ran}");
        assert_eq!(ran["span"]["term"], 1, "{ran}");
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
}
