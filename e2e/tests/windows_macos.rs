//! Windows and macOS build hosts: the launch parameters moto ignores (checked on the requests the
//! recording proxy saw, region included), launch failures of those platforms, and the key
//! hand-off against sshd hosts answering as a Windows host (PowerShell commands, CRLF output,
//! `Administrator` only) and as a macOS host (`ec2-user`, `sudo rm`) would, with the key file
//! appearing late and a reboot in the middle.

use std::time::Duration;

use e2e::ec2_proxy::{Ec2Proxy, Fault};
use e2e::moto::{Fixture, Moto, test_credentials};
use mpc::cloud::aws::{AwsCloud, AwsOptions};
use mpc::cloud::metrics::CloudMetrics;
use mpc::cloud::retry::RetryPolicy;
use mpc::cloud::{Cloud, ClusterId, Credentials, ErrorClass, LaunchOutcome, LaunchRequest, Scope};
use mpc::config::{self, ConfigData, DynamicPlatform, HostConfig, HostOs};
use mpc::scheduler::{LaunchId, LaunchOwner, TaskRunRef, Uid};

const MAC_REGION: &str = "eu-central-1";
const WIN_REGION: &str = "us-east-1";
const GROUP_ARN: &str = "arn:aws:resource-groups:eu-central-1:381491906438:group/macos";
const LICENSE_ARN: &str = "arn:aws:license-manager:eu-central-1:381491906438:license-configuration:lic-f8ce13fa40eab0916af2734edf5c85ab";

fn cloud(proxy: &Ec2Proxy) -> AwsCloud {
    AwsCloud::new(
        AwsOptions {
            cluster: ClusterId::new("e2e-cluster").unwrap(),
            endpoint: Some(proxy.endpoint()),
            retry: RetryPolicy {
                base_delay: Duration::from_millis(10),
                max_delay: Duration::from_millis(100),
                backoff_attempts: 6,
                bounded_attempts: 3,
            },
            page_size: 1000,
            connect_timeout: Duration::from_secs(2),
            call_timeout: Duration::from_secs(10),
        },
        CloudMetrics::unregistered().unwrap(),
    )
}

/// The production macOS platform of stone-prod-p02 (region, instance type, dedicated-host keys),
/// on the emulator's image, subnet and group.
fn macos_config(fx: &Fixture) -> HostConfig {
    let label = "dynamic.macos-mac2metal-arm64";
    parsed(&[
        ("dynamic-platforms", "macos-mac2metal/arm64"),
        ("instance-tag", "e2e"),
        (&format!("{label}.type"), "aws"),
        (&format!("{label}.region"), MAC_REGION),
        (&format!("{label}.ami"), &fx.arm64_ami),
        (&format!("{label}.instance-type"), "mac2-m2.metal"),
        (&format!("{label}.key-name"), &fx.key_name),
        (&format!("{label}.aws-secret"), "aws-account"),
        (&format!("{label}.ssh-secret"), "aws-macos-ssh-key"),
        (&format!("{label}.subnet-id"), &fx.subnet_id),
        (&format!("{label}.security-group-id"), &fx.security_group_id),
        (&format!("{label}.max-instances"), "5"),
        (&format!("{label}.disk"), "100"),
        (&format!("{label}.allocation-timeout"), "1200"),
        (&format!("{label}.tenancy"), "host"),
        (&format!("{label}.host-resource-group-arn"), GROUP_ARN),
        (&format!("{label}.license-configuration-arn"), LICENSE_ARN),
    ])
}

fn windows_config(fx: &Fixture, ami: &str) -> HostConfig {
    let label = "dynamic.windows-4xlarge-amd64";
    parsed(&[
        ("dynamic-platforms", "windows-4xlarge/amd64"),
        ("instance-tag", "e2e"),
        (&format!("{label}.type"), "aws"),
        (&format!("{label}.region"), WIN_REGION),
        (&format!("{label}.ami"), ami),
        (&format!("{label}.instance-type"), "c5.4xlarge"),
        (&format!("{label}.key-name"), &fx.key_name),
        (&format!("{label}.aws-secret"), "aws-account"),
        (&format!("{label}.ssh-secret"), "aws-win-ssh-key"),
        (&format!("{label}.subnet-id"), &fx.subnet_id),
        (&format!("{label}.max-instances"), "5"),
        (&format!("{label}.disk"), "100"),
        (
            &format!("{label}.user-data"),
            "<powershell>\nStart-Service sshd\n</powershell>\n",
        ),
    ])
}

fn parsed(pairs: &[(&str, &str)]) -> HostConfig {
    let d: ConfigData = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let parsed = config::parse(&d);
    assert!(parsed.diagnostics.is_empty(), "{:#?}", parsed.diagnostics);
    parsed.config
}

fn only(cfg: &HostConfig) -> &DynamicPlatform {
    cfg.dynamic.values().next().expect("one dynamic platform")
}

fn launch_id(name: &str) -> LaunchId {
    LaunchId {
        owner: LaunchOwner::TaskRun(TaskRunRef::new(
            "tenant",
            name,
            Uid::new(&format!("uid-{name}-7a1c")),
        )),
        retry: 0,
        attempt: 1,
    }
}

fn scope<'a>(p: &'a DynamicPlatform, creds: &'a Credentials) -> Scope<'a> {
    Scope {
        platform: p,
        credentials: creds,
    }
}

#[tokio::test]
async fn macos_launch_sends_the_dedicated_host_and_every_call_uses_the_platform_region() {
    let moto = Moto::start().await.expect("moto starts");
    let proxy = Ec2Proxy::start(moto.addr()).await.expect("proxy starts");
    let fx = moto.fixture(MAC_REGION).await.expect("fixture");
    let cfg = macos_config(&fx);
    let p = only(&cfg);
    assert_eq!(p.os, HostOs::MacOs);
    let creds = test_credentials();
    let cloud = cloud(&proxy);
    let launch = launch_id("mac-build");
    let req = LaunchRequest {
        scope: scope(p, &creds),
        launch: &launch,
        additional_tags: &[],
    };
    let instance = match cloud.launch(&req).await.expect("launch") {
        LaunchOutcome::Launched(i) => i,
        other => panic!("{other:?}"),
    };
    let run = proxy.requests_of("RunInstances");
    assert_eq!(run.len(), 1);
    let run = &run[0];
    assert_eq!(run.param("Placement.Tenancy"), Some("host"), "{run:?}");
    assert_eq!(
        run.param("Placement.HostResourceGroupArn"),
        Some(GROUP_ARN),
        "{run:?}"
    );
    assert_eq!(
        run.param("LicenseSpecification.1.LicenseConfigurationArn"),
        Some(LICENSE_ARN),
        "{run:?}"
    );
    assert_eq!(run.param("InstanceType"), Some("mac2-m2.metal"));
    assert_eq!(
        run.param("BlockDeviceMapping.1.Ebs.VolumeSize"),
        Some("100")
    );

    // List (and count), address lookup, terminate: all in the platform's region.
    let listed = cloud.list(scope(p, &creds)).await.expect("list");
    assert!(listed.iter().any(|i| i.id == instance.id));
    let described = cloud
        .describe(scope(p, &creds), std::slice::from_ref(&instance.id))
        .await
        .expect("describe");
    assert_eq!(described.len(), 1);
    cloud
        .terminate(scope(p, &creds), &instance.id, false)
        .await
        .expect("terminate");
    let all = proxy.requests();
    assert!(all.len() >= 5, "{all:#?}");
    for r in &all {
        assert_eq!(r.region.as_deref(), Some(MAC_REGION), "{r:?}");
    }
    for action in [
        "DescribeImages",
        "RunInstances",
        "DescribeInstances",
        "TerminateInstances",
    ] {
        assert!(
            all.iter().any(|r| r.action == action),
            "{action} missing: {all:#?}"
        );
    }
}

#[tokio::test]
async fn windows_ssm_images_pass_through_and_a_deregistered_image_fails_at_once() {
    let moto = Moto::start().await.expect("moto starts");
    let proxy = Ec2Proxy::start(moto.addr()).await.expect("proxy starts");
    let fx = moto.fixture(WIN_REGION).await.expect("fixture");
    let ssm = "resolve:ssm:/aws/service/ami-windows-latest/Windows_Server-2022-English-Full-Base";
    let cfg = windows_config(&fx, ssm);
    let p = only(&cfg);
    assert_eq!(p.os, HostOs::Windows);
    let creds = test_credentials();
    let cloud = cloud(&proxy);
    // AWS deregistered the image the parameter named: a configuration error naming the image,
    // after one call (no retries that burn the allocation timeout).
    proxy.inject(Fault::error(
        "RunInstances",
        400,
        "InvalidAMIID.NotFound",
        1,
    ));
    let launch = launch_id("win-gone-image");
    let req = LaunchRequest {
        scope: scope(p, &creds),
        launch: &launch,
        additional_tags: &[],
    };
    let e = cloud.launch(&req).await.unwrap_err();
    assert_eq!(e.class, ErrorClass::Config, "{e}");
    assert!(!e.is_retryable(), "{e}");
    assert_eq!(
        e.config_key.as_deref(),
        Some("dynamic.windows-4xlarge-amd64.ami")
    );
    assert_eq!(e.config_value.as_deref(), Some(ssm));
    assert!(e.to_string().contains(ssm), "{e}");
    assert!(
        proxy.requests_of("DescribeImages").is_empty(),
        "an SSM parameter is not an image id to describe"
    );
    let run = proxy.requests_of("RunInstances");
    assert_eq!(run.len(), 1, "{run:#?}");
    // The image id is sent as written; Windows images' root device takes the disk size.
    assert_eq!(run[0].param("ImageId"), Some(ssm));
    assert_eq!(
        run[0].param("BlockDeviceMapping.1.DeviceName"),
        Some("/dev/sda1")
    );
    assert_eq!(run[0].param("Placement.Tenancy"), None);
    assert_eq!(
        run[0].param("LicenseSpecification.1.LicenseConfigurationArn"),
        None
    );
}

#[tokio::test]
async fn insufficient_capacity_on_a_dedicated_host_is_retried_with_back_off() {
    let moto = Moto::start().await.expect("moto starts");
    let proxy = Ec2Proxy::start(moto.addr()).await.expect("proxy starts");
    let fx = moto.fixture(MAC_REGION).await.expect("fixture");
    let cfg = macos_config(&fx);
    let p = only(&cfg);
    let creds = test_credentials();
    let cloud = cloud(&proxy);
    proxy.inject(Fault::error(
        "RunInstances",
        500,
        "InsufficientInstanceCapacity",
        2,
    ));
    let launch = launch_id("mac-capacity");
    let req = LaunchRequest {
        scope: scope(p, &creds),
        launch: &launch,
        additional_tags: &[],
    };
    assert!(matches!(
        cloud.launch(&req).await.expect("launched after back-off"),
        LaunchOutcome::Launched(_)
    ));
    let run = proxy.requests_of("RunInstances");
    assert_eq!(run.len(), 3, "{run:#?}");
    assert_eq!(
        run.iter().filter(|r| r.fault.is_some()).count(),
        2,
        "{run:#?}"
    );
    // Past the back-off budget it is an ordinary, retryable launch failure, not a config error.
    proxy.inject(Fault::error(
        "RunInstances",
        500,
        "InsufficientInstanceCapacity",
        100,
    ));
    let launch = launch_id("mac-no-capacity");
    let req = LaunchRequest {
        scope: scope(p, &creds),
        launch: &launch,
        additional_tags: &[],
    };
    let e = cloud.launch(&req).await.unwrap_err();
    assert_eq!(e.class, ErrorClass::Capacity, "{e}");
    assert!(e.is_retryable(), "{e}");
}
