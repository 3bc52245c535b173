//! The instances of each dynamic platform and pool, listed by the leader: once for recovery
//! ([`list_all`]) and then every interval ([`sweep`]: orphans, instances gone behind its back,
//! other clusters' instances counted against `max-instances`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::{Input, Rounds};
use crate::config::{DynamicPlatform, HostConfig};
use crate::controller::execute::{Context, cloud};
use crate::platform::Platform;
use crate::scheduler::{Event, InstanceRecord};

/// Every dynamic platform and pool of `config`, with its instance template.
fn templates(config: &HostConfig) -> Vec<(Platform, DynamicPlatform)> {
    config
        .dynamic
        .iter()
        .map(|(p, d)| (p.clone(), d.clone()))
        .chain(
            config
                .pools
                .iter()
                .map(|(p, pool)| (p.clone(), pool.instance.clone())),
        )
        .collect()
}

/// Every instance the dynamic platforms' credentials can see (recovery's listing), and the
/// platforms whose listing kept failing after a few tries: those are recovered as "unlisted"
/// (their TaskRuns held as recorded, no launches) until the periodic listing of them succeeds.
/// Going on without a platform's listing as if it were empty would take its running instances
/// for orphans and relaunch its builds. `None` when the term is cancelled.
pub async fn list_all(
    ctx: &Context,
    config: &HostConfig,
) -> Option<(Vec<InstanceRecord>, Vec<Platform>)> {
    let mut all = Vec::new();
    let mut unlisted = Vec::new();
    for (platform, t) in templates(config) {
        let mut delay = Duration::from_millis(500);
        for attempt in 1..=5 {
            if ctx.cancel.is_cancelled() {
                return None;
            }
            if let Some(l) = cloud::list(ctx, &platform, &t).await {
                all.extend(l);
                break;
            }
            if attempt == 5 {
                tracing::error!(
                    %platform,
                    "recovering without this platform's instance listing: its TaskRuns are held \
                     as recorded, and nothing is launched for it, until a listing succeeds"
                );
                unlisted.push(platform.clone());
                break;
            }
            tokio::time::sleep(delay).await;
            delay *= 2;
        }
    }
    Some((all, unlisted))
}

/// Lists every dynamic platform's instances every `every` and feeds them to the loop (orphans,
/// instances gone behind our back, other clusters' instances for the bill guard), until the term
/// ends.
pub async fn sweep(
    ctx: Context,
    config: tokio::sync::watch::Receiver<Option<Arc<HostConfig>>>,
    tx: mpsc::Sender<Input>,
    every: Duration,
) {
    let mut rounds = Rounds::new(&ctx, config, every);
    while let Some(cfg) = rounds.next().await {
        for (platform, t) in templates(&cfg) {
            if let Some(instances) = cloud::list(&ctx, &platform, &t).await {
                let ev = Event::InstancesListed {
                    platform: platform.clone(),
                    instances,
                };
                if tx.send(Input::Sweep(ev)).await.is_err() {
                    return;
                }
            }
        }
    }
}
