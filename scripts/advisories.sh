#!/usr/bin/env bash
# Checks the dependency graph against the RustSec advisory database without the network.
#
# supply-chain/advisory-db.tar.gz is a snapshot of github.com/rustsec/advisory-db in the layout
# cargo-deny expects under its db-path (supply-chain/README.md says how to refresh it). It is
# unpacked under the cargo target dir and handed to cargo-deny through MPC_ADVISORY_DB (deny.toml's
# `db-path`). Before the real check, a canary crate pinned to an affected smallvec must FAIL:
# otherwise an empty or unreadable database would pass every graph.
#
# Exit status: non-zero when an advisory affects a dependency, or when the canary passes.
# Environment: ADVISORY_MAX_AGE_DAYS (default 180): older snapshots are warned about, not failed,
# since nothing in CI can refresh them.
set -euo pipefail
cd "$(dirname "$0")/.."

snapshot=supply-chain/advisory-db.tar.gz
db="${CARGO_TARGET_DIR:-target}/advisory-db"
max_age="${ADVISORY_MAX_AGE_DAYS:-180}"

rm -rf "$db"
mkdir -p "$db"
tar -xzf "$snapshot" -C "$db"
clone=$(find "$db" -mindepth 1 -maxdepth 1 -type d -name 'advisory-db-*' | head -n1)
if [[ -z "$clone" ]]; then
  echo "advisories: $snapshot holds no advisory-db-* directory" >&2
  exit 1
fi
export MPC_ADVISORY_DB="$db"

commit=$(git -C "$clone" log -1 --format=%H)
taken=$(git -C "$clone" log -1 --format=%ct)
age=$(( ($(date +%s) - taken) / 86400 ))
echo "advisories: RustSec snapshot ${commit:0:12} of $(date -u -d "@$taken" +%F), $age days old"
if (( age > max_age )); then
  echo "advisories: WARNING: the snapshot is older than $max_age days; refresh it (supply-chain/README.md)" >&2
fi

canary=tests/fixtures/advisory-canary
cargo fetch --locked --manifest-path "$canary/Cargo.toml" --quiet
if out=$(cargo deny --locked --offline --manifest-path "$canary/Cargo.toml" --config deny.toml \
    check advisories 2>&1); then
  echo "advisories: the canary passed; the database is not being read" >&2
  exit 1
fi
if ! grep -q RUSTSEC-2021-0003 <<<"$out"; then
  echo "advisories: the canary failed without RUSTSEC-2021-0003:" >&2
  echo "$out" >&2
  exit 1
fi
echo "advisories: canary caught (RUSTSEC-2021-0003)"

cargo deny --locked --offline check advisories
