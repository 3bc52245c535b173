//! The shipped installation, deployed the way the README says and run the way a cluster runs it.
//!
//! In a copy of the checkout's deploy files, the test runs the README's deploy commands (checked
//! to be there verbatim): the OTP Secrets, `mpc certs` for both Services, `mpc check-config`, and
//! `kubectl apply -k examples` against the test API server. The image is the Dockerfile's runtime
//! stage around the `mpc` built here (`e2e/image.sh runtime`; no registry is reachable, so it is
//! tagged with the name the installation is pointed at). Then [`e2e::kubelet`] runs every
//! Deployment's pods from the rendered objects exactly as specified (image, args, env, user,
//! `fsGroup`, read-only root, dropped capabilities, declared volumes only, memory and CPU limits,
//! probes), and the product must work through them: the replicas become ready, one takes the
//! Lease, the example TaskRun gets its Secret through the webhook and the scheduler, its step
//! redeems the key from the OTP pod and builds on a loopback sshd host, and deleting it cleans up.
//! Nothing patches the rendered spec: a failure means the manifests or the binary are wrong.
//!
//! It also holds the rendered Services, the ServiceMonitor and the NetworkPolicies against the
//! sockets the containers really listen on, checks each container stayed under its memory limit
//! and was never failed by its liveness probe, and that a pod deletion ends it gracefully.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use e2e::apiserver::{ApiServer, Options, TEKTON_CRDS};
use e2e::kubelet::{self, ClusterNet, Kubelet, Pod};
use e2e::sshd::{SshdHost, require_tools, user_exists};
use e2e::tekton::{RunOptions, Tekton};
use serde_json::Value;

const NS: &str = "multi-platform-controller";
const TENANT: &str = "demo";
/// The image the installation is pointed at (README step 1).
const IMAGE: &str = "registry.example.com/mpc:dev";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `script` with bash in `dir` (`mpc` is the binary under test); its stdout, or a panic with
/// everything it printed.
fn sh(dir: &Path, script: &str) -> String {
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c"])
        .arg(format!("mpc() {{ \"$MPC\" \"$@\"; }}\n{script}"))
        .env("MPC", e2e::mpc_binary!())
        .current_dir(dir)
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "`{script}` failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The README's deploy commands this test runs as written.
const README_COMMANDS: [&str; 7] = [
    "mpc check-config examples/host-config.yaml",
    "head -c 48 /dev/urandom | base64 -w0 > examples/secrets/otp-seal-key",
    "head -c 48 /dev/urandom | base64 -w0 > examples/secrets/otp-store-token",
    "mpc certs --service mpc-webhook --namespace multi-platform-controller --out webhook-certs/mpc-certs/out/webhook",
    "mpc certs --service mpc-otp --namespace multi-platform-controller --out webhook-certs/mpc-certs/out/otp",
    "kubectl apply -k examples",
    "kubectl kustomize examples",
];

fn rendered(dir: &Path, kustomization: &str) -> Vec<Value> {
    e2e::kubectl::kustomize(&dir.join(kustomization))
}

fn logs(pods: &[&Pod]) -> String {
    pods.iter()
        .map(|p| format!("--- {} ---\n{}", p.name, p.log_text()))
        .collect()
}

async fn eventually<T, F, Fut>(timeout: Duration, what: &str, pods: &[&Pod], mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}\n{}",
            logs(pods)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The containerPort behind a Service port of the pods it selects.
fn target_port(svc: &Value, port_name: &str, container: &Value) -> u16 {
    let p = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == port_name)
        .unwrap_or_else(|| {
            panic!(
                "Service {} has no port {port_name}",
                svc["metadata"]["name"]
            )
        });
    kubelet::resolve_port(container, &p["targetPort"]).expect("the targetPort is declared")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_shipped_installation_builds_when_its_pods_run_as_a_cluster_runs_them() {
    require_tools(&[
        "podman", "runc", "ip", "ss", "mount", "kubectl", "curl", "sshd",
    ])
    .expect("tools");
    mpc::tls::install_crypto_provider();
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    for c in README_COMMANDS {
        assert!(readme.contains(c), "README.md no longer says `{c}`");
    }

    // A checkout's deploy files, where the README's commands run.
    let work = tempfile::Builder::new()
        .prefix("mpc-deployed-")
        .tempdir()
        .unwrap();
    let w = work.path();
    for d in ["manifests", "examples", "webhook-certs"] {
        sh(&repo(), &format!("cp -r {d} '{}/'", w.display()));
    }

    // Step 1: the image (here its runtime stage around the binary under test), and the
    // installation pointed at it as the README says (`images:` in examples/kustomization.yaml).
    sh(
        &repo(),
        &format!(
            "bash e2e/image.sh runtime '{}' {IMAGE}",
            e2e::mpc_binary!().display()
        ),
    );
    let k = w.join("examples/kustomization.yaml");
    let text = std::fs::read_to_string(&k).unwrap();
    let (name, tag) = IMAGE.rsplit_once(':').unwrap();
    // What `kustomize edit set image quay.io/...=registry.example.com/mpc:dev` writes: the entry
    // gets newName and newTag, and loses the example's placeholder digest.
    let mut pointed = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("digest: sha256:") {
            pointed.push_str(&format!("    newName: {name}\n    newTag: {tag}\n"));
        } else {
            pointed.push_str(line);
            pointed.push('\n');
        }
    }
    assert_ne!(
        pointed, text,
        "examples/kustomization.yaml names no image to replace"
    );
    std::fs::write(&k, pointed).unwrap();

    // Step 2: the hosts: one loopback sshd build host for linux/arm64.
    let host = SshdHost::start_on_port_22().expect("sshd");
    std::fs::write(
        w.join("examples/host-config.yaml"),
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: host-config\n  labels:\n    build.appstudio.redhat.com/multi-platform-config: hosts\ndata:\n  local-platforms: \"linux/x86_64,local,localhost\"\n  host.host-1.address: \"{}\"\n  host.host-1.platform: linux/arm64\n  host.host-1.user: root\n  host.host-1.secret: host-1-admin\n  host.host-1.concurrency: \"1\"\n",
            host.address()
        ),
    )
    .unwrap();
    // Steps 2-4 as written.
    for c in &README_COMMANDS[..5] {
        sh(w, c);
    }

    // Step 5, against the test API server.
    let api = ApiServer::start(Options::default()).await.unwrap();
    api.create_yaml(TEKTON_CRDS).await.unwrap();
    // kubectl as the cluster's admin, from the copied checkout: its stdout, or everything it said.
    let try_kubectl = |args: &[&str]| -> Result<String, String> {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(api.kubeconfig_path())
            .args(args)
            .current_dir(w)
            .output()
            .map_err(|e| format!("kubectl does not run: {e}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
        }
    };
    let kubectl =
        |args: &[&str]| try_kubectl(args).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}"));
    kubectl(&["apply", "-k", "examples"]);
    // The FlowSchema is cluster-scoped: stored without the namespace kustomize gives it.
    let fs = kubectl(&[
        "get",
        "flowschema",
        "multi-platform-controller-leader-election",
        "-o",
        "jsonpath={.metadata.namespace}/{.spec.priorityLevelConfiguration.name}",
    ]);
    assert_eq!(fs, "/leader-election");
    // The admin key of the host, a Secret the operator keeps in the controller's namespace.
    let key_file = w.join("host-1-id_rsa");
    std::fs::write(&key_file, host.admin_key().as_slice()).unwrap();
    kubectl(&[
        "create",
        "secret",
        "generic",
        "host-1-admin",
        "-n",
        NS,
        &format!("--from-file=id_rsa={}", key_file.display()),
    ]);
    kubectl(&["create", "namespace", TENANT]);
    let objects = rendered(w, "examples");
    let client = api.client().await.unwrap();
    let tekton = Tekton::start(client.clone());

    // The pods.
    let api_addr: SocketAddr = api
        .url()
        .trim_start_matches("https://")
        .parse()
        .expect("the API server's address");
    let mut kubelet = Kubelet::new(
        NS,
        objects.clone(),
        ClusterNet {
            api: api_addr,
            api_ca_pem: api.ca_pem().to_owned(),
            egress: vec![SocketAddr::new(host.address().parse().unwrap(), 22)],
        },
    )
    .expect("kubelet");
    api.map_service(
        NS,
        "mpc-webhook",
        443,
        kubelet
            .service_addr("mpc-webhook", 443)
            .expect("webhook VIP"),
    );
    let otp = kubelet.start_deployment("mpc-otp-server").expect("OTP pod");
    let controllers = kubelet
        .start_deployment("multi-platform-controller")
        .expect("controller pods");
    assert_eq!(controllers.len(), 2, "the Deployment asks for 2 replicas");
    let all: Vec<&Pod> = otp.iter().chain(&controllers).collect();
    eventually(Duration::from_secs(90), "every pod ready", &all, || async {
        for p in &all {
            assert!(p.alive(), "{} exited\n{}", p.name, logs(&all));
        }
        all.iter().all(|p| p.ready()).then_some(())
    })
    .await;

    // Resource limits as the runtime applied them.
    for p in &all {
        let limits = &p.container["resources"]["limits"];
        let (mem, cpu) = p.applied_limits().expect("cgroup limits");
        assert_eq!(
            mem,
            kubelet::parse_bytes(limits["memory"].as_str().unwrap()).unwrap(),
            "{}",
            p.name
        );
        let want = kubelet::parse_cpu(limits["cpu"].as_str().unwrap()).unwrap();
        assert!((cpu - want).abs() < 0.01, "{}: cpu {cpu} vs {want}", p.name);
    }

    // One replica takes the Lease.
    let names: BTreeSet<String> = controllers.iter().map(|p| p.name.clone()).collect();
    let leader = eventually(Duration::from_secs(60), "a Lease holder", &all, || async {
        let holder = try_kubectl(&[
            "get",
            "lease",
            "-n",
            NS,
            "multi-platform-controller",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ])
        .ok()?;
        let holder = holder.trim().to_owned();
        names.contains(&holder).then_some(holder)
    })
    .await;
    eprintln!("leader: {leader}");

    // The example TaskRun, end to end.
    kubectl(&["apply", "-n", TENANT, "-f", "examples/taskrun.yaml"]);
    let tr = "try-build";
    let secret = eventually(
        Duration::from_secs(90),
        "the TaskRun's secret",
        &all,
        || async {
            let json = try_kubectl(&[
                "get",
                "secret",
                "-n",
                TENANT,
                &format!("multi-platform-ssh-{tr}"),
                "-o",
                "json",
            ])
            .ok()?;
            serde_json::from_str::<Value>(&json).ok()
        },
    )
    .await;
    use base64::Engine;
    let field = |k: &str| {
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(secret["data"][k].as_str().unwrap_or_default())
                .unwrap(),
        )
        .unwrap()
    };
    assert!(
        secret["data"]["error"].is_null(),
        "error secret: {}\n{}",
        field("error"),
        logs(&all)
    );
    assert!(
        field("host").ends_with(&host.address()),
        "{}",
        field("host")
    );
    assert!(
        field("otp-server").starts_with("https://mpc-otp.multi-platform-controller.svc"),
        "{}",
        field("otp-server")
    );
    // The build step resolves the OTP Service's name as cluster DNS would.
    let curl_home = w.join("curl-home");
    std::fs::create_dir_all(&curl_home).unwrap();
    let otp_vip = kubelet.service_addr("mpc-otp", 443).expect("OTP VIP");
    std::fs::write(
        curl_home.join(".curlrc"),
        format!(
            "resolve = \"mpc-otp.multi-platform-controller.svc:443:{}\"\n",
            otp_vip.ip()
        ),
    )
    .unwrap();
    let run = tekton
        .run_steps(
            TENANT,
            tr,
            RunOptions {
                env: vec![("CURL_HOME".into(), curl_home.display().to_string())],
                ..RunOptions::default()
            },
        )
        .await
        .expect("the step runs");
    assert_eq!(
        run.exit_code,
        0,
        "the build failed:\n{}\n{}\n{}",
        run.stdout,
        run.stderr,
        logs(&all)
    );
    let user = mpc::contract::remote_user_name(tr, TENANT);
    assert!(user_exists(&user), "the build user {user} is on the host");
    kubectl(&["delete", "taskrun", "-n", TENANT, tr, "--wait=false"]);
    eventually(Duration::from_secs(60), "cleanup", &all, || async {
        let left = try_kubectl(&["get", "taskrun,secret", "-n", TENANT, "-o", "name"]).ok()?;
        (left.trim().is_empty() && !user_exists(&user)).then_some(())
    })
    .await;

    // Ports: what the rendered Services, ServiceMonitor and NetworkPolicies name is what the
    // containers listen on, and nothing else listens beyond loopback.
    let monitoring = rendered(w, "manifests/monitoring");
    let find = |objs: &[Value], kind: &str, name: &str| -> Value {
        objs.iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind}/{name} rendered"))
            .clone()
    };
    let listening = |p: &Pod| -> BTreeSet<u16> {
        p.net
            .netns
            .listening()
            .unwrap()
            .into_iter()
            .filter(|a| !a.ip().is_loopback())
            .map(|a| a.port())
            .collect()
    };
    for p in &all {
        let declared: BTreeSet<u16> = p.container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["containerPort"].as_u64().unwrap() as u16)
            .collect();
        assert_eq!(
            listening(p),
            declared,
            "{}: listening vs containerPorts",
            p.name
        );
    }
    let c0 = &controllers[0];
    let o0 = &otp[0];
    let ctl_svc = find(&objects, "Service", "mpc-webhook");
    let otp_svc = find(&objects, "Service", "mpc-otp");
    let ctl_listen = listening(c0);
    let otp_listen = listening(o0);
    for (svc, pod, ports) in [(&ctl_svc, c0, &ctl_listen), (&otp_svc, o0, &otp_listen)] {
        for sp in svc["spec"]["ports"].as_array().unwrap() {
            let t = target_port(svc, sp["name"].as_str().unwrap(), &pod.container);
            assert!(
                ports.contains(&t),
                "Service {} port {} → {t}: nothing listens",
                svc["metadata"]["name"],
                sp["name"]
            );
        }
    }
    // The ServiceMonitor scrapes each Service's named port with its scheme: plain HTTP /metrics.
    let sm = monitoring
        .iter()
        .find(|o| o["kind"] == "ServiceMonitor")
        .expect("a ServiceMonitor");
    for ep in sm["spec"]["endpoints"].as_array().unwrap() {
        let port_name = ep["port"].as_str().expect("endpoints name a Service port");
        let scheme = ep["scheme"].as_str().unwrap_or("http");
        let path = ep["path"].as_str().unwrap_or("/metrics");
        assert_eq!(scheme, "http", "the admin ports serve plain HTTP");
        for (svc, pod) in [(&ctl_svc, c0), (&otp_svc, o0)] {
            if svc["spec"]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == port_name)
            {
                let port = target_port(svc, port_name, &pod.container);
                assert_eq!(
                    kubelet::get(pod, port, path).await.unwrap(),
                    200,
                    "{} {port_name}",
                    pod.name
                );
            }
        }
    }
    for np in objects.iter().filter(|o| o["kind"] == "NetworkPolicy") {
        let sel: BTreeMap<String, String> =
            serde_json::from_value(np["spec"]["podSelector"]["matchLabels"].clone()).unwrap();
        let pod = all
            .iter()
            .find(|p| sel.iter().all(|(k, v)| p.labels.get(k) == Some(v)))
            .unwrap_or_else(|| panic!("NetworkPolicy {} selects no pod", np["metadata"]["name"]));
        for rule in np["spec"]["ingress"].as_array().unwrap() {
            for port in rule["ports"].as_array().unwrap() {
                let n = kubelet::resolve_port(&pod.container, &port["port"]).unwrap();
                assert!(
                    listening(pod).contains(&n),
                    "NetworkPolicy {} opens {} ({n}): nothing listens",
                    np["metadata"]["name"],
                    port["port"]
                );
            }
        }
    }

    // Through the whole scenario: no liveness failure, under the memory limit, never OOM-killed.
    for p in &all {
        assert_eq!(
            p.liveness_failures
                .load(std::sync::atomic::Ordering::SeqCst),
            0,
            "{} failed liveness\n{}",
            p.name,
            p.log_text()
        );
        let limit = kubelet::parse_bytes(
            p.container["resources"]["limits"]["memory"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        let peak = p.peak_rss().expect("the container runs");
        eprintln!(
            "{}: peak RSS {:.1} MiB (limit {} MiB)",
            p.name,
            peak as f64 / 1048576.0,
            limit >> 20
        );
        assert!(
            peak < limit,
            "{}: peak RSS {peak} over its limit {limit}",
            p.name
        );
        assert!(!p.oom_killed(), "{} was OOM-killed", p.name);
    }

    // Deleting the pods: each ends on SIGTERM within its grace period, exit code 0.
    for p in all.iter().rev() {
        assert_eq!(
            p.terminate(),
            Some(0),
            "{} did not stop cleanly\n{}",
            p.name,
            p.log_text()
        );
    }
}
