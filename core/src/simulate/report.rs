//! The text report: per platform, both policies on adjacent lines.

use std::fmt::Write;

use super::engine::{Kind, Outcome, PlatformStats};

/// `p`-th percentile (nearest rank) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `42s`, `3m05s`, `2h04m`.
pub fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

/// Build-time share of the capacity paid for, when meaningful.
fn utilisation(s: &PlatformStats, end: f64) -> Option<f64> {
    match s.kind {
        Kind::Static if s.slots > 0 && end > 0.0 => Some(s.build_secs / (s.slots as f64 * end)),
        Kind::Dynamic if s.instance_secs > 0.0 => Some(s.build_secs / s.instance_secs),
        Kind::Pool if s.instance_secs > 0.0 => {
            Some(s.build_secs / (s.instance_secs * s.slots.max(1) as f64))
        }
        _ => None,
    }
}

struct Row {
    taskruns: u64,
    p50: f64,
    p95: f64,
    p99: f64,
    max: f64,
    util: Option<f64>,
    peak: u32,
    inst_hours: f64,
    errors: u64,
    cloud: bool,
}

fn row(s: &PlatformStats, end: f64) -> Row {
    let mut w = s.waits.clone();
    w.sort_by(f64::total_cmp);
    Row {
        taskruns: s.taskruns,
        p50: percentile(&w, 50.0),
        p95: percentile(&w, 95.0),
        p99: percentile(&w, 99.0),
        max: w.last().copied().unwrap_or(0.0),
        util: utilisation(s, end),
        peak: s.peak_instances,
        inst_hours: s.instance_secs / 3600.0,
        errors: s.errors,
        cloud: matches!(s.kind, Kind::Dynamic | Kind::Pool),
    }
}

fn total(o: &Outcome) -> Row {
    let mut all = PlatformStats {
        kind: Kind::Unserved,
        taskruns: 0,
        waits: Vec::new(),
        errors: 0,
        build_secs: 0.0,
        instance_secs: 0.0,
        peak_instances: 0,
        slots: 0,
        mac: None,
    };
    for s in o.platforms.values() {
        all.taskruns += s.taskruns;
        all.waits.extend_from_slice(&s.waits);
        all.errors += s.errors;
        all.instance_secs += s.instance_secs;
    }
    let mut r = row(&all, o.end);
    r.cloud = true;
    r.peak = o.samples.iter().map(|s| s.instances).max().unwrap_or(0);
    r
}

fn line(out: &mut String, platform: &str, kind: &str, policy: &str, r: &Row) {
    let util = r
        .util
        .map_or_else(|| "-".to_owned(), |u| format!("{:.0}%", u * 100.0));
    let (peak, hours) = if r.cloud {
        (r.peak.to_string(), format!("{:.1}", r.inst_hours))
    } else {
        ("-".to_owned(), "-".to_owned())
    };
    let _ = writeln!(
        out,
        "{platform:<22} {kind:<7} {policy:<7} {:>8} {:>7} {:>7} {:>7} {:>7} {util:>5} {peak:>5} {hours:>9} {:>6}",
        r.taskruns,
        duration(r.p50),
        duration(r.p95),
        duration(r.p99),
        duration(r.max),
        r.errors,
    );
}

/// Renders the table for one or more runs of the same trace (policies side by side).
pub fn render(outcomes: &[Outcome]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:<7} {:<7} {:>8} {:>7} {:>7} {:>7} {:>7} {:>5} {:>5} {:>9} {:>6}",
        "PLATFORM",
        "KIND",
        "POLICY",
        "TASKRUNS",
        "WAIT50",
        "WAIT95",
        "WAIT99",
        "MAX",
        "UTIL",
        "PEAK",
        "INST-H",
        "ERRORS"
    );
    let Some(first) = outcomes.first() else {
        return out;
    };
    for (platform, s) in &first.platforms {
        for (i, o) in outcomes.iter().enumerate() {
            let Some(st) = o.platforms.get(platform) else {
                continue;
            };
            let name = if i == 0 { platform.as_str() } else { "" };
            let kind = if i == 0 { s.kind.label() } else { "" };
            line(&mut out, name, kind, o.policy, &row(st, o.end));
        }
    }
    for (i, o) in outcomes.iter().enumerate() {
        line(
            &mut out,
            if i == 0 { "all platforms" } else { "" },
            "",
            o.policy,
            &total(o),
        );
    }
    if outcomes.len() == 2 {
        let (a, b) = (total(&outcomes[0]), total(&outcomes[1]));
        let _ = writeln!(
            out,
            "\n{} vs {}: p95 wait {} vs {}, p99 {} vs {}, {:.0} vs {:.0} instance-hours, {} vs {} error secrets.",
            outcomes[0].policy,
            outcomes[1].policy,
            duration(a.p95),
            duration(b.p95),
            duration(a.p99),
            duration(b.p99),
            a.inst_hours,
            b.inst_hours,
            a.errors,
            b.errors
        );
    }
    out
}

/// The dedicated hosts of macOS platforms, when the trace has any: hosts allocated, host-hours
/// billed (at least 24 h each), the share of them instances ran, and launches refused while
/// every host was busy or being scrubbed. Empty otherwise.
pub fn render_mac_hosts(outcomes: &[Outcome]) -> String {
    let mut out = String::new();
    let Some(first) = outcomes.first() else {
        return out;
    };
    let macs: Vec<&String> = first
        .platforms
        .iter()
        .filter(|(_, s)| s.mac.is_some())
        .map(|(p, _)| p)
        .collect();
    if macs.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\nmacOS dedicated hosts: each billed for at least 24 h, scrubbed ~50 min after every \
         instance, boots 6-20 min.\n{:<22} {:<7} {:>5} {:>8} {:>5} {:>7}",
        "PLATFORM", "POLICY", "HOSTS", "HOST-H", "BUSY", "REFUSED"
    );
    for p in macs {
        for (i, o) in outcomes.iter().enumerate() {
            let Some((s, m)) = o.platforms.get(p).and_then(|s| Some((s, s.mac.as_ref()?))) else {
                continue;
            };
            let busy = if m.billed_secs > 0.0 {
                format!("{:.0}%", 100.0 * s.instance_secs / m.billed_secs)
            } else {
                "-".to_owned()
            };
            let _ = writeln!(
                out,
                "{:<22} {:<7} {:>5} {:>8.1} {busy:>5} {:>7}",
                if i == 0 { p.as_str() } else { "" },
                o.policy,
                m.hosts,
                m.billed_secs / 3600.0,
                m.refused,
            );
        }
    }
    let _ = writeln!(
        out,
        "HOST-H = host-hours billed (24 h minimum per host, past the end of the run included); BUSY =\n\
         instance time / host time billed; REFUSED = launches refused while every host was busy or\n\
         scrubbing (InsufficientInstanceCapacity; the scheduler backs off and launches again). mpc\n\
         counts a terminated instance's max-instances slot taken for the host's scrub (host-scrub,\n\
         50 min by default), mpc-go frees it at the termination."
    );
    out
}

/// Capacity groups: per group and policy, its limit and peak, and its members' waits, with the
/// group (`with`) and with every group removed from the config (`without`, the same trace and
/// seed); `groups` holds each group's (name, limit, members).
pub fn render_groups(
    groups: &[(String, u32, Vec<String>)],
    with: &[Outcome],
    without: &[Outcome],
) -> String {
    let mut out = String::new();
    if groups.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\ncapacity groups: their members' TaskRuns, with the group and without it (same trace and seed).\n\
         {:<22} {:<7} {:<7} {:>5} {:>5} {:>8} {:>7} {:>7} {:>7} {:>7}",
        "GROUP", "POLICY", "RUN", "LIMIT", "PEAK", "TASKRUNS", "WAIT50", "WAIT95", "WAIT99", "MAX"
    );
    for (name, limit, members) in groups {
        let mut first = true;
        for (o, base) in with.iter().zip(without) {
            for (run, outcome, limit) in [
                ("group", o, limit.to_string()),
                ("without", base, "-".to_owned()),
            ] {
                let mut waits: Vec<f64> = Vec::new();
                let mut taskruns = 0;
                for m in members {
                    if let Some(s) = outcome.platforms.get(m) {
                        taskruns += s.taskruns;
                        waits.extend_from_slice(&s.waits);
                    }
                }
                waits.sort_by(f64::total_cmp);
                // Without the group there is no group to count: the members' instances alive
                // at once all the same.
                let peak = outcome.group_peaks.get(name).copied().unwrap_or(0);
                let _ = writeln!(
                    out,
                    "{:<22} {:<7} {run:<7} {limit:>5} {peak:>5} {taskruns:>8} {:>7} {:>7} {:>7} {:>7}",
                    if first { name.as_str() } else { "" },
                    if run == "group" { outcome.policy } else { "" },
                    duration(percentile(&waits, 50.0)),
                    duration(percentile(&waits, 95.0)),
                    duration(percentile(&waits, 99.0)),
                    duration(waits.last().copied().unwrap_or(0.0)),
                );
                first = false;
            }
        }
    }
    let _ = writeln!(
        out,
        "PEAK = most instances of the group's members alive at once (a pool instance counts once)."
    );
    out
}

/// The legend printed under the table.
pub const LEGEND: &str = "\
WAIT = TaskRun created -> secret ready (queueing, instance boot, SSH provisioning). UTIL = build
time / capacity paid for (static: slots x run time; dynamic and pool: instance time x concurrency).
PEAK = most cloud instances alive at once; INST-H = instance-hours until the end of the run.";

/// Printed when the Go controller's policy ran.
pub const GO_LEGEND: &str =
    "mpc-go models the Go controller's timing: 1-minute requeues with one wake-up per completion,
first address check 2 minutes after launch then every check-interval, no idle reaping.";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_durations() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(duration(5.4), "5s");
        assert_eq!(duration(185.0), "3m05s");
        assert_eq!(duration(7440.0), "2h04m");
    }
}
