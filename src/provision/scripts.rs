//! The remote scripts, as constants, and the pure assembly of the one command line per operation.
//!
//! Scripts never contain request data: values arrive as positional parameters quoted by
//! [`super::quote`], and the scripts only ever use them inside double quotes. Exit codes follow
//! `sysexits.h` so the caller can tell a bad request (65) from a host that lacks a tool (69) or
//! failed (75).

use std::collections::BTreeMap;
use std::time::Duration;

use super::HostUser;
use super::quote::{NulInArgument, sh_command};
use crate::config::BuildUserSettings;
use crate::contract::is_remote_user_name;

/// Exit code: the host rejected data derived from the request (e.g. visudo refused the rule).
pub const EXIT_BAD_REQUEST: i32 = 65;
/// Exit code: a required tool is missing on the host.
pub const EXIT_UNAVAILABLE: i32 = 69;
/// Exit code: a host-side step failed; retrying elsewhere may work.
pub const EXIT_TEMPFAIL: i32 = 75;

/// `$0` of provisioning scripts (shows in `ps` on the host while they run).
pub const SCRIPT_NAME: &str = "mpc-provision";

/// Shell function shared by the scripts: is systemd the host's init, able to take unit changes?
/// Asked through `systemctl` (not `/run/systemd/system`) so only a host whose manager answers counts.
macro_rules! systemd_running_fn {
    () => {
        r#"systemd_running() {
  command -v systemctl >/dev/null 2>&1 || return 1
  case $(systemctl is-system-running 2>/dev/null) in
    running|degraded|starting|initializing|maintenance|stopping) return 0 ;;
  esac
  return 1
}
"#
    };
}

/// Creates or refreshes one build user. Arguments: user, authorized_keys line, sudoers text (empty:
/// none), limits text (empty: none), slice drop-in text (empty: none; see [`slice_drop_in`]).
///
/// Files inside the user's home are written as the user (setpriv/runuser), so a user who replaced
/// `~/.ssh` with a symlink during an earlier attempt cannot make root write elsewhere. Steps the
/// Go controller's provisioning also takes, each skipped where the host lacks the tool: podman
/// must exist (exit 69 otherwise), `restorecon -FRv ~/.ssh` on SELinux hosts, and the slice
/// drop-in where systemd runs.
pub const PROVISION: &str = concat!(
    r#"set -u
umask 022
user=$1 key=$2 sudoers=$3 limits=$4 slice=$5
home=/home/$user
fail() { code=$1; shift; printf 'mpc-provision: %s\n' "$*" >&2; exit "$code"; }
for tool in id useradd; do
  command -v "$tool" >/dev/null 2>&1 || fail 69 "$tool is not installed"
done
# Builds run their containers with podman on the host. The Go controller's provisioning ran
# 'dnf install podman' every time; we check instead of changing the host's packages.
command -v podman >/dev/null 2>&1 ||
  fail 69 "podman is not installed on this host: install it (e.g. dnf install -y podman); builds run their containers with it"
"#,
    systemd_running_fn!(),
    r#"selinux_enabled() {
  if command -v selinuxenabled >/dev/null 2>&1; then selinuxenabled; else [ -e /sys/fs/selinux/enforce ]; fi
}
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
      # 10: passwd or group file locked; 16, 18: /etc/subuid, /etc/subgid locked (by the cleanup,
      # which does not take glibc's lock shadow's tools wait for first).
      1|10|16|18)
        tries=$((tries + 1))
        [ "$tries" -lt 100 ] || fail 75 "useradd: an account file stayed locked: $out"
        sleep 0.05 ;;
      *) fail 75 "useradd exited with $rc: $out" ;;
    esac
  done
else
  # Accounts made by other tools may be locked ('!'), which sshd refuses without PAM; one an
  # interrupted cleanup expired refuses logins with PAM too.
  usermod -p '*' "$user" >/dev/null 2>&1 || true
  usermod -e '' "$user" >/dev/null 2>&1 || true
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
# On SELinux hosts the new files may carry a label sshd may not read: without this, logins fail.
if command -v restorecon >/dev/null 2>&1 && selinux_enabled; then
  out=$(restorecon -FRv -- "$home/.ssh" 2>&1) || fail 75 "restorecon -FRv $home/.ssh failed: $out"
fi
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
# Resource caps: a drop-in for user-<uid>.slice, which holds every session and service of the
# user. Its name carries the user so cleanup finds it without the uid. Written where systemd runs.
reload=
for f in /etc/systemd/system/user-*.slice.d/50-mpc-"$user".conf; do
  [ -e "$f" ] || continue
  rm -f -- "$f"
  rmdir -- "${f%/*}" 2>/dev/null
  reload=1
done
systemd=
if [ -n "$slice$reload" ] && systemd_running; then systemd=1; fi
if [ -n "$slice" ] && [ -n "$systemd" ]; then
  uid=$(id -u "$user") || fail 75 "user $user vanished while being provisioned"
  dir=/etc/systemd/system/user-$uid.slice.d
  # A drop-in of a deleted user whose uid this one reuses.
  rm -f -- "$dir"/50-mpc-u-*.conf
  { mkdir -p -- "$dir" && printf '%s\n' "$slice" > "$dir/.50-mpc-$user.tmp" &&
    mv -f -- "$dir/.50-mpc-$user.tmp" "$dir/50-mpc-$user.conf"; } ||
    fail 75 "writing $dir/50-mpc-$user.conf failed"
  reload=1
fi
if [ -n "$reload" ] && [ -n "$systemd" ]; then
  out=$(systemctl daemon-reload 2>&1) || fail 75 "systemctl daemon-reload failed: $out"
fi
"#
);

/// Removes build users, everything provisioning created for them and everything a build can
/// leave behind outside its home: processes, crontab, `at` jobs, lingering and the systemd user
/// manager, SysV IPC objects, and files anywhere under the world-writable directories. The user's
/// is what its uid owns and, where the host gives users subordinate ids (`/etc/subuid`,
/// `/etc/subgid`, which `useradd` fills on Debian, RHEL and Fedora), what runs as or is owned by
/// those: a rootless container's processes and files, whose range the next user gets. The account
/// goes last, only once none of that is found any more, so its uid and range are not handed to a
/// new user while something of the old one remains (that would make it the new user's). A user
/// already gone is not an error. Arguments: the users.
///
/// It runs as root over directories tenants write to, so no path is resolved twice: files are
/// removed by `find -delete`, relative to the directories `find` holds open while walking (never
/// by a path handed to `rm`, on which a tenant can swap a directory for a symlink to `/` in
/// between); symlinks are removed, never followed; a directory of the user that holds someone
/// else's entries keeps them and is handed to root instead.
pub const DEPROVISION: &str = concat!(
    r#"set -u
fail() { code=$1; shift; printf 'mpc-deprovision: %s\n' "$*" >&2; exit "$code"; }
command -v awk >/dev/null 2>&1 || fail 69 "awk is not installed"
"#,
    systemd_running_fn!(),
    r#"shared_dirs="/tmp /var/tmp /dev/shm /dev/mqueue /var/crash"
at_spools="/var/spool/cron/atjobs /var/spool/at /var/spool/atjobs"
# awk: is the id $1 in one of the ranges ("first-last first-last ...") of $2?
within='function within(id, list,   n, i, r, b) {
  n = split(list, r, " ")
  for (i = 1; i <= n; i++) { split(r[i], b, "-"); if (id + 0 >= b[1] + 0 && id + 0 <= b[2] + 0) return 1 }
  return 0
}'
# The subordinate ids that file $3 gives user $1 (uid $2), as "first-last" words; never from 0.
subids() {
  [ -e "$3" ] || return 0
  awk -F: -v n="$1" -v id="$2" '($1 == n || $1 == id) && $2 ~ /^[0-9]+$/ && $3 ~ /^[0-9]+$/ &&
    $2 > 0 && $3 > 0 { printf "%.0f-%.0f\n", $2, $2 + $3 - 1 }' "$3"
}
# Takes the lock shadow's tools (useradd, userdel) take on file $1: $1.lock, made by a link, holding
# the holder's pid; one whose holder is gone is stale.
lock() {
  printf '%s' "$$" > "$1.mpc-$$" || return 1
  n=0
  until ln -- "$1.mpc-$$" "$1.lock" 2>/dev/null; do
    holder=$(cat -- "$1.lock" 2>/dev/null)
    case $holder in
      ''|*[!0-9]*) ;;
      *) kill -0 "$holder" 2>/dev/null || rm -f -- "$1.lock" ;;
    esac
    n=$((n + 1))
    [ "$n" -lt 100 ] || { rm -f -- "$1.mpc-$$"; return 1; }
    sleep 0.05
  done
  rm -f -- "$1.mpc-$$"
}
# Drops the lines of user $1 (and of uid $2 if not empty) from the subordinate ids file $3.
drop_subids() {
  [ -e "$3" ] || return 0
  has='$1 == n || (id != "" && $1 == id)'
  awk -F: -v n="$1" -v id="$2" "$has"' { f = 1 } END { exit !f }' "$3" || return 0
  lock "$3" || return 1
  cp -p -- "$3" "$3.mpc-tmp" &&
    awk -F: -v n="$1" -v id="$2" "!($has)" "$3" > "$3.mpc-tmp" &&
    mv -f -- "$3.mpc-tmp" "$3"
  rc=$?
  rm -f -- "$3.lock"
  return "$rc"
}
# Live processes (a zombie is dead already) with any uid in $ranges or any gid in $granges.
pids() {
  cat /proc/[0-9]*/status 2>/dev/null | awk -v u="$ranges" -v g="$granges" "$within"'
/^State:/ { live = $2 != "Z" && $2 != "X" }
/^Pid:/ { p = $2 }
/^Uid:/ && live { for (i = 2; i <= 5; i++) if (within($i, u)) hit[p] = 1 }
/^Gid:/ && live { for (i = 2; i <= 5; i++) if (within($i, g)) hit[p] = 1 }
END { for (p in hit) print p }'
}
# Ids of the SysV IPC objects of kind $1 (shm, msg, sem) that a uid in $ranges owns or created.
# Columns of /proc/sysvipc: the id is the 2nd; owner and creator uid the 8th and 10th, the 5th and
# 7th for sem.
ipc_ids() {
  [ -r "/proc/sysvipc/$1" ] || return 0
  case $1 in sem) o=5 c=7 ;; *) o=8 c=10 ;; esac
  awk -v u="$ranges" -v o="$o" -v c="$c" "$within"'
NR > 1 && (within($o, u) || within($c, u)) { print $2 }' "/proc/sysvipc/$1"
}
# Run by find -execdir in a directory it walked, with names there: hands each to root if it is a
# directory owned by a uid in the ranges $1. Checked and changed as '.' after entering it, so a
# name swapped in between cannot redirect the chown to something else.
to_root='r=$1; shift
for f; do
  (cd -P -- "$f" && o=$(stat -c %u .) && for x in $r; do
    if [ "$o" -ge "${x%-*}" ] && [ "$o" -le "${x#*-}" ]; then exec chown 0:0 .; fi
  done; exit 1) || exit 1
done'
# find refuses -execdir while PATH holds a relative directory: it runs with the absolute ones.
find_path=
set -f; IFS=:
for d in $PATH; do case $d in /*) find_path=${find_path:+$find_path:}$d ;; esac; done
unset IFS; set +f
# Removes what user $1 (uid $2; the uids in $ranges, find's test $owned) left outside its home.
sweep() {
  if command -v crontab >/dev/null 2>&1; then crontab -r -u "$1" >/dev/null 2>&1; fi
  rm -f -- "/var/spool/cron/crontabs/$1" "/var/spool/cron/$1" "/var/spool/cron/tabs/$1"
  for d in $at_spools; do
    [ -d "$d" ] && find "$d" -xdev -mindepth 1 -maxdepth 1 -uid "$2" -type f -delete 2>/dev/null
  done
  if command -v loginctl >/dev/null 2>&1; then
    loginctl disable-linger "$1" >/dev/null 2>&1
    loginctl terminate-user "$1" >/dev/null 2>&1
  fi
  rm -f -- "/var/lib/systemd/linger/$1"
  if command -v ipcrm >/dev/null 2>&1; then
    for id in $(ipc_ids shm); do ipcrm -m "$id" >/dev/null 2>&1; done
    for id in $(ipc_ids msg); do ipcrm -q "$id" >/dev/null 2>&1; done
    for id in $(ipc_ids sem); do ipcrm -s "$id" >/dev/null 2>&1; done
  fi
  # Anywhere under them, not only at the top: a file in another user's directory counts too.
  # Depth first; -delete removes each entry relative to the directory find has open, never by a
  # path resolved again; a directory still holding others' entries goes to root. One pass each
  # (they can be large); a failure (a removal refused, a directory swapped mid-walk) is reported
  # by leftover and the round repeated.
  unremoved=
  for d in $shared_dirs; do
    [ -d "$d" ] || continue
    PATH=$find_path find "$d" -xdev -mindepth 1 -depth $owned \( -type d ! -empty \
      -execdir sh -c "$to_root" mpc-chown "$ranges" {} + -o -delete \) 2>/dev/null || unremoved=$d
  done
  [ -d "/run/user/$2" ] && rm -rf -- "/run/user/$2" 2>/dev/null
  return 0
}
# Prints the first thing of user $1 (uid $2) that is still there after sweep (its processes are
# gone and the account is expired, so nothing new appears in the shared directories: those are
# not scanned again, sweep says whether removing there failed).
leftover() {
  if [ -n "$(pids)" ]; then echo "a process"; return; fi
  if [ -n "$unremoved" ]; then echo "files in $unremoved"; return; fi
  for f in "/var/spool/cron/crontabs/$1" "/var/spool/cron/$1" "/var/lib/systemd/linger/$1"; do
    if [ -e "$f" ]; then echo "$f"; return; fi
  done
  for d in $at_spools; do
    [ -d "$d" ] || continue
    f=$(find "$d" -xdev -mindepth 1 -maxdepth 1 -uid "$2" 2>/dev/null)
    if [ -n "$f" ]; then echo "an at job"; return; fi
  done
  for kind in shm msg sem; do
    if [ -n "$(ipc_ids "$kind")" ]; then echo "a SysV IPC object ($kind)"; return; fi
  done
}
reload=
for user in "$@"; do
  tries=0 kills=0
  removed=
  while uid=$(id -u "$user" 2>/dev/null); do
    # Everything below removes by uid: never for root's.
    [ "$uid" -gt 0 ] || fail 65 "$user has uid 0; refusing to remove it"
    # Read on every round, before userdel drops them.
    subuids=$(subids "$user" "$uid" /etc/subuid) || fail 75 "reading /etc/subuid failed"
    subgids=$(subids "$user" "$uid" /etc/subgid) || fail 75 "reading /etc/subgid failed"
    subuids=$(echo $subuids) granges=$(echo $subgids)
    ranges="$uid-$uid${subuids:+ $subuids}"
    # A range that holds another account's id (a misconfiguration) would make the rest kill and
    # delete that account's processes and files.
    other=$(getent passwd | awk -F: -v n="$user" -v r="$subuids" "$within"'
$1 != n && within($3, r) { print $1; exit }')
    [ -z "$other" ] || fail 75 "the subordinate uids of $user include the uid of $other; refusing"
    other=$(getent group | awk -F: -v r="$granges" "$within"'within($3, r) { print $1; exit }')
    [ -z "$other" ] || fail 75 "the subordinate gids of $user include the gid of $other; refusing"
    owned='('
    for r in $ranges; do
      [ "$owned" = '(' ] || owned="$owned -o"
      owned="$owned ( -uid +$((${r%-*} - 1)) -uid -$((${r#*-} + 1)) )"
    done
    owned="$owned )"
    # No new logins, cron or at runs from here on: the account is expired.
    usermod -e 1 "$user" >/dev/null 2>&1
    # Freeze each round's processes before killing them, so none can react to a sibling's death.
    # No process found: no kill round; one started after this is found below and comes back here.
    p=$(pids)
    killed=
    while [ -n "$p" ]; do
      killed=1
      kills=$((kills + 1))
      [ "$kills" -le 100 ] ||
        fail 75 "processes of $user or its subordinate ids survive SIGKILL or keep being started: $(echo $p)"
      kill -STOP $p 2>/dev/null
      kill -KILL $p 2>/dev/null
      sleep 0.02
      p=$(pids)
    done
    sweep "$user" "$uid"
    left=$(leftover "$user" "$uid")
    # One scan finding none after a kill proves little (a supervisor outside the ids may be starting
    # them again): the account goes only after a round that had nothing to kill.
    [ -n "$left" ] || [ -z "$killed" ] || left="processes that keep being started"
    if [ -n "$left" ]; then
      tries=$((tries + 1))
      [ "$tries" -lt 100 ] || fail 75 "$user (uid $uid) still has $left; the account is kept so the uid is not reused"
      sleep 0.05
      continue
    fi
    out=$(userdel -r "$user" 2>&1)
    rc=$?
    case $rc in
      # 6: removed concurrently; 12: home or mail spool was already missing.
      0|6|12) removed=$uid; break ;;
      *)
        tries=$((tries + 1))
        [ "$tries" -lt 100 ] || fail 75 "userdel exited with $rc: $out"
        sleep 0.05 ;;
    esac
  done
  # shadow's userdel drops the user's subordinate ids; one built without them does not. Lines
  # naming the uid only when this run removed the account (else the uid may be someone else's).
  for f in /etc/subuid /etc/subgid; do
    drop_subids "$user" "$removed" "$f" || fail 75 "removing $user from $f failed"
  done
  rm -rf -- "/home/$user"
  rm -f -- "/etc/sudoers.d/$user" "/etc/sudoers.d/.$user.tmp" \
    "/etc/security/limits.d/$user.conf" "/etc/security/limits.d/.$user.tmp" \
    "/var/mail/$user" "/var/spool/mail/$user" \
    "/var/spool/cron/crontabs/$user" "/var/spool/cron/$user"
  for f in /etc/systemd/system/user-*.slice.d/50-mpc-"$user".conf \
    /etc/systemd/system/user-*.slice.d/.50-mpc-"$user".tmp; do
    [ -e "$f" ] || continue
    rm -f -- "$f"
    rmdir -- "${f%/*}" 2>/dev/null
    reload=1
  done
done
# The drop-ins are gone whatever happens here; a failed reload only leaves systemd's memory of
# them until the next one, not worth failing (and retrying) the cleanup for.
if [ -n "$reload" ] && systemd_running; then
  systemctl daemon-reload >/dev/null 2>&1 || true
fi
"#
);

/// Lists the build users with what their age is measured by. No arguments. Output, one item a
/// line: `now <host epoch seconds>`, `user <name>` per build user, `home <name> <mtime>` per
/// existing home directory, `shadow <name>:<day of last password change>` per shadow entry
/// ([`parse_user_listing`] reads it). Runs as root for the shadow entries.
pub const LIST_USERS: &str = r#"set -u
now=$(date +%s) || exit 75
printf 'now %s\n' "$now"
users=$(getent passwd | cut -d: -f1 | grep -xE 'u-[0-9a-f]{28}')
[ -n "$users" ] || exit 0
printf 'user %s\n' $users
# One stat for every home directory; a missing one only prints an error.
cd /home 2>/dev/null && stat -c 'home %n %Y' -- $users 2>/dev/null
getent shadow $users 2>/dev/null | cut -d: -f1,3 | sed 's/^/shadow /'
exit 0
"#;

/// `$0` of the listing script.
pub const LIST_USERS_NAME: &str = "mpc-list-users";

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

/// The drop-in for the user's slice (`user-<uid>.slice`) capping memory and CPU as `settings`
/// say; empty when they set no cap. Values are validated by the config parser.
pub fn slice_drop_in(user: &str, settings: &BuildUserSettings) -> String {
    if !settings.has_slice() {
        return String::new();
    }
    let mut text = format!(
        "# Build user {user}: written by the build-host broker, removed with the user.\n[Slice]"
    );
    if let Some(m) = &settings.memory_max {
        text.push_str("\nMemoryMax=");
        text.push_str(m.as_str());
    }
    if let Some(c) = settings.cpu_quota {
        text.push_str(&format!("\nCPUQuota={}%", c.percent()));
    }
    text
}

/// The full command line that provisions `user`.
pub fn provision_command(
    prefix: &[&str],
    user: &str,
    authorized_key: &str,
    sudoers: &str,
    limits: &str,
    slice: &str,
) -> Result<String, NulInArgument> {
    sh_command(
        prefix,
        PROVISION,
        SCRIPT_NAME,
        &[user, authorized_key, sudoers, limits, slice],
    )
}

/// The full command line that removes `users`.
pub fn deprovision_command(prefix: &[&str], users: &[&str]) -> Result<String, NulInArgument> {
    sh_command(prefix, DEPROVISION, DEPROVISION_NAME, users)
}

/// The full command line that lists build users.
pub fn list_users_command(prefix: &[&str]) -> Result<String, NulInArgument> {
    sh_command(prefix, LIST_USERS, LIST_USERS_NAME, &[])
}

/// Reads [`LIST_USERS`] output: the build users, sorted, each with its age on the host's clock
/// (so the controller's clock does not matter): since its home directory last changed (what the
/// Go controller's host cleanup measures), or, for a user without a home, since the end of the day
/// its shadow entry last changed (`useradd` sets it); else unknown. Neither exceeds the user's
/// real age, so a grace period on them never removes a younger user. Other lines are ignored (a
/// chatty login shell); a listing without its `now` line is an error.
pub fn parse_user_listing(out: &str) -> Result<Vec<HostUser>, String> {
    const DAY: u64 = 24 * 60 * 60;
    let mut now = None;
    // name -> (home mtime, shadow day)
    let mut users: BTreeMap<&str, (Option<u64>, Option<u64>)> = BTreeMap::new();
    for line in out.lines() {
        let Some((kind, rest)) = line.split_once(' ') else {
            continue;
        };
        match kind {
            "now" => {
                now = Some(
                    rest.trim()
                        .parse::<u64>()
                        .map_err(|_| format!("bad clock line {line:?}"))?,
                );
            }
            "user" if is_remote_user_name(rest) => {
                users.entry(rest).or_default();
            }
            "home" => {
                if let Some((name, t)) = rest.split_once(' ')
                    && let (Some(u), Ok(t)) = (users.get_mut(name), t.trim().parse())
                {
                    u.0 = Some(t);
                }
            }
            "shadow" => {
                if let Some((name, day)) = rest.split_once(':')
                    && let (Some(u), Ok(day)) = (users.get_mut(name), day.trim().parse::<u64>())
                {
                    u.1 = Some(day);
                }
            }
            _ => {}
        }
    }
    let now = now.ok_or_else(|| "the listing has no `now` line".to_owned())?;
    Ok(users
        .into_iter()
        .map(|(name, (home, day))| {
            let since = home.or_else(|| day.map(|d| d.saturating_add(1).saturating_mul(DAY)));
            HostUser {
                name: name.to_owned(),
                age: since.map(|t| Duration::from_secs(now.saturating_sub(t))),
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::quote::tests::tokenize;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn scripts_parse_in_the_system_shell() {
        for script in [PROVISION, DEPROVISION, LIST_USERS] {
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

    /// The e2e tests that race the cleanup need root; this keeps the rule visible without it: a
    /// path `find` prints is never handed to a command that resolves it again (`-exec`), only
    /// removed by `-delete` or acted on from inside its directory (`-execdir`).
    #[test]
    fn cleanup_never_hands_found_paths_to_another_command() {
        assert!(!DEPROVISION.contains("-exec "));
        assert!(!DEPROVISION.contains("find -L") && !DEPROVISION.contains("-follow"));
        assert!(DEPROVISION.contains("-o -delete"));
    }

    #[test]
    fn slice_drop_in_text() {
        use crate::config::{BuildUserSettings, CpuQuota, MemoryMax};
        assert_eq!(slice_drop_in("u-1", &BuildUserSettings::DEFAULT), "");
        let both = BuildUserSettings {
            memory_max: Some(MemoryMax::parse("8G").unwrap()),
            cpu_quota: Some(CpuQuota::parse("250%").unwrap()),
            ..BuildUserSettings::DEFAULT
        };
        assert_eq!(
            slice_drop_in("u-1", &both),
            "# Build user u-1: written by the build-host broker, removed with the user.\n\
             [Slice]\nMemoryMax=8G\nCPUQuota=250%"
        );
        let cpu_only = BuildUserSettings {
            memory_max: None,
            ..both
        };
        assert!(slice_drop_in("u-1", &cpu_only).ends_with("[Slice]\nCPUQuota=250%"));
    }

    #[test]
    fn user_listing_gives_ages_on_the_host_clock() {
        let a = "u-0123456789abcdef0123456789ab";
        let b = "u-1111111111111111111111111111";
        let c = "u-2222222222222222222222222222";
        let d = "u-3333333333333333333333333333";
        let out = format!(
            "Welcome to the build host\n\
             now 1700000000\n\
             user {b}\nuser {a}\nuser {c}\nuser {d}\n\
             user u-NOTHEX\nuser root\n\
             home {a} 1699990000\n\
             home {b} 1700000100\n\
             home u-9999999999999999999999999999 1\n\
             shadow {a}:19000\n\
             shadow {c}:19674\n\
             shadow {d}:\n"
        );
        let users = parse_user_listing(&out).unwrap();
        let got: Vec<(&str, Option<u64>)> = users
            .iter()
            .map(|u| (u.name.as_str(), u.age.map(|a| a.as_secs())))
            .collect();
        assert_eq!(
            got,
            [
                // The home directory's mtime wins over the shadow day.
                (a, Some(10_000)),
                // A home touched after `now` (clock steps): age zero, never negative.
                (b, Some(0)),
                // No home: from the end of the shadow entry's day (19674 = 2023-11-13).
                (c, Some(1_700_000_000 - 19_675 * 86_400)),
                // Neither: unknown.
                (d, None),
            ]
        );
        assert_eq!(parse_user_listing("now 5\n").unwrap(), []);
        assert!(parse_user_listing(&format!("user {a}\n")).is_err());
        assert!(parse_user_listing("now soon\n").is_err());
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
            prop_assert!(is_remote_user_name(&user));
            let commands = crate::config::values::sudo_commands(&sudo).unwrap_or_default();
            let sudoers = sudoers_file(&user, &commands);
            let limits = limits_file(&user, &default_limits());
            let slice = slice_drop_in(&user, &crate::config::BuildUserSettings {
                memory_max: crate::config::MemoryMax::parse("8G").ok(),
                ..crate::config::BuildUserSettings::DEFAULT
            });
            let key = format!("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB2a {comment}");
            let line =
                provision_command(&["sudo", "-n"], &user, &key, &sudoers, &limits, &slice).unwrap();
            let words = tokenize(&line).map_err(TestCaseError::fail)?;
            prop_assert_eq!(
                words,
                vec!["sudo".to_owned(), "-n".into(), "sh".into(), "-c".into(), PROVISION.into(),
                     SCRIPT_NAME.into(), user.clone(), key, sudoers, limits, slice]
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
