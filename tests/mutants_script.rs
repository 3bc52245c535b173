//! `scripts/mutants.sh`, the hand mutation of the safety code: every mutant still matches the
//! code it mutates (the `--check` CI runs, seconds and no build), and a mutant that does not
//! match is reported STALE without a byte written anywhere, while one that applies is undone.
//!
//! The last three run the script in a scratch copy of the repository layout with a stand-in
//! `cargo` first on `PATH`, so no build runs and every file the script touches is visible.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The target string of the `uid-test` mutant (as in `mutant_strings` in the script).
const UID_TEST_TARGET: &str = r#"p.test("/metadata/uid", json!(uid));"#;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `bash <root>/scripts/mutants.sh ARGS` (bash and perl must be installed: a missing one
/// fails the test).
fn run(root: &Path, args: &[&str], envs: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg(root.join("scripts/mutants.sh")).args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("bash runs")
}

#[test]
fn every_mutant_still_matches_the_code() {
    let out = run(&repo(), &["--check"], &[]);
    assert!(
        out.status.success(),
        "scripts/mutants.sh --check: {}\n{}{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    // Each listed mutant was checked and found its target.
    let listed = run(&repo(), &["--list"], &[]);
    assert!(listed.status.success());
    let ids: Vec<String> = text(&listed.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    assert!(ids.len() >= 10, "{ids:?}");
    let checked = text(&out.stdout);
    for id in &ids {
        assert!(
            checked
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == [id, "ok"]),
            "{id} not checked ok: {checked}"
        );
    }
}

/// A scratch repository holding only the script, and a stand-in `cargo` that records each call
/// and the content of `src/controller/patch.rs` (when present) at the time of the call.
struct Scratch {
    dir: tempfile::TempDir,
    bin: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("scripts")).unwrap();
        std::fs::copy(
            repo().join("scripts/mutants.sh"),
            dir.path().join("scripts/mutants.sh"),
        )
        .unwrap();
        let bin = tempfile::tempdir().unwrap();
        let cargo = bin.path().join("cargo");
        std::fs::write(
            &cargo,
            "#!/bin/sh\necho \"$*\" >>\"$CARGO_CALLS\"\n\
             if [ -f src/controller/patch.rs ]; then cat src/controller/patch.rs >>\"$CARGO_CALLS\"; fi\n\
             exit 0\n",
        )
        .unwrap();
        std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
        Self { dir, bin }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn calls(&self) -> PathBuf {
        self.bin.path().join("calls")
    }

    /// Runs the script with `args`, no baseline, the stand-in cargo first on PATH.
    fn run(&self, args: &[&str]) -> Output {
        let path = format!(
            "{}:{}",
            self.bin.path().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("bash");
        cmd.arg(self.root().join("scripts/mutants.sh"))
            .args(args)
            .env("PATH", path)
            .env("NO_BASELINE", "1")
            .env("CARGO_CALLS", self.calls());
        cmd.output().expect("bash runs")
    }

    /// Every file under the scratch root with its content.
    fn files(&self) -> BTreeMap<PathBuf, Vec<u8>> {
        fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    walk(root, &p, out);
                } else {
                    let rel = p.strip_prefix(root).unwrap().to_owned();
                    out.insert(rel, std::fs::read(&p).unwrap());
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(self.root(), self.root(), &mut out);
        out
    }

    fn put(&self, rel: &str, content: &str) {
        let p = self.root().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }
}

/// The result column of each mutant in the script's final table.
fn results(out: &Output) -> BTreeMap<String, String> {
    text(&out.stdout)
        .lines()
        .skip_while(|l| !l.starts_with("MUTANT"))
        .skip(1)
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_owned(), w.next()?.to_owned()))
        })
        .collect()
}

#[test]
fn a_mutant_whose_file_is_missing_is_stale_and_nothing_is_written() {
    let s = Scratch::new();
    let before = s.files();
    let out = s.run(&[]);
    let table = results(&out);
    let listed = run(&repo(), &["--list"], &[]);
    let ids: Vec<String> = text(&listed.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    for id in &ids {
        assert_eq!(
            table.get(id).map(String::as_str),
            Some("STALE"),
            "{id}: {}",
            text(&out.stdout)
        );
    }
    assert_eq!(out.status.code(), Some(ids.len() as i32));
    // Not one file written, no suite run.
    assert_eq!(s.files(), before, "{}", text(&out.stderr));
    assert!(!s.calls().exists(), "cargo ran for a stale mutant");
    // `--check` says the same in seconds, and fails.
    let check = s.run(&["--check"]);
    assert!(!check.status.success());
    assert!(
        text(&check.stdout).contains("uid-test         STALE  no file src/controller/patch.rs"),
        "{}",
        text(&check.stdout)
    );
}

#[test]
fn a_target_found_twice_is_stale_and_its_file_left_as_it_was() {
    let s = Scratch::new();
    let twice = format!("fn a() {{ {UID_TEST_TARGET} }}\nfn b() {{ {UID_TEST_TARGET} }}\n");
    s.put("src/controller/patch.rs", &twice);
    let before = s.files();
    let out = s.run(&["uid-test"]);
    assert_eq!(
        results(&out).get("uid-test").map(String::as_str),
        Some("STALE")
    );
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(s.files(), before);
    assert!(!s.calls().exists(), "cargo ran for a stale mutant");
    let check = s.run(&["--check"]);
    assert!(
        text(&check.stdout).contains("target string found 2 times in src/controller/patch.rs"),
        "{}",
        text(&check.stdout)
    );
}

#[test]
fn an_applied_mutant_is_in_place_while_its_suites_run_and_undone_after() {
    let s = Scratch::new();
    let original = format!("fn a() {{ {UID_TEST_TARGET} }}\n");
    s.put("src/controller/patch.rs", &original);
    let before = s.files();
    let out = s.run(&["uid-test"]);
    // The stand-in cargo fails no test: the mutant survives.
    assert_eq!(
        results(&out).get("uid-test").map(String::as_str),
        Some("SURVIVED"),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(1));
    let calls = std::fs::read_to_string(s.calls()).unwrap();
    assert!(calls.contains("nextest run"), "{calls}");
    assert!(
        calls.contains("fn a() { let _ = uid; }") && !calls.contains(UID_TEST_TARGET),
        "the suites ran on the mutant: {calls}"
    );
    assert_eq!(
        s.files(),
        before,
        "restored byte for byte, nothing else left"
    );
}
