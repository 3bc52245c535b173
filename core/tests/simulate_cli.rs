//! `mpc-simulate` (the same arguments and run function as `mpc simulate`) end to end through the
//! real binary.

use std::process::Command;

fn simulate(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mpc-simulate"))
        .args(args)
        .output()
        .expect("run mpc-simulate");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/workloads/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// The row of `platform` for `policy` (the platform name is only on the first policy's row).
fn row<'a>(out: &'a str, platform: &str, policy: &str) -> Vec<&'a str> {
    let mut current = "";
    for line in out.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() >= 2 && cols[0].contains('/') {
            current = cols[0];
        }
        if current == platform && cols.contains(&policy) {
            let at = cols.iter().position(|c| *c == policy).unwrap();
            return cols[at..].to_vec();
        }
    }
    panic!("no {platform} {policy} row in:\n{out}");
}

#[test]
fn built_in_day_prints_both_policies_side_by_side_and_writes_a_chart() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("day.svg");
    let (ok, out, err) = simulate(&[
        "--taskruns",
        "600",
        "--seed",
        "3",
        "--chart",
        chart.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    for p in [
        "linux/amd64",
        "linux/s390x",
        "linux-m2xlarge/arm64",
        "linux/x86_64",
    ] {
        let mpc = row(&out, p, "mpc");
        let go = row(&out, p, "mpc-go");
        assert_eq!(mpc[1], go[1], "same trace, same TaskRun count for {p}");
    }
    assert!(out.contains("mpc vs mpc-go: p95 wait"), "{out}");
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 4);
    // Deterministic for a seed.
    let (_, again, _) = simulate(&["--taskruns", "600", "--seed", "3"]);
    let table = |s: &str| {
        s.lines()
            .take_while(|l| !l.starts_with("WAIT ="))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(table(&out), table(&again));
}

#[test]
fn csv_trace_on_a_given_config() {
    let (ok, out, err) = simulate(&[
        "--config",
        &fixture("one-host.yaml"),
        "--workload",
        &fixture("small.csv"),
        "--policy",
        "mpc",
    ]);
    assert!(ok, "{err}");
    // Two slots, three 10-minute builds: the third waits for the first to finish.
    let s390x = row(&out, "linux/s390x", "mpc");
    assert_eq!(s390x[1], "3");
    let max = s390x[5];
    assert!(max.starts_with("10m"), "max wait {max}:\n{out}");
    // Not configured here: error secrets, counted.
    assert_eq!(row(&out, "linux/arm64", "mpc").last(), Some(&"2"));
    assert!(!out.contains("mpc-go"));
}

#[test]
fn yaml_trace_and_bad_inputs() {
    let (ok, out, err) = simulate(&["--workload", &fixture("small.yaml")]);
    assert!(ok, "{err}");
    assert_eq!(row(&out, "linux-m2xlarge/arm64", "mpc")[1], "1");
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "at,namespace,platform,duration\n0,a,linux/arm64,soon\n",
    )
    .unwrap();
    let (ok, _, err) = simulate(&["--workload", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("bad.csv: line 2: duration \"soon\" is not a number of seconds"),
        "{err}"
    );
    let (ok, _, err) = simulate(&["--config", "/nonexistent/host-config.yaml"]);
    assert!(!ok);
    assert!(
        err.contains("/nonexistent/host-config.yaml: No such file"),
        "{err}"
    );
}

#[test]
fn macos_platforms_report_dedicated_host_hours_and_others_do_not() {
    let config = format!(
        "{}/tests/fixtures/configmaps/stone-prod-p02-windows-macos.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let (ok, out, err) = simulate(&[
        "--config",
        &config,
        "--workload",
        &fixture("macos-day.csv"),
        "--seed",
        "1",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("macOS dedicated hosts: each billed for at least 24 h"),
        "{out}"
    );
    let hosts: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("macOS dedicated hosts"))
        .nth(2)
        .expect("the macOS host row")
        .split_whitespace()
        .collect();
    // platform, policy, hosts, host-hours, busy, refused: at most max-instances (5) hosts, each
    // billed 24 h at least, far more than the instances ran.
    assert_eq!(hosts[0], "macos-mac2metal/arm64", "{out}");
    let n: u32 = hosts[2].parse().unwrap();
    let billed: f64 = hosts[3].parse().unwrap();
    assert!((1..=5).contains(&n), "{out}");
    assert!(billed >= 24.0 * f64::from(n), "{out}");
    let busy: f64 = hosts[4].trim_end_matches('%').parse().unwrap();
    assert!(busy < 50.0, "{out}");
    // Windows instances have no hosts: not in that section; a Linux-only trace has no section.
    assert!(
        !out.contains("windows-4xlarge/amd64  mpc         "),
        "{out}"
    );
    let (ok, out, err) = simulate(&["--taskruns", "300", "--seed", "2"]);
    assert!(ok, "{err}");
    assert!(!out.contains("dedicated hosts"), "{out}");
}

#[test]
fn check_samples_the_state_and_leaves_the_report_as_it_was() {
    let args = ["--taskruns", "400", "--seed", "2"];
    let (ok, plain, err) = simulate(&args);
    assert!(ok, "{err}");
    let (ok, checked, err) = simulate(&[&args[..], &["--check", "--check-every", "50"]].concat());
    assert!(ok, "{err}");
    // Everything but the last line (time taken, and how often the state was checked).
    let report = |s: &str| {
        let lines: Vec<&str> = s.lines().collect();
        lines[..lines.len() - 1].join("\n")
    };
    assert_eq!(report(&checked), report(&plain));
    let last = checked.lines().last().unwrap();
    let events: u64 = last
        .split(" scheduler events")
        .next()
        .and_then(|s| s.rsplit('(').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("event count in {last:?}"));
    assert!(
        last.ends_with("every invariant held)") && !plain.contains("checked"),
        "{last}"
    );
    // Both policies: every 50 events, and once at each end.
    assert!(last.contains("state checked "), "{last}");
    let checks: u64 = last
        .split("state checked ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(
        (events / 50..=events / 50 + 2).contains(&checks),
        "{checks} checks for {events} events"
    );
    // --check-every means nothing without --check.
    let (ok, _, err) = simulate(&["--check-every", "10"]);
    assert!(!ok && err.contains("--check"), "{err}");
}
