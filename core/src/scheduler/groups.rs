//! Capacity groups (`capacity-group.<g>.*`, see `crate::config`): a limit on instances shared by
//! several dynamic platforms and pools. The fleet owns the index ([`Groups`] is a field of
//! `Fleet`): an instance entry counts for its platform's groups from the call that tracks it to
//! the call that forgets it, exactly as it counts against its platform's `max-instances`, so the
//! two counts can never drift apart.
//!
//! Only launches are held back ([`super::Scheduler::group_room`], read by the strategies and
//! `has_room`): an instance that already exists (recovered, adopted from a TaskRun, an orphan
//! found by a listing) is tracked whatever the limit says, and a limit lowered by a new config
//! terminates nothing. Both may leave a group above its `max`; what is above it then is its
//! *tolerance*, which only shrinks as instances go, so the state invariant is exact: tolerance
//! equals in-use minus max (or zero) at every step, and a launch past the limit breaks it
//! ([`Invariant::GroupLimit`]).
//!
//! Fairness: room a group gets back is handed on round-robin across its member platforms with
//! waiters (`handoff::serve_group`), one placement per member per turn, starting after the member
//! served last; the turn is kept here with the group.

use std::sync::Arc;

use super::PlatformId;
use super::invariant::{Invariant, StateError, ensure};
use crate::config::GroupScope;

/// Index into the group table.
pub(super) type GroupId = u32;

static NO_GROUPS: Vec<GroupId> = Vec::new();

/// A group's definition as the scheduler uses it: platforms by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct GroupDef {
    pub(super) name: Arc<str>,
    pub(super) max: u32,
    pub(super) scope: GroupScope,
    /// Member platforms, in platform-id order.
    pub(super) members: Vec<PlatformId>,
}

#[derive(Debug)]
pub(super) struct Group {
    def: GroupDef,
    /// Instance entries of its members (leaked ones included).
    in_use: u32,
    /// How far `in_use` may be above `max`: what existed above it when it was set (a config
    /// lowering it, instances recovered or adopted); shrinks as instances go.
    tolerated: u32,
    /// Index in `members` of the member served first when room comes back.
    turn: usize,
}

impl Group {
    pub(super) fn def(&self) -> &GroupDef {
        &self.def
    }

    /// This cluster's instances of its members.
    pub(super) fn in_use(&self) -> u32 {
        self.in_use
    }

    pub(super) fn turn(&self) -> usize {
        self.turn
    }

    fn settle(&mut self) {
        self.tolerated = self.tolerated.min(self.in_use.saturating_sub(self.def.max));
    }
}

/// The groups and, per platform, the groups it is in.
#[derive(Debug, Default)]
pub(super) struct Groups {
    groups: Vec<Group>,
    /// By platform id; platforms past the end are in no group.
    of: Vec<Vec<GroupId>>,
}

impl Groups {
    /// Installs the definitions of a config and counts each group anew from `counted` (a
    /// platform's instance entries). What is above a limit now is tolerated; a group that keeps
    /// its name keeps its turn.
    pub(super) fn configure(&mut self, defs: Vec<GroupDef>, counted: impl Fn(PlatformId) -> u32) {
        let old = std::mem::take(&mut self.groups);
        self.of.clear();
        for (g, def) in defs.into_iter().enumerate() {
            for &p in &def.members {
                let i = p as usize;
                if self.of.len() <= i {
                    self.of.resize_with(i + 1, Vec::new);
                }
                self.of[i].push(g as GroupId);
            }
            let in_use = def.members.iter().map(|&p| counted(p)).sum::<u32>();
            let turn = old
                .iter()
                .find(|o| o.def.name == def.name)
                .map_or(0, |o| o.turn % def.members.len().max(1));
            self.groups.push(Group {
                tolerated: in_use.saturating_sub(def.max),
                in_use,
                turn,
                def,
            });
        }
    }

    /// The groups platform `p` is in.
    pub(super) fn of(&self, p: PlatformId) -> &[GroupId] {
        self.of.get(p as usize).unwrap_or(&NO_GROUPS)
    }

    pub(super) fn get(&self, g: GroupId) -> &Group {
        &self.groups[g as usize]
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (GroupId, &Group)> {
        self.groups
            .iter()
            .enumerate()
            .map(|(g, x)| (g as GroupId, x))
    }

    pub(super) fn len(&self) -> usize {
        self.groups.len()
    }

    /// An instance entry of `p` is tracked: a launch (`existing` false) or one that already ran
    /// (recovered, adopted, an orphan), which raises the tolerance by what it puts above a limit.
    pub(super) fn counted_up(&mut self, p: PlatformId, existing: bool) {
        for &g in self.of.get(p as usize).unwrap_or(&NO_GROUPS) {
            let group = &mut self.groups[g as usize];
            group.in_use += 1;
            if existing {
                group.tolerated = group.in_use.saturating_sub(group.def.max);
            }
        }
    }

    /// An instance entry of `p` is forgotten.
    pub(super) fn counted_down(&mut self, p: PlatformId) {
        for &g in self.of.get(p as usize).unwrap_or(&NO_GROUPS) {
            let group = &mut self.groups[g as usize];
            group.in_use = group.in_use.saturating_sub(1);
            group.settle();
        }
    }

    /// Member `served` (an index into its members) was served: the next turn starts after it.
    pub(super) fn served(&mut self, g: GroupId, served: usize) {
        let group = &mut self.groups[g as usize];
        group.turn = (served + 1) % group.def.members.len().max(1);
    }

    /// The definitions are `want`, each group's count is its members' `counted`, and its
    /// tolerance is exactly what is above its limit.
    pub(super) fn check(
        &self,
        want: &[GroupDef],
        counted: impl Fn(PlatformId) -> u32,
    ) -> Vec<StateError> {
        let mut found = Vec::new();
        let mut members = |ok: bool, detail: &dyn Fn() -> String| {
            if let Err(e) = ensure(ok, Invariant::GroupMembers, detail) {
                found.push(e);
                true
            } else {
                false
            }
        };
        let have: Vec<&GroupDef> = self.groups.iter().map(|g| &g.def).collect();
        let want_refs: Vec<&GroupDef> = want.iter().collect();
        let mut broken = members(have == want_refs, &|| {
            format!("groups {have:?}, the config says {want:?}")
        });
        let mut of: Vec<Vec<GroupId>> = Vec::new();
        for (g, group) in self.groups.iter().enumerate() {
            for &p in &group.def.members {
                if of.len() <= p as usize {
                    of.resize_with(p as usize + 1, Vec::new);
                }
                of[p as usize].push(g as GroupId);
            }
        }
        let n = of.len().max(self.of.len());
        for p in 0..n {
            if broken {
                break;
            }
            let mine = self.of(p as PlatformId);
            let theirs = of.get(p).map_or(&[][..], |v| v.as_slice());
            broken = members(mine == theirs, &|| {
                format!(
                    "platform {p} is indexed in groups {mine:?}, the groups name it in {theirs:?}"
                )
            });
        }
        for group in &self.groups {
            let recount = group.def.members.iter().map(|&p| counted(p)).sum::<u32>();
            if let Err(e) = ensure(group.in_use == recount, Invariant::GroupCount, || {
                format!(
                    "group {} counts {}, its members have {recount} instances",
                    group.def.name, group.in_use
                )
            }) {
                found.push(e);
                break;
            }
        }
        for group in &self.groups {
            let above = group.in_use.saturating_sub(group.def.max);
            if let Err(e) = ensure(group.tolerated == above, Invariant::GroupLimit, || {
                format!(
                    "group {} holds {} of max {} with {} tolerated: a launch went past its limit",
                    group.def.name, group.in_use, group.def.max, group.tolerated
                )
            }) {
                found.push(e);
                break;
            }
        }
        found
    }

    /// Test hook: miscounts group `g`.
    #[cfg(test)]
    pub(super) fn corrupt_count(&mut self, g: GroupId) {
        self.groups[g as usize].in_use += 1;
    }

    /// Test hook: tolerates one more instance above group `g`'s limit than it holds.
    #[cfg(test)]
    pub(super) fn corrupt_tolerated(&mut self, g: GroupId) {
        self.groups[g as usize].tolerated += 1;
    }

    /// Test hook: forgets that platform `p` is in any group.
    #[cfg(test)]
    pub(super) fn corrupt_of(&mut self, p: PlatformId) {
        if let Some(v) = self.of.get_mut(p as usize) {
            v.clear();
        }
    }
}
