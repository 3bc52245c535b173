//! The scheduler's state invariants by name, and the error that names a broken one. Each owning
//! type checks its own ([`super::Scheduler::check`] gathers them and checks the relations between
//! them); kept apart from `check.rs` so the owners need not import the code that imports them.

use std::fmt;

/// One invariant of the scheduler's state (docs/architecture.md, "The scheduler's state").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Invariant {
    /// Every tracked TaskRun is found by its UID, and the index holds nothing else.
    UidIndex,
    /// No tracked TaskRun's UID is remembered as finished.
    Tombstones,
    /// The user-name index holds exactly the tracked TaskRuns, under their build user's hash.
    UserIndex,
    /// Namespace ids and names map to each other; every TaskRun's namespace id is interned.
    Namespaces,
    /// Platform ids and platforms map to each other; every reference to a platform resolves.
    Platforms,
    /// Host ids and names map to each other.
    HostIds,
    /// A host is in its platform's set of hosts with room exactly when it is configured for the
    /// platform, not backing off and below its concurrency, under the key its load gives.
    HostRoom,
    /// A platform's host list holds exactly its configured hosts, by rank.
    PlatformHosts,
    /// A host's load is the number of TaskRuns on it.
    HostLoad,
    /// A host backing off has the timer that ends its back-off.
    HostBackoff,
    /// No TaskRun is allocated to a drained static host: one being provisioned on a static host
    /// holds a definition that was not drained (allocations made before a drain keep theirs),
    /// unless it is a Tekton retry of a build found there at recovery (its pod mounted the
    /// secret naming the host).
    DrainedHost,
    /// Instance ids and instance entries map to each other.
    InstanceIds,
    /// A platform's member set holds exactly its instances.
    InstanceMembers,
    /// A platform's instance count is the number of its instances, leaked ones included (they
    /// still run and are billed).
    InstanceCount,
    /// The capacity groups, their limits and scopes and each platform's groups are the config's.
    GroupMembers,
    /// A capacity group's count is the number of its members' instances.
    GroupCount,
    /// A capacity group holds more than its `max` only by what it was tolerated when the limit
    /// was set (instances that already ran, a lowered limit), and that only shrinks: no launch
    /// ever took it past its limit.
    GroupLimit,
    /// A terminated instance's slot held while its dedicated host is scrubbed has the timer
    /// that frees it when the scrub ends (else the platform's waiters would wait for good).
    ScrubHold,
    /// A pool instance is in its platform's ready or booting set exactly when it takes work,
    /// under the key its load and age give.
    PoolIndex,
    /// A pool instance's attached TaskRuns are exactly the TaskRuns on it; a dynamic one has
    /// none attached.
    PoolAttached,
    /// Each TaskRun's count of instance terminations its finalizer waits for is the number of
    /// instances naming it.
    AwaitedTerminations,
    /// A TaskRun on an instance is on one the fleet tracks, of its own platform.
    TaskRunInstance,
    /// A dynamic instance's owner is the TaskRun on it, and a TaskRun on a dynamic instance is
    /// its owner; a pool instance has no owner.
    InstanceOwner,
    /// A launching or terminating instance's operation is in flight, for it; every launch or
    /// termination in flight is the one its instance's state names (an instance is forgotten
    /// only once its operations are answered).
    InstanceOps,
    /// An instance's probe in flight (`probe_op`) is in the operation table, for it, while it
    /// boots; a booting instance waits for every probe in flight for it (one whose instance
    /// stopped booting is answered and ignored).
    ProbeOps,
    /// An instance waiting to retry its termination has the timer that retries it, and a leaked
    /// one is being terminated or waiting to retry: a termination is never given up.
    TerminationRetried,
    /// A TaskRun being provisioned has its provisioning in flight, for it; every provisioning
    /// in flight is its TaskRun's current one, compensates (removes what it creates), or is on
    /// an instance whose users go with it (dynamic, terminating or gone).
    ProvisionOps,
    /// A waiting TaskRun is in its platform's queue (retry lane when it failed somewhere) with
    /// its ticket, or, when waiters poll, has its requeue timer.
    Waiters,
    /// A queue's own bookkeeping (entry count, turn order) matches its lanes.
    Queue,
    /// A TaskRun in cleanup waits for exactly the cleanups that name it; a live one is named by
    /// no cleanup but instance terminations (of instances it left).
    CleanupPending,
    /// Removals of a build user in progress are exactly the removals in flight or delayed.
    Cleaning,
    /// Delayed cleanups and their timers map to each other; timer sequence numbers are unique
    /// and already issued.
    Timers,
    /// The operation table's count matches its slots.
    OpTable,
    /// TaskRuns held for an unlisted platform's listing are tracked nowhere else and belong to
    /// an unlisted platform; an unlisted platform tracks no instance and is served from the
    /// cloud.
    Unlisted,
    /// A platform's cached mode (how it is served) and label are what the config in force
    /// gives it.
    PlatformMode,
    /// Two live TaskRuns with the same build user name are never on one host or instance, and
    /// none is where a removal of its user name is in flight.
    UserGuard,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Invariant::UidIndex => "UID index",
            Invariant::Tombstones => "tombstones",
            Invariant::UserIndex => "user-name index",
            Invariant::Namespaces => "namespace table",
            Invariant::Platforms => "platform table",
            Invariant::HostIds => "host ids",
            Invariant::HostRoom => "index of hosts with room",
            Invariant::PlatformHosts => "platform host lists",
            Invariant::HostLoad => "host load",
            Invariant::HostBackoff => "host back-off timers",
            Invariant::DrainedHost => "no allocation on a drained host",
            Invariant::InstanceIds => "instance ids",
            Invariant::InstanceMembers => "platform instance members",
            Invariant::InstanceCount => "max-instances ledger",
            Invariant::GroupMembers => "capacity group members",
            Invariant::GroupCount => "capacity group counts",
            Invariant::GroupLimit => "capacity group limits",
            Invariant::ScrubHold => "slots held for scrubbed hosts",
            Invariant::PoolIndex => "index of pool instances with room",
            Invariant::PoolAttached => "pool attachments",
            Invariant::AwaitedTerminations => "awaited instance terminations",
            Invariant::TaskRunInstance => "TaskRuns' instances",
            Invariant::InstanceOwner => "dynamic instance owners",
            Invariant::InstanceOps => "instance operations",
            Invariant::ProbeOps => "probes in flight",
            Invariant::TerminationRetried => "termination retries",
            Invariant::ProvisionOps => "provisioning operations",
            Invariant::Waiters => "waiters' queue entries",
            Invariant::Queue => "queue bookkeeping",
            Invariant::CleanupPending => "pending cleanups",
            Invariant::Cleaning => "user removals in progress",
            Invariant::Timers => "timers",
            Invariant::OpTable => "operation table",
            Invariant::Unlisted => "unlisted platforms",
            Invariant::PlatformMode => "platform modes",
            Invariant::UserGuard => "shared user names kept apart",
        };
        f.write_str(s)
    }
}

/// A broken invariant, with what was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scheduler state: {invariant} broken: {detail}")]
pub struct StateError {
    /// Which invariant.
    pub invariant: Invariant,
    /// The entry that breaks it and how.
    pub detail: String,
}

/// `Err` naming `invariant` unless `ok`.
pub(super) fn ensure(
    ok: bool,
    invariant: Invariant,
    detail: impl FnOnce() -> String,
) -> Result<(), StateError> {
    if ok {
        Ok(())
    } else {
        Err(StateError {
            invariant,
            detail: detail(),
        })
    }
}
