use super::*;

use std::time::Duration;

use crate::platform::Platform;

fn data(pairs: &[(&str, &str)]) -> ConfigData {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn p(s: &str) -> Platform {
    Platform::parse(s).unwrap()
}

fn fixture(name: &str) -> Parsed {
    let path = format!(
        "{}/tests/fixtures/configmaps/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    let (d, mut diags) = read_configmap_yaml(&text).unwrap();
    let mut parsed = parse(&d);
    diags.append(&mut parsed.diagnostics);
    parsed.diagnostics = diags;
    parsed
}

fn dynamic_keys(label: &str) -> Vec<(String, String)> {
    [
        ("type", "aws"),
        ("region", "us-east-1"),
        ("ami", "ami-1"),
        ("instance-type", "m6g.large"),
        ("key-name", "kp"),
        ("aws-secret", "aws"),
        ("ssh-secret", "ssh"),
        ("max-instances", "3"),
    ]
    .iter()
    .map(|(f, v)| (format!("dynamic.{label}.{f}"), (*v).to_owned()))
    .collect()
}

fn with(mut base: Vec<(String, String)>, extra: &[(&str, &str)]) -> ConfigData {
    base.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    base.into_iter().collect()
}

fn errors_for<'a>(parsed: &'a Parsed, key: &str) -> Vec<&'a Diagnostic> {
    parsed
        .of(Severity::Error)
        .filter(|d| d.key == key)
        .collect()
}

#[test]
fn production_like_fixture_parses_cleanly() {
    let parsed = fixture("production-like.yaml");
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let c = &parsed.config;
    assert_eq!(
        c.local,
        [p("linux/x86_64"), p("local"), p("localhost")].into()
    );
    assert_eq!(c.dynamic.len(), 4);
    let arm = &c.dynamic[&p("linux/arm64")];
    assert_eq!(arm.max_instances, 250);
    assert_eq!(arm.instance_tag, "prod-arm64");
    assert_eq!(arm.disk_gb, DEFAULT_DISK_GB);
    assert_eq!(arm.allocation_timeout, DEFAULT_ALLOCATION_TIMEOUT);
    assert_eq!(
        arm.security_group_id.as_deref(),
        Some("sg-0759f4a43faada557")
    );
    let mlarge = &c.dynamic[&p("linux-mlarge/arm64")];
    assert_eq!(
        mlarge.instance_tag, "example-prod",
        "falls back to the global tag"
    );
    assert_eq!(mlarge.disk_gb, 160);
    let ud = mlarge.user_data.as_deref().unwrap();
    assert!(ud.starts_with("Content-Type: multipart/mixed"));
    assert!(ud.contains("grep -qE '\\S'"));
    assert!(ud.ends_with("--//--"));
    let root = &c.dynamic[&p("linux-root/amd64")];
    assert_eq!(
        root.sudo_commands,
        [
            "/usr/bin/podman",
            "/usr/bin/rm /usr/share/containers/mounts.conf"
        ]
    );
    assert_eq!((root.iops, root.throughput), (Some(16000), Some(1000)));
    assert_eq!(
        c.additional_instance_tags,
        vec![
            ("Project".to_owned(), "Example".to_owned()),
            ("Owner".to_owned(), "infra@example.com".to_owned()),
            ("ManagedBy".to_owned(), "Example Infra Team".to_owned()),
            ("cost-center".to_owned(), "670".to_owned()),
        ]
    );
    let pool = &c.pools[&p("linux-pool/arm64")];
    assert_eq!(pool.concurrency, 4);
    assert_eq!(pool.max_age, Duration::from_secs(120 * 60));
    assert_eq!(c.capacity(&p("linux-pool/arm64")), Some(40));
    let s390 = &c.static_pools[&p("linux/s390x")];
    assert_eq!(s390.hosts.len(), 2);
    assert_eq!(s390.hosts[1].address, "s390x-2.builders.example.com");
    assert_eq!(c.capacity(&p("linux/s390x")), Some(8));
    let ppc = &c.static_pools[&p("linux/ppc64le")];
    assert_eq!(ppc.hosts[0].name, "ppc64le.static.1", "dotted host names");
    assert!(matches!(c.resolve(&p("linux/s390x")), Strategy::Static(_)));
    let fips = c.build_users.for_static_host("s390x-static-2");
    assert_eq!(fips.key_type, KeyType::Rsa { bits: 3072 });
    assert_eq!(fips.memory_max.as_ref().map(MemoryMax::as_str), Some("15G"));
    assert_eq!(fips.cpu_quota, None);
    assert_eq!(
        c.build_users.for_static_host("s390x-static-1"),
        &BuildUserSettings::DEFAULT
    );
    let shared = c.build_users.for_platform(&p("linux-pool/arm64"));
    assert_eq!(shared.key_type, KeyType::Ed25519);
    assert_eq!(shared.cpu_quota.map(CpuQuota::percent), Some(400));
    assert_eq!(
        c.build_users.for_platform(&p("linux/arm64")),
        &BuildUserSettings::DEFAULT
    );
    assert!(matches!(c.resolve(&p("linux/x86_64")), Strategy::Local));
    assert!(matches!(c.resolve(&p("linux/riscv64")), Strategy::Unknown));
    // A Go-era config pins no static host key: those warnings, and no other.
    let warned: Vec<_> = parsed
        .of(Severity::Warning)
        .map(|d| d.key.as_str())
        .collect();
    let unpinned: Vec<String> = c
        .static_pools
        .values()
        .flat_map(|p| &p.hosts)
        .map(|h| format!("host.{}.host-key", h.name))
        .collect();
    assert_eq!(warned, unpinned, "{:#?}", parsed.diagnostics);
}

#[test]
fn dev_like_fixture_disables_only_the_unconfigured_platform() {
    let parsed = fixture("dev-like.yaml");
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let c = &parsed.config;
    assert!(
        matches!(c.resolve(&p("linux/s390x")), Strategy::Disabled(r) if r.contains("no dynamic.linux-s390x.* keys"))
    );
    assert!(
        matches!(c.resolve(&p("linux/arm64")), Strategy::Dynamic(d) if d.strict_public_address)
    );
    let win = &c.dynamic[&p("windows/c4xlarge-amd64")];
    assert_eq!(win.allocation_timeout, Duration::from_secs(1200));
    assert!(
        win.user_data
            .as_deref()
            .unwrap()
            .starts_with("<powershell>\nStart-Service sshd")
    );
    let warned: Vec<_> = parsed
        .of(Severity::Warning)
        .map(|d| d.key.as_str())
        .collect();
    assert!(
        warned.contains(&"dynamic.linux-arm64.concurrency"),
        "{warned:?}"
    );
    assert!(
        warned.contains(&"dynamic.linux-arm64.max-age"),
        "{warned:?}"
    );
    assert!(warned.contains(&"dynamic-platforms"), "{warned:?}");
}

#[test]
fn local_only_fixture_accepts_bare_names() {
    let parsed = fixture("local-only.yaml");
    assert!(parsed.diagnostics.is_empty(), "{:#?}", parsed.diagnostics);
    assert!(matches!(
        parsed.config.resolve(&p("test-platform")),
        Strategy::Local
    ));
}

#[test]
fn resolution_order_local_dynamic_pool_static() {
    let mut d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("local-platforms", "linux/arm64"),
            ("dynamic-platforms", "linux/arm64,linux/amd64"),
            ("dynamic-pool-platforms", "linux/amd64, linux/s390x"),
        ],
    );
    d.extend(with(
        dynamic_keys("linux-amd64"),
        &[("dynamic.linux-amd64.concurrency", "2")],
    ));
    d.extend(with(
        dynamic_keys("linux-s390x"),
        &[("dynamic.linux-s390x.concurrency", "2")],
    ));
    for (f, v) in [
        ("address", "10.0.0.1"),
        ("platform", "linux/s390x"),
        ("user", "root"),
        ("secret", "k"),
        ("concurrency", "2"),
    ] {
        d.insert(format!("host.h1.{f}"), v.to_owned());
    }
    let parsed = parse(&d);
    let c = &parsed.config;
    assert!(matches!(c.resolve(&p("linux/arm64")), Strategy::Local));
    assert!(matches!(c.resolve(&p("linux/amd64")), Strategy::Dynamic(_)));
    assert!(matches!(
        c.resolve(&p("linux/s390x")),
        Strategy::DynamicPool(_)
    ));
    assert!(
        c.static_pools.is_empty(),
        "shadowed static hosts are not used"
    );
    let warnings: Vec<String> = parsed
        .of(Severity::Warning)
        .map(|d| d.to_string())
        .collect();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("dynamic-platforms = \"linux/arm64\"")
                && w.contains("local-platforms")),
        "{warnings:#?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("host.h1.platform") && w.contains("dynamic-pool-platforms")),
        "{warnings:#?}"
    );
}

#[test]
fn every_error_names_key_and_value() {
    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64,linux/AMD64"),
            ("dynamic.linux-arm64.max-instances", "lots"),
        ],
    );
    let parsed = parse(&d);
    let e = errors_for(&parsed, "dynamic.linux-arm64.max-instances");
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].value.as_deref(), Some("lots"));
    assert!(
        e[0].to_string()
            .starts_with("error: dynamic.linux-arm64.max-instances = \"lots\": not a whole number")
    );
    let e = errors_for(&parsed, "dynamic-platforms");
    assert_eq!(e[0].value.as_deref(), Some("linux/AMD64"));
    assert!(
        matches!(parsed.config.resolve(&p("linux/arm64")), Strategy::Disabled(r) if r.contains("max-instances"))
    );
}

#[test]
fn one_bad_platform_disables_only_itself() {
    let mut d = with(
        dynamic_keys("linux-arm64"),
        &[("dynamic-platforms", "linux/arm64,linux/amd64")],
    );
    d.extend(with(
        dynamic_keys("linux-amd64"),
        &[("dynamic.linux-amd64.type", "gcp")],
    ));
    let parsed = parse(&d);
    assert!(matches!(
        parsed.config.resolve(&p("linux/arm64")),
        Strategy::Dynamic(_)
    ));
    assert!(
        matches!(parsed.config.resolve(&p("linux/amd64")), Strategy::Disabled(r) if r.contains("gcp"))
    );
    assert_eq!(errors_for(&parsed, "dynamic.linux-amd64.type").len(), 1);
}

#[test]
fn missing_required_dynamic_keys() {
    let d: ConfigData = dynamic_keys("linux-arm64")
        .into_iter()
        .filter(|(k, _)| !k.ends_with(".ami") && !k.ends_with(".max-instances"))
        .chain([("dynamic-platforms".to_owned(), "linux/arm64".to_owned())])
        .collect();
    let parsed = parse(&d);
    assert_eq!(errors_for(&parsed, "dynamic.linux-arm64.ami").len(), 1);
    assert_eq!(
        errors_for(&parsed, "dynamic.linux-arm64.max-instances").len(),
        1
    );
    assert!(matches!(
        parsed.config.resolve(&p("linux/arm64")),
        Strategy::Disabled(_)
    ));
}

#[test]
fn pool_rules() {
    let base = |extra: &[(&str, &str)]| {
        let mut d = with(dynamic_keys("linux-arm64"), extra);
        d.insert("dynamic-pool-platforms".into(), "linux/arm64".into());
        parse(&d)
    };
    let parsed = base(&[]);
    assert_eq!(
        errors_for(&parsed, "dynamic.linux-arm64.concurrency").len(),
        1,
        "concurrency required"
    );
    let parsed = base(&[("dynamic.linux-arm64.concurrency", "9")]);
    assert_eq!(
        errors_for(&parsed, "dynamic.linux-arm64.concurrency").len(),
        1,
        "1..=8"
    );
    let parsed = base(&[
        ("dynamic.linux-arm64.concurrency", "2"),
        ("dynamic.linux-arm64.max-age", "1441"),
    ]);
    assert_eq!(errors_for(&parsed, "dynamic.linux-arm64.max-age").len(), 1);
    let parsed = base(&[
        ("dynamic.linux-arm64.concurrency", "2"),
        ("dynamic.linux-arm64.min-instances", "5"),
    ]);
    assert_eq!(
        errors_for(&parsed, "dynamic.linux-arm64.min-instances").len(),
        1,
        "min > max"
    );
    let parsed = base(&[
        ("dynamic.linux-arm64.concurrency", "2"),
        ("dynamic.linux-arm64.min-instances", "1"),
    ]);
    assert!(!parsed.has_errors());
    let pool = &parsed.config.pools[&p("linux/arm64")];
    assert_eq!(
        (pool.concurrency, pool.min_instances, pool.max_age),
        (2, 1, DEFAULT_MAX_AGE)
    );
}

#[test]
fn dynamic_value_rules() {
    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("dynamic.linux-arm64.disk", "0"),
            ("dynamic.linux-arm64.strict-public-address", "yes"),
            ("dynamic.linux-arm64.sudo-commands", "/bin/sh -c 'reboot'"),
            ("dynamic.linux-arm64.allocation-timeout", "-1"),
            ("dynamic.linux-arm64.user", "Admin"),
            ("dynamic.linux-arm64.host-key-policy", "off"),
            ("dynamic.linux-arm64.region", "us east"),
            ("dynamic.linux-arm64.frobnicate", "1"),
        ],
    );
    let parsed = parse(&d);
    for field in [
        "disk",
        "strict-public-address",
        "sudo-commands",
        "allocation-timeout",
        "user",
        "host-key-policy",
        "region",
    ] {
        assert_eq!(
            errors_for(&parsed, &format!("dynamic.linux-arm64.{field}")).len(),
            1,
            "{field}: {:#?}",
            parsed.diagnostics
        );
    }
    assert!(
        parsed
            .of(Severity::Warning)
            .any(|d| d.key == "dynamic.linux-arm64.frobnicate")
    );
    let big = "x".repeat(MAX_USER_DATA_BYTES + 1);
    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("dynamic.linux-arm64.user-data", &big),
        ],
    );
    let parsed = parse(&d);
    let e = errors_for(&parsed, "dynamic.linux-arm64.user-data");
    assert_eq!(e.len(), 1);
    assert!(e[0].message.contains("16384"));
}

#[test]
fn spot_and_user_and_tags() {
    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("dynamic.linux-arm64.spot", "true"),
            ("dynamic.linux-arm64.user", "ubuntu"),
            ("additional-instance-tags", "a=1,broken,b=two words"),
        ],
    );
    let parsed = parse(&d);
    let dp = &parsed.config.dynamic[&p("linux/arm64")];
    assert!(dp.spot);
    assert_eq!(dp.user, "ubuntu");
    assert_eq!(dp.instance_tag, DEFAULT_INSTANCE_TAG);
    assert_eq!(
        parsed.config.additional_instance_tags,
        vec![("a".into(), "1".into()), ("b".into(), "two words".into())],
        "the bad tag alone is dropped"
    );
    let e = errors_for(&parsed, "additional-instance-tags");
    assert_eq!(e[0].value.as_deref(), Some("broken"));
}

#[test]
fn static_host_rules() {
    let host = |name: &str, fields: &[(&str, &str)]| -> Vec<(String, String)> {
        fields
            .iter()
            .map(|(f, v)| (format!("host.{name}.{f}"), (*v).to_owned()))
            .collect()
    };
    let good = [
        ("address", "10.0.0.1"),
        ("platform", "linux/s390x"),
        ("user", "root"),
        ("secret", "key"),
        ("concurrency", "4"),
    ];
    let mut d: ConfigData = host("good", &good).into_iter().collect();
    d.extend(host(
        "bad-addr",
        &[
            ("address", "10.0.0.2; rm -rf /"),
            ("platform", "linux/s390x"),
            ("user", "root"),
            ("secret", "key"),
        ],
    ));
    d.extend(host(
        "no-conc",
        &[
            ("address", "h.example.com"),
            ("platform", "linux/s390x"),
            ("user", "root"),
            ("secret", "key"),
        ],
    ));
    d.extend(host(
        "too-many",
        &[
            ("address", "10.0.0.3"),
            ("platform", "linux/ppc64le"),
            ("user", "root"),
            ("secret", "key"),
            ("concurrency", "9"),
        ],
    ));
    d.extend(host(
        "pinned",
        &[
            ("address", "10.0.0.4"),
            ("platform", "linux/s390x"),
            ("user", "root"),
            ("secret", "key"),
            ("concurrency", "1"),
            ("host-key", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB2a"),
        ],
    ));
    let parsed = parse(&d);
    let s390 = &parsed.config.static_pools[&p("linux/s390x")];
    let names: Vec<_> = s390.hosts.iter().map(|h| h.name.as_str()).collect();
    assert_eq!(names, ["good", "no-conc", "pinned"]);
    assert_eq!(s390.hosts[1].concurrency, 1, "defaults to 1 with a warning");
    assert_eq!(s390.capacity(), 6);
    assert!(
        s390.hosts[2]
            .host_key
            .as_deref()
            .unwrap()
            .starts_with("ssh-ed25519 ")
    );
    assert_eq!(errors_for(&parsed, "host.bad-addr.address").len(), 1);
    assert_eq!(errors_for(&parsed, "host.too-many.concurrency").len(), 1);
    assert!(matches!(
        parsed.config.resolve(&p("linux/ppc64le")),
        Strategy::Disabled(r) if r.contains("host.too-many.concurrency")
    ));
}

#[test]
fn globals() {
    let parsed = parse(&data(&[
        ("gate-pending", "true"),
        ("reject-unknown-platforms", "maybe"),
        ("otp-server-url", "http://otp"),
        ("something-new", "x"),
    ]));
    assert!(parsed.config.gate_pending);
    assert!(!parsed.config.reject_unknown_platforms);
    assert_eq!(errors_for(&parsed, "reject-unknown-platforms").len(), 1);
    assert_eq!(errors_for(&parsed, "otp-server-url").len(), 1);
    assert!(
        parsed
            .of(Severity::Warning)
            .any(|d| d.key == "something-new")
    );
    let parsed = parse(&data(&[("otp-server-url", "https://otp.mpc.svc:8443/otp")]));
    assert_eq!(
        parsed.config.otp_server_url.as_deref(),
        Some("https://otp.mpc.svc:8443/otp")
    );
}

#[test]
fn unused_dynamic_group_is_a_warning() {
    let parsed = parse(&dynamic_keys("linux-arm64").into_iter().collect());
    assert!(!parsed.has_errors());
    assert!(parsed.config.dynamic.is_empty());
    assert!(
        parsed
            .of(Severity::Warning)
            .any(|d| d.message.contains("unused"))
    );
}

#[test]
fn report_lists_strategies_and_capacity() {
    let parsed = fixture("production-like.yaml");
    let out = render_report("prod.yaml", &parsed);
    assert!(out.contains("linux/s390x"), "{out}");
    assert!(out.contains("2 host(s) × concurrency 4 = 8 slots"), "{out}");
    assert!(
        out.contains("max-instances 10 × concurrency 4 = 40 slots"),
        "{out}"
    );
    assert!(out.contains("kubernetes.io/arch=amd64"), "{out}");
    assert!(
        out.contains(
            "build users: key-type ed25519, no slice, except:\n  \
             dynamic.linux-pool-arm64.*: key-type ed25519, memory-max 14G, cpu-quota 400%\n  \
             host.s390x-static-2.*: key-type rsa-3072, memory-max 15G\n"
        ),
        "{out}"
    );
    assert!(out.contains("errors: 0"), "{out}");
    let plain = render_report("dev.yaml", &fixture("dev-like.yaml"));
    assert!(
        plain.contains("build users: key-type ed25519, no slice, everywhere\n"),
        "{plain}"
    );
}

#[test]
fn build_user_keys_disable_only_their_own_host_or_platform() {
    let mut d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64,linux/amd64"),
            ("dynamic.linux-arm64.key-type", "rsa-4096"),
            ("dynamic.linux-arm64.cpu-quota", "150%"),
            ("dynamic.linux-amd64.memory-max", "lots"),
        ],
    );
    d.extend(dynamic_keys("linux-amd64"));
    for (name, extra) in [
        ("fips", ("key-type", "rsa-2048")),
        ("fine", ("memory-max", "6G")),
    ] {
        for (f, v) in [
            ("address", "10.0.0.9"),
            ("platform", "linux/s390x"),
            ("user", "root"),
            ("secret", "key"),
            ("concurrency", "2"),
            extra,
        ] {
            d.insert(format!("host.{name}.{f}"), v.to_owned());
        }
    }
    let parsed = parse(&d);
    let c = &parsed.config;
    let arm = c.build_users.for_platform(&p("linux/arm64"));
    assert_eq!(arm.key_type, KeyType::Rsa { bits: 4096 });
    assert_eq!(arm.cpu_quota.map(CpuQuota::percent), Some(150));
    assert!(matches!(c.resolve(&p("linux/arm64")), Strategy::Dynamic(_)));

    let e = errors_for(&parsed, "dynamic.linux-amd64.memory-max");
    assert_eq!(e.len(), 1, "{:#?}", parsed.diagnostics);
    assert_eq!(e[0].value.as_deref(), Some("lots"));
    assert!(
        e[0].message.contains("not a memory size"),
        "{}",
        e[0].message
    );
    assert!(matches!(
        c.resolve(&p("linux/amd64")),
        Strategy::Disabled(r) if r.contains("dynamic.linux-amd64.memory-max")
    ));

    let e = errors_for(&parsed, "host.fips.key-type");
    assert_eq!(e.len(), 1, "{:#?}", parsed.diagnostics);
    assert_eq!(e[0].value.as_deref(), Some("rsa-2048"));
    assert!(e[0].message.ends_with("host disabled"), "{}", e[0].message);
    let s390 = &c.static_pools[&p("linux/s390x")];
    assert_eq!(s390.hosts.len(), 1);
    assert_eq!(s390.hosts[0].name, "fine");
    assert_eq!(
        c.build_users
            .for_static_host("fine")
            .memory_max
            .as_ref()
            .map(MemoryMax::as_str),
        Some("6G")
    );
    assert!(!c.build_users.hosts.contains_key("fips"));
    // Known keys: no "unknown field" warnings.
    assert!(
        !parsed
            .diagnostics
            .iter()
            .any(|d| d.message.contains("unknown field")),
        "{:#?}",
        parsed.diagnostics
    );
}

#[test]
fn check_interval_default_and_range() {
    let arm = |extra: &[(&str, &str)]| {
        let mut pairs = vec![("dynamic-platforms", "linux/arm64")];
        pairs.extend_from_slice(extra);
        parse(&with(dynamic_keys("linux-arm64"), &pairs))
    };
    let parsed = arm(&[]);
    assert_eq!(
        parsed.config.dynamic[&p("linux/arm64")].check_interval,
        DEFAULT_CHECK_INTERVAL
    );
    let parsed = arm(&[("dynamic.linux-arm64.check-interval", "15")]);
    assert_eq!(
        parsed.config.dynamic[&p("linux/arm64")].check_interval,
        Duration::from_secs(15)
    );
    for bad in ["0", "3601", "soon"] {
        let parsed = arm(&[("dynamic.linux-arm64.check-interval", bad)]);
        let e = errors_for(&parsed, "dynamic.linux-arm64.check-interval");
        assert_eq!(e.len(), 1, "{bad}: {:#?}", parsed.diagnostics);
        assert_eq!(e[0].value.as_deref(), Some(bad));
    }
}

#[test]
fn static_hosts_without_a_pinned_key_are_warned_about() {
    let host = |name: &str| {
        [
            ("address", "10.0.0.1"),
            ("user", "root"),
            ("platform", "linux/s390x"),
            ("secret", "ssh"),
            ("concurrency", "2"),
        ]
        .iter()
        .map(|(f, v)| (format!("host.{name}.{f}"), (*v).to_owned()))
        .collect::<Vec<_>>()
    };
    let mut pairs = host("open");
    pairs.extend(host("pinned"));
    let d = with(
        pairs,
        &[(
            "host.pinned.host-key",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl",
        )],
    );
    let parsed = parse(&d);
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let warned: Vec<_> = parsed
        .of(Severity::Warning)
        .map(|d| d.key.as_str())
        .collect();
    assert_eq!(warned, ["host.open.host-key"], "{:#?}", parsed.diagnostics);
    let report = report::render_report("test", &parsed);
    assert!(
        report.contains("host.open.host-key") && report.contains("trusted on first contact"),
        "{report}"
    );
}

#[test]
fn sudo_commands_that_grant_root_are_warned_about() {
    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("instance-tag", "t"),
            (
                "dynamic.linux-arm64.sudo-commands",
                "/usr/bin/podman, /bin/bash, /usr/bin/*",
            ),
        ],
    );
    let parsed = parse(&d);
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let warned: Vec<_> = parsed
        .of(Severity::Warning)
        .filter(|d| d.key == "dynamic.linux-arm64.sudo-commands")
        .map(|d| d.message.clone())
        .collect();
    assert_eq!(warned.len(), 2, "{warned:#?}");
    assert!(warned[0].contains("\"/bin/bash\" runs any command as root"));
    assert!(warned[1].contains("\"/usr/bin/*\" matches any command"));
    // `ALL` (sudoers' everything) is not a command path at all: refused outright.
    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("dynamic.linux-arm64.sudo-commands", "ALL"),
        ],
    );
    assert!(!errors_for(&parse(&d), "dynamic.linux-arm64.sudo-commands").is_empty());
}

#[test]
fn an_instance_profile_is_flagged_as_readable_by_every_build() {
    let base = || {
        with(
            dynamic_keys("linux-arm64"),
            &[("dynamic-platforms", "linux/arm64"), ("instance-tag", "t")],
        )
    };
    let warned = |parsed: &Parsed, field: &str| {
        parsed.of(Severity::Warning).any(|d| {
            d.key == format!("dynamic.linux-arm64.{field}") && d.message.contains("every build")
        })
    };
    let parsed = parse(&base());
    assert!(!warned(&parsed, "instance-profile-arn") && !warned(&parsed, "instance-profile-name"));
    for field in ["instance-profile-arn", "instance-profile-name"] {
        let mut data = base();
        data.insert(
            format!("dynamic.linux-arm64.{field}"),
            "arn:aws:iam::1:instance-profile/p".into(),
        );
        let parsed = parse(&data);
        assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
        assert!(warned(&parsed, field), "{field}: {:#?}", parsed.diagnostics);
    }
}

#[test]
fn imds_defaults_to_v2_with_one_hop() {
    let base = || {
        with(
            dynamic_keys("linux-arm64"),
            &[("dynamic-platforms", "linux/arm64"), ("instance-tag", "t")],
        )
    };
    let parsed = parse(&base());
    let d = &parsed.config.dynamic[&p("linux/arm64")];
    assert_eq!(
        d.imds,
        ImdsOptions {
            tokens_required: true,
            hop_limit: 1
        }
    );
    let mut data = base();
    data.insert("dynamic.linux-arm64.imds-hop-limit".into(), "2".into());
    data.insert("dynamic.linux-arm64.imds-tokens".into(), "optional".into());
    let parsed = parse(&data);
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    assert_eq!(
        parsed.config.dynamic[&p("linux/arm64")].imds,
        ImdsOptions {
            tokens_required: false,
            hop_limit: 2
        }
    );
    assert!(
        parsed
            .of(Severity::Warning)
            .any(|d| d.key == "dynamic.linux-arm64.imds-tokens")
    );
    for (field, bad) in [
        ("imds-hop-limit", "0"),
        ("imds-hop-limit", "65"),
        ("imds-tokens", "v1"),
    ] {
        let mut data = base();
        data.insert(format!("dynamic.linux-arm64.{field}"), bad.into());
        let parsed = parse(&data);
        assert!(
            !errors_for(&parsed, &format!("dynamic.linux-arm64.{field}")).is_empty(),
            "{field}={bad}"
        );
    }
}

#[test]
fn stone_prod_windows_and_macos_platforms_load_with_nothing_ignored() {
    let parsed = fixture("stone-prod-p02-windows-macos.yaml");
    assert!(parsed.diagnostics.is_empty(), "{:#?}", parsed.diagnostics);
    let c = &parsed.config;
    let win = &c.dynamic[&p("windows-4xlarge/amd64")];
    assert_eq!(win.os, HostOs::Windows);
    assert_eq!(win.user, "Administrator");
    assert_eq!(win.dedicated_host, None);
    assert_eq!(win.allocation_timeout, Duration::from_secs(1200));
    let mac = &c.dynamic[&p("macos-mac2metal/arm64")];
    assert_eq!(mac.os, HostOs::MacOs);
    assert_eq!(mac.user, "ec2-user");
    assert_eq!(mac.region, "eu-central-1");
    assert_eq!(
        mac.dedicated_host,
        Some(DedicatedHost {
            tenancy: "host".into(),
            host_resource_group_arn: "arn:aws:resource-groups:eu-central-1:381491906438:group/macos"
                .into(),
            license_configuration_arn: "arn:aws:license-manager:eu-central-1:381491906438:license-configuration:lic-f8ce13fa40eab0916af2734edf5c85ab".into(),
            scrub: DEFAULT_HOST_SCRUB,
        })
    );
    let report = report::render_report("p02", &parsed);
    assert!(report.contains("windows: no build user"), "{report}");
    assert!(report.contains("billed for at least 24 h"), "{report}");
    // What max-instances 5 costs on dedicated hosts.
    assert!(
        report.contains("a burst of 5 builds costs at least 120 host-hours (5 x 24 h)"),
        "{report}"
    );
    assert!(!report.contains("ignored"), "{report}");
}

#[test]
fn os_kind_follows_the_platform_name() {
    assert_eq!(HostOs::of(&p("windows/amd64")), HostOs::Windows);
    assert_eq!(HostOs::of(&p("windows-4xlarge/amd64")), HostOs::Windows);
    assert_eq!(HostOs::of(&p("macos-mac2metal/arm64")), HostOs::MacOs);
    assert_eq!(HostOs::of(&p("linux/arm64")), HostOs::Linux);
    assert_eq!(HostOs::of(&p("linux-windows/amd64")), HostOs::Linux);
}

const MAC_FULL: [(&str, &str); 4] = [
    ("dynamic-platforms", "macos/arm64"),
    ("dynamic.macos-arm64.tenancy", "host"),
    (
        "dynamic.macos-arm64.host-resource-group-arn",
        "arn:aws:resource-groups:eu-central-1:1:group/macos",
    ),
    (
        "dynamic.macos-arm64.license-configuration-arn",
        "arn:aws:license-manager:eu-central-1:1:license-configuration:lic-1",
    ),
];

#[test]
fn macos_dedicated_host_keys_are_all_three_or_none() {
    let full = MAC_FULL;
    let parsed = parse(&with(dynamic_keys("macos-arm64"), &full));
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    assert!(
        parsed.config.dynamic[&p("macos/arm64")]
            .dedicated_host
            .is_some()
    );
    // None: allowed.
    let parsed = parse(&with(dynamic_keys("macos-arm64"), &full[..1]));
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    // Any partial set disables the platform, naming each missing key with Go's words.
    for drop in 1..full.len() {
        let partial: Vec<_> = full
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != drop)
            .map(|(_, kv)| *kv)
            .collect();
        let parsed = parse(&with(dynamic_keys("macos-arm64"), &partial));
        let missing = full[drop].0;
        let e = errors_for(&parsed, missing);
        assert_eq!(e.len(), 1, "{missing}: {:#?}", parsed.diagnostics);
        assert!(
            e[0].message
                .contains("MacOS dedicated host configuration requires all three fields"),
            "{}",
            e[0]
        );
        assert!(matches!(
            parsed.config.resolve(&p("macos/arm64")),
            Strategy::Disabled(_)
        ));
    }
    // Tenancy other than host, and a non-ARN.
    let mut bad = full.to_vec();
    bad[1] = ("dynamic.macos-arm64.tenancy", "dedicated");
    let parsed = parse(&with(dynamic_keys("macos-arm64"), &bad));
    assert_eq!(errors_for(&parsed, "dynamic.macos-arm64.tenancy").len(), 1);
    let mut bad = full.to_vec();
    bad[2] = ("dynamic.macos-arm64.host-resource-group-arn", "macos");
    let parsed = parse(&with(dynamic_keys("macos-arm64"), &bad));
    assert_eq!(
        errors_for(&parsed, "dynamic.macos-arm64.host-resource-group-arn").len(),
        1
    );
    // On a Linux platform the keys are ignored, as Go does, and said so.
    let parsed = parse(&with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("dynamic.linux-arm64.tenancy", "host"),
        ],
    ));
    assert!(!parsed.has_errors());
    assert!(
        parsed
            .of(Severity::Warning)
            .any(|d| d.key == "dynamic.linux-arm64.tenancy" && d.message.contains("only to macos"))
    );
}

#[test]
fn windows_and_macos_platforms_reject_pools_and_ignore_build_user_keys() {
    let parsed = parse(&with(
        dynamic_keys("windows-amd64"),
        &[
            ("dynamic-pool-platforms", "windows/amd64"),
            ("dynamic.windows-amd64.concurrency", "2"),
        ],
    ));
    assert_eq!(errors_for(&parsed, "dynamic-pool-platforms").len(), 1);
    assert!(matches!(
        parsed.config.resolve(&p("windows/amd64")),
        Strategy::Disabled(_)
    ));
    let parsed = parse(&with(
        dynamic_keys("windows-amd64"),
        &[
            ("dynamic-platforms", "windows/amd64"),
            ("dynamic.windows-amd64.user", "builder"),
            ("dynamic.windows-amd64.sudo-commands", "/usr/bin/podman"),
            ("dynamic.windows-amd64.key-type", "rsa"),
        ],
    ));
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let w = &parsed.config.dynamic[&p("windows/amd64")];
    assert_eq!(w.user, "Administrator");
    assert!(w.sudo_commands.is_empty());
    for field in ["user", "sudo-commands", "key-type"] {
        let k = format!("dynamic.windows-amd64.{field}");
        assert!(
            parsed
                .of(Severity::Warning)
                .any(|d| d.key == k && d.message.contains("no build user")),
            "{k}: {:#?}",
            parsed.diagnostics
        );
    }
}

#[test]
fn amis_pass_through_unchanged() {
    let ssm = "resolve:ssm:/aws/service/ami-windows-latest/Windows_Server-2022-English-Full-Base";
    let parsed = parse(&with(
        dynamic_keys("windows-amd64"),
        &[
            ("dynamic-platforms", "windows/amd64"),
            ("dynamic.windows-amd64.ami", ssm),
            ("instance-tag", "prod"),
        ],
    ));
    assert!(parsed.diagnostics.is_empty(), "{:#?}", parsed.diagnostics);
    assert_eq!(parsed.config.dynamic[&p("windows/amd64")].ami, ssm);
}

fn two_dynamic(extra: &[(&str, &str)]) -> ConfigData {
    let mut base = dynamic_keys("linux-arm64");
    base.extend(dynamic_keys("linux-amd64"));
    base.push(("dynamic-platforms".into(), "linux/arm64,linux/amd64".into()));
    base.push(("instance-tag".into(), "test".into()));
    with(base, extra)
}

fn warnings_for<'a>(parsed: &'a Parsed, key: &str) -> Vec<&'a Diagnostic> {
    parsed
        .of(Severity::Warning)
        .filter(|d| d.key == key)
        .collect()
}

#[test]
fn capacity_group_members_and_scope() {
    let parsed = parse(&two_dynamic(&[
        ("capacity-group.aws-ip.max", "250"),
        ("capacity-group.gpu.max", "4"),
        ("capacity-group.gpu.scope", "account"),
        ("dynamic.linux-arm64.capacity-group", "aws-ip,gpu"),
        ("dynamic.linux-amd64.capacity-group", "aws-ip"),
    ]));
    assert!(parsed.diagnostics.is_empty(), "{:?}", parsed.diagnostics);
    let g = &parsed.config.capacity_groups;
    assert_eq!(g["aws-ip"].max, 250);
    assert_eq!(g["aws-ip"].scope, GroupScope::Cluster);
    assert_eq!(
        g["aws-ip"].members,
        [p("linux/amd64"), p("linux/arm64")].into()
    );
    assert_eq!(g["gpu"].scope, GroupScope::Account);
    assert_eq!(g["gpu"].members, [p("linux/arm64")].into());
    let arm = p("linux/arm64");
    let of: Vec<_> = parsed
        .config
        .groups_of(&arm)
        .map(|g| g.name.as_str())
        .collect();
    assert_eq!(of, ["aws-ip", "gpu"]);
    // The member key is not a template field: the platform parses as without it.
    assert_eq!(parsed.config.dynamic[&arm].max_instances, 3);
}

#[test]
fn capacity_group_errors_are_diagnostics_not_panics() {
    let parsed = parse(&two_dynamic(&[
        ("capacity-group.zero.max", "0"),
        ("capacity-group.word.max", "lots"),
        ("capacity-group.nomax.scope", "account"),
        ("capacity-group.Bad_Name.max", "3"),
        ("capacity-group.ok.max", "3"),
        ("capacity-group.ok.scope", "planet"),
        ("capacity-group.ok.colour", "red"),
        ("dynamic.linux-arm64.capacity-group", "ok,undefined,zero"),
        ("dynamic.linux-amd64.capacity-group", ""),
        ("dynamic.linux-s390x.capacity-group", "ok"),
        ("host.h1.capacity-group", "ok"),
    ]));
    assert_eq!(errors_for(&parsed, "capacity-group.zero.max").len(), 1);
    assert_eq!(errors_for(&parsed, "capacity-group.word.max").len(), 1);
    let missing = errors_for(&parsed, "capacity-group.nomax.max");
    assert!(missing[0].message.contains("missing"), "{missing:?}");
    assert_eq!(errors_for(&parsed, "capacity-group.Bad_Name.max").len(), 1);
    assert_eq!(errors_for(&parsed, "capacity-group.ok.scope").len(), 1);
    assert_eq!(warnings_for(&parsed, "capacity-group.ok.colour").len(), 1);
    // Only the undefined group is reported at the member key: `zero` has its own error.
    let member = errors_for(&parsed, "dynamic.linux-arm64.capacity-group");
    assert_eq!(member.len(), 1, "{member:?}");
    assert_eq!(member[0].value.as_deref(), Some("undefined"));
    assert_eq!(
        warnings_for(&parsed, "dynamic.linux-amd64.capacity-group").len(),
        1
    );
    assert_eq!(
        warnings_for(&parsed, "dynamic.linux-s390x.capacity-group").len(),
        1
    );
    let host = warnings_for(&parsed, "host.h1.capacity-group");
    assert!(host[0].message.contains("static hosts are not members"));
    // Bad groups are left out, the good one keeps its members; no platform is disabled.
    let g = &parsed.config.capacity_groups;
    assert_eq!(g.keys().collect::<Vec<_>>(), ["ok"]);
    assert_eq!(g["ok"].scope, GroupScope::Cluster);
    assert_eq!(g["ok"].members, [p("linux/arm64")].into());
    assert!(
        parsed.config.disabled.is_empty(),
        "{:?}",
        parsed.config.disabled
    );
}

#[test]
fn a_capacity_group_without_members_is_a_warning() {
    let parsed = parse(&two_dynamic(&[("capacity-group.aws-ip.max", "5")]));
    assert!(!parsed.has_errors());
    assert_eq!(warnings_for(&parsed, "capacity-group.aws-ip.max").len(), 1);
}

#[test]
fn a_broken_capacity_group_keeps_its_last_good_definition() {
    let good = parse(&two_dynamic(&[
        ("capacity-group.aws-ip.max", "5"),
        ("dynamic.linux-arm64.capacity-group", "aws-ip"),
    ]));
    let bad = parse(&two_dynamic(&[
        ("capacity-group.aws-ip.max", "five"),
        ("dynamic.linux-arm64.capacity-group", "aws-ip"),
    ]));
    assert!(bad.config.capacity_groups.is_empty());
    let merged = keep_last_good(&good.config, bad.config, &bad.diagnostics);
    assert_eq!(merged.config.capacity_groups, good.config.capacity_groups);
    assert!(
        merged
            .kept
            .iter()
            .any(|k| k.contains("capacity group aws-ip"))
    );
}

#[test]
fn check_config_explains_each_group_for_its_members() {
    let parsed = parse(&two_dynamic(&[
        ("capacity-group.aws-ip.max", "4"),
        ("capacity-group.aws-ip.scope", "account"),
        ("dynamic.linux-arm64.capacity-group", "aws-ip"),
        ("dynamic.linux-amd64.capacity-group", "aws-ip"),
    ]));
    let report = render_report("cm.yaml", &parsed);
    let arm = report
        .lines()
        .find(|l| l.trim_start().starts_with("linux/arm64"))
        .unwrap();
    assert!(
        arm.ends_with("; launches only while capacity group(s) aws-ip (max 4) have room"),
        "{report}"
    );
    assert!(report.contains("capacity groups: 1\n  aws-ip: max 4 instances, counting its members' instances in their accounts"), "{report}");
    assert!(report.contains("members: linux/amd64 (max-instances 3), linux/arm64 (max-instances 3); Kueue resource aws-ip"), "{report}");
    assert!(!report.contains("never binding"), "{report}");
}

#[test]
fn the_capacity_group_fixture_groups_every_aws_platform() {
    let parsed = fixture("capacity-group.yaml");
    assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
    let g = parsed
        .config
        .capacity_groups
        .get("aws-ip")
        .unwrap_or_else(|| panic!("{:?}", parsed.diagnostics));
    assert_eq!(g.max, 120);
    assert_eq!(g.members.len(), 5, "{g:?}");
}

/// `host.<h>.*` keys of a linux/s390x host with these extra fields.
fn s390x_host(name: &str, n: u8, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = [
        ("address", format!("10.0.0.{n}")),
        ("platform", "linux/s390x".to_owned()),
        ("user", "root".to_owned()),
        ("secret", "key".to_owned()),
        (
            "host-key",
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB2a".to_owned(),
        ),
    ]
    .into_iter()
    .map(|(f, v)| (format!("host.{name}.{f}"), v))
    .collect();
    v.extend(
        extra
            .iter()
            .map(|(f, v)| (format!("host.{name}.{f}"), (*v).to_owned())),
    );
    v
}

fn warning_for<'a>(parsed: &'a Parsed, key: &str) -> Option<&'a Diagnostic> {
    parsed.of(Severity::Warning).find(|d| d.key == key)
}

#[test]
fn a_host_drained_by_concurrency_0_or_drain_serves_with_no_capacity() {
    let mut pairs = s390x_host("zero", 1, &[("concurrency", "0")]);
    pairs.extend(s390x_host(
        "drained",
        2,
        &[("concurrency", "4"), ("drain", "true")],
    ));
    pairs.extend(s390x_host(
        "up",
        3,
        &[("concurrency", "2"), ("drain", "false")],
    ));
    let parsed = parse(&pairs.into_iter().collect());
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let pool = &parsed.config.static_pools[&p("linux/s390x")];
    let drained: Vec<_> = pool.drained().map(|h| h.name.as_str()).collect();
    assert_eq!(drained, ["drained", "zero"]);
    assert_eq!(pool.hosts.len(), 3, "drained hosts stay configured");
    assert_eq!(pool.hosts[0].concurrency, 4, "the real concurrency is kept");
    assert_eq!(pool.capacity(), 2);
    assert_eq!(parsed.config.capacity(&p("linux/s390x")), Some(2));
    // What a rollback to the Go controller does with each.
    let zero = warning_for(&parsed, "host.zero.concurrency").expect("noted");
    assert!(
        zero.message.contains("Go controller rejects concurrency 0"),
        "{zero}"
    );
    let drain = warning_for(&parsed, "host.drained.drain").expect("noted");
    assert!(
        drain.message.contains("Go controller ignores drain"),
        "{drain}"
    );
    assert!(warning_for(&parsed, "host.up.drain").is_none());
}

#[test]
fn a_platform_whose_every_host_is_drained_is_served_not_disabled() {
    let mut pairs = s390x_host("a", 1, &[("concurrency", "0")]);
    pairs.extend(s390x_host("b", 2, &[("drain", "TRUE")]));
    let parsed = parse(&pairs.into_iter().collect());
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    assert!(matches!(
        parsed.config.resolve(&p("linux/s390x")),
        Strategy::Static(s) if s.capacity() == 0 && s.hosts.len() == 2
    ));
    assert!(parsed.config.is_drained(&p("linux/s390x")));
    let report = report::render_report("x", &parsed);
    assert!(report.contains("drained: a, b"), "{report}");
}

#[test]
fn a_bad_drain_value_disables_only_its_own_entry() {
    let mut pairs = s390x_host("a", 1, &[("drain", "soon")]);
    pairs.extend(s390x_host("b", 2, &[]));
    let parsed = parse(&pairs.into_iter().collect());
    assert_eq!(errors_for(&parsed, "host.a.drain").len(), 1);
    let pool = &parsed.config.static_pools[&p("linux/s390x")];
    assert_eq!(pool.hosts.len(), 1);
    assert_eq!(pool.hosts[0].name, "b");

    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("instance-tag", "t"),
            ("dynamic.linux-arm64.drain", "soon"),
        ],
    );
    let parsed = parse(&d);
    assert_eq!(errors_for(&parsed, "dynamic.linux-arm64.drain").len(), 1);
    assert!(matches!(
        parsed.config.resolve(&p("linux/arm64")),
        Strategy::Disabled(r) if r.contains("drain")
    ));
}

#[test]
fn a_drained_dynamic_platform_or_pool_has_no_capacity() {
    let d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic-platforms", "linux/arm64"),
            ("instance-tag", "t"),
            ("dynamic.linux-arm64.drain", "true"),
        ],
    );
    let parsed = parse(&d);
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let dp = &parsed.config.dynamic[&p("linux/arm64")];
    assert!(dp.drained);
    assert_eq!(dp.max_instances, 3, "kept for when the drain is lifted");
    assert_eq!(parsed.config.capacity(&p("linux/arm64")), Some(0));
    assert!(parsed.config.is_drained(&p("linux/arm64")));
    let w = warning_for(&parsed, "dynamic.linux-arm64.drain").expect("noted");
    assert!(w.message.contains("Go controller ignores drain"), "{w}");
    assert!(
        !parsed
            .diagnostics
            .iter()
            .any(|d| d.message.contains("unknown field")),
        "{:#?}",
        parsed.diagnostics
    );

    let mut d = with(
        dynamic_keys("linux-arm64"),
        &[
            ("dynamic.linux-arm64.drain", "true"),
            ("dynamic.linux-arm64.concurrency", "4"),
            ("instance-tag", "t"),
        ],
    );
    d.insert("dynamic-pool-platforms".into(), "linux/arm64".into());
    let parsed = parse(&d);
    assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
    let pool = &parsed.config.pools[&p("linux/arm64")];
    assert!(pool.instance.drained);
    assert_eq!(parsed.config.capacity(&p("linux/arm64")), Some(0));
    let w = warning_for(&parsed, "dynamic.linux-arm64.drain").expect("noted");
    assert!(w.message.contains("idle ones are terminated"), "{w}");
}

#[test]
fn a_mac_dedicated_host_is_scrubbed_50_minutes_unless_host_scrub_says_otherwise() {
    let parsed = fixture("stone-prod-p02-windows-macos.yaml");
    let mac = &parsed.config.dynamic[&p("macos-mac2metal/arm64")];
    assert_eq!(
        mac.dedicated_host.as_ref().map(|h| h.scrub),
        Some(Duration::from_secs(50 * 60))
    );
    let path = format!(
        "{}/tests/fixtures/configmaps/stone-prod-p02-windows-macos.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    let (mut data, _) = read_configmap_yaml(&text).unwrap();
    for (v, want) in [("0", Some(0)), ("65", Some(65 * 60))] {
        data.insert("dynamic.macos-mac2metal-arm64.host-scrub".into(), v.into());
        let parsed = parse(&data);
        assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
        let mac = &parsed.config.dynamic[&p("macos-mac2metal/arm64")];
        assert_eq!(
            mac.dedicated_host.as_ref().map(|h| h.scrub.as_secs()),
            want,
            "{v}"
        );
    }
    data.insert(
        "dynamic.macos-mac2metal-arm64.host-scrub".into(),
        "soon".into(),
    );
    let parsed = parse(&data);
    assert_eq!(
        errors_for(&parsed, "dynamic.macos-mac2metal-arm64.host-scrub").len(),
        1
    );
    // Elsewhere it means nothing.
    data.insert(
        "dynamic.windows-4xlarge-amd64.host-scrub".into(),
        "10".into(),
    );
    let parsed = parse(&data);
    assert!(
        warning_for(&parsed, "dynamic.windows-4xlarge-amd64.host-scrub")
            .is_some_and(|w| w.message.contains("ignored")),
        "{:#?}",
        parsed.diagnostics
    );
}
