//! How build users are set up on a host: the key type of their SSH key and the systemd resource
//! caps of their slice. Set per static host (`host.<name>.<field>`) or per dynamic platform or
//! pool (`dynamic.<p>.<field>`):
//!
//! - `key-type`: `ed25519` (default), `rsa` (= `rsa-3072`) or `rsa-4096`, for hosts in FIPS mode
//!   whose sshd refuses ed25519.
//! - `memory-max`: systemd `MemoryMax=` of the user's slice: bytes with an optional `K`, `M`, `G`
//!   or `T` suffix (base 1024), or a percentage of the host's memory (`1%`..`100%`).
//! - `cpu-quota`: systemd `CPUQuota=` of the user's slice, in percent of one CPU (`200%` = two
//!   CPUs).
//!
//! The Go controller's provisioning writes no slice, so neither cap is set unless configured;
//! hosts without systemd skip the slice.

use std::collections::BTreeMap;
use std::fmt;

use super::values::ValueError;
use crate::platform::Platform;

/// The ConfigMap fields this module reads, under `host.<name>.` and `dynamic.<p>.`.
pub const FIELDS: [&str; 3] = ["key-type", "memory-max", "cpu-quota"];

/// Key pair type of build users.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyType {
    /// Ed25519 (the default).
    #[default]
    Ed25519,
    /// RSA with this many bits (3072 or 4096).
    Rsa {
        /// Modulus size.
        bits: u32,
    },
}

impl KeyType {
    /// Parses a `key-type` value.
    pub fn parse(value: &str) -> Result<Self, ValueError> {
        match value.trim() {
            "ed25519" => Ok(Self::Ed25519),
            "rsa" | "rsa-3072" => Ok(Self::Rsa { bits: 3072 }),
            "rsa-4096" => Ok(Self::Rsa { bits: 4096 }),
            _ => Err(ValueError::KeyType),
        }
    }
}

impl fmt::Display for KeyType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ed25519 => f.write_str("ed25519"),
            Self::Rsa { bits } => write!(f, "rsa-{bits}"),
        }
    }
}

/// A validated systemd `MemoryMax=` value (`8G`, `512M`, `75%`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryMax(String);

impl MemoryMax {
    /// Parses a `memory-max` value.
    pub fn parse(value: &str) -> Result<Self, ValueError> {
        let v = value.trim();
        let bad = || Err(ValueError::MemorySize);
        if let Some(pct) = v.strip_suffix('%') {
            return match pct.parse::<u8>() {
                Ok(1..=100) if !pct.starts_with('0') => Ok(Self(v.to_owned())),
                _ => bad(),
            };
        }
        let digits = v.strip_suffix(['K', 'M', 'G', 'T']).unwrap_or(v);
        // At most 15 digits: no suffix overflows systemd's 64-bit byte count.
        if digits.is_empty()
            || digits.len() > 15
            || digits.starts_with('0')
            || !digits.bytes().all(|b| b.is_ascii_digit())
        {
            return bad();
        }
        Ok(Self(v.to_owned()))
    }

    /// The value as systemd reads it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A validated systemd `CPUQuota=`, in percent of one CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuQuota(u32);

impl CpuQuota {
    /// Largest accepted quota: 1024 CPUs.
    pub const MAX_PERCENT: u32 = 102_400;

    /// Parses a `cpu-quota` value (`250%`).
    pub fn parse(value: &str) -> Result<Self, ValueError> {
        let bad = || {
            Err(ValueError::CpuQuota {
                max: Self::MAX_PERCENT,
            })
        };
        let Some(pct) = value.trim().strip_suffix('%') else {
            return bad();
        };
        if pct.starts_with(['0', '+']) {
            return bad();
        }
        match pct.parse::<u32>() {
            Ok(n @ 1..=Self::MAX_PERCENT) => Ok(Self(n)),
            _ => bad(),
        }
    }

    /// Percent of one CPU.
    pub fn percent(self) -> u32 {
        self.0
    }
}

/// Build-user setup of one host or platform. The default is what the Go controller does: ed25519
/// keys (ours; Go generated RSA on the host), no slice.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BuildUserSettings {
    /// Key pair type.
    pub key_type: KeyType,
    /// `MemoryMax=` of the user's slice.
    pub memory_max: Option<MemoryMax>,
    /// `CPUQuota=` of the user's slice.
    pub cpu_quota: Option<CpuQuota>,
}

impl BuildUserSettings {
    /// Ed25519 keys, no slice.
    pub const DEFAULT: Self = Self {
        key_type: KeyType::Ed25519,
        memory_max: None,
        cpu_quota: None,
    };

    /// Whether provisioning writes a slice drop-in.
    pub fn has_slice(&self) -> bool {
        self.memory_max.is_some() || self.cpu_quota.is_some()
    }

    /// `key-type rsa-3072, memory-max 8G, cpu-quota 200%` (for `mpc check-config`).
    pub fn describe(&self) -> String {
        let mut parts = vec![format!("key-type {}", self.key_type)];
        if let Some(m) = &self.memory_max {
            parts.push(format!("memory-max {}", m.as_str()));
        }
        if let Some(c) = self.cpu_quota {
            parts.push(format!("cpu-quota {}%", c.percent()));
        }
        parts.join(", ")
    }

    /// Reads the [`FIELDS`] of one `host.<name>.*` or `dynamic.<p>.*` group; every bad value is
    /// reported through `error(field, value, message)`, and any makes the result `Err(())`.
    pub(super) fn parse<'v>(
        get: impl Fn(&str) -> Option<&'v str>,
        mut error: impl FnMut(&str, &str, ValueError),
    ) -> Result<Self, ()> {
        let mut ok = true;
        let key_type = field(&get, &mut error, &mut ok, "key-type", KeyType::parse);
        let memory_max = field(&get, &mut error, &mut ok, "memory-max", MemoryMax::parse);
        let cpu_quota = field(&get, &mut error, &mut ok, "cpu-quota", CpuQuota::parse);
        if !ok {
            return Err(());
        }
        Ok(Self {
            key_type: key_type.unwrap_or_default(),
            memory_max,
            cpu_quota,
        })
    }
}

/// `get(name)` parsed by `parse`; a bad value is reported through `error` and clears `ok`.
fn field<'v, T>(
    get: &impl Fn(&str) -> Option<&'v str>,
    error: &mut impl FnMut(&str, &str, ValueError),
    ok: &mut bool,
    name: &str,
    parse: fn(&str) -> Result<T, ValueError>,
) -> Option<T> {
    let v = get(name)?;
    match parse(v) {
        Ok(t) => Some(t),
        Err(e) => {
            error(name, v, e);
            *ok = false;
            None
        }
    }
}

static DEFAULT: BuildUserSettings = BuildUserSettings::DEFAULT;

/// The build-user settings of every static host and dynamic platform that sets any; the rest use
/// [`BuildUserSettings::DEFAULT`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BuildUsers {
    /// By static host name.
    pub hosts: BTreeMap<String, BuildUserSettings>,
    /// By dynamic platform or pool.
    pub platforms: BTreeMap<Platform, BuildUserSettings>,
}

impl BuildUsers {
    /// Settings for users on static host `name`.
    pub fn for_static_host(&self, name: &str) -> &BuildUserSettings {
        self.hosts.get(name).unwrap_or(&DEFAULT)
    }

    /// Settings for users on instances of dynamic platform or pool `platform`.
    pub fn for_platform(&self, platform: &Platform) -> &BuildUserSettings {
        self.platforms.get(platform).unwrap_or(&DEFAULT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_types() {
        assert_eq!(KeyType::parse("ed25519"), Ok(KeyType::Ed25519));
        assert_eq!(KeyType::parse(" rsa "), Ok(KeyType::Rsa { bits: 3072 }));
        assert_eq!(KeyType::parse("rsa-3072"), Ok(KeyType::Rsa { bits: 3072 }));
        assert_eq!(KeyType::parse("rsa-4096"), Ok(KeyType::Rsa { bits: 4096 }));
        for bad in ["RSA", "rsa-2048", "rsa-1024", "dsa", "ecdsa", ""] {
            assert!(KeyType::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(KeyType::Rsa { bits: 4096 }.to_string(), "rsa-4096");
        assert_eq!(KeyType::default().to_string(), "ed25519");
    }

    #[test]
    fn memory_max_values() {
        for ok in ["8G", "512M", "1048576", "1T", "64K", "100%", "1%", " 16G "] {
            assert_eq!(
                MemoryMax::parse(ok).map(|m| m.as_str().to_owned()),
                Ok(ok.trim().to_owned()),
                "{ok}"
            );
        }
        for bad in [
            "",
            "0",
            "08G",
            "8g",
            "8GB",
            "8 G",
            "-1G",
            "0%",
            "101%",
            "50.5%",
            "infinity",
            "1234567890123456",
            "8G\nCPUQuota=1%",
            "%",
        ] {
            assert!(MemoryMax::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cpu_quota_values() {
        assert_eq!(CpuQuota::parse("200%").map(CpuQuota::percent), Ok(200));
        assert_eq!(CpuQuota::parse("1%").map(CpuQuota::percent), Ok(1));
        for bad in [
            "", "200", "0%", "02%", "+5%", "1.5%", "102401%", "-1%", "2 00%",
        ] {
            assert!(CpuQuota::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn settings_collect_every_error() {
        let fields = [("key-type", "dsa"), ("cpu-quota", "fast")];
        let get = |f: &str| fields.iter().find(|(k, _)| *k == f).map(|(_, v)| *v);
        let mut errors = Vec::new();
        let r =
            BuildUserSettings::parse(get, |f, v, m| errors.push((f.to_owned(), v.to_owned(), m)));
        assert!(r.is_err());
        let named: Vec<_> = errors
            .iter()
            .map(|(f, v, _)| (f.as_str(), v.as_str()))
            .collect();
        assert_eq!(named, [("key-type", "dsa"), ("cpu-quota", "fast")]);

        let fields = [
            ("key-type", "rsa"),
            ("memory-max", "8G"),
            ("cpu-quota", "400%"),
        ];
        let get = |f: &str| fields.iter().find(|(k, _)| *k == f).map(|(_, v)| *v);
        let s = BuildUserSettings::parse(get, |_, _, m| panic!("{m}")).unwrap();
        assert!(s.has_slice());
        assert_eq!(
            s.describe(),
            "key-type rsa-3072, memory-max 8G, cpu-quota 400%"
        );
        assert!(!BuildUserSettings::DEFAULT.has_slice());
    }

    /// Diagnostics quote these messages verbatim.
    #[test]
    fn messages_read_exactly_as_documented() {
        assert_eq!(
            KeyType::parse("dsa").unwrap_err().to_string(),
            "unknown key type (expected ed25519, rsa, rsa-3072 or rsa-4096)"
        );
        assert_eq!(
            MemoryMax::parse("8X").unwrap_err().to_string(),
            "not a memory size (expected bytes with an optional K, M, G or T suffix, e.g. 8G, or a \
             percentage 1%..100%)"
        );
        assert_eq!(
            CpuQuota::parse("fast").unwrap_err().to_string(),
            "not a CPU quota (expected a percentage of one CPU, 1%..102400%, e.g. 200% for two CPUs)"
        );
    }
}
