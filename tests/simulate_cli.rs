//! `mpc simulate` through the real `mpc` binary: it is the core's simulation (the same arguments,
//! the same report), so `mpc-core`'s `tests/simulate_cli.rs` covers its behaviour.

use std::process::Command;

use mpc::simulate::{self, PolicyChoice, SimulateArgs};

/// The report without its last line (the wall time it took).
fn without_timing(report: &str) -> &str {
    let body = report.trim_end_matches('\n');
    let (body, last) = body.rsplit_once('\n').expect("a multi-line report");
    assert!(last.starts_with("simulated in "), "{last}");
    body
}

#[test]
fn mpc_simulate_prints_the_core_report_for_the_same_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("day.svg");
    let out = Command::new(env!("CARGO_BIN_EXE_mpc"))
        .args(["simulate", "--taskruns", "300", "--seed", "5", "--policy"])
        .args(["mpc-go", "--chart", chart.to_str().unwrap()])
        .output()
        .expect("run mpc");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    let svg = std::fs::read_to_string(&chart).unwrap();

    let args = SimulateArgs {
        config: None,
        workload: None,
        policy: PolicyChoice::MpcGo,
        seed: 5,
        taskruns: 300,
        chart: Some(dir.path().join("core.svg")),
        check: false,
        check_every: simulate::DEFAULT_CHECK_EVERY,
    };
    let expected = simulate::output(&args).unwrap();
    let expected = expected.replace("core.svg", "day.svg");
    assert_eq!(without_timing(&printed), without_timing(&expected));
    assert!(printed.contains("mpc-go"), "{printed}");
    assert_eq!(
        svg,
        std::fs::read_to_string(dir.path().join("core.svg")).unwrap()
    );
}
