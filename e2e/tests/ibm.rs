//! The IBM Cloud emulator, checked against IBM's own Python SDKs (`ibm-vpc`,
//! `ibm-cloud-sdk-core`, installed by `e2e/setup.sh`), and its Power VS and fault behaviour.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use e2e::ibm_emulator::{self, Behaviour, Fault, FaultKind, IbmEmulator};
use serde_json::{Value, json};

fn venv_python() -> PathBuf {
    let home = std::env::var_os("MPC_E2E_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/mpc-e2e")
        });
    home.join("venv/bin/python")
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn emulator(b: Behaviour) -> IbmEmulator {
    IbmEmulator::start(loopback(), b).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn ibm_vpc_sdk_drives_the_emulator() {
    let emu = emulator(Behaviour {
        boot_delay: Duration::from_millis(300),
        delete_delay: Duration::from_millis(300),
        ..Behaviour::default()
    })
    .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/src/ibm_emulator_sdk.py");
    let python = venv_python();
    assert!(
        python.exists(),
        "{} is missing: run e2e/setup.sh (it installs ibm-vpc and ibm-platform-services into the venv)",
        python.display()
    );
    let (vpc, iam) = (emu.vpc_url(), emu.iam_url());
    let out = tokio::process::Command::new(&python)
        .args([script, &vpc, &iam, ibm_emulator::API_KEY])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "SDK script failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let facts: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(facts["vpc"], ibm_emulator::VPC_NAME);
    assert_eq!(facts["subnet"], ibm_emulator::SUBNET_NAME);
    assert_eq!(facts["key"], ibm_emulator::KEY_NAME);
    assert_eq!(facts["created"], 5);
    assert_eq!(facts["first_status"], "pending");
    assert_eq!(facts["pages"], 3, "5 instances, 2 a page: {facts}");
    assert_eq!(facts["listed"], true);
    assert_eq!(facts["pager"], 5);
    assert_eq!(facts["booted_status"], "running");
    assert!(facts["address"].as_str().unwrap().starts_with("10.240."));
    assert_eq!(facts["deleting_status"], "deleting");
    assert_eq!(facts["gone"], true);
    assert_eq!(facts["left"], 0);
    assert_eq!(facts["attach_errors"], json!([false]));
    assert_eq!(
        facts["tags"],
        json!(["multi-platform-cluster:sdk", "taskrunid:tenant:build-1"]),
        "stored lower-case, as IBM compares tags"
    );
    assert_eq!(
        facts["tags_after_detach"],
        json!(["multi-platform-cluster:sdk"])
    );
    assert_eq!(emu.live_instances(), 0);
    // One token for the whole run: the SDK caches it, as the provider must.
    assert_eq!(emu.token_requests(), 1);
    let reqs = emu.requests();
    assert!(
        reqs.iter()
            .any(|(_, p)| p.starts_with("/v1/instances?") && p.contains("version=")),
        "the SDK sends its API version: {reqs:?}"
    );
}

struct Client {
    http: reqwest_like::Http,
}

mod reqwest_like {
    //! A tiny HTTP/1 client over hyper for the Power VS checks (no IBM SDK exists for it in
    //! Python; the field names follow IBM's power-go-client models).
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    pub struct Http(Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>);

    impl Http {
        pub fn new() -> Self {
            Self(Client::builder(TokioExecutor::new()).build_http())
        }
        pub async fn call(
            &self,
            method: &str,
            url: &str,
            headers: &[(&str, &str)],
            body: Option<String>,
        ) -> (u16, serde_json::Value) {
            let mut b = http::Request::builder().method(method).uri(url);
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            let req = b
                .body(Full::new(Bytes::from(body.unwrap_or_default())))
                .unwrap();
            let resp = self.0.request(req).await.unwrap();
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (
                status,
                serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
            )
        }
    }
}

impl Client {
    async fn token(&self, emu: &IbmEmulator) -> String {
        let body = format!(
            "grant_type=urn%3Aibm%3Aparams%3Aoauth%3Agrant-type%3Aapikey&apikey={}",
            ibm_emulator::API_KEY
        );
        let (s, v) = self
            .http
            .call(
                "POST",
                &format!("{}/identity/token", emu.iam_url()),
                &[("content-type", "application/x-www-form-urlencoded")],
                Some(body),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        v["access_token"].as_str().unwrap().to_owned()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn power_vs_create_resize_with_conflicts_delete_and_token_expiry() {
    let emu = emulator(Behaviour {
        resize_conflicts: 2,
        boot_delay: Duration::from_millis(100),
        delete_delay: Duration::from_millis(100),
        ..Behaviour::default()
    })
    .await;
    let c = Client {
        http: reqwest_like::Http::new(),
    };
    let token = c.token(&emu).await;
    let auth = format!("Bearer {token}");
    let base = format!(
        "{}/pcloud/v1/cloud-instances/{}",
        emu.power_url(),
        ibm_emulator::POWER_CLOUD_ID
    );
    let h = [
        ("authorization", auth.as_str()),
        ("crn", ibm_emulator::POWER_CRN),
        ("content-type", "application/json"),
    ];
    // Without the CRN header: refused.
    let (s, _) = c
        .http
        .call("GET", &format!("{base}/pvm-instances"), &h[..1], None)
        .await;
    assert_eq!(s, 403);
    let create = json!({
        "serverName": "stage-ppc64le-0123456789abcdefx",
        "imageID": ibm_emulator::POWER_IMAGE_NAME,
        "processors": 0.25, "memory": 2.0, "procType": "shared", "sysType": "e980",
        "keyPairName": "konflux-infra",
        "networks": [{"networkID": ibm_emulator::POWER_NETWORK_ID}],
    });
    let (s, v) = c
        .http
        .call(
            "POST",
            &format!("{base}/pvm-instances"),
            &h,
            Some(create.to_string()),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let vm = &v.as_array().expect("POST answers an array")[0];
    let id = vm["pvmInstanceID"].as_str().unwrap().to_owned();
    let vol = vm["volumeIDs"][0].as_str().unwrap().to_owned();
    assert_eq!(vm["status"], "BUILD");
    // The boot volume resize answers conflicts before it succeeds.
    let mut conflicts = 0;
    loop {
        let (s, v) = c
            .http
            .call(
                "PUT",
                &format!("{base}/volumes/{vol}"),
                &h,
                Some(json!({"size": 100.0}).to_string()),
            )
            .await;
        if s == 409 {
            conflicts += 1;
            continue;
        }
        assert_eq!(s, 200, "{v}");
        break;
    }
    assert_eq!(conflicts, 2);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (s, v) = c
        .http
        .call("GET", &format!("{base}/pvm-instances/{id}"), &h, None)
        .await;
    assert_eq!(s, 200);
    assert_eq!(v["status"], "ACTIVE");
    assert_eq!(v["health"]["status"], "OK");
    assert_eq!(v["diskSize"], 100.0);
    // An expired token is refused with 401.
    emu.expire_tokens();
    let (s, v) = c
        .http
        .call("GET", &format!("{base}/pvm-instances/{id}"), &h, None)
        .await;
    assert_eq!(s, 401, "{v}");
    let token = c.token(&emu).await;
    let auth = format!("Bearer {token}");
    let h = [
        ("authorization", auth.as_str()),
        ("crn", ibm_emulator::POWER_CRN),
    ];
    // Deleting without the data volumes is refused (it would leak them).
    let (s, _) = c
        .http
        .call("DELETE", &format!("{base}/pvm-instances/{id}"), &h, None)
        .await;
    assert_eq!(s, 400);
    // A 5xx fault, then the real delete.
    emu.inject(Fault {
        method: http::Method::DELETE,
        path: "/pvm-instances/".into(),
        times: 1,
        kind: FaultKind::Status(503),
    });
    let url = format!("{base}/pvm-instances/{id}?delete_data_volumes=true");
    let (s, _) = c.http.call("DELETE", &url, &h, None).await;
    assert_eq!(s, 503);
    let (s, _) = c.http.call("DELETE", &url, &h, None).await;
    assert_eq!(s, 200);
    let (_, v) = c
        .http
        .call("GET", &format!("{base}/pvm-instances/{id}"), &h, None)
        .await;
    assert_eq!(v["status"], "DELETING");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(emu.live_instances(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn standalone_emulator_prints_its_urls_and_key_and_serves_them() {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_e2e"))
        .args(["ibm-emulator", "--listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut got = Vec::new();
    for _ in 0..4 {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the emulator prints within 30 s")
            .unwrap()
            .expect("four lines");
        got.push(line);
    }
    let [vpc, power, iam, key] = &got[..] else {
        unreachable!()
    };
    assert!(
        vpc.starts_with("http://127.0.0.1:") && vpc.ends_with("/v1"),
        "{got:?}"
    );
    assert!(power.starts_with("http://127.0.0.1:"), "{got:?}");
    assert_eq!(key, ibm_emulator::API_KEY);
    let c = reqwest_like::Http::new();
    let body = format!("grant_type=urn%3Aibm%3Aparams%3Aoauth%3Agrant-type%3Aapikey&apikey={key}");
    let (s, v) = c
        .call(
            "POST",
            &format!("{iam}/identity/token"),
            &[("content-type", "application/x-www-form-urlencoded")],
            Some(body),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let auth = format!("Bearer {}", v["access_token"].as_str().unwrap());
    let (s, v) = c
        .call(
            "GET",
            &format!("{vpc}/vpcs?version=2024-01-01&generation=2"),
            &[("authorization", auth.as_str())],
            None,
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["vpcs"][0]["name"], ibm_emulator::VPC_NAME);
    child.kill().await.unwrap();
}

/// The provider's IAM token source against the emulator: one fetch for many concurrent callers,
/// and after every token expired (a 401 mid-flight) exactly one refetch.
#[tokio::test(flavor = "multi_thread")]
async fn iam_token_is_fetched_once_and_refreshed_once_after_a_401() {
    mpc::tls::install_crypto_provider();
    let emu = emulator(Behaviour::default()).await;
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let iam = std::sync::Arc::new(
        mpc::cloud::ibm::iam::Iam::new(
            &emu.iam_url(),
            ibm_emulator::API_KEY.to_owned(),
            tls.clone(),
        )
        .unwrap(),
    );
    let tokens = futures::future::join_all((0..16).map(|_| {
        let iam = iam.clone();
        async move { iam.token().await.unwrap().to_string() }
    }))
    .await;
    assert!(tokens.iter().all(|t| *t == tokens[0]));
    assert_eq!(emu.token_requests(), 1);

    let c = reqwest_like::Http::new();
    let vpcs = format!("{}/vpcs?version=2024-01-01&generation=2", emu.vpc_url());
    let auth = format!("Bearer {}", tokens[0]);
    let (s, _) = c
        .call("GET", &vpcs, &[("authorization", auth.as_str())], None)
        .await;
    assert_eq!(s, 200);
    emu.expire_tokens();
    let (s, _) = c
        .call("GET", &vpcs, &[("authorization", auth.as_str())], None)
        .await;
    assert_eq!(s, 401);
    // Several callers saw the 401 with the same token: one refetch between them.
    for _ in 0..3 {
        iam.invalidate(&tokens[0]).await;
    }
    let fresh = iam.token().await.unwrap().to_string();
    iam.invalidate(&tokens[0]).await;
    assert_eq!(iam.token().await.unwrap().as_str(), fresh);
    assert_ne!(fresh, tokens[0]);
    assert_eq!(emu.token_requests(), 2);
    let auth = format!("Bearer {fresh}");
    let (s, _) = c
        .call("GET", &vpcs, &[("authorization", auth.as_str())], None)
        .await;
    assert_eq!(s, 200);

    // A wrong key is an error naming IAM's refusal, not a panic or a retry loop.
    let bad = mpc::cloud::ibm::iam::Iam::new(&emu.iam_url(), "wrong".to_owned(), tls).unwrap();
    let e = bad.token().await.unwrap_err();
    assert!(e.to_string().contains("BXNIM0415E"), "{e}");
}

/// Prefix-sharing tags never count each other, every page is read, and a 401 mid-listing is
/// survived with one refetch.
#[tokio::test(flavor = "multi_thread")]
async fn vpc_listing_counts_exact_names_across_pages_and_survives_token_expiry() {
    mpc::tls::install_crypto_provider();
    let emu = emulator(Behaviour::default()).await;
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let iam = std::sync::Arc::new(
        mpc::cloud::ibm::iam::Iam::new(
            &emu.iam_url(),
            ibm_emulator::API_KEY.to_owned(),
            tls.clone(),
        )
        .unwrap(),
    );
    let c = reqwest_like::Http::new();
    let token = iam.token().await.unwrap().to_string();
    let auth = format!("Bearer {token}");
    let create = |name: String| {
        json!({
            "name": name, "zone": {"name": ibm_emulator::ZONE}, "vpc": {"id": "r014-vpc-1"},
            "image": {"id": ibm_emulator::IMAGE_ID}, "profile": {"name": "bz2-1x4"},
            "primary_network_attachment": {"virtual_network_interface": {"subnet": {"id": "subnet-1"}}},
        })
        .to_string()
    };
    let url = format!(
        "{}/instances?version=2024-11-12&generation=2",
        emu.vpc_url()
    );
    for i in 0..57u64 {
        let tag = if i % 3 == 0 {
            "prod-s390x-large"
        } else {
            "prod-s390x"
        };
        let name = mpc::config::ibm::instance_name(tag, i).unwrap();
        let (s, v) = c
            .call(
                "POST",
                &url,
                &[
                    ("authorization", auth.as_str()),
                    ("content-type", "application/json"),
                ],
                Some(create(name)),
            )
            .await;
        assert_eq!(s, 201, "{v}");
    }
    // An instance whose name merely starts with the tag is not ours.
    let (s, _) = c
        .call(
            "POST",
            &url,
            &[
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ],
            Some(create("prod-s390x-manual-test".into())),
        )
        .await;
    assert_eq!(s, 201);
    let vpc = mpc::cloud::ibm::vpc::VpcClient::new(&emu.vpc_url(), iam.clone(), tls).unwrap();
    emu.expire_tokens();
    let small = vpc.instances_of("prod-s390x").await.unwrap();
    let large = vpc.instances_of("prod-s390x-large").await.unwrap();
    assert_eq!(small.len(), 38);
    assert_eq!(large.len(), 19);
    assert!(small.iter().all(|i| i.holds_capacity()));
    assert_eq!(
        emu.token_requests(),
        2,
        "one fetch, one refetch after the 401"
    );
    let pages = emu
        .requests()
        .iter()
        .filter(|(m, p)| {
            m == http::Method::GET && p.starts_with("/v1/instances?") && p.contains("start=")
        })
        .count();
    assert!(pages >= 2, "the second page was read for each tag");
}

// ---- The provider (`mpc::cloud::ibm::IbmCloud`) against the emulator. ----

mod provider {
    use super::*;
    use mpc::cloud::ibm::{IbmCloud, IbmOptions};
    use mpc::cloud::metrics::CloudMetrics;
    use mpc::cloud::retry::RetryPolicy;
    use mpc::cloud::{
        Cloud, ClusterId, Credentials, ErrorClass, IbmApiKey, LaunchOutcome, LaunchRequest, Scope,
        Terminated,
    };
    use mpc::config::{self, ConfigData, DynamicPlatform};
    use mpc::platform::Platform;
    use mpc::scheduler::{InstanceState, LaunchId, LaunchOwner, Ownership, TaskRunRef, Uid};

    pub const CLUSTER: &str = "e2e-ibm";

    pub fn cloud(emu: &IbmEmulator, cluster: &str) -> IbmCloud {
        mpc::tls::install_crypto_provider();
        let mut o = IbmOptions::new(ClusterId::new(cluster).unwrap());
        o.iam_url = emu.iam_url();
        o.tagging_url = emu.tagging_url();
        o.retry = RetryPolicy {
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(100),
            backoff_attempts: 4,
            bounded_attempts: 3,
        };
        o.delete_check_delay = Duration::from_millis(50);
        IbmCloud::new(o, CloudMetrics::unregistered().unwrap())
    }

    pub fn creds() -> Credentials {
        Credentials::Ibm(IbmApiKey::new(ibm_emulator::API_KEY))
    }

    /// Parsed templates of `pairs` by platform.
    pub fn templates(
        pairs: Vec<(String, String)>,
        platforms: &str,
    ) -> std::collections::BTreeMap<Platform, std::sync::Arc<DynamicPlatform>> {
        let mut d = ConfigData::new();
        for (k, v) in pairs {
            d.insert(k, v);
        }
        d.insert("dynamic-platforms".into(), platforms.into());
        let parsed = config::parse(&d);
        assert!(!parsed.has_errors(), "{:#?}", parsed.diagnostics);
        parsed
            .config
            .dynamic
            .into_iter()
            .map(|(k, v)| (k, std::sync::Arc::new(v)))
            .collect()
    }

    pub fn taskrun(name: &str) -> LaunchId {
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

    async fn launch(
        c: &IbmCloud,
        p: &DynamicPlatform,
        creds: &Credentials,
        l: &LaunchId,
    ) -> LaunchOutcome {
        let req = LaunchRequest {
            scope: Scope {
                platform: p,
                credentials: creds,
            },
            launch: l,
            additional_tags: &[("team".into(), "build".into())],
        };
        c.launch(&req).await.expect("launch")
    }

    fn p(s: &str) -> Platform {
        Platform::parse(s).unwrap()
    }

    /// Launch (the request Go sends, ownership tags on the instance), idempotency per launch id,
    /// exact-name counting of prefix-sharing tags across pages, foreign and Go instances,
    /// retag, failed instances, terminate until `deleting`, and a 5xx and a token expiry on the
    /// way.
    #[tokio::test(flavor = "multi_thread")]
    async fn ibmz_launch_list_retag_terminate_with_go_rules_fixed() {
        let emu = emulator(Behaviour {
            delete_delay: Duration::from_secs(3),
            ..Behaviour::default()
        })
        .await;
        let mut pairs = emu.ibmz_config("linux-s390x", "e2e-s390x", 3, "cloud-user");
        pairs.extend(emu.ibmz_config("linux-large-s390x", "e2e-s390x-large", 3, "cloud-user"));
        let t = templates(pairs, "linux/s390x,linux-large/s390x");
        let small = &t[&p("linux/s390x")];
        let large = &t[&p("linux-large/s390x")];
        let c = cloud(&emu, CLUSTER);
        let creds = creds();
        let scope = |p| Scope {
            platform: p,
            credentials: &creds,
        };

        // A 5xx on the create is retried without a second instance.
        emu.inject(Fault {
            method: http::Method::POST,
            path: "/v1/instances".into(),
            times: 1,
            kind: FaultKind::Status(503),
        });
        let a = launch(&c, small, &creds, &taskrun("a")).await;
        let LaunchOutcome::Launched(a) = a else {
            panic!("{a:?}")
        };
        let again = launch(&c, small, &creds, &taskrun("a")).await;
        assert!(
            matches!(&again, LaunchOutcome::Adopted(i) if i.id == a.id),
            "{again:?}"
        );
        let reqs = emu.vpc_create_requests();
        assert_eq!(reqs.len(), 1, "{reqs:?}");
        let (name, r) = reqs.iter().next().unwrap();
        assert!(
            mpc::config::ibm::is_instance_name_of("e2e-s390x", name),
            "{name}"
        );
        assert_eq!(r["zone"]["name"], ibm_emulator::ZONE);
        assert_eq!(r["resource_group"]["id"], "rg-emulated");
        assert_eq!(r["vpc"]["id"], "r014-vpc-1");
        assert_eq!(r["keys"][0]["id"], "key-1");
        assert_eq!(r["availability_policy"]["host_failure"], "stop");
        let bv = &r["boot_volume_attachment"];
        assert_eq!(bv["delete_volume_on_instance_delete"], true);
        assert_eq!(bv["volume"]["profile"]["name"], "general-purpose");
        assert_eq!(bv["volume"]["capacity"], 100);
        let vni = &r["primary_network_attachment"]["virtual_network_interface"];
        assert_eq!(vni["auto_delete"], true);
        assert_eq!(vni["subnet"]["id"], "subnet-1");
        assert_eq!(vni["security_groups"][0]["id"], "sg-1");
        // Ownership tags on the instance itself (IBM keeps them lower-case).
        let crn = format!(
            "crn:v1:bluemix:public:is:{}:a/0123456789abcdef::instance:{}",
            ibm_emulator::ZONE,
            a.id
        );
        let tags = emu.tags_of(&crn);
        for want in [
            "multi-platform-cluster:e2e-ibm",
            "taskrunid:tenant:a",
            "multi-platform-owner:uid-a-5f0e",
            "multi-platform-instance:e2e-s390x",
            "team:build",
        ] {
            assert!(tags.iter().any(|t| t == want), "{want} in {tags:?}");
        }
        assert_eq!(a.ownership, Ownership::Ours);

        let b = launch(&c, large, &creds, &taskrun("b")).await;
        // Another cluster's and the Go controller's instances with exact names of the small tag,
        // and a manual one merely starting with it.
        let foreign = emu.seed_vpc_instance(
            &mpc::config::ibm::instance_name("e2e-s390x", 7).unwrap(),
            &["multi-platform-cluster:other"],
        );
        let go = emu.seed_vpc_instance(
            &mpc::config::ibm::instance_name("e2e-s390x", 8).unwrap(),
            &[],
        );
        emu.seed_vpc_instance("e2e-s390x-manual", &[]);
        // Enough instances for several pages.
        for i in 0..60u64 {
            emu.seed_vpc_instance(&format!("unrelated-{i}"), &[]);
        }
        emu.expire_tokens();
        let listed = c.list(scope(small)).await.unwrap();
        let mut owners: Vec<(String, Ownership)> =
            listed.iter().map(|i| (i.id.clone(), i.ownership)).collect();
        owners.sort_by(|x, y| x.0.cmp(&y.0));
        let mut want = vec![
            (a.id.clone(), Ownership::Ours),
            (foreign.clone(), Ownership::Foreign),
            (go.clone(), Ownership::Untagged),
        ];
        want.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(owners, want, "the large tag's instance is never counted");
        let listed_large = c.list(scope(large)).await.unwrap();
        assert_eq!(listed_large.len(), 1);
        assert_eq!(listed_large[0].id, b.instance().id);
        let ours = listed.iter().find(|i| i.id == a.id).unwrap();
        assert_eq!(ours.owner_key(), Some("uid-a-5f0e"));
        assert_eq!(ours.taskrun_id(), Some("tenant:a"));

        // Batched lookups by id.
        let ids = vec![a.id.clone(), foreign.clone(), "unknown".to_owned()];
        let d = c.describe(scope(small), &ids).await.unwrap();
        assert_eq!(d.len(), 2);
        let ready = d.iter().find(|i| i.id == a.id).unwrap();
        assert!(ready.private_ip.as_deref().unwrap().starts_with("10.240."));
        assert_eq!(ready.public_ip, None, "private addresses only");

        // Only ours, or (legacy) the Go controller's, may be terminated.
        let e = c.terminate(scope(small), &foreign, true).await.unwrap_err();
        assert_eq!(e.class, ErrorClass::Refused, "{e}");
        let e = c.terminate(scope(small), &go, false).await.unwrap_err();
        assert_eq!(e.class, ErrorClass::Refused, "{e}");
        assert_eq!(
            c.terminate(scope(small), &go, true).await.unwrap(),
            Terminated::Requested
        );

        // Retag moves the owner tags; another cluster's instance is refused.
        c.retag(scope(small), &a.id, &taskrun("c")).await.unwrap();
        let tags = emu.tags_of(&crn);
        assert!(tags.iter().any(|t| t == "taskrunid:tenant:c"), "{tags:?}");
        assert!(!tags.iter().any(|t| t == "taskrunid:tenant:a"), "{tags:?}");
        let e = c
            .retag(scope(small), &foreign, &taskrun("d"))
            .await
            .unwrap_err();
        assert_eq!(e.class, ErrorClass::Refused);

        // A failed instance is gone (never capacity) but still listed, for cleanup.
        emu.fail_vpc_instance(&b.instance().id);
        let l = c.list(scope(large)).await.unwrap();
        assert_eq!(l[0].state, InstanceState::Stopped);
        assert!(!l[0].state.counts_toward_limit());

        // Terminate: confirmed `deleting`, then gone; again is a no-op.
        emu.inject(Fault {
            method: http::Method::DELETE,
            path: "/v1/instances/".into(),
            times: 1,
            kind: FaultKind::Status(500),
        });
        assert_eq!(
            c.terminate(scope(small), &a.id, false).await.unwrap(),
            Terminated::Requested
        );
        assert_eq!(
            c.terminate(scope(small), &a.id, false).await.unwrap(),
            Terminated::AlreadyGone
        );
        c.terminate(scope(large), &b.instance().id, false)
            .await
            .unwrap();
        // A spent launch id is never adopted.
        let spent = launch(&c, small, &creds, &taskrun("a")).await;
        assert!(
            matches!(&spent, LaunchOutcome::Spent(_))
                || matches!(&spent, LaunchOutcome::Launched(_)),
            "{spent:?}"
        );
        if let LaunchOutcome::Launched(i) = &spent {
            panic!("a second instance for the same launch id: {i:?}");
        }
        assert_eq!(
            emu.token_requests(),
            2,
            "one token, one refetch after expiry"
        );
    }

    /// Power VS: the create answer is an array, the request carries Go's fields, the boot volume
    /// is resized through conflicts at readiness, ERROR with CRITICAL health is failed, and the
    /// delete removes the data volumes.
    #[tokio::test(flavor = "multi_thread")]
    async fn ibmp_launch_resize_through_conflicts_failed_state_and_delete() {
        let emu = emulator(Behaviour {
            resize_conflicts: 2,
            boot_delay: Duration::from_millis(100),
            ..Behaviour::default()
        })
        .await;
        let t = templates(
            emu.ibmp_config("linux-ppc64le", "e2e-ppc64le", 2, "root"),
            "linux/ppc64le",
        );
        let pw = &t[&p("linux/ppc64le")];
        let c = cloud(&emu, CLUSTER);
        let creds = creds();
        let scope = Scope {
            platform: pw,
            credentials: &creds,
        };
        let LaunchOutcome::Launched(i) = launch(&c, pw, &creds, &taskrun("p")).await else {
            panic!()
        };
        let reqs = emu.power_create_requests();
        let r = reqs.values().next().unwrap();
        assert_eq!(
            r["imageID"],
            ibm_emulator::POWER_IMAGE_ID,
            "the name is resolved"
        );
        assert_eq!(r["processors"], 0.5);
        assert_eq!(r["memory"], 4.0);
        assert_eq!(r["procType"], "shared");
        assert_eq!(r["sysType"], "e980");
        assert_eq!(
            r["networks"][0]["networkID"],
            ibm_emulator::POWER_NETWORK_ID
        );
        assert!(
            r["userTags"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t == "taskRunID:tenant:p"),
            "{r}"
        );
        // Ready (an address) only once the boot volume has the configured size.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut probes = 0;
        loop {
            probes += 1;
            let d = c
                .describe(scope, std::slice::from_ref(&i.id))
                .await
                .unwrap();
            if d[0].state == InstanceState::Running && d[0].private_ip.is_some() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "never resized");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(probes >= 2, "booting, then resized");
        let puts = emu
            .requests()
            .iter()
            .filter(|(m, p)| m == http::Method::PUT && p.contains("/volumes/"))
            .count();
        assert_eq!(puts, 3, "two conflicts, then the resize");
        // ERROR + CRITICAL: failed (gone, cleaned up).
        emu.fail_power_instance(&i.id);
        let l = c.list(scope).await.unwrap();
        assert_eq!(l[0].state, InstanceState::Stopped);
        assert_eq!(
            c.terminate(scope, &i.id, false).await.unwrap(),
            Terminated::Requested
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(emu.live_instances(), 0);
    }
}

// ---- A TaskRun through the real binaries (webhook, controller, OTP server) on the emulator,
// provisioned over loopback sshd hosts standing for the instances. ----

mod product {
    use super::*;
    use e2e::product::{ConfigPairs, NS, Product};
    use e2e::sshd::{AdminKey, HostSetup, SshdHost};
    use mpc::contract;
    use std::net::Ipv4Addr;

    const T: Duration = Duration::from_secs(120);

    /// The product on the emulator: `platform`'s host-config (`pairs`), its API key and SSH
    /// Secrets, one sshd host per address (admin `user`, root refused unless it is root).
    async fn start(
        emu: &IbmEmulator,
        platform: &str,
        pairs: Vec<(String, String)>,
        addresses: &[Ipv4Addr],
        user: &str,
        admin: &AdminKey,
    ) -> (Product, Vec<SshdHost>) {
        let mut p = Product::start(e2e::mpc_binary!(), &[]).await.unwrap();
        let hosts: Vec<SshdHost> = addresses
            .iter()
            .map(|a| {
                SshdHost::start_with(HostSetup {
                    address: Some(*a),
                    port: Some(22),
                    admin_key: Some(admin.clone()),
                    admin_user: (user != "root").then(|| user.to_owned()),
                    ..Default::default()
                })
                .unwrap()
            })
            .collect();
        p.put_secret(
            NS,
            "ibm-api-key",
            &[("api-key", ibm_emulator::API_KEY.as_bytes())],
        )
        .await
        .unwrap();
        let ssh = format!(
            "ibm-{}-ssh-key",
            platform.rsplit('/').next().unwrap_or_default()
        );
        p.put_secret(NS, &ssh, &[("id_rsa", admin.private().as_slice())])
            .await
            .unwrap();
        let mut cfg: ConfigPairs = p.base_config();
        cfg.extend(pairs);
        cfg.push(("dynamic-platforms".into(), platform.into()));
        p.set_config(&cfg).await.unwrap();
        p.controller_flags = vec![
            "--ibm-iam-url".into(),
            emu.iam_url(),
            "--ibm-tagging-url".into(),
            emu.tagging_url(),
            "--instance-list-interval".into(),
            "2s".into(),
        ];
        p.start_controller("c1").await.unwrap();
        (p, hosts)
    }

    async fn served(
        p: &Product,
        ns: &str,
        name: &str,
    ) -> std::collections::BTreeMap<String, String> {
        let s = p
            .wait(T, &format!("{ns}/{name}'s secret"), || async {
                p.secret(ns, name)
                    .await
                    .filter(|s| s.contains_key("otp") || s.contains_key("error"))
            })
            .await;
        assert!(s.contains_key("otp"), "{s:?}\n{}", p.logs());
        s
    }

    async fn emptied(p: &Product, emu: &IbmEmulator) {
        p.wait(T, "no instance left in the emulator", || async {
            (emu.live_instances() == 0).then_some(())
        })
        .await;
        p.wait(T, "an empty OTP store", || async {
            (p.otp_entries().await == Some(0)).then_some(())
        })
        .await;
    }

    /// ibmz end to end as `cloud-user` (root is refused on the host, as on new IBM images), with
    /// every token expired mid-flight and 5xx answers to the probe lookups and the delete.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ibmz_taskrun_end_to_end_as_cloud_user_through_token_expiry_and_5xx() {
        let a = Ipv4Addr::new(127, 0, 36, 4);
        let emu = emulator(Behaviour {
            addresses: vec![a],
            boot_delay: Duration::from_secs(1),
            ..Behaviour::default()
        })
        .await;
        let admin = AdminKey::generate().unwrap();
        let (p, hosts) = start(
            &emu,
            "linux/s390x",
            emu.ibmz_config("linux-s390x", "e2e-s390x", 1, "cloud-user"),
            &[a],
            "cloud-user",
            &admin,
        )
        .await;
        let user = contract::remote_user_name("z-1", "tenant-a");
        hosts[0].track_user(&user);
        emu.inject(Fault {
            method: http::Method::GET,
            path: "/v1/instances/".into(),
            times: 2,
            kind: FaultKind::Status(502),
        });
        p.create_taskrun("tenant-a", "z-1", "linux/s390x", json!({}))
            .await
            .unwrap();
        let s = served(&p, "tenant-a", "z-1").await;
        assert_eq!(s["host"], format!("{user}@{a}"));
        let reqs = emu.vpc_create_requests();
        assert_eq!(reqs.len(), 1);
        let (name, r) = reqs.iter().next().unwrap();
        assert!(
            mpc::config::ibm::is_instance_name_of("e2e-s390x", name),
            "{name}"
        );
        assert_eq!(r["availability_policy"]["host_failure"], "stop");
        assert_eq!(
            r["primary_network_attachment"]["virtual_network_interface"]["auto_delete"],
            true
        );
        let tr = p.taskrun("tenant-a", "z-1").await.unwrap();
        let id = tr["metadata"]["annotations"][contract::CLOUD_INSTANCE_ID_ANNOTATION]
            .as_str()
            .expect("instance annotation")
            .to_owned();
        let crn = format!(
            "crn:v1:bluemix:public:is:{}:a/0123456789abcdef::instance:{id}",
            ibm_emulator::ZONE
        );
        let tags = emu.tags_of(&crn);
        assert!(
            tags.iter().any(|t| t == "taskrunid:tenant-a:z-1"),
            "{tags:?}"
        );
        assert!(
            tags.iter()
                .any(|t| t == "multi-platform-cluster:e2e-cluster"),
            "{tags:?}"
        );
        // Root never logged in: the host refuses it, so provisioning went through cloud-user.
        assert!(
            !hosts[0].log().contains("Accepted publickey for root"),
            "{}",
            hosts[0].log()
        );
        assert!(hosts[0].log().contains("Accepted publickey for cloud-user"));

        let tokens = emu.token_requests();
        emu.expire_tokens();
        emu.inject(Fault {
            method: http::Method::DELETE,
            path: "/v1/instances/".into(),
            times: 1,
            kind: FaultKind::Status(503),
        });
        p.build("tenant-a", "z-1").await;
        p.cleaned_up("tenant-a", "z-1").await;
        emptied(&p, &emu).await;
        assert!(
            emu.token_requests() > tokens,
            "a fresh token after the expiry"
        );
        let deletes = emu
            .requests()
            .iter()
            .filter(|(m, _)| m == http::Method::DELETE)
            .count();
        assert!(deletes >= 2, "the 503 was retried");
    }

    /// ibmp end to end as root: the boot volume resize answers conflicts before it sticks, and
    /// the delete is slow.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ibmp_taskrun_end_to_end_through_resize_conflicts_and_a_slow_delete() {
        let a = Ipv4Addr::new(127, 0, 37, 4);
        let emu = emulator(Behaviour {
            addresses: vec![a],
            resize_conflicts: 2,
            boot_delay: Duration::from_secs(1),
            delete_delay: Duration::from_secs(3),
            ..Behaviour::default()
        })
        .await;
        emu.inject(Fault {
            method: http::Method::DELETE,
            path: "/pvm-instances/".into(),
            times: 1,
            kind: FaultKind::Delay(Duration::from_secs(3)),
        });
        let admin = AdminKey::generate().unwrap();
        let (p, hosts) = start(
            &emu,
            "linux/ppc64le",
            emu.ibmp_config("linux-ppc64le", "e2e-ppc64le", 1, "root"),
            &[a],
            "root",
            &admin,
        )
        .await;
        let user = contract::remote_user_name("p-1", "tenant-a");
        hosts[0].track_user(&user);
        p.create_taskrun("tenant-a", "p-1", "linux/ppc64le", json!({}))
            .await
            .unwrap();
        let s = served(&p, "tenant-a", "p-1").await;
        assert_eq!(s["host"], format!("{user}@{a}"));
        let reqs = emu.power_create_requests();
        assert_eq!(reqs.len(), 1);
        let r = reqs.values().next().unwrap();
        assert_eq!(r["imageID"], ibm_emulator::POWER_IMAGE_ID);
        assert_eq!(r["sysType"], "e980");
        let puts = emu
            .requests()
            .iter()
            .filter(|(m, p)| m == http::Method::PUT && p.contains("/volumes/"))
            .count();
        assert_eq!(puts, 3, "two conflicts, then the resize, before the secret");
        p.build("tenant-a", "p-1").await;
        p.cleaned_up("tenant-a", "p-1").await;
        emptied(&p, &emu).await;
        assert!(
            emu.requests()
                .iter()
                .any(|(m, q)| m == http::Method::DELETE && q.contains("delete_data_volumes=true"))
        );
    }

    /// Five TaskRuns at once on an ibmz platform of `max-instances: 2`: never more than two
    /// instances hold capacity, and every TaskRun is served in turn.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ibmz_max_instances_holds_under_concurrency() {
        let addrs = [Ipv4Addr::new(127, 0, 38, 4), Ipv4Addr::new(127, 0, 38, 5)];
        let emu = std::sync::Arc::new(
            emulator(Behaviour {
                addresses: addrs.to_vec(),
                boot_delay: Duration::from_millis(500),
                ..Behaviour::default()
            })
            .await,
        );
        let admin = AdminKey::generate().unwrap();
        let (p, hosts) = start(
            &emu,
            "linux/s390x",
            emu.ibmz_config("linux-s390x", "e2e-s390x", 2, "cloud-user"),
            &addrs,
            "cloud-user",
            &admin,
        )
        .await;
        let names: Vec<String> = (0..5).map(|i| format!("c-{i}")).collect();
        for n in &names {
            let user = contract::remote_user_name(n, "tenant-a");
            for h in &hosts {
                h.track_user(&user);
            }
        }
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let watch = {
            let (emu, peak) = (emu.clone(), peak.clone());
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(
                        emu.capacity_instances(),
                        std::sync::atomic::Ordering::SeqCst,
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        };
        for n in &names {
            p.create_taskrun("tenant-a", n, "linux/s390x", json!({}))
                .await
                .unwrap();
        }
        let mut done = std::collections::BTreeSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
        while done.len() < names.len() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{done:?}\n{}",
                p.logs()
            );
            for n in &names {
                if done.contains(n) {
                    continue;
                }
                if let Some(s) = p.secret("tenant-a", n).await {
                    assert!(s.contains_key("otp"), "{n}: {s:?}");
                    p.build("tenant-a", n).await;
                    done.insert(n.clone());
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for n in &names {
            p.cleaned_up("tenant-a", n).await;
        }
        emptied(&p, &emu).await;
        watch.abort();
        let peak = peak.load(std::sync::atomic::Ordering::SeqCst);
        assert!(peak <= 2, "{peak} instances held capacity at once");
        assert_eq!(peak, 2, "both slots were used");
        let creates = emu
            .requests()
            .iter()
            .filter(|(m, q)| m == http::Method::POST && q.starts_with("/v1/instances"))
            .count();
        assert_eq!(creates, 5, "one instance per TaskRun");
    }

    /// The controller is killed while an ibmz instance boots: the restarted one finds the
    /// instance by its ownership tags (no second launch), serves the TaskRun and cleans up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ibmz_restart_mid_launch_recovers_the_instance_by_its_tags() {
        let a = Ipv4Addr::new(127, 0, 39, 4);
        let emu = emulator(Behaviour {
            addresses: vec![a],
            boot_delay: Duration::from_secs(6),
            ..Behaviour::default()
        })
        .await;
        let admin = AdminKey::generate().unwrap();
        let (p, hosts) = start(
            &emu,
            "linux/s390x",
            emu.ibmz_config("linux-s390x", "e2e-s390x", 1, "cloud-user"),
            &[a],
            "cloud-user",
            &admin,
        )
        .await;
        let user = contract::remote_user_name("r-1", "tenant-a");
        hosts[0].track_user(&user);
        p.create_taskrun("tenant-a", "r-1", "linux/s390x", json!({}))
            .await
            .unwrap();
        p.wait(T, "the instance created", || async {
            (!emu.vpc_create_requests().is_empty()).then_some(())
        })
        .await;
        p.controllers[0].kill();
        p.controllers[0].restart().unwrap();
        let s = served(&p, "tenant-a", "r-1").await;
        assert_eq!(s["host"], format!("{user}@{a}"));
        let creates = emu
            .requests()
            .iter()
            .filter(|(m, q)| m == http::Method::POST && q.starts_with("/v1/instances"))
            .count();
        assert_eq!(
            creates, 1,
            "the restarted controller adopted the booting instance"
        );
        p.build("tenant-a", "r-1").await;
        p.cleaned_up("tenant-a", "r-1").await;
        emptied(&p, &emu).await;
    }

    /// `user: root` (Go's default) on an image that puts no key on root, as IBM Cloud VPC images
    /// since 2026-01-19: the TaskRun gets an error naming the refused root login, and every
    /// instance tried is deleted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ibmz_root_login_refused_by_a_new_image_is_an_error_secret_and_no_leak() {
        let a = Ipv4Addr::new(127, 0, 40, 4);
        let emu = emulator(Behaviour {
            addresses: vec![a],
            ..Behaviour::default()
        })
        .await;
        let admin = AdminKey::generate().unwrap();
        // The host's admin is cloud-user; root is refused.
        let mut p = Product::start(e2e::mpc_binary!(), &[]).await.unwrap();
        let _host = SshdHost::start_with(HostSetup {
            address: Some(a),
            port: Some(22),
            admin_key: Some(admin.clone()),
            admin_user: Some("cloud-user".into()),
            ..Default::default()
        })
        .unwrap();
        p.put_secret(
            NS,
            "ibm-api-key",
            &[("api-key", ibm_emulator::API_KEY.as_bytes())],
        )
        .await
        .unwrap();
        p.put_secret(
            NS,
            "ibm-s390x-ssh-key",
            &[("id_rsa", admin.private().as_slice())],
        )
        .await
        .unwrap();
        let mut cfg: ConfigPairs = p.base_config();
        cfg.extend(emu.ibmz_config("linux-s390x", "e2e-s390x", 1, "root"));
        cfg.push(("dynamic-platforms".into(), "linux/s390x".into()));
        p.set_config(&cfg).await.unwrap();
        p.controller_flags = vec![
            "--ibm-iam-url".into(),
            emu.iam_url(),
            "--ibm-tagging-url".into(),
            emu.tagging_url(),
        ];
        p.start_controller("c1").await.unwrap();
        p.create_taskrun("tenant-a", "root-1", "linux/s390x", json!({}))
            .await
            .unwrap();
        let s = p
            .wait(Duration::from_secs(240), "an error secret", || async {
                p.secret("tenant-a", "root-1")
                    .await
                    .filter(|s| s.contains_key("error") || s.contains_key("otp"))
            })
            .await;
        let error = s.get("error").unwrap_or_else(|| panic!("{s:?}"));
        assert!(error.contains("root@127.0.40.4"), "{error}");
        p.delete_taskrun("tenant-a", "root-1").await;
        p.cleaned_up("tenant-a", "root-1").await;
        p.wait(T, "no instance left in the emulator", || async {
            (emu.live_instances() == 0).then_some(())
        })
        .await;
    }
}
