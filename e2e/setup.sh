#!/usr/bin/env bash
# Installs what the test suite needs, idempotently; a no-op in a second when everything is present.
#   - openssh-server (sshd for provisioning tests), openssh-client, curl, rsync
#   - podman and sudo (provisioning requires podman on build hosts; sudo-commands need visudo)
#   - prometheus (for promtool, which lints our /metrics exposition)
#   - kubectl (from Debian's kubernetes-client if the machine has none)
#   - a Python venv with moto[server] (the EC2 emulator)
# Prints the moto venv path at the end. Honours MPC_E2E_HOME (default ~/.cache/mpc-e2e).
set -euo pipefail

home="${MPC_E2E_HOME:-$HOME/.cache/mpc-e2e}"
moto_version="${MOTO_VERSION:-5.1.*}"
mkdir -p "$home"

sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
command -v visudo >/dev/null 2>&1 || missing+=(sudo)
command -v podman >/dev/null 2>&1 || missing+=(podman)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  sudo_ apt-get update -qq
  # --no-install-recommends keeps the prometheus package from pulling exporters and a web UI.
  sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The Debian package enables services we do not want running; tests start their own.
  for svc in ssh prometheus; do
    if command -v systemctl >/dev/null 2>&1; then sudo_ systemctl disable --now "$svc" >/dev/null 2>&1 || true; fi
    sudo_ service "$svc" stop >/dev/null 2>&1 || true
  done
fi
# sshd refuses to start without its privilege-separation directory.
[ -d /run/sshd ] || sudo_ mkdir -p /run/sshd

venv="$home/venv"
if ! "$venv/bin/python" -c 'import moto, flask' >/dev/null 2>&1; then
  echo "setup: creating $venv with moto[server]"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "moto[server]==$moto_version"
fi
command -v kubectl >/dev/null && command -v promtool >/dev/null && command -v podman >/dev/null &&
  [ -x "$venv/bin/moto_server" ]
echo "setup: ok (moto venv: $venv)"
