//! Workload traces: when each TaskRun arrives, in which namespace, for which platform, and how
//! long its build runs once it has a host.
//!
//! Trace files (`--workload`), times in seconds from the start of the trace:
//!
//! CSV, with a header naming these columns in any order (extra columns are ignored; `#` starts
//! a comment line):
//! ```text
//! at,namespace,platform,duration
//! 0,team-a,linux/arm64,420
//! 12.5,team-b,linux/s390x,900
//! ```
//!
//! YAML:
//! ```yaml
//! taskruns:
//!   - {at: 0, namespace: team-a, platform: linux/arm64, duration: 420}
//!   - {at: 12.5, namespace: team-b, platform: linux/s390x, duration: 900}
//! ```

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;

use super::latency::lognormal;

/// One TaskRun of a trace.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Job {
    /// Arrival, seconds from the start of the trace.
    pub at: f64,
    pub namespace: String,
    /// `PLATFORM` param.
    pub platform: String,
    /// Build duration once it has a host, seconds.
    pub duration: f64,
}

/// A trace: jobs sorted by arrival.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Workload {
    pub jobs: Vec<Job>,
    /// What it is, for the report.
    pub description: String,
}

/// Why a trace file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A CSV line is wrong.
    #[error("line {line}: {message}")]
    Csv {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The YAML does not parse.
    #[error("{0}")]
    Yaml(String),
    /// A job is invalid.
    #[error("TaskRun #{index}: {message}")]
    Job {
        /// 1-based position.
        index: usize,
        /// What is wrong.
        message: String,
    },
    /// Nothing in it.
    #[error("the trace has no TaskRuns")]
    Empty,
}

impl Workload {
    /// Parses a trace; YAML when it starts like YAML (`taskruns:` or `---`), CSV otherwise.
    pub fn parse(text: &str, description: String) -> Result<Self, WorkloadError> {
        let first = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .unwrap_or("");
        let mut jobs = if first.starts_with("taskruns:") || first.starts_with("---") {
            parse_yaml(text)?
        } else {
            parse_csv(text)?
        };
        for (i, j) in jobs.iter().enumerate() {
            let bad = |m: &str| WorkloadError::Job {
                index: i + 1,
                message: m.to_owned(),
            };
            if !(j.at.is_finite() && j.at >= 0.0) {
                return Err(bad("`at` must be a non-negative number of seconds"));
            }
            if !(j.duration.is_finite() && j.duration >= 0.0) {
                return Err(bad("`duration` must be a non-negative number of seconds"));
            }
            if j.namespace.is_empty() || j.platform.is_empty() {
                return Err(bad("`namespace` and `platform` must not be empty"));
            }
        }
        if jobs.is_empty() {
            return Err(WorkloadError::Empty);
        }
        jobs.sort_by(|a, b| a.at.total_cmp(&b.at));
        Ok(Workload { jobs, description })
    }

    /// Length of the trace (last arrival), seconds.
    pub fn span(&self) -> f64 {
        self.jobs.last().map_or(0.0, |j| j.at)
    }
}

fn parse_yaml(text: &str) -> Result<Vec<Job>, WorkloadError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct File {
        taskruns: Vec<Job>,
    }
    serde_norway::from_str::<File>(text)
        .map(|f| f.taskruns)
        .map_err(|e| WorkloadError::Yaml(e.to_string()))
}

fn parse_csv(text: &str) -> Result<Vec<Job>, WorkloadError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    let Some((hline, header)) = lines.next() else {
        return Ok(Vec::new());
    };
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let find = |name: &str| {
        cols.iter()
            .position(|c| *c == name)
            .ok_or_else(|| WorkloadError::Csv {
                line: hline + 1,
                message: format!(
                    "the header must name the columns at,namespace,platform,duration (missing {name:?})"
                ),
            })
    };
    let (at, ns, pf, du) = (
        find("at")?,
        find("namespace")?,
        find("platform")?,
        find("duration")?,
    );
    let mut jobs = Vec::new();
    for (i, line) in lines {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let get = |c: usize| {
            f.get(c).copied().ok_or_else(|| WorkloadError::Csv {
                line: i + 1,
                message: format!("expected {} fields, found {}", cols.len(), f.len()),
            })
        };
        let num = |c: usize, what: &str| -> Result<f64, WorkloadError> {
            let v = get(c)?;
            v.parse::<f64>().map_err(|_| WorkloadError::Csv {
                line: i + 1,
                message: format!("{what} {v:?} is not a number of seconds"),
            })
        };
        jobs.push(Job {
            at: num(at, "at")?,
            namespace: get(ns)?.to_owned(),
            platform: get(pf)?.to_owned(),
            duration: num(du, "duration")?,
        });
    }
    Ok(jobs)
}

/// Platforms of the built-in day: (platform, share of TaskRuns, median build minutes).
const MIX: &[(&str, f64, f64)] = &[
    ("linux/amd64", 0.30, 6.0),
    ("linux/arm64", 0.26, 7.0),
    ("linux-mlarge/amd64", 0.06, 9.0),
    ("linux-c4xlarge/arm64", 0.04, 12.0),
    ("linux-m2xlarge/arm64", 0.06, 10.0),
    ("linux/s390x", 0.09, 9.0),
    ("linux/ppc64le", 0.07, 8.0),
    ("linux/x86_64", 0.12, 5.0),
];

/// A bursty working day: a diurnal base load from 40 tenants (a few much busier than the rest),
/// a mass rebuild at 02:00 (dependency bumps across every component) and a release-day spike
/// at 14:00 from one tenant. `taskruns` scales the whole day.
pub fn bursty_day(taskruns: usize, seed: u64) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let day = 24.0 * 3600.0;
    // Tenant weights: Zipf-like, so a few tenants dominate.
    let tenants: Vec<(String, f64)> = (0..40)
        .map(|i| (format!("tenant-{i:02}"), 1.0 / (1.0 + i as f64)))
        .collect();
    let total_w: f64 = tenants.iter().map(|t| t.1).sum();
    let pick_tenant = |rng: &mut StdRng| {
        let mut x = rng.r#gen::<f64>() * total_w;
        for (name, w) in &tenants {
            if x < *w {
                return name.clone();
            }
            x -= w;
        }
        tenants[0].0.clone()
    };
    let pick_platform = |rng: &mut StdRng| {
        let mut x = rng.r#gen::<f64>();
        for &(p, share, minutes) in MIX {
            if x < share {
                return (p, minutes);
            }
            x -= share;
        }
        (MIX[0].0, MIX[0].2)
    };
    let burst_rebuild = taskruns * 12 / 100;
    let burst_release = taskruns * 8 / 100;
    let base = taskruns - burst_rebuild - burst_release;
    let mut jobs = Vec::with_capacity(taskruns);
    // Diurnal base: rejection-sample arrival times against a working-hours curve.
    while jobs.len() < base {
        let t = rng.r#gen::<f64>() * day;
        let hour = t / 3600.0;
        let shape = 0.25 + 0.75 * (-((hour - 13.0) / 4.0).powi(2)).exp();
        if rng.r#gen::<f64>() > shape {
            continue;
        }
        let (p, minutes) = pick_platform(&mut rng);
        jobs.push(Job {
            at: t,
            namespace: pick_tenant(&mut rng),
            platform: p.to_owned(),
            duration: lognormal(&mut rng, minutes * 60.0, 0.5),
        });
    }
    // 02:00: every tenant's components rebuilt within ten minutes.
    for _ in 0..burst_rebuild {
        let (p, minutes) = pick_platform(&mut rng);
        jobs.push(Job {
            at: 2.0 * 3600.0 + rng.r#gen::<f64>() * 600.0,
            namespace: pick_tenant(&mut rng),
            platform: p.to_owned(),
            duration: lognormal(&mut rng, minutes * 60.0, 0.5),
        });
    }
    // 14:00: one small tenant's release: many multi-arch builds in five minutes.
    for _ in 0..burst_release {
        let (p, minutes) = pick_platform(&mut rng);
        jobs.push(Job {
            at: 14.0 * 3600.0 + rng.r#gen::<f64>() * 300.0,
            namespace: "tenant-release".to_owned(),
            platform: p.to_owned(),
            duration: lognormal(&mut rng, minutes * 60.0, 0.4),
        });
    }
    jobs.sort_by(|a, b| a.at.total_cmp(&b.at));
    Workload {
        jobs,
        description: format!(
            "built-in bursty day: {taskruns} TaskRuns from 41 tenants, a mass rebuild at 02:00 and a release spike at 14:00"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_with_columns_in_any_order_and_comments() {
        let w = Workload::parse(
            "# trace\nplatform,at,duration,namespace,extra\nlinux/arm64,5,60,a,x\nlinux/s390x,1.5,30,b,y\n",
            String::new(),
        )
        .unwrap();
        assert_eq!(w.jobs.len(), 2);
        assert_eq!(w.jobs[0].at, 1.5, "sorted by arrival");
        assert_eq!(w.jobs[0].platform, "linux/s390x");
    }

    #[test]
    fn csv_errors_name_the_line() {
        let e = Workload::parse(
            "at,namespace,platform,duration\n0,a,linux/arm64,soon\n",
            String::new(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "line 2: duration \"soon\" is not a number of seconds");
        let e = Workload::parse("at,namespace,duration\n", String::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing \"platform\""), "{e}");
        let e = Workload::parse(
            "at,namespace,platform,duration\n-1,a,b/c,1\n",
            String::new(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("TaskRun #1") && e.contains("non-negative"),
            "{e}"
        );
    }

    #[test]
    fn yaml_trace() {
        let w = Workload::parse(
            "taskruns:\n  - {at: 3, namespace: a, platform: linux/arm64, duration: 60}\n",
            String::new(),
        )
        .unwrap();
        assert_eq!(w.jobs[0].duration, 60.0);
        assert!(Workload::parse("taskruns:\n  - {at: 3}\n", String::new()).is_err());
    }

    #[test]
    fn built_in_day_is_deterministic_and_bursty() {
        let a = bursty_day(5000, 7);
        assert_eq!(a, bursty_day(5000, 7));
        assert_ne!(a.jobs, bursty_day(5000, 8).jobs);
        assert_eq!(a.jobs.len(), 5000);
        let in_window =
            |from: f64, to: f64| a.jobs.iter().filter(|j| j.at >= from && j.at < to).count();
        // The 02:00 burst packs more into ten minutes than the surrounding hour's base load.
        assert!(in_window(7200.0, 7800.0) > 3 * in_window(3600.0, 7200.0));
    }
}
