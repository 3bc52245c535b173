//! Orphan sweep: terminate tagged instances that no live allocation owns, after a grace period.
//!
//! [`select_orphans`] is the pure decision; [`sweep`] lists, decides and terminates through a
//! [`Cloud`].

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use crate::cloud::metrics::CloudMetrics;
use crate::cloud::{Cloud, CloudError, Instance, InstanceState, Scope, Terminated};
use crate::contract::taskrun_id;

/// Owner keys of live allocations, as the scheduler's ledger knows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveOwners {
    keys: HashSet<String>,
}

impl LiveOwners {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a live TaskRun: its uid (our owner tag) and `<namespace>:<name>` (the only owner tag
    /// on instances the Go controller launched).
    pub fn add_taskrun(&mut self, namespace: &str, name: &str, uid: &str) {
        self.keys.insert(uid.to_owned());
        self.keys.insert(taskrun_id(namespace, name));
    }

    /// Adds a live dynamic-pool instance by its name.
    pub fn add_pool_instance(&mut self, name: &str) {
        self.keys.insert(name.to_owned());
    }

    /// True when `key` belongs to a live allocation.
    pub fn contains(&self, key: &str) -> bool {
        self.keys.contains(key)
    }
}

/// The instances to terminate: not already going away, older than `grace` at `now`, and owned by
/// nobody in `live`. Instances without a launch time are kept (their age cannot be told).
pub fn select_orphans<'a>(
    instances: &'a [Instance],
    live: &LiveOwners,
    now: SystemTime,
    grace: Duration,
) -> Vec<&'a Instance> {
    instances
        .iter()
        .filter(|i| {
            !matches!(
                i.state,
                InstanceState::ShuttingDown | InstanceState::Terminated
            )
        })
        .filter(|i| i.age(now).is_some_and(|age| age >= grace))
        .filter(|i| !i.owner_key().is_some_and(|k| live.contains(k)))
        .collect()
}

/// What one sweep did.
#[derive(Debug, Default)]
pub struct SweepReport {
    /// Instances examined.
    pub examined: usize,
    /// Orphans terminated (or found already gone).
    pub terminated: Vec<String>,
    /// Orphans whose termination failed; the next sweep tries again.
    pub failed: Vec<(String, CloudError)>,
}

/// Lists the scope's instances, terminates the orphans among them, logs and counts each.
pub async fn sweep(
    cloud: &dyn Cloud,
    scope: Scope<'_>,
    live: &LiveOwners,
    now: SystemTime,
    grace: Duration,
    metrics: &CloudMetrics,
) -> Result<SweepReport, CloudError> {
    let instances = cloud.list(scope).await?;
    let orphans = select_orphans(&instances, live, now, grace);
    let platform = scope.platform.platform.as_str();
    let results = futures::future::join_all(
        orphans
            .iter()
            .map(|i| async move { (i, cloud.terminate(scope, &i.id).await) }),
    )
    .await;
    let mut report = SweepReport {
        examined: instances.len(),
        ..SweepReport::default()
    };
    for (i, result) in results {
        let owner = i.owner_key().unwrap_or("");
        let age_s = i.age(now).unwrap_or_default().as_secs();
        match result {
            Ok(outcome) => {
                tracing::warn!(
                    platform,
                    instance = %i.id,
                    owner,
                    taskrun_id = i.taskrun_id().unwrap_or(""),
                    age_s,
                    already_gone = outcome == Terminated::AlreadyGone,
                    "terminated orphaned instance"
                );
                metrics.orphan_terminated(platform);
                report.terminated.push(i.id.clone());
            }
            Err(e) => {
                tracing::error!(platform, instance = %i.id, owner, error = %e, "could not terminate orphaned instance");
                report.failed.push((i.id.clone(), e));
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::launch::tags;
    use crate::contract::instance_tags;
    use std::collections::BTreeMap;

    const NOW: u64 = 1_000_000;

    fn inst(id: &str, state: InstanceState, age_s: Option<u64>, tags: &[(&str, &str)]) -> Instance {
        Instance {
            id: id.into(),
            state,
            launch_time: age_s.map(|a| SystemTime::UNIX_EPOCH + Duration::from_secs(NOW - a)),
            instance_type: "t3.micro".into(),
            private_ip: None,
            public_ip: None,
            public_dns: None,
            spot: false,
            tags: tags
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn selects_only_old_unowned_live_instances() {
        use InstanceState::*;
        let grace = Duration::from_secs(600);
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(NOW);
        let mut live = LiveOwners::new();
        live.add_taskrun("ns", "alive", "uid-alive");
        live.add_taskrun("ns", "legacy-alive", "uid-legacy");
        live.add_pool_instance("pool-1");
        let o = tags::OWNER;
        let t = instance_tags::TASKRUN_ID;
        let instances = vec![
            inst(
                "owned",
                Running,
                Some(7200),
                &[(o, "uid-alive"), (t, "ns:alive")],
            ),
            inst(
                "orphan",
                Running,
                Some(7200),
                &[(o, "uid-dead"), (t, "ns:dead")],
            ),
            // Same name as a live TaskRun but an older uid: a deleted and recreated TaskRun.
            inst(
                "recreated",
                Running,
                Some(7200),
                &[(o, "uid-old"), (t, "ns:alive")],
            ),
            inst("young-orphan", Pending, Some(30), &[(o, "uid-dead2")]),
            inst(
                "legacy-owned",
                Running,
                Some(7200),
                &[(t, "ns:legacy-alive")],
            ),
            inst("legacy-orphan", Running, Some(7200), &[(t, "ns:gone")]),
            inst("pool-owned", Running, Some(7200), &[(o, "pool-1")]),
            inst("stopped-orphan", Stopped, Some(7200), &[(o, "uid-x")]),
            inst("already-going", ShuttingDown, Some(7200), &[(o, "uid-y")]),
            inst("no-owner", Running, Some(7200), &[]),
            inst("no-launch-time", Running, None, &[(o, "uid-z")]),
            inst("exactly-grace", Running, Some(600), &[(o, "uid-w")]),
        ];
        let ids: Vec<_> = select_orphans(&instances, &live, now, grace)
            .into_iter()
            .map(|i| i.id.as_str())
            .collect();
        assert_eq!(
            ids,
            [
                "orphan",
                "recreated",
                "legacy-orphan",
                "stopped-orphan",
                "no-owner",
                "exactly-grace"
            ]
        );
    }
}
