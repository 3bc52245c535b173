//! One-time tokens: 256 random bits, URL-safe base64 without padding (43 characters). The store
//! keeps only their SHA-256, so the database alone cannot redeem anything.

use aws_lc_rs::digest;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// Raw token length in bytes (256 bits).
pub const TOKEN_BYTES: usize = 32;
/// Encoded token length.
pub const TOKEN_LEN: usize = 43;

/// A token as handed to the TaskRun (in the secret's `otp` key).
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// SHA-256 of a token's raw bytes: the database key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenHash(pub [u8; 32]);

impl std::fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenHash({})", self.log_id())
    }
}

impl TokenHash {
    /// A short id for logs: a prefix of a hash of the hash, useless for redeeming.
    pub fn log_id(&self) -> String {
        let d = digest::digest(&digest::SHA256, &self.0);
        hex::encode(&d.as_ref()[..6])
    }
}

/// The body of a redeem request is not a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed token")]
pub struct MalformedToken;

impl Token {
    /// A fresh random token.
    pub fn random() -> Self {
        let mut raw = [0u8; TOKEN_BYTES];
        // The system RNG failing is unrecoverable for a key server.
        aws_lc_rs::rand::fill(&mut raw).expect("system random number generator failed");
        Self::from_raw(&raw)
    }

    /// The token for these raw bytes.
    pub fn from_raw(raw: &[u8; TOKEN_BYTES]) -> Self {
        Self(URL_SAFE_NO_PAD.encode(raw))
    }

    /// The encoded token.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Its database key.
    pub fn hash(&self) -> TokenHash {
        // Constructed only from raw bytes, so decoding cannot fail.
        hash_raw(&URL_SAFE_NO_PAD.decode(&self.0).unwrap_or_default())
    }

    /// Parses a request body: the token, optionally surrounded by whitespace (curl `-d @file`
    /// strips line breaks, `--data-binary` keeps them).
    pub fn parse(body: &[u8]) -> Result<Self, MalformedToken> {
        let s = std::str::from_utf8(body)
            .map_err(|_| MalformedToken)?
            .trim_matches(|c: char| c.is_ascii_whitespace());
        if s.len() != TOKEN_LEN {
            return Err(MalformedToken);
        }
        let raw = URL_SAFE_NO_PAD.decode(s).map_err(|_| MalformedToken)?;
        let raw: [u8; TOKEN_BYTES] = raw.try_into().map_err(|_| MalformedToken)?;
        // Reject non-canonical encodings so one token has exactly one spelling.
        let t = Self::from_raw(&raw);
        if t.0 != s {
            return Err(MalformedToken);
        }
        Ok(t)
    }
}

fn hash_raw(raw: &[u8]) -> TokenHash {
    let d = digest::digest(&digest::SHA256, raw);
    let mut h = [0u8; 32];
    h.copy_from_slice(d.as_ref());
    TokenHash(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tokens_are_url_safe_random_and_parse_back() {
        let a = Token::random();
        let b = Token::random();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), TOKEN_LEN);
        assert!(
            a.as_str()
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        );
        assert_eq!(Token::parse(a.as_str().as_bytes()).unwrap(), a);
        let with_newline = format!("{}\n", a.as_str());
        assert_eq!(Token::parse(with_newline.as_bytes()).unwrap(), a);
        assert_eq!(
            Token::parse(a.as_str().as_bytes()).unwrap().hash(),
            a.hash()
        );
        assert_ne!(a.hash(), b.hash());
        assert!(!format!("{a:?}").contains(a.as_str()));
    }

    #[test]
    fn malformed_bodies_are_rejected() {
        assert!(Token::parse(b"").is_err());
        assert!(Token::parse(b"short").is_err());
        assert!(Token::parse(&[b'A'; 44]).is_err());
        assert!(Token::parse(&[0xff; 43]).is_err());
        // 43 characters whose last one carries non-zero padding bits is not canonical.
        let mut t = Token::from_raw(&[0; 32]).as_str().to_owned();
        t.pop();
        t.push('B');
        assert!(Token::parse(t.as_bytes()).is_err());
    }

    proptest! {
        #[test]
        fn parse_never_panics_and_accepts_only_canonical(body in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(t) = Token::parse(&body) {
                prop_assert_eq!(t.as_str().len(), TOKEN_LEN);
            }
        }
    }
}
