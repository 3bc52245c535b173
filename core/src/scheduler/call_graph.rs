//! The scheduler's files call each other without a cycle: behaviour is layered (event handlers
//! and timers over the strategies, the strategies over the transition function, which calls
//! nothing above it), so a change to one layer never has to follow a loop back into itself.
//!
//! Read from the source text: the methods of each `impl Type` block, per file, and the
//! `self.method(` and `Self::method(` calls inside them; a call from one file to a method of the
//! same type defined in another is an edge between the files. Test modules (`tests/` and
//! `#[cfg(test)] mod`) are not read. A method name defined in two files of the same type cannot
//! be resolved: that fails too.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Where to read: the scheduler's directory.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/scheduler")
}

/// The source files under `dir` (relative names), test files excluded.
fn files(dir: &Path, base: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let rel = path.strip_prefix(base).expect("under base");
        let name = rel.to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "tests" {
                files(&path, base, out);
            }
        } else if name.ends_with(".rs") && name != "call_graph.rs" {
            let text = std::fs::read_to_string(&path).expect("readable source");
            out.push((name, strip(&text)));
        }
    }
}

/// The text with comments, string and char literals blanked and test modules cut.
fn strip(text: &str) -> String {
    // An inline test module (`mod tests;` declares a file, read or not by its own rule).
    let mut cut = text.len();
    let mut from = 0;
    while let Some(at) = text[from..].find("#[cfg(test)]\nmod ") {
        let start = from + at;
        let after = &text[start + "#[cfg(test)]\nmod ".len()..];
        let name = ident_at(after);
        if after[name.len()..].trim_start().starts_with('{') {
            cut = start;
            break;
        }
        from = start + 1;
    }
    let text = &text[..cut];
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && (b.get(i + 2) == Some(&b'\'') || (b.get(i + 1) == Some(&b'\\')))
        {
            // A char literal ('x', '\n', '\''); a lifetime has no closing quote there.
            i += 2;
            while i < b.len() && b[i] != b'\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            let c = text[i..].chars().next().expect("in bounds");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// Each `impl [<..>] Type {` block of `code`: the type and the block's body.
fn impls(code: &str) -> Vec<(String, &str)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("impl") {
        let start = from + at;
        from = start + 4;
        let before_ok =
            start == 0 || !code[..start].ends_with(|c: char| c.is_alphanumeric() || c == '_');
        let rest = &code[start + 4..];
        if !before_ok || !rest.starts_with([' ', '<']) {
            continue;
        }
        let Some(open) = rest.find('{') else { break };
        let head = rest[..open].trim();
        // `impl Trait for Type` blocks hold trait methods: not the type's own.
        if head.contains(" for ") || head.contains(';') {
            continue;
        }
        let head = if head.starts_with('<') {
            let mut depth = 0;
            let mut end = 0;
            for (i, c) in head.char_indices() {
                match c {
                    '<' => depth += 1,
                    '>' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            head[end..].trim()
        } else {
            head
        };
        let ty = ident_at(head).to_owned();
        if ty.is_empty() {
            continue;
        }
        let body_start = start + 4 + open + 1;
        let mut depth = 1;
        let mut end = body_start;
        for (i, c) in code[body_start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = body_start + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((ty, &code[body_start..end]));
        from = end;
    }
    out
}

/// The methods an impl body defines at its top level.
fn methods(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    let b = body.as_bytes();
    while i < b.len() {
        match b[i] {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b'f' if depth == 0
                && body[i..].starts_with("fn ")
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                out.push(ident_at(&body[i + 3..]).to_owned());
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The methods `body` calls on `self` (or `Self::`), with how often.
fn calls(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    for prefix in ["self.", "Self::"] {
        let mut rest = body;
        while let Some(at) = rest.find(prefix) {
            let before = &rest[..at];
            rest = &rest[at + prefix.len()..];
            if before.ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '.') {
                continue;
            }
            let name = ident_at(rest);
            let after = rest[name.len()..].trim_start();
            if !name.is_empty() && (after.starts_with('(') || after.starts_with("::<")) {
                out.push(name.to_owned());
            }
        }
    }
    out
}

/// The file graph of the scheduler's methods.
struct Graph {
    /// (type, method) to the file defining it.
    defined: BTreeMap<(String, String), String>,
    /// Methods defined in two files of one type.
    ambiguous: BTreeSet<(String, String)>,
    /// (from file, to file) to the calls made, as "caller -> callee".
    edges: BTreeMap<(String, String), Vec<String>>,
}

fn graph(sources: &[(String, String)]) -> Graph {
    let mut defined = BTreeMap::new();
    let mut ambiguous = BTreeSet::new();
    for (file, code) in sources {
        for (ty, body) in impls(code) {
            for m in methods(body) {
                if let Some(other) = defined.insert((ty.clone(), m.clone()), file.clone())
                    && &other != file
                {
                    ambiguous.insert((ty.clone(), m));
                }
            }
        }
    }
    let mut edges: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (file, code) in sources {
        for (ty, body) in impls(code) {
            // Attribute each call to the method it is in.
            let mut depth = 0;
            let mut current = String::new();
            let mut start = 0;
            let b = body.as_bytes();
            let mut spans = Vec::new();
            for (i, &c) in b.iter().enumerate() {
                match c {
                    b'{' => depth += 1,
                    b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            spans.push((current.clone(), &body[start..=i]));
                        }
                    }
                    b'f' if depth == 0
                        && body[i..].starts_with("fn ")
                        && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
                    {
                        current = ident_at(&body[i + 3..]).to_owned();
                        start = i;
                    }
                    _ => {}
                }
            }
            for (caller, span) in spans {
                for callee in calls(span) {
                    let Some(to) = defined.get(&(ty.clone(), callee.clone())) else {
                        continue;
                    };
                    if to != file {
                        edges
                            .entry((file.clone(), to.clone()))
                            .or_default()
                            .push(format!("{caller} -> {callee}"));
                    }
                }
            }
        }
    }
    Graph {
        defined,
        ambiguous,
        edges,
    }
}

/// A cycle through the files, if any, as the files in order (the first repeated at the end).
fn cycle(edges: &BTreeMap<(String, String), Vec<String>>) -> Option<Vec<String>> {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges.keys() {
        next.entry(a).or_default().push(b);
    }
    // Depth-first search with colours; the path on the stack names the cycle.
    fn visit<'a>(
        n: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        done: &mut BTreeSet<&'a str>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|&p| p == n) {
            let mut c: Vec<String> = path[at..].iter().map(|s| s.to_string()).collect();
            c.push(n.to_owned());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n);
        for &m in next.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, next, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n);
        None
    }
    let mut done = BTreeSet::new();
    for &n in next.keys() {
        if let Some(c) = visit(n, &next, &mut done, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

fn sources() -> Vec<(String, String)> {
    let base = root();
    let mut out = Vec::new();
    files(&base, &base, &mut out);
    out
}

#[test]
fn scheduler_files_call_each_other_without_a_cycle() {
    let g = graph(&sources());
    assert!(
        g.ambiguous.is_empty(),
        "methods defined in two files: {:?}",
        g.ambiguous
    );
    if let Some(c) = cycle(&g.edges) {
        let calls: Vec<String> = c
            .windows(2)
            .map(|w| {
                let via = &g.edges[&(w[0].clone(), w[1].clone())];
                format!("{} -> {} ({})", w[0], w[1], via.join(", "))
            })
            .collect();
        panic!(
            "the scheduler's files call each other in a cycle: {}\n  {}",
            c.join(" -> "),
            calls.join("\n  ")
        );
    }
}

/// Only `transition.rs` writes a TaskRun's state or what other owners hold about it (a host's
/// load, a pool instance's attached TaskRuns, a dynamic instance's owner, the cleanups pending):
/// a write anywhere else could move one without the other.
#[test]
fn only_the_transitions_write_a_taskruns_state_and_its_relations() {
    const WRITES: &[&str] = &[
        ".state = State::",
        "&mut t.state",
        "mut t.state,",
        "hosts.add_load(",
        "hosts.release(",
        ".owner = ",
        ".owner.take()",
        ".attached.push(",
        ".attached.retain(",
        ".attached.clear(",
        ".attached.drain(",
        ".attached.remove(",
        ".attached.insert(",
        "State::Cleanup { pending } = &mut",
    ];
    let mut found = Vec::new();
    for (file, code) in sources() {
        if file == "transition.rs" {
            continue;
        }
        for w in WRITES {
            for (n, line) in code.lines().enumerate() {
                if line.contains(w) {
                    found.push(format!("{file}:{}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "TaskRun state or a relation written outside transition.rs:\n{}",
        found.join("\n")
    );
}

/// The numbers docs/architecture.md quotes: `cargo test -p mpc-core --lib call_graph -- --ignored
/// --nocapture`.
#[test]
#[ignore = "prints figures, asserts nothing"]
fn print_call_graph() {
    let g = graph(&sources());
    let mut per_file: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for ((ty, _), file) in &g.defined {
        *per_file.entry((ty, file)).or_default() += 1;
    }
    for ((ty, file), n) in &per_file {
        println!("methods {ty:<12} {file:<24} {n}");
    }
    let total: usize = g.defined.keys().filter(|(ty, _)| ty == "Scheduler").count();
    let files = per_file.keys().filter(|(ty, _)| *ty == "Scheduler").count();
    println!("Scheduler: {total} methods in {files} files");
    let mut n = 0;
    for ((a, b), via) in &g.edges {
        println!("calls {a} -> {b}: {}", via.len());
        n += via.len();
    }
    println!("cross-file calls: {n} over {} file pairs", g.edges.len());
    println!("cycle: {:?}", cycle(&g.edges));
    // Files in a cycle: those that reach each other (transitive closure).
    let nodes: BTreeSet<&String> = g.edges.keys().flat_map(|(a, b)| [a, b]).collect();
    let nodes: Vec<&String> = nodes.into_iter().collect();
    let at = |f: &String| nodes.iter().position(|n| *n == f).expect("a node");
    let mut reach = vec![vec![false; nodes.len()]; nodes.len()];
    for (a, b) in g.edges.keys() {
        reach[at(a)][at(b)] = true;
    }
    for k in 0..nodes.len() {
        for i in 0..nodes.len() {
            for j in 0..nodes.len() {
                reach[i][j] = reach[i][j] || (reach[i][k] && reach[k][j]);
            }
        }
    }
    let mut seen = BTreeSet::new();
    for (i, row) in reach.iter().enumerate() {
        let group: Vec<&str> = nodes
            .iter()
            .enumerate()
            .filter(|&(j, _)| row[j] && reach[j][i])
            .map(|(_, n)| n.as_str())
            .collect();
        if group.len() > 1 && seen.insert(group.clone()) {
            println!("files in one cycle ({}): {}", group.len(), group.join(" "));
        }
    }
}

#[test]
fn a_cycle_is_found_and_named() {
    let src = |s: &str| strip(s);
    let sources = vec![
        (
            "a.rs".to_owned(),
            src("impl S { fn a(&mut self) { self.b(); } // self.c()\n }"),
        ),
        (
            "b.rs".to_owned(),
            src("impl S { fn b(&mut self) { let _ = \"self.c()\"; self.c(1); } }"),
        ),
        (
            "c.rs".to_owned(),
            src("impl<'x> S { pub(super) fn c(&mut self, n: u32) { Self::a(self); } }"),
        ),
        (
            "d.rs".to_owned(),
            src("impl T { fn a(&self) { self.b(); } }"),
        ),
    ];
    let g = graph(&sources);
    assert_eq!(
        cycle(&g.edges),
        Some(vec![
            "a.rs".into(),
            "b.rs".into(),
            "c.rs".into(),
            "a.rs".into()
        ])
    );
    // Without the call back from c there is none; comments and strings are not calls.
    let sources: Vec<_> = sources
        .into_iter()
        .map(|(f, s)| (f, s.replace("Self::a(self);", "")))
        .collect();
    let g = graph(&sources);
    assert_eq!(cycle(&g.edges), None);
    assert_eq!(g.edges.len(), 2);
}
