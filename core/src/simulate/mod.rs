//! `mpc simulate` (also the `mpc-simulate` binary of this crate): the real scheduler core on a workload trace, with a virtual clock and a
//! simulated cluster and cloud answering after seeded-random latencies (SSH provisioning,
//! instance boot, API calls). No cluster or cloud needed; a 24 h trace runs in about a second.
//!
//! With no arguments it runs the built-in example — a bursty day on a host-config shaped like a
//! large production one (local, dynamic, dynamic-pool and static platforms) — under both
//! policies, `mpc` and `mpc-go` (the Go controller's timing), and prints them side by side per
//! platform: TaskRuns, wait p50/p95/p99/max, utilisation, peak instances, instance-hours, error
//! secrets. `--chart FILE` writes an SVG of queue length and instances over time.
//!
//! `macos/*` platforms run on dedicated hosts ([`engine::MacHostStats`]): an instance boots in
//! 6-20 min on a free host (or a new one, up to `max-instances` hosts), its host is scrubbed for
//! ~50 min after it terminates (launches meanwhile are refused as EC2 refuses them,
//! `InsufficientInstanceCapacity`), and every host is billed for at least 24 h; the report adds
//! the hosts and host-hours billed. Other platforms' results do not change.
//!
//! With capacity groups in the config (`capacity-group.<g>.max`), the same trace and seed run
//! again with the groups removed, and a section per group shows its limit, its members' peak
//! instances and their waits with and without it. A config without groups prints exactly what it
//! printed before groups existed.
//!
//! `--config` takes a host-config ConfigMap YAML, `--workload` a trace (CSV or YAML, see
//! [`workload`]).

pub mod chart;
pub mod engine;
pub mod latency;
pub mod report;
pub mod workload;

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::config::{self, HostConfig};
use crate::scheduler::{Policy, StateError};
use engine::{Outcome, SimSettings, simulate};
use workload::Workload;

/// The built-in host-config.
pub const EXAMPLE_CONFIG: &str = include_str!("example-host-config.yaml");

/// Errors from a simulation run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// A file could not be read or written.
    #[error("{}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The ConfigMap YAML is unusable.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// The trace is unusable.
    #[error("{}", path.display())]
    Workload {
        /// The file.
        path: PathBuf,
        /// Why.
        source: workload::WorkloadError,
    },
    /// `--check` found the scheduler's state broken.
    #[error(
        "policy {policy}: after scheduler event {event} (at {:.3} s simulated)",
        *at_ms as f64 / 1000.0
    )]
    State {
        /// The policy that was running.
        policy: &'static str,
        /// Scheduler events processed when it was found.
        event: u64,
        /// Simulated time, in milliseconds from the start.
        at_ms: u64,
        /// What is broken.
        #[source]
        error: StateError,
    },
}

/// Which policies to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyChoice {
    /// Both, side by side.
    Both,
    /// This controller.
    Mpc,
    /// The Go controller's timing.
    MpcGo,
}

/// `mpc simulate` / `mpc-simulate` arguments: the one definition both binaries flatten.
#[derive(Debug, Clone, clap::Args)]
#[command(after_long_help = TRACE_HELP)]
pub struct SimulateArgs {
    /// host-config ConfigMap YAML [default: built-in production-shaped example].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Workload trace, CSV or YAML (format below) [default: built-in bursty day].
    #[arg(long, value_name = "FILE")]
    pub workload: Option<PathBuf>,
    /// Policy to simulate; `both` prints them side by side.
    #[arg(long, value_enum, default_value_t = PolicyChoice::Both)]
    pub policy: PolicyChoice,
    /// Seed of the latency model (and of the built-in workload).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// TaskRuns in the built-in day (ignored with --workload).
    #[arg(long, default_value_t = 20_000, value_name = "N")]
    pub taskruns: usize,
    /// Also write an SVG chart of queue length and instances over time.
    #[arg(long, value_name = "FILE")]
    pub chart: Option<PathBuf>,
    /// Check the scheduler's state invariants during the run (every --check-every events and at
    /// the end); a broken one stops the run with an error naming it.
    #[arg(long)]
    pub check: bool,
    /// Events between two checks under --check (1: after every event).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_CHECK_EVERY, requires = "check")]
    pub check_every: u64,
}

/// Events between two state checks under `--check`. A check walks the whole state (about 1.5 ms
/// at the built-in day's peak), so checking after every event multiplies the run time; every
/// 10,000 events adds about a quarter of a second to the built-in day's 1.3 million events.
pub const DEFAULT_CHECK_EVERY: u64 = 10_000;

const TRACE_HELP: &str = "\
Workload trace (--workload), times in seconds from the start of the trace:

  CSV, header naming the columns (any order, extra columns ignored, # comments):
    at,namespace,platform,duration
    0,team-a,linux/arm64,420
    12.5,team-b,linux/s390x,900

  YAML:
    taskruns:
      - {at: 0, namespace: team-a, platform: linux/arm64, duration: 420}

duration is how long the build runs once it has a host. Latencies (SSH provisioning ~2.5 s,
instance boot ~55 s, 1% retryable launch failures, 0.2% provisioning failures) are drawn from
seeded distributions: the same --seed gives the same result.";

/// Loads a host-config ConfigMap.
pub fn load_config(text: &str, shown: &str) -> Result<(HostConfig, usize), SimulateError> {
    let (data, mut diags) =
        config::read_configmap_yaml(text).map_err(|e| SimulateError::Config {
            path: shown.to_owned(),
            message: e.to_string(),
        })?;
    let mut parsed = config::parse(&data);
    diags.append(&mut parsed.diagnostics);
    let errors = diags
        .iter()
        .filter(|d| d.severity == config::Severity::Error)
        .count();
    Ok((parsed.config, errors))
}

fn read(path: &Path) -> Result<String, SimulateError> {
    std::fs::read_to_string(path).map_err(|source| SimulateError::Io {
        path: path.to_owned(),
        source,
    })
}

/// Runs the chosen policies on one trace.
pub fn run_policies(
    config: &HostConfig,
    workload: &Workload,
    choice: PolicyChoice,
    seed: u64,
) -> Vec<Outcome> {
    run_policies_checked(config, workload, choice, seed, None)
}

/// [`run_policies`], checking the scheduler's state every `check_every` events (see
/// [`SimSettings::check_every`]).
pub fn run_policies_checked(
    config: &HostConfig,
    workload: &Workload,
    choice: PolicyChoice,
    seed: u64,
    check_every: Option<u64>,
) -> Vec<Outcome> {
    let policies = match choice {
        PolicyChoice::Both => vec![Policy::mpc(), Policy::mpc_go()],
        PolicyChoice::Mpc => vec![Policy::mpc()],
        PolicyChoice::MpcGo => vec![Policy::mpc_go()],
    };
    policies
        .into_iter()
        .map(|p| {
            let settings = SimSettings {
                check_every,
                ..SimSettings::new(p, seed)
            };
            simulate(config, workload, &settings)
        })
        .collect()
}

/// Runs `mpc simulate`: prints [`output`].
pub fn run(args: &SimulateArgs) -> Result<(), SimulateError> {
    print!("{}", output(args)?);
    Ok(())
}

/// Simulates as `args` say, writes the chart if asked, and returns what `mpc simulate` prints.
pub fn output(args: &SimulateArgs) -> Result<String, SimulateError> {
    let started = Instant::now();
    let (config, config_name, config_errors) = match &args.config {
        Some(path) => {
            let shown = path.display().to_string();
            let (c, e) = load_config(&read(path)?, &shown)?;
            (c, shown, e)
        }
        None => {
            let (c, e) = load_config(EXAMPLE_CONFIG, "built-in example")?;
            (c, "built-in production-shaped example".to_owned(), e)
        }
    };
    let workload = match &args.workload {
        Some(path) => {
            Workload::parse(&read(path)?, path.display().to_string()).map_err(|source| {
                SimulateError::Workload {
                    path: path.clone(),
                    source,
                }
            })?
        }
        None => workload::bursty_day(args.taskruns, args.seed),
    };
    let check_every = args.check.then_some(args.check_every.max(1));
    let outcomes = run_policies_checked(&config, &workload, args.policy, args.seed, check_every);
    for o in &outcomes {
        if let Some(v) = &o.violation {
            return Err(SimulateError::State {
                policy: o.policy,
                event: v.event,
                at_ms: v.at_ms,
                error: v.error.clone(),
            });
        }
    }
    let mut text = String::new();
    text.push_str(&format!("config:   {config_name}"));
    if config_errors > 0 {
        text.push_str(&format!(
            " ({config_errors} error(s): affected platforms get error secrets; see mpc check-config)"
        ));
    }
    text.push_str(&format!(
        "\nworkload: {} ({} TaskRuns over {})\n\n",
        workload.description,
        workload.jobs.len(),
        report::duration(workload.span())
    ));
    text.push_str(&report::render(&outcomes));
    text.push_str(&report::render_mac_hosts(&outcomes));
    if !config.capacity_groups.is_empty() {
        text.push_str(&group_effect(
            &config,
            &workload,
            args,
            &outcomes,
            check_every,
        ));
    }
    text.push('\n');
    text.push_str(report::LEGEND);
    text.push('\n');
    if args.policy != PolicyChoice::Mpc {
        text.push_str(report::GO_LEGEND);
        text.push('\n');
    }
    if let Some(path) = &args.chart {
        let svg = chart::render(&outcomes, "mpc simulate", &workload.description);
        std::fs::write(path, svg).map_err(|source| SimulateError::Io {
            path: path.clone(),
            source,
        })?;
        text.push_str(&format!("chart:    {}\n", path.display()));
    }
    let events: u64 = outcomes.iter().map(|o| o.events).sum();
    let checked = if args.check {
        let checks: u64 = outcomes.iter().map(|o| o.checks).sum();
        format!("; state checked {checks} times, every invariant held")
    } else {
        String::new()
    };
    text.push_str(&format!(
        "simulated in {:.2} s ({} scheduler events, seed {}{checked})\n",
        started.elapsed().as_secs_f64(),
        events,
        args.seed
    ));
    Ok(text)
}

/// The capacity groups' section: the same trace and seed run again with every group removed, so
/// the members' waits show what the groups cost (and their peaks what they prevent).
fn group_effect(
    config: &HostConfig,
    workload: &Workload,
    args: &SimulateArgs,
    with: &[Outcome],
    check_every: Option<u64>,
) -> String {
    let mut ungrouped = config.clone();
    ungrouped.capacity_groups.clear();
    let groups: Vec<(String, u32, Vec<String>)> = config
        .capacity_groups
        .values()
        .map(|g| {
            let members = g.members.iter().map(|m| m.as_str().to_owned()).collect();
            (g.name.clone(), g.max, members)
        })
        .collect();
    let watch: Vec<(String, Vec<String>)> = groups
        .iter()
        .map(|(name, _, members)| (name.clone(), members.clone()))
        .collect();
    let without: Vec<Outcome> = with
        .iter()
        .map(|o| {
            let policy = if o.policy == Policy::mpc_go().name {
                Policy::mpc_go()
            } else {
                Policy::mpc()
            };
            let settings = SimSettings {
                check_every,
                watch_groups: watch.clone(),
                ..SimSettings::new(policy, args.seed)
            };
            simulate(&ungrouped, workload, &settings)
        })
        .collect();
    report::render_groups(&groups, with, &without)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_config_is_valid_and_covers_every_strategy() {
        let (c, errors) = load_config(EXAMPLE_CONFIG, "x").unwrap();
        assert_eq!(errors, 0);
        assert!(!c.local.is_empty() && !c.dynamic.is_empty());
        assert!(!c.pools.is_empty() && !c.static_pools.is_empty());
        // Every platform of the built-in day is served.
        let w = workload::bursty_day(2000, 1);
        for j in &w.jobs {
            let p = crate::platform::Platform::parse(&j.platform).unwrap();
            assert!(
                !matches!(
                    c.resolve(&p),
                    crate::config::Strategy::Unknown | crate::config::Strategy::Disabled(_)
                ),
                "{p}"
            );
        }
    }

    /// A capacity group caps its members' instances alive at once, and the report says what it
    /// costs: the same trace without it peaks higher and waits less.
    #[test]
    fn a_capacity_group_caps_its_members_and_the_report_shows_the_cost() {
        let text = include_str!("../../tests/fixtures/configmaps/capacity-group.yaml");
        let (config, errors) = load_config(text, "capacity-group.yaml").unwrap();
        assert_eq!(errors, 0);
        let jobs = (0..400)
            .map(|i| workload::Job {
                at: f64::from(i) * 0.5,
                namespace: format!("t{}", i % 5),
                platform: ["linux/amd64", "linux/arm64", "linux-mlarge/amd64"][i as usize % 3]
                    .into(),
                duration: 1800.0,
            })
            .collect();
        let w = Workload {
            jobs,
            description: "burst".into(),
        };
        let with = run_policies_checked(&config, &w, PolicyChoice::Mpc, 3, Some(500));
        assert!(with[0].violation.is_none(), "{:?}", with[0].violation);
        assert_eq!(with[0].group_peaks["aws-ip"], 120);
        let args = SimulateArgs {
            config: None,
            workload: None,
            policy: PolicyChoice::Mpc,
            seed: 3,
            taskruns: 0,
            chart: None,
            check: false,
            check_every: DEFAULT_CHECK_EVERY,
        };
        let section = group_effect(&config, &w, &args, &with, None);
        let lines: Vec<&str> = section.lines().skip(3).collect();
        assert!(lines[0].starts_with("aws-ip "), "{section}");
        let field = |line: &str, i: usize| line.split_whitespace().nth(i).unwrap().to_owned();
        // group row: name policy run limit peak ...; without row: run limit peak ...
        assert_eq!(
            (field(lines[0], 3), field(lines[0], 4)),
            ("120".into(), "120".into())
        );
        let peak_without: u32 = field(lines[1], 2).parse().unwrap();
        assert!(peak_without > 120, "{section}");
    }
}
