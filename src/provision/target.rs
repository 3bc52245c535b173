//! Where to connect and how to trust the host: a validated description of one SSH target.

use std::fmt;
use std::sync::Arc;

use zeroize::Zeroizing;

use super::error::ProvisionError;
use crate::config::{StaticHost, values};

/// How the host's SSH key is verified. There is deliberately no "accept anything".
#[derive(Clone, PartialEq, Eq)]
pub enum HostKeyTrust {
    /// Only this key (`<algorithm> <base64>`, as in `host.<name>.host-key`) is accepted.
    Pinned(String),
    /// The first key seen is recorded in the controller's known-hosts store; any other key later is
    /// refused. Dynamic instances are keyed by instance id, so a recycled address starts fresh.
    TrustOnFirstUse,
}

impl fmt::Debug for HostKeyTrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pinned(k) => write!(f, "Pinned({})", k.split(' ').next().unwrap_or("")),
            Self::TrustOnFirstUse => f.write_str("TrustOnFirstUse"),
        }
    }
}

/// One SSH host as the admin sees it.
#[derive(Clone)]
pub struct Target {
    /// Stable identity: the static host's name or the cloud instance id. Keys the connection cache
    /// and the known-hosts store (`[A-Za-z0-9._-]`, not starting with `.` or `-`).
    pub id: String,
    /// IP address or DNS name.
    pub address: String,
    /// SSH port.
    pub port: u16,
    /// Admin login (root, or a user with passwordless sudo).
    pub user: String,
    /// The admin's private key (`id_rsa` from the host's Secret), in any format `ssh` reads.
    pub admin_key: Arc<Zeroizing<Vec<u8>>>,
    /// Host key verification.
    pub host_key: HostKeyTrust,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("id", &self.id)
            .field("address", &self.address)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("host_key", &self.host_key)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// A static host from config, with its admin key bytes read by the caller from `host.secret`.
    pub fn from_static(host: &StaticHost, admin_key: Arc<Zeroizing<Vec<u8>>>) -> Self {
        Self {
            id: host.name.clone(),
            address: host.address.clone(),
            port: 22,
            user: host.user.clone(),
            admin_key,
            host_key: host
                .host_key
                .clone()
                .map_or(HostKeyTrust::TrustOnFirstUse, HostKeyTrust::Pinned),
        }
    }

    /// A dynamic instance, trusted on first use under its instance id.
    pub fn dynamic(
        instance_id: &str,
        address: &str,
        user: &str,
        admin_key: Arc<Zeroizing<Vec<u8>>>,
    ) -> Self {
        Self {
            id: instance_id.to_owned(),
            address: address.to_owned(),
            port: 22,
            user: user.to_owned(),
            admin_key,
            host_key: HostKeyTrust::TrustOnFirstUse,
        }
    }

    /// `user@address` for a build user on this host (the secret's `host` value).
    pub fn login_for(&self, user: &str) -> String {
        format!("{user}@{}", self.address)
    }

    /// Checks every field that reaches the `ssh` command line or its config file.
    pub fn validate(&self) -> Result<(), ProvisionError> {
        let bad = |what: &str, v: &str, why: &str| {
            Err(ProvisionError::InvalidRequest(format!(
                "host {:?}: {what} {v:?} {why}",
                self.id
            )))
        };
        if !is_host_id(&self.id) {
            return bad(
                "id",
                &self.id,
                "must be 1-128 of [A-Za-z0-9._-], not starting with '.' or '-'",
            );
        }
        // Exact match: a leading '-' or embedded space would be read by ssh as an option.
        if values::host_address(&self.address).ok() != Some(self.address.as_str()) {
            return bad("address", &self.address, "is not an IP address or DNS name");
        }
        if values::posix_user(&self.user).ok() != Some(self.user.as_str()) {
            return bad("user", &self.user, "is not a valid user name");
        }
        if self.port == 0 {
            return bad("port", "0", "is not a valid port");
        }
        if self.admin_key.is_empty() {
            return bad("admin key", "", "is empty");
        }
        if let HostKeyTrust::Pinned(k) = &self.host_key {
            match values::host_key(k) {
                Ok(norm) if norm == *k => {}
                Ok(_) | Err(_) => {
                    return bad(
                        "host-key",
                        k,
                        "is not \"<algorithm> <base64>\" as in known_hosts",
                    );
                }
            }
        }
        Ok(())
    }
}

/// A host id usable as a file name and as `HostKeyAlias`.
pub fn is_host_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && !id.starts_with(['.', '-'])
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn target(address: &str) -> Target {
        Target::dynamic(
            "i-0abc",
            address,
            "root",
            Arc::new(Zeroizing::new(b"k".to_vec())),
        )
    }

    #[test]
    fn validation() {
        assert!(target("10.0.0.1").validate().is_ok());
        assert!(target("build-1.example.com").validate().is_ok());
        assert!(target("::1").validate().is_ok());
        assert!(target("-oProxyCommand=sh").validate().is_err());
        assert!(target("a b").validate().is_err());
        assert!(target(" 10.0.0.1").validate().is_err());
        let mut t = target("10.0.0.1");
        t.id = "../etc".into();
        assert!(t.validate().is_err());
        t.id = "host.example".into();
        t.host_key = HostKeyTrust::Pinned("ssh-ed25519 AAAA\nevil".into());
        assert!(t.validate().is_err());
        t.host_key = HostKeyTrust::Pinned("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB2a".into());
        assert!(t.validate().is_ok());
        assert!(!format!("{t:?}").contains("AAAAC3"));
    }

    proptest! {
        /// Whatever address validation accepts is a single word of address characters that ssh
        /// cannot read as an option.
        #[test]
        fn accepted_addresses_are_inert(address in "[^\\x00]{0,40}", id in "[^\\x00]{0,20}") {
            let mut t = target(&address);
            t.id = id;
            if t.validate().is_ok() {
                prop_assert!(!t.address.starts_with('-'));
                prop_assert!(t.address.bytes().all(|b| b.is_ascii_alphanumeric() || b".:-".contains(&b)));
                prop_assert!(t.id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)));
            }
        }
    }
}
