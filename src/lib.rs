//! Multi-platform build-host broker for Tekton.
//!
//! Functional core (pure, deterministic): [`platform`], [`contract`], [`config`], [`admission`],
//! [`scheduler`]. Imperative shell: [`server`] (webhook + admin), [`provision`] (SSH), [`otp`],
//! [`cloud`] (EC2), with [`tls`] and [`serve`] shared by the HTTPS servers.

pub mod admission;
pub mod certs;
pub mod cloud;
pub mod config;
pub mod config_source;
pub mod contract;
pub mod controller;
pub mod duration;
pub mod metrics;
pub mod otp;
pub mod platform;
pub mod provision;
pub mod scheduler;
pub mod serve;
pub mod server;
pub mod simulate;
pub mod tls;
