//! A hand-written SVG chart: TaskRuns waiting for a host and cloud instances alive, over time,
//! one line per policy.

use std::fmt::Write;

use super::engine::{Outcome, Sample};

const W: f64 = 960.0;
const PANEL_H: f64 = 220.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 62.0;
const GAP: f64 = 60.0;
const COLORS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// Renders the chart.
pub fn render(outcomes: &[Outcome], title: &str, subtitle: &str) -> String {
    let end = outcomes.iter().map(|o| o.end).fold(3600.0, f64::max);
    let h = TOP + 2.0 * PANEL_H + GAP + 50.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        escape(title)
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="40" fill="#555">{}</text>"##,
        escape(subtitle)
    );
    panel(
        &mut s,
        outcomes,
        end,
        TOP,
        "TaskRuns waiting for a build host",
        |x| x.waiting,
    );
    panel(
        &mut s,
        outcomes,
        end,
        TOP + PANEL_H + GAP,
        "Cloud instances alive",
        |x| x.instances,
    );
    // Legend.
    let ly = h - 18.0;
    for (i, o) in outcomes.iter().enumerate() {
        let x = LEFT + i as f64 * 140.0;
        let dash = if i == 0 {
            ""
        } else {
            r#" stroke-dasharray="6 3""#
        };
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
            x + 30.0,
            COLORS[i % COLORS.len()],
            x + 36.0,
            ly + 4.0,
            escape(o.policy)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn panel(
    s: &mut String,
    outcomes: &[Outcome],
    end: f64,
    top: f64,
    label: &str,
    value: impl Fn(&Sample) -> u32,
) {
    let plot_w = W - LEFT - RIGHT;
    let max = outcomes
        .iter()
        .flat_map(|o| o.samples.iter().map(&value))
        .max()
        .unwrap_or(0)
        .max(1);
    let ymax = nice(max as f64);
    let bottom = top + PANEL_H;
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="{}" font-weight="bold">{}</text>"#,
        top - 8.0,
        escape(label)
    );
    // Grid and axes.
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        let y = bottom - PANEL_H * k as f64 / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            v.round()
        );
    }
    let hours = (end / 3600.0).ceil().max(1.0) as u32;
    let step = if hours > 12 { 2 } else { 1 };
    for hr in (0..=hours).step_by(step) {
        let x = LEFT + plot_w * (hr as f64 * 3600.0 / end).min(1.0);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{bottom}" x2="{x:.1}" y2="{:.1}" stroke="#999"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{hr}h</text>"##,
            bottom + 4.0,
            bottom + 17.0
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" y1="{bottom}" x2="{:.1}" y2="{bottom}" stroke="#333"/>"##,
        W - RIGHT
    );
    for (i, o) in outcomes.iter().enumerate() {
        let mut pts = String::new();
        for x in &o.samples {
            let px = LEFT + plot_w * (x.t / end).min(1.0);
            let py = bottom - PANEL_H * (value(x) as f64 / ymax);
            let _ = write!(pts, "{px:.1},{py:.1} ");
        }
        let dash = if i == 0 {
            ""
        } else {
            r#" stroke-dasharray="6 3""#
        };
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5"{dash} points="{}"/>"#,
            COLORS[i % COLORS.len()],
            pts.trim_end()
        );
    }
}

/// The next "nice" axis maximum (1, 2, 5 × 10^k) at or above `v`.
fn nice(v: f64) -> f64 {
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * mag >= v {
            return m * mag;
        }
    }
    10.0 * mag
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn svg_has_one_line_per_policy_and_scales_to_the_data() {
        let o = |policy, peak| Outcome {
            policy,
            platforms: BTreeMap::new(),
            group_peaks: BTreeMap::new(),
            samples: vec![
                Sample {
                    t: 0.0,
                    waiting: 0,
                    instances: 0,
                },
                Sample {
                    t: 1800.0,
                    waiting: peak,
                    instances: 3,
                },
                Sample {
                    t: 3600.0,
                    waiting: 0,
                    instances: 1,
                },
            ],
            end: 3600.0,
            events: 0,
            checks: 0,
            violation: None,
        };
        let svg = render(&[o("mpc", 7), o("mpc-go", 140)], "t <1>", "sub");
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 4, "2 panels x 2 policies");
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.contains(">200<"), "axis rounded up from 140");
        assert_eq!(nice(7.0), 10.0);
        assert_eq!(nice(140.0), 200.0);
    }
}
