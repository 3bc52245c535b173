//! Ledger memory per tracked TaskRun, measured with a counting allocator: bytes held after
//! adding 100,000 TaskRuns minus bytes held before (hosts and config excluded), for queued
//! TaskRuns and for TaskRuns running on hosts. Realistic names: ~40-character TaskRun names,
//! UUID uids, 200 namespaces.
//!
//! `cargo bench -p mpc-core --bench scheduler_memory`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use mpc_core::config::ConfigData;
use mpc_core::scheduler::{Action, Event, Policy, Scheduler, Snapshot, TaskRunSpec, Time};

struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        HELD.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HELD.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        HELD.fetch_add(new, Ordering::Relaxed);
        HELD.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const N: usize = 100_000;
const LIMIT: usize = 256;

fn config(hosts: usize, concurrency: u32) -> mpc_core::config::HostConfig {
    let mut data = ConfigData::new();
    for i in 0..hosts {
        let h = format!("host.s390x-{i:05}");
        data.insert(
            format!("{h}.address"),
            format!("10.{}.{}.1", i / 250, i % 250),
        );
        data.insert(format!("{h}.user"), "root".into());
        data.insert(format!("{h}.platform"), "linux/s390x".into());
        data.insert(format!("{h}.secret"), "ssh".into());
        data.insert(format!("{h}.concurrency"), concurrency.to_string());
    }
    mpc_core::config::parse(&data).config
}

fn spec(i: usize) -> TaskRunSpec {
    TaskRunSpec {
        namespace: format!("tenant-{:03}", i % 200),
        name: format!("component-{i:06}-on-push-build-container"),
        uid: format!("{:08x}-1b2d-4e3f-8a9b-{i:012x}", i * 7919),
        platform: "linux/s390x".into(),
        since: Time::from_secs(1_700_000_000),
        retries: 0,
        gated: false,
    }
}

/// Bytes per TaskRun held by the scheduler after admitting N of them (and, when `provision`,
/// handing each its secret).
fn measure(hosts: usize, concurrency: u32, provision: bool) -> (f64, usize) {
    let cfg = config(hosts, concurrency);
    let now = Time::from_secs(1_700_000_000);
    let mut sched = Scheduler::new(cfg, Policy::mpc());
    let mut out = Vec::new();
    sched.recover(now, Snapshot::default(), &mut out);
    // Allocated before the window, never grown: not counted.
    let mut ops = Vec::with_capacity(N);
    out = Vec::with_capacity(64);
    let before = HELD.load(Ordering::Relaxed);
    // Each spec is built inside the window: what the scheduler keeps of its strings counts, what
    // it drops nets out.
    for i in 0..N {
        sched.handle(now, Event::TaskRun(spec(i)), &mut out);
        for a in out.drain(..) {
            if let Action::Provision { op, .. } = a {
                ops.push(op);
            }
        }
    }
    if provision {
        for op in ops.drain(..) {
            sched.handle(
                now,
                Event::Provisioned {
                    op,
                    otp: String::new(),
                },
                &mut out,
            );
            out.clear();
        }
    }
    let after = HELD.load(Ordering::Relaxed);
    assert_eq!(sched.tracked(), N);
    let held = after
        .checked_sub(before)
        .expect("frees inside the window exceed allocations: the measurement is broken");
    drop(sched);
    (held as f64 / N as f64, held)
}

fn main() {
    // `cargo test --benches` runs bench binaries with `--bench` absent: keep that quick.
    if !std::env::args().any(|a| a == "--bench") {
        println!("scheduler_memory: run with `cargo bench -p mpc-core --bench scheduler_memory`");
        return;
    }
    let (queued, qb) = measure(1_000, 4, false);
    let (running, rb) = measure(12_500, 8, true);
    println!("ledger bytes per tracked TaskRun (limit {LIMIT}):");
    println!("  100,000 queued (1,000 hosts x 4, 4,000 provisioning):  {queued:7.1}  ({qb} bytes)");
    println!(
        "  100,000 running (12,500 hosts x 8, all provisioned):    {running:7.1}  ({rb} bytes)"
    );
    assert!(
        queued <= LIMIT as f64 && running <= LIMIT as f64,
        "over {LIMIT} bytes per TaskRun"
    );
}
