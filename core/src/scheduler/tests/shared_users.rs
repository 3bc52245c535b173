//! Go-compatible user names collide across namespaces (`md5(name + namespace)`, no separator):
//! two live TaskRuns with one user name never share a host or instance.

use super::*;

/// `build-x1` in `team-a` and `build-x` in `1team-a`: one user name.
const A: (&str, &str) = ("team-a", "build-x1");
const B: (&str, &str) = ("1team-a", "build-x");

#[test]
fn static_host_takes_the_second_only_after_the_first_is_cleaned_up() {
    const P: &str = "linux/s390x";
    assert_eq!(
        crate::contract::remote_user_name(A.1, A.0),
        crate::contract::remote_user_name(B.1, B.0),
        "the pair shares a user name"
    );
    let mut h = H::new(&static_pairs(&[("h1", 4)]));
    let op = provision_op(&h.submit(A.0, A.1, P), A.1);
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    // The host has room, but its user is A's.
    let a = h.submit(B.0, B.1, P);
    assert!(provisions(&a).is_empty(), "{a:#?}");
    assert_eq!(
        records(&a, B.1)[0].waiting_for_platform.as_deref(),
        Some("linux-s390x")
    );
    // Another namespace's TaskRun is not held up behind it.
    assert_eq!(provisions(&h.submit("ns", "other", P)).len(), 1);
    // A finishes: its user's removal is in flight, B still waits.
    let a = h.done(A.0, A.1);
    let d = deprovisions(&a);
    assert_eq!(d.len(), 1);
    assert!(provisions(&a).is_empty(), "{a:#?}");
    // Removed: B goes to the host in the same step.
    let a = h.send(Event::Deprovisioned {
        op: d[0].0,
        error: None,
    });
    let p = provisions(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), (B.1, "h1"));
}

#[test]
fn static_pool_places_the_second_on_another_host_at_once() {
    const P: &str = "linux/s390x";
    let mut h = H::new(&static_pairs(&[("h1", 4), ("h2", 4)]));
    let p = provisions(&h.submit(A.0, A.1, P));
    assert_eq!(p[0].2, "h1");
    let p = provisions(&h.submit("ns", "other", P));
    assert_eq!(p[0].2, "h2");
    // Equal load: h1 would be next (by name).
    let p = provisions(&h.submit(B.0, B.1, P));
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].2, "h2", "not on h1, where A's user lives");
}

#[test]
fn failed_cleanup_retries_keep_the_host_off_until_given_up() {
    const P: &str = "linux/s390x";
    let mut h = H::new(&static_pairs(&[("h1", 4)]));
    let op = provision_op(&h.submit(A.0, A.1, P), A.1);
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    h.submit(B.0, B.1, P);
    let mut d = deprovisions(&h.done(A.0, A.1));
    let mut failures = 0;
    loop {
        assert_eq!(d.len(), 1, "one removal in flight");
        let a = h.send(Event::Deprovisioned {
            op: d[0].0,
            error: Some("ssh: connection refused".into()),
        });
        failures += 1;
        let p = provisions(&a);
        if !p.is_empty() {
            assert_eq!(p[0].1, B.1);
            break;
        }
        assert!(failures < h.s.policy().cleanup_attempts, "{a:#?}");
        // The retry is due later; B still waits meanwhile.
        let a = h.wait(600);
        assert!(provisions(&a).is_empty(), "{a:#?}");
        d = deprovisions(&a);
    }
    assert_eq!(failures, h.s.policy().cleanup_attempts);
}

#[test]
fn pool_instance_takes_the_second_only_after_the_first_is_cleaned_up() {
    const P: &str = "linux/arm64";
    // One instance at most, four slots.
    let mut h = H::new(&dynamic_pairs(1, Some((4, 600))));
    let l = launches(&h.submit(A.0, A.1, P))[0].0;
    let op = provision_op(&boot(&mut h, l, "i-1"), A.1);
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
    let a = h.submit(B.0, B.1, P);
    assert!(
        provisions(&a).is_empty() && launches(&a).is_empty(),
        "{a:#?}"
    );
    let a = h.done(A.0, A.1);
    let d = deprovisions(&a);
    assert_eq!(d.len(), 1);
    assert!(provisions(&a).is_empty(), "{a:#?}");
    let a = h.send(Event::Deprovisioned {
        op: d[0].0,
        error: None,
    });
    let p = provisions(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    assert_eq!((p[0].1.as_str(), p[0].2.as_str()), (B.1, "i-1"));
}
