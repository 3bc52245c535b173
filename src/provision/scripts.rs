//! The remote scripts, as constants, and the pure assembly of the one command line per operation.
//!
//! Scripts never contain request data: values arrive as positional parameters quoted by
//! [`super::quote`], and the scripts only ever use them inside double quotes. Exit codes follow
//! `sysexits.h` so the caller can tell a bad request (65) from a host that lacks a tool (69) or
//! failed (75).

use super::quote::{NulInArgument, sh_command};

/// Exit code: the host rejected data derived from the request (e.g. visudo refused the rule).
pub const EXIT_BAD_REQUEST: i32 = 65;
/// Exit code: a required tool is missing on the host.
pub const EXIT_UNAVAILABLE: i32 = 69;
/// Exit code: a host-side step failed; retrying elsewhere may work.
pub const EXIT_TEMPFAIL: i32 = 75;

/// `$0` of provisioning scripts (shows in `ps` on the host while they run).
pub const SCRIPT_NAME: &str = "mpc-provision";

/// Creates or refreshes one build user. Arguments: user, authorized_keys line, sudoers text (empty:
/// none), limits text (empty: none).
///
/// Files inside the user's home are written as the user (setpriv/runuser), so a user who replaced
/// `~/.ssh` with a symlink during an earlier attempt cannot make root write elsewhere.
pub const PROVISION: &str = r#"set -u
umask 022
user=$1 key=$2 sudoers=$3 limits=$4
home=/home/$user
fail() { code=$1; shift; printf 'mpc-provision: %s\n' "$*" >&2; exit "$code"; }
for tool in id useradd; do
  command -v "$tool" >/dev/null 2>&1 || fail 69 "$tool is not installed"
done
if ! id -u "$user" >/dev/null 2>&1; then
  # A home left behind by an interrupted cleanup must not be inherited by the new account.
  rm -rf -- "$home"
  shell=/bin/bash
  [ -x "$shell" ] || shell=/bin/sh
  tries=0
  # '*' as the password hash: no password login, but not locked (sshd refuses locked accounts).
  until out=$(useradd -m -d "$home" -s "$shell" -p '*' "$user" 2>&1); do
    rc=$?
    case $rc in
      9) break ;;
      1|10)
        tries=$((tries + 1))
        [ "$tries" -lt 100 ] || fail 75 "useradd: passwd or group file stayed locked: $out"
        sleep 0.05 ;;
      *) fail 75 "useradd exited with $rc: $out" ;;
    esac
  done
else
  # Accounts made by other tools may be locked ('!'), which sshd refuses without PAM.
  usermod -p '*' "$user" >/dev/null 2>&1 || true
fi
gid=$(id -g "$user") || fail 75 "user $user vanished while being provisioned"
[ -d "$home" ] || install -d -m 0755 -o "$user" -g "$gid" "$home" || fail 75 "cannot create $home"
as_user() {
  if command -v setpriv >/dev/null 2>&1; then
    setpriv --reuid="$user" --regid="$gid" --init-groups -- "$@"
  elif command -v runuser >/dev/null 2>&1; then
    runuser -u "$user" -- "$@"
  else
    fail 69 "neither setpriv nor runuser is installed"
  fi
}
as_user sh -c 'umask 077
mkdir -p "$1/.ssh" "$1/build" && chmod 0700 "$1/.ssh" &&
printf "%s\n" "$2" > "$1/.ssh/authorized_keys.new" &&
mv -f "$1/.ssh/authorized_keys.new" "$1/.ssh/authorized_keys"' mpc-user "$home" "$key" ||
  fail 75 "writing $home/.ssh/authorized_keys as $user failed"
dir=/etc/security/limits.d
if [ -n "$limits" ] && [ -d "$dir" ]; then
  { printf '%s\n' "$limits" > "$dir/.$user.tmp" && mv -f "$dir/.$user.tmp" "$dir/$user.conf"; } ||
    fail 75 "writing $dir/$user.conf failed"
else
  rm -f -- "$dir/$user.conf"
fi
dir=/etc/sudoers.d
if [ -n "$sudoers" ]; then
  command -v visudo >/dev/null 2>&1 || fail 69 "sudo-commands are configured but visudo is not installed"
  [ -d "$dir" ] || fail 69 "$dir does not exist"
  # sudo skips file names containing '.', so the candidate is inert until renamed.
  tmp=$dir/.$user.tmp
  { printf '%s\n' "$sudoers" > "$tmp" && chmod 0440 "$tmp"; } || fail 75 "writing $tmp failed"
  if ! out=$(visudo -cf "$tmp" 2>&1); then
    rm -f -- "$tmp"
    fail 65 "visudo rejected the sudoers rule: $out"
  fi
  mv -f "$tmp" "$dir/$user" || fail 75 "installing $dir/$user failed"
else
  rm -f -- "$dir/$user"
fi
"#;

/// Removes build users and everything provisioning created for them. Arguments: the users.
/// A user already gone is not an error.
pub const DEPROVISION: &str = r#"set -u
fail() { code=$1; shift; printf 'mpc-deprovision: %s\n' "$*" >&2; exit "$code"; }
for user in "$@"; do
  tries=0
  while id -u "$user" >/dev/null 2>&1; do
    # Freeze first so nothing can fork while the rest is being killed. No process found: no
    # kill round (each scans /proc); one started after this makes userdel fail and come back here.
    if pkill -STOP -u "$user" 2>/dev/null; then
      kills=0
      while pkill -KILL -u "$user" 2>/dev/null; do
        kills=$((kills + 1))
        [ "$kills" -lt 250 ] || fail 75 "processes of $user survive SIGKILL"
        sleep 0.02
      done
    fi
    for d in /tmp /var/tmp /dev/shm; do
      [ -d "$d" ] && find "$d" -xdev -mindepth 1 -maxdepth 1 -user "$user" -exec rm -rf -- {} + 2>/dev/null
    done
    out=$(userdel -r "$user" 2>&1)
    rc=$?
    case $rc in
      # 6: removed concurrently; 12: home or mail spool was already missing.
      0|6|12) break ;;
      *)
        tries=$((tries + 1))
        [ "$tries" -lt 100 ] || fail 75 "userdel exited with $rc: $out"
        sleep 0.05 ;;
    esac
  done
  rm -rf -- "/home/$user"
  rm -f -- "/etc/sudoers.d/$user" "/etc/sudoers.d/.$user.tmp" \
    "/etc/security/limits.d/$user.conf" "/etc/security/limits.d/.$user.tmp" \
    "/var/mail/$user" "/var/spool/mail/$user" \
    "/var/spool/cron/crontabs/$user" "/var/spool/cron/$user"
done
"#;

/// `$0` of cleanup scripts.
pub const DEPROVISION_NAME: &str = "mpc-deprovision";

/// A resource limit written to `/etc/security/limits.d/<user>.conf` (applied by `pam_limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// The limited resource.
    pub item: LimitItem,
    /// `None` means `unlimited`.
    pub value: Option<u64>,
}

/// The `pam_limits` items we write (a closed set, so nothing unvalidated reaches the file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitItem {
    /// Open files.
    Nofile,
    /// Processes.
    Nproc,
    /// Core file size (KB).
    Core,
    /// Locked-in-memory address space (KB).
    Memlock,
}

impl LimitItem {
    fn as_str(self) -> &'static str {
        match self {
            Self::Nofile => "nofile",
            Self::Nproc => "nproc",
            Self::Core => "core",
            Self::Memlock => "memlock",
        }
    }
}

/// Default limits: enough for container builds, bounded so one build cannot exhaust the host's PIDs.
pub fn default_limits() -> Vec<Limit> {
    vec![
        Limit {
            item: LimitItem::Nofile,
            value: Some(65_536),
        },
        Limit {
            item: LimitItem::Nproc,
            value: Some(16_384),
        },
    ]
}

/// The limits file: one `<user> - <item> <value>` line per limit (soft and hard).
pub fn limits_file(user: &str, limits: &[Limit]) -> String {
    limits
        .iter()
        .map(|l| {
            let v = l
                .value
                .map_or_else(|| "unlimited".to_owned(), |v| v.to_string());
            format!("{user} - {} {v}", l.item.as_str())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The sudoers file letting `user` run exactly `commands` as root without a password; empty when
/// there are no commands. Commands must already be validated (see `config::values::sudo_commands`).
pub fn sudoers_file(user: &str, commands: &[String]) -> String {
    if commands.is_empty() {
        return String::new();
    }
    format!(
        "Defaults:{user} !requiretty\n{user} ALL=(root) NOPASSWD: {}",
        commands.join(", ")
    )
}

/// The full command line that provisions `user`.
pub fn provision_command(
    prefix: &[&str],
    user: &str,
    authorized_key: &str,
    sudoers: &str,
    limits: &str,
) -> Result<String, NulInArgument> {
    sh_command(
        prefix,
        PROVISION,
        SCRIPT_NAME,
        &[user, authorized_key, sudoers, limits],
    )
}

/// The full command line that removes `users`.
pub fn deprovision_command(prefix: &[&str], users: &[&str]) -> Result<String, NulInArgument> {
    sh_command(prefix, DEPROVISION, DEPROVISION_NAME, users)
}

/// Is `name` one of our per-TaskRun users (`u-` + 28 lowercase hex digits)?
pub fn is_build_user(name: &str) -> bool {
    name.strip_prefix("u-").is_some_and(|h| {
        h.len() == 28
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Build users in `getent passwd` output.
pub fn build_users_in_passwd(passwd: &str) -> Vec<String> {
    passwd
        .lines()
        .filter_map(|l| l.split(':').next())
        .filter(|u| is_build_user(u))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::quote::tests::tokenize;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scripts_parse_in_the_system_shell() {
        for script in [PROVISION, DEPROVISION] {
            let out = std::process::Command::new("sh")
                .args(["-n", "-c", script])
                .output()
                .expect("running sh -n");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    #[test]
    fn sudoers_and_limits_text() {
        let s = sudoers_file("u-1", &["/usr/bin/podman".into(), "/usr/bin/rm /x".into()]);
        assert_eq!(
            s,
            "Defaults:u-1 !requiretty\nu-1 ALL=(root) NOPASSWD: /usr/bin/podman, /usr/bin/rm /x"
        );
        assert_eq!(sudoers_file("u-1", &[]), "");
        assert_eq!(
            limits_file("u-1", &default_limits()),
            "u-1 - nofile 65536\nu-1 - nproc 16384"
        );
        let unlimited = [Limit {
            item: LimitItem::Core,
            value: None,
        }];
        assert_eq!(limits_file("u-1", &unlimited), "u-1 - core unlimited");
    }

    #[test]
    fn build_users_are_recognised_strictly() {
        let passwd = "root:x:0:0::/root:/bin/bash\n\
                      u-0123456789abcdef0123456789ab:x:1001:1001::/home/u:/bin/bash\n\
                      u-0123456789ABCDEF0123456789ab:x:1002:1002::/home/u:/bin/bash\n\
                      u-short:x:1003:1003::/home/u:/bin/bash\n";
        assert_eq!(
            build_users_in_passwd(passwd),
            ["u-0123456789abcdef0123456789ab"]
        );
        assert!(!is_build_user("root"));
        assert!(!is_build_user("u-0123456789abcdef0123456789abc"));
    }

    proptest! {
        /// Hostile TaskRun names and namespaces, sudo commands and keys: whatever survives
        /// validation reaches the remote shell as exactly the intended words.
        #[test]
        fn provision_command_never_leaks_unquoted_metacharacters(
            name in "[^\\x00]{0,60}",
            namespace in "[^\\x00]{0,60}",
            sudo in "[^\\x00]{0,60}",
            comment in "[^\\x00]{0,30}",
        ) {
            let user = crate::contract::remote_user_name(&name, &namespace);
            prop_assert!(is_build_user(&user));
            let commands = crate::config::values::sudo_commands(&sudo).unwrap_or_default();
            let sudoers = sudoers_file(&user, &commands);
            let limits = limits_file(&user, &default_limits());
            let key = format!("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB2a {comment}");
            let line = provision_command(&["sudo", "-n"], &user, &key, &sudoers, &limits).unwrap();
            let words = tokenize(&line).map_err(TestCaseError::fail)?;
            prop_assert_eq!(
                words,
                vec!["sudo".to_owned(), "-n".into(), "sh".into(), "-c".into(), PROVISION.into(),
                     SCRIPT_NAME.into(), user.clone(), key, sudoers, limits]
            );
        }

        #[test]
        fn deprovision_command_round_trips(users in proptest::collection::vec("[^\\x00]{0,40}", 0..4)) {
            let refs: Vec<&str> = users.iter().map(String::as_str).collect();
            let line = deprovision_command(&[], &refs).unwrap();
            let mut expected = vec!["sh".to_owned(), "-c".into(), DEPROVISION.into(), DEPROVISION_NAME.into()];
            expected.extend(users.iter().cloned());
            prop_assert_eq!(tokenize(&line).map_err(TestCaseError::fail)?, expected);
        }
    }
}
