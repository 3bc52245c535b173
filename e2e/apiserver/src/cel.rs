//! A small subset of CEL for webhook `matchConditions` and ValidatingAdmissionPolicies: literals
//! (lists, maps), `object`/`oldObject`/`request`/`variables` field access (`.`, `[...]`,
//! `has()`), `== != < <= > >= in`, `+ -` (integers, strings, lists), `&& || !`, `? :`, `size()`,
//! `startsWith`/`endsWith`/`contains`/`matches`, `int()`, `string()`, `timestamp()` (only
//! converted back to unix seconds with `int()`), the `exists`/`all`/`exists_one` macros, and
//! resource checks of the `authorizer` (`authorizer.group(g).resource(r)`, optionally
//! `.subresource(s)`, `.namespace(n)`, `.name(n)`, then `.check(verb).allowed()`), answered by the
//! caller's [`Authorize`]. Expressions outside the subset are refused when they are parsed, never
//! silently misjudged.

use serde_json::Value;

/// A parsed expression.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// A literal.
    Lit(Value),
    /// A variable or macro-bound name.
    Ident(String),
    /// `e.f`.
    Field(Box<Expr>, String),
    /// `e[i]`.
    Index(Box<Expr>, Box<Expr>),
    /// `has(e.f)`.
    Has(Box<Expr>, String),
    /// `!e`.
    Not(Box<Expr>),
    /// Binary operator.
    Bin(String, Box<Expr>, Box<Expr>),
    /// `c ? a : b`.
    Cond(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `target.method(args)` or `fn(args)` (target `None`).
    Call(Option<Box<Expr>>, String, Vec<Expr>),
    /// `target.exists(v, pred)` and friends.
    Macro(Box<Expr>, String, String, Box<Expr>),
    /// `[a, b]`.
    List(Vec<Expr>),
    /// `{k: v}`.
    Map(Vec<(Expr, Expr)>),
    /// `authorizer.group(..).resource(..)[.subresource(..)][.namespace(..)][.name(..)]
    /// .check(verb).allowed()`.
    Allowed(Box<CheckExpr>),
}

/// The arguments of an authorizer resource check, as parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckExpr {
    group: Expr,
    resource: Expr,
    subresource: Option<Expr>,
    namespace: Option<Expr>,
    name: Option<Expr>,
    verb: Expr,
}

/// An authorizer resource check, evaluated: what [`Authorize`] is asked. No namespace is a
/// cluster-wide check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub group: String,
    pub resource: String,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub verb: String,
}

/// Answers the `authorizer` checks of an expression: whether the request's user is allowed.
pub type Authorize<'a> = &'a dyn Fn(&Check) -> bool;

/// The key of the one-entry JSON object that stands for a CEL timestamp (unix seconds): no
/// Kubernetes object has a key starting with a NUL.
const TIMESTAMP_KEY: &str = "\u{0}timestamp";

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Num(f64),
    Op(&'static str),
}

fn lex(s: &str) -> Result<Vec<Tok>, String> {
    let c: Vec<char> = s.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    const OPS: [&str; 22] = [
        "&&", "||", "==", "!=", "<=", ">=", "!", "<", ">", "(", ")", "[", "]", ".", ",", "?", ":",
        "+", "-", "{", "}", "*",
    ];
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '\'' || ch == '"' {
            let q = ch;
            i += 1;
            let mut v = String::new();
            while i < c.len() && c[i] != q {
                if c[i] == '\\' && i + 1 < c.len() {
                    i += 1;
                }
                v.push(c[i]);
                i += 1;
            }
            if i >= c.len() {
                return Err("unterminated string literal".into());
            }
            i += 1;
            out.push(Tok::Str(v));
        } else if ch.is_ascii_digit() {
            let start = i;
            while i < c.len() && (c[i].is_ascii_digit() || c[i] == '.') {
                i += 1;
            }
            let n: String = c[start..i].iter().collect();
            out.push(Tok::Num(n.parse().map_err(|_| format!("bad number {n}"))?));
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else {
            let rest: String = c[i..c.len().min(i + 2)].iter().collect();
            let op = OPS
                .iter()
                .find(|o| rest.starts_with(*o))
                .ok_or_else(|| format!("unexpected character {ch:?}"))?;
            i += op.len();
            out.push(Tok::Op(op));
        }
    }
    Ok(out)
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
}

impl Parser {
    fn peek_op(&self, op: &str) -> bool {
        matches!(self.toks.get(self.pos), Some(Tok::Op(o)) if *o == op)
    }
    fn eat_op(&mut self, op: &str) -> bool {
        if self.peek_op(op) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, op: &str) -> Result<(), String> {
        if self.eat_op(op) {
            Ok(())
        } else {
            Err(format!("expected {op:?} at token {}", self.pos))
        }
    }
    fn expr(&mut self) -> Result<Expr, String> {
        let c = self.or()?;
        if self.eat_op("?") {
            let a = self.expr()?;
            self.expect(":")?;
            let b = self.expr()?;
            return Ok(Expr::Cond(Box::new(c), Box::new(a), Box::new(b)));
        }
        Ok(c)
    }
    fn or(&mut self) -> Result<Expr, String> {
        let mut l = self.and()?;
        while self.eat_op("||") {
            l = Expr::Bin("||".into(), Box::new(l), Box::new(self.and()?));
        }
        Ok(l)
    }
    fn and(&mut self) -> Result<Expr, String> {
        let mut l = self.rel()?;
        while self.eat_op("&&") {
            l = Expr::Bin("&&".into(), Box::new(l), Box::new(self.rel()?));
        }
        Ok(l)
    }
    fn rel(&mut self) -> Result<Expr, String> {
        let l = self.add()?;
        for op in ["==", "!=", "<=", ">=", "<", ">"] {
            if self.eat_op(op) {
                return Ok(Expr::Bin(op.into(), Box::new(l), Box::new(self.add()?)));
            }
        }
        if matches!(self.toks.get(self.pos), Some(Tok::Ident(s)) if s == "in") {
            self.pos += 1;
            return Ok(Expr::Bin("in".into(), Box::new(l), Box::new(self.add()?)));
        }
        if let Some(Tok::Op(o @ "*")) = self.toks.get(self.pos) {
            return Err(format!(
                "arithmetic ({o}) is not supported by this test API server"
            ));
        }
        Ok(l)
    }
    fn add(&mut self) -> Result<Expr, String> {
        let mut l = self.unary()?;
        loop {
            let op = if self.eat_op("+") {
                "+"
            } else if self.eat_op("-") {
                "-"
            } else {
                return Ok(l);
            };
            l = Expr::Bin(op.into(), Box::new(l), Box::new(self.unary()?));
        }
    }
    fn unary(&mut self) -> Result<Expr, String> {
        if self.eat_op("!") {
            return Ok(Expr::Not(Box::new(self.unary()?)));
        }
        self.member()
    }
    fn args(&mut self) -> Result<Vec<Expr>, String> {
        let mut a = Vec::new();
        if self.eat_op(")") {
            return Ok(a);
        }
        loop {
            a.push(self.expr()?);
            if self.eat_op(")") {
                return Ok(a);
            }
            self.expect(",")?;
        }
    }
    fn member(&mut self) -> Result<Expr, String> {
        let mut e = self.primary()?;
        loop {
            if self.eat_op(".") {
                let Some(Tok::Ident(name)) = self.toks.get(self.pos).cloned() else {
                    return Err("expected a field name after '.'".into());
                };
                self.pos += 1;
                if self.eat_op("(") {
                    if matches!(name.as_str(), "exists" | "all" | "exists_one") {
                        let Some(Tok::Ident(var)) = self.toks.get(self.pos).cloned() else {
                            return Err(format!("{name}() needs a variable name"));
                        };
                        self.pos += 1;
                        self.expect(",")?;
                        let body = self.expr()?;
                        self.expect(")")?;
                        e = Expr::Macro(Box::new(e), name, var, Box::new(body));
                    } else if matches!(
                        name.as_str(),
                        "startsWith" | "endsWith" | "contains" | "size" | "matches"
                    ) {
                        let a = self.args()?;
                        e = Expr::Call(Some(Box::new(e)), name, a);
                    } else {
                        return Err(format!(
                            "method {name}() is not supported by this test API server"
                        ));
                    }
                } else {
                    e = Expr::Field(Box::new(e), name);
                }
            } else if self.eat_op("[") {
                let i = self.expr()?;
                self.expect("]")?;
                e = Expr::Index(Box::new(e), Box::new(i));
            } else {
                return Ok(e);
            }
        }
    }
    fn primary(&mut self) -> Result<Expr, String> {
        let t = self
            .toks
            .get(self.pos)
            .cloned()
            .ok_or("unexpected end of expression")?;
        self.pos += 1;
        match t {
            Tok::Str(s) => Ok(Expr::Lit(Value::String(s))),
            // Integer literals stay integers (CEL's int), so `int(x) - 300` is exact.
            Tok::Num(n) if n.fract() == 0.0 && n.abs() < 9.0e15 => {
                Ok(Expr::Lit(serde_json::json!(n as i64)))
            }
            Tok::Num(n) => Ok(Expr::Lit(serde_json::json!(n))),
            Tok::Op("(") => {
                let e = self.expr()?;
                self.expect(")")?;
                Ok(e)
            }
            Tok::Op("[") => {
                let mut items = Vec::new();
                if !self.eat_op("]") {
                    loop {
                        items.push(self.expr()?);
                        if self.eat_op("]") {
                            break;
                        }
                        self.expect(",")?;
                    }
                }
                Ok(Expr::List(items))
            }
            Tok::Op("{") => {
                let mut entries = Vec::new();
                if !self.eat_op("}") {
                    loop {
                        let k = self.expr()?;
                        self.expect(":")?;
                        entries.push((k, self.expr()?));
                        if self.eat_op("}") {
                            break;
                        }
                        self.expect(",")?;
                    }
                }
                Ok(Expr::Map(entries))
            }
            Tok::Ident(id) => match id.as_str() {
                "true" => Ok(Expr::Lit(Value::Bool(true))),
                "false" => Ok(Expr::Lit(Value::Bool(false))),
                "null" => Ok(Expr::Lit(Value::Null)),
                "has" => {
                    self.expect("(")?;
                    let e = self.member()?;
                    self.expect(")")?;
                    match e {
                        Expr::Field(t, f) => Ok(Expr::Has(t, f)),
                        _ => Err("has() needs a field selection argument".into()),
                    }
                }
                "authorizer" => self.authorizer_check(),
                "size" | "int" | "string" | "timestamp" if self.peek_op("(") => {
                    self.pos += 1;
                    let a = self.args()?;
                    Ok(Expr::Call(None, id, a))
                }
                _ if self.peek_op("(") => Err(format!(
                    "function {id}() is not supported by this test API server"
                )),
                _ => Ok(Expr::Ident(id)),
            },
            Tok::Op(o) => Err(format!("unexpected {o:?}")),
        }
    }
}

impl Parser {
    /// `.method(arg)` when the next method is `name`.
    fn method_arg(&mut self, name: &str) -> Result<Option<Expr>, String> {
        let is_next = self.peek_op(".")
            && matches!(self.toks.get(self.pos + 1), Some(Tok::Ident(m)) if m == name)
            && matches!(self.toks.get(self.pos + 2), Some(Tok::Op("(")));
        if !is_next {
            return Ok(None);
        }
        self.pos += 3;
        let e = self.expr()?;
        self.expect(")")?;
        Ok(Some(e))
    }

    /// The rest of `authorizer...allowed()`, after `authorizer`: only resource checks.
    fn authorizer_check(&mut self) -> Result<Expr, String> {
        let unsupported = || {
            "only authorizer.group(..).resource(..)[.subresource(..)][.namespace(..)][.name(..)]\
             .check(..).allowed() is supported by this test API server"
                .to_owned()
        };
        let group = self.method_arg("group")?.ok_or_else(unsupported)?;
        let resource = self.method_arg("resource")?.ok_or_else(unsupported)?;
        let subresource = self.method_arg("subresource")?;
        let namespace = self.method_arg("namespace")?;
        let name = self.method_arg("name")?;
        let verb = self.method_arg("check")?.ok_or_else(unsupported)?;
        if !(self.eat_op(".")
            && matches!(self.toks.get(self.pos), Some(Tok::Ident(m)) if m == "allowed"))
        {
            return Err(unsupported());
        }
        self.pos += 1;
        self.expect("(")?;
        self.expect(")")?;
        Ok(Expr::Allowed(Box::new(CheckExpr {
            group,
            resource,
            subresource,
            namespace,
            name,
            verb,
        })))
    }
}

/// Parses an expression of the supported subset.
pub fn parse(src: &str) -> Result<Expr, String> {
    let mut p = Parser {
        toks: lex(src)?,
        pos: 0,
    };
    let e = p.expr()?;
    if p.pos != p.toks.len() {
        return Err(format!("unexpected trailing input at token {}", p.pos));
    }
    Ok(e)
}

struct Env<'a> {
    vars: Vec<(String, Value)>,
    authorize: Option<Authorize<'a>>,
}

fn lookup(env: &Env<'_>, name: &str) -> Result<Value, String> {
    env.vars
        .iter()
        .rev()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
        .ok_or_else(|| format!("undeclared reference to {name:?}"))
}

fn truthy(v: &Value) -> Result<bool, String> {
    v.as_bool()
        .ok_or_else(|| format!("no such overload: expected bool, got {v}"))
}

fn eval_in(e: &Expr, env: &mut Env<'_>) -> Result<Value, String> {
    Ok(match e {
        Expr::Lit(v) => v.clone(),
        Expr::Ident(n) => lookup(env, n)?,
        Expr::Field(t, f) => {
            let t = eval_in(t, env)?;
            t.get(f.as_str())
                .cloned()
                .ok_or_else(|| format!("no such key: {f}"))?
        }
        Expr::Index(t, i) => {
            let t = eval_in(t, env)?;
            let i = eval_in(i, env)?;
            match (&t, &i) {
                (Value::Object(m), Value::String(k)) => m
                    .get(k)
                    .cloned()
                    .ok_or_else(|| format!("no such key: {k}"))?,
                (Value::Array(a), Value::Number(n)) => a
                    .get(n.as_f64().unwrap_or(-1.0) as usize)
                    .cloned()
                    .ok_or("index out of range")?,
                _ => return Err(format!("no such overload: index {i} of {t}")),
            }
        }
        Expr::Has(t, f) => {
            let t = eval_in(t, env)?;
            Value::Bool(t.get(f.as_str()).is_some_and(|v| !v.is_null()))
        }
        Expr::Not(x) => Value::Bool(!truthy(&eval_in(x, env)?)?),
        Expr::Cond(c, a, b) => {
            if truthy(&eval_in(c, env)?)? {
                eval_in(a, env)?
            } else {
                eval_in(b, env)?
            }
        }
        Expr::Bin(op, l, r) => {
            if op == "&&" || op == "||" {
                // CEL's commutative logic: an error on one side is absorbed if the other decides.
                let lv = eval_in(l, env).and_then(|v| truthy(&v));
                let short = op == "||";
                if lv == Ok(short) {
                    return Ok(Value::Bool(short));
                }
                let rv = eval_in(r, env).and_then(|v| truthy(&v));
                return match (lv, rv) {
                    (_, Ok(b)) if b == short => Ok(Value::Bool(short)),
                    (Ok(_), Ok(_)) => Ok(Value::Bool(!short)),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
            }
            let lv = eval_in(l, env)?;
            let rv = eval_in(r, env)?;
            match op.as_str() {
                "+" | "-" => arithmetic(op, &lv, &rv)?,
                "==" => Value::Bool(json_eq(&lv, &rv)),
                "!=" => Value::Bool(!json_eq(&lv, &rv)),
                "in" => Value::Bool(match &rv {
                    Value::Object(m) => lv.as_str().is_some_and(|k| m.contains_key(k)),
                    Value::Array(a) => a.iter().any(|x| json_eq(x, &lv)),
                    _ => return Err(format!("no such overload: in {rv}")),
                }),
                cmp => {
                    let ord = match (&lv, &rv) {
                        (Value::Number(a), Value::Number(b)) => a
                            .as_f64()
                            .partial_cmp(&b.as_f64())
                            .ok_or("incomparable numbers")?,
                        (Value::String(a), Value::String(b)) => a.cmp(b),
                        _ => return Err(format!("no such overload: {lv} {cmp} {rv}")),
                    };
                    Value::Bool(match cmp {
                        "<" => ord.is_lt(),
                        "<=" => ord.is_le(),
                        ">" => ord.is_gt(),
                        _ => ord.is_ge(),
                    })
                }
            }
        }
        Expr::Call(target, name, args) => {
            let mut vals = Vec::new();
            if let Some(t) = target {
                vals.push(eval_in(t, env)?);
            }
            for a in args {
                vals.push(eval_in(a, env)?);
            }
            match (name.as_str(), vals.as_slice()) {
                ("size", [v]) => serde_json::json!(match v {
                    Value::String(s) => s.chars().count(),
                    Value::Array(a) => a.len(),
                    Value::Object(m) => m.len(),
                    _ => return Err(format!("no such overload: size({v})")),
                }),
                ("startsWith", [Value::String(a), Value::String(b)]) => {
                    Value::Bool(a.starts_with(b.as_str()))
                }
                ("endsWith", [Value::String(a), Value::String(b)]) => {
                    Value::Bool(a.ends_with(b.as_str()))
                }
                ("contains", [Value::String(a), Value::String(b)]) => {
                    Value::Bool(a.contains(b.as_str()))
                }
                ("matches", [Value::String(a), Value::String(re)]) => Value::Bool(
                    regex::Regex::new(re)
                        .map_err(|e| format!("invalid regular expression {re:?}: {e}"))?
                        .is_match(a),
                ),
                ("int", [v]) => int_of(v)?,
                ("string", [v]) => match v {
                    Value::String(_) => v.clone(),
                    Value::Number(n) => Value::String(n.to_string()),
                    Value::Bool(b) => Value::String(b.to_string()),
                    _ => return Err(format!("no such overload: string({v})")),
                },
                ("timestamp", [Value::String(s)]) => {
                    let t = time::OffsetDateTime::parse(
                        s,
                        &time::format_description::well_known::Rfc3339,
                    )
                    .map_err(|e| format!("timestamp({s:?}): {e}"))?;
                    serde_json::json!({TIMESTAMP_KEY: t.unix_timestamp()})
                }
                _ => return Err(format!("no such overload: {name}")),
            }
        }
        Expr::Macro(t, name, var, body) => {
            let items: Vec<Value> = match eval_in(t, env)? {
                Value::Array(a) => a,
                Value::Object(m) => m.keys().map(|k| Value::String(k.clone())).collect(),
                other => return Err(format!("no such overload: {name} on {other}")),
            };
            let mut hits = 0usize;
            let mut first_err = None;
            for item in items {
                env.vars.push((var.clone(), item));
                let r = eval_in(body, env).and_then(|v| truthy(&v));
                env.vars.pop();
                match r {
                    Ok(true) => hits += 1,
                    Ok(false) if name == "all" => return Ok(Value::Bool(false)),
                    Ok(false) => {}
                    Err(e) => first_err = first_err.or(Some(e)),
                }
                if name == "exists" && hits > 0 {
                    return Ok(Value::Bool(true));
                }
            }
            if let Some(e) = first_err {
                return Err(e);
            }
            Value::Bool(match name.as_str() {
                "exists" => false,
                "all" => true,
                _ => hits == 1,
            })
        }
        Expr::Allowed(c) => {
            let mut text = |e: &Expr| match eval_in(e, env)? {
                Value::String(s) => Ok(s),
                other => Err(format!("no such overload: authorizer argument {other}")),
            };
            let check = Check {
                group: text(&c.group)?,
                resource: text(&c.resource)?,
                subresource: c.subresource.as_ref().map(&mut text).transpose()?,
                namespace: c.namespace.as_ref().map(&mut text).transpose()?,
                name: c.name.as_ref().map(&mut text).transpose()?,
                verb: text(&c.verb)?,
            };
            let authorize = env
                .authorize
                .ok_or("undeclared reference to \"authorizer\"")?;
            Value::Bool(authorize(&check))
        }
        Expr::List(items) => Value::Array(
            items
                .iter()
                .map(|i| eval_in(i, env))
                .collect::<Result<_, _>>()?,
        ),
        Expr::Map(entries) => {
            let mut m = serde_json::Map::new();
            for (k, v) in entries {
                let Value::String(k) = eval_in(k, env)? else {
                    return Err("map keys must be strings in this test API server".into());
                };
                m.insert(k, eval_in(v, env)?);
            }
            Value::Object(m)
        }
    })
}

/// `int(x)`: integers as they are, decimal strings parsed, timestamps as unix seconds.
fn int_of(v: &Value) -> Result<Value, String> {
    let n = match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.parse::<i64>().ok(),
        Value::Object(m) if m.len() == 1 => m.get(TIMESTAMP_KEY).and_then(Value::as_i64),
        _ => None,
    };
    n.map(Value::from)
        .ok_or_else(|| format!("no such overload or bad value: int({v})"))
}

/// `+` on integers, strings and lists; `-` on integers. Overflow is an error, as in CEL.
fn arithmetic(op: &str, l: &Value, r: &Value) -> Result<Value, String> {
    match (op, l, r) {
        (_, Value::Number(a), Value::Number(b)) => {
            let (Some(a), Some(b)) = (a.as_i64(), b.as_i64()) else {
                return Err(format!("no such overload: {l} {op} {r} (integers only)"));
            };
            let n = if op == "+" {
                a.checked_add(b)
            } else {
                a.checked_sub(b)
            };
            n.map(Value::from).ok_or_else(|| "integer overflow".into())
        }
        ("+", Value::String(a), Value::String(b)) => Ok(Value::String(format!("{a}{b}"))),
        ("+", Value::Array(a), Value::Array(b)) => {
            Ok(Value::Array(a.iter().chain(b).cloned().collect()))
        }
        _ => Err(format!("no such overload: {l} {op} {r}")),
    }
}

fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

/// Evaluates `expr` with `vars` bound (`object`, `oldObject`, `request`); the result must be bool.
pub fn eval_bool(expr: &Expr, vars: &[(&str, Value)]) -> Result<bool, String> {
    truthy(&eval(expr, vars)?)
}

/// Evaluates `expr` with `vars` bound.
pub fn eval(expr: &Expr, vars: &[(&str, Value)]) -> Result<Value, String> {
    eval_with(expr, vars, None)
}

/// Evaluates `expr` with `vars` bound and `authorizer` checks answered by `authorize` (without
/// one, an expression using `authorizer` fails).
pub fn eval_with(
    expr: &Expr,
    vars: &[(&str, Value)],
    authorize: Option<Authorize<'_>>,
) -> Result<Value, String> {
    let mut env = Env {
        vars: vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        authorize,
    };
    eval_in(expr, &mut env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(src: &str, obj: Value) -> Result<bool, String> {
        eval_bool(
            &parse(src).unwrap(),
            &[
                ("object", obj),
                ("oldObject", Value::Null),
                ("request", json!({"operation": "CREATE"})),
            ],
        )
    }

    #[test]
    fn subset_evaluates() {
        let tr = json!({"metadata": {"labels": {"a": "1"}}, "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}]}});
        assert_eq!(
            ev(
                "object.spec.params.exists(p, p.name == 'PLATFORM')",
                tr.clone()
            ),
            Ok(true)
        );
        assert_eq!(
            ev(
                "has(object.metadata.labels) && 'a' in object.metadata.labels",
                tr.clone()
            ),
            Ok(true)
        );
        assert_eq!(
            ev("!has(object.metadata.annotations)", tr.clone()),
            Ok(true)
        );
        assert_eq!(
            ev(
                "request.operation == \"CREATE\" || request.operation == 'UPDATE'",
                tr.clone()
            ),
            Ok(true)
        );
        assert_eq!(
            ev(
                "object.spec.params.all(p, p.value.startsWith('linux/'))",
                tr.clone()
            ),
            Ok(true)
        );
        assert_eq!(
            ev("size(object.spec.params) > 1 ? true : false", tr.clone()),
            Ok(false)
        );
        assert_eq!(
            ev("object.metadata.labels['a'] == '1'", tr.clone()),
            Ok(true)
        );
        // Errors are absorbed by a deciding || side, and surface otherwise.
        assert_eq!(
            ev("has(object.x) || object.x.y == 1", tr.clone()),
            Err("no such key: x".into())
        );
        assert_eq!(ev("object.x.y == 1 || true", tr.clone()), Ok(true));
    }

    #[test]
    fn policy_functions_evaluate() {
        let tr = json!({"metadata": {"creationTimestamp": "2026-01-02T03:04:05Z",
            "annotations": {"t": "1767323045", "x": "abc"}}});
        assert_eq!(
            ev(
                "int(object.metadata.annotations['t']) == int(timestamp(object.metadata.creationTimestamp))",
                tr.clone()
            ),
            Ok(true)
        );
        assert_eq!(
            ev(
                "int(object.metadata.annotations['t']) - 300 < int(timestamp(object.metadata.creationTimestamp)) + 1",
                tr.clone()
            ),
            Ok(true)
        );
        assert_eq!(
            ev(
                "object.metadata.annotations['t'].matches('^[0-9]{1,12}$') && !object.metadata.annotations['x'].matches('^[0-9]+$')",
                tr.clone()
            ),
            Ok(true)
        );
        assert!(ev("int(object.metadata.annotations['x']) > 0", tr.clone()).is_err());
        assert_eq!(
            ev(
                "(has(object.metadata.labels) ? object.metadata.labels : {}) == {} && {'a': 1}['a'] == 1",
                tr.clone()
            ),
            Ok(true)
        );
        assert_eq!(
            ev("size([1] + [2, 3]) == 3 && 'a' + 'b' == 'ab'", tr.clone()),
            Ok(true)
        );
        assert_eq!(ev("string(12) == '12'", tr.clone()), Ok(true));
        assert!(ev("timestamp('yesterday') == 1", tr).is_err());
    }

    #[test]
    fn authorizer_checks_are_asked_of_the_caller() {
        let asked = std::cell::RefCell::new(Vec::new());
        let authorize = |c: &Check| {
            asked.borrow_mut().push(c.clone());
            c.verb == "approve"
        };
        let ev = |src: &str| {
            eval_with(
                &parse(src).unwrap(),
                &[("request", json!({"namespace": "ns"}))],
                Some(&authorize),
            )
        };
        assert_eq!(
            ev("authorizer.group('tekton.dev').resource('taskruns').check('approve').allowed()"),
            Ok(json!(true))
        );
        assert_eq!(
            ev(
                "authorizer.group('').resource('pods').subresource('log').namespace(request.namespace).name('p').check('get').allowed() || false"
            ),
            Ok(json!(false))
        );
        assert_eq!(
            asked.borrow().clone(),
            [
                Check {
                    group: "tekton.dev".into(),
                    resource: "taskruns".into(),
                    subresource: None,
                    namespace: None,
                    name: None,
                    verb: "approve".into()
                },
                Check {
                    group: String::new(),
                    resource: "pods".into(),
                    subresource: Some("log".into()),
                    namespace: Some("ns".into()),
                    name: Some("p".into()),
                    verb: "get".into()
                }
            ]
        );
        // Without an authorizer (webhook matchConditions here), using it fails.
        let e = parse("authorizer.group('').resource('pods').check('get').allowed()").unwrap();
        assert!(eval(&e, &[]).is_err());
    }

    #[test]
    fn unsupported_is_refused_at_parse() {
        assert!(parse("object.metadata.name.lowerAscii()").is_err());
        assert!(parse("size(object.a) * 2 > 2").is_err());
        assert!(parse("authorizer.requestResource.check('x').allowed()").is_err());
        assert!(parse("authorizer.group('').resource('pods').check('get')").is_err());
        assert!(parse("authorizer.group('').resource('pods').check('get').reason()").is_err());
        assert!(parse("authorizer.serviceAccount('ns', 'sa').group('').resource('pods').check('get').allowed()").is_err());
        assert!(parse("'a' ==").is_err());
    }
}
