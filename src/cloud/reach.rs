//! Reaching instances: the address-resolution step every SSH dial goes through, and readiness
//! probes (the SSH daemon answers with its version banner).
//!
//! Production uses [`Direct`] (the instance address, port 22). Tests inject a [`LoopbackMap`],
//! which sends known addresses to loopback listeners and refuses every other address, so the fake
//! addresses an emulated cloud hands out are never dialled.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::RwLock;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Where to dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            _ => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// Why an address cannot be dialled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The resolver does not allow dialling this address.
    #[error("address {0} is not mapped to a loopback endpoint; refusing to dial it")]
    Unmapped(String),
    /// A mapping target is not a loopback address.
    #[error("mapping target {0} is not a loopback address")]
    NotLoopback(SocketAddr),
}

/// Turns an instance address into the endpoint to dial for SSH.
pub trait ResolveAddress: Send + Sync + fmt::Debug {
    /// The endpoint for `address` (a DNS name or IP as the cloud reported it).
    fn resolve(&self, address: &str) -> Result<Endpoint, ResolveError>;
}

/// Dials the instance address itself on the SSH port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Direct {
    /// SSH port, 22.
    pub port: u16,
}

impl Default for Direct {
    fn default() -> Self {
        Self { port: 22 }
    }
}

impl ResolveAddress for Direct {
    fn resolve(&self, address: &str) -> Result<Endpoint, ResolveError> {
        Ok(Endpoint {
            host: address.to_owned(),
            port: self.port,
        })
    }
}

/// Test-only resolution: explicit address → loopback endpoint mappings, plus optionally "an
/// address that is itself a loopback IP dials itself on this port" (instances launched into a
/// `127.0.0.0/8` subnet of an emulated cloud). Everything else is refused.
#[derive(Debug, Default)]
pub struct LoopbackMap {
    map: RwLock<BTreeMap<String, SocketAddr>>,
    loopback_port: Option<u16>,
}

impl LoopbackMap {
    /// Refuses every address until mappings are added.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also accepts addresses that are loopback IPs, dialling them on `port`.
    pub fn with_loopback_port(mut self, port: u16) -> Self {
        self.loopback_port = Some(port);
        self
    }

    /// Sends `address` to `target`, which must be a loopback address.
    pub fn insert(&self, address: &str, target: SocketAddr) -> Result<(), ResolveError> {
        if !target.ip().is_loopback() {
            return Err(ResolveError::NotLoopback(target));
        }
        self.map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(address.to_owned(), target);
        Ok(())
    }
}

impl ResolveAddress for LoopbackMap {
    fn resolve(&self, address: &str) -> Result<Endpoint, ResolveError> {
        let mapped = self
            .map
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(address)
            .copied();
        if let Some(t) = mapped {
            return Ok(Endpoint {
                host: t.ip().to_string(),
                port: t.port(),
            });
        }
        match (address.parse::<IpAddr>(), self.loopback_port) {
            (Ok(ip), Some(port)) if ip.is_loopback() => Ok(Endpoint {
                host: ip.to_string(),
                port,
            }),
            _ => Err(ResolveError::Unmapped(address.to_owned())),
        }
    }
}

/// Result of one readiness probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The SSH daemon answered with this version line.
    Ready {
        /// The endpoint dialled.
        endpoint: Endpoint,
        /// The `SSH-2.0-...` line.
        banner: String,
    },
    /// Not (yet) answering: refused, timed out, or not an SSH daemon.
    NotReady {
        /// The endpoint dialled.
        endpoint: Endpoint,
        /// What happened.
        reason: String,
    },
    /// The address could not be resolved to an endpoint; nothing was dialled.
    Unresolved {
        /// Why.
        reason: String,
    },
}

impl Probe {
    /// True when the SSH daemon answered.
    pub fn is_ready(&self) -> bool {
        matches!(self, Self::Ready { .. })
    }
}

/// Longest pre-banner text read before giving up (RFC 4253 allows lines before the version line).
const MAX_BANNER_BYTES: usize = 4096;

/// Probes one address: resolve, connect, and read the SSH version line, all within `timeout`.
pub async fn probe_ssh(resolver: &dyn ResolveAddress, address: &str, timeout: Duration) -> Probe {
    let endpoint = match resolver.resolve(address) {
        Ok(e) => e,
        Err(e) => {
            return Probe::Unresolved {
                reason: e.to_string(),
            };
        }
    };
    match tokio::time::timeout(timeout, read_banner(&endpoint)).await {
        Ok(Ok(banner)) => Probe::Ready { endpoint, banner },
        Ok(Err(e)) => Probe::NotReady {
            endpoint,
            reason: e.to_string(),
        },
        Err(_) => Probe::NotReady {
            endpoint,
            reason: format!("no SSH banner within {timeout:?}"),
        },
    }
}

/// Probes many addresses concurrently; the whole batch takes about one `timeout`, not one per
/// address. Results are in input order.
pub async fn probe_all(
    resolver: &dyn ResolveAddress,
    addresses: &[&str],
    timeout: Duration,
) -> Vec<Probe> {
    futures::future::join_all(addresses.iter().map(|a| probe_ssh(resolver, a, timeout))).await
}

/// Why an endpoint gave no SSH banner (the probe's `NotReady` reason).
#[derive(Debug, thiserror::Error)]
enum BannerError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("read: {0}")]
    Read(std::io::Error),
    #[error("connection closed before an SSH banner")]
    Closed,
    #[error("no SSH banner in the first 4 KiB")]
    TooLong,
}

async fn read_banner(endpoint: &Endpoint) -> Result<String, BannerError> {
    let mut stream = TcpStream::connect((endpoint.host.as_str(), endpoint.port))
        .await
        .map_err(BannerError::Connect)?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    loop {
        let n = stream.read(&mut chunk).await.map_err(BannerError::Read)?;
        if n == 0 {
            return Err(BannerError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf);
        for line in text.split_inclusive('\n') {
            if !line.ends_with('\n') {
                break;
            }
            let line = line.trim_end();
            if line.starts_with("SSH-") {
                return Ok(line.to_owned());
            }
        }
        if buf.len() > MAX_BANNER_BYTES {
            return Err(BannerError::TooLong);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    #[test]
    fn loopback_map_refuses_unmapped_and_non_loopback() {
        let m = LoopbackMap::new();
        assert_eq!(
            m.resolve("54.1.2.3"),
            Err(ResolveError::Unmapped("54.1.2.3".into()))
        );
        assert_eq!(
            m.insert("54.1.2.3", "10.0.0.1:22".parse().unwrap()),
            Err(ResolveError::NotLoopback("10.0.0.1:22".parse().unwrap()))
        );
        m.insert("54.1.2.3", "127.0.0.1:2222".parse().unwrap())
            .unwrap();
        assert_eq!(
            m.resolve("54.1.2.3").unwrap(),
            Endpoint {
                host: "127.0.0.1".into(),
                port: 2222
            }
        );
        assert!(m.resolve("127.0.1.4").is_err(), "no loopback port set");
        let m = LoopbackMap::new().with_loopback_port(2200);
        assert_eq!(m.resolve("127.0.1.4").unwrap().port, 2200);
        assert!(m.resolve("10.0.1.4").is_err());
        assert!(m.resolve("ec2-54-1-2-3.compute-1.amazonaws.com").is_err());
    }

    #[test]
    fn direct_dials_port_22() {
        let e = Direct::default().resolve("ec2.example").unwrap();
        assert_eq!(e.to_string(), "ec2.example:22");
        let e = Direct::default().resolve("::1").unwrap();
        assert_eq!(e.to_string(), "[::1]:22");
    }

    async fn serve_once(reply: &'static [u8]) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let _ = s.write_all(reply).await;
                // Keep the connection open so only the banner decides.
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn probe_reads_the_banner_after_preamble_lines() {
        let addr = serve_once(b"hello\r\nSSH-2.0-OpenSSH_9.2p1 Debian\r\n").await;
        let m = LoopbackMap::new();
        m.insert("54.0.0.9", addr).unwrap();
        let p = probe_ssh(&m, "54.0.0.9", Duration::from_secs(5)).await;
        assert_eq!(
            p,
            Probe::Ready {
                endpoint: Endpoint {
                    host: "127.0.0.1".into(),
                    port: addr.port()
                },
                banner: "SSH-2.0-OpenSSH_9.2p1 Debian".into()
            }
        );
    }

    #[tokio::test]
    async fn non_ssh_and_closed_ports_are_not_ready() {
        let http = serve_once(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let m = LoopbackMap::new();
        m.insert("a", http).unwrap();
        m.insert("b", closed).unwrap();
        let probes = probe_all(&m, &["a", "b", "c"], Duration::from_millis(300)).await;
        assert!(
            matches!(&probes[0], Probe::NotReady { reason, .. } if reason.contains("no SSH banner")),
            "{probes:?}"
        );
        assert!(
            matches!(&probes[1], Probe::NotReady { reason, .. } if reason.contains("connect")),
            "{probes:?}"
        );
        assert!(matches!(&probes[2], Probe::Unresolved { .. }), "{probes:?}");
    }

    /// Probes of silent endpoints run concurrently: with the clock paused, a batch of eight takes
    /// exactly one timeout of virtual time, not eight.
    #[tokio::test(start_paused = true)]
    async fn probes_run_concurrently() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        });
        let m = LoopbackMap::new();
        let names: Vec<String> = (0..8).map(|i| format!("10.0.0.{i}")).collect();
        for n in &names {
            m.insert(n, addr).unwrap();
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let start = tokio::time::Instant::now();
        let probes = probe_all(&m, &refs, Duration::from_secs(10)).await;
        let elapsed = start.elapsed();
        assert!(probes.iter().all(|p| !p.is_ready()));
        assert!(elapsed >= Duration::from_secs(10), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
    }

    /// Probe reasons are logged and shown in `mpc` status output as they read here.
    #[tokio::test]
    async fn not_ready_reasons_read_exactly_as_documented() {
        let reason = |p: &Probe| match p {
            Probe::NotReady { reason, .. } => reason.clone(),
            other => panic!("{other:?}"),
        };
        let closes = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    let _ = s.write_all(b"hello\r\n").await;
                }
            });
            addr
        };
        let chatty = serve_once(&[b'x'; 5000]).await;
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let m = LoopbackMap::new();
        m.insert("closes", closes).unwrap();
        m.insert("chatty", chatty).unwrap();
        m.insert("closed", closed).unwrap();
        let t = Duration::from_secs(5);
        assert_eq!(
            reason(&probe_ssh(&m, "closes", t).await),
            "connection closed before an SSH banner"
        );
        assert_eq!(
            reason(&probe_ssh(&m, "chatty", t).await),
            "no SSH banner in the first 4 KiB"
        );
        assert_eq!(
            reason(&probe_ssh(&m, "closed", t).await),
            "connect: Connection refused (os error 111)"
        );
    }
}
