//! [`Scheduler::check`] names the invariant an index breaks: each case corrupts one index of a
//! consistent state behind the scheduler's back.

use super::*;

const S390X: &str = "linux/s390x";

/// Two static hosts with one TaskRun provisioning and one waiting; a pool platform with an
/// instance booting for one TaskRun.
fn busy() -> H {
    let mut pairs = static_pairs(&[("h1", 1)]);
    pairs.extend(dynamic_pairs(2, Some((2, 60))));
    let mut h = H::new(&pairs);
    assert_eq!(provisions(&h.submit("ns", "a", S390X)).len(), 1);
    assert!(provisions(&h.submit("ns", "b", S390X)).is_empty());
    assert_eq!(launches(&h.submit("ns", "c", "linux/arm64")).len(), 1);
    h.s.check().expect("consistent before the corruption");
    h
}

fn broken(h: &H) -> Invariant {
    h.s.check().expect_err("the corruption is found").invariant
}

fn key_of(h: &H, name: &str) -> Key {
    let uid = Uid::new(&format!("uid-ns-{name}"));
    h.s.taskruns.find(&uid).expect("tracked")
}

fn platform(h: &H, p: &str) -> usize {
    h.s.platform_ids[&Platform::parse(p).unwrap()] as usize
}

#[test]
fn a_taskrun_missing_from_the_uid_index() {
    let mut h = busy();
    let k = key_of(&h, "a");
    h.s.taskruns.corrupt_uid_index(k);
    assert_eq!(broken(&h), Invariant::UidIndex);
}

#[test]
fn a_taskrun_missing_from_the_user_index() {
    let mut h = busy();
    let k = key_of(&h, "b");
    h.s.taskruns.corrupt_user_index(k);
    assert_eq!(broken(&h), Invariant::UserIndex);
}

#[test]
fn a_full_host_left_in_the_index_of_hosts_with_room() {
    let mut h = busy();
    let p = platform(&h, S390X);
    // h1 (concurrency 1) is full: a stale entry makes it look free.
    h.s.hosts.corrupt_avail(p as PlatformId, 0);
    assert_eq!(broken(&h), Invariant::HostRoom);
}

#[test]
fn a_host_load_without_its_taskrun() {
    let mut h = busy();
    let k = key_of(&h, "a");
    h.s.taskruns.get_mut(k).unwrap().state = State::Failed;
    assert_eq!(broken(&h), Invariant::HostLoad);
}

#[test]
fn an_instance_count_off_by_one() {
    let mut h = busy();
    let p = platform(&h, "linux/arm64");
    h.s.instances.corrupt_count(p as PlatformId);
    assert_eq!(broken(&h), Invariant::InstanceCount);
}

#[test]
fn a_booting_pool_instance_missing_from_its_index() {
    let mut h = busy();
    let p = platform(&h, "linux/arm64");
    h.s.instances.corrupt_booting(p as PlatformId);
    assert_eq!(broken(&h), Invariant::PoolIndex);
}

#[test]
fn an_awaited_termination_no_instance_names() {
    let mut h = busy();
    let k = key_of(&h, "b");
    h.s.instances.corrupt_awaited(k);
    assert_eq!(broken(&h), Invariant::AwaitedTerminations);
}

#[test]
fn a_waiter_missing_from_its_queue() {
    let mut h = busy();
    let p = platform(&h, S390X);
    h.s.platforms[p].queue.drain_all();
    assert_eq!(broken(&h), Invariant::Waiters);
}

#[test]
fn a_delayed_cleanup_without_its_timer() {
    let mut h = busy();
    let inst = key_of(&h, "a");
    h.s.timers.corrupt_delayed(Op::Launch { inst });
    assert_eq!(broken(&h), Invariant::Timers);
}

#[test]
fn the_error_names_the_invariant_and_the_entry() {
    let mut h = busy();
    let k = key_of(&h, "a");
    h.s.taskruns.corrupt_uid_index(k);
    let e = h.s.check().unwrap_err();
    let text = e.to_string();
    assert!(text.contains("UID index"), "{text}");
    assert!(text.contains("2 entries for 3 TaskRuns"), "{text}");
}
