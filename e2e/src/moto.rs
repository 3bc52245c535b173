//! A real `moto` server (the AWS emulator, moto 5.x from PyPI) on 127.0.0.1, for EC2 tests through
//! the real AWS SDK.
//!
//! [`Moto::start`] runs `$MPC_E2E_HOME/venv/bin/moto_server` (`MPC_E2E_HOME` defaults to
//! `~/.cache/mpc-e2e`, as `e2e/setup.sh` installs it; `MPC_E2E_MOTO` overrides the binary) on a
//! random free port with `MOTO_ENABLE_AMI_VALIDATION=true` and
//! `MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION=true`, so unknown images and instance types fail as
//! on AWS. It waits until the server answers and kills it on drop. [`Moto::fixture`] creates what
//! launches need (image lookup, VPC/subnet, security group, key pair, instance profile) through the
//! SDK (IAM through moto's query API, to keep the IAM SDK out of the build).
//!
//! What moto does and does not emulate (moto 5.1, found by trying):
//! - It ignores `ClientToken`: the same token launches a second instance.
//! - Instances are `pending` only in the RunInstances answer and `running` at once afterwards;
//!   there are no faults or throttling. [`crate::ec2_proxy`] adds both.
//! - Addresses are fake (10.x private, 54.x public in the default VPC) and must never be dialled.
//! - **Loopback addresses work**: in a VPC `127.0.0.0/16` with a subnet such as `127.0.1.0/24`
//!   (see [`Moto::loopback_subnet`]) instances get private addresses `127.0.1.4`, `127.0.1.5`, ...
//!   and no public address, so the address chosen for SSH is a loopback IP that a test can bind a
//!   real sshd (or banner listener) to on a random port, dialled through
//!   `mpc::cloud::reach::LoopbackMap::with_loopback_port`. Nothing else is ever dialled.
//! - It records the root volume's size and type but not the requested IOPS and throughput (it
//!   reports gp3's default 3000 IOPS); tests read those back from the requests the proxy recorded.
//! - A RunInstances with an unknown security group *name* fails with an HTTP 500 (a moto bug);
//!   unknown group ids fail with `InvalidGroup.NotFound` as on AWS.
//! - Key pair names are not validated at launch.
//! - It keeps terminated instances for ever and scans them all on every DescribeInstances, so a
//!   long run slows down with every instance it ever launched. EC2 drops a terminated instance
//!   from its answers after about an hour; moto here runs under a launcher ([`FORGET_TERMINATED`])
//!   that does the same after [`Moto::start_forgetting_terminated_after`]'s delay (an hour for
//!   [`Moto::start`]; a soak that compresses hours into minutes passes less).

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aws_sdk_ec2::Client;
use aws_sdk_ec2::config::{BehaviorVersion, Region};
use aws_sdk_ec2::types::{ResourceType, Tag, TagSpecification};
use mpc::cloud::{AwsCredentials, Credentials};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Access key id tests use (moto accepts any).
pub const ACCESS_KEY_ID: &str = "AKIAMPCTESTING";
/// Secret key tests use.
pub const SECRET_ACCESS_KEY: &str = "mpc-testing-secret";

/// What can go wrong running moto.
#[derive(Debug, thiserror::Error)]
pub enum MotoError {
    /// The moto binary is missing.
    #[error(
        "moto is not installed: {0} is missing (run e2e/setup.sh, or set MPC_E2E_HOME / MPC_E2E_MOTO)"
    )]
    NotInstalled(PathBuf),
    /// Starting or reaching moto failed.
    #[error("moto: {0}")]
    Io(#[from] std::io::Error),
    /// Moto did not come up.
    #[error("moto did not answer on {addr} within {secs}s; log:\n{log}")]
    Timeout {
        /// Address it should listen on.
        addr: SocketAddr,
        /// Seconds waited.
        secs: u64,
        /// Tail of its output.
        log: String,
    },
    /// An HTTP call to moto's API failed.
    #[error("moto API {path}: HTTP {status}: {body}")]
    Api {
        /// Path called.
        path: String,
        status: u16,
        /// Body (truncated).
        body: String,
    },
    /// An SDK call used to build a fixture failed.
    #[error("moto fixture: {0}")]
    Sdk(String),
}

/// The moto binary: `MPC_E2E_MOTO`, else `$MPC_E2E_HOME/venv/bin/moto_server`.
pub fn moto_server_path() -> PathBuf {
    if let Some(p) = std::env::var_os("MPC_E2E_MOTO") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("MPC_E2E_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/mpc-e2e")
        });
    home.join("venv/bin/moto_server")
}

/// Credentials for the controller under test.
pub fn test_credentials() -> Credentials {
    Credentials::Aws(AwsCredentials {
        access_key_id: ACCESS_KEY_ID.into(),
        secret_access_key: SECRET_ACCESS_KEY.into(),
        session_token: None,
    })
}

/// Runs moto's server (`moto.server.main`, as `moto_server` does) in a Python process whose
/// background thread forgets instances that have been terminated for `MPC_E2E_TERMINATED_TTL`
/// seconds: removed from their reservation (the reservation too once empty) with their tags, as
/// EC2 stops listing them. Only moto's own data is touched; requests are served unchanged.
pub const FORGET_TERMINATED: &str = r#"
import os, sys, threading, time
from moto.server import main
from moto.ec2.models import ec2_backends

TTL = float(os.environ["MPC_E2E_TERMINATED_TTL"])

def forget_terminated():
    since = {}
    while True:
        time.sleep(1)
        now = time.monotonic()
        # dict.values: moto's backend dicts create accounts and regions on lookup.
        for account in list(dict.values(ec2_backends)):
            for backend in list(dict.values(account)):
                for rid, res in list(backend.reservations.items()):
                    keep = []
                    for inst in list(res.instances):
                        if inst.state != "terminated":
                            keep.append(inst)
                            continue
                        first = since.setdefault(inst.id, now)
                        if now - first < TTL:
                            keep.append(inst)
                            continue
                        since.pop(inst.id, None)
                        backend.tags.pop(inst.id, None)
                    if len(keep) != len(res.instances):
                        res.instances = keep
                        if not keep:
                            backend.reservations.pop(rid, None)

threading.Thread(target=forget_terminated, daemon=True).start()
sys.exit(main(sys.argv[1:]))
"#;

/// A running moto server, killed on drop.
#[derive(Debug)]
pub struct Moto {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

impl Moto {
    /// Starts moto on 127.0.0.1 and a random free port and waits until it answers; terminated
    /// instances are listed for an hour, as on EC2.
    pub async fn start() -> Result<Self, MotoError> {
        Self::start_forgetting_terminated_after(Duration::from_secs(60 * 60)).await
    }

    /// As [`Moto::start`], with terminated instances dropped from moto's answers `ttl` after
    /// their termination.
    pub async fn start_forgetting_terminated_after(ttl: Duration) -> Result<Self, MotoError> {
        let bin = moto_server_path();
        if !bin.exists() {
            return Err(MotoError::NotInstalled(bin));
        }
        // The launcher runs with the Python that has moto installed, the one beside its script.
        let python = bin.with_file_name("python3");
        if !python.exists() {
            return Err(MotoError::NotInstalled(python));
        }
        // The port may be taken between probing and binding: try a few.
        let mut last = None;
        for _ in 0..5 {
            match Self::start_on(&python, ttl, free_port()?).await {
                Ok(m) => return Ok(m),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("at least one try"))
    }

    async fn start_on(python: &PathBuf, ttl: Duration, port: u16) -> Result<Self, MotoError> {
        let dir = tempfile::tempdir()?;
        let log = std::fs::File::create(dir.path().join("moto.log"))?;
        let child = Command::new(python)
            .args([
                "-c",
                FORGET_TERMINATED,
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .env("MPC_E2E_TERMINATED_TTL", ttl.as_secs_f64().to_string())
            .env("MOTO_ENABLE_AMI_VALIDATION", "true")
            .env("MOTO_EC2_ENABLE_INSTANCE_TYPE_VALIDATION", "true")
            // Never reach out for anything: moto only serves what it emulates.
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
            .env("NO_PROXY", "*")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut moto = Self {
            child,
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            dir,
        };
        let wait = Duration::from_secs(60);
        let deadline = Instant::now() + wait;
        loop {
            if let Ok((200, _)) = http(moto.addr, "GET", "/moto-api/", None, "").await {
                return Ok(moto);
            }
            if moto.child.try_wait()?.is_some() || Instant::now() > deadline {
                return Err(MotoError::Timeout {
                    addr: moto.addr,
                    secs: wait.as_secs(),
                    log: moto.log_tail(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines moto printed.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("moto.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The endpoint URL (`http://127.0.0.1:<port>`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Forgets every resource (moto's `/moto-api/reset`).
    pub async fn reset(&self) -> Result<(), MotoError> {
        match http(self.addr, "POST", "/moto-api/reset", None, "").await? {
            (200, _) => Ok(()),
            (status, body) => Err(MotoError::Api {
                path: "/moto-api/reset".into(),
                status,
                body,
            }),
        }
    }

    /// An SDK client for setting up and inspecting state (test credentials, no retries).
    pub fn ec2(&self, region: &str) -> Client {
        sdk_client(&self.endpoint(), region)
    }

    /// Creates an IAM instance profile; returns its ARN.
    pub async fn create_instance_profile(&self, name: &str) -> Result<String, MotoError> {
        let body =
            format!("Action=CreateInstanceProfile&InstanceProfileName={name}&Version=2010-05-08");
        let auth = "AWS4-HMAC-SHA256 Credential=AKIAMPCTESTING/20240101/us-east-1/iam/aws4_request, SignedHeaders=host, Signature=00";
        let (status, text) = http(self.addr, "POST", "/", Some(auth), &body).await?;
        let arn = between(&text, "<Arn>", "</Arn>");
        match (status, arn) {
            (200, Some(arn)) => Ok(arn.to_owned()),
            _ => Err(MotoError::Api {
                path: "/ (CreateInstanceProfile)".into(),
                status,
                body: text.chars().take(500).collect(),
            }),
        }
    }

    /// A VPC `10.77.0.0/16` with one subnet, a security group and key pair in `region`, some of
    /// moto's images (moto's RegisterImage ignores the root device name and architecture, so its
    /// built-in images are used) and an instance profile.
    pub async fn fixture(&self, region: &str) -> Result<Fixture, MotoError> {
        self.fixture_in(region, "10.77.0.0/16", "10.77.1.0/24")
            .await
    }

    /// Like [`Self::fixture`], in a VPC `127.0.0.0/16` with subnet `127.0.<n>.0/24`: instances get
    /// loopback private addresses (moto hands out `127.0.<n>.4` first, then counts up) and no
    /// public one. Tests that run at once and listen on those addresses pick different `n`.
    pub async fn loopback_subnet(&self, region: &str, n: u8) -> Result<Fixture, MotoError> {
        self.fixture_in(region, "127.0.0.0/16", &format!("127.0.{n}.0/24"))
            .await
    }

    /// Like [`Self::fixture`] in a VPC of `vpc_cidr` with one subnet of `subnet_cidr` (a loopback
    /// range gives instances addresses where test sshd hosts can answer).
    pub async fn fixture_in(
        &self,
        region: &str,
        vpc_cidr: &str,
        subnet_cidr: &str,
    ) -> Result<Fixture, MotoError> {
        let ec2 = self.ec2(region);
        let sdk = |e: &dyn std::fmt::Display| MotoError::Sdk(e.to_string());
        let images = ec2
            .describe_images()
            .owners("amazon")
            .send()
            .await
            .map_err(|e| sdk(&aws_sdk_ec2::error::DisplayErrorContext(e)))?;
        // (id, architecture, root device), sorted for a stable choice.
        let mut images: Vec<(String, String, String)> = images
            .images()
            .iter()
            .filter_map(|i| {
                Some((
                    i.image_id()?.to_owned(),
                    i.architecture()?.as_str().to_owned(),
                    i.root_device_name()?.to_owned(),
                ))
            })
            .collect();
        images.sort();
        let pick = |arch: &str, root: Option<&str>, not_root: Option<&str>| {
            images
                .iter()
                .find(|(_, a, r)| {
                    a == arch
                        && root.is_none_or(|want| r == want)
                        && not_root.is_none_or(|avoid| r != avoid)
                })
                .cloned()
                .ok_or_else(|| MotoError::Sdk(format!("moto lists no {arch} image")))
        };
        let (ami, _, root_device) = pick("x86_64", Some("/dev/xvda"), None)?;
        let (alt_ami, _, alt_root_device) = pick("x86_64", None, Some(&root_device))?;
        let (arm64_ami, _, _) = pick("arm64", None, None)?;
        let vpc = ec2
            .create_vpc()
            .cidr_block(vpc_cidr)
            .send()
            .await
            .map_err(|e| sdk(&aws_sdk_ec2::error::DisplayErrorContext(e)))?;
        let vpc_id = vpc.vpc().and_then(|v| v.vpc_id()).unwrap_or("").to_owned();
        let subnet = ec2
            .create_subnet()
            .vpc_id(&vpc_id)
            .cidr_block(subnet_cidr)
            .send()
            .await
            .map_err(|e| sdk(&aws_sdk_ec2::error::DisplayErrorContext(e)))?;
        let subnet_id = subnet
            .subnet()
            .and_then(|s| s.subnet_id())
            .unwrap_or("")
            .to_owned();
        let group_name = "mpc-builders".to_owned();
        let sg = ec2
            .create_security_group()
            .group_name(&group_name)
            .description("builders")
            .vpc_id(&vpc_id)
            .send()
            .await
            .map_err(|e| sdk(&aws_sdk_ec2::error::DisplayErrorContext(e)))?;
        let key_name = "mpc-key".to_owned();
        ec2.create_key_pair()
            .key_name(&key_name)
            .send()
            .await
            .map_err(|e| sdk(&aws_sdk_ec2::error::DisplayErrorContext(e)))?;
        let profile_name = "mpc-builder-profile".to_owned();
        let profile_arn = match self.create_instance_profile(&profile_name).await {
            Ok(arn) => arn,
            // Already made by an earlier fixture on this server.
            Err(MotoError::Api { status: 409, .. }) => {
                format!("arn:aws:iam::123456789012:instance-profile/{profile_name}")
            }
            Err(e) => return Err(e),
        };
        Ok(Fixture {
            region: region.to_owned(),
            ami,
            root_device,
            alt_ami,
            alt_root_device,
            arm64_ami,
            vpc_id,
            subnet_id,
            security_group_id: sg.group_id().unwrap_or("").to_owned(),
            security_group_name: group_name,
            key_name,
            instance_profile_name: profile_name,
            instance_profile_arn: profile_arn,
        })
    }

    /// Launches `n` instances directly (not through the controller) with `tags`, as another
    /// controller or a person would; returns their ids.
    pub async fn launch_raw(
        &self,
        region: &str,
        ami: &str,
        n: i32,
        tags: &[(&str, &str)],
    ) -> Result<Vec<String>, MotoError> {
        let ec2 = self.ec2(region);
        let spec = TagSpecification::builder()
            .resource_type(ResourceType::Instance)
            .set_tags(Some(
                tags.iter()
                    .map(|(k, v)| Tag::builder().key(*k).value(*v).build())
                    .collect(),
            ))
            .build();
        let mut req = ec2
            .run_instances()
            .image_id(ami)
            .instance_type("t3.micro".into())
            .min_count(n)
            .max_count(n);
        if !tags.is_empty() {
            req = req.tag_specifications(spec);
        }
        let out = req
            .send()
            .await
            .map_err(|e| MotoError::Sdk(aws_sdk_ec2::error::DisplayErrorContext(e).to_string()))?;
        Ok(out
            .instances()
            .iter()
            .filter_map(|i| i.instance_id().map(str::to_owned))
            .collect())
    }
}

/// Resources a launch needs, created in moto.
#[derive(Debug, Clone)]
pub struct Fixture {
    pub region: String,
    /// An x86_64 image moto knows, with root device `/dev/xvda`.
    pub ami: String,
    /// Its root device name.
    pub root_device: String,
    /// An x86_64 image with another root device name.
    pub alt_ami: String,
    /// Its root device name (not `root_device`).
    pub alt_root_device: String,
    /// An arm64 image.
    pub arm64_ami: String,
    pub vpc_id: String,
    /// A subnet of the VPC.
    pub subnet_id: String,
    /// A security group of the VPC.
    pub security_group_id: String,
    /// Its name.
    pub security_group_name: String,
    /// A key pair.
    pub key_name: String,
    pub instance_profile_name: String,
    /// Its ARN.
    pub instance_profile_arn: String,
}

/// An SDK client for `endpoint` with the test credentials and the SDK's retries off.
pub fn sdk_client(endpoint: &str, region: &str) -> Client {
    let conf = aws_sdk_ec2::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region.to_owned()))
        .credentials_provider(aws_sdk_ec2::config::Credentials::new(
            ACCESS_KEY_ID,
            SECRET_ACCESS_KEY,
            None,
            None,
            "e2e",
        ))
        .retry_config(aws_sdk_ec2::config::retry::RetryConfig::disabled())
        .endpoint_url(endpoint)
        .build();
    Client::from_conf(conf)
}

fn between<'a>(text: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let i = text.find(start)? + start.len();
    let j = text[i..].find(end)? + i;
    Some(&text[i..j])
}

/// A minimal HTTP/1.0 request to a loopback address; returns status and body.
async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    authorization: Option<&str>,
    body: &str,
) -> std::io::Result<(u16, String)> {
    assert!(addr.ip().is_loopback(), "only loopback is ever dialled");
    let io = async {
        let mut s = TcpStream::connect(addr).await?;
        let auth = authorization
            .map(|a| format!("Authorization: {a}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/x-www-form-urlencoded\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), io)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "moto API timed out"))?
}
