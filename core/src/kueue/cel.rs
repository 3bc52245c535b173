//! tekton-kueue CEL for capacity groups (`mpc kueue-quotas --group-cel`): the expressions that
//! make a PipelineRun request one unit of a group's resource per member platform it builds for,
//! so membership comes from host-config instead of a hand-kept list.
//!
//! Shaped like the `aws-ip` expressions in infra-deployments' tekton-kueue `config.yaml`
//! (`cel.expressions`, one for the `build-platforms` parameter and one for the older
//! per-task `PLATFORM` parameter), indented to paste under `expressions:`. Where those charge
//! every platform *not* on an exception list (so static `linux/riscv64`, `linux-large/s390x` and
//! `linux/ppc64be` builds take subnet addresses they never use), these charge exactly the
//! members.
//!
//! Kueue counts per PipelineRun: one unit per `build-platforms` entry (or per task with a
//! `PLATFORM` parameter), held for the whole PipelineRun. The controller counts instances, from
//! launch to acknowledged termination, per TaskRun (a pool instance once, however many builds
//! share it). So Kueue's count is an admission-time estimate: it over-counts pool members and
//! PipelineRuns that are not building yet, and does not see instances still terminating; the
//! controller's limit is the one that holds.

use std::fmt::Write;

use crate::config::HostConfig;

/// The CEL expressions for every capacity group of `config`, in name order (empty when it has
/// none).
pub fn group_cel(config: &HostConfig) -> String {
    let mut out = String::new();
    for g in config.capacity_groups.values() {
        let members: Vec<&str> = g.members.iter().map(|p| p.as_str()).collect();
        let list = |indent: &str| -> String {
            members
                .iter()
                .map(|m| format!("{indent}'{m}',\n"))
                .collect()
        };
        let name = &g.name;
        let _ = write!(
            out,
            "    # Request {name} for its member platforms (capacity-group.{name}.max: {max}; \
             generated from host-config by mpc kueue-quotas --group-cel)
    - |
        has(pipelineRun.spec.params) &&
        pipelineRun.spec.params.exists(p, p.name == 'build-platforms') &&
        type(pipelineRun.spec.params.filter(p, p.name == 'build-platforms')[0].value) == list ?
        pipelineRun.spec.params.filter(
          p,
          p.name == 'build-platforms')[0]
        .value.filter(
          p,
          p in [
{new_list}          ]
        ).map(
          p,
          resource('{name}', 1)
        ) : []

    # Request {name} for its member platforms which doesn't use the build-platforms parameter (old style)
    - |
      !(
        has(pipelineRun.spec.params) &&
        pipelineRun.spec.params.exists(p, p.name == 'build-platforms')
      ) &&
      has(pipelineRun.spec.pipelineSpec) &&
      has(pipelineRun.spec.pipelineSpec.tasks) &&
      pipelineRun.spec.pipelineSpec.tasks.size() > 0 ?
      pipelineRun.spec.pipelineSpec.tasks.map(
        task,
        has(task.params) ? task.params.filter(p, p.name == 'PLATFORM') : []
      )
      .filter(p, p.size() > 0)
      .filter(
        p,
        p[0].value in [
{old_list}        ]
      )
      .map(
        p,
        resource('{name}', 1)
      ) : []

",
            max = g.max,
            new_list = list("            "),
            old_list = list("          "),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConfigData, parse};

    fn config(pairs: &[(&str, &str)]) -> HostConfig {
        let mut data: ConfigData = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        for label in ["linux-arm64", "linux-m2xlarge-amd64"] {
            for (f, v) in [
                ("type", "aws"),
                ("region", "us-east-1"),
                ("ami", "ami-1"),
                ("instance-type", "m6g.large"),
                ("aws-secret", "aws"),
                ("ssh-secret", "ssh"),
                ("max-instances", "10"),
            ] {
                data.insert(format!("dynamic.{label}.{f}"), v.to_owned());
            }
        }
        let parsed = parse(&data);
        assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
        parsed.config
    }

    #[test]
    fn a_group_requests_its_resource_for_exactly_its_members() {
        let c = config(&[
            ("instance-tag", "t"),
            ("dynamic-platforms", "linux/arm64,linux-m2xlarge/amd64"),
            ("capacity-group.aws-ip.max", "500"),
            ("dynamic.linux-arm64.capacity-group", "aws-ip"),
            ("dynamic.linux-m2xlarge-amd64.capacity-group", "aws-ip"),
        ]);
        let cel = group_cel(&c);
        assert_eq!(cel.matches("resource('aws-ip', 1)").count(), 2, "{cel}");
        assert!(cel.contains(
            "          p in [\n            'linux-m2xlarge/amd64',\n            'linux/arm64',\n          ]\n"
        ), "{cel}");
        assert!(cel.contains(
            "        p[0].value in [\n          'linux-m2xlarge/amd64',\n          'linux/arm64',\n        ]\n"
        ), "{cel}");
        // Pasted under `expressions:`, it is a YAML list of two block strings.
        let doc: serde_norway::Value =
            serde_norway::from_str(&format!("cel:\n  expressions:\n{cel}")).unwrap();
        let exprs = doc["cel"]["expressions"].as_sequence().unwrap();
        assert_eq!(exprs.len(), 2);
        assert!(
            exprs[0]
                .as_str()
                .unwrap()
                .starts_with("has(pipelineRun.spec.params)")
        );
        assert!(!exprs[0].as_str().unwrap().contains('!'));
        assert!(exprs[1].as_str().unwrap().starts_with("!(\n"));
    }

    #[test]
    fn no_groups_no_expressions() {
        let c = config(&[("instance-tag", "t"), ("dynamic-platforms", "linux/arm64")]);
        assert_eq!(group_cel(&c), "");
    }
}
