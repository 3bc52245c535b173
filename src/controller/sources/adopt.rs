//! The safety net for TaskRuns the webhook missed (down, `failurePolicy: Ignore`): a slow scan
//! of unlabelled TaskRuns that marks the ones needing a host exactly as the webhook would have
//! (docs/architecture.md, "One TaskRun, end to end"). The decision and the marks come from the
//! webhook's own rules ([`crate::admission::decide`] on the listed TaskRun), so both apply one set
//! of detection rules; only metadata is written (a started TaskRun's spec is immutable).

use std::time::Duration;

use kube::api::{Api, DynamicObject, ListParams};
use serde_json::Value;
use tracing::Instrument;

use crate::admission::{self, Decision, TaskRunView};
use crate::config::HostConfig;
use crate::controller::execute::Context;
use crate::controller::patch::{self, TaskRunPatch};
use crate::jsonpatch::PatchOp;

/// The JSON Patch that marks a missed TaskRun (labels, finalizer, `allocation-start-time`),
/// guarded by its UID and resourceVersion; `None` when it needs nothing (finished, not a
/// multi-platform TaskRun, or already marked).
pub fn adoption_patch(taskrun: &Value, config: &HostConfig, now_unix: u64) -> Option<TaskRunPatch> {
    let meta = &taskrun["metadata"];
    let (uid, rv) = (meta["uid"].as_str()?, meta["resourceVersion"].as_str()?);
    let finished = taskrun["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Succeeded" && (c["status"] == "True" || c["status"] == "False"));
    if finished || !meta["deletionTimestamp"].is_null() {
        return None;
    }
    let text = serde_json::to_string(taskrun).ok()?;
    let decided = admission::decide(&TaskRunView::from_json(&text).ok()?, config, now_unix);
    if !matches!(
        decided.decision,
        Decision::Local | Decision::Remote | Decision::Unknown
    ) {
        return None;
    }
    let marks: Vec<PatchOp> = decided
        .patch
        .into_iter()
        .filter(|op| op.path().starts_with("/metadata/"))
        .collect();
    (!marks.is_empty()).then(|| patch::adoption(uid, rv, marks))
}

/// TaskRuns listed per page (whole objects: kept small).
const PAGE: u32 = 100;

/// One scan over every TaskRun without our label; returns how many were marked.
pub async fn scan(ctx: &Context, config: &HostConfig) -> Result<usize, kube::Error> {
    let api: Api<DynamicObject> = Api::all_with(
        ctx.client.clone(),
        &kube::core::ApiResource {
            group: "tekton.dev".into(),
            version: "v1".into(),
            api_version: "tekton.dev/v1".into(),
            kind: "TaskRun".into(),
            plural: "taskruns".into(),
        },
    );
    let selector = format!(
        "!{},!{}",
        crate::contract::TARGET_PLATFORM_LABEL,
        crate::contract::TASK_TYPE_LABEL
    );
    let mut params = ListParams::default().labels(&selector).limit(PAGE);
    let mut marked = 0;
    loop {
        let page = api.list(&params).await?;
        let now = super::now().as_secs();
        for obj in &page.items {
            let Ok(v) = serde_json::to_value(obj) else {
                continue;
            };
            let Some(ops) = adoption_patch(&v, config, now) else {
                continue;
            };
            let (ns, name, uid) = (
                v["metadata"]["namespace"].as_str().unwrap_or_default(),
                v["metadata"]["name"].as_str().unwrap_or_default(),
                v["metadata"]["uid"].as_str().unwrap_or_default(),
            );
            let span = tracing::info_span!("adopt_taskrun", namespace = ns, taskrun = name, uid);
            let path = format!("/apis/tekton.dev/v1/namespaces/{ns}/taskruns/{name}");
            let req = http::Request::patch(&path)
                .header(http::header::CONTENT_TYPE, "application/json-patch+json")
                .body(serde_json::to_vec(&ops).expect("JSON values serialise"))
                .expect("valid request");
            let answer = ctx
                .client
                .request::<Value>(req)
                .instrument(span.clone())
                .await;
            let _entered = span.enter();
            match answer {
                Ok(_) => {
                    marked += 1;
                    tracing::info!("marked a TaskRun the webhook missed");
                }
                // Changed or gone meanwhile: the next scan looks again.
                Err(error) => tracing::debug!(%error, "not marked"),
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(marked),
        }
    }
}

/// Scans at once and then every `every`, until the term's context is cancelled.
pub async fn run(
    ctx: Context,
    config: tokio::sync::watch::Receiver<Option<std::sync::Arc<HostConfig>>>,
    every: Duration,
) {
    loop {
        let current = config.borrow().clone();
        if let Some(cfg) = current {
            // Its writes belong to the term: none may land after it ended.
            let scanned = tokio::select! {
                () = ctx.cancel.cancelled() => return,
                r = scan(&ctx, &cfg) => r,
            };
            match scanned {
                Ok(0) => {}
                Ok(n) => tracing::warn!(
                    marked = n,
                    "safety-net scan marked TaskRuns the webhook missed"
                ),
                Err(error) => tracing::warn!(%error, "safety-net scan failed; retrying next round"),
            }
        }
        tokio::select! {
            () = ctx.cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn config() -> HostConfig {
        let text = include_str!("../../../core/tests/fixtures/admission/host-config.yaml");
        let (data, _) = crate::config::read_configmap_yaml(text).unwrap();
        crate::config::parse(&data).config
    }

    fn unmarked() -> Value {
        let mut v: Value = serde_json::from_str(include_str!(
            "../../../tests/fixtures/controller/taskrun-waiting.json"
        ))
        .unwrap();
        let m = v["metadata"].as_object_mut().unwrap();
        m.insert("finalizers".into(), json!([]));
        m.insert("annotations".into(), json!({}));
        m["labels"]
            .as_object_mut()
            .unwrap()
            .retain(|k, _| !k.starts_with("build.appstudio.redhat.com/"));
        v
    }

    #[test]
    fn marks_a_missed_remote_taskrun_like_the_webhook_and_only_its_metadata() {
        let tr = unmarked();
        let ops = adoption_patch(&tr, &config(), 1_700_000_000).expect("needs marking");
        assert_eq!(ops[0].path(), "/metadata/uid");
        assert_eq!(ops[1].path(), "/metadata/resourceVersion");
        assert!(ops.iter().all(|o| o.path().starts_with("/metadata/")));
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::to_value(&ops).unwrap()).unwrap();
        let mut marked = tr.clone();
        json_patch::patch(&mut marked, &patch).unwrap();
        let m = &marked["metadata"];
        assert_eq!(
            m["labels"][crate::contract::TARGET_PLATFORM_LABEL],
            "linux-arm64"
        );
        assert_eq!(m["finalizers"], json!([crate::contract::FINALIZER]));
        assert_eq!(
            m["annotations"][crate::contract::ALLOCATION_START_TIME_ANNOTATION],
            "1700000000"
        );
        assert_eq!(marked["spec"], tr["spec"], "the spec is never touched");
    }

    #[test]
    fn finished_internal_and_platformless_taskruns_are_left_alone() {
        let mut done = unmarked();
        done["status"]["conditions"][0]["status"] = "True".into();
        assert!(adoption_patch(&done, &config(), 1).is_none());
        let mut internal = unmarked();
        internal["metadata"]["labels"][crate::contract::TASK_TYPE_LABEL] = "x".into();
        assert!(adoption_patch(&internal, &config(), 1).is_none());
        let mut none = unmarked();
        none["spec"]["params"] = json!([]);
        none["status"]["taskSpec"]["params"] = json!([]);
        assert!(adoption_patch(&none, &config(), 1).is_none());
    }

    /// The decision is taken on the listed TaskRun itself: once marked, it needs nothing more,
    /// and a forged controller-only label alone is no reason to write.
    #[test]
    fn a_marked_taskrun_is_not_marked_again() {
        let tr = unmarked();
        let ops = adoption_patch(&tr, &config(), 1_700_000_000).expect("needs marking");
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::to_value(&ops).unwrap()).unwrap();
        let mut marked = tr.clone();
        json_patch::patch(&mut marked, &patch).unwrap();
        assert!(adoption_patch(&marked, &config(), 1_700_000_100).is_none());
        let mut internal = unmarked();
        let labels = internal["metadata"]["labels"].as_object_mut().unwrap();
        labels.insert(crate::contract::TASK_TYPE_LABEL.into(), "x".into());
        labels.insert(crate::contract::ASSIGNED_HOST_LABEL.into(), "h".into());
        assert!(adoption_patch(&internal, &config(), 1).is_none());
    }
}
