//! Strategy-independent behaviour: local and unknown platforms, gating, errors.

use super::*;

fn mixed() -> Vec<(String, String)> {
    let mut v = static_pairs(&[("h1", 1)]);
    v.push(kv("local-platforms", "linux/x86_64,local"));
    v
}

#[test]
fn local_platform_gets_localhost_and_nothing_else() {
    let mut h = H::new(&mixed());
    let a = h.submit("ns", "a", "linux/x86_64");
    assert_eq!(secret(&a, "a"), Some(&SecretData::Localhost));
    assert!(provisions(&a).is_empty());
    let r = records(&a, "a");
    assert_eq!(r.len(), 1, "{a:#?}");
    assert_eq!(r[0].assigned_host.as_deref(), Some("localhost"));
    assert_eq!(r[0].waiting_for_platform, None);
    let a = h.done("ns", "a");
    assert!(a.iter().any(|x| matches!(x, Action::DeleteSecret { .. })));
    assert_eq!(finalized(&a), vec!["a"]);
}

#[test]
fn unknown_platform_gets_an_error_naming_the_configured_ones() {
    let mut h = H::new(&mixed());
    let mut spec = H::spec("ns", "a", "linux/riscv64");
    spec.gated = true;
    let a = h.send(Event::TaskRun(spec));
    let msg = error_of(&a, "a");
    assert!(msg.contains("linux/riscv64 is not configured"), "{msg}");
    assert!(msg.contains("linux/s390x"), "{msg}");
    assert!(
        a.iter().any(|x| matches!(x, Action::Ungate { .. })),
        "gated TaskRuns run to show the error"
    );
    assert!(
        !a.iter().any(|x| matches!(x, Action::Observe(_))),
        "no metric label for unconfigured platforms"
    );
}

#[test]
fn malformed_platform_gets_a_specific_error() {
    let mut h = H::new(&mixed());
    let a = h.submit("ns", "a", "Linux/ARM64");
    let msg = error_of(&a, "a");
    assert!(
        msg.contains("\"Linux/ARM64\"") && msg.contains("linux/arm64"),
        "{msg}"
    );
}

#[test]
fn disabled_platform_says_why() {
    let mut pairs = static_pairs(&[("h1", 1)]);
    pairs.push(kv("dynamic-platforms", "linux/arm64"));
    pairs.push(kv("dynamic.linux-arm64.type", "aws"));
    let data: crate::config::ConfigData = pairs.into_iter().collect();
    let cfg = crate::config::parse(&data).config;
    let mut s = Scheduler::new(cfg, Policy::mpc());
    let now = Time::from_secs(START);
    let mut out = Vec::new();
    s.recover(now, Snapshot::default(), &mut out);
    let a = s.step(now, Event::TaskRun(H::spec("ns", "a", "linux/arm64")));
    let msg = error_of(&a, "a");
    assert!(msg.contains("invalid") && msg.contains("region"), "{msg}");
}

#[test]
fn failed_taskrun_retry_gets_a_new_chance() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let op = provision_op(&h.submit("ns", "a", "linux/s390x"), "a");
    let a = h.send(Event::ProvisionFailed {
        op,
        error: "down".into(),
        blame: Blame::Host,
    });
    error_of(&a, "a");
    let removal = deprovisions(&a);
    assert_eq!(removal.len(), 1, "the half-made user is removed");
    let mut spec = H::spec("ns", "a", "linux/s390x");
    spec.retries = 1;
    let a = h.send(Event::TaskRun(spec));
    assert!(
        matches!(a[0], Action::DeleteSecret { .. }),
        "old error removed first"
    );
    // Its user's removal on h1 is still in flight (a retry of it would remove the new user).
    assert!(provisions(&a).is_empty(), "{a:#?}");
    let a = h.send(Event::Deprovisioned {
        op: removal[0].0,
        error: None,
    });
    assert_eq!(provisions(&a)[0].2, "h1");
}

#[test]
fn platform_removed_from_config_fails_its_waiters_with_a_reason() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    h.submit("ns", "a", "linux/s390x");
    let a = h.submit("ns", "b", "linux/s390x");
    assert!(provisions(&a).is_empty());
    let mut pairs = static_pairs(&[]);
    pairs.push(kv("local-platforms", "linux/x86_64"));
    let a = h.send(Event::ConfigReplaced(Box::new(config(&pairs))));
    assert!(error_of(&a, "b").contains("not configured"));
    assert!(
        secret(&a, "a").is_none(),
        "the running allocation is untouched"
    );
}

/// Found by the model test: a failed waiter kept its `waiting-for-platform` label, so a
/// restart (which reads no secret of a waiting TaskRun) queued it again and served it a second
/// secret in the same attempt.
#[test]
fn a_failing_waiter_loses_its_waiting_label_before_its_error_secret() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    h.submit("ns", "a", "linux/s390x");
    let a = h.submit("ns", "b", "linux/s390x");
    assert_eq!(
        records(&a, "b")[0].waiting_for_platform.as_deref(),
        Some("linux-s390x")
    );
    let a = h.send(Event::ConfigReplaced(Box::new(config(&static_pairs(&[])))));
    error_of(&a, "b");
    let cleared = a.iter().position(|x| {
        matches!(x, Action::Record { taskrun, placement } if taskrun.name() == "b"
            && *placement == Placement::default())
    });
    let secret = a
        .iter()
        .position(|x| matches!(x, Action::WriteSecret { taskrun, .. } if taskrun.name() == "b"));
    assert!(
        cleared.is_some_and(|c| secret.is_some_and(|s| c < s)),
        "labels cleared before the error secret: {a:#?}"
    );
}

/// Asserts `name`'s writes in `acts` relabel it `localhost` first, then write its localhost
/// secret. Found by the model test: with the secret first, a crash between the two left the
/// secret under a waiting label (the restart, which reads no secret of a waiting TaskRun, served
/// it again on a host) or under a host's name (counted against that host, as the Go controller
/// counts a host's load).
fn relabelled_before_localhost_secret(acts: &[Action], name: &str) {
    let writes: Vec<&Action> = acts
        .iter()
        .filter(|x| {
            matches!(x, Action::Record { taskrun, .. } | Action::WriteSecret { taskrun, .. }
                if taskrun.name() == name)
        })
        .collect();
    assert!(
        matches!(writes[..], [Action::Record { placement, .. }, Action::WriteSecret { secret: SecretData::Localhost, .. }]
            if placement.assigned_host.as_deref() == Some("localhost")
                && placement.waiting_for_platform.is_none()),
        "{writes:#?}"
    );
}

#[test]
fn a_provisioning_taskrun_turning_local_is_relabelled_before_its_secret() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    let op = provision_op(&h.submit("ns", "a", "linux/s390x"), "a");
    let mut pairs = static_pairs(&[]);
    pairs.push(kv("local-platforms", "linux/s390x"));
    h.send(Event::ConfigReplaced(Box::new(config(&pairs))));
    let a = h.send(Event::ProvisionFailed {
        op,
        error: "down".into(),
        blame: Blame::Host,
    });
    relabelled_before_localhost_secret(&a, "a");
    // A new local TaskRun keeps the Go controller's order: the secret, then the label.
    let a = h.submit("ns", "c", "linux/s390x");
    assert!(
        matches!(a[..], [Action::WriteSecret { .. }, Action::Record { .. }]),
        "{a:#?}"
    );
}

#[test]
fn platform_becoming_local_serves_its_waiters_in_pods() {
    let mut h = H::new(&static_pairs(&[("h1", 1)]));
    h.submit("ns", "a", "linux/s390x");
    h.submit("ns", "b", "linux/s390x");
    let mut pairs = static_pairs(&[("h1", 1)]);
    pairs.push(kv("local-platforms", "linux/s390x"));
    let a = h.send(Event::ConfigReplaced(Box::new(config(&pairs))));
    assert_eq!(secret(&a, "b"), Some(&SecretData::Localhost));
    relabelled_before_localhost_secret(&a, "b");
}

#[test]
fn next_deadline_tracks_timers() {
    let mut h = H::new(&dynamic_pairs(1, None));
    assert_eq!(h.s.next_deadline(), None);
    let l = launches(&h.submit("ns", "a", "linux/arm64"))[0].0;
    // Allocation deadline.
    assert_eq!(
        h.s.next_deadline(),
        Some(h.now + std::time::Duration::from_secs(600))
    );
    h.send(Event::Launched {
        op: l,
        instance_id: "i-1".into(),
    });
    assert_eq!(
        h.s.next_deadline(),
        Some(h.now + std::time::Duration::from_secs(20))
    );
}

#[test]
fn late_events_for_a_finished_taskrun_are_ignored_for_at_least_an_hour() {
    let mut h = H::new(&mixed());
    h.submit("ns", "a", "linux/x86_64");
    assert_eq!(finalized(&h.done("ns", "a")), vec!["a"]);
    // A replayed watch event and a duplicate finish within the hour: nothing happens.
    for wait in [0, 1800, 1799] {
        h.wait(wait);
        assert!(h.submit("ns", "a", "linux/x86_64").is_empty());
        assert!(h.done("ns", "a").is_empty());
    }
    // Past the hour the tombstone has moved to the older generation: still recognised.
    h.wait(600);
    assert!(h.submit("ns", "a", "linux/x86_64").is_empty());
    // Forgotten after two hours: the same UID is a TaskRun again.
    h.wait(2 * 3600);
    let a = h.submit("ns", "a", "linux/x86_64");
    assert_eq!(secret(&a, "a"), Some(&SecretData::Localhost));
}

#[test]
fn actions_and_events_move_without_a_copy_loop() {
    // Every decision pushes several actions and takes an event by value; above 128 bytes the
    // compiler moves them with a memcpy call, which showed up in the drain benchmark.
    assert!(
        std::mem::size_of::<Action>() <= 128,
        "{}",
        std::mem::size_of::<Action>()
    );
    assert!(
        std::mem::size_of::<Event>() <= 128,
        "{}",
        std::mem::size_of::<Event>()
    );
}
