# syntax=docker/dockerfile:1
# Multi-stage build of the `mpc` binary: Rust builder → Debian slim runtime with openssh-client.
#   docker build -t multi-platform-controller .
# Or around an `mpc` built elsewhere (CI builds it once for the tests; nothing is compiled here):
#   docker build --target prebuilt -f Dockerfile -t multi-platform-controller DIR
# where DIR holds only the `mpc` binary (a context of its own, so the repository's context never
# carries target/). BuildKit and buildah build only the stages the target needs: the default
# (last) stage never reads ./mpc, and `prebuilt` never compiles.
# On a machine without Docker or registry access, e2e/image.sh does both with podman.
# Runs as the non-root user 65532 and writes nothing outside mounted volumes (HOME and TMPDIR are
# emptyDirs in manifests/deployment.yaml), so it works with readOnlyRootFilesystem.
#
# Decided against, for now:
# - A UBI variant (registry.access.redhat.com/ubi9/ubi-minimal): that base is neither reachable nor
#   reproducible (as the Debian one is, from a Debian mirror) on the machines this is built and
#   tested on, and the `mpc` built on trixie needs GLIBC_2.39 symbols (checked with objdump -T),
#   newer than UBI 9's glibc 2.34, so the variant wants a UBI builder stage too. Not provided
#   rather than shipped untested.
# - FIPS: TLS is rustls on aws-lc-rs in its default (non-FIPS) build, and ssh is Debian's OpenSSH
#   on OpenSSL; neither is a validated module here, so no FIPS claim is made. The path would be
#   aws-lc-rs's `fips` feature (aws-lc-fips-sys: Go and cmake in the builder) with rustls' FIPS
#   provider selected at start, and a FIPS OpenSSL for ssh: not built or tested yet.

# Keep in step with rust-toolchain.toml (not copied: the image already is that toolchain).
ARG RUST_VERSION=1.95.0
ARG DEBIAN_RELEASE=trixie

FROM docker.io/library/rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS builder
WORKDIR /src
# aws-lc-rs compiles C with the system toolchain; no OpenSSL anywhere.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake make gcc g++ \
 && rm -rf /var/lib/apt/lists/*
COPY Cargo.toml Cargo.lock ./
COPY src ./src
# The functional core (the `mpc-core` crate the binary is built on).
COPY core ./core
# Every workspace target must exist for cargo to read the manifest.
COPY benches ./benches
COPY e2e ./e2e
# Cache mounts keep the registry and compiled dependencies between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p multi-platform-controller --bin mpc \
 && install -m 0755 target/release/mpc /usr/local/bin/mpc

# Everything of the runtime image but `mpc`, which the last two stages add.
FROM docker.io/library/debian:${DEBIAN_RELEASE}-slim AS runtime-base
# openssh-client: provisioning runs ssh with multiplexed connections; ca-certificates: cloud APIs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-client ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 mpc \
 && useradd --system --uid 65532 --gid 65532 --home-dir /home/mpc --no-create-home --shell /usr/sbin/nologin mpc
ENV HOME=/home/mpc \
    TMPDIR=/tmp \
    MPC_LOG_FORMAT=json
USER 65532:65532
EXPOSE 9443 8080
ENTRYPOINT ["/usr/local/bin/mpc"]
CMD ["controller", "--config=/etc/mpc/host-config"]
# After the RUN step, so a new revision reuses its layer.
ARG DEBIAN_RELEASE
ARG VERSION=0.0.0-dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="multi-platform-controller" \
      org.opencontainers.image.description="Konflux multi-platform-controller: assigns Tekton TaskRuns build hosts (static pools, EC2, local) over SSH" \
      org.opencontainers.image.source="https://github.com/konflux-ci/multi-platform-controller-rs" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="docker.io/library/debian:${DEBIAN_RELEASE}-slim"

# `mpc` from the build context (see the top).
FROM runtime-base AS prebuilt
COPY mpc /usr/local/bin/mpc

# The default: `mpc` from the builder stage.
FROM runtime-base AS runtime
COPY --from=builder /usr/local/bin/mpc /usr/local/bin/mpc
