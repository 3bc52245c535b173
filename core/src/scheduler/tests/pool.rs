//! Dynamic pools: shared instances, binding until ready, max-age draining, idle reaping, warm
//! instances.

use super::*;

const P: &str = "linux/arm64";

/// Submits `ns/a`, which launches `i-1`, boots it and provisions `a` there.
fn serve_a_on_a_new_instance(h: &mut H) {
    let l = launches(&h.submit("ns", "a", P))[0].0;
    let op = provision_op(&boot(h, l, "i-1"), "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
}

#[test]
fn instance_is_shared_up_to_concurrency() {
    let mut h = H::new(&dynamic_pairs(2, Some((2, 60))));
    let a = h.submit("ns", "a", P);
    let l = launches(&a);
    assert_eq!(l.len(), 1);
    // b reserves the second slot of the booting instance rather than launching another.
    let b = h.submit("ns", "b", P);
    assert!(launches(&b).is_empty());
    let a = boot(&mut h, l[0].0, "i-1");
    let p = provisions(&a);
    assert_eq!(p.len(), 2);
    assert_eq!(p[0].1, "a", "the launching TaskRun first");
    assert!(p.iter().all(|x| x.2 == "i-1"));
    // Pool TaskRuns carry the instance as assigned-host, not the dynamic annotations.
    let r = records(&a, "a");
    assert_eq!(r[0].assigned_host.as_deref(), Some("i-1"));
    assert_eq!(r[0].instance_id, None);
    // A third one launches a second instance.
    assert_eq!(launches(&h.submit("ns", "c", P)).len(), 1);
}

#[test]
fn pool_full_waits_and_gets_the_slot_when_freed() {
    let mut h = H::new(&dynamic_pairs(1, Some((1, 60))));
    serve_a_on_a_new_instance(&mut h);
    let a = h.submit("ns", "b", P);
    assert!(launches(&a).is_empty() && provisions(&a).is_empty());
    let a = h.done("ns", "a");
    // Same instance, reused: a's user removed, b provisioned in the same step.
    assert_eq!(deprovisions(&a)[0].2, "i-1");
    let p = provisions(&a);
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("b", "i-1"));
    assert!(terminates(&a).is_empty());
}

#[test]
fn old_instance_is_terminated_only_when_idle() {
    let mut h = H::new(&dynamic_pairs(2, Some((2, 10))));
    serve_a_on_a_new_instance(&mut h);
    // Past max-age (10 min) with a build on it: no new work, not terminated.
    let a = h.wait(11 * 60);
    assert!(terminates(&a).is_empty(), "{a:#?}");
    let a = h.submit("ns", "b", P);
    assert_eq!(
        launches(&a).len(),
        1,
        "a draining instance takes no new work"
    );
    // a finishes: the old instance is terminated without waiting for traffic.
    let a = h.done("ns", "a");
    assert_eq!(terminates(&a)[0].1, "i-1");
}

#[test]
fn idle_instance_is_terminated_on_a_timer_without_traffic() {
    let mut h = H::new(&dynamic_pairs(2, Some((2, 600))));
    serve_a_on_a_new_instance(&mut h);
    let a = h.done("ns", "a");
    assert!(terminates(&a).is_empty(), "kept warm for a while");
    assert!(terminates(&h.wait(9 * 60)).is_empty());
    assert_eq!(terminates(&h.wait(61))[0].1, "i-1");
}

#[test]
fn go_policy_keeps_idle_instances_and_drains_old_ones_only_on_traffic() {
    let mut h = H::with_policy(&dynamic_pairs(2, Some((2, 10))), Policy::mpc_go());
    let l = launches(&h.submit("ns", "a", P))[0].0;
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let p = probes(&h.wait(120))[0].0;
    let a = h.send(Event::Probed {
        op: p,
        result: ProbeResult::Reachable {
            address: "192.0.2.1".into(),
        },
    });
    let op = provision_op(&a, "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    let d = deprovisions(&h.done("ns", "a"))[0].0;
    h.send(Event::Deprovisioned { op: d, error: None });
    // Idle and past max-age for hours: nothing happens without traffic.
    assert!(terminates(&h.wait(3 * 3600)).is_empty());
    // The next TaskRun for the pool notices.
    let a = h.submit("ns", "b", P);
    assert_eq!(terminates(&a)[0].1, "i-1");
}

#[test]
fn min_instances_are_kept_warm() {
    let mut pairs = dynamic_pairs(3, Some((2, 60)));
    pairs.push(kv("dynamic.linux-arm64.min-instances", "1"));
    let mut s = Scheduler::new(config(&pairs), Policy::mpc());
    let mut out = Vec::new();
    s.recover(Time::from_secs(START), Snapshot::default(), &mut out);
    let l = launches(&out);
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].1, None, "warm instances belong to no TaskRun");
    let mut h = H::from(s, Time::from_secs(START));
    let a = boot(&mut h, l[0].0, "i-warm");
    assert!(provisions(&a).is_empty());
    // Idle past the idle timeout (but not max-age): kept, it is the warm one.
    assert!(terminates(&h.wait(1800)).is_empty());
    // A TaskRun uses it without a launch.
    let a = h.submit("ns", "a", P);
    assert!(launches(&a).is_empty());
    assert_eq!(provisions(&a)[0].2, "i-warm");
    // Past max-age (60 min) it drains; a fresh warm instance replaces it.
    let a = h.wait(1800);
    assert_eq!(launches(&a).len(), 1, "{a:#?}");
    assert!(terminates(&a).is_empty(), "a still builds on it");
}

#[test]
fn provisioning_failure_moves_the_taskrun_to_another_instance() {
    let mut h = H::new(&dynamic_pairs(2, Some((2, 60))));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    let op = provision_op(&boot(&mut h, l, "i-1"), "a");
    let a = h.send(Event::ProvisionFailed {
        op,
        error: "useradd: failure".into(),
        blame: Blame::Host,
    });
    assert_eq!(deprovisions(&a)[0].2, "i-1");
    assert_eq!(launches(&a).len(), 1, "i-1 failed for a: a new instance");
    assert!(
        terminates(&a).is_empty(),
        "one failure does not condemn a shared instance"
    );
}

#[test]
fn config_change_drains_instances_of_the_old_template() {
    let mut h = H::new(&dynamic_pairs(2, Some((2, 60))));
    serve_a_on_a_new_instance(&mut h);
    let mut pairs = dynamic_pairs(2, Some((2, 60)));
    for (k, v) in &mut pairs {
        if k.ends_with(".ami") {
            *v = "ami-0fedcba9876543210".into();
        }
    }
    h.send(Event::ConfigReplaced(Box::new(config(&pairs))));
    let a = h.submit("ns", "b", P);
    assert_eq!(launches(&a).len(), 1, "b needs the new image");
    let a = h.done("ns", "a");
    assert_eq!(terminates(&a)[0].1, "i-1", "old instance goes once idle");
}

/// A pool instance terminated while a finished TaskRun's user is being removed from it takes
/// the user with it: the removal's failure ends that cleanup at once (no retries for a minute,
/// no `CleanupFailed` warning) and the TaskRun is finalized.
#[test]
fn a_user_removal_failing_on_a_terminated_instance_is_done() {
    let mut h = H::new(&dynamic_pairs(2, Some((2, 10))));
    serve_a_on_a_new_instance(&mut h);
    h.wait(11 * 60);
    let a = h.done("ns", "a");
    let (dep, _, host) = deprovisions(&a)[0].clone();
    assert_eq!(host, "i-1");
    let (term, _) = terminates(&a)[0].clone();
    assert!(
        finalized(&h.send(Event::Terminated {
            op: term,
            error: None
        }))
        .is_empty()
    );
    let a = h.send(Event::Deprovisioned {
        op: dep,
        error: Some("host i-1 is unreachable: connection refused".into()),
    });
    assert_eq!(finalized(&a), ["a"], "{a:#?}");
    assert!(
        !a.iter()
            .any(|x| matches!(x, Action::Notify { reason, .. } if *reason == "CleanupFailed")),
        "{a:#?}"
    );
    assert!(deprovisions(&h.wait(60)).is_empty(), "no retry");
}
