//! Gauges for the metrics (recomputed from scratch on each call: the `running_tasks` and
//! `waiting_tasks` gauges are reset each pass) and the ledger's memory accounting.

use std::collections::BTreeMap;

use super::{InstState, Scheduler, State};

/// Per-platform gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlatformGauges {
    /// Queued TaskRuns.
    pub waiting: u32,
    /// TaskRuns holding a host or instance (any phase).
    pub running: u32,
    /// Instances counted against `max-instances` (leaked ones included).
    pub instances: u32,
    /// Live instances others run with the platform's instance tag (other clusters, the Go
    /// controller, other platforms sharing the tag), as of the last listing; they count against
    /// `max-instances` too.
    pub foreign: u32,
    /// Instances launching or booting.
    pub booting: u32,
    /// Instances being terminated (counted).
    pub terminating: u32,
    /// Instances whose termination kept failing: still retried, still counted (in `instances`,
    /// not in `terminating`).
    pub leaked: u32,
    /// Slots held for terminated instances whose dedicated host is still scrubbed (counted
    /// against `max-instances` until the scrub ends).
    pub scrubbing: u32,
    /// Concurrent TaskRuns the platform can serve (`platform_pool_size`).
    pub capacity: Option<u32>,
    /// Its listing failed at recovery and none has succeeded since: nothing is launched,
    /// terminated or finalized for it, and `held` of its TaskRuns wait as recorded.
    pub unlisted: bool,
    /// TaskRuns held as recorded while the platform is unlisted.
    pub held: u32,
    /// When the longest-waiting queued TaskRun joined the queue.
    pub oldest_queued: Option<super::Time>,
}

/// Per capacity group gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupGauges {
    /// Its `max`.
    pub limit: u32,
    /// Units it holds: its members' instances (leaked ones included), and with `scope: account`
    /// their foreign ones as listed. May exceed `limit` after the limit was lowered or instances
    /// were recovered; nothing is launched for a member until it is below.
    pub in_use: u32,
    /// TaskRuns queued for its members (whatever holds each one back).
    pub waiting: u32,
}

/// All gauges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gauges {
    /// By platform (as written).
    pub platforms: BTreeMap<String, PlatformGauges>,
    /// By capacity group name.
    pub groups: BTreeMap<String, GroupGauges>,
    /// `(platform, namespace)` → (waiting, running).
    pub by_namespace: BTreeMap<(String, String), (u32, u32)>,
}

/// Bytes the ledger holds, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LedgerSize {
    /// Tracked TaskRuns.
    pub taskruns: usize,
    /// TaskRun slots (including free ones) × slot size.
    pub taskrun_slots: usize,
    /// UID index buffer.
    pub uid_index: usize,
    /// Queue buffers.
    pub queues: usize,
}

impl Scheduler {
    /// Current gauges. Linear in tracked TaskRuns; call once per metrics pass.
    pub fn gauges(&self) -> Gauges {
        let mut g = Gauges::default();
        for (p, ps) in self.platforms.iter().enumerate() {
            let p = p as super::PlatformId;
            let mut pg = PlatformGauges {
                instances: self.instances.counted(p),
                foreign: ps.foreign,
                scrubbing: self.instances.scrubbing(p),
                capacity: self.config.capacity(&ps.platform),
                unlisted: ps.unlisted,
                ..Default::default()
            };
            for i in self
                .instances
                .members(p)
                .iter()
                .filter_map(|k| self.instances.get(*k))
            {
                match i.state {
                    InstState::LaunchWait | InstState::Launching(_) | InstState::Booting => {
                        pg.booting += 1
                    }
                    InstState::Terminating(_) | InstState::TerminateWait if i.leaked() => {
                        pg.leaked += 1
                    }
                    InstState::Terminating(_) | InstState::TerminateWait => pg.terminating += 1,
                    InstState::Ready => {}
                }
            }
            g.platforms.insert(ps.platform.as_str().to_owned(), pg);
        }
        for held in self.held.values() {
            let ps = &self.platforms[held.platform as usize];
            if let Some(pg) = g.platforms.get_mut(ps.platform.as_str()) {
                pg.held += 1;
            }
        }
        for (_, t) in self.taskruns.iter() {
            if t.platform == super::NO_PLATFORM {
                continue;
            }
            let (w, r) = match t.state {
                State::Waiting { .. } => (1, 0),
                State::OnHost { .. } | State::OnInstance { .. } => (0, 1),
                _ => continue,
            };
            let ps = &self.platforms[t.platform as usize];
            let e = g
                .platforms
                .entry(ps.platform.as_str().to_owned())
                .or_default();
            e.waiting += w;
            e.running += r;
            if w == 1 {
                e.oldest_queued = Some(e.oldest_queued.map_or(t.queued, |o| o.min(t.queued)));
            }
            let n = g
                .by_namespace
                .entry((
                    ps.platform.as_str().to_owned(),
                    self.taskruns.namespace(t.ns).to_string(),
                ))
                .or_default();
            n.0 += w;
            n.1 += r;
        }
        for (gid, group) in self.instances.groups().iter() {
            let def = group.def();
            let waiting = def
                .members
                .iter()
                .filter_map(|&m| {
                    g.platforms
                        .get(self.platforms[m as usize].platform.as_str())
                })
                .map(|pg| pg.waiting)
                .sum();
            g.groups.insert(
                def.name.to_string(),
                GroupGauges {
                    limit: def.max,
                    in_use: self.group_in_use(gid),
                    waiting,
                },
            );
        }
        g
    }

    /// Number of tracked TaskRuns.
    pub fn tracked(&self) -> usize {
        self.taskruns.len()
    }

    /// Whether the TaskRun with this UID is tracked (allocated, queued, or being cleaned up).
    pub fn tracks(&self, uid: &str) -> bool {
        self.taskruns.find(&super::Uid::new(uid)).is_some()
    }

    /// Directly held buffer sizes of the per-TaskRun structures (heap strings excluded; measure
    /// those with an allocator, as the memory benchmark does).
    pub fn ledger_size(&self) -> LedgerSize {
        LedgerSize {
            taskruns: self.taskruns.len(),
            taskrun_slots: self.taskruns.capacity_bytes(),
            uid_index: self.taskruns.uid_index_bytes(),
            queues: self
                .platforms
                .iter()
                .map(|p| p.queue.capacity_bytes() + p.retry.capacity() * 8)
                .sum(),
        }
    }
}
