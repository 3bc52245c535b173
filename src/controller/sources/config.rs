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
        let drained_before = source.current().map(|c| c.drained_summary());
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
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("ConfigMap".into()),
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            ..Default::default()
        };
        if let Some(cfg) = source.current()
            && let Some((reason, message)) =
                drain_note(drained_before.as_deref(), &cfg.drained_summary())
        {
            let note = events::Note {
                reference: reference.clone(),
                warning: false,
                reason,
                message,
            };
            events::publish(&recorder, &note).await;
        }
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
        let note = events::Note {
            reference,
            warning: true,
            reason: "InvalidConfig",
            message,
        };
        events::publish(&recorder, &note).await;
    }
}

/// The Normal Event a served config that changes what is drained gets (on the host-config
/// ConfigMap): `Drained` naming everything drained now, or `DrainLifted` once nothing is.
/// `before` is what the config served until then drained (`None`: no config yet).
fn drain_note(before: Option<&[String]>, now: &[String]) -> Option<(&'static str, String)> {
    if before.unwrap_or_default() == now {
        return None;
    }
    if now.is_empty() {
        return Some((
            "DrainLifted",
            "no build host or platform is drained any more: new TaskRuns go everywhere again"
                .into(),
        ));
    }
    Some((
        "Drained",
        format!(
            "drained: {}. No new TaskRun goes there; builds running there finish and are cleaned up (see the host_drained and platform_drained metrics)",
            now.join(", ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::drain_note;

    #[test]
    fn a_change_of_what_is_drained_is_noted_once() {
        let h1 = vec!["host h1 (linux/arm64)".to_owned()];
        let both = vec![
            "host h1 (linux/arm64)".to_owned(),
            "linux/amd64 (dynamic)".to_owned(),
        ];
        assert_eq!(drain_note(None, &[]), None, "nothing drained at the start");
        let (reason, message) = drain_note(None, &h1).unwrap();
        assert_eq!(reason, "Drained");
        assert!(
            message.starts_with("drained: host h1 (linux/arm64). "),
            "{message}"
        );
        assert_eq!(drain_note(Some(&h1), &h1), None, "unchanged: no new Event");
        let (_, message) = drain_note(Some(&h1), &both).unwrap();
        assert!(
            message.contains("host h1 (linux/arm64), linux/amd64 (dynamic)"),
            "{message}"
        );
        assert_eq!(drain_note(Some(&both), &[]).unwrap().0, "DrainLifted");
    }
}
