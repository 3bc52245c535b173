//! Leader election on a `coordination.k8s.io` Lease (docs/architecture.md, "The controller shell").
//!
//! Every replica serves the webhook; only the Lease holder schedules. Pure: [`decide`], the rule
//! for one round (take a free or expired Lease, renew our own, otherwise follow), [`Observer`],
//! which tells when this replica last saw the Lease record change, and [`Terms`], which turns the
//! rounds' outcomes and the clock (passed in) into leadership gained and lost.
//! [`Elector`] is the shell: it reads and writes the Lease with optimistic concurrency (a write
//! that loses a race is a 409 and changes nothing), sleeps when [`Terms`] says, and publishes
//! leadership on a watch channel.
//!
//! Guarantees: a replica reports leadership only while the round of its last successful renewal
//! started less than `renew_deadline` ago. Another replica takes the Lease only once it has seen
//! the record unchanged for `leaseDurationSeconds` by its own monotonic clock (as client-go's
//! leader election: never the holder's `renewTime` against the local clock, so wall clocks may
//! disagree by any amount); it saw that last renewal after the round that wrote it started, and
//! the duration is longer than the renew deadline, so the old holder has stopped (reported
//! `false`, its term token cancelled) first. This holds when the API server hangs: a round that
//! has not answered by the deadline is abandoned and leadership ends on time, not when the
//! request returns. (The leader's client also gives each request up at the renew deadline: alone,
//! that would end the term too, up to a retry period after the claim.) Graceful shutdown releases
//! the Lease so a successor takes over at once.
//! Assumptions: the replicas' clocks run at nearly the same rate (a claim lasts `renew_deadline`
//! on the holder's clock, a follower waits `lease_duration` on its own; [`Timing::new`] refuses
//! a renew deadline that leaves no room between them). A follower that starts, or first sees a
//! new holder, waits a full duration even if the holder is long gone.

use std::time::Duration;

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
    /// How long the holder's claim lasts without a change of the record.
    pub duration: Duration,
}

/// When this replica last saw the Lease record change (client-go's `observedTime`): the holder's
/// own timestamps are another machine's clock, so only their changing counts, timed here.
#[derive(Debug, Clone)]
pub struct Observer<R> {
    seen: Option<(R, Instant)>,
}

impl<R> Default for Observer<R> {
    fn default() -> Self {
        Observer { seen: None }
    }
}

impl<R: PartialEq + Clone> Observer<R> {
    /// `record` was read at `now`: returns when it last changed, by this replica's clock (`now`
    /// when it differs from the record seen before, or is the first one seen).
    pub fn observe(&mut self, record: &R, now: Instant) -> Instant {
        match &self.seen {
            Some((seen, at)) if seen == record => *at,
            _ => {
                self.seen = Some((record.clone(), now));
                now
            }
        }
    }
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

/// The election rule. `changed` is when this replica last saw the record change
/// ([`Observer::observe`]), `now` is this replica's clock.
pub fn decide(holder: &Holder, me: &str, changed: Instant, now: Instant) -> Decision {
    match holder.identity.as_deref() {
        Some(id) if id == me => Decision::Renew,
        None | Some("") => Decision::Acquire,
        Some(_) => {
            let expired = changed + holder.duration <= now;
            if expired {
                Decision::Acquire
            } else {
                Decision::Follow
            }
        }
    }
}

/// Lease timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long a holder's claim lasts without renewal.
    pub lease_duration: Duration,
    /// A holder that could not renew for this long stops leading (shorter than the duration).
    pub renew_deadline: Duration,
    /// How often to renew or retry.
    pub retry_period: Duration,
}

/// Lease timings that cannot elect one leader at a time (client-go refuses the same).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    #[error(
        "--lease-renew-deadline ({renew_deadline:?}) must be shorter than --lease-duration \
         ({lease_duration:?}): a leader must stop before a follower may take the Lease"
    )]
    RenewDeadlineNotShorter {
        renew_deadline: Duration,
        lease_duration: Duration,
    },
    #[error(
        "--lease-renew-deadline ({renew_deadline:?}) must be longer than 1.2 × \
         --lease-retry-period ({retry_period:?}): a leader must get more than one renewal \
         attempt before its term ends"
    )]
    RetryPeriodTooLong {
        renew_deadline: Duration,
        retry_period: Duration,
    },
    #[error("--lease-duration ({0:?}) must be at least 1s (the Lease records whole seconds)")]
    DurationTooShort(Duration),
    #[error("--lease-retry-period must be longer than zero")]
    NoRetryPeriod,
}

impl Timing {
    /// Checked timings: the renew deadline shorter than the duration, and longer than 1.2 retry
    /// periods (client-go's `JitterFactor`); a duration of at least a second.
    pub fn new(
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Result<Self, TimingError> {
        if lease_duration < Duration::from_secs(1) {
            return Err(TimingError::DurationTooShort(lease_duration));
        }
        if renew_deadline >= lease_duration {
            return Err(TimingError::RenewDeadlineNotShorter {
                renew_deadline,
                lease_duration,
            });
        }
        if retry_period.is_zero() {
            return Err(TimingError::NoRetryPeriod);
        }
        if renew_deadline <= retry_period.mul_f64(1.2) {
            return Err(TimingError::RetryPeriodTooLong {
                renew_deadline,
                retry_period,
            });
        }
        Ok(Timing {
            lease_duration,
            renew_deadline,
            retry_period,
        })
    }

    /// The duration written into the Lease: whole seconds, rounded up, so that a follower
    /// never waits less than this replica's own setting.
    fn lease_duration_seconds(&self) -> i32 {
        let d = self.lease_duration;
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        i32::try_from(secs.max(1)).unwrap_or(i32::MAX)
    }

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

/// How one round of Lease requests ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// We hold the Lease (acquired or renewed).
    Held,
    /// Someone else holds it, or a race was lost.
    NotHeld,
    /// No answer: an error, or none by the round's limit. A claim we had stands until it ends.
    Failed,
}

/// A change of leadership to publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Gained,
    Lost,
}

/// Leadership terms from the rounds' outcomes (pure: every instant is passed in).
///
/// A claim lasts `renew_deadline` from the start of the round that made it, whatever the
/// request did meanwhile; leadership is reported exactly while a claim lasts.
#[derive(Debug, Clone)]
pub struct Terms {
    timing: Timing,
    /// Until when the current claim is ours: `renew_deadline` after the start of the round that
    /// renewed it. The Lease records a renew time taken later than that start, so this replica
    /// stops before any other can see the Lease expire.
    valid_until: Option<Instant>,
    leading: bool,
}

impl Terms {
    pub fn new(timing: Timing) -> Self {
        Terms {
            timing,
            valid_until: None,
            leading: false,
        }
    }

    /// Whether leadership is reported now.
    pub fn leading(&self) -> bool {
        self.leading
    }

    /// When a round starting at `started` must have answered ([`Timing::round_limit`]).
    pub fn round_limit(&self, started: Instant) -> Instant {
        self.timing.round_limit(started, self.valid_until)
    }

    /// A round that started at `started` ended at `now` with `round`.
    pub fn round_ended(&mut self, started: Instant, now: Instant, round: Round) -> Option<Change> {
        match round {
            Round::Held => self.valid_until = Some(started + self.timing.renew_deadline),
            Round::NotHeld => self.valid_until = None,
            Round::Failed => {}
        }
        self.valid_until = self.valid_until.filter(|v| *v > now);
        self.set(self.valid_until.is_some())
    }

    /// When to wake after a round that ended at `now`: the next round, or the end of the claim
    /// if sooner (to step down on time).
    pub fn wake_at(&self, now: Instant) -> Instant {
        let next = now + self.timing.retry_period;
        self.valid_until.map_or(next, |v| v.min(next))
    }

    /// Woken at `now`: a claim that ran out ends leadership.
    pub fn woke(&mut self, now: Instant) -> Option<Change> {
        if self.valid_until.is_some_and(|v| v <= now) {
            self.valid_until = None;
            return self.set(false);
        }
        None
    }

    /// Stopping: leadership ends (the caller then releases the Lease if it was held).
    pub fn stop(&mut self) -> Option<Change> {
        self.valid_until = None;
        self.set(false)
    }

    fn set(&mut self, lead: bool) -> Option<Change> {
        if lead == self.leading {
            return None;
        }
        self.leading = lead;
        Some(if lead { Change::Gained } else { Change::Lost })
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
        let mut terms = Terms::new(self.timing);
        let mut observer = Observer::default();
        loop {
            let started = Instant::now();
            let limit = terms.round_limit(started);
            let outcome = tokio::select! {
                () = stop.cancelled() => break,
                r = tokio::time::timeout_at(limit, self.try_once(&mut observer)) => r,
            };
            let round = match outcome {
                Ok(Ok(true)) => Round::Held,
                Ok(Ok(false)) => Round::NotHeld,
                Ok(Err(error)) => {
                    tracing::warn!(%error, lease = %self.name, "lease renewal failed");
                    Round::Failed
                }
                Err(_) => {
                    tracing::warn!(lease = %self.name, limit = ?limit.duration_since(started), "lease request did not answer in time; abandoned");
                    Round::Failed
                }
            };
            self.publish(&leading, terms.round_ended(started, Instant::now(), round));
            let wake = terms.wake_at(Instant::now());
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(wake) => {}
            }
            self.publish(&leading, terms.woke(Instant::now()));
        }
        if let Some(change) = terms.stop() {
            self.publish(&leading, Some(change));
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
    fn publish(&self, leading: &watch::Sender<Option<CancellationToken>>, change: Option<Change>) {
        let Some(change) = change else {
            return;
        };
        let lead = change == Change::Gained;
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
    /// One round: true when we hold the Lease afterwards. `observer` keeps when the record
    /// last changed, across rounds.
    async fn try_once(&self, observer: &mut Observer<LeaseSpec>) -> Result<bool, kube::Error> {
        let current = match self.api.get_opt(&self.name).await? {
            Some(l) => l,
            None => {
                let lease = self.claim(None, 0);
                return match self.api.create(&PostParams::default(), &lease).await {
                    Ok(written) => {
                        observer.observe(&written.spec.unwrap_or_default(), Instant::now());
                        Ok(true)
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(e),
                };
            }
        };
        let spec = current.spec.clone().unwrap_or_default();
        let now = Instant::now();
        let changed = observer.observe(&spec, now);
        let holder = Holder {
            identity: spec.holder_identity.clone(),
            duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64),
        };
        let transitions = spec.lease_transitions.unwrap_or(0);
        let mut next = match decide(&holder, &self.identity, changed, now) {
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
            Ok(written) => {
                observer.observe(&written.spec.unwrap_or_default(), Instant::now());
                Ok(true)
            }
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
                lease_duration_seconds: Some(self.timing.lease_duration_seconds()),
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

    /// `changed_ago`: how long ago (by this replica's clock) the record last changed.
    #[test]
    fn take_free_or_expired_renew_own_follow_live() {
        let now = Instant::now() + Duration::from_secs(1000);
        let held = |id: &str| Holder {
            identity: Some(id.into()),
            duration: Duration::from_secs(15),
        };
        let ago = |s: u64| now - Duration::from_secs(s);
        assert_eq!(decide(&Holder::default(), "a", now, now), Decision::Acquire);
        assert_eq!(decide(&held(""), "a", now, now), Decision::Acquire);
        assert_eq!(decide(&held("a"), "a", ago(100), now), Decision::Renew);
        assert_eq!(decide(&held("b"), "a", ago(5), now), Decision::Follow);
        assert_eq!(decide(&held("b"), "a", ago(14), now), Decision::Follow);
        assert_eq!(decide(&held("b"), "a", ago(15), now), Decision::Acquire);
    }

    /// Only a change of the record restarts the wait; reading the same record again does not,
    /// and its timestamps are never compared with this replica's clock.
    #[test]
    fn expiry_counts_from_when_the_record_last_changed_here() {
        let t0 = Instant::now();
        let mut o = Observer::default();
        assert_eq!(o.observe(&"renewed at 09:00", t0), t0, "first seen");
        assert_eq!(o.observe(&"renewed at 09:00", at(t0, 5)), t0);
        assert_eq!(o.observe(&"renewed at 09:00", at(t0, 14)), t0);
        assert_eq!(o.observe(&"renewed at 08:00", at(t0, 16)), at(t0, 16));
        assert_eq!(o.observe(&"renewed at 08:00", at(t0, 20)), at(t0, 16));
    }

    /// client-go's rules: a renew deadline shorter than the duration and longer than 1.2 retry
    /// periods.
    #[test]
    fn timings_that_cannot_keep_one_leader_are_refused() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(Timing::new(s(15), s(10), s(2)), Ok(Timing::default()));
        assert!(Timing::new(s(3), s(2), ms(300)).is_ok(), "the e2e timings");
        for (duration, deadline, retry) in [
            (s(15), s(15), s(2)),
            (s(10), s(15), s(2)),
            (s(15), s(10), s(10)),
            (s(15), s(10), ms(8400)),
            (s(15), s(10), Duration::ZERO),
            (ms(900), ms(500), ms(100)),
        ] {
            let refused = Timing::new(duration, deadline, retry);
            assert!(refused.is_err(), "{duration:?} {deadline:?} {retry:?}");
        }
        let e = Timing::new(s(10), s(10), s(2)).unwrap_err().to_string();
        assert!(
            e.contains("--lease-renew-deadline (10s) must be shorter than --lease-duration (10s)"),
            "{e}"
        );
        let e = Timing::new(s(15), s(10), s(9)).unwrap_err().to_string();
        assert!(e.contains("--lease-retry-period (9s)"), "{e}");
    }

    #[test]
    fn the_recorded_duration_never_undercuts_the_setting() {
        let t = |d| Timing {
            lease_duration: d,
            ..Timing::default()
        };
        assert_eq!(t(Duration::from_secs(15)).lease_duration_seconds(), 15);
        assert_eq!(t(Duration::from_millis(2500)).lease_duration_seconds(), 3);
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

    fn at(start: Instant, secs: u64) -> Instant {
        start + Duration::from_secs(secs)
    }

    /// Default timing: a claim lasts 10 s from its round's start, rounds every 2 s.
    #[test]
    fn a_held_round_gains_and_renewals_keep_the_term() {
        let t0 = Instant::now();
        let mut terms = Terms::new(Timing::default());
        assert!(!terms.leading());
        assert_eq!(terms.round_limit(t0), at(t0, 10));
        assert_eq!(
            terms.round_ended(t0, at(t0, 1), Round::Held),
            Some(Change::Gained)
        );
        assert_eq!(terms.wake_at(at(t0, 1)), at(t0, 3));
        assert_eq!(terms.woke(at(t0, 3)), None);
        // Renewed at 3 s: the claim now runs to 13 s, and the next round must answer by then.
        assert_eq!(terms.round_ended(at(t0, 3), at(t0, 4), Round::Held), None);
        assert_eq!(terms.round_limit(at(t0, 5)), at(t0, 13));
        assert!(terms.leading());
    }

    /// A hanging API server: rounds fail, the claim of the last renewal runs out, and leadership
    /// ends exactly then, not when some request returns.
    #[test]
    fn failed_rounds_keep_the_claim_until_it_runs_out_and_no_longer() {
        let t0 = Instant::now();
        let mut terms = Terms::new(Timing::default());
        terms.round_ended(t0, t0, Round::Held);
        assert_eq!(terms.round_ended(at(t0, 2), at(t0, 8), Round::Failed), None);
        assert!(terms.leading(), "the claim of 0 s lasts until 10 s");
        // The next round may not outlive the claim; the elector wakes at its end.
        assert_eq!(terms.round_limit(at(t0, 8)), at(t0, 10));
        assert_eq!(terms.wake_at(at(t0, 9)), at(t0, 10));
        assert_eq!(terms.woke(at(t0, 10)), Some(Change::Lost));
        assert!(!terms.leading());
        assert_eq!(terms.woke(at(t0, 11)), None, "lost once");
        // A success that answers after its own claim ended gains nothing.
        assert_eq!(terms.round_ended(at(t0, 11), at(t0, 21), Round::Held), None);
        assert!(!terms.leading());
    }

    #[test]
    fn losing_the_lease_or_stopping_ends_the_term_at_once() {
        let t0 = Instant::now();
        let mut terms = Terms::new(Timing::default());
        terms.round_ended(t0, t0, Round::Held);
        assert_eq!(
            terms.round_ended(at(t0, 2), at(t0, 2), Round::NotHeld),
            Some(Change::Lost)
        );
        assert_eq!(
            terms.round_limit(at(t0, 4)),
            at(t0, 14),
            "a follower waits a full deadline"
        );
        assert_eq!(terms.stop(), None, "nothing to release when following");
        terms.round_ended(at(t0, 4), at(t0, 4), Round::Held);
        assert_eq!(terms.stop(), Some(Change::Lost));
        assert!(!terms.leading());
    }
}

/// The elector against an in-memory Lease API (no network, no request timeout of any kind),
/// on tokio's paused clock.
#[cfg(test)]
mod elector_tests {
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use http::{Method, Request, Response, StatusCode};
    use http_body_util::{BodyExt, Full};

    use std::time::SystemTime;

    use super::*;

    /// What the fake API server holds and does.
    #[derive(Default)]
    struct Server {
        lease: Option<Lease>,
        version: u64,
        /// Requests get no answer, ever (a hung API server; nothing times them out).
        hang: bool,
        /// Holders written through the API, in order.
        writes: Vec<String>,
    }

    impl Server {
        /// Another replica writes the Lease directly (its own renewal).
        fn put(&mut self, holder: &str, renewed: SystemTime) {
            self.version += 1;
            let time = |t: SystemTime| {
                MicroTime(k8s_openapi::jiff::Timestamp::try_from(t).expect("in range"))
            };
            self.lease = Some(Lease {
                metadata: ObjectMeta {
                    name: Some("lease".into()),
                    namespace: Some("ns".into()),
                    resource_version: Some(self.version.to_string()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(holder.into()),
                    lease_duration_seconds: Some(15),
                    acquire_time: Some(time(renewed)),
                    renew_time: Some(time(renewed)),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            });
        }

        fn answer(&mut self, method: &Method, body: &[u8]) -> (StatusCode, Vec<u8>) {
            let status = |code: u16, reason: &str| {
                let s = serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "reason": reason, "message": reason, "code": code});
                (
                    StatusCode::from_u16(code).unwrap(),
                    s.to_string().into_bytes(),
                )
            };
            let ok = |code: StatusCode, lease: &Lease| (code, serde_json::to_vec(lease).unwrap());
            match *method {
                Method::GET => match &self.lease {
                    Some(l) => ok(StatusCode::OK, l),
                    None => status(404, "NotFound"),
                },
                Method::POST | Method::PUT => {
                    let mut lease: Lease = serde_json::from_slice(body).unwrap();
                    let current = self
                        .lease
                        .as_ref()
                        .and_then(|l| l.metadata.resource_version.clone());
                    let conflict = if *method == Method::POST {
                        self.lease.is_some()
                    } else {
                        lease.metadata.resource_version != current
                    };
                    if conflict {
                        return status(409, "Conflict");
                    }
                    self.version += 1;
                    lease.metadata.resource_version = Some(self.version.to_string());
                    let holder = lease.spec.as_ref().and_then(|s| s.holder_identity.clone());
                    self.writes.push(holder.unwrap_or_default());
                    self.lease = Some(lease.clone());
                    ok(StatusCode::OK, &lease)
                }
                _ => status(405, "MethodNotAllowed"),
            }
        }
    }

    fn client(server: Arc<Mutex<Server>>) -> kube::Client {
        let service = tower::service_fn(move |req: Request<kube::client::Body>| {
            let server = server.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                if server.lock().unwrap().hang {
                    std::future::pending::<()>().await;
                }
                let (code, bytes) = server.lock().unwrap().answer(&parts.method, &body);
                let response = Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(bytes)))
                    .unwrap();
                Ok::<_, Infallible>(response)
            }
        });
        kube::Client::new(service, "ns")
    }

    type Leading = watch::Receiver<Option<CancellationToken>>;

    /// Replica `a` electing itself on the fake server.
    fn start(server: &Arc<Mutex<Server>>, timing: Timing) -> (Leading, CancellationToken) {
        let api = Api::namespaced(client(server.clone()), "ns");
        let elector = Elector::new(api, "lease".into(), "a".into(), timing);
        let (tx, rx) = watch::channel(None);
        let stop = CancellationToken::new();
        tokio::spawn(elector.run(tx, stop.clone()));
        (rx, stop)
    }

    async fn led_within(leading: &mut Leading, limit: Duration) -> bool {
        tokio::time::timeout(limit, leading.wait_for(|l| l.is_some()))
            .await
            .is_ok()
    }

    /// The holder's clock is an hour behind ours, and it renews every 2 s: its `renewTime`
    /// always looks long expired by our clock, yet the Lease is alive.
    #[tokio::test(start_paused = true)]
    async fn a_follower_behind_a_holder_with_a_slow_clock_does_not_take_a_lease_being_renewed() {
        let server = Arc::new(Mutex::new(Server::default()));
        let slow = SystemTime::now() - Duration::from_secs(3600);
        server.lock().unwrap().put("b", slow);
        let renewing = {
            let server = server.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                loop {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    server.lock().unwrap().put("b", slow + started.elapsed());
                }
            })
        };
        let (mut leading, stop) = start(&server, Timing::default());
        assert!(
            !led_within(&mut leading, Duration::from_secs(120)).await,
            "took a Lease its holder renews every 2 s"
        );
        assert!(server.lock().unwrap().writes.is_empty());
        renewing.abort();
        stop.cancel();
    }

    /// The holder's clock is an hour ahead of ours and it stopped renewing: its last
    /// `renewTime` looks fresh for an hour by our clock, yet the Lease is dead after one
    /// duration without a change.
    #[tokio::test(start_paused = true)]
    async fn a_follower_takes_a_lease_that_stopped_changing_whatever_its_renew_time_says() {
        let server = Arc::new(Mutex::new(Server::default()));
        server
            .lock()
            .unwrap()
            .put("b", SystemTime::now() + Duration::from_secs(3600));
        let timing = Timing::default();
        let started = Instant::now();
        let (mut leading, stop) = start(&server, timing);
        assert!(
            led_within(&mut leading, Duration::from_secs(120)).await,
            "never took a Lease that stopped changing"
        );
        let waited = started.elapsed();
        // A full duration after first seeing the record, as client-go: not sooner, and no
        // more than a retry period later.
        assert!(
            waited >= timing.lease_duration
                && waited <= timing.lease_duration + timing.retry_period,
            "took it after {waited:?}"
        );
        assert_eq!(server.lock().unwrap().writes, ["a"]);
        stop.cancel();
    }
    /// Mechanism one alone: the leader's Lease requests stop answering and nothing times them
    /// out (this API has no request timeout, as a client without one): the elector's own clock
    /// ends the term, and cancels its token, when the claim of the last renewal runs out.
    #[tokio::test(start_paused = true)]
    async fn without_request_timeouts_the_electors_clock_ends_the_term_when_the_api_hangs() {
        let server = Arc::new(Mutex::new(Server::default()));
        let timing = Timing::default();
        let t0 = Instant::now();
        let (mut leading, stop) = start(&server, timing);
        assert!(led_within(&mut leading, Duration::from_secs(1)).await);
        let term = leading.borrow().clone().expect("leading");
        // Rounds at 0, 2, 4 s renew; from 5 s nothing answers. The claim of the round of 4 s
        // lasts to 14 s.
        tokio::time::sleep_until(t0 + Duration::from_secs(5)).await;
        server.lock().unwrap().hang = true;
        let renewals = server.lock().unwrap().writes.len();
        assert_eq!(renewals, 3, "acquired at 0 s, renewed at 2 and 4 s");
        tokio::time::timeout(Duration::from_secs(60), term.cancelled())
            .await
            .expect("the term never ended while its Lease requests hung");
        assert_eq!(t0.elapsed(), Duration::from_secs(4) + timing.renew_deadline);
        assert!(leading.borrow().is_none());
        stop.cancel();
    }
}
