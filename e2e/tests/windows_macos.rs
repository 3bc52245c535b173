//! Windows and macOS build hosts: the launch parameters moto ignores (checked on the requests the
//! recording proxy saw, region included), launch failures of those platforms, and the key
//! hand-off against sshd hosts answering as a Windows host (PowerShell commands, CRLF output,
//! `Administrator` only) and as a macOS host (`ec2-user`, `sudo rm`) would, with the key file
//! appearing late and a reboot in the middle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::ec2_proxy::{Ec2Proxy, Fault};
use e2e::moto::{Fixture, Moto, test_credentials};
use e2e::sshd::{AdminKey, EmulatedOs, EmulatedOsHost};
use mpc::cloud::aws::{AwsCloud, AwsOptions};
use mpc::cloud::metrics::CloudMetrics;
use mpc::cloud::retry::RetryPolicy;
use mpc::cloud::{Cloud, ClusterId, Credentials, ErrorClass, LaunchOutcome, LaunchRequest, Scope};
use mpc::config::{self, ConfigData, DynamicPlatform, HostConfig, HostOs};
use mpc::provision::{
    Connections, KeyHandOff, ProvisionError, Readiness, SshOptions, Target, keys,
};
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

/// The controller's side of the hand-off against `host`, sharing one SSH state directory.
struct Controller {
    _state: tempfile::TempDir,
    connections: Connections,
    handoff: KeyHandOff,
}

impl Controller {
    fn new() -> Self {
        let state = tempfile::tempdir().unwrap();
        let connections = Connections::new(SshOptions {
            connect_timeout: Duration::from_secs(3),
            command_timeout: Duration::from_secs(10),
            ..SshOptions::new(state.path().join("ssh"))
        })
        .unwrap();
        let handoff = KeyHandOff::new(&connections);
        Self {
            _state: state,
            connections,
            handoff,
        }
    }

    fn target(host: &EmulatedOsHost, id: &str, user: &str, admin: &AdminKey) -> Target {
        let mut t = Target::dynamic(id, &host.sshd.address(), user, admin.private());
        t.port = host.sshd.port();
        t
    }

    fn readiness(secs: u64) -> Readiness {
        Readiness {
            deadline: Instant::now() + Duration::from_secs(secs),
            interval: Duration::from_millis(200),
        }
    }
}

fn build_user_key() -> String {
    keys::generate("konflux-builder")
        .unwrap()
        .private_openssh
        .to_string()
}

#[tokio::test]
async fn windows_hand_off_waits_out_a_late_key_and_a_reboot() {
    let admin = AdminKey::generate().unwrap();
    let host = Arc::new(EmulatedOsHost::start(EmulatedOs::Windows, &admin).expect("sshd"));
    let c = Controller::new();
    let target = Controller::target(&host, "i-0win0001", "Administrator", &admin);
    let key = build_user_key();

    // sshd is up before the key exists; then the machine reboots (port closed), comes back, and
    // the user-data leaves the key last.
    let h = Arc::clone(&host);
    let k = key.clone();
    let boot = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        h.sshd.kill();
        std::thread::sleep(Duration::from_millis(1500));
        h.sshd.start_again().unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        h.place_key(&k).unwrap();
    });
    let probes = c
        .handoff
        .wait_ready(
            &c.connections,
            HostOs::Windows,
            &target,
            Controller::readiness(30),
        )
        .await
        .expect("ready once the key file exists");
    boot.join().unwrap();
    assert!(
        probes >= 5,
        "probed before, during and after the reboot: {probes}"
    );
    let taken = c
        .handoff
        .take_key(&c.connections, HostOs::Windows, &target)
        .await
        .expect("key taken");
    assert_eq!(taken.as_str(), key, "CRLF stripped, byte for byte");
    assert!(!host.key_present(), "removed from the host");
    // Nothing but the three PowerShell lines ever ran there.
    let commands = host.commands();
    let ready = r"powershell -Command Test-Path C:\Users\Administrator\konflux-builder";
    assert!(commands.len() >= 3, "{commands:?}");
    assert!(
        commands[..commands.len() - 2].iter().all(|c| c == ready),
        "{commands:?}"
    );
    assert_eq!(
        commands[commands.len() - 2..],
        [
            r"powershell -Command cat C:\Users\Administrator\konflux-builder",
            r"powershell -Command rm C:\Users\Administrator\konflux-builder",
        ]
    );
    // The key is gone: a second hand-off finds nothing to read.
    let e = c
        .handoff
        .take_key(&c.connections, HostOs::Windows, &target)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            ProvisionError::CommandFailed {
                exit_code: Some(1),
                ..
            }
        ),
        "{e}"
    );
}

#[tokio::test]
async fn windows_hand_off_fails_when_the_key_cannot_be_removed_or_never_appears() {
    let admin = AdminKey::generate().unwrap();
    let host = EmulatedOsHost::start(EmulatedOs::Windows, &admin).expect("sshd");
    let c = Controller::new();
    let target = Controller::target(&host, "i-0win0002", "Administrator", &admin);
    // Never appears: the last answer is returned at the deadline.
    let started = Instant::now();
    let e = c
        .handoff
        .wait_ready(
            &c.connections,
            HostOs::Windows,
            &target,
            Controller::readiness(2),
        )
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(e.to_string().contains("not there yet"), "{e}");
    // Only Administrator logs in to a Windows host.
    let root = Controller::target(&host, "i-0win0002", "root", &admin);
    let e = c
        .handoff
        .take_key(&c.connections, HostOs::Windows, &root)
        .await
        .unwrap_err();
    assert!(matches!(e, ProvisionError::AuthRefused { .. }), "{e}");
    // A key that cannot be removed fails the hand-off.
    host.place_key(&build_user_key()).unwrap();
    host.deny_removal().unwrap();
    let e = c
        .handoff
        .take_key(&c.connections, HostOs::Windows, &target)
        .await
        .unwrap_err();
    assert!(
        matches!(
            &e,
            ProvisionError::CommandFailed {
                operation: "remove the key file",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("is denied"), "{e}");
}

#[tokio::test]
async fn macos_hand_off_reads_and_sudo_removes_a_late_key() {
    let admin = AdminKey::generate().unwrap();
    let host = Arc::new(EmulatedOsHost::start(EmulatedOs::MacOs, &admin).expect("sshd"));
    let c = Controller::new();
    let target = Controller::target(&host, "i-0mac0001", "ec2-user", &admin);
    let key = build_user_key();
    let h = Arc::clone(&host);
    let k = key.clone();
    let boot = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1200));
        h.place_key(&k).unwrap();
    });
    let probes = c
        .handoff
        .wait_ready(
            &c.connections,
            HostOs::MacOs,
            &target,
            Controller::readiness(30),
        )
        .await
        .expect("ready");
    boot.join().unwrap();
    assert!(probes >= 2, "{probes}");
    let taken = c
        .handoff
        .take_key(&c.connections, HostOs::MacOs, &target)
        .await
        .unwrap();
    assert_eq!(taken.as_str(), key);
    assert!(!host.key_present());
    let commands = host.commands();
    assert_eq!(
        commands[commands.len() - 2..],
        [
            "cat /Users/ec2-user/konflux-builder",
            "sudo rm /Users/ec2-user/konflux-builder",
        ]
    );
    assert!(
        commands[..commands.len() - 2]
            .iter()
            .all(|c| c == "test -f /Users/ec2-user/konflux-builder"),
        "{commands:?}"
    );
}
