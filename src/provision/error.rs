//! Typed provisioning errors, classified so the scheduler can tell a bad host from a bad request.

use std::time::Duration;

use super::scripts::{EXIT_BAD_REQUEST, EXIT_UNAVAILABLE};

/// Who is to blame for a failure, which decides what the scheduler does next: the scheduler's
/// own type, so the blame travels in [`Event::ProvisionFailed`](crate::scheduler::Event) as is.
pub use crate::scheduler::Blame;

/// Why an SSH operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    /// TCP or SSH transport could not be established, or the connection dropped.
    #[error("host {host} is unreachable: {detail}")]
    Unreachable {
        host: String,
        /// What `ssh` reported.
        detail: String,
    },
    /// The host refused the admin key.
    #[error("host {host} refused the admin key: {detail}")]
    AuthRefused {
        host: String,
        /// What `ssh` reported.
        detail: String,
    },
    /// The host presented a key that does not match the pinned or first-seen one.
    #[error(
        "host {host} presented a host key that does not match the {expected} key; refusing to connect \
         (if the host was legitimately re-keyed, update host.<name>.host-key or remove {record})"
    )]
    HostKeyMismatch {
        host: String,
        /// `pinned` or `recorded`.
        expected: &'static str,
        /// The known-hosts file holding the expected key.
        record: String,
    },
    /// An SSH step did not finish in time.
    #[error("{operation} on host {host} timed out after {after:?}")]
    Timeout {
        host: String,
        /// What was running (`connect`, `provision`, ...).
        operation: &'static str,
        /// The limit that expired.
        after: Duration,
    },
    /// The remote script failed.
    #[error("{operation} on host {host} failed with exit code {exit_code:?}: {stderr_tail}")]
    CommandFailed {
        host: String,
        /// What was running.
        operation: &'static str,
        /// Exit code, `None` when killed by a signal.
        exit_code: Option<i32>,
        /// The last part of stderr.
        stderr_tail: String,
    },
    /// A remote command succeeded but its output was not what the script prints.
    #[error("{operation} on host {host} printed unexpected output: {detail}")]
    UnexpectedOutput {
        host: String,
        /// What was running.
        operation: &'static str,
        /// What was wrong with it.
        detail: String,
    },
    /// The request was refused before anything was sent.
    #[error("invalid provisioning request: {0}")]
    InvalidRequest(String),
    /// A local step failed (state directory, temp files, spawning `ssh`).
    #[error("local SSH setup failed: {0}")]
    Local(String),
}

impl ProvisionError {
    /// Who is to blame (see [`Blame`]).
    pub fn blame(&self) -> Blame {
        match self {
            Self::Unreachable { .. }
            | Self::AuthRefused { .. }
            | Self::HostKeyMismatch { .. }
            | Self::Timeout { .. }
            | Self::UnexpectedOutput { .. } => Blame::Host,
            Self::CommandFailed { exit_code, .. } => match *exit_code {
                Some(EXIT_BAD_REQUEST) => Blame::Request,
                Some(EXIT_UNAVAILABLE) | Some(_) | None => Blame::Host,
            },
            Self::InvalidRequest(_) => Blame::Request,
            Self::Local(_) => Blame::Controller,
        }
    }

    /// True when the host is at fault (take it out of rotation for a while).
    pub fn is_host_problem(&self) -> bool {
        self.blame() == Blame::Host
    }
}

/// The last `max` bytes of `s` (on a character boundary), trimmed.
pub(crate) fn tail(s: &str, max: usize) -> String {
    let s = s.trim();
    if s.len() <= max {
        return s.to_owned();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &s[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blame_separates_hosts_from_requests() {
        let failed = |code| ProvisionError::CommandFailed {
            host: "h".into(),
            operation: "provision",
            exit_code: code,
            stderr_tail: String::new(),
        };
        assert_eq!(failed(Some(65)).blame(), Blame::Request);
        assert_eq!(failed(Some(75)).blame(), Blame::Host);
        assert_eq!(failed(None).blame(), Blame::Host);
        assert!(
            ProvisionError::Unreachable {
                host: "h".into(),
                detail: String::new()
            }
            .is_host_problem()
        );
        assert!(!ProvisionError::InvalidRequest("x".into()).is_host_problem());
    }

    #[test]
    fn tail_keeps_the_end_on_char_boundaries() {
        assert_eq!(tail("  short \n", 10), "short");
        assert_eq!(tail("abcdefghij", 4), "…ghij");
        assert_eq!(tail("ééééé", 3), "…é");
    }
}
