//! The build users of each static host, listed by the leader every interval; the scheduler
//! removes the old ones no allocation owns (leftovers of a crash or of the Go controller).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::{Input, Rounds};
use crate::config::{HostConfig, StaticHost};
use crate::controller::execute::{Context, ssh};
use crate::scheduler::Event;

/// Lists the build users of every static host every `every` and feeds them to the loop, which
/// removes the old ones no allocation owns (docs/architecture.md, "What the scheduler guarantees").
/// A host that cannot be listed is skipped until the next round; the term's end stops it.
pub async fn sweep(
    ctx: Context,
    config: tokio::sync::watch::Receiver<Option<Arc<HostConfig>>>,
    tx: mpsc::Sender<Input>,
    every: Duration,
) {
    let mut rounds = Rounds::new(&ctx, config, every);
    while let Some(cfg) = rounds.next().await {
        let hosts: BTreeMap<&str, &StaticHost> = cfg
            .static_pools
            .values()
            .flat_map(|p| &p.hosts)
            .map(|h| (h.name.as_str(), h))
            .collect();
        for host in hosts.into_values() {
            let listed = ssh::list_build_users(&ctx, host);
            let users = tokio::select! {
                () = ctx.cancel.cancelled() => return,
                r = listed => r,
            };
            match users {
                Ok(users) => {
                    let ev = Event::HostUsersListed {
                        host: host.name.clone(),
                        users,
                    };
                    if tx.send(Input::Sweep(ev)).await.is_err() {
                        return;
                    }
                }
                Err(error) => {
                    ctx.metrics.failed("list_host_users");
                    tracing::warn!(host = %host.name, %error, "listing build users failed");
                }
            }
        }
    }
}
