//! The cluster-side controllers a real control plane runs and clients rely on: the garbage
//! collector (ownerReferences; background, foreground and orphan propagation), the namespace
//! controller (a deleted namespace empties, then goes) and CRD cleanup (a deleted CRD's custom
//! resources are deleted before the CRD goes).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::Shared;
use super::meta::{self, CRD_CLEANUP_FINALIZER, FOREGROUND_FINALIZER, ORPHAN_FINALIZER};
use super::ops::{DeleteOpts, WriteOpts};
use super::resources::ResourceDef;
use super::store::{EventType, ObjKey, Store, StoreError};

type Loc = (String, ObjKey);

fn owner_uids(obj: &Value) -> Vec<String> {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["uid"].as_str().map(str::to_owned))
        .collect()
}

#[derive(Default)]
struct State {
    /// owner uid → dependents.
    dependents: HashMap<String, BTreeSet<Loc>>,
    /// dependent → owner uids it was indexed under.
    owners: HashMap<Loc, Vec<String>>,
    terminating_namespaces: BTreeSet<String>,
    deleting_crds: BTreeSet<String>,
    deleting_owners: BTreeSet<String>,
    /// Dependents with a reference to a kind the server does not serve: looked at again when the
    /// served kinds change (the garbage collector retries them).
    unresolved: BTreeSet<Loc>,
}

impl State {
    fn index(&mut self, loc: Loc, obj: Option<&Value>) {
        if let Some(old) = self.owners.remove(&loc) {
            for u in old {
                if let Some(set) = self.dependents.get_mut(&u) {
                    set.remove(&loc);
                    if set.is_empty() {
                        self.dependents.remove(&u);
                    }
                }
            }
        }
        let Some(obj) = obj else { return };
        let uids = owner_uids(obj);
        if uids.is_empty() {
            return;
        }
        for u in &uids {
            self.dependents
                .entry(u.clone())
                .or_default()
                .insert(loc.clone());
        }
        self.owners.insert(loc, uids);
    }

    fn observe(&mut self, storage: &str, obj: &Value, gone: bool) {
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let deleting = !gone && meta::is_deleting(obj);
        match storage {
            "core/namespaces" => {
                if deleting {
                    self.terminating_namespaces.insert(name.clone());
                } else {
                    self.terminating_namespaces.remove(&name);
                }
            }
            "apiextensions.k8s.io/customresourcedefinitions" => {
                if deleting {
                    self.deleting_crds.insert(name.clone());
                } else {
                    self.deleting_crds.remove(&name);
                }
            }
            _ => {}
        }
        if let Some(uid) = obj["metadata"]["uid"].as_str() {
            let f = meta::finalizers(obj);
            if deleting
                && f.iter()
                    .any(|x| x == ORPHAN_FINALIZER || x == FOREGROUND_FINALIZER)
            {
                self.deleting_owners.insert(uid.to_owned());
            } else {
                self.deleting_owners.remove(uid);
            }
        }
    }
}

/// Runs the controllers until `cancel` fires.
pub(crate) async fn run(shared: Arc<Shared>, cancel: CancellationToken) {
    let mut changed = shared.changed.subscribe();
    let mut state = State::default();
    let mut cursor: Option<u64> = None;
    loop {
        changed.borrow_and_update();
        let mut check: BTreeSet<Loc> = BTreeSet::new();
        let batch = cursor.map(|c| {
            let s = shared.lock();
            s.events_after(c).map(|e| (e, s.current_rv()))
        });
        match batch {
            Some(Ok((events, current))) => {
                for ev in events {
                    if &*ev.storage == "apiextensions.k8s.io/customresourcedefinitions" {
                        check.extend(std::mem::take(&mut state.unresolved));
                    }
                    let loc: Loc = (ev.storage.to_string(), ev.key.clone());
                    let gone = ev.kind == EventType::Deleted;
                    // Everything these controllers look at is in the metadata.
                    let object = ev.object.metadata();
                    state.index(loc.clone(), (!gone).then_some(&object));
                    state.observe(&ev.storage, &object, gone);
                    if gone {
                        if let Some(uid) = object["metadata"]["uid"].as_str()
                            && let Some(deps) = state.dependents.get(uid)
                        {
                            check.extend(deps.iter().cloned());
                        }
                    } else if !owner_uids(&object).is_empty() {
                        check.insert(loc);
                    }
                }
                cursor = Some(current);
            }
            Some(Err(StoreError::Gone { .. })) | None => {
                // First run, or we fell behind the history: rebuild from the full state.
                state = State::default();
                let (current, all) = {
                    let s = shared.lock();
                    let all: Vec<_> = shared
                        .registry()
                        .storages()
                        .into_iter()
                        .map(|storage| {
                            let objs = s.list_encoded(&storage, None);
                            (storage, objs)
                        })
                        .collect();
                    (s.current_rv(), all)
                };
                for (storage, objs) in all {
                    for (k, o) in objs {
                        let o = o.metadata();
                        state.index((storage.clone(), k.clone()), Some(&o));
                        state.observe(&storage, &o, false);
                        if !owner_uids(&o).is_empty() {
                            check.insert((storage.clone(), k));
                        }
                    }
                }
                cursor = Some(current);
            }
            Some(Err(_)) => {}
        }
        for loc in check {
            let has_dependents =
                uid_at(&shared, &loc).is_some_and(|u| state.dependents.contains_key(&u));
            if check_dependent(&shared, &loc, has_dependents).await == Verdict::Unresolved {
                state.unresolved.insert(loc);
            }
        }
        for uid in state.deleting_owners.clone() {
            let deps: Vec<Loc> = state
                .dependents
                .get(&uid)
                .map(|d| d.iter().cloned().collect())
                .unwrap_or_default();
            let owners: HashSet<String> = state.dependents.keys().cloned().collect();
            process_owner(&shared, &uid, &deps, &owners).await;
        }
        for ns in state.terminating_namespaces.clone() {
            process_namespace(&shared, &ns).await;
        }
        for crd in state.deleting_crds.clone() {
            process_crd(&shared, &crd).await;
        }
        let pending = !state.deleting_owners.is_empty()
            || !state.terminating_namespaces.is_empty()
            || !state.deleting_crds.is_empty();
        tokio::select! {
            () = cancel.cancelled() => return,
            r = changed.changed() => if r.is_err() { return },
            // Deletions in progress are re-examined periodically as well.
            () = tokio::time::sleep(Duration::from_millis(500)), if pending => {}
        }
    }
}

fn def_for(shared: &Shared, storage: &str) -> Option<Arc<ResourceDef>> {
    shared.registry().preferred(storage)
}

async fn delete_background(shared: &Arc<Shared>, loc: &Loc) {
    delete_dependent(shared, loc, "Background").await;
}

async fn delete_dependent(shared: &Arc<Shared>, loc: &Loc, policy: &str) {
    let Some(def) = def_for(shared, &loc.0) else {
        return;
    };
    let (ns, name) = &loc.1;
    let ns = (!ns.is_empty()).then_some(ns.as_str());
    let opts = DeleteOpts {
        propagation: Some(policy.into()),
        ..DeleteOpts::default()
    };
    if let Err(e) = shared
        .delete(&def, ns, name, &opts, &WriteOpts::internal())
        .await
        && e.code != 404
    {
        tracing::warn!(storage = %loc.0, %name, error = %e.message, "garbage collection delete failed");
    }
}

async fn remove_owner_refs(shared: &Arc<Shared>, loc: &Loc, drop: &HashSet<String>) {
    let Some(def) = def_for(shared, &loc.0) else {
        return;
    };
    let (ns, name) = &loc.1;
    let ns = (!ns.is_empty()).then_some(ns.as_str());
    let r = shared
        .update_with(&def, ns, name, |old| {
            let mut o = old.clone();
            if let Some(refs) = o["metadata"]["ownerReferences"].as_array_mut() {
                refs.retain(|r| !r["uid"].as_str().is_some_and(|u| drop.contains(u)));
                if refs.is_empty()
                    && let Some(m) = o["metadata"].as_object_mut()
                {
                    m.remove("ownerReferences");
                }
            }
            Ok(o)
        })
        .await;
    if let Err(e) = r
        && e.code != 404
    {
        tracing::warn!(%name, error = %e.message, "removing owner references failed");
    }
}

/// How the garbage collector sees one ownerReference: the owner is looked up by `apiVersion`,
/// `kind` and `name` (in the dependent's namespace when the kind is namespaced, at cluster scope
/// otherwise) and is live only if it has the referenced `uid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OwnerState {
    Solid,
    /// Live but being deleted in the foreground.
    Waiting,
    Dangling,
    /// The kind is not served (or a cluster-scoped dependent names a namespaced kind): the
    /// garbage collector cannot judge it and leaves the dependent alone.
    Unresolvable,
}

/// Resolves the kind of every reference; `None` for kinds not served.
fn owner_defs(shared: &Shared, obj: &Value) -> Vec<(Value, Option<Arc<ResourceDef>>)> {
    let reg = shared.registry();
    obj["metadata"]["ownerReferences"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let (g, v) = super::split_api_version(r["apiVersion"].as_str().unwrap_or_default());
            let def = reg.find_kind(g, v, r["kind"].as_str().unwrap_or_default());
            (r.clone(), def)
        })
        .collect()
}

fn owner_state(
    store: &Store,
    dependent_ns: &str,
    r: &Value,
    def: Option<&ResourceDef>,
) -> OwnerState {
    let Some(def) = def else {
        return OwnerState::Unresolvable;
    };
    if def.namespaced && dependent_ns.is_empty() {
        return OwnerState::Unresolvable;
    }
    let ns = if def.namespaced { dependent_ns } else { "" };
    let name = r["name"].as_str().unwrap_or_default();
    let owner = store.get_encoded(&def.storage, &(ns.to_owned(), name.to_owned()));
    match owner.map(|o| o.metadata()) {
        Some(o) if o["metadata"]["uid"] == r["uid"] => {
            if meta::is_deleting(&o)
                && meta::finalizers(&o)
                    .iter()
                    .any(|f| f == FOREGROUND_FINALIZER)
            {
                OwnerState::Waiting
            } else {
                OwnerState::Solid
            }
        }
        _ => OwnerState::Dangling,
    }
}

fn uid_at(shared: &Shared, loc: &Loc) -> Option<String> {
    let o = shared.lock().get_encoded(&loc.0, &loc.1)?;
    o.metadata()["metadata"]["uid"].as_str().map(str::to_owned)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Done,
    Unresolved,
}

/// The garbage collector's decision for one dependent (`attemptToDeleteItem`): with a live owner,
/// references to missing owners and to owners deleted in the foreground are removed; with none,
/// the dependent is deleted (in the foreground if an owner waits for it and it has dependents of
/// its own).
async fn check_dependent(shared: &Arc<Shared>, loc: &Loc, has_dependents: bool) -> Verdict {
    let Some(obj) = shared.lock().get_encoded(&loc.0, &loc.1) else {
        return Verdict::Done;
    };
    // What the garbage collector looks at is all in the metadata.
    let obj = obj.metadata();
    if meta::is_deleting(&obj) {
        return Verdict::Done;
    }
    let defs = owner_defs(shared, &obj);
    if defs.is_empty() {
        return Verdict::Done;
    }
    let states: Vec<(String, OwnerState)> = {
        let store = shared.lock();
        defs.iter()
            .map(|(r, def)| {
                let uid = r["uid"].as_str().unwrap_or_default().to_owned();
                (uid, owner_state(&store, &loc.1.0, r, def.as_deref()))
            })
            .collect()
    };
    let is = |want: OwnerState| states.iter().filter(move |(_, s)| *s == want);
    if is(OwnerState::Unresolvable).next().is_some() {
        return Verdict::Unresolved;
    }
    if is(OwnerState::Solid).next().is_some() {
        let drop: HashSet<String> = is(OwnerState::Dangling)
            .chain(is(OwnerState::Waiting))
            .map(|(u, _)| u.clone())
            .collect();
        if !drop.is_empty() {
            remove_owner_refs(shared, loc, &drop).await;
        }
    } else if is(OwnerState::Waiting).next().is_some() && has_dependents {
        delete_dependent(shared, loc, "Foreground").await;
    } else {
        delete_dependent(shared, loc, "Background").await;
    }
    Verdict::Done
}

/// Orphan and foreground propagation for an owner being deleted.
async fn process_owner(
    shared: &Arc<Shared>,
    uid: &str,
    deps: &[Loc],
    dependents_of: &HashSet<String>,
) {
    let (loc, obj) = {
        let s = shared.lock();
        let Some((st, k)) = s.locate_uid(uid) else {
            return;
        };
        let Some(o) = s.get_encoded(&st, &k) else {
            return;
        };
        ((st, k), o)
    };
    let obj = obj.metadata();
    let fins = meta::finalizers(&obj);
    let mut done: Vec<&str> = Vec::new();
    if fins.iter().any(|f| f == ORPHAN_FINALIZER) {
        let drop: HashSet<String> = [uid.to_owned()].into();
        for d in deps {
            remove_owner_refs(shared, d, &drop).await;
        }
        done.push(ORPHAN_FINALIZER);
    }
    if fins.iter().any(|f| f == FOREGROUND_FINALIZER) {
        for d in deps {
            let has_dependents = uid_at(shared, d).is_some_and(|u| dependents_of.contains(&u));
            check_dependent(shared, d, has_dependents).await;
        }
        // The owner goes once no dependent that still refers to it blocks its deletion.
        let blocking = deps.iter().any(|d| blocks_owner(shared, d, uid));
        if !blocking {
            done.push(FOREGROUND_FINALIZER);
        }
    }
    if done.is_empty() {
        return;
    }
    let Some(def) = def_for(shared, &loc.0) else {
        return;
    };
    let (ns, name) = &loc.1;
    let ns = (!ns.is_empty()).then_some(ns.as_str());
    let _ = shared
        .update_with(&def, ns, name, |old| {
            let mut o = old.clone();
            let f: Vec<String> = meta::finalizers(old)
                .into_iter()
                .filter(|f| !done.contains(&f.as_str()))
                .collect();
            meta::set_finalizers(&mut o, &f);
            Ok(o)
        })
        .await;
}

/// Whether the dependent at `loc` still holds a `blockOwnerDeletion` reference that resolves to
/// the owner with `uid`.
fn blocks_owner(shared: &Shared, loc: &Loc, uid: &str) -> bool {
    let Some(dep) = shared.lock().get_encoded(&loc.0, &loc.1) else {
        return false;
    };
    let dep = dep.metadata();
    let defs = owner_defs(shared, &dep);
    let store = shared.lock();
    defs.iter().any(|(r, def)| {
        r["uid"].as_str() == Some(uid)
            && r["blockOwnerDeletion"].as_bool() == Some(true)
            && owner_state(&store, &loc.1.0, r, def.as_deref()) == OwnerState::Waiting
    })
}

/// Deletes a terminating namespace's content, then the namespace.
async fn process_namespace(shared: &Arc<Shared>, ns: &str) {
    let storages: Vec<String> = shared
        .registry()
        .storages()
        .into_iter()
        .filter(|s| def_for(shared, s).is_some_and(|d| d.namespaced))
        .collect();
    let mut remaining = 0;
    for storage in &storages {
        let objs = shared.lock().list_encoded(storage, Some(ns));
        remaining += objs.len();
        for (k, o) in objs {
            if !meta::is_deleting(&o.metadata()) {
                delete_background(shared, &(storage.clone(), k)).await;
            }
        }
    }
    if remaining > 0 {
        return;
    }
    let key: ObjKey = (String::new(), ns.to_owned());
    let mut s = shared.lock();
    let Some(obj) = s.get("core/namespaces", &key) else {
        return;
    };
    if !meta::is_deleting(&obj) {
        return;
    }
    let mut last = (*obj).clone();
    last["spec"]["finalizers"] = Value::Array(Vec::new());
    let rv: Option<u64> = obj["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|r| r.parse().ok());
    let r = if meta::finalizers(&obj).is_empty() {
        s.delete("core/namespaces", &key, Some(last), rv)
    } else {
        s.update("core/namespaces", &key, last, rv)
    };
    if r.is_ok() {
        let cur = s.current_rv();
        drop(s);
        shared.notify(cur);
    }
}

/// Deletes a deleted CRD's custom resources, then releases the CRD.
async fn process_crd(shared: &Arc<Shared>, crd_name: &str) {
    let Some((plural, group)) = crd_name.split_once('.') else {
        return;
    };
    let storage = format!("{group}/{plural}");
    let objs = shared.lock().list_encoded(&storage, None);
    let remaining = objs.len();
    for (k, o) in objs {
        if !meta::is_deleting(&o.metadata()) {
            delete_background(shared, &(storage.clone(), k)).await;
        }
    }
    if remaining > 0 {
        return;
    }
    let Some(def) = def_for(shared, "apiextensions.k8s.io/customresourcedefinitions") else {
        return;
    };
    let _ = shared
        .update_with(&def, None, crd_name, |old| {
            let mut o = old.clone();
            let f: Vec<String> = meta::finalizers(old)
                .into_iter()
                .filter(|f| f != CRD_CLEANUP_FINALIZER)
                .collect();
            meta::set_finalizers(&mut o, &f);
            Ok(o)
        })
        .await;
}
