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
    BlockDeviceMapping, EbsBlockDevice, Filter, IamInstanceProfileSpecification,
    InstanceInterruptionBehavior, InstanceMarketOptionsRequest, InstanceType, MarketType,
    ResourceType, ShutdownBehavior, SpotInstanceType, SpotMarketOptions, Tag, TagSpecification,
    VolumeType,
};
use futures::future::BoxFuture;

use crate::cloud::error::{classify, is_spot_refusal};
use crate::cloud::launch::{Market, client_token, encode_user_data, instance_tags, tags};
use crate::cloud::metrics::CloudMetrics;
use crate::cloud::retry::RetryPolicy;
use crate::cloud::{
    Cloud, CloudError, Credentials, ErrorClass, Instance, InstanceState, LaunchRequest, Launched,
    Operation, Scope, Terminated,
};
use crate::config::DynamicPlatform;
use crate::contract::instance_tags as compat_tags;

/// Instance states a listing asks for: everything but `terminated`.
const LIVE_STATES: [&str; 5] = ["pending", "running", "shutting-down", "stopping", "stopped"];

/// Options of the EC2 provider.
#[derive(Debug, Clone)]
pub struct AwsOptions {
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

impl Default for AwsOptions {
    fn default() -> Self {
        Self {
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

fn to_instance(i: &aws_sdk_ec2::types::Instance) -> Option<Instance> {
    let nonempty = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_owned);
    Some(Instance {
        id: i.instance_id()?.to_owned(),
        state: i
            .state()
            .and_then(|s| s.name())
            .map(|n| InstanceState::from_name(n.as_str()))
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
    })
}

/// True when the instance carries our managed tag and the platform's instance tag.
fn is_ours(i: &Instance, p: &DynamicPlatform) -> bool {
    i.tag(compat_tags::MANAGED) == Some("true")
        && i.tag(compat_tags::INSTANCE) == Some(p.instance_tag.as_str())
}

/// True when a listed instance belongs to platform `p`: our platform tag matches, or it has none
/// (launched by the Go controller, which only had the instance tag to go by).
fn of_platform(i: &Instance, p: &DynamicPlatform) -> bool {
    i.platform_label()
        .is_none_or(|l| l == p.platform.label_value())
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
        let c: &Credentials = scope.credentials;
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
    async fn describe_all(
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
                    .filter_map(to_instance),
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
        let mut all = self
            .describe_all(&client, p, Self::scope_filters(p))
            .await?;
        all.retain(|i| of_platform(i, p));
        self.metrics.set_instances(p.platform.as_str(), &all);
        Ok(all)
    }

    /// DescribeInstances of one id: the instance, or `None` when the cloud does not know it.
    async fn lookup(
        &self,
        p: &DynamicPlatform,
        client: &Client,
        id: &str,
    ) -> Result<Option<Instance>, CloudError> {
        let req = client.describe_instances().instance_ids(id);
        let out = match self
            .call(
                p,
                Operation::DescribeInstances,
                |_| false,
                || req.clone().send(),
            )
            .await
        {
            Ok(out) => out,
            Err(f) if f.class == ErrorClass::NotFound => return Ok(None),
            Err(f) => return Err(f.into_error(p, Operation::DescribeInstances)),
        };
        Ok(out
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .filter_map(to_instance)
            .find(|i| i.id == id))
    }

    async fn describe_impl(
        &self,
        scope: Scope<'_>,
        id: &str,
    ) -> Result<Option<Instance>, CloudError> {
        let p = scope.platform;
        let client = self.client(scope);
        match self.lookup(p, &client, id).await? {
            Some(i) if is_ours(&i, p) => Ok(Some(i)),
            Some(i) => {
                tracing::warn!(platform = %p.platform, instance = %i.id, "instance lacks our tags; ignoring it");
                Ok(None)
            }
            None => Ok(None),
        }
    }

    async fn terminate_impl(&self, scope: Scope<'_>, id: &str) -> Result<Terminated, CloudError> {
        let p = scope.platform;
        let client = self.client(scope);
        // Look first: never terminate an instance that is not ours (ids come from TaskRun
        // annotations, which users can edit), and skip the call when it is already gone.
        let Some(inst) = self.lookup(p, &client, id).await? else {
            return Ok(Terminated::AlreadyGone);
        };
        if !is_ours(&inst, p) {
            return Err(CloudError::new(
                p,
                Operation::TerminateInstances,
                ErrorClass::Refused,
                None,
                format!(
                    "instance {id} does not carry {}=true and {}={}; refusing to terminate it",
                    compat_tags::MANAGED,
                    compat_tags::INSTANCE,
                    p.instance_tag
                ),
                0,
            ));
        }
        if matches!(
            inst.state,
            InstanceState::ShuttingDown | InstanceState::Terminated
        ) {
            return Ok(Terminated::AlreadyGone);
        }
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

    /// The image's root device name, so the gp3 root disk override lands on the root volume.
    async fn root_device(
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

    /// The instance an earlier try of this (owner, attempt) launched, if any.
    async fn find_attempt(
        &self,
        client: &Client,
        req: &LaunchRequest<'_>,
    ) -> Result<Option<Instance>, CloudError> {
        let p = req.scope.platform;
        let mut filters = Self::scope_filters(p);
        filters.push(filter(&format!("tag:{}", tags::OWNER), &[req.owner.key()]));
        filters.push(filter(
            &format!("tag:{}", tags::ATTEMPT),
            &[req.attempt.to_string().as_str()],
        ));
        let mut found = self.describe_all(client, p, filters).await?;
        // Prefer one that is alive, should several exist.
        found.sort_by_key(|i| (i.state.is_gone(), i.launch_time));
        Ok(found.into_iter().next())
    }

    async fn run(
        &self,
        client: &Client,
        req: &LaunchRequest<'_>,
        root_device: &str,
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
            .client_token(client_token(req.owner.key(), req.attempt, market))
            .instance_initiated_shutdown_behavior(ShutdownBehavior::Terminate)
            .block_device_mappings(
                BlockDeviceMapping::builder()
                    .device_name(root_device)
                    .ebs(ebs)
                    .build(),
            )
            .tag_specifications(spec(ResourceType::Instance))
            .tag_specifications(spec(ResourceType::Volume))
            .set_key_name(p.key_name.clone())
            .set_subnet_id(p.subnet_id.clone())
            .set_user_data(p.user_data.as_deref().map(encode_user_data));
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
            .find_map(to_instance)
            .ok_or_else(|| Failure {
                class: ErrorClass::Other,
                code: None,
                message: "RunInstances answered without an instance".into(),
                attempts: 1,
            })
    }

    async fn launch_impl(&self, req: &LaunchRequest<'_>) -> Result<Launched, CloudError> {
        let p = req.scope.platform;
        let platform = p.platform.as_str();
        let client = self.client(req.scope);
        // The cloud's ClientToken makes a repeated RunInstances return the first instance, but
        // not every EC2-compatible cloud honours it: look for our own tags first.
        if let Some(instance) = self.find_attempt(&client, req).await? {
            tracing::info!(
                platform,
                owner = req.owner.key(),
                attempt = req.attempt,
                instance = %instance.id,
                state = instance.state.as_str(),
                "adopting the instance of an earlier launch try"
            );
            self.metrics.launched(platform, true);
            return Ok(Launched {
                instance,
                adopted: true,
            });
        }
        let root = self.root_device(&client, p).await?;
        let (tags, ignored) = instance_tags(p, &req.owner, req.attempt, req.additional_tags);
        if !ignored.is_empty() {
            tracing::warn!(
                platform,
                ?ignored,
                "additional-instance-tags keys reserved by us or the cloud are ignored"
            );
        }
        if p.spot {
            match self.run(&client, req, &root, &tags, Market::Spot).await {
                Ok(instance) => return Ok(self.launched(req, instance)),
                Err(f) if is_spot_refusal(f.code.as_deref()) => {
                    tracing::warn!(
                        platform,
                        owner = req.owner.key(),
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
            .run(&client, req, &root, &tags, Market::OnDemand)
            .await
            .map_err(|f| f.into_error(p, Operation::RunInstances))?;
        Ok(self.launched(req, instance))
    }

    fn launched(&self, req: &LaunchRequest<'_>, instance: Instance) -> Launched {
        let p = req.scope.platform;
        tracing::info!(
            platform = %p.platform,
            owner = req.owner.key(),
            taskrun_id = %req.owner.taskrun_id_tag(),
            attempt = req.attempt,
            instance = %instance.id,
            spot = instance.spot,
            "launched instance"
        );
        self.metrics.launched(p.platform.as_str(), false);
        Launched {
            instance,
            adopted: false,
        }
    }
}

impl Cloud for AwsCloud {
    fn launch<'a>(
        &'a self,
        request: &'a LaunchRequest<'a>,
    ) -> BoxFuture<'a, Result<Launched, CloudError>> {
        Box::pin(self.launch_impl(request))
    }

    fn list<'a>(&'a self, scope: Scope<'a>) -> BoxFuture<'a, Result<Vec<Instance>, CloudError>> {
        Box::pin(self.list_impl(scope))
    }

    fn describe<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Instance>, CloudError>> {
        Box::pin(self.describe_impl(scope, id))
    }

    fn terminate<'a>(
        &'a self,
        scope: Scope<'a>,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Terminated, CloudError>> {
        Box::pin(self.terminate_impl(scope, id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::testing::platform;
    use aws_sdk_ec2::primitives::DateTime;
    use aws_sdk_ec2::types::{InstanceLifecycleType, InstanceStateName};

    fn creds(id: &str, secret: &str) -> Credentials {
        Credentials {
            access_key_id: id.into(),
            secret_access_key: secret.into(),
            session_token: None,
        }
    }

    #[tokio::test]
    async fn clients_are_cached_per_region_and_credentials_and_replaced_on_rotation() {
        let cloud = AwsCloud::new(AwsOptions::default(), CloudMetrics::unregistered().unwrap());
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
        let got = to_instance(&i).unwrap();
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
        assert_eq!(to_instance(&no_id), None);
    }

    #[test]
    fn ours_means_managed_and_same_instance_tag() {
        let p = platform();
        let mut i = to_instance(
            &aws_sdk_ec2::types::Instance::builder()
                .instance_id("i-1")
                .build(),
        )
        .unwrap();
        assert!(!is_ours(&i, &p));
        i.tags.insert("MultiPlatformManaged".into(), "true".into());
        i.tags
            .insert("multi-platform-instance".into(), "someone-else".into());
        assert!(!is_ours(&i, &p));
        i.tags
            .insert("multi-platform-instance".into(), p.instance_tag.clone());
        assert!(is_ours(&i, &p));
        assert!(of_platform(&i, &p), "no platform tag: a Go-era instance");
        i.tags.insert(tags::PLATFORM.into(), "linux-s390x".into());
        assert!(!of_platform(&i, &p));
    }
}
