//! The key hand-off of Windows and macOS instances (docs/architecture.md, "The contract with the
//! Go controller").
//!
//! On these hosts no build user is created or removed: the operator's user-data creates the local
//! user `konflux-builder`, generates its key pair and leaves the private key in a file of the
//! admin's home. The controller logs in as the admin (`Administrator`, `ec2-user`) with the
//! platform's `ssh-secret`, waits until that file exists, reads it, removes it (a failed removal
//! fails the hand-off: the key must not stay readable on the host), and hands the key out as the
//! Go controller does. The instance is terminated when the TaskRun ends.
//!
//! Readiness is the key file, not port 22: user-data that starts sshd early (or reboots after
//! creating the key) opens the port before the key exists. The file is probed until the
//! allocation deadline; a reboot in the middle (connection reset, port closed for a while) is
//! waited out.
//!
//! Nothing here runs a POSIX shell on a Windows host: each command is one fixed `powershell
//! -Command` line, sent as is by a plain `ssh` (the multiplexed connections of
//! [`super::Connections`] wrap commands in `sh` and ask `id -u`, which Windows cannot answer).
//! Host keys follow the same trust-on-first-use store, keyed by instance id.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use zeroize::Zeroizing;

use super::error::{ProvisionError, tail};
use super::target::{HostKeyTrust, Target};
use super::{Connections, SshOptions};
use crate::config::HostOs;

/// The build user the instance's user-data creates.
pub const BUILD_USER: &str = "konflux-builder";
/// Where Windows user-data leaves the build user's private key.
pub const WINDOWS_KEY_FILE: &str = r"C:\Users\Administrator\konflux-builder";
/// Where macOS user-data leaves it.
pub const MACOS_KEY_FILE: &str = "/Users/ec2-user/konflux-builder";
/// The secret's `user-dir` on Windows: the Go controller's script writes it from single quotes,
/// so the backslashes are stored doubled, literally.
pub const WINDOWS_USER_DIR: &str = r"C:\\Users\\konflux-builder";
/// The secret's `user-dir` on macOS.
pub const MACOS_USER_DIR: &str = "/Users/konflux-builder";

/// ssh's own exit status for a failure of ssh itself (connection, authentication, host key), as
/// opposed to the remote command's.
const SSH_FAILED: i32 = 255;

/// The three commands of a hand-off, exactly as the Go controller sends them (Windows) or their
/// macOS form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commands {
    /// Succeeds and says whether the key file exists.
    pub ready: &'static str,
    /// Prints the key.
    pub read: &'static str,
    /// Removes the key file.
    pub remove: &'static str,
}

/// The commands for `os`; `None` for Linux (build users are provisioned there).
pub fn commands(os: HostOs) -> Option<Commands> {
    match os {
        HostOs::Linux => None,
        HostOs::Windows => Some(Commands {
            ready: r"powershell -Command Test-Path C:\Users\Administrator\konflux-builder",
            read: r"powershell -Command cat C:\Users\Administrator\konflux-builder",
            remove: r"powershell -Command rm C:\Users\Administrator\konflux-builder",
        }),
        HostOs::MacOs => Some(Commands {
            ready: "test -f /Users/ec2-user/konflux-builder",
            read: "cat /Users/ec2-user/konflux-builder",
            remove: "sudo rm /Users/ec2-user/konflux-builder",
        }),
    }
}

/// Whether a readiness probe that ran (ssh itself did not fail) found the key file. PowerShell's
/// `Test-Path` exits 0 either way and prints `True` or `False` (CRLF-terminated); `test -f` says
/// it by its exit status.
pub fn key_file_present(os: HostOs, exit_code: i32, stdout: &[u8]) -> bool {
    match os {
        HostOs::Windows => {
            exit_code == 0
                && String::from_utf8_lossy(stdout)
                    .trim()
                    .eq_ignore_ascii_case("true")
        }
        HostOs::MacOs | HostOs::Linux => exit_code == 0,
    }
}

/// The private key as printed by the host: `\r` stripped (PowerShell's `cat` ends lines with
/// CRLF), one trailing newline, and it must look like a private key.
pub fn parse_key(stdout: &[u8]) -> Result<Zeroizing<String>, String> {
    let text = Zeroizing::new(String::from_utf8(stdout.to_vec()).map_err(|_| "not UTF-8")?);
    let mut key = Zeroizing::new(text.replace('\r', ""));
    let trimmed_len = key.trim_end().len();
    key.truncate(trimmed_len);
    let key_start = key.trim_start();
    if !key_start.starts_with("-----BEGIN ") || !key.contains("PRIVATE KEY-----") {
        return Err(format!(
            "{} bytes that are not a PEM or OpenSSH private key",
            stdout.len()
        ));
    }
    let mut out = Zeroizing::new(key_start.to_owned());
    out.push('\n');
    Ok(out)
}

/// The secret values that name the host and the build user's directory, byte for byte as the
/// Go controller writes them: `host`, `user-dir` and `otp-server` end with a newline (its scripts
/// `echo` each value into `base64`), `otp` does not. Consumers read them with `$(cat ...)`,
/// which drops the newline; parity keeps any stricter consumer of the Go layout working.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoSecretLayout {
    /// `konflux-builder@<address>\n`.
    pub host: String,
    /// `C:\\Users\\konflux-builder\n` (doubled backslashes) or `/Users/konflux-builder\n`.
    pub user_dir: String,
}

impl GoSecretLayout {
    /// The layout for an instance of `os` at `address`; `None` for Linux.
    pub fn new(os: HostOs, address: &str) -> Option<Self> {
        let dir = match os {
            HostOs::Linux => return None,
            HostOs::Windows => WINDOWS_USER_DIR,
            HostOs::MacOs => MACOS_USER_DIR,
        };
        Some(Self {
            host: format!("{BUILD_USER}@{address}\n"),
            user_dir: format!("{dir}\n"),
        })
    }

    /// `otp-server` as Go writes it.
    pub fn otp_server(url: &str) -> String {
        format!("{url}\n")
    }
}

/// How a hand-off waits for the key file.
#[derive(Debug, Clone, Copy)]
pub struct Readiness {
    /// Give up after this instant (the allocation deadline).
    pub deadline: Instant,
    /// Pause between probes.
    pub interval: Duration,
}

/// Takes the build user's key off Windows and macOS instances over plain `ssh` commands.
#[derive(Debug, Clone)]
pub struct KeyHandOff {
    opts: SshOptions,
    keys_dir: PathBuf,
}

/// What one `ssh` run gave.
struct Ran {
    code: i32,
    stdout: Zeroizing<Vec<u8>>,
    stderr: String,
}

impl KeyHandOff {
    /// A hand-off sharing `connections`' state directory (and so its host-key store).
    pub fn new(connections: &Connections) -> Self {
        let opts = connections.options().clone();
        let keys_dir = opts.state_dir.join("keys");
        Self { opts, keys_dir }
    }

    /// Probes until the key file exists or `readiness.deadline` passes; returns the number of
    /// probes. Unreachable hosts, refused logins (sshd up before the key is authorised) and a
    /// reboot's closed port are waited out; the last failure is returned at the deadline.
    pub async fn wait_ready(
        &self,
        connections: &Connections,
        os: HostOs,
        target: &Target,
        readiness: Readiness,
    ) -> Result<u32, ProvisionError> {
        let cmds = commands(os).ok_or_else(|| not_handed_off(os))?;
        let mut probes = 0;
        let mut last: Option<ProvisionError> = None;
        loop {
            probes += 1;
            let left = readiness.deadline.saturating_duration_since(Instant::now());
            let e = match self
                .ssh(
                    connections,
                    target,
                    cmds.ready,
                    left.min(self.opts.command_timeout),
                )
                .await
            {
                Ok(ran) if ran.code == SSH_FAILED => ssh_failure(target, &ran),
                Ok(ran) if key_file_present(os, ran.code, &ran.stdout) => return Ok(probes),
                Ok(ran) => ProvisionError::CommandFailed {
                    host: target.id.clone(),
                    operation: "wait for the key file",
                    exit_code: Some(ran.code),
                    stderr_tail: format!(
                        "{} not there yet {}",
                        key_file(os),
                        tail(&ran.stderr, 200)
                    ),
                },
                Err(e) => e,
            };
            if matches!(
                e,
                ProvisionError::HostKeyMismatch { .. }
                    | ProvisionError::Local(_)
                    | ProvisionError::InvalidRequest(_)
            ) {
                return Err(e);
            }
            tracing::debug!(host = %target.id, probes, error = %e, "key file not ready");
            // A probe cut short by the deadline says less than the answer before it.
            let e = match (e, last.take()) {
                (ProvisionError::Timeout { .. }, Some(earlier)) => earlier,
                (e, _) => e,
            };
            let now = Instant::now();
            if now + readiness.interval >= readiness.deadline {
                return Err(e);
            }
            last = Some(e);
            tokio::time::sleep(readiness.interval).await;
        }
    }

    /// Reads the key and removes its file; a failed removal fails the hand-off.
    pub async fn take_key(
        &self,
        connections: &Connections,
        os: HostOs,
        target: &Target,
    ) -> Result<Zeroizing<String>, ProvisionError> {
        let cmds = commands(os).ok_or_else(|| not_handed_off(os))?;
        let limit = self.opts.command_timeout;
        let read = self.ssh(connections, target, cmds.read, limit).await?;
        check(target, "read the key file", &read)?;
        let key = parse_key(&read.stdout).map_err(|detail| ProvisionError::UnexpectedOutput {
            host: target.id.clone(),
            operation: "read the key file",
            detail,
        })?;
        let removed = self.ssh(connections, target, cmds.remove, limit).await?;
        check(target, "remove the key file", &removed)?;
        tracing::info!(host = %target.id, os = os.as_str(), "build user's key taken off the host");
        Ok(key)
    }

    /// Runs `command` on `target` as its admin with a fresh `ssh` process; ssh's own failures
    /// come back as exit status 255.
    async fn ssh(
        &self,
        connections: &Connections,
        target: &Target,
        command: &str,
        limit: Duration,
    ) -> Result<Ran, ProvisionError> {
        validate(target)?;
        let key_file = self.key_file(target)?;
        let known_hosts = connections.known_hosts_file(target);
        if let HostKeyTrust::Pinned(key) = &target.host_key {
            write_private(&known_hosts, format!("{} {key}\n", target.id).as_bytes())?;
        }
        let connect = self.opts.connect_timeout.as_secs().max(1);
        let mut cmd = tokio::process::Command::new("ssh");
        cmd.arg("-F")
            .arg("/dev/null")
            .arg("-i")
            .arg(key_file.path())
            .arg("-p")
            .arg(target.port.to_string())
            .arg("-o")
            .arg(format!("HostKeyAlias={}", target.id))
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", known_hosts.display()))
            .arg("-o")
            .arg(match target.host_key {
                HostKeyTrust::Pinned(_) => "StrictHostKeyChecking=yes",
                HostKeyTrust::TrustOnFirstUse => "StrictHostKeyChecking=accept-new",
            })
            .arg("-o")
            .arg(format!("ConnectTimeout={connect}"));
        for o in [
            "GlobalKnownHostsFile=/dev/null",
            "CheckHostIP=no",
            "HashKnownHosts=no",
            "UpdateHostKeys=no",
            "BatchMode=yes",
            "PasswordAuthentication=no",
            "KbdInteractiveAuthentication=no",
            "IdentitiesOnly=yes",
            "IdentityAgent=none",
            "ForwardAgent=no",
            "ForwardX11=no",
            "ClearAllForwardings=yes",
            "RequestTTY=no",
            "ServerAliveInterval=15",
            "ServerAliveCountMax=3",
            "LogLevel=ERROR",
        ] {
            cmd.arg("-o").arg(o);
        }
        cmd.arg("-l")
            .arg(&target.user)
            .arg(&target.address)
            .arg("--")
            .arg(command)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .map_err(|e| ProvisionError::Local(format!("starting ssh: {e}")))?;
        let out = tokio::time::timeout(limit, child.wait_with_output())
            .await
            .map_err(|_| ProvisionError::Timeout {
                host: target.id.clone(),
                operation: "key hand-off",
                after: limit,
            })?
            .map_err(|e| ProvisionError::Local(format!("running ssh: {e}")))?;
        drop(key_file);
        Ok(Ran {
            code: out.status.code().unwrap_or(SSH_FAILED),
            stdout: Zeroizing::new(out.stdout),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// The admin key in a private file that is deleted when dropped.
    fn key_file(&self, target: &Target) -> Result<tempfile::NamedTempFile, ProvisionError> {
        let local = |what: &str, e: std::io::Error| {
            ProvisionError::Local(format!("{what} {}: {e}", self.keys_dir.display()))
        };
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(&self.keys_dir)
            .map_err(|e| local("creating", e))?;
        let mut f = tempfile::Builder::new()
            .prefix("handoff-")
            .tempfile_in(&self.keys_dir)
            .map_err(|e| local("creating a key file in", e))?;
        f.write_all(&target.admin_key)
            .and_then(|()| {
                if target.admin_key.last() == Some(&b'\n') {
                    Ok(())
                } else {
                    f.write_all(b"\n")
                }
            })
            .and_then(|()| f.flush())
            .map_err(|e| local("writing a key file in", e))?;
        Ok(f)
    }
}

/// The target's checks, with the admin login allowed to be Windows' `Administrator` (not a POSIX
/// user name): letters, digits, `.`, `_`, `-`, not starting with `-`.
fn validate(target: &Target) -> Result<(), ProvisionError> {
    let user = &target.user;
    if user.is_empty()
        || user.starts_with('-')
        || !user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(ProvisionError::InvalidRequest(format!(
            "host {:?}: login {user:?} is not a user name",
            target.id
        )));
    }
    let mut rest = target.clone();
    rest.user = "admin".to_owned();
    rest.validate()
}

fn key_file(os: HostOs) -> &'static str {
    match os {
        HostOs::Windows => WINDOWS_KEY_FILE,
        HostOs::MacOs | HostOs::Linux => MACOS_KEY_FILE,
    }
}

fn not_handed_off(os: HostOs) -> ProvisionError {
    ProvisionError::InvalidRequest(format!(
        "{} hosts get build users, not a key hand-off",
        os.as_str()
    ))
}

/// ssh itself failed: a changed host key, a refused login, or no connection.
fn ssh_failure(target: &Target, ran: &Ran) -> ProvisionError {
    let detail = tail(&ran.stderr, 600);
    if detail.contains("REMOTE HOST IDENTIFICATION HAS CHANGED")
        || detail.contains("Host key verification failed")
    {
        ProvisionError::HostKeyMismatch {
            host: target.id.clone(),
            expected: match target.host_key {
                HostKeyTrust::Pinned(_) => "pinned",
                HostKeyTrust::TrustOnFirstUse => "recorded",
            },
            record: target.id.clone(),
        }
    } else if detail.contains("Permission denied") {
        ProvisionError::AuthRefused {
            host: target.id.clone(),
            detail,
        }
    } else {
        ProvisionError::Unreachable {
            host: target.id.clone(),
            detail,
        }
    }
}

fn check(target: &Target, operation: &'static str, ran: &Ran) -> Result<(), ProvisionError> {
    match ran.code {
        0 => Ok(()),
        SSH_FAILED => Err(ssh_failure(target, ran)),
        code => Err(ProvisionError::CommandFailed {
            host: target.id.clone(),
            operation,
            exit_code: Some(code),
            stderr_tail: tail(&ran.stderr, 600),
        }),
    }
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), ProvisionError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(|e| ProvisionError::Local(format!("writing {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_commands_are_gos_and_run_no_posix_shell() {
        let c = commands(HostOs::Windows).unwrap();
        assert_eq!(
            c.read,
            r"powershell -Command cat C:\Users\Administrator\konflux-builder"
        );
        assert_eq!(
            c.remove,
            r"powershell -Command rm C:\Users\Administrator\konflux-builder"
        );
        for line in [c.ready, c.read, c.remove] {
            assert!(line.starts_with("powershell -Command "), "{line}");
            assert!(!line.contains(['\'', '"', ';', '|', '&', '$']), "{line}");
        }
        let m = commands(HostOs::MacOs).unwrap();
        assert_eq!(m.remove, "sudo rm /Users/ec2-user/konflux-builder");
        assert_eq!(commands(HostOs::Linux), None);
    }

    #[test]
    fn readiness_reads_test_paths_answer_or_the_exit_status() {
        assert!(key_file_present(HostOs::Windows, 0, b"True\r\n"));
        assert!(!key_file_present(HostOs::Windows, 0, b"False\r\n"));
        assert!(!key_file_present(HostOs::Windows, 0, b""));
        assert!(!key_file_present(HostOs::Windows, 1, b"True\r\n"));
        assert!(key_file_present(HostOs::MacOs, 0, b""));
        assert!(!key_file_present(HostOs::MacOs, 1, b""));
    }

    #[test]
    fn keys_lose_carriage_returns_and_keep_one_newline() {
        let crlf = b"-----BEGIN OPENSSH PRIVATE KEY-----\r\nAAAA\r\n-----END OPENSSH PRIVATE KEY-----\r\n\r\n";
        assert_eq!(
            parse_key(crlf).unwrap().as_str(),
            "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
        );
        assert!(parse_key(b"Get-Content : Cannot find path\r\n").is_err());
        assert!(parse_key(b"").is_err());
        assert!(parse_key(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn secret_layout_is_gos_byte_for_byte() {
        let w = GoSecretLayout::new(HostOs::Windows, "10.0.1.7").unwrap();
        assert_eq!(w.host.as_bytes(), b"konflux-builder@10.0.1.7\n");
        assert_eq!(w.user_dir.as_bytes(), b"C:\\\\Users\\\\konflux-builder\n");
        let m = GoSecretLayout::new(HostOs::MacOs, "10.0.2.9").unwrap();
        assert_eq!(m.host.as_bytes(), b"konflux-builder@10.0.2.9\n");
        assert_eq!(m.user_dir.as_bytes(), b"/Users/konflux-builder\n");
        assert_eq!(
            GoSecretLayout::otp_server("https://otp:9443/otp"),
            "https://otp:9443/otp\n"
        );
        assert_eq!(GoSecretLayout::new(HostOs::Linux, "10.0.0.1"), None);
    }
}
