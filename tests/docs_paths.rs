//! The documentation names only files that exist: every repository path written in backticks
//! in `README.md`, `RELIABILITY.md`, `BENCHMARKS.md`, `docs/*.md` and the READMEs of `e2e/`,
//! `webhook-certs/` and `supply-chain/` (paths from the repository root; brace groups such as
//! `fleet/{mod,pool}.rs` expanded) is a file or directory of the checkout. A file moved or
//! renamed without its page fails here, so the architecture page's walk of a TaskRun keeps
//! naming the code that does it.

use std::path::{Path, PathBuf};

/// Top-level directories whose paths the docs name.
const ROOTS: [&str; 13] = [
    "src/",
    "core/",
    "e2e/",
    "tests/",
    "manifests/",
    "docs/",
    "scripts/",
    "webhook-certs/",
    "examples/",
    "benches/",
    "fuzz/",
    "supply-chain/",
    ".ci/",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `a/{b,c}.rs` -> `a/b.rs`, `a/c.rs` (nested groups too).
fn expand(path: &str) -> Vec<String> {
    let Some(open) = path.find('{') else {
        return vec![path.to_owned()];
    };
    let Some(close) = path[open..].find('}').map(|c| open + c) else {
        return vec![path.to_owned()];
    };
    path[open + 1..close]
        .split(',')
        .flat_map(|alt| {
            expand(&format!(
                "{}{}{}",
                &path[..open],
                alt.trim(),
                &path[close + 1..]
            ))
        })
        .collect()
}

/// The repository paths among a page's backticked spans: a known root, then path characters
/// only (so commands, globs and placeholders such as `<name>` are left alone), with anything
/// after `:` or `#` (a line or an anchor) cut off.
fn paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, span) in text.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        let span = span.split([':', '#']).next().unwrap_or_default();
        if !ROOTS
            .iter()
            .any(|r| span.starts_with(r) || span == r.trim_end_matches('/'))
        {
            continue;
        }
        let pathlike = span
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-{},".contains(c));
        if pathlike && !span.contains("..") {
            out.extend(expand(span));
        }
    }
    out
}

fn pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = [
        "README.md",
        "RELIABILITY.md",
        "BENCHMARKS.md",
        "e2e/README.md",
        "webhook-certs/README.md",
        "supply-chain/README.md",
    ]
    .iter()
    .map(|p| repo().join(p))
    .collect();
    for entry in std::fs::read_dir(repo().join("docs")).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "md") {
            pages.push(p);
        }
    }
    pages.sort();
    pages
}

#[test]
fn every_path_the_docs_name_exists() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for p in paths(&text) {
            checked += 1;
            if !Path::new(&repo().join(&p)).exists() {
                missing.push(format!(
                    "{}: {p}",
                    page.strip_prefix(repo()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} paths found: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "named but missing:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_scan_finds_paths_and_expands_groups_but_leaves_commands_alone() {
    let text = "see `core/src/scheduler/fleet/{mod,pool}.rs` and `src/controller/driver.rs:42`, \
                not `cargo run -- simulate`, `e2e/<name>.rs` or `src/*.rs`; `docs/` is a dir";
    assert_eq!(
        paths(text),
        [
            "core/src/scheduler/fleet/mod.rs",
            "core/src/scheduler/fleet/pool.rs",
            "src/controller/driver.rs",
            "docs/",
        ]
    );
}
