//! Mac dedicated hosts: after an instance terminates its host is scrubbed (about 50 min) and
//! takes no launch meanwhile, so the instance's `max-instances` slot stays taken for the scrub.

use super::*;

const MAC: &str = "macos-m2/arm64";

/// A macOS dynamic platform, with the dedicated-host keys (and `host-scrub` minutes) or without.
fn mac_pairs(max: u32, dedicated: bool, scrub: Option<u32>) -> Vec<(String, String)> {
    let label = "macos-m2-arm64";
    let mut v = vec![kv("dynamic-platforms", MAC), kv("instance-tag", "test")];
    let mut fields = vec![
        ("type", "aws".to_owned()),
        ("region", "us-east-1".to_owned()),
        ("ami", "ami-0123456789abcdef0".to_owned()),
        ("instance-type", "mac2-m2.metal".to_owned()),
        ("key-name", "kp".to_owned()),
        ("aws-secret", "aws-account".to_owned()),
        ("ssh-secret", "aws-ssh".to_owned()),
        ("max-instances", max.to_string()),
    ];
    if dedicated {
        fields.extend([
            ("tenancy", "host".to_owned()),
            (
                "host-resource-group-arn",
                "arn:aws:resource-groups:us-east-1:1:group/mac".to_owned(),
            ),
            (
                "license-configuration-arn",
                "arn:aws:license-manager:us-east-1:1:license-configuration:lic-1".to_owned(),
            ),
        ]);
    }
    if let Some(m) = scrub {
        fields.push(("host-scrub", m.to_string()));
    }
    for (f, val) in fields {
        v.push(kv(&format!("dynamic.{label}.{f}"), &val));
    }
    v
}

/// `a` launched on i-1 and served there.
fn serve_a(h: &mut H) {
    let l = launches(&h.submit("ns", "a", MAC));
    assert_eq!(l.len(), 1);
    let op = provision_op(&boot(h, l[0].0, "i-1"), "a");
    h.send(Event::Provisioned {
        op,
        otp: "t".into(),
    });
}

/// `a` finishes and its termination is acknowledged: the actions of the acknowledgement.
fn end_a(h: &mut H) -> Vec<Action> {
    let t = terminates(&h.done("ns", "a"));
    assert_eq!(t.len(), 1);
    h.send(Event::Terminated {
        op: t[0].0,
        error: None,
    })
}

#[test]
fn a_terminated_mac_instance_keeps_its_slot_while_its_host_is_scrubbed() {
    let mut h = H::new(&mac_pairs(1, true, None));
    serve_a(&mut h);
    let a = h.submit("ns", "b", MAC);
    assert!(launches(&a).is_empty(), "max-instances 1 is taken by a");
    let a = end_a(&mut h);
    assert!(
        launches(&a).is_empty(),
        "launched into a host still being scrubbed: {a:#?}"
    );
    assert!(secret(&a, "b").is_none());
    assert_eq!(h.s.gauges().platforms[MAC].scrubbing, 1);
    // Still scrubbing a minute before the 50 are up; b launches when they are.
    assert!(launches(&h.wait(49 * 60)).is_empty());
    let a = h.wait(60);
    assert_eq!(launches(&a).len(), 1, "{a:#?}");
    assert_eq!(h.s.gauges().platforms[MAC].scrubbing, 0);
}

#[test]
fn host_scrub_sets_the_hold_and_0_turns_it_off() {
    let mut h = H::new(&mac_pairs(1, true, Some(10)));
    serve_a(&mut h);
    assert!(launches(&h.submit("ns", "b", MAC)).is_empty());
    assert!(launches(&end_a(&mut h)).is_empty());
    assert_eq!(launches(&h.wait(10 * 60)).len(), 1);

    let mut h = H::new(&mac_pairs(1, true, Some(0)));
    serve_a(&mut h);
    assert!(launches(&h.submit("ns", "b", MAC)).is_empty());
    assert_eq!(launches(&end_a(&mut h)).len(), 1);
}

#[test]
fn without_dedicated_host_keys_or_the_policy_the_slot_frees_at_termination() {
    let mut h = H::new(&mac_pairs(1, false, None));
    serve_a(&mut h);
    assert!(launches(&h.submit("ns", "b", MAC)).is_empty());
    assert_eq!(launches(&end_a(&mut h)).len(), 1);

    // The Go controller's timing (`mpc simulate`'s mpc-go) frees it at termination.
    assert!(!Policy::mpc_go().hold_scrubbing_hosts);
    let policy = Policy {
        hold_scrubbing_hosts: false,
        ..Policy::mpc()
    };
    let mut h = H::with_policy(&mac_pairs(1, true, None), policy);
    serve_a(&mut h);
    assert!(launches(&h.submit("ns", "b", MAC)).is_empty());
    assert_eq!(launches(&end_a(&mut h)).len(), 1);
}

#[test]
fn scrubbing_slots_count_against_max_instances_one_each() {
    let mut h = H::new(&mac_pairs(2, true, None));
    // a on i-1 ends (its host scrubs); c gets the other slot; d waits for the scrub.
    serve_a(&mut h);
    assert!(launches(&end_a(&mut h)).is_empty());
    assert_eq!(launches(&h.submit("ns", "c", MAC)).len(), 1);
    assert!(launches(&h.submit("ns", "d", MAC)).is_empty());
    assert_eq!(launches(&h.wait(50 * 60)).len(), 1);
}
