//! Cluster ownership, the shared `max-instances` bill guard, and the launch identity.

use super::recovery::{instance, rec, start};
use super::*;

const P: &str = "linux/arm64";

fn arm64() -> Platform {
    Platform::parse(P).unwrap()
}

/// A live instance with the platform's tag, launched by `ownership` (ours: for `label`).
fn listed(id: &str, ownership: Ownership, label: Option<&str>, age_s: u64) -> InstanceRecord {
    InstanceRecord {
        ownership,
        platform_label: label.map(str::to_owned),
        owner: None,
        ..instance(id, None, START - age_s)
    }
}

fn listing(instances: Vec<InstanceRecord>) -> Event {
    Event::InstancesListed {
        platform: arm64(),
        instances,
    }
}

fn foreign(h: &H) -> u32 {
    h.s.gauges().platforms[P].foreign
}

#[test]
fn instances_others_run_reduce_headroom_until_a_listing_shows_them_gone() {
    let mut h = H::new(&dynamic_pairs(4, None));
    let theirs = |id| listed(id, Ownership::Foreign, Some("linux-arm64"), 60);
    let a = h.send(listing(vec![
        theirs("i-p02-1"),
        theirs("i-p02-2"),
        listed("i-go", Ownership::Untagged, None, 60),
        // Ours, of another platform sharing the tag: the same bill.
        listed("i-amd", Ownership::Ours, Some("linux-amd64"), 60),
        // Not counted: stopped (ours not tracked yet: see `faults`).
        InstanceRecord {
            state: InstanceState::Stopped,
            ..theirs("i-p02-stopped")
        },
    ]));
    assert!(terminates(&a).is_empty(), "{a:#?}");
    assert_eq!(foreign(&h), 4);
    let a = h.submit("ns", "a", P);
    assert!(launches(&a).is_empty(), "no room: 0 ours + 4 others");
    assert_eq!(
        records(&a, "a")[0].waiting_for_platform.as_deref(),
        Some("linux-arm64")
    );
    // Two of theirs are gone at the next listing: the waiter launches in the same step.
    let a = h.send(listing(vec![
        theirs("i-p02-1"),
        listed("i-go", Ownership::Untagged, None, 60),
    ]));
    assert_eq!(foreign(&h), 2);
    assert_eq!(launches(&a).len(), 1, "{a:#?}");
    assert_eq!(launches(&h.submit("ns", "b", P)).len(), 1);
    assert!(
        launches(&h.submit("ns", "c", P)).is_empty(),
        "2 ours + 2 others"
    );
}

#[test]
fn listings_orphan_only_this_clusters_instances_of_the_platform() {
    let mut h = H::new(&dynamic_pairs(9, None));
    let old = 3600;
    let a = h.send(listing(vec![
        listed("i-theirs", Ownership::Foreign, Some("linux-arm64"), old),
        listed("i-go", Ownership::Untagged, None, old),
        listed("i-amd", Ownership::Ours, Some("linux-amd64"), old),
        listed("i-mine", Ownership::Ours, Some("linux-arm64"), old),
        InstanceRecord {
            state: InstanceState::Stopped,
            ..listed("i-mine-stopped", Ownership::Ours, Some("linux-arm64"), old)
        },
        InstanceRecord {
            state: InstanceState::Stopped,
            ..listed(
                "i-theirs-stopped",
                Ownership::Foreign,
                Some("linux-arm64"),
                old,
            )
        },
    ]));
    let mut t: Vec<String> = terminates(&a).into_iter().map(|t| t.1).collect();
    t.sort();
    assert_eq!(t, ["i-mine", "i-mine-stopped"]);
    assert!(
        a.iter()
            .all(|x| !matches!(x, Action::Terminate { legacy: true, .. }))
    );
    assert_eq!(foreign(&h), 3, "theirs, Go's and the other platform's");
}

#[test]
fn recovery_adopts_a_named_go_instance_but_never_another_clusters() {
    let mut go = rec("a", P);
    go.instance_id = Some("i-go".into());
    go.assigned_host = Some("i-go".into());
    go.secret = Some(SecretKind::Remote);
    let mut theirs = rec("b", P);
    theirs.instance_id = Some("i-theirs".into());
    theirs.assigned_host = Some("i-theirs".into());
    let (mut h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![go, theirs],
            instances: vec![
                // Go tags its instances `taskRunID=<namespace>:<name>`.
                InstanceRecord {
                    taskrun_id: Some("ns:a".into()),
                    ..listed("i-go", Ownership::Untagged, None, 600)
                },
                InstanceRecord {
                    owner: Some("uid-ns-b".into()),
                    ..listed("i-theirs", Ownership::Foreign, Some("linux-arm64"), 600)
                },
            ],
            ..Default::default()
        },
    );
    assert!(
        out.iter().any(|x| matches!(x, Action::Notify { reason: "ForeignInstance", taskrun: Some(t), .. } if t.name() == "b")),
        "{out:#?}"
    );
    assert!(terminates(&out).is_empty());
    assert!(launches(&out).is_empty(), "1 ours (i-go) + 1 theirs = 2");
    assert_eq!(foreign(&h), 1);
    let a = h.done("ns", "a");
    let t: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            Action::Terminate {
                op,
                instance_id,
                legacy,
                ..
            } => Some((*op, instance_id.to_string(), *legacy)),
            _ => None,
        })
        .collect();
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].1.as_str(), t[0].2), ("i-go", true));
    let a = h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    });
    assert_eq!(finalized(&a), ["a"]);
    assert_eq!(launches(&a).len(), 1, "b gets a fresh instance of ours");
}

#[test]
fn recovery_finds_an_unrecorded_launch_by_this_clusters_owner_tag_only() {
    let (h, out) = start(
        &dynamic_pairs(3, None),
        Snapshot {
            taskruns: vec![rec("a", P)],
            instances: vec![
                // Another cluster's instance cannot be a's, whatever its tags say.
                InstanceRecord {
                    owner: Some("uid-ns-a".into()),
                    ..listed("i-theirs", Ownership::Foreign, Some("linux-arm64"), 30)
                },
                instance("i-older", Some("uid-ns-a"), START - 50),
                instance("i-latest", Some("uid-ns-a"), START - 20),
            ],
            ..Default::default()
        },
    );
    assert!(launches(&out).is_empty(), "{out:#?}");
    assert_eq!(
        records(&out, "a")[0].instance_id.as_deref(),
        Some("i-latest")
    );
    // i-older is ours and unowned: an orphan once past the grace period (tracked meanwhile).
    assert_eq!(h.s.gauges().platforms[P].instances, 2);
    assert_eq!(foreign(&h), 1);
}

#[test]
fn a_restarted_controller_relaunches_with_the_crashed_ones_identity() {
    // The first process launches for a and crashes before the result.
    let mut h = H::new(&dynamic_pairs(2, None));
    let first = launch_ids(&h.submit("ns", "a", P))[0].1.clone();
    assert_eq!(
        (first.owner_key().as_str(), first.retry, first.attempt),
        ("uid-ns-a", 0, 1)
    );
    // The listing missed the instance (listings lag launches): the same launch again.
    let (mut h2, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![rec("a", P)],
            instances: vec![],
            ..Default::default()
        },
    );
    let (op, again) = launch_ids(&out)[0].clone();
    assert_eq!(again, first);

    // That process then sees i-1 fail and launches attempt 2.
    h2.send(Event::Launched {
        op,
        instance_id: "i-1".into(),
    });
    let p = probes(&h2.wait(20))[0].0;
    let a = h2.send(Event::Probed {
        op: p,
        result: ProbeResult::Failed {
            reason: "instance i-1 is stopped".into(),
        },
    });
    let second = launch_ids(&a)[0].1.clone();
    assert_eq!((second.retry, second.attempt), (0, 2));
    // Crash: the annotation names i-1 (gone) and failed-hosts was never written.
    let mut crashed = rec("a", P);
    crashed.instance_id = Some("i-1".into());
    crashed.assigned_host = Some("i-1".into());
    let (mut h3, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![crashed],
            instances: vec![InstanceRecord {
                state: InstanceState::ShuttingDown,
                ..instance("i-1", Some("uid-ns-a"), START - 60)
            }],
            ..Default::default()
        },
    );
    assert!(launches(&out).is_empty());
    let p = probes(&h3.wait(0))[0].0;
    let a = h3.send(Event::Probed {
        op: p,
        result: ProbeResult::Failed {
            reason: "instance i-1 is shutting-down".into(),
        },
    });
    assert_eq!(
        launch_ids(&a)[0].1,
        second,
        "the relaunch finds the crashed process's attempt 2"
    );
    // With failed-hosts written, the same identity straight away.
    let mut recorded = rec("a", P);
    recorded.failed_hosts = vec!["i-1".into()];
    let (_, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![recorded],
            instances: vec![],
            ..Default::default()
        },
    );
    assert_eq!(launch_ids(&out)[0].1, second);
}

#[test]
fn spent_attempts_count_as_failed_instances_and_move_on() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let (mut op, id) = launch_ids(&h.submit("ns", "a", P))[0].clone();
    assert_eq!(id.attempt, 1);
    let mut last = Vec::new();
    for n in 1..=3 {
        let a = h.send(Event::LaunchSpent {
            op,
            instance_id: format!("i-old-{n}"),
            state: InstanceState::Terminated,
        });
        assert!(
            terminates(&a).is_empty(),
            "a spent instance needs no termination"
        );
        match launch_ids(&a).first() {
            Some((next, l)) => {
                assert_eq!((l.retry, l.attempt), (0, n + 1));
                op = *next;
            }
            None => {
                last = a;
                break;
            }
        }
    }
    let msg = error_of(&last, "a");
    assert!(
        msg.contains("3 attempt") && msg.contains("i-old-3"),
        "{msg}"
    );
    assert_eq!(h.s.gauges().platforms[P].instances, 0);
    // Tekton retries the TaskRun: a new retry starts its own attempts.
    let mut spec = H::spec("ns", "a", P);
    spec.retries = 1;
    let a = h.send(Event::TaskRun(spec));
    let l = &launch_ids(&a)[0].1;
    assert_eq!((l.retry, l.attempt), (1, 1));
}

#[test]
fn the_same_instance_for_two_launches_is_a_failure_for_the_second_not_a_loop() {
    let mut h = H::new(&dynamic_pairs(3, None));
    let la = launch_ids(&h.submit("ns", "a", P))[0].0;
    let lb = launch_ids(&h.submit("ns", "b", P))[0].0;
    h.send(Event::Launched {
        op: la,
        instance_id: "i-1".into(),
    });
    let a = h.send(Event::Launched {
        op: lb,
        instance_id: "i-1".into(),
    });
    let next = launch_ids(&a);
    assert_eq!(next.len(), 1, "{a:#?}");
    assert_eq!(
        (next[0].1.owner_key().as_str(), next[0].1.attempt),
        ("uid-ns-b", 2)
    );
}

#[test]
fn an_instance_handed_over_during_its_launch_is_retagged_once_launched() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    assert!(launches(&h.submit("ns", "b", P)).is_empty());
    let a = h.done("ns", "a");
    assert_eq!(finalized(&a), ["a"]);
    assert!(!a.iter().any(|x| matches!(x, Action::Retag { .. })));
    let a = h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let retag: Vec<_> = a
        .iter()
        .filter_map(|x| match x {
            Action::Retag {
                instance_id,
                launch,
                ..
            } => Some((instance_id.to_string(), launch.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(retag.len(), 1, "{a:#?}");
    assert_eq!(retag[0].0, "i-1");
    assert_eq!(retag[0].1.owner_key(), "uid-ns-b");
    assert_eq!(records(&a, "b")[0].instance_id.as_deref(), Some("i-1"));
}

#[test]
fn a_stopped_instance_fails_its_taskrun_over_and_is_terminated() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let l = launches(&h.submit("ns", "a", P))[0].0;
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    let a = h.send(listing(vec![InstanceRecord {
        state: InstanceState::Stopped,
        ..instance("i-1", Some("uid-ns-a"), START)
    }]));
    assert_eq!(terminates(&a)[0].1, "i-1");
    let l = launch_ids(&a);
    assert_eq!(l.len(), 1, "a relaunches: {a:#?}");
    assert_eq!(l[0].1.attempt, 2);
}

#[test]
fn warm_pool_instances_have_warm_identities() {
    let mut pairs = dynamic_pairs(3, Some((2, 600)));
    pairs.push(kv("dynamic.linux-arm64.min-instances", "1"));
    let (mut h, out) = start(&pairs, Snapshot::default());
    let l = launch_ids(&out);
    assert_eq!(l.len(), 1);
    assert!(
        matches!(&l[0].1.owner, LaunchOwner::Warm(name) if name.starts_with("warm-")),
        "{:?}",
        l[0].1
    );
    // A TaskRun finding no room launches a pool instance under its own identity.
    h.submit("ns", "a", P);
    h.submit("ns", "b", P);
    let l = launch_ids(&h.submit("ns", "c", P));
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].1.owner_key(), "uid-ns-c");
}
