//! The live host-config: the current [`HostConfig`] plus change notification, fed by a backend.
//!
//! [`ConfigSource`] is what consumers hold (the webhook reads [`ConfigSource::current`] per request;
//! the scheduler can [`ConfigSource::subscribe`]). Backends push raw ConfigMap data into it with
//! [`ConfigSource::publish`] or report an unreadable input with [`ConfigSource::publish_failure`].
//! This module has the file backend ([`watch_path`]): a ConfigMap YAML file, or a directory holding
//! a mounted ConfigMap (one file per key). A ConfigMap watch is another backend of the same shape.
//!
//! The last good config keeps serving: an unreadable or unparsable input changes nothing, and a
//! readable update with entry errors keeps the previous definition of whatever those errors would
//! disable ([`config::keep_last_good`]). Problems are logged and counted in `config_errors`;
//! `platform_pool_size{platform}` (Go's: static slots, or `max-instances`) and
//! `platform_capacity{platform}` (concurrent TaskRuns) follow the config that is actually served,
//! and so do `host_drained{host,platform}` and `platform_drained{platform}` (what a drain took out
//! of service).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus::{IntCounter, IntGaugeVec, Opts, Registry};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::{self, ConfigData, Diagnostic, HostConfig, Merged, Severity, keep_last_good};
use crate::metrics;

/// Metrics about the served configuration.
#[derive(Clone, Debug)]
pub struct ConfigMetrics {
    errors: IntCounter,
    pool_size: IntGaugeVec,
    capacity: IntGaugeVec,
    host_drained: IntGaugeVec,
    platform_drained: IntGaugeVec,
}

impl ConfigMetrics {
    /// Creates `config_errors`, `platform_pool_size`, `platform_capacity`, `host_drained` and
    /// `platform_drained` and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let errors = IntCounter::with_opts(Opts::new(
            metrics::name("config_errors"),
            "Problems found in host-config updates: entry errors, plus unreadable or unparsable inputs.",
        ))?;
        let pool_size = IntGaugeVec::new(
            Opts::new(
                metrics::name("platform_pool_size"),
                "The size of the platform's machine pool under the served config: static hosts' concurrency summed, max-instances of a dynamic platform or pool (0 when disabled)",
            ),
            &["platform"],
        )?;
        let capacity = IntGaugeVec::new(
            Opts::new(
                metrics::name("platform_capacity"),
                "Concurrent TaskRuns each remote platform can serve under the served config: a dynamic pool's max-instances x concurrency (0 when disabled)",
            ),
            &["platform"],
        )?;
        let host_drained = IntGaugeVec::new(
            Opts::new(
                metrics::name("host_drained"),
                "1 while the served host-config drains the static host (drain: \"true\" or concurrency: \"0\"): it takes no new TaskRun, the builds on it finish; 0 for every other static host",
            ),
            &["host", "platform"],
        )?;
        let platform_drained = IntGaugeVec::new(
            Opts::new(
                metrics::name("platform_drained"),
                "1 while the served host-config leaves the remote platform no capacity by a drain (a drained dynamic platform or pool, or every static host drained): its TaskRuns wait until the drain is lifted; 0 for every other remote platform",
            ),
            &["platform"],
        )?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(pool_size.clone()))?;
        registry.register(Box::new(capacity.clone()))?;
        registry.register(Box::new(host_drained.clone()))?;
        registry.register(Box::new(platform_drained.clone()))?;
        Ok(Self {
            errors,
            pool_size,
            capacity,
            host_drained,
            platform_drained,
        })
    }

    /// What the served config drains: one series per static host and per remote platform.
    fn set_drained(&self, cfg: &HostConfig) {
        self.host_drained.reset();
        self.platform_drained.reset();
        for pool in cfg.static_pools.values() {
            let platform = pool.platform.label_value();
            for h in &pool.hosts {
                self.host_drained
                    .with_label_values(&[h.name.as_str(), platform.as_str()])
                    .set(i64::from(h.drained));
            }
        }
        for p in cfg.platforms() {
            if cfg.capacity(p).is_some() {
                self.platform_drained
                    .with_label_values(&[p.label_value()])
                    .set(i64::from(cfg.is_drained(p)));
            }
        }
    }

    fn set_pool_sizes(&self, cfg: &HostConfig) {
        self.pool_size.reset();
        self.capacity.reset();
        for p in cfg.platforms() {
            let Some(n) = cfg.capacity(p) else { continue };
            // Go's label value: `linux-arm64`.
            let label = [p.label_value()];
            self.capacity.with_label_values(&label).set(i64::from(n));
            // Go registers a pool with its `max-instances`: the instance alerts divide by it, so
            // a drained cloud platform keeps it (its instances finish under it).
            let machines = match cfg.resolve(p) {
                config::Strategy::DynamicPool(pool) => pool.instance.max_instances,
                config::Strategy::Dynamic(d) => d.max_instances,
                _ => n,
            };
            self.pool_size
                .with_label_values(&label)
                .set(i64::from(machines));
        }
    }
}

/// What a publish did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// Same input as last time: nothing to do.
    Unchanged,
    /// The input was parsed and is now served (merged with the last good config).
    Applied {
        /// Error diagnostics in the input.
        errors: usize,
        /// What kept its previous definition, one message each.
        kept: Vec<String>,
    },
    /// The input was rejected as a whole; the last good config (if any) keeps serving.
    Rejected(String),
}

/// The live configuration, shared by every consumer. Cloning is cheap.
#[derive(Clone, Debug)]
pub struct ConfigSource {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    tx: watch::Sender<Option<Arc<HostConfig>>>,
    metrics: Option<ConfigMetrics>,
    last: Mutex<LastInput>,
}

#[derive(Debug, Default)]
struct LastInput {
    data: Option<ConfigData>,
    failure: Option<String>,
}

impl ConfigSource {
    /// An empty source (not loaded until the first publish).
    pub fn new(metrics: Option<ConfigMetrics>) -> Self {
        let (tx, _) = watch::channel(None);
        Self {
            inner: Arc::new(Inner {
                tx,
                metrics,
                last: Mutex::new(LastInput::default()),
            }),
        }
    }

    /// A source serving `config` until something is published (tests, benchmarks, simulation).
    pub fn fixed(config: HostConfig) -> Self {
        let s = Self::new(None);
        s.inner.tx.send_replace(Some(Arc::new(config)));
        s
    }

    /// The config being served, `None` until the first successful load.
    pub fn current(&self) -> Option<Arc<HostConfig>> {
        self.inner.tx.borrow().clone()
    }

    /// True once a config has been loaded.
    pub fn is_loaded(&self) -> bool {
        self.inner.tx.borrow().is_some()
    }

    /// A receiver that sees every change of the served config.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<HostConfig>>> {
        self.inner.tx.subscribe()
    }

    /// Publishes ConfigMap data read by a backend (`read_diagnostics` are problems the backend found
    /// while reading, e.g. non-string values). `origin` names the input in logs.
    pub fn publish(
        &self,
        origin: &str,
        data: ConfigData,
        read_diagnostics: Vec<Diagnostic>,
    ) -> Update {
        let mut last = self.inner.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.data.as_ref() == Some(&data) {
            if last.failure.take().is_some() {
                tracing::info!(origin, "host-config readable again, unchanged");
            }
            return Update::Unchanged;
        }
        last.failure = None;
        let mut parsed = config::parse(&data);
        let mut diagnostics = read_diagnostics;
        diagnostics.append(&mut parsed.diagnostics);
        let errors = diagnostics
            .iter()
            .filter(|d| d.severity == Severity::Error)
            .count();
        for d in &diagnostics {
            match d.severity {
                Severity::Error => tracing::warn!(origin, diagnostic = %d, "host-config error"),
                _ => tracing::info!(origin, diagnostic = %d, "host-config warning"),
            }
        }
        if let Some(m) = &self.inner.metrics {
            m.errors.inc_by(errors as u64);
        }
        let previous = self.current();
        let merged = match previous.as_deref() {
            Some(prev) => keep_last_good(prev, parsed.config, &diagnostics),
            None => Merged {
                config: parsed.config,
                kept: Vec::new(),
                rejected: None,
            },
        };
        last.data = Some(data);
        if let Some(why) = merged.rejected {
            tracing::warn!(origin, reason = %why, "host-config update not applied; the previous config keeps serving");
            return Update::Rejected(why);
        }
        for k in &merged.kept {
            tracing::warn!(origin, kept = %k, "host-config entry kept from the previous config");
        }
        self.serve(merged.config);
        tracing::info!(
            origin,
            errors,
            kept = merged.kept.len(),
            "host-config loaded"
        );
        Update::Applied {
            errors,
            kept: merged.kept,
        }
    }

    /// Reports an input that could not be read or parsed at all; counted once per distinct error.
    pub fn publish_failure(&self, origin: &str, error: &str) -> Update {
        let mut last = self.inner.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.failure.as_deref() == Some(error) {
            return Update::Unchanged;
        }
        last.failure = Some(error.to_owned());
        // Whatever comes next must be re-applied even if it equals the last good input.
        last.data = None;
        if let Some(m) = &self.inner.metrics {
            m.errors.inc();
        }
        let serving = if self.is_loaded() {
            "the previous config keeps serving"
        } else {
            "no config loaded yet"
        };
        tracing::warn!(origin, %error, "host-config unreadable; {serving}");
        Update::Rejected(error.to_owned())
    }

    fn serve(&self, cfg: HostConfig) {
        if let Some(m) = &self.inner.metrics {
            m.set_pool_sizes(&cfg);
            m.set_drained(&cfg);
        }
        self.inner.tx.send_if_modified(|cur| {
            if cur.as_deref() == Some(&cfg) {
                false
            } else {
                *cur = Some(Arc::new(cfg));
                true
            }
        });
    }
}

/// Why a host-config file or directory cannot be read at all.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not UTF-8 text: {source}", path.display())]
    NotUtf8 {
        path: PathBuf,
        source: std::str::Utf8Error,
    },
    #[error("{}: {source}", path.display())]
    ConfigMap {
        path: PathBuf,
        source: config::ConfigMapError,
    },
}

impl ReadError {
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        |source| Self::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// Reads a host-config from `path`: a ConfigMap YAML file, or a directory where a ConfigMap is
/// mounted (one file per key; Kubernetes' `..data` snapshot is read when present, so a swap in
/// progress is never seen half done).
pub fn read_path(path: &Path) -> Result<(ConfigData, Vec<Diagnostic>), ReadError> {
    let meta = std::fs::metadata(path).map_err(ReadError::io(path))?;
    if meta.is_dir() {
        return read_dir(path).map(|d| (d, Vec::new()));
    }
    let bytes = std::fs::read(path).map_err(ReadError::io(path))?;
    let text = std::str::from_utf8(&bytes).map_err(|source| ReadError::NotUtf8 {
        path: path.to_owned(),
        source,
    })?;
    config::read_configmap_yaml(text).map_err(|source| ReadError::ConfigMap {
        path: path.to_owned(),
        source,
    })
}

fn read_dir(dir: &Path) -> Result<ConfigData, ReadError> {
    // `..data` points at the current timestamped snapshot directory.
    let snapshot = dir.join("..data");
    let root = if snapshot.is_dir() {
        std::fs::canonicalize(&snapshot).map_err(ReadError::io(&snapshot))?
    } else {
        dir.to_owned()
    };
    let mut data = ConfigData::new();
    for entry in std::fs::read_dir(&root).map_err(ReadError::io(&root))? {
        let entry = entry.map_err(ReadError::io(&root))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if name.starts_with('.') {
            continue;
        }
        let p = entry.path();
        if !p.is_file() {
            continue;
        }
        let bytes = std::fs::read(&p).map_err(ReadError::io(&p))?;
        let value = String::from_utf8(bytes).map_err(|e| ReadError::NotUtf8 {
            source: e.utf8_error(),
            path: p,
        })?;
        data.insert(name, value);
    }
    Ok(data)
}

/// Reads `path` once and publishes the result.
pub fn load_path(source: &ConfigSource, path: &Path) -> Update {
    let origin = path.display().to_string();
    match read_path(path) {
        Ok((data, diags)) => source.publish(&origin, data, diags),
        Err(e) => source.publish_failure(&origin, &e.to_string()),
    }
}

/// Polls `path` every `interval` (reading follows symlink swaps) until `cancel` fires.
pub fn watch_path(
    source: ConfigSource,
    path: PathBuf,
    interval: Duration,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let (s, p) = (source.clone(), path.clone());
            // File reads are blocking; they are small, but keep them off the async workers.
            let _ = tokio::task::spawn_blocking(move || load_path(&s, &p)).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::platform::Platform;

    /// A dynamic platform of 4 instances and a static one of 2 + 3 slots.
    fn base() -> ConfigData {
        [
            ("dynamic-platforms", "linux/arm64"),
            ("dynamic.linux-arm64.type", "aws"),
            ("dynamic.linux-arm64.region", "us-east-1"),
            ("dynamic.linux-arm64.ami", "ami-1"),
            ("dynamic.linux-arm64.instance-type", "m6g.large"),
            ("dynamic.linux-arm64.aws-secret", "aws"),
            ("dynamic.linux-arm64.ssh-secret", "ssh"),
            ("dynamic.linux-arm64.max-instances", "4"),
            ("host.p1.address", "10.0.0.1"),
            ("host.p1.platform", "linux/ppc64le"),
            ("host.p1.user", "builder"),
            ("host.p1.secret", "ssh"),
            ("host.p1.concurrency", "2"),
            ("host.p2.address", "10.0.0.2"),
            ("host.p2.platform", "linux/ppc64le"),
            ("host.p2.user", "builder"),
            ("host.p2.secret", "ssh"),
            ("host.p2.concurrency", "3"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
    }

    #[test]
    fn publish_serves_counts_and_keeps_last_good() {
        let registry = Registry::new();
        let metrics = ConfigMetrics::register(&registry).unwrap();
        let src = ConfigSource::new(Some(metrics.clone()));
        let mut rx = src.subscribe();
        assert!(!src.is_loaded());
        assert!(matches!(
            src.publish("t", base(), Vec::new()),
            Update::Applied { errors: 0, .. }
        ));
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        assert_eq!(src.publish("t", base(), Vec::new()), Update::Unchanged);
        assert!(!rx.has_changed().unwrap());
        let size = |pl: &str| metrics.pool_size.with_label_values(&[pl]).get();
        assert_eq!(size("linux-arm64"), 4);
        assert_eq!(size("linux-ppc64le"), 5);

        let mut bad = base();
        bad.insert("dynamic.linux-arm64.max-instances".into(), "x".into());
        match src.publish("t", bad.clone(), Vec::new()) {
            Update::Applied { errors: 1, kept } => assert_eq!(kept.len(), 1),
            other => panic!("{other:?}"),
        }
        assert_eq!(metrics.errors.get(), 1);
        assert_eq!(
            src.current().unwrap().dynamic[&Platform::parse("linux/arm64").unwrap()].max_instances,
            4
        );
        assert_eq!(
            size("linux-arm64"),
            4,
            "the gauge follows the served config"
        );

        // Unreadable input: counted once, config unchanged.
        assert!(matches!(
            src.publish_failure("t", "boom"),
            Update::Rejected(_)
        ));
        assert_eq!(src.publish_failure("t", "boom"), Update::Unchanged);
        assert_eq!(metrics.errors.get(), 2);
        assert!(src.is_loaded());

        // Removing a platform drops its gauge series.
        let mut smaller = base();
        smaller.insert("dynamic-platforms".into(), "".into());
        src.publish("t", smaller, Vec::new());
        let text = metrics::encode(&registry);
        assert!(!text.contains("platform=\"linux-arm64\""), "{text}");
        assert!(text.contains("platform=\"linux-ppc64le\"} 5"), "{text}");
    }

    /// The drain gauges follow the served config: a drained host and a drained platform read 1,
    /// the rest 0; the capacity drops, the cloud platform's pool size (the alerts' divisor) stays.
    #[test]
    fn drained_hosts_and_platforms_have_their_gauges() {
        let registry = Registry::new();
        let metrics = ConfigMetrics::register(&registry).unwrap();
        let src = ConfigSource::new(Some(metrics.clone()));
        src.publish("t", base(), Vec::new());
        let host = |h: &str| {
            metrics
                .host_drained
                .with_label_values(&[h, "linux-ppc64le"])
                .get()
        };
        let platform = |p: &str| metrics.platform_drained.with_label_values(&[p]).get();
        assert_eq!((host("p1"), host("p2")), (0, 0));
        assert_eq!(platform("linux-arm64"), 0);
        let mut drained = base();
        drained.insert("host.p1.concurrency".into(), "0".into());
        drained.insert("dynamic.linux-arm64.drain".into(), "true".into());
        src.publish("t", drained.clone(), Vec::new());
        assert_eq!((host("p1"), host("p2")), (1, 0));
        assert_eq!(platform("linux-arm64"), 1);
        assert_eq!(platform("linux-ppc64le"), 0, "p2 still serves");
        assert_eq!(
            metrics.capacity.with_label_values(&["linux-arm64"]).get(),
            0
        );
        assert_eq!(
            metrics.pool_size.with_label_values(&["linux-arm64"]).get(),
            4
        );
        assert_eq!(
            metrics.capacity.with_label_values(&["linux-ppc64le"]).get(),
            3
        );
        drained.insert("host.p2.drain".into(), "true".into());
        src.publish("t", drained, Vec::new());
        assert_eq!(platform("linux-ppc64le"), 1, "every host drained");
        src.publish("t", base(), Vec::new());
        assert_eq!((host("p1"), platform("linux-arm64")), (0, 0));
    }

    /// Go's `platform_pool_size` is `max-instances` for a dynamic pool (what the instance alerts
    /// divide by), not the concurrent TaskRuns it can serve.
    #[test]
    fn pool_size_of_a_dynamic_pool_is_max_instances() {
        let registry = Registry::new();
        let metrics = ConfigMetrics::register(&registry).unwrap();
        let src = ConfigSource::new(Some(metrics.clone()));
        let mut data = base();
        data.insert("dynamic-pool-platforms".into(), "linux/amd64".into());
        for (k, v) in [
            ("type", "aws"),
            ("region", "us-east-1"),
            ("ami", "ami-1"),
            ("instance-type", "m6i.large"),
            ("aws-secret", "aws"),
            ("ssh-secret", "ssh"),
            ("max-instances", "3"),
            ("concurrency", "4"),
            ("max-age", "60"),
        ] {
            data.insert(format!("dynamic.linux-amd64.{k}"), v.into());
        }
        assert!(matches!(
            src.publish("t", data, Vec::new()),
            Update::Applied { errors: 0, .. }
        ));
        let text = metrics::encode(&registry);
        let has = |series: &str| text.lines().any(|l| l == series);
        for series in [
            "multi_platform_controller_platform_pool_size{platform=\"linux-amd64\"} 3",
            "multi_platform_controller_platform_pool_size{platform=\"linux-arm64\"} 4",
            "multi_platform_controller_platform_pool_size{platform=\"linux-ppc64le\"} 5",
            "multi_platform_controller_platform_capacity{platform=\"linux-amd64\"} 12",
            "multi_platform_controller_platform_capacity{platform=\"linux-arm64\"} 4",
            "multi_platform_controller_platform_capacity{platform=\"linux-ppc64le\"} 5",
        ] {
            assert!(has(series), "{series} in\n{text}");
        }
    }

    #[test]
    fn reads_a_mounted_configmap_directory_through_its_data_symlink() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let snap1 = d.join("..2025_01_01_00_00_00.1");
        std::fs::create_dir(&snap1).unwrap();
        std::fs::write(snap1.join("local-platforms"), "linux/amd64").unwrap();
        symlink("..2025_01_01_00_00_00.1", d.join("..data")).unwrap();
        symlink("..data/local-platforms", d.join("local-platforms")).unwrap();
        let (data, _) = read_path(d).unwrap();
        assert_eq!(data.len(), 1);
        assert_eq!(data["local-platforms"], "linux/amd64");

        // Kubernetes-style swap: new snapshot, then an atomic rename of a new `..data` link.
        let snap2 = d.join("..2025_01_01_00_01_00.2");
        std::fs::create_dir(&snap2).unwrap();
        std::fs::write(snap2.join("local-platforms"), "linux/arm64").unwrap();
        std::fs::write(snap2.join("gate-pending"), "true").unwrap();
        symlink("..2025_01_01_00_01_00.2", d.join("..data_tmp")).unwrap();
        std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        std::fs::remove_dir_all(&snap1).unwrap();
        let (data, _) = read_path(d).unwrap();
        assert_eq!(data["local-platforms"], "linux/arm64");
        assert_eq!(data["gate-pending"], "true");
    }

    #[test]
    fn read_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("host-config.yaml");
        let e = read_path(&f).unwrap_err().to_string();
        assert!(e.contains("host-config.yaml"), "{e}");
        std::fs::write(&f, "kind: Secret\n").unwrap();
        let e = read_path(&f).unwrap_err().to_string();
        assert!(e.contains("not a ConfigMap"), "{e}");
    }

    /// The reason a config file cannot be served is logged and published as it reads here.
    #[test]
    fn read_error_messages_read_exactly_as_documented() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("host-config.yaml");
        let shown = f.display().to_string();
        assert_eq!(
            read_path(&f).unwrap_err().to_string(),
            format!("cannot read {shown}: No such file or directory (os error 2)")
        );
        std::fs::write(&f, b"kind: \xff\n").unwrap();
        assert_eq!(
            read_path(&f).unwrap_err().to_string(),
            format!("{shown}: not UTF-8 text: invalid utf-8 sequence of 1 bytes from index 6")
        );
        std::fs::write(&f, "kind: Secret\n").unwrap();
        assert_eq!(
            read_path(&f).unwrap_err().to_string(),
            format!("{shown}: not a ConfigMap: kind is Secret")
        );
        let mounted = dir.path().join("mounted");
        std::fs::create_dir(&mounted).unwrap();
        std::fs::write(mounted.join("local-platforms"), b"\xff").unwrap();
        assert_eq!(
            read_path(&mounted).unwrap_err().to_string(),
            format!(
                "{}: not UTF-8 text: invalid utf-8 sequence of 1 bytes from index 0",
                mounted.join("local-platforms").display()
            )
        );
    }
}
