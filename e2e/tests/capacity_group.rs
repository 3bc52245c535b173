//! A capacity group through the real binaries: two dynamic platforms on moto, each allowed 2
//! instances, share group `aws-ip` with max 2. Six TaskRuns of both are all served, while moto
//! never shows more than 2 of their instances alive at once, and the controller's metrics show
//! the group's limit, what it holds and who waits.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use e2e::product::{ConfigPairs, Product};
use serde_json::json;

/// Loopback subnet `127.0.61.0/24`: moto hands out its addresses, sshd answers there.
const SUBNET: u8 = 61;
const NS: &str = "tenant-a";
const TAGS: [&str; 2] = ["e2e-arm64", "e2e-amd64"];

/// Instances of the group's platforms moto shows holding an address (pending, running, or on
/// their way down).
async fn group_instances(moto: &e2e::moto::Moto) -> Option<usize> {
    let d = moto
        .ec2("us-east-1")
        .describe_instances()
        .send()
        .await
        .ok()?;
    let n = d
        .reservations()
        .iter()
        .flat_map(|r| r.instances())
        .filter(|i| {
            let state = i.state().and_then(|s| s.name()).map(|n| n.as_str());
            let tagged = i.tags().iter().any(|t| {
                t.key() == Some("multi-platform-instance")
                    && t.value().is_some_and(|v| TAGS.contains(&v))
            });
            tagged && !matches!(state, Some("terminated") | None)
        })
        .count();
    Some(n)
}

/// The value of the series `line_prefix` (a whole metric name with labels) in `text`.
fn series(text: &str, line_prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_group_caps_two_platforms_instances_and_serves_every_taskrun() {
    use e2e::moto::Moto;
    let mut p = Product::start(e2e::mpc_binary!(), &[]).await.unwrap();
    let moto = Arc::new(Moto::start().await.unwrap());
    let fx = moto.loopback_subnet("us-east-1", SUBNET).await.unwrap();
    let admin = e2e::sshd::AdminKey::generate().unwrap();
    // One sshd per address moto may hand out over the run (six launches, with room to spare).
    let _hosts: Vec<_> = (0..8)
        .map(|i| {
            e2e::sshd::SshdHost::start_with(e2e::sshd::HostSetup {
                address: Some(std::net::Ipv4Addr::new(127, 0, SUBNET, 4 + i)),
                port: Some(22),
                admin_key: Some(admin.clone()),
                ..Default::default()
            })
            .unwrap()
        })
        .collect();
    let mut cfg = ConfigPairs::new();
    for (platform, tag) in [("linux/arm64", TAGS[0]), ("linux/amd64", TAGS[1])] {
        let pairs = p
            .moto_platform(&fx, platform, &admin.private(), tag)
            .await
            .unwrap();
        cfg.extend(pairs.into_iter().filter(|(k, _)| k != "dynamic-platforms"));
    }
    // Each platform allows 2 (moto_platform's max-instances); together they may hold 2.
    for (k, v) in [
        ("dynamic-platforms", "linux/arm64,linux/amd64"),
        ("local-platforms", "local"),
        ("capacity-group.aws-ip.max", "2"),
        ("dynamic.linux-arm64.capacity-group", "aws-ip"),
        ("dynamic.linux-amd64.capacity-group", "aws-ip"),
    ] {
        cfg.push((k.to_owned(), v.to_owned()));
    }
    p.set_config(&cfg).await.unwrap();
    p.controller_flags = vec!["--ec2-endpoint".into(), moto.endpoint()];
    p.start_controller("c1").await.unwrap();

    // Watch moto for the whole run.
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicUsize::new(0));
    let watcher = {
        let (moto, done, peak) = (moto.clone(), done.clone(), peak.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::SeqCst) {
                if let Some(n) = group_instances(&moto).await {
                    peak.fetch_max(n, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    let names: Vec<(String, &str)> = (0..6)
        .map(|i| {
            let platform = if i % 2 == 0 {
                "linux/arm64"
            } else {
                "linux/amd64"
            };
            (format!("grp-{i}"), platform)
        })
        .collect();
    for (name, platform) in &names {
        p.create_taskrun(NS, name, platform, json!({}))
            .await
            .unwrap();
    }

    // While the group is full and others wait, the metrics say so.
    let limit = "multi_platform_controller_capacity_group_limit{group=\"aws-ip\"}";
    let in_use = "multi_platform_controller_capacity_group_in_use{group=\"aws-ip\"}";
    let waiting = "multi_platform_controller_capacity_group_waiting{group=\"aws-ip\"}";
    let text = p
        .wait(
            Duration::from_secs(60),
            "the group full, with waiters",
            || async {
                let text = p.controllers[0].metrics().await;
                (series(&text, limit) == Some(2.0)
                    && series(&text, in_use) == Some(2.0)
                    && series(&text, waiting).is_some_and(|w| w >= 1.0))
                .then_some(text)
            },
        )
        .await;
    // The group's families pass promtool's lint (HELP and TYPE, names, values).
    let ours: String = text
        .lines()
        .filter(|l| l.contains("capacity_group_"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(ours.matches("# HELP ").count(), 3, "{ours}");
    let mut lint = tokio::process::Command::new(
        std::env::var("MPC_PROMTOOL").unwrap_or_else(|_| "promtool".into()),
    )
    .args(["check", "metrics"])
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("promtool (installed by e2e/setup.sh; MPC_PROMTOOL overrides the path)");
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = lint.stdin.take().unwrap();
        stdin.write_all(ours.as_bytes()).await.unwrap();
    }
    let linted = lint.wait_with_output().await.unwrap();
    assert!(
        linted.status.success(),
        "promtool check metrics: {}{}\n{ours}",
        String::from_utf8_lossy(&linted.stdout),
        String::from_utf8_lossy(&linted.stderr)
    );

    // Build each TaskRun as its host is ready; every one is served, two at a time at most.
    let mut built = BTreeSet::new();
    while built.len() < names.len() {
        let ready = p
            .wait(
                Duration::from_secs(180),
                "a TaskRun with its host",
                || async {
                    for (name, _) in &names {
                        if built.contains(name) {
                            continue;
                        }
                        if let Some(s) = p.secret(NS, name).await {
                            assert!(!s.contains_key("error"), "{name}: {s:?}\n{}", p.logs());
                            if s.contains_key("otp") {
                                return Some(name.clone());
                            }
                        }
                    }
                    None
                },
            )
            .await;
        p.build(NS, &ready).await;
        p.cleaned_up(NS, &ready).await;
        built.insert(ready);
    }
    // Every instance goes once its build is done.
    p.wait(
        Duration::from_secs(60),
        "every instance terminated",
        || async { (group_instances(&moto).await == Some(0)).then_some(()) },
    )
    .await;
    done.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    let peak = peak.load(Ordering::SeqCst);
    assert_eq!(
        peak,
        2,
        "the group's platforms held {peak} instances at once (max 2)\n{}",
        p.logs()
    );
    p.wait(
        Duration::from_secs(30),
        "the group empty in the metrics",
        || async {
            let text = p.controllers[0].metrics().await;
            (series(&text, in_use) == Some(0.0) && series(&text, waiting) == Some(0.0))
                .then_some(())
        },
    )
    .await;
}
