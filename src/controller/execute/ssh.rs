//! Provisioning and removal of build users over SSH, and the hand-over of the private key to the
//! OTP server (design §6, §7).

use std::sync::Arc;

use super::{Context, kube};
use crate::provision::{ProvisionRequest, Target, Zeroizing};
use crate::scheduler::{HostRef, RemoteUser, TaskRunRef};

/// The admin login for a host, with its key read now from the host's Secret (`id_rsa`).
async fn target(ctx: &Context, host: &HostRef) -> Result<Target, String> {
    let (secret, key_name) = match host {
        HostRef::Static(h) => (h.secret.as_str(), "id_rsa"),
        HostRef::Instance { template, .. } => (template.ssh_secret.as_str(), "id_rsa"),
    };
    let data = kube::controller_secret(ctx, secret).await?;
    let key = data.get(key_name).filter(|k| !k.is_empty()).ok_or_else(|| {
        format!(
            "Secret {}/{secret} has no {key_name:?} key (the host's admin SSH private key)",
            ctx.namespace
        )
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
/// of the secret as it is; that token is re-armed with the new key instead of a new one issued.
pub async fn provision(
    ctx: &Context,
    op: u64,
    taskrun: &TaskRunRef,
    host: &HostRef,
    rearm: bool,
) -> Result<String, String> {
    let target = target(ctx, host).await?;
    let _permit = ctx.limits.ssh.acquire().await;
    let req = ProvisionRequest {
        taskrun_name: taskrun.name(),
        namespace: taskrun.namespace(),
        sudo_commands: sudo_commands(host),
    };
    let provisioned = ctx
        .provisioner
        .provision(&target, &req)
        .await
        .map_err(|e| e.to_string())?;
    let rearm_token = if rearm {
        match kube::read_secret(ctx, taskrun).await {
            Ok(s) => s.as_ref().and_then(crate::controller::patch::secret_token),
            Err(e) => return Err(format!("reading the secret to re-arm its token: {e}")),
        }
    } else {
        None
    };
    let owner = taskrun.uid().to_string();
    ctx.keys
        .store(
            &owner,
            &format!("{owner}-{op}"),
            rearm_token.as_deref(),
            provisioned.private_key.as_bytes(),
        )
        .await
        .map_err(|e| format!("storing the key in the OTP server: {e}"))
}

/// `Action::Deprovision`: removes the user and everything provisioning created.
pub async fn deprovision(ctx: &Context, user: &RemoteUser, host: &HostRef) -> Result<(), String> {
    let target = target(ctx, host).await?;
    let _permit = ctx.limits.ssh.acquire().await;
    ctx.provisioner
        .deprovision(&target, &user.name())
        .await
        .map_err(|e| e.to_string())
}
