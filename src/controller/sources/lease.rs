//! Leader election on a `coordination.k8s.io` Lease (docs/architecture.md, "The controller shell").
//!
//! Every replica serves the webhook; only the Lease holder schedules. [`decide`] is the pure rule
//! (take a free or expired Lease, renew our own, otherwise follow); [`Elector`] is the shell: it
//! reads and writes the Lease with optimistic concurrency (a write that loses a race is a 409 and
//! changes nothing) and publishes leadership on a watch channel.
//!
//! Guarantees: a replica reports leadership only while the round of its last successful renewal
//! started less than `renew_deadline` ago, which is shorter than the Lease duration, so the old
//! holder has stopped (reported `false`, its term token cancelled) before any other replica can
//! take an expired Lease. This holds when the API server hangs: a round that has not answered by
//! the deadline is abandoned and leadership ends on time, not when the request returns. Graceful
//! shutdown releases the Lease so a successor takes over at once.
//! Assumptions: clocks of the replicas agree to well within `lease_duration - renew_deadline`.

use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The Lease as [`decide`] reads it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Holder {
    pub identity: Option<String>,
    /// Last renewal.
    pub renewed: Option<SystemTime>,
    pub duration: Duration,
}

/// What to do with the Lease now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// It is ours: renew it.
    Renew,
    /// Free or expired: take it.
    Acquire,
    /// Someone else holds it.
    Follow,
}

/// The election rule.
pub fn decide(holder: &Holder, me: &str, now: SystemTime) -> Decision {
    match holder.identity.as_deref() {
        Some(id) if id == me => Decision::Renew,
        None | Some("") => Decision::Acquire,
        Some(_) => {
            let expired = holder.renewed.is_none_or(|t| t + holder.duration <= now);
            if expired {
                Decision::Acquire
            } else {
                Decision::Follow
            }
        }
    }
}

/// Lease timing.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long a holder's claim lasts without renewal.
    pub lease_duration: Duration,
    /// A holder that could not renew for this long stops leading (shorter than the duration).
    pub renew_deadline: Duration,
    /// How often to renew or retry.
    pub retry_period: Duration,
}

impl Timing {
    /// When a round of Lease requests that starts at `started` must have answered: by the end
    /// of the current claim (`valid_until`) while leading, else one renew deadline later (an
    /// answer after that could not make this replica leader anyway).
    pub fn round_limit(&self, started: Instant, valid_until: Option<Instant>) -> Instant {
        let own = started + self.renew_deadline;
        valid_until.map_or(own, |v| v.min(own))
    }
}

impl Default for Timing {
    fn default() -> Self {
        // client-go's leader-election defaults.
        Timing {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Runs the election for `identity` on Lease `name` until `stop`; leadership is published on
/// the returned channel. Releases the Lease on stop when holding it.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: Timing,
}

impl Elector {
    /// An elector for the Lease `name` in `api`'s namespace.
    pub fn new(api: Api<Lease>, name: String, identity: String, timing: Timing) -> Self {
        Self {
            api,
            name,
            identity,
            timing,
        }
    }

    /// Runs until `stop` is cancelled. While this replica leads, `leading` holds a token that is
    /// cancelled the moment leadership ends locally (the renew deadline passed, whatever a Lease
    /// request is doing, or `stop`), so work of the term can stop without waiting for a reader
    /// of the channel; otherwise it holds `None`.
    pub async fn run(
        self,
        leading: watch::Sender<Option<CancellationToken>>,
        stop: CancellationToken,
    ) {
        // Until when the current claim is ours: `renew_deadline` after the start of the round
        // that renewed it. The Lease records a renew time taken later than that start, so this
        // replica stops before any other can see the Lease expire.
        let mut valid_until: Option<Instant> = None;
        loop {
            let started = Instant::now();
            let limit = self.timing.round_limit(started, valid_until);
            let outcome = tokio::select! {
                () = stop.cancelled() => break,
                r = tokio::time::timeout_at(limit, self.try_once()) => r,
            };
            match outcome {
                Ok(Ok(true)) => valid_until = Some(started + self.timing.renew_deadline),
                Ok(Ok(false)) => valid_until = None,
                Ok(Err(error)) => {
                    tracing::warn!(%error, lease = %self.name, "lease renewal failed");
                }
                Err(_) => {
                    tracing::warn!(lease = %self.name, limit = ?limit.duration_since(started), "lease request did not answer in time; abandoned");
                }
            }
            valid_until = valid_until.filter(|v| *v > Instant::now());
            self.publish(&leading, valid_until.is_some());
            // Sleep until the next round, waking at the deadline to step down on time.
            let next = Instant::now() + self.timing.retry_period;
            let wake = valid_until.map_or(next, |v| v.min(next));
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(wake) => {}
            }
            if valid_until.is_some_and(|v| v <= Instant::now()) {
                valid_until = None;
                self.publish(&leading, false);
            }
        }
        if leading.borrow().is_some() {
            self.publish(&leading, false);
            let released = tokio::time::timeout(self.timing.renew_deadline, self.release()).await;
            match released {
                Ok(Ok(())) => tracing::info!(lease = %self.name, "lease released"),
                Ok(Err(error)) => tracing::warn!(%error, "could not release the lease"),
                Err(_) => tracing::warn!("could not release the lease: no answer in time"),
            }
        }
    }

    /// Publishes a change of leadership: a fresh term token on gain, the old one cancelled on
    /// loss.
    fn publish(&self, leading: &watch::Sender<Option<CancellationToken>>, lead: bool) {
        leading.send_if_modified(|current| {
            if current.is_some() == lead {
                return false;
            }
            tracing::info!(leading = lead, identity = %self.identity, lease = %self.name, "leadership changed");
            match current.take() {
                Some(term) => term.cancel(),
                None => *current = Some(CancellationToken::new()),
            }
            true
        });
    }

    /// One round: true when we hold the Lease afterwards.
    async fn try_once(&self) -> Result<bool, kube::Error> {
        let current = match self.api.get_opt(&self.name).await? {
            Some(l) => l,
            None => {
                let lease = self.claim(None, 0);
                return match self.api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(e),
                };
            }
        };
        let spec = current.spec.clone().unwrap_or_default();
        let holder = Holder {
            identity: spec.holder_identity.clone(),
            renewed: spec.renew_time.as_ref().map(|t| SystemTime::from(t.0)),
            duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64),
        };
        let transitions = spec.lease_transitions.unwrap_or(0);
        let mut next = match decide(&holder, &self.identity, SystemTime::now()) {
            Decision::Follow => return Ok(false),
            Decision::Renew => self.claim(spec.acquire_time.clone(), transitions),
            Decision::Acquire => self.claim(None, transitions + 1),
        };
        next.metadata.resource_version = current.metadata.resource_version.clone();
        match self
            .api
            .replace(&self.name, &PostParams::default(), &next)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn claim(&self, acquired: Option<MicroTime>, transitions: i32) -> Lease {
        let now = MicroTime(jiff_now());
        Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.identity.clone()),
                lease_duration_seconds: Some(self.timing.lease_duration.as_secs().max(1) as i32),
                acquire_time: Some(acquired.unwrap_or_else(|| now.clone())),
                renew_time: Some(now),
                lease_transitions: Some(transitions),
                ..LeaseSpec::default()
            }),
        }
    }

    /// Gives the Lease up (holder cleared, as client-go's `ReleaseOnCancel`).
    async fn release(&self) -> Result<(), kube::Error> {
        let Some(current) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let mut spec = current.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(&self.identity) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(jiff_now()));
        let next = Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                resource_version: current.metadata.resource_version.clone(),
                ..ObjectMeta::default()
            },
            spec: Some(spec),
        };
        self.api
            .replace(&self.name, &PostParams::default(), &next)
            .await
            .map(|_| ())
    }
}

fn jiff_now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_free_or_expired_renew_own_follow_live() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let held = |id: &str, ago: u64| Holder {
            identity: Some(id.into()),
            renewed: Some(now - Duration::from_secs(ago)),
            duration: Duration::from_secs(15),
        };
        assert_eq!(decide(&Holder::default(), "a", now), Decision::Acquire);
        assert_eq!(decide(&held("", 0), "a", now), Decision::Acquire);
        assert_eq!(decide(&held("a", 100), "a", now), Decision::Renew);
        assert_eq!(decide(&held("b", 5), "a", now), Decision::Follow);
        assert_eq!(decide(&held("b", 15), "a", now), Decision::Acquire);
        let never = Holder {
            identity: Some("b".into()),
            renewed: None,
            duration: Duration::from_secs(15),
        };
        assert_eq!(decide(&never, "a", now), Decision::Acquire);
    }

    #[test]
    fn a_round_ends_by_the_end_of_the_claim_or_one_renew_deadline() {
        let t = Timing::default();
        let start = Instant::now();
        assert_eq!(t.round_limit(start, None), start + t.renew_deadline);
        let claim_ends = start + Duration::from_secs(3);
        assert_eq!(t.round_limit(start, Some(claim_ends)), claim_ends);
        assert_eq!(
            t.round_limit(start, Some(start + Duration::from_secs(60))),
            start + t.renew_deadline
        );
    }
}
