//! Reading a `host-config` ConfigMap from YAML (as written for `kubectl apply`).

use super::{ConfigData, Diagnostic, Severity};

/// A ConfigMap file that cannot be read at all.
#[derive(Debug, thiserror::Error)]
pub enum ConfigMapError {
    /// Not valid YAML.
    #[error("not valid YAML: {0}")]
    Yaml(#[from] serde_norway::Error),
    /// Valid YAML, but not a ConfigMap.
    #[error("not a ConfigMap: {0}")]
    NotConfigMap(String),
}

/// Reads the `data` of a ConfigMap document. Non-string scalar values are accepted (and stringified)
/// with a warning, because the API server rejects them: `max-instances: 250` must be quoted.
pub fn read_configmap_yaml(text: &str) -> Result<(ConfigData, Vec<Diagnostic>), ConfigMapError> {
    use serde_norway::Value;
    let doc: Value = serde_norway::from_str(text)?;
    let Value::Mapping(top) = doc else {
        return Err(ConfigMapError::NotConfigMap(
            "the document is not a mapping".into(),
        ));
    };
    let get = |k: &str| top.get(Value::String(k.to_owned()));
    match get("kind") {
        Some(Value::String(k)) if k == "ConfigMap" => {}
        Some(other) => {
            return Err(ConfigMapError::NotConfigMap(format!(
                "kind is {}",
                scalar_text(other).unwrap_or_else(|| "not a string".into())
            )));
        }
        None => return Err(ConfigMapError::NotConfigMap("no kind field".into())),
    }
    let mut data = ConfigData::new();
    let mut diags = Vec::new();
    match get("data") {
        None | Some(Value::Null) => {}
        Some(Value::Mapping(m)) => {
            for (k, v) in m {
                let Some(key) = scalar_text(k) else {
                    return Err(ConfigMapError::NotConfigMap(
                        "a data key is not a string".into(),
                    ));
                };
                match v {
                    Value::String(s) => {
                        data.insert(key, s.clone());
                    }
                    other => match scalar_text(other) {
                        Some(s) => {
                            diags.push(Diagnostic {
                                severity: Severity::Warning,
                                key: key.clone(),
                                value: Some(s.clone()),
                                message: "ConfigMap data values must be strings; quote it or the API server rejects the ConfigMap".into(),
                            });
                            data.insert(key, s);
                        }
                        None => {
                            diags.push(Diagnostic {
                                severity: Severity::Error,
                                key,
                                value: None,
                                message: "value is a list or mapping; ConfigMap data values must be strings".into(),
                            });
                        }
                    },
                }
            }
        }
        Some(_) => {
            return Err(ConfigMapError::NotConfigMap("data is not a mapping".into()));
        }
    }
    Ok((data, diags))
}

fn scalar_text(v: &serde_norway::Value) -> Option<String> {
    use serde_norway::Value;
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Null => Some(String::new()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_double_quoted_lists_and_block_scalars() {
        let text = r#"
apiVersion: v1
kind: ConfigMap
metadata:
  name: host-config
data:
  local-platforms: "\
    linux/x86_64,\
    local,\
    "
  additional-instance-tags: "\
    Project=Konflux,\
    ManagedBy=Konflux Infra Team,\
    cost-center=670\
    "
  dynamic.linux-arm64.user-data: |-
    #!/bin/bash
    echo hi
  dynamic.linux-arm64.max-instances: 250
"#;
        let (data, diags) = read_configmap_yaml(text).unwrap();
        assert_eq!(data["local-platforms"], "linux/x86_64,local,");
        assert_eq!(
            data["additional-instance-tags"],
            "Project=Konflux,ManagedBy=Konflux Infra Team,cost-center=670"
        );
        assert_eq!(
            data["dynamic.linux-arm64.user-data"],
            "#!/bin/bash\necho hi"
        );
        assert_eq!(data["dynamic.linux-arm64.max-instances"], "250");
        assert_eq!(diags.len(), 1);
        assert_eq!(diags[0].key, "dynamic.linux-arm64.max-instances");
    }

    #[test]
    fn rejects_non_configmaps() {
        assert!(matches!(
            read_configmap_yaml("kind: Secret\n"),
            Err(ConfigMapError::NotConfigMap(m)) if m.contains("Secret")
        ));
        assert!(matches!(
            read_configmap_yaml("a: [unclosed"),
            Err(ConfigMapError::Yaml(_))
        ));
        assert!(read_configmap_yaml("- 1\n").is_err());
        let (d, _) = read_configmap_yaml("kind: ConfigMap\n").unwrap();
        assert!(d.is_empty());
    }
}
