//! Functional core of the multi-platform build-host broker: pure, deterministic, no I/O beyond
//! reading the files a caller names ([`simulate`]'s inputs).
//!
//! [`platform`] and [`contract`] (the Go controller's names, labels and secret layout) are shared
//! by everything, and [`jsonpatch`] builds every TaskRun patch; [`config`] parses a `host-config` ConfigMap; [`admission`] decides and patches
//! AdmissionReviews; [`scheduler`] is the state machine that allocates build hosts (events in,
//! actions out); [`simulate`] runs that scheduler on a workload trace with a virtual clock;
//! [`kueue`] renders Kueue quotas from a host-config and checks a ClusterQueue against it. The
//! `mpc` crate is the shell around them: servers, Kubernetes, SSH, the cloud, metrics.

pub mod admission;
pub mod config;
pub mod contract;
pub mod duration;
pub mod jsonpatch;
pub mod kueue;
pub mod platform;
pub mod scheduler;
pub mod simulate;
