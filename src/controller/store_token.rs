//! The OTP store token as the controller holds it. Kubernetes updates a mounted Secret in place
//! when it changes, so rotating the token (docs/migration.md, "Rotating the OTP store token")
//! reaches the file, not the process: the controller re-reads it, as the OTP server does, and
//! on a new token rebuilds the client that authenticates `/store-key` with it and rotates the
//! allocation proof key derived from it ([`SecretProof::rotate`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

use super::patch::SecretProof;
use crate::otp::{OtpClient, OtpClientError};

/// Why the token could not be (re-)read or used.
#[derive(Debug, thiserror::Error)]
pub enum StoreTokenError {
    /// The file could not be read, or holds no token.
    #[error("OTP store token {path}: {error}")]
    File {
        path: PathBuf,
        error: std::io::Error,
    },
    /// No OTP client could be built with it.
    #[error("OTP server settings: {0}")]
    Otp(#[source] OtpClientError),
}

/// The token file, the client using its token, and the proof key following it.
pub struct StoreToken {
    path: PathBuf,
    url: String,
    ca_pem: Vec<u8>,
    proof: Arc<SecretProof>,
    held: Mutex<Held>,
}

struct Held {
    token: Zeroizing<String>,
    client: Arc<OtpClient>,
}

impl std::fmt::Debug for StoreToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreToken")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The token in the file, surrounding whitespace trimmed; an empty file is an error.
fn read_token(path: &Path) -> Result<Zeroizing<String>, StoreTokenError> {
    let bytes = Zeroizing::new(std::fs::read(path).map_err(|error| StoreTokenError::File {
        path: path.to_owned(),
        error,
    })?);
    let token = Zeroizing::new(String::from_utf8_lossy(&bytes).trim().to_owned());
    if token.is_empty() {
        return Err(StoreTokenError::File {
            path: path.to_owned(),
            error: std::io::Error::new(std::io::ErrorKind::InvalidData, "empty token file"),
        });
    }
    Ok(token)
}

impl StoreToken {
    /// Reads the token (it must be there at start) and builds the client for the OTP server at
    /// `url`, verified by `ca_pem`.
    pub fn load(path: PathBuf, url: &str, ca_pem: &[u8]) -> Result<Self, StoreTokenError> {
        let token = read_token(&path)?;
        let proof = Arc::new(SecretProof::from_store_token(token.as_bytes()));
        let client = OtpClient::new(url, ca_pem, token.clone()).map_err(StoreTokenError::Otp)?;
        Ok(Self {
            path,
            url: url.to_owned(),
            ca_pem: ca_pem.to_vec(),
            proof,
            held: Mutex::new(Held {
                token,
                client: Arc::new(client),
            }),
        })
    }

    /// The allocation proof, keyed by the token.
    pub fn proof(&self) -> Arc<SecretProof> {
        self.proof.clone()
    }

    /// The client authenticating with the token as last read.
    pub fn client(&self) -> Arc<OtpClient> {
        self.held().client.clone()
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Re-reads the file; a new token replaces the client and rotates the proof key. Returns
    /// whether the token changed. A missing, unreadable or empty file keeps the token held (a
    /// Secret update swaps a symlink; a moment without the file must not cost the key), as
    /// does a client that cannot be built.
    pub fn refresh(&self) -> Result<bool, StoreTokenError> {
        let token = read_token(&self.path)?;
        if *token == *self.held().token {
            return Ok(false);
        }
        let client =
            OtpClient::new(&self.url, &self.ca_pem, token.clone()).map_err(StoreTokenError::Otp)?;
        let rotated = self.proof.rotate(token.as_bytes());
        *self.held() = Held {
            token,
            client: Arc::new(client),
        };
        tracing::info!(path = %self.path.display(), proof_key = %self.proof.key_id(), rotated, "OTP store token changed: using the new one");
        Ok(true)
    }

    /// Re-reads the file every `every` until `stop`.
    pub async fn follow(self: Arc<Self>, every: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(error) = self.refresh() {
                tracing::warn!(%error, "re-reading the OTP store token; keeping the one held");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{ProofTag, TaskRunRef, Uid};

    fn parsed(proof: &str) -> ProofTag {
        let (id, mac) = proof.strip_prefix("v2:").unwrap().split_once(':').unwrap();
        ProofTag {
            key_id: Some(hex::decode(id).unwrap().try_into().unwrap()),
            mac: hex::decode(mac).unwrap().try_into().unwrap(),
        }
    }

    /// The token file rewritten in place: the next read takes the new token, for the client and
    /// the proof, and a proof made before still verifies; a file gone for a moment changes
    /// nothing.
    #[test]
    fn a_rewritten_token_file_rotates_the_client_and_the_proof_key() {
        crate::tls::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first\n").unwrap();
        let ca = crate::certs::generate("otp", &["127.0.0.1".into()], 1).unwrap();
        let t =
            StoreToken::load(path.clone(), "https://127.0.0.1:1", ca.ca_pem.as_bytes()).unwrap();
        let r = TaskRunRef::new("tenant", "build-1", Uid::new("u-1"));
        let (proof, client) = (t.proof(), t.client());
        let before = parsed(&proof.sign_allocation(&r, "h1"));
        assert!(!t.refresh().unwrap(), "the same token changes nothing");
        assert!(Arc::ptr_eq(&client, &t.client()));

        std::fs::write(&path, "second").unwrap();
        assert!(t.refresh().unwrap());
        assert!(!Arc::ptr_eq(&client, &t.client()), "a new client");
        let after = parsed(&proof.sign_allocation(&r, "h1"));
        assert_ne!(after.key_id, before.key_id);
        assert_eq!(
            proof.sign_allocation(&r, "h1"),
            SecretProof::from_store_token(b"second").sign_allocation(&r, "h1")
        );
        assert!(proof.verify_allocation(&r, Some("h1"), Some(&before)));
        assert!(proof.verify_allocation(&r, Some("h1"), Some(&after)));

        std::fs::remove_file(&path).unwrap();
        assert!(t.refresh().is_err());
        std::fs::write(&path, " \n").unwrap();
        assert!(t.refresh().is_err());
        assert!(proof.verify_allocation(&r, Some("h1"), Some(&after)));
        assert_eq!(proof.key_id(), hex::encode(after.key_id.unwrap()));
    }
}
