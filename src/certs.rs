//! `mpc certs`: a private CA and a serving certificate for an in-cluster Service.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// Why certificates could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// rcgen failed.
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    /// Writing a file failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// `mpc certs` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct CertsArgs {
    /// Service name the webhook (or OTP server) is reached by.
    #[arg(long)]
    pub service: String,
    /// Namespace of the Service.
    #[arg(long)]
    pub namespace: String,
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Validity of the serving certificate, days.
    #[arg(long, default_value_t = 825)]
    pub days: u32,
    /// Extra DNS names or IP addresses for the serving certificate (repeatable).
    #[arg(long = "san")]
    pub extra_sans: Vec<String>,
}

/// PEM output of [`generate`].
#[derive(Debug, Clone)]
pub struct CertBundle {
    /// CA certificate (also the `caBundle` of the webhook configuration).
    pub ca_pem: String,
    /// CA private key (keep it, or delete it: it is only needed to issue more certificates).
    pub ca_key_pem: String,
    /// Serving certificate.
    pub cert_pem: String,
    /// Serving key.
    pub key_pem: String,
}

/// The DNS names a Service is reachable by from inside the cluster.
pub fn service_sans(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Generates a CA and a serving certificate for `sans` (DNS names or IP addresses).
pub fn generate(common_name: &str, sans: &[String], days: u32) -> Result<CertBundle, CertsError> {
    let now = time::OffsetDateTime::now_utc();

    let mut ca = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("{common_name} CA"));
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = now - time::Duration::hours(1);
    ca.not_after = now + time::Duration::days(i64::from(days) + 365);
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca, ca_key);

    let mut leaf = CertificateParams::new(sans.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    leaf.distinguished_name = dn;
    leaf.is_ca = IsCa::ExplicitNoCa;
    leaf.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.not_before = now - time::Duration::hours(1);
    leaf.not_after = now + time::Duration::days(i64::from(days));
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;

    Ok(CertBundle {
        ca_pem: ca_cert.pem(),
        ca_key_pem: issuer.key().serialize_pem(),
        cert_pem: leaf_cert.pem(),
        key_pem: leaf_key.serialize_pem(),
    })
}

/// Writes `ca.crt`, `ca.key`, `tls.crt`, `tls.key` and `ca-bundle` (base64 of `ca.crt`, for a
/// webhook configuration's `caBundle`) into `dir`. Keys are written mode 0600.
pub fn write_bundle(bundle: &CertBundle, dir: &Path) -> Result<(), CertsError> {
    use base64::Engine;
    let io = |path: &Path, source| CertsError::Write {
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let b64 = base64::engine::general_purpose::STANDARD.encode(&bundle.ca_pem);
    for (name, content, secret) in [
        ("ca.crt", bundle.ca_pem.as_str(), false),
        ("ca.key", bundle.ca_key_pem.as_str(), true),
        ("tls.crt", bundle.cert_pem.as_str(), false),
        ("tls.key", bundle.key_pem.as_str(), true),
        ("ca-bundle", b64.as_str(), false),
    ] {
        let path = dir.join(name);
        write_file(&path, content.as_bytes(), secret).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

fn write_file(path: &Path, content: &[u8], secret: bool) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(path)?;
    f.write_all(content)
}

/// Runs `mpc certs`.
pub fn run(args: &CertsArgs) -> Result<(), CertsError> {
    let mut sans = service_sans(&args.service, &args.namespace);
    sans.extend(args.extra_sans.iter().cloned());
    let cn = format!("{}.{}.svc", args.service, args.namespace);
    let bundle = generate(&cn, &sans, args.days)?;
    write_bundle(&bundle, &args.out)?;
    tracing::info!(out = %args.out.display(), ?sans, "certificates written");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundle_verifies_for_every_service_name() {
        crate::tls::install_crypto_provider();
        let sans = service_sans("mpc-webhook", "mpc");
        let b = generate("mpc-webhook.mpc.svc", &sans, 30).unwrap();
        let paths = crate::tls::CertPaths {
            cert: "tls.crt".into(),
            key: "tls.key".into(),
        };
        crate::tls::certified_key(b.cert_pem.as_bytes(), b.key_pem.as_bytes(), &paths).unwrap();
        // A mismatched key is refused.
        let other = generate("x", &["x".to_owned()], 1).unwrap();
        assert!(matches!(
            crate::tls::certified_key(b.cert_pem.as_bytes(), other.key_pem.as_bytes(), &paths),
            Err(crate::tls::TlsError::KeyMismatch)
        ));
        let (_, cert) = x509_names(&b.cert_pem);
        for s in &sans {
            assert!(cert.contains(s), "{s} missing");
        }
    }

    fn x509_names(pem: &str) -> ((), String) {
        // The SANs are stored as plain ASCII inside the DER; good enough to prove presence.
        let der = crate::tls::parse_certs(pem.as_bytes(), Path::new("t")).unwrap();
        ((), String::from_utf8_lossy(der[0].as_ref()).into_owned())
    }

    #[test]
    fn writes_files_with_private_modes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let b = generate("x", &["x".to_owned()], 1).unwrap();
        write_bundle(&b, dir.path()).unwrap();
        let mode = |n: &str| {
            std::fs::metadata(dir.path().join(n))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("tls.key"), 0o600);
        assert_eq!(mode("ca.key"), 0o600);
        assert_eq!(mode("tls.crt"), 0o644);
        let bundle = std::fs::read_to_string(dir.path().join("ca-bundle")).unwrap();
        use base64::Engine;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(bundle)
            .unwrap();
        assert_eq!(decoded, b.ca_pem.as_bytes());
    }
}
