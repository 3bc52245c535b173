//! A YAML writer whose output is byte-for-byte what PyYAML's `yaml.dump_all(docs,
//! default_flow_style=False, sort_keys=True)` writes, because infra-deployments commits the
//! ClusterQueue files that way and checks in CI that regenerating them changes nothing: a file we
//! write must not differ from the one their tooling writes.
//!
//! The layout rules (PyYAML's emitter, YAML 1.1 resolver, width 80, indent 2):
//! - mappings in block style with keys sorted; a sequence that is a mapping value is not indented
//!   (`key:\n- a`); empty collections are `{}` / `[]`;
//! - a string is written plain unless it would read back as another type (`'500'`, `'true'`,
//!   `''`) or contains indicators, then single-quoted, and double-quoted when it holds characters
//!   that single quotes cannot carry (control or non-ASCII characters);
//! - long plain and quoted scalars are folded at spaces past column 80;
//! - documents after the first start with `---`.
//!
//! Floats are written in Rust's shortest form, which can differ from Python's `repr` for very
//! large or small values; tagged values are refused. Neither occurs in a ClusterQueue.

use serde_norway::{Mapping, Value};

/// Column past which scalars are folded at a space.
const BEST_WIDTH: usize = 80;
/// Spaces per nesting level.
const BEST_INDENT: usize = 2;

/// A value this writer cannot represent as PyYAML would.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot write a tagged YAML value ({0}) the way the ClusterQueue tooling does")]
pub struct UnsupportedValue(pub String);

/// Writes `docs` as a YAML stream, one document each.
pub fn dump_all(docs: &[Value]) -> Result<String, UnsupportedValue> {
    let mut e = Emitter::default();
    for (i, doc) in docs.iter().enumerate() {
        if i > 0 {
            e.write_indent();
            e.write_indicator("---", true, false, false);
        }
        e.node(doc, Ctx::ROOT)?;
        // Document end.
        e.indent = None;
        e.write_indent();
    }
    Ok(e.out)
}

/// Where a node sits (PyYAML's root/sequence/mapping/simple-key contexts).
#[derive(Clone, Copy)]
struct Ctx {
    mapping: bool,
    simple_key: bool,
}

impl Ctx {
    const ROOT: Ctx = Ctx {
        mapping: false,
        simple_key: false,
    };
    const SEQUENCE: Ctx = Ctx::ROOT;
    const MAPPING_VALUE: Ctx = Ctx {
        mapping: true,
        simple_key: false,
    };
    const MAPPING_KEY: Ctx = Ctx {
        mapping: true,
        simple_key: true,
    };
}

struct Emitter {
    out: String,
    indent: Option<usize>,
    indents: Vec<Option<usize>>,
    column: usize,
    whitespace: bool,
    indention: bool,
}

impl Default for Emitter {
    fn default() -> Self {
        Self {
            out: String::new(),
            indent: None,
            indents: Vec::new(),
            column: 0,
            whitespace: true,
            indention: true,
        }
    }
}

/// Quoting style of a scalar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    Plain,
    Single,
    Double,
}

impl Emitter {
    fn node(&mut self, v: &Value, ctx: Ctx) -> Result<(), UnsupportedValue> {
        match v {
            Value::Sequence(items) if items.is_empty() => self.empty_flow("[", "]"),
            Value::Mapping(m) if m.is_empty() => self.empty_flow("{", "}"),
            Value::Sequence(items) => self.block_sequence(items, ctx)?,
            Value::Mapping(m) => self.block_mapping(m)?,
            Value::Tagged(t) => return Err(UnsupportedValue(t.tag.to_string())),
            scalar => {
                let (text, implicit_plain) = scalar_text(scalar);
                self.scalar(&text, implicit_plain, ctx);
            }
        }
        Ok(())
    }

    fn empty_flow(&mut self, open: &str, close: &str) {
        self.write_indicator(open, true, true, false);
        self.write_indicator(close, false, false, false);
    }

    fn increase_indent(&mut self, flow: bool, indentless: bool) {
        self.indents.push(self.indent);
        self.indent = match self.indent {
            None if flow => Some(BEST_INDENT),
            None => Some(0),
            Some(i) if !indentless => Some(i + BEST_INDENT),
            same => same,
        };
    }

    fn pop_indent(&mut self) {
        self.indent = self.indents.pop().flatten();
    }

    fn block_sequence(&mut self, items: &[Value], ctx: Ctx) -> Result<(), UnsupportedValue> {
        let indentless = ctx.mapping && !self.indention;
        self.increase_indent(false, indentless);
        for item in items {
            self.write_indent();
            self.write_indicator("-", true, false, true);
            self.node(item, Ctx::SEQUENCE)?;
        }
        self.pop_indent();
        Ok(())
    }

    fn block_mapping(&mut self, m: &Mapping) -> Result<(), UnsupportedValue> {
        self.increase_indent(false, false);
        let mut entries: Vec<(String, &Value, &Value)> =
            m.iter().map(|(k, v)| (sort_key(k), k, v)).collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, k, v) in entries {
            self.write_indent();
            if is_simple_key(k) {
                self.node(k, Ctx::MAPPING_KEY)?;
                self.write_indicator(":", false, false, false);
            } else {
                self.write_indicator("?", true, false, true);
                self.node(k, Ctx::MAPPING_VALUE)?;
                self.write_indent();
                self.write_indicator(":", true, false, true);
            }
            self.node(v, Ctx::MAPPING_VALUE)?;
        }
        self.pop_indent();
        Ok(())
    }

    fn scalar(&mut self, text: &str, implicit_plain: bool, ctx: Ctx) {
        self.increase_indent(true, false);
        let a = analyze(text);
        let style = if implicit_plain
            && !(ctx.simple_key && (a.empty || a.multiline))
            && a.allow_block_plain
        {
            Style::Plain
        } else if a.allow_single_quoted && !(ctx.simple_key && a.multiline) {
            Style::Single
        } else {
            Style::Double
        };
        let split = !ctx.simple_key;
        match style {
            Style::Plain => self.write_plain(text, split),
            Style::Single => self.write_single_quoted(text, split),
            Style::Double => self.write_double_quoted(text, split),
        }
        self.pop_indent();
    }

    fn write(&mut self, s: &str) {
        self.column += s.chars().count();
        self.out.push_str(s);
    }

    fn write_indicator(
        &mut self,
        ind: &str,
        need_whitespace: bool,
        whitespace: bool,
        indention: bool,
    ) {
        if !self.whitespace && need_whitespace {
            self.write(" ");
        }
        self.write(ind);
        self.whitespace = whitespace;
        self.indention = self.indention && indention;
    }

    fn write_indent(&mut self) {
        let indent = self.indent.unwrap_or(0);
        if !self.indention || self.column > indent || (self.column == indent && !self.whitespace) {
            self.write_line_break(None);
        }
        if self.column < indent {
            self.whitespace = true;
            let pad = " ".repeat(indent - self.column);
            self.write(&pad);
        }
    }

    fn write_line_break(&mut self, br: Option<char>) {
        self.out.push(br.unwrap_or('\n'));
        self.whitespace = true;
        self.indention = true;
        self.column = 0;
    }

    fn write_plain(&mut self, text: &str, split: bool) {
        if text.is_empty() {
            return;
        }
        if !self.whitespace {
            self.write(" ");
        }
        self.whitespace = false;
        self.indention = false;
        let chars: Vec<char> = text.chars().collect();
        let (mut spaces, mut breaks) = (false, false);
        let (mut start, mut end) = (0, 0);
        while end <= chars.len() {
            let ch = chars.get(end).copied();
            if spaces {
                if ch != Some(' ') {
                    if start + 1 == end && self.column > BEST_WIDTH && split {
                        self.write_indent();
                        self.whitespace = false;
                        self.indention = false;
                    } else {
                        self.write(&collect(&chars[start..end]));
                    }
                    start = end;
                }
            } else if breaks {
                if !ch.is_some_and(is_break) {
                    if chars[start] == '\n' {
                        self.write_line_break(None);
                    }
                    for &br in &chars[start..end] {
                        self.write_line_break(Some(br));
                    }
                    self.write_indent();
                    self.whitespace = false;
                    self.indention = false;
                    start = end;
                }
            } else if ch.is_none_or(|c| c == ' ' || is_break(c)) {
                self.write(&collect(&chars[start..end]));
                start = end;
            }
            if let Some(c) = ch {
                spaces = c == ' ';
                breaks = is_break(c);
            }
            end += 1;
        }
    }

    fn write_single_quoted(&mut self, text: &str, split: bool) {
        self.write_indicator("'", true, false, false);
        let chars: Vec<char> = text.chars().collect();
        let (mut spaces, mut breaks) = (false, false);
        let (mut start, mut end) = (0, 0);
        while end <= chars.len() {
            let ch = chars.get(end).copied();
            if spaces {
                if ch != Some(' ') {
                    if start + 1 == end
                        && self.column > BEST_WIDTH
                        && split
                        && start != 0
                        && end != chars.len()
                    {
                        self.write_indent();
                    } else {
                        self.write(&collect(&chars[start..end]));
                    }
                    start = end;
                }
            } else if breaks {
                if !ch.is_some_and(is_break) {
                    if chars[start] == '\n' {
                        self.write_line_break(None);
                    }
                    for &br in &chars[start..end] {
                        self.write_line_break(Some(br));
                    }
                    self.write_indent();
                    start = end;
                }
            } else if ch.is_none_or(|c| c == ' ' || c == '\'' || is_break(c)) && start < end {
                self.write(&collect(&chars[start..end]));
                start = end;
            }
            if ch == Some('\'') {
                self.write("''");
                start = end + 1;
            }
            if let Some(c) = ch {
                spaces = c == ' ';
                breaks = is_break(c);
            }
            end += 1;
        }
        self.write_indicator("'", false, false, false);
    }

    fn write_double_quoted(&mut self, text: &str, split: bool) {
        self.write_indicator("\"", true, false, false);
        let chars: Vec<char> = text.chars().collect();
        let (mut start, mut end) = (0, 0);
        while end <= chars.len() {
            let ch = chars.get(end).copied();
            let escape = match ch {
                None => true,
                Some(c) => {
                    matches!(
                        c,
                        '"' | '\\' | '\u{85}' | '\u{2028}' | '\u{2029}' | '\u{FEFF}'
                    ) || !(' '..='~').contains(&c)
                }
            };
            if escape {
                if start < end {
                    self.write(&collect(&chars[start..end]));
                    start = end;
                }
                if let Some(c) = ch {
                    let data = match c {
                        '\0' => "\\0".to_owned(),
                        '\x07' => "\\a".to_owned(),
                        '\x08' => "\\b".to_owned(),
                        '\t' => "\\t".to_owned(),
                        '\n' => "\\n".to_owned(),
                        '\x0B' => "\\v".to_owned(),
                        '\x0C' => "\\f".to_owned(),
                        '\r' => "\\r".to_owned(),
                        '\x1B' => "\\e".to_owned(),
                        '"' => "\\\"".to_owned(),
                        '\\' => "\\\\".to_owned(),
                        '\u{85}' => "\\N".to_owned(),
                        '\u{A0}' => "\\_".to_owned(),
                        '\u{2028}' => "\\L".to_owned(),
                        '\u{2029}' => "\\P".to_owned(),
                        c if (c as u32) <= 0xFF => format!("\\x{:02X}", c as u32),
                        c if (c as u32) <= 0xFFFF => format!("\\u{:04X}", c as u32),
                        c => format!("\\U{:08X}", c as u32),
                    };
                    self.write(&data);
                    start = end + 1;
                }
            }
            if 0 < end
                && end + 1 < chars.len()
                && (ch == Some(' ') || start >= end)
                && self.column as isize + end as isize - start as isize > BEST_WIDTH as isize
                && split
            {
                let mut data = collect(&chars[start.min(end)..end]);
                data.push('\\');
                if start < end {
                    start = end;
                }
                self.write(&data);
                self.write_indent();
                self.whitespace = false;
                self.indention = false;
                if chars.get(start) == Some(&' ') {
                    self.write("\\");
                }
            }
            end += 1;
        }
        self.write_indicator("\"", false, false, false);
    }
}

fn collect(chars: &[char]) -> String {
    chars.iter().collect()
}

fn is_break(c: char) -> bool {
    matches!(c, '\n' | '\u{85}' | '\u{2028}' | '\u{2029}')
}

/// The text of a scalar and whether PyYAML may write it plain (it reads back as the same type).
fn scalar_text(v: &Value) -> (String, bool) {
    match v {
        Value::Null => ("null".to_owned(), true),
        Value::Bool(b) => (b.to_string(), true),
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                let text = if f.is_nan() {
                    ".nan".to_owned()
                } else if f.is_infinite() {
                    if f > 0.0 { ".inf" } else { "-.inf" }.to_owned()
                } else {
                    format!("{f:?}")
                };
                (text, true)
            } else {
                (n.to_string(), true)
            }
        }
        Value::String(s) => (s.clone(), resolves_to_str(s)),
        _ => unreachable!("collections are handled by the caller"),
    }
}

/// Sort order of mapping keys: PyYAML sorts the loaded keys, strings by code point.
fn sort_key(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        other => scalar_text(other).0,
    }
}

fn is_simple_key(k: &Value) -> bool {
    match k {
        Value::Sequence(s) => s.is_empty(),
        Value::Mapping(m) => m.is_empty(),
        Value::Tagged(_) => false,
        scalar => {
            let (text, _) = scalar_text(scalar);
            let a = analyze(&text);
            // PyYAML counts the (implicit) `!!str`-style tag too.
            text.chars().count() + 5 < 128 && !a.empty && !a.multiline
        }
    }
}

/// What a scalar's characters allow (PyYAML's `analyze_scalar`, block context).
struct Analysis {
    empty: bool,
    multiline: bool,
    allow_block_plain: bool,
    allow_single_quoted: bool,
}

fn analyze(s: &str) -> Analysis {
    if s.is_empty() {
        return Analysis {
            empty: true,
            multiline: false,
            allow_block_plain: true,
            allow_single_quoted: true,
        };
    }
    let chars: Vec<char> = s.chars().collect();
    let ws =
        |c: Option<&char>| c.is_none_or(|c| matches!(c, '\0' | ' ' | '\t' | '\r') || is_break(*c));
    let mut block_indicators = s.starts_with("---") || s.starts_with("...");
    let (mut line_breaks, mut special) = (false, false);
    let (mut leading_space, mut leading_break, mut trailing_space, mut trailing_break) =
        (false, false, false, false);
    let (mut break_space, mut space_break) = (false, false);
    let (mut previous_space, mut previous_break) = (false, false);
    let mut preceded_by_ws = true;
    for (i, &ch) in chars.iter().enumerate() {
        let followed_by_ws = ws(chars.get(i + 1));
        if i == 0 {
            if "#,[]{}&*!|>'\"%@`".contains(ch) {
                block_indicators = true;
            }
            if (ch == '?' || ch == ':' || ch == '-') && followed_by_ws {
                block_indicators = true;
            }
        } else {
            if ch == ':' && followed_by_ws {
                block_indicators = true;
            }
            if ch == '#' && preceded_by_ws {
                block_indicators = true;
            }
        }
        if is_break(ch) {
            line_breaks = true;
        }
        if !(ch == '\n' || (' '..='~').contains(&ch)) {
            // Without allow_unicode every other character needs an escape.
            special = true;
        }
        if ch == ' ' {
            leading_space |= i == 0;
            trailing_space |= i == chars.len() - 1;
            break_space |= previous_break;
            previous_space = true;
            previous_break = false;
        } else if is_break(ch) {
            leading_break |= i == 0;
            trailing_break |= i == chars.len() - 1;
            space_break |= previous_space;
            previous_space = false;
            previous_break = true;
        } else {
            previous_space = false;
            previous_break = false;
        }
        preceded_by_ws = ws(Some(&ch));
    }
    let mut allow_block_plain = true;
    let mut allow_single_quoted = true;
    if leading_space || leading_break || trailing_space || trailing_break {
        allow_block_plain = false;
    }
    if break_space {
        allow_block_plain = false;
        allow_single_quoted = false;
    }
    if space_break || special {
        allow_block_plain = false;
        allow_single_quoted = false;
    }
    if line_breaks || block_indicators {
        allow_block_plain = false;
    }
    Analysis {
        empty: false,
        multiline: line_breaks,
        allow_block_plain,
        allow_single_quoted,
    }
}

/// True when PyYAML's YAML 1.1 resolver reads `s`, written plain, back as a string (not a bool,
/// int, float, null, timestamp, merge or value key).
pub(crate) fn resolves_to_str(s: &str) -> bool {
    !(is_bool(s)
        || is_null(s)
        || s == "<<"
        || s == "="
        || is_int(s)
        || is_float(s)
        || is_timestamp(s))
}

fn is_bool(s: &str) -> bool {
    matches!(
        s,
        "yes"
            | "Yes"
            | "YES"
            | "no"
            | "No"
            | "NO"
            | "true"
            | "True"
            | "TRUE"
            | "false"
            | "False"
            | "FALSE"
            | "on"
            | "On"
            | "ON"
            | "off"
            | "Off"
            | "OFF"
    )
}

fn is_null(s: &str) -> bool {
    matches!(s, "" | "~" | "null" | "Null" | "NULL")
}

fn strip_sign(s: &str) -> &str {
    s.strip_prefix(['-', '+']).unwrap_or(s)
}

fn all_of(s: &str, ok: impl Fn(char) -> bool) -> bool {
    !s.is_empty() && s.chars().all(ok)
}

/// `(:[0-5]?[0-9])+`
fn is_sexagesimal_tail(s: &str) -> bool {
    let Some(rest) = s.strip_prefix(':') else {
        return false;
    };
    rest.split(':').all(|part| {
        let b = part.as_bytes();
        match b.len() {
            1 => b[0].is_ascii_digit(),
            2 => (b'0'..=b'5').contains(&b[0]) && b[1].is_ascii_digit(),
            _ => false,
        }
    })
}

fn is_int(s: &str) -> bool {
    let u = strip_sign(s);
    if let Some(bits) = u.strip_prefix("0b") {
        return all_of(bits, |c| c == '0' || c == '1' || c == '_');
    }
    if let Some(hex) = u.strip_prefix("0x") {
        return all_of(hex, |c| c.is_ascii_hexdigit() || c == '_');
    }
    if u == "0" {
        return true;
    }
    if let Some(oct) = u.strip_prefix('0') {
        return all_of(oct, |c| ('0'..='7').contains(&c) || c == '_');
    }
    let (head, tail) = match u.find(':') {
        Some(i) => (&u[..i], Some(&u[i..])),
        None => (u, None),
    };
    let decimal = head.starts_with(|c: char| ('1'..='9').contains(&c))
        && head.chars().all(|c| c.is_ascii_digit() || c == '_');
    decimal && tail.is_none_or(is_sexagesimal_tail)
}

/// `[eE][-+][0-9]+` or nothing.
fn is_exponent_or_empty(s: &str) -> bool {
    if s.is_empty() {
        return true;
    }
    let Some(rest) = s.strip_prefix(['e', 'E']) else {
        return false;
    };
    let Some(digits) = rest.strip_prefix(['-', '+']) else {
        return false;
    };
    all_of(digits, |c| c.is_ascii_digit())
}

fn is_float(s: &str) -> bool {
    if matches!(s, ".nan" | ".NaN" | ".NAN") {
        return true;
    }
    let u = strip_sign(s);
    if matches!(u, ".inf" | ".Inf" | ".INF") {
        return true;
    }
    // `.5`, `.5e+3` (unsigned only)
    if let Some(frac) = s.strip_prefix('.') {
        let end = frac.find(['e', 'E']).unwrap_or(frac.len());
        let (digits, exp) = frac.split_at(end);
        return digits.starts_with(|c: char| c.is_ascii_digit())
            && digits.chars().all(|c| c.is_ascii_digit() || c == '_')
            && is_exponent_or_empty(exp);
    }
    let Some(dot) = u.find('.') else {
        return false;
    };
    let (int_part, rest) = (&u[..dot], &u[dot + 1..]);
    let end = rest.find(['e', 'E']).unwrap_or(rest.len());
    let (frac, exp) = rest.split_at(end);
    let frac_ok = frac.chars().all(|c| c.is_ascii_digit() || c == '_');
    // `[0-9][0-9_]*.[0-9_]*(exp)?`
    let plain = int_part.starts_with(|c: char| c.is_ascii_digit())
        && int_part.chars().all(|c| c.is_ascii_digit() || c == '_')
        && frac_ok
        && is_exponent_or_empty(exp);
    // `[0-9][0-9_]*(:[0-5]?[0-9])+.[0-9_]*`
    let sexagesimal = match int_part.find(':') {
        Some(i) => {
            let head = &int_part[..i];
            head.starts_with(|c: char| c.is_ascii_digit())
                && head.chars().all(|c| c.is_ascii_digit() || c == '_')
                && is_sexagesimal_tail(&int_part[i..])
                && all_of(&format!("0{frac}"), |c| c.is_ascii_digit() || c == '_')
                && exp.is_empty()
        }
        None => false,
    };
    plain || sexagesimal
}

fn is_timestamp(s: &str) -> bool {
    let b = s.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    // `yyyy-mm-dd`
    if b.len() == 10 && (0..4).all(digit) && b[4] == b'-' && digit(5) && digit(6) && b[7] == b'-' {
        return digit(8) && digit(9);
    }
    // `yyyy-m(m)?-d(d)?([Tt]|[ \t]+)h(h)?:mm:ss(.f*)?(([ \t]*)(Z|[-+]h(h)?(:mm)?))?`
    let mut i = 0;
    let take_digits = |i: &mut usize, min: usize, max: usize| {
        let start = *i;
        while *i < b.len() && *i - start < max && b[*i].is_ascii_digit() {
            *i += 1;
        }
        *i - start >= min
    };
    let expect = |i: &mut usize, c: u8| {
        if b.get(*i) == Some(&c) {
            *i += 1;
            true
        } else {
            false
        }
    };
    if !(take_digits(&mut i, 4, 4)
        && expect(&mut i, b'-')
        && take_digits(&mut i, 1, 2)
        && expect(&mut i, b'-')
        && take_digits(&mut i, 1, 2))
    {
        return false;
    }
    if matches!(b.get(i), Some(b'T' | b't')) {
        i += 1;
    } else {
        let start = i;
        while matches!(b.get(i), Some(b' ' | b'\t')) {
            i += 1;
        }
        if i == start {
            return false;
        }
    }
    if !(take_digits(&mut i, 1, 2)
        && expect(&mut i, b':')
        && take_digits(&mut i, 2, 2)
        && expect(&mut i, b':')
        && take_digits(&mut i, 2, 2))
    {
        return false;
    }
    if expect(&mut i, b'.') {
        while digit(i) {
            i += 1;
        }
    }
    if i == b.len() {
        return true;
    }
    while matches!(b.get(i), Some(b' ' | b'\t')) {
        i += 1;
    }
    if expect(&mut i, b'Z') {
        return i == b.len();
    }
    if !matches!(b.get(i), Some(b'-' | b'+')) {
        return false;
    }
    i += 1;
    if !take_digits(&mut i, 1, 2) {
        return false;
    }
    if expect(&mut i, b':') && !take_digits(&mut i, 2, 2) {
        return false;
    }
    i == b.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dump(yaml: &str) -> String {
        let docs: Vec<Value> = serde_norway::Deserializer::from_str(yaml)
            .map(|d| serde::Deserialize::deserialize(d).unwrap())
            .collect();
        dump_all(&docs).unwrap()
    }

    #[test]
    fn block_layout_sorted_keys_and_indentless_sequences() {
        let out = dump(
            "spec:\n  z: 1\n  resourceGroups:\n    - coveredResources: [b, a]\n      flavors: []\n  a: {}\nkind: X\n",
        );
        assert_eq!(
            out,
            "kind: X\nspec:\n  a: {}\n  resourceGroups:\n  - coveredResources:\n    - b\n    - a\n    flavors: []\n  z: 1\n"
        );
    }

    #[test]
    fn later_documents_start_with_a_marker() {
        assert_eq!(dump("a: 1\n---\nb: 2\n"), "a: 1\n---\nb: 2\n");
        assert_eq!(dump("- - a\n  - b\n- c\n"), "- - a\n  - b\n- c\n");
    }

    #[test]
    fn strings_that_read_back_as_other_types_are_quoted() {
        for (value, written) in [
            ("'500'", "'500'"),
            ("1k", "1k"),
            ("500Ti", "500Ti"),
            ("'true'", "'true'"),
            ("'yes'", "'yes'"),
            ("'on'", "'on'"),
            ("''", "''"),
            ("'~'", "'~'"),
            ("'0.5'", "'0.5'"),
            ("'1e3'", "1e3"),
            ("'1_000'", "'1_000'"),
            ("'0x1F'", "'0x1F'"),
            ("'12:30'", "'12:30'"),
            ("'2025-10-01'", "'2025-10-01'"),
            ("tekton.dev/pipelineruns", "tekton.dev/pipelineruns"),
            ("'a: b'", "'a: b'"),
            ("'- a'", "'- a'"),
            ("'#x'", "'#x'"),
            ("a#b", "a#b"),
            ("'a #b'", "'a #b'"),
            ("' leading'", "' leading'"),
            ("\"it's\"", "it's"),
            ("\"caf\\u00e9\"", "\"caf\\xE9\""),
            ("\"tab\\there\"", "\"tab\\there\""),
            ("500", "500"),
            ("true", "true"),
            ("null", "null"),
        ] {
            assert_eq!(
                dump(&format!("k: {value}\n")),
                format!("k: {written}\n"),
                "{value}"
            );
        }
    }

    #[test]
    fn long_plain_scalars_fold_past_column_80() {
        let words = vec!["word"; 30].join(" ");
        let out = dump(&format!("key: {words}\n"));
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines.len() > 1, "{out}");
        assert!(lines[1].starts_with("  word"), "{out}");
        let back: Value = serde_norway::from_str(&out).unwrap();
        assert_eq!(back["key"], Value::String(words));
    }
}
