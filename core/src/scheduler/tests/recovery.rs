//! Restart from a snapshot.

use super::*;

pub(super) fn rec(name: &str, platform: &str) -> TaskRunRecord {
    TaskRunRecord {
        namespace: "ns".into(),
        name: name.into(),
        uid: format!("uid-ns-{name}"),
        platform: platform.into(),
        since: Time::from_secs(START - 100),
        ..Default::default()
    }
}

pub(super) fn start(pairs: &[(String, String)], snap: Snapshot) -> (H, Vec<Action>) {
    let mut s = Scheduler::new(config(pairs), Policy::mpc());
    let now = Time::from_secs(START);
    let mut out = Vec::new();
    s.recover(now, snap, &mut out);
    (H::from(s, now), out)
}

/// An instance of this cluster for linux/arm64, launched for the TaskRun with UID `owner`.
pub(super) fn instance(id: &str, owner: Option<&str>, launched: u64) -> InstanceRecord {
    InstanceRecord {
        id: id.into(),
        platform: crate::platform::Platform::parse("linux/arm64").unwrap(),
        instance_tag: "test".into(),
        ownership: Ownership::Ours,
        platform_label: Some("linux-arm64".into()),
        owner: owner.map(str::to_owned),
        taskrun_id: None,
        launched_at: Time::from_secs(launched),
        state: InstanceState::Running,
        address: Some("192.0.2.9".into()),
    }
}

#[test]
fn static_allocations_are_counted_and_missing_secrets_reprovisioned() {
    let mut running = rec("a", "linux/s390x");
    running.assigned_host = Some("h1".into());
    running.secret = Some(SecretKind::Remote);
    let mut half = rec("b", "linux/s390x");
    half.assigned_host = Some("h2".into());
    let waiting = rec("c", "linux/s390x");
    let (mut h, out) = start(
        &static_pairs(&[("h1", 1), ("h2", 1)]),
        Snapshot {
            taskruns: vec![running, half, waiting],
            instances: vec![],
            ..Default::default()
        },
    );
    // b was assigned but never got its secret: provisioned again on the same host.
    let p = provisions(&out);
    assert_eq!(p.len(), 1, "{out:#?}");
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("b", "h2"));
    // c waits: both hosts are full.
    assert_eq!(
        records(&out, "c")[0].waiting_for_platform.as_deref(),
        Some("linux-s390x")
    );
    // a finishing frees h1 for c; a's user is removed from h1.
    let a = h.done("ns", "a");
    assert_eq!(deprovisions(&a)[0].2, "h1");
    assert_eq!(provisions(&a)[0].1, "c");
}

#[test]
fn dynamic_instance_is_probed_and_an_unannotated_launch_is_adopted_by_tag() {
    let mut booting = rec("a", "linux/arm64");
    booting.instance_id = Some("i-a".into());
    // Crashed between launch and annotation: found by its taskRunID tag.
    let lost = rec("b", "linux/arm64");
    let (mut h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![booting, lost],
            instances: vec![
                instance("i-a", Some("uid-ns-a"), START - 60),
                instance("i-b", Some("uid-ns-b"), START - 50),
            ],
            ..Default::default()
        },
    );
    assert!(
        launches(&out).is_empty(),
        "max-instances already used by the two: {out:#?}"
    );
    assert_eq!(records(&out, "b")[0].instance_id.as_deref(), Some("i-b"));
    let p = probes(&h.wait(0));
    assert_eq!(p.len(), 2, "{p:?}");
    assert_eq!(h.s.gauges().platforms["linux/arm64"].instances, 2);
}

#[test]
fn orphans_are_terminated_after_the_grace_period() {
    let (mut h, out) = start(
        &dynamic_pairs(3, None),
        Snapshot {
            taskruns: vec![],
            instances: vec![
                instance("i-old", Some("uid-ns-gone"), START - 3600),
                instance("i-young", Some("uid-ns-gone2"), START - 60),
                InstanceRecord {
                    instance_tag: "someone-else".into(),
                    ..instance("i-foreign", None, START - 3600)
                },
            ],
            ..Default::default()
        },
    );
    let t = terminates(&out);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].1, "i-old");
    assert_eq!(terminates(&h.wait(9 * 60 + 1))[0].1, "i-young");
    // The sweep finds one launched later that nothing owns.
    let a = h.send(Event::InstancesListed {
        platform: crate::platform::Platform::parse("linux/arm64").unwrap(),
        instances: vec![instance("i-new", None, START - 3000)],
    });
    assert_eq!(terminates(&a)[0].1, "i-new");
}

#[test]
fn finished_taskruns_are_cleaned_up_then_released() {
    let mut d = rec("a", "linux/arm64");
    d.finished = true;
    d.instance_id = Some("i-a".into());
    d.secret = Some(SecretKind::Remote);
    let mut s = rec("b", "linux/s390x");
    s.finished = true;
    s.assigned_host = Some("h1".into());
    let mut w = rec("c", "linux/s390x");
    w.finished = true;
    let mut pairs = dynamic_pairs(2, None);
    pairs.extend(static_pairs(&[("h1", 1)]));
    let (mut h, out) = start(
        &pairs,
        Snapshot {
            taskruns: vec![d, s, w],
            instances: vec![instance("i-a", Some("uid-ns-a"), START - 600)],
            ..Default::default()
        },
    );
    assert_eq!(finalized(&out), vec!["c"]);
    let t = terminates(&out);
    assert_eq!(t[0].1, "i-a");
    let dp = deprovisions(&out);
    assert_eq!(dp[0].2, "h1");
    assert_eq!(
        finalized(&h.send(Event::Terminated {
            op: t[0].0,
            error: None
        })),
        vec!["a"]
    );
    assert_eq!(
        finalized(&h.send(Event::Deprovisioned {
            op: dp[0].0,
            error: None
        })),
        vec!["b"]
    );
}

#[test]
fn a_finished_taskruns_secret_is_deleted_though_recovery_did_not_read_it() {
    // The controller reads no secret for finished TaskRuns (`secret` stays `None`): a leader that
    // died after the build got its secret left it behind when cleanup waited for evidence of it.
    let mut b = rec("b", "linux/s390x");
    b.finished = true;
    b.assigned_host = Some("h1".into());
    let (_, out) = start(
        &static_pairs(&[("h1", 1)]),
        Snapshot {
            taskruns: vec![b],
            instances: vec![],
            ..Default::default()
        },
    );
    let deleted: Vec<String> = out
        .iter()
        .filter_map(|a| match a {
            Action::DeleteSecret { taskrun } => Some(taskrun.name().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(deleted, ["b"]);
}

#[test]
fn pool_instances_and_their_taskruns_are_rebuilt() {
    let mut a = rec("a", "linux/arm64");
    a.assigned_host = Some("i-p".into());
    a.secret = Some(SecretKind::Remote);
    let (mut h, out) = start(
        &dynamic_pairs(1, Some((2, 600))),
        Snapshot {
            taskruns: vec![a],
            instances: vec![instance("i-p", Some("uid-ns-a"), START - 60)],
            ..Default::default()
        },
    );
    assert!(launches(&out).is_empty());
    let p = probes(&h.wait(0))[0].0;
    h.send(Event::Probed {
        op: p,
        result: ProbeResult::Reachable {
            address: "192.0.2.9".into(),
        },
    });
    // One slot left on i-p: b gets it; c waits (max-instances 1).
    assert_eq!(provisions(&h.submit("ns", "b", "linux/arm64"))[0].2, "i-p");
    let c = h.submit("ns", "c", "linux/arm64");
    assert!(provisions(&c).is_empty() && launches(&c).is_empty());
}

/// A waiter recovered under a config that no longer serves its platform fails, and its
/// `waiting-for-platform` label goes with the error (else the next restart queues it again).
#[test]
fn a_recovered_waiter_that_fails_loses_its_waiting_label() {
    let mut waiting = rec("a", "linux/riscv64");
    waiting.waiting = true;
    let (_, out) = start(
        &static_pairs(&[("h1", 1)]),
        Snapshot {
            taskruns: vec![waiting],
            instances: vec![],
            ..Default::default()
        },
    );
    error_of(&out, "a");
    assert_eq!(records(&out, "a"), vec![&Placement::default()], "{out:#?}");
}

/// Found by the model test: after a restart a pool instance with a running build was adopted as
/// booting and probed, and one failed probe (a transient SSH failure) terminated it under the
/// build. An instance holding a recorded allocation was reachable before: a failed probe takes
/// it out of service, its running builds keep it until they finish.
#[test]
fn a_failed_probe_of_a_recovered_pool_instance_spares_its_running_build() {
    let mut a = rec("a", "linux/arm64");
    a.assigned_host = Some("i-p".into());
    a.secret = Some(SecretKind::Remote);
    let mut b = rec("b", "linux/arm64");
    b.assigned_host = Some("i-p".into());
    let (mut h, out) = start(
        &dynamic_pairs(2, Some((3, 600))),
        Snapshot {
            taskruns: vec![a, b],
            instances: vec![instance("i-p", Some("uid-ns-a"), START - 60)],
            ..Default::default()
        },
    );
    assert!(launches(&out).is_empty());
    let p = probes(&h.wait(0))[0].0;
    let failed = h.send(Event::Probed {
        op: p,
        result: ProbeResult::Failed {
            reason: "connection reset".into(),
        },
    });
    assert!(terminates(&failed).is_empty(), "{failed:#?}");
    assert!(secret(&failed, "a").is_none());
    // b, not provisioned yet, moves to a new instance with i-p counted as failed.
    assert_eq!(launches(&failed).len(), 1, "{failed:#?}");
    assert!(provisions(&failed).is_empty());
    // No new work for i-p: c joins the new instance, booting.
    let c = h.submit("ns", "c", "linux/arm64");
    assert!(
        provisions(&c).is_empty() && launches(&c).is_empty(),
        "{c:#?}"
    );
    // a finishes: its user is removed and the idle instance terminated.
    let done = h.done("ns", "a");
    assert_eq!(deprovisions(&done)[0].2, "i-p");
    assert_eq!(terminates(&done)[0].1, "i-p");
}

/// Found by the model test: a dynamic instance handed over to a waiter when its TaskRun finished
/// during the launch is named by both TaskRuns; a restart before the finished one's finalizer
/// was removed terminated it as that one's cleanup, under the running build of the other.
#[test]
fn an_instance_handed_over_is_not_terminated_with_its_first_owners_cleanup() {
    let mut first = rec("a", "linux/arm64");
    first.finished = true;
    first.instance_id = Some("i-1".into());
    first.assigned_host = Some("i-1".into());
    let mut second = rec("b", "linux/arm64");
    second.instance_id = Some("i-1".into());
    second.assigned_host = Some("i-1".into());
    second.secret = Some(SecretKind::Remote);
    let (mut h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![first, second],
            instances: vec![instance("i-1", Some("uid-ns-b"), START - 60)],
            ..Default::default()
        },
    );
    assert!(terminates(&out).is_empty(), "{out:#?}");
    assert_eq!(finalized(&out), vec!["a"]);
    // b's cleanup terminates it.
    assert_eq!(terminates(&h.done("ns", "b"))[0].1, "i-1");
}

/// Answers every probe "pending" until an action list shows a termination or `limit` seconds
/// pass; returns that list and the seconds it took.
fn pending_until_terminated(h: &mut H, limit: u64) -> (Vec<Action>, u64) {
    let mut probe = probes(&h.wait(0))[0].0;
    let mut elapsed = 0;
    loop {
        let out = h.send(Event::Probed {
            op: probe,
            result: ProbeResult::Pending,
        });
        assert!(terminates(&out).is_empty(), "{out:#?}");
        let out = h.wait(5);
        elapsed += 5;
        match probes(&out).first() {
            Some(p) if elapsed < limit => probe = p.0,
            _ => return (out, elapsed),
        }
    }
}

/// A recovered instance whose probe answers "pending" forever (stuck in the provider's pending
/// phase, or an address that never answers) had no allocation deadline, so it held its slot for
/// good. Idle, it is replaced at `allocation-timeout` counted from recovery.
#[test]
fn a_recovered_idle_pool_instance_that_never_answers_is_terminated_at_the_deadline() {
    let (mut h, out) = start(
        &dynamic_pairs(1, Some((2, 600))),
        Snapshot {
            taskruns: vec![],
            instances: vec![instance("i-p", None, START - 3_600)],
            ..Default::default()
        },
    );
    assert!(launches(&out).is_empty());
    let (due, elapsed) = pending_until_terminated(&mut h, 1_300);
    let t = terminates(&due);
    assert_eq!(t.len(), 1, "{due:#?}");
    assert_eq!(t[0].1, "i-p");
    // Counted from recovery (the default 600 s), not from its launch an hour ago.
    assert!((600..=605).contains(&elapsed), "{elapsed}");
    // Once gone, its slot serves the next TaskRun.
    h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    });
    let a = h.submit("ns", "a", "linux/arm64");
    assert_eq!(launches(&a).len(), 1, "{a:#?}");
}

/// The same with a build recorded on it: the build keeps the instance until it finishes, only
/// new work goes elsewhere.
#[test]
fn a_recovered_pool_instance_with_a_build_that_never_answers_stops_taking_work() {
    let mut a = rec("a", "linux/arm64");
    a.assigned_host = Some("i-p".into());
    a.secret = Some(SecretKind::Remote);
    let (mut h, out) = start(
        &dynamic_pairs(2, Some((2, 600))),
        Snapshot {
            taskruns: vec![a],
            instances: vec![instance("i-p", Some("uid-ns-a"), START - 60)],
            ..Default::default()
        },
    );
    assert!(launches(&out).is_empty());
    let (due, elapsed) = pending_until_terminated(&mut h, 1_300);
    assert!(terminates(&due).is_empty(), "{due:#?}");
    assert!(
        (600..=605).contains(&elapsed),
        "probed past the deadline: {elapsed}"
    );
    // New work goes to a new instance.
    let b = h.submit("ns", "b", "linux/arm64");
    assert_eq!(launches(&b).len(), 1, "{b:#?}");
    // a finishing frees it: its user is removed and it is terminated.
    let done = h.done("ns", "a");
    assert_eq!(deprovisions(&done)[0].2, "i-p");
    assert_eq!(terminates(&done)[0].1, "i-p");
}

/// A leader died between its launch call and recording the instance; the new leader finds it
/// in the listing under the owner tag of a TaskRun that has since finished, or of one placed on
/// another instance: nothing can claim it any more, so it goes at once rather than holding a
/// `max-instances` place for the whole grace period (and outliving its TaskRun). An owner the
/// ledger does not know keeps the grace.
#[test]
fn an_instance_whose_owner_moved_on_is_terminated_without_waiting_out_the_grace() {
    let mut finished = rec("done", "linux/arm64");
    finished.finished = true;
    let mut running = rec("run", "linux/arm64");
    running.instance_id = Some("i-run".into());
    running.secret = Some(SecretKind::Remote);
    let (mut h, out) = start(
        &dynamic_pairs(4, None),
        Snapshot {
            taskruns: vec![finished, running],
            instances: vec![
                instance("i-run", Some("uid-ns-run"), START - 120),
                // Launched for `done` by the dead leader, never recorded.
                instance("i-done", Some("uid-ns-done"), START - 30),
                instance("i-stranger", Some("uid-ns-unknown"), START - 30),
            ],
            ..Default::default()
        },
    );
    let t: Vec<String> = terminates(&out).into_iter().map(|t| t.1).collect();
    assert_eq!(t, ["i-done"], "{out:#?}");
    // A late launch of the dead leader lands after recovery, for `run`, which is on i-run.
    let a = h.send(Event::InstancesListed {
        platform: crate::platform::Platform::parse("linux/arm64").unwrap(),
        instances: vec![
            instance("i-run", Some("uid-ns-run"), START - 120),
            instance("i-done", Some("uid-ns-done"), START - 30),
            instance("i-stranger", Some("uid-ns-unknown"), START - 30),
            instance("i-late", Some("uid-ns-run"), START - 5),
        ],
    });
    let t: Vec<String> = terminates(&a).into_iter().map(|t| t.1).collect();
    assert_eq!(t, ["i-late"], "{a:#?}");
    // The stranger waits out the grace period.
    let later = h.wait(10 * 60);
    let t: Vec<String> = terminates(&later).into_iter().map(|t| t.1).collect();
    assert_eq!(t, ["i-stranger"], "{later:#?}");
}

/// A new leader re-admits what the last one queued without writing the waiting label again or
/// re-sending its Event (both stand); one with failed hosts is written again (its annotation is
/// rebuilt from what recovery kept), and one that was not labelled is labelled.
#[test]
fn recovered_waiters_already_labelled_are_not_written_or_announced_again() {
    let mut running = rec("a", "linux/s390x");
    running.assigned_host = Some("h1".into());
    running.secret = Some(SecretKind::Remote);
    let mut labelled = rec("b", "linux/s390x");
    labelled.waiting = true;
    let mut failed = rec("c", "linux/s390x");
    failed.waiting = true;
    failed.failed_hosts = vec!["h2".into()];
    let unlabelled = rec("d", "linux/s390x");
    let (mut h, out) = start(
        &static_pairs(&[("h1", 1)]),
        Snapshot {
            taskruns: vec![running, labelled, failed, unlabelled],
            instances: vec![],
            ..Default::default()
        },
    );
    let notified = |out: &[Action], name: &str| {
        out.iter().any(|a| {
            matches!(a, Action::Notify { taskrun: Some(t), reason: "WaitingForHost", .. } if t.name() == name)
        })
    };
    assert!(records(&out, "b").is_empty(), "{out:#?}");
    assert!(!notified(&out, "b"));
    assert_eq!(records(&out, "c").len(), 1, "{out:#?}");
    assert_eq!(
        records(&out, "d")[0].waiting_for_platform.as_deref(),
        Some("linux-s390x")
    );
    assert!(notified(&out, "d"));
    // b is still served in its turn (after c, a retry), and its placement is recorded.
    let a = h.done("ns", "a");
    assert_eq!(provisions(&a)[0].1, "c");
    let c = h.done("ns", "c");
    assert_eq!(provisions(&c)[0].1, "b");
    assert_eq!(records(&c, "b")[0].assigned_host.as_deref(), Some("h1"));
}

fn arm64() -> crate::platform::Platform {
    crate::platform::Platform::parse("linux/arm64").unwrap()
}

/// Served on `id` with the controller's proof (`proven`) or without (a Go-era or forged claim).
fn on_instance(name: &str, id: &str, proven: bool) -> TaskRunRecord {
    let mut r = rec(name, "linux/arm64");
    r.instance_id = Some(id.into());
    r.assigned_host = Some(id.into());
    r.secret = Some(SecretKind::Remote);
    r.secret_proven = proven;
    r
}

/// The cloud listing of linux/arm64 failed at recovery (five tries). Going on as if it were
/// empty rebuilt the proven build as a slot on a "retired host", re-queued and relaunched the
/// unproven one while its build ran (and launched for the waiter, up to max-instances, blind to
/// what runs), and the next listing terminated both running instances as orphans whose owners
/// had moved on. The platform is "unlisted" instead: its TaskRuns stay as recorded, nothing is
/// launched or terminated, until a listing of it arrives; then it is recovered as a restart with
/// that listing would be.
#[test]
fn a_platform_whose_listing_failed_keeps_its_allocations_until_it_is_listed() {
    let a = on_instance("a", "i-a", true);
    let b = on_instance("b", "i-b", false);
    let c = rec("c", "linux/arm64");
    let mut d = on_instance("d", "i-d", true);
    d.finished = true;
    d.secret = None;
    let (mut h, out) = start(
        &dynamic_pairs(4, None),
        Snapshot {
            taskruns: vec![a, b, c, d],
            instances: vec![],
            unlisted: vec![arm64()],
        },
    );
    assert!(launches(&out).is_empty(), "{out:#?}");
    assert!(terminates(&out).is_empty(), "{out:#?}");
    assert!(provisions(&out).is_empty(), "{out:#?}");
    assert!(
        finalized(&out).is_empty(),
        "d's instance may still run: {out:#?}"
    );
    assert!(written(&out, "b").is_none() && written(&out, "a").is_none());
    // Operators see it: the platform is unlisted with its four TaskRuns held.
    let g = &h.s.gauges().platforms["linux/arm64"];
    assert!(g.unlisted, "{g:?}");
    assert_eq!(g.held, 4, "{g:?}");
    // Nothing is launched for new TaskRuns either while what runs is unknown.
    assert!(launches(&h.submit("ns", "e", "linux/arm64")).is_empty());
    assert!(launches(&h.wait(600)).is_empty());
    // The listing arrives: a and b keep their instances, d's is terminated (its cleanup), and
    // the waiters launch within max-instances (i-a, i-b, i-d count until d's goes).
    let listed = h.send(Event::InstancesListed {
        platform: arm64(),
        instances: vec![
            instance("i-a", Some("uid-ns-a"), START - 600),
            instance("i-b", Some("uid-ns-b"), START - 600),
            instance("i-d", Some("uid-ns-d"), START - 600),
        ],
    });
    let t = terminates(&listed);
    assert_eq!(t.len(), 1, "{listed:#?}");
    assert_eq!(t[0].1, "i-d");
    let g = &h.s.gauges().platforms["linux/arm64"];
    assert!(!g.unlisted && g.held == 0, "{g:?}");
    assert_eq!(launches(&listed).len(), 1, "c or e: {listed:#?}");
    assert!(written(&listed, "a").is_none() && written(&listed, "b").is_none());
    let a = h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    });
    assert_eq!(finalized(&a), ["d"]);
    assert_eq!(launches(&a).len(), 1, "then the other: {a:#?}");
    // Later listings leave the running builds' instances alone.
    h.wait(11 * 60);
    let later = h.send(Event::InstancesListed {
        platform: arm64(),
        instances: vec![
            instance("i-a", Some("uid-ns-a"), START - 600),
            instance("i-b", Some("uid-ns-b"), START - 600),
        ],
    });
    assert!(terminates(&later).is_empty(), "{later:#?}");
    // a and b end on their instances as any other build.
    assert_eq!(terminates(&h.done("ns", "a"))[0].1, "i-a");
    assert_eq!(terminates(&h.done("ns", "b"))[0].1, "i-b");
}

/// A pool instance is shared: its builds keep it while the pool is unlisted, and the listing
/// rebuilds their slots on it.
#[test]
fn a_pool_whose_listing_failed_keeps_its_builds_on_their_instance() {
    let mut a = rec("a", "linux/arm64");
    a.assigned_host = Some("i-p".into());
    a.secret = Some(SecretKind::Remote);
    a.secret_proven = true;
    let mut b = rec("b", "linux/arm64");
    b.assigned_host = Some("i-p".into());
    b.secret = Some(SecretKind::Remote);
    let (mut h, out) = start(
        &dynamic_pairs(2, Some((3, 600))),
        Snapshot {
            taskruns: vec![a, b],
            instances: vec![],
            unlisted: vec![arm64()],
        },
    );
    assert!(launches(&out).is_empty(), "{out:#?}");
    assert!(provisions(&out).is_empty() && written(&out, "b").is_none());
    let listed = h.send(Event::InstancesListed {
        platform: arm64(),
        instances: vec![instance("i-p", Some("uid-ns-a"), START - 600)],
    });
    assert!(terminates(&listed).is_empty() && launches(&listed).is_empty());
    let p = probes(&h.wait(0))[0].0;
    h.send(Event::Probed {
        op: p,
        result: ProbeResult::Reachable {
            address: "192.0.2.9".into(),
        },
    });
    // One slot left on i-p: c gets it.
    assert_eq!(provisions(&h.submit("ns", "c", "linux/arm64"))[0].2, "i-p");
    assert!(terminates(&h.wait(11 * 60)).is_empty());
}

/// What happens to a held TaskRun meanwhile is applied once its platform is recovered: one that
/// finished is cleaned up then (its instance terminated before its finalizer goes), a retry of
/// one served re-arms its secret on the same instance.
#[test]
fn events_of_a_held_taskrun_apply_once_its_platform_is_listed() {
    let a = on_instance("a", "i-a", true);
    let b = on_instance("b", "i-b", true);
    let (mut h, _) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![a, b],
            instances: vec![],
            unlisted: vec![arm64()],
        },
    );
    let done = h.done("ns", "a");
    assert!(finalized(&done).is_empty() && terminates(&done).is_empty());
    let mut retry = H::spec("ns", "b", "linux/arm64");
    retry.retries = 1;
    assert!(h.send(Event::TaskRun(retry)).is_empty());
    let listed = h.send(Event::InstancesListed {
        platform: arm64(),
        instances: vec![
            instance("i-a", Some("uid-ns-a"), START - 600),
            instance("i-b", Some("uid-ns-b"), START - 600),
        ],
    });
    let t = terminates(&listed);
    assert_eq!(t.len(), 1, "{listed:#?}");
    assert_eq!(t[0].1, "i-a");
    assert_eq!(provisions(&listed)[0].2, "i-b", "b's retry re-arms on i-b");
    assert_eq!(
        finalized(&h.send(Event::Terminated {
            op: t[0].0,
            error: None,
        })),
        ["a"]
    );
}

/// A platform that stops being a dynamic one is never listed again: its held TaskRuns are
/// recovered at once, without a listing.
#[test]
fn a_held_platform_that_is_no_longer_dynamic_is_recovered_without_a_listing() {
    let a = on_instance("a", "i-a", true);
    let w = rec("w", "linux/arm64");
    let (mut h, _) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![a, w],
            instances: vec![],
            unlisted: vec![arm64()],
        },
    );
    let mut local = vec![kv("local-platforms", "linux/arm64")];
    local.extend(static_pairs(&[("h1", 1)]));
    let out = h.send(Event::ConfigReplaced(Box::new(config(&local))));
    assert_eq!(secret(&out, "w"), Some(&SecretData::Localhost), "{out:#?}");
    assert!(written(&out, "a").is_none(), "a's build keeps running");
    assert!(!finalized(&h.done("ns", "a")).is_empty());
}

/// Found by the model: the listing that recovers a held platform finalized a TaskRun that had
/// finished, which let a waiter with the same (colliding) user name be placed, before the
/// listing's count of other clusters' instances was in (max-instances exceeded).
#[test]
fn a_listing_that_recovers_a_platform_counts_others_instances_before_serving_waiters() {
    let mut d = on_instance("tr-3", "i-d", true);
    d.namespace = "ns1".into();
    d.uid = "uid-d".into();
    d.finished = true;
    d.secret = None;
    let (mut h, _) = start(
        &dynamic_pairs(1, None),
        Snapshot {
            taskruns: vec![d],
            instances: vec![],
            unlisted: vec![arm64()],
        },
    );
    // `s1/tr-3n` has the build user of `ns1/tr-3`.
    assert!(launches(&h.submit("s1", "tr-3n", "linux/arm64")).is_empty());
    // i-d is gone already; another cluster's instance fills max-instances.
    let listed = h.send(Event::InstancesListed {
        platform: arm64(),
        instances: vec![InstanceRecord {
            ownership: Ownership::Foreign,
            ..instance("f-1", Some("other"), START - 60)
        }],
    });
    assert_eq!(finalized(&listed), ["tr-3"]);
    assert!(launches(&listed).is_empty(), "{listed:#?}");
    assert_eq!(h.s.gauges().platforms["linux/arm64"].foreign, 1);
}

/// Recovery adopts an unannotated launch (a crash between launch and annotation) only by this
/// TaskRun's own UID in the owner tag: an instance of ours launched for another TaskRun is never
/// taken over, and the TaskRun gets an instance of its own.
#[test]
fn an_unannotated_taskrun_never_takes_an_instance_tagged_for_another() {
    let lost = rec("b", "linux/arm64");
    let (_h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![lost],
            instances: vec![instance("i-x", Some("uid-ns-someone-else"), START - 50)],
            ..Default::default()
        },
    );
    assert!(
        records(&out, "b")
            .iter()
            .all(|r| r.instance_id.as_deref() != Some("i-x")),
        "{out:#?}"
    );
    assert_eq!(launches(&out).len(), 1, "b launches its own: {out:#?}");
}

/// Recovers `b`, served on instance i-1 whose owner tag still names `a` (the hand-over's retag
/// never landed), with `a` still recorded (`first_recorded`: finished, its finalizer kept) or
/// gone: `true` when recovery gave i-1 to `b` (nothing terminates it until `b` finishes).
fn handed_over_kept(b: TaskRunRecord, listed: InstanceRecord, first_recorded: bool) -> bool {
    let mut first = rec("a", "linux/arm64");
    first.finished = true;
    first.instance_id = Some("i-1".into());
    first.assigned_host = Some("i-1".into());
    let mut taskruns = vec![b];
    if first_recorded {
        taskruns.insert(0, first);
    }
    let (mut h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns,
            instances: vec![listed],
            ..Default::default()
        },
    );
    let ends_i1 = |acts: &[Action]| terminates(acts).iter().any(|t| t.1 == "i-1");
    // Past the orphan grace period: an instance nothing claims is gone by then.
    let later = h.wait(10 * 60 + 1);
    let spared = !ends_i1(&out) && !ends_i1(&later);
    if first_recorded && spared {
        // Handed over: nothing of i-1 is a's to clean up.
        assert_eq!(finalized(&out), vec!["a"], "{out:#?}");
    }
    // b's cleanup terminates i-1 only if recovery gave it to b.
    spared && ends_i1(&h.done("ns", "b"))
}

/// Found by the model test: a hand-over emits `Retag(i-1 -> b)` and `a`'s finalizer removal in
/// different lanes, and a retag has no result. Should the removal land and the retag not (a
/// crash, or a failed CreateTags), i-1's owner tag names `a`, which is gone: recovery refused
/// b's `cloud-instance-id` and terminated i-1 as an orphan under b's running build. b's
/// allocation is proven (the controller's proof for b and host i-1, and its secret exists), so
/// its claim holds for this cluster's instance of its platform whatever the owner tag says; `a`,
/// if still recorded, does not terminate it as its own.
#[test]
fn a_proven_hand_over_keeps_its_instance_though_the_retag_was_lost() {
    for first_recorded in [false, true] {
        assert!(
            handed_over_kept(
                on_instance("b", "i-1", true),
                instance("i-1", Some("uid-ns-a"), START - 60),
                first_recorded
            ),
            "a recorded: {first_recorded}"
        );
    }
}

/// What a proven hand-over accepts and nothing more: an unproven claim (Go's, or a tenant's
/// forged labels), one proven for another host, and another cluster's instance or another
/// platform's are refused as before.
#[test]
fn only_a_proven_hand_over_of_our_instance_overrides_its_owner_tag() {
    let ours = || instance("i-1", Some("uid-ns-a"), START - 60);
    let mut other_host = on_instance("b", "i-1", true);
    other_host.assigned_host = Some("i-2".into());
    let mut amd64 = ours();
    amd64.platform_label = Some("linux-amd64".into());
    for (what, b, listed) in [
        ("unproven", on_instance("b", "i-1", false), ours()),
        ("proven for another host", other_host, ours()),
        ("another platform's", on_instance("b", "i-1", true), amd64),
    ] {
        for first_recorded in [false, true] {
            assert!(
                !handed_over_kept(b.clone(), listed.clone(), first_recorded),
                "{what}, a recorded: {first_recorded}"
            );
        }
    }
    // Another cluster's instance is never ours to keep or terminate.
    let foreign = InstanceRecord {
        ownership: Ownership::Foreign,
        ..ours()
    };
    let (mut h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![on_instance("b", "i-1", true)],
            instances: vec![foreign],
            ..Default::default()
        },
    );
    assert!(
        out.iter().any(|a| matches!(
            a,
            Action::Notify {
                reason: "ForeignInstance",
                ..
            }
        )),
        "{out:#?}"
    );
    let later = h.wait(10 * 60 + 1);
    assert!(terminates(&out).is_empty() && terminates(&later).is_empty());
    assert!(terminates(&h.done("ns", "b")).is_empty());
}

/// The previous owner still live and naming the instance (its tag-based claim stands, as the
/// retag was lost) does not take it from the proven new owner, which is rebuilt first: one
/// instance, one owner. It starts over.
#[test]
fn a_live_previous_owner_does_not_take_a_proven_hand_over() {
    let mut first = rec("a", "linux/arm64");
    first.instance_id = Some("i-1".into());
    first.assigned_host = Some("i-1".into());
    let (mut h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![first, on_instance("b", "i-1", true)],
            instances: vec![instance("i-1", Some("uid-ns-a"), START - 60)],
            ..Default::default()
        },
    );
    assert!(terminates(&out).is_empty(), "{out:#?}");
    let relaunched = launches(&out);
    assert_eq!(relaunched.len(), 1, "{out:#?}");
    assert_eq!(relaunched[0].1.as_deref(), Some("ns:a"));
    assert!(terminates(&h.done("ns", "a")).iter().all(|t| t.1 != "i-1"));
    assert_eq!(terminates(&h.done("ns", "b"))[0].1, "i-1");
}
