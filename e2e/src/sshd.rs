//! Real OpenSSH servers on loopback for provisioning tests.
//!
//! Each [`SshdHost`] runs `/usr/sbin/sshd -D -e -f <own config>` on its own 127.0.0.x address and
//! port with its own host key. The admin is root, authorised through a test key kept in the
//! host's directory (`AuthorizedKeysFile .ssh/authorized_keys <dir>/admin_keys/%u`), so the
//! machine's own `/root/.ssh` is never touched; build users use their real
//! `~/.ssh/authorized_keys` with `StrictModes yes`, which checks the permissions provisioning set.
//!
//! Users are machine-wide, so several "hosts" share one passwd file: tests use unique TaskRun
//! names ([`unique_name`]) and register the users they create ([`SshdHost::track_user`]) so that
//! dropping the host kills their processes and deletes them. Dropping also kills sshd with all its
//! session processes and removes the host's directory.
//!
//! A host can instead have a user database of its own ([`HostSetup::own_users`]), as a real
//! machine does: sshd then runs under `unshare` in its own mount, PID and IPC namespaces, with a
//! copy of this machine's `/etc` and an empty `/home` bound over the real ones, and fresh tmpfs
//! on `/tmp`, `/var/tmp` and `/dev/shm`. Its `useradd`/`userdel` take that copy's locks, not the
//! machine's, and the cleanup's scans (`/proc`, the shared directories, SysV IPC) see only that
//! host's processes and files, so uids that repeat between hosts never reach each other. Its
//! users vanish with it.
//!
//! A host can stand for a machine that lacks some tools or has others ([`HostSetup`]): its
//! sessions then get `PATH` set (sshd's `SetEnv`) to a directory of links to this machine's
//! executables minus the hidden ones, plus the host's own scripts.
//!
//! Needs root (sshd, useradd) and what `e2e/setup.sh` installs (openssh-server, podman, sudo);
//! a missing one fails the test with a message saying so. Override the binary with `MPC_E2E_SSHD`;
//! directories live under `$MPC_E2E_HOME/sshd` (default `~/.cache/mpc-e2e/sshd`), whose parents
//! must not be group- or world-writable (sshd's `StrictModes` checks the admin key's path).

use std::collections::HashMap;
use std::fs;
use std::hash::{BuildHasher, Hasher};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mpc::provision::{HostKeyTrust, Target, Zeroizing, keys};

/// Directories sshd puts on a root session's `PATH` (Debian's default).
const SYSTEM_PATH: [&str; 6] = [
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// Where `name` is on this machine's system `PATH`, if anywhere.
pub fn find_tool(name: &str) -> Option<PathBuf> {
    SYSTEM_PATH
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// Fails unless every tool in `names` is installed on this machine, saying how to get it.
pub fn require_tools(names: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| find_tool(n).is_none())
        .collect();
    if !missing.is_empty() {
        bail!(
            "{} not installed on this machine: run e2e/setup.sh",
            missing.join(", ")
        );
    }
    Ok(())
}

/// A random number from the process's hash seed (no extra dependency needed for test names).
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// A name unique to this test run, e.g. for TaskRuns: `<prefix>-<16 hex>`.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}-{:016x}", random_u64())
}

/// Base directory of the e2e tools (`MPC_E2E_HOME`, default `~/.cache/mpc-e2e`).
pub fn e2e_home() -> PathBuf {
    std::env::var_os("MPC_E2E_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cache/mpc-e2e")
        })
}

/// Does `user` exist on this machine?
pub fn user_exists(user: &str) -> bool {
    Command::new("getent")
        .args(["passwd", user])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Sets the modification time of `user`'s home `secs` seconds into the past: the age by which
/// build users are listed (as the Go cleanup measures it).
pub fn age_home(user: &str, secs: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs();
    let st = Command::new("touch")
        .args([
            "-m",
            "-d",
            &format!("@{}", now - secs),
            &format!("/home/{user}"),
        ])
        .status()
        .expect("touch");
    assert!(st.success(), "aging /home/{user}");
}

/// Kills `user`'s processes and deletes it with everything provisioning creates; ignores a user
/// that does not exist.
pub fn remove_user(user: &str) {
    if user_exists(user) {
        for _ in 0..50 {
            let found = Command::new("pkill")
                .args(["-KILL", "-u", user])
                .status()
                .is_ok_and(|s| s.success());
            if !found {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = Command::new("userdel")
            .args(["-r", user])
            .stderr(Stdio::null())
            .status();
    }
    let _ = fs::remove_dir_all(format!("/home/{user}"));
    for f in [
        format!("/etc/sudoers.d/{user}"),
        format!("/etc/sudoers.d/.{user}.tmp"),
        format!("/etc/security/limits.d/{user}.conf"),
        format!("/etc/security/limits.d/.{user}.tmp"),
    ] {
        let _ = fs::remove_file(f);
    }
    for dir in slice_drop_in_dirs() {
        let _ = fs::remove_file(dir.join(format!("50-mpc-{user}.conf")));
        let _ = fs::remove_dir(dir);
    }
}

/// The `user-<uid>.slice.d` drop-in directories under `/etc/systemd/system`.
pub fn slice_drop_in_dirs() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir("/etc/systemd/system") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("user-") && n.ends_with(".slice.d"))
        })
        .map(|e| e.path())
        .collect()
}

/// How a host differs from this machine.
#[derive(Debug, Clone, Default)]
pub struct HostSetup {
    /// Listen on this loopback address instead of a random 127.0.0.x.
    pub address: Option<Ipv4Addr>,
    /// Listen on this port (22: what a controller reaches with nothing but the configured
    /// address, as in production) instead of a free one.
    pub port: Option<u16>,
    /// Executables the host's sessions cannot find, as if not installed.
    pub hidden: Vec<String>,
    /// Executables only this host has: name and `sh` script (without the `#!` line).
    pub extra: Vec<(String, String)>,
    /// Environment of the host's sessions (sshd's `SetEnv`), e.g. `HOME` to pick the admin's
    /// shell startup file.
    pub env: Vec<(String, String)>,
    /// The admin key pair, shared by hosts that stand for machines booted from one image (cloud
    /// instances); default: a fresh one.
    pub admin_key: Option<AdminKey>,
    /// sshd_config lines appended at the end (`Match` blocks: a `ForceCommand` per user).
    pub extra_config: String,
    /// The admin login instead of root: a local user of this machine (created when missing)
    /// with passwordless sudo, and root logins refused, as on cloud images that no longer put
    /// keys on root (IBM Cloud VPC since 2026-01-19).
    pub admin_user: Option<String>,
    /// A user database (`/etc`, `/home`) of the host's own instead of this machine's, kept where
    /// [`OwnUsers`] says; only for a host otherwise like this machine (root admin, this
    /// machine's tools).
    pub own_users: Option<OwnUsers>,
    /// sshd and everything it runs at this niceness (`nice -n`): the hosts still do all their
    /// work, but a controller sharing the machine's cores with many of them is served first,
    /// as it would be on cores of its own.
    pub nice: Option<i32>,
}

/// Where a host with its own user database keeps its `/etc` and `/home`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnUsers {
    /// On this machine's disk, beside the host's directory: `useradd`'s fsyncs cost what they
    /// cost here, but every such host shares the one disk (a real host has its own).
    Disk,
    /// On tmpfs (`/dev/shm`): fsyncs cost nothing, so hosts never wait for each other's disk;
    /// every other cost (sshd, the shell, the tools' CPU) is the same.
    Memory,
}

impl std::str::FromStr for OwnUsers {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "disk" => Ok(Self::Disk),
            "memory" => Ok(Self::Memory),
            other => bail!("{other:?}: expected disk or memory"),
        }
    }
}

/// An admin (root) key pair: the private half in OpenSSH format, the public half as an
/// `authorized_keys` line.
#[derive(Clone)]
pub struct AdminKey {
    private: Arc<Zeroizing<Vec<u8>>>,
    public: String,
}

impl std::fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminKey")
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

impl AdminKey {
    /// A fresh ed25519 key pair.
    pub fn generate() -> anyhow::Result<Self> {
        let k = keys::generate("e2e-admin").context("generating the admin key")?;
        Ok(Self {
            private: Arc::new(Zeroizing::new(k.private_openssh.as_bytes().to_vec())),
            public: k.public_openssh,
        })
    }

    /// The private key (OpenSSH format), as the admin-key Secret holds it.
    pub fn private(&self) -> Arc<Zeroizing<Vec<u8>>> {
        Arc::clone(&self.private)
    }

    /// The public key, as an `authorized_keys` line.
    pub fn public(&self) -> &str {
        &self.public
    }
}

impl HostSetup {
    /// A host without `name`.
    pub fn without(mut self, name: &str) -> Self {
        self.hidden.push(name.to_owned());
        self
    }

    /// A host with its own `name`, running `script`.
    pub fn with_tool(mut self, name: &str, script: &str) -> Self {
        self.extra.push((name.to_owned(), script.to_owned()));
        self
    }

    fn changes_path(&self) -> bool {
        !self.hidden.is_empty() || !self.extra.is_empty()
    }

    /// Hidden or replaced: whether this machine has it does not matter.
    fn overrides(&self, name: &str) -> bool {
        self.hidden.iter().any(|h| h == name) || self.extra.iter().any(|(n, _)| n == name)
    }
}

/// A running sshd on loopback, stopped and cleaned up on drop.
pub struct SshdHost {
    address: Ipv4Addr,
    port: u16,
    dir: tempfile::TempDir,
    child: Mutex<Option<Child>>,
    admin_private: Arc<Zeroizing<Vec<u8>>>,
    host_public: String,
    users: Mutex<Vec<String>>,
    // The sessions' PATH directory when the host differs from this machine; outside `dir`, whose
    // parents build users cannot traverse.
    tools: Option<tempfile::TempDir>,
    own: Option<OwnRoot>,
    nice: Option<i32>,
}

/// The `/etc` and `/home` of a host with its own user database.
struct OwnRoot {
    etc: PathBuf,
    home: PathBuf,
    // Set for [`OwnUsers::Memory`]; for `Disk` both live in the host's directory.
    _tmpfs: Option<tempfile::TempDir>,
}

/// Run by `unshare` as the new namespaces' first process: binds the host's `/etc` (`$1`) and
/// `/home` (`$2`) over the machine's, gives it empty temporary directories, then becomes sshd
/// (the rest of the arguments), PID 1 there, reaping its sessions.
const OWN_ROOT_SCRIPT: &str = r#"set -e
mount --bind "$1" /etc
mount --bind "$2" /home
for d in /tmp /var/tmp /dev/shm; do
  [ -d "$d" ] && mount -t tmpfs -o mode=1777 mpc-e2e-host "$d"
done
shift 2
exec "$@"
"#;

impl OwnRoot {
    /// A copy of this machine's `/etc` and an empty `/home` under `base`.
    fn create(base: &Path, tmpfs: Option<tempfile::TempDir>) -> anyhow::Result<Self> {
        let etc = base.join("etc");
        let home = base.join("home");
        let out = Command::new("cp")
            .args(["-a", "--", "/etc"])
            .arg(&etc)
            .output()
            .context("running cp")?;
        // Files that vanished mid-copy are another process's transient lock files (a `useradd`
        // elsewhere on this machine); anything else is an error.
        let stderr = String::from_utf8_lossy(&out.stderr);
        let vanished =
            |l: &str| l.starts_with("cp: cannot stat") && l.ends_with("No such file or directory");
        if !out.status.success() && !stderr.lines().all(vanished) {
            bail!("copying /etc: {stderr}");
        }
        // A lock file another process held on the machine's files at the moment of the copy.
        for e in fs::read_dir(&etc)?.flatten() {
            if e.file_name().to_str().is_some_and(|n| n.ends_with(".lock")) {
                let _ = fs::remove_file(e.path());
            }
        }
        fs::create_dir(&home)?;
        fs::set_permissions(&home, fs::Permissions::from_mode(0o755))?;
        Ok(Self {
            etc,
            home,
            _tmpfs: tmpfs,
        })
    }
}

impl std::fmt::Debug for SshdHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshdHost")
            .field("address", &self.address)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

fn sshd_binary() -> PathBuf {
    std::env::var_os("MPC_E2E_SSHD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/sbin/sshd"))
}

fn write_mode(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

/// A free TCP port on `addr` (the listener is closed again; sshd binds with SO_REUSEADDR).
fn free_port(addr: Ipv4Addr) -> anyhow::Result<u16> {
    let l = TcpListener::bind((addr, 0)).with_context(|| format!("binding {addr}:0"))?;
    Ok(l.local_addr()?.port())
}

impl SshdHost {
    /// Starts sshd on a random 127.0.0.x address and free port with a fresh host key, for a
    /// machine like this one.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(HostSetup::default())
    }

    /// Starts sshd on port 22 of a free random 127.0.0.x address.
    pub fn start_on_port_22() -> anyhow::Result<Self> {
        Self::start_with(HostSetup {
            port: Some(22),
            ..HostSetup::default()
        })
    }

    /// Starts sshd on `address:port` (an address a cloud emulator hands an instance, say).
    pub fn start_at(address: Ipv4Addr, port: u16) -> anyhow::Result<Self> {
        Self::start_with(HostSetup {
            address: Some(address),
            port: Some(port),
            ..HostSetup::default()
        })
    }

    /// Starts sshd for a host set up as `setup` says.
    pub fn start_with(setup: HostSetup) -> anyhow::Result<Self> {
        if !sshd_binary().exists() {
            bail!(
                "{} not found: run e2e/setup.sh (installs openssh-server)",
                sshd_binary().display()
            );
        }
        // Provisioning refuses hosts without podman; a machine without it is not set up.
        if !setup.overrides("podman") {
            require_tools(&["podman"])?;
        }
        // sshd refuses to start without its privilege-separation directory.
        let _ = fs::create_dir_all("/run/sshd");
        let base = e2e_home().join("sshd");
        fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
        fs::set_permissions(&base, fs::Permissions::from_mode(0o755))?;
        let dir = tempfile::Builder::new()
            .prefix("host-")
            .tempdir_in(&base)
            .context("creating the sshd directory")?;
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))?;
        fs::create_dir(dir.path().join("admin_keys"))?;
        fs::set_permissions(
            dir.path().join("admin_keys"),
            fs::Permissions::from_mode(0o755),
        )?;

        let admin = match &setup.admin_key {
            Some(k) => k.clone(),
            None => AdminKey::generate()?,
        };
        let admin_user = setup.admin_user.clone().unwrap_or_else(|| "root".into());
        if setup.own_users.is_some() {
            // Those put files in the machine's /home or /tmp, which such a host does not see.
            if admin_user != "root" || setup.changes_path() {
                bail!("a host with its own users has root as its admin and this machine's tools");
            }
            for shadowed in ["/tmp", "/var/tmp", "/dev/shm"] {
                if dir.path().starts_with(shadowed) {
                    bail!(
                        "{}: a host with its own users gets an empty {shadowed}; set \
                         MPC_E2E_HOME outside it",
                        dir.path().display()
                    );
                }
            }
        }
        let keys_file = dir.path().join(format!("admin_keys/{admin_user}"));
        write_mode(&keys_file, format!("{}\n", admin.public).as_bytes(), 0o600)?;
        if admin_user != "root" {
            ensure_user(&admin_user)?;
            // sshd reads keys as the user, who cannot reach this directory: the key goes to the
            // user's own authorized_keys (appended: parallel tests share the login).
            let ssh_dir = PathBuf::from(format!("/home/{admin_user}/.ssh"));
            fs::create_dir_all(&ssh_dir)?;
            fs::set_permissions(&ssh_dir, fs::Permissions::from_mode(0o700))?;
            let keys = ssh_dir.join("authorized_keys");
            let mut f = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&keys)?;
            writeln!(f, "{}", admin.public)?;
            fs::set_permissions(&keys, fs::Permissions::from_mode(0o600))?;
            chown(&ssh_dir, &admin_user)?;
            chown(&keys, &admin_user)?;
            let sudoers = format!("/etc/sudoers.d/mpc-e2e-{admin_user}");
            write_mode(
                Path::new(&sudoers),
                format!("{admin_user} ALL=(ALL) NOPASSWD: ALL\n").as_bytes(),
                0o440,
            )?;
        }
        let random = || Ipv4Addr::new(127, 0, 0, 2 + (random_u64() % 250) as u8);
        let (address, port) = match (setup.address, setup.port) {
            (Some(a), Some(p)) => (a, p),
            (Some(a), None) => (a, free_port(a)?),
            (None, None) => {
                let a = random();
                (a, free_port(a)?)
            }
            (None, Some(p)) => (0..64)
                .map(|_| random())
                .find(|a| TcpListener::bind((*a, p)).is_ok())
                .map(|a| (a, p))
                .with_context(|| format!("no free 127.0.0.x address with port {p} free"))?,
        };
        let mut host = Self {
            address,
            port,
            dir,
            child: Mutex::new(None),
            admin_private: admin.private,
            host_public: String::new(),
            users: Mutex::new(Vec::new()),
            tools: None,
            own: None,
            nice: setup.nice,
        };
        host.own = match setup.own_users {
            None => None,
            Some(OwnUsers::Disk) => Some(OwnRoot::create(host.dir.path(), None)?),
            Some(OwnUsers::Memory) => {
                let tmpfs = tempfile::Builder::new()
                    .prefix("mpc-e2e-host-")
                    .tempdir_in("/dev/shm")
                    .context("creating the host's directory in /dev/shm")?;
                let base = tmpfs.path().to_owned();
                Some(OwnRoot::create(&base, Some(tmpfs))?)
            }
        };
        host.new_host_key()?;
        let mut env = setup.env.clone();
        if setup.changes_path() {
            let tools = tool_dir(&setup)?;
            env.push(("PATH".into(), tools.path().display().to_string()));
            host.tools = Some(tools);
        }
        let extra = match &setup.admin_user {
            Some(u) if u != "root" => format!(
                "Match User {u}\n  SetEnv HOME=/home/{u}\nMatch all\nDenyUsers root\n{}",
                setup.extra_config
            ),
            _ => setup.extra_config.clone(),
        };
        host.write_config(&env, &extra)?;
        host.spawn()?;
        Ok(host)
    }

    fn new_host_key(&mut self) -> anyhow::Result<()> {
        let key = self.dir.path().join("host_ed25519");
        let _ = fs::remove_file(&key);
        let _ = fs::remove_file(key.with_extension("pub"));
        let out = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-C", "", "-f"])
            .arg(&key)
            .output()
            .context("running ssh-keygen")?;
        if !out.status.success() {
            bail!("ssh-keygen: {}", String::from_utf8_lossy(&out.stderr));
        }
        let public = fs::read_to_string(key.with_extension("pub"))?;
        let mut parts = public.split_whitespace();
        self.host_public = format!(
            "{} {}",
            parts.next().unwrap_or_default(),
            parts.next().unwrap_or_default()
        );
        Ok(())
    }

    fn write_config(&self, env: &[(String, String)], extra: &str) -> anyhow::Result<()> {
        let d = self.dir.path().display();
        // One line: sshd keeps the first SetEnv directive it reads.
        let set_env = if env.is_empty() {
            String::new()
        } else {
            let vars: Vec<String> = env.iter().map(|(k, v)| format!("\"{k}={v}\"")).collect();
            format!("SetEnv {}\n", vars.join(" "))
        };
        // The admin's sessions get a home of their own unless the setup picks one: this machine's
        // root startup files (a version manager's rehash that leaves a stale lock when a session
        // is killed, stalling every later login) are not the build host under test.
        let mut admin_env = env.to_vec();
        if !env.iter().any(|(k, _)| k == "HOME") {
            let home = self.dir.path().join("admin-home");
            fs::create_dir_all(&home)?;
            admin_env.push(("HOME".into(), home.display().to_string()));
        }
        let admin_vars: Vec<String> = admin_env
            .iter()
            .map(|(k, v)| format!("\"{k}={v}\""))
            .collect();
        let config = format!(
            "ListenAddress {addr}:{port}\n\
             HostKey {d}/host_ed25519\n\
             PidFile none\n\
             AuthorizedKeysFile .ssh/authorized_keys {d}/admin_keys/%u\n\
             UsePAM no\n\
             PermitRootLogin prohibit-password\n\
             PasswordAuthentication no\n\
             KbdInteractiveAuthentication no\n\
             StrictModes yes\n\
             MaxStartups 200\n\
             MaxSessions 64\n\
             LoginGraceTime 30\n\
             PrintMotd no\n\
             LogLevel VERBOSE\n\
             {set_env}\
             Match User root\n\
             \x20 SetEnv {admin_vars}\n\
             {extra}",
            addr = self.address,
            port = self.port,
            admin_vars = admin_vars.join(" "),
            extra = extra,
        );
        write_mode(
            &self.dir.path().join("sshd_config"),
            config.as_bytes(),
            0o644,
        )
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spawn(&self) -> anyhow::Result<()> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("sshd.log"))?;
        // The programs before sshd exec what follows them: the child's pid stays the host's root.
        let mut argv: Vec<std::ffi::OsString> = Vec::new();
        if let Some(n) = self.nice {
            argv.extend(["nice".into(), "-n".into(), n.to_string().into()]);
        }
        if let Some(own) = &self.own {
            // `--kill-child`: sshd and with it the namespace go when unshare is killed.
            argv.extend(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--mount-proc",
                    "--ipc",
                    "--",
                    "/bin/sh",
                    "-c",
                    OWN_ROOT_SCRIPT,
                    "mpc-e2e-host",
                ]
                .map(Into::into),
            );
            argv.extend([own.etc.clone().into(), own.home.clone().into()]);
        }
        argv.push(sshd_binary().into());
        let mut command = Command::new(&argv[0]);
        command.args(&argv[1..]);
        // Its own process group, so a terminal's Ctrl-C to the harness does not stop it first.
        let child = command
            .args(["-D", "-e", "-f"])
            .arg(self.dir.path().join("sshd_config"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting sshd")?;
        *self.child() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = SocketAddr::from((self.address, self.port));
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            let exited = self
                .child()
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                *self.child() = None;
                bail!("sshd exited with {status} on start:\n{}", self.log());
            }
            if Instant::now() > deadline {
                bail!("sshd did not listen on {addr} within 10s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The loopback address sshd listens on.
    pub fn address(&self) -> String {
        self.address.to_string()
    }

    /// The host's own `/etc/passwd` if it has its own user database, as its sessions see it.
    pub fn own_passwd(&self) -> Option<String> {
        let own = self.own.as_ref()?;
        fs::read_to_string(own.etc.join("passwd")).ok()
    }

    /// The listening sshd's process id while it runs (its sessions are its descendants; for a
    /// host with its own users, the `unshare` above sshd).
    pub fn pid(&self) -> Option<u32> {
        self.child().as_ref().map(|c| c.id())
    }

    /// The port sshd listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host's public key, `ssh-ed25519 <base64>` (for pinning).
    pub fn host_key(&self) -> &str {
        &self.host_public
    }

    /// The admin (root) private key.
    pub fn admin_key(&self) -> Arc<Zeroizing<Vec<u8>>> {
        Arc::clone(&self.admin_private)
    }

    /// A provisioning target for this host, trusted on first use under `id`.
    pub fn target(&self, id: &str) -> Target {
        Target {
            id: id.to_owned(),
            address: self.address(),
            port: self.port,
            user: "root".to_owned(),
            admin_key: self.admin_key(),
            host_key: HostKeyTrust::TrustOnFirstUse,
        }
    }

    /// A provisioning target for this host with its current key pinned.
    pub fn pinned_target(&self, id: &str) -> Target {
        Target {
            host_key: HostKeyTrust::Pinned(self.host_public.clone()),
            ..self.target(id)
        }
    }

    /// A known_hosts line for ssh clients connecting to `address` on this port.
    pub fn known_hosts_line(&self) -> String {
        format!("[{}]:{} {}", self.address, self.port, self.host_public)
    }

    /// sshd's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("sshd.log")).unwrap_or_default()
    }

    /// Deletes `user` (and its processes and files) when this host is dropped; nothing to do
    /// for a host with its own users, whose users go with it.
    pub fn track_user(&self, user: &str) {
        if self.own.is_some() {
            return;
        }
        self.users
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(user.to_owned());
    }

    /// Runs `command` over a real `ssh` client as `user` authenticating with `private_key`, checking
    /// the host key strictly.
    pub fn ssh_as(&self, user: &str, private_key: &str, command: &str) -> anyhow::Result<Output> {
        let key = self.dir.path().join(format!("client-{:x}", random_u64()));
        write_mode(&key, private_key.as_bytes(), 0o600)?;
        let known = self.dir.path().join("client_known_hosts");
        write_mode(
            &known,
            format!("{}\n", self.known_hosts_line()).as_bytes(),
            0o644,
        )?;
        let out = Command::new("ssh")
            .args([
                "-F",
                "/dev/null",
                "-o",
                "BatchMode=yes",
                "-o",
                "IdentitiesOnly=yes",
            ])
            .args([
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "GlobalKnownHostsFile=/dev/null",
            ])
            .arg("-o")
            .arg(format!("UserKnownHostsFile={}", known.display()))
            .arg("-i")
            .arg(&key)
            .arg("-p")
            .arg(self.port.to_string())
            .arg(format!("{user}@{}", self.address))
            .arg(command)
            .stdin(Stdio::null())
            .output()
            .context("running ssh");
        let _ = fs::remove_file(&key);
        out
    }

    /// Kills sshd and every session process it spawned (as if the machine died).
    pub fn kill(&self) {
        let child = self.child().take();
        if let Some(mut child) = child {
            kill_tree(child.id());
            let _ = child.wait();
        }
    }

    /// Stops (SIGSTOP) sshd and its sessions: the host hangs, connections stay open.
    pub fn freeze(&self) {
        if let Some(child) = &*self.child() {
            signal("-STOP", &descendants(child.id()));
        }
    }

    /// Resumes a frozen host.
    pub fn thaw(&self) {
        if let Some(child) = &*self.child() {
            signal("-CONT", &descendants(child.id()));
        }
    }

    /// Starts a killed host again: sshd on the same address and port with the same host key (the
    /// machine came back).
    pub fn start_again(&self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }

    /// Starts sshd again on the same address and port, with a new host key if `new_host_key`.
    pub fn restart(&mut self, new_host_key: bool) -> anyhow::Result<()> {
        self.kill();
        if new_host_key {
            self.new_host_key()?;
        }
        self.spawn()
    }
}

impl Drop for SshdHost {
    fn drop(&mut self) {
        self.kill();
        let users = std::mem::take(&mut *self.users.lock().unwrap_or_else(|e| e.into_inner()));
        for user in users {
            remove_user(&user);
        }
    }
}

/// A directory every user can search holding links to every system executable not hidden, then
/// the extra tools.
fn tool_dir(setup: &HostSetup) -> anyhow::Result<tempfile::TempDir> {
    let bin = tempfile::Builder::new()
        .prefix("mpc-e2e-path-")
        .tempdir_in("/tmp")
        .context("creating a PATH directory in /tmp")?;
    fs::set_permissions(bin.path(), fs::Permissions::from_mode(0o755))?;
    for dir in SYSTEM_PATH {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let link = bin.path().join(&name);
            if setup.hidden.iter().any(|h| name == h.as_str()) || link.symlink_metadata().is_ok() {
                continue;
            }
            std::os::unix::fs::symlink(e.path(), &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
    }
    for (name, script) in &setup.extra {
        let path = bin.path().join(name);
        let _ = fs::remove_file(&path);
        write_mode(&path, format!("#!/bin/sh\n{script}").as_bytes(), 0o755)?;
    }
    Ok(bin)
}

/// Parent pid of every process, from `/proc`.
fn parents() -> HashMap<u32, u32> {
    let mut map = HashMap::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return map;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // The command name is parenthesised and may contain spaces: parse after the last ')'.
        if let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok())
        {
            map.insert(pid, ppid);
        }
    }
    map
}

fn descendants(root: u32) -> Vec<u32> {
    let parents = parents();
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parents.iter().filter(|&(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

fn signal(sig: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let _ = Command::new("kill")
        .arg(sig)
        .args(pids.iter().map(u32::to_string))
        .stderr(Stdio::null())
        .status();
}

/// Stops the whole tree first (so nothing forks away), then kills it.
fn kill_tree(root: u32) {
    let first = descendants(root);
    signal("-STOP", &first);
    let mut all = descendants(root);
    all.extend(first);
    all.sort_unstable();
    all.dedup();
    signal("-KILL", &all);
}

/// Writes `text` to a new file in `dir` with `mode` and returns its path.
pub fn write_file(dir: &Path, name: &str, text: &str, mode: u32) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    let mut f = fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    fs::set_permissions(&path, fs::Permissions::from_mode(mode))?;
    Ok(path)
}

/// The build user the Windows and macOS user-data creates.
pub const BUILD_USER: &str = "konflux-builder";

/// Which foreign OS an [`EmulatedOsHost`] answers as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmulatedOs {
    /// OpenSSH on Windows Server, default shell `cmd.exe`: `powershell -Command ...` lines,
    /// CRLF output, only `Administrator` may log in.
    Windows,
    /// macOS: `ec2-user` with passwordless sudo.
    MacOs,
}

/// Answers `$SSH_ORIGINAL_COMMAND` as a Windows host would for the commands the controller
/// sends, from `@ROOT@` standing for `C:\Users\Administrator`; logs every command.
const WINDOWS_FORCE_COMMAND: &str = r#"#!/bin/sh
root='@ROOT@'
key="$root/konflux-builder"
printf '%s\n' "$SSH_ORIGINAL_COMMAND" >> "$root/commands.log"
case "$SSH_ORIGINAL_COMMAND" in
'powershell -Command Test-Path C:\Users\Administrator\konflux-builder')
  if [ -f "$key" ]; then printf 'True\r\n'; else printf 'False\r\n'; fi
  exit 0 ;;
'powershell -Command cat C:\Users\Administrator\konflux-builder')
  if [ -f "$key" ]; then sed 's/$/\r/' "$key"; exit 0; fi
  printf "Get-Content : Cannot find path 'C:\\Users\\Administrator\\konflux-builder' because it does not exist.\r\n" >&2
  exit 1 ;;
'powershell -Command rm C:\Users\Administrator\konflux-builder')
  if [ -f "$root/rm-denied" ]; then
    printf "Remove-Item : Access to the path 'C:\\Users\\Administrator\\konflux-builder' is denied.\r\n" >&2
    exit 1
  fi
  if rm "$key" 2>/dev/null; then exit 0; fi
  printf "Remove-Item : Cannot find path 'C:\\Users\\Administrator\\konflux-builder' because it does not exist.\r\n" >&2
  exit 1 ;;
*)
  printf "'%s' is not recognized as an internal or external command,\r\noperable program or batch file.\r\n" "${SSH_ORIGINAL_COMMAND%% *}" >&2
  exit 1 ;;
esac
"#;

/// Answers as a macOS instance would, from `@ROOT@` standing for `/Users/ec2-user`.
const MACOS_FORCE_COMMAND: &str = r#"#!/bin/sh
root='@ROOT@'
key="$root/konflux-builder"
printf '%s\n' "$SSH_ORIGINAL_COMMAND" >> "$root/commands.log"
case "$SSH_ORIGINAL_COMMAND" in
'test -f /Users/ec2-user/konflux-builder') test -f "$key"; exit $? ;;
'cat /Users/ec2-user/konflux-builder') exec cat "$key" ;;
'sudo rm /Users/ec2-user/konflux-builder')
  if [ -f "$root/rm-denied" ]; then echo "rm: $key: Operation not permitted" >&2; exit 1; fi
  exec rm "$key" ;;
*) echo "unexpected command: $SSH_ORIGINAL_COMMAND" >&2; exit 127 ;;
esac
"#;

/// Answers the build user's commands as a Windows host would for the few a build step in these
/// tests sends (`powershell -Command whoami`, `... Write-Output TEXT`); logs every command.
const WINDOWS_BUILD_USER_COMMAND: &str = r#"#!/bin/sh
log='@ROOT@/build-commands.log'
printf '%s\n' "$SSH_ORIGINAL_COMMAND" >> "$log"
case "$SSH_ORIGINAL_COMMAND" in
'powershell -Command whoami') printf 'ec2amaz-e2e\\konflux-builder\r\n'; exit 0 ;;
'powershell -Command Write-Output '*)
  printf '%s\r\n' "${SSH_ORIGINAL_COMMAND#powershell -Command Write-Output }"; exit 0 ;;
*)
  printf "'%s' is not recognized as an internal or external command,\r\noperable program or batch file.\r\n" "${SSH_ORIGINAL_COMMAND%% *}" >&2
  exit 1 ;;
esac
"#;

/// An sshd host standing for a Windows or macOS cloud instance: its admin login (a local user of
/// this machine, created when missing) gets a `ForceCommand` that answers the controller's
/// commands as that OS would, and the user-data's key file lives in a directory of its own.
pub struct EmulatedOsHost {
    /// The sshd.
    pub sshd: SshdHost,
    /// The OS answered as.
    pub os: EmulatedOs,
    root: tempfile::TempDir,
}

impl std::fmt::Debug for EmulatedOsHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedOsHost")
            .field("os", &self.os)
            .field("sshd", &self.sshd)
            .finish_non_exhaustive()
    }
}

/// Creates local user `name` with a home if missing (ignoring a concurrent creation).
fn ensure_user(name: &str) -> anyhow::Result<()> {
    if !user_exists(name) {
        let out = Command::new("useradd")
            .args(["--badname", "-m", "-s", "/bin/sh", name])
            .output()
            .context("running useradd")?;
        if !out.status.success() && !user_exists(name) {
            bail!("useradd {name}: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    // No password, but not locked: sshd without PAM refuses locked accounts even for keys.
    let out = Command::new("usermod")
        .args(["-p", "*", name])
        .output()
        .context("running usermod")?;
    if !out.status.success() {
        bail!("usermod {name}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

fn chown(path: &Path, user: &str) -> anyhow::Result<()> {
    let out = Command::new("chown")
        .arg(format!("{user}:"))
        .arg(path)
        .output()
        .context("running chown")?;
    if !out.status.success() {
        bail!(
            "chown {user} {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

impl EmulatedOsHost {
    /// The admin login of `os`.
    pub fn admin_user(os: EmulatedOs) -> &'static str {
        match os {
            EmulatedOs::Windows => "Administrator",
            EmulatedOs::MacOs => "ec2-user",
        }
    }

    /// Starts a host answering as `os`, authorising `admin` (the platform's `ssh-secret`) for
    /// its admin login only.
    pub fn start(os: EmulatedOs, admin: &AdminKey) -> anyhow::Result<Self> {
        Self::start_with(os, admin, HostSetup::default())
    }

    /// [`Self::start`] with `setup`'s address and port (`127.0.<n>.4:22`, where a cloud emulator
    /// says the instance is).
    pub fn start_with(os: EmulatedOs, admin: &AdminKey, setup: HostSetup) -> anyhow::Result<Self> {
        let user = Self::admin_user(os);
        ensure_user(user)?;
        let home = PathBuf::from(format!("/home/{user}"));
        let ssh_dir = home.join(".ssh");
        fs::create_dir_all(&ssh_dir)?;
        fs::set_permissions(&ssh_dir, fs::Permissions::from_mode(0o700))?;
        // Appended: parallel tests share the login, each with its own key.
        let keys = ssh_dir.join("authorized_keys");
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&keys)?;
        writeln!(f, "{}", admin.public())?;
        fs::set_permissions(&keys, fs::Permissions::from_mode(0o600))?;
        chown(&ssh_dir, user)?;
        chown(&keys, user)?;

        let root = tempfile::Builder::new()
            .prefix("mpc-e2e-os-")
            .tempdir_in("/tmp")
            .context("creating the host's home directory")?;
        fs::set_permissions(root.path(), fs::Permissions::from_mode(0o755))?;
        chown(root.path(), user)?;
        let script = match os {
            EmulatedOs::Windows => WINDOWS_FORCE_COMMAND,
            EmulatedOs::MacOs => MACOS_FORCE_COMMAND,
        }
        .replace("@ROOT@", &root.path().display().to_string());
        let script = write_file(root.path(), "force-command.sh", &script, 0o755)?;
        let deny = match os {
            // Windows: nothing but Administrator and the build user log in.
            EmulatedOs::Windows => "DenyUsers root ec2-user\n",
            EmulatedOs::MacOs => "DenyUsers root\n",
        };
        // The build user answers as the OS would too on Windows; on macOS it gets a real shell.
        let build_user = match os {
            EmulatedOs::Windows => {
                let s = WINDOWS_BUILD_USER_COMMAND
                    .replace("@ROOT@", &root.path().display().to_string());
                let s = write_file(root.path(), "build-user-command.sh", &s, 0o755)?;
                write_file(root.path(), "build-commands.log", "", 0o666)?;
                format!("Match User {BUILD_USER}\n  ForceCommand {}\n", s.display())
            }
            EmulatedOs::MacOs => String::new(),
        };
        let sshd = SshdHost::start_with(HostSetup {
            admin_key: Some(admin.clone()),
            extra_config: format!(
                "Match User {user}\n  ForceCommand {}\n{build_user}Match all\n{deny}",
                script.display()
            ),
            ..setup
        })?;
        Ok(Self { sshd, os, root })
    }

    /// What the instance's user-data does last: leave the build user's private key in the
    /// admin's home, owned by the admin.
    pub fn place_key(&self, private_key: &str) -> anyhow::Result<()> {
        let tmp = write_file(self.root.path(), ".konflux-builder.tmp", private_key, 0o600)?;
        chown(&tmp, Self::admin_user(self.os))?;
        fs::rename(&tmp, self.root.path().join("konflux-builder"))?;
        Ok(())
    }

    /// The rest of what the user-data does for the build user: create `konflux-builder` and
    /// authorise `public_key` (an `authorized_keys` line) for it, then leave `private_key` in
    /// the admin's home ([`Self::place_key`]). Parallel tests share the local user, each with
    /// its own key.
    pub fn place_build_key(&self, private_key: &str, public_key: &str) -> anyhow::Result<()> {
        ensure_user(BUILD_USER)?;
        let ssh_dir = PathBuf::from(format!("/home/{BUILD_USER}/.ssh"));
        fs::create_dir_all(&ssh_dir)?;
        fs::set_permissions(&ssh_dir, fs::Permissions::from_mode(0o700))?;
        let keys = ssh_dir.join("authorized_keys");
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&keys)?;
        writeln!(f, "{}", public_key.trim_end())?;
        fs::set_permissions(&keys, fs::Permissions::from_mode(0o600))?;
        chown(&ssh_dir, BUILD_USER)?;
        chown(&keys, BUILD_USER)?;
        self.place_key(private_key)
    }

    /// Every command the build user ran on an emulated Windows host, in order.
    pub fn build_user_commands(&self) -> Vec<String> {
        fs::read_to_string(self.root.path().join("build-commands.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Whether the key file is still on the host.
    pub fn key_present(&self) -> bool {
        self.root.path().join("konflux-builder").exists()
    }

    /// Makes the removal of the key file fail (access denied).
    pub fn deny_removal(&self) -> anyhow::Result<()> {
        write_file(self.root.path(), "rm-denied", "", 0o644).map(|_| ())
    }

    /// Every command the admin login was asked to run, in order.
    pub fn commands(&self) -> Vec<String> {
        fs::read_to_string(self.root.path().join("commands.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}
