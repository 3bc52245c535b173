//! How often and how long to wait before retrying a failed cloud call. Pure: the caller supplies
//! the jitter and does the sleeping.

use std::time::Duration;

use crate::cloud::error::{ErrorClass, RetryMode};

/// Retry policy of one cloud call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Delay after the first failure; doubles after each further one.
    pub base_delay: Duration,
    /// Longest delay.
    pub max_delay: Duration,
    /// Calls in all for throttling, capacity and unavailability (back-off classes).
    pub backoff_attempts: u32,
    /// Calls in all for other failures.
    pub bounded_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(20),
            backoff_attempts: 6,
            bounded_attempts: 3,
        }
    }
}

impl RetryPolicy {
    /// The wait before the next call after `calls_made` calls failed, the last with `class`;
    /// `None` to give up. `jitter` in `[0, 1)` spreads the wait over its upper half, so callers
    /// throttled together do not retry in lockstep.
    pub fn next_delay(&self, class: ErrorClass, calls_made: u32, jitter: f64) -> Option<Duration> {
        let limit = match class.retry_mode() {
            RetryMode::Backoff => self.backoff_attempts,
            RetryMode::Bounded => self.bounded_attempts,
            RetryMode::Never => return None,
        };
        if calls_made >= limit {
            return None;
        }
        let exp = calls_made.saturating_sub(1).min(30);
        let full = self
            .base_delay
            .saturating_mul(1u32 << exp)
            .min(self.max_delay);
        let jitter = jitter.clamp(0.0, 1.0);
        Some(full.mul_f64(0.5 + jitter / 2.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(1000),
            backoff_attempts: 6,
            bounded_attempts: 3,
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_then_gives_up() {
        let p = policy();
        let d: Vec<_> = (1..=6)
            .map(|n| p.next_delay(ErrorClass::Throttled, n, 0.999_999))
            .collect();
        let ms = |o: Option<Duration>| o.map(|d| d.as_millis());
        assert_eq!(ms(d[0]), Some(99));
        assert_eq!(ms(d[1]), Some(199));
        assert_eq!(ms(d[2]), Some(399));
        assert_eq!(ms(d[3]), Some(799));
        assert_eq!(ms(d[4]), Some(999), "capped at max_delay");
        assert_eq!(d[5], None, "six calls in all");
    }

    #[test]
    fn jitter_spreads_over_the_upper_half() {
        let p = policy();
        assert_eq!(
            p.next_delay(ErrorClass::Capacity, 2, 0.0),
            Some(Duration::from_millis(100))
        );
        assert_eq!(
            p.next_delay(ErrorClass::Capacity, 2, 0.5),
            Some(Duration::from_millis(150))
        );
    }

    #[test]
    fn classes_get_their_budgets() {
        let p = policy();
        assert!(p.next_delay(ErrorClass::Other, 2, 0.0).is_some());
        assert_eq!(p.next_delay(ErrorClass::Other, 3, 0.0), None);
        assert_eq!(p.next_delay(ErrorClass::Config, 1, 0.0), None);
        assert_eq!(p.next_delay(ErrorClass::NotFound, 1, 0.0), None);
        assert!(p.next_delay(ErrorClass::Unavailable, 5, 0.0).is_some());
    }

    #[test]
    fn huge_attempt_counts_do_not_overflow() {
        let p = RetryPolicy {
            backoff_attempts: u32::MAX,
            ..policy()
        };
        assert_eq!(
            p.next_delay(ErrorClass::Throttled, 1_000, 0.0),
            Some(Duration::from_millis(500))
        );
    }
}
