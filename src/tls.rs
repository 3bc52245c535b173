//! TLS material: serving certificates that are re-read when the mounted Secret changes, and client
//! configurations that trust a given CA.
//!
//! Kubernetes updates a mounted Secret by swapping a `..data` symlink, so an inotify watch on the
//! files themselves can miss the change. We poll instead: reading two small files every few seconds
//! costs nothing, always follows the current symlink target, and a pair that fails to parse (or a
//! half-swapped pair whose key does not match its certificate) simply keeps the old pair serving.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::{Error as PemError, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

/// Why TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The certificate file holds no PEM certificate.
    #[error("{0}: no PEM certificate found")]
    NoCertificate(PathBuf),
    /// The key file holds no PEM private key.
    #[error("{0}: no PEM private key found")]
    NoKey(PathBuf),
    /// PEM is malformed.
    #[error("{path}: malformed PEM: {source}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: PemError,
    },
    /// rustls refused the key or the pair.
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    /// The private key does not belong to the certificate.
    #[error("the private key does not match the certificate")]
    KeyMismatch,
}

/// Where a serving certificate and its key live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertPaths {
    /// PEM certificate chain (`tls.crt`).
    pub cert: PathBuf,
    /// PEM private key (`tls.key`).
    pub key: PathBuf,
}

impl CertPaths {
    /// `tls.crt` and `tls.key` in a directory (the layout of a `kubernetes.io/tls` Secret).
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Parses every PEM certificate in `pem`.
pub fn parse_certs(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|source| TlsError::Pem {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_owned()));
    }
    Ok(certs)
}

/// Builds a signing key pair from PEM text, checking that key and certificate belong together.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    paths: &CertPaths,
) -> Result<CertifiedKey, TlsError> {
    let certs = parse_certs(cert_pem, &paths.cert)?;
    let key = match PrivateKeyDer::from_pem_slice(key_pem) {
        Ok(key) => key,
        Err(PemError::NoItemsFound) => return Err(TlsError::NoKey(paths.key.clone())),
        Err(source) => {
            return Err(TlsError::Pem {
                path: paths.key.clone(),
                source,
            });
        }
    };
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()));
    let ck = CertifiedKey::from_der(certs, key, &provider).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => TlsError::KeyMismatch,
        other => TlsError::Rustls(other),
    })?;
    Ok(ck)
}

/// A serving certificate that can be swapped while connections are being accepted.
pub struct ReloadingCert {
    paths: CertPaths,
    current: ArcSwap<CertifiedKey>,
    // Bytes of the pair currently served, to skip re-parsing unchanged files.
    loaded: std::sync::Mutex<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for ReloadingCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingCert")
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

impl ReloadingCert {
    /// Loads the pair once; fails if it is not usable (the server must not start without one).
    pub fn load(paths: CertPaths) -> Result<Arc<Self>, TlsError> {
        let cert = read(&paths.cert)?;
        let key = read(&paths.key)?;
        let ck = certified_key(&cert, &key, &paths)?;
        Ok(Arc::new(Self {
            paths,
            current: ArcSwap::from_pointee(ck),
            loaded: std::sync::Mutex::new((cert, key)),
        }))
    }

    /// Re-reads the files; returns `Ok(true)` if a new pair is now served. On error the old pair
    /// keeps serving.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let cert = read(&self.paths.cert)?;
        let key = read(&self.paths.key)?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if loaded.0 == cert && loaded.1 == key {
            return Ok(false);
        }
        let ck = certified_key(&cert, &key, &self.paths)?;
        self.current.store(Arc::new(ck));
        *loaded = (cert, key);
        Ok(true)
    }

    /// The pair currently served.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current.load_full()
    }

    /// Polls the files every `interval` until `cancel` fires, logging reloads and failures.
    pub fn spawn_reloader(
        self: &Arc<Self>,
        interval: Duration,
        cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // A broken pair stays broken for many polls: report each distinct problem once.
            let mut last_error = String::new();
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    _ = tick.tick() => {}
                }
                match this.reload() {
                    Ok(true) => {
                        last_error.clear();
                        tracing::info!(cert = %this.paths.cert.display(), "serving certificate reloaded")
                    }
                    Ok(false) => last_error.clear(),
                    Err(error) => {
                        let text = error.to_string();
                        if text != last_error {
                            tracing::warn!(%error, "serving certificate not reloaded; the previous one keeps serving");
                            last_error = text;
                        }
                    }
                }
            }
        })
    }

    /// A rustls server configuration that serves the current pair, with the given ALPN protocols.
    pub fn server_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let mut cfg = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(cfg)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// A client configuration trusting only the CA certificates in `ca_pem` (no system roots).
pub fn client_config_trusting(
    ca_pem: &[u8],
    alpn: &[&[u8]],
) -> Result<rustls::ClientConfig, TlsError> {
    let path = Path::new("<ca bundle>");
    let mut roots = rustls::RootCertStore::empty();
    for cert in parse_certs(ca_pem, path)? {
        roots.add(cert)?;
    }
    let mut cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(cfg)
}

/// Installs aws-lc-rs as the process-wide rustls provider; call first thing in `main` and in tests.
/// Idempotent.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths() -> CertPaths {
        CertPaths::in_dir(Path::new("/certs"))
    }

    #[test]
    fn a_generated_pair_loads_and_keys_are_matched() {
        install_crypto_provider();
        let b = crate::certs::generate("mpc", &["mpc.example".into()], 1).unwrap();
        assert!(certified_key(b.cert_pem.as_bytes(), b.key_pem.as_bytes(), &paths()).is_ok());
        // Two certificates in one file (serving + CA bundle) are both read.
        let both = format!("{}{}", b.cert_pem, b.ca_pem);
        assert_eq!(
            parse_certs(both.as_bytes(), &paths().cert).unwrap().len(),
            2
        );
        let other = crate::certs::generate("other", &["other.example".into()], 1).unwrap();
        assert!(matches!(
            certified_key(b.cert_pem.as_bytes(), other.key_pem.as_bytes(), &paths()),
            Err(TlsError::KeyMismatch)
        ));
    }

    #[test]
    fn missing_and_malformed_pem_are_told_apart() {
        install_crypto_provider();
        let b = crate::certs::generate("mpc", &["mpc.example".into()], 1).unwrap();
        assert!(matches!(
            parse_certs(b"not pem at all", &paths().cert),
            Err(TlsError::NoCertificate(_))
        ));
        // A key file that holds only a certificate has no key.
        assert!(matches!(
            certified_key(b.cert_pem.as_bytes(), b.cert_pem.as_bytes(), &paths()),
            Err(TlsError::NoKey(p)) if p == paths().key
        ));
        let broken = b.cert_pem.replace("-----END CERTIFICATE-----", "");
        assert!(
            matches!(
                parse_certs(broken.as_bytes(), &paths().cert),
                Err(TlsError::Pem { .. })
            ),
            "{:?}",
            parse_certs(broken.as_bytes(), &paths().cert)
        );
    }
}
