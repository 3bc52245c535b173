//! CEL for webhook `matchConditions` and ValidatingAdmissionPolicies, by the `cel` crate (the
//! standard library and macros: `has`, `all`, `exists`, `exists_one`, `map`, `filter`,
//! `matches`, `timestamp`, ...) plus the part of Kubernetes' CEL library that admission uses here:
//! the `authorizer` (`authorizer.group(g).resource(r)`, optionally `.subresource(s)`,
//! `.namespace(n)`, `.name(n)`, then `.check(verb)` and `.allowed()`/`.reason()`/`.errored()`),
//! answered by the caller's [`Authorizer`].
//!
//! Objects go in as JSON is read into CEL by kube-apiserver for a schemaless value: objects as
//! maps with string keys, integers as `int` (64-bit), other numbers as `double`, `null` as `null`.

use std::sync::{Arc, LazyLock};

use cel::objects::{Key, Map, Opaque};
use cel::{Context, ExecutionError, Value as Cel};
use serde_json::Value;

/// What an expression gives.
pub use cel::Value as CelValue;

/// An authorizer resource check, evaluated: what the [`Authorizer`] is asked. No namespace is a
/// cluster-wide check.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Check {
    pub group: String,
    pub resource: String,
    pub subresource: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub verb: String,
}

/// Answers the `authorizer` checks of an expression: whether the request's user is allowed.
pub type Authorizer = Arc<dyn Fn(&Check) -> bool + Send + Sync>;

/// Why an expression did not compile or evaluate.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CelError {
    #[error("{0}")]
    Compile(String),
    #[error("{0}")]
    Eval(String),
}

/// The variables admission expressions may name (kube-apiserver declares exactly these; an
/// expression naming another fails to compile there).
const VARIABLES: &[&str] = &[
    "object",
    "oldObject",
    "request",
    "params",
    "namespaceObject",
    "variables",
    "authorizer",
];

/// The standard library with the strings extension (`lowerAscii`, `split`, `replace`, ...), which
/// Kubernetes' CEL environment also has. A repeated key in a map literal keeps its last value, as
/// cel-go (and so kube-apiserver) does.
static ENV: LazyLock<Arc<cel::Env>> = LazyLock::new(|| {
    let mut env = cel::Env::stdlib();
    env.add_extension(cel::extensions::strings)
        .expect("the strings extension declares no standard name");
    env.set_error_on_duplicate_map_keys(false);
    Arc::new(env)
});

/// The member functions of the authorizer library, registered per evaluation.
const AUTHORIZER_FUNCTIONS: &[&str] = &[
    "group",
    "resource",
    "subresource",
    "namespace",
    "name",
    "check",
    "allowed",
    "errored",
    "reason",
];

/// Whether the environment declares function `name`: registering a function of that name in a
/// context of it is refused exactly then.
fn declared(name: &str) -> bool {
    AUTHORIZER_FUNCTIONS.contains(&name)
        || Context::with_env(Arc::clone(&ENV))
            .add_function(name, || false)
            .is_err()
}

/// A compiled expression.
pub struct Program {
    program: cel::Program,
}

impl std::fmt::Debug for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Program").finish_non_exhaustive()
    }
}

/// Parses `src`; refuses names outside the admission environment, as kube-apiserver's type check
/// does.
pub fn compile(src: &str) -> Result<Program, CelError> {
    let program = ENV
        .compile(src)
        .map_err(|e| CelError::Compile(e.to_string()))?;
    let mut free = Vec::new();
    free_variables(program.expression(), &mut Vec::new(), &mut free);
    if let Some(v) = free.into_iter().find(|v| !VARIABLES.contains(&v.as_str())) {
        return Err(CelError::Compile(format!("undeclared reference to '{v}'")));
    }
    // Operators are spelled `_+_`, `!_`, `@in`, ...: only named functions are looked up.
    let refs = program.references();
    if let Some(f) = refs
        .functions()
        .into_iter()
        .filter(|f| f.starts_with(char::is_alphabetic))
        .find(|f| !declared(f))
    {
        return Err(CelError::Compile(format!("undeclared reference to '{f}'")));
    }
    Ok(Program { program })
}

/// The identifiers `e` names that no macro binds (`cel`'s own reference list counts a macro's
/// loop variable too).
fn free_variables(e: &cel::IdedExpr, bound: &mut Vec<String>, out: &mut Vec<String>) {
    use cel::common::ast::{EntryExpr, Expr};
    match &e.expr {
        Expr::Unspecified | Expr::Literal(_) => {}
        Expr::Ident(name) => {
            if !name.starts_with('@') && !bound.contains(name) {
                out.push(name.clone());
            }
        }
        Expr::Call(c) => {
            for x in c.target.as_deref().into_iter().chain(&c.args) {
                free_variables(x, bound, out);
            }
        }
        Expr::Select(s) => free_variables(&s.operand, bound, out),
        Expr::List(l) => {
            for x in &l.elements {
                free_variables(x, bound, out);
            }
        }
        Expr::Map(m) => {
            for entry in &m.entries {
                match &entry.expr {
                    EntryExpr::MapEntry(me) => {
                        free_variables(&me.key, bound, out);
                        free_variables(&me.value, bound, out);
                    }
                    EntryExpr::StructField(f) => free_variables(&f.value, bound, out),
                }
            }
        }
        Expr::Struct(st) => {
            for entry in &st.entries {
                if let EntryExpr::StructField(f) = &entry.expr {
                    free_variables(&f.value, bound, out);
                }
            }
        }
        Expr::Comprehension(c) => {
            free_variables(&c.iter_range, bound, out);
            free_variables(&c.accu_init, bound, out);
            let depth = bound.len();
            bound.push(c.iter_var.clone());
            bound.extend(c.iter_var2.clone());
            bound.push(c.accu_var.clone());
            for x in [&c.loop_cond, &c.loop_step, &c.result] {
                free_variables(x, bound, out);
            }
            bound.truncate(depth);
        }
    }
}

/// The variables an expression is evaluated with.
#[derive(Default, Clone)]
pub struct Bindings {
    vars: Vec<(&'static str, Cel)>,
    authorizer: Option<Authorizer>,
}

impl Bindings {
    /// Binds `name` to a JSON value.
    pub fn json(mut self, name: &'static str, v: &Value) -> Self {
        self.set(name, from_json(v));
        self
    }

    /// Binds (or rebinds) `name` to a CEL value.
    pub fn set(&mut self, name: &'static str, v: Cel) {
        self.vars.retain(|(n, _)| *n != name);
        self.vars.push((name, v));
    }

    /// Makes `authorizer` available, answered by `a`.
    pub fn set_authorizer(&mut self, a: Authorizer) {
        self.authorizer = Some(a);
    }
}

impl Program {
    /// Evaluates the expression.
    pub fn eval(&self, b: &Bindings) -> Result<Cel, CelError> {
        let mut ctx = Context::with_env(Arc::clone(&ENV));
        for (n, v) in &b.vars {
            ctx.add_variable_from_value(*n, v.clone());
        }
        if let Some(a) = &b.authorizer {
            ctx.add_variable_from_value(
                "authorizer",
                Cel::Opaque(Arc::new(Authz::Root(Arc::clone(a)))),
            );
        }
        register_authorizer(&mut ctx);
        self.program
            .execute(&ctx)
            .map_err(|e| CelError::Eval(e.to_string()))
    }

    /// Evaluates the expression, which must give a bool.
    pub fn eval_bool(&self, b: &Bindings) -> Result<bool, CelError> {
        match self.eval(b)? {
            Cel::Bool(v) => Ok(v),
            other => Err(CelError::Eval(format!(
                "expected a bool, got {}",
                type_name(&other)
            ))),
        }
    }
}

/// A JSON value as CEL sees it.
pub fn from_json(v: &Value) -> Cel {
    match v {
        Value::Null => Cel::Null,
        Value::Bool(b) => Cel::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Cel::Int(i),
            (None, Some(u)) => Cel::UInt(u),
            _ => Cel::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => Cel::String(Arc::new(s.clone())),
        Value::Array(a) => Cel::List(Arc::new(a.iter().map(from_json).collect())),
        Value::Object(o) => Cel::Map(Map {
            map: Arc::new(
                o.iter()
                    .map(|(k, v)| (Key::String(Arc::new(k.clone())), from_json(v)))
                    .collect(),
            ),
        }),
    }
}

/// A map of CEL values by name (`variables`).
pub fn map_of(entries: impl IntoIterator<Item = (String, Cel)>) -> Cel {
    Cel::Map(Map {
        map: Arc::new(
            entries
                .into_iter()
                .map(|(k, v)| (Key::String(Arc::new(k)), v))
                .collect(),
        ),
    })
}

fn type_name(v: &Cel) -> &'static str {
    match v {
        Cel::List(_) => "list",
        Cel::Map(_) => "map",
        Cel::Int(_) => "int",
        Cel::UInt(_) => "uint",
        Cel::Float(_) => "double",
        Cel::String(_) => "string",
        Cel::Bytes(_) => "bytes",
        Cel::Bool(_) => "bool",
        Cel::Null => "null_type",
        Cel::Timestamp(_) => "google.protobuf.Timestamp",
        Cel::Duration(_) => "google.protobuf.Duration",
        _ => "dyn",
    }
}

/// The stages of Kubernetes' authorizer library: `authorizer` → `group()` → `resource()`
/// (refined by `subresource()`, `namespace()`, `name()`) → `check()` → a decision.
#[derive(Clone)]
enum Authz {
    Root(Authorizer),
    Group(Authorizer, Check),
    Resource(Authorizer, Check),
    Decision(bool),
}

impl std::fmt::Debug for Authz {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Root(_) => f.write_str("Authorizer"),
            Self::Group(_, c) => write!(f, "GroupCheck({:?})", c.group),
            Self::Resource(_, c) => write!(f, "ResourceCheck({c:?})"),
            Self::Decision(a) => write!(f, "Decision(allowed: {a})"),
        }
    }
}

impl PartialEq for Authz {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Decision(a), Self::Decision(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Authz {}

impl Opaque for Authz {
    fn runtime_type_name(&self) -> &str {
        match self {
            Self::Root(_) => "kubernetes.authorization.Authorizer",
            Self::Group(..) => "kubernetes.authorization.GroupCheck",
            Self::Resource(..) => "kubernetes.authorization.ResourceCheck",
            Self::Decision(_) => "kubernetes.authorization.Decision",
        }
    }
}

fn authz(this: &Arc<dyn Opaque>, method: &str) -> Result<Authz, ExecutionError> {
    this.downcast_ref::<Authz>()
        .cloned()
        .ok_or_else(|| ExecutionError::function_error(method, "no such overload"))
}

fn bad(method: &str) -> ExecutionError {
    ExecutionError::function_error(method, "no such overload")
}

fn opaque(a: Authz) -> Cel {
    Cel::Opaque(Arc::new(a))
}

fn register_authorizer(ctx: &mut Context<'_, '_>) {
    use cel::extractors::This;
    type R = Result<Cel, ExecutionError>;
    // Names the standard library does not declare, so registering them cannot fail.
    let _ = ctx.add_function(
        "group",
        move |This(t): This<Arc<dyn Opaque>>, g: Arc<String>| -> R {
            match authz(&t, "group")? {
                Authz::Root(a) => Ok(opaque(Authz::Group(
                    a,
                    Check {
                        group: g.to_string(),
                        ..Check::default()
                    },
                ))),
                _ => Err(bad("group")),
            }
        },
    );
    let _ = ctx.add_function(
        "resource",
        move |This(t): This<Arc<dyn Opaque>>, r: Arc<String>| -> R {
            match authz(&t, "resource")? {
                Authz::Group(a, mut c) => {
                    c.resource = r.to_string();
                    Ok(opaque(Authz::Resource(a, c)))
                }
                _ => Err(bad("resource")),
            }
        },
    );
    for field in ["subresource", "namespace", "name"] {
        let _ = ctx.add_function(
            field,
            move |This(t): This<Arc<dyn Opaque>>, v: Arc<String>| -> R {
                match authz(&t, field)? {
                    Authz::Resource(a, mut c) => {
                        let slot = match field {
                            "subresource" => &mut c.subresource,
                            "namespace" => &mut c.namespace,
                            _ => &mut c.name,
                        };
                        // An empty string is "not set", as in Kubernetes' library.
                        *slot = (!v.is_empty()).then(|| v.to_string());
                        Ok(opaque(Authz::Resource(a, c)))
                    }
                    _ => Err(bad(field)),
                }
            },
        );
    }
    let _ = ctx.add_function(
        "check",
        move |This(t): This<Arc<dyn Opaque>>, verb: Arc<String>| -> R {
            match authz(&t, "check")? {
                Authz::Resource(a, mut c) => {
                    c.verb = verb.to_string();
                    Ok(opaque(Authz::Decision(a(&c))))
                }
                _ => Err(bad("check")),
            }
        },
    );
    let decision = |m: &'static str, t: &Arc<dyn Opaque>| match authz(t, m)? {
        Authz::Decision(allowed) => Ok(allowed),
        _ => Err(bad(m)),
    };
    let _ = ctx.add_function("allowed", move |This(t): This<Arc<dyn Opaque>>| -> R {
        decision("allowed", &t).map(Cel::Bool)
    });
    let _ = ctx.add_function("errored", move |This(t): This<Arc<dyn Opaque>>| -> R {
        decision("errored", &t).map(|_| Cel::Bool(false))
    });
    let _ = ctx.add_function("reason", move |This(t): This<Arc<dyn Opaque>>| -> R {
        decision("reason", &t).map(|_| Cel::String(Arc::new(String::new())))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(src: &str, obj: Value) -> Result<bool, CelError> {
        compile(src)?.eval_bool(
            &Bindings::default()
                .json("object", &obj)
                .json("oldObject", &Value::Null)
                .json("request", &json!({"operation": "CREATE"})),
        )
    }

    #[test]
    fn standard_cel_evaluates() {
        let tr = json!({"metadata": {"labels": {"a": "1"}}, "spec": {"params": [{"name": "PLATFORM", "value": "linux/arm64"}]}});
        for src in [
            "object.spec.params.exists(p, p.name == 'PLATFORM')",
            "has(object.metadata.labels) && 'a' in object.metadata.labels",
            "!has(object.metadata.annotations)",
            "request.operation == \"CREATE\" || request.operation == 'UPDATE'",
            "object.spec.params.all(p, p.value.startsWith('linux/'))",
            "!(size(object.spec.params) > 1 ? true : false)",
            "object.metadata.labels['a'] == '1'",
            "object.x.y == 1 || true",
        ] {
            assert_eq!(ev(src, tr.clone()), Ok(true), "{src}");
        }
        // Errors are absorbed by a deciding || side, and surface otherwise.
        assert!(ev("has(object.x) || object.x.y == 1", tr).is_err());
    }

    #[test]
    fn policy_functions_evaluate() {
        let tr = json!({"metadata": {"creationTimestamp": "2026-01-02T03:04:05Z",
            "annotations": {"t": "1767323045", "x": "abc"}}});
        for src in [
            "int(object.metadata.annotations['t']) == int(timestamp(object.metadata.creationTimestamp))",
            "int(object.metadata.annotations['t']) - 300 < int(timestamp(object.metadata.creationTimestamp)) + 1",
            "object.metadata.annotations['t'].matches('^[0-9]{1,12}$') && !object.metadata.annotations['x'].matches('^[0-9]+$')",
            "(has(object.metadata.labels) ? object.metadata.labels : {}) == {} && {'a': 1}['a'] == 1",
            "size([1] + [2, 3]) == 3 && 'a' + 'b' == 'ab'",
            "string(12) == '12'",
        ] {
            assert_eq!(ev(src, tr.clone()), Ok(true), "{src}");
        }
        assert!(ev("int(object.metadata.annotations['x']) > 0", tr.clone()).is_err());
        assert!(ev("timestamp('yesterday') == timestamp('yesterday')", tr).is_err());
    }

    #[test]
    fn values_are_cel_values() {
        let o = json!({"n": null, "big": 9007199254740993_i64, "l": [1]});
        for src in [
            "has(object.n) && object.n == null",
            "object.big != 9007199254740992 && object.big > 9007199254740992",
            r"'\x41\u0041\101' == 'AAA' && size('\n') == 1",
        ] {
            assert_eq!(ev(src, o.clone()), Ok(true), "{src}");
        }
        assert_eq!(ev("{'a': 1, 'a': 2}.a == 2", o.clone()), Ok(true));
        for src in ["has(object.l.a)", "1 + 1.0 == 2.0"] {
            assert!(ev(src, o.clone()).is_err(), "{src}");
        }
    }

    #[test]
    fn authorizer_checks_are_asked_of_the_caller() {
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = Arc::clone(&asked);
        let authorize: Authorizer = Arc::new(move |c: &Check| {
            log.lock().unwrap().push(c.clone());
            c.verb == "approve"
        });
        let mut vars = Bindings::default().json("request", &json!({"namespace": "ns"}));
        vars.set_authorizer(authorize);
        let ev = |src: &str| compile(src).unwrap().eval(&vars);
        assert_eq!(
            ev("authorizer.group('tekton.dev').resource('taskruns').check('approve').allowed()"),
            Ok(Cel::Bool(true))
        );
        assert_eq!(
            ev(
                "authorizer.group('').resource('pods').subresource('log').namespace(request.namespace).name('p').check('get').allowed() || false"
            ),
            Ok(Cel::Bool(false))
        );
        assert_eq!(
            asked.lock().unwrap().clone(),
            [
                Check {
                    group: "tekton.dev".into(),
                    resource: "taskruns".into(),
                    verb: "approve".into(),
                    ..Check::default()
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
        assert!(ev("authorizer.resource('pods')").is_err());
        // Without an authorizer (webhook matchConditions here), using it fails.
        let e = compile("authorizer.group('').resource('pods').check('get').allowed()").unwrap();
        assert!(e.eval(&Bindings::default()).is_err());
    }

    #[test]
    fn bad_expressions_are_refused_at_compile() {
        assert!(compile("'a' ==").is_err());
        assert!(compile("self.x == 1").is_err());
        assert!(compile("object.metadata.name.noSuchFunction()").is_err());
        assert!(compile("object.metadata.name.lowerAscii() == 'a'").is_ok());
        assert!(compile("[1].all(x, x > 0) && object.y").is_ok());
    }
}
