//! `mpc controller`: brokers build hosts in a cluster.

pub mod observe;
pub mod patch;
pub mod taskrun;
