//! Multi-platform build-host broker for Tekton.
//!
//! Functional core (pure, deterministic; the `mpc-core` crate, re-exported here at the same
//! paths): [`platform`], [`contract`], [`jsonpatch`], [`config`], [`admission`], [`scheduler`],
//! [`simulate`], [`kueue`].
//! Imperative shell: [`server`] (webhook + admin), [`controller`], [`provision`] (SSH), [`otp`],
//! [`cloud`] (EC2), with [`tls`] and [`serve`] shared by the HTTPS servers.

pub use mpc_core::{
    admission, config, contract, duration, jsonpatch, kueue, platform, scheduler, simulate,
};

pub mod certs;
pub mod cloud;
pub mod config_source;
pub mod controller;
pub mod metrics;
pub mod otp;
pub mod provision;
pub mod serve;
pub mod server;
pub mod tls;
