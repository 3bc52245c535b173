//! Latency models of the simulated world: seeded, so a run is reproducible with `--seed`.

use rand::Rng;
use rand::rngs::StdRng;

/// A log-normal sample with the given median and shape (sigma of the underlying normal).
pub fn lognormal(rng: &mut StdRng, median: f64, sigma: f64) -> f64 {
    // Box-Muller; 1 - u keeps the logarithm finite.
    let u1: f64 = 1.0 - rng.r#gen::<f64>();
    let u2: f64 = rng.r#gen::<f64>();
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    median * (sigma * z).exp()
}

/// Plausible latencies of the things the controller waits for.
#[derive(Debug, Clone)]
pub struct Latencies {
    /// SSH user creation + OTP store on a static host: median seconds.
    pub provision_static: f64,
    /// The same on a fresh cloud instance.
    pub provision_instance: f64,
    /// RunInstances round trip.
    pub launch_api: f64,
    /// Launch to SSH-reachable: median seconds.
    pub boot: f64,
    /// Share of launches refused with a retryable capacity error.
    pub launch_failure_rate: f64,
    /// Share of provisioning attempts that fail.
    pub provision_failure_rate: f64,
    /// A macOS instance's launch to SSH-reachable: median seconds, and the range it stays in
    /// (EC2 Mac boots take 6-20 minutes).
    pub mac_boot: f64,
    /// Shortest and longest macOS boot, seconds.
    pub mac_boot_range: (f64, f64),
    /// How long a dedicated Mac host is scrubbed after its instance terminates (median seconds);
    /// no instance can start on it meanwhile.
    pub mac_scrub: f64,
    /// The shortest time a dedicated Mac host is billed for, seconds.
    pub mac_min_billing: f64,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            provision_static: 2.5,
            provision_instance: 4.0,
            launch_api: 1.5,
            boot: 55.0,
            launch_failure_rate: 0.01,
            provision_failure_rate: 0.002,
            mac_boot: 600.0,
            mac_boot_range: (360.0, 1200.0),
            mac_scrub: 3000.0,
            mac_min_billing: 24.0 * 3600.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn lognormal_median_is_about_right() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut v: Vec<f64> = (0..4001).map(|_| lognormal(&mut rng, 60.0, 0.3)).collect();
        v.sort_by(f64::total_cmp);
        assert!((55.0..65.0).contains(&v[2000]), "{}", v[2000]);
        assert!(v.iter().all(|x| *x > 0.0));
    }
}
