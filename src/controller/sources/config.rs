//! The host-config ConfigMap: watched by every replica (unless the config comes from a file),
//! published to the webhook through [`ConfigSource`], and forwarded to the loop.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::events::Recorder;
use kube::runtime::watcher;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::Input;
use crate::config_source::{ConfigSource, Update};
use crate::controller::events;

/// Hands every config the source publishes to the loop, until `stop`.
pub async fn forward(
    mut rx: watch::Receiver<Option<Arc<crate::config::HostConfig>>>,
    tx: mpsc::Sender<Input>,
    stop: CancellationToken,
) {
    loop {
        let current = rx.borrow_and_update().clone();
        if let Some(cfg) = current
            && tx.send(Input::Config(cfg)).await.is_err()
        {
            return;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            r = rx.changed() => if r.is_err() { return },
        }
    }
}

/// Watches the host-config ConfigMap and publishes it; problems are reported as Events on it.
pub async fn watch_config_map(
    client: kube::Client,
    namespace: String,
    recorder: Recorder,
    name: String,
    source: ConfigSource,
    stop: CancellationToken,
) {
    use kube::runtime::WatchStreamExt;
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, &namespace);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(api, cfg).default_backoff().boxed();
    let origin = format!("ConfigMap {namespace}/{name}");
    loop {
        let next = tokio::select! {
            () = stop.cancelled() => return,
            n = stream.next() => n,
        };
        let update = match next {
            Some(Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm))) => {
                let mut diagnostics = Vec::new();
                if cm.binary_data.as_ref().is_some_and(|b| !b.is_empty()) {
                    diagnostics.push(crate::config::Diagnostic {
                        severity: crate::config::Severity::Error,
                        key: "binaryData".into(),
                        value: None,
                        message: "binaryData is ignored: host-config keys must be in data".into(),
                    });
                }
                source.publish(&origin, cm.data.unwrap_or_default(), diagnostics)
            }
            Some(Ok(watcher::Event::Delete(_))) => {
                source.publish_failure(&origin, "the ConfigMap was deleted")
            }
            Some(Ok(_)) => continue,
            Some(Err(error)) => {
                tracing::warn!(%error, "host-config watch error; retrying");
                continue;
            }
            None => return,
        };
        let message = match update {
            Update::Applied { errors, kept } if errors > 0 || !kept.is_empty() => format!(
                "host-config has {errors} error(s); entries kept from the previous config: {}. Run `mpc check-config` on it for details.",
                if kept.is_empty() {
                    "none".to_owned()
                } else {
                    kept.join("; ")
                }
            ),
            Update::Rejected(why) => {
                format!("host-config not applied, the previous config keeps serving: {why}")
            }
            _ => continue,
        };
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("ConfigMap".into()),
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            ..Default::default()
        };
        let note = events::Note {
            reference,
            warning: true,
            reason: "InvalidConfig",
            message,
        };
        events::publish(&recorder, &note).await;
    }
}
