#!/usr/bin/env bash
# Builds the container image of ./Dockerfile with podman, on a machine that reaches no container
# registry (only the Debian mirror its apt is configured with, and crates.io).
#
#   bash e2e/image.sh bases               make and tag the base images the Dockerfile names
#                                         (skipped for a tag that already exists)
#   bash e2e/image.sh full [TAG]          bases, then the whole Dockerfile as written (the builder
#                                         stage compiles `mpc`); prints build time, size and contents
#   bash e2e/image.sh runtime BINARY TAG  the runtime base, then the Dockerfile's runtime stage around
#                                         a host-built `mpc` (--target prebuilt: no compile; for CI)
#   bash e2e/image.sh check TAG           runs `mpc --version` in TAG read-only as 65532:65532
#
# Works from any directory of a checkout, as root (podman's root storage) or through sudo. Installs
# podman, runc and debootstrap with apt-get when they are missing.
#
# Base images, made here because no registry is reachable; tagged with the Dockerfile's exact names:
#   - docker.io/library/debian:<release>-slim: `debootstrap --variant=minbase` from the Debian mirror
#     of this machine's apt sources (read at run time), then what debuerreotype does to the official
#     slim image: the apt/dpkg "docker" configuration (no caches, gzipped indexes, no translations,
#     no service starts), dpkg path excludes for docs, man pages, info and locales (files already
#     installed are removed, copyright files kept), no logs, apt lists or .debs; one layer.
#   - docker.io/library/rust:<version>-slim-<release>: that base plus what the official rust:slim
#     image has (ca-certificates, gcc, libc6-dev, a Rust toolchain in /usr/local/rustup with its
#     binaries on PATH through /usr/local/cargo/bin); the toolchain of rust-toolchain.toml is copied
#     from this machine's rustup (without its HTML docs) instead of downloaded.
#
# This machine's container settings live here, never in the Dockerfile or the manifests: RUN steps
# use chroot isolation and the host network; the host CA bundle is mounted beside the image's own
# (cargo is pointed at it, so a TLS-inspecting proxy's CA is trusted; the image's bundle stays the
# one its ca-certificates package makes); containers run with runc and ulimits the host allows.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dockerfile="$repo/Dockerfile"

log() { printf 'image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
podman_() { sudo_ podman "$@"; }

# The ARG defaults the FROM lines are built from: the Dockerfile is the one place they are set.
dockerfile_arg() {
  local value
  value="$(sed -n "s/^ARG $1=\(.*\)$/\1/p" "$dockerfile" | head -n1)"
  [ -n "$value" ] || die "Dockerfile has no 'ARG $1=<default>'"
  printf '%s' "$value"
}
rust_version="$(dockerfile_arg RUST_VERSION)"
debian_release="$(dockerfile_arg DEBIAN_RELEASE)"
debian_tag="docker.io/library/debian:${debian_release}-slim"
rust_tag="docker.io/library/rust:${rust_version}-slim-${debian_release}"
grep -qF 'FROM docker.io/library/debian:${DEBIAN_RELEASE}-slim' "$dockerfile" \
  || die "Dockerfile's runtime base is not $debian_tag: update this script with it"
grep -qF 'FROM docker.io/library/rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE}' "$dockerfile" \
  || die "Dockerfile's builder base is not $rust_tag: update this script with it"
toolchain_channel="$(sed -n 's/^channel *= *"\(.*\)"/\1/p' "$repo/rust-toolchain.toml")"
[ "$toolchain_channel" = "$rust_version" ] \
  || die "Dockerfile RUST_VERSION=$rust_version but rust-toolchain.toml says $toolchain_channel"

# Flags for this machine (see the header).
build_flags=(--isolation chroot --network=host --pull=never)
run_flags=(--runtime runc run --rm --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
host_ca=/etc/ssl/certs/ca-certificates.crt

ensure_tools() {
  local missing=() tool
  for tool in "$@"; do
    case "$tool" in
      runc) [ -x /usr/sbin/runc ] || command -v runc >/dev/null 2>&1 || missing+=(runc) ;;
      debootstrap) command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap) ;;
      *) command -v "$tool" >/dev/null 2>&1 || missing+=("$tool") ;;
    esac
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    sudo_ env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# Prints "<archive URI> <security URI or empty>" of the host's Debian entries in apt's sources
# (deb822 .sources files and one-line .list files): the entry whose suites hold the host's
# codename is the archive, the one with <codename>-security the security archive.
debian_mirrors() {
  local codename
  codename="$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")"
  [ -n "$codename" ] || die "no VERSION_CODENAME in /etc/os-release: not a Debian host?"
  local files=()
  [ -f /etc/apt/sources.list ] && files+=(/etc/apt/sources.list)
  local f
  for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && files+=("$f")
  done
  [ "${#files[@]}" -gt 0 ] || die "no apt sources on this machine"
  awk -v main="$codename" -v sec="$codename-security" '
    function entry(types, uris, suites,   n, s, i, uri) {
      if (types !~ /(^|[ \t])deb([ \t]|$)/) return
      split(uris, u, /[ \t]+/); uri = u[1]; sub(/\/+$/, "", uri)
      n = split(suites, s, /[ \t]+/)
      for (i = 1; i <= n; i++) {
        if (s[i] == main && archive == "") archive = uri
        if (s[i] == sec && security == "") security = uri
      }
    }
    function flush() { if (t != "") entry(t, ur, su); t = ur = su = "" }
    FILENAME ~ /\.sources$/ {
      if ($0 ~ /^[ \t]*$/) { flush(); next }
      if ($0 ~ /^#/) next
      if (tolower($1) == "types:") { t = $0; sub(/^[^:]*:[ \t]*/, "", t) }
      if (tolower($1) == "uris:") { ur = $0; sub(/^[^:]*:[ \t]*/, "", ur) }
      if (tolower($1) == "suites:") { su = $0; sub(/^[^:]*:[ \t]*/, "", su) }
      next
    }
    FNR == 1 { flush() }
    $1 == "deb" {
      i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
      entry("deb", $i, $(i + 1))
    }
    END { flush(); print archive, security }
  ' "${files[@]}"
}

make_debian_base() {
  if podman_ image exists "$debian_tag"; then
    log "$debian_tag exists"
    return
  fi
  ensure_tools debootstrap
  local mirrors mirror security
  mirrors="$(debian_mirrors)"
  read -r mirror security <<<"$mirrors" || true
  [ -n "$mirror" ] || die "no Debian archive for this host's release in apt's sources"
  local start work rootfs
  start=$(date +%s)
  work="$(mktemp -d "${TMPDIR:-/var/tmp}/mpc-image-base.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$work'" EXIT
  rootfs="$work/rootfs"
  log "debootstrap --variant=minbase $debian_release from the host's Debian mirror"
  sudo_ debootstrap --variant=minbase "$debian_release" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }

  local keyring=/usr/share/keyrings/debian-archive-keyring.pgp
  [ -e "$rootfs$keyring" ] || keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: %s\n' \
      "$mirror" "$debian_release" "$debian_release" "$keyring"
    if [ -n "$security" ]; then
      printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: %s\n' \
        "$security" "$debian_release" "$keyring"
    fi
  } | sudo_ tee "$rootfs/etc/apt/sources.list.d/debian.sources" >/dev/null
  sudo_ rm -f "$rootfs/etc/apt/sources.list"

  # The rest runs inside the rootfs, in a private mount namespace so /proc and /dev vanish with it.
  sudo_ tee "$rootfs/mpc-slim.sh" >/dev/null <<'SLIM'
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# debuerreotype-minimizing-config: what the official Debian images configure.
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
chmod 0755 /usr/sbin/policy-rc.d
echo force-unsafe-io >/etc/dpkg/dpkg.cfg.d/docker-apt-speedup
echo 'Apt::AutoRemove::SuggestsImportant "false";' >/etc/apt/apt.conf.d/docker-autoremove-suggests
clean='"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true";'
cat >/etc/apt/apt.conf.d/docker-clean <<EOF
DPkg::Post-Invoke { $clean };
APT::Update::Post-Invoke { $clean };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
echo 'Acquire::GzipIndexes "true";' >/etc/apt/apt.conf.d/docker-gzip-indexes
echo 'Acquire::Languages "none";' >/etc/apt/apt.conf.d/docker-no-languages
chmod 0644 /etc/dpkg/dpkg.cfg.d/docker-apt-speedup /etc/apt/apt.conf.d/docker-*

# Updates and security fixes, as the official image has them.
apt-get update -qq
apt-get full-upgrade -y -qq >/dev/null

# debuerreotype-slimify: dpkg excludes these paths from every later install, and what is already
# installed under them goes now (copyright files and locale metadata stay).
set -f
excludes=(/usr/share/doc/* /usr/share/info/* /usr/share/linda/* /usr/share/lintian/overrides/*
  /usr/share/locale/* /usr/share/man/* /usr/share/doc/kde/HTML/*/* /usr/share/gnome/help/*/*
  /usr/share/omf/*/*-*.emf)
includes=(/usr/share/doc/*/copyright /usr/share/doc/kde/HTML/C/* /usr/share/gnome/help/*/C/*
  /usr/share/locale/all_languages /usr/share/locale/currency/* /usr/share/locale/l10n/*
  /usr/share/locale/languages /usr/share/locale/locale.alias /usr/share/omf/*/*-C.emf)
{
  echo '# The "slim" variant: files normally unnecessary in containers are excluded.'
  for path in "${excludes[@]}"; do echo "path-exclude $path"; done
  for path in "${includes[@]}"; do echo "path-include $path"; done
} >/etc/dpkg/dpkg.cfg.d/docker
chmod 0644 /etc/dpkg/dpkg.cfg.d/docker
keep=('(')
for path in "${includes[@]}"; do
  [ "${#keep[@]}" -eq 1 ] || keep+=(-o)
  keep+=(-path "$path")
done
keep+=(')')
set +f
# Some maintainer scripts expect the man section directories.
man_dirs=(/usr/share/man/man[0-9]/)
for path in "${excludes[@]}"; do
  dir="${path%/*}"
  [ -d "$dir" ] || continue
  find "$dir" -depth -mindepth 1 -not \( -type d -o -type l \) -not "${keep[@]}" -exec rm -f '{}' +
  while [ "$(find "$dir" -depth -mindepth 1 \( -empty -o -xtype l \) -exec rm -rf '{}' ';' -printf . | wc -c)" -gt 0 ]; do :; done
done
[ ! -d "${man_dirs[0]}" ] || mkdir -p "${man_dirs[@]}"

# debuerreotype-fixup and its tar excludes: no logs, caches, indexes or host-specific files.
rm -f /var/log/dpkg.log /var/log/bootstrap.log /var/log/alternatives.log /var/log/apt/history.log \
  /var/log/apt/term.log /var/cache/ldconfig/aux-cache /var/cache/apt/*.bin /var/cache/apt/archives/*.deb \
  /etc/apt/apt.conf.d/01autoremove-kernels /etc/machine-id /etc/hostname /etc/resolv.conf \
  /var/lib/systemd/catalog/database
find /var/lib/apt/lists -maxdepth 1 -type f -delete
SLIM
  log "slimming it as the official slim image is"
  # shellcheck disable=SC2016
  sudo_ unshare --mount --propagation private bash -c '
    set -euo pipefail
    mount -t proc proc "$1/proc"
    mount --rbind /dev "$1/dev"
    cp /etc/resolv.conf "$1/etc/resolv.conf"
    chroot "$1" bash /mpc-slim.sh
  ' bash "$rootfs"
  sudo_ rm -f "$rootfs/mpc-slim.sh"

  sudo_ tar --numeric-owner -C "$rootfs" -cf "$work/rootfs.tar" \
    --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' --exclude='./debootstrap' .
  podman_ import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase $debian_release, slimmed like the official slim image" \
    "$work/rootfs.tar" "$debian_tag" >/dev/null
  sudo_ rm -rf "$work"
  trap - EXIT
  log "$debian_tag made in $(($(date +%s) - start)) s, $(image_size "$debian_tag")"
}

make_rust_base() {
  if podman_ image exists "$rust_tag"; then
    log "$rust_tag exists"
    return
  fi
  local rustup_home="${RUSTUP_HOME:-$HOME/.rustup}" triple=x86_64-unknown-linux-gnu toolchain
  toolchain="$(readlink -f "$rustup_home/toolchains/$rust_version-$triple" || true)"
  [ -x "$toolchain/bin/rustc" ] && [ -x "$toolchain/bin/cargo" ] \
    || die "no Rust $rust_version toolchain in $rustup_home (rustup toolchain install $rust_version)"
  "$toolchain/bin/rustc" --version | grep -qF "rustc $rust_version " \
    || die "$toolchain is not Rust $rust_version"
  local start ctx
  start=$(date +%s)
  ctx="$(mktemp -d "${TMPDIR:-/tmp}/mpc-image-rust.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$ctx'" EXIT
  cat >"$ctx/Containerfile" <<EOF
FROM $debian_tag
ENV RUSTUP_HOME=/usr/local/rustup \\
    CARGO_HOME=/usr/local/cargo \\
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    RUST_VERSION=$rust_version
RUN apt-get update \\
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev \\
 && rm -rf /var/lib/apt/lists/*
RUN dest=/usr/local/rustup/toolchains/$rust_version-$triple \\
 && mkdir -p "\$dest" /usr/local/cargo/bin \\
 && tar -C /toolchain --exclude=./share/doc -cf - . | tar -C "\$dest" -xf - \\
 && for bin in "\$dest"/bin/*; do ln -s "\$bin" /usr/local/cargo/bin/; done \\
 && cargo --version && rustc --version
EOF
  log "making $rust_tag from $debian_tag and this machine's Rust $rust_version"
  podman_ build "${build_flags[@]}" -v "$toolchain:/toolchain:ro" -t "$rust_tag" -f "$ctx/Containerfile" "$ctx" \
    >"$ctx/build.log" 2>&1 || { tail -n 30 "$ctx/build.log" >&2; die "making $rust_tag failed"; }
  rm -rf "$ctx"
  trap - EXIT
  log "$rust_tag made in $(($(date +%s) - start)) s, $(image_size "$rust_tag")"
}

image_size() {
  local bytes
  bytes="$(podman_ image inspect --format '{{.Size}}' "$1")"
  printf '%s bytes (%s MB, %s MiB)' "$bytes" "$((bytes / 1000000))" "$((bytes / 1048576))"
}

# OCI label values of the checkout being built.
label_args() {
  local version revision
  version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n1)"
  revision="$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
  if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then revision="$revision-dirty"; fi
  printf '%s\n' --build-arg "VERSION=${version:-0.0.0}" --build-arg "REVISION=$revision"
}

check_image() {
  local tag="$1" out
  out="$(podman_ "${run_flags[@]}" --network none --read-only --user 65532:65532 "$tag" --version)" \
    || die "$tag does not run mpc --version read-only as 65532"
  log "$tag runs read-only as 65532:65532: $out"
}

cmd_full() {
  local tag="${1:-multi-platform-controller:dev}"
  ensure_tools podman runc
  local start
  start=$(date +%s)
  lock_bases
  make_debian_base
  make_rust_base
  exec 9>&-
  log "bases ready in $(($(date +%s) - start)) s"
  local labels cargo_config build_start
  mapfile -t labels < <(label_args)
  # Cargo's CA setting goes in through a mounted config file rather than --env, which would stay
  # in the image's environment.
  cargo_config="$(mktemp "${TMPDIR:-/tmp}/mpc-image-cargo.XXXXXX")"
  printf '[http]\ncainfo = "/host-ca.crt"\n' >"$cargo_config"
  chmod 0644 "$cargo_config"
  build_start=$(date +%s)
  log "building $tag from the whole Dockerfile (the builder stage compiles mpc)"
  podman_ build "${build_flags[@]}" -v "$host_ca:/host-ca.crt:ro" \
    -v "$cargo_config:/usr/local/cargo/config.toml:ro" \
    "${labels[@]}" -t "$tag" -f "$dockerfile" "$repo" >&2
  rm -f "$cargo_config"
  log "built $tag in $(($(date +%s) - build_start)) s (bases included: $(($(date +%s) - start)) s)"
  report_image "$tag"
}

cmd_runtime() {
  [ "$#" -eq 2 ] || die "usage: e2e/image.sh runtime BINARY TAG"
  local binary="$1" tag="$2"
  [ -f "$binary" ] || die "$binary: no such file"
  ensure_tools podman runc
  lock_bases
  make_debian_base
  exec 9>&-
  # The binary travels in a context of its own: the repository's context never holds target/.
  local ctx labels start
  ctx="$(mktemp -d "${TMPDIR:-/tmp}/mpc-image-ctx.XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$ctx'" EXIT
  install -m 0755 "$binary" "$ctx/mpc"
  mapfile -t labels < <(label_args)
  start=$(date +%s)
  podman_ build "${build_flags[@]}" --target prebuilt \
    "${labels[@]}" -t "$tag" -f "$dockerfile" "$ctx" >&2
  rm -rf "$ctx"
  trap - EXIT
  log "built $tag around $binary in $(($(date +%s) - start)) s, $(image_size "$tag")"
  check_image "$tag"
}

report_image() {
  local tag="$1"
  log "$tag: $(image_size "$tag")"
  podman_ images --filter "reference=$tag" >&2
  check_image "$tag"
  log "what takes the space (KiB, largest first):"
  podman_ "${run_flags[@]}" --user 0:0 --entrypoint /usr/bin/du "$tag" \
    -xk --max-depth=3 / 2>/dev/null | sort -rn | head -n 25 >&2
}

# Concurrent runs (CI and a developer, two test binaries) make each base once.
lock_bases() {
  exec 9>"${TMPDIR:-/tmp}/mpc-image-bases.lock"
  flock 9
}

case "${1:-}" in
  bases)
    ensure_tools podman runc
    lock_bases
    make_debian_base
    make_rust_base
    ;;
  full) shift; cmd_full "$@" ;;
  runtime) shift; cmd_runtime "$@" ;;
  check)
    [ "$#" -eq 2 ] || die "usage: e2e/image.sh check TAG"
    ensure_tools podman runc
    check_image "$2"
    ;;
  *) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
