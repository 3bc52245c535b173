//! Provisioning, listing and removal of build users over SSH, and the hand-over of the private key to the
//! OTP server (docs/architecture.md, "The contract with the Go controller" and "The key hand-off
//! and retries").

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};

use super::{Context, kube as k8s};
use crate::config::{DynamicPlatform, HostOs, StaticHost};
use crate::otp::OtpClientError;
use crate::provision::{
    HostUser, KeyHandOff, ProvisionError, ProvisionRequest, Readiness, Target, Zeroizing,
};
use crate::scheduler::{Blame, HostRef, RemoteUser, TaskRunRef};

/// Why [`provision`] failed, with whose fault it is ([`ProvisionFailure::blame`]).
#[derive(Debug, thiserror::Error)]
pub enum ProvisionFailure {
    /// The host's admin key could not be read from its Secret: ours to fix, not the host's.
    #[error(transparent)]
    AdminKey(#[from] AdminKeyError),
    /// The SSH step failed; its own blame says whose fault.
    #[error(transparent)]
    Ssh(#[from] ProvisionError),
    /// The TaskRun could not be read back after the user was created.
    #[error("reading the TaskRun: {0}")]
    TaskRun(#[source] k8s::ApiError),
    /// The private key could not be stored in the OTP server.
    #[error("storing the key in the OTP server: {0}")]
    Otp(#[source] OtpClientError),
    /// The whole provisioning overran its limit (connect, script and store together).
    #[error("provisioning took longer than {0:?}")]
    TimedOut(Duration),
}

impl ProvisionFailure {
    /// Whose fault it is: the scheduler backs off a host only for the host's own failures. An
    /// overrun counts as the host's, as it did before failures were blamed: SSH is nearly all of
    /// the time.
    pub fn blame(&self) -> Blame {
        match self {
            Self::Ssh(e) => e.blame(),
            Self::TimedOut(_) => Blame::Host,
            Self::AdminKey(_) | Self::TaskRun(_) | Self::Otp(_) => Blame::Controller,
        }
    }
}

/// Why a host's admin key could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AdminKeyError {
    #[error(transparent)]
    Secret(#[from] k8s::SecretError),
    #[error("Secret {namespace}/{secret} has no {key:?} key (the host's admin SSH private key)")]
    NoKey {
        namespace: String,
        secret: String,
        key: &'static str,
    },
}

/// Why an SSH operation other than provisioning (a removal, a listing) failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    AdminKey(#[from] AdminKeyError),
    #[error(transparent)]
    Ssh(#[from] ProvisionError),
    #[error("removal took longer than {0:?}")]
    TimedOut(Duration),
}

/// The admin login for a host, with its key read now from the host's Secret (`id_rsa`).
async fn target(ctx: &Context, host: &HostRef) -> Result<Target, AdminKeyError> {
    let (secret, key_name) = match host {
        HostRef::Static(h) => (h.secret.as_str(), "id_rsa"),
        HostRef::Instance { template, .. } => (template.ssh_secret.as_str(), "id_rsa"),
    };
    let data = k8s::controller_secret(ctx, secret).await?;
    let key = data
        .get(key_name)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| AdminKeyError::NoKey {
            namespace: ctx.namespace.clone(),
            secret: secret.to_owned(),
            key: key_name,
        })?;
    let key = Arc::new(Zeroizing::new(key.clone()));
    Ok(match host {
        HostRef::Static(h) => Target::from_static(h, key),
        HostRef::Instance {
            id,
            address,
            template,
        } => Target::dynamic(id, address, &template.user, key),
    })
}

fn sudo_commands(host: &HostRef) -> &[String] {
    match host {
        HostRef::Static(_) => &[],
        HostRef::Instance { template, .. } => &template.sudo_commands,
    }
}

/// `Action::Provision`: creates the TaskRun's user with a fresh key and stores the private key in
/// the OTP server; returns the token. `rearm`: a retry attempt, whose pod already holds the token
/// of the secret as it is (the owner's latest in the OTP server); that token is re-armed with the
/// new key instead of a new one issued.
pub async fn provision(
    ctx: &Context,
    op: u64,
    taskrun: &TaskRunRef,
    host: &HostRef,
    rearm: bool,
) -> Result<String, ProvisionFailure> {
    let mut clock = Steps::new();
    // Tekton's retry count (only a used token with a retry still to come may hold its redeems
    // in the OTP server; a tenant can redeem its own token at will) is read beside the SSH
    // work rather than after it: the read was a whole API round trip on every TaskRun's way
    // to its secret, and the count changes only when a retry starts, long after this.
    let (t, ssh_part) = tokio::join!(
        async {
            let t = k8s::current(ctx, taskrun).await;
            (t, clock.since_start())
        },
        async {
            let target = target(ctx, host)
                .await
                .map_err(ProvisionFailure::AdminKey)?;
            let admin_key = clock.since_start();
            if let Some((os, template)) = hand_off_os(host) {
                let key = hand_off(ctx, os, template, &target).await?;
                let ssh = clock.since_start() - admin_key;
                ctx.known_hosts.record(ctx, &target).await;
                let known_host = clock.since_start() - admin_key - ssh;
                return Ok::<_, ProvisionFailure>((key, [admin_key, 0, ssh, known_host]));
            }
            let _permit = ctx.limits.ssh.acquire().await;
            let ssh_permit = clock.since_start() - admin_key;
            // Key type and slice caps as the host-config says now for the host or platform.
            let config = ctx.config.current().unwrap_or_default();
            let settings = match host {
                HostRef::Static(h) => config.build_users.for_static_host(&h.name),
                HostRef::Instance { template, .. } => {
                    config.build_users.for_platform(&template.platform)
                }
            };
            let req = ProvisionRequest {
                taskrun_name: taskrun.name(),
                namespace: taskrun.namespace(),
                sudo_commands: sudo_commands(host),
                settings,
            };
            let provisioned = ctx.provisioner.provision(&target, &req).await?;
            let ssh = clock.since_start() - admin_key - ssh_permit;
            // Instances too: a replica taking over must not trust whatever answers at a pool
            // instance's address next.
            ctx.known_hosts.record(ctx, &target).await;
            let known_host = clock.since_start() - admin_key - ssh_permit - ssh;
            Ok::<_, ProvisionFailure>((
                provisioned.private_key,
                [admin_key, ssh_permit, ssh, known_host],
            ))
        }
    );
    let (private_key, [admin_key, ssh_permit, ssh, known_host]) = ssh_part?;
    let (t, taskrun_read) = t;
    let t = t.map_err(ProvisionFailure::TaskRun)?;
    let rearms_left = rearms_left(&t);
    clock.lap();
    let owner = taskrun.uid().to_string();
    let token = ctx
        .keys
        .store(
            &owner,
            // Unique per provisioning (a fresh key each time, op ids restart with the process);
            // the client's own retries of this store reuse it.
            &format!("{op}-{}", hex_nonce()),
            // The token is named by owner: the controller never reads it back from the secret.
            rearm,
            rearms_left,
            private_key.as_bytes(),
        )
        .await
        .map_err(ProvisionFailure::Otp)?;
    tracing::debug!(
        target: super::TIMING,
        namespace = taskrun.namespace(),
        taskrun = taskrun.name(),
        admin_key_us = admin_key,
        ssh_permit_us = ssh_permit,
        ssh_us = ssh,
        known_host_us = known_host,
        taskrun_read_us = taskrun_read,
        otp_us = clock.lap(),
        "provisioning steps"
    );
    Ok(token)
}

/// How many more times the TaskRun's token may be re-armed, as the OTP server is told: the
/// retries Tekton may still start (`spec.retries` minus the retries started, one
/// `status.retriesStatus` entry each). The server holds a used token's redeems only while one is
/// to come: one too many keeps a last attempt's used token waiting for a re-arm that never comes,
/// one too few refuses the redeem of the retry still to start.
fn rearms_left(t: &crate::controller::taskrun::TaskRun) -> u32 {
    t.spec.retries.saturating_sub(t.status.retries)
}

/// The OS of an instance whose user-data makes the build user and its key (Windows, macOS):
/// those get the key hand-off instead of a build user.
fn hand_off_os(host: &HostRef) -> Option<(HostOs, &DynamicPlatform)> {
    match host {
        HostRef::Instance { template, .. } if template.os.hands_off_key() => {
            Some((template.os, template))
        }
        _ => None,
    }
}

/// How long provisioning on `host` may take: the key hand-off waits for the key file up to the
/// platform's allocation timeout (boots of 6-20 min, a reboot among them); everything else gets
/// `ssh_limit`.
pub fn provision_limit(host: &HostRef, ssh_limit: Duration) -> Duration {
    match hand_off_os(host) {
        Some((_, template)) => template.allocation_timeout.max(ssh_limit),
        None => ssh_limit,
    }
}

/// Longest pause between probes of the key file.
const HAND_OFF_PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// Waits for the key file (holding no SSH permit: that can take the whole allocation timeout),
/// then reads and removes it under one.
async fn hand_off(
    ctx: &Context,
    os: HostOs,
    template: &DynamicPlatform,
    target: &Target,
) -> Result<Zeroizing<String>, ProvisionError> {
    let handoff = KeyHandOff::new(ctx.provisioner.connections());
    let readiness = Readiness {
        deadline: std::time::Instant::now() + template.allocation_timeout,
        interval: template.check_interval.min(HAND_OFF_PROBE_INTERVAL),
    };
    let connections = ctx.provisioner.connections();
    let probes = handoff
        .wait_ready(connections, os, target, readiness)
        .await?;
    let _permit = ctx.limits.ssh.acquire().await;
    let key = handoff.take_key(connections, os, target).await?;
    tracing::info!(host = %target.id, platform = %template.platform, probes, "key handed off");
    Ok(key)
}

/// Microseconds between successive steps.
struct Steps(std::time::Instant);

impl Steps {
    fn new() -> Self {
        Steps(std::time::Instant::now())
    }

    fn since_start(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }

    fn lap(&mut self) -> u64 {
        let now = std::time::Instant::now();
        let us = (now - self.0).as_micros() as u64;
        self.0 = now;
        us
    }
}

fn hex_nonce() -> String {
    use rand::Rng;
    format!("{:016x}", rand::thread_rng().r#gen::<u64>())
}

/// `Action::Deprovision`: removes the user and everything provisioning created.
pub async fn deprovision(
    ctx: &Context,
    user: &RemoteUser,
    host: &HostRef,
) -> Result<(), HostError> {
    // No build user was made there, and the instance is terminated.
    if hand_off_os(host).is_some() {
        return Ok(());
    }
    let target = target(ctx, host).await?;
    let _permit = ctx.limits.ssh.acquire().await;
    Ok(ctx.provisioner.deprovision(&target, &user.name()).await?)
}

/// The build users on static host `host`.
pub async fn list_build_users(
    ctx: &Context,
    host: &StaticHost,
) -> Result<Vec<HostUser>, HostError> {
    let target = target(ctx, &HostRef::Static(Arc::new(host.clone()))).await?;
    let _permit = ctx.limits.ssh.acquire().await;
    Ok(ctx.provisioner.list_build_users(&target).await?)
}

/// Host keys learned on first use, of static hosts (by name) and instances (by instance id),
/// kept in a ConfigMap of the controller's namespace so they survive restarts and failovers and
/// every replica trusts the same keys (an emptyDir would forget them, and a replaced host key
/// would then be accepted again). An instance's entry goes when the instance is terminated.
#[derive(Debug)]
pub struct KnownHosts {
    /// The ConfigMap's name.
    name: String,
    /// What the ConfigMap holds per host id, as last read or written.
    synced: Mutex<HashMap<String, String>>,
}

impl KnownHosts {
    /// The store in ConfigMap `name`.
    pub fn new(name: String) -> Self {
        Self {
            name,
            synced: Mutex::new(HashMap::new()),
        }
    }

    /// Writes every stored record into the local known-hosts files (the ConfigMap wins). Called
    /// before a term schedules anything.
    pub async fn load(&self, ctx: &Context) -> Result<usize, KnownHostsError> {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        let cm = api
            .get_opt(&self.name)
            .await
            .map_err(|source| KnownHostsError::Api {
                configmap: format!("{}/{}", ctx.namespace, self.name),
                source,
            })?;
        let data = cm.and_then(|c| c.data).unwrap_or_default();
        let mut synced = self.synced.lock().unwrap_or_else(|e| e.into_inner());
        for (id, text) in &data {
            let path = ctx.provisioner.connections().tofu_file(id);
            if let Err(source) = std::fs::write(&path, text) {
                return Err(KnownHostsError::Write { path, source });
            }
            synced.insert(id.clone(), text.clone());
        }
        Ok(data.len())
    }

    /// Stores the record ssh made for `target` on first contact, when it is new.
    pub async fn record(&self, ctx: &Context, target: &Target) {
        if !matches!(
            target.host_key,
            crate::provision::HostKeyTrust::TrustOnFirstUse
        ) {
            return;
        }
        let path = ctx.provisioner.connections().known_hosts_file(target);
        let Ok(text) = std::fs::read_to_string(&path) else {
            return;
        };
        let known = self
            .synced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&target.id)
            .cloned();
        if text.trim().is_empty() || known.as_deref() == Some(text.as_str()) {
            return;
        }
        match self.store(ctx, &target.id, &text).await {
            Ok(()) => {
                self.synced
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(target.id.clone(), text);
                tracing::info!(host = %target.id, configmap = %self.name, "host key stored");
            }
            Err(error) => {
                tracing::warn!(host = %target.id, %error, "could not store the learned host key")
            }
        }
    }

    /// Forgets the key of a terminated instance: the ConfigMap entry and the local record.
    pub async fn forget(&self, ctx: &Context, id: &str) {
        let _ = std::fs::remove_file(ctx.provisioner.connections().tofu_file(id));
        self.synced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        for _ in 0..5 {
            let mut cm = match api.get_opt(&self.name).await {
                Ok(Some(cm)) => cm,
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(host = %id, %error, "could not remove the host key");
                    return;
                }
            };
            let removed = cm.data.as_mut().and_then(|d| d.remove(id));
            if removed.is_none() {
                return;
            }
            match api.replace(&self.name, &PostParams::default(), &cm).await {
                Ok(_) => {
                    tracing::info!(host = %id, configmap = %self.name, "host key removed");
                    return;
                }
                Err(::kube::Error::Api(s)) if s.code == 409 => continue,
                Err(error) => {
                    tracing::warn!(host = %id, %error, "could not remove the host key");
                    return;
                }
            }
        }
        tracing::warn!(host = %id, "could not remove the host key: the ConfigMap kept changing");
    }

    async fn store(&self, ctx: &Context, id: &str, text: &str) -> Result<(), KnownHostsError> {
        let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ctx.namespace);
        let failed = |source| KnownHostsError::Api {
            configmap: format!("{}/{}", ctx.namespace, self.name),
            source,
        };
        for _ in 0..5 {
            let current = api.get_opt(&self.name).await.map_err(failed)?;
            let result = match current {
                None => {
                    let cm = ConfigMap {
                        metadata: ObjectMeta {
                            name: Some(self.name.clone()),
                            ..ObjectMeta::default()
                        },
                        data: Some(BTreeMap::from([(id.to_owned(), text.to_owned())])),
                        ..ConfigMap::default()
                    };
                    api.create(&PostParams::default(), &cm).await.map(|_| ())
                }
                Some(mut cm) => {
                    // Another replica learned it first: keep theirs (the file is rewritten from
                    // it at the next term).
                    if cm.data.as_ref().is_some_and(|d| d.contains_key(id)) {
                        return Ok(());
                    }
                    cm.data
                        .get_or_insert_with(BTreeMap::new)
                        .insert(id.to_owned(), text.to_owned());
                    api.replace(&self.name, &PostParams::default(), &cm)
                        .await
                        .map(|_| ())
                }
            };
            match result {
                Ok(()) => return Ok(()),
                Err(::kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(failed(e)),
            }
        }
        Err(KnownHostsError::KeptChanging)
    }
}

/// Why the known host keys could not be loaded or stored.
#[derive(Debug, thiserror::Error)]
pub enum KnownHostsError {
    #[error("ConfigMap {configmap}: {source}")]
    Api {
        configmap: String,
        source: ::kube::Error,
    },
    #[error("writing {}: {source}", path.display())]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("the ConfigMap kept changing")]
    KeptChanging,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `spec.retries` 2: the first attempt may be re-armed twice, the first retry once, the
    /// last never; a TaskRun without retries, or past them, never.
    #[test]
    fn the_rearm_budget_is_the_retries_not_yet_started() {
        let taskrun = |retries: u32, started: usize| -> crate::controller::taskrun::TaskRun {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "b", "namespace": "t", "uid": "u"},
                "spec": {"retries": retries},
                "status": {"retriesStatus": vec![serde_json::json!({}); started]},
            }))
            .unwrap()
        };
        for (retries, started, left) in [
            (2, 0, 2),
            (2, 1, 1),
            (2, 2, 0),
            (2, 3, 0),
            (1, 0, 1),
            (1, 1, 0),
            (0, 0, 0),
        ] {
            assert_eq!(
                rearms_left(&taskrun(retries, started)),
                left,
                "retries {retries}, {started} started"
            );
        }
    }

    /// Only a failure of the host itself may count against its health.
    #[test]
    fn only_the_hosts_own_failures_are_blamed_on_it() {
        let missing = ProvisionFailure::from(AdminKeyError::Secret(k8s::SecretError::Missing {
            namespace: "ns".into(),
            name: "h1-admin".into(),
        }));
        assert_eq!(missing.blame(), Blame::Controller);
        assert_eq!(
            ProvisionFailure::Otp(OtpClientError::InvalidUrl("x".into())).blame(),
            Blame::Controller
        );
        let refused = ProvisionFailure::from(ProvisionError::AuthRefused {
            host: "h1".into(),
            detail: String::new(),
        });
        assert_eq!(refused.blame(), Blame::Host);
        let bad = ProvisionFailure::from(ProvisionError::InvalidRequest("x".into()));
        assert_eq!(bad.blame(), Blame::Request);
        let local = ProvisionFailure::from(ProvisionError::Local("no ssh".into()));
        assert_eq!(local.blame(), Blame::Controller);
        assert_eq!(
            ProvisionFailure::TimedOut(Duration::from_secs(1)).blame(),
            Blame::Host
        );
    }
}
