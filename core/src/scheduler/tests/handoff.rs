//! A dynamic slot freed by a termination goes to the next waiter at once, whatever listing
//! arrives around the acknowledgement.

use super::recovery::instance;
use super::*;

const P: &str = "linux/arm64";

/// `name` submitted, launched as `id`, reachable and provisioned.
fn running(h: &mut H, name: &str, id: &str) {
    let a = h.submit("ns", name, P);
    let l = launches(&a);
    assert_eq!(l.len(), 1, "{a:#?}");
    let a = boot(h, l[0].0, id);
    let op = provision_op(&a, name);
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
}

/// The platform's instances as a listing shows them, running, with their owner tag (the
/// TaskRun's UID), if any.
fn listing(instances: &[(&str, Option<&str>)]) -> Event {
    Event::InstancesListed {
        platform: Platform::parse(P).unwrap(),
        instances: instances
            .iter()
            .map(|(id, owner)| instance(id, owner.map(|o| format!("uid-ns-{o}")).as_deref(), START))
            .collect(),
    }
}

/// `a` runs on i-1 and `b` waits; `a` finishes and i-1's termination is acknowledged, then a
/// listing made before that arrives, still showing i-1 running (as `stale` lists it). `b` runs
/// on i-2 and finishes: the slot i-2 frees must serve `c` at once.
fn stale_listing_then_handoff(stale: Option<&str>) {
    let mut h = H::new(&dynamic_pairs(1, None));
    running(&mut h, "a", "i-1");
    assert!(launches(&h.submit("ns", "b", P)).is_empty(), "no room");
    let t = terminates(&h.done("ns", "a"))[0].0;
    let a = h.send(Event::Terminated { op: t, error: None });
    let b = launches(&a);
    assert_eq!(b.len(), 1, "b launches in the same step: {a:#?}");
    let a = h.send(listing(&[("i-1", stale)]));
    assert!(
        terminates(&a).is_empty(),
        "i-1 is not an orphan to terminate again: {a:#?}"
    );
    assert_eq!(
        h.s.gauges().platforms[P].foreign,
        0,
        "nor another's instance"
    );
    let a = boot(&mut h, b[0].0, "i-2");
    let op = provision_op(&a, "b");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    assert!(launches(&h.submit("ns", "c", P)).is_empty(), "no room");
    let t = terminates(&h.done("ns", "b"))[0].0;
    let a = h.send(Event::Terminated { op: t, error: None });
    assert_eq!(
        launches(&a).len(),
        1,
        "the slot i-2 held serves c in the same step, not after the next listing: {a:#?}"
    );
}

#[test]
fn a_listing_older_than_a_termination_does_not_resurrect_the_instance_as_an_orphan() {
    // Its owner finished: as an orphan it would be tracked (and counted) again.
    stale_listing_then_handoff(Some("a"));
}

#[test]
fn a_listing_older_than_a_termination_does_not_count_the_instance_as_anothers() {
    // No owner tag: an untracked instance of ours, counted against max-instances.
    stale_listing_then_handoff(None);
}

#[test]
fn a_terminated_instance_still_listed_running_past_the_orphan_grace_is_terminated_again() {
    let mut h = H::new(&dynamic_pairs(2, None));
    running(&mut h, "a", "i-1");
    let t = terminates(&h.done("ns", "a"))[0].0;
    h.send(Event::Terminated { op: t, error: None });
    assert!(terminates(&h.send(listing(&[("i-1", Some("a"))]))).is_empty());
    h.wait(601);
    let a = h.send(listing(&[("i-1", Some("a"))]));
    assert_eq!(
        terminates(&a)
            .iter()
            .map(|t| t.1.as_str())
            .collect::<Vec<_>>(),
        vec!["i-1"],
        "the termination did not take: {a:#?}"
    );
}
