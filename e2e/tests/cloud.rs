//! The EC2 provider against a real moto server through the real AWS SDK, with the fault-injecting
//! proxy in front (it also records requests, for parameters moto does not keep).
//!
//! Every test starts its own moto and proxy on random loopback ports, so tests run in parallel.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant, SystemTime};

use aws_sdk_ec2::types::InstanceAttributeName;
use e2e::ec2_proxy::{Ec2Proxy, Fault};
use e2e::moto::{Fixture, Moto, test_credentials};
use e2e::sshd::{HostSetup, SshdHost};
use mpc::cloud::aws::{AwsCloud, AwsOptions};
use mpc::cloud::launch::{Market, client_token, tags};
use mpc::cloud::metrics::CloudMetrics;
use mpc::cloud::reach::{LoopbackMap, Probe, probe_all, probe_ssh};
use mpc::cloud::retry::RetryPolicy;
use mpc::cloud::sweep::{LiveOwners, sweep};
use mpc::cloud::{
    Cloud, CloudError, Credentials, ErrorClass, InstanceState, LaunchRequest, Launched, Operation,
    Owner, Scope, Terminated, count_toward_limit,
};
use mpc::config::{self, ConfigData, DynamicPlatform, HostConfig};

const REGION: &str = "us-east-1";
const PLATFORM: &str = "linux/amd64";

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
        moto.loopback_subnet(REGION).await
    } else {
        moto.fixture(REGION).await
    }
    .expect("fixture");
    let mut options = AwsOptions {
        endpoint: Some(proxy.endpoint()),
        retry: fast_retry(),
        page_size: 1000,
        connect_timeout: Duration::from_secs(2),
        call_timeout: Duration::from_secs(10),
    };
    tune(&mut options);
    Harness {
        moto,
        proxy,
        fx,
        cloud: AwsCloud::new(options, CloudMetrics::unregistered().unwrap()),
        creds: test_credentials(),
    }
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

fn taskrun(name: &str) -> Owner {
    Owner::TaskRun {
        namespace: "tenant".into(),
        name: name.into(),
        uid: format!("uid-{name}-5f0e"),
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
        owner: Owner,
        attempt: u32,
    ) -> Result<Launched, CloudError> {
        let req = LaunchRequest {
            scope: self.scope(dynamic(cfg)),
            owner,
            attempt,
            additional_tags: &cfg.additional_instance_tags,
        };
        self.cloud.launch(&req).await
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
    let launched = h.launch(&cfg, owner.clone(), 1).await.unwrap();
    assert!(!launched.adopted);
    let id = launched.instance.id.clone();

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
        (tags::OWNER, "uid-build-all-options-5f0e"),
        (tags::ATTEMPT, "1"),
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
        Some(client_token(owner.key(), 1, Market::OnDemand).as_str())
    );
    assert_eq!(r.param("InstanceMarketOptions.MarketType"), None);
    // The root volume is tagged like the instance.
    assert_eq!(r.param("TagSpecification.2.ResourceType"), Some("volume"));
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
    let id = h
        .launch(&cfg, taskrun("by-name"), 1)
        .await
        .unwrap()
        .instance
        .id;
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
async fn inventory_pages_and_filters_by_tag_and_state() {
    let h = harness_with(|o| o.page_size = 5, false).await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let mut ours = Vec::new();
    for n in 0..8 {
        ours.push(
            h.launch(&cfg, taskrun(&format!("inv-{n}")), 1)
                .await
                .unwrap()
                .instance
                .id,
        );
    }
    // Not ours: another instance tag, no tags at all, and our tag but another platform.
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
    h.moto.launch_raw(REGION, &h.fx.ami, 1, &[]).await.unwrap();
    h.moto
        .launch_raw(
            REGION,
            &h.fx.ami,
            1,
            &[
                ("MultiPlatformManaged", "true"),
                ("multi-platform-instance", "e2e-amd64"),
                (tags::PLATFORM, "linux-arm64"),
            ],
        )
        .await
        .unwrap();
    // One launched by the Go controller (no platform tag): ours by instance tag.
    let legacy = h
        .moto
        .launch_raw(
            REGION,
            &h.fx.ami,
            1,
            &[
                ("MultiPlatformManaged", "true"),
                ("multi-platform-instance", "e2e-amd64"),
                ("taskRunID", "tenant:go-built"),
            ],
        )
        .await
        .unwrap();
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
        .map(String::as_str)
        .chain(legacy.iter().map(String::as_str))
        .collect();
    want.sort();
    assert_eq!(ids, want);
    let stopped = listed.iter().find(|i| i.id == ours[1]).unwrap();
    assert!(matches!(
        stopped.state,
        InstanceState::Stopped | InstanceState::Stopping
    ));
    assert!(stopped.state.is_gone());
    assert_eq!(
        count_toward_limit(&listed),
        7,
        "6 running of ours + the legacy one"
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
    assert_eq!(m.instances(PLATFORM, InstanceState::Running), 7);
    assert_eq!(
        m.instances(PLATFORM, InstanceState::Stopped)
            + m.instances(PLATFORM, InstanceState::Stopping),
        1
    );
}

#[tokio::test]
async fn terminate_is_idempotent_and_only_for_our_instances() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let id = h
        .launch(&cfg, taskrun("term"), 1)
        .await
        .unwrap()
        .instance
        .id;
    assert_eq!(
        h.cloud.terminate(h.scope(p), &id).await.unwrap(),
        Terminated::Requested
    );
    assert_eq!(
        h.cloud.terminate(h.scope(p), &id).await.unwrap(),
        Terminated::AlreadyGone
    );
    assert_eq!(h.proxy.requests_of("TerminateInstances").len(), 1);
    assert_eq!(h.moto_state(&id).await, "terminated");
    let seen = h.cloud.describe(h.scope(p), &id).await.unwrap().unwrap();
    assert!(seen.state.is_gone());
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
            .terminate(h.scope(p), "i-0123456789abcdef0")
            .await
            .unwrap(),
        Terminated::AlreadyGone
    );
    assert_eq!(
        h.cloud
            .describe(h.scope(p), "i-0123456789abcdef0")
            .await
            .unwrap(),
        None
    );

    // Not ours (no tags): refused, and left running.
    let foreign = h
        .moto
        .launch_raw(REGION, &h.fx.ami, 1, &[("team", "x")])
        .await
        .unwrap();
    let e = h
        .cloud
        .terminate(h.scope(p), &foreign[0])
        .await
        .unwrap_err();
    assert_eq!(e.class, ErrorClass::Refused);
    assert!(!e.is_retryable());
    assert!(e.to_string().contains("refusing to terminate"), "{e}");
    assert_eq!(h.moto_state(&foreign[0]).await, "running");
    assert_eq!(
        h.cloud.describe(h.scope(p), &foreign[0]).await.unwrap(),
        None
    );
}

#[tokio::test]
async fn max_instances_counting_includes_pending_instances() {
    let h = harness().await;
    h.proxy.report_pending_for(Duration::from_secs(600));
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    for n in 0..3 {
        let l = h
            .launch(&cfg, taskrun(&format!("cap-{n}")), 1)
            .await
            .unwrap();
        assert_eq!(l.instance.state, InstanceState::Pending);
    }
    let listed = h.cloud.list(h.scope(p)).await.unwrap();
    assert_eq!(listed.len(), 3);
    assert!(
        listed.iter().all(|i| i.state == InstanceState::Pending),
        "{listed:?}"
    );
    assert_eq!(
        count_toward_limit(&listed),
        p.max_instances,
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
    let launched = h.launch(&cfg, taskrun("boot"), 1).await.unwrap().instance;
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
        let i = h
            .cloud
            .describe(h.scope(p), &launched.id)
            .await
            .unwrap()
            .unwrap();
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
    let launched = h
        .launch(&cfg, taskrun("fake-addr"), 1)
        .await
        .unwrap()
        .instance;
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
async fn launch_adopts_the_instance_of_an_earlier_try() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let owner = taskrun("adopt");
    let first = h.launch(&cfg, owner.clone(), 1).await.unwrap();
    assert!(!first.adopted);
    // The same (owner, attempt) again, e.g. after a timeout or a restart: no second instance.
    let again = h.launch(&cfg, owner.clone(), 1).await.unwrap();
    assert!(again.adopted);
    assert_eq!(again.instance.id, first.instance.id);
    assert_eq!(h.proxy.requests_of("RunInstances").len(), 1);

    // A try whose RunInstances answer was lost: the instance exists only in the cloud.
    let lost = h
        .moto
        .launch_raw(
            REGION,
            &h.fx.ami,
            1,
            &[
                ("MultiPlatformManaged", "true"),
                ("multi-platform-instance", "e2e-amd64"),
                ("taskRunID", "tenant:lost"),
                (tags::OWNER, "uid-lost-5f0e"),
                (tags::ATTEMPT, "1"),
                (tags::PLATFORM, "linux-amd64"),
            ],
        )
        .await
        .unwrap();
    let adopted = h.launch(&cfg, taskrun("lost"), 1).await.unwrap();
    assert!(adopted.adopted);
    assert_eq!(adopted.instance.id, lost[0]);
    assert_eq!(h.proxy.requests_of("RunInstances").len(), 1);

    // A new attempt launches a new instance.
    let second = h.launch(&cfg, owner, 2).await.unwrap();
    assert!(!second.adopted);
    assert_ne!(second.instance.id, first.instance.id);
    assert_eq!(second.instance.attempt(), Some(2));
    assert_eq!(h.proxy.requests_of("RunInstances").len(), 2);
    assert_eq!(h.cloud.list(h.scope(p)).await.unwrap().len(), 3);
    assert_eq!(h.cloud.metrics().launches(PLATFORM), (2, 2));
}

#[tokio::test]
async fn orphan_sweep_terminates_only_what_it_should() {
    let h = harness().await;
    let cfg = host_config(&h.fx, &[]);
    let p = dynamic(&cfg);
    let live_id = h
        .launch(&cfg, taskrun("alive"), 1)
        .await
        .unwrap()
        .instance
        .id;
    let dead_id = h
        .launch(&cfg, taskrun("dead"), 1)
        .await
        .unwrap()
        .instance
        .id;
    let pool_id = h
        .launch(
            &cfg,
            Owner::PoolInstance {
                name: "pool-amd64-1".into(),
            },
            1,
        )
        .await
        .unwrap()
        .instance
        .id;
    let legacy_live = h
        .moto
        .launch_raw(
            REGION,
            &h.fx.ami,
            1,
            &[
                ("MultiPlatformManaged", "true"),
                ("multi-platform-instance", "e2e-amd64"),
                ("taskRunID", "tenant:go-alive"),
            ],
        )
        .await
        .unwrap();
    let legacy_dead = h
        .moto
        .launch_raw(
            REGION,
            &h.fx.ami,
            1,
            &[
                ("MultiPlatformManaged", "true"),
                ("multi-platform-instance", "e2e-amd64"),
                ("taskRunID", "tenant:go-dead"),
            ],
        )
        .await
        .unwrap();
    let not_ours = h
        .moto
        .launch_raw(
            REGION,
            &h.fx.ami,
            1,
            &[
                ("MultiPlatformManaged", "true"),
                ("multi-platform-instance", "someone-else"),
            ],
        )
        .await
        .unwrap();

    let mut live = LiveOwners::new();
    live.add_taskrun("tenant", "alive", "uid-alive-5f0e");
    live.add_taskrun("tenant", "go-alive", "uid-go-alive");
    live.add_pool_instance("pool-amd64-1");
    let grace = Duration::from_secs(15 * 60);

    // Within the grace period nothing is touched.
    let r = sweep(
        &h.cloud,
        h.scope(p),
        &live,
        SystemTime::now(),
        grace,
        h.cloud.metrics(),
    )
    .await
    .unwrap();
    assert_eq!(r.examined, 5);
    assert!(r.terminated.is_empty() && r.failed.is_empty(), "{r:?}");

    // An hour later the two orphans go.
    let later = SystemTime::now() + Duration::from_secs(3600);
    let r = sweep(&h.cloud, h.scope(p), &live, later, grace, h.cloud.metrics())
        .await
        .unwrap();
    let mut gone = r.terminated.clone();
    gone.sort();
    let mut want = vec![dead_id.clone(), legacy_dead[0].clone()];
    want.sort();
    assert_eq!(gone, want);
    assert!(r.failed.is_empty());
    for id in [&live_id, &pool_id, &legacy_live[0], &not_ours[0]] {
        assert_eq!(h.moto_state(id).await, "running", "{id}");
    }
    for id in &want {
        assert_eq!(h.moto_state(id).await, "terminated", "{id}");
    }
    assert_eq!(h.cloud.metrics().orphans_terminated(PLATFORM), 2);

    // Nothing left to sweep.
    let r = sweep(&h.cloud, h.scope(p), &live, later, grace, h.cloud.metrics())
        .await
        .unwrap();
    assert!(r.terminated.is_empty());
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
    let launched = h.launch(&cfg, owner.clone(), 1).await.unwrap();
    assert_eq!(launched.instance.tag("taskRunID"), Some("tenant:retry"));

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
    let token = client_token(owner.key(), 1, Market::OnDemand);
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
            .launch(&cfg, taskrun(&format!("bad-{n}")), 1)
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
    let owner = taskrun("spot-ok");
    let spot = h.launch(&cfg, owner, 1).await.unwrap();
    assert!(spot.instance.spot, "moto honours the spot market option");

    h.proxy.inject(
        Fault::capacity("RunInstances", 10).when_param("InstanceMarketOptions.MarketType", "spot"),
    );
    let owner = taskrun("spot-refused");
    let fallback = h.launch(&cfg, owner.clone(), 1).await.unwrap();
    assert!(!fallback.instance.spot);
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
        Some(client_token(owner.key(), 1, Market::OnDemand).as_str())
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
