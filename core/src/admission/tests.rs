//! Unit tests of the parts the fixture tests (`tests/admission.rs`) do not reach directly.

use super::*;
use crate::config::{ConfigData, parse};

fn config(pairs: &[(&str, &str)]) -> HostConfig {
    let data: ConfigData = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    parse(&data).config
}

fn request(object_first: bool, object: &str) -> String {
    let head = r#""uid":"u-1","kind":{"group":"tekton.dev","version":"v1","kind":"TaskRun"},"operation":"CREATE","namespace":"ns","name":"tr""#;
    let body = if object_first {
        format!(r#"{{"object":{object},{head}}}"#)
    } else {
        format!(r#"{{{head},"object":{object}}}"#)
    };
    format!(r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{body}}}"#)
}

fn decode_patch(response: &[u8]) -> Option<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_slice(response).unwrap();
    let p = v["response"]["patch"].as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(p).unwrap();
    Some(serde_json::from_slice(&bytes).unwrap())
}

const LOCAL_TR: &str =
    r#"{"metadata":{"name":"tr"},"spec":{"params":[{"name":"PLATFORM","value":"linux/amd64"}]}}"#;

#[test]
fn object_before_kind_and_operation_gives_the_same_answer() {
    let cfg = config(&[("local-platforms", "linux/amd64")]);
    let a = review(request(false, LOCAL_TR).as_bytes(), &cfg, 7).unwrap();
    let b = review(request(true, LOCAL_TR).as_bytes(), &cfg, 7).unwrap();
    assert_eq!(a.decision, Decision::Local);
    assert_eq!(a.response, b.response);
    assert_eq!(a.namespace, "ns");
    assert_eq!(a.name, "tr");
    assert_eq!(a.platform.as_deref(), Some("linux/amd64"));
}

#[test]
fn object_first_of_another_shape_is_still_ignored_or_rejected_as_in_api_order() {
    let cfg = config(&[("local-platforms", "linux/amd64")]);
    // Not a TaskRun view (`spec.params` is a string): an UPDATE or another kind is allowed as is.
    let odd = r#"{"spec":{"params":"x"}}"#;
    for (kind, operation) in [("TaskRun", "UPDATE"), ("PipelineRun", "CREATE")] {
        let body = request(true, odd)
            .replace(
                r#""operation":"CREATE""#,
                &format!(r#""operation":"{operation}""#),
            )
            .replace(r#""kind":"TaskRun""#, &format!(r#""kind":"{kind}""#));
        let r = review(body.as_bytes(), &cfg, 7).unwrap();
        assert!(
            matches!(r.decision, Decision::Ignored(_)),
            "{kind} {operation}"
        );
        assert!(decode_patch(&r.response).is_none());
    }
    // A TaskRun CREATE of that shape is rejected in both orders (positions differ: object-first
    // errors are located within the object).
    for object_first in [true, false] {
        let e = review(request(object_first, odd).as_bytes(), &cfg, 7).unwrap_err();
        assert!(
            e.to_string()
                .contains(r#"invalid type: string "x", expected a sequence"#),
            "{e}"
        );
    }
}

#[test]
fn escaped_strings_are_read_like_plain_ones() {
    // `\/` and `\u0041` escapes force owned strings; the decision must not change.
    let obj = r#"{"metadata":{"labels":{"build.appstudio.redhat.com\/task-type":"x"}},"spec":{"params":[{"name":"PL\u0041TFORM","value":"linux\/amd64"}]}}"#;
    let cfg = config(&[("local-platforms", "linux/amd64")]);
    let r = review(request(false, obj).as_bytes(), &cfg, 7).unwrap();
    assert_eq!(r.decision, Decision::Ignored(IgnoreReason::Internal));
    let obj = r#"{"spec":{"params":[{"name":"PL\u0041TFORM","value":"linux\/amd64"}]}}"#;
    let r = review(request(false, obj).as_bytes(), &cfg, 7).unwrap();
    assert_eq!(r.decision, Decision::Local);
    // No metadata at all: it is created before labels are added under it.
    let ops = decode_patch(&r.response).unwrap();
    assert_eq!(ops[0]["path"], "/metadata");
    assert_eq!(ops[1]["path"], "/metadata/labels");
}

#[test]
fn inline_task_default_supplies_the_platform() {
    let obj = r#"{"metadata":{"name":"tr"},"spec":{"taskSpec":{"params":[{"name":"PLATFORM","default":"linux/arm64"}],"volumes":[{"name":"ssh","secret":{"secretName":"multi-platform-ssh-$(context.taskRun.name)"}}],"steps":[]}}}"#;
    let cfg = config(&[
        ("dynamic-platforms", "linux/arm64"),
        ("dynamic.linux-arm64.type", "aws"),
        ("dynamic.linux-arm64.region", "us-east-1"),
        ("dynamic.linux-arm64.ami", "ami-1"),
        ("dynamic.linux-arm64.instance-type", "m6g.large"),
        ("dynamic.linux-arm64.aws-secret", "aws"),
        ("dynamic.linux-arm64.ssh-secret", "ssh"),
        ("dynamic.linux-arm64.max-instances", "4"),
    ]);
    let r = review(request(false, obj).as_bytes(), &cfg, 1700000000).unwrap();
    assert_eq!(r.decision, Decision::Remote);
    let ops = decode_patch(&r.response).unwrap();
    let adds: Vec<&str> = ops
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        adds,
        [
            "/metadata/labels",
            "/metadata/finalizers",
            "/metadata/annotations"
        ]
    );
    assert_eq!(
        ops[0]["value"]["build.appstudio.redhat.com/target-platform"],
        "linux-arm64"
    );
    assert_eq!(
        ops[2]["value"]["build.appstudio.redhat.com/allocation-start-time"],
        "1700000000"
    );
}

#[test]
fn label_values_are_always_valid() {
    assert_eq!(target_label_value("linux/arm64"), "linux-arm64");
    assert_eq!(target_label_value("linux/AMD64"), "linux-AMD64");
    assert_eq!(target_label_value("linux arm64"), INVALID_PLATFORM_LABEL);
    assert_eq!(target_label_value(""), INVALID_PLATFORM_LABEL);
    assert_eq!(target_label_value("-linux"), INVALID_PLATFORM_LABEL);
    let long = format!("linux/{}", "a".repeat(63));
    assert_eq!(target_label_value(&long), INVALID_PLATFORM_LABEL);
    assert!(is_label_value(INVALID_PLATFORM_LABEL));
    assert!(is_label_value("a"));
    assert!(is_label_value(&"a".repeat(63)));
    assert!(!is_label_value(&"a".repeat(64)));
    assert!(!is_label_value("a_"));
}

#[test]
fn errors_name_what_is_wrong() {
    let cfg = HostConfig::default();
    let e = review(b"{\"apiVersion\":\"admission.k8s.io/v1\",", &cfg, 0).unwrap_err();
    assert!(e.to_string().contains("EOF"), "{e}");
    let e = review(br#"{"apiVersion":"v1","kind":"Pod"}"#, &cfg, 0).unwrap_err();
    assert!(e.to_string().contains("not an AdmissionReview"), "{e}");
    let e = review(
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
        &cfg,
        0,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "malformed AdmissionReview: request is missing"
    );
    let no_object = r#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"1","kind":{"group":"tekton.dev","version":"v1","kind":"TaskRun"},"operation":"CREATE"}}"#;
    let e = review(no_object.as_bytes(), &cfg, 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "malformed AdmissionReview: request.object is missing"
    );
    let bad_labels = r#"{"metadata":{"finalizers":[1]},"spec":{"params":[{"name":"PLATFORM","value":"linux/amd64"}]}}"#;
    let e = review(request(false, bad_labels).as_bytes(), &cfg, 0).unwrap_err();
    assert!(e.to_string().contains("expected a string"), "{e}");
    // Objects the patch writes into must be objects: arrays would make the patch inapplicable.
    for obj in [
        r#"{"metadata":[],"spec":{"params":[{"name":"PLATFORM","value":"linux/amd64"}]}}"#,
        r#"[{"labels":{}},{"params":[{"name":"PLATFORM","value":"linux/amd64"}]}]"#,
        r#"{"spec":{"params":[{"name":"PLATFORM","value":"linux/amd64"}],"podTemplate":[[]]}}"#,
    ] {
        let e = review(request(false, obj).as_bytes(), &cfg, 0).unwrap_err();
        assert!(e.to_string().contains("expected an object"), "{obj}: {e}");
    }
}

#[test]
fn logged_platform_is_capped() {
    assert_eq!(truncated("linux/arm64", 128), "linux/arm64");
    let long = "é".repeat(100);
    let t = truncated(&long, 7);
    assert_eq!(t, "ééé...");
}

#[test]
fn outcomes_cover_every_decision() {
    for d in [
        Decision::Local,
        Decision::Remote,
        Decision::Unknown,
        Decision::Denied,
        Decision::Ignored(IgnoreReason::NoPlatform),
    ] {
        assert!(Decision::OUTCOMES.contains(&d.outcome()));
    }
}

#[test]
fn hand_written_response_is_the_json_a_serialiser_would_write() {
    let patch = br#"[{"op":"add","path":"/metadata/labels","value":{"a":"b"}}]"#.to_vec();
    let r = Response {
        allowed: true,
        patch: Some(patch.clone()),
        patch_ops: 1,
        status: None,
        warnings: vec!["careful \"here\"".into()],
    };
    let out = r.encode("admission.k8s.io/v1", "uid-\"1\"\\");
    let v: serde_json::Value = serde_json::from_slice(&out).expect("valid JSON");
    let b64 = base64::engine::general_purpose::STANDARD.encode(&patch);
    assert_eq!(
        v,
        serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {
                "uid": "uid-\"1\"\\",
                "allowed": true,
                "patchType": "JSONPatch",
                "patch": b64,
                "warnings": ["careful \"here\""],
            }
        })
    );
    let denied = Response::deny("no such platform".into()).encode("admission.k8s.io/v1", "u");
    let v: serde_json::Value = serde_json::from_slice(&denied).expect("valid JSON");
    assert_eq!(v["response"]["allowed"], false);
    assert_eq!(v["response"]["status"]["code"], 422);
    assert_eq!(v["response"]["status"]["message"], "no such platform");
    assert!(v["response"].get("patch").is_none() && v["response"].get("patchType").is_none());
}

/// `decide` on a TaskRun the caller holds is `review` of its CREATE without the envelope: the
/// same decision, the same patch operations in the same order, the same warnings and denial.
#[test]
fn decide_is_review_without_the_envelope() {
    let remote = [
        ("static-platforms", "linux/s390x"),
        ("host.s1.address", "10.0.0.1"),
        ("host.s1.platform", "linux/s390x"),
        ("host.s1.user", "root"),
        ("host.s1.secret", "s1"),
        ("host.s1.concurrency", "2"),
        ("local-platforms", "linux/amd64"),
    ];
    let lenient = config(&remote);
    let mut strict_pairs = remote.to_vec();
    strict_pairs.push(("reject-unknown-platforms", "true"));
    let strict = config(&strict_pairs);
    let taskruns = [
        LOCAL_TR,
        r#"{"metadata":{"name":"tr","labels":{"a":"b"}},"spec":{"params":[{"name":"PLATFORM","value":"linux/s390x"}]}}"#,
        // Forged controller-only keys are removed whatever the decision.
        r#"{"metadata":{"name":"tr","labels":{"build.appstudio.redhat.com/assigned-host":"x"}},"spec":{"params":[{"name":"PLATFORM","value":"linux/s390x"}]}}"#,
        r#"{"metadata":{"name":"tr"},"spec":{"params":[{"name":"PLATFORM","value":"linux/mips"}]}}"#,
        r#"{"metadata":{"name":"tr"},"spec":{"params":[{"name":"PLATFORM","value":["linux/s390x"]}]}}"#,
        r#"{"metadata":{"name":"tr","labels":{"build.appstudio.redhat.com/task-type":"x"}},"spec":{"params":[{"name":"PLATFORM","value":"linux/s390x"}]}}"#,
        r#"{"metadata":{"name":"tr"},"spec":{}}"#,
    ];
    let mut seen = std::collections::BTreeSet::new();
    for cfg in [&lenient, &strict] {
        for tr in taskruns {
            let reviewed = review(request(false, tr).as_bytes(), cfg, 1_700_000_000).unwrap();
            let decided = decide(&TaskRunView::from_json(tr).unwrap(), cfg, 1_700_000_000);
            seen.insert(decided.decision.outcome());
            assert_eq!(decided.decision, reviewed.decision, "{tr}");
            assert_eq!(decided.platform, reviewed.platform, "{tr}");
            assert_eq!(decided.patch.len(), reviewed.patch_ops, "{tr}");
            let patch = serde_json::to_value(&decided.patch).unwrap();
            let expected = decode_patch(&reviewed.response).unwrap_or(serde_json::json!([]));
            assert_eq!(patch, expected, "{tr}");
            let response: serde_json::Value = serde_json::from_slice(&reviewed.response).unwrap();
            let warnings: Vec<String> = response["response"]["warnings"]
                .as_array()
                .map(|w| w.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
                .unwrap_or_default();
            assert_eq!(decided.warnings, warnings, "{tr}");
            assert_eq!(
                decided.denial.as_deref(),
                response["response"]["status"]["message"].as_str(),
                "{tr}"
            );
            assert_eq!(
                decided.denial.is_some(),
                decided.decision == Decision::Denied
            );
        }
    }
    assert_eq!(
        seen.len(),
        Decision::OUTCOMES.len(),
        "every outcome: {seen:?}"
    );
    assert!(matches!(
        TaskRunView::from_json("[1]"),
        Err(AdmissionError::Json(_))
    ));
}
