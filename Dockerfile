# syntax=docker/dockerfile:1
# Multi-stage build of the `mpc` binary: Rust builder → Debian slim runtime with openssh-client.
# Build: docker build -t multi-platform-controller .
# Runs as a non-root user and writes nothing outside mounted volumes (HOME and TMPDIR are emptyDirs
# in manifests/deployment.yaml), so it works with readOnlyRootFilesystem.

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

FROM docker.io/library/debian:${DEBIAN_RELEASE}-slim
# openssh-client: provisioning runs ssh with multiplexed connections; ca-certificates: cloud APIs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-client ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 mpc \
 && useradd --system --uid 65532 --gid 65532 --home-dir /home/mpc --no-create-home --shell /usr/sbin/nologin mpc
COPY --from=builder /usr/local/bin/mpc /usr/local/bin/mpc
ENV HOME=/home/mpc \
    TMPDIR=/tmp \
    MPC_LOG_FORMAT=json
USER 65532:65532
EXPOSE 9443 8080
ENTRYPOINT ["/usr/local/bin/mpc"]
CMD ["controller", "--config=/etc/mpc/host-config"]
