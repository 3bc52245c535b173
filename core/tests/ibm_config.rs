//! IBM Cloud dynamic platforms (`type: ibmz`, `type: ibmp`) in the host-config: every key the Go
//! controller reads, its defaults, Go's validation rules, and the historic infra-deployments
//! configs as fixtures.

use mpc_core::config::ibm::{self, IbmService};
use mpc_core::config::{ConfigData, Diagnostic, Parsed, Severity, parse, read_configmap_yaml};
use mpc_core::platform::Platform;

fn p(s: &str) -> Platform {
    Platform::parse(s).unwrap()
}

fn fixture(name: &str) -> (ConfigData, Parsed) {
    let path = format!(
        "{}/tests/fixtures/configmaps/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    let (d, _) = read_configmap_yaml(&text).unwrap();
    let parsed = parse(&d);
    (d, parsed)
}

fn data(pairs: &[(&str, &str)]) -> ConfigData {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn errors<'a>(parsed: &'a Parsed, key: &str) -> Vec<&'a Diagnostic> {
    parsed
        .of(Severity::Error)
        .filter(|d| d.key == key)
        .collect()
}

fn warnings<'a>(parsed: &'a Parsed, key: &str) -> Vec<&'a Diagnostic> {
    parsed
        .of(Severity::Warning)
        .filter(|d| d.key == key)
        .collect()
}

/// A clean ibmz group (every key set) and a clean ibmp group.
fn clean() -> Vec<(&'static str, &'static str)> {
    vec![
        ("dynamic-platforms", "linux/s390x,linux/ppc64le"),
        ("dynamic.linux-s390x.type", "ibmz"),
        ("dynamic.linux-s390x.ssh-secret", "ibm-s390x-ssh-key"),
        ("dynamic.linux-s390x.secret", "ibm-api-key"),
        ("dynamic.linux-s390x.vpc", "vpc-a"),
        ("dynamic.linux-s390x.key", "key-a"),
        ("dynamic.linux-s390x.subnet", "subnet-a"),
        ("dynamic.linux-s390x.image-id", "r014-ecc81939"),
        ("dynamic.linux-s390x.region", "us-east-1"),
        (
            "dynamic.linux-s390x.url",
            "https://us-east.iaas.cloud.ibm.com/v1",
        ),
        ("dynamic.linux-s390x.profile", "bz2-1x4"),
        ("dynamic.linux-s390x.private-ip", "true"),
        ("dynamic.linux-s390x.user", "cloud-user"),
        ("dynamic.linux-s390x.instance-tag", "stage-s390x"),
        ("dynamic.linux-s390x.max-instances", "2"),
        ("dynamic.linux-ppc64le.type", "ibmp"),
        ("dynamic.linux-ppc64le.ssh-secret", "ibm-ppc64le-ssh-key"),
        ("dynamic.linux-ppc64le.secret", "ibm-api-key"),
        ("dynamic.linux-ppc64le.key", "konflux-infra"),
        ("dynamic.linux-ppc64le.image", "RHEL9-SP2"),
        (
            "dynamic.linux-ppc64le.crn",
            "crn:v1:bluemix:public:power-iaas:wdc06:a/5cb0704ee6304413bd0b171372c0fd77:4e9dc638-7a78-4e7c-b432-e83b7010c531::",
        ),
        (
            "dynamic.linux-ppc64le.url",
            "https://us-east.power-iaas.cloud.ibm.com",
        ),
        ("dynamic.linux-ppc64le.network", "net-1, net-2"),
        ("dynamic.linux-ppc64le.system", "e980"),
        ("dynamic.linux-ppc64le.instance-tag", "stage-ppc64le"),
        ("dynamic.linux-ppc64le.max-instances", "2"),
    ]
}

#[test]
fn clean_ibm_platforms_parse_with_go_defaults_and_are_served() {
    let d = data(&clean());
    let parsed = parse(&d);
    for platform in ["linux/s390x", "linux/ppc64le"] {
        assert!(
            !parsed.config.disabled.contains_key(&p(platform)),
            "{:#?}",
            parsed.config.disabled
        );
        let t = &parsed.config.dynamic[&p(platform)];
        assert_eq!(t.cloud, mpc_core::config::CloudKind::Ibm);
        assert_eq!(t.aws_secret, "ibm-api-key", "the API key Secret");
    }
    let z = &parsed.config.dynamic[&p("linux/s390x")];
    assert_eq!(z.user, "cloud-user");
    assert_eq!(z.instance_tag, "stage-s390x");
    assert!(matches!(&z.ibm, Some(IbmService::Vpc(v)) if v.zone == "us-east-1"));
    let pw = &parsed.config.dynamic[&p("linux/ppc64le")];
    assert!(matches!(&pw.ibm, Some(IbmService::Power(_))));
    // Probe lookups batch per endpoint and workspace: one endpoint serves many workspaces.
    assert!(
        pw.region
            .ends_with("/pcloud/v1/cloud-instances/4e9dc638-7a78-4e7c-b432-e83b7010c531"),
        "{}",
        pw.region
    );
    assert_eq!(pw.disk_gb, 100);
    // check-config says how the instances are reached.
    let rows = parsed.config.summaries();
    let row = rows
        .iter()
        .find(|r| r.platform == p("linux/s390x"))
        .expect("a report row");
    assert!(
        row.capacity.contains("private addresses only")
            && row.capacity.contains("login cloud-user"),
        "{}",
        row.capacity
    );
    // No errors, and no key is unknown.
    let errs: Vec<_> = parsed.of(Severity::Error).collect();
    assert!(errs.is_empty(), "{errs:#?}");
    assert!(
        parsed
            .diagnostics
            .iter()
            .all(|d| !d.message.contains("unknown field") && !d.message.contains("not a ib")),
        "{:#?}",
        parsed.diagnostics
    );

    let (z, diags) = ibm::parse_platform(&p("linux/s390x"), &d, false);
    let z = z.unwrap_or_else(|| panic!("{diags:#?}"));
    let IbmService::Vpc(vpc) = &z.service else {
        panic!("ibmz is VPC")
    };
    assert_eq!(vpc.zone, "us-east-1");
    assert_eq!(vpc.disk_gb, 100);
    assert!(vpc.private_ip);
    assert_eq!(z.user, "cloud-user");
    assert_eq!(z.api_key_secret, "ibm-api-key");
    assert_eq!(z.instance_tag, "stage-s390x");
    assert_eq!(z.allocation_timeout_secs, 600);

    let (pw, diags) = ibm::parse_platform(&p("linux/ppc64le"), &d, false);
    let pw = pw.unwrap_or_else(|| panic!("{diags:#?}"));
    let IbmService::Power(power) = &pw.service else {
        panic!("ibmp is Power VS")
    };
    assert_eq!(
        power.crn.cloud_instance_id(),
        "4e9dc638-7a78-4e7c-b432-e83b7010c531"
    );
    assert_eq!(power.networks, ["net-1", "net-2"]);
    assert_eq!(power.cores, 0.25);
    assert_eq!(power.memory_gb, 2.0);
    assert_eq!(power.disk_gb, 100);
    assert_eq!(power.user_data, None);
    assert_eq!(pw.user, "root");
}

#[test]
fn ibmp_disk_is_never_below_100_and_bad_numbers_are_errors_not_defaults() {
    let mut pairs = clean();
    pairs.push(("dynamic.linux-ppc64le.disk", "20"));
    pairs.push(("dynamic.linux-ppc64le.cores", "2"));
    pairs.push(("dynamic.linux-ppc64le.memory", "8"));
    pairs.push(("dynamic.linux-s390x.disk", "250"));
    let d = data(&pairs);
    let (pw, _) = ibm::parse_platform(&p("linux/ppc64le"), &d, false);
    let IbmService::Power(power) = pw.unwrap().service else {
        panic!()
    };
    assert_eq!(
        (power.disk_gb, power.cores, power.memory_gb),
        (100, 2.0, 8.0)
    );
    let parsed = parse(&d);
    assert_eq!(warnings(&parsed, "dynamic.linux-ppc64le.disk").len(), 1);
    let (z, _) = ibm::parse_platform(&p("linux/s390x"), &d, false);
    let IbmService::Vpc(vpc) = z.unwrap().service else {
        panic!()
    };
    assert_eq!(vpc.disk_gb, 250);

    let mut pairs = clean();
    pairs.push(("dynamic.linux-ppc64le.cores", "a quarter"));
    let parsed = parse(&data(&pairs));
    let e = errors(&parsed, "dynamic.linux-ppc64le.cores");
    assert_eq!(e.len(), 1, "{:#?}", parsed.diagnostics);
    assert!(
        parsed.config.disabled[&p("linux/ppc64le")].contains("not a positive number"),
        "the first error, not the unavailability, is the reason"
    );
}

#[test]
fn bad_crn_is_rejected_with_gos_reason() {
    for (crn, why) in [
        ("crm:v1:x", "must start with 'crn:'"),
        (
            "crn:v1:bluemix:public:power-iaas:wdc06",
            "expected 10 segments, but got 6",
        ),
        (
            "crn:v1:bluemix:public:is:us-east:a/1:inst::",
            "expected 'power-iaas', but got 'is'",
        ),
    ] {
        let mut pairs = clean();
        pairs.retain(|(k, _)| *k != "dynamic.linux-ppc64le.crn");
        pairs.push(("dynamic.linux-ppc64le.crn", crn));
        let parsed = parse(&data(&pairs));
        let e = errors(&parsed, "dynamic.linux-ppc64le.crn");
        assert_eq!(e.len(), 1, "{crn}: {:#?}", parsed.diagnostics);
        assert!(e[0].message.contains(why), "{crn}: {}", e[0].message);
    }
}

#[test]
fn ibm_ssh_secret_must_name_the_architecture() {
    let mut pairs = clean();
    pairs.retain(|(k, _)| !k.ends_with(".ssh-secret"));
    pairs.push(("dynamic.linux-s390x.ssh-secret", "ibm-ppc64le-ssh-key"));
    pairs.push(("dynamic.linux-ppc64le.ssh-secret", "ibm-ssh-key"));
    let parsed = parse(&data(&pairs));
    for platform in ["linux-s390x", "linux-ppc64le"] {
        let e = errors(&parsed, &format!("dynamic.{platform}.ssh-secret"));
        assert_eq!(e.len(), 1, "{:#?}", parsed.diagnostics);
        assert!(
            e[0].message
                .contains("host secret key and value must contain matching platform substring"),
            "{}",
            e[0].message
        );
    }
}

#[test]
fn go_instance_tag_rule_is_explained_for_every_dynamic_platform_aws_too() {
    let aws = |label: &str, tag: &str| -> Vec<(String, String)> {
        [
            ("type", "aws"),
            ("region", "us-east-1"),
            ("ami", "ami-1"),
            ("instance-type", "m6g.large"),
            ("key-name", "kp"),
            ("aws-secret", "aws"),
            ("ssh-secret", "ssh"),
            ("max-instances", "3"),
            ("instance-tag", tag),
        ]
        .iter()
        .map(|(f, v)| (format!("dynamic.{label}.{f}"), (*v).to_owned()))
        .collect()
    };
    let mut d: ConfigData = aws("linux-arm64", "prod-amd64").into_iter().collect();
    d.extend(aws("linux-m2xlarge-arm64", "prod-arm64-m2xlarge"));
    d.extend(aws("linux-c4xlarge-amd64", "prod-amd64-c8xlarge"));
    d.extend(aws("linux-d160-m4xlarge-amd64", "prod-amd64-m4xlarge-d160"));
    d.insert(
        "dynamic-platforms".into(),
        "linux/arm64,linux-m2xlarge/arm64,linux-d160-m4xlarge/amd64".into(),
    );
    d.insert(
        "dynamic-pool-platforms".into(),
        "linux-c4xlarge/amd64".into(),
    );
    d.insert(
        "dynamic.linux-c4xlarge-amd64.concurrency".into(),
        "2".into(),
    );
    let parsed = parse(&d);
    // Production EC2 platforms break the rule, so for EC2 it is a warning that says what Go does.
    let w = warnings(&parsed, "dynamic.linux-arm64.instance-tag");
    assert_eq!(w.len(), 1, "{:#?}", parsed.diagnostics);
    assert!(
        w[0].message
            .contains("platform mismatch: key has 'arm64', value has 'amd64'")
            && w[0]
                .message
                .contains("the Go controller disables this platform"),
        "{}",
        w[0].message
    );
    let w = warnings(&parsed, "dynamic.linux-c4xlarge-amd64.instance-tag");
    assert!(
        w[0].message
            .contains("instance type mismatch: key has 'c4xlarge', value has 'c8xlarge'"),
        "{}",
        w[0].message
    );
    assert!(parsed.config.dynamic.contains_key(&p("linux/arm64")));
    assert!(parsed.config.pools.contains_key(&p("linux-c4xlarge/amd64")));
    // Matching tags (instance-type parts in any order) get no word.
    for label in ["linux-m2xlarge-arm64", "linux-d160-m4xlarge-amd64"] {
        assert!(
            warnings(&parsed, &format!("dynamic.{label}.instance-tag")).is_empty(),
            "{label}"
        );
    }
    assert_eq!(
        parsed.of(Severity::Error).count(),
        0,
        "{:#?}",
        parsed.diagnostics
    );
}

#[test]
fn ibm_instance_tag_rule_disables_the_ibm_platform() {
    let mut pairs = clean();
    pairs.retain(|(k, _)| *k != "dynamic.linux-ppc64le.instance-tag");
    pairs.push(("dynamic.linux-ppc64le.instance-tag", "stage-s390x"));
    let parsed = parse(&data(&pairs));
    let e = errors(&parsed, "dynamic.linux-ppc64le.instance-tag");
    assert_eq!(e.len(), 1, "{:#?}", parsed.diagnostics);
    assert!(
        parsed.config.disabled[&p("linux/ppc64le")]
            .contains("platform mismatch: key has 'ppc64le', value has 's390x'")
    );
}

#[test]
fn ibm_tag_length_limits_and_user_and_floating_ip_warnings() {
    let mut pairs = clean();
    pairs.retain(|(k, _)| !k.ends_with(".instance-tag") && !k.ends_with(".private-ip"));
    pairs.retain(|(k, _)| *k != "dynamic.linux-s390x.user");
    // A 30-character global tag fits s390x names (45) but not Power VS names (29).
    pairs.push(("instance-tag", "a-very-long-cluster-tag-123456"));
    let parsed = parse(&data(&pairs));
    let e = errors(&parsed, "instance-tag");
    assert_eq!(e.len(), 1, "{:#?}", parsed.diagnostics);
    assert!(e[0].message.contains("(max 29)"), "{}", e[0].message);
    assert!(parsed.config.disabled[&p("linux/ppc64le")].contains("max 29"));
    assert!(parsed.config.dynamic.contains_key(&p("linux/s390x")));
    let w = warnings(&parsed, "dynamic.linux-s390x.user");
    assert!(w[0].message.contains("2026-01-19"), "{w:#?}");
    let w = warnings(&parsed, "dynamic.linux-s390x.private-ip");
    assert!(
        w[0].message.contains("floating IPs are not supported"),
        "{w:#?}"
    );
}

#[test]
fn ibmp_pool_needs_concurrency_and_misplaced_keys_are_explained() {
    let mut pairs = clean();
    pairs.retain(|(k, _)| *k != "dynamic-platforms");
    pairs.push(("dynamic-platforms", "linux/s390x"));
    pairs.push(("dynamic-pool-platforms", "linux/ppc64le"));
    pairs.push(("dynamic.linux-s390x.user-data", "#cloud-config"));
    pairs.push(("dynamic.linux-s390x.ami", "ami-1"));
    let parsed = parse(&data(&pairs));
    assert_eq!(
        errors(&parsed, "dynamic.linux-ppc64le.concurrency").len(),
        1,
        "{:#?}",
        parsed.diagnostics
    );
    assert!(
        warnings(&parsed, "dynamic.linux-s390x.user-data")[0]
            .message
            .contains("no user-data")
    );
    assert!(
        warnings(&parsed, "dynamic.linux-s390x.ami")[0]
            .message
            .contains("not a ibmz field")
    );
}

#[test]
fn historic_infra_deployments_ibm_configs_fail_as_go_fails_them() {
    let (d, parsed) = fixture("ibm-infra-deployments.yaml");
    for label in ["linux-s390x", "linux-ppc64le", "linux-large-s390x"] {
        let e = errors(&parsed, &format!("dynamic.{label}.ssh-secret"));
        assert_eq!(e.len(), 1, "{label}: {:#?}", parsed.diagnostics);
    }
    for platform in ["linux/s390x", "linux/ppc64le", "linux-large/s390x"] {
        let reason = &parsed.config.disabled[&p(platform)];
        assert!(
            reason.contains("must contain matching platform substring"),
            "{platform}: {reason}"
        );
    }
    // With architecture-named secrets the same groups parse completely.
    let mut fixed = d.clone();
    for (k, v) in fixed.iter_mut() {
        if k.ends_with(".ssh-secret") {
            let arch = if k.contains("ppc64le") {
                "ppc64le"
            } else {
                "s390x"
            };
            *v = format!("{v}-{arch}");
        }
    }
    for platform in ["linux/s390x", "linux/ppc64le", "linux-large/s390x"] {
        let (parsed, diags) = ibm::parse_platform(&p(platform), &fixed, false);
        assert!(parsed.is_some(), "{platform}: {diags:#?}");
    }
    let parsed = parse(&fixed);
    assert_eq!(
        parsed.of(Severity::Error).count(),
        0,
        "{:#?}",
        parsed.diagnostics
    );
    for platform in ["linux/s390x", "linux/ppc64le", "linux-large/s390x"] {
        assert!(
            parsed.config.dynamic.contains_key(&p(platform)),
            "{platform}"
        );
    }
}
