//! `mpc check-config` through the real binary, on real-world ConfigMaps (copies of the Konflux
//! production and development host-configs) and on a broken one.

use std::process::Command;

fn check_config(files: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mpc"))
        .arg("check-config")
        .args(files)
        .output()
        .expect("run mpc");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fixture(name: &str) -> String {
    format!(
        "{}/core/tests/fixtures/configmaps/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// The report row of `platform`, split into columns.
fn row<'a>(out: &'a str, platform: &str) -> Vec<&'a str> {
    out.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cols| cols.first() == Some(&platform))
        .unwrap_or_else(|| panic!("no row for {platform} in:\n{out}"))
}

#[test]
fn production_config_passes_with_every_platform_and_its_capacity() {
    let (code, out, err) = check_config(&[&fixture("konflux-production.yaml")]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("konflux-production.yaml: 37 platform(s)"),
        "{out}"
    );
    assert_eq!(
        row(&out, "linux/arm64")[..4],
        ["linux/arm64", "dynamic", "max-instances", "250"]
    );
    assert!(row(&out, "linux/arm64").contains(&"(m6g.large"), "{out}");
    // Folded, trailing-comma host lists: every s390x and ppc64le host is counted.
    assert_eq!(
        row(&out, "linux/s390x")[1..],
        [
            "static",
            "14",
            "host(s)",
            "×",
            "concurrency",
            "4",
            "=",
            "56",
            "slots"
        ]
    );
    assert_eq!(row(&out, "linux/ppc64le")[2], "8", "{out}");
    assert_eq!(row(&out, "linux/x86_64")[1], "local");
    assert!(row(&out, "linux/x86_64").contains(&"kubernetes.io/arch=amd64)"));
    assert_eq!(
        row(&out, "local")[1..],
        ["local", "in", "the", "build", "pod"]
    );
    // Go-era static hosts pin no host key: one warning each, and nothing else.
    let (_, after) = out.split_once("warnings: ").expect("a warnings section");
    let (count, rest) = after.split_once('\n').unwrap();
    let count: usize = count.parse().unwrap();
    let warnings: Vec<&str> = rest.lines().take(count).collect();
    assert!(count > 0, "{out}");
    // And one for a tag the Go controller's instance-tag rule refuses (served here).
    let (tag, keys): (Vec<&str>, Vec<&str>) = warnings
        .iter()
        .partition(|w| w.contains("invalid instance-tag"));
    assert_eq!(tag.len(), 1, "{out}");
    assert!(
        tag[0].contains("instance type mismatch: key has 'g64xlarge', value has 'g6xlarge'"),
        "{out}"
    );
    assert!(
        keys.iter()
            .all(|w| w.trim_start().starts_with("warning: host.")
                && w.contains(".host-key: not set")),
        "{out}"
    );
    assert!(out.contains("\nerrors: 0"), "{out}");
}

#[test]
fn dev_config_passes_and_explains_what_it_ignores() {
    let (code, out, err) = check_config(&[&fixture("konflux-dev.yaml")]);
    assert_eq!(code, Some(0), "{out}{err}");
    // Listed without keys: disabled with a reason, a warning rather than an error.
    assert_eq!(row(&out, "linux/s390x")[1], "disabled");
    assert!(
        out.contains("warning: dynamic-platforms = \"linux/s390x\": no dynamic.linux-s390x.* keys"),
        "{out}"
    );
    assert!(
        out.contains("warning: dynamic.linux-arm64.concurrency = \"2\": ignored"),
        "{out}"
    );
    assert_eq!(
        row(&out, "linux/arm64")[..4],
        ["linux/arm64", "dynamic", "max-instances", "2"]
    );
    assert!(out.contains("errors: 0"), "{out}");
}

#[test]
fn errors_name_key_and_value_disable_only_their_platform_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: host-config\ndata:\n\
         \x20 dynamic-platforms: \"linux/arm64\"\n\
         \x20 dynamic.linux-arm64.type: aws\n\
         \x20 dynamic.linux-arm64.max-instances: \"many\"\n\
         \x20 host.h1.address: 10.0.0.1\n\
         \x20 host.h1.platform: linux/ppc64le\n\
         \x20 host.h1.user: builder\n\
         \x20 host.h1.secret: ssh-key\n\
         \x20 host.h1.concurrency: \"4\"\n",
    )
    .unwrap();
    let bad = bad.to_str().unwrap();
    // Several files in one call: each gets its report, and one bad file fails the run.
    let (code, out, err) = check_config(&[&fixture("local-only.yaml"), bad]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(
        out.contains("error: dynamic.linux-arm64.max-instances = \"many\": not a whole number"),
        "{out}"
    );
    assert!(
        out.contains(
            "error: dynamic.linux-arm64.region: required for dynamic platform linux/arm64"
        ),
        "{out}"
    );
    assert_eq!(row(&out, "linux/arm64")[1], "disabled");
    assert!(
        !out.contains("configuration error: error:"),
        "the reason is not prefixed twice: {out}"
    );
    assert_eq!(row(&out, "linux/ppc64le")[1], "static", "{out}");
    assert!(out.contains("local-only.yaml: "), "{out}");

    let (code, _, err) = check_config(&["/nonexistent/host-config.yaml"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("/nonexistent/host-config.yaml"), "{err}");
}

#[test]
fn stone_prod_windows_and_macos_platforms_pass_with_nothing_ignored() {
    let (code, out, err) = check_config(&[&fixture("stone-prod-p02-windows-macos.yaml")]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("warnings: 0"), "{out}");
    assert!(out.contains("errors: 0"), "{out}");
    let win = row(&out, "windows-4xlarge/amd64").join(" ");
    assert!(win.contains("windows: no build user"), "{out}");
    let mac = row(&out, "macos-mac2metal/arm64").join(" ");
    assert!(mac.contains("eu-central-1"), "{out}");
    assert!(mac.contains("group/macos"), "{out}");
    assert!(mac.contains("billed for at least 24 h"), "{out}");
    assert!(mac.contains("at least 120 host-hours"), "{out}");
    assert!(!out.contains("ignored"), "{out}");
}

/// Operators drain a host with `concurrency: "0"`: served here (exit 0, the host drained), with a
/// note that the Go controller rejects the value, so a rollback to it would serve no static
/// platform of the cluster; `drain: "true"` the same, which Go ignores.
#[test]
fn a_drained_host_passes_with_the_go_rollback_noted() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("drained.yaml");
    let mut text =
        String::from("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: host-config\ndata:\n");
    for (name, extra) in [
        ("h1", "concurrency: \"0\""),
        ("h2", "drain: \"true\""),
        ("h3", "concurrency: \"2\""),
    ] {
        for (k, v) in [
            ("address", "10.0.0.1"),
            ("platform", "linux/s390x"),
            ("user", "builder"),
            ("secret", "ssh-key"),
        ] {
            text.push_str(&format!("  host.{name}.{k}: {v}\n"));
        }
        text.push_str(&format!("  host.{name}.{extra}\n"));
    }
    std::fs::write(&file, text).unwrap();
    let (code, out, err) = check_config(&[file.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(row(&out, "linux/s390x")[1], "static", "{out}");
    assert!(out.contains("drained: h1, h2"), "{out}");
    assert!(
        out.contains("warning: host.h1.concurrency = \"0\": host h1 is drained")
            && out.contains("the Go controller rejects concurrency 0"),
        "{out}"
    );
    assert!(
        out.contains("warning: host.h2.drain = \"true\": host h2 is drained")
            && out.contains("the Go controller ignores drain"),
        "{out}"
    );
    assert!(out.contains("errors: 0"), "{out}");
}
