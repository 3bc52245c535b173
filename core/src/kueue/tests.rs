use super::*;

/// A host-config data file: `n` dynamic platforms `linux-p<i>/arm64` with max-instances `10 + i`,
/// plus the extra lines.
fn data_file(n: usize, extra: &str) -> String {
    let mut s = String::from("dynamic-platforms: \"");
    let names: Vec<String> = (0..n).map(|i| format!("linux-p{i:02}/arm64")).collect();
    s.push_str(&names.join(","));
    s.push_str("\"\n");
    for i in 0..n {
        let l = format!("linux-p{i:02}-arm64");
        for (k, v) in [
            ("type", "aws".to_owned()),
            ("region", "us-east-1".to_owned()),
            ("ami", "ami-1".to_owned()),
            ("instance-type", "m6g.large".to_owned()),
            ("aws-secret", "aws".to_owned()),
            ("ssh-secret", "ssh".to_owned()),
            ("max-instances", format!("\"{}\"", 10 + i)),
        ] {
            s.push_str(&format!("dynamic.{l}.{k}: {v}\n"));
        }
    }
    s.push_str(extra);
    s
}

fn quotas_of(text: &str) -> std::collections::BTreeMap<String, ResourceQuota> {
    let (_, parsed) = read_host_config(text, "test").unwrap();
    platform_quotas(&parsed.config)
}

const BASE_QUEUE: &str = "\
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata:
  name: cluster-pipeline-queue
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [tekton.dev/pipelineruns, cpu, memory, aws-ip]
    flavors:
    - name: default-flavor
      resources:
      - {name: tekton.dev/pipelineruns, nominalQuota: '500'}
      - {name: cpu, nominalQuota: 1k}
      - {name: memory, nominalQuota: 500Ti}
      - {name: aws-ip, nominalQuota: '250'}
  - coveredResources: [linux-old]
    flavors:
    - name: platform-group-1
      resources:
      - {name: linux-old, nominalQuota: '3'}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata:
  name: platform-group-1
spec: {}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata:
  name: default-flavor
";

#[test]
fn groups_hold_at_most_16_resources_sorted_with_numbered_flavors() {
    let q = quotas_of(&data_file(17, "local-platforms: linux/x86_64\n"));
    let groups = platform_groups(&q);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].flavor, "platform-group-1");
    assert_eq!(groups[0].resources.len(), 16);
    assert_eq!(groups[1].flavor, "platform-group-2");
    assert_eq!(
        groups[1].resources,
        [
            ("linux-p16-arm64".to_owned(), 26),
            ("linux-x86-64".to_owned(), 1000)
        ]
    );
    let v2 = render_groups(&q, KueueApi::V1beta2).unwrap();
    assert!(
        v2.starts_with("- coveredResources:\n  - linux-p00-arm64\n"),
        "{v2}"
    );
    assert!(
        v2.contains("  - name: platform-group-2\n    resources:\n"),
        "{v2}"
    );
    assert!(
        v2.contains("    - name: linux-x86-64\n      nominalQuota: 1k\n"),
        "{v2}"
    );
    assert!(
        v2.contains("    - name: linux-p00-arm64\n      nominalQuota: '10'\n"),
        "{v2}"
    );
    let v1 = render_groups(&q, KueueApi::V1beta1).unwrap();
    assert!(v1.contains("nominalQuota: '1000'\n"), "{v1}");
}

#[test]
fn more_than_15_platform_groups_do_not_fit_next_to_the_base_group() {
    let q = quotas_of(&data_file(16 * 15, ""));
    assert_eq!(platform_groups(&q).len(), 15);
    render_groups(&q, KueueApi::V1beta2).unwrap();
    let q = quotas_of(&data_file(16 * 15 + 1, ""));
    assert!(matches!(
        render_groups(&q, KueueApi::V1beta2),
        Err(KueueError::TooManyGroups { groups: 17 })
    ));
}

#[test]
fn whole_queue_keeps_the_base_group_replaces_platform_groups_and_adds_flavors() {
    let q = quotas_of(&data_file(17, ""));
    let out = render_cluster_queue(BASE_QUEUE, &q).unwrap();
    let docs = queue::read_documents(&out).unwrap();
    // Sorted by kind, then name: the queue, then the flavors by name, the new one added.
    let ids: Vec<(String, String)> = docs
        .iter()
        .map(|d| {
            (
                d["kind"].as_str().unwrap().to_owned(),
                d["metadata"]["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        ids,
        [
            ("ClusterQueue", "cluster-pipeline-queue"),
            ("ResourceFlavor", "default-flavor"),
            ("ResourceFlavor", "platform-group-1"),
            ("ResourceFlavor", "platform-group-2"),
        ]
        .map(|(a, b)| (a.to_owned(), b.to_owned()))
    );
    assert_eq!(
        docs[3]["apiVersion"].as_str(),
        Some("kueue.x-k8s.io/v1beta2")
    );
    let groups = queue::existing_groups(&docs[0]);
    assert_eq!(groups.len(), 3);
    // The base group as it was, in its order (not sorted).
    assert_eq!(
        groups[0].covered,
        ["tekton.dev/pipelineruns", "cpu", "memory", "aws-ip"]
    );
    assert_eq!(groups[0].flavors[0].1[1], ("cpu".into(), "1k".into()));
    // The old platform group is gone with its resource.
    assert!(!out.contains("linux-old"), "{out}");
    assert_eq!(groups[2].covered, ["linux-p16-arm64"]);
    // Rendering its own output again changes nothing.
    assert_eq!(render_cluster_queue(&out, &q).unwrap(), out);
    // PyYAML's layout: keys sorted, indentless lists, first document without a marker.
    assert!(
        out.starts_with("apiVersion: kueue.x-k8s.io/v1beta2\nkind: ClusterQueue\nmetadata:\n  name: cluster-pipeline-queue\nspec:\n  namespaceSelector: {}\n  resourceGroups:\n  - coveredResources:\n    - tekton.dev/pipelineruns\n"),
        "{out}"
    );
    assert!(
        out.ends_with("---\napiVersion: kueue.x-k8s.io/v1beta2\nkind: ResourceFlavor\nmetadata:\n  name: platform-group-2\nspec: {}\n"),
        "{out}"
    );
}

#[test]
fn hand_made_groups_are_kept_and_may_not_cover_a_platform() {
    let extra_group = BASE_QUEUE.replace(
        "  - coveredResources: [linux-old]",
        "  - coveredResources: [mintmaker]\n    flavors:\n    - name: mintmaker-flavor\n      resources:\n      - {name: mintmaker, nominalQuota: '150'}\n  - coveredResources: [linux-old]",
    );
    let q = quotas_of(&data_file(2, ""));
    let out = render_cluster_queue(&extra_group, &q).unwrap();
    let docs = queue::read_documents(&out).unwrap();
    let groups = queue::existing_groups(&docs[0]);
    assert_eq!(groups[1].covered, ["mintmaker"]);
    assert_eq!(groups[2].flavors[0].0, "platform-group-1");

    let clash = BASE_QUEUE.replace("aws-ip]", "aws-ip, linux-p00-arm64]");
    match render_cluster_queue(&clash, &q) {
        Err(KueueError::Overlap { resource, flavor }) => {
            assert_eq!(
                (resource.as_str(), flavor.as_str()),
                ("linux-p00-arm64", "default-flavor")
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        render_cluster_queue("kind: ResourceFlavor\n", &q),
        Err(KueueError::NoClusterQueue)
    ));
}

#[test]
fn allowed_annotations_are_the_covered_resources_but_pipelineruns() {
    let list = allowed_annotations(BASE_QUEUE).unwrap();
    assert_eq!(
        list,
        [
            "kueue.konflux-ci.dev/requests-aws-ip",
            "kueue.konflux-ci.dev/requests-cpu",
            "kueue.konflux-ci.dev/requests-linux-old",
            "kueue.konflux-ci.dev/requests-memory",
        ]
    );
    assert_eq!(
        format_annotation_list(&list[..2]),
        r#"["kueue.konflux-ci.dev/requests-aws-ip", "kueue.konflux-ci.dev/requests-cpu"]"#
    );
    let cm = format!(
        "kind: ConfigMap\ndata:\n  allowed-annotations: '{}'\n",
        format_annotation_list(&list)
    );
    assert_eq!(queue::read_annotation_list(&cm).unwrap(), list);
    assert_eq!(queue::read_annotation_list("[a, b]\n").unwrap(), ["a", "b"]);
    assert!(matches!(
        queue::read_annotation_list("kind: ConfigMap\ndata: {}\n"),
        Err(KueueError::NoAnnotationList)
    ));
}

#[test]
fn data_file_and_configmap_read_the_same() {
    let data = data_file(2, "local-platforms: \"linux/x86_64,local\"\n");
    let indented: String = data.lines().map(|l| format!("  {l}\n")).collect();
    let cm = format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: host-config\ndata:\n{indented}"
    );
    let (d1, p1) = read_host_config(&data, "data").unwrap();
    let (d2, p2) = read_host_config(&cm, "cm").unwrap();
    assert_eq!(d1, d2);
    assert_eq!(p1.config, p2.config);
    assert_eq!(platform_quotas(&p1.config).len(), 4);
    assert!(matches!(
        read_host_config("kind: Secret\n", "x"),
        Err(KueueError::HostConfig { .. })
    ));
}

fn findings(config: &str, queue_file: &str, annotations: Option<&str>) -> Vec<String> {
    let (data, parsed) = read_host_config(config, "test").unwrap();
    check(&data, &parsed.config, queue_file, annotations)
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn a_rendered_queue_and_its_annotations_pass_the_check() {
    let config = data_file(17, "local-platforms: local\n");
    let q = quotas_of(&config);
    let queue_file = render_cluster_queue(BASE_QUEUE, &q).unwrap();
    let list = format_annotation_list(&allowed_annotations(&queue_file).unwrap());
    assert_eq!(
        findings(&config, &queue_file, Some(&list)),
        Vec::<String>::new()
    );
}

#[test]
fn check_names_each_disagreement() {
    let config = data_file(
        3,
        "dynamic-pool-platforms: \"linux-g4xlarge/amd64\"\n\
         local-platforms: local\n\
         dynamic.linux-unlisted-arm64.max-instances: \"5\"\n",
    );
    let q = quotas_of(&config);
    let good = render_cluster_queue(BASE_QUEUE, &q).unwrap();
    let bad = good
        // linux-p00-arm64: 10 → 12
        .replace(
            "- name: linux-p00-arm64\n        nominalQuota: '10'",
            "- name: linux-p00-arm64\n        nominalQuota: '12'",
        )
        // linux-p01-arm64: removed altogether
        .replace("    - linux-p01-arm64\n", "")
        .replace(
            "      - name: linux-p01-arm64\n        nominalQuota: '11'\n",
            "",
        )
        // local: not a whole number
        .replace("nominalQuota: 1k", "nominalQuota: 1.5")
        // two resources the config does not serve
        .replace(
            "    - local\n",
            "    - local\n    - linux-g4xlarge-amd64\n    - linux-unlisted-arm64\n",
        );
    // The policy's list: aws-ip missing, one for a resource the queue does not have.
    let mut allowed = allowed_annotations(&bad).unwrap();
    allowed.retain(|a| !a.ends_with("-aws-ip"));
    allowed.push("kueue.konflux-ci.dev/requests-gone".to_owned());
    let got = findings(&config, &bad, Some(&format_annotation_list(&allowed)));
    let expect_prefixes = [
        "linux-g4xlarge/amd64: listed in dynamic-pool-platforms but no dynamic.linux-g4xlarge-amd64.* key exists",
        "linux-p00-arm64: ClusterQueue quota 12 (12) but host-config allows 10 concurrent builds: linux-p00/arm64 (dynamic, max-instances 10); set nominalQuota to 10",
        "linux-p01-arm64: no quota in the ClusterQueue",
        "local: ClusterQueue quota \"1.5\" is not a whole-number quantity; host-config allows 1000",
        "linux-g4xlarge-amd64 (flavor platform-group-1): linux-g4xlarge/amd64 is disabled in host-config",
        "linux-unlisted-arm64 (flavor platform-group-1): host-config has dynamic.linux-unlisted-arm64.* keys but lists no such platform",
    ];
    for p in expect_prefixes {
        assert!(
            got.iter().any(|f| f.starts_with(p)),
            "no finding starting with {p:?} in {got:#?}"
        );
    }
    assert!(
        got.iter().any(|f| f
            .starts_with("kueue.konflux-ci.dev/requests-aws-ip: not in the allowed annotations")),
        "{got:#?}"
    );
    assert!(
        got.iter().any(|f| f.starts_with(
            "kueue.konflux-ci.dev/requests-gone: allowed, but the ClusterQueue covers no gone"
        )),
        "{got:#?}"
    );
    assert_eq!(got.len(), 8, "{got:#?}");
    assert!(!got.iter().any(|f| f.starts_with("cpu")), "{got:#?}");
}

/// A capacity group is a resource of the platform groups (its quota the group's max, once,
/// whatever its members), so a queue rendered from the config passes; a queue whose group
/// resource the config has lost names why.
#[test]
fn a_capacity_group_is_one_resource_of_the_platform_groups() {
    let queue_without_aws_ip = BASE_QUEUE
        .replace(", aws-ip]", "]")
        .replace("      - {name: aws-ip, nominalQuota: '250'}\n", "");
    let config = data_file(
        3,
        "capacity-group.subnet-a.max: \"20\"\n\
         dynamic.linux-p00-arm64.capacity-group: subnet-a\n\
         dynamic.linux-p02-arm64.capacity-group: subnet-a\n",
    );
    let q = quotas_of(&config);
    assert_eq!(q["subnet-a"].quota, 20);
    assert_eq!(
        q["subnet-a"].describe(),
        "capacity group subnet-a, max 20 instances of linux-p00/arm64, linux-p02/arm64"
    );
    let rendered = render_cluster_queue(&queue_without_aws_ip, &q).unwrap();
    assert!(
        rendered.contains("      - name: subnet-a\n        nominalQuota: '20'\n"),
        "{rendered}"
    );
    assert_eq!(findings(&config, &rendered, None), Vec::<String>::new());
    // The group's max now fails to parse: the queue's resource has no group behind it.
    let broken = config.replace("max: \"20\"", "max: \"twenty\"");
    let got = findings(&broken, &rendered, None);
    assert!(
        got.iter().any(|f| f.starts_with(
            "subnet-a (flavor platform-group-1): host-config's capacity group subnet-a is left out by an error"
        )),
        "{got:#?}"
    );
}

#[test]
fn a_drain_makes_the_check_ask_for_the_drained_quota() {
    let config = data_file(2, "");
    let queue_file = render_cluster_queue(BASE_QUEUE, &quotas_of(&config)).unwrap();
    assert_eq!(findings(&config, &queue_file, None), Vec::<String>::new());
    // Drain linux-p01/arm64: the queue rendered before still says 11, the config now 0.
    let drained = data_file(2, "dynamic.linux-p01-arm64.drain: \"true\"\n");
    let got = findings(&drained, &queue_file, None);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].starts_with(
            "linux-p01-arm64: ClusterQueue quota 11 (11) but host-config allows 0 concurrent builds: linux-p01/arm64 (drained: nothing new is launched"
        ),
        "{got:#?}"
    );
    // And a queue rendered from the drained config passes.
    let again = render_cluster_queue(BASE_QUEUE, &quotas_of(&drained)).unwrap();
    assert_eq!(findings(&drained, &again, None), Vec::<String>::new());
}
