//! A small secret read from a file mounted from a Kubernetes Secret, re-read when it may have
//! changed. Kubernetes swaps a `..data` symlink on update, so we simply re-read after a short
//! interval rather than watch inodes.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

/// When the file was last read, and what it held.
type Cached = Option<(Instant, Option<Zeroizing<Vec<u8>>>)>;

/// The current content of a secret file (surrounding whitespace trimmed).
pub struct SecretFile {
    path: PathBuf,
    max_age: Duration,
    cached: Mutex<Cached>,
}

impl std::fmt::Debug for SecretFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl SecretFile {
    /// A secret at `path`, re-read at most every `max_age`.
    pub fn new(path: PathBuf, max_age: Duration) -> Self {
        Self {
            path,
            max_age,
            cached: Mutex::new(None),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The secret, or `None` when the file is missing, unreadable or empty (which must refuse
    /// everything, never allow it).
    pub fn current(&self) -> Option<Zeroizing<Vec<u8>>> {
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, value)) = cached.as_ref()
            && at.elapsed() < self.max_age
        {
            return value.clone();
        }
        let value = match std::fs::read(&self.path) {
            Ok(bytes) => {
                let bytes = Zeroizing::new(bytes);
                let t = bytes.trim_ascii();
                if t.is_empty() {
                    tracing::warn!(path = %self.path.display(), "secret file is empty; refusing every request");
                    None
                } else {
                    Some(Zeroizing::new(t.to_vec()))
                }
            }
            Err(error) => {
                tracing::warn!(path = %self.path.display(), %error, "secret file unreadable; refusing every request");
                None
            }
        };
        *cached = Some((Instant::now(), value.clone()));
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_changes_and_refuses_when_missing_or_empty() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        let s = SecretFile::new(p.clone(), Duration::ZERO);
        assert!(s.current().is_none());
        std::fs::write(&p, "one\n").unwrap();
        assert_eq!(s.current().unwrap().as_slice(), b"one");
        std::fs::write(&p, "two").unwrap();
        assert_eq!(s.current().unwrap().as_slice(), b"two");
        std::fs::write(&p, " \n").unwrap();
        assert!(s.current().is_none());
        let cached = SecretFile::new(p.clone(), Duration::from_secs(3600));
        std::fs::write(&p, "three").unwrap();
        assert_eq!(cached.current().unwrap().as_slice(), b"three");
        std::fs::write(&p, "four").unwrap();
        assert_eq!(cached.current().unwrap().as_slice(), b"three");
    }
}
