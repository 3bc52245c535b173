//! A hand-written IBM Cloud emulator on loopback: IAM tokens, the VPC API (`/v1/...`, what `ibmz`
//! uses), the Power Virtual Server API (`/pcloud/v1/...`, what `ibmp` uses) and the Global
//! Tagging API (`/v3/tags...`, where instances' user tags live), in one HTTP server.
//!
//! No IBM emulator exists, so the wire shapes are kept honest from outside: IBM's own Python SDKs
//! (`ibm-vpc`, `ibm-cloud-sdk-core` from PyPI) drive the VPC and IAM parts in `e2e/tests/ibm.rs`
//! and parse every answer with their models. IBM publishes no Python SDK for Power VS; its field
//! names here follow the published `power-go-client` models (`PVMInstance`, `PVMInstanceCreate`,
//! `VolumeReference`). The Global Tagging part is driven by IBM's `ibm-platform-services` SDK
//! (`GlobalTaggingV1`). Tags are stored lower-case, as IBM compares them case-insensitively.
//!
//! Behaviour: tokens expire (and can be expired on demand), every API call needs a live bearer
//! token (else 401), instances boot (`pending` → `running`) and delete (`deleting` → gone) after
//! configurable delays, instance lists paginate (`limit`, `start`, `next.href`), Power VS volume
//! resizes answer with conflicts a configurable number of times, and faults ([`Fault`]) answer
//! chosen calls with a status or a delay.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use base64::Engine;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The API key the emulator accepts.
pub const API_KEY: &str = "emulator-api-key";
/// Names of the seeded VPC objects.
pub const VPC_NAME: &str = "emulated-vpc";
pub const SUBNET_NAME: &str = "emulated-subnet";
pub const KEY_NAME: &str = "emulated-key";
pub const IMAGE_ID: &str = "r014-00000000-0000-4000-8000-000000000001";
pub const ZONE: &str = "us-east-1";
/// The seeded Power VS workspace (cloud instance) id, its CRN, image and network.
pub const POWER_CLOUD_ID: &str = "4e9dc638-7a78-4e7c-b432-e83b7010c531";
pub const POWER_CRN: &str = "crn:v1:bluemix:public:power-iaas:wdc06:a/0123456789abcdef0123456789abcdef:4e9dc638-7a78-4e7c-b432-e83b7010c531::";
pub const POWER_IMAGE_NAME: &str = "emulated-ppc-image";
pub const POWER_IMAGE_ID: &str = "a1b2c3d4-0000-4000-8000-000000000002";
pub const POWER_NETWORK_ID: &str = "a6d8d6da-c412-4106-9b57-4e25541b2e7f";

/// What a fault does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// Answer with this status and an IBM error body.
    Status(u16),
    /// Wait, then answer as usual.
    Delay(Duration),
}

/// One injected fault: `method` requests whose path contains `path` get `kind`, `times` times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub method: Method,
    pub path: String,
    pub times: u32,
    pub kind: FaultKind,
}

/// Knobs of the emulator.
#[derive(Debug, Clone)]
pub struct Behaviour {
    /// Lifetime of issued tokens.
    pub token_ttl: Duration,
    /// From create to `running` / `ACTIVE`.
    pub boot_delay: Duration,
    /// From delete to gone.
    pub delete_delay: Duration,
    /// Power VS volume resizes answered 409 before one succeeds (per volume).
    pub resize_conflicts: u32,
    /// Addresses given to new instances in turn (both APIs); empty: `10.240.x.y`.
    pub addresses: Vec<std::net::Ipv4Addr>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self {
            token_ttl: Duration::from_secs(3600),
            boot_delay: Duration::from_millis(200),
            delete_delay: Duration::from_millis(200),
            resize_conflicts: 0,
            addresses: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
struct Vm {
    id: String,
    name: String,
    created: Instant,
    created_at: String,
    deleted: Option<Instant>,
    /// The create request body, as sent.
    request: Value,
    address: String,
    boot_volume: String,
    disk_gb: f64,
    conflicts_left: u32,
    failed: bool,
}

#[derive(Default)]
struct Inner {
    behaviour: Behaviour,
    tokens: BTreeMap<String, Instant>,
    vpc_vms: BTreeMap<String, Vm>,
    power_vms: BTreeMap<String, Vm>,
    faults: Vec<Fault>,
    requests: Vec<(Method, String)>,
    counter: u64,
    token_requests: u32,
    /// User tags by resource CRN.
    tags: BTreeMap<String, Vec<String>>,
    /// Instances created so far (both APIs).
    created: usize,
}

/// A running emulator. Dropping it stops the server.
pub struct IbmEmulator {
    addr: SocketAddr,
    state: Arc<Mutex<Inner>>,
    task: JoinHandle<()>,
}

impl Drop for IbmEmulator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Shared = Arc<Mutex<Inner>>;

fn now_rfc3339() -> String {
    time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

fn epoch() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn ibm_error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({
            "errors": [{"code": code, "message": message}],
            "trace": "emulator",
            "status_code": status.as_u16(),
        })),
    )
        .into_response()
}

impl IbmEmulator {
    /// Starts on `addr` (a loopback address; port 0 picks one).
    pub async fn start(addr: SocketAddr, behaviour: Behaviour) -> std::io::Result<Self> {
        assert!(
            addr.ip().is_loopback(),
            "the emulator listens on loopback only"
        );
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state: Shared = Arc::new(Mutex::new(Inner {
            behaviour,
            ..Inner::default()
        }));
        let app = Router::new()
            .route("/identity/token", post(token))
            .route("/v1/vpcs", get(vpcs))
            .route("/v1/subnets", get(subnets))
            .route("/v1/keys", get(keys))
            .route("/v1/instances", get(list_instances).post(create_instance))
            .route(
                "/v1/instances/{id}",
                get(get_instance).delete(delete_instance),
            )
            .route(
                "/pcloud/v1/cloud-instances/{cloud}/pvm-instances",
                get(list_pvms).post(create_pvm),
            )
            .route(
                "/pcloud/v1/cloud-instances/{cloud}/pvm-instances/{id}",
                get(get_pvm).delete(delete_pvm),
            )
            .route(
                "/pcloud/v1/cloud-instances/{cloud}/volumes/{id}",
                put(resize_volume),
            )
            .route(
                "/pcloud/v1/cloud-instances/{cloud}/images",
                get(power_images),
            )
            .route("/v3/tags", get(list_tags))
            .route("/v3/tags/attach", post(attach_tags))
            .route("/v3/tags/detach", post(detach_tags))
            .layer(axum::middleware::from_fn_with_state(state.clone(), gate))
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, state, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    /// IAM endpoint base (the SDK appends `/identity/token`).
    pub fn iam_url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// VPC API base, as in `dynamic.<p>.url` of ibmz.
    pub fn vpc_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
    /// Power VS regional endpoint, as in `dynamic.<p>.url` of ibmp.
    pub fn power_url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// Global Tagging endpoint (the same server as IAM).
    pub fn tagging_url(&self) -> String {
        format!("http://{}", self.addr)
    }
    /// The user tags attached to `crn`.
    pub fn tags_of(&self, crn: &str) -> Vec<String> {
        self.lock().tags.get(crn).cloned().unwrap_or_default()
    }
    /// Creates a VPC instance directly (another cluster's, or the Go controller's), with `tags`.
    pub fn seed_vpc_instance(&self, name: &str, tags: &[&str]) -> String {
        let mut s = self.lock();
        let request = json!({"name": name, "zone": {"name": ZONE}, "profile": {"name": "bz2-1x4"}});
        let vm = new_vm(&mut s, name.to_owned(), request, 100.0);
        let id = vm.id.clone();
        s.tags.insert(
            crn("instance", &id),
            tags.iter().map(|t| t.to_ascii_lowercase()).collect(),
        );
        s.vpc_vms.insert(id.clone(), vm);
        id
    }
    /// Marks VPC instance `id` failed.
    pub fn fail_vpc_instance(&self, id: &str) {
        if let Some(v) = self.lock().vpc_vms.get_mut(id) {
            v.failed = true;
        }
    }
    /// Marks Power VS instance `id` failed (`ERROR`, health `CRITICAL`).
    pub fn fail_power_instance(&self, id: &str) {
        if let Some(v) = self.lock().power_vms.get_mut(id) {
            v.failed = true;
        }
    }
    /// Instances that hold capacity: existing, neither deleting nor failed (both APIs).
    pub fn capacity_instances(&self) -> usize {
        self.live_instances();
        let s = self.lock();
        s.vpc_vms
            .values()
            .chain(s.power_vms.values())
            .filter(|v| v.deleted.is_none() && !v.failed)
            .count()
    }
    /// Names of the instances that still exist (deleting ones included), VPC then Power VS.
    pub fn instance_names(&self) -> Vec<String> {
        self.live_instances();
        let s = self.lock();
        s.vpc_vms
            .values()
            .chain(s.power_vms.values())
            .map(|v| v.name.clone())
            .collect()
    }
    /// Create request bodies of Power VS instances, by name.
    pub fn power_create_requests(&self) -> BTreeMap<String, Value> {
        let s = self.lock();
        s.power_vms
            .values()
            .map(|v| (v.name.clone(), v.request.clone()))
            .collect()
    }
    /// Host-config entries (without `dynamic-platforms`) of an `ibmz` platform `label`
    /// (`linux-s390x`) on this emulator: API key Secret `ibm-api-key`, SSH Secret
    /// `ibm-s390x-ssh-key`.
    pub fn ibmz_config(
        &self,
        label: &str,
        tag: &str,
        max: u32,
        user: &str,
    ) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = [
            ("type", "ibmz"),
            ("url", self.vpc_url().as_str()),
            ("region", ZONE),
            ("vpc", VPC_NAME),
            ("subnet", SUBNET_NAME),
            ("key", KEY_NAME),
            ("image-id", IMAGE_ID),
            ("profile", "bz2-1x4"),
            ("private-ip", "true"),
            ("secret", "ibm-api-key"),
            ("ssh-secret", "ibm-s390x-ssh-key"),
            ("user", user),
            ("instance-tag", tag),
        ]
        .into_iter()
        .map(|(k, v)| (format!("dynamic.{label}.{k}"), v.to_owned()))
        .collect();
        out.push((format!("dynamic.{label}.max-instances"), max.to_string()));
        out
    }
    /// Host-config entries of an `ibmp` platform `label` (`linux-ppc64le`) on this emulator.
    pub fn ibmp_config(
        &self,
        label: &str,
        tag: &str,
        max: u32,
        user: &str,
    ) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = [
            ("type", "ibmp"),
            ("url", self.power_url().as_str()),
            ("crn", POWER_CRN),
            ("key", KEY_NAME),
            ("image", POWER_IMAGE_NAME),
            ("network", POWER_NETWORK_ID),
            ("system", "e980"),
            ("cores", "0.5"),
            ("memory", "4"),
            ("disk", "120"),
            ("secret", "ibm-api-key"),
            ("ssh-secret", "ibm-ppc64le-ssh-key"),
            ("user", user),
            ("instance-tag", tag),
        ]
        .into_iter()
        .map(|(k, v)| (format!("dynamic.{label}.{k}"), v.to_owned()))
        .collect();
        out.push((format!("dynamic.{label}.max-instances"), max.to_string()));
        out
    }
    /// Adds a fault.
    pub fn inject(&self, fault: Fault) {
        self.lock().faults.push(fault);
    }
    /// Makes every issued token expired.
    pub fn expire_tokens(&self) {
        let past = Instant::now();
        for t in self.lock().tokens.values_mut() {
            *t = past;
        }
    }
    /// How many tokens were issued.
    pub fn token_requests(&self) -> u32 {
        self.lock().token_requests
    }
    /// Every request seen (method, path and query).
    pub fn requests(&self) -> Vec<(Method, String)> {
        self.lock().requests.clone()
    }
    /// Create request bodies of VPC instances, by name.
    pub fn vpc_create_requests(&self) -> BTreeMap<String, Value> {
        let s = self.lock();
        s.vpc_vms
            .values()
            .map(|v| (v.name.clone(), v.request.clone()))
            .collect()
    }
    /// Instances that still exist in either API (deleting ones included).
    pub fn live_instances(&self) -> usize {
        let mut s = self.lock();
        let Inner {
            behaviour,
            vpc_vms,
            power_vms,
            ..
        } = &mut *s;
        reap(vpc_vms, behaviour.delete_delay);
        reap(power_vms, behaviour.delete_delay);
        vpc_vms.len() + power_vms.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn reap(vms: &mut BTreeMap<String, Vm>, delay: Duration) {
    vms.retain(|_, v| v.deleted.is_none_or(|d| d.elapsed() < delay));
}

/// Records, applies faults and checks the bearer token of every API call.
async fn gate(
    State(state): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_default();
    let (fault, authorised) = {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        s.requests.push((method.clone(), pq));
        let fault = s
            .faults
            .iter_mut()
            .find(|f| f.times > 0 && f.method == method && path.contains(&f.path))
            .map(|f| {
                f.times -= 1;
                f.kind.clone()
            });
        let authorised = path == "/identity/token"
            || req
                .headers()
                .get("authorization")
                .and_then(|h| h.to_str().ok())
                .and_then(|h| h.strip_prefix("Bearer "))
                .and_then(|t| s.tokens.get(t))
                .is_some_and(|exp| Instant::now() < *exp);
        (fault, authorised)
    };
    match fault {
        Some(FaultKind::Status(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return ibm_error(status, "internal_error", "injected fault");
        }
        Some(FaultKind::Delay(d)) => tokio::time::sleep(d).await,
        None => {}
    }
    if !authorised {
        return ibm_error(
            StatusCode::UNAUTHORIZED,
            "not_authorized",
            "the request is not authorized: missing, unknown or expired token",
        );
    }
    if path.starts_with("/pcloud/") {
        let crn_ok = req
            .headers()
            .get("crn")
            .and_then(|h| h.to_str().ok())
            .is_some_and(|c| c == POWER_CRN);
        if !crn_ok {
            return (
                StatusCode::FORBIDDEN,
                axum::Json(json!({"description": "CRN header missing or not this workspace", "error": "forbidden"})),
            )
                .into_response();
        }
    }
    next.run(req).await
}

fn b64url(v: &Value) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
}

async fn token(State(state): State<Shared>, body: Bytes) -> Response {
    let form: BTreeMap<String, String> = form_urlencoded::parse(&body).into_owned().collect();
    if form.get("grant_type").map(String::as_str) != Some("urn:ibm:params:oauth:grant-type:apikey")
    {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"errorCode": "BXNIM0109E", "errorMessage": "Property missing or empty: grant_type"})),
        )
            .into_response();
    }
    if form.get("apikey").map(String::as_str) != Some(API_KEY) {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"errorCode": "BXNIM0415E", "errorMessage": "Provided API key could not be found."})),
        )
            .into_response();
    }
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    s.counter += 1;
    s.token_requests += 1;
    let ttl = s.behaviour.token_ttl;
    let iat = epoch();
    let exp = iat + ttl.as_secs().max(1);
    // SDKs read `exp` and `iat` from the token itself (a JWT; its signature is not checked).
    let access = format!(
        "{}.{}.{}",
        b64url(&json!({"alg": "HS256", "typ": "JWT"})),
        b64url(&json!({"iat": iat, "exp": exp, "sub": "emulator", "n": s.counter})),
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b"signature")
    );
    s.tokens.insert(access.clone(), Instant::now() + ttl);
    axum::Json(json!({
        "access_token": access,
        "refresh_token": "not-supported",
        "token_type": "Bearer",
        "expires_in": ttl.as_secs(),
        "expiration": exp,
        "scope": "ibm openid",
    }))
    .into_response()
}

fn href(base: &str, kind: &str, id: &str) -> String {
    format!("{base}/v1/{kind}/{id}")
}

fn base_of(headers: &HeaderMap) -> String {
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    format!("http://{host}")
}

fn resource_group(base: &str) -> Value {
    json!({"id": "rg-emulated", "href": format!("{base}/v2/resource_groups/rg-emulated"), "name": "default"})
}

fn crn(kind: &str, id: &str) -> String {
    format!("crn:v1:bluemix:public:is:{ZONE}:a/0123456789abcdef::{kind}:{id}")
}

fn vpc_json(base: &str) -> Value {
    json!({
        "id": "r014-vpc-1", "name": VPC_NAME, "crn": crn("vpc", "r014-vpc-1"),
        "href": href(base, "vpcs", "r014-vpc-1"),
        "classic_access": false, "created_at": "2024-01-01T00:00:00Z",
        "cse_source_ips": [], "default_network_acl": {"id": "acl-1", "name": "acl", "href": href(base, "network_acls", "acl-1"), "crn": crn("network-acl", "acl-1")},
        "default_routing_table": {"id": "rt-1", "name": "rt", "href": href(base, "vpcs/r014-vpc-1/routing_tables", "rt-1"), "crn": crn("routing-table", "rt-1"), "resource_type": "routing_table"},
        "default_security_group": {"id": "sg-1", "name": "default-sg", "href": href(base, "security_groups", "sg-1"), "crn": crn("security-group", "sg-1")},
        "dns": {"enable_hub": false, "resolution_binding_count": 0, "resolver": {"type": "system", "servers": [], "configuration": "default"}},
        "health_reasons": [], "health_state": "ok", "public_address_ranges": [],
        "resource_group": resource_group(base), "resource_type": "vpc", "status": "available",
    })
}

fn collection(base: &str, kind: &str, items: Vec<Value>) -> Value {
    let total = items.len();
    let mut out = json!({
        "first": {"href": format!("{base}/v1/{kind}?limit=50")},
        "limit": 50,
        "total_count": total,
    });
    out[kind] = Value::Array(items);
    out
}

async fn vpcs(headers: HeaderMap) -> Response {
    let base = base_of(&headers);
    axum::Json(collection(&base, "vpcs", vec![vpc_json(&base)])).into_response()
}

async fn subnets(headers: HeaderMap) -> Response {
    let base = base_of(&headers);
    let subnet = json!({
        "id": "subnet-1", "name": SUBNET_NAME, "crn": crn("subnet", "subnet-1"),
        "href": href(&base, "subnets", "subnet-1"),
        "available_ipv4_address_count": 250, "created_at": "2024-01-01T00:00:00Z",
        "ip_version": "ipv4", "ipv4_cidr_block": "10.240.0.0/24",
        "network_acl": {"id": "acl-1", "name": "acl", "href": href(&base, "network_acls", "acl-1"), "crn": crn("network-acl", "acl-1")},
        "resource_group": resource_group(&base), "resource_type": "subnet",
        "routing_table": {"id": "rt-1", "name": "rt", "href": href(&base, "vpcs/r014-vpc-1/routing_tables", "rt-1"), "crn": crn("routing-table", "rt-1"), "resource_type": "routing_table"},
        "status": "available", "total_ipv4_address_count": 256,
        "vpc": {"id": "r014-vpc-1", "name": VPC_NAME, "href": href(&base, "vpcs", "r014-vpc-1"), "crn": crn("vpc", "r014-vpc-1"), "resource_type": "vpc"},
        "zone": {"name": ZONE, "href": format!("{base}/v1/regions/us-east/zones/{ZONE}")},
    });
    axum::Json(collection(&base, "subnets", vec![subnet])).into_response()
}

async fn keys(headers: HeaderMap) -> Response {
    let base = base_of(&headers);
    let key = json!({
        "id": "key-1", "name": KEY_NAME, "crn": crn("key", "key-1"),
        "href": href(&base, "keys", "key-1"), "created_at": "2024-01-01T00:00:00Z",
        "fingerprint": "SHA256:emulated", "length": 256,
        "public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEmulatedKeyEmulatedKeyEmulatedKeyEmulated",
        "resource_group": resource_group(&base), "resource_type": "key", "type": "ed25519",
    });
    axum::Json(collection(&base, "keys", vec![key])).into_response()
}

fn vpc_status(vm: &Vm, b: &Behaviour) -> &'static str {
    if vm.deleted.is_some() {
        "deleting"
    } else if vm.failed {
        "failed"
    } else if vm.created.elapsed() < b.boot_delay {
        "pending"
    } else {
        "running"
    }
}

fn instance_json(base: &str, vm: &Vm, b: &Behaviour) -> Value {
    let status = vpc_status(vm, b);
    let r = &vm.request;
    let profile = r["profile"]["name"].as_str().unwrap_or("bz2-1x4");
    let vni = json!({"id": format!("{}-att", vm.id), "name": "eth0", "href": href(base, &format!("instances/{}/network_attachments", vm.id), &format!("{}-att", vm.id)), "resource_type": "instance_network_attachment",
        "primary_ip": {"address": vm.address, "href": href(base, "subnets/subnet-1/reserved_ips", &format!("{}-ip", vm.id)), "id": format!("{}-ip", vm.id), "name": "ip", "resource_type": "subnet_reserved_ip"},
        "subnet": {"id": "subnet-1", "name": SUBNET_NAME, "href": href(base, "subnets", "subnet-1"), "crn": crn("subnet", "subnet-1"), "resource_type": "subnet"},
        "virtual_network_interface": {"id": format!("{}-vni", vm.id), "name": "vni", "href": href(base, "virtual_network_interfaces", &format!("{}-vni", vm.id)), "crn": crn("virtual-network-interface", &format!("{}-vni", vm.id)), "resource_type": "virtual_network_interface"}});
    let nic = json!({"id": format!("{}-nic", vm.id), "name": "eth0", "href": href(base, &format!("instances/{}/network_interfaces", vm.id), &format!("{}-nic", vm.id)), "resource_type": "network_interface",
        "primary_ip": {"address": vm.address, "href": href(base, "subnets/subnet-1/reserved_ips", &format!("{}-ip", vm.id)), "id": format!("{}-ip", vm.id), "name": "ip", "resource_type": "subnet_reserved_ip"},
        "subnet": {"id": "subnet-1", "name": SUBNET_NAME, "href": href(base, "subnets", "subnet-1"), "crn": crn("subnet", "subnet-1"), "resource_type": "subnet"}});
    let boot = boot_ref(base, vm);
    let mut out = json!({
        "id": vm.id, "name": vm.name, "crn": crn("instance", &vm.id), "href": href(base, "instances", &vm.id),
        "availability": {"class": "standard"},
        "availability_policy": {"host_failure": r["availability_policy"]["host_failure"].as_str().unwrap_or("restart"), "preemption": "stop"},
        "bandwidth": 4000, "boot_volume_attachment": boot, "cluster_network_attachments": [],
        "confidential_compute_mode": "disabled", "created_at": vm.created_at, "disks": [],
        "enable_secure_boot": false, "health_reasons": [], "health_state": "ok",
        "image": {"id": IMAGE_ID, "name": "emulated-image", "href": href(base, "images", IMAGE_ID), "crn": crn("image", IMAGE_ID), "resource_type": "image"},
    });
    let rest = json!({
        "lifecycle_reasons": [], "lifecycle_state": if status == "deleting" { "deleting" } else { "stable" },
        "memory": 4, "metadata_service": {"enabled": false, "protocol": "http", "response_hop_limit": 1},
        "network_attachments": [vni.clone()], "primary_network_attachment": vni,
        "network_interfaces": [nic.clone()], "primary_network_interface": nic,
        "profile": {"name": profile, "href": href(base, "instance/profiles", profile), "resource_type": "instance_profile"},
        "reservation_affinity": {"policy": "disabled", "pool": []},
        "resource_group": resource_group(base), "resource_type": "instance",
        "software_attachments": [], "startable": true, "status": status, "status_reasons": [],
        "threads_per_core": 2, "total_network_bandwidth": 3000, "total_volume_bandwidth": 1000,
        "vcpu": {"architecture": "s390x", "count": 1, "manufacturer": "ibm", "percentage": 100},
        "volume_attachments": [boot_ref(base, vm)], "volume_bandwidth_qos_mode": "pooled",
        "vpc": {"id": "r014-vpc-1", "name": VPC_NAME, "href": href(base, "vpcs", "r014-vpc-1"), "crn": crn("vpc", "r014-vpc-1"), "resource_type": "vpc"},
        "zone": {"name": r["zone"]["name"].as_str().unwrap_or(ZONE), "href": format!("{base}/v1/regions/us-east/zones/{ZONE}")},
    });
    if let (Some(a), Value::Object(b)) = (out.as_object_mut(), rest) {
        a.extend(b);
    }
    out
}

fn boot_ref(base: &str, vm: &Vm) -> Value {
    json!({"id": format!("{}-boot-att", vm.id), "name": "boot", "href": href(base, &format!("instances/{}/volume_attachments", vm.id), &format!("{}-boot-att", vm.id)),
        "device": {"id": format!("{}-dev", vm.id)},
        "volume": {"id": vm.boot_volume, "name": format!("{}-boot", vm.name), "href": href(base, "volumes", &vm.boot_volume), "crn": crn("volume", &vm.boot_volume), "resource_type": "volume"}})
}

fn new_vm(s: &mut Inner, name: String, request: Value, disk_gb: f64) -> Vm {
    s.counter += 1;
    let n = s.counter;
    s.created += 1;
    let pool = &s.behaviour.addresses;
    let address = if pool.is_empty() {
        format!("10.240.{}.{}", (n / 250) % 250, n % 250 + 2)
    } else {
        pool[(s.created - 1) % pool.len()].to_string()
    };
    Vm {
        id: format!("0757_{n:08x}-0000-4000-8000-{n:012x}"),
        name,
        created: Instant::now(),
        created_at: now_rfc3339(),
        deleted: None,
        request,
        address,
        boot_volume: format!("r014-vol-{n:08x}"),
        disk_gb,
        conflicts_left: s.behaviour.resize_conflicts,
        failed: false,
    }
}

fn bad_request(message: &str) -> Response {
    ibm_error(StatusCode::BAD_REQUEST, "validation_failed", message)
}

async fn create_instance(State(state): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let Ok(r) = serde_json::from_slice::<Value>(&body) else {
        return bad_request("body is not JSON");
    };
    for field in ["name", "zone", "profile", "image", "vpc"] {
        if r.get(field).is_none() {
            return bad_request(&format!("missing field {field}"));
        }
    }
    if r.get("primary_network_attachment").is_none() && r.get("primary_network_interface").is_none()
    {
        return bad_request("missing primary_network_attachment");
    }
    let name = r["name"].as_str().unwrap_or_default().to_owned();
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    if s.vpc_vms.values().any(|v| v.name == name) {
        return ibm_error(
            StatusCode::BAD_REQUEST,
            "instance_name_duplicate",
            "name in use",
        );
    }
    let disk = r["boot_volume_attachment"]["volume"]["capacity"]
        .as_f64()
        .unwrap_or(100.0);
    let vm = new_vm(&mut s, name, r, disk);
    let base = base_of(&headers);
    let answer = instance_json(&base, &vm, &s.behaviour);
    s.vpc_vms.insert(vm.id.clone(), vm);
    (StatusCode::CREATED, axum::Json(answer)).into_response()
}

async fn list_instances(
    State(state): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let base = base_of(&headers);
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(50)
        .clamp(1, 100);
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let Inner {
        behaviour, vpc_vms, ..
    } = &mut *s;
    reap(vpc_vms, behaviour.delete_delay);
    let all: Vec<&Vm> = vpc_vms
        .values()
        .filter(|v| q.get("name").is_none_or(|n| *n == v.name))
        .collect();
    let start = q
        .get("start")
        .and_then(|st| all.iter().position(|v| v.id == *st))
        .unwrap_or(0);
    let page: Vec<Value> = all
        .iter()
        .skip(start)
        .take(limit)
        .map(|v| instance_json(&base, v, behaviour))
        .collect();
    let mut out = json!({
        "instances": page,
        "first": {"href": format!("{base}/v1/instances?limit={limit}")},
        "limit": limit,
        "total_count": all.len(),
    });
    if let Some(next) = all.get(start + limit) {
        out["next"] =
            json!({"href": format!("{base}/v1/instances?limit={limit}&start={}", next.id)});
    }
    axum::Json(out).into_response()
}

async fn get_instance(
    State(state): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let base = base_of(&headers);
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let Inner {
        behaviour, vpc_vms, ..
    } = &mut *s;
    reap(vpc_vms, behaviour.delete_delay);
    match vpc_vms.get(&id) {
        Some(v) => axum::Json(instance_json(&base, v, behaviour)).into_response(),
        None => ibm_error(StatusCode::NOT_FOUND, "not_found", "Instance not found"),
    }
}

async fn delete_instance(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let Inner {
        behaviour, vpc_vms, ..
    } = &mut *s;
    reap(vpc_vms, behaviour.delete_delay);
    match vpc_vms.get_mut(&id) {
        Some(v) => {
            v.deleted.get_or_insert_with(Instant::now);
            StatusCode::NO_CONTENT.into_response()
        }
        None => ibm_error(StatusCode::NOT_FOUND, "not_found", "Instance not found"),
    }
}

fn power_crn(id: &str) -> String {
    format!(
        "crn:v1:bluemix:public:power-iaas:wdc06:a/0123456789abcdef0123456789abcdef:{POWER_CLOUD_ID}:pvm-instance:{id}"
    )
}

fn pvm_json(vm: &Vm, b: &Behaviour, tags: &BTreeMap<String, Vec<String>>) -> Value {
    let (status, health) = if vm.deleted.is_some() {
        ("DELETING", "WARNING")
    } else if vm.failed {
        ("ERROR", "CRITICAL")
    } else if vm.created.elapsed() < b.boot_delay {
        ("BUILD", "PENDING")
    } else {
        ("ACTIVE", "OK")
    };
    let r = &vm.request;
    json!({
        "pvmInstanceID": vm.id,
        "serverName": vm.name,
        "crn": power_crn(&vm.id),
        "userTags": tags.get(&power_crn(&vm.id)).cloned().unwrap_or_default(),
        "osType": "rhel",
        "storageType": "tier3",
        "networkIDs": [POWER_NETWORK_ID],
        "status": status,
        "health": {"status": health, "lastUpdate": now_rfc3339()},
        "imageID": POWER_IMAGE_ID,
        "processors": r["processors"].as_f64().unwrap_or(0.25),
        "procType": r["procType"].as_str().unwrap_or("shared"),
        "memory": r["memory"].as_f64().unwrap_or(2.0),
        "sysType": r["sysType"].as_str().unwrap_or("e980"),
        "diskSize": vm.disk_gb,
        "creationDate": vm.created_at,
        "volumeIDs": [vm.boot_volume],
        "networks": [{"networkID": POWER_NETWORK_ID, "ipAddress": vm.address, "ip": vm.address, "type": "fixed", "networkName": "emulated-net"}],
        "addresses": [{"networkID": POWER_NETWORK_ID, "ipAddress": vm.address, "ip": vm.address, "type": "fixed", "networkName": "emulated-net"}],
    })
}

async fn create_pvm(
    State(state): State<Shared>,
    Path(cloud): Path<String>,
    body: Bytes,
) -> Response {
    if cloud != POWER_CLOUD_ID {
        return ibm_error(
            StatusCode::NOT_FOUND,
            "not_found",
            "cloud instance not found",
        );
    }
    let Ok(r) = serde_json::from_slice::<Value>(&body) else {
        return bad_request("body is not JSON");
    };
    for field in ["serverName", "imageID", "processors", "memory", "procType"] {
        if r.get(field).is_none() {
            return bad_request(&format!("missing field {field}"));
        }
    }
    let image = r["imageID"].as_str().unwrap_or_default();
    if image != POWER_IMAGE_ID && image != POWER_IMAGE_NAME {
        return bad_request("image not found");
    }
    let name = r["serverName"].as_str().unwrap_or_default().to_owned();
    if name.len() > 47 {
        return bad_request("serverName longer than 47 characters");
    }
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    if s.power_vms.values().any(|v| v.name == name) {
        return bad_request("serverName already in use");
    }
    let tags: Vec<String> = r["userTags"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_ascii_lowercase)
        .collect();
    let vm = new_vm(&mut s, name, r, 20.0);
    s.tags.insert(power_crn(&vm.id), tags);
    let answer = json!([pvm_json(&vm, &s.behaviour, &s.tags)]);
    s.power_vms.insert(vm.id.clone(), vm);
    (StatusCode::CREATED, axum::Json(answer)).into_response()
}

async fn list_pvms(State(state): State<Shared>) -> Response {
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let Inner {
        behaviour,
        power_vms,
        tags,
        ..
    } = &mut *s;
    reap(power_vms, behaviour.delete_delay);
    let all: Vec<Value> = power_vms
        .values()
        .map(|v| pvm_json(v, behaviour, tags))
        .collect();
    axum::Json(json!({"pvmInstances": all})).into_response()
}

async fn get_pvm(State(state): State<Shared>, Path((_c, id)): Path<(String, String)>) -> Response {
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let Inner {
        behaviour,
        power_vms,
        tags,
        ..
    } = &mut *s;
    reap(power_vms, behaviour.delete_delay);
    match power_vms.get(&id) {
        Some(v) => axum::Json(pvm_json(v, behaviour, tags)).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"description": "pvm-instance not found", "error": "not found"})),
        )
            .into_response(),
    }
}

async fn delete_pvm(
    State(state): State<Shared>,
    Path((_c, id)): Path<(String, String)>,
    uri: Uri,
) -> Response {
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let Inner {
        behaviour,
        power_vms,
        ..
    } = &mut *s;
    reap(power_vms, behaviour.delete_delay);
    let deletes_volumes = uri
        .query()
        .is_some_and(|q| q.contains("delete_data_volumes=true"));
    match power_vms.get_mut(&id) {
        Some(v) if deletes_volumes => {
            v.deleted.get_or_insert_with(Instant::now);
            (StatusCode::OK, axum::Json(json!({}))).into_response()
        }
        // Leaving volumes behind leaks storage; the emulator refuses so tests notice.
        Some(_) => bad_request(
            "emulator: delete without delete_data_volumes=true would leak the boot volume",
        ),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"description": "pvm-instance not found", "error": "not found"})),
        )
            .into_response(),
    }
}

async fn resize_volume(
    State(state): State<Shared>,
    Path((_c, id)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let Ok(r) = serde_json::from_slice::<Value>(&body) else {
        return bad_request("body is not JSON");
    };
    let Some(size) = r["size"].as_f64() else {
        return bad_request("missing size");
    };
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    let Some(vm) = s.power_vms.values_mut().find(|v| v.boot_volume == id) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"description": "volume not found", "error": "not found"})),
        )
            .into_response();
    };
    if vm.conflicts_left > 0 {
        vm.conflicts_left -= 1;
        return (
            StatusCode::CONFLICT,
            axum::Json(json!({"description": "volume is busy", "error": "conflict"})),
        )
            .into_response();
    }
    vm.disk_gb = size;
    axum::Json(json!({"volumeID": id, "name": format!("{}-boot", vm.name), "size": size, "state": "in-use", "bootable": true})).into_response()
}

async fn power_images(Path(cloud): Path<String>) -> Response {
    if cloud != POWER_CLOUD_ID {
        return ibm_error(
            StatusCode::NOT_FOUND,
            "not_found",
            "cloud instance not found",
        );
    }
    axum::Json(json!({"images": [{
        "imageID": POWER_IMAGE_ID, "name": POWER_IMAGE_NAME, "state": "active",
        "href": format!("/pcloud/v1/cloud-instances/{POWER_CLOUD_ID}/images/{POWER_IMAGE_ID}"),
        "storageType": "tier3", "storagePool": "Tier3-Flash-1",
        "specifications": {"operatingSystem": "rhel", "architecture": "ppc64"},
    }]}))
    .into_response()
}

/// `GET /v3/tags?attached_to=<crn>&tag_type=user` (`TagList`).
async fn list_tags(
    State(state): State<Shared>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    if q.get("tag_type").is_some_and(|t| t != "user") {
        return axum::Json(json!({"total_count": 0, "offset": 0, "limit": 100, "items": []}))
            .into_response();
    }
    let s = state.lock().unwrap_or_else(|e| e.into_inner());
    let names: Vec<String> = match q.get("attached_to") {
        Some(crn) => s.tags.get(crn).cloned().unwrap_or_default(),
        None => {
            let mut all: Vec<String> = s.tags.values().flatten().cloned().collect();
            all.sort();
            all.dedup();
            all
        }
    };
    let offset: usize = q.get("offset").and_then(|o| o.parse().ok()).unwrap_or(0);
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(100)
        .clamp(1, 1000);
    let items: Vec<Value> = names
        .iter()
        .skip(offset)
        .take(limit)
        .map(|n| json!({"name": n}))
        .collect();
    axum::Json(
        json!({"total_count": names.len(), "offset": offset, "limit": limit, "items": items}),
    )
    .into_response()
}

/// The resources and tag names of an attach or detach, or why the request is bad.
fn tag_request(body: &[u8]) -> Result<(Vec<String>, Vec<String>), String> {
    let r: Value = serde_json::from_slice(body).map_err(|_| "body is not JSON".to_owned())?;
    let resources: Vec<String> = r["resources"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x["resource_id"].as_str().map(str::to_owned))
        .collect();
    let names: Vec<String> = r["tag_names"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_ascii_lowercase)
        .collect();
    if resources.is_empty() || names.is_empty() {
        return Err("resources and tag_names are required".into());
    }
    if let Some(bad) = names.iter().find(|n| {
        n.len() > 128
            || !n
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b' ' | b'_' | b'-' | b'.' | b':'))
    }) {
        return Err(format!("invalid tag name {bad:?}"));
    }
    Ok((resources, names))
}

fn tag_results(resources: &[String]) -> Response {
    let results: Vec<Value> = resources
        .iter()
        .map(|r| json!({"resource_id": r, "is_error": false}))
        .collect();
    axum::Json(json!({"results": results})).into_response()
}

/// `POST /v3/tags/attach` (`TagResults`).
async fn attach_tags(State(state): State<Shared>, body: Bytes) -> Response {
    let (resources, names) = match tag_request(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&e),
    };
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    for r in &resources {
        let t = s.tags.entry(r.clone()).or_default();
        for n in &names {
            if !t.contains(n) {
                t.push(n.clone());
            }
        }
    }
    tag_results(&resources)
}

/// `POST /v3/tags/detach` (`TagResults`).
async fn detach_tags(State(state): State<Shared>, body: Bytes) -> Response {
    let (resources, names) = match tag_request(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(&e),
    };
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    for r in &resources {
        if let Some(t) = s.tags.get_mut(r) {
            t.retain(|x| !names.contains(x));
        }
    }
    tag_results(&resources)
}
