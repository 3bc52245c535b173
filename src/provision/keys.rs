//! In-process ed25519 key pairs for build users: the private half goes to the OTP server, only the
//! public half ever reaches the host.

use ssh_key::{Algorithm, LineEnding, PrivateKey};
use zeroize::Zeroizing;

/// Key generation failed (the system random source or encoding).
#[derive(Debug, thiserror::Error)]
#[error("generating an SSH key pair failed: {0}")]
pub struct KeyGenError(#[from] ssh_key::Error);

/// A freshly generated key pair.
pub struct KeyPair {
    /// OpenSSH private key (`-----BEGIN OPENSSH PRIVATE KEY-----`), newline-terminated.
    pub private_openssh: Zeroizing<String>,
    /// `ssh-ed25519 <base64> <comment>`, as an `authorized_keys` line.
    pub public_openssh: String,
}

impl std::fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyPair")
            .field("public_openssh", &self.public_openssh)
            .finish_non_exhaustive()
    }
}

/// Generates an ed25519 key pair with `comment` on the public key.
pub fn generate(comment: &str) -> Result<KeyPair, KeyGenError> {
    let mut key = PrivateKey::random(&mut rand::rngs::OsRng, Algorithm::Ed25519)?;
    key.set_comment(comment);
    let private_openssh = key.to_openssh(LineEnding::LF)?;
    let public_openssh = key.public_key().to_openssh()?;
    Ok(KeyPair {
        private_openssh,
        public_openssh,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_are_fresh_and_parse_back() {
        let a = generate("mpc:u-1").unwrap();
        let b = generate("mpc:u-1").unwrap();
        assert_ne!(a.public_openssh, b.public_openssh);
        assert!(a.public_openssh.starts_with("ssh-ed25519 "));
        assert!(a.public_openssh.ends_with(" mpc:u-1"));
        assert!(a.private_openssh.ends_with('\n'));
        let parsed = PrivateKey::from_openssh(a.private_openssh.as_bytes()).unwrap();
        assert_eq!(parsed.public_key().to_openssh().unwrap(), a.public_openssh);
        assert!(!format!("{a:?}").contains("PRIVATE"));
    }
}
