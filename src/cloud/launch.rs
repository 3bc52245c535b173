//! What a launch asks for: owner, tags and the idempotency token. Pure.

use base64::Engine;
use md5::{Digest, Md5};

use crate::cloud::Scope;
use crate::cloud::instance::Instance;
use crate::config::DynamicPlatform;
use crate::contract::{instance_tags, taskrun_id};

/// Tag keys of our own (beyond the compat ones in [`crate::contract::instance_tags`]).
pub mod tags {
    /// Owner key: the TaskRun uid, or the pool instance name.
    pub const OWNER: &str = "multi-platform-owner";
    /// Launch attempt number of the owner.
    pub const ATTEMPT: &str = "multi-platform-attempt";
    /// Platform label value (`linux-arm64`), so platforms sharing an instance tag stay apart.
    pub const PLATFORM: &str = "multi-platform-platform";
    /// The console name.
    pub const NAME: &str = "Name";
}

/// Longest tag value AWS accepts.
const MAX_TAG_VALUE: usize = 256;

/// Who an instance is launched for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Owner {
    /// A TaskRun of a dynamic platform (one instance per TaskRun).
    TaskRun {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// UID: tells a recreated TaskRun of the same name apart.
        uid: String,
    },
    /// An instance of a dynamic pool, named by the pool manager (unique per pool).
    PoolInstance {
        /// Instance name.
        name: String,
    },
}

impl Owner {
    /// The owner key stored in the owner tag and matched by the orphan sweep.
    pub fn key(&self) -> &str {
        match self {
            Self::TaskRun { uid, .. } => uid,
            Self::PoolInstance { name } => name,
        }
    }

    /// The compat `taskRunID` tag value: `<namespace>:<name>`, or the pool instance name (as the Go
    /// controller tags pool instances).
    pub fn taskrun_id_tag(&self) -> String {
        match self {
            Self::TaskRun {
                namespace, name, ..
            } => taskrun_id(namespace, name),
            Self::PoolInstance { name } => name.clone(),
        }
    }

    fn name_suffix(&self) -> String {
        match self {
            Self::TaskRun {
                namespace, name, ..
            } => format!("{namespace}-{name}"),
            Self::PoolInstance { name } => name.clone(),
        }
    }
}

/// One launch.
#[derive(Debug, Clone)]
pub struct LaunchRequest<'a> {
    /// Platform and account.
    pub scope: Scope<'a>,
    /// Who the instance is for.
    pub owner: Owner,
    /// The owner's launch attempt, from 1. A retried call for the same attempt never launches a
    /// second instance; a new attempt (the previous instance died) must use a new number.
    pub attempt: u32,
    /// `additional-instance-tags` of the host config.
    pub additional_tags: &'a [(String, String)],
}

/// A launched or adopted instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launched {
    /// The instance as the cloud reported it.
    pub instance: Instance,
    /// True when an instance of the same (owner, attempt) already existed and was adopted.
    pub adopted: bool,
}

/// Purchase option of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Market {
    /// On-demand.
    OnDemand,
    /// Spot.
    Spot,
}

/// The idempotency token of a launch (`ClientToken`, at most 64 ASCII characters): the same
/// (owner, attempt, market) always yields the same token. Spot and on-demand differ because the
/// cloud rejects a token reused with different parameters.
pub fn client_token(owner_key: &str, attempt: u32, market: Market) -> String {
    let mut h = Md5::new();
    h.update((owner_key.len() as u64).to_le_bytes());
    h.update(owner_key.as_bytes());
    h.update(attempt.to_le_bytes());
    let m = match market {
        Market::OnDemand => "od",
        Market::Spot => "spot",
    };
    format!("mpc-{}-{m}", hex::encode(h.finalize()))
}

/// Tags of a new instance: the compat tags, ours, then `additional` except keys we set ourselves
/// or that the cloud reserves (`aws:`), which are returned as ignored.
pub fn instance_tags(
    platform: &DynamicPlatform,
    owner: &Owner,
    attempt: u32,
    additional: &[(String, String)],
) -> (Vec<(String, String)>, Vec<String>) {
    let name = format!(
        "{}-{}-{}",
        platform.instance_tag,
        platform.platform.label_value(),
        owner.name_suffix()
    );
    let mut out: Vec<(String, String)> = vec![
        (instance_tags::MANAGED.into(), "true".into()),
        (
            instance_tags::INSTANCE.into(),
            platform.instance_tag.clone(),
        ),
        (instance_tags::TASKRUN_ID.into(), owner.taskrun_id_tag()),
        (tags::NAME.into(), truncate(&name, MAX_TAG_VALUE)),
        (tags::OWNER.into(), owner.key().to_owned()),
        (tags::ATTEMPT.into(), attempt.to_string()),
        (tags::PLATFORM.into(), platform.platform.label_value()),
    ];
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
    use crate::cloud::testing::platform;

    fn owner() -> Owner {
        Owner::TaskRun {
            namespace: "tenant".into(),
            name: "build-1".into(),
            uid: "0b9f3c1e-0000-4000-8000-000000000001".into(),
        }
    }

    #[test]
    fn client_token_is_stable_bounded_and_distinct() {
        let t = client_token(owner().key(), 1, Market::OnDemand);
        assert_eq!(t, client_token(owner().key(), 1, Market::OnDemand));
        assert!(t.len() <= 64 && t.is_ascii(), "{t}");
        assert_ne!(t, client_token(owner().key(), 2, Market::OnDemand));
        assert_ne!(t, client_token(owner().key(), 1, Market::Spot));
        assert_ne!(t, client_token("other-uid", 1, Market::OnDemand));
        let long = "x".repeat(500);
        assert!(client_token(&long, u32::MAX, Market::Spot).len() <= 64);
    }

    #[test]
    fn tags_carry_compat_and_own_keys_and_ours_win() {
        let additional = vec![
            ("team".to_owned(), "build".to_owned()),
            ("taskRunID".to_owned(), "evil:override".to_owned()),
            ("aws:cloudformation:stack".to_owned(), "x".to_owned()),
        ];
        let (tags, ignored) = instance_tags(&platform(), &owner(), 3, &additional);
        let get = |k: &str| {
            tags.iter()
                .filter(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!(get("MultiPlatformManaged"), ["true"]);
        assert_eq!(get("multi-platform-instance"), ["prod-arm64"]);
        assert_eq!(get("taskRunID"), ["tenant:build-1"]);
        assert_eq!(get(tags::OWNER), ["0b9f3c1e-0000-4000-8000-000000000001"]);
        assert_eq!(get(tags::ATTEMPT), ["3"]);
        assert_eq!(get(tags::PLATFORM), ["linux-arm64"]);
        assert_eq!(get("Name"), ["prod-arm64-linux-arm64-tenant-build-1"]);
        assert_eq!(get("team"), ["build"]);
        assert_eq!(ignored, ["taskRunID", "aws:cloudformation:stack"]);
    }

    #[test]
    fn pool_instances_use_their_name_as_taskrun_id_and_owner() {
        let o = Owner::PoolInstance {
            name: "pool-x-1".into(),
        };
        let (tags, _) = instance_tags(&platform(), &o, 1, &[]);
        assert!(tags.contains(&("taskRunID".into(), "pool-x-1".into())));
        assert!(tags.contains(&(tags::OWNER.into(), "pool-x-1".into())));
    }

    #[test]
    fn long_names_are_truncated_to_the_tag_limit() {
        let o = Owner::PoolInstance {
            name: "n".repeat(400),
        };
        let (tags, _) = instance_tags(&platform(), &o, 1, &[]);
        let name = &tags.iter().find(|(k, _)| k == "Name").unwrap().1;
        assert_eq!(name.chars().count(), MAX_TAG_VALUE);
    }

    #[test]
    fn user_data_is_base64() {
        assert_eq!(
            encode_user_data("#!/bin/sh\necho hi"),
            "IyEvYmluL3NoCmVjaG8gaGk="
        );
    }
}
