//! IBM Cloud (`type: ibmz` VPC and `type: ibmp` Power Virtual Server) behind the [`Cloud`]
//! interface, with the EC2 provider's guarantees:
//!
//! - **Identity.** Instance names are `<tag>-<16 hex>x` (the Go shape), the hex derived from this
//!   cluster's id and the [`LaunchId`], so a repeated launch finds the instance an earlier try
//!   created (`GET /instances?name=`) instead of creating a second one. Ownership tags (managed,
//!   instance tag, cluster, platform, owner, attempt, `taskRunID`) are user tags on the instance's
//!   CRN (Global Tagging API; the VPC API takes none on instances): an orphan names its cluster
//!   and TaskRun. Instances carrying no tags (the Go controller's) are `Untagged`.
//! - **Counting.** Only exact-shape names of the platform's tag count (Go counted by prefix, so
//!   `prod-ppc64le` counted `prod-ppc64le-large`), across every page.
//! - **Bad answers are "not ready".** A missing address, status or health is a booting instance,
//!   never a panic (Go #985).
//! - **Tokens.** One IAM token per API key, cached and refreshed ([`iam`]); a 401 refreshes once.
//! - **Addresses.** Private only: floating IPs are not supported (`check-config` says so).
//!
//! Termination (retried until the API says `deleting`) and the Power VS boot-volume resize
//! (retried on conflicts) run inside the scheduler's tracked operations: a terminate that is not
//! confirmed fails and the scheduler retries it; the resize is part of the instance's readiness
//! probe, so the allocation timeout bounds it.

pub mod http;
pub mod iam;
pub mod power;
pub mod tagging;
pub mod vpc;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::future::BoxFuture;
use md5::{Digest, Md5};
use serde_json::{Value, json};

use crate::cloud::instance::tags as our_tags;
use crate::cloud::launch::{instance_tags, owner_tags};
use crate::cloud::metrics::CloudMetrics;
use crate::cloud::retry::RetryPolicy;
use crate::cloud::{
    Cloud, CloudError, ClusterId, Credentials, ErrorClass, Instance, LaunchOutcome, LaunchRequest,
    Operation, Scope, Terminated,
};
use crate::config::DynamicPlatform;
use crate::config::ibm::{IbmService, instance_name, is_instance_name_of};
use crate::contract::instance_tags as compat_tags;
use crate::scheduler::{InstanceState, LaunchId, Ownership};

use self::http::Http;
use self::iam::Iam;
use self::power::{PowerClient, PowerInstance};
use self::tagging::{Tagging, valid_tag};
use self::vpc::{VpcClient, VpcError, VpcInstance};

/// IBM's public IAM endpoint.
pub const DEFAULT_IAM_URL: &str = "https://iam.cloud.ibm.com";

/// Settings of the IBM provider.
#[derive(Debug, Clone)]
pub struct IbmOptions {
    /// This cluster's identity, tagged on every instance.
    pub cluster: ClusterId,
    /// IAM endpoint ([`DEFAULT_IAM_URL`]).
    pub iam_url: String,
    /// Global Tagging endpoint ([`tagging::DEFAULT_TAGGING_URL`]).
    pub tagging_url: String,
    /// Retries of one call.
    pub retry: RetryPolicy,
    /// Longest time one call may take.
    pub call_timeout: Duration,
    /// After a delete, how often and how long apart the instance is checked for `deleting`
    /// (the delete is sent again each time); unconfirmed, the termination fails and the
    /// scheduler retries it.
    pub delete_checks: u32,
    pub delete_check_delay: Duration,
    /// Trusted roots; `None`: the system's.
    pub tls: Option<rustls::ClientConfig>,
}

impl IbmOptions {
    /// Production endpoints and timings.
    pub fn new(cluster: ClusterId) -> Self {
        Self {
            cluster,
            iam_url: DEFAULT_IAM_URL.into(),
            tagging_url: tagging::DEFAULT_TAGGING_URL.into(),
            retry: RetryPolicy::default(),
            call_timeout: Duration::from_secs(30),
            delete_checks: 5,
            delete_check_delay: Duration::from_secs(2),
            tls: None,
        }
    }
}

/// The clients of one API key.
struct Account {
    iam: Arc<Iam>,
    tagging: Tagging,
}

/// The IBM Cloud provider of one cluster.
pub struct IbmCloud {
    options: IbmOptions,
    metrics: CloudMetrics,
    http: Http,
    tls: rustls::ClientConfig,
    accounts: Mutex<HashMap<String, Arc<Account>>>,
    /// Tags of instances known to carry a cluster tag, by CRN: they change only through this
    /// provider (retag), so listings need not ask again.
    tags: Mutex<HashMap<String, Vec<String>>>,
}

impl std::fmt::Debug for IbmCloud {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbmCloud")
            .field("cluster", &self.options.cluster)
            .finish_non_exhaustive()
    }
}

/// The system's trusted roots, for IBM's public endpoints.
fn system_roots() -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for cert in found.certs {
        let _ = roots.add(cert);
    }
    rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// A failed call, classified.
struct Failure {
    class: ErrorClass,
    code: Option<String>,
    message: String,
    /// The `dynamic.<p>.<field>` at fault, for config errors.
    field: Option<&'static str>,
}

/// Classifies an IBM answer: 401/403 and IAM refusals are the API key's fault, 404 is gone, 409
/// a conflict (retried a few times), 429 throttling, 5xx and transport failures unavailability.
fn classify(status: Option<u16>, iam_refused: bool) -> (ErrorClass, Option<&'static str>) {
    if iam_refused {
        return (ErrorClass::Config, Some("secret"));
    }
    match status {
        None => (ErrorClass::Unavailable, None),
        Some(401 | 403) => (ErrorClass::Config, Some("secret")),
        Some(404) => (ErrorClass::NotFound, None),
        Some(429) => (ErrorClass::Throttled, None),
        Some(s) if s >= 500 => (ErrorClass::Unavailable, None),
        Some(_) => (ErrorClass::Other, None),
    }
}

impl From<VpcError> for Failure {
    fn from(e: VpcError) -> Self {
        let iam_refused = matches!(
            &e,
            VpcError::Iam(iam::IamError::Refused { .. })
                | VpcError::Call {
                    source: http::CallError::Iam(iam::IamError::Refused { .. }),
                    ..
                }
        );
        let (code, status) = e.code_and_status();
        let code = code.map(str::to_owned);
        let (class, field) = match &e {
            VpcError::NoSuchName { field, .. } => (ErrorClass::Config, Some(*field)),
            VpcError::InvalidUrl(_) => (ErrorClass::Config, Some("url")),
            VpcError::BadAnswer { .. } | VpcError::TooManyPages(_) => (ErrorClass::Other, None),
            _ => classify(status, iam_refused),
        };
        Self {
            class,
            code,
            message: e.to_string(),
            field,
        }
    }
}

impl From<tagging::TaggingError> for Failure {
    fn from(e: tagging::TaggingError) -> Self {
        let iam_refused = matches!(
            &e,
            tagging::TaggingError::Call {
                source: http::CallError::Iam(iam::IamError::Refused { .. }),
                ..
            }
        );
        let (class, field) = match &e {
            tagging::TaggingError::InvalidUrl(_) => (ErrorClass::Config, None),
            tagging::TaggingError::Refused { .. } => (ErrorClass::Other, None),
            tagging::TaggingError::Call { .. } => classify(e.status(), iam_refused),
        };
        Self {
            class,
            code: None,
            message: e.to_string(),
            field,
        }
    }
}

impl From<power::PowerError> for Failure {
    fn from(e: power::PowerError) -> Self {
        let (class, field) = e.class_and_field();
        Self {
            class,
            code: e.code().map(str::to_owned),
            message: e.to_string(),
            field,
        }
    }
}

/// The 64 bits of an instance name: the same for every try of one launch in this cluster.
fn name_bits(cluster: &ClusterId, launch: &LaunchId) -> u64 {
    let mut h = Md5::new();
    for part in [
        cluster.as_str(),
        launch.owner_key().as_str(),
        launch.attempt_tag().as_str(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    let d = h.finalize();
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// Our tags as IBM user tags (`key:value`); those IBM would refuse (too long, odd characters)
/// and the `Name` tag (the instance name says it) are left out.
fn user_tags(pairs: &[(String, String)]) -> Vec<String> {
    pairs
        .iter()
        .filter(|(k, _)| k != our_tags::NAME)
        .map(|(k, v)| format!("{k}:{v}"))
        .filter(|t| valid_tag(t))
        .collect()
}

/// The keys of our ownership tags, to read back case-insensitively (IBM compares tags so).
const KNOWN_KEYS: [&str; 7] = [
    compat_tags::MANAGED,
    compat_tags::INSTANCE,
    compat_tags::TASKRUN_ID,
    our_tags::CLUSTER,
    our_tags::OWNER,
    our_tags::ATTEMPT,
    our_tags::PLATFORM,
];

/// The owner tags a retag replaces.
const OWNER_KEYS: [&str; 3] = [our_tags::OWNER, our_tags::ATTEMPT, compat_tags::TASKRUN_ID];

fn tag_map(tags: &[String]) -> BTreeMap<String, String> {
    tags.iter()
        .filter_map(|t| t.split_once(':'))
        .map(|(k, v)| {
            let key = KNOWN_KEYS
                .iter()
                .find(|known| known.eq_ignore_ascii_case(k))
                .map_or_else(|| k.to_owned(), |known| (*known).to_owned());
            (key, v.to_owned())
        })
        .collect()
}

fn parse_time(t: Option<&str>) -> Option<SystemTime> {
    let t = time::OffsetDateTime::parse(t?, &time::format_description::well_known::Rfc3339).ok()?;
    let nanos = u64::try_from(t.unix_timestamp_nanos()).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// What the provider knows of one instance, whichever service.
struct Seen {
    id: String,
    name: String,
    crn: Option<String>,
    state: InstanceState,
    address: Option<String>,
    instance_type: String,
    created_at: Option<String>,
}

impl Seen {
    fn vpc(v: &VpcInstance) -> Self {
        Self {
            id: v.id.clone(),
            name: v.name.clone(),
            crn: v.crn.clone(),
            state: vpc_state(&v.status),
            address: v.address.clone(),
            instance_type: v.profile.clone().unwrap_or_default(),
            created_at: v.created_at.clone(),
        }
    }
    fn power(p: &PowerInstance) -> Self {
        Self {
            id: p.id.clone(),
            name: p.name.clone(),
            crn: p.crn.clone(),
            state: p.state(),
            address: p.address.clone(),
            instance_type: p.sys_type.clone().unwrap_or_default(),
            created_at: p.created_at.clone(),
        }
    }
}

/// VPC instance status onto the one state enum; `failed` is down (cleaned up, never capacity).
pub fn vpc_state(status: &str) -> InstanceState {
    match status {
        "pending" | "starting" | "restarting" | "resuming" => InstanceState::Pending,
        "running" => InstanceState::Running,
        "deleting" => InstanceState::ShuttingDown,
        "stopping" | "suspending" => InstanceState::Stopping,
        "stopped" | "suspended" | "failed" => InstanceState::Stopped,
        _ => InstanceState::Unknown,
    }
}

impl IbmCloud {
    /// A provider with `options`, counting into `metrics`.
    pub fn new(options: IbmOptions, metrics: CloudMetrics) -> Self {
        let tls = options.tls.clone().unwrap_or_else(system_roots);
        Self {
            http: Http::new(tls.clone(), options.call_timeout),
            tls,
            options,
            metrics,
            accounts: Mutex::new(HashMap::new()),
            tags: Mutex::new(HashMap::new()),
        }
    }

    fn error(&self, p: &DynamicPlatform, op: Operation, f: Failure, attempts: u32) -> CloudError {
        let mut e = CloudError::new(p, op, f.class, f.code, f.message, attempts);
        if let Some(field) = f.field {
            e.config_key = Some(format!("dynamic.{}.{field}", p.platform.label_value()));
            e.config_value = match field {
                "secret" => Some(p.aws_secret.clone()),
                "url" => p.ibm.as_ref().map(|s| s.url().to_owned()),
                "image" | "image-id" => Some(p.ami.clone()),
                "key" => p.key_name.clone(),
                _ => match &p.ibm {
                    Some(IbmService::Vpc(v)) => match field {
                        "vpc" => Some(v.vpc.clone()),
                        "subnet" => Some(v.subnet.clone()),
                        _ => None,
                    },
                    _ => None,
                },
            };
        }
        e
    }

    fn refused(&self, p: &DynamicPlatform, op: Operation, message: String) -> CloudError {
        CloudError::new(p, op, ErrorClass::Refused, None, message, 1)
    }

    /// Runs `f` with the retry policy, counting every call.
    async fn call<T, E, Fut>(
        &self,
        p: &DynamicPlatform,
        op: Operation,
        f: impl Fn() -> Fut,
    ) -> Result<T, CloudError>
    where
        Fut: Future<Output = Result<T, E>>,
        Failure: From<E>,
    {
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let start = Instant::now();
            let result = f().await;
            let elapsed = start.elapsed();
            let failure = match result {
                Ok(v) => {
                    self.metrics.call(op, Ok(()), elapsed);
                    return Ok(v);
                }
                Err(e) => Failure::from(e),
            };
            self.metrics.call(op, Err(failure.class), elapsed);
            match self
                .options
                .retry
                .next_delay(failure.class, attempts, rand::random::<f64>())
            {
                Some(d) => {
                    tracing::debug!(platform = %p.platform, op = op.as_str(), attempts, error = %failure.message, "retrying IBM Cloud call");
                    tokio::time::sleep(d).await;
                }
                None => return Err(self.error(p, op, failure, attempts)),
            }
        }
    }

    // Async only so the large error stays in the future (no boxing).
    async fn account(
        &self,
        p: &DynamicPlatform,
        c: &Credentials,
    ) -> Result<Arc<Account>, CloudError> {
        let Some(key) = c.ibm() else {
            return Err(self.error(
                p,
                Operation::DescribeInstances,
                Failure {
                    class: ErrorClass::Config,
                    code: None,
                    message: "the Secret holds no IBM Cloud api-key".into(),
                    field: Some("secret"),
                },
                1,
            ));
        };
        let fp = c.fingerprint();
        let mut accounts = self.accounts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = accounts.get(&fp) {
            return Ok(a.clone());
        }
        let build = || -> Result<Account, String> {
            let iam = Arc::new(
                Iam::new(
                    &self.options.iam_url,
                    key.expose().to_owned(),
                    self.tls.clone(),
                )
                .map_err(|e| e.to_string())?,
            );
            let tagging = Tagging::new(&self.options.tagging_url, iam.clone(), self.http.clone())
                .map_err(|e| e.to_string())?;
            Ok(Account { iam, tagging })
        };
        let account = Arc::new(build().map_err(|m| {
            self.refused(
                p,
                Operation::DescribeInstances,
                format!("IBM endpoints: {m}"),
            )
        })?);
        // A rotated key replaces the old one's clients rather than piling up.
        if accounts.len() > 64 {
            accounts.clear();
        }
        accounts.insert(fp, account.clone());
        Ok(account)
    }

    async fn vpc(&self, p: &DynamicPlatform, a: &Account) -> Result<VpcClient, CloudError> {
        let Some(IbmService::Vpc(cfg)) = &p.ibm else {
            return Err(self.refused(p, Operation::DescribeInstances, "not a VPC platform".into()));
        };
        VpcClient::with_http(&cfg.url, a.iam.clone(), self.http.clone())
            .map_err(|e| self.error(p, Operation::DescribeInstances, e.into(), 1))
    }

    async fn power(&self, p: &DynamicPlatform, a: &Account) -> Result<PowerClient, CloudError> {
        let Some(IbmService::Power(cfg)) = &p.ibm else {
            return Err(self.refused(
                p,
                Operation::DescribeInstances,
                "not a Power VS platform".into(),
            ));
        };
        PowerClient::new(&cfg.url, cfg.crn.clone(), a.iam.clone(), self.http.clone())
            .map_err(|e| self.error(p, Operation::DescribeInstances, e.into(), 1))
    }

    /// The user tags of `crn` (cached once they name a cluster).
    async fn tags_of(
        &self,
        p: &DynamicPlatform,
        a: &Account,
        crn: &str,
    ) -> Result<Vec<String>, CloudError> {
        if let Some(t) = self.tags.lock().unwrap_or_else(|e| e.into_inner()).get(crn) {
            return Ok(t.clone());
        }
        let t = self
            .call(p, Operation::DescribeInstances, || a.tagging.tags_of(crn))
            .await?;
        self.remember(crn, &t);
        Ok(t)
    }

    fn remember(&self, crn: &str, t: &[String]) {
        let has_cluster = tag_map(t).contains_key(our_tags::CLUSTER);
        let mut cache = self.tags.lock().unwrap_or_else(|e| e.into_inner());
        if has_cluster {
            cache.insert(crn.to_owned(), t.to_vec());
        } else {
            cache.remove(crn);
        }
    }

    fn forget(&self, crn: Option<&str>) {
        if let Some(crn) = crn {
            self.tags
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(crn);
        }
    }

    /// The instance as the scheduler's side sees it. An exact-shape name of the platform's tag
    /// stands for the managed and instance tags (Go's instances carry no tags at all).
    fn instance(&self, p: &DynamicPlatform, s: &Seen, tags: &[String]) -> Instance {
        let mut map = tag_map(tags);
        if is_instance_name_of(&p.instance_tag, &s.name) {
            map.insert(compat_tags::MANAGED.into(), "true".into());
            map.insert(compat_tags::INSTANCE.into(), p.instance_tag.clone());
        } else if map
            .get(compat_tags::INSTANCE)
            .is_some_and(|t| t.eq_ignore_ascii_case(&p.instance_tag))
        {
            map.insert(compat_tags::INSTANCE.into(), p.instance_tag.clone());
        }
        let ownership = match map.get(our_tags::CLUSTER) {
            Some(c) if c.eq_ignore_ascii_case(self.options.cluster.as_str()) => {
                map.insert(
                    our_tags::CLUSTER.into(),
                    self.options.cluster.as_str().to_owned(),
                );
                Ownership::Ours
            }
            Some(_) => Ownership::Foreign,
            None => Ownership::Untagged,
        };
        Instance {
            id: s.id.clone(),
            state: s.state,
            launch_time: parse_time(s.created_at.as_deref()),
            instance_type: s.instance_type.clone(),
            private_ip: s.address.clone(),
            public_ip: None,
            public_dns: None,
            spot: false,
            tags: map,
            ownership,
        }
    }

    async fn with_tags(
        &self,
        p: &DynamicPlatform,
        a: &Account,
        seen: Vec<Seen>,
    ) -> Result<Vec<Instance>, CloudError> {
        let mut out = Vec::with_capacity(seen.len());
        for s in seen {
            let tags = match &s.crn {
                Some(crn) => self.tags_of(p, a, crn).await?,
                None => Vec::new(),
            };
            out.push(self.instance(p, &s, &tags));
        }
        Ok(out)
    }

    /// Lists the instances of the scope's tag (exact names), every page.
    async fn seen_of_tag(&self, p: &DynamicPlatform, a: &Account) -> Result<Vec<Seen>, CloudError> {
        Ok(match &p.ibm {
            Some(IbmService::Vpc(_)) => {
                let vpc = self.vpc(p, a).await?;
                self.call(p, Operation::DescribeInstances, || {
                    vpc.instances_of(&p.instance_tag)
                })
                .await?
                .iter()
                .map(Seen::vpc)
                .collect()
            }
            Some(IbmService::Power(_)) => {
                let pw = self.power(p, a).await?;
                self.call(p, Operation::DescribeInstances, || pw.instances())
                    .await?
                    .iter()
                    .filter(|i| is_instance_name_of(&p.instance_tag, &i.name))
                    .map(Seen::power)
                    .collect()
            }
            None => {
                return Err(self.refused(
                    p,
                    Operation::DescribeInstances,
                    "not an IBM platform".into(),
                ));
            }
        })
    }

    /// One instance by id, `None` when unknown.
    async fn seen(
        &self,
        p: &DynamicPlatform,
        a: &Account,
        id: &str,
    ) -> Result<Option<Seen>, CloudError> {
        Ok(match &p.ibm {
            Some(IbmService::Vpc(_)) => {
                let vpc = self.vpc(p, a).await?;
                self.call(p, Operation::DescribeInstances, || vpc.instance(id))
                    .await?
                    .as_ref()
                    .map(Seen::vpc)
            }
            Some(IbmService::Power(_)) => {
                let pw = self.power(p, a).await?;
                self.call(p, Operation::DescribeInstances, || pw.instance(id))
                    .await?
                    .as_ref()
                    .map(Seen::power)
            }
            None => {
                return Err(self.refused(
                    p,
                    Operation::DescribeInstances,
                    "not an IBM platform".into(),
                ));
            }
        })
    }

    /// Attaches `tags` to `crn`, remembering them.
    async fn tag(
        &self,
        p: &DynamicPlatform,
        a: &Account,
        crn: &str,
        tags: &[String],
    ) -> Result<(), CloudError> {
        self.call(p, Operation::CreateTags, || a.tagging.attach(crn, tags))
            .await?;
        let mut all = self
            .tags
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(crn)
            .cloned()
            .unwrap_or_default();
        for t in tags {
            if !all.iter().any(|x| x.eq_ignore_ascii_case(t)) {
                all.push(t.clone());
            }
        }
        self.remember(crn, &all);
        Ok(())
    }

    async fn launch_vpc(
        &self,
        request: &LaunchRequest<'_>,
        a: &Account,
        name: &str,
        tags: &[String],
    ) -> Result<Seen, CloudError> {
        let p = request.scope.platform;
        let Some(IbmService::Vpc(cfg)) = &p.ibm else {
            return Err(self.refused(p, Operation::RunInstances, "not a VPC platform".into()));
        };
        let vpc = self.vpc(p, a).await?;
        let op = Operation::RunInstances;
        let network = self
            .call(p, op, || vpc.named("vpcs", &cfg.vpc, "vpc"))
            .await?;
        let subnet = self
            .call(p, op, || vpc.named("subnets", &cfg.subnet, "subnet"))
            .await?;
        let key = self
            .call(p, op, || vpc.named("keys", &cfg.key, "key"))
            .await?;
        let id = |v: &Value, ptr: &str| v.pointer(ptr).cloned().unwrap_or(Value::Null);
        let prototype = json!({
            "name": name,
            "zone": {"name": cfg.zone},
            "resource_group": {"id": id(&network, "/resource_group/id")},
            "vpc": {"id": id(&network, "/id")},
            "image": {"id": cfg.image_id},
            "profile": {"name": cfg.profile},
            "keys": [{"id": id(&key, "/id")}],
            "availability_policy": {"host_failure": "stop"},
            "boot_volume_attachment": {
                "delete_volume_on_instance_delete": true,
                "volume": {
                    "capacity": cfg.disk_gb,
                    "profile": {"name": "general-purpose"},
                    "user_tags": tags,
                },
            },
            "primary_network_attachment": {
                "name": "eth0",
                "virtual_network_interface": {
                    "auto_delete": true,
                    "subnet": {"id": id(&subnet, "/id")},
                    "security_groups": [{"id": id(&network, "/default_security_group/id")}],
                },
            },
        });
        self.create_or_find(
            p,
            || vpc.create(&prototype),
            || vpc.instance_named(name),
            Seen::vpc,
            // A VPC 400 that did not create the instance: the request is wrong.
            |class| match class {
                ErrorClass::Other => ErrorClass::Config,
                c => c,
            },
        )
        .await
    }

    async fn launch_inner(&self, request: &LaunchRequest<'_>) -> Result<LaunchOutcome, CloudError> {
        let p = request.scope.platform;
        let a = self.account(p, request.scope.credentials).await?;
        let name = instance_name(
            &p.instance_tag,
            name_bits(&self.options.cluster, request.launch),
        )
        .map_err(|e| self.refused(p, Operation::RunInstances, e.to_string()))?;
        let (pairs, ignored) = instance_tags(
            &self.options.cluster,
            p,
            request.launch,
            request.additional_tags,
        );
        if !ignored.is_empty() {
            tracing::debug!(platform = %p.platform, ?ignored, "additional tags not applied");
        }
        let tags = user_tags(&pairs);
        // An earlier try of this launch: adopted when alive, spent when gone.
        let earlier = match &p.ibm {
            Some(IbmService::Vpc(_)) => {
                let vpc = self.vpc(p, &a).await?;
                self.call(p, Operation::DescribeInstances, || {
                    vpc.instance_named(&name)
                })
                .await?
                .as_ref()
                .map(Seen::vpc)
            }
            Some(IbmService::Power(_)) => {
                let pw = self.power(p, &a).await?;
                self.call(p, Operation::DescribeInstances, || pw.instance_named(&name))
                    .await?
                    .as_ref()
                    .map(Seen::power)
            }
            None => {
                return Err(self.refused(p, Operation::RunInstances, "not an IBM platform".into()));
            }
        };
        if let Some(s) = earlier {
            if let Some(crn) = &s.crn {
                // Tagging may have failed after the create: finish it.
                self.tag(p, &a, crn, &tags).await?;
            }
            let t = match &s.crn {
                Some(crn) => self.tags_of(p, &a, crn).await?,
                None => Vec::new(),
            };
            let i = self.instance(p, &s, &t);
            if i.state.is_gone() {
                return Ok(LaunchOutcome::Spent(i));
            }
            self.metrics.launched(p.platform.as_str(), true);
            return Ok(LaunchOutcome::Adopted(i));
        }
        let s = match &p.ibm {
            Some(IbmService::Vpc(_)) => self.launch_vpc(request, &a, &name, &tags).await?,
            Some(IbmService::Power(_)) => self.launch_power(request, &a, &name, &tags).await?,
            None => unreachable!("checked above"),
        };
        let Some(crn) = s.crn.clone() else {
            self.delete_quietly(p, &a, &s.id).await;
            return Err(self.error(
                p,
                Operation::RunInstances,
                Failure {
                    class: ErrorClass::Unavailable,
                    code: None,
                    message: format!("created instance {} has no CRN to tag; deleted", s.id),
                    field: None,
                },
                1,
            ));
        };
        if let Err(e) = self.tag(p, &a, &crn, &tags).await {
            // Untagged, it would count as the Go controller's: remove it, the launch is retried.
            self.delete_quietly(p, &a, &s.id).await;
            return Err(e);
        }
        self.metrics.launched(p.platform.as_str(), false);
        Ok(LaunchOutcome::Launched(self.instance(p, &s, &tags)))
    }

    async fn launch_power(
        &self,
        request: &LaunchRequest<'_>,
        a: &Account,
        name: &str,
        tags: &[String],
    ) -> Result<Seen, CloudError> {
        let p = request.scope.platform;
        let pw = self.power(p, a).await?;
        let Some(IbmService::Power(cfg)) = &p.ibm else {
            return Err(self.refused(p, Operation::RunInstances, "not a Power VS platform".into()));
        };
        let op = Operation::RunInstances;
        let image = self.call(p, op, || pw.image_id(&cfg.image)).await?;
        let body = power::create_body(cfg, name, &image, tags);
        self.create_or_find(
            p,
            || pw.create(&body),
            || pw.instance_named(name),
            Seen::power,
            |class| class,
        )
        .await
    }

    /// Creates an instance with the retry policy. A create that failed in flight may have made
    /// the instance, so before each retry the instance is looked up by its name (names are
    /// unique per launch, so a second create would be refused anyway). `reclassify` maps a
    /// failure's class before the retry decision.
    async fn create_or_find<R, E, C, F, FE>(
        &self,
        p: &DynamicPlatform,
        create: impl Fn() -> C,
        find: impl Fn() -> F,
        seen: impl Fn(&R) -> Seen,
        reclassify: impl Fn(ErrorClass) -> ErrorClass,
    ) -> Result<Seen, CloudError>
    where
        C: Future<Output = Result<R, E>>,
        F: Future<Output = Result<Option<R>, FE>>,
        Failure: From<E>,
    {
        let op = Operation::RunInstances;
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let start = Instant::now();
            let result = create().await;
            let elapsed = start.elapsed();
            let f = match result {
                Ok(created) => {
                    self.metrics.call(op, Ok(()), elapsed);
                    return Ok(seen(&created));
                }
                Err(e) => Failure::from(e),
            };
            self.metrics.call(op, Err(f.class), elapsed);
            if let Ok(Some(found)) = find().await {
                return Ok(seen(&found));
            }
            let class = reclassify(f.class);
            match self
                .options
                .retry
                .next_delay(class, attempts, rand::random::<f64>())
            {
                Some(d) => tokio::time::sleep(d).await,
                None => return Err(self.error(p, op, Failure { class, ..f }, attempts)),
            }
        }
    }

    async fn delete_call(
        &self,
        p: &DynamicPlatform,
        a: &Account,
        id: &str,
    ) -> Result<bool, CloudError> {
        let op = Operation::TerminateInstances;
        match &p.ibm {
            Some(IbmService::Vpc(_)) => {
                let vpc = self.vpc(p, a).await?;
                self.call(p, op, || vpc.delete(id)).await
            }
            Some(IbmService::Power(_)) => {
                let pw = self.power(p, a).await?;
                self.call(p, op, || pw.delete(id)).await
            }
            None => Err(self.refused(p, op, "not an IBM platform".into())),
        }
    }

    async fn delete_quietly(&self, p: &DynamicPlatform, a: &Account, id: &str) {
        if let Err(e) = self.delete_call(p, a, id).await {
            tracing::warn!(platform = %p.platform, instance = id, error = %e, "could not delete an instance whose launch failed; listings count it until it is cleaned up");
        }
    }

    async fn terminate_inner(
        &self,
        scope: Scope<'_>,
        id: &str,
        legacy: bool,
    ) -> Result<Terminated, CloudError> {
        let p = scope.platform;
        let op = Operation::TerminateInstances;
        let a = self.account(p, scope.credentials).await?;
        let Some(s) = self.seen(p, &a, id).await? else {
            return Ok(Terminated::AlreadyGone);
        };
        let tags = match &s.crn {
            Some(crn) => self.tags_of(p, &a, crn).await?,
            None => Vec::new(),
        };
        let i = self.instance(p, &s, &tags);
        if !i.may_manage(p, legacy) {
            return Err(self.refused(
                p,
                op,
                format!(
                    "instance {id} ({}) is not this cluster's to terminate",
                    s.name
                ),
            ));
        }
        if i.state.is_terminating() {
            return Ok(Terminated::AlreadyGone);
        }
        // Go: "retry until deleting". Each check sends the delete again until the API says so.
        for check in 0..=self.options.delete_checks {
            if !self.delete_call(p, &a, id).await? {
                self.forget(s.crn.as_deref());
                return Ok(if check == 0 {
                    Terminated::AlreadyGone
                } else {
                    Terminated::Requested
                });
            }
            tokio::time::sleep(self.options.delete_check_delay).await;
            match self.seen(p, &a, id).await? {
                None => {
                    self.forget(s.crn.as_deref());
                    return Ok(Terminated::Requested);
                }
                Some(now) if now.state.is_terminating() => {
                    self.forget(s.crn.as_deref());
                    return Ok(Terminated::Requested);
                }
                Some(_) => {}
            }
        }
        Err(self.error(
            p,
            op,
            Failure {
                class: ErrorClass::Unavailable,
                code: None,
                message: format!(
                    "instance {id} accepted the delete but is not deleting after {} checks",
                    self.options.delete_checks + 1
                ),
                field: None,
            },
            self.options.delete_checks + 1,
        ))
    }

    async fn retag_inner(
        &self,
        scope: Scope<'_>,
        id: &str,
        launch: &LaunchId,
    ) -> Result<(), CloudError> {
        let p = scope.platform;
        let op = Operation::CreateTags;
        let a = self.account(p, scope.credentials).await?;
        let Some(s) = self.seen(p, &a, id).await? else {
            return Err(self.error(
                p,
                op,
                Failure {
                    class: ErrorClass::NotFound,
                    code: None,
                    message: format!("instance {id} not found"),
                    field: None,
                },
                1,
            ));
        };
        let Some(crn) = s.crn.clone() else {
            return Err(self.refused(p, op, format!("instance {id} has no CRN")));
        };
        let current = self.tags_of(p, &a, &crn).await?;
        let i = self.instance(p, &s, &current);
        if i.ownership != Ownership::Ours || !i.has_platform_tags(p) {
            return Err(self.refused(
                p,
                op,
                format!("instance {id} is not this cluster's to retag"),
            ));
        }
        let new = user_tags(&owner_tags(p, launch));
        let stale: Vec<String> = current
            .iter()
            .filter(|t| {
                t.split_once(':')
                    .is_some_and(|(k, _)| OWNER_KEYS.iter().any(|o| o.eq_ignore_ascii_case(k)))
                    && !new.iter().any(|n| n.eq_ignore_ascii_case(t))
            })
            .cloned()
            .collect();
        self.call(p, op, || a.tagging.detach(&crn, &stale)).await?;
        let kept: Vec<String> = current.into_iter().filter(|t| !stale.contains(t)).collect();
        self.remember(&crn, &kept);
        self.tag(p, &a, &crn, &new).await
    }

    async fn describe_inner(
        &self,
        scope: Scope<'_>,
        ids: &[String],
    ) -> Result<Vec<Instance>, CloudError> {
        let p = scope.platform;
        let a = self.account(p, scope.credentials).await?;
        let seen: Vec<Seen> = if ids.len() == 1 {
            self.seen(p, &a, &ids[0]).await?.into_iter().collect()
        } else {
            // One listing answers a whole batch of probes.
            let all: Vec<Seen> = match &p.ibm {
                Some(IbmService::Vpc(_)) => {
                    let vpc = self.vpc(p, &a).await?;
                    self.call(p, Operation::DescribeInstances, || vpc.all_instances())
                        .await?
                        .iter()
                        .map(Seen::vpc)
                        .collect()
                }
                Some(IbmService::Power(_)) => {
                    let pw = self.power(p, &a).await?;
                    self.call(p, Operation::DescribeInstances, || pw.instances())
                        .await?
                        .iter()
                        .map(Seen::power)
                        .collect()
                }
                None => Vec::new(),
            };
            all.into_iter().filter(|s| ids.contains(&s.id)).collect()
        };
        // A Power VS instance is ready once its boot volume has the configured size: the resize
        // is retried at every probe until it sticks (conflicts are expected), bounded by the
        // allocation timeout.
        let mut seen = seen;
        if let Some(IbmService::Power(cfg)) = &p.ibm {
            let pw = self.power(p, &a).await?;
            for s in seen.iter_mut() {
                if s.state == InstanceState::Running
                    && let Err(e) = self.ensure_disk(p, &pw, cfg.disk_gb, &s.id).await
                {
                    tracing::info!(platform = %p.platform, instance = %s.id, error = %e, "boot volume not resized yet; instance not ready");
                    s.address = None;
                }
            }
        }
        self.with_tags(p, &a, seen).await
    }

    /// Resizes the boot volume of Power VS instance `id` to `gb` unless it already is.
    async fn ensure_disk(
        &self,
        p: &DynamicPlatform,
        pw: &PowerClient,
        gb: u32,
        id: &str,
    ) -> Result<(), CloudError> {
        let op = Operation::ResizeVolume;
        let Some(i) = self
            .call(p, Operation::DescribeInstances, || pw.instance(id))
            .await?
        else {
            return Ok(());
        };
        if i.disk_gb.is_some_and(|d| d >= f64::from(gb)) {
            return Ok(());
        }
        let Some(volume) = i.boot_volume.clone() else {
            return Err(self.refused(p, op, format!("instance {id} reports no boot volume yet")));
        };
        self.call(p, Operation::ResizeVolume, || pw.resize(&volume, gb))
            .await?;
        Err(self.error(
            p,
            Operation::ResizeVolume,
            Failure {
                class: ErrorClass::Other,
                code: None,
                message: format!("boot volume {volume} resize to {gb} GB requested"),
                field: None,
            },
            1,
        ))
    }
}

impl Cloud for IbmCloud {
    fn launch<'a>(
        &'a self,
        request: &'a LaunchRequest<'a>,
    ) -> BoxFuture<'a, Result<LaunchOutcome, CloudError>> {
        Box::pin(self.launch_inner(request))
    }

    fn list<'a>(&'a self, scope: Scope<'a>) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>> {
        Box::pin(async move {
            let p = scope.platform;
            let a = self.account(p, scope.credentials).await?;
            let seen = self.seen_of_tag(p, &a).await?;
            let listed: Vec<Instance> = self
                .with_tags(p, &a, seen)
                .await?
                .into_iter()
                .filter(|i| i.state != InstanceState::Terminated)
                .collect();
            self.metrics.set_instances(p.platform.as_str(), &listed);
            Ok(listed)
        })
    }

    fn describe<'a>(
        &'a self,
        scope: Scope<'a>,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>> {
        Box::pin(self.describe_inner(scope, ids))
    }

    fn terminate<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        legacy: bool,
    ) -> BoxFuture<'a, Result<Terminated, CloudError>> {
        Box::pin(self.terminate_inner(scope, id, legacy))
    }

    fn retag<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        launch: &'a LaunchId,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(self.retag_inner(scope, id, launch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::testing::launch_id;

    #[test]
    fn names_are_stable_per_launch_and_cluster() {
        let c = ClusterId::new("c1").unwrap();
        let a = name_bits(&c, &launch_id("uid-1", 0, 1));
        assert_eq!(a, name_bits(&c, &launch_id("uid-1", 0, 1)));
        assert_ne!(a, name_bits(&c, &launch_id("uid-1", 0, 2)));
        assert_ne!(
            a,
            name_bits(&ClusterId::new("c2").unwrap(), &launch_id("uid-1", 0, 1))
        );
    }

    #[test]
    fn tags_read_back_case_insensitively_and_bad_ones_are_left_out() {
        let pairs = vec![
            ("MultiPlatformManaged".to_owned(), "true".to_owned()),
            ("taskRunID".to_owned(), "tenant-a:build-1".to_owned()),
            ("Name".to_owned(), "x".to_owned()),
            ("bad".to_owned(), "a/b".to_owned()),
        ];
        let t = user_tags(&pairs);
        assert_eq!(
            t,
            ["MultiPlatformManaged:true", "taskRunID:tenant-a:build-1"]
        );
        let lower: Vec<String> = t.iter().map(|x| x.to_ascii_lowercase()).collect();
        let m = tag_map(&lower);
        assert_eq!(m["MultiPlatformManaged"], "true");
        assert_eq!(m["taskRunID"], "tenant-a:build-1");
    }

    #[test]
    fn vpc_states_and_times() {
        assert_eq!(vpc_state("failed"), InstanceState::Stopped);
        assert!(vpc_state("failed").is_gone());
        assert!(
            !vpc_state("failed").is_terminating(),
            "failed instances are cleaned up"
        );
        assert_eq!(vpc_state("deleting"), InstanceState::ShuttingDown);
        assert_eq!(vpc_state("pending"), InstanceState::Pending);
        assert_eq!(vpc_state("weird"), InstanceState::Unknown);
        assert!(parse_time(Some("2024-01-01T00:00:00Z")).is_some());
        assert_eq!(parse_time(Some("yesterday")), None);
        assert_eq!(parse_time(None), None);
    }
}
