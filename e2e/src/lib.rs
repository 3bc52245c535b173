//! End-to-end harness: a Kubernetes test API server that real clients (kubectl, kube-rs) accept, a
//! Tekton stand-in, and helpers that run real `sshd` and `moto` on loopback.
//!
//! Test infrastructure only; never used in production.

/// The test API server, its own crate ([`e2e_apiserver`]).
pub use e2e_apiserver as apiserver;
pub mod ec2_proxy;
pub mod ibm_emulator;
pub mod kubectl;
pub mod kubelet;
pub mod moto;
pub mod product;
pub mod promql;
pub mod sshd;
pub mod tekton;
