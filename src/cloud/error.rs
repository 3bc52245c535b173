//! Cloud errors: classification into what to do about them, and the config key at fault. Pure.

use std::fmt;

use crate::config::DynamicPlatform;

/// A cloud API operation; a bounded metric label value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// Launch instances.
    RunInstances,
    /// List or look up instances.
    DescribeInstances,
    /// Look up an image (root device name).
    DescribeImages,
    TerminateInstances,
    /// Set tags on an instance.
    CreateTags,
    /// Resize a boot volume (IBM Power VS).
    ResizeVolume,
}

impl Operation {
    /// Every operation, for metrics.
    pub const ALL: [Operation; 6] = [
        Self::RunInstances,
        Self::DescribeInstances,
        Self::DescribeImages,
        Self::TerminateInstances,
        Self::CreateTags,
        Self::ResizeVolume,
    ];

    /// The API name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RunInstances => "RunInstances",
            Self::DescribeInstances => "DescribeInstances",
            Self::DescribeImages => "DescribeImages",
            Self::TerminateInstances => "TerminateInstances",
            Self::CreateTags => "CreateTags",
            Self::ResizeVolume => "ResizeVolume",
        }
    }
}

/// What kind of failure, which decides whether and how to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// Rate limited: retry with back-off.
    Throttled,
    /// No capacity or quota left: retry with back-off.
    Capacity,
    /// Server error, timeout or connection failure: retry with back-off.
    Unavailable,
    /// The configuration or credentials are wrong: never retry, fix the ConfigMap or Secret.
    Config,
    /// The instance does not exist.
    NotFound,
    /// We refused: the instance is not ours, or the request could not be built.
    Refused,
    /// Anything else: a bounded number of retries.
    Other,
}

/// How a class of failure is retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryMode {
    /// Retry with exponential back-off, many times.
    Backoff,
    /// Retry a few times.
    Bounded,
    /// Do not retry.
    Never,
}

impl ErrorClass {
    /// Every class, for metrics.
    pub const ALL: [ErrorClass; 7] = [
        Self::Throttled,
        Self::Capacity,
        Self::Unavailable,
        Self::Config,
        Self::NotFound,
        Self::Refused,
        Self::Other,
    ];

    /// A bounded metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Throttled => "throttled",
            Self::Capacity => "capacity",
            Self::Unavailable => "unavailable",
            Self::Config => "config",
            Self::NotFound => "not_found",
            Self::Refused => "refused",
            Self::Other => "other",
        }
    }

    /// How this class is retried within one call.
    pub fn retry_mode(self) -> RetryMode {
        match self {
            Self::Throttled | Self::Capacity | Self::Unavailable => RetryMode::Backoff,
            Self::Other => RetryMode::Bounded,
            Self::Config | Self::NotFound | Self::Refused => RetryMode::Never,
        }
    }
}

const THROTTLED: &[&str] = &[
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "SlowDown",
    "PriorRequestNotComplete",
];

const CAPACITY: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "InsufficientAddressCapacity",
    "InsufficientFreeAddressesInSubnet",
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "MaxSpotInstanceCountExceeded",
    "SpotMaxPriceTooLow",
    "UnfulfillableCapacity",
];

const UNAVAILABLE: &[&str] = &[
    "Unavailable",
    "ServiceUnavailable",
    "InternalError",
    "InternalFailure",
    "RequestTimeout",
    "RequestTimeoutException",
];

/// Credential and permission failures: the `aws-secret` is at fault.
const AUTH: &[&str] = &[
    "AuthFailure",
    "UnauthorizedOperation",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "MissingAuthenticationToken",
    "IncompleteSignature",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "OptInRequired",
    "Blocked",
];

const CONFIG_PREFIXES: &[&str] = &[
    "InvalidAMIID.",
    "InvalidInstanceType",
    "InvalidKeyPair.",
    "InvalidSubnetID.",
    "InvalidSubnet",
    "InvalidGroup.",
    "InvalidGroupId.",
    "InvalidSecurityGroupID.",
    "InvalidParameter",
    "MissingParameter",
    "InvalidBlockDeviceMapping",
    "InvalidUserData.",
    "InvalidIamInstanceProfile",
    "Unsupported",
    "NoSuchEntity",
];

/// Codes meaning the spot market refused the request: fall back to on-demand.
const SPOT_REFUSED: &[&str] = &[
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "MaxSpotInstanceCountExceeded",
    "SpotMaxPriceTooLow",
    "UnfulfillableCapacity",
];

/// Classifies an error by its code and HTTP status. A missing code and status means the request
/// never got an answer (connection failure, timeout).
pub fn classify(code: Option<&str>, status: Option<u16>) -> ErrorClass {
    if let Some(code) = code {
        if THROTTLED.contains(&code) {
            return ErrorClass::Throttled;
        }
        if CAPACITY.contains(&code) {
            return ErrorClass::Capacity;
        }
        if UNAVAILABLE.contains(&code) {
            return ErrorClass::Unavailable;
        }
        if code.starts_with("InvalidInstanceID.") {
            return ErrorClass::NotFound;
        }
        if AUTH.contains(&code) || CONFIG_PREFIXES.iter().any(|p| code.starts_with(p)) {
            return ErrorClass::Config;
        }
    }
    match status {
        Some(s) if s >= 500 => ErrorClass::Unavailable,
        Some(429) => ErrorClass::Throttled,
        Some(401 | 403) if code.is_none() => ErrorClass::Config,
        None if code.is_none() => ErrorClass::Unavailable,
        _ => ErrorClass::Other,
    }
}

/// True when a spot launch failed because the spot market refused it.
pub fn is_spot_refusal(code: Option<&str>) -> bool {
    code.is_some_and(|c| SPOT_REFUSED.contains(&c))
}

/// The `dynamic.<p>.<field>` field a config error points at, if it can be told.
pub fn config_field(platform: &DynamicPlatform, code: &str, message: &str) -> Option<&'static str> {
    let sg = if platform.security_group_id.is_some() {
        "security-group-id"
    } else {
        "security-group"
    };
    let profile = if platform.instance_profile_arn.is_some() {
        "instance-profile-arn"
    } else {
        "instance-profile-name"
    };
    if AUTH.contains(&code) {
        return Some("aws-secret");
    }
    let by_code = [
        ("InvalidAMIID.", "ami"),
        ("InvalidInstanceType", "instance-type"),
        ("Unsupported", "instance-type"),
        ("InvalidKeyPair.", "key-name"),
        ("InvalidSubnet", "subnet-id"),
        ("InvalidGroup.", sg),
        ("InvalidGroupId.", sg),
        ("InvalidSecurityGroupID.", sg),
        ("InvalidBlockDeviceMapping", "disk"),
        ("InvalidUserData.", "user-data"),
        ("InvalidIamInstanceProfile", profile),
        ("NoSuchEntity", profile),
    ];
    if let Some((_, field)) = by_code.iter().find(|(p, _)| code.starts_with(p)) {
        return Some(field);
    }
    if code.starts_with("InvalidParameter") || code == "MissingParameter" {
        // The code is generic; the message names the parameter (`iamInstanceProfile.name`, ...).
        let m = message.to_ascii_lowercase();
        let by_message = [
            ("iaminstanceprofile", profile),
            ("instance profile", profile),
            ("iops", "iops"),
            ("throughput", "throughput"),
            ("volumesize", "disk"),
            ("volume size", "disk"),
            ("userdata", "user-data"),
            ("user data", "user-data"),
            ("instancetype", "instance-type"),
            ("instance type", "instance-type"),
            ("keyname", "key-name"),
            ("key pair", "key-name"),
            ("subnet", "subnet-id"),
            ("security group", sg),
            ("groupid", sg),
            ("groupname", sg),
            ("imageid", "ami"),
            ("image id", "ami"),
            ("ami", "ami"),
        ];
        return by_message
            .iter()
            .find(|(needle, _)| m.contains(needle))
            .map(|(_, f)| *f);
    }
    None
}

/// The configured value of a `dynamic.<p>.<field>` key, to quote in messages.
pub fn config_value(platform: &DynamicPlatform, field: &str) -> Option<String> {
    let opt = |v: &Option<String>| v.clone();
    match field {
        "ami" => Some(platform.ami.clone()),
        "instance-type" => Some(platform.instance_type.clone()),
        "key-name" => opt(&platform.key_name),
        "subnet-id" => opt(&platform.subnet_id),
        "security-group" => opt(&platform.security_group),
        "security-group-id" => opt(&platform.security_group_id),
        "instance-profile-name" => opt(&platform.instance_profile_name),
        "instance-profile-arn" => opt(&platform.instance_profile_arn),
        "aws-secret" => Some(platform.aws_secret.clone()),
        "disk" => Some(platform.disk_gb.to_string()),
        "iops" => platform.iops.map(|v| v.to_string()),
        "throughput" => platform.throughput.map(|v| v.to_string()),
        // User data can be long and may hold secrets: never quoted.
        _ => None,
    }
}

/// A failed cloud call, after retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudError {
    /// Platform (`linux/arm64`).
    pub platform: String,
    /// The operation that failed.
    pub operation: Operation,
    /// What kind of failure.
    pub class: ErrorClass,
    /// The cloud's error code, when it answered with one.
    pub code: Option<String>,
    /// The cloud's (or the transport's) message.
    pub message: String,
    /// The full config key at fault (`dynamic.linux-arm64.ami`), for config errors.
    pub config_key: Option<String>,
    /// The configured value of that key.
    pub config_value: Option<String>,
    /// Calls made, retries included.
    pub attempts: u32,
}

impl CloudError {
    /// True when trying again later may succeed (everything except config errors and refusals).
    pub fn is_retryable(&self) -> bool {
        !matches!(self.class, ErrorClass::Config | ErrorClass::Refused)
    }

    /// Builds an error for `platform`, naming the config key for config errors.
    pub fn new(
        platform: &DynamicPlatform,
        operation: Operation,
        class: ErrorClass,
        code: Option<String>,
        message: String,
        attempts: u32,
    ) -> Self {
        let field = match (class, code.as_deref()) {
            (ErrorClass::Config, Some(c)) => config_field(platform, c, &message),
            _ => None,
        };
        Self {
            platform: platform.platform.to_string(),
            operation,
            class,
            config_key: field.map(|f| format!("dynamic.{}.{f}", platform.platform.label_value())),
            config_value: field.and_then(|f| config_value(platform, f)),
            code,
            message,
            attempts,
        }
    }

    fn cause(&self) -> String {
        match &self.code {
            Some(c) => format!("{}: {c}: {}", self.operation.as_str(), self.message),
            None => format!("{}: {}", self.operation.as_str(), self.message),
        }
    }
}

impl fmt::Display for CloudError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.platform;
        match (self.class, &self.config_key) {
            (ErrorClass::Config, Some(key))
                if key.ends_with(".aws-secret") || key.ends_with(".secret") =>
            {
                write!(
                    f,
                    "dynamic platform {p}: the cloud rejected the credentials of the Secret named by {key}{} ({}); fix that Secret",
                    quoted(&self.config_value),
                    self.cause()
                )
            }
            (ErrorClass::Config, Some(key)) => write!(
                f,
                "dynamic platform {p}: the cloud rejected {key}{} ({}); fix the host-config ConfigMap",
                quoted(&self.config_value),
                self.cause()
            ),
            (ErrorClass::Config, None) => write!(
                f,
                "dynamic platform {p}: the cloud rejected the launch configuration ({}); check the dynamic.{}.* keys of the host-config ConfigMap",
                self.cause(),
                crate::platform::label_value(p)
            ),
            (class, _) => write!(
                f,
                "dynamic platform {p}: {} failed after {} attempt{} ({}): {}",
                self.operation.as_str(),
                self.attempts,
                if self.attempts == 1 { "" } else { "s" },
                class.as_str(),
                self.cause()
            ),
        }
    }
}

fn quoted(v: &Option<String>) -> String {
    v.as_ref().map(|v| format!("={v:?}")).unwrap_or_default()
}

impl std::error::Error for CloudError {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::testing::platform;

    #[test]
    fn classification_table() {
        use ErrorClass::*;
        let cases: &[(Option<&str>, Option<u16>, ErrorClass)] = &[
            (Some("RequestLimitExceeded"), Some(503), Throttled),
            (Some("Throttling"), Some(400), Throttled),
            (Some("InsufficientInstanceCapacity"), Some(500), Capacity),
            (Some("VcpuLimitExceeded"), Some(400), Capacity),
            (Some("Unavailable"), Some(503), Unavailable),
            (Some("InternalError"), Some(500), Unavailable),
            (None, Some(502), Unavailable),
            (None, None, Unavailable),
            (Some("SomethingNew"), Some(503), Unavailable),
            (Some("InvalidAMIID.NotFound"), Some(400), Config),
            (Some("InvalidAMIID.Malformed"), Some(400), Config),
            (Some("InvalidParameterValue"), Some(400), Config),
            (Some("InvalidKeyPair.NotFound"), Some(400), Config),
            (Some("InvalidSubnetID.NotFound"), Some(400), Config),
            (Some("InvalidGroup.NotFound"), Some(400), Config),
            (Some("InvalidInstanceType.NotFound"), Some(400), Config),
            (Some("AuthFailure"), Some(401), Config),
            (Some("UnauthorizedOperation"), Some(403), Config),
            (None, Some(403), Config),
            (Some("InvalidInstanceID.NotFound"), Some(400), NotFound),
            (Some("InvalidInstanceID.Malformed"), Some(400), NotFound),
            (Some("IdempotentParameterMismatch"), Some(400), Other),
            (None, Some(400), Other),
            (None, Some(429), Throttled),
        ];
        for (code, status, want) in cases {
            assert_eq!(classify(*code, *status), *want, "{code:?} {status:?}");
        }
    }

    #[test]
    fn retry_modes() {
        assert_eq!(ErrorClass::Throttled.retry_mode(), RetryMode::Backoff);
        assert_eq!(ErrorClass::Capacity.retry_mode(), RetryMode::Backoff);
        assert_eq!(ErrorClass::Unavailable.retry_mode(), RetryMode::Backoff);
        assert_eq!(ErrorClass::Other.retry_mode(), RetryMode::Bounded);
        assert_eq!(ErrorClass::Config.retry_mode(), RetryMode::Never);
        assert_eq!(ErrorClass::NotFound.retry_mode(), RetryMode::Never);
    }

    #[test]
    fn config_errors_name_the_key_and_value() {
        let mut p = platform();
        p.ami = "ami-bad".into();
        let e = CloudError::new(
            &p,
            Operation::RunInstances,
            ErrorClass::Config,
            Some("InvalidAMIID.NotFound".into()),
            "The image id '[ami-bad]' does not exist".into(),
            1,
        );
        assert_eq!(e.config_key.as_deref(), Some("dynamic.linux-arm64.ami"));
        assert_eq!(
            e.to_string(),
            "dynamic platform linux/arm64: the cloud rejected dynamic.linux-arm64.ami=\"ami-bad\" \
             (RunInstances: InvalidAMIID.NotFound: The image id '[ami-bad]' does not exist); \
             fix the host-config ConfigMap"
        );
        assert!(!e.is_retryable());
    }

    #[test]
    fn generic_parameter_errors_are_attributed_by_message() {
        let mut p = platform();
        p.instance_profile_name = Some("builder".into());
        p.iops = Some(99);
        let field = |code: &str, msg: &str| config_field(&p, code, msg);
        assert_eq!(
            field(
                "InvalidParameterValue",
                "Value (builder) for parameter iamInstanceProfile.name is invalid. Invalid IAM Instance Profile name"
            ),
            Some("instance-profile-name")
        );
        assert_eq!(
            field("InvalidParameterValue", "Invalid iops: 99 is below 3000"),
            Some("iops")
        );
        assert_eq!(
            field(
                "InvalidParameterValue",
                "Invalid value 'x1' for InstanceType."
            ),
            Some("instance-type")
        );
        assert_eq!(field("InvalidParameterCombination", "no hint here"), None);
        assert_eq!(
            field("NoSuchEntity", "Instance profile builder not found"),
            Some("instance-profile-name")
        );
        assert_eq!(field("InvalidGroup.NotFound", ""), Some("security-group"));
        p.security_group_id = Some("sg-1".into());
        let field = |code: &str, msg: &str| config_field(&p, code, msg);
        assert_eq!(
            field("InvalidGroup.NotFound", ""),
            Some("security-group-id")
        );
        assert_eq!(
            field("AuthFailure", "AWS was not able to validate"),
            Some("aws-secret")
        );
    }

    #[test]
    fn auth_errors_point_at_the_secret() {
        let e = CloudError::new(
            &platform(),
            Operation::DescribeInstances,
            ErrorClass::Config,
            Some("AuthFailure".into()),
            "AWS was not able to validate the provided access credentials".into(),
            1,
        );
        let s = e.to_string();
        assert!(s.contains("dynamic.linux-arm64.aws-secret=\"aws\""), "{s}");
        assert!(s.contains("fix that Secret"), "{s}");
    }

    #[test]
    fn unattributed_config_errors_point_at_the_platform_keys() {
        let e = CloudError::new(
            &platform(),
            Operation::RunInstances,
            ErrorClass::Config,
            Some("InvalidParameterCombination".into()),
            "nope".into(),
            1,
        );
        assert_eq!(e.config_key, None);
        assert!(e.to_string().contains("dynamic.linux-arm64.* keys"), "{e}");
    }

    #[test]
    fn transient_errors_report_attempts_and_class() {
        let e = CloudError::new(
            &platform(),
            Operation::DescribeInstances,
            ErrorClass::Throttled,
            Some("RequestLimitExceeded".into()),
            "Request limit exceeded.".into(),
            5,
        );
        assert!(e.is_retryable());
        assert_eq!(e.config_key, None);
        assert_eq!(
            e.to_string(),
            "dynamic platform linux/arm64: DescribeInstances failed after 5 attempts (throttled): \
             DescribeInstances: RequestLimitExceeded: Request limit exceeded."
        );
    }

    #[test]
    fn spot_refusals() {
        assert!(is_spot_refusal(Some("InsufficientInstanceCapacity")));
        assert!(is_spot_refusal(Some("SpotMaxPriceTooLow")));
        assert!(!is_spot_refusal(Some("RequestLimitExceeded")));
        assert!(!is_spot_refusal(None));
    }
}
