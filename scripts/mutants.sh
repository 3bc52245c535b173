#!/usr/bin/env bash
# Hand mutation of the safety code: does some test fail when a safety rule is broken?
#
# Each mutant below is a one-line change (an exact string replaced once) that breaks one rule the
# controller promises: a TaskRun write guarded by its UID, a host over its concurrency or taking
# work while backing off, `max-instances` (foreign instances included), FIFO queueing, a
# finalizer kept until cleanup finished, other clusters' instances left alone, one user per host,
# the re-arm budget told to the OTP server, an allocation proof covering each field it promises
# and surviving one store-token rotation.
# For each, the script applies the change, runs the suites that guard that code, records which
# tests failed, and restores the file. A mutant no test catches is a gap in the tests.
#
# Usage:
#   scripts/mutants.sh            # baseline (all suites green), then every mutant
#   scripts/mutants.sh ID...      # only these mutants (see --list)
#   scripts/mutants.sh --list     # the mutants, one a line
#   scripts/mutants.sh --check    # every mutant still matches the code (seconds, no build; CI)
#   NO_BASELINE=1 scripts/mutants.sh ...   # skip the unmutated run
#
# The suites run as CI runs them (default case counts of the property tests). A mutant's file
# must exist and its target string occur there exactly once; when the code moved on and it
# does not, the mutant is reported STALE (update it here) and nothing is written. Files are
# restored from a copy taken before each change, also on interrupt; the build directory is
# cargo's usual one (CARGO_TARGET_DIR). Output: a table, mutant -> CAUGHT (the failing tests),
# SURVIVED, STALE or NO BUILD, and the exit status is the number of mutants not CAUGHT.
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
    ssh) echo "-p multi-platform-controller --lib controller::execute::ssh::" ;;
    recovery) echo "-p multi-platform-controller --lib controller::sources::recovery::" ;;
    lease) echo "-p multi-platform-controller --lib controller::sources::lease::" ;;
    controller) echo "-p multi-platform-controller --lib controller::tests::" ;;
    *) echo "unknown suite $1" >&2; return 1 ;;
    esac
}

# id | file | suites (comma-separated) | what it breaks
# The target and replacement strings are in mutant_strings (bash $'...' for line breaks).
MUTANTS=(
    "uid-test|src/controller/patch.rs|patch,model|TaskRun patches lose their leading test of /metadata/uid"
    "backoff-index|core/src/scheduler/hosts.rs|core,model|a host whose back-off starts stays in the free-host index"
    "newest-first|core/src/scheduler/queue.rs|core,model|waiters of a namespace are served newest first"
    "foreign-ignored|core/src/scheduler/view.rs|core,model|max-instances ignores other clusters' instances"
    "finalizer-early|core/src/scheduler/lifecycle.rs|core,model|the finalizer goes before the build user's removal finished"
    "host-over|core/src/scheduler/hosts.rs|core,model|a full static host stays in the free-host index"
    "max-instances|core/src/scheduler/fleet/dynamic.rs|core,model|a dynamic platform launches one instance over max-instances"
    "orphan-foreign|core/src/scheduler/sweep.rs|core,model|the orphan sweep terminates instances that are not ours"
    "shared-user|core/src/scheduler/users.rs|core,model|two TaskRuns with one user name share a static host"
    "pool-over|core/src/scheduler/instances.rs|core,model|a full pool instance stays in the index of instances with room"
    "rearm-low|src/controller/execute/ssh.rs|ssh|the OTP server is told one re-arm fewer than the retries not yet started"
    "rearm-high|src/controller/execute/ssh.rs|ssh|the OTP server is told one re-arm more than the retries not yet started"
    "proof-kind|src/controller/patch.rs|patch|the allocation proof does not cover the secret's kind"
    "proof-name|src/controller/patch.rs|patch|the allocation proof does not cover the TaskRun's name"
    "proof-uid|src/controller/patch.rs|patch|the allocation proof does not cover the TaskRun's UID"
    "proof-previous|src/controller/patch.rs|patch|a proof made before a store-token rotation no longer verifies"
    "recovery-verdict|src/controller/sources/recovery.rs|recovery|recovery takes any well-formed proof as valid instead of the verifier's verdict"
    "group-over|core/src/scheduler/view.rs|core,model|a capacity group launches one instance over its max"
    "drained-host|core/src/config/types.rs|core,model|a drained static host keeps its concurrency"
    "recovery-platform|core/src/scheduler/recovery.rs|core,model|recovery keeps a TaskRun on a host that does not serve its platform"
    "recovery-room|core/src/scheduler/recovery.rs|core,model|recovery puts one TaskRun more on a host than its concurrency"
    "recovery-owner|core/src/scheduler/recovery.rs|core,model|recovery adopts an unannotated launch whose owner tag names another TaskRun"
    "recovery-annotated|core/src/scheduler/recovery.rs|core,model|recovery trusts a cloud-instance-id whose instance was launched for another TaskRun"
    "recovery-handover|core/src/scheduler/snapshot.rs|core,model|recovery takes an unproven cloud-instance-id over the instance's owner tag as a hand-over"
    "recovery-handover-host|core/src/scheduler/snapshot.rs|core,model|recovery takes a cloud-instance-id as a hand-over with a proof for another host"
    "secret-refused|core/src/scheduler/mod.rs|core,model|a refused secret is not handed back to the scheduler (the host stays taken)"
    "pool-shared-user|core/src/scheduler/users.rs|core,model|two TaskRuns with one user name share a pool instance"
    "lease-cancel|src/controller/sources/lease.rs|lease|the elector does not cancel the term's token when its claim runs out"
    "lease-timeouts|src/controller/mod.rs|controller|the leader's requests have no timeout of the renew deadline"
)

# Sets OLD and NEW for mutant $1.
mutant_strings() {
    case "$1" in
    uid-test)
        OLD='p.test("/metadata/uid", json!(uid));'
        NEW='let _ = uid;' ;;
    backoff-index)
        OLD=$'let level = h.backoff_level;\n            self.reindex(hid);'
        NEW='let level = h.backoff_level;' ;;
    newest-first)
        OLD='lane.push_back(entry);'
        NEW='lane.push_front(entry);' ;;
    foreign-ignored)
        OLD='self.instances.counted(p) + ps.foreign'
        NEW='self.instances.counted(p)' ;;
    finalizer-early)
        OLD=$'HostRef::Static(def),\n                                    out,\n                                );\n                                1'
        NEW=$'HostRef::Static(def),\n                                    out,\n                                );\n                                0' ;;
    host-over)
        OLD='|| self.load >= def.capacity()'
        NEW='|| self.load > def.capacity()' ;;
    max-instances)
        OLD='if self.occupied(p) >= template.capacity() || !self.group_room(p) {'
        NEW='if self.occupied(p) > template.capacity() || !self.group_room(p) {' ;;
    orphan-foreign)
        OLD=$'|| !rec.is_ours_for(&label)\n'
        NEW=$'\n' ;;
    shared-user)
        OLD='(Some(State::OnHost { host, .. }), Target::Host(h)) => *host == h,'
        NEW='(Some(State::OnHost { .. }), Target::Host(_)) => false,' ;;
    pool-over)
        OLD='if self.draining || load >= pool.concurrency {'
        NEW='if self.draining || load > pool.concurrency {' ;;
    rearm-low)
        OLD='t.spec.retries.saturating_sub(t.status.retries)'
        NEW='t.spec.retries.saturating_sub(t.status.retries + 1)' ;;
    rearm-high)
        OLD='t.spec.retries.saturating_sub(t.status.retries)'
        NEW='(t.spec.retries + 1).saturating_sub(t.status.retries)' ;;
    proof-kind)
        OLD='for part in [kind, taskrun.namespace(), taskrun.name(), &uid, host] {'
        NEW='for part in [taskrun.namespace(), taskrun.name(), &uid, host] {' ;;
    proof-name)
        OLD='for part in [kind, taskrun.namespace(), taskrun.name(), &uid, host] {'
        NEW='for part in [kind, taskrun.namespace(), &uid, host] {' ;;
    proof-uid)
        OLD='for part in [kind, taskrun.namespace(), taskrun.name(), &uid, host] {'
        NEW='for part in [kind, taskrun.namespace(), taskrun.name(), host] {' ;;
    proof-previous)
        OLD='[Some(&keys.current), keys.previous.as_ref()]'
        NEW='[Some(&keys.current), None]' ;;
    recovery-verdict)
        OLD='let verified = proof.verify_allocation(r, rec.assigned_host.as_deref(), rec.proof.as_ref());'
        NEW='let verified = proof.verify_allocation(r, rec.assigned_host.as_deref(), rec.proof.as_ref()) || rec.proof.is_some();' ;;
    group-over)
        OLD='&& self.group_in_use(g) < def.max'
        NEW='&& self.group_in_use(g) <= def.max' ;;
    drained-host)
        OLD='if self.drained { 0 } else { self.concurrency }'
        NEW='self.concurrency' ;;
    recovery-platform)
        OLD='if host.platform != p || (host.load() >= def.capacity() && !keeps) || rival {'
        NEW='if (host.load() >= def.capacity() && !keeps) || rival {' ;;
    recovery-room)
        OLD='if host.platform != p || (host.load() >= def.capacity() && !keeps) || rival {'
        NEW='if host.platform != p || (host.load() > def.capacity() && !keeps) || rival {' ;;
    recovery-owner)
        OLD=$'l.is_ours_for(&label)\n                        && l.owner.as_deref() == Some(rec.uid.as_str())'
        NEW='l.is_ours_for(&label)' ;;
    recovery-annotated)
        OLD='if l.claimed_by(rec) {'
        NEW='if l.ownership != Ownership::Foreign {' ;;
    recovery-handover)
        OLD=$'taskrun.secret_proven\n            && taskrun.secret == Some(SecretKind::Remote)'
        NEW='taskrun.secret == Some(SecretKind::Remote)' ;;
    recovery-handover-host)
        OLD=$'\n            && taskrun.assigned_host.as_deref() == Some(self.id.as_str())'
        NEW='' ;;
    secret-refused)
        OLD='} => self.on_secret_refused(&taskrun, secret, &error, out),'
        NEW='} => { let _ = (taskrun, secret, error); }' ;;
    pool-shared-user)
        OLD='(Some(State::OnInstance { inst, .. }), Target::Instance(i)) => *inst == i,'
        NEW='(Some(State::OnInstance { .. }), Target::Instance(_)) => false,' ;;
    lease-cancel)
        OLD='Some(term) => term.cancel(),'
        NEW='Some(_) => {}' ;;
    lease-timeouts)
        OLD='kube_client(args, Some(args.lease_renew_deadline))'
        NEW='kube_client(args, None)' ;;
    *) return 1 ;;
    esac
}

# How many times OLD occurs in file $1 (read only; 0 when the file is missing or unreadable).
occurrences() {
    [ -f "$1" ] && [ -r "$1" ] || { echo 0; return; }
    OLD="$OLD" perl -0777 -ne 'my $n = () = /\Q$ENV{OLD}\E/g; print "$n\n"' "$1"
}

# Why mutant $1 (file $2) cannot be applied, or nothing when it can: its file must be a regular
# file that exists and its target string must occur there exactly once.
stale_reason() {
    local n
    if ! mutant_strings "$1"; then
        echo "no target and replacement strings for $1 in this script"
        return
    fi
    if [ ! -f "$2" ]; then
        echo "no file $2"
        return
    fi
    n=$(occurrences "$2")
    [ "$n" = 1 ] || echo "target string found $n times in $2 (wanted once)"
}

# Replaces OLD by NEW in the existing file $1, which must hold OLD exactly once (checked again
# here: nothing is ever written to a path that does not exist or does not match).
apply_mutant() {
    [ -f "$1" ] || return 3
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

case "${1:-}" in
--list)
    for m in "${MUTANTS[@]}"; do
        IFS='|' read -r id file suites what <<<"$m"
        printf '%-16s %-40s %-12s %s\n' "$id" "$file" "$suites" "$what"
    done
    exit 0
    ;;
--check)
    # Every mutant still matches the code: its file exists, its target string occurs there
    # exactly once, its suites are known. Reads only; no build.
    stale=0
    for m in "${MUTANTS[@]}"; do
        IFS='|' read -r id file suites _ <<<"$m"
        why=$(stale_reason "$id" "$file")
        for suite in ${suites//,/ }; do
            suite_args "$suite" >/dev/null 2>&1 || why="${why:+$why; }unknown suite $suite"
        done
        if [ -n "$why" ]; then
            printf '%-16s STALE  %s\n' "$id" "$why"
            stale=$((stale + 1))
        else
            printf '%-16s ok\n' "$id"
        fi
    done
    [ "$stale" = 0 ] || echo "$stale mutant(s) no longer match the code: update them in $0" >&2
    exit "$stale"
    ;;
esac

wanted=("$@")
selected=()
for m in "${MUTANTS[@]}"; do
    id="${m%%|*}"
    if [ "${#wanted[@]}" -eq 0 ] || printf '%s\n' "${wanted[@]}" | grep -qx "$id"; then
        selected+=("$m")
    fi
done
[ "${#selected[@]}" -gt 0 ] || { echo "no such mutant: $*" >&2; exit 64; }

results=()
bad=0

# Stale mutants are reported without building anything; the rest run.
runnable=()
for m in "${selected[@]}"; do
    IFS='|' read -r id file _ _ <<<"$m"
    why=$(stale_reason "$id" "$file")
    if [ -n "$why" ]; then
        results+=("$id|STALE|$why")
        bad=$((bad + 1))
    else
        runnable+=("$m")
    fi
done

# The file under mutation ($current) and its copy taken before the change. Restoring writes
# only over a file that exists, from a copy that exists, and checks the result; it runs after
# each mutant and on any exit (interrupt included). A plain copy, not `cp -p`: the restored file
# must look newer than the mutant's build, or cargo would reuse it.
backup=$(mktemp -d)
current=""
restore() {
    [ -n "$current" ] || return 0
    if [ -f "$current" ] && [ -f "$backup/file" ] && cp "$backup/file" "$current" &&
        cmp -s "$backup/file" "$current"; then
        current=""
        return 0
    fi
    echo "COULD NOT RESTORE $current: its original is in $backup/file" >&2
    backup=""
    return 1
}
cleanup() {
    restore || exit 70
    [ -z "$backup" ] || rm -rf "$backup"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ -z "${NO_BASELINE:-}" ] && [ "${#runnable[@]}" -gt 0 ]; then
    all=$(for m in "${runnable[@]}"; do IFS='|' read -r _ _ s _ <<<"$m"; echo "${s//,/ }"; done |
        tr ' ' '\n' | sort -u | paste -sd, -)
    echo "baseline: suites $all on the unmutated tree" >&2
    if ! out=$(run_suites "$all"); then
        echo "the unmutated tree fails (fix that first):" >&2
        echo "$out" >&2
        exit 65
    fi
fi

for m in ${runnable[@]+"${runnable[@]}"}; do
    IFS='|' read -r id file suites what <<<"$m"
    mutant_strings "$id"
    cp "$file" "$backup/file" || exit 70
    current="$file"
    if ! apply_mutant "$file" 2>/dev/null; then
        restore || exit 70
        results+=("$id|STALE|target string not found exactly once in $file")
        bad=$((bad + 1))
        continue
    fi
    echo "mutant $id: $what ($file); running $suites" >&2
    start=$(date +%s)
    out=$(run_suites "$suites")
    status=$?
    restore || exit 70
    secs=$(($(date +%s) - start))
    case $status in
    0)
        results+=("$id|SURVIVED|no test failed (${secs}s)")
        bad=$((bad + 1))
        ;;
    1) results+=("$id|CAUGHT|$(echo "$out" | paste -sd' ' -) (${secs}s)") ;;
    *)
        results+=("$id|NO BUILD|the mutant does not compile: fix it (${secs}s)")
        bad=$((bad + 1))
        ;;
    esac
done

printf '\n%-16s %-9s %s\n' MUTANT RESULT "FAILING TESTS"
for r in "${results[@]}"; do
    IFS='|' read -r id res detail <<<"$r"
    printf '%-16s %-9s %s\n' "$id" "$res" "$detail"
done
exit "$bad"
