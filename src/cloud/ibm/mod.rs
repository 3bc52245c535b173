//! IBM Cloud (`type: ibmz` VPC and `type: ibmp` Power Virtual Server).
//!
//! What is here so far: the IAM token source every IBM call goes through, and the VPC instance
//! listing (every page, exact-name counting). Launch, terminate, Power VS and the wiring into
//! the controller's cloud dispatch are not built yet; until they are, the configuration parser
//! disables IBM platforms with a reason that says so.

pub mod iam;
pub mod vpc;
