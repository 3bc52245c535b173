//! Build platforms as written in a TaskRun's `PLATFORM` param (`linux/arm64`, `local`, ...).
//!
//! Pure code: reading the `PLATFORM` value of a TaskRun ([`requested`], the one reading the
//! webhook and the controller share), parsing, the label form (`/` → `-`) and the node-affinity
//! values for local platforms.

use std::borrow::Cow;
use std::fmt;

use serde_json::Value;
use serde_json::value::RawValue;

use crate::contract::PLATFORM_PARAM;

/// Longest DNS-1035 label.
const MAX_LABEL_LEN: usize = 63;

/// Why a platform string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlatformError {
    /// Empty or whitespace-only.
    #[error("platform is empty")]
    Empty,
    /// Not of the form `os/arch`.
    #[error(
        "platform {0:?} is not of the form os/arch (for example linux/arm64) nor a single lowercase name"
    )]
    NotOsArch(String),
    /// One part is not a DNS-1035 label (lowercase letters, digits, '-', starting with a letter).
    #[error(
        "platform {platform:?}: {part:?} is not a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, at most 63 characters)"
    )]
    BadPart {
        /// The whole platform string.
        platform: String,
        /// The offending part.
        part: String,
    },
}

/// A validated platform: `os/arch` (each part a DNS-1035 label), `linux/x86_64`, or a bare name
/// that is one DNS-1035 label (`local`, `localhost`; existing configs also use names such as
/// `test-platform` in `local-platforms`). Bare names carry no os/arch, so they get no node affinity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Platform(String);

impl Platform {
    /// Parses and validates a platform string; surrounding whitespace is ignored.
    pub fn parse(s: &str) -> Result<Self, PlatformError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(PlatformError::Empty);
        }
        if s == "linux/x86_64" || is_dns1035_label(s) {
            return Ok(Self(s.to_owned()));
        }
        let Some((os, arch)) = s.split_once('/') else {
            return Err(PlatformError::NotOsArch(s.to_owned()));
        };
        for part in [os, arch] {
            if !is_dns1035_label(part) {
                return Err(PlatformError::BadPart {
                    platform: s.to_owned(),
                    part: part.to_owned(),
                });
            }
        }
        Ok(Self(s.to_owned()))
    }

    /// The platform as written (`linux/arm64`).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The label and config-key form: `/` replaced by `-` (`linux/arm64` → `linux-arm64`).
    pub fn label_value(&self) -> String {
        label_value(&self.0)
    }

    /// True for bare names (`local`, `localhost`, ...), which have no os/arch and so no affinity.
    pub fn is_bare_name(&self) -> bool {
        !self.0.contains('/')
    }

    /// `kubernetes.io/os` and `kubernetes.io/arch` values for a local platform, `None` for bare names.
    ///
    /// `x86_64` maps to `amd64` and `aarch64` to `arm64`, the names nodes are labelled with.
    pub fn node_os_arch(&self) -> Option<(&str, &str)> {
        let (os, arch) = self.0.split_once('/')?;
        let arch = match arch {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        Some((os, arch))
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The label form of any platform string, valid or not (`/` → `-`).
pub fn label_value(platform: &str) -> String {
    platform.replace('/', "-")
}

/// True when `s` is a DNS-1035 label: `[a-z]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1035_label(s: &str) -> bool {
    is_dns1123_label(s) && s.as_bytes()[0].is_ascii_lowercase()
}

/// True when `s` is a DNS-1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_LABEL_LEN
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
}

/// A TaskRun's `PLATFORM` value as written ([`requested`]).
#[derive(Debug, Clone, PartialEq)]
pub enum PlatformValue<'a> {
    /// A JSON string: the platform, still to be validated ([`Platform::parse`]).
    Text(Cow<'a, str>),
    /// Any other JSON value (array, object, number, boolean): a malformed platform.
    NotString(Value),
}

impl PlatformValue<'_> {
    /// The string, or the compact JSON text of any other value (what logs and error messages
    /// show, the same whichever reader read it).
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            PlatformValue::Text(s) => Cow::Borrowed(s),
            PlatformValue::NotString(v) => Cow::Owned(v.to_string()),
        }
    }
}

/// A JSON value as a TaskRun reader holds it: parsed (`serde_json::Value`) or raw (`RawValue`,
/// the webhook's borrowed view).
pub trait JsonValue {
    /// The value as a `PLATFORM` value; `None` for `null`.
    fn platform_value(&self) -> Option<PlatformValue<'_>>;
}

impl JsonValue for Value {
    fn platform_value(&self) -> Option<PlatformValue<'_>> {
        match self {
            Value::Null => None,
            Value::String(s) => Some(PlatformValue::Text(Cow::Borrowed(s))),
            other => Some(PlatformValue::NotString(other.clone())),
        }
    }
}

impl JsonValue for RawValue {
    fn platform_value(&self) -> Option<PlatformValue<'_>> {
        let json = self.get();
        // A string without escapes is borrowed as is; any other value is rare (a malformed
        // platform) and parsed whole.
        if let Ok(s) = serde_json::from_str::<&str>(json) {
            return Some(PlatformValue::Text(Cow::Borrowed(s)));
        }
        match serde_json::from_str::<Value>(json).ok()? {
            Value::Null => None,
            Value::String(s) => Some(PlatformValue::Text(Cow::Owned(s))),
            other => Some(PlatformValue::NotString(other)),
        }
    }
}

/// The `PLATFORM` value a TaskRun asks for, from its `params` (name, value) and, in order, the
/// params (name, default) of the Task specs the reader has: the inline `spec.taskSpec`, then the
/// resolved `status.taskSpec` (the webhook, at CREATE, has only the first).
///
/// The TaskRun's own param wins when it has one, even with a `null` or missing value (then there
/// is no platform: a Task default never fills in a param the TaskRun set); else the default of
/// the first Task spec that declares the param. The first of duplicate names counts.
pub fn requested<
    's,
    'v,
    V: JsonValue + ?Sized + 'v,
    S: IntoIterator<Item = (&'s str, Option<&'v V>)>,
>(
    params: impl IntoIterator<Item = (&'s str, Option<&'v V>)>,
    task_specs: impl IntoIterator<Item = S>,
) -> Option<PlatformValue<'v>> {
    let declared = |(name, _): &(&str, _)| *name == PLATFORM_PARAM;
    let (_, value) = params.into_iter().find(declared).or_else(|| {
        task_specs
            .into_iter()
            .find_map(|ps| ps.into_iter().find(declared))
    })?;
    value?.platform_value()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_os_arch_and_special_names() {
        for ok in [
            "linux/arm64",
            "linux/amd64",
            "linux-mlarge/arm64",
            "windows/c4xlarge-amd64",
            "linux/s390x",
            "local",
            "localhost",
            "linux/x86_64",
            " linux/ppc64le ",
            "test-platform",
        ] {
            assert!(Platform::parse(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_malformed() {
        assert_eq!(Platform::parse(""), Err(PlatformError::Empty));
        assert!(matches!(
            Platform::parse("Linux"),
            Err(PlatformError::NotOsArch(_))
        ));
        assert!(matches!(
            Platform::parse("linux_amd64"),
            Err(PlatformError::NotOsArch(_))
        ));
        for bad in [
            "linux/AMD64",
            "linux/arm64/v8",
            "/arm64",
            "linux/",
            "linux/-arm",
            "linux/arm-",
            "1inux/arm64",
            "linux/ar m",
            "linux/aarch64_be",
        ] {
            assert!(
                matches!(Platform::parse(bad), Err(PlatformError::BadPart { .. })),
                "{bad}: {:?}",
                Platform::parse(bad)
            );
        }
        let long = format!("linux/{}", "a".repeat(64));
        assert!(Platform::parse(&long).is_err());
        let max = format!("linux/{}", "a".repeat(63));
        assert!(Platform::parse(&max).is_ok());
    }

    #[test]
    fn label_and_node_values() {
        let p = Platform::parse("linux-mlarge/arm64").unwrap();
        assert_eq!(p.label_value(), "linux-mlarge-arm64");
        assert_eq!(p.node_os_arch(), Some(("linux-mlarge", "arm64")));
        let p = Platform::parse("linux/x86_64").unwrap();
        assert_eq!(p.node_os_arch(), Some(("linux", "amd64")));
        let p = Platform::parse("linux/aarch64").unwrap();
        assert_eq!(p.node_os_arch(), Some(("linux", "arm64")));
        let p = Platform::parse("localhost").unwrap();
        assert!(p.is_bare_name());
        assert_eq!(p.node_os_arch(), None);
    }
}
