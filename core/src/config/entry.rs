//! What the ConfigMap walk ([`super::parse`]) hands each per-entry parser (`dynamic`, `ibm`,
//! `static_host`): the sink their diagnostics go to and, for a `dynamic.<label>.*` group, which
//! list named the platform. Kept apart from the walk so the parsers it calls do not import it back.

use std::fmt;

use super::{Diagnostic, Severity};

/// A dynamic pool's `(concurrency, max-age, min-instances)`, as the entry parsers return it.
pub(super) type PoolFields = (u32, std::time::Duration, u32);

/// Collects diagnostics while parsing.
#[derive(Default)]
pub(super) struct Sink(pub(super) Vec<Diagnostic>);

impl Sink {
    pub(super) fn error(&mut self, key: &str, value: Option<&str>, message: impl fmt::Display) {
        self.push(Severity::Error, key, value, message.to_string());
    }
    pub(super) fn warn(&mut self, key: &str, value: Option<&str>, message: impl fmt::Display) {
        self.push(Severity::Warning, key, value, message.to_string());
    }
    fn push(&mut self, severity: Severity, key: &str, value: Option<&str>, message: String) {
        self.0.push(Diagnostic {
            severity,
            key: key.to_owned(),
            value: value.map(str::to_owned),
            message,
        });
    }
}

/// Which list named a dynamic platform.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum DynKind {
    Dynamic,
    Pool,
}
