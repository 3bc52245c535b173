//! Multiplexed, reused SSH connections per host, driven by the system `ssh` through the `openssh`
//! crate (one ControlMaster per host; each command is a new channel on it).
//!
//! Host keys: a pinned key is written to a per-host known_hosts file checked strictly; otherwise the
//! first key seen is recorded (`StrictHostKeyChecking=accept-new`) in the controller's own store,
//! keyed by host id through `HostKeyAlias`, so a recycled cloud address never inherits an old key.
//! Every connection uses our own `ssh_config` (`-F`), so nothing from `~/.ssh/config` or
//! `/etc/ssh/ssh_config` (e.g. `StrictHostKeyChecking no`) can weaken this.
//!
//! A remote command dies with the controller's interest in it: it runs under [`GUARD`], which
//! kills it when the channel's stdin reaches end of file, and the controller holds that stdin
//! open, unwritten, until the command has exited. Dropping the command (a term that ended, a
//! timeout), the controller dying and the connection breaking all close it; SSH itself would
//! leave the command running (no pty: sshd signals nothing when a channel closes).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use openssh::{ControlPersist, KnownHosts, Session, SessionBuilder, Stdio};
use tokio::sync::{Mutex, Semaphore};

use super::error::{ProvisionError, tail};
use super::quote::{NulInArgument, sh_command};
use super::target::{HostKeyTrust, Target};

/// Runs `$1`, a command line, so that it dies when the SSH channel's stdin closes (the
/// controller dropped it, died, or lost the connection): the command gets its own session
/// (`setsid`, so its whole process group can be killed) and `/dev/null` as stdin, while a watcher
/// reads this shell's stdin, which the controller keeps open and never writes. End of file there
/// means nobody waits for the command any more: SIGTERM to its group, SIGKILL 2 s later. Exits
/// with the command's status.
/// (An asynchronous list's stdin is `/dev/null` unless redirected, hence the copy on fd 3.)
pub(crate) const GUARD: &str = r#"exec 3<&0
if command -v setsid >/dev/null 2>&1; then
  setsid sh -c "$1" </dev/null 3<&- &
else
  sh -c "$1" </dev/null 3<&- &
fi
pid=$!
(
  while read -r _; do :; done
  for sig in TERM KILL; do
    kill -s "$sig" -- "-$pid" 2>/dev/null || kill -s "$sig" "$pid" 2>/dev/null
    sleep 2
  done
) <&3 3<&- >/dev/null 2>&1 &
watcher=$!
exec 3<&-
wait "$pid"
rc=$?
kill "$watcher" 2>/dev/null
exit "$rc""#;

/// `line` run under [`GUARD`], behind `prefix` (`sudo -n`: the guard must be able to kill what
/// the command starts as root).
fn guarded(prefix: &[&str], line: &str) -> Result<String, NulInArgument> {
    sh_command(prefix, GUARD, "mpc-guard", &[line])
}

/// Connection behaviour.
#[derive(Debug, Clone)]
pub struct SshOptions {
    /// Directory the controller owns: known-hosts store, per-host ssh configs, short-lived key files
    /// and (when its path is short enough) the control sockets. Created 0700.
    pub state_dir: PathBuf,
    /// Longest time to establish a connection (TCP, key exchange, authentication).
    pub connect_timeout: Duration,
    /// Longest time one remote operation may take, including waiting for a session slot.
    pub command_timeout: Duration,
    /// Concurrent commands per host (sshd's `MaxSessions` defaults to 10).
    pub max_sessions_per_host: usize,
    /// Keep-alive probe interval on idle connections.
    pub keepalive: Duration,
    /// A master connection left idle this long exits by itself (also bounds orphans if we crash).
    pub idle_close: Duration,
}

impl SshOptions {
    /// Defaults with the given state directory.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            connect_timeout: Duration::from_secs(15),
            command_timeout: Duration::from_secs(120),
            max_sessions_per_host: 8,
            keepalive: Duration::from_secs(15),
            idle_close: Duration::from_secs(600),
        }
    }
}

/// What a remote command produced.
#[derive(Debug)]
pub(crate) struct RemoteOutput {
    /// Standard output.
    pub stdout: Vec<u8>,
    /// Where its time went.
    pub timing: RunTiming,
}

/// The parts of one remote command's time (for the timing log lines).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RunTiming {
    /// Waiting for one of the host's session permits.
    pub permit: Duration,
    /// Checking the master, or connecting when there was none.
    pub session: Duration,
    /// The command itself (a new channel on the master, the script, its exit).
    pub command: Duration,
}

struct Live {
    fingerprint: Vec<u8>,
    session: Arc<Session>,
    // `sudo -n` when the admin is not root.
    needs_sudo: bool,
}

struct HostSlot {
    permits: Semaphore,
    live: Mutex<Option<Live>>,
}

/// Paths inside the state directory.
struct Dirs {
    pinned: PathBuf,
    tofu: PathBuf,
    config: PathBuf,
    keys: PathBuf,
    control: PathBuf,
    // A short-path directory for control sockets when the state dir's path is too long for a
    // unix socket name (108 bytes); removed on drop.
    _control_tmp: Option<tempfile::TempDir>,
}

/// The connection manager: one multiplexed master per host id, reused until it fails, idles out
/// or the host's target changes.
pub struct Connections {
    opts: SshOptions,
    dirs: Dirs,
    hosts: StdMutex<HashMap<String, Arc<HostSlot>>>,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connections")
            .field("state_dir", &self.opts.state_dir)
            .finish_non_exhaustive()
    }
}

fn local(what: &str, path: &Path, e: impl std::fmt::Display) -> ProvisionError {
    ProvisionError::Local(format!("{what} {}: {e}", path.display()))
}

fn private_dir(path: &Path) -> Result<(), ProvisionError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(|e| local("creating", path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| local("securing", path, e))
}

/// Longest control directory path that leaves room for openssh's `/.ssh-connectionXXXXXX/master`
/// plus ssh's temporary suffix inside `sun_path`.
const MAX_CONTROL_DIR_LEN: usize = 50;

impl Connections {
    /// Prepares the state directory; connects lazily.
    pub fn new(opts: SshOptions) -> Result<Self, ProvisionError> {
        let s = opts.state_dir.to_string_lossy();
        if s.contains(['"', '\n', '\r']) {
            return Err(ProvisionError::Local(format!(
                "state directory {s:?} contains a quote or line break"
            )));
        }
        let root = &opts.state_dir;
        let dirs = Dirs {
            pinned: root.join("known_hosts/pinned"),
            tofu: root.join("known_hosts/tofu"),
            config: root.join("ssh_config"),
            keys: root.join("keys"),
            control: root.join("ctl"),
            _control_tmp: None,
        };
        // The root may be a volume's mount point that this user does not own (a Kubernetes
        // emptyDir is root's, group fsGroup, mode 2777), so it is only created if missing;
        // everything in it lives in subdirectories made private here.
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(root)
            .map_err(|e| local("creating", root, e))?;
        for d in [&dirs.pinned, &dirs.tofu, &dirs.config, &dirs.keys] {
            private_dir(d)?;
        }
        // Key files are deleted right after use; anything left is from a crash.
        if let Ok(entries) = std::fs::read_dir(&dirs.keys) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let dirs = if dirs.control.as_os_str().len() <= MAX_CONTROL_DIR_LEN {
            private_dir(&dirs.control)?;
            dirs
        } else {
            let tmp = tempfile::Builder::new()
                .prefix("mpc-ssh-")
                .tempdir_in("/tmp")
                .map_err(|e| local("creating a control directory in", Path::new("/tmp"), e))?;
            Dirs {
                control: tmp.path().to_owned(),
                _control_tmp: Some(tmp),
                ..dirs
            }
        };
        Ok(Self {
            opts,
            dirs,
            hosts: StdMutex::new(HashMap::new()),
        })
    }

    /// The options in use.
    pub fn options(&self) -> &SshOptions {
        &self.opts
    }

    fn slot(&self, id: &str) -> Arc<HostSlot> {
        let mut hosts = self.hosts.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(hosts.entry(id.to_owned()).or_insert_with(|| {
            Arc::new(HostSlot {
                permits: Semaphore::new(self.opts.max_sessions_per_host.max(1)),
                live: Mutex::new(None),
            })
        }))
    }

    /// Where a host key learned on first use for host `id` is recorded.
    pub fn tofu_file(&self, id: &str) -> PathBuf {
        self.dirs.tofu.join(id)
    }

    /// Where the expected key of `target` is recorded.
    pub fn known_hosts_file(&self, target: &Target) -> PathBuf {
        match target.host_key {
            HostKeyTrust::Pinned(_) => self.dirs.pinned.join(&target.id),
            HostKeyTrust::TrustOnFirstUse => self.dirs.tofu.join(&target.id),
        }
    }

    /// Runs the command line built by `build` (given the privilege prefix, e.g. `sudo -n`) on
    /// `target`, within the command timeout. A non-zero exit is [`ProvisionError::CommandFailed`].
    pub(crate) async fn run(
        &self,
        target: &Target,
        operation: &'static str,
        build: impl FnOnce(&[&str]) -> Result<String, NulInArgument>,
    ) -> Result<RemoteOutput, ProvisionError> {
        target.validate()?;
        let slot = self.slot(&target.id);
        let limit = self.opts.command_timeout;
        let timed_out = || ProvisionError::Timeout {
            host: target.id.clone(),
            operation,
            after: limit,
        };
        let started = Instant::now();
        let deadline = started + limit;
        let _permit = tokio::time::timeout_at(deadline.into(), slot.permits.acquire())
            .await
            .map_err(|_| timed_out())?
            .map_err(|_| ProvisionError::Local("connection manager closed".into()))?;
        let permitted = Instant::now();
        let (session, needs_sudo) = self.session(&slot, target, deadline).await?;
        let connected = Instant::now();
        let prefix: &[&str] = if needs_sudo { &["sudo", "-n"] } else { &[] };
        // The command itself runs as the guard's user: root.
        let line = build(&[])
            .and_then(|line| guarded(prefix, &line))
            .map_err(|e| ProvisionError::InvalidRequest(e.to_string()))?;
        let result = tokio::time::timeout_at(deadline.into(), async {
            let mut child = session
                .raw_command(&line)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .await?;
            // Held open until the command has exited (or this future is dropped): its end of
            // file is what stops the command remotely (GUARD).
            let stdin = child.stdin().take();
            let out = child.wait_with_output().await;
            drop(stdin);
            out
        })
        .await;
        match result {
            Err(_) => {
                // The host may be wedged: start over with a fresh connection next time.
                Self::invalidate(&slot, &session).await;
                Err(timed_out())
            }
            Ok(Err(e)) => {
                Self::invalidate(&slot, &session).await;
                Err(self.classify(target, e))
            }
            Ok(Ok(out)) if out.status.success() => Ok(RemoteOutput {
                stdout: out.stdout,
                timing: RunTiming {
                    permit: permitted - started,
                    session: connected - permitted,
                    command: connected.elapsed(),
                },
            }),
            Ok(Ok(out)) => Err(ProvisionError::CommandFailed {
                host: target.id.clone(),
                operation,
                exit_code: out.status.code(),
                stderr_tail: tail(&String::from_utf8_lossy(&out.stderr), 600),
            }),
        }
    }

    async fn invalidate(slot: &HostSlot, session: &Arc<Session>) {
        let mut live = slot.live.lock().await;
        if live
            .as_ref()
            .is_some_and(|l| Arc::ptr_eq(&l.session, session))
        {
            *live = None;
        }
    }

    /// The live session for `target`, connecting (once, however many callers wait) if needed.
    async fn session(
        &self,
        slot: &HostSlot,
        target: &Target,
        deadline: Instant,
    ) -> Result<(Arc<Session>, bool), ProvisionError> {
        let fingerprint = fingerprint(target);
        let mut live = slot.live.lock().await;
        if let Some(l) = live.as_ref() {
            if l.fingerprint == fingerprint && l.session.check().await.is_ok() {
                return Ok((Arc::clone(&l.session), l.needs_sudo));
            }
            tracing::debug!(host = %target.id, "SSH master gone or target changed; reconnecting");
        }
        *live = None;
        let connect_limit = self.opts.connect_timeout;
        let connect_deadline = deadline.min(Instant::now() + connect_limit);
        let session = tokio::time::timeout_at(connect_deadline.into(), self.connect(target))
            .await
            .map_err(|_| ProvisionError::Timeout {
                host: target.id.clone(),
                operation: "connect",
                after: connect_limit,
            })??;
        let session = Arc::new(session);
        let needs_sudo = if target.user == "root" {
            false
        } else {
            let out = tokio::time::timeout_at(
                connect_deadline.into(),
                session.raw_command("id -u").output(),
            )
            .await
            .map_err(|_| ProvisionError::Timeout {
                host: target.id.clone(),
                operation: "connect",
                after: connect_limit,
            })?
            .map_err(|e| self.classify(target, e))?;
            String::from_utf8_lossy(&out.stdout).trim() != "0"
        };
        tracing::info!(host = %target.id, address = %target.address, port = target.port, "SSH master connected");
        *live = Some(Live {
            fingerprint,
            session: Arc::clone(&session),
            needs_sudo,
        });
        Ok((session, needs_sudo))
    }

    async fn connect(&self, target: &Target) -> Result<Session, ProvisionError> {
        let known_hosts = self.known_hosts_file(target);
        let check = match &target.host_key {
            HostKeyTrust::Pinned(key) => {
                write_private_file(&known_hosts, format!("{} {key}\n", target.id).as_bytes())?;
                KnownHosts::Strict
            }
            HostKeyTrust::TrustOnFirstUse => KnownHosts::Add,
        };
        let config = self.dirs.config.join(&target.id);
        write_private_file(&config, ssh_config(target, &known_hosts).as_bytes())?;

        // The key file exists only while the master authenticates.
        let mut key_file = tempfile::Builder::new()
            .prefix("admin-")
            .tempfile_in(&self.dirs.keys)
            .map_err(|e| local("creating a key file in", &self.dirs.keys, e))?;
        key_file
            .write_all(&target.admin_key)
            .and_then(|()| {
                if target.admin_key.last() == Some(&b'\n') {
                    Ok(())
                } else {
                    key_file.write_all(b"\n")
                }
            })
            .and_then(|()| key_file.flush())
            .map_err(|e| local("writing", key_file.path(), e))?;

        let idle = usize::try_from(self.opts.idle_close.as_secs().max(1)).unwrap_or(usize::MAX);
        let mut b = SessionBuilder::default();
        b.user(target.user.clone())
            .port(target.port)
            .keyfile(key_file.path())
            .known_hosts_check(check)
            .user_known_hosts_file(&known_hosts)
            .config_file(&config)
            .connect_timeout(self.opts.connect_timeout.max(Duration::from_secs(1)))
            .server_alive_interval(self.opts.keepalive.max(Duration::from_secs(1)))
            .control_directory(&self.dirs.control)
            .control_persist(ControlPersist::IdleFor(
                NonZeroUsize::new(idle).unwrap_or(NonZeroUsize::MIN),
            ));
        let result = b.connect_mux(&target.address).await;
        drop(key_file);
        result.map_err(|e| self.classify(target, e))
    }

    /// Maps an `openssh` error to our taxonomy, reading `ssh`'s own messages.
    fn classify(&self, target: &Target, e: openssh::Error) -> ProvisionError {
        let host = target.id.clone();
        let detail = match &e {
            // ssh's own failures arrive with its log text; NotFound means it never ran (no `ssh`
            // binary, or it died before opening its log).
            openssh::Error::Connect(io) if io.kind() != std::io::ErrorKind::NotFound => {
                io.to_string()
            }
            openssh::Error::Connect(io) | openssh::Error::Ssh(io) => {
                return ProvisionError::Local(format!("cannot run the ssh client: {io}"));
            }
            openssh::Error::Master(io) => {
                return ProvisionError::Local(format!("creating the SSH control directory: {io}"));
            }
            openssh::Error::InvalidCommand => {
                return ProvisionError::InvalidRequest("command contains a NUL byte".into());
            }
            other => other.to_string(),
        };
        let lower = detail.to_ascii_lowercase();
        if lower.contains("host key verification failed")
            || lower.contains("remote host identification has changed")
            || lower.contains("host key for")
        {
            return ProvisionError::HostKeyMismatch {
                host,
                expected: match target.host_key {
                    HostKeyTrust::Pinned(_) => "pinned",
                    HostKeyTrust::TrustOnFirstUse => "recorded",
                },
                record: self.known_hosts_file(target).display().to_string(),
            };
        }
        if lower.contains("permission denied") || lower.contains("too many authentication failures")
        {
            return ProvisionError::AuthRefused {
                host,
                detail: tail(&detail, 400),
            };
        }
        ProvisionError::Unreachable {
            host,
            detail: tail(&detail, 400),
        }
    }

    /// Closes `id`'s connection and deletes its trust-on-first-use record (an instance that was
    /// terminated); the next contact records a fresh key.
    pub async fn forget(&self, id: &str) {
        let slot = self
            .hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(slot) = slot {
            slot.live.lock().await.take();
        }
        if super::target::is_host_id(id) {
            for dir in [&self.dirs.tofu, &self.dirs.pinned, &self.dirs.config] {
                let _ = std::fs::remove_file(dir.join(id));
            }
        }
    }

    /// Closes every master connection (graceful shutdown); in-flight commands keep theirs until
    /// they finish.
    pub async fn close_all(&self) {
        let slots: Vec<_> = self
            .hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, s)| s)
            .collect();
        for slot in slots {
            let live = slot.live.lock().await.take();
            if let Some(l) = live
                && let Ok(session) = Arc::try_unwrap(l.session)
            {
                let _ = session.close().await;
            }
        }
    }
}

/// Identity of everything that shapes a connection; a change means reconnect.
fn fingerprint(t: &Target) -> Vec<u8> {
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    for part in [
        t.address.as_bytes(),
        t.user.as_bytes(),
        &t.port.to_be_bytes(),
    ] {
        ctx.update(&(part.len() as u64).to_be_bytes());
        ctx.update(part);
    }
    ctx.update(&t.admin_key);
    match &t.host_key {
        HostKeyTrust::Pinned(k) => ctx.update(k.as_bytes()),
        HostKeyTrust::TrustOnFirstUse => ctx.update(b"\0tofu"),
    }
    ctx.finish().as_ref().to_vec()
}

/// Our `ssh_config` for one host. Values are validated (host id) or ours (paths without quotes).
fn ssh_config(target: &Target, known_hosts: &Path) -> String {
    let mut c = String::from("Host *\n");
    let _ = writeln!(c, "  HostKeyAlias {}", target.id);
    let _ = writeln!(c, "  UserKnownHostsFile \"{}\"", known_hosts.display());
    for line in [
        "GlobalKnownHostsFile /dev/null",
        "CheckHostIP no",
        "HashKnownHosts no",
        "UpdateHostKeys no",
        "BatchMode yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "IdentitiesOnly yes",
        "IdentityAgent none",
        "ForwardAgent no",
        "ForwardX11 no",
        "ClearAllForwardings yes",
        "RequestTTY no",
        "ServerAliveCountMax 3",
    ] {
        let _ = writeln!(c, "  {line}");
    }
    c
}

fn write_private_file(path: &Path, bytes: &[u8]) -> Result<(), ProvisionError> {
    use std::os::unix::fs::OpenOptionsExt;
    // Host ids contain dots, so append rather than replace an extension.
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| local("writing", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeroize::Zeroizing;

    #[test]
    fn config_isolates_trust_settings() {
        let t = Target::dynamic(
            "i-0abc",
            "10.0.0.1",
            "root",
            Arc::new(Zeroizing::new(b"k".to_vec())),
        );
        let c = ssh_config(&t, Path::new("/state/known_hosts/tofu/i-0abc"));
        assert!(c.contains("HostKeyAlias i-0abc\n"));
        assert!(c.contains("UserKnownHostsFile \"/state/known_hosts/tofu/i-0abc\"\n"));
        assert!(c.contains("GlobalKnownHostsFile /dev/null"));
        assert!(!c.to_ascii_lowercase().contains("stricthostkeychecking"));
    }

    #[test]
    fn fingerprint_follows_every_connection_input() {
        let key = Arc::new(Zeroizing::new(b"k".to_vec()));
        let a = Target::dynamic("i-1", "10.0.0.1", "root", Arc::clone(&key));
        let mut b = a.clone();
        assert_eq!(fingerprint(&a), fingerprint(&b));
        b.admin_key = Arc::new(Zeroizing::new(b"k2".to_vec()));
        assert_ne!(fingerprint(&a), fingerprint(&b));
        let mut c = a.clone();
        c.host_key = HostKeyTrust::Pinned("ssh-ed25519 AAAA".into());
        assert_ne!(fingerprint(&a), fingerprint(&c));
        let mut d = a.clone();
        d.port = 2222;
        assert_ne!(fingerprint(&a), fingerprint(&d));
    }

    #[test]
    fn ssh_messages_map_to_typed_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let c = Connections::new(SshOptions::new(tmp.path().join("s"))).unwrap();
        let t = Target::dynamic(
            "i-1",
            "10.0.0.1",
            "root",
            Arc::new(Zeroizing::new(b"k".to_vec())),
        );
        let connect = |msg: &str| {
            c.classify(
                &t,
                openssh::Error::Connect(std::io::Error::other(msg.to_owned())),
            )
        };
        assert!(matches!(
            connect(
                "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed."
            ),
            ProvisionError::HostKeyMismatch {
                expected: "recorded",
                ..
            }
        ));
        assert!(matches!(
            connect("root@10.0.0.1: Permission denied (publickey)."),
            ProvisionError::AuthRefused { .. }
        ));
        assert!(matches!(
            connect("connect to host 10.0.0.1 port 22: Connection refused"),
            ProvisionError::Unreachable { .. }
        ));
        assert!(matches!(
            c.classify(&t, openssh::Error::Disconnected),
            ProvisionError::Unreachable { .. }
        ));
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert!(matches!(
            c.classify(&t, openssh::Error::Connect(missing)),
            ProvisionError::Local(_)
        ));
        let e = connect("Host key verification failed.");
        assert!(
            e.to_string()
                .contains(&c.known_hosts_file(&t).display().to_string())
        );
    }

    #[test]
    fn state_dir_is_private_and_long_paths_fall_back_for_sockets() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let long = tmp.path().join("a".repeat(60));
        let c = Connections::new(SshOptions::new(&long)).unwrap();
        let mode = std::fs::metadata(&long).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert!(c.dirs.control.as_os_str().len() <= MAX_CONTROL_DIR_LEN);
        let short = Connections::new(SshOptions::new(tmp.path().join("s"))).unwrap();
        assert_eq!(short.dirs.control, tmp.path().join("s/ctl"));
    }
}
