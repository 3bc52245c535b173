//! The cargo-fuzz target bodies (`fuzz/src/lib.rs`) on stable: over every fixture, and over
//! generated TaskRun shapes (absent, null and present parents; existing terms, labels, finalizers;
//! every kind of PLATFORM value), checking that each patch applies and is idempotent.

#[path = "../../fuzz/src/lib.rs"]
mod bodies;

use std::path::PathBuf;

use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// The `mpc-core` package directory; the example installation is one level up.
fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn admission_body_holds_on_every_fixture() {
    let dir = manifest_dir().join("tests/fixtures/admission");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            let bytes = std::fs::read(&p).unwrap();
            bodies::admission(&bytes);
            // Compact JSON, as the API server sends it.
            if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
                bodies::admission(&serde_json::to_vec(&v).unwrap());
            }
            n += 1;
        }
    }
    assert!(n >= 20, "fixtures found: {n}");
}

#[test]
fn config_body_holds_on_every_config_fixture() {
    let mut files = vec![
        manifest_dir().join("../examples/host-config.yaml"),
        manifest_dir().join("tests/fixtures/admission/host-config.yaml"),
    ];
    for e in std::fs::read_dir(manifest_dir().join("tests/fixtures/configmaps")).unwrap() {
        files.push(e.unwrap().path());
    }
    for f in files {
        let text = std::fs::read(&f).unwrap();
        bodies::config(&text);
        // Truncations exercise partial documents.
        for end in (0..text.len()).step_by(97) {
            bodies::config(&text[..end]);
        }
    }
}

/// Every input a fuzzing run found a failure with (`tests/fixtures/fuzz/<target>/`), fixed since.
#[test]
fn bodies_hold_on_every_input_fuzzing_found() {
    let dir = manifest_dir().join("tests/fixtures/fuzz");
    let mut n = 0;
    for (target, body) in [
        ("admission", bodies::admission as fn(&[u8])),
        ("config", bodies::config),
    ] {
        // A target without a directory has had no finding yet.
        let Ok(entries) = std::fs::read_dir(dir.join(target)) else {
            continue;
        };
        for e in entries {
            body(&std::fs::read(e.unwrap().path()).unwrap());
            n += 1;
        }
    }
    assert!(n >= 1, "regression inputs found: {n}");
}

/// Absent, `null`, or a value.
fn maybe(inner: impl Strategy<Value = Value> + 'static) -> BoxedStrategy<Option<Value>> {
    prop_oneof![Just(None), Just(Some(Value::Null)), inner.prop_map(Some)].boxed()
}

fn put(obj: &mut Map<String, Value>, key: &str, v: Option<Value>) {
    if let Some(v) = v {
        obj.insert(key.to_owned(), v);
    }
}

fn string_map(keys: &'static [&'static str]) -> impl Strategy<Value = Value> {
    prop::collection::btree_map(
        prop::sample::select(keys),
        prop::sample::select(&["linux-arm64", "localhost", "x", "1699990000"][..]),
        0..4,
    )
    .prop_map(|m| json!(m))
}

fn requirement() -> impl Strategy<Value = Value> {
    prop::sample::select(
        &[
            ("kubernetes.io/os", "In", "linux"),
            ("kubernetes.io/arch", "In", "amd64"),
            ("kubernetes.io/arch", "In", "arm64"),
            ("kubernetes.io/os", "NotIn", "windows"),
            ("topology.kubernetes.io/zone", "In", "a"),
        ][..],
    )
    .prop_map(|(k, op, v)| json!({"key": k, "operator": op, "values": [v]}))
}

fn term() -> impl Strategy<Value = Value> {
    (
        maybe(prop::collection::vec(requirement(), 0..3).prop_map(Value::Array)),
        any::<bool>(),
    )
        .prop_map(|(exprs, fields)| {
            let mut t = Map::new();
            put(&mut t, "matchExpressions", exprs);
            if fields {
                t.insert(
                    "matchFields".into(),
                    json!([{"key": "metadata.name", "operator": "In", "values": ["n1"]}]),
                );
            }
            Value::Object(t)
        })
}

fn pod_template() -> impl Strategy<Value = Value> {
    let terms = maybe(prop::collection::vec(term(), 0..4).prop_map(Value::Array));
    let required = maybe(terms.prop_map(|t| {
        let mut m = Map::new();
        put(&mut m, "nodeSelectorTerms", t);
        Value::Object(m)
    }));
    let node_affinity = maybe(required.prop_map(|r| {
        let mut m = Map::new();
        put(&mut m, "requiredDuringSchedulingIgnoredDuringExecution", r);
        Value::Object(m)
    }));
    let affinity = maybe(node_affinity.prop_map(|na| {
        let mut m = Map::new();
        put(&mut m, "nodeAffinity", na);
        m.insert("podAntiAffinity".into(), json!({}));
        Value::Object(m)
    }));
    (affinity, any::<bool>()).prop_map(|(a, tolerations)| {
        let mut m = Map::new();
        put(&mut m, "affinity", a);
        if tolerations {
            m.insert(
                "tolerations".into(),
                json!([{"key": "k", "operator": "Exists"}]),
            );
        }
        Value::Object(m)
    })
}

fn platform_value() -> impl Strategy<Value = Value> {
    prop::sample::select(
        &[
            "linux/amd64",
            "linux/x86_64",
            "localhost",
            "linux/arm64",
            "linux/s390x",
            "linux/ppc64le",
            "linux/riscv64",
            "linux/AMD64",
            "",
            "[\"linux/arm64\"]",
            "{\"a\":1}",
            "5",
        ][..],
    )
    .prop_map(|s| serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_owned())))
}

fn taskrun() -> impl Strategy<Value = Value> {
    let labels = maybe(string_map(
        &[
            "build.appstudio.redhat.com/target-platform",
            "build.appstudio.redhat.com/assigned-host",
            "app",
        ][..],
    ));
    let annotations = maybe(string_map(
        &["build.appstudio.redhat.com/allocation-start-time", "note"][..],
    ));
    let finalizers = maybe(
        prop::collection::vec(
            prop::sample::select(
                &["appstudio.io/multi-platform-finalizer", "chains.tekton.dev"][..],
            )
            .prop_map(|s| json!(s)),
            0..3,
        )
        .prop_map(Value::Array),
    );
    let status = maybe(
        prop::sample::select(&["TaskRunPending", "TaskRunCancelled"][..]).prop_map(|s| json!(s)),
    );
    let inline = prop::option::of(any::<bool>());
    (
        any::<bool>(),
        labels,
        annotations,
        finalizers,
        platform_value(),
        maybe(pod_template()),
        status,
        inline,
    )
        .prop_map(
            |(has_meta, labels, annotations, finalizers, platform, pt, status, inline)| {
                let mut meta = Map::new();
                put(&mut meta, "labels", labels);
                put(&mut meta, "annotations", annotations);
                put(&mut meta, "finalizers", finalizers);
                let mut spec = Map::new();
                spec.insert(
                    "params".into(),
                    json!([{"name": "IMAGE", "value": "x"}, {"name": "PLATFORM", "value": platform}]),
                );
                put(&mut spec, "podTemplate", pt);
                put(&mut spec, "status", status);
                if let Some(with_secret) = inline {
                    let secret = if with_secret {
                        "multi-platform-ssh-$(context.taskRun.name)"
                    } else {
                        "other"
                    };
                    spec.insert(
                        "taskSpec".into(),
                        json!({"steps": [{"name": "s", "script": "true"}],
                               "volumes": [{"name": "ssh", "secret": {"secretName": secret}}]}),
                    );
                }
                let mut obj = Map::new();
                obj.insert("apiVersion".into(), json!("tekton.dev/v1"));
                obj.insert("kind".into(), json!("TaskRun"));
                if has_meta {
                    obj.insert("metadata".into(), Value::Object(meta));
                }
                obj.insert("spec".into(), Value::Object(spec));
                Value::Object(obj)
            },
        )
}

proptest! {
    #[test]
    fn generated_taskruns_get_applicable_idempotent_patches(object in taskrun()) {
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "u",
                "kind": {"group": "tekton.dev", "version": "v1", "kind": "TaskRun"},
                "operation": "CREATE",
                "namespace": "ns",
                "object": object,
            }
        });
        let body = serde_json::to_vec(&review).unwrap();
        // Well-formed objects are always decided, never rejected as malformed.
        prop_assert!(mpc_core::admission::review(&body, &mpc_core::config::HostConfig::default(), 0).is_ok());
        bodies::admission(&body);
    }
}
