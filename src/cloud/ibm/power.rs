//! The IBM Power Virtual Server API calls of the `ibmp` provider
//! (`/pcloud/v1/cloud-instances/{cloud}/...`, every call with header `CRN: <workspace crn>`).
//! Field names are those of IBM's published models (`power-go-client`: `PVMInstanceCreate`,
//! `PVMInstance`, `PVMInstanceNetwork`, `UpdateVolume`, `ImageReference`).

use std::sync::Arc;

use http::Method;
use serde_json::{Value, json};

use super::http::{CallError, Http, encode, endpoint_ok};
use super::iam::{Iam, IamError};
use crate::cloud::ErrorClass;
use crate::config::ibm::{IbmPowerPlatform, PowerCrn};
use crate::scheduler::InstanceState;

/// Why a Power VS call failed.
#[derive(Debug, thiserror::Error)]
pub enum PowerError {
    #[error("Power VS API URL {0:?} is not https (plain http is allowed on loopback only)")]
    InvalidUrl(String),
    #[error("Power VS API {path}: {source}")]
    Call {
        path: String,
        #[source]
        source: CallError,
    },
    #[error("Power VS API {path}: answer is not what the API documents: {reason}")]
    BadAnswer { path: String, reason: String },
    #[error("Power VS: no image with id or name {0:?} in the workspace (dynamic.<platform>.image)")]
    NoSuchImage(String),
}

impl PowerError {
    /// IBM's error code, when the API answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Call {
                source: CallError::Http { code, .. },
                ..
            } => code.as_deref(),
            _ => None,
        }
    }

    /// How to treat it, and the config key at fault. Conflicts and bad requests of the volume
    /// API are retried a few times (Go: it "randomly throws conflicts or bad requests").
    pub fn class_and_field(&self) -> (ErrorClass, Option<&'static str>) {
        match self {
            Self::InvalidUrl(_) => (ErrorClass::Config, Some("url")),
            Self::NoSuchImage(_) => (ErrorClass::Config, Some("image")),
            Self::BadAnswer { .. } => (ErrorClass::Other, None),
            Self::Call { source, .. } => match source {
                CallError::Iam(IamError::Refused { .. }) => (ErrorClass::Config, Some("secret")),
                CallError::Iam(_) | CallError::Transport(_) => (ErrorClass::Unavailable, None),
                CallError::BadAnswer(_) => (ErrorClass::Other, None),
                CallError::Http { status, .. } => match status {
                    401 | 403 => (ErrorClass::Config, Some("secret")),
                    404 => (ErrorClass::NotFound, None),
                    429 => (ErrorClass::Throttled, None),
                    s if *s >= 500 => (ErrorClass::Unavailable, None),
                    _ => (ErrorClass::Other, None),
                },
            },
        }
    }

    fn status(&self) -> Option<u16> {
        match self {
            Self::Call { source, .. } => source.status(),
            _ => None,
        }
    }
}

/// One Power VS instance as the provider sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PowerInstance {
    pub id: String,
    pub name: String,
    pub crn: Option<String>,
    /// `BUILD`, `ACTIVE`, `ERROR`, `SHUTOFF`, `DELETING`, ...
    pub status: String,
    /// `health.status`: `OK`, `WARNING`, `CRITICAL`, `PENDING`; absent on some answers.
    pub health: Option<String>,
    /// First network's external address, else its address.
    pub address: Option<String>,
    /// Boot volume (the first of `volumeIDs`).
    pub boot_volume: Option<String>,
    /// `diskSize`, GB.
    pub disk_gb: Option<f64>,
    pub sys_type: Option<String>,
    pub created_at: Option<String>,
}

impl PowerInstance {
    /// The instance in an answer; `None` without an id or name (never a panic).
    pub fn from_json(v: &Value) -> Option<Self> {
        let s = |p: &str| v.pointer(p).and_then(Value::as_str).map(str::to_owned);
        let ip_ok = |a: &String| {
            a.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| !ip.is_unspecified())
        };
        let first = v
            .get("networks")
            .and_then(Value::as_array)
            .filter(|n| !n.is_empty())
            .or_else(|| v.get("addresses").and_then(Value::as_array))
            .and_then(|n| n.first());
        let address = first.and_then(|n| {
            ["externalIP", "ipAddress", "ip"]
                .iter()
                .filter_map(|k| n.get(*k).and_then(Value::as_str))
                .map(str::to_owned)
                .find(ip_ok)
        });
        Some(Self {
            id: s("/pvmInstanceID").filter(|i| !i.is_empty())?,
            name: s("/serverName")?,
            crn: s("/crn").filter(|c| !c.is_empty()),
            status: s("/status").unwrap_or_default(),
            health: s("/health/status"),
            address,
            boot_volume: v
                .pointer("/volumeIDs/0")
                .and_then(Value::as_str)
                .map(str::to_owned),
            disk_gb: v.get("diskSize").and_then(Value::as_f64),
            sys_type: s("/sysType"),
            created_at: s("/creationDate"),
        })
    }

    /// The scheduler's state. Failed is `ERROR` with health `CRITICAL` (Go's rule); `ERROR`
    /// without a health yet is still booting.
    pub fn state(&self) -> InstanceState {
        let critical = self.health.as_deref() == Some("CRITICAL");
        match self.status.to_ascii_uppercase().as_str() {
            "ERROR" if critical => InstanceState::Stopped,
            "ERROR" | "BUILD" | "PENDING" | "WARNING" | "RESIZE" | "VERIFY_RESIZE" => {
                InstanceState::Pending
            }
            "ACTIVE" => InstanceState::Running,
            "DELETING" | "REMOVED" => InstanceState::ShuttingDown,
            "SHUTOFF" | "STOPPED" => InstanceState::Stopped,
            "STOPPING" => InstanceState::Stopping,
            _ => InstanceState::Unknown,
        }
    }
}

/// The `PVMInstanceCreate` body of a launch.
pub fn create_body(cfg: &IbmPowerPlatform, name: &str, image_id: &str, tags: &[String]) -> Value {
    let mut body = json!({
        "serverName": name,
        "imageID": image_id,
        "processors": cfg.cores,
        "procType": "shared",
        "memory": cfg.memory_gb,
        "networks": cfg.networks.iter().map(|n| json!({"networkID": n})).collect::<Vec<_>>(),
        "keyPairName": cfg.key,
        "sysType": cfg.system,
        "userTags": tags,
    });
    if let Some(u) = &cfg.user_data {
        body["userData"] = json!(crate::cloud::launch::encode_user_data(u));
    }
    body
}

/// A Power VS client for one workspace.
pub struct PowerClient {
    base: String,
    crn: PowerCrn,
    iam: Arc<Iam>,
    http: Http,
}

impl PowerClient {
    /// A client for the regional endpoint `url` and workspace `crn`.
    pub fn new(url: &str, crn: PowerCrn, iam: Arc<Iam>, http: Http) -> Result<Self, PowerError> {
        let base = url.trim_end_matches('/').to_owned();
        if !endpoint_ok(&base) {
            return Err(PowerError::InvalidUrl(url.to_owned()));
        }
        Ok(Self {
            base,
            crn,
            iam,
            http,
        })
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, PowerError> {
        let url = format!(
            "{}/pcloud/v1/cloud-instances/{}{path}",
            self.base,
            encode(self.crn.cloud_instance_id())
        );
        self.http
            .call(&self.iam, method, &url, &[("CRN", self.crn.as_str())], body)
            .await
            .map_err(|source| PowerError::Call {
                path: path.to_owned(),
                source,
            })
    }

    /// Every instance of the workspace.
    pub async fn instances(&self) -> Result<Vec<PowerInstance>, PowerError> {
        let v = self.call(Method::GET, "/pvm-instances", None).await?;
        let items = v
            .get("pvmInstances")
            .and_then(Value::as_array)
            .ok_or_else(|| PowerError::BadAnswer {
                path: "/pvm-instances".into(),
                reason: "no pvmInstances array".into(),
            })?;
        Ok(items.iter().filter_map(PowerInstance::from_json).collect())
    }

    /// The instance named `name`.
    pub async fn instance_named(&self, name: &str) -> Result<Option<PowerInstance>, PowerError> {
        Ok(self.instances().await?.into_iter().find(|i| i.name == name))
    }

    /// One instance by id; `None` when unknown.
    pub async fn instance(&self, id: &str) -> Result<Option<PowerInstance>, PowerError> {
        match self
            .call(Method::GET, &format!("/pvm-instances/{}", encode(id)), None)
            .await
        {
            Ok(v) => Ok(PowerInstance::from_json(&v)),
            Err(e) if e.status() == Some(404) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The id of the image `image` names (an id or a name, as Go accepts).
    pub async fn image_id(&self, image: &str) -> Result<String, PowerError> {
        let v = self.call(Method::GET, "/images", None).await?;
        let images = v.get("images").and_then(Value::as_array);
        let field = |i: &Value, k: &str| i.get(k).and_then(Value::as_str).map(str::to_owned);
        images
            .into_iter()
            .flatten()
            .find(|i| field(i, "imageID").as_deref() == Some(image))
            .or_else(|| {
                images
                    .into_iter()
                    .flatten()
                    .find(|i| field(i, "name").as_deref() == Some(image))
            })
            .and_then(|i| field(i, "imageID"))
            .ok_or_else(|| PowerError::NoSuchImage(image.to_owned()))
    }

    /// `POST /pvm-instances`; the answer is an array of the instances created.
    pub async fn create(&self, body: &Value) -> Result<PowerInstance, PowerError> {
        let v = self
            .call(Method::POST, "/pvm-instances", Some(body))
            .await?;
        v.as_array()
            .and_then(|a| a.first())
            .and_then(PowerInstance::from_json)
            .ok_or_else(|| PowerError::BadAnswer {
                path: "/pvm-instances".into(),
                reason: "not an array holding the created instance".into(),
            })
    }

    /// Deletes an instance with its data volumes; false when unknown.
    pub async fn delete(&self, id: &str) -> Result<bool, PowerError> {
        match self
            .call(
                Method::DELETE,
                &format!("/pvm-instances/{}?delete_data_volumes=true", encode(id)),
                None,
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if e.status() == Some(404) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Resizes volume `id` to `gb` (`UpdateVolume`).
    pub async fn resize(&self, id: &str, gb: u32) -> Result<(), PowerError> {
        self.call(
            Method::PUT,
            &format!("/volumes/{}", encode(id)),
            Some(&json!({"size": gb})),
        )
        .await
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_needs_error_and_critical_and_a_missing_health_is_not_a_crash() {
        let mut v =
            json!({"pvmInstanceID": "p1", "serverName": "t-0123456789abcdefx", "status": "ERROR"});
        let i = PowerInstance::from_json(&v).unwrap();
        assert_eq!(i.health, None);
        assert_eq!(i.state(), InstanceState::Pending, "no health yet");
        v["health"] = json!({"status": "CRITICAL"});
        assert_eq!(
            PowerInstance::from_json(&v).unwrap().state(),
            InstanceState::Stopped
        );
        v["status"] = json!("ACTIVE");
        v["health"] = json!(null);
        let i = PowerInstance::from_json(&v).unwrap();
        assert_eq!(i.state(), InstanceState::Running);
        assert_eq!(i.address, None, "no networks: no address, not a panic");
        assert!(PowerInstance::from_json(&json!({"serverName": 1})).is_none());
    }

    #[test]
    fn address_prefers_the_external_ip_of_the_first_network() {
        let v = json!({"pvmInstanceID": "p1", "serverName": "n", "status": "ACTIVE",
            "networks": [{"ipAddress": "10.0.0.5", "externalIP": ""}, {"ipAddress": "10.9.9.9"}],
            "volumeIDs": ["vol-1"], "diskSize": 20.0});
        let i = PowerInstance::from_json(&v).unwrap();
        assert_eq!(i.address.as_deref(), Some("10.0.0.5"));
        assert_eq!(i.boot_volume.as_deref(), Some("vol-1"));
        assert_eq!(i.disk_gb, Some(20.0));
    }
}
