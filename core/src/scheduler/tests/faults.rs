//! Faults that must stay bounded: a released TaskRun that needs a host after all, a secret the
//! API server refuses, a terminate the cloud refuses, and instances of ours a listing shows
//! before anything here tracks them.

use std::collections::BTreeSet;

use super::recovery::instance;
use super::*;

const S390X: &str = "linux/s390x";
const ARM: &str = "linux/arm64";

fn release(h: &mut H, ns: &str, name: &str) -> Vec<Action> {
    h.send(Event::TaskRunReleased {
        taskrun: TaskRunRef::new(ns, name, Uid::new(&format!("uid-{ns}-{name}"))),
    })
}

fn reference(ns: &str, name: &str) -> TaskRunRef {
    TaskRunRef::new(ns, name, Uid::new(&format!("uid-{ns}-{name}")))
}

fn refuse(h: &mut H, name: &str, secret: &SecretData) -> Vec<Action> {
    h.send(Event::SecretRefused {
        taskrun: reference("ns", name),
        secret: secret.clone(),
        error: "secrets \"x\" is forbidden: exceeded quota".into(),
    })
}

/// `revoke` of each RemoveFinalizer.
fn revokes(acts: &[Action]) -> Vec<bool> {
    acts.iter()
        .filter_map(|a| match a {
            Action::RemoveFinalizer { revoke, .. } => Some(*revoke),
            _ => None,
        })
        .collect()
}

fn notified(acts: &[Action], reason: &str) -> Vec<String> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Notify {
                reason: r, message, ..
            } if *r == reason => Some(message.clone()),
            _ => None,
        })
        .collect()
}

/// Serves `name` on a static host: its provisioning succeeds; returns the secret written.
fn served(h: &mut H, acts: &[Action], name: &str) -> SecretData {
    let op = provision_op(acts, name);
    let a = h.send(Event::Provisioned {
        op,
        otp: format!("otp-{name}"),
    });
    secret(&a, name).cloned().expect("a secret")
}

#[test]
fn a_released_taskrun_that_needs_a_host_after_all_is_served_then_finalized() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let a = h.submit("ns", "a", S390X);
    served(&mut h, &a, "a");
    // Its Task turned out not to mount the secret: the host is cleaned, the finalizer waits.
    let r = release(&mut h, "ns", "a");
    let d = deprovisions(&r);
    assert_eq!(d.len(), 1, "{r:#?}");
    assert!(finalized(&r).is_empty());
    // It needs a host after all (the answer flipped back) while the cleanup runs.
    assert!(provisions(&h.submit("ns", "a", S390X)).is_empty());
    let a = h.send(Event::Deprovisioned {
        op: d[0].0,
        error: None,
    });
    assert!(finalized(&a).is_empty(), "its finalizer stays: {a:#?}");
    served(&mut h, &a, "a");
    // Finished for good: cleaned, finalized, and remembered.
    let d = deprovisions(&h.done("ns", "a"));
    let a = h.send(Event::Deprovisioned {
        op: d[0].0,
        error: None,
    });
    assert_eq!(finalized(&a), ["a"]);
    assert!(
        h.submit("ns", "a", S390X).is_empty(),
        "a late event changes nothing"
    );
}

#[test]
fn a_taskrun_released_before_it_was_seen_is_served_when_it_needs_a_host() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    // Released on a remembered answer before the scheduler ever saw it: the finalizer goes.
    let r = release(&mut h, "ns", "b");
    assert_eq!(finalized(&r), ["b"]);
    assert_eq!(
        revokes(&r),
        [false],
        "its keys stay storable: it may need a host"
    );
    // Its resolved Task mounts the secret after all: the controller adds the finalizer back and
    // the scheduler serves it (it is not remembered as finished).
    let a = h.submit("ns", "b", S390X);
    served(&mut h, &a, "b");
    let d = deprovisions(&h.done("ns", "b"));
    let a = h.send(Event::Deprovisioned {
        op: d[0].0,
        error: None,
    });
    assert_eq!(finalized(&a), ["b"], "the finalizer added again is removed");
    assert_eq!(revokes(&a), [true], "ended: its keys are revoked");
}

#[test]
fn a_refused_secret_is_retried_then_the_host_is_freed_with_an_error() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let a = h.submit("ns", "a", S390X);
    let remote = served(&mut h, &a, "a");
    assert!(
        provisions(&h.submit("ns", "b", S390X)).is_empty(),
        "b waits"
    );
    let a = refuse(&mut h, "a", &remote);
    assert_eq!(notified(&a, "SecretRefused").len(), 1, "{a:#?}");
    assert!(secret(&a, "a").is_none());
    // Written again after 2, 4 and 8 s.
    for wait in [2, 4, 8] {
        assert!(secret(&h.wait(wait - 1), "a").is_none());
        let a = h.wait(1);
        assert_eq!(secret(&a, "a"), Some(&remote), "after {wait} s: {a:#?}");
        let a = refuse(&mut h, "a", &remote);
        if wait < 8 {
            assert!(a.is_empty(), "{a:#?}");
            continue;
        }
        // The fourth refusal: the host is freed for b and a gets an error.
        let d = deprovisions(&a);
        assert_eq!(d.len(), 1, "{a:#?}");
        assert!(d[0].1.starts_with("u-"));
        provision_op(&a, "b");
        let msg = error_of(&a, "a");
        assert!(msg.contains("refused") && msg.contains("quota"), "{msg}");
        assert_eq!(notified(&a, "AllocationFailed").len(), 1);
        // The error secret is refused too: the Event is all the user gets, once.
        let a = refuse(&mut h, "a", &SecretData::Error(msg));
        assert_eq!(notified(&a, "SecretRefused").len(), 1, "{a:#?}");
        assert!(secret(&a, "a").is_none());
        assert!(secret(&h.wait(600), "a").is_none());
    }
    let a = h.done("ns", "a");
    assert_eq!(finalized(&a), ["a"], "nothing left to wait for");
}

#[test]
fn a_refusal_of_a_superseded_secret_changes_nothing() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let a = h.submit("ns", "a", S390X);
    served(&mut h, &a, "a");
    assert!(refuse(&mut h, "a", &SecretData::Localhost).is_empty());
    let other = SecretData::Error("an older error".into());
    assert!(refuse(&mut h, "a", &other).is_empty());
}

#[test]
fn a_refused_secret_on_a_dynamic_instance_terminates_it_for_the_next_taskrun() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let l = launches(&h.submit("ns", "a", ARM))[0].0;
    let a = boot(&mut h, l, "i-1");
    let remote = served(&mut h, &a, "a");
    assert!(launches(&h.submit("ns", "b", ARM)).is_empty());
    refuse(&mut h, "a", &remote);
    for wait in [2, 4, 8] {
        h.wait(wait);
        let a = refuse(&mut h, "a", &remote);
        if wait == 8 {
            let t = terminates(&a);
            assert_eq!(t.len(), 1, "{a:#?}");
            assert_eq!(t[0].1, "i-1");
            error_of(&a, "a");
            let a = h.send(Event::Terminated {
                op: t[0].0,
                error: None,
            });
            assert_eq!(launches(&a).len(), 1, "b launches once i-1 is gone");
        }
    }
    assert_eq!(finalized(&h.done("ns", "a")), ["a"]);
}

#[test]
fn a_terminate_refused_past_the_bound_is_reported_leaked_and_still_counts() {
    let mut h = H::new(&dynamic_pairs(1, None));
    let l = launches(&h.submit("ns", "a", ARM))[0].0;
    let a = boot(&mut h, l, "i-1");
    served(&mut h, &a, "a");
    let mut t = terminates(&h.done("ns", "a"))[0].0;
    assert!(launches(&h.submit("ns", "b", ARM)).is_empty());
    for n in 1..=5 {
        let a = h.send(Event::Terminated {
            op: t,
            error: Some("UnauthorizedOperation".into()),
        });
        assert!(launches(&a).is_empty(), "still counted after {n}: {a:#?}");
        if n < 5 {
            assert!(finalized(&a).is_empty());
        } else {
            // The bound: a's finalizer goes and operators hear, but i-1 still runs and is
            // billed: it keeps its max-instances place, so b waits.
            assert_eq!(finalized(&a), ["a"]);
            let leaked = notified(&a, "InstanceLeaked");
            assert_eq!(leaked.len(), 1, "{a:#?}");
            assert!(leaked[0].contains("i-1") && leaked[0].contains("UnauthorizedOperation"));
            let g = &h.s.gauges().platforms[ARM];
            assert_eq!((g.instances, g.leaked, g.terminating), (1, 1, 0));
        }
        t = terminates(&h.wait(301))[0].0;
    }
    // Still retried every few minutes, reported once; when it lands the leak is over and b
    // launches in the same step.
    let a = h.send(Event::Terminated {
        op: t,
        error: Some("UnauthorizedOperation".into()),
    });
    assert!(notified(&a, "InstanceLeaked").is_empty());
    assert!(launches(&a).is_empty());
    let t = terminates(&h.wait(301));
    assert_eq!(t[0].1, "i-1");
    let a = h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    });
    assert_eq!(launches(&a).len(), 1, "b launches once i-1 is gone: {a:#?}");
    let g = &h.s.gauges().platforms[ARM];
    assert_eq!((g.instances, g.leaked), (1, 0), "b's instance only");
}

/// A cloud that answers every action at once, refusing terminations while `refuse` (an IAM or
/// SCP change, termination protection); `live` holds the instances it runs. Returns the actions
/// seen, the ones the answers led to included.
fn refusing_cloud(
    h: &mut H,
    acts: Vec<Action>,
    live: &mut (BTreeSet<String>, u32),
    refuse: bool,
) -> Vec<Action> {
    let (live, next) = live;
    let mut seen = Vec::new();
    let mut todo: std::collections::VecDeque<Action> = acts.into();
    while let Some(a) = todo.pop_front() {
        let next = match &a {
            Action::Launch { op, .. } => {
                *next += 1;
                let id = format!("i-{next}");
                live.insert(id.clone());
                Some(Event::Launched {
                    op: *op,
                    instance_id: id,
                })
            }
            Action::Probe {
                op, instance_id, ..
            } => Some(Event::Probed {
                op: *op,
                result: ProbeResult::Reachable {
                    address: format!("192.0.2.{}", instance_id.len()),
                },
            }),
            Action::Provision { op, .. } => Some(Event::Provisioned {
                op: *op,
                otp: "otp".into(),
            }),
            Action::Terminate {
                op, instance_id, ..
            } => {
                if !refuse {
                    live.remove(&**instance_id);
                }
                Some(Event::Terminated {
                    op: *op,
                    error: refuse.then(|| "UnauthorizedOperation".into()),
                })
            }
            _ => None,
        };
        seen.push(a);
        if let Some(e) = next {
            todo.extend(h.send(e));
        }
    }
    seen
}

#[test]
fn five_taskruns_with_every_terminate_refused_leave_at_most_max_instances_live() {
    let max = 1;
    let mut h = H::new(&dynamic_pairs(max, None));
    let mut cloud = (BTreeSet::new(), 0);
    let mut all = Vec::new();
    for n in 1..=5 {
        let name = format!("t{n}");
        let a = h.submit("ns", &name, ARM);
        let mut a = refusing_cloud(&mut h, a, &mut cloud, true);
        // Its instance boots (probed 20 s after the launch).
        let boot = h.wait(30);
        a.extend(refusing_cloud(&mut h, boot, &mut cloud, true));
        let served = a
            .iter()
            .any(|x| matches!(x, Action::WriteSecret { taskrun, .. } if *taskrun.name() == *name));
        all.extend(a);
        if served {
            // Its build runs a minute, then it ends.
            let a = h.wait(60);
            all.extend(refusing_cloud(&mut h, a, &mut cloud, true));
            let a = h.done("ns", &name);
            all.extend(refusing_cloud(&mut h, a, &mut cloud, true));
        }
        // An hour of refused terminations (retries answered as they come).
        for _ in 0..120 {
            let a = h.wait(30);
            all.extend(refusing_cloud(&mut h, a, &mut cloud, true));
            let live = &cloud.0;
            assert!(
                live.len() <= max as usize,
                "after {name}: {} instances live with max-instances {max}: {live:?}",
                live.len()
            );
        }
    }
    assert_eq!(cloud.0.len(), 1);
    let leaked = notified(&all, "InstanceLeaked");
    assert_eq!(leaked.len(), 1, "reported once: {leaked:?}");
    // The first TaskRun's finalizer went at the bound; the others wait for a host.
    assert_eq!(finalized(&all), ["t1"]);
    assert_eq!(launches(&all).len(), 1);
    assert_eq!(h.s.gauges().platforms[ARM].leaked, 1);
    // Still retried at a slow rate (the back-off's cap, five minutes): never given up.
    let mut retries = 0;
    for _ in 0..12 {
        let a = h.wait(60);
        retries += terminates(&a).len();
        refusing_cloud(&mut h, a, &mut cloud, true);
    }
    assert!(
        (2..=3).contains(&retries),
        "{retries} retries in 12 minutes"
    );
    // Terminations work again: the leaked instance goes at its next retry, and the waiters are
    // served one at a time again (the platform is not blocked for good).
    let mut launched = 0;
    for _ in 0..10 {
        let a = h.wait(60);
        launched += launches(&refusing_cloud(&mut h, a, &mut cloud, false)).len();
    }
    assert_eq!(launched, 1, "the next waiter launches");
    assert_eq!(h.s.gauges().platforms[ARM].leaked, 0);
    assert_eq!(cloud.0.len(), 1, "the next waiter's");
}

#[test]
fn young_instances_of_ours_nothing_tracks_count_against_max_instances() {
    let mut h = H::new(&dynamic_pairs(2, None));
    let listing = |instances| Event::InstancesListed {
        platform: Platform::parse(ARM).unwrap(),
        instances,
    };
    // Launched by this cluster a few seconds ago, by a process whose result never came (a
    // crash, a leader that lost its term): too young to be an orphan, alive and billed.
    let a = h.send(listing(vec![instance(
        "i-young",
        Some("uid-x-gone"),
        START - 5,
    )]));
    assert!(terminates(&a).is_empty(), "young: left alone");
    assert_eq!(h.s.gauges().platforms[ARM].foreign, 1);
    assert_eq!(launches(&h.submit("ns", "a", ARM)).len(), 1);
    assert!(
        launches(&h.submit("ns", "b", ARM)).is_empty(),
        "a's launch + i-young = max-instances"
    );
    // a's launch shows in a listing before its result arrives: counted once, by the ledger.
    h.send(listing(vec![
        instance("i-young", Some("uid-x-gone"), START - 5),
        instance("i-a", Some("uid-ns-a"), START),
    ]));
    assert_eq!(h.s.gauges().platforms[ARM].foreign, 1);
    // i-young is gone at the next listing: b launches in the same step.
    let a = h.send(listing(vec![instance("i-a", Some("uid-ns-a"), START)]));
    assert_eq!(h.s.gauges().platforms[ARM].foreign, 0);
    assert_eq!(launches(&a).len(), 1, "{a:#?}");
}
