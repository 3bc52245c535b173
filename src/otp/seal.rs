//! Sealing stored keys with AEAD (AES-256-GCM, random 96-bit nonces) under a key derived from a
//! mounted Secret, bound to the entry's token hash so a sealed value cannot be moved to another
//! entry. Several secrets may be configured: the first seals, all open (rotation without losing
//! pending entries).

use aws_lc_rs::aead::{AES_256_GCM, Aad, NONCE_LEN, Nonce, RandomizedNonceKey};
use aws_lc_rs::{digest, hmac};
use zeroize::Zeroizing;

use super::token::{TOKEN_BYTES, Token};

/// Shortest accepted secret (bytes of file content after trimming).
pub const MIN_SECRET_LEN: usize = 32;
const KEY_ID_LEN: usize = 8;

/// Sealing failures.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// The configured secret is too short to be a key.
    #[error(
        "the sealing secret has {0} bytes; at least {MIN_SECRET_LEN} random bytes are required"
    )]
    WeakSecret(usize),
    /// No sealing secret was configured.
    #[error("no sealing secret configured")]
    NoSecret,
    /// The entry was sealed with a secret that is not configured any more.
    #[error("the entry was sealed with a secret that is no longer configured")]
    UnknownKey,
    /// Authentication failed: the entry was altered or belongs elsewhere.
    #[error("the sealed entry failed authentication")]
    Corrupt,
}

struct SealKey {
    id: [u8; KEY_ID_LEN],
    aead: RandomizedNonceKey,
    digest: hmac::Key,
}

/// A keyed digest of a stored key ([`Sealer::digest`]).
pub type KeyDigest = [u8; 32];

/// Seals and opens stored keys; also derives idempotent tokens.
pub struct Sealer {
    keys: Vec<SealKey>,
    token_key: hmac::Key,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("keys", &self.keys.len())
            .finish_non_exhaustive()
    }
}

fn derive(secret: &[u8], purpose: &[u8]) -> Zeroizing<Vec<u8>> {
    let k = hmac::Key::new(hmac::HMAC_SHA256, secret);
    Zeroizing::new(hmac::sign(&k, purpose).as_ref().to_vec())
}

impl Sealer {
    /// Builds a sealer from secret file contents (surrounding whitespace ignored); the first
    /// secret seals new entries.
    pub fn new<S: AsRef<[u8]>>(secrets: &[S]) -> Result<Self, SealError> {
        let first = secrets.first().ok_or(SealError::NoSecret)?;
        let mut keys = Vec::with_capacity(secrets.len());
        for s in secrets {
            let s = s.as_ref().trim_ascii();
            if s.len() < MIN_SECRET_LEN {
                return Err(SealError::WeakSecret(s.len()));
            }
            let key = derive(s, b"mpc otp aead v1");
            let id_digest = digest::digest(&digest::SHA256, &derive(s, b"mpc otp key id v1"));
            let mut id = [0u8; KEY_ID_LEN];
            id.copy_from_slice(&id_digest.as_ref()[..KEY_ID_LEN]);
            let aead =
                RandomizedNonceKey::new(&AES_256_GCM, &key).map_err(|_| SealError::Corrupt)?;
            let digest = hmac::Key::new(hmac::HMAC_SHA256, &derive(s, b"mpc otp key digest v1"));
            keys.push(SealKey { id, aead, digest });
        }
        let token_key = hmac::Key::new(
            hmac::HMAC_SHA256,
            &derive(first.as_ref().trim_ascii(), b"mpc otp token v1"),
        );
        Ok(Self { keys, token_key })
    }

    /// `key id | nonce | ciphertext+tag` of `plaintext`, authenticated together with `aad`.
    pub fn seal(&self, aad: &[u8], plaintext: &[u8]) -> Vec<u8> {
        let key = &self.keys[0];
        let mut buf = plaintext.to_vec();
        // Only fails for absurd lengths; the body limit keeps inputs small.
        let nonce = key
            .aead
            .seal_in_place_append_tag(Aad::from(aad), &mut buf)
            .expect("AES-GCM sealing failed");
        let mut out = Vec::with_capacity(KEY_ID_LEN + NONCE_LEN + buf.len());
        out.extend_from_slice(&key.id);
        out.extend_from_slice(nonce.as_ref());
        out.extend_from_slice(&buf);
        zeroize::Zeroize::zeroize(&mut buf);
        out
    }

    /// Opens what [`Self::seal`] produced with the same `aad`.
    pub fn open(&self, aad: &[u8], sealed: &[u8]) -> Result<Zeroizing<Vec<u8>>, SealError> {
        if sealed.len() < KEY_ID_LEN + NONCE_LEN {
            return Err(SealError::Corrupt);
        }
        let (id, rest) = sealed.split_at(KEY_ID_LEN);
        let (nonce, ct) = rest.split_at(NONCE_LEN);
        let key = self
            .keys
            .iter()
            .find(|k| k.id == id)
            .ok_or(SealError::UnknownKey)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Corrupt)?;
        let mut buf = Zeroizing::new(ct.to_vec());
        let n = key
            .aead
            .open_in_place(nonce, Aad::from(aad), &mut buf)
            .map_err(|_| SealError::Corrupt)?
            .len();
        buf.truncate(n);
        Ok(buf)
    }

    /// A digest of `plaintext` bound to `aad`, kept with an entry so a retried store can be
    /// recognised without opening the sealed key, and after the key itself is gone. Keyed, so the
    /// database alone cannot confirm a guessed key.
    pub fn digest(&self, aad: &[u8], plaintext: &[u8]) -> KeyDigest {
        digest_with(&self.keys[0].digest, aad, plaintext)
    }

    /// Whether `digest` is [`Self::digest`] of `plaintext` under any configured secret (so a
    /// retry is still recognised after a rotation).
    pub fn digest_matches(&self, aad: &[u8], plaintext: &[u8], digest: &KeyDigest) -> bool {
        self.keys.iter().any(|k| {
            let d = digest_with(&k.digest, aad, plaintext);
            aws_lc_rs::constant_time::verify_slices_are_equal(&d, digest).is_ok()
        })
    }

    /// The token for a client-chosen idempotency key: retries of one store get the same token,
    /// and nobody without the sealing secret can predict it.
    pub fn token_for(&self, idempotency_key: &[u8]) -> Token {
        let tag = hmac::sign(&self.token_key, idempotency_key);
        let mut raw = [0u8; TOKEN_BYTES];
        raw.copy_from_slice(&tag.as_ref()[..TOKEN_BYTES]);
        Token::from_raw(&raw)
    }

    /// The token for one owner's request. Idempotency keys are visible ASCII, so the NUL
    /// separators keep the two derivations from ever meeting.
    pub fn token_for_owner(&self, owner: &str, request: &str) -> Token {
        let mut input = Vec::with_capacity(7 + owner.len() + request.len());
        input.extend_from_slice(b"owner\0");
        input.extend_from_slice(owner.as_bytes());
        input.push(0);
        input.extend_from_slice(request.as_bytes());
        self.token_for(&input)
    }
}

fn digest_with(key: &hmac::Key, aad: &[u8], plaintext: &[u8]) -> KeyDigest {
    let mut ctx = hmac::Context::with_key(key);
    ctx.update(&(aad.len() as u64).to_be_bytes());
    ctx.update(aad);
    ctx.update(plaintext);
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.sign().as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &[u8] = b"0123456789abcdef0123456789abcdef";
    const B: &[u8] = b"fedcba9876543210fedcba9876543210";

    #[test]
    fn seal_open_round_trip_bound_to_aad() {
        let s = Sealer::new(&[A]).unwrap();
        let sealed = s.seal(b"slot-1", b"secret key");
        assert!(!sealed.windows(10).any(|w| w == b"secret key"));
        assert_eq!(&*s.open(b"slot-1", &sealed).unwrap(), b"secret key");
        assert!(matches!(
            s.open(b"slot-2", &sealed),
            Err(SealError::Corrupt)
        ));
        let mut flipped = sealed.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(
            s.open(b"slot-1", &flipped),
            Err(SealError::Corrupt)
        ));
        assert_ne!(s.seal(b"slot-1", b"x"), s.seal(b"slot-1", b"x"));
    }

    #[test]
    fn rotation_opens_old_entries_and_rejects_unknown_keys() {
        let old = Sealer::new(&[A]).unwrap();
        let sealed = old.seal(b"h", b"k");
        let rotated = Sealer::new(&[B, A]).unwrap();
        assert_eq!(&*rotated.open(b"h", &sealed).unwrap(), b"k");
        let only_new = Sealer::new(&[B]).unwrap();
        assert!(matches!(
            only_new.open(b"h", &sealed),
            Err(SealError::UnknownKey)
        ));
    }

    #[test]
    fn weak_or_missing_secrets_are_refused() {
        assert!(matches!(
            Sealer::new(&[b"short"]),
            Err(SealError::WeakSecret(5))
        ));
        assert!(matches!(
            Sealer::new::<&[u8]>(&[]),
            Err(SealError::NoSecret)
        ));
        // Trailing newline from `kubectl create secret --from-file` does not count.
        let mut with_nl = A.to_vec();
        with_nl.push(b'\n');
        let a = Sealer::new(&[A]).unwrap();
        let b = Sealer::new(&[with_nl]).unwrap();
        assert_eq!(&*b.open(b"h", &a.seal(b"h", b"k")).unwrap(), b"k");
    }

    #[test]
    fn key_digests_survive_rotation_and_bind_the_entry() {
        let old = Sealer::new(&[A]).unwrap();
        let d = old.digest(b"h", b"key");
        assert!(old.digest_matches(b"h", b"key", &d));
        assert!(!old.digest_matches(b"h", b"other", &d));
        assert!(!old.digest_matches(b"h2", b"key", &d));
        assert!(
            Sealer::new(&[B, A])
                .unwrap()
                .digest_matches(b"h", b"key", &d)
        );
        assert!(!Sealer::new(&[B]).unwrap().digest_matches(b"h", b"key", &d));
        // Length-prefixed: moving bytes between the entry binding and the key changes the digest.
        assert_ne!(old.digest(b"ab", b"c"), old.digest(b"a", b"bc"));
    }

    #[test]
    fn owner_tokens_are_stable_and_distinct_from_idempotency_tokens() {
        let a = Sealer::new(&[A]).unwrap();
        assert_eq!(
            a.token_for_owner("uid-1", "req-1"),
            a.token_for_owner("uid-1", "req-1")
        );
        assert_ne!(
            a.token_for_owner("uid-1", "req-1"),
            a.token_for_owner("uid-1", "req-2")
        );
        assert_ne!(
            a.token_for_owner("uid-1", "req-1"),
            a.token_for_owner("uid-2", "req-1")
        );
        assert_ne!(
            a.token_for_owner("uid-1", "req-1"),
            a.token_for(b"owner uid-1 req-1")
        );
    }

    #[test]
    fn idempotent_tokens_are_stable_and_secret_dependent() {
        let a = Sealer::new(&[A]).unwrap();
        assert_eq!(a.token_for(b"req-1"), a.token_for(b"req-1"));
        assert_ne!(a.token_for(b"req-1"), a.token_for(b"req-2"));
        assert_ne!(
            a.token_for(b"req-1"),
            Sealer::new(&[B]).unwrap().token_for(b"req-1")
        );
    }
}
