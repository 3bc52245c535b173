//! Capacity groups: a limit shared by several platforms (first of all a subnet's addresses,
//! Konflux's `aws-ip`).
//!
//! Keys (ours; the Go controller reads neither: it looks up `dynamic.<label>.<field>` by name and
//! walks only `host.*` keys):
//! - `capacity-group.<g>.max: N` (1..=100000, required) defines group `g`;
//! - `capacity-group.<g>.scope: cluster | account` (default `cluster`): what counts against it;
//! - `dynamic.<label>.capacity-group: g1,g2` makes a dynamic platform or dynamic pool a member
//!   (a platform may be in several groups; it launches only while every one has room).
//!
//! The unit is what a member's own `max-instances` counts: one cloud instance, from its launch
//! request until its termination is acknowledged (leaked ones included: they still hold their
//! address). A pool instance is one unit however many TaskRuns share it. A group has room while
//! the sum over its members is below `max`; with `scope: account` the members' foreign instances
//! (other clusters' with the same tag, in the same account and region, as the members' last
//! listings showed: the `max-instances` bill guard's count) are added, so clusters sharing a
//! subnet share the limit (with the bill guard's slack: launches others made since the last
//! listing are unseen, and a retry of a failed launch keeps the unit its first try took; members
//! that share one instance tag see each other's instances as foreign, counted twice, which only
//! holds launches back). Only launches are held back: a TaskRun joining a pool instance with
//! room takes no unit. Room a group gets back is handed round-robin across its members with
//! waiters (the scheduler's `groups` module), so a small member is not starved by a busy one.
//!
//! Membership is the platform's as configured now: a config change recounts every group from the
//! instances tracked then (a platform that leaves a group stops counting for it at once, its
//! instances still running).
//!
//! Static hosts are not members, and `host.<h>.capacity-group` is ignored with a warning: a static
//! host holds its address (and whatever else it is) whether or not it builds, so a build on it
//! takes nothing a group limits. This is exactly what Kueue gets wrong today: its `aws-ip` CEL
//! charges every platform not on a hand-kept exception list, so static `linux/riscv64`,
//! `linux-large/s390x` and `linux/ppc64be` builds consume subnet addresses they never use. (A
//! `host.<h>.*` key for a host the Go controller cannot parse would also make Go reject every
//! static platform of the cluster.)
//!
//! A group with a bad or missing `max` or a bad name is left out (an error; its members are then
//! limited only by their own `max-instances`) and the last good config keeps its previous
//! definition; membership of a group that is not defined is an error and is ignored; a group
//! no platform names is a warning (it limits nothing).

use std::collections::{BTreeMap, BTreeSet};

use super::entry::Sink;
use super::{CapacityGroup, GroupScope, MAX_GROUP_LIMIT, values};
use crate::platform::Platform;

/// The member field of a `dynamic.<label>.*` group.
pub(super) const MEMBER_FIELD: &str = "capacity-group";

/// `capacity-group.<g>.<field>` keys, grouped by group name.
pub(super) type GroupKeys<'a> = BTreeMap<&'a str, BTreeMap<&'a str, &'a str>>;

/// A group name is a DNS-1123 label, so it is a valid Kueue resource and metric label value as
/// it stands.
fn valid_name(name: &str) -> bool {
    crate::platform::is_dns1123_label(name)
}

/// Parses the group definitions (no members yet).
pub(super) fn parse_groups(keys: &GroupKeys, sink: &mut Sink) -> BTreeMap<String, CapacityGroup> {
    let mut groups = BTreeMap::new();
    for (name, fields) in keys {
        let key = |field: &str| format!("capacity-group.{name}.{field}");
        if !valid_name(name) {
            let first = fields.keys().next().copied().unwrap_or("max");
            sink.error(
                &key(first),
                None,
                format!(
                    "group name {name:?} is not a DNS label (lowercase letters, digits and '-', at \
                     most 63); the group is left out"
                ),
            );
            continue;
        }
        for (field, value) in fields {
            if !["max", "scope"].contains(field) {
                sink.warn(
                    &key(field),
                    Some(value),
                    "unknown field, ignored by this version (expected max or scope)",
                );
            }
        }
        let max = match fields.get("max") {
            None => {
                sink.error(
                    &key("max"),
                    None,
                    format!(
                        "missing: group {name} is left out (its members are limited only by their \
                         own max-instances)"
                    ),
                );
                continue;
            }
            Some(v) => match values::parse_u32_in(v, 1, MAX_GROUP_LIMIT) {
                Ok(n) => n,
                Err(e) => {
                    sink.error(
                        &key("max"),
                        Some(v),
                        format!(
                            "{e}; group {name} is left out (its members are limited only by their \
                             own max-instances)"
                        ),
                    );
                    continue;
                }
            },
        };
        let scope = match fields.get("scope").map(|v| v.trim()) {
            None | Some("cluster") => GroupScope::Cluster,
            Some("account") => GroupScope::Account,
            Some(v) => {
                sink.error(
                    &key("scope"),
                    Some(v),
                    "expected \"cluster\" or \"account\"; using cluster",
                );
                GroupScope::Cluster
            }
        };
        groups.insert(
            (*name).to_owned(),
            CapacityGroup {
                name: (*name).to_owned(),
                max,
                scope,
                members: BTreeSet::new(),
            },
        );
    }
    groups
}

/// Adds `platform` (served, dynamic or pool) to the groups its `capacity-group` value names.
pub(super) fn join(
    groups: &mut BTreeMap<String, CapacityGroup>,
    defined: &GroupKeys,
    platform: &Platform,
    key: &str,
    value: &str,
    sink: &mut Sink,
) {
    let mut any = false;
    for g in values::split_list(value) {
        any = true;
        if let Some(group) = groups.get_mut(g) {
            if !group.members.insert(platform.clone()) {
                sink.warn(key, Some(g), "named twice");
            }
        } else if !defined.contains_key(g) {
            sink.error(
                key,
                Some(g),
                format!(
                    "no group {g} is defined (capacity-group.{g}.max); {platform} is not limited \
                     by it"
                ),
            );
        }
        // A defined group with errors was reported at its own keys.
    }
    if !any {
        sink.warn(key, Some(value), "names no group");
    }
}

/// Warns about groups no platform names.
pub(super) fn warn_empty(groups: &BTreeMap<String, CapacityGroup>, sink: &mut Sink) {
    for g in groups.values().filter(|g| g.members.is_empty()) {
        sink.warn(
            &format!("capacity-group.{}.max", g.name),
            None,
            format!(
                "no served dynamic platform or pool names group {} (dynamic.<label>.capacity-group); \
                 it limits nothing",
                g.name
            ),
        );
    }
}

/// The warning for `host.<h>.capacity-group`.
pub(super) fn static_member(key: &str, value: &str, sink: &mut Sink) {
    sink.warn(
        key,
        Some(value),
        "ignored: static hosts are not members of capacity groups (a static host holds its \
         address whether or not it builds, so its builds take nothing a group limits)",
    );
}

/// Leaves out (with an error) a group named like a platform's Kueue resource: `mpc kueue-quotas`
/// exports both under their names, which must differ.
pub(super) fn refuse_platform_names(
    groups: &mut BTreeMap<String, CapacityGroup>,
    platforms: &BTreeSet<&Platform>,
    sink: &mut Sink,
) {
    groups.retain(|name, _| {
        let clash = platforms.iter().find(|p| {
            let label = p.label_value();
            label == *name || label.replace('_', "-") == *name
        });
        if let Some(p) = clash {
            sink.error(
                &format!("capacity-group.{name}.max"),
                None,
                format!(
                    "group {name} has the Kueue resource name of platform {p}; the group is left out \
                     (choose another name)"
                ),
            );
        }
        clash.is_none()
    });
}
