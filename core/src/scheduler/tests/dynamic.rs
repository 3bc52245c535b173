//! Dynamic platforms: one instance per TaskRun.

use super::*;

const P: &str = "linux/arm64";

fn ready_taskrun(h: &mut H, name: &str, id: &str) -> OpId {
    let a = h.submit("ns", name, P);
    let l = launches(&a);
    assert_eq!(l.len(), 1, "{a:#?}");
    assert_eq!(l[0].1.as_deref(), Some(format!("ns:{name}").as_str()));
    let a = boot(h, l[0].0, id);
    provision_op(&a, name)
}

/// A platform checked every few seconds is first probed after its check-interval, not the
/// default 20 s: the build waits for the probe that finds the instance up.
#[test]
fn a_short_check_interval_brings_the_first_probe_forward() {
    let mut pairs = dynamic_pairs(2, None);
    pairs.push(kv("dynamic.linux-arm64.check-interval", "2"));
    let mut h = H::new(&pairs);
    let a = h.submit("ns", "a", P);
    let (op, _) = launches(&a)[0].clone();
    h.send(Event::Launched {
        op,
        instance_id: "i-1".into(),
    });
    assert!(probes(&h.wait(1)).is_empty());
    assert_eq!(
        probes(&h.wait(1)).len(),
        1,
        "first probe at the 2 s check-interval"
    );
}

#[test]
fn launches_probes_provisions_and_terminates() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let a = h.submit("ns", "a", P);
    let (op, _) = launches(&a)[0].clone();
    let (_, id) = launch_ids(&a)[0].clone();
    assert_eq!(
        (id.owner_key().as_str(), id.retry, id.attempt),
        ("uid-ns-a", 0, 1)
    );
    let a = h.send(Event::Launched {
        op,
        instance_id: "i-1".into(),
    });
    let rec = records(&a, "a");
    assert_eq!(rec[0].instance_id.as_deref(), Some("i-1"));
    assert_eq!(rec[0].assigned_host.as_deref(), Some("i-1"));
    // First probe after 20 s, then every 5 s while pending.
    assert!(probes(&h.wait(19)).is_empty());
    let p = probes(&h.wait(1));
    assert_eq!(p.len(), 1);
    assert!(
        h.send(Event::Probed {
            op: p[0].0,
            result: ProbeResult::Pending
        })
        .is_empty()
    );
    let p = probes(&h.wait(5));
    let a = h.send(Event::Probed {
        op: p[0].0,
        result: ProbeResult::Reachable {
            address: "192.0.2.7".into(),
        },
    });
    let rec = records(&a, "a");
    assert_eq!(rec[0].instance_address.as_deref(), Some("192.0.2.7"));
    let op = provision_op(&a, "a");
    let a = h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    assert!(
        written(&a, "a")
            .and_then(|(taskrun, s)| s.login(taskrun))
            .is_some_and(|h| h.ends_with("@192.0.2.7"))
    );
    let a = h.done("ns", "a");
    let t = terminates(&a);
    assert_eq!(t[0].1, "i-1");
    assert!(
        deprovisions(&a).is_empty(),
        "the instance goes away with its user"
    );
    assert!(finalized(&a).is_empty());
    assert_eq!(
        finalized(&h.send(Event::Terminated {
            op: t[0].0,
            error: None
        })),
        vec!["a"]
    );
    assert_eq!(h.s.gauges().platforms[P].instances, 0);
}

#[test]
fn max_instances_counts_booting_and_terminating_instances() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let op = ready_taskrun(&mut h, "a", "i-1");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    let a = h.submit("ns", "b", P);
    assert!(launches(&a).is_empty());
    assert_eq!(
        records(&a, "b")[0].waiting_for_platform.as_deref(),
        Some("linux-arm64")
    );
    // a finishes: its instance still counts until termination is acknowledged.
    let t = terminates(&h.done("ns", "a"))[0].0;
    let a = h.send(Event::Terminated { op: t, error: None });
    assert_eq!(launches(&a).len(), 1, "b launches in the same step");
    assert_eq!(finalized(&a), vec!["a"]);
}

#[test]
fn an_instance_running_with_an_address_is_probed_every_second_until_ssh_answers() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let p = probes(&h.wait(20))[0].0;
    // Not running yet: the next probe in 5 s.
    h.send(Event::Probed {
        op: p,
        result: ProbeResult::Pending,
    });
    assert!(probes(&h.wait(4)).is_empty());
    let p = probes(&h.wait(1))[0].0;
    // Running with an address, its SSH daemon not up yet: every second.
    h.send(Event::Probed {
        op: p,
        result: ProbeResult::Booting {
            address: "192.0.2.1".into(),
        },
    });
    let p = probes(&h.wait(1))[0].0;
    let a = h.send(Event::Probed {
        op: p,
        result: ProbeResult::Reachable {
            address: "192.0.2.1".into(),
        },
    });
    assert!(
        a.iter().any(|x| matches!(x, Action::Provision { .. })),
        "{a:?}"
    );
}

#[test]
fn allocation_timeout_gives_an_error_secret_and_terminates() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let mut last = Vec::new();
    for _ in 0..200 {
        let a = h.wait(5);
        for (op, _) in probes(&a) {
            h.send(Event::Probed {
                op,
                result: ProbeResult::Booting {
                    address: "192.0.2.1".into(),
                },
            });
        }
        if secret(&a, "a").is_some() {
            last = a;
            break;
        }
    }
    let msg = error_of(&last, "a");
    assert!(msg.contains("600 s") && msg.contains("i-1"), "{msg}");
    assert_eq!(terminates(&last)[0].1, "i-1");
}

#[test]
fn failed_instance_is_replaced_up_to_a_bound_then_an_error_secret() {
    let mut h = H::new(&dynamic_pairs(3, None));
    let mut l = launches(&h.submit("ns", "a", P))[0].0;
    for n in 1..=3 {
        let id = format!("i-{n}");
        h.send(Event::Launched {
            op: l,
            instance_id: id.clone(),
        });
        let p = probes(&h.wait(20))[0].0;
        let a = h.send(Event::Probed {
            op: p,
            result: ProbeResult::Failed {
                reason: "instance-status check failed".into(),
            },
        });
        assert_eq!(terminates(&a)[0].1, id);
        if n < 3 {
            let next = launches(&a);
            assert_eq!(next.len(), 1, "fresh instance #{n}: {a:#?}");
            l = next[0].0;
        } else {
            let msg = error_of(&a, "a");
            assert!(msg.contains("3 attempt"), "{msg}");
        }
    }
}

#[test]
fn provisioning_failure_relaunches_a_fresh_instance() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let op = ready_taskrun(&mut h, "a", "i-1");
    let a = h.send(Event::ProvisionFailed {
        op,
        error: "ssh: handshake failed".into(),
        blame: Blame::Host,
    });
    let t = terminates(&a);
    assert_eq!(t[0].1, "i-1");
    assert!(
        launches(&a).is_empty(),
        "max-instances 1: wait for the termination"
    );
    let a = h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    });
    assert_eq!(launches(&a).len(), 1);
    let a = boot(&mut h, launches(&a)[0].0, "i-2");
    assert_eq!(records(&a, "a")[0].failed_hosts.as_deref(), Some("i-1"));
}

#[test]
fn launch_retries_back_off_then_an_error_secret() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let mut l = launches(&h.submit("ns", "a", P))[0].0;
    let mut gaps = Vec::new();
    let last = loop {
        let a = h.send(Event::LaunchFailed {
            op: l,
            error: "InsufficientInstanceCapacity".into(),
            retryable: true,
        });
        if secret(&a, "a").is_some() {
            break a;
        }
        let mut waited = 0;
        loop {
            waited += 1;
            let a = h.wait(1);
            if let Some(x) = launches(&a).first() {
                l = x.0;
                break;
            }
        }
        gaps.push(waited);
    };
    assert_eq!(gaps, vec![10, 20, 40, 80]);
    let msg = error_of(&last, "a");
    assert!(
        msg.contains("5 attempt") && msg.contains("InsufficientInstanceCapacity"),
        "{msg}"
    );
    assert_eq!(h.s.gauges().platforms[P].instances, 0);
}

#[test]
fn non_retryable_launch_error_fails_at_once() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    let a = h.send(Event::LaunchFailed {
        op: l,
        error: "InvalidAMIID.NotFound".into(),
        retryable: false,
    });
    assert!(error_of(&a, "a").contains("configuration looks wrong"));
}

#[test]
fn delete_mid_launch_terminates_when_the_launch_result_arrives() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    let a = h.done("ns", "a");
    assert!(finalized(&a).is_empty(), "held until the instance is gone");
    let a = h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let t = terminates(&a);
    assert_eq!(t[0].1, "i-1");
    assert_eq!(
        finalized(&h.send(Event::Terminated {
            op: t[0].0,
            error: None
        })),
        vec!["a"]
    );
}

#[test]
fn instance_of_a_cancelled_taskrun_is_adopted_by_a_waiter() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    assert!(launches(&h.submit("ns", "b", P)).is_empty());
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let a = h.done("ns", "a");
    assert_eq!(finalized(&a), vec!["a"]);
    assert!(terminates(&a).is_empty());
    assert!(
        a.iter()
            .any(|x| matches!(x, Action::Retag { launch, .. } if launch.owner_key() == "uid-ns-b" && launch.taskrun_id() == "ns:b"))
    );
    assert_eq!(records(&a, "b")[0].instance_id.as_deref(), Some("i-1"));
    let p = probes(&h.wait(20))[0].0;
    let a = h.send(Event::Probed {
        op: p,
        result: ProbeResult::Reachable {
            address: "192.0.2.1".into(),
        },
    });
    provision_op(&a, "b");
}

#[test]
fn used_instances_are_never_adopted() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let op = ready_taskrun(&mut h, "a", "i-1");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    h.submit("ns", "b", P);
    let a = h.done("ns", "a");
    assert_eq!(terminates(&a)[0].1, "i-1");
    assert!(!a.iter().any(|x| matches!(x, Action::Retag { .. })));
}

#[test]
fn vanished_instance_while_booting_is_replaced() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let a = h.send(Event::InstanceGone {
        instance_id: "i-1".into(),
    });
    assert!(terminates(&a).is_empty());
    assert_eq!(launches(&a).len(), 1);
    assert_eq!(h.s.gauges().platforms[P].instances, 1);
}

#[test]
fn go_policy_polls_on_its_own_timing() {
    let mut h = H::with_policy(&dynamic_pairs(1, None), Policy::mpc_go());
    let l = launches(&h.submit("ns", "a", P))[0].0;
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    assert!(probes(&h.wait(119)).is_empty());
    let p = probes(&h.wait(1))[0].0;
    h.send(Event::Probed {
        op: p,
        result: ProbeResult::Pending,
    });
    assert!(probes(&h.wait(59)).is_empty());
    assert_eq!(probes(&h.wait(1)).len(), 1);
    // A waiter polls every minute instead of being handed the slot.
    assert!(launches(&h.submit("ns", "b", P)).is_empty());
}

/// Sends a refusal for the termination `op`, then waits until the retry's termination goes out.
fn refuse_termination(h: &mut H, op: OpId) -> (Vec<Action>, Option<OpId>) {
    let refused = h.send(Event::Terminated {
        op,
        error: Some("RequestLimitExceeded".into()),
    });
    for _ in 0..400 {
        if let Some(t) = terminates(&h.wait(1)).first() {
            return (refused, Some(t.0));
        }
    }
    (refused, None)
}

/// A TaskRun whose launch timed out, done, its instance being terminated: (termination op).
fn timed_out_and_done(h: &mut H) -> OpId {
    let l = launches(&h.submit("ns", "a", P))[0].0;
    // The deadline passes while the launch is in flight: the result brings the error.
    h.wait(600);
    let a = h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    assert!(error_of(&a, "a").contains("600 s"));
    let t = terminates(&a);
    assert_eq!(t[0].1, "i-1");
    let a = h.done("ns", "a");
    assert!(
        finalized(&a).is_empty(),
        "the instance launched for it is not terminated yet: {a:#?}"
    );
    t[0].0
}

#[test]
fn a_timed_out_taskrun_keeps_its_finalizer_until_its_instance_is_terminated() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let t = timed_out_and_done(&mut h);
    let (a, retry) = refuse_termination(&mut h, t);
    assert!(finalized(&a).is_empty(), "{a:#?}");
    let a = h.send(Event::Terminated {
        op: retry.expect("termination retried"),
        error: None,
    });
    assert_eq!(finalized(&a), vec!["a"]);
    assert_eq!(h.s.gauges().platforms[P].instances, 0);
}

#[test]
fn a_timed_out_taskrun_is_finalized_when_its_instance_is_given_up_as_leaked() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let mut op = timed_out_and_done(&mut h);
    // The fifth refusal gives the instance up: it no longer holds the finalizer.
    for n in 1..=5 {
        let (a, retry) = refuse_termination(&mut h, op);
        if n < 5 {
            assert!(finalized(&a).is_empty(), "refusal {n}: {a:#?}");
        } else {
            assert_eq!(finalized(&a), vec!["a"]);
            assert!(a.iter().any(|x| matches!(x,
                Action::Notify { taskrun: Some(t), reason: "CleanupFailed", .. } if t.name() == "a")));
        }
        op = retry.expect("termination retried");
    }
}

#[test]
fn a_taskrun_moved_off_a_failed_instance_keeps_its_finalizer_until_that_instance_is_terminated() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let op = ready_taskrun(&mut h, "a", "i-1");
    let a = h.send(Event::ProvisionFailed {
        op,
        error: "ssh: handshake failed".into(),
        blame: Blame::Host,
    });
    let t = terminates(&a);
    assert_eq!(t[0].1, "i-1");
    // Waiting for room for a fresh instance, it finishes.
    let a = h.done("ns", "a");
    assert!(finalized(&a).is_empty(), "i-1 was launched for it: {a:#?}");
    let a = h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    });
    assert_eq!(finalized(&a), vec!["a"]);
    assert!(launches(&a).is_empty(), "{a:#?}");
}

#[test]
fn an_instance_launched_for_a_finished_taskrun_goes_to_a_waiter_and_frees_the_first() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    assert!(finalized(&h.done("ns", "a")).is_empty());
    assert!(
        launches(&h.submit("ns", "b", P)).is_empty(),
        "max-instances 1"
    );
    let a = h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    assert!(terminates(&a).is_empty(), "{a:#?}");
    assert_eq!(records(&a, "b")[0].instance_id.as_deref(), Some("i-1"));
    assert_eq!(finalized(&a), vec!["a"]);
}
