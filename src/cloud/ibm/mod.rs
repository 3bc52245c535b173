//! IBM Cloud (`type: ibmz` VPC and `type: ibmp` Power Virtual Server).
//!
//! What is here so far: the IAM token source every IBM call goes through. The VPC and Power VS
//! clients, launch/list/terminate/address and the wiring into the controller's cloud dispatch
//! are not built yet; until they are, the configuration parser disables IBM platforms with a
//! reason that says so.

pub mod iam;
