//! Cloud credentials as plain data, read by the caller from the Secret named by `aws-secret`
//! (AWS) or `secret` (IBM Cloud: its `api-key`).
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
/// Secret key holding an IBM Cloud API key (Go's name).
pub const IBM_API_KEY: &str = "api-key";

/// Static cloud credentials. `Debug` never prints the secret parts.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct AwsCredentials {
    /// Access key id (not secret; appears in logs).
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Session token of temporary credentials.
    pub session_token: Option<String>,
}

impl fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AwsCredentials")
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

/// An IBM Cloud API key. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IbmApiKey(String);

impl fmt::Debug for IbmApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IbmApiKey(<redacted>)")
    }
}

impl IbmApiKey {
    /// A key (surrounding whitespace dropped).
    pub fn new(key: &str) -> Self {
        Self(key.trim().to_owned())
    }
    /// The key, to exchange for a token.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// The credentials of one platform's cloud account, by provider.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Credentials {
    Aws(AwsCredentials),
    Ibm(IbmApiKey),
}

/// Shared by every caller that gets non-AWS credentials for an AWS call: it fails as unauthorised.
static NO_AWS_CREDENTIALS: std::sync::LazyLock<AwsCredentials> =
    std::sync::LazyLock::new(|| AwsCredentials {
        access_key_id: String::new(),
        secret_access_key: String::new(),
        session_token: None,
    });

impl Credentials {
    /// Reads the credentials of `cloud` from a Secret's data.
    pub fn from_secret_data(
        cloud: crate::config::CloudKind,
        secret: &str,
        data: &BTreeMap<String, Vec<u8>>,
    ) -> Result<Self, CredentialsError> {
        match cloud {
            crate::config::CloudKind::Aws => {
                AwsCredentials::from_secret_data(secret, data).map(Self::Aws)
            }
            crate::config::CloudKind::Ibm => {
                let bytes = data
                    .get(IBM_API_KEY)
                    .ok_or_else(|| CredentialsError::Missing {
                        secret: secret.to_owned(),
                        key: IBM_API_KEY,
                    })?;
                let key = std::str::from_utf8(bytes).map_err(|_| CredentialsError::NotText {
                    secret: secret.to_owned(),
                    key: IBM_API_KEY,
                })?;
                if key.trim().is_empty() {
                    return Err(CredentialsError::Missing {
                        secret: secret.to_owned(),
                        key: IBM_API_KEY,
                    });
                }
                Ok(Self::Ibm(IbmApiKey::new(key)))
            }
        }
    }

    /// The AWS credentials; for any other provider an empty set, which AWS rejects as
    /// unauthorised (the provider dispatch never hands them to the EC2 provider).
    pub fn aws(&self) -> &AwsCredentials {
        match self {
            Self::Aws(c) => c,
            Self::Ibm(_) => &NO_AWS_CREDENTIALS,
        }
    }

    /// The IBM API key, if these are IBM credentials.
    pub fn ibm(&self) -> Option<&IbmApiKey> {
        match self {
            Self::Ibm(k) => Some(k),
            Self::Aws(_) => None,
        }
    }

    /// A name for the account that may be logged (the access key id; nothing of an API key).
    pub fn key_id(&self) -> &str {
        match self {
            Self::Aws(c) => &c.access_key_id,
            Self::Ibm(_) => "ibm-api-key",
        }
    }

    /// A digest that tells credential sets apart without keeping the secret in cache keys.
    pub(crate) fn fingerprint(&self) -> String {
        match self {
            Self::Aws(c) => c.fingerprint(),
            Self::Ibm(k) => {
                use md5::{Digest, Md5};
                let mut h = Md5::new();
                h.update(b"ibm\0");
                h.update(k.0.as_bytes());
                hex::encode(h.finalize())
            }
        }
    }
}

impl From<AwsCredentials> for Credentials {
    fn from(c: AwsCredentials) -> Self {
        Self::Aws(c)
    }
}

impl AwsCredentials {
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
        let c = AwsCredentials::from_secret_data(
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
        let e = AwsCredentials::from_secret_data("aws-prod", &data(&[(ACCESS_KEY_ID, b"AKIA1")]))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "secret aws-prod: key secret-access-key is missing or empty"
        );
        let e = AwsCredentials::from_secret_data(
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
        let c = AwsCredentials {
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
        let a = AwsCredentials {
            access_key_id: "a".into(),
            secret_access_key: "bc".into(),
            session_token: None,
        };
        let b = AwsCredentials {
            access_key_id: "ab".into(),
            secret_access_key: "c".into(),
            session_token: None,
        };
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.fingerprint(), a.clone().fingerprint());
    }
}
