//! What the cloud says about one instance: state, addresses, tags, and who launched it. Pure.
//!
//! States are the scheduler's [`InstanceState`] (one enum, one meaning of gone); this module only
//! maps the cloud's names onto it.

use std::collections::BTreeMap;
use std::time::SystemTime;

use crate::config::DynamicPlatform;
use crate::contract::instance_tags;
use crate::platform::Platform;
use crate::scheduler::{InstanceRecord, InstanceState, Ownership, Time};

/// Tag keys of our own (beyond the compat ones in [`crate::contract::instance_tags`]).
pub mod tags {
    /// The cluster that launched the instance ([`ClusterId`](crate::cloud::ClusterId)).
    pub const CLUSTER: &str = "multi-platform-cluster";
    /// Owner key: the TaskRun UID, or the warm pool instance's name.
    pub const OWNER: &str = "multi-platform-owner";
    /// `<retry>.<attempt>` of the owner's launch.
    pub const ATTEMPT: &str = "multi-platform-attempt";
    /// Platform label value (`linux-arm64`), so platforms sharing an instance tag stay apart.
    pub const PLATFORM: &str = "multi-platform-platform";
    /// The console name.
    pub const NAME: &str = "Name";
}

/// Maps an EC2 state name (`pending`, `running`, `shutting-down`, ...); names this version does
/// not know map to [`InstanceState::Unknown`].
pub fn state_from_name(name: &str) -> InstanceState {
    InstanceState::ALL
        .into_iter()
        .find(|s| *s != InstanceState::Unknown && s.as_str() == name)
        .unwrap_or(InstanceState::Unknown)
}

/// One instance as the cloud reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Instance id.
    pub id: String,
    /// Lifecycle state.
    pub state: InstanceState,
    /// Launch time, if the cloud reported one.
    pub launch_time: Option<SystemTime>,
    pub instance_type: String,
    /// Private IPv4 address.
    pub private_ip: Option<String>,
    /// Public IPv4 address.
    pub public_ip: Option<String>,
    /// Public DNS name.
    pub public_dns: Option<String>,
    /// Launched as a spot instance.
    pub spot: bool,
    pub tags: BTreeMap<String, String>,
    /// Who launched it, by its cluster tag, as seen by the provider that reported it.
    pub ownership: Ownership,
}

impl Instance {
    /// The address to reach the instance at: public DNS name, else public IP, else (unless
    /// `strict_public`) the private IP. `None` while the cloud has not assigned one.
    pub fn address(&self, strict_public: bool) -> Option<&str> {
        let public = self.public_dns.as_deref().or(self.public_ip.as_deref());
        if strict_public {
            public
        } else {
            public.or(self.private_ip.as_deref())
        }
    }

    /// Our owner tag: the TaskRun UID or warm instance name it was launched (or retagged) for.
    pub fn owner_key(&self) -> Option<&str> {
        self.tag(tags::OWNER)
    }

    /// The `taskRunID` tag (`<namespace>:<name>`).
    pub fn taskrun_id(&self) -> Option<&str> {
        self.tag(instance_tags::TASKRUN_ID)
    }

    /// Our attempt tag (`<retry>.<attempt>`).
    pub fn attempt(&self) -> Option<&str> {
        self.tag(tags::ATTEMPT)
    }

    /// The platform label value recorded in our tag (absent on instances the Go controller launched).
    pub fn platform_label(&self) -> Option<&str> {
        self.tag(tags::PLATFORM)
    }

    /// A tag value.
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.tags.get(key).map(String::as_str)
    }

    /// Carries the managed tag and `platform`'s instance tag.
    pub fn has_platform_tags(&self, platform: &DynamicPlatform) -> bool {
        self.tag(instance_tags::MANAGED) == Some("true")
            && self.tag(instance_tags::INSTANCE) == Some(platform.instance_tag.as_str())
    }

    /// Ours to act on for `platform`: it carries the platform's tags and this cluster's identity,
    /// or (only when `legacy`, for an instance a TaskRun of this cluster names) no cluster
    /// identity at all. Another cluster's instance never is.
    pub fn may_manage(&self, platform: &DynamicPlatform, legacy: bool) -> bool {
        self.has_platform_tags(platform)
            && match self.ownership {
                Ownership::Ours => true,
                Ownership::Untagged => legacy,
                Ownership::Foreign => false,
            }
    }

    /// The scheduler's view of it, as listed by `lister`'s config; `strict_public` is that
    /// platform's `strict-public-address`.
    pub fn record(&self, lister: &Platform, strict_public: bool) -> InstanceRecord {
        let launched_at = self
            .launch_time
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(Time::ZERO, |d| {
                Time::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            });
        InstanceRecord {
            id: self.id.clone(),
            platform: lister.clone(),
            instance_tag: self
                .tag(instance_tags::INSTANCE)
                .unwrap_or_default()
                .to_owned(),
            ownership: self.ownership,
            platform_label: self.platform_label().map(str::to_owned),
            owner: self.owner_key().map(str::to_owned),
            taskrun_id: self.taskrun_id().map(str::to_owned),
            launched_at,
            state: self.state,
            address: self.address(strict_public).map(str::to_owned),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::testing::{instance, platform};
    use std::time::Duration;

    #[test]
    fn address_prefers_public_dns_then_public_ip_then_private() {
        let mut i = instance("i-1");
        assert_eq!(
            i.address(false),
            Some("ec2-54-1-2-3.compute-1.amazonaws.com")
        );
        assert_eq!(
            i.address(true),
            Some("ec2-54-1-2-3.compute-1.amazonaws.com")
        );
        i.public_dns = None;
        assert_eq!(i.address(false), Some("54.1.2.3"));
        i.public_ip = None;
        assert_eq!(i.address(false), Some("10.0.0.5"));
        assert_eq!(
            i.address(true),
            None,
            "strict-public-address never falls back"
        );
        i.private_ip = None;
        assert_eq!(i.address(false), None);
    }

    #[test]
    fn ec2_state_names_map_to_the_one_state_enum() {
        for s in InstanceState::ALL {
            assert_eq!(state_from_name(s.as_str()), s);
        }
        assert_eq!(state_from_name("hibernating"), InstanceState::Unknown);
        assert_eq!(state_from_name("stopping"), InstanceState::Stopping);
        assert!(state_from_name("stopped").is_gone());
    }

    #[test]
    fn may_manage_needs_our_tags_and_never_another_clusters() {
        let p = platform();
        let mut i = instance("i-1");
        i.ownership = Ownership::Ours;
        assert!(!i.may_manage(&p, false), "no managed tag");
        i.tags.insert("MultiPlatformManaged".into(), "true".into());
        i.tags
            .insert("multi-platform-instance".into(), "someone-else".into());
        assert!(!i.may_manage(&p, true), "another instance tag");
        i.tags
            .insert("multi-platform-instance".into(), p.instance_tag.clone());
        assert!(i.may_manage(&p, false));
        i.ownership = Ownership::Untagged;
        assert!(!i.may_manage(&p, false));
        assert!(i.may_manage(&p, true), "named by a TaskRun");
        i.ownership = Ownership::Foreign;
        assert!(
            !i.may_manage(&p, true),
            "another cluster's, even when named"
        );
    }

    #[test]
    fn records_carry_ownership_owner_and_launch_time() {
        let mut i = instance("i-1");
        i.launch_time = Some(SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_500));
        i.ownership = Ownership::Ours;
        i.public_dns = None;
        i.public_ip = None;
        for (k, v) in [
            ("multi-platform-instance", "prod-arm64"),
            (tags::PLATFORM, "linux-arm64"),
            (tags::OWNER, "uid-1"),
        ] {
            i.tags.insert(k.into(), v.into());
        }
        let lister = Platform::parse("linux/arm64").unwrap();
        let r = i.record(&lister, false);
        assert_eq!(r.platform, lister);
        assert_eq!(r.instance_tag, "prod-arm64");
        assert_eq!(r.ownership, Ownership::Ours);
        assert!(r.is_ours_for("linux-arm64"));
        assert!(!r.is_ours_for("linux-amd64"));
        assert_eq!(r.owner.as_deref(), Some("uid-1"));
        assert_eq!(r.launched_at, Time::from_millis(1_700_000_000_500));
        assert_eq!(r.address.as_deref(), Some("10.0.0.5"));
        assert_eq!(i.record(&lister, true).address, None);
    }
}
