//! Cloud credentials as plain data, read by the caller from the Secret named by `aws-secret`.
//!
//! Pure: no Kubernetes types; the caller hands over the Secret's `data` map.

use std::collections::BTreeMap;
use std::fmt;

/// Secret key holding the access key id.
pub const ACCESS_KEY_ID: &str = "access-key-id";
/// Secret key holding the secret access key.
pub const SECRET_ACCESS_KEY: &str = "secret-access-key";
/// Optional secret key holding a session token.
pub const SESSION_TOKEN: &str = "session-token";

/// Static cloud credentials. `Debug` never prints the secret parts.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Credentials {
    /// Access key id (not secret; appears in logs).
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Session token of temporary credentials.
    pub session_token: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// Why a Secret's data does not hold usable credentials.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialsError {
    /// A required key is absent or empty.
    #[error("secret {secret}: key {key} is missing or empty")]
    Missing {
        /// Secret name.
        secret: String,
        /// Missing key.
        key: &'static str,
    },
    /// A value is not UTF-8 text.
    #[error("secret {secret}: key {key} is not UTF-8 text")]
    NotText {
        /// Secret name.
        secret: String,
        /// Offending key.
        key: &'static str,
    },
}

impl Credentials {
    /// Reads credentials from a Secret's data. Surrounding whitespace (a trailing newline from
    /// `echo` into `kubectl create secret`) is ignored; an empty `session-token` counts as absent.
    pub fn from_secret_data(
        secret: &str,
        data: &BTreeMap<String, Vec<u8>>,
    ) -> Result<Self, CredentialsError> {
        let text = |key: &'static str| -> Result<Option<String>, CredentialsError> {
            match data.get(key) {
                None => Ok(None),
                Some(bytes) => {
                    let s = std::str::from_utf8(bytes).map_err(|_| CredentialsError::NotText {
                        secret: secret.to_owned(),
                        key,
                    })?;
                    let s = s.trim();
                    Ok((!s.is_empty()).then(|| s.to_owned()))
                }
            }
        };
        let required = |key: &'static str| -> Result<String, CredentialsError> {
            text(key)?.ok_or_else(|| CredentialsError::Missing {
                secret: secret.to_owned(),
                key,
            })
        };
        Ok(Self {
            access_key_id: required(ACCESS_KEY_ID)?,
            secret_access_key: required(SECRET_ACCESS_KEY)?,
            session_token: text(SESSION_TOKEN)?,
        })
    }

    /// A digest that tells credential sets apart without keeping the secret in cache keys.
    pub(crate) fn fingerprint(&self) -> String {
        use md5::{Digest, Md5};
        let mut h = Md5::new();
        for part in [
            self.access_key_id.as_str(),
            self.secret_access_key.as_str(),
            self.session_token.as_deref().unwrap_or(""),
        ] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        hex::encode(h.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &[u8])]) -> BTreeMap<String, Vec<u8>> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
            .collect()
    }

    #[test]
    fn reads_and_trims_values() {
        let c = Credentials::from_secret_data(
            "aws",
            &data(&[
                (ACCESS_KEY_ID, b"AKIA1\n"),
                (SECRET_ACCESS_KEY, b" s3cret "),
                (SESSION_TOKEN, b"\n"),
            ]),
        )
        .unwrap();
        assert_eq!(c.access_key_id, "AKIA1");
        assert_eq!(c.secret_access_key, "s3cret");
        assert_eq!(c.session_token, None);
    }

    #[test]
    fn names_the_missing_key_and_secret() {
        let e = Credentials::from_secret_data("aws-prod", &data(&[(ACCESS_KEY_ID, b"AKIA1")]))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "secret aws-prod: key secret-access-key is missing or empty"
        );
        let e = Credentials::from_secret_data(
            "aws-prod",
            &data(&[(ACCESS_KEY_ID, b"\xff"), (SECRET_ACCESS_KEY, b"x")]),
        )
        .unwrap_err();
        assert!(matches!(
            e,
            CredentialsError::NotText {
                key: ACCESS_KEY_ID,
                ..
            }
        ));
    }

    #[test]
    fn debug_redacts_secrets() {
        let c = Credentials {
            access_key_id: "AKIA1".into(),
            secret_access_key: "topsecret".into(),
            session_token: Some("tok3n".into()),
        };
        let d = format!("{c:?}");
        assert!(d.contains("AKIA1"));
        assert!(!d.contains("topsecret") && !d.contains("tok3n"), "{d}");
    }

    #[test]
    fn fingerprint_separates_credential_sets() {
        let a = Credentials {
            access_key_id: "a".into(),
            secret_access_key: "bc".into(),
            session_token: None,
        };
        let b = Credentials {
            access_key_id: "ab".into(),
            secret_access_key: "c".into(),
            session_token: None,
        };
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.fingerprint(), a.clone().fingerprint());
    }
}
