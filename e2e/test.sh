#!/usr/bin/env bash
# The whole test suite: installs what the tests need, then format, lint and every test.
# Uses a cargo target dir outside the clone unless CARGO_TARGET_DIR is set, so repeated runs on one
# machine reuse compiled dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/mpc-target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

bash e2e/setup.sh
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Licences, banned crates and sources (deny.toml), then advisories against the snapshot in
# supply-chain/ (offline).
cargo deny --locked check licenses bans sources
bash scripts/advisories.sh
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
