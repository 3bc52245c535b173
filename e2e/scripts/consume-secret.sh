#!/usr/bin/env bash
# Consumes a multi-platform-controller secret the way Konflux build steps do (design §3):
#   - /ssh/error present: print it and fail;
#   - /ssh/host is "localhost": run the command here, in the pod;
#   - /ssh/otp present: redeem it at /ssh/otp-server (trusting /ssh/otp-ca) for the private key;
#     otherwise copy /ssh/id_rsa;
#   - optionally rsync a directory into "$(cat /ssh/user-dir)/build";
#   - run the command on "$(cat /ssh/host)" over ssh.
# Unlike the Konflux steps (StrictHostKeyChecking=no) the host key is checked against a
# known_hosts file.
#
# Usage: consume-secret.sh COMMAND...
# Environment:
#   SSH_DIR          where the secret is mounted (default /ssh)
#   SSH_KNOWN_HOSTS  known_hosts file for the build host (required for remote hosts)
#   SSH_PORT         build host's SSH port (default 22)
#   SYNC_DIR         directory to copy into the user's ~/build before running (optional)
#   HOME             the key is written to $HOME/.ssh/id_rsa
set -euo pipefail

dir="${SSH_DIR:-/ssh}"
port="${SSH_PORT:-22}"

if [ -e "$dir/error" ]; then
  echo "multi-platform allocation failed: $(cat "$dir/error")" >&2
  exit 1
fi
host="$(cat "$dir/host")"
if [ "$host" = "localhost" ]; then
  exec "$@"
fi
: "${SSH_KNOWN_HOSTS:?set SSH_KNOWN_HOSTS to a known_hosts file for the build host}"

mkdir -p "$HOME/.ssh"
chmod 0700 "$HOME/.ssh"
key="$HOME/.ssh/id_rsa"
rm -f "$key"
if [ -e "$dir/otp" ]; then
  curl --fail --cacert "$dir/otp-ca" -XPOST -d @"$dir/otp" "$(cat "$dir/otp-server")" > "$key"
  echo "" >> "$key"
else
  cp "$dir/id_rsa" "$key"
fi
chmod 0400 "$key"

ssh_opts=(-i "$key" -p "$port" -o IdentitiesOnly=yes -o BatchMode=yes
  -o StrictHostKeyChecking=yes -o "UserKnownHostsFile=$SSH_KNOWN_HOSTS"
  -o GlobalKnownHostsFile=/dev/null -F /dev/null)

if [ -n "${SYNC_DIR:-}" ]; then
  rsync -ra -e "ssh ${ssh_opts[*]}" "$SYNC_DIR/" "$host:$(cat "$dir/user-dir")/build/"
fi
exec ssh "${ssh_opts[@]}" "$host" "$@"
