//! The EC2 provider against a real moto server through the real AWS SDK, with the fault-injecting
//! proxy in front (it also records requests, for parameters moto does not keep), and the
//! scheduler driving it through the cloud runner: two clusters sharing one account, and the
//! probing cost.
//!
//! Every test starts its own moto and proxy on random loopback ports, so tests run in parallel.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant, SystemTime};

use std::collections::BTreeSet;
use std::sync::Arc;

use aws_sdk_ec2::types::InstanceAttributeName;
use e2e::ec2_proxy::{Ec2Proxy, Fault};
use e2e::moto::{Fixture, Moto, test_credentials};
use e2e::sshd::{HostSetup, SshdHost};
use mpc::cloud::aws::{AwsCloud, AwsOptions};
use mpc::cloud::instance::tags;
use mpc::cloud::launch::{Market, client_token};
use mpc::cloud::metrics::CloudMetrics;
use mpc::cloud::reach::{LoopbackMap, Probe, probe_all, probe_ssh};
use mpc::cloud::retry::RetryPolicy;
use mpc::cloud::runner::RunnerOptions;
use mpc::cloud::{
    BatchOptions, Cloud, CloudError, ClusterId, Credentials, ErrorClass, Instance, LaunchOutcome,
    LaunchRequest, Operation, ProbeBatcher, Runner, Scope, Terminated,
};
use mpc::config::{self, ConfigData, DynamicPlatform, HostConfig};
use mpc::platform::Platform;
use mpc::scheduler::{
    Action, Event, InstanceState, LaunchId, LaunchOwner, Ownership, Policy, Scheduler, Snapshot,
    TaskRunRef, TaskRunSpec, Time, Uid,
};

const REGION: &str = "us-east-1";
const PLATFORM: &str = "linux/amd64";
/// This cluster, in the single-cluster tests.
const CLUSTER: &str = "e2e-cluster";

struct Harness {
    moto: Moto,
    proxy: Ec2Proxy,
    fx: Fixture,
    cloud: AwsCloud,
    creds: Credentials,
}

fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(100),
        backoff_attempts: 6,
        bounded_attempts: 3,
    }
}

async fn harness_with(tune: impl FnOnce(&mut AwsOptions), loopback: bool) -> Harness {
    let moto = Moto::start().await.expect("moto starts");
    let proxy = Ec2Proxy::start(moto.addr()).await.expect("proxy starts");
    let fx = if loopback {
        moto.loopback_subnet(REGION, 4).await
    } else {
        moto.fixture(REGION).await
    }
    .expect("fixture");
    let mut options = test_options(CLUSTER, &proxy);
    tune(&mut options);
    Harness {
        moto,
        proxy,
        fx,
        cloud: AwsCloud::new(options, CloudMetrics::unregistered().unwrap()),
        creds: test_credentials(),
    }
}

/// Provider options for `cluster` through `proxy`, with fast retries.
fn test_options(cluster: &str, proxy: &Ec2Proxy) -> AwsOptions {
    AwsOptions {
        cluster: ClusterId::new(cluster).unwrap(),
        endpoint: Some(proxy.endpoint()),
        retry: fast_retry(),
        page_size: 1000,
        connect_timeout: Duration::from_secs(2),
        call_timeout: Duration::from_secs(10),
    }
}

/// A provider for `cluster` through `proxy`, as the runner takes it.
fn shared_cloud(cluster: &str, proxy: &Ec2Proxy) -> Arc<dyn Cloud> {
    Arc::new(AwsCloud::new(
        test_options(cluster, proxy),
        CloudMetrics::unregistered().unwrap(),
    ))
}

async fn harness() -> Harness {
    harness_with(|_| {}, false).await
}

/// Host config with a `linux/amd64` dynamic platform on the fixture, plus `extra` keys
/// (`dynamic.linux-amd64.<field>` when the key has no dot, else as given).
fn host_config(fx: &Fixture, extra: &[(&str, &str)]) -> HostConfig {
    let mut d = ConfigData::new();
    let mut put = |k: &str, v: &str| {
        let k = if k.contains('.') || k.contains("platforms") || k.contains("tags") {
            k.to_owned()
        } else {
            format!("dynamic.linux-amd64.{k}")
        };
        d.insert(k, v.to_owned());
    };
    put("dynamic-platforms", PLATFORM);
    put("type", "aws");
    put("region", REGION);
    put("ami", &fx.ami);
    put("instance-type", "t3.micro");
    put("aws-secret", "aws-account");
    put("ssh-secret", "aws-ssh-key");
    put("max-instances", "3");
    put("instance-tag", "e2e-amd64");
    for (k, v) in extra {
        put(k, v);
    }
    let parsed = config::parse(&d);
    assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
    parsed.config
}

fn dynamic(cfg: &HostConfig) -> &DynamicPlatform {
    cfg.dynamic.values().next().expect("one dynamic platform")
}

/// The launch of TaskRun `tenant/<name>`'s first instance.
fn taskrun(name: &str) -> LaunchId {
    LaunchId {
        owner: LaunchOwner::TaskRun(TaskRunRef::new(
            "tenant",
            name,
            Uid::new(&format!("uid-{name}-5f0e")),
        )),
        retry: 0,
        attempt: 1,
    }
}

fn attempt(mut l: LaunchId, n: u32) -> LaunchId {
    l.attempt = n;
    l
}

fn cluster() -> ClusterId {
    ClusterId::new(CLUSTER).unwrap()
}

/// An instance the Go controller launched for the platform: no cluster tag.
const GO_TAGS: [(&str, &str); 3] = [
    ("MultiPlatformManaged", "true"),
    ("multi-platform-instance", "e2e-amd64"),
    ("taskRunID", "tenant:go-built"),
];

/// The tags moto needs to show an instance as launched by `cluster` for `owner`'s first attempt.
fn launched_by<'a>(cluster: &'a str, owner: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("MultiPlatformManaged", "true"),
        ("multi-platform-instance", "e2e-amd64"),
        (tags::CLUSTER, cluster),
        (tags::PLATFORM, "linux-amd64"),
        (tags::OWNER, owner),
        (tags::ATTEMPT, "0.1"),
    ]
}

/// The only instance a launch outcome may be used as.
fn usable(o: LaunchOutcome) -> Instance {
    match o {
        LaunchOutcome::Launched(i) | LaunchOutcome::Adopted(i) => i,
        LaunchOutcome::Spent(i) => panic!("spent: {i:?}"),
    }
}

impl Harness {
    fn scope<'a>(&'a self, p: &'a DynamicPlatform) -> Scope<'a> {
        Scope {
            platform: p,
            credentials: &self.creds,
        }
    }

    async fn launch(
        &self,
        cfg: &HostConfig,
        launch: LaunchId,
    ) -> Result<LaunchOutcome, CloudError> {
        let req = LaunchRequest {
            scope: self.scope(dynamic(cfg)),
            launch: &launch,
            additional_tags: &cfg.additional_instance_tags,
        };
        self.cloud.launch(&req).await
    }

    /// Launches one instance directly (not through the provider) with `tags`; its id.
    async fn raw(&self, tags: &[(&str, &str)]) -> String {
        let ids = self
            .moto
            .launch_raw(REGION, &self.fx.ami, 1, tags)
            .await
            .unwrap();
        ids.into_iter().next().expect("one instance")
    }

    /// One instance by id through the batch lookup.
    async fn describe(&self, p: &DynamicPlatform, id: &str) -> Option<Instance> {
        let found = self
            .cloud
            .describe(self.scope(p), &[id.to_owned()])
            .await
            .unwrap();
        found.into_iter().find(|i| i.id == id)
    }

    async fn moto_state(&self, id: &str) -> String {
        let out = self
            .moto
            .ec2(REGION)
            .describe_instances()
            .instance_ids(id)
            .send()
            .await
            .unwrap();
        out.reservations()[0].instances()[0]
            .state()
            .and_then(|s| s.name())
            .map(|n| n.as_str().to_owned())
            .unwrap()
    }
}

#[tokio::test]
async fn launch_with_every_option_reads_back_from_moto() {
    let h = harness().await;
    let fx = &h.fx;
    let cfg = host_config(
        fx,
        &[
            ("key-name", &fx.key_name),
            ("subnet-id", &fx.subnet_id),
            ("security-group-id", &fx.security_group_id),
            ("instance-profile-name", &fx.instance_profile_name),
            ("disk", "80"),
            ("iops", "4000"),
            ("throughput", "250"),
            ("user-data", "#!/bin/sh\necho ready > /tmp/ready\n"),
            ("additional-instance-tags", "team=builds,cost-center=42"),
        ],
    );
    let owner = taskrun("build-all-options");
    let launched = h.launch(&cfg, owner.clone()).await.unwrap();
    assert!(
        matches!(launched, LaunchOutcome::Launched(_)),
        "{launched:?}"
    );
    let id = launched.instance().id.clone();

    // Read everything back from moto with an independent client.
    let ec2 = h.moto.ec2(REGION);
    let out = ec2
        .describe_instances()
        .instance_ids(&id)
        .send()
        .await
        .unwrap();
    let i = &out.reservations()[0].instances()[0];
    let tags: BTreeMap<&str, &str> = i
        .tags()
        .iter()
        .map(|t| (t.key().unwrap(), t.value().unwrap()))
        .collect();
    let want = [
        ("MultiPlatformManaged", "true"),
        ("multi-platform-instance", "e2e-amd64"),
        ("taskRunID", "tenant:build-all-options"),
        ("Name", "e2e-amd64-linux-amd64-tenant-build-all-options"),
        (tags::CLUSTER, CLUSTER),
        (tags::OWNER, "uid-build-all-options-5f0e"),
        (tags::ATTEMPT, "0.1"),
        (tags::PLATFORM, "linux-amd64"),
        ("team", "builds"),
        ("cost-center", "42"),
    ];
    for (k, v) in want {
        assert_eq!(tags.get(k), Some(&v), "tag {k}: {tags:?}");
    }
    assert_eq!(tags.len(), want.len(), "{tags:?}");
    assert_eq!(i.instance_type().unwrap().as_str(), "t3.micro");
    assert_eq!(i.image_id(), Some(fx.ami.as_str()));
    assert_eq!(i.key_name(), Some(fx.key_name.as_str()));
    assert_eq!(i.subnet_id(), Some(fx.subnet_id.as_str()));
    let groups: Vec<_> = i
        .security_groups()
        .iter()
        .filter_map(|g| g.group_id())
        .collect();
    assert_eq!(groups, [fx.security_group_id.as_str()]);
    assert_eq!(
        i.iam_instance_profile().and_then(|p| p.arn()),
        Some(fx.instance_profile_arn.as_str())
    );

    // Root disk: one volume, on the image's root device, gp3 of the configured size.
    let bdm = i.block_device_mappings();
    assert_eq!(bdm.len(), 1, "{bdm:?}");
    assert_eq!(bdm[0].device_name(), Some(fx.root_device.as_str()));
    let vol_id = bdm[0].ebs().and_then(|e| e.volume_id()).unwrap();
    let vols = ec2
        .describe_volumes()
        .volume_ids(vol_id)
        .send()
        .await
        .unwrap();
    let vol = &vols.volumes()[0];
    assert_eq!(vol.size(), Some(80));
    assert_eq!(vol.volume_type().map(|t| t.as_str()), Some("gp3"));

    // User data (base64 of the raw script) and shutdown behaviour.
    let ud = ec2
        .describe_instance_attribute()
        .instance_id(&id)
        .attribute(InstanceAttributeName::UserData)
        .send()
        .await
        .unwrap();
    assert_eq!(
        ud.user_data().and_then(|v| v.value()),
        Some(mpc::cloud::launch::encode_user_data("#!/bin/sh\necho ready > /tmp/ready\n").as_str())
    );
    let sb = ec2
        .describe_instance_attribute()
        .instance_id(&id)
        .attribute(InstanceAttributeName::InstanceInitiatedShutdownBehavior)
        .send()
        .await
        .unwrap();
    assert_eq!(
        sb.instance_initiated_shutdown_behavior()
            .and_then(|v| v.value()),
        Some("terminate")
    );

    // What moto does not keep, from the request as sent.
    let runs = h.proxy.requests_of("RunInstances");
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert_eq!(r.param("BlockDeviceMapping.1.Ebs.Iops"), Some("4000"));
    assert_eq!(r.param("BlockDeviceMapping.1.Ebs.Throughput"), Some("250"));
    assert_eq!(r.param("BlockDeviceMapping.1.Ebs.VolumeType"), Some("gp3"));
    assert_eq!(
        r.param("BlockDeviceMapping.1.Ebs.DeleteOnTermination"),
        Some("true")
    );
    assert_eq!(
        r.param("ClientToken"),
        Some(client_token(&cluster(), &owner, Market::OnDemand).as_str())
    );
    assert_eq!(r.param("InstanceMarketOptions.MarketType"), None);
    // The root volume is tagged like the instance.
    assert_eq!(r.param("TagSpecification.2.ResourceType"), Some("volume"));
}

/// Instance role credentials stay off the network path of build containers: IMDSv2 only, with a
/// PUT response hop limit of 1, unless the platform says otherwise.
#[tokio::test]
async fn launches_require_imdsv2_with_hop_limit_one_unless_configured() {
    use aws_sdk_ec2::types::HttpTokensState;
    let h = harness().await;
    let read_back = |id: String| {
        let ec2 = h.moto.ec2(REGION);
        async move {
            let out = ec2
                .describe_instances()
                .instance_ids(&id)
                .send()
                .await
                .unwrap();
            let m = out.reservations()[0].instances()[0]
                .metadata_options()
                .cloned()
                .expect("metadata options");
            (m.http_tokens().cloned(), m.http_put_response_hop_limit())
        }
    };
    let cfg = host_config(&h.fx, &[]);
    let id = usable(h.launch(&cfg, taskrun("imds-default")).await.unwrap()).id;
    assert_eq!(
        read_back(id).await,
        (Some(HttpTokensState::Required), Some(1))
    );
    let r = &h.proxy.requests_of("RunInstances")[0];
    assert_eq!(r.param("MetadataOptions.HttpTokens"), Some("required"));
    assert_eq!(
        r.param("MetadataOptions.HttpPutResponseHopLimit"),
        Some("1")
    );

    let cfg = host_config(
        &h.fx,
        &[("imds-hop-limit", "2"), ("imds-tokens", "optional")],
    );
    let id = usable(h.launch(&cfg, taskrun("imds-relaxed")).await.unwrap()).id;
    assert_eq!(
        read_back(id).await,
        (Some(HttpTokensState::Optional), Some(2))
    );
}

#[tokio::test]
async fn launch_with_group_name_and_profile_arn() {
    let h = harness().await;
    let fx = &h.fx;
    let cfg = host_config(
        fx,
        &[
            ("ami", &fx.alt_ami),
            ("subnet-id", &fx.subnet_id),
            ("security-group", &fx.security_group_name),
            ("instance-profile-arn", &fx.instance_profile_arn),
        ],
    );
    let id = usable(h.launch(&cfg, taskrun("by-name")).await.unwrap()).id;
    let out = h
        .moto
        .ec2(REGION)
        .describe_instances()
        .instance_ids(&id)
        .send()
        .await
        .unwrap();
    let i = &out.reservations()[0].instances()[0];
    let names: Vec<_> = i
        .security_groups()
        .iter()
        .filter_map(|g| g.group_name())
        .collect();
    assert_eq!(names, [fx.security_group_name.as_str()]);
    assert_eq!(
        i.iam_instance_profile().and_then(|p| p.arn()),
        Some(fx.instance_profile_arn.as_str())
    );
    let r = &h.proxy.requests_of("RunInstances")[0];
    assert_eq!(
        r.param("SecurityGroup.1"),
        Some(fx.security_group_name.as_str())
    );
    assert_eq!(r.param("SecurityGroupId.1"), None);
    assert_eq!(
        r.param("IamInstanceProfile.Arn"),
        Some(fx.instance_profile_arn.as_str())
    );
    assert_eq!(r.param("IamInstanceProfile.Name"), None);
    // Defaults: 40 GB gp3, no IOPS/throughput override.
    assert_eq!(r.param("BlockDeviceMapping.1.Ebs.VolumeSize"), Some("40"));
    assert_eq!(r.param("BlockDeviceMapping.1.Ebs.Iops"), None);
    // The root disk override follows this image's root device, not a fixed name.
    assert_ne!(fx.alt_root_device, fx.root_device);
    assert_eq!(
        r.param("BlockDeviceMapping.1.DeviceName"),
        Some(fx.alt_root_device.as_str())
    );
    let bdm = i.block_device_mappings();
    assert_eq!(bdm.len(), 1, "{bdm:?}");
    assert_eq!(bdm[0].device_name(), Some(fx.alt_root_device.as_str()));
}

#[tokio::test]
async fn inventory_pages_lists_everyone_with_the_tag_and_says_whose() {
    let h = harness_with(|o| o.page_size = 5, false).await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let mut ours = Vec::new();
    for n in 0..8 {
        let l = h.launch(&cfg, taskrun(&format!("inv-{n}"))).await.unwrap();
        ours.push(usable(l).id);
    }
    // Not listed: another instance tag, no tags at all.
    h.moto
        .launch_raw(
            REGION,
            &h.fx.ami,
            2,
            &[
                ("MultiPlatformManaged", "true"),
                ("multi-platform-instance", "other-tag"),
            ],
        )
        .await
        .unwrap();
    h.raw(&[]).await;
    // Listed, with the same tag: another platform of ours, another cluster's, the Go
    // controller's (no cluster tag).
    let mut other_platform = launched_by(CLUSTER, "uid-x");
    other_platform[3] = (tags::PLATFORM, "linux-arm64");
    let other_platform = h.raw(&other_platform).await;
    let theirs = h.raw(&launched_by("stone-prod-p02", "uid-y")).await;
    let legacy = h.raw(&GO_TAGS).await;
    // One of ours terminated (gone from the listing), one stopped (listed, and gone for scheduling).
    let ec2 = h.moto.ec2(REGION);
    ec2.terminate_instances()
        .instance_ids(&ours[0])
        .send()
        .await
        .unwrap();
    ec2.stop_instances()
        .instance_ids(&ours[1])
        .send()
        .await
        .unwrap();

    let before = h.proxy.requests_of("DescribeInstances").len();
    let listed = h.cloud.list(h.scope(p)).await.unwrap();
    let pages = h.proxy.requests_of("DescribeInstances")[before..].to_vec();
    assert!(
        pages.len() >= 2,
        "more instances than one page: {} pages",
        pages.len()
    );
    assert!(pages[1].param("NextToken").is_some());
    assert_eq!(pages[0].param("MaxResults"), Some("5"));

    let mut ids: Vec<&str> = listed.iter().map(|i| i.id.as_str()).collect();
    ids.sort();
    let mut want: Vec<&str> = ours[1..]
        .iter()
        .chain([&other_platform, &theirs, &legacy])
        .map(String::as_str)
        .collect();
    want.sort();
    assert_eq!(ids, want);
    let whose = |id: &str| listed.iter().find(|i| i.id == id).unwrap().ownership;
    assert_eq!(whose(&ours[2]), Ownership::Ours);
    assert_eq!(whose(&other_platform), Ownership::Ours);
    assert_eq!(whose(&theirs), Ownership::Foreign);
    assert_eq!(whose(&legacy), Ownership::Untagged);
    let stopped = listed.iter().find(|i| i.id == ours[1]).unwrap();
    assert!(matches!(
        stopped.state,
        InstanceState::Stopped | InstanceState::Stopping
    ));
    assert!(stopped.state.is_gone());
    assert_eq!(
        listed
            .iter()
            .filter(|i| i.state.counts_toward_limit())
            .count(),
        9,
        "6 running of ours + the other platform's + theirs + the Go one"
    );
    let running = listed.iter().find(|i| i.id == ours[2]).unwrap();
    assert_eq!(running.state, InstanceState::Running);
    assert_eq!(running.instance_type, "t3.micro");
    assert!(running.launch_time.is_some());
    assert!(running.private_ip.is_some() && running.public_ip.is_some());
    assert!(running.public_dns.is_some());
    assert_eq!(running.address(false), running.public_dns.as_deref());
    assert_eq!(running.tag("taskRunID"), Some("tenant:inv-2"));
    let m = h.cloud.metrics();
    assert_eq!(m.instances(PLATFORM, InstanceState::Running), 9);
    assert_eq!(m.instances_of(PLATFORM, Ownership::Foreign), 1);
    assert_eq!(m.instances_of(PLATFORM, Ownership::Untagged), 1);
    assert_eq!(
        m.instances(PLATFORM, InstanceState::Stopped)
            + m.instances(PLATFORM, InstanceState::Stopping),
        1
    );
    // The scheduler's view: the lister, the owner tag, the address.
    let r = running.record(&Platform::parse(PLATFORM).unwrap(), false);
    assert!(r.is_ours_for("linux-amd64"));
    assert_eq!(r.owner.as_deref(), Some("uid-inv-2-5f0e"));
    assert_eq!(r.address.as_deref(), running.public_dns.as_deref());
}

#[tokio::test]
async fn terminate_is_idempotent_and_only_for_this_clusters_instances() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let id = usable(h.launch(&cfg, taskrun("term")).await.unwrap()).id;
    assert_eq!(
        h.cloud.terminate(h.scope(p), &id, false).await.unwrap(),
        Terminated::Requested
    );
    assert_eq!(
        h.cloud.terminate(h.scope(p), &id, false).await.unwrap(),
        Terminated::AlreadyGone
    );
    assert_eq!(h.proxy.requests_of("TerminateInstances").len(), 1);
    assert_eq!(h.moto_state(&id).await, "terminated");
    let seen = h.describe(p, &id).await.unwrap();
    assert!(
        seen.state.is_gone(),
        "terminated instances still show by id"
    );
    assert!(
        !h.cloud
            .list(h.scope(p))
            .await
            .unwrap()
            .iter()
            .any(|i| i.id == id)
    );

    // Unknown to the cloud: already gone.
    assert_eq!(
        h.cloud
            .terminate(h.scope(p), "i-0123456789abcdef0", false)
            .await
            .unwrap(),
        Terminated::AlreadyGone
    );
    assert_eq!(h.describe(p, "i-0123456789abcdef0").await, None);

    let refused = |e: CloudError, why: &str| {
        assert_eq!(e.class, ErrorClass::Refused, "{e}");
        assert!(!e.is_retryable());
        assert!(e.to_string().contains(why), "{e}");
        assert!(e.to_string().contains("refusing to terminate"), "{e}");
    };
    // Not managed at all (no tags): refused, and left running.
    let foreign = h.raw(&[("team", "x")]).await;
    refused(
        h.cloud
            .terminate(h.scope(p), &foreign, true)
            .await
            .unwrap_err(),
        "does not carry MultiPlatformManaged=true",
    );
    // Another cluster's, with every tag of ours but its cluster: refused even when named.
    let theirs = h.raw(&launched_by("stone-prod-p02", "uid-t")).await;
    for legacy in [false, true] {
        refused(
            h.cloud
                .terminate(h.scope(p), &theirs, legacy)
                .await
                .unwrap_err(),
            "belongs to cluster stone-prod-p02, not e2e-cluster",
        );
    }
    // The Go controller's (no cluster tag): only when a TaskRun of ours names it.
    let go = h.raw(&GO_TAGS).await;
    refused(
        h.cloud.terminate(h.scope(p), &go, false).await.unwrap_err(),
        "carries no multi-platform-cluster tag",
    );
    for id in [&foreign, &theirs, &go] {
        assert_eq!(h.moto_state(id).await, "running", "{id}");
    }
    assert_eq!(h.proxy.requests_of("TerminateInstances").len(), 1);
    assert_eq!(
        h.cloud.terminate(h.scope(p), &go, true).await.unwrap(),
        Terminated::Requested
    );
    assert_eq!(h.moto_state(&go).await, "terminated");
}

#[tokio::test]
async fn max_instances_counting_includes_pending_instances() {
    let h = harness().await;
    h.proxy.report_pending_for(Duration::from_secs(600));
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    for n in 0..3 {
        let l = usable(h.launch(&cfg, taskrun(&format!("cap-{n}"))).await.unwrap());
        assert_eq!(l.state, InstanceState::Pending);
    }
    let listed = h.cloud.list(h.scope(p)).await.unwrap();
    assert_eq!(listed.len(), 3);
    assert!(
        listed.iter().all(|i| i.state == InstanceState::Pending),
        "{listed:?}"
    );
    assert_eq!(
        listed
            .iter()
            .filter(|i| i.state.counts_toward_limit())
            .count(),
        p.max_instances as usize,
        "the platform is full while booting"
    );
    assert_eq!(
        h.cloud
            .metrics()
            .instances(PLATFORM, InstanceState::Pending),
        3
    );
    assert_eq!(
        h.cloud
            .metrics()
            .instances(PLATFORM, InstanceState::Running),
        0
    );
}

#[tokio::test]
async fn pending_then_running_then_ssh_ready_on_a_loopback_instance() {
    let h = harness_with(|_| {}, true).await;
    h.proxy.report_pending_for(Duration::from_millis(1500));
    let cfg = host_config(&h.fx, &[("subnet-id", &h.fx.subnet_id)]);
    let p = dynamic(&cfg);
    let launched = usable(h.launch(&cfg, taskrun("boot")).await.unwrap());
    // moto put the instance on a loopback address: pair it with a real sshd there.
    let address = launched
        .address(p.strict_public_address)
        .unwrap()
        .to_owned();
    let ip: Ipv4Addr = address.parse().unwrap();
    assert!(ip.is_loopback(), "{address}");
    assert_eq!(launched.public_ip, None);
    let sshd = SshdHost::start_with(HostSetup {
        address: Some(ip),
        ..HostSetup::default()
    })
    .unwrap();
    let resolver = LoopbackMap::new().with_loopback_port(sshd.port());

    let start = Instant::now();
    let mut states = Vec::new();
    let instance = loop {
        let i = h.describe(p, &launched.id).await.unwrap();
        if states.last() != Some(&i.state) {
            states.push(i.state);
        }
        if i.state == InstanceState::Running {
            break i;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "stuck in {:?}",
            i.state
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(states, [InstanceState::Pending, InstanceState::Running]);
    assert!(!instance.state.is_gone());

    let deadline = Instant::now() + Duration::from_secs(20);
    let banner = loop {
        match probe_ssh(&resolver, &address, Duration::from_secs(2)).await {
            Probe::Ready { banner, endpoint } => {
                assert_eq!(endpoint.host, address);
                break banner;
            }
            other => {
                assert!(Instant::now() < deadline, "sshd never answered: {other:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert!(banner.starts_with("SSH-2.0-OpenSSH"), "{banner}");
}

#[tokio::test]
async fn fake_cloud_addresses_are_never_dialled() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let launched = usable(h.launch(&cfg, taskrun("fake-addr")).await.unwrap());
    // moto's default VPC: a public DNS name, a 54.x public and a 10.x private address.
    let addresses: Vec<&str> = [
        launched.public_dns.as_deref(),
        launched.public_ip.as_deref(),
        launched.private_ip.as_deref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    assert_eq!(addresses.len(), 3, "{launched:?}");
    assert_eq!(launched.address(false), Some(addresses[0]));
    for a in &addresses {
        assert!(
            a.parse::<IpAddr>().map_or(true, |ip| !ip.is_loopback()),
            "{a}"
        );
    }
    // Even with a loopback port configured, none of them is dialled: refused before any connect.
    let resolver = LoopbackMap::new().with_loopback_port(22);
    let probes = probe_all(&resolver, &addresses, Duration::from_secs(1)).await;
    for (probe, a) in probes.iter().zip(&addresses) {
        assert!(
            matches!(probe, Probe::Unresolved { reason } if reason.contains(a)),
            "{probe:?}"
        );
    }
}

#[tokio::test]
async fn launch_adopts_a_live_instance_of_an_earlier_try_and_never_a_gone_one() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let owner = taskrun("adopt");
    let first = h.launch(&cfg, owner.clone()).await.unwrap();
    assert!(matches!(first, LaunchOutcome::Launched(_)));
    let first = first.instance().clone();
    // The same launch again, e.g. after a timeout or a restart: no second instance.
    let again = h.launch(&cfg, owner.clone()).await.unwrap();
    assert!(matches!(again, LaunchOutcome::Adopted(_)), "{again:?}");
    assert_eq!(again.instance().id, first.id);
    assert_eq!(h.proxy.requests_of("RunInstances").len(), 1);

    // A try whose RunInstances answer was lost: the instance exists only in the cloud.
    let lost = h.raw(&launched_by(CLUSTER, "uid-lost-5f0e")).await;
    let adopted = h.launch(&cfg, taskrun("lost")).await.unwrap();
    assert!(matches!(adopted, LaunchOutcome::Adopted(_)));
    assert_eq!(adopted.instance().id, lost);
    assert_eq!(h.proxy.requests_of("RunInstances").len(), 1);

    // Another cluster's instance with the same owner and attempt tags is not ours to adopt.
    h.raw(&launched_by("stone-prod-p02", "uid-twin-5f0e")).await;
    let twin = h.launch(&cfg, taskrun("twin")).await.unwrap();
    assert!(matches!(twin, LaunchOutcome::Launched(_)), "{twin:?}");
    assert_eq!(twin.instance().ownership, Ownership::Ours);

    // The earlier try's instance was stopped, or terminated: spent, never adopted, and no new
    // instance under the same identity.
    let ec2 = h.moto.ec2(REGION);
    let runs = h.proxy.requests_of("RunInstances").len();
    ec2.stop_instances()
        .instance_ids(&first.id)
        .send()
        .await
        .unwrap();
    let spent = h.launch(&cfg, owner.clone()).await.unwrap();
    assert!(matches!(spent, LaunchOutcome::Spent(_)), "{spent:?}");
    assert_eq!(spent.instance().id, first.id);
    assert!(spent.instance().state.is_gone());
    ec2.terminate_instances()
        .instance_ids(&lost)
        .send()
        .await
        .unwrap();
    let spent = h.launch(&cfg, taskrun("lost")).await.unwrap();
    assert_eq!(
        (spent.instance().id.as_str(), spent.instance().state),
        (lost.as_str(), InstanceState::Terminated)
    );
    assert!(matches!(spent, LaunchOutcome::Spent(_)));
    assert_eq!(h.proxy.requests_of("RunInstances").len(), runs);

    // The next attempt launches a new instance.
    let second = h.launch(&cfg, attempt(owner, 2)).await.unwrap();
    assert!(matches!(second, LaunchOutcome::Launched(_)));
    assert_ne!(second.instance().id, first.id);
    assert_eq!(second.instance().attempt(), Some("0.2"));
    assert_eq!(h.proxy.requests_of("RunInstances").len(), runs + 1);
    // Listed: the stopped first one, the twin, theirs, the second (the lost one is terminated).
    assert_eq!(h.cloud.list(h.scope(p)).await.unwrap().len(), 4);
    assert_eq!(h.cloud.metrics().launches(PLATFORM), (3, 2));
}

#[tokio::test]
async fn retag_moves_ownership_tags_and_refuses_what_is_not_ours() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let id = usable(h.launch(&cfg, taskrun("first-owner")).await.unwrap()).id;
    let next = LaunchId {
        owner: LaunchOwner::TaskRun(TaskRunRef::new(
            "tenant-b",
            "waiter",
            Uid::new("uid-waiter"),
        )),
        retry: 1,
        attempt: 2,
    };
    h.cloud.retag(h.scope(p), &id, &next).await.unwrap();
    let i = h.describe(p, &id).await.unwrap();
    assert_eq!(i.taskrun_id(), Some("tenant-b:waiter"));
    assert_eq!(i.owner_key(), Some("uid-waiter"));
    assert_eq!(i.attempt(), Some("1.2"));
    assert_eq!(i.tag("Name"), Some("e2e-amd64-linux-amd64-tenant-b-waiter"));
    assert_eq!(i.tag(tags::CLUSTER), Some(CLUSTER), "identity kept");
    assert_eq!(h.proxy.requests_of("CreateTags").len(), 1);
    // A listing (and so recovery) now finds it under the new owner.
    let listed = h.cloud.list(h.scope(p)).await.unwrap();
    let r = listed[0].record(&Platform::parse(PLATFORM).unwrap(), false);
    assert_eq!(r.owner.as_deref(), Some("uid-waiter"));

    let go = h.raw(&GO_TAGS).await;
    let theirs = h.raw(&launched_by("stone-prod-p02", "uid-t")).await;
    for (id, why) in [
        (&go, "carries no multi-platform-cluster tag"),
        (&theirs, "belongs to cluster stone-prod-p02"),
    ] {
        let e = h.cloud.retag(h.scope(p), id, &next).await.unwrap_err();
        assert_eq!(e.class, ErrorClass::Refused, "{e}");
        assert!(e.to_string().contains(why), "{e}");
        assert!(e.to_string().contains("refusing to retag"), "{e}");
    }
    assert_eq!(
        h.proxy.requests_of("CreateTags").len(),
        1,
        "no call for refused ones"
    );
    assert_eq!(
        h.describe(p, &go).await.unwrap().taskrun_id(),
        Some("tenant:go-built")
    );
    let e = h
        .cloud
        .retag(h.scope(p), "i-0123456789abcdef0", &next)
        .await
        .unwrap_err();
    assert_eq!(e.class, ErrorClass::NotFound);
}

#[tokio::test]
async fn throttling_capacity_and_server_errors_are_retried() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    h.proxy.inject(Fault::throttle("DescribeInstances", 2));
    h.proxy.inject(Fault::status("DescribeImages", 503, 1));
    h.proxy.inject(Fault::capacity("RunInstances", 2));
    let owner = taskrun("retry");
    let launched = usable(h.launch(&cfg, owner.clone()).await.unwrap());
    assert_eq!(launched.tag("taskRunID"), Some("tenant:retry"));

    let runs = h.proxy.requests_of("RunInstances");
    assert_eq!(runs.len(), 3);
    let faults: Vec<_> = runs.iter().map(|r| r.fault.as_deref()).collect();
    assert_eq!(
        faults,
        [
            Some("InsufficientInstanceCapacity"),
            Some("InsufficientInstanceCapacity"),
            None
        ]
    );
    // Every retry carries the same idempotency token.
    let token = client_token(&cluster(), &owner, Market::OnDemand);
    assert!(
        runs.iter()
            .all(|r| r.param("ClientToken") == Some(token.as_str()))
    );
    assert_eq!(
        h.cloud.list(h.scope(p)).await.unwrap().len(),
        1,
        "exactly one instance"
    );

    let m = h.cloud.metrics();
    assert_eq!(m.calls(Operation::DescribeInstances, "throttled"), 2);
    assert_eq!(m.calls(Operation::DescribeImages, "unavailable"), 1);
    assert_eq!(m.calls(Operation::RunInstances, "capacity"), 2);
    assert_eq!(m.calls(Operation::RunInstances, "success"), 1);
}

#[tokio::test]
async fn retries_are_bounded_and_reported() {
    let h = harness_with(
        |o| {
            o.retry.backoff_attempts = 4;
            o.retry.bounded_attempts = 2;
        },
        false,
    )
    .await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    h.proxy.inject(Fault::throttle("DescribeInstances", 100));
    let e = h.cloud.list(h.scope(p)).await.unwrap_err();
    assert_eq!(e.class, ErrorClass::Throttled);
    assert_eq!(e.attempts, 4);
    assert!(e.is_retryable());
    assert_eq!(e.code.as_deref(), Some("RequestLimitExceeded"));
    assert!(
        e.to_string()
            .contains("DescribeInstances failed after 4 attempts (throttled)"),
        "{e}"
    );
    assert_eq!(h.proxy.requests_of("DescribeInstances").len(), 4);

    h.proxy.clear_faults();
    h.proxy.inject(Fault::error(
        "DescribeInstances",
        400,
        "IdempotentParameterMismatch",
        100,
    ));
    let before = h.proxy.requests_of("DescribeInstances").len();
    let e = h.cloud.list(h.scope(p)).await.unwrap_err();
    assert_eq!((e.class, e.attempts), (ErrorClass::Other, 2));
    assert_eq!(h.proxy.requests_of("DescribeInstances").len() - before, 2);
}

#[tokio::test]
async fn slow_answers_time_out_and_are_retried() {
    let h = harness_with(|o| o.call_timeout = Duration::from_millis(700), false).await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    h.proxy
        .inject(Fault::delay("DescribeInstances", Duration::from_secs(5), 1));
    let listed = h.cloud.list(h.scope(p)).await.unwrap();
    assert!(listed.is_empty());
    assert_eq!(
        h.cloud
            .metrics()
            .calls(Operation::DescribeInstances, "unavailable"),
        1
    );
    assert_eq!(
        h.cloud
            .metrics()
            .calls(Operation::DescribeInstances, "success"),
        1
    );
}

#[tokio::test]
async fn bad_config_fails_at_once_naming_the_key() {
    let h = harness().await;
    let fx = h.fx.clone();
    type Case<'a> = (Vec<(&'a str, &'a str)>, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![("ami", "ami-0badc0de")],
            "dynamic.linux-amd64.ami",
            "ami-0badc0de",
        ),
        (
            vec![("instance-type", "t3.enormous")],
            "dynamic.linux-amd64.instance-type",
            "t3.enormous",
        ),
        (
            vec![("subnet-id", "subnet-0123456789abcdef0")],
            "dynamic.linux-amd64.subnet-id",
            "subnet-0123456789abcdef0",
        ),
        (
            vec![
                ("subnet-id", &fx.subnet_id),
                ("security-group-id", "sg-0123456789abcdef0"),
            ],
            "dynamic.linux-amd64.security-group-id",
            "sg-0123456789abcdef0",
        ),
        (
            vec![("instance-profile-name", "no-such-profile")],
            "dynamic.linux-amd64.instance-profile-name",
            "no-such-profile",
        ),
    ];
    for (n, (extra, key, value)) in cases.into_iter().enumerate() {
        let cfg = host_config(&fx, &extra);
        let calls_before = h.proxy.requests().len();
        let e = h
            .launch(&cfg, taskrun(&format!("bad-{n}")))
            .await
            .unwrap_err();
        assert_eq!(e.class, ErrorClass::Config, "{e}");
        assert!(!e.is_retryable());
        assert_eq!(e.attempts, 1, "{e}");
        assert_eq!(e.config_key.as_deref(), Some(key), "{e}");
        assert_eq!(e.config_value.as_deref(), Some(value), "{e}");
        let msg = e.to_string();
        assert!(
            msg.starts_with("dynamic platform linux/amd64: the cloud rejected"),
            "{msg}"
        );
        assert!(msg.contains(&format!("{key}=\"{value}\"")), "{msg}");
        // No retries: one call of the failing operation.
        let failing: Vec<_> = h.proxy.requests()[calls_before..]
            .iter()
            .filter(|r| r.action == e.operation.as_str())
            .cloned()
            .collect();
        assert_eq!(failing.len(), 1, "{e}");
    }
    assert!(
        h.cloud
            .list(h.scope(dynamic(&host_config(&fx, &[]))))
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn rejected_credentials_point_at_the_secret() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    h.proxy
        .inject(Fault::error("DescribeInstances", 401, "AuthFailure", 1));
    let e = h.cloud.list(h.scope(dynamic(&cfg))).await.unwrap_err();
    assert_eq!(e.class, ErrorClass::Config);
    assert_eq!(
        e.config_key.as_deref(),
        Some("dynamic.linux-amd64.aws-secret")
    );
    assert!(
        e.to_string()
            .contains("Secret named by dynamic.linux-amd64.aws-secret=\"aws-account\""),
        "{e}"
    );
}

#[tokio::test]
async fn spot_launches_fall_back_to_on_demand_when_refused() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[("spot", "true")]);
    let spot = usable(h.launch(&cfg, taskrun("spot-ok")).await.unwrap());
    assert!(spot.spot, "moto honours the spot market option");

    h.proxy.inject(
        Fault::capacity("RunInstances", 10).when_param("InstanceMarketOptions.MarketType", "spot"),
    );
    let owner = taskrun("spot-refused");
    let fallback = usable(h.launch(&cfg, owner.clone()).await.unwrap());
    assert!(!fallback.spot);
    let runs = h.proxy.requests_of("RunInstances");
    let last_two: Vec<_> = runs[runs.len() - 2..].to_vec();
    assert_eq!(
        last_two[0].param("InstanceMarketOptions.MarketType"),
        Some("spot")
    );
    assert_eq!(
        last_two[0].fault.as_deref(),
        Some("InsufficientInstanceCapacity")
    );
    assert_eq!(last_two[1].param("InstanceMarketOptions.MarketType"), None);
    assert_eq!(
        last_two[1].param("ClientToken"),
        Some(client_token(&cluster(), &owner, Market::OnDemand).as_str())
    );
    assert_eq!(runs.len(), 3, "the spot refusal is not retried as spot");
    assert_eq!(h.cloud.metrics().spot_fallbacks(PLATFORM), 1);
}

// Harness self-checks.

#[tokio::test]
async fn moto_resets_and_stops_on_drop() {
    let moto = Moto::start().await.unwrap();
    let fx = moto.fixture(REGION).await.unwrap();
    moto.launch_raw(REGION, &fx.ami, 2, &[("k", "v")])
        .await
        .unwrap();
    let count = |out: aws_sdk_ec2::operation::describe_instances::DescribeInstancesOutput| {
        out.reservations()
            .iter()
            .map(|r| r.instances().len())
            .sum::<usize>()
    };
    let ec2 = moto.ec2(REGION);
    assert_eq!(count(ec2.describe_instances().send().await.unwrap()), 2);
    moto.reset().await.unwrap();
    assert_eq!(count(ec2.describe_instances().send().await.unwrap()), 0);
    let addr = moto.addr();
    drop(moto);
    assert!(std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err());
}

/// EC2 stops listing a terminated instance after a while; moto, left alone, never does, and its
/// DescribeInstances slows with every instance it ever ran.
#[tokio::test]
async fn moto_forgets_terminated_instances_after_the_delay() {
    let moto = Moto::start_forgetting_terminated_after(Duration::from_secs(2))
        .await
        .unwrap();
    let fx = moto.fixture(REGION).await.unwrap();
    let ids = moto
        .launch_raw(REGION, &fx.ami, 2, &[("k", "v")])
        .await
        .unwrap();
    let ec2 = moto.ec2(REGION);
    ec2.terminate_instances()
        .instance_ids(&ids[0])
        .send()
        .await
        .unwrap();
    let listed = |out: aws_sdk_ec2::operation::describe_instances::DescribeInstancesOutput| {
        out.reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter_map(|i| i.instance_id().map(str::to_owned))
            .collect::<Vec<_>>()
    };
    let all = listed(ec2.describe_instances().send().await.unwrap());
    assert!(
        all.contains(&ids[0]),
        "still listed right after termination: {all:?}"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        listed(ec2.describe_instances().send().await.unwrap()),
        vec![ids[1].clone()],
        "the terminated one is gone, the running one stays"
    );
    let e = ec2
        .describe_instances()
        .instance_ids(&ids[0])
        .send()
        .await
        .unwrap_err();
    let code = e.as_service_error().and_then(|e| e.meta().code());
    assert_eq!(code, Some("InvalidInstanceID.NotFound"), "{e:?}");
}

#[tokio::test]
async fn proxy_refuses_a_non_loopback_upstream() {
    let e = Ec2Proxy::start("10.1.2.3:80".parse().unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not a loopback address"), "{e}");
}

#[tokio::test]
async fn proxy_reports_pending_consistently_with_the_state_filter() {
    let moto = Moto::start().await.unwrap();
    let proxy = Ec2Proxy::start(moto.addr()).await.unwrap();
    let fx = moto.fixture(REGION).await.unwrap();
    proxy.report_pending_for(Duration::from_millis(1500));
    let ec2 = e2e::moto::sdk_client(&proxy.endpoint(), REGION);
    let out = ec2
        .run_instances()
        .image_id(&fx.ami)
        .instance_type("t3.micro".into())
        .min_count(1)
        .max_count(1)
        .send()
        .await
        .unwrap();
    let id = out.instances()[0].instance_id().unwrap().to_owned();
    let ids_in = |state: &'static str| {
        let ec2 = ec2.clone();
        async move {
            let out = ec2
                .describe_instances()
                .filters(
                    aws_sdk_ec2::types::Filter::builder()
                        .name("instance-state-name")
                        .values(state)
                        .build(),
                )
                .send()
                .await
                .unwrap();
            out.reservations()
                .iter()
                .flat_map(|r| r.instances())
                .filter_map(|i| i.instance_id().map(str::to_owned))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(ids_in("pending").await, [id.as_str()]);
    assert!(ids_in("running").await.is_empty());
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert!(ids_in("pending").await.is_empty());
    assert_eq!(ids_in("running").await, [id.as_str()]);
}

// The probe batcher against moto, counting calls at the proxy.

/// `n` instances of this cluster for the platform, launched directly.
async fn launch_many(h: &Harness, n: i32) -> Vec<String> {
    h.moto
        .launch_raw(REGION, &h.fx.ami, n, &launched_by(CLUSTER, "uid-many"))
        .await
        .unwrap()
}

fn id_lookups(proxy: &Ec2Proxy) -> Vec<e2e::ec2_proxy::Recorded> {
    proxy
        .requests_of("DescribeInstances")
        .into_iter()
        .filter(|r| r.param("Filter.1.Name") == Some("instance-id"))
        .collect()
}

#[tokio::test]
async fn probe_lookups_coalesce_per_account_and_fan_out() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let ids = launch_many(&h, 250).await;
    let theirs = h.raw(&launched_by("stone-prod-p02", "uid-t")).await;
    let cloud: Arc<dyn Cloud> = shared_cloud(CLUSTER, &h.proxy);
    let batcher = ProbeBatcher::new(
        cloud,
        BatchOptions {
            window: Duration::from_millis(300),
            max_ids: 200,
        },
    );
    let scope = h.scope(p);
    // 250 of ours, one unknown id, another cluster's: all at once.
    let mut asked: Vec<String> = ids.clone();
    asked.push("i-0123456789abcdef0".into());
    asked.push(theirs.clone());
    let answers =
        futures::future::join_all(asked.iter().map(|id| batcher.describe(scope, id))).await;
    for (id, a) in asked.iter().zip(&answers) {
        let a = a.as_ref().unwrap();
        if ids.contains(id) {
            assert_eq!(a.as_ref().map(|i| i.id.as_str()), Some(id.as_str()));
            assert_eq!(a.as_ref().unwrap().state, InstanceState::Running);
        } else {
            assert_eq!(a, &None, "{id}: unknown, or another cluster's");
        }
    }
    // 252 ids: a full batch of 200 at once, and one of 52 after the window.
    let calls = id_lookups(&h.proxy);
    assert_eq!(calls.len(), 2, "{}", calls.len());
    let values = |r: &e2e::ec2_proxy::Recorded| {
        r.params
            .iter()
            .filter(|(k, _)| k.starts_with("Filter.1.Value."))
            .count()
    };
    let mut sizes: Vec<usize> = calls.iter().map(values).collect();
    sizes.sort();
    assert_eq!(sizes, [52, 200]);

    // Other credentials are another account: their lookups are not mixed in.
    let other = Credentials::Aws(mpc::cloud::AwsCredentials {
        access_key_id: "AKIAOTHERACCOUNT".into(),
        ..test_credentials().aws().clone()
    });
    let other_scope = Scope {
        platform: p,
        credentials: &other,
    };
    let (a, b) = tokio::join!(
        batcher.describe(scope, &ids[0]),
        batcher.describe(other_scope, &ids[1])
    );
    assert!(a.unwrap().is_some() && b.unwrap().is_some());
    assert_eq!(id_lookups(&h.proxy).len(), 4, "one call per account");

    // A failed call reaches every lookup of the batch.
    h.proxy
        .inject(Fault::error("DescribeInstances", 401, "AuthFailure", 1));
    let (a, b) = tokio::join!(
        batcher.describe(scope, &ids[0]),
        batcher.describe(scope, &ids[1])
    );
    for r in [a, b] {
        assert_eq!(r.unwrap_err().class, ErrorClass::Config);
    }
}

/// A controller in miniature: the real scheduler core, cloud actions run through the real
/// runner, results fed back at once; Probe actions are left unanswered (instances stay booting).
struct Ctl {
    sched: Scheduler,
    runner: Runner,
    proxy: Ec2Proxy,
    creds: Credentials,
    platform: Platform,
    template: DynamicPlatform,
    /// Instances this controller launched.
    launched: BTreeSet<String>,
}

impl Ctl {
    async fn start(moto: &Moto, cluster: &str, cfg: &HostConfig, now: Time) -> Self {
        let proxy = Ec2Proxy::start(moto.addr()).await.unwrap();
        let cloud: Arc<dyn Cloud> = shared_cloud(cluster, &proxy);
        let runner = Runner::new(
            cloud,
            Arc::new(LoopbackMap::new()),
            CloudMetrics::unregistered().unwrap(),
            RunnerOptions::default(),
        );
        let mut ctl = Ctl {
            sched: Scheduler::new(cfg.clone(), Policy::mpc()),
            runner,
            proxy,
            creds: test_credentials(),
            platform: Platform::parse(PLATFORM).unwrap(),
            template: dynamic(cfg).clone(),
            launched: BTreeSet::new(),
        };
        let snapshot = Snapshot {
            taskruns: vec![],
            instances: ctl.listing().await,
            ..Snapshot::default()
        };
        let mut out = Vec::new();
        ctl.sched.recover(now, snapshot, &mut out);
        ctl.run(now, out).await;
        ctl
    }

    async fn listing(&self) -> Vec<mpc::scheduler::InstanceRecord> {
        self.runner
            .list(&self.platform, &self.template, &self.creds)
            .await
            .unwrap()
    }

    /// Feeds `e` and runs the resulting cloud actions (and theirs) to the end.
    async fn step(&mut self, now: Time, e: Event) -> Vec<Action> {
        let out = self.sched.step(now, e);
        self.run(now, out).await
    }

    async fn run(&mut self, now: Time, out: Vec<Action>) -> Vec<Action> {
        let mut all = Vec::new();
        let mut queue: std::collections::VecDeque<Action> = out.into();
        while let Some(a) = queue.pop_front() {
            if !matches!(a, Action::Probe { .. })
                && let Some(ev) = self.runner.run(&a, &self.creds).await
            {
                if let Event::Launched { instance_id, .. } = &ev {
                    self.launched.insert(instance_id.clone());
                }
                queue.extend(self.sched.step(now, ev));
            }
            all.push(a);
        }
        all
    }

    async fn list(&mut self, now: Time) -> Vec<Action> {
        let instances = self.listing().await;
        let e = Event::InstancesListed {
            platform: self.platform.clone(),
            instances,
        };
        self.step(now, e).await
    }

    async fn submit(&mut self, now: Time, name: &str) -> Vec<Action> {
        let spec = TaskRunSpec {
            namespace: "tenant".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            platform: PLATFORM.into(),
            since: now,
            retries: 0,
            gated: false,
        };
        self.step(now, Event::TaskRun(spec)).await
    }

    async fn done(&mut self, now: Time, name: &str) -> Vec<Action> {
        let e = Event::TaskRunDone {
            taskrun: TaskRunRef::new("tenant", name, Uid::new(&format!("uid-{name}"))),
        };
        self.step(now, e).await
    }

    /// Instance ids this controller asked the cloud to terminate or retag.
    fn touched(&self) -> BTreeSet<String> {
        ["TerminateInstances", "CreateTags"]
            .iter()
            .flat_map(|a| self.proxy.requests_of(a))
            .filter_map(|r| {
                r.param("InstanceId.1")
                    .or(r.param("ResourceId.1"))
                    .map(str::to_owned)
            })
            .collect()
    }
}

fn launched_in(actions: &[Action]) -> usize {
    actions
        .iter()
        .filter(|a| matches!(a, Action::Launch { .. }))
        .count()
}

fn terminated_in(actions: &[Action]) -> Vec<String> {
    actions
        .iter()
        .filter_map(|x| match x {
            Action::Terminate { instance_id, .. } => Some(instance_id.to_string()),
            _ => None,
        })
        .collect()
}

/// Live instances with the tag in the account, whoever launched them.
async fn live_with_tag(moto: &Moto) -> usize {
    let out = moto
        .ec2(REGION)
        .describe_instances()
        .filters(
            aws_sdk_ec2::types::Filter::builder()
                .name("tag:multi-platform-instance")
                .values("e2e-amd64")
                .build(),
        )
        .send()
        .await
        .unwrap();
    out.reservations()
        .iter()
        .flat_map(|r| r.instances())
        .filter(|i| {
            i.state()
                .and_then(|s| s.name())
                .is_some_and(|n| matches!(n.as_str(), "pending" | "running"))
        })
        .count()
}

fn wall(offset: Duration) -> Time {
    let since = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap();
    Time::from_millis((since + offset).as_millis() as u64)
}

/// Two production clusters share an account, a region and an instance tag (and the Go
/// controller left an instance behind with it): neither touches the other's instances, and
/// together they exceed `max-instances` by at most the launches each made since the other's
/// last listing.
#[tokio::test]
async fn two_clusters_share_an_account_without_touching_each_others_instances() {
    let moto = Moto::start().await.unwrap();
    let fx = moto.fixture(REGION).await.unwrap();
    // Instances stay booting here (probes go unanswered): no allocation timeout within the test.
    let cfg = host_config(
        &fx,
        &[("max-instances", "4"), ("allocation-timeout", "7200")],
    );
    let max = 4;
    let go = moto.launch_raw(REGION, &fx.ami, 1, &GO_TAGS).await.unwrap();
    let mut now = wall(Duration::ZERO);
    let mut a = Ctl::start(&moto, "stone-prod-p01", &cfg, now).await;
    let mut b = Ctl::start(&moto, "stone-prod-p02", &cfg, now).await;
    let foreign = |c: &Ctl| c.sched.gauges().platforms[PLATFORM].foreign;
    assert_eq!((foreign(&a), foreign(&b)), (1, 1), "the Go instance counts");

    // A fills the shared limit; B sees it at its next listing and launches nothing.
    for n in 1..=3 {
        assert_eq!(launched_in(&a.submit(now, &format!("a{n}")).await), 1);
    }
    assert_eq!(launched_in(&a.submit(now, "a4").await), 0, "1 + 3 = max");
    b.list(now).await;
    assert_eq!(foreign(&b), 4);
    assert_eq!(launched_in(&b.submit(now, "b1").await), 0);
    assert_eq!(launched_in(&b.submit(now, "b2").await), 0);
    assert_eq!(live_with_tag(&moto).await, max);

    // A's builds end: a4 takes over a1's unused instance, and B gets a2's slot once it lists.
    a.done(now, "a1").await;
    a.done(now, "a2").await;
    assert_eq!(live_with_tag(&moto).await, max - 1);
    let listed = b.list(now).await;
    assert_eq!(foreign(&b), 3, "a3, a4 and the Go one");
    assert_eq!(launched_in(&listed), 1, "b1 launches from the listing step");
    assert_eq!(live_with_tag(&moto).await, max);
    a.list(now).await;
    assert_eq!(foreign(&a), 2);

    // Both list, then both get a burst before seeing each other again: each launches into the
    // headroom its listing showed. The overshoot is bounded by the other's launches since.
    for n in ["a3", "a4"] {
        a.done(now, n).await;
    }
    // b2 was waiting: it takes over b1's unused instance at once, retagged as its own.
    let handed = b.done(now, "b1").await;
    assert_eq!(launched_in(&handed), 0);
    assert!(
        handed
            .iter()
            .any(|x| matches!(x, Action::Retag { launch, .. } if launch.owner_key() == "uid-b2"))
    );
    b.list(now).await;
    a.list(now).await;
    assert_eq!(live_with_tag(&moto).await, 2, "the Go instance and b2");
    let mut launched_a = 0;
    let mut launched_b = 0;
    for n in 5..=8 {
        launched_a += launched_in(&a.submit(now, &format!("a{n}")).await);
        launched_b += launched_in(&b.submit(now, &format!("b{n}")).await);
    }
    assert_eq!((launched_a, launched_b), (2, 2), "each saw 2 of 4 taken");
    let total = live_with_tag(&moto).await;
    assert_eq!(total, 6);
    assert!(
        total <= max + launched_b.min(launched_a),
        "over the limit by more than one listing interval's launches: {total}"
    );
    // The next listings see the overshoot: nobody launches until it is gone.
    assert_eq!(launched_in(&a.list(now).await), 0);
    assert_eq!(launched_in(&b.list(now).await), 0);
    assert_eq!((foreign(&a), foreign(&b)), (4, 3));
    assert_eq!(launched_in(&a.submit(now, "a9").await), 0);
    assert_eq!(live_with_tag(&moto).await, 6);

    // An hour later (past the orphan grace), each cluster's listing terminates only its own
    // orphans: an instance of each carrying its cluster tag that no TaskRun owns.
    now = wall(Duration::from_secs(3600));
    let orphan_a = moto
        .launch_raw(
            REGION,
            &fx.ami,
            1,
            &launched_by("stone-prod-p01", "uid-gone-a"),
        )
        .await
        .unwrap();
    let orphan_b = moto
        .launch_raw(
            REGION,
            &fx.ami,
            1,
            &launched_by("stone-prod-p02", "uid-gone-b"),
        )
        .await
        .unwrap();
    assert_eq!(terminated_in(&a.list(now).await), orphan_a);
    assert_eq!(terminated_in(&b.list(now).await), orphan_b);

    // Neither ever asked the cloud to terminate or retag what it did not launch (or, for the
    // orphans, what does not carry its cluster tag); the Go instance is untouched.
    let mine_a: BTreeSet<String> = a.launched.iter().chain(&orphan_a).cloned().collect();
    let mine_b: BTreeSet<String> = b.launched.iter().chain(&orphan_b).cloned().collect();
    assert!(a.touched().is_subset(&mine_a), "{:?}", a.touched());
    assert!(b.touched().is_subset(&mine_b), "{:?}", b.touched());
    assert!(!a.touched().is_empty() && !b.touched().is_empty());
    let state = |id: String| {
        let ec2 = moto.ec2(REGION);
        async move {
            let out = ec2
                .describe_instances()
                .instance_ids(&id)
                .send()
                .await
                .unwrap();
            out.reservations()[0].instances()[0]
                .state()
                .and_then(|s| s.name())
                .map(|n| n.as_str().to_owned())
                .unwrap()
        }
    };
    assert_eq!(state(go[0].clone()).await, "running");
    let running = futures::future::join_all(
        a.launched
            .iter()
            .chain(&b.launched)
            .map(|id| state(id.clone())),
    )
    .await
    .into_iter()
    .filter(|s| s == "running")
    .count();
    assert_eq!(running, 5, "a5, a6, b5, b6 and b1's, now b2's");
}

/// A launch of ours that a listing shows before anything here tracks it (a leader that crashed
/// before the launch result came back) counts against `max-instances` while it is younger than
/// the orphan grace, and is terminated as an orphan after it. A terminate the cloud keeps
/// refusing (403 `UnauthorizedOperation` through the proxy) is retried with back-off; at the
/// bound an Event reports it leaked and its TaskRun's finalizer goes, but it still counts
/// against `max-instances`: however many TaskRuns come, no more than `max-instances` instances
/// run while every termination is refused. The terminations are still retried, every few
/// minutes, and once the cloud accepts them the waiters launch.
#[tokio::test]
async fn young_unknown_instances_count_and_a_refused_terminate_is_bounded() {
    let moto = Moto::start().await.unwrap();
    let fx = moto.fixture(REGION).await.unwrap();
    let cfg = host_config(
        &fx,
        &[("max-instances", "2"), ("allocation-timeout", "7200")],
    );
    let mut now = wall(Duration::ZERO);
    let mut c = Ctl::start(&moto, CLUSTER, &cfg, now).await;
    let gauges = |c: &Ctl| c.sched.gauges().platforms[PLATFORM].clone();

    let young = moto
        .launch_raw(REGION, &fx.ami, 1, &launched_by(CLUSTER, "uid-crashed"))
        .await
        .unwrap();
    assert!(
        terminated_in(&c.list(now).await).is_empty(),
        "young: left alone"
    );
    assert_eq!(gauges(&c).foreign, 1);
    assert_eq!(launched_in(&c.submit(now, "a1").await), 1);
    assert_eq!(
        launched_in(&c.submit(now, "a2").await),
        0,
        "a1's and the young one fill max-instances"
    );
    assert_eq!(live_with_tag(&moto).await, 2);
    now = wall(Duration::from_secs(11 * 60));
    let listed = c.list(now).await;
    assert_eq!(terminated_in(&listed), young, "an orphan past the grace");
    assert_eq!(launched_in(&listed), 1, "a2 takes its place");

    // Terminations are refused from here on.
    c.proxy.inject(Fault::error(
        "TerminateInstances",
        403,
        "UnauthorizedOperation",
        1000,
    ));
    // a1 and a2 end before anyone waits (a waiter would take over an unused instance).
    let mut stuck = BTreeSet::new();
    for name in ["a1", "a2"] {
        stuck.extend(terminated_in(&c.done(now, name).await));
    }
    assert_eq!(stuck.len(), 2);
    // TaskRuns keep coming: none launches, whatever the refusals.
    for name in ["a3", "a4", "a5", "a6", "a7"] {
        assert_eq!(launched_in(&c.submit(now, name).await), 0, "{name}");
    }
    let mut tries = 1;
    let mut leaked = Vec::new();
    while leaked.is_empty() {
        assert!(tries < 10, "never bounded");
        now = now + Duration::from_secs(301);
        let a = c.step(now, Event::Tick).await;
        let retried: BTreeSet<String> = terminated_in(&a).into_iter().collect();
        assert_eq!(retried, stuck, "retried");
        assert_eq!(launched_in(&a), 0, "still running: still counted");
        tries += 1;
        if a.iter().any(|x| {
            matches!(
                x,
                Action::Notify {
                    reason: "InstanceLeaked",
                    ..
                }
            )
        }) {
            leaked = a;
        }
    }
    assert_eq!(
        tries,
        Policy::mpc().cleanup_attempts,
        "bounded by cleanup_attempts"
    );
    for id in &stuck {
        assert!(
            leaked.iter().any(|x| matches!(x, Action::Notify { reason: "InstanceLeaked", message, .. } if message.contains(id.as_str()))),
            "{leaked:#?}"
        );
    }
    for name in ["a1", "a2"] {
        assert!(
            leaked.iter().any(
                |x| matches!(x, Action::RemoveFinalizer { taskrun, .. } if taskrun.name() == name)
            ),
            "{name}'s finalizer goes"
        );
    }
    assert_eq!(
        c.proxy.requests_of("TerminateInstances").len(),
        2 * tries as usize + 1,
        "the young one's, then a1's and a2's tries"
    );
    // Still retried every few minutes; nothing launches while they run.
    for _ in 0..6 {
        now = now + Duration::from_secs(301);
        let a = c.step(now, Event::Tick).await;
        assert_eq!(terminated_in(&a).len(), 2, "retried: {a:#?}");
        assert_eq!(launched_in(&a), 0, "{a:#?}");
    }
    let g = gauges(&c);
    assert_eq!((g.instances, g.leaked, g.waiting), (2, 2, 5));
    assert_eq!(
        live_with_tag(&moto).await,
        2,
        "max-instances, not one per TaskRun"
    );

    // Once the cloud accepts, the leaks are over and two waiters launch.
    c.proxy.clear_faults();
    now = now + Duration::from_secs(301);
    let a = c.step(now, Event::Tick).await;
    let gone: BTreeSet<String> = terminated_in(&a).into_iter().collect();
    assert_eq!(gone, stuck);
    assert_eq!(launched_in(&a), 2, "{a:#?}");
    assert_eq!(gauges(&c).leaked, 0);
    assert_eq!(live_with_tag(&moto).await, 2);
}

/// Time runs this much faster than the scheduler's clock in the probing measurement.
const SPEED: f64 = 3.0;

/// What one probing measurement saw over 30 s of scheduler time.
#[derive(Debug)]
struct ProbeCost {
    probes: usize,
    calls: usize,
}

/// 100 TaskRuns arrive over 30 s of scheduler time; the real scheduler launches an instance for
/// each (answered from `instances`, launched beforehand in one call: launching is not what is
/// measured) and probes them on `Policy::mpc()`'s cadence (first probe 20 s after the launch,
/// then 5 s after each answer). The instances stay booting (the proxy reports them pending), so
/// every one keeps probing; each probe runs through the runner, concurrently. Counts the probes
/// issued and the DescribeInstances-by-id calls the proxy saw over 30 s of scheduler time once
/// all of them probe. The clock runs `SPEED` times faster than real time; `batch.window` is
/// given in scheduler time and scaled alike.
async fn measure_probe_cost(
    h: &Harness,
    cfg: &HostConfig,
    instances: Vec<String>,
    batch: BatchOptions,
) -> ProbeCost {
    let cloud: Arc<dyn Cloud> = shared_cloud(CLUSTER, &h.proxy);
    let runner = Arc::new(Runner::new(
        cloud,
        Arc::new(LoopbackMap::new()),
        CloudMetrics::unregistered().unwrap(),
        RunnerOptions {
            batch: BatchOptions {
                window: batch.window.div_f64(SPEED),
                ..batch
            },
            ssh_timeout: Duration::from_secs(1),
        },
    ));
    let n = instances.len();
    let mut unused = instances.into_iter();
    let mut sched = Scheduler::new(cfg.clone(), Policy::mpc());
    let t0 = Time::from_secs(1_700_000_000);
    let real0 = Instant::now();
    let vnow = || t0 + real0.elapsed().mul_f64(SPEED);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Event>();
    let (mut probes, mut submitted, mut launched) = (0usize, 0usize, 0usize);
    let mut window: Option<(Time, Time)> = None;
    let mut at_start: Option<(usize, usize)> = None;
    let mut out = Vec::new();
    sched.recover(vnow(), Snapshot::default(), &mut out);
    let mut pending: std::collections::VecDeque<Action> = out.into();
    loop {
        let now = vnow();
        while submitted < n && t0 + Duration::from_millis(submitted as u64 * 300) <= now {
            let spec = TaskRunSpec {
                namespace: "bench".into(),
                name: format!("build-{submitted}"),
                uid: format!("uid-bench-{submitted}"),
                platform: PLATFORM.into(),
                since: now,
                retries: 0,
                gated: false,
            };
            pending.extend(sched.step(now, Event::TaskRun(spec)));
            submitted += 1;
        }
        if sched.next_deadline().is_some_and(|d| d <= now) {
            pending.extend(sched.step(now, Event::Tick));
        }
        while let Some(a) = pending.pop_front() {
            match a {
                Action::Launch { op, .. } => {
                    let id = unused.next().expect("one instance per TaskRun");
                    pending.extend(sched.step(
                        now,
                        Event::Launched {
                            op,
                            instance_id: id,
                        },
                    ));
                    launched += 1;
                    if launched == n {
                        // Every instance probes from 20 s after its launch: steady from 25 s.
                        let start = now + Duration::from_secs(25);
                        window = Some((start, start + Duration::from_secs(30)));
                    }
                }
                Action::Probe { .. } => {
                    probes += 1;
                    let (runner, tx) = (runner.clone(), tx.clone());
                    tokio::spawn(async move {
                        if let Some(ev) = runner.run(&a, &test_credentials()).await {
                            let _ = tx.send(ev);
                        }
                    });
                }
                _ => {}
            }
        }
        if let Some((start, end)) = window {
            if now >= end {
                let (p0, c0) = at_start.expect("the window started");
                return ProbeCost {
                    probes: probes - p0,
                    calls: id_lookups(&h.proxy).len() - c0,
                };
            }
            if now >= start && at_start.is_none() {
                at_start = Some((probes, id_lookups(&h.proxy).len()));
            }
        }
        tokio::select! {
            Some(ev) = rx.recv() => pending.extend(sched.step(vnow(), ev)),
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    }
}

/// BENCHMARKS.md "Probing cost": DescribeInstances calls per minute for 100 booting instances,
/// one per probe versus the probe batcher. A measurement (about a minute and a half of wall time), so run
/// on demand: `cargo test --workspace --test cloud -- --ignored --nocapture batched_probes`.
#[tokio::test]
#[ignore = "benchmark, run on demand (BENCHMARKS.md, Probing cost)"]
async fn batched_probes_cut_describe_calls_per_minute() {
    let h = harness().await;
    h.proxy.report_pending_for(Duration::from_secs(3600));
    let cfg = host_config(
        &h.fx,
        &[("max-instances", "100"), ("allocation-timeout", "3600")],
    );
    let unbatched = measure_probe_cost(
        &h,
        &cfg,
        launch_many(&h, 100).await,
        BatchOptions {
            window: Duration::ZERO,
            max_ids: 1,
        },
    )
    .await;
    let batched = measure_probe_cost(
        &h,
        &cfg,
        launch_many(&h, 100).await,
        BatchOptions::default(),
    )
    .await;
    let per_minute = |c: &ProbeCost| (c.probes * 2, c.calls * 2);
    let (p1, c1) = per_minute(&unbatched);
    let (p2, c2) = per_minute(&batched);
    eprintln!(
        "100 booting instances, per minute of scheduler time: one call per probe: {p1} probes, {c1} DescribeInstances; batched (1 s window): {p2} probes, {c2} DescribeInstances"
    );
    // One call per probe (up to the window's edges), each instance every 5 s and the answer's
    // latency.
    assert!(c1.abs_diff(p1) * 10 <= p1, "{unbatched:?}");
    assert!(p1 >= 600, "{unbatched:?}");
    // Batched: every instance keeps being probed, a call covers many.
    assert!(p2 >= p1 / 2, "{batched:?}");
    assert!(c1 >= 10 * c2, "{unbatched:?} {batched:?}");
}
