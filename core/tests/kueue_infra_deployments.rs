//! `mpc kueue-quotas` against the ClusterQueues Konflux commits next to the same clusters'
//! host-configs (fixtures/kueue/README.md says where each file comes from): our rendering must be
//! the committed file, byte for byte, except where a difference is deliberate and listed here.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mpc_core::kueue::{
    self, ResourceQuota, allowed_annotations, format_annotation_list, platform_quotas,
    render_cluster_queue,
};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kueue")
}

fn read(path: PathBuf) -> String {
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

const V1BETA1_CLUSTERS: [&str; 10] = [
    "kflux-ocp-p01",
    "kflux-osp-p01",
    "kflux-prd-rh02",
    "kflux-prd-rh03",
    "kflux-rhel-p01",
    "stone-prd-rh01",
    "stone-prod-p01",
    "stone-prod-p02",
    "stone-stage-p01",
    "stone-stg-rh01",
];

/// None of these clusters has a dynamic pool, a platform listed without keys or an unlisted
/// platform's keys, so none of the deliberate differences from the script (kueue module docs)
/// shows: every file must come out unchanged.
#[test]
fn rendering_equals_every_committed_v1beta1_cluster_queue() {
    let mut failures = Vec::new();
    for cluster in V1BETA1_CLUSTERS {
        let dir = fixtures().join("v1beta1").join(cluster);
        let committed = read(dir.join("cluster-queue.yaml"));
        let (_, parsed) =
            kueue::read_host_config(&read(dir.join("host-config.yaml")), cluster).unwrap();
        let quotas = platform_quotas(&parsed.config);
        let rendered = render_cluster_queue(&committed, &quotas).unwrap();
        if rendered != committed {
            failures.push(format!(
                "{cluster}:\n--- committed\n{committed}\n--- rendered\n{rendered}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The platform quotas a queue's generated groups hold.
fn quotas_in(queue_file: &str) -> BTreeMap<String, ResourceQuota> {
    let docs = kueue::queue::read_documents(queue_file).unwrap();
    let queue = kueue::queue::find_cluster_queue(&docs).unwrap();
    kueue::queue::existing_groups(queue)
        .into_iter()
        .filter(|g| g.is_platform_group())
        .flat_map(|g| g.flavors.into_iter().flat_map(|(_, rs)| rs))
        .map(|(resource, q)| {
            let quota = kueue::quota::parse_quantity(&q).unwrap() as u64;
            (
                resource.clone(),
                ResourceQuota {
                    resource,
                    quota,
                    platforms: Vec::new(),
                },
            )
        })
        .collect()
}

#[test]
fn v1beta2_queues_are_reproduced_with_canonical_quantities() {
    for cluster in ["stone-stg-rh01", "stone-stage-p01"] {
        let committed = read(
            fixtures()
                .join("v1beta2")
                .join(cluster)
                .join("cluster-queue.yaml"),
        );
        let quotas = quotas_in(&committed);
        // Local platforms: 1000, written `1k` as the API server stores it.
        assert_eq!(quotas["local"].quota, 1000, "{cluster}");
        assert!(committed.contains("- name: local\n        nominalQuota: 1k\n"));
        assert_eq!(
            render_cluster_queue(&committed, &quotas).unwrap(),
            committed,
            "{cluster}"
        );
    }
}

#[test]
fn allowed_annotations_match_the_committed_admission_policy_lists() {
    for cluster in ["stone-stg-rh01", "stone-stage-p01"] {
        let dir = fixtures().join("v1beta2").join(cluster);
        let queue = read(dir.join("cluster-queue.yaml"));
        let policy = read(dir.join("deny-unallowed-annotations-configmap.yaml"));
        let derived = allowed_annotations(&queue).unwrap();
        assert_eq!(
            kueue::queue::read_annotation_list(&policy).unwrap(),
            derived,
            "{cluster}"
        );
        // The very string the ConfigMap holds.
        let cm: serde_norway::Value = serde_norway::from_str(&policy).unwrap();
        assert_eq!(
            cm["data"]["allowed-annotations"].as_str().unwrap(),
            format_annotation_list(&derived),
            "{cluster}"
        );
        // And the check agrees.
        assert!(derived.contains(&"kueue.konflux-ci.dev/requests-linux-arm64".to_owned()));
    }
}

/// The one deliberate difference in numbers: a dynamic pool exports `max-instances × concurrency`
/// where the script exports `max-instances`. Shown on a real cluster whose `linux/arm64` is turned
/// into a pool of 4 builds per instance: everything stays as committed but that quota.
#[test]
fn a_pool_exports_its_real_capacity_the_rest_unchanged() {
    let dir = fixtures().join("v1beta1").join("stone-stg-rh01");
    let committed = read(dir.join("cluster-queue.yaml"));
    let (mut data, _) = kueue::read_host_config_data(&read(dir.join("host-config.yaml"))).unwrap();
    let dynamic: Vec<String> = data["dynamic-platforms"]
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty() && *p != "linux/arm64")
        .map(str::to_owned)
        .collect();
    data.insert("dynamic-platforms".into(), dynamic.join(","));
    data.insert("dynamic-pool-platforms".into(), "linux/arm64".into());
    data.insert("dynamic.linux-arm64.concurrency".into(), "4".into());
    data.insert("dynamic.linux-arm64.max-age".into(), "1440".into());
    let parsed = mpc_core::config::parse(&data);
    let quotas = platform_quotas(&parsed.config);
    assert_eq!(quotas["linux-arm64"].quota, 1000);

    let before = "      - name: linux-arm64\n        nominalQuota: '250'\n";
    assert!(committed.contains(before));
    let expected = committed.replace(
        before,
        "      - name: linux-arm64\n        nominalQuota: '1000'\n",
    );
    assert_eq!(render_cluster_queue(&committed, &quotas).unwrap(), expected);
}
