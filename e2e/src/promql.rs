//! What a PromQL expression reads, and what a Prometheus text exposition offers, so dashboards and
//! alerts can be checked against the metric families the binaries export.
//!
//! The extractor is a tokenizer with a little context, not a PromQL parser: an identifier is a
//! metric name when it is followed by `{` or stands as a selector; identifiers followed by `(` are
//! functions or aggregations, `by`/`without`/`on`/`ignoring`/`group_left`/`group_right` lists are
//! label names, and keywords, numbers, durations, strings and Grafana `$variables` are skipped.

use std::collections::{BTreeMap, BTreeSet};

/// One vector selector: a metric name and the label names its matchers use.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Selector {
    pub metric: String,
    pub labels: BTreeSet<String>,
}

/// Everything an expression reads: its selectors, and the label names of its grouping and
/// vector-matching clauses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Uses {
    pub selectors: Vec<Selector>,
    pub grouping: BTreeSet<String>,
}

/// Why an expression could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PromqlError {
    #[error("unterminated string starting at byte {0}")]
    UnterminatedString(usize),
    #[error("unexpected {found:?} at byte {at} (expected {expected})")]
    Unexpected {
        found: String,
        at: usize,
        expected: &'static str,
    },
    #[error("unexpected end of expression (expected {0})")]
    End(&'static str),
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    /// Numbers, durations, `$variables`, operators: nothing a name check needs.
    Other(String),
    Open(char),
    Close(char),
    Comma,
}

/// Keywords followed by a parenthesised list of label names.
const LABEL_LISTS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];
/// Set operators, modifiers and literals: never metric names either.
const KEYWORDS: [&str; 7] = ["and", "or", "unless", "bool", "offset", "inf", "nan"];

fn tokenize(expr: &str) -> Result<Vec<(usize, Tok)>, PromqlError> {
    let b = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    while i < b.len() {
        let c = b[i];
        let start = i;
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' | b'\'' | b'`' => {
                i += 1;
                let mut s = String::new();
                loop {
                    let Some(&d) = b.get(i) else {
                        return Err(PromqlError::UnterminatedString(start));
                    };
                    i += 1;
                    if d == c {
                        break;
                    }
                    if d == b'\\' && c != b'`' {
                        if let Some(&e) = b.get(i) {
                            s.push(e as char);
                            i += 1;
                        }
                        continue;
                    }
                    s.push(d as char);
                }
                out.push((start, Tok::Str(s)));
            }
            b'(' | b'{' | b'[' => {
                out.push((start, Tok::Open(c as char)));
                i += 1;
            }
            b')' | b'}' | b']' => {
                out.push((start, Tok::Close(c as char)));
                i += 1;
            }
            b',' => {
                out.push((start, Tok::Comma));
                i += 1;
            }
            b'$' => {
                // Grafana variables: `$platform`, `${platform}`, `$__rate_interval`.
                i += 1;
                if b.get(i) == Some(&b'{') {
                    while i < b.len() && b[i] != b'}' {
                        i += 1;
                    }
                    i += 1;
                } else {
                    while i < b.len() && word(b[i]) {
                        i += 1;
                    }
                }
                out.push((start, Tok::Other(expr[start..i.min(b.len())].to_owned())));
            }
            c if c.is_ascii_digit() || c == b'.' => {
                // Numbers and durations (`0.99`, `5m`, `1h30m`, `1e3`).
                while i < b.len() && (word(b[i]) || b[i] == b'.') {
                    i += 1;
                }
                out.push((start, Tok::Other(expr[start..i].to_owned())));
            }
            c if word(c) => {
                while i < b.len() && word(b[i]) {
                    i += 1;
                }
                out.push((start, Tok::Ident(expr[start..i].to_owned())));
            }
            _ => {
                i += 1;
                out.push((start, Tok::Other((c as char).to_string())));
            }
        }
    }
    Ok(out)
}

/// The selectors and grouping labels of `expr`.
pub fn uses(expr: &str) -> Result<Uses, PromqlError> {
    let toks = tokenize(expr)?;
    let mut uses = Uses::default();
    let mut i = 0;
    while i < toks.len() {
        let next = toks.get(i + 1).map(|(_, t)| t);
        match &toks[i].1 {
            Tok::Ident(id) if LABEL_LISTS.contains(&id.as_str()) => {
                i += 1;
                // `group_left` may stand without a list.
                if next != Some(&Tok::Open('(')) {
                    continue;
                }
                let (labels, end) = label_list(&toks, i + 1)?;
                uses.grouping.extend(labels);
                i = end;
            }
            Tok::Ident(id) if KEYWORDS.contains(&id.as_str()) => i += 1,
            // A function or an aggregation (`sum(`, or `sum by (...) (`).
            Tok::Ident(_)
                if matches!(next, Some(Tok::Open('(')))
                    || matches!(next, Some(Tok::Ident(k)) if k == "by" || k == "without") =>
            {
                i += 1;
            }
            Tok::Ident(id) => {
                let mut s = Selector {
                    metric: id.clone(),
                    labels: BTreeSet::new(),
                };
                i += 1;
                if next == Some(&Tok::Open('{')) {
                    let (matchers, end) = matchers(&toks, i + 1)?;
                    s.labels = matchers.into_keys().collect();
                    i = end;
                }
                uses.selectors.push(s);
            }
            Tok::Open('{') => {
                // A selector without a name: `{__name__="x", ...}`.
                let (mut m, end) = matchers(&toks, i + 1)?;
                let metric = m.remove("__name__").ok_or(PromqlError::Unexpected {
                    found: "{".into(),
                    at: toks[i].0,
                    expected: "a metric name or __name__ matcher",
                })?;
                uses.selectors.push(Selector {
                    metric,
                    labels: m.into_keys().collect(),
                });
                i = end;
            }
            Tok::Open('[') => {
                // Range or subquery duration.
                while i < toks.len() && toks[i].1 != Tok::Close(']') {
                    i += 1;
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    Ok(uses)
}

/// `(a, b)` from the token after `(`; returns the names and the index after `)`.
fn label_list(toks: &[(usize, Tok)], mut i: usize) -> Result<(Vec<String>, usize), PromqlError> {
    let mut out = Vec::new();
    loop {
        match toks.get(i) {
            Some((_, Tok::Ident(l))) => out.push(l.clone()),
            Some((_, Tok::Comma)) => {}
            Some((_, Tok::Close(')'))) => return Ok((out, i + 1)),
            Some((at, t)) => return Err(unexpected(t, *at, "a label name")),
            None => return Err(PromqlError::End("`)`")),
        }
        i += 1;
    }
}

/// `label op "value", ...}` from the token after `{`; returns label → value and the index after
/// `}`.
fn matchers(
    toks: &[(usize, Tok)],
    mut i: usize,
) -> Result<(BTreeMap<String, String>, usize), PromqlError> {
    let mut out = BTreeMap::new();
    loop {
        match toks.get(i) {
            Some((_, Tok::Close('}'))) => return Ok((out, i + 1)),
            Some((_, Tok::Comma)) => i += 1,
            Some((_, Tok::Ident(label))) => {
                // The operator is one or two `Other` tokens (`=`, `!=`, `=~`, `!~`).
                let mut j = i + 1;
                while matches!(toks.get(j), Some((_, Tok::Other(o))) if ["=", "!", "~"].contains(&o.as_str()))
                {
                    j += 1;
                }
                match toks.get(j) {
                    Some((_, Tok::Str(v))) if j > i + 1 => {
                        out.insert(label.clone(), v.clone());
                        i = j + 1;
                    }
                    Some((at, t)) => return Err(unexpected(t, *at, "a matcher and a string")),
                    None => return Err(PromqlError::End("a label value")),
                }
            }
            Some((at, t)) => return Err(unexpected(t, *at, "a label matcher")),
            None => return Err(PromqlError::End("`}`")),
        }
    }
}

fn unexpected(t: &Tok, at: usize, expected: &'static str) -> PromqlError {
    PromqlError::Unexpected {
        found: format!("{t:?}"),
        at,
        expected,
    }
}

/// One metric family of an exposition: its type and the label names its series carry (`le`
/// and `quantile` included, from the buckets and quantiles).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Family {
    pub kind: String,
    pub labels: BTreeSet<String>,
}

/// The families of a Prometheus text exposition, by name. Families of several expositions (one
/// per process) merge with [`merge`].
pub fn families(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut w = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (w.next(), w.next()) {
                out.entry(name.to_owned()).or_default().kind = kind.to_owned();
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let series = &line[..name_end];
        let Some(family) = family_of(series, &out) else {
            continue;
        };
        let labels = series_labels(&line[name_end..]);
        if let Some(f) = out.get_mut(&family) {
            f.labels.extend(labels);
        }
    }
    out
}

/// Adds `more`'s families to `into` (label names unite).
pub fn merge(into: &mut BTreeMap<String, Family>, more: BTreeMap<String, Family>) {
    for (name, f) in more {
        let e = into.entry(name).or_default();
        e.kind = f.kind;
        e.labels.extend(f.labels);
    }
}

/// The family a series or selector name belongs to: itself, or for `_bucket`, `_sum` and
/// `_count` the histogram or summary it is part of.
pub fn family_of(series: &str, families: &BTreeMap<String, Family>) -> Option<String> {
    if families.contains_key(series) {
        return Some(series.to_owned());
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = series.strip_suffix(suffix)?;
        let f = families.get(base)?;
        let fits = match *suffix {
            "_bucket" => f.kind == "histogram",
            _ => f.kind == "histogram" || f.kind == "summary",
        };
        fits.then(|| base.to_owned())
    })
}

/// Label names of `{a="x",b="y"} 1`.
fn series_labels(rest: &str) -> Vec<String> {
    let Some(body) = rest.strip_prefix('{') else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut in_value = false;
    let mut escaped = false;
    let mut name = String::new();
    for c in body.chars() {
        if in_value {
            match (escaped, c) {
                (false, '\\') => escaped = true,
                (false, '"') => in_value = false,
                _ => escaped = false,
            }
            continue;
        }
        match c {
            '=' => out.push(std::mem::take(&mut name)),
            '"' => in_value = true,
            '}' => break,
            ',' | ' ' => {}
            c => name.push(c),
        }
    }
    out
}

/// Checks `uses` against exported `families`: every selector names an exported family (with the
/// histogram suffixes mapped), every matcher label exists on its family (`le` only on buckets),
/// and every grouping label exists on at least one family the expression reads. Returns one
/// message per problem.
pub fn check(uses: &Uses, families: &BTreeMap<String, Family>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut offered = BTreeSet::new();
    for s in &uses.selectors {
        let Some(name) = family_of(&s.metric, families) else {
            problems.push(format!("{} is not an exported metric family", s.metric));
            continue;
        };
        let f = &families[&name];
        let bucket = s.metric.ends_with("_bucket") && name != s.metric;
        let labels: BTreeSet<&str> = f
            .labels
            .iter()
            .map(String::as_str)
            .filter(|l| *l != "le" || bucket)
            .collect();
        for l in &s.labels {
            if !labels.contains(l.as_str()) {
                problems.push(format!(
                    "{}: label {l} is not on {name} (it has {labels:?})",
                    s.metric
                ));
            }
        }
        offered.extend(labels.iter().map(|l| (*l).to_owned()));
    }
    for l in &uses.grouping {
        if !offered.contains(l) {
            problems.push(format!(
                "grouping label {l} is on none of {:?}",
                uses.selectors.iter().map(|s| &s.metric).collect::<Vec<_>>()
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(expr: &str) -> Vec<(String, Vec<String>)> {
        uses(expr)
            .unwrap()
            .selectors
            .into_iter()
            .map(|s| (s.metric, s.labels.into_iter().collect()))
            .collect()
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn quantile_of_a_histogram_by_platform() {
        let u = uses(
            r#"histogram_quantile(0.95, sum by (le, platform) (rate(mpc_wait_time_bucket{platform=~"$platform"}[$__rate_interval])))"#,
        )
        .unwrap();
        assert_eq!(
            names(
                r#"histogram_quantile(0.95, sum by (le, platform) (rate(mpc_wait_time_bucket{platform=~"$platform"}[$__rate_interval])))"#
            ),
            [(
                "mpc_wait_time_bucket".to_owned(),
                vec!["platform".to_owned()]
            )]
        );
        assert_eq!(u.grouping, set(&["le", "platform"]));
    }

    #[test]
    fn bare_selectors_binary_operators_and_trailing_grouping() {
        assert_eq!(
            names("sum(a_total) by (x) / on(x) group_left b > 0 and c offset 5m unless d[1h]"),
            ["a_total", "b", "c", "d"].map(|n| (n.to_owned(), vec![]))
        );
        let u = uses("sum(a) by (x) / on(y) group_left(z) b").unwrap();
        assert_eq!(u.grouping, set(&["x", "y", "z"]));
    }

    #[test]
    fn keywords_numbers_strings_and_variables_are_not_metrics() {
        assert_eq!(
            names(
                r#"max without (instance) (m{a="by", b!~'sum(x)', c=`or`}) * 1e3 + 0.5 - inf or vector(1) > bool $threshold"#
            ),
            [(
                "m".to_owned(),
                vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]
            )]
        );
        assert_eq!(
            names(r#"{__name__="n", job="j"}"#),
            [("n".to_owned(), vec!["job".to_owned()])]
        );
        assert_eq!(
            names(r#"label_replace(x, "dst", "$1", "src", "(.*)")"#),
            [("x".to_owned(), vec![])]
        );
    }

    #[test]
    fn malformed_expressions_are_errors_naming_the_place() {
        assert_eq!(uses(r#"m{a="x"#), Err(PromqlError::UnterminatedString(4)));
        assert!(matches!(
            uses("m{a x}"),
            Err(PromqlError::Unexpected { at: 4, .. })
        ));
        assert_eq!(uses("sum by (a"), Err(PromqlError::End("`)`")));
        assert!(uses(r#"{job="j"}"#).is_err(), "no metric name");
    }

    const EXPOSITION: &str = r#"# HELP h A histogram.
# TYPE h histogram
h_bucket{platform="linux-arm64",le="1"} 0
h_bucket{platform="linux-arm64",le="+Inf"} 1
h_sum{platform="linux-arm64"} 0.5
h_count{platform="linux-arm64"} 1
# TYPE c counter
c{outcome="a \"quoted\", value",kind="x"} 3
# TYPE g gauge
g 1
"#;

    #[test]
    fn exposition_families_with_their_labels() {
        let f = families(EXPOSITION);
        assert_eq!(f["h"].kind, "histogram");
        assert_eq!(f["h"].labels, set(&["le", "platform"]));
        assert_eq!(f["c"].labels, set(&["kind", "outcome"]));
        assert_eq!(f["g"].labels, set(&[]));
        assert_eq!(family_of("h_count", &f).as_deref(), Some("h"));
        assert_eq!(family_of("g_count", &f), None, "a gauge has no _count");
        assert_eq!(family_of("c", &f).as_deref(), Some("c"));
    }

    #[test]
    fn check_names_unknown_families_and_labels() {
        let f = families(EXPOSITION);
        let ok = uses("histogram_quantile(0.9, sum by (le, platform) (rate(h_bucket[5m]))) + sum by (kind) (c)").unwrap();
        assert_eq!(check(&ok, &f), Vec::<String>::new());
        let bad =
            uses(r#"sum by (namespace) (rate(h_sum{le="1"}[5m])) + nope + c{kind="x", zone="z"}"#)
                .unwrap();
        let problems = check(&bad, &f);
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(problems[0].starts_with("h_sum: label le"), "{problems:?}");
        assert!(problems[1].starts_with("nope is not"), "{problems:?}");
        assert!(problems[2].starts_with("c: label zone"), "{problems:?}");
        assert!(
            problems[3].starts_with("grouping label namespace"),
            "{problems:?}"
        );
    }
}
