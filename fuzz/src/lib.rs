//! Fuzz target bodies. Besides "never panics", each checks properties that must hold for any
//! input; `core/tests/admission_fuzz.rs` includes this file and runs the same bodies.

use std::sync::OnceLock;

use base64::Engine as _;
use mpc_core::config::{HostConfig, Strategy};
use serde::de::IgnoredAny;
use serde_json::Value;

/// A config with a platform of each kind, so every branch of the webhook is reachable.
const CONFIG: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata:
  name: host-config
data:
  local-platforms: "linux/x86_64,linux/amd64,localhost"
  dynamic-platforms: "linux/arm64,linux/s390x"
  dynamic.linux-arm64.type: aws
  dynamic.linux-arm64.region: us-east-1
  dynamic.linux-arm64.ami: ami-1
  dynamic.linux-arm64.instance-type: m6g.large
  dynamic.linux-arm64.aws-secret: aws
  dynamic.linux-arm64.ssh-secret: ssh
  dynamic.linux-arm64.max-instances: "4"
  host.p1.address: 10.0.0.1
  host.p1.platform: linux/ppc64le
  host.p1.user: builder
  host.p1.secret: ssh
  host.p1.concurrency: "2"
"#;

fn host_config() -> &'static HostConfig {
    static CFG: OnceLock<HostConfig> = OnceLock::new();
    CFG.get_or_init(|| {
        let (data, _) = mpc_core::config::read_configmap_yaml(CONFIG).expect("embedded config");
        mpc_core::config::parse(&data).config
    })
}

/// Admission on arbitrary bytes: never panics; a decided request gets a JSON response echoing the
/// uid, whose patch applies to the received object and leaves nothing to do on reinvocation.
pub fn admission(data: &[u8]) {
    let cfg = host_config();
    let Ok(reviewed) = mpc_core::admission::review(data, cfg, 1_700_000_000) else {
        return;
    };
    let response: Value = serde_json::from_slice(&reviewed.response).expect("response is JSON");
    let text = std::str::from_utf8(data).expect("an accepted request is UTF-8");
    serde_json::from_str::<IgnoredAny>(text).expect("an accepted request is JSON");
    let Ok(request) = serde_json::from_str::<Value>(text) else {
        // JSON that a `Value` cannot hold (a lone surrogate escape, a number beyond f64) in a
        // field the webhook skips: nothing to apply the patch to. The API server sends neither.
        return;
    };
    assert_eq!(response["response"]["uid"], request["request"]["uid"]);
    let Some(patch) = response["response"]["patch"].as_str() else {
        assert_eq!(reviewed.patch_ops, 0);
        return;
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(patch)
        .expect("patch is base64");
    let ops: json_patch::Patch = serde_json::from_slice(&bytes).expect("patch is a JSON Patch");
    let mut object = request["request"]["object"].clone();
    json_patch::patch(&mut object, &ops).expect("the patch applies to the received object");
    let mut again = request;
    again["request"]["object"] = object;
    let body = serde_json::to_vec(&again).expect("re-encode");
    let second = mpc_core::admission::review(&body, cfg, 1_700_000_100)
        .expect("the patched object is readable");
    assert_eq!(second.decision, reviewed.decision);
    assert_eq!(second.patch_ops, 0, "reinvocation must not patch again");
}

/// Config parsing on arbitrary text: never panics; every named platform resolves; merging an
/// update with itself changes nothing, and merging with any previous config never loses a platform
/// the update serves.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok((data, _)) = mpc_core::config::read_configmap_yaml(text) else {
        return;
    };
    let parsed = mpc_core::config::parse(&data);
    let _ = mpc_core::config::render_report("fuzz", &parsed);
    let cfg = &parsed.config;
    for p in cfg.platforms() {
        assert!(
            !matches!(cfg.resolve(p), Strategy::Unknown),
            "{p} named but unknown"
        );
        let _ = cfg.capacity(p);
    }
    let same = mpc_core::config::keep_last_good(cfg, cfg.clone(), &parsed.diagnostics);
    if same.rejected.is_none() {
        assert_eq!(&same.config, cfg, "merging with itself changes nothing");
    }
    let merged = mpc_core::config::keep_last_good(host_config(), cfg.clone(), &parsed.diagnostics);
    if merged.rejected.is_none() {
        for p in cfg.platforms() {
            let served = |s: Strategy<'_>| !matches!(s, Strategy::Disabled(_) | Strategy::Unknown);
            if served(cfg.resolve(p)) {
                assert!(served(merged.config.resolve(p)), "{p} lost by the merge");
            }
        }
    }
}
