//! `kubectl` helpers: the runner itself lives with the test API server
//! ([`e2e_apiserver::kubectl`]); what renders the shipped manifests lives here.

use std::path::Path;

use serde_json::Value;

pub use e2e_apiserver::kubectl::{Kubectl, Out, kustomize};

/// The MutatingWebhookConfiguration as `kubectl kustomize manifests/` renders it (its Service and
/// namespaces are kustomize vars), with `ca_bundle` (base64, as `mpc certs` writes it) as every
/// webhook's `caBundle`, as one of the ways in `webhook-certs/` fills it in.
pub fn shipped_webhook_configuration(ca_bundle: &str) -> Value {
    let manifests = Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests");
    let mut config = kustomize(&manifests)
        .into_iter()
        .find(|d| d["kind"] == "MutatingWebhookConfiguration")
        .expect("manifests/ render a MutatingWebhookConfiguration");
    let bundle = ca_bundle.trim().to_owned();
    for webhook in config["webhooks"]
        .as_array_mut()
        .expect("the configuration lists its webhooks")
    {
        webhook["clientConfig"]["caBundle"] = Value::String(bundle.clone());
    }
    config
}
