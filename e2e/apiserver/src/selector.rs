//! Label and field selectors with the Kubernetes syntax (`a=b,c!=d,e in (x,y),f notin (z),g,!h`).

use std::collections::BTreeSet;

use serde_json::Value;

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// `key=value` or `key==value`.
    Equals(String, String),
    /// `key!=value` (also true when the key is absent).
    NotEquals(String, String),
    /// `key in (a,b)`.
    In(String, BTreeSet<String>),
    /// `key notin (a,b)` (also true when the key is absent).
    NotIn(String, BTreeSet<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    DoesNotExist(String),
    /// `key>n` (integer comparison).
    GreaterThan(String, i64),
    /// `key<n` (integer comparison).
    LessThan(String, i64),
}

/// A parsed label selector: every requirement must hold. The empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    requirements: Vec<Requirement>,
    /// A `LabelSelector` object with an unknown operator matches nothing (as the apiserver does).
    nothing: bool,
}

fn label_of<'a>(labels: Option<&'a Value>, key: &str) -> Option<&'a str> {
    labels?.get(key)?.as_str()
}

impl Requirement {
    fn matches(&self, labels: Option<&Value>) -> bool {
        match self {
            Self::Equals(k, v) => label_of(labels, k) == Some(v.as_str()),
            Self::NotEquals(k, v) => label_of(labels, k) != Some(v.as_str()),
            Self::In(k, vs) => label_of(labels, k).is_some_and(|l| vs.contains(l)),
            Self::NotIn(k, vs) => !label_of(labels, k).is_some_and(|l| vs.contains(l)),
            Self::Exists(k) => label_of(labels, k).is_some(),
            Self::DoesNotExist(k) => label_of(labels, k).is_none(),
            Self::GreaterThan(k, n) => label_of(labels, k)
                .and_then(|l| l.parse::<i64>().ok())
                .is_some_and(|l| l > *n),
            Self::LessThan(k, n) => label_of(labels, k)
                .and_then(|l| l.parse::<i64>().ok())
                .is_some_and(|l| l < *n),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    Not,
    NotEquals,
    Equals,
    DoubleEquals,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

fn lex(input: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut chars = input.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '!' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    out.push(Token::NotEquals);
                } else {
                    out.push(Token::Not);
                }
            }
            '=' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    out.push(Token::DoubleEquals);
                } else {
                    out.push(Token::Equals);
                }
            }
            '>' => {
                chars.next();
                out.push(Token::Gt);
            }
            '<' => {
                chars.next();
                out.push(Token::Lt);
            }
            '(' => {
                chars.next();
                out.push(Token::Open);
            }
            ')' => {
                chars.next();
                out.push(Token::Close);
            }
            ',' => {
                chars.next();
                out.push(Token::Comma);
            }
            _ => {
                let mut s = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_whitespace() || "!=<>(),".contains(c) {
                        break;
                    }
                    s.push(c);
                    chars.next();
                }
                out.push(Token::Ident(s));
            }
        }
    }
    out
}

/// Checks a label key: optional DNS-subdomain prefix and `/`, then a name of at most 63 characters.
pub fn validate_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && !is_dns_subdomain(p)
    {
        return Err(format!(
            "invalid label key {key:?}: prefix part must be a lowercase RFC 1123 subdomain"
        ));
    }
    if name.is_empty() || name.len() > 63 || !is_qualified_name_part(name) {
        return Err(format!(
            "invalid label key {key:?}: name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (at most 63 characters)"
        ));
    }
    Ok(())
}

/// Checks a label value: empty, or at most 63 characters of `[A-Za-z0-9_.-]` starting and ending
/// alphanumeric.
pub fn validate_label_value(value: &str) -> Result<(), String> {
    if value.is_empty() || (value.len() <= 63 && is_qualified_name_part(value)) {
        Ok(())
    } else {
        Err(format!(
            "invalid label value {value:?}: must be 63 characters or less and must be empty or begin and end with an alphanumeric character with '-', '_', '.', and alphanumerics between"
        ))
    }
}

fn is_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

/// RFC 1123 subdomain: lowercase alphanumerics, `-` and `.`, at most 253 characters.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && !s.is_empty() && s.split('.').all(is_dns_label_part)
}

fn is_dns_label_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// RFC 1123 label (namespace names): lowercase alphanumerics and `-`, at most 63 characters.
pub fn is_dns_label(s: &str) -> bool {
    is_dns_label_part(s)
}

impl LabelSelector {
    /// Parses the `labelSelector` query syntax.
    pub fn parse(input: &str) -> Result<Self, String> {
        let tokens = lex(input);
        let mut reqs = Vec::new();
        let mut i = 0;
        let ident = |i: usize| -> Result<String, String> {
            match tokens.get(i) {
                Some(Token::Ident(s)) => Ok(s.clone()),
                other => Err(format!(
                    "unable to parse requirement: expected a label key or value, found {other:?}"
                )),
            }
        };
        while i < tokens.len() {
            let req = if tokens[i] == Token::Not {
                let key = ident(i + 1)?;
                validate_label_key(&key)?;
                i += 2;
                Requirement::DoesNotExist(key)
            } else {
                let key = ident(i)?;
                validate_label_key(&key)?;
                i += 1;
                match tokens.get(i) {
                    None | Some(Token::Comma) => Requirement::Exists(key),
                    Some(Token::Equals | Token::DoubleEquals | Token::NotEquals) => {
                        let neg = tokens[i] == Token::NotEquals;
                        i += 1;
                        // An empty value (`a=`) is allowed.
                        let value = match tokens.get(i) {
                            Some(Token::Ident(v)) => {
                                i += 1;
                                v.clone()
                            }
                            None | Some(Token::Comma) => String::new(),
                            Some(t) => {
                                return Err(format!(
                                    "unable to parse requirement: unexpected {t:?}"
                                ));
                            }
                        };
                        validate_label_value(&value)?;
                        if neg {
                            Requirement::NotEquals(key, value)
                        } else {
                            Requirement::Equals(key, value)
                        }
                    }
                    Some(Token::Gt | Token::Lt) => {
                        let gt = tokens[i] == Token::Gt;
                        let v = ident(i + 1)?;
                        i += 2;
                        let n: i64 = v.parse().map_err(|_| {
                            format!("invalid value {v:?} for '>' or '<': must be an integer")
                        })?;
                        if gt {
                            Requirement::GreaterThan(key, n)
                        } else {
                            Requirement::LessThan(key, n)
                        }
                    }
                    Some(Token::Ident(op)) if op == "in" || op == "notin" => {
                        let negate = op == "notin";
                        i += 1;
                        if tokens.get(i) != Some(&Token::Open) {
                            return Err(format!("expected '(' after '{op}'"));
                        }
                        i += 1;
                        let mut values = BTreeSet::new();
                        loop {
                            match tokens.get(i) {
                                Some(Token::Ident(v)) => {
                                    validate_label_value(v)?;
                                    values.insert(v.clone());
                                    i += 1;
                                }
                                Some(Token::Close) => {
                                    i += 1;
                                    break;
                                }
                                Some(Token::Comma) => {
                                    // `(a,,b)` or `(,a)` keeps an empty value, like the apiserver.
                                    if matches!(
                                        tokens.get(i + 1),
                                        Some(Token::Comma | Token::Close)
                                    ) || matches!(tokens.get(i - 1), Some(Token::Open))
                                    {
                                        values.insert(String::new());
                                    }
                                    i += 1;
                                }
                                other => {
                                    return Err(format!(
                                        "unable to parse set for {key:?}: unexpected {other:?}"
                                    ));
                                }
                            }
                        }
                        if values.is_empty() {
                            return Err(format!(
                                "for 'in', 'notin' operators, values set can't be empty (key {key:?})"
                            ));
                        }
                        if negate {
                            Requirement::NotIn(key, values)
                        } else {
                            Requirement::In(key, values)
                        }
                    }
                    Some(t) => {
                        return Err(format!(
                            "unable to parse requirement: unexpected {t:?} after {key:?}"
                        ));
                    }
                }
            };
            reqs.push(req);
            match tokens.get(i) {
                None => {}
                Some(Token::Comma) => {
                    i += 1;
                    if i == tokens.len() {
                        return Err("unable to parse requirement: trailing ','".into());
                    }
                }
                Some(t) => {
                    return Err(format!(
                        "unable to parse requirement: expected ',' found {t:?}"
                    ));
                }
            }
        }
        Ok(Self {
            requirements: reqs,
            nothing: false,
        })
    }

    /// Builds a selector from a `metav1.LabelSelector` object (`matchLabels`, `matchExpressions`).
    /// A missing object matches everything.
    pub fn from_object(sel: Option<&Value>) -> Result<Self, String> {
        let Some(sel) = sel.filter(|v| !v.is_null()) else {
            return Ok(Self::default());
        };
        let mut reqs = Vec::new();
        if let Some(ml) = sel.get("matchLabels").and_then(Value::as_object) {
            for (k, v) in ml {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("matchLabels[{k}] must be a string"))?;
                reqs.push(Requirement::Equals(k.clone(), v.to_owned()));
            }
        }
        for e in sel
            .get("matchExpressions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let key = e
                .get("key")
                .and_then(Value::as_str)
                .ok_or("matchExpressions[].key is required")?
                .to_owned();
            let values: BTreeSet<String> = e
                .get("values")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect();
            let req = match e.get("operator").and_then(Value::as_str) {
                Some("In") => Requirement::In(key, values),
                Some("NotIn") => Requirement::NotIn(key, values),
                Some("Exists") => Requirement::Exists(key),
                Some("DoesNotExist") => Requirement::DoesNotExist(key),
                other => return Err(format!("{other:?} is not a valid label selector operator")),
            };
            reqs.push(req);
        }
        Ok(Self {
            requirements: reqs,
            nothing: false,
        })
    }

    /// Whether `labels` (a JSON object, or `None`) satisfies every requirement.
    pub fn matches(&self, labels: Option<&Value>) -> bool {
        !self.nothing && self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Whether the selector has no requirements.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty() && !self.nothing
    }
}

/// One `field=value` / `field!=value` term of a field selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldTerm {
    /// Dotted field path, e.g. `metadata.name`.
    pub field: String,
    /// The value compared with.
    pub value: String,
    /// `!=`.
    pub negated: bool,
}

/// A parsed field selector; which fields are allowed depends on the resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    /// All terms must hold.
    pub terms: Vec<FieldTerm>,
}

impl FieldSelector {
    /// Parses `a=b,c!=d,e==f` (`\` escapes `,`, `=`, `!` and `\` in values).
    pub fn parse(input: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for part in split_unescaped(input, ',') {
            if part.trim().is_empty() {
                continue;
            }
            let (field, value, negated) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, true)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, v, false)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, v, false)
            } else {
                return Err(format!(
                    "invalid selector: '{part}'; can't understand '{part}'"
                ));
            };
            terms.push(FieldTerm {
                field: field.trim().to_owned(),
                value: unescape(value.trim()),
                negated,
            });
        }
        Ok(Self { terms })
    }

    /// Whether `get(field)` satisfies every term (a missing field reads as "").
    pub fn matches(&self, get: impl Fn(&str) -> Option<String>) -> bool {
        self.terms.iter().all(|t| {
            let v = get(&t.field).unwrap_or_default();
            (v == t.value) != t.negated
        })
    }
}

fn split_unescaped(s: &str, sep: char) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            out.last_mut().expect("non-empty").push('\\');
            out.last_mut().expect("non-empty").push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == sep {
            out.push(String::new());
        } else {
            out.last_mut().expect("non-empty").push(c);
        }
    }
    out
}

fn unescape(s: &str) -> String {
    let mut out = String::new();
    let mut escaped = false;
    for c in s.chars() {
        if escaped {
            out.push(c);
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn m(sel: &str, labels: Value) -> bool {
        LabelSelector::parse(sel).unwrap().matches(Some(&labels))
    }

    #[test]
    fn label_operators() {
        let l = json!({"a": "1", "b": "x", "tier": "web"});
        assert!(m("a=1", l.clone()));
        assert!(m("a==1", l.clone()));
        assert!(!m("a!=1", l.clone()));
        assert!(m("c!=1", l.clone()), "!= holds for a missing key");
        assert!(m("b in (x, y)", l.clone()));
        assert!(!m("b notin (x,y)", l.clone()));
        assert!(m("z notin (x)", l.clone()));
        assert!(m("a", l.clone()));
        assert!(!m("!a", l.clone()));
        assert!(m("!zz", l.clone()));
        assert!(m("a>0,a<2", l.clone()));
        assert!(!m("a>1", l.clone()));
        assert!(m("a=1, tier in (web), !c", l.clone()));
        assert!(!m("a=1,tier=db", l.clone()));
        assert!(m("", l.clone()));
        assert!(m(
            "build.appstudio.redhat.com/target-platform",
            json!({"build.appstudio.redhat.com/target-platform": "linux-arm64"})
        ));
        assert!(m("e=", json!({"e": ""})));
    }

    #[test]
    fn label_errors() {
        for bad in [
            "a in x", "a in ()", "a=1,", "=x", "a b", "-a=1", "a=-x-", "a in (x",
        ] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn selector_objects() {
        let s = LabelSelector::from_object(Some(&json!({
            "matchLabels": {"a": "1"},
            "matchExpressions": [{"key": "b", "operator": "NotIn", "values": ["x"]}]
        })))
        .unwrap();
        assert!(s.matches(Some(&json!({"a": "1"}))));
        assert!(!s.matches(Some(&json!({"a": "1", "b": "x"}))));
        assert!(LabelSelector::from_object(None).unwrap().matches(None));
        assert!(
            LabelSelector::from_object(Some(
                &json!({"matchExpressions": [{"key": "b", "operator": "Bogus"}]})
            ))
            .is_err()
        );
    }

    #[test]
    fn fields() {
        let f = FieldSelector::parse("metadata.name=foo,metadata.namespace!=kube-system").unwrap();
        let get = |ns: &'static str| {
            move |k: &str| match k {
                "metadata.name" => Some("foo".to_owned()),
                "metadata.namespace" => Some(ns.to_owned()),
                _ => None,
            }
        };
        assert!(f.matches(get("default")));
        assert!(!f.matches(get("kube-system")));
        let e = FieldSelector::parse(r"metadata.name=a\,b").unwrap();
        assert_eq!(e.terms[0].value, "a,b");
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
