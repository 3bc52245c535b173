//! Every [`Invariant`] has a corruption that breaks it alone: each case builds a consistent
//! state, changes one relation behind the scheduler's back, and [`Scheduler::violations`] must
//! name exactly that invariant (and [`Scheduler::check`] return it).

use super::*;

const S390X: &str = "linux/s390x";
const ARM: &str = "linux/arm64";

fn found(h: &H) -> Vec<Invariant> {
    h.s.violations().into_iter().map(|e| e.invariant).collect()
}

fn consistent(h: H) -> H {
    assert_eq!(found(&h), [], "{:?}", h.s.violations());
    h
}

fn key_of(h: &H, name: &str) -> Key {
    h.s.taskruns
        .find(&Uid::new(&format!("uid-ns-{name}")))
        .expect("tracked")
}

fn platform(h: &H, p: &str) -> usize {
    h.s.platform_ids[&Platform::parse(p).unwrap()] as usize
}

/// The instance a TaskRun is on.
fn instance_of(h: &H, name: &str) -> Key {
    match h.s.taskruns.get(key_of(h, name)).unwrap().state {
        State::OnInstance { inst, .. } => inst,
        _ => panic!("{name} is not on an instance"),
    }
}

fn taskrun<'a>(h: &'a mut H, name: &str) -> &'a mut TaskRun {
    let k = key_of(h, name);
    h.s.taskruns.get_mut(k).unwrap()
}

/// Changes an instance in place (then re-indexed, as the scheduler's own changes are).
fn instance(h: &mut H, inst: Key, change: impl FnOnce(&mut Instance)) {
    h.s.instances.update(inst, change).unwrap();
}

/// An operation id no operation ever had.
const BOGUS: OpId = OpId(u64::MAX);

/// Static host h1 (concurrency 1) with `a` provisioning on it and `b` waiting for it; a pool
/// instance launching for `c`.
fn busy() -> H {
    let mut pairs = static_pairs(&[("h1", 1)]);
    pairs.extend(dynamic_pairs(2, Some((2, 60))));
    let mut h = H::new(&pairs);
    assert_eq!(provisions(&h.submit("ns", "a", S390X)).len(), 1);
    assert!(provisions(&h.submit("ns", "b", S390X)).is_empty());
    assert_eq!(launches(&h.submit("ns", "c", ARM)).len(), 1);
    consistent(h)
}

/// Dynamic linux/arm64 in capacity group `aws-ip` (max 2), launching an instance for `g`.
fn grouped() -> H {
    let mut pairs = dynamic_pairs(2, None);
    pairs.push(kv("capacity-group.aws-ip.max", "2"));
    pairs.push(kv("dynamic.linux-arm64.capacity-group", "aws-ip"));
    let mut h = H::new(&pairs);
    assert_eq!(launches(&h.submit("ns", "g", ARM)).len(), 1);
    consistent(h)
}

/// How far the dynamic TaskRun `d` has come.
#[derive(Clone, Copy, PartialEq, PartialOrd)]
enum Stage {
    /// Its instance's launch is in flight.
    Launching,
    /// Its instance `i-1` is launched and being probed.
    Probing,
    /// Its user is being provisioned on the reachable `i-1`.
    Provisioning,
    /// It finished: `i-1` is being terminated, and its finalizer waits for that.
    Cleanup,
}

fn dynamic(stage: Stage) -> H {
    let mut h = H::new(&dynamic_pairs(2, None));
    let l = launches(&h.submit("ns", "d", ARM));
    if stage >= Stage::Probing {
        h.send(Event::Launched {
            op: l[0].0,
            instance_id: "i-1".into(),
        });
        let p = probes(&h.wait(20));
        assert_eq!(p.len(), 1);
        if stage >= Stage::Provisioning {
            let a = h.send(Event::Probed {
                op: p[0].0,
                result: ProbeResult::Reachable {
                    address: "192.0.2.1".into(),
                },
            });
            let op = provision_op(&a, "d");
            if stage >= Stage::Cleanup {
                h.send(Event::Provisioned {
                    op,
                    otp: "t".into(),
                });
                assert_eq!(terminates(&h.done("ns", "d")).len(), 1);
            }
        }
    }
    consistent(h)
}

type Case = (Invariant, &'static str, fn() -> H);

/// Each invariant (in order; some more than once, one case per direction of a relation), the
/// corruption that breaks it alone, and the corrupted state.
const CASES: &[Case] = &[
    (
        Invariant::UidIndex,
        "a TaskRun missing from the UID index",
        || {
            let mut h = busy();
            let k = key_of(&h, "a");
            h.s.taskruns.corrupt_uid_index(k);
            h
        },
    ),
    (
        Invariant::Tombstones,
        "a tracked TaskRun remembered as finished",
        || {
            let mut h = busy();
            h.s.taskruns.bury(&Uid::new("uid-ns-b"));
            h
        },
    ),
    (
        Invariant::UserIndex,
        "a TaskRun missing from the user index",
        || {
            let mut h = busy();
            let k = key_of(&h, "b");
            h.s.taskruns.corrupt_user_index(k);
            h
        },
    ),
    (
        Invariant::Namespaces,
        "a TaskRun in a namespace never interned",
        || {
            let mut h = busy();
            taskrun(&mut h, "a").ns = 99;
            h
        },
    ),
    (
        Invariant::Platforms,
        "a TaskRun of a platform id with no platform",
        || {
            let mut h = busy();
            taskrun(&mut h, "a").platform = 99;
            h
        },
    ),
    (
        Invariant::HostIds,
        "a TaskRun on a host id with no host",
        || {
            let mut h = busy();
            // The host lets it go (its load stays right); the TaskRun says it is elsewhere.
            h.s.hosts.release(0);
            if let State::OnHost { host, .. } = &mut taskrun(&mut h, "a").state {
                *host = 99;
            }
            h
        },
    ),
    (
        Invariant::HostRoom,
        "a full host in the index of hosts with room",
        || {
            let mut h = busy();
            let p = platform(&h, S390X);
            h.s.hosts.corrupt_avail(p as PlatformId, 0);
            h
        },
    ),
    (
        Invariant::PlatformHosts,
        "a platform's host list lost",
        || {
            let mut h = busy();
            let p = platform(&h, S390X);
            h.s.hosts.corrupt_configured(p as PlatformId);
            h
        },
    ),
    (
        Invariant::HostLoad,
        "a host load with no TaskRun behind it",
        || {
            let mut h = busy();
            h.s.hosts.add_load(0);
            h
        },
    ),
    (
        Invariant::HostBackoff,
        "a host backing off with no timer to end it",
        || {
            let mut h = busy();
            let b = h.s.policy.host_backoff.expect("mpc backs hosts off");
            let now = h.now;
            while h.s.hosts.failed(0, b, now).is_none() {}
            h
        },
    ),
    (
        Invariant::DrainedHost,
        "a first allocation provisioned under a drained host definition",
        || {
            let mut h = busy();
            if let State::OnHost { def: Some(def), .. } = &mut taskrun(&mut h, "a").state {
                let drained = crate::config::StaticHost {
                    drained: true,
                    ..(**def).clone()
                };
                *def = Arc::new(drained);
            }
            h
        },
    ),
    (
        Invariant::InstanceIds,
        "an instance whose id resolves to nothing",
        || {
            let mut h = dynamic(Stage::Probing);
            let i = instance_of(&h, "d");
            h.s.instances.name_only(i, "i-2".into());
            h
        },
    ),
    (
        Invariant::InstanceMembers,
        "an instance missing from its platform's members",
        || {
            let mut h = busy();
            let i = instance_of(&h, "c");
            h.s.instances.corrupt_members(i);
            h
        },
    ),
    (
        Invariant::InstanceCount,
        "a platform's instance count off by one",
        || {
            let mut h = busy();
            let p = platform(&h, ARM);
            h.s.instances.corrupt_count(p as PlatformId);
            h
        },
    ),
    (
        Invariant::GroupMembers,
        "a member platform missing from the index of its groups",
        || {
            let mut h = grouped();
            let p = platform(&h, ARM);
            h.s.instances.groups_mut().corrupt_of(p as PlatformId);
            h
        },
    ),
    (
        Invariant::GroupCount,
        "a capacity group's count off by one",
        || {
            let mut h = grouped();
            h.s.instances.groups_mut().corrupt_count(0);
            h
        },
    ),
    (
        Invariant::GroupLimit,
        "a capacity group tolerating more above its limit than it holds",
        || {
            let mut h = grouped();
            h.s.instances.groups_mut().corrupt_tolerated(0);
            h
        },
    ),
    (
        Invariant::ScrubHold,
        "a slot held for a scrubbed host with no timer to free it",
        || {
            let mut h = busy();
            let p = platform(&h, ARM);
            let until = h.now + std::time::Duration::from_secs(3000);
            h.s.instances.hold_for_scrub(p as PlatformId, until);
            h
        },
    ),
    (
        Invariant::PoolIndex,
        "a booting pool instance missing from its index",
        || {
            let mut h = busy();
            let p = platform(&h, ARM);
            h.s.instances.corrupt_booting(p as PlatformId);
            h
        },
    ),
    (
        Invariant::PoolAttached,
        "a pool instance attaching a TaskRun not on it",
        || {
            let mut h = busy();
            let (i, b) = (instance_of(&h, "c"), key_of(&h, "b"));
            // Same load, so its place in the pool index stays right.
            instance(&mut h, i, |i| i.attached = vec![b]);
            h
        },
    ),
    (
        Invariant::AwaitedTerminations,
        "a termination awaited that no instance names",
        || {
            let mut h = busy();
            let k = key_of(&h, "b");
            h.s.instances.corrupt_awaited(k);
            h
        },
    ),
    (
        Invariant::TaskRunInstance,
        "a TaskRun on an instance the fleet forgot",
        || {
            let mut h = dynamic(Stage::Provisioning);
            let i = instance_of(&h, "d");
            h.s.instances.remove(i);
            h
        },
    ),
    (
        Invariant::InstanceOwner,
        "a dynamic instance that lost its owner",
        || {
            let mut h = dynamic(Stage::Provisioning);
            let i = instance_of(&h, "d");
            instance(&mut h, i, |i| i.owner = None);
            h
        },
    ),
    (
        Invariant::InstanceOwner,
        "a pool instance with an owner",
        || {
            let mut h = busy();
            let (i, c) = (instance_of(&h, "c"), key_of(&h, "c"));
            instance(&mut h, i, |i| i.owner = Some(c));
            h
        },
    ),
    (
        Invariant::InstanceOps,
        "an instance launching under an id not in flight",
        || {
            let mut h = dynamic(Stage::Launching);
            let i = instance_of(&h, "d");
            instance(&mut h, i, |i| i.state = InstState::Launching(BOGUS));
            h
        },
    ),
    (
        Invariant::InstanceOps,
        "a launch in flight for an instance not launching",
        || {
            let mut h = dynamic(Stage::Launching);
            let i = instance_of(&h, "d");
            instance(&mut h, i, |i| i.state = InstState::LaunchWait);
            h
        },
    ),
    (
        Invariant::ProbeOps,
        "a booting instance that forgot its probe in flight",
        || {
            let mut h = dynamic(Stage::Probing);
            let i = instance_of(&h, "d");
            instance(&mut h, i, |i| i.probe_op = None);
            h
        },
    ),
    (
        Invariant::TerminationRetried,
        "a leaked instance not being terminated",
        || {
            let mut h = dynamic(Stage::Provisioning);
            let i = instance_of(&h, "d");
            h.s.instances.leak(i);
            h
        },
    ),
    (
        Invariant::ProvisionOps,
        "a TaskRun provisioning under an id not in flight",
        || {
            let mut h = busy();
            if let State::OnHost { phase, .. } = &mut taskrun(&mut h, "a").state {
                *phase = Phase::Provisioning(BOGUS);
            }
            h
        },
    ),
    (
        Invariant::ProvisionOps,
        "a static host's provisioning its TaskRun no longer waits for",
        || {
            let mut h = busy();
            // Nor does it compensate: the user it creates would stay on the host.
            let now = h.now;
            if let State::OnHost { phase, .. } = &mut taskrun(&mut h, "a").state {
                *phase = Phase::Ready(now);
            }
            h
        },
    ),
    (
        Invariant::Waiters,
        "a waiter missing from its queue",
        || {
            let mut h = busy();
            let p = platform(&h, S390X);
            h.s.platforms[p].queue.drain_all();
            h
        },
    ),
    (Invariant::Queue, "a queue miscounting its entries", || {
        let mut h = busy();
        let p = platform(&h, S390X);
        h.s.platforms[p].queue.corrupt_count();
        h
    }),
    (
        Invariant::CleanupPending,
        "a finalizer waiting for a cleanup nothing does",
        || {
            let mut h = dynamic(Stage::Cleanup);
            if let State::Cleanup { pending } = &mut taskrun(&mut h, "d").state {
                *pending += 1;
            }
            h
        },
    ),
    (
        Invariant::Cleaning,
        "a user removal in progress with none in flight",
        || {
            let mut h = busy();
            h.s.cleaning.insert("u-x".into(), vec!["h1".into()]);
            h
        },
    ),
    (
        Invariant::Timers,
        "a delayed cleanup without its timer",
        || {
            let mut h = busy();
            let inst = instance_of(&h, "c");
            h.s.timers.corrupt_delayed(Op::Launch { inst });
            h
        },
    ),
    (
        Invariant::OpTable,
        "an operation table miscounting its entries",
        || {
            let mut h = busy();
            h.s.ops.corrupt_count();
            h
        },
    ),
    (
        Invariant::Unlisted,
        "a static platform waiting for a cloud listing",
        || {
            let mut h = busy();
            let p = platform(&h, S390X);
            h.s.platforms[p].unlisted = true;
            h
        },
    ),
    (
        Invariant::PlatformMode,
        "a platform's cached mode the config does not give",
        || {
            let mut h = busy();
            let p = platform(&h, S390X);
            h.s.platforms[p].mode = Mode::Unknown;
            h
        },
    ),
    (
        Invariant::UserGuard,
        "two live TaskRuns of one user name on one host",
        || on_the_first_ones_host(colliding(false)),
    ),
    (
        Invariant::UserGuard,
        "a TaskRun on the host its user name is being removed from",
        || on_the_first_ones_host(colliding(true)),
    ),
];

/// `team-a/build-x1` provisioning on h1 (concurrency 2), or finished there (its user being
/// removed); `1team-a/build-x`, the same build user name, waiting: it may not go there.
fn colliding(first_finished: bool) -> H {
    let mut h = H::new(&static_pairs(&[("h1", 2)]));
    let op = provision_op(&h.submit("team-a", "build-x1", S390X), "build-x1");
    assert!(provisions(&h.submit("1team-a", "build-x", S390X)).is_empty());
    if first_finished {
        h.send(Event::Provisioned {
            op,
            otp: "t".into(),
        });
        assert_eq!(deprovisions(&h.done("team-a", "build-x1")).len(), 1);
    }
    consistent(h)
}

/// Puts the second TaskRun of [`colliding`] on h1 anyway (the host's load follows).
fn on_the_first_ones_host(mut h: H) -> H {
    let host = h.s.hosts.id("h1").unwrap();
    let def = h.s.hosts[host].def.clone();
    let k = h.s.taskruns.find(&Uid::new("uid-1team-a-build-x")).unwrap();
    h.s.hosts.add_load(host);
    h.s.taskruns.get_mut(k).unwrap().state = State::OnHost {
        host,
        def,
        phase: Phase::Ready(h.now),
    };
    h
}

/// Every invariant in order: an exhaustive match, so a new one does not compile until it is
/// placed here (and then needs its case above).
fn after(i: Option<Invariant>) -> Option<Invariant> {
    use Invariant::*;
    let Some(i) = i else {
        return Some(UidIndex);
    };
    match i {
        UidIndex => Some(Tombstones),
        Tombstones => Some(UserIndex),
        UserIndex => Some(Namespaces),
        Namespaces => Some(Platforms),
        Platforms => Some(HostIds),
        HostIds => Some(HostRoom),
        HostRoom => Some(PlatformHosts),
        PlatformHosts => Some(HostLoad),
        HostLoad => Some(HostBackoff),
        HostBackoff => Some(DrainedHost),
        DrainedHost => Some(InstanceIds),
        InstanceIds => Some(InstanceMembers),
        InstanceMembers => Some(InstanceCount),
        InstanceCount => Some(GroupMembers),
        GroupMembers => Some(GroupCount),
        GroupCount => Some(GroupLimit),
        GroupLimit => Some(ScrubHold),
        ScrubHold => Some(PoolIndex),
        PoolIndex => Some(PoolAttached),
        PoolAttached => Some(AwaitedTerminations),
        AwaitedTerminations => Some(TaskRunInstance),
        TaskRunInstance => Some(InstanceOwner),
        InstanceOwner => Some(InstanceOps),
        InstanceOps => Some(ProbeOps),
        ProbeOps => Some(TerminationRetried),
        TerminationRetried => Some(ProvisionOps),
        ProvisionOps => Some(Waiters),
        Waiters => Some(Queue),
        Queue => Some(CleanupPending),
        CleanupPending => Some(Cleaning),
        Cleaning => Some(Timers),
        Timers => Some(OpTable),
        OpTable => Some(Unlisted),
        Unlisted => Some(PlatformMode),
        PlatformMode => Some(UserGuard),
        UserGuard => None,
    }
}

#[test]
fn every_invariant_has_a_corruption_case() {
    let all: Vec<Invariant> = std::iter::successors(after(None), |&i| after(Some(i))).collect();
    let mut cased: Vec<Invariant> = CASES.iter().map(|c| c.0).collect();
    cased.dedup();
    assert_eq!(cased, all, "every invariant has a case, in order");
}

#[test]
fn each_corruption_breaks_exactly_its_invariant() {
    let mut wrong = Vec::new();
    for &(invariant, what, corrupt) in CASES {
        let h = corrupt();
        let found = found(&h);
        let first = h.s.check().err().map(|e| e.invariant);
        if found != [invariant] || first != Some(invariant) {
            wrong.push(format!(
                "{what}: want {invariant:?} alone, violations {found:?}, check() {first:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

#[test]
fn a_violation_names_its_invariant_and_the_entry() {
    let mut h = dynamic(Stage::Provisioning);
    let i = instance_of(&h, "d");
    h.s.instances.remove(i);
    let text = h.s.check().unwrap_err().to_string();
    assert!(text.contains("TaskRuns' instances broken"), "{text}");
    assert!(text.contains("ns/d is on instance"), "{text}");
}
