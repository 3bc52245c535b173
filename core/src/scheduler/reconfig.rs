//! Config replacement: applies to new work. Running allocations keep the host definition or
//! instance template they were made with; waiters are served by the new config. Capacity groups
//! are counted anew from the instances tracked now: a `max` lowered below what its members hold
//! terminates nothing, it only holds launches back until they are below it. A drain (a static
//! host's, a dynamic platform's or a pool's) is such a change too: nothing new goes there, what
//! runs finishes, and lifting it serves the platform's waiters in the same step.

use super::{Action, HostConfig, InstState, Mode, PlatformId, Scheduler, State, mode_of};

impl Scheduler {
    pub(super) fn apply_config(&mut self, config: HostConfig, out: &mut Vec<Action>) {
        self.config = config;
        if *self.additional_tags != *self.config.additional_instance_tags {
            self.additional_tags = self.config.additional_instance_tags.as_slice().into();
        }
        for platform in self
            .config
            .platforms()
            .into_iter()
            .cloned()
            .collect::<Vec<_>>()
        {
            self.platform_id(&platform);
        }
        let groups = self.group_defs();
        self.instances.configure_groups(groups);
        self.apply_hosts();
        for p in 0..self.platforms.len() as PlatformId {
            let new = mode_of(&self.config, &self.platforms[p as usize].platform);
            if new != self.platforms[p as usize].mode {
                self.change_mode(p, new, out);
            }
        }
        self.unlist_unlistable(out);
        // Room a group gained (a higher max, a new member) goes round its members first.
        for g in 0..self.instances.groups().len() as super::groups::GroupId {
            self.serve_group(g, out);
        }
        for p in 0..self.platforms.len() as PlatformId {
            self.pump(p, out);
            self.ensure_warm(p, out);
        }
    }

    /// The config's capacity groups by platform id (every member has one: `apply_config` gives
    /// each platform of the config its id first).
    pub(super) fn group_defs(&self) -> Vec<super::groups::GroupDef> {
        self.config
            .capacity_groups
            .values()
            .map(|g| super::groups::GroupDef {
                name: g.name.as_str().into(),
                max: g.max,
                scope: g.scope,
                members: g
                    .members
                    .iter()
                    .filter_map(|m| self.platform_ids.get(m).copied())
                    .collect(),
            })
            .collect()
    }

    /// Upserts static hosts and rebuilds every platform's index of hosts with room.
    fn apply_hosts(&mut self) {
        let defs: Vec<_> = self
            .config
            .static_pools
            .values()
            .flat_map(|pool| pool.hosts.iter().cloned())
            .collect();
        let defs = defs
            .into_iter()
            .map(|def| {
                let p = self.platform_id(&def.platform);
                (def, p)
            })
            .collect();
        self.hosts.apply(defs);
    }

    fn change_mode(&mut self, p: PlatformId, new: Mode, out: &mut Vec<Action>) {
        let members: Vec<_> = self.instances.members(p).iter().copied().collect();
        for inst in members {
            let Some(i) = self.instances.get(inst) else {
                continue;
            };
            if i.pool.is_none() {
                continue;
            }
            match &new {
                // A drain keeps the machines but takes them out of service (below).
                Mode::Pool(pool) if pool.instance == *i.template && !pool.instance.drained => {
                    // Same machines: new concurrency, max-age and min-instances apply.
                    let at = i.created + pool.max_age;
                    let live = !matches!(
                        i.state,
                        InstState::Terminating(_) | InstState::TerminateWait
                    );
                    self.instances.update(inst, |i| i.pool = Some(pool.clone()));
                    if live && self.policy.pool_idle_timeout.is_some() {
                        self.timers.arm(at, super::Timer::MaxAge(inst));
                    }
                }
                _ => {
                    // Different machines, a drained pool, or no pool any more: drain the old
                    // ones (no new TaskRun; idle ones are terminated, busy ones once empty).
                    self.instances.update(inst, |i| i.draining = true);
                    self.settle(inst, out);
                }
            }
        }
        let routes_waiters = matches!(new, Mode::Local | Mode::Disabled(_) | Mode::Unknown);
        let ps = &mut self.platforms[p as usize];
        if listing_scope(&ps.mode) != listing_scope(&new) {
            // The last listing counted another tag or account: the next one counts anew.
            ps.foreign = 0;
        }
        ps.mode = new;
        if routes_waiters {
            let ps = &mut self.platforms[p as usize];
            let mut waiters: Vec<_> = std::mem::take(&mut ps.retry);
            waiters.extend(ps.queue.drain_all().into_iter().map(|e| e.taskrun));
            for key in waiters {
                if matches!(
                    self.taskruns.get(key).map(|t| (&t.state, t.platform)),
                    Some((State::Waiting { .. }, tp)) if tp == p
                ) {
                    self.admit(key, false, out);
                }
            }
        }
    }
}

/// What a platform's listing covers: (region, credentials Secret, instance tag).
fn listing_scope(mode: &Mode) -> Option<(&str, &str, &str)> {
    let t = match mode {
        Mode::Dynamic(t) => &**t,
        Mode::Pool(pool) => &pool.instance,
        _ => return None,
    };
    Some((&t.region, &t.aws_secret, &t.instance_tag))
}
