//! JSON Patch (RFC 6902) operations built against the received TaskRun, with the builder the
//! controller's writes share ([`crate::jsonpatch`]).
//!
//! `add` goes only onto parents that exist in the received object: a missing (or null) parent is
//! created whole, with our values inside. On an existing object member `add` replaces the value,
//! which is what we want for labels we own. `remove` takes out the controller-only keys a creator
//! sent. Every operation is skipped when the object already holds what it would write, so a second
//! call on the patched object yields no operations.

use serde_json::{Value, json};

use super::wire::{MetadataIn, NodeSelectorTermIn, PodTemplateIn, SpecIn};
use crate::contract;
use crate::jsonpatch::{Patch, escape_pointer_token};

/// How old an `allocation-start-time` may be and still be kept: one this webhook wrote moments
/// ago, seen again when the API server reinvokes it within the same request (webhooks run one
/// after another, each bounded by its timeout of at most 30 s). Any other value is the creator's
/// and is replaced. (The scheduler also never orders a TaskRun before its creation time.)
pub(super) const REINVOCATION_WINDOW_SECS: u64 = 300;

/// Removes the labels and annotations only the controller writes ([`contract::CONTROLLER_ONLY_LABELS`],
/// [`contract::CONTROLLER_ONLY_ANNOTATIONS`]): at creation they can only come from the creator,
/// and recovery would otherwise rebuild an allocation from them.
pub(super) fn strip_controller_keys(patch: &mut Patch, meta: Option<&MetadataIn<'_>>) {
    let Some(meta) = meta else { return };
    if let Some(labels) = &meta.labels {
        for key in contract::CONTROLLER_ONLY_LABELS {
            if labels.get(key).is_some() {
                patch.remove(format!("/metadata/labels/{}", escape_pointer_token(key)));
            }
        }
    }
    if let Some(annotations) = &meta.annotations {
        for key in contract::CONTROLLER_ONLY_ANNOTATIONS {
            if annotations.get(key).is_some() {
                patch.remove(format!(
                    "/metadata/annotations/{}",
                    escape_pointer_token(key)
                ));
            }
        }
    }
}

/// Removes our finalizer from a TaskRun left without the `target-platform` label: the controller
/// finds the TaskRuns whose finalizer it removes by that label, and nobody else may remove it
/// (manifests/taskrun-policy.yaml), so such a TaskRun could never be deleted. Every occurrence,
/// last first, so earlier indices stay valid.
pub(super) fn strip_unearned_finalizer(patch: &mut Patch, meta: Option<&MetadataIn<'_>>) {
    let Some(meta) = meta else { return };
    let labelled = meta
        .labels
        .as_ref()
        .is_some_and(|l| l.get(contract::TARGET_PLATFORM_LABEL).is_some());
    if labelled {
        return;
    }
    for (i, f) in meta
        .finalizers
        .as_deref()
        .unwrap_or_default()
        .iter()
        .enumerate()
        .rev()
    {
        if &**f == contract::FINALIZER {
            patch.remove_finalizer_at(i, false);
        }
    }
}

/// What a remote (or unknown) platform's TaskRun must carry.
pub(super) struct RemoteMarks<'a> {
    /// `target-platform` label value.
    pub label: &'a str,
    /// `allocation-start-time` value (unix seconds), unless a recent one is kept.
    pub now_unix: u64,
    /// Set `spec.status: TaskRunPending` when unset.
    pub gate_pending: bool,
}

/// Ensures `metadata` exists; returns the view to use (empty when it was just created).
fn metadata<'m, 'a>(
    patch: &mut Patch,
    meta: Option<&'m MetadataIn<'a>>,
    empty: &'m MetadataIn<'a>,
) -> &'m MetadataIn<'a> {
    match meta {
        Some(m) => m,
        None => {
            patch.add("/metadata", json!({}));
            empty
        }
    }
}

/// Label, finalizer, allocation start time and (optionally) the pending gate.
pub(super) fn remote(
    patch: &mut Patch,
    meta: Option<&MetadataIn<'_>>,
    spec: &SpecIn<'_>,
    marks: &RemoteMarks<'_>,
) {
    let empty = MetadataIn::default();
    let meta = metadata(patch, meta, &empty);

    let labels = meta.labels.as_ref();
    if labels.and_then(|l| l.get(contract::TARGET_PLATFORM_LABEL)) != Some(marks.label) {
        patch.set_entry(
            "/metadata/labels",
            labels.is_some(),
            contract::TARGET_PLATFORM_LABEL,
            marks.label,
        );
    }

    patch.add_finalizer(
        meta.finalizers
            .as_deref()
            .map(|list| list.iter().map(|f| &**f)),
    );

    // The creator's value would order the queue: replaced, unless this webhook wrote it moments
    // ago (a reinvocation), so allocation time is measured from the first admission.
    let annotations = meta.annotations.as_ref();
    let ours = annotations
        .and_then(|a| a.get(contract::ALLOCATION_START_TIME_ANNOTATION))
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|t| t <= marks.now_unix && marks.now_unix - t <= REINVOCATION_WINDOW_SECS);
    if !ours {
        patch.set_entry(
            "/metadata/annotations",
            annotations.is_some(),
            contract::ALLOCATION_START_TIME_ANNOTATION,
            &marks.now_unix.to_string(),
        );
    }

    if marks.gate_pending && spec.status.is_none() {
        patch.add("/spec/status", json!("TaskRunPending"));
    }
}

/// `target-platform=<label>` and, unless `os_arch` is `None` (bare names), a required node
/// affinity for `kubernetes.io/os` and `kubernetes.io/arch`.
pub(super) fn local(
    patch: &mut Patch,
    meta: Option<&MetadataIn<'_>>,
    spec: &SpecIn<'_>,
    os_arch: Option<(&str, &str)>,
    label: &str,
) {
    let empty = MetadataIn::default();
    let meta = metadata(patch, meta, &empty);
    let labels = meta.labels.as_ref();
    // The controller watches this label; it writes the `host: localhost` secret and labels
    // `assigned-host=localhost` (docs/architecture.md, "One TaskRun, end to end").
    if labels.and_then(|l| l.get(contract::TARGET_PLATFORM_LABEL)) != Some(label) {
        patch.set_entry(
            "/metadata/labels",
            labels.is_some(),
            contract::TARGET_PLATFORM_LABEL,
            label,
        );
    }
    if let Some((os, arch)) = os_arch {
        node_affinity(patch, spec.pod_template.as_deref(), os, arch);
    }
}

const OS_KEY: &str = "kubernetes.io/os";
const ARCH_KEY: &str = "kubernetes.io/arch";

fn requirement(key: &str, value: &str) -> Value {
    json!({ "key": key, "operator": "In", "values": [value] })
}

/// Merges `os`/`arch` requirements into every non-empty node selector term (terms are ORed, so
/// each must carry them), or adds a term when there is none, creating missing parents.
fn node_affinity(
    patch: &mut Patch,
    pod_template: Option<&PodTemplateIn<'_>>,
    os: &str,
    arch: &str,
) {
    let ours = || json!([requirement(OS_KEY, os), requirement(ARCH_KEY, arch)]);
    let term = || json!({ "matchExpressions": ours() });
    let selector = || json!({ "nodeSelectorTerms": [term()] });
    let node_affinity = || json!({ "requiredDuringSchedulingIgnoredDuringExecution": selector() });

    let Some(pt) = pod_template else {
        patch.add(
            "/spec/podTemplate",
            json!({ "affinity": { "nodeAffinity": node_affinity() } }),
        );
        return;
    };
    let Some(affinity) = &pt.affinity else {
        patch.add(
            "/spec/podTemplate/affinity",
            json!({ "nodeAffinity": node_affinity() }),
        );
        return;
    };
    let base = "/spec/podTemplate/affinity/nodeAffinity";
    let Some(na) = &affinity.node_affinity else {
        patch.add(base, node_affinity());
        return;
    };
    let base = format!("{base}/requiredDuringSchedulingIgnoredDuringExecution");
    let Some(required) = &na.required else {
        patch.add(base, selector());
        return;
    };
    let base = format!("{base}/nodeSelectorTerms");
    let Some(terms) = &required.terms else {
        patch.add(base, json!([term()]));
        return;
    };
    let mut merged_any = false;
    for (i, t) in terms.iter().enumerate() {
        if t.is_empty() {
            continue;
        }
        merged_any = true;
        merge_term(patch, &format!("{base}/{i}/matchExpressions"), t, os, arch);
    }
    if !merged_any {
        patch.add(format!("{base}/-"), term());
    }
}

fn merge_term(patch: &mut Patch, path: &str, term: &NodeSelectorTermIn<'_>, os: &str, arch: &str) {
    let missing: Vec<Value> = [(OS_KEY, os), (ARCH_KEY, arch)]
        .into_iter()
        .filter(|(k, v)| !term.requires(k, v))
        .map(|(k, v)| requirement(k, v))
        .collect();
    if missing.is_empty() {
        return;
    }
    if term.match_expressions.is_some() {
        for m in missing {
            patch.add(format!("{path}/-"), m);
        }
    } else {
        patch.add(path.to_owned(), Value::Array(missing));
    }
}
