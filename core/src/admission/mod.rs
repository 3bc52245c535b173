//! The TaskRun mutating admission webhook, as a pure function: AdmissionReview request bytes, the
//! live [`HostConfig`] and the current time in, AdmissionReview response bytes out
//! (docs/architecture.md, "One TaskRun, end to end" and §2).
//!
//! - local platform: label `target-platform` and, for `os/arch` platforms, a required node
//!   affinity on `kubernetes.io/os` and `kubernetes.io/arch` merged into every node selector term;
//! - remote platform (dynamic, dynamic pool, static, or configured but disabled by a config error):
//!   label `target-platform`, the finalizer, annotation `allocation-start-time` (replacing the
//!   creator's, which would order the queue), and `spec.status: TaskRunPending` when
//!   `gate-pending` is set;
//! - unknown or malformed platform: marked like a remote one so the scheduler writes an `error`
//!   secret explaining the problem, or denied with 422 when `reject-unknown-platforms` is set;
//! - every TaskRun: the labels and annotations only the controller writes (`assigned-host`,
//!   `waiting-for-platform`, `failed-hosts`, `cloud-instance-id`, `cloud-address`) are removed.
//!   Tenants write TaskRun metadata (through a pipeline task's metadata too), so at creation these
//!   can only be forged: recovery would rebuild allocations from them;
//! - an ignored TaskRun (left without `target-platform`): the finalizer is removed, which only
//!   the controller may remove later and which it would never see without the label.
//!
//! The target-platform label value is the platform with `/` → `-` when that is a valid Kubernetes
//! label value, else [`INVALID_PLATFORM_LABEL`] (the API server would reject the TaskRun otherwise;
//! the scheduler reads the platform from the `PLATFORM` param, the label is only its selector).
//!
//! Two entry points apply the same rules. [`review`] is the webhook: it reads an AdmissionReview,
//! lets anything that is not a TaskRun CREATE through unmarked, and encodes the response.
//! [`decide`] is the decision alone, for a caller that already holds a TaskRun (the controller's
//! safety net for TaskRuns the webhook missed): a [`TaskRunView`] read from the TaskRun's JSON, the
//! config and the time in; a typed [`Decided`] out, whose [`Decided::patch`] is exactly the JSON
//! Patch [`review`] would send for a CREATE of that TaskRun (none when denied), in the same order.
//! Neither reads anything else or has side effects.

mod patch;
mod wire;

#[cfg(test)]
mod tests;

use std::fmt::Write as _;

use base64::Engine as _;
use serde::Serialize;

use crate::config::{HostConfig, Strategy};
use crate::contract;
use crate::jsonpatch::{self, PatchOp};
use crate::platform::{self, Platform, PlatformValue, label_value};

use wire::{Obj, ObjectIn, RequestIn, ReviewIn, SpecIn, TaskRunIn};

/// `target-platform` value for a platform whose label form is not a valid label value (arrays,
/// spaces, over 63 characters). The underscore keeps it distinct from every valid platform's label.
pub const INVALID_PLATFORM_LABEL: &str = "invalid_platform";

/// `spec.status` value that keeps Tekton from creating the pod (Tekton ≥ 1.11).
pub const PENDING_STATUS: &str = "TaskRunPending";

/// Why a request was let through unmarked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoreReason {
    /// Not a `tekton.dev` v1/v1beta1 TaskRun.
    NotTaskRun,
    /// An operation other than CREATE.
    NotCreate,
    /// Labelled `build.appstudio.redhat.com/task-type`: an internal TaskRun.
    Internal,
    /// No `PLATFORM` param (nor an inline Task default for it).
    NoPlatform,
    /// An inline Task that mounts no `multi-platform-ssh-*` secret.
    NoSecretVolume,
}

/// What the webhook decided for one request; [`Decision::outcome`] is the metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Local platform: pinned to matching nodes.
    Local,
    /// Remote platform: marked for allocation.
    Remote,
    /// Unknown or malformed platform: allowed and marked, so the scheduler writes an error secret.
    Unknown,
    /// Unknown or malformed platform denied (`reject-unknown-platforms`).
    Denied,
    /// Allowed unmarked (only controller-only keys a creator sent are removed).
    Ignored(IgnoreReason),
}

impl Decision {
    /// Every [`Decision::outcome`] value, for pre-registering metric label sets.
    pub const OUTCOMES: [&'static str; 5] = ["local", "remote", "unknown", "denied", "ignored"];

    /// Bounded metric label: `local`, `remote`, `unknown`, `denied` or `ignored`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Decision::Local => "local",
            Decision::Remote => "remote",
            Decision::Unknown => "unknown",
            Decision::Denied => "denied",
            Decision::Ignored(_) => "ignored",
        }
    }
}

/// A request the webhook could not read: the server answers HTTP 400 with this message.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// Not UTF-8, so not JSON (RFC 8259), wherever the bad bytes are.
    #[error("malformed AdmissionReview: not UTF-8: {0}")]
    NotUtf8(#[from] std::str::Utf8Error),
    /// Not JSON, or JSON of the wrong shape.
    #[error("malformed AdmissionReview: {0}")]
    Json(#[from] serde_json::Error),
    /// `kind` is not `AdmissionReview` or `apiVersion` not `admission.k8s.io/...`.
    #[error(
        "not an AdmissionReview: expected apiVersion admission.k8s.io/v1 and kind AdmissionReview, got apiVersion {api_version:?} and kind {kind:?}"
    )]
    NotAdmissionReview {
        /// `apiVersion` as received.
        api_version: String,
        /// `kind` as received.
        kind: String,
    },
    /// A required field is missing.
    #[error("malformed AdmissionReview: {0} is missing")]
    Missing(&'static str),
}

/// A decided request: the response to send and what to log and count.
#[derive(Debug, Clone)]
pub struct Reviewed {
    pub decision: Decision,
    /// AdmissionReview response JSON.
    pub response: Vec<u8>,
    /// JSON Patch operations in the response (0 when nothing changes).
    pub patch_ops: usize,
    /// `request.namespace`.
    pub namespace: String,
    /// `request.name` (empty when the API server has not generated it yet).
    pub name: String,
    /// `request.uid`, which names this review.
    pub review_uid: String,
    /// The TaskRun's `metadata.uid`, when it has one: never in a CREATE from the API server,
    /// which assigns it after mutating admission.
    pub uid: Option<String>,
    /// The `PLATFORM` value as received, when there is one (JSON text when not a string).
    pub platform: Option<String>,
}

/// A TaskRun as the webhook reads it: only the fields a decision looks at, borrowed from its JSON.
pub struct TaskRunView<'a>(TaskRunIn<'a>);

impl<'a> TaskRunView<'a> {
    /// Reads a TaskRun object (`metadata`, `spec`; other fields are skipped).
    pub fn from_json(json: &'a str) -> Result<Self, AdmissionError> {
        Ok(Self(serde_json::from_str::<Obj<TaskRunIn<'a>>>(json)?.0))
    }
}

/// What [`decide`] concluded for a CREATE of one TaskRun.
#[derive(Debug, Clone)]
pub struct Decided {
    pub decision: Decision,
    /// The JSON Patch [`review`] would send, in application order; empty when nothing changes
    /// and when denied.
    pub patch: Vec<PatchOp>,
    /// Warnings [`review`] would send to the creator.
    pub warnings: Vec<String>,
    /// The denial message, `Some` exactly when the decision is [`Decision::Denied`].
    pub denial: Option<String>,
    /// The `PLATFORM` value as received, when there is one (JSON text when not a string,
    /// truncated for logs).
    pub platform: Option<String>,
}

/// Decides a CREATE of `taskrun` by the webhook's rules (see the module doc). `now_unix`
/// (seconds) stamps `allocation-start-time`.
pub fn decide(taskrun: &TaskRunView<'_>, config: &HostConfig, now_unix: u64) -> Decided {
    let mut platform = None;
    let (decision, verdict) = judge(&taskrun.0, config, now_unix, &mut platform);
    let (patch, warnings, denial) = match verdict {
        Verdict::Patch(ops, warnings) => (ops.into_ops(), warnings, None),
        Verdict::Deny(message) => (Vec::new(), Vec::new(), Some(message)),
    };
    Decided {
        decision,
        patch,
        warnings,
        denial,
        platform,
    }
}

/// Reviews one AdmissionReview request. `now_unix` (seconds) stamps `allocation-start-time`.
pub fn review(body: &[u8], config: &HostConfig, now_unix: u64) -> Result<Reviewed, AdmissionError> {
    // The parser checks the UTF-8 of the strings it reads but not of those it skips (fields the
    // webhook ignores), so the whole body is checked once here; parsing a `str` then checks no
    // string twice.
    let body = std::str::from_utf8(body)?;
    let review = match serde_json::from_str::<ReviewIn<'_, true>>(body) {
        Ok(r) => r,
        // An object read before `kind`/`operation` that is no TaskRun view (or a malformed
        // body): parse again lazily, which also gives the error for a malformed one.
        Err(_) => lazy(serde_json::from_str::<ReviewIn<'_, false>>(body)?),
    };
    let api_version = review.api_version.as_deref().unwrap_or("");
    let kind = review.kind.as_deref().unwrap_or("");
    if !api_version.starts_with("admission.k8s.io/") || kind != "AdmissionReview" {
        return Err(AdmissionError::NotAdmissionReview {
            api_version: api_version.to_owned(),
            kind: kind.to_owned(),
        });
    }
    let request = review.request.ok_or(AdmissionError::Missing("request"))?;
    let uid = request.uid.ok_or(AdmissionError::Missing("request.uid"))?;
    let gvk = request
        .kind
        .ok_or(AdmissionError::Missing("request.kind"))?;
    let operation = request
        .operation
        .ok_or(AdmissionError::Missing("request.operation"))?;

    let mut out = Reviewed {
        decision: Decision::Ignored(IgnoreReason::NotTaskRun),
        response: Vec::new(),
        patch_ops: 0,
        namespace: request.namespace.as_deref().unwrap_or("").to_owned(),
        name: request.name.as_deref().unwrap_or("").to_owned(),
        review_uid: (*uid).to_owned(),
        uid: None,
        platform: None,
    };
    let respond = |out: &mut Reviewed, r: Response| {
        out.response = r.encode(api_version, &uid);
    };

    if !gvk.is_taskrun() {
        respond(&mut out, Response::allow());
        return Ok(out);
    }
    if &*operation != "CREATE" {
        out.decision = Decision::Ignored(IgnoreReason::NotCreate);
        respond(&mut out, Response::allow());
        return Ok(out);
    }
    // The object was parsed in the first pass unless it came before `kind`/`operation`.
    let parsed_late;
    let taskrun: &TaskRunIn<'_> = match &request.object {
        ObjectIn::TaskRun(t) => &t.0,
        ObjectIn::Raw(raw) => {
            parsed_late = serde_json::from_str::<Obj<TaskRunIn<'_>>>(raw.get())?;
            &parsed_late.0
        }
        ObjectIn::Absent | ObjectIn::Skipped => {
            return Err(AdmissionError::Missing("request.object"));
        }
    };

    out.uid = taskrun
        .metadata
        .as_ref()
        .and_then(|m| m.0.uid.as_deref())
        .map(str::to_owned);
    let (decision, verdict) = judge(taskrun, config, now_unix, &mut out.platform);
    let response = match verdict {
        Verdict::Patch(ops, warnings) => Response::patch(&ops, warnings),
        Verdict::Deny(message) => Response::deny(message),
    };
    out.decision = decision;
    out.patch_ops = response.patch_ops;
    respond(&mut out, response);
    Ok(out)
}

/// A lazily parsed review in the eager type (its object may be captured raw).
fn lazy(r: ReviewIn<'_, false>) -> ReviewIn<'_, true> {
    ReviewIn {
        api_version: r.api_version,
        kind: r.kind,
        request: r.request.map(|q| RequestIn {
            uid: q.uid,
            kind: q.kind,
            operation: q.operation,
            namespace: q.namespace,
            name: q.name,
            object: q.object,
        }),
    }
}

/// The `PLATFORM` value, by the reading the controller shares ([`platform::requested`]); only the
/// inline Task's default is there to see at CREATE.
fn platform_value<'a>(spec: &'a SpecIn<'_>) -> Option<PlatformValue<'a>> {
    let params = spec.params.as_deref().unwrap_or_default();
    let inline = spec.task_spec.as_ref().map(|ts| {
        let ps = ts.params.as_deref().unwrap_or_default();
        ps.iter().map(|p| (&*p.name, p.default))
    });
    platform::requested(params.iter().map(|p| (&*p.name, p.value)), inline)
}

/// How the platform resolved.
enum Resolved<'c> {
    Local(Platform),
    Remote(Platform, Strategy<'c>),
    Unknown(Platform),
    Malformed(String),
}

/// What a decision does to the request (the patch is built once and either encoded straight
/// into a response or handed out as typed operations).
enum Verdict {
    Patch(jsonpatch::Patch, Vec<String>),
    Deny(String),
}

fn judge(
    taskrun: &TaskRunIn<'_>,
    config: &HostConfig,
    now_unix: u64,
    platform_out: &mut Option<String>,
) -> (Decision, Verdict) {
    let meta = taskrun.metadata.as_deref();
    // Whatever the decision: a TaskRun the controller ignores today is still read by recovery
    // if its creator also labels it as ours.
    let mut ops = jsonpatch::Patch::default();
    patch::strip_controller_keys(&mut ops, meta);
    // An ignored TaskRun gets no label, so it may not keep our finalizer either.
    let ignore = |why, mut ops| {
        patch::strip_unearned_finalizer(&mut ops, meta);
        (Decision::Ignored(why), Verdict::Patch(ops, Vec::new()))
    };
    if meta
        .and_then(|m| m.labels.as_ref())
        .and_then(|l| l.get(contract::TASK_TYPE_LABEL))
        .is_some()
    {
        return ignore(IgnoreReason::Internal, ops);
    }
    let default_spec = SpecIn::default();
    let spec = taskrun.spec.as_deref().unwrap_or(&default_spec);
    let Some(value) = platform_value(spec) else {
        return ignore(IgnoreReason::NoPlatform, ops);
    };
    // A taskRef TaskRun shows no volumes at CREATE, so only an inline Task can rule itself out.
    if let Some(ts) = &spec.task_spec
        && !ts
            .volumes
            .as_deref()
            .unwrap_or_default()
            .iter()
            .any(|v| v.is_ssh_secret())
    {
        return ignore(IgnoreReason::NoSecretVolume, ops);
    }

    let resolved = match &value {
        PlatformValue::Text(s) => {
            *platform_out = Some(truncated(s, 128));
            match Platform::parse(s) {
                Ok(p) => match config.resolve(&p) {
                    Strategy::Local => Resolved::Local(p),
                    Strategy::Unknown => Resolved::Unknown(p),
                    other => Resolved::Remote(p, other),
                },
                Err(e) => Resolved::Malformed(format!("PLATFORM {:?} is invalid: {e}", &**s)),
            }
        }
        PlatformValue::NotString(v) => {
            *platform_out = Some(truncated(&value.text(), 128));
            Resolved::Malformed(format!(
                "PLATFORM must be a string such as \"linux/arm64\", got {}",
                json_type(v)
            ))
        }
    };

    let mut warnings = Vec::new();
    let remote_marks = |label: &str, ops: &mut jsonpatch::Patch| {
        let marks = patch::RemoteMarks {
            label,
            now_unix,
            gate_pending: config.gate_pending,
        };
        patch::remote(ops, meta, spec, &marks);
    };
    let decision = match resolved {
        Resolved::Local(p) => {
            patch::local(
                &mut ops,
                meta,
                spec,
                p.node_os_arch(),
                &target_label_value(p.as_str()),
            );
            Decision::Local
        }
        Resolved::Remote(p, strategy) => {
            if let Strategy::Disabled(reason) = strategy {
                warnings.push(format!(
                    "platform {p} is disabled by a host-config error ({reason}); this build will fail with that message"
                ));
            }
            remote_marks(&target_label_value(p.as_str()), &mut ops);
            Decision::Remote
        }
        Resolved::Unknown(p) => {
            let why = format!(
                "platform {p} is not configured on this cluster (configured: {})",
                configured_list(config)
            );
            if config.reject_unknown_platforms {
                return (Decision::Denied, Verdict::Deny(why));
            }
            warnings.push(format!("{why}; this build will fail with that message"));
            remote_marks(&target_label_value(p.as_str()), &mut ops);
            Decision::Unknown
        }
        Resolved::Malformed(why) => {
            if config.reject_unknown_platforms {
                return (Decision::Denied, Verdict::Deny(why));
            }
            let label = match &value {
                PlatformValue::Text(s) => target_label_value(s),
                PlatformValue::NotString(_) => INVALID_PLATFORM_LABEL.to_owned(),
            };
            warnings.push(format!("{why}; this build will fail with that message"));
            remote_marks(&label, &mut ops);
            Decision::Unknown
        }
    };
    (decision, Verdict::Patch(ops, warnings))
}

/// The `target-platform` label value for a platform string: `/` → `-` when that is a valid label
/// value, else [`INVALID_PLATFORM_LABEL`].
pub fn target_label_value(platform: &str) -> String {
    let v = label_value(platform);
    if is_label_value(&v) {
        v
    } else {
        INVALID_PLATFORM_LABEL.to_owned()
    }
}

/// A non-empty Kubernetes label value: at most 63 of `[A-Za-z0-9_.-]`, alphanumeric at both ends.
pub fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// At most `max` bytes of `s` (on a char boundary), for logs.
fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

fn json_type(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
        Value::String(_) => "a string",
        Value::Bool(_) => "a boolean",
        Value::Null => "null",
        Value::Number(_) => "a number",
    }
}

/// Served platforms for messages, capped so a large config cannot blow up a response.
fn configured_list(config: &HostConfig) -> String {
    const SHOWN: usize = 20;
    let served: Vec<_> = config
        .platforms()
        .into_iter()
        .filter(|p| !config.disabled.contains_key(*p))
        .collect();
    if served.is_empty() {
        return "none".into();
    }
    let mut s = String::new();
    for (i, p) in served.iter().take(SHOWN).enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(p.as_str());
    }
    if served.len() > SHOWN {
        let _ = write!(s, " and {} more", served.len() - SHOWN);
    }
    s
}

/// An AdmissionResponse before encoding.
struct Response {
    allowed: bool,
    /// The JSON Patch document (base64-encoded straight into the response).
    patch: Option<Vec<u8>>,
    patch_ops: usize,
    status: Option<StatusOut>,
    warnings: Vec<String>,
}

impl Response {
    fn allow() -> Self {
        Self {
            allowed: true,
            patch: None,
            patch_ops: 0,
            status: None,
            warnings: Vec::new(),
        }
    }

    fn patch(ops: &jsonpatch::Patch, warnings: Vec<String>) -> Self {
        let mut r = Self::allow();
        r.warnings = warnings;
        if !ops.is_empty() {
            r.patch = Some(ops.to_json());
            r.patch_ops = ops.len();
        }
        r
    }

    fn deny(message: String) -> Self {
        Self {
            allowed: false,
            patch: None,
            patch_ops: 0,
            status: Some(StatusOut {
                status: "Failure",
                code: 422,
                reason: "Invalid",
                message,
            }),
            warnings: Vec::new(),
        }
    }

    /// The AdmissionReview JSON. Written by hand around the fixed keys: the base64 patch goes
    /// straight into the buffer instead of through a string serialiser's escape scan (base64
    /// needs no escaping), which was a visible share of each request under load.
    fn encode(self, api_version: &str, uid: &str) -> Vec<u8> {
        use base64::engine::general_purpose::STANDARD;
        let patch_len = self
            .patch
            .as_ref()
            .map_or(0, |p| base64::encoded_len(p.len(), true).unwrap_or(0));
        let mut out = Vec::with_capacity(160 + api_version.len() + uid.len() + patch_len);
        out.extend_from_slice(b"{\"apiVersion\":");
        json_string(&mut out, api_version);
        out.extend_from_slice(b",\"kind\":\"AdmissionReview\",\"response\":{\"uid\":");
        json_string(&mut out, uid);
        out.extend_from_slice(if self.allowed {
            b",\"allowed\":true"
        } else {
            b",\"allowed\":false"
        });
        if let Some(patch) = &self.patch {
            out.extend_from_slice(b",\"patchType\":\"JSONPatch\",\"patch\":\"");
            let start = out.len();
            out.resize(start + patch_len, 0);
            let written = STANDARD.encode_slice(patch, &mut out[start..]).unwrap_or(0);
            out.truncate(start + written);
            out.push(b'"');
        }
        // Denials and warnings are rare: plain serialisation (of strings and numbers, which
        // cannot fail).
        if let Some(status) = &self.status {
            out.extend_from_slice(b",\"status\":");
            let _ = serde_json::to_writer(&mut out, status);
        }
        if !self.warnings.is_empty() {
            out.extend_from_slice(b",\"warnings\":");
            let _ = serde_json::to_writer(&mut out, &self.warnings);
        }
        out.extend_from_slice(b"}}");
        out
    }
}

/// Appends `s` as a JSON string.
fn json_string(out: &mut Vec<u8>, s: &str) {
    // Writing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// A `metav1.Status` for denials.
#[derive(Serialize)]
struct StatusOut {
    status: &'static str,
    code: u16,
    reason: &'static str,
    message: String,
}
