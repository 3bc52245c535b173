//! The Grafana dashboard and the alerts read only what the binaries export: the real
//! `mpc controller` (webhook and scheduler metrics) and `mpc otp-server` are scraped after TaskRuns
//! went through every path a panel shows (a queued and a served build on a static host, a host
//! that cannot be reached, an instance launched and terminated on a cloud platform, a refused OTP
//! redeem), and every metric name and label of every panel and alert is looked up in what they
//! exported.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use e2e::moto::Moto;
use e2e::product::{NS, Product, static_host};
use e2e::promql::{self, Family, Uses};
use mpc::contract;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel)
}

/// Labels Prometheus attaches to every scraped series (the target's, as the ServiceMonitor
/// discovers it), so queries may group or join on them.
const TARGET_LABELS: [&str; 7] = [
    "job",
    "instance",
    "namespace",
    "pod",
    "service",
    "container",
    "endpoint",
];

/// Series the alerts read from other exporters: `(name prefix or name, who exports it)`.
const EXTERNAL: [(&str, &str); 3] = [
    ("up", "Prometheus, per scrape target"),
    (
        "apiserver_admission_webhook_fail_open_count",
        "the Kubernetes API server",
    ),
    ("certmanager_certificate_", "cert-manager"),
];

/// What a platform team needs on the dashboard (the list), as the families that show it.
const DASHBOARD_MUST_SHOW: [&str; 21] = [
    "host_allocation_time",
    "wait_time",
    "running_tasks",
    "waiting_tasks",
    "queue_length",
    "queue_oldest_seconds",
    "available",
    "provisioning_failures",
    "cleanup_failures",
    "cloud_instances",
    "platform_pool_size",
    "actions_in_flight",
    "action_failures",
    "leader",
    "webhook_requests",
    "webhook_request_duration_seconds",
    "otp_stored",
    "otp_redeemed",
    "otp_rejected",
    "config_errors",
    "host_allocation_failures",
];

/// `(where, expression)` of every dashboard query and template variable.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo_file("manifests/monitoring/grafana-dashboard.json"))
        .expect("dashboard JSON");
    let d: Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let mut out = Vec::new();
    let mut panels: Vec<&Value> = Vec::new();
    for p in d["panels"].as_array().into_iter().flatten() {
        panels.push(p);
        panels.extend(p["panels"].as_array().into_iter().flatten());
    }
    for p in panels {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().expect("a target's expr").to_owned();
            out.push((format!("panel {:?} {}", p["title"], t["refId"]), expr));
        }
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"].as_str().expect("a variable's query");
        out.push((format!("variable {}", v["name"]), label_values(q)));
    }
    out
}

/// Grafana's `label_values(selector, label)` as a PromQL expression reading the same: the
/// selector, grouped by the label.
fn label_values(q: &str) -> String {
    let inner = q
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
        .unwrap_or_else(|| panic!("unsupported variable query {q}"));
    let (selector, label) = inner
        .rsplit_once(',')
        .expect("label_values(selector, label)");
    format!("count by ({}) ({})", label.trim(), selector.trim())
}

/// `(alert, expression)` of every alert.
fn alert_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo_file("manifests/monitoring/prometheusrule.yaml"))
        .expect("prometheusrule.yaml");
    let rules: serde_norway::Value = serde_norway::from_str(&text).expect("YAML");
    let mut out = Vec::new();
    for g in rules["spec"]["groups"].as_sequence().expect("groups") {
        for r in g["rules"].as_sequence().expect("rules") {
            out.push((
                format!("alert {}", r["alert"].as_str().expect("alert name")),
                r["expr"].as_str().expect("expr").to_owned(),
            ));
        }
    }
    out
}

fn external(metric: &str) -> bool {
    EXTERNAL
        .iter()
        .any(|(n, _)| metric == *n || (n.ends_with('_') && metric.starts_with(n)))
}

/// Problems of one query: our metrics are checked against `families` (with the target labels
/// every series gets), external ones only by name.
fn problems(uses: &Uses, families: &BTreeMap<String, Family>) -> Vec<String> {
    let mut ours = uses.clone();
    ours.selectors.retain(|s| !external(&s.metric));
    let mut fams = families.clone();
    for f in fams.values_mut() {
        f.labels.extend(TARGET_LABELS.map(str::to_owned));
    }
    let mut out: Vec<String> = uses
        .selectors
        .iter()
        .filter(|s| !s.metric.starts_with(mpc::metrics::PREFIX) && !external(&s.metric))
        .map(|s| format!("{} is neither ours nor a listed external series", s.metric))
        .collect();
    // Grouping labels may come from external series too (`by (name)` over cert-manager's).
    if ours.selectors.len() < uses.selectors.len() {
        ours.grouping.clear();
    }
    out.extend(promql::check(&ours, &fams));
    out
}

/// Metric families the expressions read, ours only, by family name.
fn families_used(queries: &[(String, String)]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (_, q) in queries {
        for s in promql::uses(q).expect("parses").selectors {
            if let Some(base) = s.metric.strip_prefix(mpc::metrics::PREFIX) {
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|x| base.strip_suffix(x))
                    .unwrap_or(base);
                out.insert(format!("{}{base}", mpc::metrics::PREFIX));
            }
        }
    }
    out
}

async fn scrape(p: &Product) -> BTreeMap<String, Family> {
    let mut f = promql::families(&p.controllers[0].metrics().await);
    promql::merge(&mut f, promql::families(&p.otp.metrics().await));
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alerts_read_only_exported_metrics_and_labels() {
    let dashboard = dashboard_queries();
    let alerts = alert_queries();
    // Every query parses, and the dashboard shows what a platform team needs.
    for (w, q) in dashboard.iter().chain(&alerts) {
        promql::uses(q).unwrap_or_else(|e| panic!("{w}: {e}: {q}"));
    }
    let shown = families_used(&dashboard);
    for f in DASHBOARD_MUST_SHOW {
        assert!(shown.contains(&mpc::metrics::name(f)), "no panel shows {f}");
    }

    // The product: a static host of one slot, a host nothing answers on, and a cloud platform
    // whose instances get loopback addresses nothing answers on.
    let mut p = Product::start(e2e::mpc_binary!(), &[("h1", 1)])
        .await
        .unwrap();
    let moto = Moto::start().await.unwrap();
    let fx = moto.loopback_subnet("us-east-1", 3).await.unwrap();
    p.put_secret(
        NS,
        "dead-admin",
        &[("id_rsa", p.hosts[0].sshd.admin_key().as_slice())],
    )
    .await
    .unwrap();
    let mut cfg = p.base_config();
    // 127.0.0.0/8 is all loopback; nothing listens on this address.
    cfg.extend(static_host("dead", "127.0.3.251", 1, "linux/s390x"));
    cfg.extend(
        p.moto_platform(&fx, "linux/ppc64le", b"unused", "e2e-ppc64le")
            .await
            .unwrap(),
    );
    // A cloud platform whose image is gone: its launch is rejected for its configuration.
    cfg.extend(
        p.moto_platform(&fx, "linux/riscv64", b"unused", "e2e-riscv64")
            .await
            .unwrap(),
    );
    cfg.push((
        "dynamic.linux-riscv64.ami".into(),
        "ami-0000000000000dead".into(),
    ));
    // A cloud platform whose account cannot be read (its aws-secret is missing): its listing
    // fails at recovery, so it is held unlisted.
    cfg.extend(
        p.moto_platform(&fx, "linux/mips64le", b"unused", "e2e-mips64le")
            .await
            .unwrap(),
    );
    cfg.retain(|(k, _)| k != "dynamic.linux-mips64le.aws-secret");
    cfg.push((
        "dynamic.linux-mips64le.aws-secret".into(),
        "no-such-aws-account".into(),
    ));
    let platforms: Vec<String> = cfg
        .iter()
        .filter(|(k, _)| k == "dynamic-platforms")
        .map(|(_, v)| v.clone())
        .collect();
    cfg.retain(|(k, _)| k != "dynamic-platforms");
    cfg.push(("dynamic-platforms".into(), platforms.join(",")));
    p.set_config(&cfg).await.unwrap();
    p.controller_flags = vec![
        "--ec2-endpoint".into(),
        moto.endpoint(),
        "--instance-list-interval".into(),
        "2s".into(),
    ];
    p.start_controller("c1").await.unwrap();

    // Two builds for one slot (the second waits), one on the dead host, one on the cloud.
    for (ns, name, platform) in [
        ("tenant-a", "build-1", "linux/arm64"),
        ("tenant-b", "build-2", "linux/arm64"),
        ("tenant-a", "dead-1", "linux/s390x"),
        ("tenant-a", "cloud-1", "linux/ppc64le"),
        ("tenant-b", "gone-image-1", "linux/riscv64"),
    ] {
        p.create_taskrun(ns, name, platform, json!({}))
            .await
            .unwrap();
        p.hosts[0]
            .sshd
            .track_user(&contract::remote_user_name(name, ns));
    }
    // Gauges of the scheduler's ledger have series only while something is running, waiting or
    // booting: the families are what every scrape of the scenario showed.
    let mut seen = BTreeMap::new();
    let during = [
        "running_tasks",
        "waiting_tasks",
        "queue_length",
        "scheduler_instances",
    ]
    .map(mpc::metrics::name);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while !during.iter().all(|f| seen.contains_key(f)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no build running, waiting and booting at once:\n{}\n{}",
            describe(&seen),
            p.logs()
        );
        promql::merge(&mut seen, scrape(&p).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (ns, name) in [("tenant-a", "build-1"), ("tenant-b", "build-2")] {
        p.wait(T, &format!("{ns}/{name} gets the host"), || async {
            p.secret(ns, name).await.filter(|s| s.contains_key("otp"))
        })
        .await;
        p.build(ns, name).await;
    }
    // The instance is launched, then its TaskRun goes away: it is terminated.
    p.wait(Duration::from_secs(90), "cloud-1's instance", || async {
        let tr = p.taskrun("tenant-a", "cloud-1").await?;
        tr["metadata"]["annotations"][contract::CLOUD_INSTANCE_ID_ANNOTATION]
            .as_str()
            .map(str::to_owned)
    })
    .await;
    p.delete_taskrun("tenant-a", "cloud-1").await;
    // A token nobody stored.
    assert!(p.otp_redeem("not-a-token").await.is_err());

    // Failures and cleanups take the scheduler's retry back-offs (cleanup gives up after about
    // 75 s): wait until every family a query reads has been exported, then check the labels.
    let wanted = families_used(&[dashboard.clone(), alerts.clone()].concat());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(240);
    let families = loop {
        promql::merge(&mut seen, scrape(&p).await);
        let missing: Vec<&String> = wanted.iter().filter(|w| !seen.contains_key(*w)).collect();
        if missing.is_empty() {
            break seen;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never exported: {missing:?}\nexported:\n{}\n{}",
            describe(&seen),
            p.logs()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let mut all = Vec::new();
    for (w, q) in dashboard.iter().chain(&alerts) {
        let u = promql::uses(q).unwrap();
        for problem in problems(&u, &families) {
            all.push(format!("{w}: {problem}\n    {q}"));
        }
    }
    assert!(all.is_empty(), "{}", all.join("\n"));
    // Per-platform series carry Go's label value (`linux-arm64`), as dashboards built on Go's
    // series select them.
    let text = p.controllers[0].metrics().await;
    let values: BTreeSet<&str> = text
        .match_indices("platform=\"")
        .map(|(i, m)| {
            let rest = &text[i + m.len()..];
            &rest[..rest.find('"').unwrap_or(rest.len())]
        })
        .collect();
    assert!(values.contains("linux-arm64"), "{values:?}");
    assert!(values.iter().all(|v| !v.contains('/')), "{values:?}");
    // Values, not only names (docs/metrics.md): two builds went through the one-slot static
    // host, the second queued behind the first. Go's `wait_time` sees only the one that waited,
    // `queue_wait_seconds` both; a static host is allocated at once (Go measures from the
    // allocation attempt, not from creation), so `host_allocation_time` sums to exactly zero.
    let value = |family: &str| {
        let series = format!(
            "{}{family}{{platform=\"linux-arm64\"}} ",
            mpc::metrics::PREFIX
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&series)?.parse::<f64>().ok())
    };
    for (family, expected) in [
        ("wait_time_count", 1.0),
        ("queue_wait_seconds_count", 2.0),
        ("host_allocation_time_count", 2.0),
        ("host_allocation_time_sum", 0.0),
        ("host_ready_seconds_count", 2.0),
    ] {
        assert_eq!(value(family), Some(expected), "{family} in\n{text}");
    }
    // The waiter waited for a whole build, so its wait is its queue wait and more.
    let waited = value("wait_time_sum").unwrap_or_default();
    let queued = value("queue_wait_seconds_sum").unwrap_or_default();
    assert!(
        waited > 0.0 && queued > 0.0 && waited + 1.0 >= queued,
        "{text}"
    );
    // The checker is not vacuous: a misspelt family and a label no series has are refused.
    let bad = promql::uses(&format!(
        "sum by (tenant) ({}wait_times_bucket) + {}leader{{zone=\"a\"}}",
        mpc::metrics::PREFIX,
        mpc::metrics::PREFIX
    ))
    .unwrap();
    assert_eq!(
        problems(&bad, &families).len(),
        3,
        "{:?}",
        problems(&bad, &families)
    );
}

/// Families and their labels as the binaries exported them, for a failing test's message.
fn describe(f: &BTreeMap<String, Family>) -> String {
    f.iter()
        .map(|(n, f)| format!("{n} {} {:?}", f.kind, f.labels))
        .collect::<Vec<_>>()
        .join("\n")
}
