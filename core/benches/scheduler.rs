//! Scheduler core throughput: 100,000 queued TaskRuns drained through 1,000 static hosts
//! (concurrency 4), every allocation provisioned, finished and cleaned up.
//!
//! `cargo bench -p mpc-core --bench scheduler`

// The `mpc` binary's allocator, so these numbers are the binary's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::VecDeque;
use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use mpc_core::config::ConfigData;
use mpc_core::scheduler::{
    Action, Event, OpId, Policy, Scheduler, Snapshot, TaskRunRef, TaskRunSpec, Time, Uid,
};

const HOSTS: usize = 1000;
const TASKRUNS: usize = 100_000;

fn config() -> mpc_core::config::HostConfig {
    let mut data = ConfigData::new();
    for i in 0..HOSTS {
        let h = format!("host.s390x-{i:04}");
        data.insert(
            format!("{h}.address"),
            format!("10.{}.{}.1", i / 250, i % 250),
        );
        data.insert(format!("{h}.user"), "root".into());
        data.insert(format!("{h}.platform"), "linux/s390x".into());
        data.insert(format!("{h}.secret"), "ssh".into());
        data.insert(format!("{h}.concurrency"), "4".into());
    }
    let parsed = mpc_core::config::parse(&data);
    assert!(!parsed.has_errors());
    parsed.config
}

fn spec(i: usize) -> TaskRunSpec {
    TaskRunSpec {
        namespace: format!("tenant-{:03}", i % 200),
        name: format!("component-{i}-on-push-build-container"),
        uid: format!("00000000-0000-4000-8000-{i:012x}"),
        platform: "linux/s390x".into(),
        since: Time::from_secs(1_700_000_000),
        retries: 0,
        gated: false,
    }
}

/// A scheduler with every TaskRun queued (the first 4,000 already placed).
struct Queued {
    sched: Scheduler,
    provisioning: VecDeque<(OpId, usize)>,
    /// Each TaskRun's finish event, built outside the timed drain (the controller gets these
    /// strings from the watch; building them is not the scheduler's work).
    done: Vec<Option<Event>>,
}

fn done_event(i: usize) -> Event {
    let s = spec(i);
    Event::TaskRunDone {
        taskrun: TaskRunRef::new(&s.namespace, &s.name, Uid::new(&s.uid)),
    }
}

fn queued(cfg: &mpc_core::config::HostConfig) -> Queued {
    let mut sched = Scheduler::new(cfg.clone(), Policy::mpc());
    let now = Time::from_secs(1_700_000_000);
    let mut out = Vec::new();
    sched.recover(now, Snapshot::default(), &mut out);
    let mut provisioning = VecDeque::new();
    for i in 0..TASKRUNS {
        out.clear();
        sched.handle(now, Event::TaskRun(spec(i)), &mut out);
        collect(&out, &mut provisioning, &mut Vec::new());
    }
    Queued {
        sched,
        provisioning,
        done: (0..TASKRUNS).map(|i| Some(done_event(i))).collect(),
    }
}

/// `i` of `component-<i>-...`.
fn index_of(name: &str) -> usize {
    name.bytes()
        .skip("component-".len())
        .take_while(u8::is_ascii_digit)
        .fold(0, |n, d| n * 10 + usize::from(d - b'0'))
}

fn collect(out: &[Action], provisioning: &mut VecDeque<(OpId, usize)>, cleanups: &mut Vec<OpId>) {
    for a in out {
        match a {
            Action::Provision { op, taskrun, .. } => {
                provisioning.push_back((*op, index_of(taskrun.name())))
            }
            Action::Deprovision { op, .. } => cleanups.push(*op),
            _ => {}
        }
    }
}

/// Drains the queue: each provisioned TaskRun gets its secret, finishes, and is cleaned up;
/// each finish hands its slot to the next waiter. Returns the number of secrets written, and the
/// emptied scheduler so that freeing it happens outside the timed routine.
fn drain(mut q: Queued) -> (usize, Queued) {
    let now = Time::from_secs(1_700_000_100);
    let mut out = Vec::with_capacity(16);
    let mut cleanups = Vec::new();
    let mut secrets = 0;
    while let Some((op, i)) = q.provisioning.pop_front() {
        out.clear();
        q.sched.handle(
            now,
            Event::Provisioned {
                op,
                otp: String::new(),
            },
            &mut out,
        );
        secrets += out
            .iter()
            .filter(|a| matches!(a, Action::WriteSecret { .. }))
            .count();
        out.clear();
        let done = q.done[i].take().expect("each TaskRun finishes once");
        q.sched.handle(now, done, &mut out);
        collect(&out, &mut q.provisioning, &mut cleanups);
        for op in cleanups.drain(..) {
            out.clear();
            q.sched
                .handle(now, Event::Deprovisioned { op, error: None }, &mut out);
        }
    }
    assert_eq!(q.sched.tracked(), 0);
    (secrets, q)
}

fn benches(c: &mut Criterion) {
    let cfg = config();
    let mut g = c.benchmark_group("scheduler");
    g.sample_size(10);
    g.throughput(Throughput::Elements(TASKRUNS as u64));
    g.bench_function("enqueue_100k_on_1000_hosts", |b| {
        b.iter_batched(
            || cfg.clone(),
            |cfg| black_box(queued(&cfg).provisioning.len()),
            BatchSize::LargeInput,
        )
    });
    g.bench_function("drain_100k_through_1000_hosts", |b| {
        b.iter_batched(
            || queued(&cfg),
            |q| {
                let (secrets, q) = drain(q);
                assert_eq!(black_box(secrets), TASKRUNS);
                q
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(scheduler_benches, benches);
criterion_main!(scheduler_benches);
