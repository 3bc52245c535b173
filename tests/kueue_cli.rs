//! `mpc kueue-quotas` and `mpc check-config --cluster-queue` through the real binary, on the
//! ClusterQueues and host-configs Konflux commits (core/tests/fixtures/kueue/README.md).

use std::path::{Path, PathBuf};
use std::process::Command;

fn mpc(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mpc"))
        .args(args)
        .output()
        .expect("run mpc");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn kueue_fixture(path: &str) -> String {
    format!(
        "{}/core/tests/fixtures/kueue/{path}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn configmap_fixture(name: &str) -> String {
    format!(
        "{}/core/tests/fixtures/configmaps/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

const CLUSTER: &str = "v1beta1/stone-prd-rh01";

fn host_config() -> String {
    kueue_fixture(&format!("{CLUSTER}/host-config.yaml"))
}

fn committed_queue() -> String {
    std::fs::read_to_string(kueue_fixture(&format!("{CLUSTER}/cluster-queue.yaml"))).unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn whole_cluster_queue_is_the_committed_one_and_write_restores_it() {
    let queue = kueue_fixture(&format!("{CLUSTER}/cluster-queue.yaml"));
    let (code, out, err) = mpc(&["kueue-quotas", &host_config(), "--cluster-queue", &queue]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, committed_queue());

    // A stale copy (a quota changed by hand, a platform group lost) is rewritten in place.
    let dir = tempfile::tempdir().unwrap();
    let stale = committed_queue().replace(
        "      - name: linux-amd64\n        nominalQuota: '250'\n",
        "      - name: linux-amd64\n        nominalQuota: '7'\n",
    );
    assert_ne!(stale, committed_queue());
    let path = write(dir.path(), "cluster-queue.yaml", &stale);
    let path = path.to_str().unwrap();
    let (code, out, err) = mpc(&[
        "kueue-quotas",
        &host_config(),
        "--cluster-queue",
        path,
        "--write",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, "");
    assert!(err.contains(&format!("updated {path}")), "{err}");
    assert_eq!(std::fs::read_to_string(path).unwrap(), committed_queue());
}

#[test]
fn groups_only_in_either_api_version_and_allowed_annotations() {
    let (code, v2, err) = mpc(&["kueue-quotas", &host_config()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        v2.starts_with("- coveredResources:\n  - linux-amd64\n"),
        "{v2}"
    );
    assert!(v2.contains("  - name: platform-group-1\n"), "{v2}");
    assert!(
        v2.contains("    - name: local\n      nominalQuota: 1k\n"),
        "{v2}"
    );
    assert!(!v2.contains("tekton.dev/pipelineruns"), "{v2}");
    let (_, v1, _) = mpc(&["kueue-quotas", &host_config(), "--api", "v1beta1"]);
    assert!(
        v1.contains("    - name: local\n      nominalQuota: '1000'\n"),
        "{v1}"
    );
    // The groups are the committed queue's platform groups, line for line.
    let committed = committed_queue();
    for line in v1.lines() {
        assert!(committed.contains(&format!("  {line}\n")), "{line:?}");
    }

    let queue = kueue_fixture(&format!("{CLUSTER}/cluster-queue.yaml"));
    let (code, list, err) = mpc(&[
        "kueue-quotas",
        &host_config(),
        "--cluster-queue",
        &queue,
        "--allowed-annotations",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        list.starts_with(
            r#"["kueue.konflux-ci.dev/requests-aws-ip", "kueue.konflux-ci.dev/requests-cpu", "#
        ),
        "{list}"
    );
    assert!(!list.contains("pipelineruns"), "{list}");
    assert_eq!(list.lines().count(), 1);
}

#[test]
fn check_config_passes_the_committed_pair() {
    let queue = kueue_fixture(&format!("{CLUSTER}/cluster-queue.yaml"));
    let (code, out, err) = mpc(&["check-config", &host_config(), "--cluster-queue", &queue]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains(&format!(
            "{queue} against {}: 0 problem(s)\n",
            host_config()
        )),
        "{out}"
    );
}

#[test]
fn check_config_reports_each_disagreement_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let committed = committed_queue();
    assert!(committed.contains("      - name: linux-arm64\n        nominalQuota: '250'\n"));
    let tampered = committed
        .replace(
            "      - name: linux-arm64\n        nominalQuota: '250'\n",
            "      - name: linux-arm64\n        nominalQuota: '100'\n",
        )
        .replacen(
            "    - linux-amd64\n",
            "    - linux-amd64\n    - linux-retired-amd64\n",
            1,
        );
    let queue = write(dir.path(), "cluster-queue.yaml", &tampered);
    // The list as rendered from the config, so without linux-retired-amd64.
    let (code, list, _) = mpc(&[
        "kueue-quotas",
        &host_config(),
        "--cluster-queue",
        queue.to_str().unwrap(),
        "--allowed-annotations",
    ]);
    assert_eq!(code, Some(0));
    let annotations = write(
        dir.path(),
        "allowed.json",
        &list.replace("\"kueue.konflux-ci.dev/requests-linux-s390x\", ", ""),
    );
    let (code, out, err) = mpc(&[
        "check-config",
        &host_config(),
        "--cluster-queue",
        queue.to_str().unwrap(),
        "--allowed-annotations",
        annotations.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.contains(": 4 problem(s)\n"), "{out}");
    for expected in [
        "  error: linux-arm64: ClusterQueue quota 100 (100) but host-config allows 250 concurrent builds: linux/arm64 (dynamic, max-instances 250); set nominalQuota to 250\n",
        "  error: linux-retired-amd64 (flavor platform-group-1): host-config has no such platform;",
        "  error: kueue.konflux-ci.dev/requests-linux-s390x: not in the allowed annotations although the ClusterQueue covers linux-s390x;",
        "  error: kueue.konflux-ci.dev/requests-linux-retired-amd64: not in the allowed annotations although the ClusterQueue covers linux-retired-amd64;",
    ] {
        assert!(out.contains(expected), "{expected:?} not in:\n{out}");
    }
}

#[test]
fn platforms_listed_without_keys_fail_the_check() {
    // konflux-dev lists linux/s390x in dynamic-platforms with no dynamic.linux-s390x.* key.
    let dir = tempfile::tempdir().unwrap();
    let base = "apiVersion: kueue.x-k8s.io/v1beta2\nkind: ClusterQueue\nmetadata:\n  name: q\nspec:\n  resourceGroups:\n  - coveredResources: [tekton.dev/pipelineruns]\n    flavors:\n    - name: default-flavor\n      resources:\n      - {name: tekton.dev/pipelineruns, nominalQuota: '500'}\n";
    let queue = write(dir.path(), "cluster-queue.yaml", base);
    let queue = queue.to_str().unwrap();
    let config = configmap_fixture("konflux-dev.yaml");
    let (code, _, err) = mpc(&["kueue-quotas", &config, "--cluster-queue", queue, "--write"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("linux/s390x: no quota, the controller does not serve it: linux/s390x is listed in dynamic-platforms but has no dynamic.linux-s390x.* keys"),
        "{err}"
    );
    let (code, out, err) = mpc(&["check-config", &config, "--cluster-queue", queue]);
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.contains(": 1 problem(s)\n"), "{out}");
    assert!(
        out.contains("  error: linux/s390x: listed in dynamic-platforms but no dynamic.linux-s390x.* key exists, so it has no capacity and no Kueue quota, and the Go controller answers its TaskRuns with an error secret"),
        "{out}"
    );
}

#[test]
fn data_files_are_read_like_configmaps() {
    let dir = tempfile::tempdir().unwrap();
    let data = write(
        dir.path(),
        "data.yaml",
        "local-platforms: \"linux/x86_64,local\"\n",
    );
    let data = data.to_str().unwrap();
    let (code, out, err) = mpc(&["kueue-quotas", data]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out,
        "- coveredResources:\n  - linux-x86-64\n  - local\n  flavors:\n  - name: platform-group-1\n    resources:\n    - name: linux-x86-64\n      nominalQuota: 1k\n    - name: local\n      nominalQuota: 1k\n"
    );
    let (code, out, _) = mpc(&["check-config", data]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(": 2 platform(s)"), "{out}");
}

#[test]
fn usage_errors() {
    let queue = kueue_fixture(&format!("{CLUSTER}/cluster-queue.yaml"));
    let (code, _, err) = mpc(&[
        "check-config",
        &host_config(),
        &host_config(),
        "--cluster-queue",
        &queue,
    ]);
    assert_eq!(code, Some(1));
    assert!(err.contains("give exactly one file"), "{err}");
    let (code, _, err) = mpc(&[
        "check-config",
        &host_config(),
        "--allowed-annotations",
        &queue,
    ]);
    assert_eq!(code, Some(2), "{err}");
    let (code, _, err) = mpc(&["kueue-quotas", &host_config(), "--write"]);
    assert_eq!(code, Some(2), "{err}");
    let (code, _, err) = mpc(&[
        "kueue-quotas",
        &host_config(),
        "--cluster-queue",
        &host_config(),
    ]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no ClusterQueue document"), "{err}");
}

/// stone-prd-rh01's host-config with capacity group `aws-ip` (`max`) over its two main AWS
/// platforms.
fn grouped_host_config(dir: &Path, max: u32) -> PathBuf {
    let text = std::fs::read_to_string(host_config()).unwrap().replacen(
        "\ndata:\n",
        &format!(
            "\ndata:\n  capacity-group.aws-ip.max: \"{max}\"\n  \
             dynamic.linux-arm64.capacity-group: aws-ip\n  \
             dynamic.linux-amd64.capacity-group: aws-ip\n"
        ),
        1,
    );
    write(dir, "host-config.yaml", &text)
}

#[test]
fn a_capacity_group_is_a_resource_its_quota_checked_and_its_members_in_cel() {
    let dir = tempfile::tempdir().unwrap();
    let queue = kueue_fixture(&format!("{CLUSTER}/cluster-queue.yaml"));
    // The committed queue keeps aws-ip at 250 in its base group: the same max agrees.
    let agreeing = grouped_host_config(dir.path(), 250);
    let (code, out, err) = mpc(&[
        "check-config",
        agreeing.to_str().unwrap(),
        "--cluster-queue",
        &queue,
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    let raised = grouped_host_config(dir.path(), 500);
    let (code, out, _) = mpc(&[
        "check-config",
        raised.to_str().unwrap(),
        "--cluster-queue",
        &queue,
    ]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(
            "  error: aws-ip: ClusterQueue quota 250 (250) but host-config allows 500 concurrent \
             builds: capacity group aws-ip, max 500 instances of linux/amd64, linux/arm64; set \
             nominalQuota to 500\n"
        ),
        "{out}"
    );
    // Rendered into the platform groups: the hand-kept base-group entry must go first.
    let (code, _, err) = mpc(&[
        "kueue-quotas",
        raised.to_str().unwrap(),
        "--cluster-queue",
        &queue,
    ]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("resource aws-ip is covered by the group of flavor default-flavor"),
        "{err}"
    );
    let (code, groups, err) = mpc(&["kueue-quotas", raised.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert!(groups.contains("  - aws-ip\n"), "{groups}");
    assert!(
        groups.contains("    - name: aws-ip\n      nominalQuota: '500'\n"),
        "{groups}"
    );
    // The tekton-kueue expressions name exactly the members.
    let (code, cel, err) = mpc(&["kueue-quotas", raised.to_str().unwrap(), "--group-cel"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(cel.matches("resource('aws-ip', 1)").count(), 2, "{cel}");
    assert_eq!(cel.matches("'linux/arm64',").count(), 2, "{cel}");
    assert!(!cel.contains("linux-mlarge"), "{cel}");
}
