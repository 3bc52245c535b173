//! No module imports one that imports it back, in any directory of any crate of the workspace
//! (docs/architecture.md, "Layering").
//!
//! The crates are found by walking the repository (every directory holding a `Cargo.toml` and a
//! `src/`), and every directory module of each crate's `src/` is checked, the crate root
//! included: its child modules are the nodes, and `a → b` is an edge when code of `a` (any file
//! below it, test code excluded) names a path into `b`. The directory's own file (`mod.rs`,
//! `lib.rs`) is no node: it is where what the children share lives, and the façade that
//! re-exports them, so it may use them and be used by them.
//!
//! Paths are read from the source text: `use` trees, `crate::`/`super::`/`self::` paths and, in a
//! module's own file, paths through its child modules. A path through a re-export (`pub use
//! x::Y`, `pub use x::*`) counts as a path to where the item is defined. Test code is whatever
//! `#[cfg(test)]` marks: items, inline modules, and the files of `#[cfg(test)] mod x;`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module of one crate, by its path from the crate root (`[]` is the root).
type ModPath = Vec<String>;

/// A directory module's own file, when a path names one of its items.
const ROOT: &str = "(root)";

// ---------------------------------------------------------------------------------------------
// Reading source text

/// `text` with comments and the contents of string and character literals blanked (same length,
/// newlines kept), so paths are only found in code and byte offsets still give line numbers.
fn blank_literals(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for c in &mut out[from..to.min(b.len())] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < b.len() {
        let prev_ident = i > 0 && ident(b[i - 1]);
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                let end = text[i..].find('\n').map_or(b.len(), |n| i + n);
                blank(&mut out, i, end);
                i = end;
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let (mut depth, mut j) = (1, i + 2);
                while j < b.len() && depth > 0 {
                    if b[j..].starts_with(b"/*") {
                        depth += 1;
                        j += 2;
                    } else if b[j..].starts_with(b"*/") {
                        depth -= 1;
                        j += 2;
                    } else {
                        j += 1;
                    }
                }
                blank(&mut out, i, j);
                i = j;
            }
            // Raw strings: r"…", r#"…"#, br"…", cr"…".
            b'r' if !prev_ident
                || (i > 0 && matches!(b[i - 1], b'b' | b'c') && (i < 2 || !ident(b[i - 2]))) =>
            {
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                let start = i + 2 + hashes;
                let end = b[start..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |n| start + n);
                blank(&mut out, start, end);
                i = end + close.len();
            }
            b'"' => {
                let mut j = i + 1;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                blank(&mut out, i + 1, j);
                i = j + 1;
            }
            b'\'' => {
                // A character literal, or a lifetime / label (left alone).
                let end = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 3..]
                        .iter()
                        .position(|&c| c == b'\'')
                        .map(|n| i + 3 + n)
                } else {
                    let len = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                    (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 1 + len)
                };
                match end {
                    Some(end) => {
                        blank(&mut out, i + 1, end);
                        i = end + 1;
                    }
                    None => i += 1,
                }
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).expect("blanking keeps UTF-8")
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// The tokens of blanked text, each with its byte offset. Literals and lifetimes are dropped.
fn tokens(text: &str) -> Vec<(usize, Tok)> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_alphabetic() || c == b'_' || !c.is_ascii() {
            let len = text[i..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(text.len() - i);
            if len == 0 {
                // Some other non-ASCII character.
                i += text[i..].chars().next().map_or(1, char::len_utf8);
                continue;
            }
            out.push((i, Tok::Ident(text[i..i + len].to_owned())));
            i += len;
        } else if c.is_ascii_digit() {
            i += text[i..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(text.len() - i);
        } else if c == b'\'' {
            // A lifetime or label (character literals were blanked to `' '`).
            i += 1;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
        } else if b[i..].starts_with(b"::") {
            out.push((i, Tok::Path));
            i += 2;
        } else {
            out.push((i, Tok::Punct(c as char)));
            i += 1;
        }
    }
    out
}

fn is(t: Option<&(usize, Tok)>, want: &Tok) -> bool {
    t.is_some_and(|(_, t)| t == want)
}

fn ident(t: Option<&(usize, Tok)>) -> Option<&str> {
    match t {
        Some((_, Tok::Ident(s))) => Some(s),
        _ => None,
    }
}

/// Index of the token closing the bracket opened at `open`.
fn matching(toks: &[(usize, Tok)], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, (_, t)) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Punct('{' | '(' | '[') => depth += 1,
            Tok::Punct('}' | ')' | ']') => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    toks.len()
}

/// The tokens with every `#[cfg(test)]` item removed, and the names of the file modules declared
/// test-only (`#[cfg(test)] mod x;`).
fn without_tests(toks: Vec<(usize, Tok)>) -> (Vec<(usize, Tok)>, BTreeSet<String>) {
    let mut keep = vec![true; toks.len()];
    let mut test_mods = BTreeSet::new();
    let cfg_test = [
        Tok::Punct('#'),
        Tok::Punct('['),
        Tok::Ident("cfg".into()),
        Tok::Punct('('),
        Tok::Ident("test".into()),
        Tok::Punct(')'),
        Tok::Punct(']'),
    ];
    let mut i = 0;
    while i < toks.len() {
        if !toks[i..].iter().map(|(_, t)| t).take(7).eq(cfg_test.iter()) {
            i += 1;
            continue;
        }
        let mut j = i + 7;
        // Further attributes of the same item.
        while is(toks.get(j), &Tok::Punct('#')) {
            j = matching(&toks, j + 1) + 1;
        }
        // The item ends at its first `;` outside brackets, or with its first `{ … }` block.
        let mut k = j;
        while k < toks.len() {
            match &toks[k].1 {
                Tok::Punct(';') => break,
                Tok::Punct('{') => {
                    k = matching(&toks, k);
                    break;
                }
                Tok::Punct('(' | '[') => k = matching(&toks, k) + 1,
                _ => k += 1,
            }
        }
        let item: Vec<&Tok> = toks[j..k.min(toks.len())].iter().map(|(_, t)| t).collect();
        if let Some(at) = item.iter().position(|t| **t == Tok::Ident("mod".into()))
            && let Some(Tok::Ident(name)) = item.get(at + 1)
            && is(toks.get(k), &Tok::Punct(';'))
        {
            test_mods.insert(name.clone());
        }
        for kept in &mut keep[i..=k.min(toks.len() - 1)] {
            *kept = false;
        }
        i = k + 1;
    }
    let toks = toks
        .into_iter()
        .zip(keep)
        .filter_map(|(t, k)| k.then_some(t))
        .collect();
    (toks, test_mods)
}

/// A path a `use` names (a glob as a last segment `*`), with the name it binds (`None` for a
/// glob).
type UsePath = (Vec<String>, Option<String>);

/// A `use` tree from `toks[at..]` as the paths it names, and the index after its end.
fn use_tree(toks: &[(usize, Tok)], at: usize) -> (Vec<UsePath>, usize) {
    fn tree(
        toks: &[(usize, Tok)],
        mut i: usize,
        prefix: &[String],
        out: &mut Vec<UsePath>,
    ) -> usize {
        let mut path = prefix.to_vec();
        if is(toks.get(i), &Tok::Path) {
            // `::std::…`: an extern crate.
            path.push("::".into());
            i += 1;
        }
        loop {
            match toks.get(i).map(|(_, t)| t) {
                Some(Tok::Punct('{')) => {
                    i += 1;
                    while !is(toks.get(i), &Tok::Punct('}')) && i < toks.len() {
                        i = tree(toks, i, &path, out);
                        if is(toks.get(i), &Tok::Punct(',')) {
                            i += 1;
                        }
                    }
                    return i + 1;
                }
                Some(Tok::Punct('*')) => {
                    path.push("*".into());
                    out.push((path, None));
                    return i + 1;
                }
                Some(Tok::Ident(s)) => {
                    let s = s.clone();
                    i += 1;
                    if is(toks.get(i), &Tok::Path) {
                        path.push(s);
                        i += 1;
                        continue;
                    }
                    let mut name = s.clone();
                    if s != "self" || path.is_empty() {
                        path.push(s);
                    } else {
                        name = path.last().cloned().unwrap_or_default();
                    }
                    if ident(toks.get(i)) == Some("as") {
                        name = ident(toks.get(i + 1)).unwrap_or("_").to_owned();
                        i += 2;
                    }
                    out.push((path, Some(name)));
                    return i;
                }
                _ => return i,
            }
        }
    }
    let mut out = Vec::new();
    let end = tree(toks, at, &[], &mut out);
    (out, end)
}

/// What one file says about paths.
#[derive(Default)]
struct FileRead {
    /// Every path named, relative as written (`crate`, `super`, `self` or a bare first segment),
    /// with the module it was written in (inline modules appended to the file's) and its offset.
    paths: Vec<(Vec<String>, Vec<String>, usize)>,
    /// Top-level `use` bindings: name → path as written.
    binds: BTreeMap<String, Vec<String>>,
    /// Top-level glob imports, as written (without the `*`).
    globs: Vec<Vec<String>>,
    /// Names of the items defined at the top level.
    defines: BTreeSet<String>,
    /// File modules declared `#[cfg(test)] mod x;`.
    test_mods: BTreeSet<String>,
    /// File modules declared (`mod x;`), test ones included.
    declared: BTreeSet<String>,
}

fn read(text: &str) -> FileRead {
    let (toks, test_mods) = without_tests(tokens(&blank_literals(text)));
    let mut r = FileRead {
        test_mods,
        ..FileRead::default()
    };
    // Inline modules: token span → name.
    let mut inline: Vec<(usize, usize, String)> = Vec::new();
    for i in 0..toks.len() {
        if ident(toks.get(i)) == Some("mod")
            && let Some(name) = ident(toks.get(i + 1))
        {
            match toks.get(i + 2).map(|(_, t)| t) {
                Some(Tok::Punct('{')) => inline.push((i + 2, matching(&toks, i + 2), name.into())),
                Some(Tok::Punct(';')) => {
                    r.declared.insert(name.into());
                }
                _ => {}
            }
        }
    }
    let scope = |i: usize| -> Vec<String> {
        inline
            .iter()
            .filter(|(s, e, _)| *s < i && i < *e)
            .map(|(_, _, n)| n.clone())
            .collect()
    };
    let mut depth = 0usize;
    let mut i = 0;
    while i < toks.len() {
        let prev = i.checked_sub(1).and_then(|p| toks.get(p));
        match &toks[i].1 {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::Ident(kw) if kw == "use" && !is(prev, &Tok::Path) => {
                let (paths, end) = use_tree(&toks, i + 1);
                let within = scope(i);
                for (path, name) in paths {
                    if depth == 0 && within.is_empty() {
                        match name {
                            Some(n) => {
                                r.binds.insert(n, path.clone());
                            }
                            None => r.globs.push(path[..path.len() - 1].to_vec()),
                        }
                    }
                    r.paths.push((within.clone(), path, toks[i].0));
                }
                i = end;
                continue;
            }
            Tok::Ident(kw)
                if depth == 0
                    && matches!(
                        kw.as_str(),
                        "struct"
                            | "enum"
                            | "fn"
                            | "const"
                            | "static"
                            | "type"
                            | "trait"
                            | "union"
                            | "mod"
                    )
                    && !is(prev, &Tok::Path) =>
            {
                if let Some(name) = ident(toks.get(i + 1)) {
                    r.defines.insert(name.into());
                }
            }
            Tok::Ident(kw) if kw == "macro_rules" && depth == 0 => {
                if let Some(name) = ident(toks.get(i + 2)) {
                    r.defines.insert(name.into());
                }
            }
            Tok::Ident(first)
                if is(toks.get(i + 1), &Tok::Path)
                    && !is(prev, &Tok::Path)
                    && !is(prev, &Tok::Punct('.')) =>
            {
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while is(toks.get(j), &Tok::Path)
                    && let Some(s) = ident(toks.get(j + 1))
                {
                    path.push(s.to_owned());
                    j += 2;
                }
                r.paths.push((scope(i), path, toks[i].0));
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    r
}

// ---------------------------------------------------------------------------------------------
// One crate

/// One source file of a crate.
struct File {
    rel: PathBuf,
    module: ModPath,
    text: String,
    read: FileRead,
}

/// A crate's modules, read from its `src/`.
struct Crate {
    /// `src/` relative to the workspace root, for messages.
    name: String,
    files: Vec<File>,
    /// Every module of the crate (test modules excluded), with its own file's index.
    modules: BTreeMap<ModPath, usize>,
    /// Modules that have children (a directory).
    dirs: BTreeSet<ModPath>,
}

/// Where a path leads: a module or an item of one, or outside the crate.
enum Target {
    /// A module (`m`) or an item of module `m` (`m` plus one segment).
    Local(Vec<String>),
    Extern,
}

impl Crate {
    fn load(workspace: &Path, src: &Path) -> Crate {
        let name = src
            .strip_prefix(workspace)
            .unwrap_or(src)
            .display()
            .to_string();
        let mut files = Vec::new();
        let mut stack = vec![src.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).expect("readable source directory") {
                let path = entry.expect("directory entry").path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let rel = path.strip_prefix(src).unwrap().to_path_buf();
                let mut module: ModPath = rel
                    .with_extension("")
                    .iter()
                    .map(|s| s.to_string_lossy().into_owned())
                    .collect();
                let text = std::fs::read_to_string(&path).expect("readable source file");
                let read = read(&text);
                if module == ["main"] || module.first().is_some_and(|m| m == "bin") {
                    // A binary's root is its own crate; it must use the library by name.
                    assert!(
                        read.declared.is_empty(),
                        "{}: a binary root declaring modules ({:?}) is a layout this check \
                         does not read",
                        path.display(),
                        read.declared
                    );
                    continue;
                }
                if module.last().is_some_and(|m| m == "mod") || module == ["lib"] {
                    module.pop();
                }
                files.push(File {
                    rel: Path::new(&name).join(&rel),
                    module,
                    text,
                    read,
                });
            }
        }
        files.sort_by(|a, b| a.rel.cmp(&b.rel));
        // Test modules (and everything below them) are not part of the graph.
        let tests: Vec<ModPath> = files
            .iter()
            .flat_map(|f| {
                f.read.test_mods.iter().map(|t| {
                    let mut m = f.module.clone();
                    m.push(t.clone());
                    m
                })
            })
            .collect();
        files.retain(|f| !tests.iter().any(|t| f.module.starts_with(t)));
        let modules: BTreeMap<ModPath, usize> = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.module.clone(), i))
            .collect();
        let dirs = modules
            .keys()
            .filter_map(|m| m.split_last().map(|(_, parent)| parent.to_vec()))
            .collect();
        Crate {
            name,
            files,
            modules,
            dirs,
        }
    }

    /// A path as written in module `at`, made absolute; `None` if it leaves the crate or is a
    /// local name that is no module.
    fn absolute(&self, at: &[String], path: &[String]) -> Option<Vec<String>> {
        let (mut base, rest): (Vec<String>, &[String]) = match path.first()?.as_str() {
            "crate" | "$crate" => (Vec::new(), &path[1..]),
            "self" => (at.to_vec(), &path[1..]),
            "super" => {
                let ups = path.iter().take_while(|s| *s == "super").count();
                let base = at.get(..at.len().checked_sub(ups)?)?.to_vec();
                (base, &path[ups..])
            }
            first => {
                // A bare path leads into the crate only through a child module of `at`
                // (names bound by `use` were counted at the `use`).
                let mut child = at.to_vec();
                child.push(first.to_owned());
                if !self.modules.contains_key(&child) {
                    return None;
                }
                (at.to_vec(), path)
            }
        };
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// Where an absolute path leads, following re-exports.
    fn resolve(&self, path: &[String], hops: usize) -> Target {
        if hops > 32 {
            panic!("re-exports loop at {path:?}");
        }
        let module_len = (0..=path.len())
            .rev()
            .find(|&n| self.modules.contains_key(&path[..n]))
            .unwrap_or(0);
        if module_len == path.len() {
            return Target::Local(path.to_vec());
        }
        let module = &path[..module_len];
        let name = &path[module_len];
        let rest = &path[module_len + 1..];
        let Some(&file) = self.modules.get(module) else {
            return Target::Extern;
        };
        let read = &self.files[file].read;
        if name != "*" && !read.defines.contains(name) {
            if let Some(bound) = read.binds.get(name) {
                return match self.absolute(module, bound) {
                    Some(mut p) => {
                        p.extend(rest.iter().cloned());
                        self.resolve(&p, hops + 1)
                    }
                    None => Target::Extern,
                };
            }
            for glob in &read.globs {
                let Some(g) = self.absolute(module, glob) else {
                    continue;
                };
                let Some(&gf) = self.modules.get(&g) else {
                    continue;
                };
                let gr = &self.files[gf].read;
                if gr.defines.contains(name) || gr.binds.contains_key(name) {
                    let mut p = g;
                    p.push(name.clone());
                    p.extend(rest.iter().cloned());
                    return self.resolve(&p, hops + 1);
                }
            }
        }
        Target::Local(path[..=module_len].to_vec())
    }

    /// Per directory module: node → node → where the first path making that edge was written.
    fn graphs(&self) -> BTreeMap<ModPath, BTreeMap<String, BTreeMap<String, String>>> {
        let mut out: BTreeMap<ModPath, BTreeMap<String, BTreeMap<String, String>>> = self
            .dirs
            .iter()
            .map(|d| (d.clone(), BTreeMap::new()))
            .collect();
        for f in &self.files {
            for (inline, written, offset) in &f.read.paths {
                let mut at = f.module.clone();
                at.extend(inline.iter().cloned());
                let Some(abs) = self.absolute(&at, written) else {
                    continue;
                };
                let Target::Local(target) = self.resolve(&abs, 0) else {
                    continue;
                };
                let from = &f.module;
                let common = from.iter().zip(&target).take_while(|(a, b)| a == b).count();
                if common == target.len() {
                    // The module itself or one of its ancestors (`pub(in crate::x)`).
                    continue;
                }
                let dir = target[..common].to_vec();
                let node = |m: &ModPath| -> String {
                    if m.len() > common && self.modules.contains_key(&m[..=common]) {
                        m[common].clone()
                    } else {
                        ROOT.to_owned()
                    }
                };
                let (a, b) = (node(from), node(&target));
                // Edges to or from the directory's own file are not part of the rule (above).
                if a == b || a == ROOT || b == ROOT {
                    continue;
                }
                let line = f.text[..*offset].matches('\n').count() + 1;
                let evidence = format!("{}:{line} `{}`", f.rel.display(), written.join("::"));
                out.entry(dir)
                    .or_default()
                    .entry(a)
                    .or_default()
                    .entry(b)
                    .or_insert(evidence);
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Cycles

/// The strongly connected components of more than one node (Tarjan), each sorted.
fn cycles(graph: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            let graph = self.graph;
            for w in graph.get(v).into_iter().flat_map(|e| e.keys()) {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let lw = self.low[w.as_str()];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w.as_str()) {
                    let iw = self.index[w.as_str()];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    scc.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.out.sort();
    walk.out
}

/// The workspace's crates: every directory with a `Cargo.toml` and a `src/`, build output and
/// hidden directories skipped.
fn crate_sources(workspace: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![workspace.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
            out.push(dir.join("src"));
        }
        for entry in std::fs::read_dir(&dir).expect("readable directory") {
            let path = entry.expect("directory entry").path();
            let name = path.file_name().unwrap().to_string_lossy();
            if path.is_dir() && !name.starts_with('.') && name != "target" && name != "src" {
                stack.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Every import cycle below `workspace`, as text naming the directory, its modules and the
/// paths that make the edges; and the number of directory modules read.
fn import_cycles(workspace: &Path) -> (Vec<String>, usize) {
    let mut found = Vec::new();
    let mut dirs = 0;
    for src in crate_sources(workspace) {
        let krate = Crate::load(workspace, &src);
        for (dir, graph) in krate.graphs() {
            dirs += 1;
            for scc in cycles(&graph) {
                let mut text = format!("{}/{}: {{{}}}", krate.name, dir.join("/"), scc.join(", "));
                for a in &scc {
                    for (b, evidence) in &graph[a] {
                        if scc.contains(b) {
                            text.push_str(&format!("\n    {a} → {b}: {evidence}"));
                        }
                    }
                }
                found.push(text.replace("src/:", "src:"));
            }
        }
    }
    (found, dirs)
}

#[test]
fn no_directory_module_of_any_crate_imports_in_a_cycle() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let crates = crate_sources(workspace);
    assert!(crates.len() >= 3, "crates found: {crates:?}");
    let (found, dirs) = import_cycles(workspace);
    assert!(dirs > 10, "directory modules read: {dirs}");
    assert!(
        found.is_empty(),
        "import cycles ({}):\n{}",
        found.len(),
        found.join("\n")
    );
}

/// Writes `files` (path, text) below a fresh directory and returns it.
fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temporary directory");
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    dir
}

#[test]
fn a_cycle_through_a_re_export_is_found_in_a_nested_crate_with_the_paths_that_make_it() {
    let dir = tree(&[
        ("Cargo.toml", "[workspace]"),
        ("tools/gen/Cargo.toml", "[package]"),
        ("tools/gen/src/lib.rs", "pub mod a;\npub mod b;"),
        // `a` re-exports `x::X`; `y` uses it through the re-export, `x` uses `y`.
        (
            "tools/gen/src/a/mod.rs",
            "mod x;\nmod y;\npub use x::*;\npub struct Shared;",
        ),
        (
            "tools/gen/src/a/x.rs",
            "pub struct X;\nfn f() { crate::a::y::g(); }",
        ),
        (
            "tools/gen/src/a/y.rs",
            "use super::{Shared, X};\npub fn g() {}",
        ),
        ("tools/gen/src/b.rs", "use crate::a::Shared;"),
    ]);
    let (found, dirs) = import_cycles(dir.path());
    assert_eq!(dirs, 2, "{found:?}");
    assert_eq!(
        found,
        [
            "tools/gen/src/a: {x, y}\n    x → y: tools/gen/src/a/x.rs:2 `crate::a::y::g`\n    \
             y → x: tools/gen/src/a/y.rs:1 `super::X`"
        ]
    );
}

#[test]
fn test_code_comments_strings_and_the_parent_file_make_no_edge() {
    let dir = tree(&[
        ("Cargo.toml", "[package]"),
        ("src/main.rs", "fn main() { gen::a::x::f(); }"),
        (
            "src/lib.rs",
            "pub mod a;\npub use a::x::f;\npub fn top() { a::y::g(); }",
        ),
        (
            "src/a/mod.rs",
            "pub mod x;\npub mod y;\n#[cfg(test)]\nmod tests;\npub struct Context;\n\
             pub fn run() { x::f(); y::g(); }",
        ),
        (
            "src/a/x.rs",
            "use super::Context;\n/// [`super::y::g`]\npub fn f() { let _ = \"super::y::g\"; \
             let _ = '\"'; }\n/* crate::a::y::g() */\n\
             #[cfg(test)]\nmod tests {\n    use crate::a::y::g;\n}",
        ),
        (
            "src/a/y.rs",
            "use super::x::f;\nuse std::fmt::{self, Display};\npub(in crate::a) fn h() {}\n\
             pub fn g() { f() }\n#[cfg(test)]\nfn helper() { super::x::f(); }",
        ),
        ("src/a/tests.rs", "use super::y::g;\nuse super::x::f;"),
        ("target/debug/build/src/lib.rs", "mod not_read;"),
    ]);
    let (found, dirs) = import_cycles(dir.path());
    assert_eq!((found, dirs), (Vec::<String>::new(), 2));
}

#[test]
fn the_reader_keeps_use_groups_aliases_and_lifetimes_apart_from_paths() {
    let r = read(
        "use super::{a::{self, B as C}, d::*};\nuse ::std::x;\n\
         fn f<'a>(x: &'a str) -> char { let c = '{'; super::super::e::g(); 'x' }\n\
         mod inner { use super::h::I; }\n",
    );
    let paths: Vec<(Vec<String>, String)> = r
        .paths
        .iter()
        .map(|(inline, p, _)| (inline.clone(), p.join("::")))
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        paths,
        [
            (s(&[]), "super::a".to_owned()),
            (s(&[]), "super::a::B".to_owned()),
            (s(&[]), "super::d::*".to_owned()),
            (s(&[]), "::::std::x".to_owned()),
            (s(&[]), "super::super::e::g".to_owned()),
            (s(&["inner"]), "super::h::I".to_owned()),
        ]
    );
    assert_eq!(r.binds.keys().collect::<Vec<_>>(), ["C", "a", "x"]);
    assert_eq!(r.globs, [s(&["super", "d"])]);
    assert!(r.defines.contains("f") && r.defines.contains("inner"));
}
