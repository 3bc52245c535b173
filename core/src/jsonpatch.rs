//! JSON Patch (RFC 6902) for a TaskRun: the one builder of the webhook's patches
//! ([`crate::admission`]) and of the controller's TaskRun writes (the `mpc` crate's
//! `controller::patch`), so the two write labels, annotations and our finalizer by the same rules.
//!
//! Two ways to set map entries, for two situations: [`Patch::set_entry`] when the object is at
//! hand (the webhook holds it: a missing map is created with the entry in it), and
//! [`Patch::write_entries`] when it is not (the controller writes without reading first: a
//! removal is `add ""` then `remove`, which succeeds whether or not the key exists).

use std::borrow::Cow;

use serde::Serialize;
use serde_json::{Value, json};

use crate::contract;

/// One JSON Patch operation, in the RFC 6902 shape when serialised (`op`, `path`, `value`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum PatchOp {
    /// Sets `value` at `path` (creating it, or replacing an object member).
    Add {
        /// JSON Pointer.
        path: String,
        /// What goes there.
        value: Value,
    },
    /// Takes out what is at `path`.
    Remove {
        /// JSON Pointer.
        path: String,
    },
    /// Fails the whole patch unless `path` holds `value`.
    Test {
        /// JSON Pointer.
        path: String,
        /// What must be there.
        value: Value,
    },
}

impl PatchOp {
    /// The JSON Pointer the operation applies to.
    pub fn path(&self) -> &str {
        match self {
            Self::Add { path, .. } | Self::Remove { path } | Self::Test { path, .. } => path,
        }
    }
}

/// Operations in application order.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Patch(Vec<PatchOp>);

impl Patch {
    /// `add`.
    pub fn add(&mut self, path: impl Into<String>, value: Value) {
        self.0.push(PatchOp::Add {
            path: path.into(),
            value,
        });
    }

    /// `remove`.
    pub fn remove(&mut self, path: impl Into<String>) {
        self.0.push(PatchOp::Remove { path: path.into() });
    }

    /// `test`.
    pub fn test(&mut self, path: impl Into<String>, value: Value) {
        self.0.push(PatchOp::Test {
            path: path.into(),
            value,
        });
    }

    /// Appends operations as they are.
    pub fn extend(&mut self, ops: impl IntoIterator<Item = PatchOp>) {
        self.0.extend(ops);
    }

    /// Sets `key=value` in the string map at `parent` (`/metadata/labels`) of an object at hand,
    /// which has that map (`exists`) or not (then the map is created holding the entry).
    pub fn set_entry(&mut self, parent: &str, exists: bool, key: &str, value: &str) {
        if exists {
            self.add(
                format!("{parent}/{}", escape_pointer_token(key)),
                Value::String(value.to_owned()),
            );
        } else {
            self.add(parent, json!({ key: value }));
        }
    }

    /// Sets the `entries` of the metadata map `map` (`labels`) of an object not read: `Some`
    /// values are set, `None` keys removed. `exists`: whether the object has the map (a JSON
    /// Patch `add` needs the parent); a missing map is created empty, and only when something is
    /// set in it.
    pub fn write_entries(&mut self, map: &str, exists: bool, entries: &[(&str, Option<&str>)]) {
        if !exists {
            if entries.iter().all(|(_, v)| v.is_none()) {
                return;
            }
            self.add(format!("/metadata/{map}"), json!({}));
        }
        for (key, value) in entries {
            let path = format!("/metadata/{map}/{}", escape_pointer_token(key));
            match value {
                Some(v) => self.add(path, json!(v)),
                None if exists => {
                    self.add(path.clone(), json!(""));
                    self.remove(path);
                }
                None => {}
            }
        }
    }

    /// Adds our finalizer to the object's `finalizers` (`None`: it has no list); nothing when it
    /// is there. Returns whether an operation was added.
    pub fn add_finalizer<'a>(
        &mut self,
        finalizers: Option<impl IntoIterator<Item = &'a str>>,
    ) -> bool {
        match finalizers {
            Some(list) => {
                if list.into_iter().any(|f| f == contract::FINALIZER) {
                    return false;
                }
                self.add(
                    "/metadata/finalizers/-",
                    Value::String(contract::FINALIZER.into()),
                );
            }
            None => self.add("/metadata/finalizers", json!([contract::FINALIZER])),
        }
        true
    }

    /// Removes `finalizers[index]`; when `guarded`, only if it still is our finalizer (the list
    /// may have changed since it was read).
    pub fn remove_finalizer_at(&mut self, index: usize, guarded: bool) {
        let path = format!("/metadata/finalizers/{index}");
        if guarded {
            self.test(path.clone(), json!(contract::FINALIZER));
        }
        self.remove(path);
    }

    /// The operations.
    pub fn ops(&self) -> &[PatchOp] {
        &self.0
    }

    /// The operations, owned.
    pub fn into_ops(self) -> Vec<PatchOp> {
        self.0
    }

    /// No operations.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The patch as JSON text.
    pub fn to_json(&self) -> Vec<u8> {
        // Plain strings and `Value`s always serialise.
        serde_json::to_vec(&self.0).unwrap_or_default()
    }
}

/// Escapes a JSON Pointer reference token: `~` → `~0`, `/` → `~1` (RFC 6901).
pub fn escape_pointer_token(token: &str) -> Cow<'_, str> {
    if token.contains(['~', '/']) {
        Cow::Owned(token.replace('~', "~0").replace('/', "~1"))
    } else {
        Cow::Borrowed(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_pointer_tokens() {
        assert_eq!(
            escape_pointer_token("build.appstudio.redhat.com/target-platform"),
            "build.appstudio.redhat.com~1target-platform"
        );
        assert_eq!(escape_pointer_token("a~b/c"), "a~0b~1c");
        assert_eq!(escape_pointer_token("~1"), "~01");
        assert!(matches!(escape_pointer_token("plain"), Cow::Borrowed(_)));
    }

    /// The wire shape both the webhook's responses and the controller's requests carry.
    #[test]
    fn operations_serialise_in_the_rfc_shape() {
        let mut p = Patch::default();
        p.test("/metadata/uid", json!("u"));
        p.add_finalizer(None::<[&str; 0]>);
        p.remove_finalizer_at(2, true);
        p.set_entry("/metadata/labels", false, "a/b", "v");
        p.write_entries("annotations", true, &[("k", None)]);
        assert_eq!(
            String::from_utf8(p.to_json()).unwrap(),
            format!(
                concat!(
                    r#"[{{"op":"test","path":"/metadata/uid","value":"u"}},"#,
                    r#"{{"op":"add","path":"/metadata/finalizers","value":["{f}"]}},"#,
                    r#"{{"op":"test","path":"/metadata/finalizers/2","value":"{f}"}},"#,
                    r#"{{"op":"remove","path":"/metadata/finalizers/2"}},"#,
                    r#"{{"op":"add","path":"/metadata/labels","value":{{"a/b":"v"}}}},"#,
                    r#"{{"op":"add","path":"/metadata/annotations/k","value":""}},"#,
                    r#"{{"op":"remove","path":"/metadata/annotations/k"}}]"#
                ),
                f = contract::FINALIZER
            )
        );
        assert!(!p.add_finalizer(Some([contract::FINALIZER])));
    }
}
