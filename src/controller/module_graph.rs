//! The controller's modules form no import cycle: data flows sources → loop → executors, and
//! each layer only uses the ones below it (docs/architecture.md, "The controller shell").
//!
//! Read from the source text: an edge `a → b` for every path `crate::controller::b`,
//! `super::b` (from a top-level file) or `super::super::b` (from a file of a directory module)
//! in the files of module `a`, test modules excluded. A path to an item of `mod.rs` itself is an
//! edge to the root, which uses every module it declares. This file is not read (its tests
//! hold paths as text).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const ROOT: &str = "(mod.rs)";

/// The first identifier of each top-level item of a `{ … }` group, or the identifier at `s`.
fn names_at(s: &str) -> Vec<String> {
    let ident = |t: &str| -> String {
        t.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let Some(group) = s.strip_prefix('{') else {
        return vec![ident(s)];
    };
    let (mut depth, mut items, mut start) = (0, Vec::new(), 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.into_iter().map(ident).collect()
}

/// The module (or [`ROOT`]) each path from `text` names, from a file `depth` directories below
/// `src/controller`.
fn targets(text: &str, depth: usize, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let code = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at]);
    let code: String = code
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let up = "super::".repeat(depth + 1);
    let mut out = BTreeSet::new();
    for prefix in ["crate::controller::", up.as_str()] {
        let mut rest = code.as_str();
        while let Some(at) = rest.find(prefix) {
            // `super::super::x` also contains `super::x`: only whole paths count.
            let before = &rest[..at];
            rest = &rest[at + prefix.len()..];
            if before.ends_with("super::") || before.ends_with(|c: char| c.is_alphanumeric()) {
                continue;
            }
            for name in names_at(rest) {
                match name.as_str() {
                    "" | "self" => {}
                    m if modules.contains(m) => {
                        out.insert(m.to_owned());
                    }
                    _ => {
                        out.insert(ROOT.to_owned());
                    }
                }
            }
        }
    }
    out
}

/// Module → the modules its files use.
fn graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files: Vec<(String, usize, String)> = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), None::<String>, 0)];
    while let Some((d, module, depth)) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("readable source directory") {
            let path = entry.expect("directory entry").path();
            let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
            let owner = module.clone().unwrap_or_else(|| stem.clone());
            if path.is_dir() {
                stack.push((path, Some(owner), depth + 1));
            } else if path.extension().is_some_and(|e| e == "rs") && stem != "module_graph" {
                let owner = if module.is_none() && stem == "mod" {
                    ROOT.to_owned()
                } else {
                    owner
                };
                // A directory module's `mod.rs` is one level up from its other files.
                let depth = if module.is_some() && stem == "mod" {
                    depth - 1
                } else {
                    depth
                };
                let text = std::fs::read_to_string(&path).expect("readable source file");
                files.push((owner, depth, text));
            }
        }
    }
    let modules: BTreeSet<String> = files
        .iter()
        .map(|(m, _, _)| m.clone())
        .filter(|m| m != ROOT)
        .collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.insert(ROOT.to_owned(), modules.clone());
    for (owner, depth, text) in &files {
        let uses = graph.entry(owner.clone()).or_default();
        for t in targets(text, *depth, &modules) {
            if &t != owner {
                uses.insert(t);
            }
        }
    }
    graph
}

/// A cycle of `graph`, as the modules along it.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == node) {
            let mut c = path[at..].to_vec();
            c.push(node.to_owned());
            return Some(c);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_controller_modules_import_each_other_in_no_cycle() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/controller");
    let graph = graph(&dir);
    assert!(graph.len() > 5, "modules found: {graph:?}");
    if let Some(c) = cycle(&graph) {
        panic!("import cycle: {}\nedges: {graph:#?}", c.join(" → "));
    }
}

#[test]
fn the_reader_sees_paths_groups_and_parent_items() {
    let modules: BTreeSet<String> = ["execute", "lanes", "driver"]
        .map(String::from)
        .into_iter()
        .collect();
    let text = "use super::{execute::{self, Job}, lanes};\nuse crate::controller::driver::Input;\n\
                // super::nothing\nfn f() { super::now(); }\n#[cfg(test)]\nmod tests { use super::*; }";
    let want: BTreeSet<String> = ["execute", "lanes", "driver", ROOT]
        .map(String::from)
        .into_iter()
        .collect();
    assert_eq!(targets(text, 0, &modules), want);
    // From `execute/ssh.rs`: `super::` is its own module, `super::super::` the controller.
    let nested = "use super::{Context, kube};\nuse super::super::lanes::LaneKey;";
    let want: BTreeSet<String> = ["lanes".to_owned()].into_iter().collect();
    assert_eq!(targets(nested, 1, &modules), want);
    let mut g = BTreeMap::new();
    g.insert("a".to_owned(), ["b".to_owned()].into_iter().collect());
    g.insert("b".to_owned(), ["a".to_owned()].into_iter().collect());
    assert_eq!(cycle(&g).map(|c| c.len()), Some(3));
}
