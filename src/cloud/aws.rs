//! Amazon EC2 (or an EC2-compatible endpoint) through the AWS SDK. The only module that uses it.
//!
//! One SDK client per (region, credentials, endpoint), cached. The SDK's own retries are off:
//! every call goes through one private wrapper (`AwsCloud::call`), which classifies failures
//! ([`classify`]), retries with back-off per [`RetryPolicy`] and counts each try in
//! [`CloudMetrics`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use aws_sdk_ec2::Client;
use aws_sdk_ec2::config::retry::RetryConfig;
use aws_sdk_ec2::config::timeout::TimeoutConfig;
use aws_sdk_ec2::config::{BehaviorVersion, Region};
use aws_sdk_ec2::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_ec2::types::{
    BlockDeviceMapping, EbsBlockDevice, Filter, HttpTokensState, IamInstanceProfileSpecification,
    InstanceInterruptionBehavior, InstanceMarketOptionsRequest, InstanceMetadataEndpointState,
    InstanceMetadataOptionsRequest, InstanceType, LicenseConfigurationRequest, MarketType,
    Placement, ResourceType, ShutdownBehavior, SpotInstanceType, SpotMarketOptions, Tag,
    TagSpecification, Tenancy, VolumeType,
};
use futures::future::BoxFuture;

use crate::cloud::error::{classify, is_spot_refusal};
use crate::cloud::instance::{state_from_name, tags};
use crate::cloud::launch::{
    ClusterId, LaunchOutcome, Market, client_token, encode_user_data, instance_tags, owner_tags,
    ownership,
};
use crate::cloud::metrics::CloudMetrics;
use crate::cloud::retry::RetryPolicy;
use crate::cloud::{
    AwsCredentials, Cloud, CloudError, ErrorClass, Instance, LaunchRequest, Operation, Scope,
    Terminated,
};
use crate::config::{DynamicPlatform, HostOs};
use crate::contract::instance_tags as compat_tags;
use crate::scheduler::{InstanceState, LaunchId, Ownership};

/// Instance states a listing asks for: everything but `terminated`.
const LIVE_STATES: [&str; 5] = ["pending", "running", "shutting-down", "stopping", "stopped"];

/// Most values one DescribeInstances filter takes: lookups by id go through the `instance-id`
/// filter, 200 ids a call, because an explicit id list fails as a whole when one id is unknown.
pub const MAX_IDS_PER_CALL: usize = 200;

/// Options of the EC2 provider.
#[derive(Debug, Clone)]
pub struct AwsOptions {
    /// This cluster's identity: tagged on every launch; only instances carrying it are adopted,
    /// retagged or terminated (see [`Instance::may_manage`]).
    pub cluster: ClusterId,
    /// Endpoint override (an EC2-compatible cloud, or an emulator in tests); `None` for AWS.
    pub endpoint: Option<String>,
    /// Retries of failed calls.
    pub retry: RetryPolicy,
    /// Instances per DescribeInstances page (5..=1000).
    pub page_size: i32,
    /// TCP/TLS connect timeout of one call.
    pub connect_timeout: Duration,
    /// Timeout of one call (one try).
    pub call_timeout: Duration,
}

impl AwsOptions {
    /// Defaults for AWS itself, for `cluster`.
    pub fn new(cluster: ClusterId) -> Self {
        Self {
            cluster,
            endpoint: None,
            retry: RetryPolicy::default(),
            page_size: 1000,
            connect_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ClientKey {
    region: String,
    access_key_id: String,
    fingerprint: String,
}

/// The EC2 provider.
#[derive(Debug)]
pub struct AwsCloud {
    options: AwsOptions,
    metrics: CloudMetrics,
    clients: Mutex<HashMap<ClientKey, Client>>,
    /// (region, image) → root device name; images are immutable.
    root_devices: Mutex<HashMap<(String, String), String>>,
}

/// A failed try, before it becomes a [`CloudError`].
#[derive(Debug)]
struct Failure {
    class: ErrorClass,
    code: Option<String>,
    message: String,
    attempts: u32,
}

impl Failure {
    fn into_error(self, platform: &DynamicPlatform, op: Operation) -> CloudError {
        CloudError::new(
            platform,
            op,
            self.class,
            self.code,
            self.message,
            self.attempts,
        )
    }
}

fn describe_sdk_error<E>(e: &SdkError<E>) -> (Option<String>, String, Option<u16>, bool)
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let status = e.raw_response().map(|r| r.status().as_u16());
    let construction = matches!(e, SdkError::ConstructionFailure(_));
    let code = e.code().map(str::to_owned);
    let message = e
        .message()
        .map(str::to_owned)
        .unwrap_or_else(|| DisplayErrorContext(e).to_string());
    (code, message, status, construction)
}

fn filter(name: &str, values: &[&str]) -> Filter {
    Filter::builder()
        .name(name)
        .set_values(Some(values.iter().map(|v| (*v).to_owned()).collect()))
        .build()
}

fn to_instance(i: &aws_sdk_ec2::types::Instance, cluster: &ClusterId) -> Option<Instance> {
    let nonempty = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_owned);
    let mut out = Instance {
        id: i.instance_id()?.to_owned(),
        state: i
            .state()
            .and_then(|s| s.name())
            .map(|n| state_from_name(n.as_str()))
            .unwrap_or(InstanceState::Unknown),
        launch_time: i.launch_time().and_then(|t| SystemTime::try_from(*t).ok()),
        instance_type: i
            .instance_type()
            .map(|t| t.as_str().to_owned())
            .unwrap_or_default(),
        private_ip: nonempty(i.private_ip_address()),
        public_ip: nonempty(i.public_ip_address()),
        public_dns: nonempty(i.public_dns_name()),
        spot: i.instance_lifecycle().is_some_and(|l| l.as_str() == "spot"),
        tags: i
            .tags()
            .iter()
            .filter_map(|t| Some((t.key()?.to_owned(), t.value().unwrap_or("").to_owned())))
            .collect(),
        ownership: Ownership::Untagged,
    };
    out.ownership = ownership(&out, cluster);
    Some(out)
}

/// Why `i` may not be acted on for `p` (see [`Instance::may_manage`]), for the refusal.
fn refusal(i: &Instance, p: &DynamicPlatform, cluster: &ClusterId) -> String {
    let id = &i.id;
    if !i.has_platform_tags(p) {
        return format!(
            "instance {id} does not carry {}=true and {}={}",
            compat_tags::MANAGED,
            compat_tags::INSTANCE,
            p.instance_tag
        );
    }
    match i.tag(tags::CLUSTER) {
        Some(other) if other != cluster.as_str() => {
            format!("instance {id} belongs to cluster {other}, not {cluster}")
        }
        _ => format!(
            "instance {id} carries no {} tag (not launched by this cluster) and no TaskRun of this cluster names it",
            tags::CLUSTER
        ),
    }
}

impl AwsCloud {
    /// A provider with `options`, counting into `metrics`.
    pub fn new(options: AwsOptions, metrics: CloudMetrics) -> Self {
        Self {
            options,
            metrics,
            clients: Mutex::new(HashMap::new()),
            root_devices: Mutex::new(HashMap::new()),
        }
    }

    /// The metrics this provider counts into.
    pub fn metrics(&self) -> &CloudMetrics {
        &self.metrics
    }

    /// Number of cached SDK clients.
    pub fn cached_clients(&self) -> usize {
        self.clients.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The cached client for the scope's region and credentials. Rotated credentials (same key
    /// id, new secret) replace the old client instead of piling up.
    fn client(&self, scope: Scope<'_>) -> Client {
        let c: &AwsCredentials = scope.credentials.aws();
        let key = ClientKey {
            region: scope.platform.region.clone(),
            access_key_id: c.access_key_id.clone(),
            fingerprint: c.fingerprint(),
        };
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = clients.get(&key) {
            return client.clone();
        }
        clients.retain(|k, _| !(k.region == key.region && k.access_key_id == key.access_key_id));
        let creds = aws_sdk_ec2::config::Credentials::new(
            c.access_key_id.clone(),
            c.secret_access_key.clone(),
            c.session_token.clone(),
            None,
            "host-config-aws-secret",
        );
        let mut b = aws_sdk_ec2::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(key.region.clone()))
            .credentials_provider(creds)
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(self.options.connect_timeout)
                    .operation_attempt_timeout(self.options.call_timeout)
                    .build(),
            );
        if let Some(e) = &self.options.endpoint {
            b = b.endpoint_url(e.clone());
        }
        let client = Client::from_conf(b.build());
        clients.insert(key, client.clone());
        client
    }

    /// Runs `f` with retries per the policy; `no_retry` ends early for codes the caller handles.
    async fn call<T, E, Fut>(
        &self,
        platform: &DynamicPlatform,
        op: Operation,
        no_retry: impl Fn(Option<&str>) -> bool,
        f: impl Fn() -> Fut,
    ) -> Result<T, Failure>
    where
        Fut: Future<Output = Result<T, SdkError<E>>>,
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let start = Instant::now();
            let result = f().await;
            let elapsed = start.elapsed();
            let e = match result {
                Ok(v) => {
                    self.metrics.call(op, Ok(()), elapsed);
                    return Ok(v);
                }
                Err(e) => e,
            };
            let (code, message, status, construction) = describe_sdk_error(&e);
            let class = if construction {
                ErrorClass::Refused
            } else {
                classify(code.as_deref(), status)
            };
            self.metrics.call(op, Err(class), elapsed);
            let delay = if no_retry(code.as_deref()) {
                None
            } else {
                self.options
                    .retry
                    .next_delay(class, attempts, rand::random::<f64>())
            };
            let Some(delay) = delay else {
                return Err(Failure {
                    class,
                    code,
                    message,
                    attempts,
                });
            };
            tracing::warn!(
                platform = %platform.platform,
                operation = op.as_str(),
                class = class.as_str(),
                code = code.as_deref().unwrap_or(""),
                status,
                attempt = attempts,
                delay_ms = delay.as_millis() as u64,
                error = %message,
                "cloud call failed; retrying"
            );
            tokio::time::sleep(delay).await;
        }
    }

    /// All instances matching `filters` (all pages).
    async fn describe_filtered(
        &self,
        client: &Client,
        platform: &DynamicPlatform,
        filters: Vec<Filter>,
    ) -> Result<Vec<Instance>, CloudError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let req = client
                .describe_instances()
                .set_filters(Some(filters.clone()))
                .max_results(self.options.page_size)
                .set_next_token(token.clone());
            let page = self
                .call(
                    platform,
                    Operation::DescribeInstances,
                    |_| false,
                    || req.clone().send(),
                )
                .await
                .map_err(|f| f.into_error(platform, Operation::DescribeInstances))?;
            out.extend(
                page.reservations()
                    .iter()
                    .flat_map(|r| r.instances())
                    .filter_map(|i| to_instance(i, &self.options.cluster)),
            );
            token = page
                .next_token()
                .filter(|t| !t.is_empty())
                .map(str::to_owned);
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    fn scope_filters(p: &DynamicPlatform) -> Vec<Filter> {
        vec![
            filter(&format!("tag:{}", compat_tags::MANAGED), &["true"]),
            filter(
                &format!("tag:{}", compat_tags::INSTANCE),
                &[p.instance_tag.as_str()],
            ),
            filter("instance-state-name", &LIVE_STATES),
        ]
    }

    async fn list_impl(&self, scope: Scope<'_>) -> Result<Vec<Instance>, CloudError> {
        let p = scope.platform;
        let client = self.client(scope);
        let all = self
            .describe_filtered(&client, p, Self::scope_filters(p))
            .await?;
        self.metrics.set_instances(p.platform.as_str(), &all);
        Ok(all)
    }

    /// DescribeInstances by id through the `instance-id` filter: unknown ids are left out rather
    /// than failing the call, and no state filter, so recently terminated ones show.
    async fn describe_impl(
        &self,
        scope: Scope<'_>,
        ids: &[String],
    ) -> Result<Vec<Instance>, CloudError> {
        let p = scope.platform;
        let client = self.client(scope);
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(MAX_IDS_PER_CALL) {
            let values: Vec<&str> = chunk.iter().map(String::as_str).collect();
            out.extend(
                self.describe_filtered(&client, p, vec![filter("instance-id", &values)])
                    .await?,
            );
        }
        Ok(out)
    }

    /// One instance by id, `None` when the cloud does not know it.
    async fn lookup(&self, scope: Scope<'_>, id: &str) -> Result<Option<Instance>, CloudError> {
        let found = self.describe_impl(scope, &[id.to_owned()]).await?;
        Ok(found.into_iter().find(|i| i.id == id))
    }

    fn refused(&self, p: &DynamicPlatform, op: Operation, why: String) -> CloudError {
        CloudError::new(p, op, ErrorClass::Refused, None, why, 0)
    }

    async fn terminate_impl(
        &self,
        scope: Scope<'_>,
        id: &str,
        legacy: bool,
    ) -> Result<Terminated, CloudError> {
        let p = scope.platform;
        // Look first: never terminate an instance that is not ours (ids come from TaskRun
        // annotations, which users can edit, and clusters share accounts), and skip the call
        // when it is already gone.
        let Some(inst) = self.lookup(scope, id).await? else {
            return Ok(Terminated::AlreadyGone);
        };
        if !inst.may_manage(p, legacy) {
            let why = refusal(&inst, p, &self.options.cluster);
            return Err(self.refused(
                p,
                Operation::TerminateInstances,
                format!("{why}; refusing to terminate it"),
            ));
        }
        if inst.state.is_terminating() {
            return Ok(Terminated::AlreadyGone);
        }
        let client = self.client(scope);
        let req = client.terminate_instances().instance_ids(id);
        match self
            .call(
                p,
                Operation::TerminateInstances,
                |_| false,
                || req.clone().send(),
            )
            .await
        {
            Ok(_) => {
                tracing::info!(platform = %p.platform, instance = id, "terminating instance");
                Ok(Terminated::Requested)
            }
            Err(f) if f.class == ErrorClass::NotFound => Ok(Terminated::AlreadyGone),
            Err(f) => Err(f.into_error(p, Operation::TerminateInstances)),
        }
    }

    async fn retag_impl(
        &self,
        scope: Scope<'_>,
        id: &str,
        launch: &LaunchId,
    ) -> Result<(), CloudError> {
        let p = scope.platform;
        let Some(inst) = self.lookup(scope, id).await? else {
            return Err(CloudError::new(
                p,
                Operation::CreateTags,
                ErrorClass::NotFound,
                None,
                format!("instance {id} does not exist"),
                0,
            ));
        };
        if !inst.may_manage(p, false) {
            let why = refusal(&inst, p, &self.options.cluster);
            return Err(self.refused(
                p,
                Operation::CreateTags,
                format!("{why}; refusing to retag it"),
            ));
        }
        let client = self.client(scope);
        let tag_list: Vec<Tag> = owner_tags(p, launch)
            .into_iter()
            .map(|(k, v)| Tag::builder().key(k).value(v).build())
            .collect();
        let req = client.create_tags().resources(id).set_tags(Some(tag_list));
        self.call(p, Operation::CreateTags, |_| false, || req.clone().send())
            .await
            .map_err(|f| f.into_error(p, Operation::CreateTags))?;
        tracing::info!(platform = %p.platform, instance = id, launch = %launch, "retagged instance");
        Ok(())
    }

    /// The image's root device name, so the gp3 root disk override lands on the root volume;
    /// `None` when it cannot be known before the launch (no root disk override then).
    async fn root_device(
        &self,
        client: &Client,
        p: &DynamicPlatform,
    ) -> Result<Option<String>, CloudError> {
        if let Some(known) = ssm_root_device(p) {
            return Ok(known.map(str::to_owned));
        }
        self.image_root_device(client, p).await.map(Some)
    }

    async fn image_root_device(
        &self,
        client: &Client,
        p: &DynamicPlatform,
    ) -> Result<String, CloudError> {
        let key = (p.region.clone(), p.ami.clone());
        if let Some(d) = self
            .root_devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(d.clone());
        }
        let req = client.describe_images().image_ids(&p.ami);
        let out = self
            .call(
                p,
                Operation::DescribeImages,
                |_| false,
                || req.clone().send(),
            )
            .await
            .map_err(|f| f.into_error(p, Operation::DescribeImages))?;
        let image = out
            .images()
            .iter()
            .find(|i| i.image_id() == Some(p.ami.as_str()));
        let Some(image) = image else {
            return Err(CloudError::new(
                p,
                Operation::DescribeImages,
                ErrorClass::Config,
                Some("InvalidAMIID.NotFound".into()),
                format!(
                    "image {} is not visible to this account in {}",
                    p.ami, p.region
                ),
                1,
            ));
        };
        let Some(root) = image.root_device_name().filter(|d| !d.is_empty()) else {
            return Err(CloudError::new(
                p,
                Operation::DescribeImages,
                ErrorClass::Config,
                Some("InvalidAMIID.NoRootDevice".into()),
                format!(
                    "image {} has no root device name, so the root disk cannot be sized",
                    p.ami
                ),
                1,
            ));
        };
        self.root_devices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, root.to_owned());
        Ok(root.to_owned())
    }

    /// The instance an earlier try of this launch started, if any, in any state (terminated
    /// ones too, while the cloud still reports them): a live one if there is one.
    async fn find_attempt(
        &self,
        client: &Client,
        req: &LaunchRequest<'_>,
    ) -> Result<Option<Instance>, CloudError> {
        let p = req.scope.platform;
        let filters = vec![
            filter(&format!("tag:{}", compat_tags::MANAGED), &["true"]),
            filter(
                &format!("tag:{}", compat_tags::INSTANCE),
                &[p.instance_tag.as_str()],
            ),
            filter(
                &format!("tag:{}", tags::CLUSTER),
                &[self.options.cluster.as_str()],
            ),
            filter(
                &format!("tag:{}", tags::OWNER),
                &[req.launch.owner_key().as_str()],
            ),
            filter(
                &format!("tag:{}", tags::ATTEMPT),
                &[req.launch.attempt_tag().as_str()],
            ),
        ];
        let mut found = self.describe_filtered(client, p, filters).await?;
        found.sort_by_key(|i| (i.state.is_gone(), i.launch_time));
        Ok(found.into_iter().next())
    }

    async fn run(
        &self,
        client: &Client,
        req: &LaunchRequest<'_>,
        root_device: Option<&str>,
        instance_tags: &[(String, String)],
        market: Market,
    ) -> Result<Instance, Failure> {
        let p = req.scope.platform;
        let tag_list: Vec<Tag> = instance_tags
            .iter()
            .map(|(k, v)| Tag::builder().key(k).value(v).build())
            .collect();
        let spec = |rt: ResourceType| {
            TagSpecification::builder()
                .resource_type(rt)
                .set_tags(Some(tag_list.clone()))
                .build()
        };
        let ebs = EbsBlockDevice::builder()
            .volume_size(i32::try_from(p.disk_gb).unwrap_or(i32::MAX))
            .volume_type(VolumeType::Gp3)
            .set_iops(p.iops.map(|v| i32::try_from(v).unwrap_or(i32::MAX)))
            .set_throughput(p.throughput.map(|v| i32::try_from(v).unwrap_or(i32::MAX)))
            .delete_on_termination(true)
            .build();
        let mut b = client
            .run_instances()
            .image_id(&p.ami)
            .instance_type(InstanceType::from(p.instance_type.as_str()))
            .min_count(1)
            .max_count(1)
            .client_token(client_token(&self.options.cluster, req.launch, market))
            .instance_initiated_shutdown_behavior(ShutdownBehavior::Terminate)
            .set_block_device_mappings(root_device.map(|d| {
                vec![
                    BlockDeviceMapping::builder()
                        .device_name(d)
                        .ebs(ebs)
                        .build(),
                ]
            }))
            .tag_specifications(spec(ResourceType::Instance))
            .tag_specifications(spec(ResourceType::Volume))
            .set_key_name(p.key_name.clone())
            .set_subnet_id(p.subnet_id.clone())
            .set_user_data(p.user_data.as_deref().map(encode_user_data))
            .metadata_options(
                InstanceMetadataOptionsRequest::builder()
                    .http_endpoint(InstanceMetadataEndpointState::Enabled)
                    .http_tokens(if p.imds.tokens_required {
                        HttpTokensState::Required
                    } else {
                        HttpTokensState::Optional
                    })
                    .http_put_response_hop_limit(i32::try_from(p.imds.hop_limit).unwrap_or(1))
                    .build(),
            );
        if let Some(id) = &p.security_group_id {
            b = b.security_group_ids(id);
        } else if let Some(name) = &p.security_group {
            b = b.security_groups(name);
        }
        if let Some(arn) = &p.instance_profile_arn {
            b = b.iam_instance_profile(IamInstanceProfileSpecification::builder().arn(arn).build());
        } else if let Some(name) = &p.instance_profile_name {
            b = b.iam_instance_profile(
                IamInstanceProfileSpecification::builder()
                    .name(name)
                    .build(),
            );
        }
        if let Some(h) = &p.dedicated_host {
            b = b
                .placement(
                    Placement::builder()
                        .tenancy(Tenancy::from(h.tenancy.as_str()))
                        .host_resource_group_arn(&h.host_resource_group_arn)
                        .build(),
                )
                .license_specifications(
                    LicenseConfigurationRequest::builder()
                        .license_configuration_arn(&h.license_configuration_arn)
                        .build(),
                );
        }
        if market == Market::Spot {
            b = b.instance_market_options(
                InstanceMarketOptionsRequest::builder()
                    .market_type(MarketType::Spot)
                    .spot_options(
                        SpotMarketOptions::builder()
                            .spot_instance_type(SpotInstanceType::OneTime)
                            .instance_interruption_behavior(InstanceInterruptionBehavior::Terminate)
                            .build(),
                    )
                    .build(),
            );
        }
        let spot = market == Market::Spot;
        let out = self
            .call(
                p,
                Operation::RunInstances,
                |code| spot && is_spot_refusal(code),
                || b.clone().send(),
            )
            .await?;
        out.instances()
            .iter()
            .find_map(|i| to_instance(i, &self.options.cluster))
            .ok_or_else(|| Failure {
                class: ErrorClass::Other,
                code: None,
                message: "RunInstances answered without an instance".into(),
                attempts: 1,
            })
    }

    async fn launch_impl(&self, req: &LaunchRequest<'_>) -> Result<LaunchOutcome, CloudError> {
        let p = req.scope.platform;
        let platform = p.platform.as_str();
        let client = self.client(req.scope);
        // The cloud's ClientToken makes a repeated RunInstances return the first instance, but
        // not every EC2-compatible cloud honours it: look for our own tags first.
        if let Some(instance) = self.find_attempt(&client, req).await? {
            let spent = instance.state.is_gone();
            tracing::info!(
                platform,
                launch = %req.launch,
                instance = %instance.id,
                state = instance.state.as_str(),
                spent,
                "found the instance of an earlier try of this launch"
            );
            if spent {
                return Ok(LaunchOutcome::Spent(instance));
            }
            self.metrics.launched(platform, true);
            return Ok(LaunchOutcome::Adopted(instance));
        }
        let root = self.root_device(&client, p).await?;
        let (tags, ignored) =
            instance_tags(&self.options.cluster, p, req.launch, req.additional_tags);
        if !ignored.is_empty() {
            tracing::warn!(
                platform,
                ?ignored,
                "additional-instance-tags keys reserved by us or the cloud are ignored"
            );
        }
        if p.spot {
            match self
                .run(&client, req, root.as_deref(), &tags, Market::Spot)
                .await
            {
                Ok(instance) => return Ok(self.launched(req, instance)),
                Err(f) if is_spot_refusal(f.code.as_deref()) => {
                    tracing::warn!(
                        platform,
                        launch = %req.launch,
                        code = f.code.as_deref().unwrap_or(""),
                        error = %f.message,
                        "spot capacity refused; launching on-demand"
                    );
                    self.metrics.spot_fallback(platform);
                }
                Err(f) => return Err(f.into_error(p, Operation::RunInstances)),
            }
        }
        let instance = self
            .run(&client, req, root.as_deref(), &tags, Market::OnDemand)
            .await
            .map_err(|f| f.into_error(p, Operation::RunInstances))?;
        Ok(self.launched(req, instance))
    }

    /// A RunInstances answer: new, or (its token was used before) an earlier try's instance,
    /// spent when gone.
    fn launched(&self, req: &LaunchRequest<'_>, instance: Instance) -> LaunchOutcome {
        let p = req.scope.platform;
        if instance.state.is_gone() {
            tracing::info!(
                platform = %p.platform,
                launch = %req.launch,
                instance = %instance.id,
                state = instance.state.as_str(),
                "the launch token's instance is gone"
            );
            return LaunchOutcome::Spent(instance);
        }
        tracing::info!(
            platform = %p.platform,
            launch = %req.launch,
            attempt = %req.launch.attempt_tag(),
            instance = %instance.id,
            spot = instance.spot,
            "launched instance"
        );
        self.metrics.launched(p.platform.as_str(), false);
        LaunchOutcome::Launched(instance)
    }
}

/// Prefix of an image id that EC2 resolves from an SSM parameter at launch
/// (`resolve:ssm:/aws/service/ami-windows-latest/...`); DescribeImages cannot look it up.
pub const SSM_IMAGE_PREFIX: &str = "resolve:ssm:";

/// The root device of an image named by an SSM parameter, which cannot be described before the
/// launch: `Some(Some(_))` where AWS images of the OS always use it (Windows and macOS:
/// `/dev/sda1`), `Some(None)` (no root disk override; `disk` is not applied) for Linux, whose
/// images differ; `None` for an ordinary image id (describe it).
fn ssm_root_device(p: &DynamicPlatform) -> Option<Option<&'static str>> {
    if !p.ami.starts_with(SSM_IMAGE_PREFIX) {
        return None;
    }
    Some(match p.os {
        HostOs::Windows | HostOs::MacOs => Some("/dev/sda1"),
        HostOs::Linux => None,
    })
}

impl Cloud for AwsCloud {
    fn launch<'a>(
        &'a self,
        request: &'a LaunchRequest<'a>,
    ) -> BoxFuture<'a, Result<LaunchOutcome, CloudError>> {
        Box::pin(self.launch_impl(request))
    }

    fn list<'a>(&'a self, scope: Scope<'a>) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>> {
        Box::pin(self.list_impl(scope))
    }

    fn describe<'a>(
        &'a self,
        scope: Scope<'a>,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>> {
        Box::pin(self.describe_impl(scope, ids))
    }

    fn terminate<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        legacy: bool,
    ) -> BoxFuture<'a, Result<Terminated, CloudError>> {
        Box::pin(self.terminate_impl(scope, id, legacy))
    }

    fn retag<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
        launch: &'a LaunchId,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(self.retag_impl(scope, id, launch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::testing::platform;
    use aws_sdk_ec2::primitives::DateTime;
    use aws_sdk_ec2::types::{InstanceLifecycleType, InstanceStateName};

    #[test]
    fn ssm_images_get_a_root_device_only_where_the_os_fixes_it() {
        let mut p = platform();
        assert_eq!(ssm_root_device(&p), None, "an image id is described");
        p.ami = "resolve:ssm:/aws/service/ami-windows-latest/Windows_Server-2022-English-Full-Base"
            .into();
        assert_eq!(ssm_root_device(&p), Some(None));
        p.os = HostOs::Windows;
        assert_eq!(ssm_root_device(&p), Some(Some("/dev/sda1")));
        p.os = HostOs::MacOs;
        assert_eq!(ssm_root_device(&p), Some(Some("/dev/sda1")));
    }

    fn creds(id: &str, secret: &str) -> crate::cloud::Credentials {
        crate::cloud::Credentials::Aws(crate::cloud::AwsCredentials {
            access_key_id: id.into(),
            secret_access_key: secret.into(),
            session_token: None,
        })
    }

    #[tokio::test]
    async fn clients_are_cached_per_region_and_credentials_and_replaced_on_rotation() {
        let cloud = AwsCloud::new(
            AwsOptions::new(ClusterId::new("test").unwrap()),
            CloudMetrics::unregistered().unwrap(),
        );
        let east = platform();
        let mut west = platform();
        west.region = "eu-west-1".into();
        let a = creds("AKIA1", "s1");
        let scope = |platform, credentials| Scope {
            platform,
            credentials,
        };
        cloud.client(scope(&east, &a));
        cloud.client(scope(&east, &a));
        assert_eq!(cloud.cached_clients(), 1, "reused");
        cloud.client(scope(&west, &a));
        assert_eq!(cloud.cached_clients(), 2, "one per region");
        let b = creds("AKIA2", "s2");
        cloud.client(scope(&east, &b));
        assert_eq!(cloud.cached_clients(), 3, "one per access key");
        let rotated = creds("AKIA1", "s1-new");
        cloud.client(scope(&east, &rotated));
        assert_eq!(
            cloud.cached_clients(),
            3,
            "a rotated secret replaces the old client"
        );
    }

    #[test]
    fn sdk_instances_map_to_the_truth() {
        let i = aws_sdk_ec2::types::Instance::builder()
            .instance_id("i-1")
            .state(
                aws_sdk_ec2::types::InstanceState::builder()
                    .name(InstanceStateName::ShuttingDown)
                    .build(),
            )
            .launch_time(DateTime::from_secs(1_700_000_000))
            .instance_type(InstanceType::M5Large)
            .private_ip_address("10.0.0.5")
            .public_dns_name("")
            .instance_lifecycle(InstanceLifecycleType::Spot)
            .tags(Tag::builder().key("taskRunID").value("ns:tr").build())
            .build();
        let cluster = ClusterId::new("test").unwrap();
        let got = to_instance(&i, &cluster).unwrap();
        assert_eq!(got.state, InstanceState::ShuttingDown);
        assert!(got.state.is_gone());
        assert_eq!(
            got.launch_time,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert_eq!(got.instance_type, "m5.large");
        assert_eq!(
            got.public_dns, None,
            "AWS reports no public name as an empty string"
        );
        assert_eq!(got.address(false), Some("10.0.0.5"));
        assert!(got.spot);
        assert_eq!(got.taskrun_id(), Some("ns:tr"));
        let no_id = aws_sdk_ec2::types::Instance::builder().build();
        assert_eq!(to_instance(&no_id, &cluster), None);
    }

    #[test]
    fn ownership_and_refusals_name_the_cluster() {
        let p = platform();
        let ours = ClusterId::new("stone-prod-p01").unwrap();
        let sdk = |tags: &[(&str, &str)]| {
            let mut b = aws_sdk_ec2::types::Instance::builder().instance_id("i-1");
            for (k, v) in tags {
                b = b.tags(Tag::builder().key(*k).value(*v).build());
            }
            to_instance(&b.build(), &ours).unwrap()
        };
        let bare = sdk(&[]);
        assert_eq!(bare.ownership, Ownership::Untagged);
        assert!(refusal(&bare, &p, &ours).contains("does not carry MultiPlatformManaged=true"));
        let managed = [
            ("MultiPlatformManaged", "true"),
            ("multi-platform-instance", "prod-arm64"),
        ];
        let go = sdk(&managed);
        assert!(go.may_manage(&p, true) && !go.may_manage(&p, false));
        assert!(
            refusal(&go, &p, &ours).contains("carries no multi-platform-cluster tag"),
            "{}",
            refusal(&go, &p, &ours)
        );
        let theirs = sdk(&[managed[0], managed[1], (tags::CLUSTER, "stone-prod-p02")]);
        assert_eq!(theirs.ownership, Ownership::Foreign);
        assert!(!theirs.may_manage(&p, true));
        assert_eq!(
            refusal(&theirs, &p, &ours),
            "instance i-1 belongs to cluster stone-prod-p02, not stone-prod-p01"
        );
        let mine = sdk(&[managed[0], managed[1], (tags::CLUSTER, "stone-prod-p01")]);
        assert_eq!(mine.ownership, Ownership::Ours);
        assert!(mine.may_manage(&p, false));
    }
}
