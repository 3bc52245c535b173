//! Shared fixtures of the module's unit tests.

use std::time::Duration;

use crate::config::{CloudKind, DynamicPlatform, HostKeyPolicy};
use crate::platform::Platform;

/// A `linux/arm64` platform with only the required keys.
pub(crate) fn platform() -> DynamicPlatform {
    DynamicPlatform {
        platform: Platform::parse("linux/arm64").unwrap(),
        cloud: CloudKind::Aws,
        region: "us-east-1".into(),
        ami: "ami-1".into(),
        instance_type: "m6g.large".into(),
        key_name: None,
        aws_secret: "aws".into(),
        ssh_secret: "ssh".into(),
        user: "ec2-user".into(),
        security_group: None,
        security_group_id: None,
        subnet_id: None,
        instance_profile_name: None,
        instance_profile_arn: None,
        strict_public_address: false,
        disk_gb: 40,
        iops: None,
        throughput: None,
        user_data: None,
        max_instances: 2,
        instance_tag: "prod-arm64".into(),
        allocation_timeout: Duration::from_secs(600),
        check_interval: Duration::from_secs(60),
        sudo_commands: vec![],
        spot: false,
        host_key_policy: HostKeyPolicy::TrustOnFirstUse,
        imds: crate::config::ImdsOptions::default(),
        os: crate::config::HostOs::Linux,
        dedicated_host: None,
        ibm: None,
        drained: false,
    }
}

/// A launch for TaskRun `tenant/build-1` with this UID.
pub(crate) fn launch_id(uid: &str, retry: u32, attempt: u32) -> crate::scheduler::LaunchId {
    crate::scheduler::LaunchId {
        owner: crate::scheduler::LaunchOwner::TaskRun(crate::scheduler::TaskRunRef::new(
            "tenant",
            "build-1",
            crate::scheduler::Uid::new(uid),
        )),
        retry,
        attempt,
    }
}

/// A running instance with every address and no tags.
pub(crate) fn instance(id: &str) -> crate::cloud::Instance {
    crate::cloud::Instance {
        id: id.into(),
        state: crate::scheduler::InstanceState::Running,
        launch_time: None,
        instance_type: "m5.large".into(),
        private_ip: Some("10.0.0.5".into()),
        public_ip: Some("54.1.2.3".into()),
        public_dns: Some("ec2-54-1-2-3.compute-1.amazonaws.com".into()),
        spot: false,
        tags: Default::default(),
        ownership: crate::scheduler::Ownership::Untagged,
    }
}
