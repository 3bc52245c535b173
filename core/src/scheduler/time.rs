//! Virtual time: the core never reads a clock; every event comes with `now`.

use std::fmt;
use std::ops::Add;
use std::time::Duration;

/// A point in time: milliseconds since the Unix epoch (virtual in `mpc simulate`, wall time in the
/// controller).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(u64);

impl Time {
    /// The epoch.
    pub const ZERO: Time = Time(0);

    /// From milliseconds since the epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Time(ms)
    }

    /// From seconds since the epoch (the `allocation-start-time` annotation's unit).
    pub const fn from_secs(secs: u64) -> Self {
        Time(secs.saturating_mul(1000))
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Whole seconds since the epoch.
    pub const fn as_secs(self) -> u64 {
        self.0 / 1000
    }

    /// Time elapsed since `earlier` (zero when `earlier` is later).
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, d: Duration) -> Time {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(ms))
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03}s", self.0 / 1000, self.0 % 1000)
    }
}
