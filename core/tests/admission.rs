//! Golden AdmissionReview fixtures through the admission core: each test applies the returned JSON
//! Patch to the received object and compares the whole resulting document with the expected one,
//! then reviews the patched object again and expects no patch (reinvocation).

use std::path::PathBuf;

use base64::Engine as _;
use mpc_core::admission::{self, Decision, IgnoreReason, Reviewed};
use mpc_core::config::HostConfig;
use mpc_core::contract::{
    ALLOCATION_START_TIME_ANNOTATION, ASSIGNED_HOST_LABEL, CLOUD_INSTANCE_ID_ANNOTATION,
    CONTROLLER_ONLY_ANNOTATIONS, CONTROLLER_ONLY_LABELS, FINALIZER, TARGET_PLATFORM_LABEL,
};
use serde_json::{Value, json};

const NOW: u64 = 1_732_000_000;

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/admission")
        .join(name)
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixture_path(&format!("{name}.json"))).unwrap()
}

fn config_with(overrides: &[(&str, &str)]) -> HostConfig {
    let text = std::fs::read_to_string(fixture_path("host-config.yaml")).unwrap();
    let (mut data, _) = mpc_core::config::read_configmap_yaml(&text).unwrap();
    for (k, v) in overrides {
        data.insert((*k).to_owned(), (*v).to_owned());
    }
    mpc_core::config::parse(&data).config
}

fn config() -> HostConfig {
    config_with(&[])
}

/// One reviewed fixture: the request, the decoded response and the patched object.
struct Case {
    request: Value,
    response: Value,
    reviewed: Reviewed,
    patched: Value,
}

impl Case {
    fn object(&self) -> Value {
        self.request["request"]["object"].clone()
    }

    fn ops(&self) -> Vec<Value> {
        decode_patch(&self.response).unwrap_or_default()
    }

    fn warnings(&self) -> Vec<String> {
        self.response["response"]["warnings"]
            .as_array()
            .map(|w| w.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default()
    }
}

fn decode_patch(response: &Value) -> Option<Vec<Value>> {
    let p = response["response"]["patch"].as_str()?;
    assert_eq!(response["response"]["patchType"], "JSONPatch");
    let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
    Some(serde_json::from_slice(&bytes).unwrap())
}

fn run_bytes(body: &[u8], cfg: &HostConfig) -> Case {
    let request: Value = serde_json::from_slice(body).unwrap();
    let reviewed = admission::review(body, cfg, NOW).unwrap();
    let response: Value = serde_json::from_slice(&reviewed.response).unwrap();
    assert_eq!(response["apiVersion"], request["apiVersion"]);
    assert_eq!(response["kind"], "AdmissionReview");
    assert_eq!(response["response"]["uid"], request["request"]["uid"]);
    let mut patched = request["request"]["object"].clone();
    let ops = decode_patch(&response);
    assert_eq!(reviewed.patch_ops, ops.as_ref().map_or(0, Vec::len));
    if let Some(ops) = &ops {
        assert!(!ops.is_empty(), "an empty patch must be left out");
        let p: json_patch::Patch = serde_json::from_value(Value::Array(ops.clone())).unwrap();
        json_patch::patch(&mut patched, &p).expect("the patch applies to the received object");
    }
    Case {
        request,
        response,
        reviewed,
        patched,
    }
}

/// Reviews a fixture, checks reinvocation on the patched object yields nothing more.
fn run(name: &str, cfg: &HostConfig) -> Case {
    let case = run_bytes(&fixture(name), cfg);
    if case.response["response"]["allowed"] == true {
        let mut again = case.request.clone();
        again["request"]["object"] = case.patched.clone();
        let again_body = serde_json::to_vec(&again).unwrap();
        let second = run_bytes(&again_body, cfg);
        assert_eq!(second.reviewed.decision, case.reviewed.decision, "{name}");
        assert_eq!(second.ops(), Vec::<Value>::new(), "{name}: reinvocation");
        assert_eq!(second.patched, case.patched);
    }
    case
}

fn expect_remote_marks(expected: &mut Value, label: &str) {
    expected["metadata"]["labels"][TARGET_PLATFORM_LABEL] = json!(label);
    let fins = &mut expected["metadata"]["finalizers"];
    if fins.is_null() {
        *fins = json!([]);
    }
    fins.as_array_mut().unwrap().push(json!(FINALIZER));
    expected["metadata"]["annotations"][ALLOCATION_START_TIME_ANNOTATION] = json!(NOW.to_string());
}

fn os_arch_requirements(os: &str, arch: &str) -> Value {
    json!([
        {"key": "kubernetes.io/os", "operator": "In", "values": [os]},
        {"key": "kubernetes.io/arch", "operator": "In", "values": [arch]},
    ])
}

#[test]
fn taskref_bundle_taskrun_is_marked_for_allocation() {
    let case = run("taskref-bundle", &config());
    assert_eq!(case.reviewed.decision, Decision::Remote);
    assert_eq!(case.reviewed.platform.as_deref(), Some("linux/arm64"));
    assert_eq!(case.reviewed.namespace, "tenant-a");
    assert_eq!(case.reviewed.name, "shop-api-on-push-x7k2p-build-images-0");
    let mut expected = case.object();
    expect_remote_marks(&mut expected, "linux-arm64");
    assert_eq!(case.patched, expected);
    // Labels and annotations existed: single keys were added, escaped, not whole maps replaced.
    let paths: Vec<_> = case.ops().iter().map(|o| o["path"].clone()).collect();
    assert_eq!(
        paths,
        [
            "/metadata/labels/build.appstudio.redhat.com~1target-platform",
            "/metadata/finalizers",
            "/metadata/annotations/build.appstudio.redhat.com~1allocation-start-time",
        ]
    );
    assert!(case.warnings().is_empty());
}

#[test]
fn inline_task_with_the_secret_volume_gets_labels_finalizer_and_annotation_maps() {
    let case = run("inline-taskspec-secret-volume", &config());
    assert_eq!(case.reviewed.decision, Decision::Remote);
    let mut expected = case.object();
    assert!(expected["metadata"].get("labels").is_none());
    assert!(expected["metadata"].get("annotations").is_none());
    expect_remote_marks(&mut expected, "linux-arm64");
    assert_eq!(case.patched, expected);
}

#[test]
fn large_inline_task_is_handled_like_a_small_one() {
    let body = fixture("large-inline-taskspec");
    assert!(body.len() > 38_000, "{}", body.len());
    let case = run("large-inline-taskspec", &config());
    assert_eq!(case.reviewed.decision, Decision::Remote);
    let mut expected = case.object();
    expect_remote_marks(&mut expected, "linux-arm64");
    assert_eq!(case.patched, expected);
}

#[test]
fn inline_task_without_the_secret_volume_is_ignored() {
    let case = run("inline-taskspec-no-secret-volume", &config());
    assert_eq!(
        case.reviewed.decision,
        Decision::Ignored(IgnoreReason::NoSecretVolume)
    );
    assert_eq!(case.response["response"]["allowed"], true);
    assert!(case.response["response"].get("patch").is_none());
    assert_eq!(case.patched, case.object());
}

#[test]
fn local_platform_without_pod_template_gets_one_with_node_affinity() {
    let case = run("local-no-podtemplate", &config());
    assert_eq!(case.reviewed.decision, Decision::Local);
    let mut expected = case.object();
    expected["metadata"]["labels"][TARGET_PLATFORM_LABEL] = json!(local_label(&case));
    // linux/x86_64 is scheduled on nodes labelled amd64.
    expected["spec"]["podTemplate"] = json!({"affinity": {"nodeAffinity": {
    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": os_arch_requirements("linux", "amd64")}
    ]}}}});
    assert_eq!(case.patched, expected);
}

#[test]
fn local_platform_keeps_tolerations_and_node_selector() {
    let case = run("local-podtemplate-tolerations", &config());
    assert_eq!(case.reviewed.decision, Decision::Local);
    let mut expected = case.object();
    expected["metadata"]["labels"][TARGET_PLATFORM_LABEL] = json!(local_label(&case));
    expected["spec"]["podTemplate"]["affinity"] = json!({"nodeAffinity": {
    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": os_arch_requirements("linux", "amd64")}
    ]}}});
    assert_eq!(case.patched, expected);
    assert_eq!(
        case.patched["spec"]["podTemplate"]["tolerations"][0]["value"],
        "konflux-tenants"
    );
}

#[test]
fn local_platform_adds_node_affinity_next_to_pod_anti_affinity() {
    let case = run("local-affinity-without-node-affinity", &config());
    let mut expected = case.object();
    expected["metadata"]["labels"][TARGET_PLATFORM_LABEL] = json!(local_label(&case));
    expected["spec"]["podTemplate"]["affinity"]["nodeAffinity"] = json!({
    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": os_arch_requirements("linux", "amd64")}
    ]}});
    assert_eq!(case.patched, expected);
    assert!(case.patched["spec"]["podTemplate"]["affinity"]["podAntiAffinity"].is_object());
}

#[test]
fn local_platform_merges_into_every_non_empty_node_selector_term() {
    let case = run("local-node-selector-terms", &config());
    assert_eq!(case.reviewed.decision, Decision::Local);
    let mut expected = case.object();
    expected["metadata"]["labels"][TARGET_PLATFORM_LABEL] = json!(local_label(&case));
    let terms = &mut expected["spec"]["podTemplate"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    let req = os_arch_requirements("linux", "amd64");
    // Term 0: zone only → both added.
    let t0 = terms[0]["matchExpressions"].as_array_mut().unwrap();
    t0.push(req[0].clone());
    t0.push(req[1].clone());
    // Term 1 already requires the os: only the arch is added.
    terms[1]["matchExpressions"]
        .as_array_mut()
        .unwrap()
        .push(req[1].clone());
    // Term 2 has only matchFields: matchExpressions is created.
    terms[2]["matchExpressions"] = req.clone();
    // Term 3 is empty (selects nothing) and stays so: giving it requirements would widen it.
    assert_eq!(terms[3], json!({}));
    assert_eq!(case.patched, expected);
    // Preferred terms are untouched.
    assert_eq!(
        case.patched["spec"]["podTemplate"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"],
        case.object()["spec"]["podTemplate"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    );
}

#[test]
fn local_bare_name_gets_only_the_label() {
    let case = run("local-bare-name", &config());
    assert_eq!(case.reviewed.decision, Decision::Local);
    let mut expected = case.object();
    expected["metadata"]["labels"][TARGET_PLATFORM_LABEL] = json!(local_label(&case));
    assert_eq!(case.patched, expected);
    assert!(case.patched["spec"].get("podTemplate").is_none());
}

#[test]
fn remote_platform_appends_to_existing_finalizers_and_creates_labels() {
    let case = run("remote-existing-finalizers", &config());
    assert_eq!(case.reviewed.decision, Decision::Remote);
    let mut expected = case.object();
    assert!(expected["metadata"].get("labels").is_none());
    expect_remote_marks(&mut expected, "linux-ppc64le");
    assert_eq!(
        expected["metadata"]["finalizers"],
        json!(["chains.tekton.dev", FINALIZER])
    );
    assert_eq!(case.patched, expected);
    assert!(
        case.ops()
            .iter()
            .any(|o| o["path"] == "/metadata/finalizers/-")
    );
}

/// `already-mutated` as the API server sends it again when it reinvokes the webhook moments
/// after the first call stamped `allocation-start-time` at `stamped`.
fn reinvoked(stamped: u64) -> Vec<u8> {
    let mut request: Value = serde_json::from_slice(&fixture("already-mutated")).unwrap();
    request["request"]["object"]["metadata"]["annotations"][ALLOCATION_START_TIME_ANNOTATION] =
        json!(stamped.to_string());
    serde_json::to_vec(&request).unwrap()
}

#[test]
fn already_mutated_object_gets_no_patch() {
    let case = run_bytes(&reinvoked(NOW - 20), &config());
    assert_eq!(case.reviewed.decision, Decision::Remote);
    assert!(case.response["response"].get("patch").is_none());
    assert!(case.response["response"].get("patchType").is_none());
    // The first admission's allocation start time is kept.
    assert_eq!(
        case.patched["metadata"]["annotations"][ALLOCATION_START_TIME_ANNOTATION],
        (NOW - 20).to_string()
    );
}

#[test]
fn a_creators_allocation_start_time_is_replaced_so_it_cannot_jump_the_queue() {
    // Older than any reinvocation (the fixture's own value), or in the future: not ours.
    let future = run_bytes(&reinvoked(NOW + 5), &config());
    let stale = run("already-mutated", &config());
    for case in [stale, future] {
        assert_eq!(case.reviewed.decision, Decision::Remote);
        assert_eq!(
            case.ops(),
            [json!({"op": "add",
                "path": "/metadata/annotations/build.appstudio.redhat.com~1allocation-start-time",
                "value": NOW.to_string()})]
        );
    }
}

#[test]
fn controller_only_keys_a_creator_sends_are_removed() {
    let case = run("forged-controller-keys", &config());
    assert_eq!(case.reviewed.decision, Decision::Remote);
    let mut expected = case.object();
    let meta = expected["metadata"].as_object_mut().unwrap();
    for key in CONTROLLER_ONLY_LABELS {
        assert!(
            meta["labels"]
                .as_object_mut()
                .unwrap()
                .remove(key)
                .is_some()
        );
    }
    for key in CONTROLLER_ONLY_ANNOTATIONS {
        assert!(
            meta["annotations"]
                .as_object_mut()
                .unwrap()
                .remove(key)
                .is_some()
        );
    }
    // `allocation-start-time: 1` would put it first in the queue: the webhook's own is written.
    expect_remote_marks(&mut expected, "linux-arm64");
    assert_eq!(case.patched, expected);
    assert_eq!(
        case.patched["metadata"]["annotations"][ALLOCATION_START_TIME_ANNOTATION],
        NOW.to_string()
    );
}

#[test]
fn controller_only_keys_are_removed_from_taskruns_the_webhook_otherwise_ignores() {
    let mut request: Value = serde_json::from_slice(&fixture("internal-task")).unwrap();
    let meta = &mut request["request"]["object"]["metadata"];
    meta["labels"][ASSIGNED_HOST_LABEL] = json!("host-1");
    meta["annotations"][CLOUD_INSTANCE_ID_ANNOTATION] = json!("i-0aaaabbbbcccc0001");
    let case = run_bytes(&serde_json::to_vec(&request).unwrap(), &config());
    assert_eq!(
        case.reviewed.decision,
        Decision::Ignored(IgnoreReason::Internal)
    );
    let paths: Vec<_> = case
        .ops()
        .iter()
        .map(|o| o["op"].to_string() + " " + o["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "\"remove\" /metadata/labels/build.appstudio.redhat.com~1assigned-host",
            "\"remove\" /metadata/annotations/build.appstudio.redhat.com~1cloud-instance-id",
        ]
    );
    let mut expected = case.object();
    expected["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove(ASSIGNED_HOST_LABEL);
    expected["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove(CLOUD_INSTANCE_ID_ANNOTATION);
    assert_eq!(case.patched, expected);
}

#[test]
fn an_ignored_taskrun_loses_our_finalizer_unless_it_carries_the_platform_label() {
    // An inline Task that mounts no multi-platform secret, created with our finalizer (twice) next
    // to its own: no label is added, so the controller would never remove ours.
    let case = run("unearned-finalizer", &config());
    assert_eq!(
        case.reviewed.decision,
        Decision::Ignored(IgnoreReason::NoSecretVolume)
    );
    assert_eq!(
        case.ops(),
        [
            json!({"op": "remove", "path": "/metadata/finalizers/2"}),
            json!({"op": "remove", "path": "/metadata/finalizers/0"}),
        ]
    );
    let mut expected = case.object();
    expected["metadata"]["finalizers"] = json!(["example.com/tenant-cleanup"]);
    assert_eq!(case.patched, expected);

    // With the label the controller watches it and removes the finalizer itself: kept.
    let mut request: Value = serde_json::from_slice(&fixture("unearned-finalizer")).unwrap();
    request["request"]["object"]["metadata"]["labels"][TARGET_PLATFORM_LABEL] =
        json!("linux-arm64");
    let case = run_bytes(&serde_json::to_vec(&request).unwrap(), &config());
    assert_eq!(
        case.reviewed.decision,
        Decision::Ignored(IgnoreReason::NoSecretVolume)
    );
    assert_eq!(case.ops(), Vec::<Value>::new());
}

#[test]
fn ignored_requests_are_allowed_untouched() {
    for (name, reason) in [
        ("no-platform", IgnoreReason::NoPlatform),
        ("internal-task", IgnoreReason::Internal),
        ("update-operation", IgnoreReason::NotCreate),
        ("wrong-kind", IgnoreReason::NotTaskRun),
    ] {
        let case = run(name, &config());
        assert_eq!(case.reviewed.decision, Decision::Ignored(reason), "{name}");
        assert_eq!(case.response["response"]["allowed"], true, "{name}");
        assert!(case.response["response"].get("patch").is_none(), "{name}");
        assert_eq!(case.patched, case.object(), "{name}");
    }
}

#[test]
fn platform_given_as_array_is_marked_with_the_invalid_marker() {
    let case = run("platform-array", &config());
    assert_eq!(case.reviewed.decision, Decision::Unknown);
    let mut expected = case.object();
    expect_remote_marks(&mut expected, admission::INVALID_PLATFORM_LABEL);
    assert_eq!(case.patched, expected);
    let w = case.warnings();
    assert!(w[0].contains("PLATFORM must be a string"), "{w:?}");
    assert!(w[0].contains("an array"), "{w:?}");
}

#[test]
fn unknown_platform_is_allowed_marked_and_warned() {
    let case = run("unknown-platform", &config());
    assert_eq!(case.reviewed.decision, Decision::Unknown);
    let mut expected = case.object();
    expect_remote_marks(&mut expected, "linux-riscv64");
    assert_eq!(case.patched, expected);
    let w = case.warnings();
    assert!(w[0].contains("linux/riscv64 is not configured"), "{w:?}");
    assert!(
        w[0].contains("linux/arm64"),
        "lists what is configured: {w:?}"
    );
}

#[test]
fn malformed_platform_is_allowed_with_a_valid_label_value() {
    let case = run("malformed-platform", &config());
    assert_eq!(case.reviewed.decision, Decision::Unknown);
    let mut expected = case.object();
    expect_remote_marks(&mut expected, "linux-AMD64");
    assert_eq!(case.patched, expected);
    assert!(case.warnings()[0].contains("\"AMD64\" is not a DNS-1035 label"));
}

#[test]
fn disabled_platform_is_remote_with_a_warning() {
    let case = run("disabled-platform", &config());
    assert_eq!(case.reviewed.decision, Decision::Remote);
    let mut expected = case.object();
    expect_remote_marks(&mut expected, "linux-s390x");
    assert_eq!(case.patched, expected);
    let w = case.warnings();
    assert!(w[0].contains("disabled by a host-config error"), "{w:?}");
    assert!(w[0].contains("dynamic.linux-s390x.ami"), "{w:?}");
}

#[test]
fn v1beta1_taskrun_on_a_dynamic_pool() {
    let case = run("v1beta1", &config());
    assert_eq!(case.request["request"]["kind"]["version"], "v1beta1");
    assert_eq!(case.reviewed.decision, Decision::Remote);
    let mut expected = case.object();
    expect_remote_marks(&mut expected, "linux-c2xlarge-arm64");
    assert_eq!(case.patched, expected);
}

#[test]
fn gate_pending_sets_spec_status_only_when_unset() {
    let cfg = config_with(&[("gate-pending", "true")]);
    let case = run("gate-pending", &cfg);
    let mut expected = case.object();
    expect_remote_marks(&mut expected, "linux-arm64");
    expected["spec"]["status"] = json!(admission::PENDING_STATUS);
    assert_eq!(case.patched, expected);

    // A status the user set (here: cancelled) is never overwritten.
    let mut req: Value = serde_json::from_slice(&fixture("gate-pending")).unwrap();
    req["request"]["object"]["spec"]["status"] = json!("TaskRunCancelled");
    let case = run_bytes(&serde_json::to_vec(&req).unwrap(), &cfg);
    assert_eq!(case.patched["spec"]["status"], "TaskRunCancelled");

    // Local platforms are never gated.
    let case = run("local-bare-name", &cfg);
    assert!(case.patched["spec"].get("status").is_none());
}

#[test]
fn reject_unknown_platforms_denies_with_422() {
    let cfg = config_with(&[("reject-unknown-platforms", "true")]);
    for (name, needle) in [
        ("reject-unknown", "linux/riscv64 is not configured"),
        ("malformed-platform", "is not a DNS-1035 label"),
        ("platform-array", "PLATFORM must be a string"),
    ] {
        let case = run(name, &cfg);
        assert_eq!(case.reviewed.decision, Decision::Denied, "{name}");
        let r = &case.response["response"];
        assert_eq!(r["allowed"], false);
        assert_eq!(r["status"]["code"], 422);
        assert_eq!(r["status"]["status"], "Failure");
        let msg = r["status"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{name}: {msg}");
        assert!(r.get("patch").is_none());
    }
    // Configured platforms are unaffected.
    assert_eq!(
        run("taskref-bundle", &cfg).reviewed.decision,
        Decision::Remote
    );
}

#[test]
fn truncated_json_is_an_error_that_says_where() {
    let body = fixture("truncated");
    let err = admission::review(&body, &config(), NOW).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("malformed AdmissionReview:"), "{msg}");
    assert!(msg.contains("EOF while parsing"), "{msg}");
    assert!(msg.contains("line"), "{msg}");
}

/// Found by fuzzing: bytes that are not UTF-8 inside a field the webhook skips (a key of
/// `request.resource`) were accepted although such a body is not JSON.
#[test]
fn invalid_utf8_anywhere_is_an_error_that_says_where() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz/admission/invalid-utf8-in-skipped-key.json");
    let body = std::fs::read(path).unwrap();
    let err = admission::review(&body, &config(), NOW).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("malformed AdmissionReview: not UTF-8:"),
        "{msg}"
    );
    assert!(msg.contains("from index 245"), "{msg}");
    // The same request with the key made valid is decided.
    let fixed = String::from_utf8_lossy(&body).into_owned();
    assert!(admission::review(fixed.as_bytes(), &config(), NOW).is_ok());
}

/// Found by fuzzing: a lone UTF-16 surrogate escape (`\uDBCC`) is JSON, though not one a
/// `serde_json::Value` holds. In a field the webhook skips (a step's `workingDir`) the request is
/// decided as if it were U+FFFD (as the API server's decoder reads it); in a field the webhook
/// reads, it is an error naming the problem.
#[test]
fn lone_surrogate_escape_is_decided_when_skipped_and_an_error_when_read() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz/admission/lone-surrogate-in-skipped-string.json");
    let body = String::from_utf8(std::fs::read(path).unwrap()).unwrap();
    assert!(body.contains("\\uDBCCpath"));
    let cfg = config();
    let lone = admission::review(body.as_bytes(), &cfg, NOW).unwrap();
    let replaced = body.replace("\\uDBCC", "\\uFFFD");
    let expected = admission::review(replaced.as_bytes(), &cfg, NOW).unwrap();
    assert_eq!(lone.decision, expected.decision);
    assert_eq!(lone.response, expected.response);

    let body = String::from_utf8(fixture("taskref-bundle")).unwrap();
    let uid = "\"7f3c0001-1b2d-4c6e-9a0f-000000001eef\"";
    assert!(body.contains(uid));
    let body = body.replacen(uid, "\"7f3c0001\\uDBCC\"", 1);
    let msg = admission::review(body.as_bytes(), &cfg, NOW)
        .unwrap_err()
        .to_string();
    assert!(msg.starts_with("malformed AdmissionReview:"), "{msg}");
    assert!(msg.contains("hex escape at line 5 column 27"), "{msg}");
}

#[test]
fn every_prefix_of_a_request_is_an_error_or_a_decision_never_a_panic() {
    let body =
        serde_json::to_vec(&serde_json::from_slice::<Value>(&fixture("taskref-bundle")).unwrap())
            .unwrap();
    let cfg = config();
    for end in 0..body.len() {
        let _ = admission::review(&body[..end], &cfg, NOW);
    }
    assert!(admission::review(&body, &cfg, NOW).is_ok());
}

/// A local TaskRun's `target-platform` label: its platform with `/` → `-` (the controller then
/// writes `host: localhost` and labels `assigned-host`).
fn local_label(case: &Case) -> String {
    case.object()["spec"]["params"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "PLATFORM")
        .unwrap()["value"]
        .as_str()
        .unwrap()
        .replace('/', "-")
}

/// A review reports its own uid and the TaskRun's `metadata.uid` when the object has one (the
/// webhook's log span carries both), whichever order the object and the operation come in.
#[test]
fn review_reports_the_review_uid_and_the_taskrun_uid() {
    let body = fixture("taskref-bundle");
    let case = run_bytes(&body, &config());
    let review_uid = case.request["request"]["uid"].as_str().unwrap();
    let uid = case.object()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(case.reviewed.review_uid, review_uid);
    assert_eq!(case.reviewed.uid.as_deref(), Some(uid.as_str()));

    // `serde_json::Value` sorts keys: `object` then comes before `operation`.
    let sorted = serde_json::to_vec(&case.request).unwrap();
    let r = admission::review(&sorted, &config(), NOW).unwrap();
    assert_eq!(r.review_uid, review_uid);
    assert_eq!(r.uid.as_deref(), Some(uid.as_str()));

    // A CREATE as the API server sends it: the uid is assigned after admission.
    let mut without = case.request.clone();
    without["request"]["object"]["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("uid");
    let r = admission::review(&serde_json::to_vec(&without).unwrap(), &config(), NOW).unwrap();
    assert_eq!(r.uid, None);
    assert_eq!(
        (r.namespace.as_str(), r.name.as_str()),
        ("tenant-a", "shop-api-on-push-x7k2p-build-images-0")
    );
}
