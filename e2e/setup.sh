#!/usr/bin/env bash
# Installs what the test suite needs, idempotently; a no-op in a second when everything is present.
# Debian or Ubuntu (apt-get), as root or with sudo:
#   - openssh-server (sshd for provisioning tests), openssh-client, curl, rsync, sudo
#   - prometheus (for promtool: lints our /metrics exposition, unit-tests the alerts)
#   - kubectl >= 1.27 (renders the kustomizations, drives the test API server); installed from the
#     distribution if it has none, which must then be recent enough
#   - podman (provisioning requires podman on build hosts), with runc (the runtime podman is run
#     with here: crun refuses some machines' cgroup layouts) and debootstrap (e2e/image.sh makes
#     the image's base images locally), for the deployed-pods test
#   - iproute2 (`ip netns`: each deployed pod gets its own network namespace)
#   - at and cron (a build user's at jobs and crontab must not survive its cleanup)
#   - cargo-deny (licence, ban and source checks of the dependency graph), built with
#     `cargo install --locked` when missing
#   - a Python venv with moto[server] (the EC2 emulator) and IBM's ibm-vpc, ibm-platform-services
#     and ibm-cloud-sdk-core SDKs
#     (they check the IBM emulator)
# Fails, naming what is missing, when a tool is still missing or too old afterwards.
# Prints the moto venv path at the end. Honours MPC_E2E_HOME (default ~/.cache/mpc-e2e).
set -euo pipefail

home="${MPC_E2E_HOME:-$HOME/.cache/mpc-e2e}"
moto_version="${MOTO_VERSION:-5.1.*}"
# The kustomizations are tested with kustomize v5 (kubectl embeds it from 1.27; v5 changed how
# replacements treat missing targets), and tests may read Events with `kubectl events` (1.26).
kubectl_min_minor=27
mkdir -p "$home"

sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
has_sshd() { command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; }

missing=()
has_sshd || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v visudo >/dev/null 2>&1 || missing+=(sudo)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
if ! command -v kubectl >/dev/null 2>&1; then
  # `kubectl` where the Kubernetes apt repository is configured, else the distribution's package.
  if apt-cache show kubectl >/dev/null 2>&1; then missing+=(kubectl); else missing+=(kubernetes-client); fi
fi
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v at >/dev/null 2>&1 || missing+=(at)
command -v crontab >/dev/null 2>&1 || missing+=(cron)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  sudo_ apt-get update -qq
  # --no-install-recommends keeps the prometheus package from pulling exporters and a web UI.
  sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The Debian package enables services we do not want running; tests start their own.
  for svc in ssh prometheus atd cron; do
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
# IBM's own SDKs keep the IBM emulator's wire shapes honest (e2e/tests/ibm.rs).
if ! "$venv/bin/python" -c 'import ibm_vpc, ibm_platform_services, ibm_cloud_sdk_core' >/dev/null 2>&1; then
  echo "setup: adding ibm-vpc, ibm-platform-services and ibm-cloud-sdk-core to $venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "ibm-vpc==0.36.*" "ibm-platform-services==0.77.*" "ibm-cloud-sdk-core==3.*"
fi

if ! cargo deny --version >/dev/null 2>&1; then
  echo "setup: building cargo-deny (a few minutes, once)"
  cargo install --locked --quiet cargo-deny
fi

# Everything must be there now; say exactly what is not.
problems=()
has_sshd || problems+=("sshd (package openssh-server)")
for tool in ssh curl rsync promtool visudo kubectl podman runc debootstrap ip at crontab; do
  command -v "$tool" >/dev/null 2>&1 || problems+=("$tool")
done
[ -x "$venv/bin/moto_server" ] || problems+=("moto_server in $venv")
"$venv/bin/python" -c 'import ibm_vpc, ibm_platform_services, ibm_cloud_sdk_core' >/dev/null 2>&1 || problems+=("ibm-vpc, ibm-platform-services and ibm-cloud-sdk-core in $venv")
cargo deny --version >/dev/null 2>&1 || problems+=("cargo-deny (cargo install --locked cargo-deny)")
if command -v kubectl >/dev/null 2>&1; then
  minor=$(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p' | head -n 1)
  if [ -z "$minor" ] || [ "$minor" -lt "$kubectl_min_minor" ]; then
    problems+=("kubectl >= 1.$kubectl_min_minor (found: $(kubectl version --client 2>&1 | head -n 1)); install a current release, e.g. from the Kubernetes apt repository at pkgs.k8s.io")
  fi
fi
if [ "${#problems[@]}" -gt 0 ]; then
  echo "setup: FAILED, still missing or unusable:" >&2
  printf '  - %s\n' "${problems[@]}" >&2
  exit 1
fi
echo "setup: ok (moto venv: $venv)"
