//! What the cloud says about one instance: state, addresses, tags. Pure.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::cloud::launch::tags;
use crate::contract::instance_tags;

/// Lifecycle state of an instance, mapped so that the scheduler is told the truth: anything on its
/// way down or stopped is gone, never "OK".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum InstanceState {
    /// Booting.
    Pending,
    /// Running (the SSH daemon may still be starting; see [`crate::cloud::reach`]).
    Running,
    /// Terminating.
    ShuttingDown,
    /// Terminated.
    Terminated,
    /// Stopping.
    Stopping,
    /// Stopped.
    Stopped,
    /// A state name this version does not know.
    Unknown,
}

impl InstanceState {
    /// Every state, for metrics that report a value per state.
    pub const ALL: [InstanceState; 7] = [
        Self::Pending,
        Self::Running,
        Self::ShuttingDown,
        Self::Terminated,
        Self::Stopping,
        Self::Stopped,
        Self::Unknown,
    ];

    /// Maps an EC2 state name (`pending`, `running`, `shutting-down`, ...).
    pub fn from_name(name: &str) -> Self {
        match name {
            "pending" => Self::Pending,
            "running" => Self::Running,
            "shutting-down" => Self::ShuttingDown,
            "terminated" => Self::Terminated,
            "stopping" => Self::Stopping,
            "stopped" => Self::Stopped,
            _ => Self::Unknown,
        }
    }

    /// The EC2 state name (`unknown` for [`Self::Unknown`]); a bounded metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::ShuttingDown => "shutting-down",
            Self::Terminated => "terminated",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Unknown => "unknown",
        }
    }

    /// Gone for scheduling: it will not run (more) work. Instances shut down on their own
    /// (`InstanceInitiatedShutdownBehavior=terminate`) or stopped by hand end up here.
    pub fn is_gone(self) -> bool {
        matches!(
            self,
            Self::ShuttingDown | Self::Terminated | Self::Stopping | Self::Stopped
        )
    }

    /// Counts toward `max-instances`: booting and running instances, and (to be safe) states we do
    /// not know, which may well be alive and billed.
    pub fn counts_toward_limit(self) -> bool {
        !self.is_gone()
    }
}

/// One instance as listed by the cloud.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Instance id.
    pub id: String,
    /// Lifecycle state.
    pub state: InstanceState,
    /// Launch time, if the cloud reported one.
    pub launch_time: Option<SystemTime>,
    /// Instance type.
    pub instance_type: String,
    /// Private IPv4 address.
    pub private_ip: Option<String>,
    /// Public IPv4 address.
    pub public_ip: Option<String>,
    /// Public DNS name.
    pub public_dns: Option<String>,
    /// Launched as a spot instance.
    pub spot: bool,
    /// Tags.
    pub tags: BTreeMap<String, String>,
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

    /// Who owns the instance: our owner tag, else (instances launched by the Go controller) the
    /// `taskRunID` tag.
    pub fn owner_key(&self) -> Option<&str> {
        self.tag(tags::OWNER).or_else(|| self.taskrun_id())
    }

    /// The `taskRunID` tag (`<namespace>:<name>`).
    pub fn taskrun_id(&self) -> Option<&str> {
        self.tag(instance_tags::TASKRUN_ID)
    }

    /// The launch attempt recorded in our tag.
    pub fn attempt(&self) -> Option<u32> {
        self.tag(tags::ATTEMPT)?.parse().ok()
    }

    /// The platform label value recorded in our tag (absent on instances the Go controller launched).
    pub fn platform_label(&self) -> Option<&str> {
        self.tag(tags::PLATFORM)
    }

    /// A tag value.
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.tags.get(key).map(String::as_str)
    }

    /// Time since launch at `now`; `None` without a launch time, zero for a launch time in the future.
    pub fn age(&self, now: SystemTime) -> Option<Duration> {
        let t = self.launch_time?;
        Some(now.duration_since(t).unwrap_or_default())
    }
}

/// How many of `instances` count toward `max-instances` (booting ones included).
pub fn count_toward_limit(instances: &[Instance]) -> u32 {
    let n = instances
        .iter()
        .filter(|i| i.state.counts_toward_limit())
        .count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance() -> Instance {
        Instance {
            id: "i-1".into(),
            state: InstanceState::Running,
            launch_time: None,
            instance_type: "m5.large".into(),
            private_ip: Some("10.0.0.5".into()),
            public_ip: Some("54.1.2.3".into()),
            public_dns: Some("ec2-54-1-2-3.compute-1.amazonaws.com".into()),
            spot: false,
            tags: BTreeMap::new(),
        }
    }

    #[test]
    fn address_prefers_public_dns_then_public_ip_then_private() {
        let mut i = instance();
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
    fn gone_states_are_gone() {
        use InstanceState::*;
        for s in [ShuttingDown, Terminated, Stopping, Stopped] {
            assert!(s.is_gone(), "{s:?}");
            assert!(!s.counts_toward_limit(), "{s:?}");
        }
        for s in [Pending, Running, Unknown] {
            assert!(!s.is_gone(), "{s:?}");
            assert!(s.counts_toward_limit(), "{s:?}");
        }
        for s in InstanceState::ALL {
            let back = InstanceState::from_name(s.as_str());
            assert_eq!(back, s);
        }
        assert_eq!(InstanceState::from_name("hibernating"), Unknown);
    }

    #[test]
    fn limit_counts_booting_and_running_only() {
        let states = [
            InstanceState::Pending,
            InstanceState::Pending,
            InstanceState::Running,
            InstanceState::Stopped,
            InstanceState::ShuttingDown,
        ];
        let list: Vec<Instance> = states
            .iter()
            .map(|s| Instance {
                state: *s,
                ..instance()
            })
            .collect();
        assert_eq!(count_toward_limit(&list), 3);
    }

    #[test]
    fn owner_key_falls_back_to_taskrun_id() {
        let mut i = instance();
        assert_eq!(i.owner_key(), None);
        i.tags
            .insert(instance_tags::TASKRUN_ID.into(), "ns:build-1".into());
        assert_eq!(i.owner_key(), Some("ns:build-1"));
        i.tags.insert(tags::OWNER.into(), "uid-1".into());
        assert_eq!(i.owner_key(), Some("uid-1"));
        i.tags.insert(tags::ATTEMPT.into(), "3".into());
        assert_eq!(i.attempt(), Some(3));
    }

    #[test]
    fn age_is_never_negative() {
        let mut i = instance();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        assert_eq!(i.age(now), None);
        i.launch_time = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(400));
        assert_eq!(i.age(now), Some(Duration::from_secs(600)));
        i.launch_time = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(2000));
        assert_eq!(i.age(now), Some(Duration::ZERO));
    }
}
