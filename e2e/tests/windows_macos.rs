//! Windows and macOS build hosts: the launch parameters moto ignores (checked on the requests the
//! recording proxy saw, region included), launch failures of those platforms, and the key
//! hand-off against sshd hosts answering as a Windows host (PowerShell commands, CRLF output,
//! `Administrator` only) and as a macOS host (`ec2-user`, `sudo rm`) would, with the key file
//! appearing late and a reboot in the middle. Then a Windows and a macOS build end to end through
//! the real binaries, and a deregistered image through them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use e2e::ec2_proxy::{Ec2Proxy, Fault};
use e2e::moto::{Fixture, Moto, test_credentials};
use e2e::product::{NS, Product};
use e2e::sshd::{AdminKey, EmulatedOs, EmulatedOsHost, HostSetup};
use mpc::cloud::aws::{AwsCloud, AwsOptions};
use mpc::cloud::metrics::CloudMetrics;
use mpc::cloud::retry::RetryPolicy;
use mpc::cloud::{Cloud, ClusterId, Credentials, ErrorClass, LaunchOutcome, LaunchRequest, Scope};
use mpc::config::{self, ConfigData, DynamicPlatform, HostConfig, HostOs};
use mpc::provision::{
    Connections, KeyHandOff, ProvisionError, Readiness, SshOptions, Target, keys,
};
use mpc::scheduler::{LaunchId, LaunchOwner, TaskRunRef, Uid};
use serde_json::json;

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

// ---------------------------------------------------------------------------------------------
// Through the real binaries: the controller (its EC2 calls through the recording proxy to moto,
// the instance's address a loopback sshd answering as the OS would), the webhook, the OTP server
// and a build step redeeming the key.

const PRODUCT_T: Duration = Duration::from_secs(180);

/// The build step of these tests: Go's consumer preamble (error, redeem the key, one trailing
/// newline appended), then `commands` on the host as the build user.
fn consumer_step(commands: &str) -> serde_json::Value {
    let script = format!(
        r#"#!/bin/bash
set -eu
if [ -e /ssh/error ]; then
  cat /ssh/error
  exit 1
fi
mkdir -p ~/.ssh
curl --fail --silent --show-error --cacert /ssh/otp-ca -XPOST -d @/ssh/otp "$(cat /ssh/otp-server)" > ~/.ssh/id_rsa
echo "" >> ~/.ssh/id_rsa
chmod 0400 ~/.ssh/id_rsa
SSH="ssh -i $HOME/.ssh/id_rsa -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes"
echo "user-dir=$(cat /ssh/user-dir)"
{commands}
"#
    );
    json!({"spec": {"taskSpec": {"steps": [{
        "name": "build", "image": "quay.io/konflux-ci/buildah-task:latest", "script": script,
        "volumeMounts": [{"name": "ssh", "mountPath": "/ssh", "readOnly": true}]
    }]}}})
}

/// One OS's platform on the product: moto behind the recording proxy, the instance's address
/// (`127.0.<subnet>.4`, moto's first in the loopback subnet) served on port 22 by an sshd host
/// emulating `os`, and one controller replica.
struct OnCloud {
    p: Product,
    moto: Moto,
    proxy: Ec2Proxy,
    host: Arc<EmulatedOsHost>,
    region: &'static str,
}

impl OnCloud {
    async fn start(
        os: EmulatedOs,
        subnet: u8,
        region: &'static str,
        platform_keys: impl FnOnce(&Fixture) -> Vec<(String, String)>,
        before_controller: impl FnOnce(&Ec2Proxy),
    ) -> Self {
        let mut p = Product::start(e2e::mpc_binary!(), &[]).await.unwrap();
        let moto = Moto::start().await.unwrap();
        let proxy = Ec2Proxy::start(moto.addr()).await.unwrap();
        let fx = moto.loopback_subnet(region, subnet).await.unwrap();
        let admin = AdminKey::generate().unwrap();
        let host = EmulatedOsHost::start_with(
            os,
            &admin,
            HostSetup {
                address: Some(std::net::Ipv4Addr::new(127, 0, subnet, 4)),
                port: Some(22),
                ..HostSetup::default()
            },
        )
        .unwrap();
        p.put_moto_credentials("aws-account").await.unwrap();
        let keys = platform_keys(&fx);
        let ssh_secret = &keys
            .iter()
            .find(|(k, _)| k.ends_with(".ssh-secret"))
            .expect("an ssh-secret")
            .1;
        p.put_secret(NS, ssh_secret, &[("id_rsa", admin.private().as_slice())])
            .await
            .unwrap();
        let mut cfg = p.base_config();
        cfg.extend(keys);
        p.set_config(&cfg).await.unwrap();
        before_controller(&proxy);
        p.controller_flags = vec!["--ec2-endpoint".into(), proxy.endpoint()];
        p.start_controller("c1").await.unwrap();
        Self {
            p,
            moto,
            proxy,
            host: Arc::new(host),
            region,
        }
    }

    /// What the instance does while the controller waits for the key: sshd answers before the
    /// key exists; once the hand-off has probed, the machine reboots (connections reset, port 22
    /// closed for three seconds), comes back, and the user-data leaves the build key last.
    fn boot(&self, private: String, public: String) -> std::thread::JoinHandle<()> {
        let h = Arc::clone(&self.host);
        std::thread::spawn(move || {
            let deadline = Instant::now() + PRODUCT_T;
            while h.commands().is_empty() {
                assert!(Instant::now() < deadline, "the hand-off never probed");
                std::thread::sleep(Duration::from_millis(100));
            }
            h.sshd.kill();
            std::thread::sleep(Duration::from_secs(3));
            h.sshd.start_again().unwrap();
            let seen = h.commands().len();
            while h.commands().len() == seen {
                assert!(Instant::now() < deadline, "no probe after the reboot");
                std::thread::sleep(Duration::from_millis(100));
            }
            h.place_build_key(&private, &public).unwrap();
        })
    }

    /// The TaskRun's secret once written (its key or its error).
    async fn secret(&self, ns: &str, name: &str) -> std::collections::BTreeMap<String, String> {
        self.p
            .wait(PRODUCT_T, "the TaskRun's secret", || async {
                self.p
                    .secret(ns, name)
                    .await
                    .filter(|s| s.contains_key("otp") || s.contains_key("error"))
            })
            .await
    }

    /// Every EC2 call went to the platform's region (none unsigned).
    fn every_call_in_region(&self) {
        let all = self.proxy.requests();
        assert!(!all.is_empty());
        for r in &all {
            assert_eq!(r.region.as_deref(), Some(self.region), "{r:?}");
        }
    }

    /// After the build: the TaskRun is cleaned up, the OTP store is empty and the instance is
    /// terminated, leaving nothing running in moto.
    async fn ends_clean(&self, ns: &str, name: &str, id: &str) {
        self.p.cleaned_up(ns, name).await;
        self.p
            .wait(PRODUCT_T, "the OTP store emptied", || async {
                (self.p.otp_entries().await == Some(0)).then_some(())
            })
            .await;
        let ec2 = self.moto.ec2(self.region);
        self.p
            .wait(PRODUCT_T, "nothing left running in moto", || async {
                let d = ec2.describe_instances().send().await.ok()?;
                let states: Vec<String> = d
                    .reservations()
                    .iter()
                    .flat_map(|r| r.instances())
                    .map(|i| {
                        i.state()
                            .and_then(|s| s.name())
                            .map(|n| n.as_str().to_owned())
                            .unwrap_or_default()
                    })
                    .collect();
                (!states.is_empty()
                    && states
                        .iter()
                        .all(|s| s == "terminated" || s == "shutting-down"))
                .then_some(())
            })
            .await;
        let terminated = self.proxy.requests_of("TerminateInstances");
        assert!(
            terminated
                .iter()
                .any(|r| r.params.iter().any(|(_, v)| v == id)),
            "{terminated:#?}"
        );
    }
}

fn instance_of(tr: &serde_json::Value) -> String {
    tr["metadata"]["annotations"][mpc::contract::CLOUD_INSTANCE_ID_ANNOTATION]
        .as_str()
        .expect("cloud-instance-id")
        .to_owned()
}

fn pairs(label: &str, kv: &[(&str, &str)]) -> Vec<(String, String)> {
    kv.iter()
        .map(|(k, v)| (format!("dynamic.{label}.{k}"), (*v).to_owned()))
        .collect()
}

const WIN_USER_DATA: &str = "<powershell>\nStart-Service sshd\n</powershell>\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_build_end_to_end_through_the_real_binaries() {
    let c = OnCloud::start(
        EmulatedOs::Windows,
        9,
        WIN_REGION,
        |fx| {
            let mut v = pairs(
                "windows-4xlarge-amd64",
                &[
                    ("type", "aws"),
                    ("region", WIN_REGION),
                    ("ami", &fx.ami),
                    ("instance-type", "c5.4xlarge"),
                    ("instance-tag", "e2e-win"),
                    ("key-name", &fx.key_name),
                    ("aws-secret", "aws-account"),
                    ("ssh-secret", "aws-win-ssh-key"),
                    ("security-group-id", &fx.security_group_id),
                    ("subnet-id", &fx.subnet_id),
                    ("max-instances", "5"),
                    ("disk", "100"),
                    ("check-interval", "1"),
                    ("allocation-timeout", "1200"),
                    ("user-data", WIN_USER_DATA),
                ],
            );
            v.push(("dynamic-platforms".into(), "windows-4xlarge/amd64".into()));
            v
        },
        |_| {},
    )
    .await;
    let build_key = keys::generate("konflux-builder").unwrap();
    let boot = c.boot(
        build_key.private_openssh.to_string(),
        build_key.public_openssh.clone(),
    );
    let step = consumer_step(
        r#"$SSH "$(cat /ssh/host)" powershell -Command whoami
$SSH "$(cat /ssh/host)" powershell -Command Write-Output built-on-windows"#,
    );
    c.p.create_taskrun("tenant-a", "win-1", "windows-4xlarge/amd64", step)
        .await
        .unwrap();
    let s = c.secret("tenant-a", "win-1").await;
    boot.join().unwrap();
    assert!(s.contains_key("otp"), "{s:?}\n{}", c.p.logs());

    // Go's bytes: newline-terminated host, user-dir (backslashes doubled) and otp-server.
    assert_eq!(s["host"], "konflux-builder@127.0.9.4\n");
    assert_eq!(s["user-dir"], "C:\\\\Users\\\\konflux-builder\n");
    assert!(s["otp-server"].ends_with("/otp\n"), "{s:?}");
    assert!(!s["otp"].ends_with('\n'), "{s:?}");

    // The launch as sent: the operator's user data, the root disk, no dedicated host.
    let run = c.proxy.requests_of("RunInstances");
    assert_eq!(run.len(), 1, "{run:#?}");
    let user_data = run[0].param("UserData").expect("UserData");
    use base64::Engine as _;
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(user_data)
            .unwrap(),
        WIN_USER_DATA.as_bytes()
    );
    assert_eq!(run[0].param("InstanceType"), Some("c5.4xlarge"));
    assert_eq!(run[0].param("Placement.Tenancy"), None);

    // Readiness was the key file, through a reboot; the key was read and removed.
    let cmds = c.host.commands();
    let probes = cmds.iter().filter(|c| c.contains("Test-Path")).count();
    assert!(probes >= 2, "{cmds:?}");
    assert_eq!(
        cmds[cmds.len() - 2..],
        [
            r"powershell -Command cat C:\Users\Administrator\konflux-builder",
            r"powershell -Command rm C:\Users\Administrator\konflux-builder",
        ]
    );
    assert!(!c.host.key_present());
    let id = instance_of(&c.p.taskrun("tenant-a", "win-1").await.unwrap());

    // The build step redeems the key and runs PowerShell as the build user.
    let run =
        c.p.tekton
            .run_steps("tenant-a", "win-1", e2e::tekton::RunOptions::default())
            .await
            .unwrap();
    assert_eq!(
        run.exit_code,
        0,
        "{}\n{}\n{}",
        run.stdout,
        run.stderr,
        c.p.logs()
    );
    assert!(
        run.stdout
            .contains("user-dir=C:\\\\Users\\\\konflux-builder"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("ec2amaz-e2e\\konflux-builder\r\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("built-on-windows\r\n"),
        "{}",
        run.stdout
    );
    assert_eq!(
        c.host.build_user_commands(),
        [
            "powershell -Command whoami",
            "powershell -Command Write-Output built-on-windows"
        ]
    );
    // The key is spent: a second redeem is refused.
    assert!(c.p.otp_redeem(&s["otp"]).await.is_err());

    c.ends_clean("tenant-a", "win-1", &id).await;
    // No Linux command ever ran on the Windows host.
    assert!(
        c.host
            .commands()
            .iter()
            .all(|c| c.starts_with("powershell -Command ")),
        "{:?}",
        c.host.commands()
    );
    c.every_call_in_region();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn macos_build_end_to_end_on_a_dedicated_host_through_capacity_refusals() {
    let c = OnCloud::start(
        EmulatedOs::MacOs,
        10,
        MAC_REGION,
        |fx| {
            let mut v = pairs(
                "macos-mac2metal-arm64",
                &[
                    ("type", "aws"),
                    ("region", MAC_REGION),
                    ("ami", &fx.arm64_ami),
                    ("instance-type", "mac2-m2.metal"),
                    ("instance-tag", "e2e-mac"),
                    ("key-name", &fx.key_name),
                    ("aws-secret", "aws-account"),
                    ("ssh-secret", "aws-macos-ssh-key"),
                    ("security-group-id", &fx.security_group_id),
                    ("subnet-id", &fx.subnet_id),
                    ("max-instances", "5"),
                    ("disk", "100"),
                    ("check-interval", "1"),
                    ("allocation-timeout", "1200"),
                    ("tenancy", "host"),
                    ("host-resource-group-arn", GROUP_ARN),
                    ("license-configuration-arn", LICENSE_ARN),
                ],
            );
            v.push(("dynamic-platforms".into(), "macos-mac2metal/arm64".into()));
            v
        },
        // The dedicated hosts are busy (scrubbing): more capacity refusals than one launch's
        // retries take, so the scheduler's launch back-off has to wait them out.
        |proxy| proxy.inject(Fault::capacity("RunInstances", 7)),
    )
    .await;
    let build_key = keys::generate("konflux-builder").unwrap();
    let boot = c.boot(
        build_key.private_openssh.to_string(),
        build_key.public_openssh.clone(),
    );
    let step = consumer_step(r#"$SSH "$(cat /ssh/host)" 'echo "built-by=$(whoami)"'"#);
    c.p.create_taskrun("tenant-b", "mac-1", "macos-mac2metal/arm64", step)
        .await
        .unwrap();
    let s = c.secret("tenant-b", "mac-1").await;
    boot.join().unwrap();
    assert!(s.contains_key("otp"), "{s:?}\n{}", c.p.logs());
    assert_eq!(s["host"], "konflux-builder@127.0.10.4\n");
    assert_eq!(s["user-dir"], "/Users/konflux-builder\n");

    // Every launch carried the dedicated host; the refused ones were retried, first by the
    // cloud client (six calls), then, after the scheduler's launch back-off, by its next launch
    // of the same attempt (the same client token: a refused call may still have made one).
    let run = c.proxy.requests_of("RunInstances");
    assert_eq!(
        run.iter().filter(|r| r.fault.is_some()).count(),
        7,
        "{run:#?}"
    );
    assert_eq!(run.last().unwrap().fault, None, "{run:#?}");
    for r in &run {
        assert_eq!(r.param("Placement.Tenancy"), Some("host"), "{r:?}");
        assert_eq!(r.param("Placement.HostResourceGroupArn"), Some(GROUP_ARN));
        assert_eq!(
            r.param("LicenseSpecification.1.LicenseConfigurationArn"),
            Some(LICENSE_ARN)
        );
        assert_eq!(r.param("InstanceType"), Some("mac2-m2.metal"));
    }
    let tokens: std::collections::BTreeSet<_> =
        run.iter().filter_map(|r| r.param("ClientToken")).collect();
    assert_eq!(tokens.len(), 1, "{run:#?}");
    let log = c.p.controllers[0].log_text();
    assert_eq!(
        log.matches("launch failed").count(),
        1,
        "one launch failed to the scheduler, which launched again:\n{log}"
    );
    let metrics = c.p.controllers[0].metrics().await;
    assert!(
        metrics.lines().any(|l| l.starts_with(
            "multi_platform_controller_cloud_api_calls{operation=\"RunInstances\",outcome=\"capacity\"} 7"
        )),
        "{metrics}"
    );

    let cmds = c.host.commands();
    assert_eq!(
        cmds[cmds.len() - 2..],
        [
            "cat /Users/ec2-user/konflux-builder",
            "sudo rm /Users/ec2-user/konflux-builder",
        ]
    );
    assert!(!c.host.key_present());
    let id = instance_of(&c.p.taskrun("tenant-b", "mac-1").await.unwrap());
    let run =
        c.p.tekton
            .run_steps("tenant-b", "mac-1", e2e::tekton::RunOptions::default())
            .await
            .unwrap();
    assert_eq!(
        run.exit_code,
        0,
        "{}\n{}\n{}",
        run.stdout,
        run.stderr,
        c.p.logs()
    );
    assert!(
        run.stdout.contains("user-dir=/Users/konflux-builder\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("built-by=konflux-builder\n"),
        "{}",
        run.stdout
    );
    c.ends_clean("tenant-b", "mac-1", &id).await;
    c.every_call_in_region();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deregistered_image_fails_the_build_at_once_with_a_warning_and_an_alert_series() {
    use k8s_openapi::api::events::v1::Event as KubeEvent;
    let ssm = "resolve:ssm:/aws/service/ami-windows-latest/Windows_Server-2022-English-Full-Base";
    let c = OnCloud::start(
        EmulatedOs::Windows,
        11,
        WIN_REGION,
        |fx| {
            let mut v = pairs(
                "windows-4xlarge-amd64",
                &[
                    ("type", "aws"),
                    ("region", WIN_REGION),
                    ("ami", ssm),
                    ("instance-type", "c5.4xlarge"),
                    ("instance-tag", "e2e-win-gone"),
                    ("key-name", &fx.key_name),
                    ("aws-secret", "aws-account"),
                    ("ssh-secret", "aws-win-ssh-key"),
                    ("subnet-id", &fx.subnet_id),
                    ("max-instances", "5"),
                    ("allocation-timeout", "1200"),
                ],
            );
            v.push(("dynamic-platforms".into(), "windows-4xlarge/amd64".into()));
            v
        },
        // AWS deregistered the image the parameter names.
        |proxy| {
            proxy.inject(Fault::error(
                "RunInstances",
                400,
                "InvalidAMIID.NotFound",
                100,
            ))
        },
    )
    .await;
    let started = Instant::now();
    c.p.create_taskrun("tenant-a", "win-gone", "windows-4xlarge/amd64", json!({}))
        .await
        .unwrap();
    let s = c.secret("tenant-a", "win-gone").await;
    // At once: one call, no retries burning the 20-minute allocation timeout.
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    let error = s.get("error").unwrap_or_else(|| panic!("{s:?}"));
    assert!(error.contains(ssm), "{error}");
    assert!(
        error.contains("dynamic.windows-4xlarge-amd64.ami"),
        "{error}"
    );
    assert_eq!(c.proxy.requests_of("RunInstances").len(), 1);

    // A Warning on host-config for the operators, with the cloud's message.
    let events: kube::Api<KubeEvent> = kube::Api::namespaced(c.p.client.clone(), NS);
    let warning =
        c.p.wait(
            PRODUCT_T,
            "the LaunchRejected Warning on host-config",
            || async {
                events
                    .list(&Default::default())
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .find(|e| e.reason.as_deref() == Some("LaunchRejected"))
            },
        )
        .await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    let regarding = warning.regarding.expect("regarding");
    assert_eq!(regarding.kind.as_deref(), Some("ConfigMap"));
    assert_eq!(
        regarding.name.as_deref(),
        Some(mpc::contract::HOST_CONFIG_NAME)
    );
    let note = warning.note.unwrap_or_default();
    assert!(note.contains("InvalidAMIID.NotFound"), "{note}");
    assert!(note.contains(ssm), "{note}");

    // The alert's series.
    let metrics = c.p.controllers[0].metrics().await;
    assert!(
        metrics.lines().any(|l| l
            == "multi_platform_controller_cloud_launch_rejected{key=\"ami\",platform=\"windows-4xlarge-amd64\"} 1"),
        "{metrics}"
    );
}
