//! Unit tests of the scheduler core, one file per strategy, on a small harness that plays the
//! controller by hand.

mod check;
mod drain;
mod dynamic;
mod faults;
mod groups;
mod handoff;
mod lifecycle;
mod metrics;
mod ownership;
mod pool;
mod recovery;
mod scrub;
mod shared_users;
mod state;
mod static_pool;
mod tenant;

use super::*;
use crate::config::ConfigData;

/// Parses ConfigMap data; the fixture must be valid.
pub(super) fn config(pairs: &[(String, String)]) -> HostConfig {
    let data: ConfigData = pairs.iter().cloned().collect();
    let parsed = crate::config::parse(&data);
    assert!(!parsed.has_errors(), "{:?}", parsed.diagnostics);
    parsed.config
}

pub(super) fn kv(k: &str, v: &str) -> (String, String) {
    (k.to_owned(), v.to_owned())
}

/// Static hosts `(name, concurrency)` for linux/s390x.
pub(super) fn static_pairs(hosts: &[(&str, u32)]) -> Vec<(String, String)> {
    let mut v = Vec::new();
    for (i, (name, c)) in hosts.iter().enumerate() {
        v.push(kv(
            &format!("host.{name}.address"),
            &format!("10.0.0.{}", i + 1),
        ));
        v.push(kv(&format!("host.{name}.user"), "root"));
        v.push(kv(&format!("host.{name}.platform"), "linux/s390x"));
        v.push(kv(&format!("host.{name}.secret"), "s390x-ssh"));
        v.push(kv(&format!("host.{name}.concurrency"), &c.to_string()));
    }
    v
}

/// A dynamic platform `linux/arm64` (or a pool when `pool` is `Some((concurrency, max_age_min))`).
pub(super) fn dynamic_pairs(max: u32, pool: Option<(u32, u32)>) -> Vec<(String, String)> {
    let label = "linux-arm64";
    let mut v = vec![
        kv(
            if pool.is_some() {
                "dynamic-pool-platforms"
            } else {
                "dynamic-platforms"
            },
            "linux/arm64",
        ),
        kv("instance-tag", "test"),
    ];
    for (f, val) in [
        ("type", "aws"),
        ("region", "us-east-1"),
        ("ami", "ami-0123456789abcdef0"),
        ("instance-type", "m6g.large"),
        ("key-name", "kp"),
        ("aws-secret", "aws-account"),
        ("ssh-secret", "aws-ssh"),
        ("security-group-id", "sg-1"),
        ("subnet-id", "subnet-1"),
    ] {
        v.push(kv(&format!("dynamic.{label}.{f}"), val));
    }
    v.push(kv(
        &format!("dynamic.{label}.max-instances"),
        &max.to_string(),
    ));
    if let Some((c, age)) = pool {
        v.push(kv(&format!("dynamic.{label}.concurrency"), &c.to_string()));
        v.push(kv(&format!("dynamic.{label}.max-age"), &age.to_string()));
    }
    v
}

/// The controller, played by hand.
pub(super) struct H {
    pub s: Scheduler,
    pub now: Time,
    /// Check the state's invariants after every event (off for bulk tests: the check is linear).
    pub check: bool,
}

pub(super) const START: u64 = 1_700_000_000;

impl H {
    pub fn new(pairs: &[(String, String)]) -> Self {
        Self::with_policy(pairs, Policy::mpc())
    }

    pub fn with_policy(pairs: &[(String, String)], policy: Policy) -> Self {
        let mut s = Scheduler::new(config(pairs), policy);
        let now = Time::from_secs(START);
        let mut out = Vec::new();
        s.recover(now, Snapshot::default(), &mut out);
        assert!(out.is_empty(), "{out:?}");
        H::from(s, now)
    }

    /// Takes over a scheduler (recovered already); its state must be consistent.
    pub fn from(s: Scheduler, now: Time) -> Self {
        s.check()
            .expect("a recovered scheduler's state is consistent");
        H {
            s,
            now,
            check: true,
        }
    }

    /// Feeds one event; the state's invariants must hold after it.
    pub fn send(&mut self, e: Event) -> Vec<Action> {
        let out = self.s.step(self.now, e);
        if self.check
            && let Err(e) = self.s.check()
        {
            panic!("{e}\nafter actions {out:#?}");
        }
        out
    }

    /// Moves time forward and fires due timers.
    pub fn wait(&mut self, secs: u64) -> Vec<Action> {
        self.now = self.now + std::time::Duration::from_secs(secs);
        self.send(Event::Tick)
    }

    pub fn spec(ns: &str, name: &str, platform: &str) -> TaskRunSpec {
        TaskRunSpec {
            namespace: ns.into(),
            name: name.into(),
            uid: format!("uid-{ns}-{name}"),
            platform: platform.into(),
            since: Time::from_secs(START),
            retries: 0,
            gated: false,
        }
    }

    pub fn submit(&mut self, ns: &str, name: &str, platform: &str) -> Vec<Action> {
        self.send(Event::TaskRun(Self::spec(ns, name, platform)))
    }

    pub fn done(&mut self, ns: &str, name: &str) -> Vec<Action> {
        self.send(Event::TaskRunDone {
            taskrun: TaskRunRef::new(ns, name, Uid::new(&format!("uid-{ns}-{name}"))),
        })
    }
}

pub(super) fn provisions(acts: &[Action]) -> Vec<(OpId, String, String)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Provision {
                op, taskrun, host, ..
            } => Some((*op, taskrun.name().to_string(), host.name().to_owned())),
            _ => None,
        })
        .collect()
}

/// The single provisioning op for `name`.
pub(super) fn provision_op(acts: &[Action], name: &str) -> OpId {
    let v: Vec<_> = provisions(acts)
        .into_iter()
        .filter(|p| p.1 == name)
        .collect();
    assert_eq!(v.len(), 1, "one provisioning for {name}: {acts:#?}");
    v[0].0
}

/// The secret written for `name` in this step, with the TaskRun it was written for.
pub(super) fn written<'a>(
    acts: &'a [Action],
    name: &str,
) -> Option<(&'a TaskRunRef, &'a SecretData)> {
    let v: Vec<_> = acts
        .iter()
        .filter_map(|a| match a {
            Action::WriteSecret { taskrun, secret } if taskrun.name() == name => {
                Some((taskrun, secret))
            }
            _ => None,
        })
        .collect();
    assert!(v.len() <= 1, "at most one secret per step: {v:?}");
    v.first().copied()
}

pub(super) fn secret<'a>(acts: &'a [Action], name: &str) -> Option<&'a SecretData> {
    written(acts, name).map(|(_, s)| s)
}

pub(super) fn error_of(acts: &[Action], name: &str) -> String {
    match secret(acts, name) {
        Some(SecretData::Error(m)) => m.clone(),
        other => panic!("expected an error secret for {name}, got {other:?}: {acts:#?}"),
    }
}

/// Launches: op and the `taskRunID` of the TaskRun it is for (`None` for a warm instance).
pub(super) fn launches(acts: &[Action]) -> Vec<(OpId, Option<String>)> {
    launch_ids(acts)
        .into_iter()
        .map(|(op, l)| {
            let taskrun = match &l.owner {
                LaunchOwner::TaskRun(t) => Some(t.id()),
                LaunchOwner::Warm(_) => None,
            };
            (op, taskrun)
        })
        .collect()
}

/// Launches with their identities.
pub(super) fn launch_ids(acts: &[Action]) -> Vec<(OpId, LaunchId)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Launch { op, launch, .. } => Some((*op, launch.clone())),
            _ => None,
        })
        .collect()
}

pub(super) fn probes(acts: &[Action]) -> Vec<(OpId, String)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Probe {
                op, instance_id, ..
            } => Some((*op, instance_id.to_string())),
            _ => None,
        })
        .collect()
}

pub(super) fn terminates(acts: &[Action]) -> Vec<(OpId, String)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Terminate {
                op, instance_id, ..
            } => Some((*op, instance_id.to_string())),
            _ => None,
        })
        .collect()
}

pub(super) fn deprovisions(acts: &[Action]) -> Vec<(OpId, String, String)> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Deprovision { op, user, host } => {
                Some((*op, user.name(), host.name().to_owned()))
            }
            _ => None,
        })
        .collect()
}

pub(super) fn finalized(acts: &[Action]) -> Vec<String> {
    acts.iter()
        .filter_map(|a| match a {
            Action::RemoveFinalizer { taskrun, .. } => Some(taskrun.name().to_string()),
            _ => None,
        })
        .collect()
}

pub(super) fn records<'a>(acts: &'a [Action], name: &str) -> Vec<&'a Placement> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Record { taskrun, placement } if taskrun.name() == name => Some(placement),
            _ => None,
        })
        .collect()
}

/// Drives one dynamic/pool instance from launch op to reachable; returns the probe-step actions.
pub(super) fn boot(h: &mut H, launch: OpId, id: &str) -> Vec<Action> {
    let a = h.send(Event::Launched {
        op: launch,
        instance_id: id.into(),
    });
    assert!(probes(&a).is_empty());
    let a = h.wait(20);
    let p = probes(&a);
    assert_eq!(p.len(), 1, "{a:#?}");
    h.send(Event::Probed {
        op: p[0].0,
        result: ProbeResult::Reachable {
            address: format!("192.0.2.{}", id.len()),
        },
    })
}
