//! Placeholder: filled in by its issue.

/// Errors that stop the OTP server.
#[derive(Debug, thiserror::Error)]
pub enum OtpError {
    /// Not built yet.
    #[error("the OTP server is not built yet")]
    NotBuilt,
}

/// `mpc otp-server` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct OtpServerArgs {}

/// Runs `mpc otp-server` until SIGTERM.
pub async fn run_server(_args: OtpServerArgs) -> Result<(), OtpError> {
    Err(OtpError::NotBuilt)
}
