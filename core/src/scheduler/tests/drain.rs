//! Drained hosts and platforms (`drain: "true"`, a static host's `concurrency: "0"`): no new
//! work goes there, what runs finishes and is cleaned up where it ran, waiters wait (no error
//! secret), and a config that lifts the drain serves them in the same step.

use super::*;

const S390X: &str = "linux/s390x";
const ARM: &str = "linux/arm64";

/// `pairs` with `extra` keys set (replacing any of the same name).
fn with(pairs: &[(String, String)], extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = pairs
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .cloned()
        .collect();
    v.extend(extra.iter().map(|(k, x)| kv(k, x)));
    v
}

fn reconfig(h: &mut H, pairs: &[(String, String)]) -> Vec<Action> {
    h.send(Event::ConfigReplaced(Box::new(config(pairs))))
}

fn serve(h: &mut H, name: &str, platform: &str, host: &str) {
    let a = h.submit("ns", name, platform);
    let p = provisions(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    assert_eq!(p[0].2, host);
    h.send(Event::Provisioned {
        op: p[0].0,
        otp: "t".into(),
    });
}

fn no_secret(a: &[Action], name: &str) {
    assert!(secret(a, name).is_none(), "{name} got a secret: {a:#?}");
}

#[test]
fn a_drained_host_takes_no_new_work_and_its_build_finishes_and_is_cleaned_up_there() {
    let base = static_pairs(&[("h1", 1), ("h2", 1)]);
    let mut h = H::new(&base);
    serve(&mut h, "a", S390X, "h1");
    let drained = with(&base, &[("host.h1.drain", "true")]);
    let a = reconfig(&mut h, &drained);
    assert!(
        deprovisions(&a).is_empty() && provisions(&a).is_empty(),
        "the running build is untouched: {a:#?}"
    );
    // New work goes to the other host, then waits.
    serve(&mut h, "b", S390X, "h2");
    let a = h.submit("ns", "c", S390X);
    assert!(provisions(&a).is_empty(), "{a:#?}");
    no_secret(&a, "c");
    // a finishes: its user is removed from the drained host, and c does not go there.
    let a = h.done("ns", "a");
    assert_eq!(deprovisions(&a).len(), 1, "{a:#?}");
    assert_eq!(deprovisions(&a)[0].2, "h1");
    assert!(
        provisions(&a).is_empty(),
        "c went to the drained h1: {a:#?}"
    );
    let op = deprovisions(&a)[0].0;
    let a = h.send(Event::Deprovisioned { op, error: None });
    assert_eq!(finalized(&a), ["a"]);
    assert!(provisions(&a).is_empty(), "{a:#?}");
    assert_eq!(h.s.gauges().platforms[S390X].waiting, 1);
    // Lifting the drain serves c at once.
    let a = reconfig(&mut h, &base);
    let p = provisions(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("c", "h1"));
}

#[test]
fn waiters_of_a_platform_whose_every_host_is_drained_wait_without_an_error() {
    let base = static_pairs(&[("h1", 2)]);
    let zero = with(&base, &[("host.h1.concurrency", "0")]);
    let mut h = H::new(&zero);
    assert_eq!(
        h.s.gauges().platforms.get(S390X).and_then(|g| g.capacity),
        Some(0)
    );
    let a = h.submit("ns", "a", S390X);
    assert!(provisions(&a).is_empty(), "{a:#?}");
    no_secret(&a, "a");
    // A long wait changes nothing: no error secret, no timeout.
    let a = h.wait(6 * 3600);
    no_secret(&a, "a");
    assert_eq!(h.s.gauges().platforms[S390X].waiting, 1);
    let a = reconfig(&mut h, &base);
    assert_eq!(provisions(&a).len(), 1, "{a:#?}");
}

#[test]
fn a_provisioning_under_way_when_the_drain_arrives_finishes_under_its_definition() {
    let base = static_pairs(&[("h1", 2)]);
    let mut h = H::new(&base);
    let op = provision_op(&h.submit("ns", "a", S390X), "a");
    reconfig(&mut h, &with(&base, &[("host.h1.drain", "true")]));
    let a = h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    assert!(
        matches!(secret(&a, "a"), Some(SecretData::Remote { .. })),
        "{a:#?}"
    );
    assert!(provisions(&h.submit("ns", "b", S390X)).is_empty());
}

/// A Tekton retry of a build on a drained host is that build (its pod mounted the secret naming
/// the host): re-armed there once; when that fails, the current config (drained) sends it on.
#[test]
fn a_retry_of_a_build_on_a_drained_host_is_rearmed_there_once_then_moves() {
    let base = static_pairs(&[("h1", 1), ("h2", 1)]);
    let mut h = H::new(&base);
    serve(&mut h, "a", S390X, "h1");
    reconfig(&mut h, &with(&base, &[("host.h1.drain", "true")]));
    let mut spec = H::spec("ns", "a", S390X);
    spec.retries = 1;
    let a = h.send(Event::TaskRun(spec));
    let p = provisions(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    assert_eq!(p[0].2, "h1");
    h.send(Event::ProvisionFailed {
        op: p[0].0,
        error: "connection refused".into(),
        blame: Blame::Host,
    });
    let a = h.wait(Policy::mpc().rearm_backoff.as_secs() * 4);
    let p = provisions(&a);
    assert!(
        !p.is_empty() && p.iter().all(|(_, _, host)| host == "h2"),
        "a failed re-arm moves off the drained h1: {a:#?}"
    );
}

#[test]
fn a_drained_dynamic_platform_launches_nothing_until_the_drain_is_lifted() {
    let base = dynamic_pairs(2, None);
    let drained = with(&base, &[("dynamic.linux-arm64.drain", "true")]);
    let mut h = H::new(&base);
    let l = launches(&h.submit("ns", "a", ARM));
    assert_eq!(l.len(), 1);
    let op = provision_op(&boot(&mut h, l[0].0, "i-1"), "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    let a = reconfig(&mut h, &drained);
    assert!(
        terminates(&a).is_empty(),
        "the running build is untouched: {a:#?}"
    );
    let a = h.submit("ns", "b", ARM);
    assert!(launches(&a).is_empty(), "{a:#?}");
    no_secret(&a, "b");
    // a finishes: its instance goes, and b still waits.
    let a = h.done("ns", "a");
    let t = terminates(&a);
    assert_eq!(t.len(), 1, "{a:#?}");
    let a = h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    });
    assert!(launches(&a).is_empty(), "{a:#?}");
    no_secret(&a, "b");
    no_secret(&h.wait(3600), "b");
    let a = reconfig(&mut h, &base);
    assert_eq!(launches(&a).len(), 1, "{a:#?}");
}

#[test]
fn a_drained_pool_takes_no_new_taskrun_and_terminates_its_idle_instances() {
    let base = dynamic_pairs(2, Some((4, 600)));
    let drained = with(&base, &[("dynamic.linux-arm64.drain", "true")]);
    let mut h = H::new(&base);
    // a runs on i-1 (room for three more), i-2 is idle (its TaskRun left).
    let l = launches(&h.submit("ns", "a", ARM));
    let op = provision_op(&boot(&mut h, l[0].0, "i-1"), "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    let a = reconfig(&mut h, &drained);
    assert!(terminates(&a).is_empty(), "i-1 runs a: {a:#?}");
    let a = h.submit("ns", "b", ARM);
    assert!(
        provisions(&a).is_empty() && launches(&a).is_empty(),
        "a drained pool took b: {a:#?}"
    );
    no_secret(&a, "b");
    // a finishes: i-1 is idle and drained, so it is terminated.
    let a = h.done("ns", "a");
    assert_eq!(terminates(&a).len(), 1, "{a:#?}");
    assert!(
        launches(&a).is_empty() && provisions(&a).is_empty(),
        "{a:#?}"
    );
    // Lifted: b gets a fresh instance.
    let a = reconfig(&mut h, &base);
    assert_eq!(launches(&a).len(), 1, "{a:#?}");
}

#[test]
fn a_drained_pool_launches_no_warm_instance() {
    let base = with(
        &dynamic_pairs(3, Some((2, 600))),
        &[("dynamic.linux-arm64.min-instances", "1")],
    );
    let drained = with(&base, &[("dynamic.linux-arm64.drain", "true")]);
    let mut s = Scheduler::new(config(&drained), Policy::mpc());
    let mut out = Vec::new();
    s.recover(Time::from_secs(START), Snapshot::default(), &mut out);
    assert!(launches(&out).is_empty(), "{out:#?}");
    let mut h = H::from(s, Time::from_secs(START));
    assert_eq!(launches(&reconfig(&mut h, &base)).len(), 1);
}

/// After a restart onto a config that drains h1: the served, proven build on h1 stays there
/// (and is cleaned up there), one assigned but never served goes elsewhere (it would be new
/// work), and a Tekton retry of the kept build re-arms on h1 (the DrainedHost invariant allows
/// exactly that).
#[test]
fn a_restart_keeps_served_builds_on_a_drained_host_and_places_the_rest_elsewhere() {
    use super::recovery::{rec, start};
    let pairs = with(
        &static_pairs(&[("h1", 2), ("h2", 1)]),
        &[("host.h1.drain", "true")],
    );
    let mut running = rec("a", S390X);
    running.assigned_host = Some("h1".into());
    running.secret = Some(SecretKind::Remote);
    running.secret_proven = true;
    let mut half = rec("b", S390X);
    half.assigned_host = Some("h1".into());
    let (mut h, out) = start(
        &pairs,
        Snapshot {
            taskruns: vec![running, half],
            ..Default::default()
        },
    );
    let p = provisions(&out);
    assert_eq!(p.len(), 1, "{out:#?}");
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), ("b", "h2"));
    let mut spec = H::spec("ns", "a", S390X);
    spec.retries = 1;
    let a = h.send(Event::TaskRun(spec));
    assert_eq!(provisions(&a).len(), 1, "{a:#?}");
    assert_eq!(provisions(&a)[0].2, "h1");
    h.send(Event::Provisioned {
        op: provisions(&a)[0].0,
        otp: "t".into(),
    });
    let a = h.done("ns", "a");
    assert_eq!(deprovisions(&a)[0].2, "h1");
}
