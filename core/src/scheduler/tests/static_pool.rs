//! Static host pools: the Go controller's scenarios plus health, fairness and cancellation.

use std::time::Duration;

use super::*;

const P: &str = "linux/s390x";

#[test]
fn allocates_provisions_and_hands_out_a_one_time_key() {
    let mut h = H::new(&static_pairs(&[("h1", 2)]));
    let mut spec = H::spec("ns", "a", P);
    spec.gated = true;
    let a = h.send(Event::TaskRun(spec));
    let rec = records(&a, "a");
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0].assigned_host.as_deref(), Some("h1"));
    assert_eq!(rec[0].waiting_for_platform, None);
    let op = provision_op(&a, "a");
    assert!(secret(&a, "a").is_none(), "no secret before provisioning");
    let a = h.send(Event::Provisioned {
        op,
        otp: "tok".into(),
    });
    let user = crate::contract::remote_user_name("a", "ns");
    let (taskrun, written) = written(&a, "a").expect("secret written");
    assert!(
        matches!(written, SecretData::Remote { otp, host } if otp == "tok" && host.name() == "h1")
    );
    assert_eq!(written.login(taskrun), Some(format!("{user}@10.0.0.1")));
    assert_eq!(written.user_dir(taskrun), Some(format!("/home/{user}")));
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Ungate { taskrun } if taskrun.name() == "a"))
    );
    // Done: secret deleted, user removed, finalizer last.
    let a = h.done("ns", "a");
    assert!(a.iter().any(|x| matches!(x, Action::DeleteSecret { .. })));
    let d = deprovisions(&a);
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].1.as_str(), d[0].2.as_str()), (user.as_str(), "h1"));
    assert!(
        finalized(&a).is_empty(),
        "finalizer held until cleanup is durable"
    );
    let a = h.send(Event::Deprovisioned {
        op: d[0].0,
        error: None,
    });
    assert_eq!(finalized(&a), vec!["a"]);
    assert_eq!(h.s.tracked(), 0);
}

#[test]
fn waits_for_concurrency_and_gets_the_freed_slot_in_the_same_step() {
    let mut h = H::new(&static_pairs(&[("h1", 1), ("h2", 1)]));
    h.submit("ns", "a", P);
    h.submit("ns", "b", P);
    let a = h.submit("ns", "c", P);
    assert!(provisions(&a).is_empty());
    let rec = records(&a, "c");
    assert_eq!(rec[0].waiting_for_platform.as_deref(), Some("linux-s390x"));
    assert!(a.iter().any(|x| matches!(
        x,
        Action::Notify {
            reason: "WaitingForHost",
            ..
        }
    )));
    let g = h.s.gauges();
    assert_eq!(g.platforms[P].waiting, 1);
    assert_eq!(g.platforms[P].running, 2);
    // b finishes (still provisioning): c gets b's host at once.
    let a = h.done("ns", "b");
    let p = provisions(&a);
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("c", "h2"));
}

#[test]
fn least_loaded_host_first_ties_by_name() {
    let mut h = H::new(&static_pairs(&[("h-b", 2), ("h-a", 2), ("h-c", 4)]));
    let mut hosts = Vec::new();
    for i in 0..8 {
        let a = h.submit("ns", &format!("t{i}"), P);
        hosts.push(provisions(&a)[0].2.clone());
    }
    // Ratio order: all empty → by name; then h-c (1/4) beats h-a (1/2)...
    assert_eq!(
        hosts,
        vec!["h-a", "h-b", "h-c", "h-c", "h-a", "h-b", "h-c", "h-c"]
    );
    let a = h.submit("ns", "t8", P);
    assert!(provisions(&a).is_empty(), "all 8 slots taken");
}

#[test]
fn failed_host_is_skipped_and_recorded_then_all_failed_gives_an_error_secret() {
    let mut h = H::new(&static_pairs(&[("h1", 2), ("h2", 2)]));
    let a = h.submit("ns", "a", P);
    let op = provision_op(&a, "a");
    assert_eq!(provisions(&a)[0].2, "h1");
    let a = h.send(Event::ProvisionFailed {
        op,
        error: "connection refused".into(),
        blame: Blame::Host,
    });
    // Partial user removed on h1; re-allocated on h2 with the failure recorded.
    assert_eq!(deprovisions(&a)[0].2, "h1");
    let p = provisions(&a);
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].2, "h2");
    let rec = records(&a, "a");
    assert_eq!(rec.last().unwrap().failed_hosts.as_deref(), Some("h1"));
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Observe(Observation::ProvisionFailed(_))))
    );
    let a = h.send(Event::ProvisionFailed {
        op: p[0].0,
        error: "disk full".into(),
        blame: Blame::Host,
    });
    let msg = error_of(&a, "a");
    assert!(msg.contains("h1: connection refused"), "{msg}");
    assert!(msg.contains("h2: disk full"), "{msg}");
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Observe(Observation::AllocationFailed(_))))
    );
    // Both slots are free again.
    assert_eq!(h.s.gauges().platforms[P].running, 0);
}

#[test]
fn failed_host_slot_goes_to_the_next_waiter_while_the_failed_taskrun_waits_elsewhere() {
    let mut h = H::new(&static_pairs(&[("h1", 1), ("h2", 1)]));
    let op_a = provision_op(&h.submit("ns", "a", P), "a");
    let _b = h.submit("ns", "b", P);
    let a = h.submit("ns", "c", P);
    assert!(provisions(&a).is_empty());
    // a fails on h1: a may not use h1 again, h2 is busy; c (next in line) gets h1.
    let a = h.send(Event::ProvisionFailed {
        op: op_a,
        error: "boom".into(),
        blame: Blame::Host,
    });
    let p = provisions(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("c", "h1"));
    // When b frees h2, a (retry lane, served first) gets it.
    let a = h.done("ns", "b");
    let p = provisions(&a);
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("a", "h2"));
}

#[test]
fn host_backs_off_after_repeated_failures_and_returns() {
    let mut h = H::new(&static_pairs(&[("h1", 4), ("h2", 1)]));
    let mut ops = Vec::new();
    let a = h.submit("ns", "x", P);
    assert_eq!(provisions(&a)[0].2, "h1");
    ops.push(provision_op(&a, "x"));
    // "busy" takes h2 (empty beats 1/4 loaded) and keeps it.
    assert_eq!(provisions(&h.submit("ns", "busy", P))[0].2, "h2");
    for name in ["f0", "f1"] {
        let a = h.submit("ns", name, P);
        assert_eq!(provisions(&a)[0].2, "h1");
        ops.push(provision_op(&a, name));
    }
    let mut notes = Vec::new();
    for op in ops {
        let a = h.send(Event::ProvisionFailed {
            op,
            error: "refused".into(),
            blame: Blame::Host,
        });
        notes.push(a.iter().any(|x| {
            matches!(
                x,
                Action::Notify {
                    reason: "HostBackedOff",
                    ..
                }
            )
        }));
    }
    assert_eq!(
        notes,
        vec![false, false, true],
        "trips on the third failure in a row"
    );
    // New work does not go to h1 while it backs off (h2 is full): it waits.
    let a = h.submit("ns", "n1", P);
    assert!(provisions(&a).is_empty(), "{a:#?}");
    assert!(h.wait(59).is_empty());
    // After the back-off (60 s) h1 takes work again; the TaskRuns that failed there do not.
    let a = h.wait(2);
    let p = provisions(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("n1", "h1"));
}

#[test]
fn cancel_while_provisioning_removes_the_user_when_the_result_arrives() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let op = provision_op(&h.submit("ns", "a", P), "a");
    let a = h.submit("ns", "b", P);
    assert!(provisions(&a).is_empty());
    let a = h.done("ns", "a");
    // Slot handed to b at once; a waits for its provisioning result before the finalizer goes.
    assert_eq!(provisions(&a)[0].1, "b");
    assert!(finalized(&a).is_empty());
    let a = h.send(Event::Provisioned {
        op,
        otp: "late".into(),
    });
    assert!(
        secret(&a, "a").is_none(),
        "no secret for a finished TaskRun"
    );
    let d = deprovisions(&a);
    assert_eq!(d.len(), 1);
    let a = h.send(Event::Deprovisioned {
        op: d[0].0,
        error: None,
    });
    assert_eq!(finalized(&a), vec!["a"]);
}

#[test]
fn duplicate_and_bogus_events_change_nothing() {
    let mut h = H::new(&static_pairs(&[("h1", 2)]));
    let a = h.submit("ns", "a", P);
    let op = provision_op(&a, "a");
    assert!(h.submit("ns", "a", P).is_empty(), "duplicate TaskRun event");
    let a = h.send(Event::Provisioned {
        op,
        otp: "t1".into(),
    });
    assert!(secret(&a, "a").is_some());
    for e in [
        Event::Provisioned {
            op,
            otp: "t2".into(),
        },
        Event::ProvisionFailed {
            op,
            error: "x".into(),
            blame: Blame::Host,
        },
        Event::Launched {
            op,
            instance_id: "i-1".into(),
        },
        Event::Terminated {
            op: OpId(9999),
            error: None,
        },
    ] {
        assert!(h.send(e).is_empty());
    }
    let a = h.done("ns", "a");
    let d = deprovisions(&a)[0].0;
    assert!(h.done("ns", "a").is_empty(), "duplicate done");
    assert_eq!(
        finalized(&h.send(Event::Deprovisioned { op: d, error: None })),
        vec!["a"]
    );
    assert!(h.done("ns", "a").is_empty(), "done after cleanup");
    assert!(
        h.submit("ns", "a", P).is_empty(),
        "late create event after done"
    );
}

#[test]
fn recreated_taskrun_with_the_same_name_is_a_new_allocation() {
    let mut h = H::new(&static_pairs(&[("h1", 2)]));
    let op1 = provision_op(&h.submit("ns", "a", P), "a");
    h.send(Event::Provisioned {
        op: op1,
        otp: "t".into(),
    });
    let a = h.done("ns", "a");
    let d = deprovisions(&a)[0].0;
    let mut spec = H::spec("ns", "a", P);
    spec.uid = "uid-second".into();
    // Same name, same user: it waits for the old one's user to be removed from the host.
    let a = h.send(Event::TaskRun(spec));
    assert!(provisions(&a).is_empty(), "{a:#?}");
    // The old one's cleanup completes, names the old UID, and the new one gets the host.
    let a = h.send(Event::Deprovisioned { op: d, error: None });
    let finalized: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            Action::RemoveFinalizer { taskrun, .. } => Some(taskrun.uid().clone()),
            _ => None,
        })
        .collect();
    assert_eq!(finalized, [Uid::new("uid-ns-a")]);
    let op2 = provision_op(&a, "a");
    assert_ne!(op1, op2);
    assert_eq!(h.s.gauges().platforms[P].running, 1);
}

/// TaskRun `a` got its key (`first`) on a host, then its first attempt failed and Tekton started
/// the retry: the retry's spec and what the scheduler did on seeing it.
fn retried(h: &mut H) -> (TaskRunSpec, Vec<Action>) {
    let op = provision_op(&h.submit("ns", "a", P), "a");
    h.send(Event::Provisioned {
        op,
        otp: "first".into(),
    });
    let mut spec = H::spec("ns", "a", P);
    spec.retries = 1;
    let a = h.send(Event::TaskRun(spec.clone()));
    (spec, a)
}

#[test]
fn retry_attempt_rearms_the_token_its_pod_already_mounted() {
    let mut h = H::new(&static_pairs(&[("h1", 2)]));
    let (spec, a) = retried(&mut h);
    // The retry's pod already mounted the secret: it is kept, and the new key re-arms its token.
    assert!(
        !a.iter().any(|x| matches!(x, Action::DeleteSecret { .. })),
        "{a:#?}"
    );
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Provision { rearm: true, .. })),
        "{a:#?}"
    );
    let op2 = provision_op(&a, "a");
    assert_eq!(provisions(&a)[0].2, "h1", "same host");
    let a = h.send(Event::Provisioned {
        op: op2,
        otp: "second".into(),
    });
    assert!(matches!(secret(&a, "a"), Some(SecretData::Remote { otp, .. }) if otp == "second"));
    // The same attempt seen again does nothing.
    assert!(h.send(Event::TaskRun(spec)).is_empty());
    assert_eq!(h.s.gauges().platforms[P].running, 1, "still one slot");
}

#[test]
fn a_retry_that_ends_while_its_key_is_re_armed_still_loses_its_secret() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let (_, a) = retried(&mut h);
    let op2 = provision_op(&a, "a");
    // The retry fails before the re-provisioning is through (the OTP server was down).
    let a = h.done("ns", "a");
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::DeleteSecret { taskrun } if taskrun.name() == "a")),
        "{a:#?}"
    );
    let a = h.send(Event::Provisioned {
        op: op2,
        otp: "second".into(),
    });
    assert!(
        secret(&a, "a").is_none(),
        "no secret written for an ended TaskRun"
    );
    let d = deprovisions(&a)[0].0;
    let a = h.send(Event::Deprovisioned { op: d, error: None });
    assert_eq!(finalized(&a), vec!["a"]);
}

/// Found by the chaos soak: a retry's re-provisioning failed because its host was down for a
/// few seconds, and the TaskRun moved to another host at once while the secret its pod had
/// mounted still named the first one (and its token was never re-armed). Now the host the pod
/// was pointed at is tried again with a back-off, keeping the slot.
#[test]
fn a_retrys_re_provisioning_tries_its_host_again_before_moving() {
    let mut h = H::new(&static_pairs(&[("h1", 1), ("h2", 1)]));
    let (_, a) = retried(&mut h);
    let on = provisions(&a)[0].2.clone();
    let mut op = provision_op(&a, "a");
    // Down twice, back the third time: same host, same token, the secret kept all along.
    for _ in 0..2 {
        let a = h.send(Event::ProvisionFailed {
            op,
            error: "connection refused".into(),
            blame: Blame::Host,
        });
        assert!(provisions(&a).is_empty(), "not at once: {a:#?}");
        assert!(records(&a, "a").is_empty(), "no new placement: {a:#?}");
        assert!(
            !a.iter().any(|x| matches!(x, Action::DeleteSecret { .. })),
            "{a:#?}"
        );
        let a = h.wait(Policy::mpc().rearm_backoff.as_secs() * 4);
        assert_eq!(provisions(&a)[0].2, on, "the same host: {a:#?}");
        assert!(
            a.iter()
                .any(|x| matches!(x, Action::Provision { rearm: true, .. })),
            "{a:#?}"
        );
        op = provision_op(&a, "a");
    }
    // Meanwhile the other host takes new work (the slot stays the retry's).
    let b = h.submit("ns", "b", P);
    assert_ne!(provisions(&b)[0].2, on);
    let a = h.send(Event::Provisioned {
        op,
        otp: "first".into(),
    });
    assert!(matches!(secret(&a, "a"), Some(SecretData::Remote { host, .. }) if host.name() == on));
}

#[test]
fn a_retrys_re_provisioning_moves_with_a_new_secret_once_its_host_stays_down() {
    let mut h = H::new(&static_pairs(&[("h1", 1), ("h2", 1)]));
    let (_, a) = retried(&mut h);
    let on = provisions(&a)[0].2.clone();
    let mut op = provision_op(&a, "a");
    for n in 1..=Policy::mpc().rearm_attempts {
        let a = h.send(Event::ProvisionFailed {
            op,
            error: "connection refused".into(),
            blame: Blame::Host,
        });
        if n == Policy::mpc().rearm_attempts {
            // The secret naming the dead host goes before the new placement is recorded.
            let del = a
                .iter()
                .position(|x| matches!(x, Action::DeleteSecret { .. }))
                .expect("secret deleted");
            let rec = a
                .iter()
                .position(|x| matches!(x, Action::Record { .. }))
                .expect("placed elsewhere");
            assert!(del < rec, "{a:#?}");
            let p = provisions(&a);
            assert_ne!(p[0].2, on);
            assert!(
                a.iter()
                    .any(|x| matches!(x, Action::Provision { rearm: false, .. })),
                "a fresh token elsewhere: {a:#?}"
            );
            let a = h.send(Event::Provisioned {
                op: p[0].0,
                otp: "fresh".into(),
            });
            assert!(
                matches!(secret(&a, "a"), Some(SecretData::Remote { host, .. }) if host.name() != on)
            );
            return;
        }
        op = provision_op(&h.wait(60), "a");
    }
    unreachable!("moved at the last try");
}

#[test]
fn deprovision_failures_are_retried_then_reported_and_the_finalizer_released() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let op = provision_op(&h.submit("ns", "a", P), "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    let mut d = deprovisions(&h.done("ns", "a"))[0].0;
    let mut attempts = 1;
    loop {
        let a = h.send(Event::Deprovisioned {
            op: d,
            error: Some("host unreachable".into()),
        });
        if !finalized(&a).is_empty() {
            assert!(
                a.iter()
                    .any(|x| matches!(x, Action::Observe(Observation::CleanupFailed(_))))
            );
            break;
        }
        assert!(
            deprovisions(&a).is_empty(),
            "retried after a delay, not at once"
        );
        let a = h.wait(400);
        d = deprovisions(&a)[0].0;
        attempts += 1;
    }
    assert_eq!(attempts, Policy::mpc().cleanup_attempts);
}

#[test]
fn config_change_mid_flight_keeps_the_allocation_definition() {
    let mut h = H::new(&static_pairs(&[("h1", 2)]));
    let op = provision_op(&h.submit("ns", "a", P), "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    // h1 moves to another address and its concurrency drops to 1; a new host h2 appears.
    let mut pairs = static_pairs(&[("h1", 1), ("h2", 1)]);
    for (k, v) in &mut pairs {
        if k == "host.h1.address" {
            *v = "10.9.9.9".into();
        }
    }
    h.send(Event::ConfigReplaced(Box::new(config(&pairs))));
    // h1 is full (1 of 1) under the new config, so new work goes to h2.
    let a = h.submit("ns", "b", P);
    assert_eq!(provisions(&a)[0].2, "h2");
    // a's cleanup goes to the address it was provisioned on.
    let a = h.done("ns", "a");
    let host = a.iter().find_map(|x| match x {
        Action::Deprovision { host, .. } => Some(host.address().to_owned()),
        _ => None,
    });
    assert_eq!(host.as_deref(), Some("10.0.0.1"));
    // The host is removed from the config entirely: waiters go elsewhere, nothing breaks.
    h.send(Event::ConfigReplaced(Box::new(config(&static_pairs(&[(
        "h2", 2,
    )])))));
    let a = h.submit("ns", "c", P);
    assert_eq!(provisions(&a)[0].2, "h2");
}

#[test]
fn namespaces_are_served_round_robin_fifo_within() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let first = provision_op(&h.submit("busy", "x", P), "x");
    for i in 0..3 {
        h.submit("burst", &format!("b{i}"), P);
    }
    h.submit("quiet", "q0", P);
    let _ = first;
    let mut order = Vec::new();
    let mut current = ("busy".to_owned(), "x".to_owned());
    for _ in 0..4 {
        let a = h.done(&current.0, &current.1);
        let p = provisions(&a);
        let name = p[0].1.clone();
        let ns = if name.starts_with('q') {
            "quiet"
        } else {
            "burst"
        };
        order.push(name.clone());
        current = (ns.to_owned(), name);
    }
    assert_eq!(order, vec!["b0", "q0", "b1", "b2"]);
}

fn listed(name: &str, age: Option<Duration>) -> crate::scheduler::HostUser {
    crate::scheduler::HostUser {
        name: name.to_owned(),
        age,
    }
}

#[test]
fn host_sweep_removes_only_unowned_users_past_the_grace_period() {
    let mut h = H::new(&static_pairs(&[("h1", 2)]));
    let op = provision_op(&h.submit("ns", "a", P), "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    let grace = Policy::mpc().host_user_grace;
    assert_eq!(
        grace,
        Duration::from_secs(24 * 60 * 60),
        "Go's host cleanup waits a day"
    );
    let old = Some(grace + Duration::from_secs(1));
    let owned = crate::contract::remote_user_name("a", "ns");
    let stale = crate::contract::remote_user_name("gone", "ns");
    let young = crate::contract::remote_user_name("go-made", "ns");
    let unknown = crate::contract::remote_user_name("no-home", "ns");
    let a = h.send(Event::HostUsersListed {
        host: "h1".into(),
        users: vec![
            listed(&owned, old),
            listed(&stale, Some(grace)),
            listed(&young, Some(grace - Duration::from_secs(1))),
            listed(&unknown, None),
            // Not our shape: never touched, however old.
            listed("u-stale0123", old),
            listed("root", old),
        ],
    });
    let d = deprovisions(&a);
    assert_eq!(d.len(), 1, "{d:?}");
    assert_eq!((d[0].1.as_str(), d[0].2.as_str()), (stale.as_str(), "h1"));
}

#[test]
fn operation_table_gives_memory_back_after_a_burst() {
    let names: Vec<String> = (0..640).map(|i| format!("h{i}")).collect();
    let hosts: Vec<(&str, u32)> = names.iter().map(|n| (n.as_str(), 8)).collect();
    let mut h = H::new(&static_pairs(&hosts));
    h.check = false;
    let mut ops = Vec::new();
    for i in 0..5000 {
        let a = h.submit("ns", &format!("t{i}"), "linux/s390x");
        ops.extend(provisions(&a).into_iter().map(|p| p.0));
    }
    assert_eq!(ops.len(), 5000, "every TaskRun placed at once");
    let peak = h.s.ops.capacity();
    assert!(peak >= 5000);
    for op in ops {
        h.send(Event::Provisioned {
            op,
            otp: "t".into(),
        });
    }
    assert_eq!(h.s.ops.len(), 0);
    h.s.check().expect("consistent after the burst");
    assert!(
        h.s.ops.capacity() * 8 <= peak,
        "{} of {peak}",
        h.s.ops.capacity()
    );
}
