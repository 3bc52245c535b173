#!/usr/bin/env bash
# Hand mutation of the safety code: does some test fail when a safety rule is broken?
#
# Each mutant below is a one-line change (an exact string replaced once) that breaks one rule the
# controller promises: a TaskRun write guarded by its UID, a host over its concurrency or taking
# work while backing off, `max-instances` (foreign instances included), FIFO queueing, a
# finalizer kept until cleanup finished, other clusters' instances left alone, one user per host.
# For each, the script applies the change, runs the suites that guard that code, records which
# tests failed, and restores the file. A mutant no test catches is a gap in the tests.
#
# Usage:
#   scripts/mutants.sh            # baseline (all suites green), then every mutant
#   scripts/mutants.sh ID...      # only these mutants (see --list)
#   scripts/mutants.sh --list     # the mutants, one a line
#   NO_BASELINE=1 scripts/mutants.sh ...   # skip the unmutated run
#
# The suites run as CI runs them (default case counts of the property tests). A mutant's target
# string must occur exactly once in its file; when the code moved on and it does not, the
# mutant is reported as STALE (update it here). Files are restored from a copy taken before
# each change, also on interrupt; the build directory is cargo's usual one (CARGO_TARGET_DIR).
# Output: a table, mutant -> CAUGHT (the failing tests) or SURVIVED, and the exit status is the
# number of mutants that survived or went stale.
set -uo pipefail

cd "$(dirname "$0")/.."

# A caught mutant need not be shrunk, nor its failing case saved as a regression to replay.
export PROPTEST_DISABLE_FAILURE_PERSISTENCE=1 PROPTEST_MAX_SHRINK_ITERS=0

# Suites by name: the cargo nextest arguments that run them.
suite_args() {
    case "$1" in
    core) echo "-p mpc-core --lib scheduler::" ;;
    model) echo "-p multi-platform-controller --test scheduler_model" ;;
    patch) echo "-p multi-platform-controller --lib controller::patch::" ;;
    *) echo "unknown suite $1" >&2; return 1 ;;
    esac
}

# id | file | suites (comma-separated) | what it breaks
# The target and replacement strings are in mutant_strings (bash $'...' for line breaks).
MUTANTS=(
    "uid-test|src/controller/patch.rs|patch,model|TaskRun patches lose their leading test of /metadata/uid"
    "backoff-index|core/src/scheduler/hosts.rs|core,model|a host whose back-off starts stays in the free-host index"
    "newest-first|core/src/scheduler/queue.rs|core,model|waiters of a namespace are served newest first"
    "foreign-ignored|core/src/scheduler/fleet.rs|core,model|max-instances ignores other clusters' instances"
    "finalizer-early|core/src/scheduler/lifecycle.rs|core,model|the finalizer goes before the build user's removal finished"
    "host-over|core/src/scheduler/hosts.rs|core,model|a full static host stays in the free-host index"
    "max-instances|core/src/scheduler/fleet.rs|core,model|a dynamic platform launches one instance over max-instances"
    "orphan-foreign|core/src/scheduler/sweep.rs|core,model|the orphan sweep terminates instances that are not ours"
    "shared-user|core/src/scheduler/users.rs|core,model|two TaskRuns with one user name share a static host"
    "pool-over|core/src/scheduler/fleet.rs|core,model|a full pool instance stays in the index of instances with room"
)

# Sets OLD and NEW for mutant $1.
mutant_strings() {
    case "$1" in
    uid-test)
        OLD='Self(vec![test_uid(uid)])'
        NEW='Self(Vec::new())' ;;
    backoff-index)
        OLD=$'room.backoff_until = until;\n            self.reindex_host(hid);'
        NEW='room.backoff_until = until;' ;;
    newest-first)
        OLD='lane.push_back(entry);'
        NEW='lane.push_front(entry);' ;;
    foreign-ignored)
        OLD='ps.instances + ps.foreign'
        NEW='ps.instances' ;;
    finalizer-early)
        OLD=$'HostRef::Static(def),\n                                    out,\n                                );\n                                1'
        NEW=$'HostRef::Static(def),\n                                    out,\n                                );\n                                0' ;;
    host-over)
        OLD='r.load >= def.concurrency'
        NEW='r.load > def.concurrency' ;;
    max-instances)
        OLD='if self.occupied(p) >= template.max_instances {'
        NEW='if self.occupied(p) > template.max_instances {' ;;
    orphan-foreign)
        OLD=$'|| !rec.is_ours_for(&label)\n'
        NEW=$'\n' ;;
    shared-user)
        OLD='(Some(State::OnHost { host, .. }), Target::Host(h)) => *host == h,'
        NEW='(Some(State::OnHost { .. }), Target::Host(_)) => false,' ;;
    pool-over)
        OLD='if i.draining || load >= pool.concurrency {'
        NEW='if i.draining || load > pool.concurrency {' ;;
    *) return 1 ;;
    esac
}

# Replaces OLD by NEW in file $1; fails unless OLD occurs exactly once.
apply_mutant() {
    OLD="$OLD" NEW="$NEW" perl -0777 -i -pe '
        my $n = () = /\Q$ENV{OLD}\E/g;
        if ($n != 1) { print STDERR "found $n times\n"; exit 3 }
        s/\Q$ENV{OLD}\E/$ENV{NEW}/;
    ' "$1"
}

# Runs the suites (comma-separated) $1; prints the failing tests, one a line; status 0 when all
# passed, 1 when some test failed, 2 when a suite did not build.
run_suites() {
    local failed=() built=0 log
    log=$(mktemp)
    local suite
    for suite in ${1//,/ }; do
        # shellcheck disable=SC2046
        cargo nextest run --no-fail-fast --color never $(suite_args "$suite") >"$log" 2>&1
        if grep -q 'error: could not compile\|error\[E' "$log"; then
            built=2
            echo "  ($suite did not build; see $log)" >&2
            continue
        fi
        # nextest prints "FAIL [ time] (n/m) <binary> <test>" (or without the counter).
        while IFS= read -r line; do
            failed+=("$suite:${line##* }")
        done < <(grep -E '^\s+(FAIL|TIMEOUT|SIGSEGV|SIGABRT) \[' "$log" | sort -u)
    done
    rm -f "$log"
    printf '%s\n' "${failed[@]}" | sort -u | grep -v '^$'
    [ "$built" = 2 ] && return 2
    [ "${#failed[@]}" -gt 0 ] && return 1
    return 0
}

if [ "${1:-}" = "--list" ]; then
    for m in "${MUTANTS[@]}"; do
        IFS='|' read -r id file suites what <<<"$m"
        printf '%-16s %-34s %-12s %s\n' "$id" "$file" "$suites" "$what"
    done
    exit 0
fi

wanted=("$@")
selected=()
for m in "${MUTANTS[@]}"; do
    id="${m%%|*}"
    if [ "${#wanted[@]}" -eq 0 ] || printf '%s\n' "${wanted[@]}" | grep -qx "$id"; then
        selected+=("$m")
    fi
done
[ "${#selected[@]}" -gt 0 ] || { echo "no such mutant: $*" >&2; exit 64; }

backup=$(mktemp -d)
current=""
restore() {
    if [ -n "$current" ]; then
        cp "$backup/file" "$current"
        current=""
    fi
}
trap 'restore; rm -rf "$backup"' EXIT
trap 'exit 130' INT TERM

if [ -z "${NO_BASELINE:-}" ]; then
    all=$(for m in "${selected[@]}"; do IFS='|' read -r _ _ s _ <<<"$m"; echo "${s//,/ }"; done |
        tr ' ' '\n' | sort -u | paste -sd, -)
    echo "baseline: suites $all on the unmutated tree" >&2
    if ! out=$(run_suites "$all"); then
        echo "the unmutated tree fails (fix that first):" >&2
        echo "$out" >&2
        exit 65
    fi
fi

results=()
bad=0
for m in "${selected[@]}"; do
    IFS='|' read -r id file suites what <<<"$m"
    mutant_strings "$id"
    cp "$file" "$backup/file"
    current="$file"
    if ! apply_mutant "$file" 2>/dev/null; then
        restore
        results+=("$id|STALE|target string not found exactly once in $file")
        bad=$((bad + 1))
        continue
    fi
    echo "mutant $id: $what ($file); running $suites" >&2
    start=$(date +%s)
    out=$(run_suites "$suites")
    status=$?
    restore
    secs=$(($(date +%s) - start))
    case $status in
    0)
        results+=("$id|SURVIVED|no test failed (${secs}s)")
        bad=$((bad + 1))
        ;;
    1) results+=("$id|CAUGHT|$(echo "$out" | paste -sd' ' -) (${secs}s)") ;;
    *) results+=("$id|NO BUILD|the mutant does not compile (${secs}s)") ;;
    esac
done

printf '\n%-16s %-9s %s\n' MUTANT RESULT "FAILING TESTS"
for r in "${results[@]}"; do
    IFS='|' read -r id res detail <<<"$r"
    printf '%-16s %-9s %s\n' "$id" "$res" "$detail"
done
exit "$bad"
