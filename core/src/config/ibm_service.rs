//! What an IBM Cloud platform is once parsed: the service kind, the VPC or Power VS settings, the
//! workspace CRN. Apart from the parser (`ibm.rs`) so the platform types can hold it without
//! importing the parser back.

use std::fmt;

/// Which IBM service a platform uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IbmKind {
    /// `ibmz`: IBM Cloud VPC (s390x virtual servers).
    Vpc,
    /// `ibmp`: Power Virtual Server (ppc64le).
    Power,
}

impl IbmKind {
    /// The `type` value naming this kind, if it is one.
    pub fn from_type(value: &str) -> Option<Self> {
        match value.trim() {
            "ibmz" => Some(Self::Vpc),
            "ibmp" => Some(Self::Power),
            _ => None,
        }
    }
}

impl fmt::Display for IbmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Vpc => "ibmz",
            Self::Power => "ibmp",
        })
    }
}

/// A parsed `ibmz` platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IbmVpcPlatform {
    /// VPC API endpoint (`url`), e.g. `https://us-east.iaas.cloud.ibm.com/v1`.
    pub url: String,
    /// Zone the instance is created in (Go reads it from `region`).
    pub zone: String,
    /// VPC, subnet and SSH key by name (resolved with `GET /vpcs`, `/subnets`, `/keys`).
    pub vpc: String,
    pub subnet: String,
    pub key: String,
    /// Boot image id.
    pub image_id: String,
    /// Instance profile, e.g. `bz2-2x8`.
    pub profile: String,
    /// `private-ip`. Only private addresses are used whatever it says (see the warning).
    pub private_ip: bool,
    /// Boot volume, GB.
    pub disk_gb: u32,
}

/// A parsed `ibmp` platform.
#[derive(Debug, Clone, PartialEq)]
pub struct IbmPowerPlatform {
    /// Regional Power VS endpoint (`url`).
    pub url: String,
    /// Workspace CRN, sent as the `CRN` header of every call.
    pub crn: PowerCrn,
    /// SSH key name.
    pub key: String,
    /// Boot image id or name.
    pub image: String,
    /// Network ids.
    pub networks: Vec<String>,
    /// System type, e.g. `e980`.
    pub system: String,
    /// Processors (shared).
    pub cores: f64,
    /// Memory, GB.
    pub memory_gb: f64,
    /// Boot volume, GB (at least the parser's minimum, 100).
    pub disk_gb: u32,
    /// Raw cloud-init user-data.
    pub user_data: Option<String>,
}

// `cores` and `memory` are parsed finite and positive, so equality is reflexive.
impl Eq for IbmPowerPlatform {}

/// The service-specific part of an IBM platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IbmService {
    Vpc(IbmVpcPlatform),
    Power(IbmPowerPlatform),
}

impl IbmService {
    /// The kind of service.
    pub fn kind(&self) -> IbmKind {
        match self {
            Self::Vpc(_) => IbmKind::Vpc,
            Self::Power(_) => IbmKind::Power,
        }
    }
    /// What instance lookups are batched by (with the API key): the VPC endpoint, or the Power
    /// VS endpoint and workspace (one endpoint serves many workspaces).
    pub fn scope(&self) -> String {
        match self {
            Self::Vpc(v) => v.url.clone(),
            Self::Power(p) => format!(
                "{}/pcloud/v1/cloud-instances/{}",
                p.url.trim_end_matches('/'),
                p.crn.cloud_instance_id()
            ),
        }
    }
    /// The API endpoint (`url`).
    pub fn url(&self) -> &str {
        match self {
            Self::Vpc(v) => &v.url,
            Self::Power(p) => &p.url,
        }
    }
}

/// A Power VS workspace CRN: `crn:v1:<cloud>:<type>:power-iaas:<location>:a/<account>:<instance>::`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PowerCrn {
    crn: String,
    cloud_instance_id: String,
}

/// Why a CRN is refused (Go's reasons).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CrnError {
    #[error("invalid CRN: must start with 'crn:'")]
    Prefix,
    #[error("invalid CRN format: expected 10 segments, but got {0}")]
    Segments(usize),
    #[error("invalid CRN service name: expected 'power-iaas', but got '{0}'")]
    Service(String),
    #[error("this resource is global and has no service instance")]
    Global,
    #[error("the service instance is null")]
    NoInstance,
}

impl PowerCrn {
    /// Parses a workspace CRN with Go's rules: `crn:` prefix, 10 `:` segments, segment 4
    /// `power-iaas`, segment 5 not `global`, segment 7 (the cloud instance id) not empty.
    pub fn parse(value: &str) -> Result<Self, CrnError> {
        let v = value.trim();
        if !v.starts_with("crn:") {
            return Err(CrnError::Prefix);
        }
        let seg: Vec<&str> = v.split(':').collect();
        if seg.len() != 10 {
            return Err(CrnError::Segments(seg.len()));
        }
        if seg[4] != "power-iaas" {
            return Err(CrnError::Service(seg[4].to_owned()));
        }
        if seg[5] == "global" {
            return Err(CrnError::Global);
        }
        if seg[7].is_empty() {
            return Err(CrnError::NoInstance);
        }
        Ok(Self {
            crn: v.to_owned(),
            cloud_instance_id: seg[7].to_owned(),
        })
    }
    /// The whole CRN (the `CRN` header).
    pub fn as_str(&self) -> &str {
        &self.crn
    }
    /// The cloud instance (workspace) id in `/pcloud/v1/cloud-instances/{id}`.
    pub fn cloud_instance_id(&self) -> &str {
        &self.cloud_instance_id
    }
}
