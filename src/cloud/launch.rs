//! The identity of launches: this cluster's id, the tags an instance carries, and the idempotency
//! token, all derived from the scheduler's [`LaunchId`]. Pure.

use std::fmt;

use base64::Engine;
use md5::{Digest, Md5};

use crate::cloud::Scope;
use crate::cloud::instance::{Instance, tags};
use crate::config::DynamicPlatform;
use crate::contract::instance_tags;
use crate::scheduler::{LaunchId, LaunchOwner, Ownership};

/// Longest tag value AWS accepts.
const MAX_TAG_VALUE: usize = 256;
/// Longest cluster id: short enough for a tag value and a log line.
const MAX_CLUSTER_ID: usize = 63;

/// This cluster's identity, tagged on every instance it launches (`multi-platform-cluster`).
/// Clusters sharing an account, region and `instance-tag` tell their instances apart by it:
/// each adopts, retags and terminates only its own. 1 to 63 characters of `A-Z a-z 0-9 . _ -`,
/// starting with a letter or digit (`stone-prod-p01`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClusterId(String);

/// Why a cluster id is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cluster id {value:?} is invalid: {reason}")]
pub struct ClusterIdError {
    /// The value given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl ClusterId {
    /// Validates a cluster id.
    pub fn new(value: &str) -> Result<Self, ClusterIdError> {
        let err = |reason| ClusterIdError {
            value: value.to_owned(),
            reason,
        };
        if value.is_empty() {
            return Err(err("it is empty"));
        }
        if value.len() > MAX_CLUSTER_ID {
            return Err(err("it is longer than 63 characters"));
        }
        if !value.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            return Err(err("it must start with a letter or digit"));
        }
        if !value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(err("only letters, digits, '.', '_' and '-' are allowed"));
        }
        Ok(Self(value.to_owned()))
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who launched an instance, by its cluster tag.
pub fn ownership(i: &Instance, cluster: &ClusterId) -> Ownership {
    match i.tag(tags::CLUSTER) {
        Some(c) if c == cluster.as_str() => Ownership::Ours,
        Some(_) => Ownership::Foreign,
        None => Ownership::Untagged,
    }
}

/// One launch.
#[derive(Debug, Clone)]
pub struct LaunchRequest<'a> {
    /// Platform and account.
    pub scope: Scope<'a>,
    /// Who the instance is for and which try: a repeated request with the same id never launches
    /// a second instance.
    pub launch: &'a LaunchId,
    /// `additional-instance-tags` of the host config.
    pub additional_tags: &'a [(String, String)],
}

/// What a launch found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchOutcome {
    /// A new instance was started.
    Launched(Instance),
    /// An earlier try of the same launch started this instance, and it is alive: use it.
    Adopted(Instance),
    /// An earlier try of the same launch started this instance and it is gone (shutting down,
    /// stopped or terminated): never adopted; the scheduler launches the next attempt.
    Spent(Instance),
}

impl LaunchOutcome {
    /// The instance concerned.
    pub fn instance(&self) -> &Instance {
        match self {
            Self::Launched(i) | Self::Adopted(i) | Self::Spent(i) => i,
        }
    }
}

/// Purchase option of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Market {
    /// On-demand.
    OnDemand,
    Spot,
}

/// The idempotency token of a launch (`ClientToken`, at most 64 ASCII characters): the same
/// (cluster, launch id, market) always yields the same token, in this process or the next.
/// Tokens are scoped to the account and region, which clusters share: the cluster is part of it.
/// Spot and on-demand differ because the cloud rejects a token reused with other parameters.
pub fn client_token(cluster: &ClusterId, launch: &LaunchId, market: Market) -> String {
    let mut h = Md5::new();
    for part in [
        cluster.as_str(),
        launch.owner_key().as_str(),
        launch.attempt_tag().as_str(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let m = match market {
        Market::OnDemand => "od",
        Market::Spot => "spot",
    };
    format!("mpc-{}-{m}", hex::encode(h.finalize()))
}

/// The tags naming an instance's owner (set at launch, replaced by a retag): `taskRunID`,
/// owner, attempt and `Name`.
pub fn owner_tags(platform: &DynamicPlatform, launch: &LaunchId) -> Vec<(String, String)> {
    let suffix = match &launch.owner {
        LaunchOwner::TaskRun(t) => format!("{}-{}", t.namespace(), t.name()),
        LaunchOwner::Warm(name) => name.to_string(),
    };
    let name = format!(
        "{}-{}-{suffix}",
        platform.instance_tag,
        platform.platform.label_value(),
    );
    vec![
        (instance_tags::TASKRUN_ID.into(), launch.taskrun_id()),
        (tags::OWNER.into(), launch.owner_key()),
        (tags::ATTEMPT.into(), launch.attempt_tag()),
        (tags::NAME.into(), truncate(&name, MAX_TAG_VALUE)),
    ]
}

/// Tags of a new instance: the compat tags, ours (cluster, platform, owner), then `additional`
/// except keys we set ourselves or that the cloud reserves (`aws:`), which are returned as
/// ignored.
pub fn instance_tags(
    cluster: &ClusterId,
    platform: &DynamicPlatform,
    launch: &LaunchId,
    additional: &[(String, String)],
) -> (Vec<(String, String)>, Vec<String>) {
    let mut out: Vec<(String, String)> = vec![
        (instance_tags::MANAGED.into(), "true".into()),
        (
            instance_tags::INSTANCE.into(),
            platform.instance_tag.clone(),
        ),
        (tags::CLUSTER.into(), cluster.as_str().to_owned()),
        (tags::PLATFORM.into(), platform.platform.label_value()),
    ];
    out.extend(owner_tags(platform, launch));
    let mut ignored = Vec::new();
    for (k, v) in additional {
        if out.iter().any(|(ours, _)| ours == k) || k.to_ascii_lowercase().starts_with("aws:") {
            ignored.push(k.clone());
        } else {
            out.push((k.clone(), v.clone()));
        }
    }
    (out, ignored)
}

/// User data as the cloud wants it: base64 of the raw script.
pub fn encode_user_data(raw: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(raw.as_bytes())
}

fn truncate(s: &str, max_chars: usize) -> String {
    s.chars().take(max_chars).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::testing::{launch_id, platform};

    fn cluster() -> ClusterId {
        ClusterId::new("stone-prod-p01").unwrap()
    }

    #[test]
    fn cluster_ids_are_validated_naming_the_value() {
        for ok in ["stone-prod-p01", "a", "kflux.ocp-p01_x", &"x".repeat(63)] {
            assert_eq!(ClusterId::new(ok).unwrap().as_str(), ok);
        }
        for (bad, why) in [
            ("", "empty"),
            (&"x".repeat(64), "longer than 63"),
            ("-prod", "start with a letter or digit"),
            ("prod p01", "only letters"),
            ("prod/p01", "only letters"),
        ] {
            let e = ClusterId::new(bad).unwrap_err();
            assert!(e.to_string().contains(why), "{bad:?}: {e}");
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn client_token_is_stable_bounded_and_distinct() {
        let c = cluster();
        let l = launch_id("uid-1", 0, 1);
        let t = client_token(&c, &l, Market::OnDemand);
        assert_eq!(
            t,
            client_token(&c, &launch_id("uid-1", 0, 1), Market::OnDemand)
        );
        assert!(t.len() <= 64 && t.is_ascii(), "{t}");
        assert_ne!(
            t,
            client_token(&c, &launch_id("uid-1", 0, 2), Market::OnDemand)
        );
        assert_ne!(
            t,
            client_token(&c, &launch_id("uid-1", 1, 1), Market::OnDemand)
        );
        assert_ne!(t, client_token(&c, &l, Market::Spot));
        assert_ne!(
            t,
            client_token(&c, &launch_id("uid-2", 0, 1), Market::OnDemand)
        );
        let other = ClusterId::new("stone-prod-p02").unwrap();
        assert_ne!(t, client_token(&other, &l, Market::OnDemand));
        // No ambiguity between fields: retry 1 attempt 11 is not retry 11 attempt 1.
        assert_ne!(
            client_token(&c, &launch_id("u", 1, 11), Market::OnDemand),
            client_token(&c, &launch_id("u", 11, 1), Market::OnDemand)
        );
        let long = launch_id(&"x".repeat(500), u32::MAX, u32::MAX);
        assert!(client_token(&c, &long, Market::Spot).len() <= 64);
    }

    #[test]
    fn tags_carry_compat_and_own_keys_and_ours_win() {
        let additional = vec![
            ("team".to_owned(), "build".to_owned()),
            ("taskRunID".to_owned(), "evil:override".to_owned()),
            (tags::CLUSTER.to_owned(), "someone-else".to_owned()),
            ("aws:cloudformation:stack".to_owned(), "x".to_owned()),
        ];
        let l = launch_id("0b9f3c1e-0000-4000-8000-000000000001", 2, 3);
        let (tags, ignored) = instance_tags(&cluster(), &platform(), &l, &additional);
        let get = |k: &str| {
            tags.iter()
                .filter(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(get("MultiPlatformManaged"), ["true"]);
        assert_eq!(get("multi-platform-instance"), ["prod-arm64"]);
        assert_eq!(get(tags::CLUSTER), ["stone-prod-p01"]);
        assert_eq!(get("taskRunID"), ["tenant:build-1"]);
        assert_eq!(get(tags::OWNER), ["0b9f3c1e-0000-4000-8000-000000000001"]);
        assert_eq!(get(tags::ATTEMPT), ["2.3"]);
        assert_eq!(get(tags::PLATFORM), ["linux-arm64"]);
        assert_eq!(get("Name"), ["prod-arm64-linux-arm64-tenant-build-1"]);
        assert_eq!(get("team"), ["build"]);
        assert_eq!(
            ignored,
            ["taskRunID", tags::CLUSTER, "aws:cloudformation:stack"]
        );
    }

    #[test]
    fn warm_instances_use_their_name_as_taskrun_id_and_owner() {
        let l = LaunchId {
            owner: LaunchOwner::Warm("warm-1700000000000-3".into()),
            retry: 0,
            attempt: 1,
        };
        let (tags, _) = instance_tags(&cluster(), &platform(), &l, &[]);
        assert!(tags.contains(&("taskRunID".into(), "warm-1700000000000-3".into())));
        assert!(tags.contains(&(tags::OWNER.into(), "warm-1700000000000-3".into())));
        assert!(tags.contains(&(tags::ATTEMPT.into(), "0.1".into())));
    }

    #[test]
    fn long_names_are_truncated_to_the_tag_limit() {
        let l = LaunchId {
            owner: LaunchOwner::Warm("n".repeat(400).into()),
            retry: 0,
            attempt: 1,
        };
        let tags = owner_tags(&platform(), &l);
        let name = &tags.iter().find(|(k, _)| k == "Name").unwrap().1;
        assert_eq!(name.chars().count(), MAX_TAG_VALUE);
    }

    #[test]
    fn ownership_follows_the_cluster_tag() {
        let mut i = crate::cloud::testing::instance("i-1");
        let c = cluster();
        assert_eq!(ownership(&i, &c), Ownership::Untagged);
        i.tags.insert(tags::CLUSTER.into(), "stone-prod-p02".into());
        assert_eq!(ownership(&i, &c), Ownership::Foreign);
        i.tags.insert(tags::CLUSTER.into(), "stone-prod-p01".into());
        assert_eq!(ownership(&i, &c), Ownership::Ours);
    }

    #[test]
    fn user_data_is_base64() {
        assert_eq!(
            encode_user_data("#!/bin/sh\necho hi"),
            "IyEvYmluL3NoCmVjaG8gaGk="
        );
    }
}
