//! ValidatingAdmissionPolicies judged as kube-apiserver judges them: CEL values (null, lists,
//! string escapes, 64-bit integers, map literals), the order in which `matchConditions` errors
//! and `false` are weighed, `failurePolicy: Ignore`, the `messageExpression` fallbacks, and the
//! `request` variable's shape. Each case is one policy, selected by a label on the ConfigMap
//! that is then created; the expected verdicts follow kube-apiserver's CEL admission plugin
//! (`k8s.io/apiserver/pkg/admission/plugin/policy/validating`, `webhook/matchconditions`).

use e2e_apiserver::{ApiServer, Options};
use serde_json::{Value, json};

/// What kube-apiserver answers to the ConfigMap create.
#[derive(Debug)]
enum Verdict {
    Admit,
    /// Denied with exactly this message (after the policy's prefix).
    Deny(&'static str),
    /// Denied because an expression failed (failurePolicy Fail); the message names the error.
    Error,
}

struct Case {
    name: &'static str,
    policy: Value,
    verdict: Verdict,
}

fn validations(exprs: &[&str]) -> Value {
    exprs
        .iter()
        .map(|e| json!({"expression": e}))
        .collect::<Vec<_>>()
        .into()
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "has-null",
            // A key holding null is present: `has()` tests presence, not value.
            policy: json!({"validations": validations(&["has({'a': null}.a)"])}),
            verdict: Verdict::Admit,
        },
        Case {
            name: "has-list",
            // A list has no fields: selecting one is an error, not `false`.
            policy: json!({"validations": validations(&["!has([{'a': 1}].a)"])}),
            verdict: Verdict::Error,
        },
        Case {
            name: "escapes",
            policy: json!({"validations": validations(&[
                r"'\n' != 'n' && size('\n') == 1",
                r"'\x41' == 'A' && '\u0041' == 'A' && '\101' == 'A'",
                r#"'\'' + '\\' == "'" + r'\'"#,
            ])}),
            verdict: Verdict::Admit,
        },
        Case {
            name: "int64",
            // Integers are 64-bit, not doubles: 2^53 + 1 is not 2^53.
            policy: json!({"validations": validations(&[
                "9007199254740993 != 9007199254740992",
                "9007199254740993 > 9007199254740992",
            ])}),
            verdict: Verdict::Admit,
        },
        Case {
            name: "duplicate-key",
            // The CEL spec calls a repeated key an error, but cel-go, and so kube-apiserver,
            // keeps the last value.
            policy: json!({"validations": validations(&["{'a': 1, 'a': 2}.a == 2"])}),
            verdict: Verdict::Admit,
        },
        Case {
            name: "strings-extension",
            policy: json!({"validations": validations(&[
                "'TacoCat'.lowerAscii() == 'tacocat' && 'a,b'.split(',') == ['a', 'b']",
            ])}),
            verdict: Verdict::Admit,
        },
        Case {
            name: "match-error-then-false",
            // Any condition false skips the policy, whatever errors came before it.
            policy: json!({
                "matchConditions": [
                    {"name": "errs", "expression": "[1][5] == 1"},
                    {"name": "no", "expression": "false"},
                ],
                "validations": validations(&["false"]),
            }),
            verdict: Verdict::Admit,
        },
        Case {
            name: "match-error-then-true",
            policy: json!({
                "matchConditions": [
                    {"name": "errs", "expression": "[1][5] == 1"},
                    {"name": "yes", "expression": "true"},
                ],
                "validations": validations(&["true"]),
            }),
            verdict: Verdict::Error,
        },
        Case {
            name: "ignore-error-then-false",
            // Ignore admits the failed validation only: the next one still denies.
            policy: json!({
                "failurePolicy": "Ignore",
                "validations": [
                    {"expression": "[1][5] == 1"},
                    {"expression": "false", "message": "second"},
                ],
            }),
            verdict: Verdict::Deny("second"),
        },
        Case {
            name: "ignore-match-error",
            policy: json!({
                "failurePolicy": "Ignore",
                "matchConditions": [{"name": "errs", "expression": "[1][5] == 1"}],
                "validations": validations(&["false"]),
            }),
            verdict: Verdict::Admit,
        },
        Case {
            name: "message-expression-empty",
            // An empty, non-string or failing messageExpression falls back to `message`.
            policy: json!({"validations": [
                {"expression": "false", "messageExpression": "'  '", "message": "static"},
            ]}),
            verdict: Verdict::Deny("static"),
        },
        Case {
            name: "message-expression-not-string",
            policy: json!({"validations": [
                {"expression": "false", "messageExpression": "1", "message": " padded "},
            ]}),
            verdict: Verdict::Deny("padded"),
        },
        Case {
            name: "message-expression-trimmed",
            policy: json!({"validations": [
                {"expression": "false", "messageExpression": "'  from ' + object.metadata.name + ' '"},
            ]}),
            verdict: Verdict::Deny("from c-message-expression-trimmed"),
        },
        Case {
            name: "message-expression-newline",
            policy: json!({"validations": [
                {"expression": "false", "messageExpression": r"'two\nlines'", "message": "one line"},
            ]}),
            verdict: Verdict::Deny("one line"),
        },
        Case {
            name: "message-fallback-expression",
            policy: json!({"validations": [{"expression": "  1 == 2 "}]}),
            verdict: Verdict::Deny("failed expression: 1 == 2"),
        },
        Case {
            name: "request-shape",
            // Empty string fields of the AdmissionRequest are omitted, not null.
            policy: json!({"validations": validations(&[
                "!('subResource' in request) && !('requestSubResource' in request)",
                "request.kind.kind == 'ConfigMap' && request.requestKind.kind == 'ConfigMap'",
                "request.resource.resource == 'configmaps' && request.requestResource.version == 'v1'",
                "request.namespace == 'default' && request.operation == 'CREATE'",
                "request.dryRun == false && request.userInfo.username == 'e2e-harness'",
            ])}),
            verdict: Verdict::Admit,
        },
    ]
}

#[tokio::test]
async fn policies_judge_as_kube_apiserver() {
    let s = ApiServer::start(Options::default()).await.unwrap();
    let cases = cases();
    let mut wrong = Vec::new();
    for c in &cases {
        let mut spec = c.policy.clone();
        spec["matchConstraints"] = json!({
            "resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE"], "resources": ["configmaps"]}],
            "objectSelector": {"matchLabels": {"case": c.name}},
        });
        if let Err(e) = s
            .create(json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": c.name},
                "spec": spec,
            }))
            .await
        {
            wrong.push(format!("{}: policy refused: {e}", c.name));
            continue;
        }
        s.create(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": c.name},
            "spec": {"policyName": c.name, "validationActions": ["Deny"]},
        }))
        .await
        .unwrap();
    }
    for c in &cases {
        let name = format!("c-{}", c.name);
        let got = s
            .create(json!({
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": "default", "labels": {"case": c.name}},
            }))
            .await;
        let prefix = format!(
            "configmaps {name:?} is forbidden: ValidatingAdmissionPolicy '{0}' with binding '{0}' denied request: ",
            c.name
        );
        let ok = match (&c.verdict, &got) {
            (Verdict::Admit, Ok(_)) => true,
            (Verdict::Deny(m), Err(e)) => e.to_string() == format!("{prefix}{m}"),
            (Verdict::Error, Err(e)) => {
                let e = e.to_string();
                e.starts_with(&prefix) && e.contains("error")
            }
            _ => false,
        };
        if !ok {
            wrong.push(format!(
                "{}: expected {:?}, got {:?}",
                c.name,
                c.verdict,
                got.map(|_| "admitted").map_err(|e| e.to_string())
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
