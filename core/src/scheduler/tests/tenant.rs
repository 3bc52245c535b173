//! Recovery when tenants lie: TaskRun labels, annotations and Secrets are the tenant's to write,
//! so what recovery rebuilds from them must be confirmed by the host config, the cloud listing
//! or the controller's secret proof. Each test is one attack of issue 23 §1, and the Go-era
//! allocations that must still be adopted next to it.

use std::collections::BTreeMap;

use super::recovery::{instance, rec, start};
use super::*;
use crate::contract;

const ARM: &str = "linux/arm64";
const S390X: &str = "linux/s390x";

/// Static s390x hosts plus the dynamic arm64 platform (at most `max` instances).
fn mixed(hosts: &[(&str, u32)], max: u32) -> Vec<(String, String)> {
    let mut pairs = dynamic_pairs(max, None);
    pairs.extend(static_pairs(hosts));
    pairs
}

/// A record whose secret the controller wrote (its proof verified).
fn served(name: &str, platform: &str, host: &str) -> TaskRunRecord {
    let mut r = rec(name, platform);
    r.assigned_host = Some(host.into());
    r.secret = Some(SecretKind::Remote);
    r.secret_proven = true;
    r
}

/// A record claiming `host` with a Remote secret the controller cannot prove: the Go
/// controller's, or a tenant's.
fn claimed(name: &str, platform: &str, host: &str) -> TaskRunRecord {
    TaskRunRecord {
        secret_proven: false,
        ..served(name, platform, host)
    }
}

/// Provisionings: TaskRun, host name, SSH address, re-armed.
fn provisioned(acts: &[Action]) -> Vec<(String, String, String, bool)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Provision {
                taskrun,
                host,
                rearm,
                ..
            } => Some((
                taskrun.name().to_string(),
                host.name().to_owned(),
                host.address().to_owned(),
                *rearm,
            )),
            _ => None,
        })
        .collect()
}

fn retry(h: &mut H, name: &str, platform: &str) -> Vec<Action> {
    let mut spec = H::spec("ns", name, platform);
    spec.retries = 1;
    h.send(Event::TaskRun(spec))
}

fn waiting(acts: &[Action], name: &str) -> bool {
    records(acts, name)
        .iter()
        .any(|p| p.waiting_for_platform.is_some())
}

#[test]
fn a_claim_on_a_static_host_of_another_platform_is_not_provisioned_there() {
    // An arm64 TaskRun labelled `assigned-host: h1` (an s390x host) before a leader change.
    let mut forged = rec("f", ARM);
    forged.assigned_host = Some("h1".into());
    let mut w = rec("w", S390X);
    w.waiting = true;
    w.since = Time::from_secs(START - 10);
    let (_, out) = start(
        &mixed(&[("h1", 1)], 2),
        Snapshot {
            taskruns: vec![forged, w],
            instances: vec![],
            ..Default::default()
        },
    );
    let p = provisioned(&out);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!((p[0].0.as_str(), p[0].1.as_str()), ("w", "h1"));
    // The forged one gets an instance of its own platform.
    assert_eq!(launches(&out).len(), 1, "{out:#?}");
}

#[test]
fn claims_beyond_a_hosts_concurrency_are_queued_not_over_assigned() {
    // Three TaskRuns name h1 (concurrency 1) without a secret: provisioned again on recovery.
    let mut claims = Vec::new();
    for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
        let mut r = rec(name, S390X);
        r.assigned_host = Some("h1".into());
        r.since = Time::from_secs(START - 100 + i as u64);
        claims.push(r);
    }
    let (mut h, out) = start(
        &static_pairs(&[("h1", 1)]),
        Snapshot {
            taskruns: claims,
            instances: vec![],
            ..Default::default()
        },
    );
    let p = provisioned(&out);
    assert_eq!(p.len(), 1, "h1 runs one build at a time: {p:?}");
    assert_eq!(p[0].0, "a", "the oldest");
    assert!(waiting(&out, "b") && waiting(&out, "c"), "{out:#?}");
    // The overflow is served in order as h1 frees up.
    h.send(Event::Provisioned {
        op: provision_op(&out, "a"),
        otp: "t".into(),
    });
    let done = h.done("ns", "a");
    let op = deprovisions(&done)[0].0;
    let freed = h.send(Event::Deprovisioned { op, error: None });
    let next: Vec<_> = provisioned(&done)
        .into_iter()
        .chain(provisioned(&freed))
        .map(|p| p.0)
        .collect();
    assert_eq!(next, ["b"]);
}

#[test]
fn an_unproven_claim_never_displaces_a_proven_allocation() {
    let mut legit = served("l", S390X, "h1");
    legit.since = Time::from_secs(START - 50);
    // Created earlier, claims the same slot with a Secret of its own making.
    let mut forged = claimed("f", S390X, "h1");
    forged.since = Time::from_secs(START - 100);
    let (mut h, out) = start(
        &static_pairs(&[("h1", 1)]),
        Snapshot {
            taskruns: vec![forged, legit],
            instances: vec![],
            ..Default::default()
        },
    );
    assert!(provisioned(&out).is_empty(), "{out:#?}");
    assert!(
        secret(&out, "l").is_none(),
        "l's running build keeps its secret"
    );
    assert!(waiting(&out, "f"), "f is queued again: {out:#?}");
    let done = h.done("ns", "l");
    let op = deprovisions(&done)[0].0;
    let mut freed = h.send(Event::Deprovisioned { op, error: None });
    freed.extend(done);
    let p = provisioned(&freed);
    assert_eq!(p.len(), 1, "{freed:#?}");
    // Served like any waiter, with a fresh token: its Secret's is not one our key server issued.
    assert_eq!(
        (p[0].0.as_str(), p[0].1.as_str(), p[0].3),
        ("f", "h1", false)
    );
}

#[test]
fn only_a_proven_secrets_token_is_rearmed() {
    let (mut h, _) = start(
        &static_pairs(&[("h1", 2)]),
        Snapshot {
            taskruns: vec![served("a", S390X, "h1"), claimed("b", S390X, "h1")],
            instances: vec![],
            ..Default::default()
        },
    );
    let a = provisioned(&retry(&mut h, "a", S390X));
    let b = provisioned(&retry(&mut h, "b", S390X));
    assert_eq!(a, [("a".into(), "h1".into(), "10.0.0.1".into(), true)]);
    assert_eq!(b, [("b".into(), "h1".into(), "10.0.0.1".into(), false)]);
}

#[test]
fn a_finished_taskrun_naming_a_shared_pool_instance_does_not_terminate_it() {
    let pool = instance("i-p", Some("warm-1700000000000-1"), START - 600);
    let mut forged = rec("f", ARM);
    forged.finished = true;
    forged.instance_id = Some("i-p".into());
    forged.assigned_host = Some("i-p".into());
    let (_, out) = start(
        &dynamic_pairs(2, Some((2, 600))),
        Snapshot {
            taskruns: vec![served("a", ARM, "i-p"), forged],
            instances: vec![pool],
            ..Default::default()
        },
    );
    assert!(terminates(&out).is_empty(), "{out:#?}");
    assert!(
        out.iter().any(|x| matches!(x,
            Action::Notify { reason: "NotItsInstance", taskrun: Some(t), .. } if t.name() == "f")),
        "{out:#?}"
    );
}

#[test]
fn a_live_taskrun_naming_a_shared_pool_instance_does_not_become_its_owner() {
    let pool = instance("i-p", Some("warm-1700000000000-1"), START - 600);
    let mut forged = claimed("f", ARM, "i-p");
    forged.instance_id = Some("i-p".into());
    let (mut h, _) = start(
        &dynamic_pairs(2, Some((2, 600))),
        Snapshot {
            taskruns: vec![served("a", ARM, "i-p"), forged],
            instances: vec![pool],
            ..Default::default()
        },
    );
    let done = h.done("ns", "f");
    assert!(terminates(&done).is_empty(), "{done:#?}");
    // Only its own user is removed; a's build goes on.
    let d = deprovisions(&done);
    assert_eq!(d.len(), 1, "{done:#?}");
    assert_eq!(d[0].2, "i-p");
}

#[test]
fn a_forged_secret_and_cloud_address_do_not_steer_provisioning() {
    let victim = TaskRunRecord {
        instance_id: Some("i-v".into()),
        ..served("v", ARM, "i-v")
    };
    // Two tenants' TaskRuns as recovery reads them from the cluster: one names the victim's
    // instance, one an instance the cloud does not list, both with an address of their choosing
    // and a Secret of their own making.
    let forge = |name: &str, id: &str| {
        let mut r = rec(name, ARM);
        r.read_metadata(
            &BTreeMap::from([(contract::ASSIGNED_HOST_LABEL.to_owned(), id.to_owned())]),
            &BTreeMap::from([
                (
                    contract::CLOUD_INSTANCE_ID_ANNOTATION.to_owned(),
                    id.to_owned(),
                ),
                (
                    contract::CLOUD_ADDRESS_ANNOTATION.to_owned(),
                    "203.0.113.66".to_owned(),
                ),
            ]),
        );
        r.secret = Some(SecretKind::Remote);
        r
    };
    let (mut h, out) = start(
        &dynamic_pairs(4, None),
        Snapshot {
            taskruns: vec![victim, forge("f", "i-v"), forge("g", "i-unlisted")],
            instances: vec![instance("i-v", Some("uid-ns-v"), START - 600)],
            ..Default::default()
        },
    );
    let launched = launches(&out).len();
    let mut acts = out;
    acts.extend(retry(&mut h, "f", ARM));
    acts.extend(retry(&mut h, "g", ARM));
    acts.extend(retry(&mut h, "v", ARM));
    let p = provisioned(&acts);
    assert!(
        p.iter().all(|p| p.2 != "203.0.113.66"),
        "provisioning at the tenant's address: {p:?}"
    );
    // The victim's retry provisions its own instance at the listed address.
    assert_eq!(p, [("v".into(), "i-v".into(), "192.0.2.9".into(), true)]);
    // Both tenants start over on instances of their own.
    assert_eq!(launched, 2);
    // The victim's instance is the victim's: nobody else's end terminates it.
    assert!(terminates(&h.done("ns", "f")).is_empty());
    assert_eq!(terminates(&h.done("ns", "v"))[0].1, "i-v");
}

#[test]
fn a_creators_allocation_start_time_cannot_put_it_ahead_of_older_taskruns() {
    let mut older = rec("older", S390X);
    older.waiting = true;
    older.since = Time::from_secs(START - 100);
    // Created after it, annotated `allocation-start-time: 1`.
    let mut jumper = rec("jumper", S390X);
    jumper.since = Time::from_secs(START - 50);
    jumper.read_metadata(
        &BTreeMap::from([(
            contract::WAITING_FOR_PLATFORM_LABEL.to_owned(),
            "linux-s390x".to_owned(),
        )]),
        &BTreeMap::from([(
            contract::ALLOCATION_START_TIME_ANNOTATION.to_owned(),
            "1".to_owned(),
        )]),
    );
    assert_eq!(jumper.since, Time::from_secs(START - 50));
    let (_, out) = start(
        &static_pairs(&[("h1", 1)]),
        Snapshot {
            taskruns: vec![jumper, older],
            instances: vec![],
            ..Default::default()
        },
    );
    let p = provisioned(&out);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].0, "older");
}

#[test]
fn go_era_allocations_that_check_out_are_adopted() {
    // The Go controller's secrets carry no proof; its static allocation and its instance (tagged
    // `taskRunID=<namespace>:<name>`, no cluster tag) are confirmed by the config and the listing.
    let mut on_instance = claimed("g2", ARM, "i-go");
    on_instance.instance_id = Some("i-go".into());
    let go_instance = InstanceRecord {
        ownership: Ownership::Untagged,
        platform_label: None,
        owner: None,
        taskrun_id: Some("ns:g2".into()),
        ..instance("i-go", None, START - 600)
    };
    let (mut h, out) = start(
        &mixed(&[("h1", 1)], 1),
        Snapshot {
            taskruns: vec![claimed("g1", S390X, "h1"), on_instance],
            instances: vec![go_instance],
            ..Default::default()
        },
    );
    assert!(provisioned(&out).is_empty(), "{out:#?}");
    assert!(secret(&out, "g1").is_none() && secret(&out, "g2").is_none());
    assert!(
        launches(&out).is_empty(),
        "i-go fills max-instances: {out:#?}"
    );
    // Both hold their capacity: newcomers wait.
    let w = h.submit("ns", "w", S390X);
    let x = h.submit("ns", "x", ARM);
    assert!(provisioned(&w).is_empty() && launches(&x).is_empty());
    // g2's end terminates the Go instance it owned.
    let t: Vec<_> = h
        .done("ns", "g2")
        .into_iter()
        .filter_map(|a| match a {
            Action::Terminate {
                instance_id,
                legacy,
                ..
            } => Some((instance_id.to_string(), legacy)),
            _ => None,
        })
        .collect();
    assert_eq!(t, [("i-go".to_owned(), true)]);
}

#[test]
fn a_go_era_instance_is_adopted_only_by_the_taskrun_its_tag_names() {
    let mut forged = claimed("f", ARM, "i-go");
    forged.instance_id = Some("i-go".into());
    let go_instance = InstanceRecord {
        ownership: Ownership::Untagged,
        platform_label: None,
        owner: None,
        taskrun_id: Some("ns:someone-else".into()),
        ..instance("i-go", None, START - 600)
    };
    let (mut h, out) = start(
        &dynamic_pairs(2, None),
        Snapshot {
            taskruns: vec![forged],
            instances: vec![go_instance],
            ..Default::default()
        },
    );
    // f starts over on an instance of its own (i-go still counts toward max-instances).
    assert_eq!(launches(&out).len(), 1, "{out:#?}");
    assert!(
        records(&out, "f")
            .iter()
            .all(|p| p.instance_id.as_deref() != Some("i-go")),
        "{out:#?}"
    );
    // i-go is never touched: not f's to terminate, not ours to orphan.
    let mut acts = h.done("ns", "f");
    acts.extend(h.wait(3600));
    assert!(terminates(&acts).iter().all(|t| t.1 != "i-go"), "{acts:#?}");
}

#[test]
fn a_go_era_pool_instance_is_adopted_only_through_a_taskrun_of_its_platform() {
    let mut pairs = dynamic_pairs(2, Some((2, 600)));
    pairs.extend(static_pairs(&[("h1", 1)]));
    let go_pool_instance = || InstanceRecord {
        ownership: Ownership::Untagged,
        platform_label: None,
        owner: None,
        ..instance("i-gp", None, START - 600)
    };
    // An s390x TaskRun naming the Go controller's arm64 pool instance.
    let (mut h, out) = start(
        &pairs,
        Snapshot {
            taskruns: vec![claimed("f", S390X, "i-gp")],
            instances: vec![go_pool_instance()],
            ..Default::default()
        },
    );
    let mut acts = out;
    acts.extend(h.wait(0));
    acts.extend(h.done("ns", "f"));
    acts.extend(h.wait(3 * 3600));
    assert!(
        probes(&acts).iter().all(|p| p.1 != "i-gp") && terminates(&acts).is_empty(),
        "not ours to manage: {acts:#?}"
    );
    // An arm64 TaskRun the Go controller placed on it: adopted with its pool instance.
    let (mut h, _) = start(
        &pairs,
        Snapshot {
            taskruns: vec![claimed("g", ARM, "i-gp")],
            instances: vec![go_pool_instance()],
            ..Default::default()
        },
    );
    assert_eq!(probes(&h.wait(0))[0].1, "i-gp");
}
