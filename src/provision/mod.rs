//! SSH provisioning of per-TaskRun build users on remote hosts, and their cleanup
//! (docs/architecture.md, "The contract with the Go controller").
//!
//! The controller connects as the host's admin over a multiplexed `openssh` master per host
//! ([`Connections`]), generates the build user's key pair in-process ([`keys`]: ed25519, or RSA
//! for FIPS hosts), and sends one constant script per operation with every value passed as a
//! quoted positional parameter ([`quote`], [`scripts`]). The private key never reaches the host:
//! the caller hands it to the OTP server.
//!
//! This module takes the admin key as bytes and knows nothing about Kubernetes; the caller reads
//! Secrets and config. What a host's build users get (key type, slice caps) comes from the config
//! ([`crate::config::BuildUsers`]) through [`ProvisionRequest::settings`].

mod connection;
mod error;
pub mod handoff;
pub mod keys;
pub mod quote;
pub mod scripts;
mod target;

pub use zeroize::Zeroizing;

pub use crate::config::BuildUserSettings;
/// What [`Provisioner::list_build_users`] finds (its ages parsed by [`scripts::parse_user_listing`]).
pub use crate::scheduler::HostUser;

pub use connection::{Connections, SshOptions};
pub use error::{Blame, ProvisionError};
pub use handoff::{GoSecretLayout, KeyHandOff, Readiness};
pub use scripts::{Limit, LimitItem};
pub use target::{HostKeyTrust, Target};

/// What to provision: one TaskRun's build user.
#[derive(Debug, Clone, Copy)]
pub struct ProvisionRequest<'a> {
    pub taskrun_name: &'a str,
    /// TaskRun namespace.
    pub namespace: &'a str,
    /// Commands the user may run with `sudo` (from `dynamic.<p>.sudo-commands`); empty for none.
    pub sudo_commands: &'a [String],
    /// Key type and slice caps, as the config says for the host or platform
    /// (`HostConfig::build_users`).
    pub settings: &'a BuildUserSettings,
}

/// A provisioned build user, with the private key the build step will fetch through the OTP server.
pub struct Provisioned {
    /// The user (`u-<28 hex>`).
    pub user: String,
    /// `/home/<user>` (the secret's `user-dir`).
    pub home: String,
    /// `<user>@<address>` (the secret's `host`).
    pub login: String,
    /// The OpenSSH private key; only this process and the OTP server ever hold it.
    pub private_key: Zeroizing<String>,
    /// The `authorized_keys` line installed on the host.
    pub public_key: String,
}

impl std::fmt::Debug for Provisioned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Provisioned")
            .field("user", &self.user)
            .field("login", &self.login)
            .finish_non_exhaustive()
    }
}

/// Provisions and removes build users over SSH.
#[derive(Debug)]
pub struct Provisioner {
    connections: Connections,
    limits: Vec<Limit>,
}

impl Provisioner {
    /// A provisioner using `opts` (connections are opened on first use).
    pub fn new(opts: SshOptions) -> Result<Self, ProvisionError> {
        Ok(Self {
            connections: Connections::new(opts)?,
            limits: scripts::default_limits(),
        })
    }

    /// Replaces the resource limits written for each user (empty: no limits file).
    pub fn with_limits(mut self, limits: Vec<Limit>) -> Self {
        self.limits = limits;
        self
    }

    /// The connection manager.
    pub fn connections(&self) -> &Connections {
        &self.connections
    }

    /// Creates (or refreshes) the TaskRun's user on `target` with a new key. Idempotent: running it
    /// again leaves one user whose only authorized key is the new one.
    pub async fn provision(
        &self,
        target: &Target,
        req: &ProvisionRequest<'_>,
    ) -> Result<Provisioned, ProvisionError> {
        let user = crate::contract::remote_user_name(req.taskrun_name, req.namespace);
        let sudo_commands = if req.sudo_commands.is_empty() {
            Vec::new()
        } else {
            // Same rules as the config parser; commands cannot contain ',' so joining round-trips.
            crate::config::values::sudo_commands(&req.sudo_commands.join(","))
                .map_err(|e| ProvisionError::InvalidRequest(format!("sudo-commands: {e}")))?
        };
        let started = std::time::Instant::now();
        let key_type = req.settings.key_type;
        let comment = format!("mpc:{user}");
        let pair = match key_type {
            keys::KeyType::Ed25519 => keys::generate_as(key_type, &comment),
            // Tens to hundreds of milliseconds of CPU: keep it off the async workers.
            keys::KeyType::Rsa { .. } => {
                tokio::task::spawn_blocking(move || keys::generate_as(key_type, &comment))
                    .await
                    .map_err(|e| ProvisionError::Local(format!("key generation task: {e}")))?
            }
        }
        .map_err(|e| ProvisionError::Local(e.to_string()))?;
        let sudoers = scripts::sudoers_file(&user, &sudo_commands);
        let limits = scripts::limits_file(&user, &self.limits);
        let slice = scripts::slice_drop_in(&user, req.settings);
        let keyed = started.elapsed();
        let out = self
            .connections
            .run(target, "provision", |prefix| {
                scripts::provision_command(
                    prefix,
                    &user,
                    &pair.public_openssh,
                    &sudoers,
                    &limits,
                    &slice,
                )
            })
            .await?;
        tracing::info!(
            host = %target.id,
            %user,
            taskrun = req.taskrun_name,
            namespace = req.namespace,
            sudo = !sudo_commands.is_empty(),
            key_type = %key_type,
            slice = !slice.is_empty(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            keygen_us = keyed.as_micros() as u64,
            permit_us = out.timing.permit.as_micros() as u64,
            session_us = out.timing.session.as_micros() as u64,
            script_us = out.timing.command.as_micros() as u64,
            "build user provisioned"
        );
        Ok(Provisioned {
            home: format!("/home/{user}"),
            login: target.login_for(&user),
            user,
            private_key: pair.private_openssh,
            public_key: pair.public_openssh,
        })
    }

    /// Removes `user` from `target`: kills its processes and those of its subordinate ids (rootless
    /// containers), removes what they left in the shared directories, deletes the account, its
    /// home, and the sudoers, limits and slice files ([`scripts::DEPROVISION`]). Succeeds when the
    /// user is already gone; fails, keeping the account, while something of it cannot be removed.
    pub async fn deprovision(&self, target: &Target, user: &str) -> Result<(), ProvisionError> {
        self.remove_users(target, &[user]).await
    }

    /// Removes the TaskRun's user (see [`Self::deprovision`]).
    pub async fn deprovision_taskrun(
        &self,
        target: &Target,
        taskrun_name: &str,
        namespace: &str,
    ) -> Result<(), ProvisionError> {
        let user = crate::contract::remote_user_name(taskrun_name, namespace);
        self.deprovision(target, &user).await
    }

    async fn remove_users(&self, target: &Target, users: &[&str]) -> Result<(), ProvisionError> {
        if let Some(bad) = users
            .iter()
            .find(|u| !crate::contract::is_remote_user_name(u))
        {
            return Err(ProvisionError::InvalidRequest(format!(
                "{bad:?} is not a build user (u- followed by 28 hex digits); refusing to delete it"
            )));
        }
        if users.is_empty() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        self.connections
            .run(target, "deprovision", |prefix| {
                scripts::deprovision_command(prefix, users)
            })
            .await?;
        tracing::info!(
            host = %target.id,
            users = ?users,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "build users removed"
        );
        Ok(())
    }

    /// The build users (`u-<28 hex>`) present on `target`, with their ages (one SSH command).
    pub async fn list_build_users(&self, target: &Target) -> Result<Vec<HostUser>, ProvisionError> {
        const OPERATION: &str = "list users";
        let out = self
            .connections
            .run(target, OPERATION, scripts::list_users_command)
            .await?;
        scripts::parse_user_listing(&String::from_utf8_lossy(&out.stdout)).map_err(|detail| {
            ProvisionError::UnexpectedOutput {
                host: target.id.clone(),
                operation: OPERATION,
                detail,
            }
        })
    }

    /// Drops the connection to `id` and its trust-on-first-use record (call when an instance is
    /// terminated, so its id never matches a different machine's key).
    pub async fn forget_host(&self, id: &str) {
        self.connections.forget(id).await;
    }

    /// Closes every connection (graceful shutdown).
    pub async fn close(&self) {
        self.connections.close_all().await;
    }
}
