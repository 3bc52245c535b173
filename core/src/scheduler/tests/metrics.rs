//! Metric observations against scenarios with known timings: each value is checked to the
//! millisecond against where `docs/metrics.md` says its measurement starts and ends.

use std::time::Duration;

use super::*;

const S390X: &str = "linux/s390x";
const ARM64: &str = "linux/arm64";

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// The observations of one step.
fn observed(acts: &[Action]) -> Vec<&Observation> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Observe(o) => Some(o),
            _ => None,
        })
        .collect()
}

/// `host_allocation_time` values of a step.
fn allocated(acts: &[Action]) -> Vec<Duration> {
    observed(acts)
        .into_iter()
        .filter_map(|o| match o {
            Observation::Allocated { took, .. } => Some(*took),
            _ => None,
        })
        .collect()
}

/// `task_run_time` values of a step.
fn ran(acts: &[Action]) -> Vec<Duration> {
    observed(acts)
        .into_iter()
        .filter_map(|o| match o {
            Observation::Ran { took, .. } => Some(*took),
            _ => None,
        })
        .collect()
}

/// `queue_wait_seconds` values of a step, by TaskRun name.
fn queue_waits(acts: &[Action]) -> Vec<(String, Duration)> {
    observed(acts)
        .into_iter()
        .filter_map(|o| match o {
            Observation::Waited { wait, taskrun, .. } => Some((taskrun.name().to_string(), *wait)),
            _ => None,
        })
        .collect()
}

/// `wait_time` values of a step.
fn go_waits(acts: &[Action]) -> Vec<Duration> {
    observed(acts)
        .into_iter()
        .filter_map(|o| match o {
            Observation::Waited { waited, .. } => *waited,
            _ => None,
        })
        .collect()
}

/// `host_ready_seconds` values of a step.
fn served(acts: &[Action]) -> Vec<Duration> {
    observed(acts)
        .into_iter()
        .filter_map(|o| match o {
            Observation::Served { took, .. } => Some(*took),
            _ => None,
        })
        .collect()
}

/// `build_time_seconds` values of a step.
fn built(acts: &[Action]) -> Vec<Duration> {
    observed(acts)
        .into_iter()
        .filter_map(|o| match o {
            Observation::Built { took, .. } => Some(*took),
            _ => None,
        })
        .collect()
}

/// A TaskRun created at `START + created` and seen by the scheduler now.
fn submit_created(h: &mut H, name: &str, platform: &str, created: u64) -> Vec<Action> {
    let mut spec = H::spec("ns", name, platform);
    spec.since = Time::from_secs(START + created);
    h.send(Event::TaskRun(spec))
}

/// Static host of one slot: `a` created at 0, seen at 2, provisioned at 3, done at 103; `b`
/// created at 4, seen at 5, waits for `a`'s slot until 103, provisioned at 104, done at 204.
#[test]
fn static_host_allocation_is_the_placement_and_task_run_time_starts_at_creation() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    h.wait(2);
    let a = submit_created(&mut h, "a", S390X, 0);
    assert_eq!(queue_waits(&a), vec![("a".to_owned(), Duration::ZERO)]);
    assert!(
        go_waits(&a).is_empty(),
        "Go observes only TaskRuns that waited"
    );
    // Go measures from the allocation attempt to the host assigned: nothing to wait for on a
    // static host, so zero (not the 2 s between creation and the controller seeing it).
    assert_eq!(allocated(&a), vec![Duration::ZERO]);
    let op_a = provision_op(&a, "a");
    h.wait(1);
    let a = h.send(Event::Provisioned {
        op: op_a,
        otp: "t".into(),
    });
    assert!(allocated(&a).is_empty(), "{a:#?}");
    assert_eq!(served(&a), vec![secs(3)]);

    h.wait(1);
    h.wait(1);
    let b = submit_created(&mut h, "b", S390X, 4);
    assert!(queue_waits(&b).is_empty(), "b waits: {b:#?}");
    h.wait(98);
    let done = h.done("ns", "a");
    // Go: creation to the end of the TaskRun (103 s), not the secret to the end (100 s).
    assert_eq!(ran(&done), vec![secs(103)]);
    assert_eq!(built(&done), vec![secs(100)]);
    assert_eq!(queue_waits(&done), vec![("b".to_owned(), secs(98))]);
    assert_eq!(go_waits(&done), vec![secs(99)]);
    assert_eq!(allocated(&done), vec![Duration::ZERO]);
    let op_b = provision_op(&done, "b");
    h.wait(1);
    let b = h.send(Event::Provisioned {
        op: op_b,
        otp: "t".into(),
    });
    assert_eq!(served(&b), vec![secs(100)]);
    h.wait(100);
    let done = h.done("ns", "b");
    assert_eq!(ran(&done), vec![secs(200)]);
    assert_eq!(built(&done), vec![secs(100)]);
}

/// One instance at most: `a` (created and seen at 0) launches at 0, is reachable at 21 and done
/// at 130; `b` (created at 10, seen at 30) waits until `a`'s instance is terminated at 140,
/// launches then and is reachable at 161.
#[test]
fn dynamic_allocation_is_the_launch_to_a_reachable_instance() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let a = h.submit("ns", "a", ARM64);
    let (launch_a, _) = launches(&a)[0].clone();
    assert!(allocated(&a).is_empty(), "the host is not there yet");
    h.wait(1);
    let a = boot(&mut h, launch_a, "i-1");
    assert_eq!(allocated(&a), vec![secs(21)]);
    let op = provision_op(&a, "a");
    h.wait(1);
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    h.wait(8);
    submit_created(&mut h, "b", ARM64, 10);
    h.wait(100);
    let done = h.done("ns", "a");
    assert_eq!(ran(&done), vec![secs(130)]);
    let t = terminates(&done)[0].0;
    h.wait(10);
    let b = h.send(Event::Terminated { op: t, error: None });
    assert_eq!(queue_waits(&b), vec![("b".to_owned(), secs(110))]);
    assert_eq!(go_waits(&b), vec![secs(130)]);
    let (launch_b, _) = launches(&b)[0].clone();
    h.wait(1);
    let b = boot(&mut h, launch_b, "i-2");
    // From b's launch (140), not from its creation (10).
    assert_eq!(allocated(&b), vec![secs(21)]);
}

/// Go observes `task_run_time` for every TaskRun it finalizes: local ones and error secrets too,
/// but not a TaskRun cancelled while it waited.
#[test]
fn task_run_time_covers_local_and_error_secrets_but_not_cancelled_waiters() {
    let mut pairs = static_pairs(&[("h1", 1)]);
    pairs.push(kv("local-platforms", "linux/x86_64"));
    let mut h = H::new(&pairs);
    h.submit("ns", "local", "linux/x86_64");
    let op = provision_op(&h.submit("ns", "busy", S390X), "busy");
    h.submit("ns", "queued", S390X);
    h.wait(30);
    assert_eq!(ran(&h.done("ns", "local")), vec![secs(30)]);
    assert!(ran(&h.done("ns", "queued")).is_empty());
    // The only host fails for `busy`: it gets an error secret.
    let a = h.send(Event::ProvisionFailed {
        op,
        error: "boom".into(),
        blame: Blame::Host,
    });
    assert!(error_of(&a, "busy").contains("boom"), "{a:#?}");
    h.wait(10);
    assert_eq!(ran(&h.done("ns", "busy")), vec![secs(40)]);
}

/// A pool instance launched at 0 for `a` takes `b` (seen at 5) while it boots; it is reachable at
/// 26. A retry attempt of `a` re-provisions its instance: no new allocation.
#[test]
fn pool_allocation_counts_from_joining_a_booting_instance_and_not_for_a_retry() {
    let mut h = H::new(&dynamic_pairs(1, Some((2, 60))));
    let a = h.submit("ns", "a", ARM64);
    let (launch, _) = launches(&a)[0].clone();
    h.wait(5);
    let b = h.submit("ns", "b", ARM64);
    assert!(launches(&b).is_empty(), "{b:#?}");
    assert_eq!(queue_waits(&b), vec![("b".to_owned(), Duration::ZERO)]);
    assert!(allocated(&b).is_empty());
    h.wait(1);
    let ready = boot(&mut h, launch, "i-1");
    let mut took = allocated(&ready);
    took.sort();
    assert_eq!(took, vec![secs(21), secs(26)]);
    let op = provision_op(&ready, "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    h.wait(50);
    let mut retry = H::spec("ns", "a", ARM64);
    retry.retries = 1;
    let again = h.send(Event::TaskRun(retry));
    provision_op(&again, "a");
    assert!(allocated(&again).is_empty(), "{again:#?}");
}
