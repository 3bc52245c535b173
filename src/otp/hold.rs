//! Redeems of a used, re-armable token waiting for its re-arm (docs/architecture.md, "The key
//! hand-off and retries"): Tekton creates a retry pod at once, so its redeem may arrive before the
//! controller re-armed the token in its secret. A waiter is woken when the token is re-armed (it
//! then tries again) or revoked (it gives up).
//!
//! The token is in a Secret its tenant can read, so the tenant can redeem it as often as it likes.
//! Only a token the controller will re-arm waits at all: the controller stores each key with the
//! retries its TaskRun may still start, and a used token with none to come is refused at once
//! ([`super::store::Entry::rearmable`]). Waiting is further bounded three ways, none of which lets
//! one token deny another's retry:
//! - one waiter per token: a newer redeem of the token takes the place of the one waiting (a
//!   retry pod's redeem is never stuck behind a stale one), so a token holds one place at most;
//! - one window per arm: the first wait for a token's current arm opens a window of `wait`, and
//!   every later redeem of that arm waits only until the window closes. Once it closed without a
//!   re-arm, the controller is not re-arming this token, and its redeems are refused at once
//!   until it does (the arm count grows, which opens a new window);
//! - at most `max` waiters in all.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use prometheus::IntGauge;
use tokio::sync::watch;
use tokio::time::Instant;

use super::token::TokenHash;

/// What happened to a token redeems wait on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Nothing yet.
    Waiting,
    /// Re-armed: try the redeem again.
    Rearmed,
    /// Revoked: the entry is gone.
    Revoked,
    /// A newer redeem of the same token waits in this one's place.
    Superseded,
}

/// Why a redeem may not wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoHold {
    /// `max` redeems already wait.
    Full,
    /// This arm's window closed without a re-arm.
    WindowClosed,
}

/// The waiting state of one token.
struct TokenHolds {
    /// The arm count the window belongs to.
    arm: usize,
    /// When the window of that arm closes.
    closes: Instant,
    /// The redeem waiting now: its ticket and how to wake it.
    waiter: Option<(u64, watch::Sender<Wake>)>,
}

struct State {
    waiting: usize,
    next_ticket: u64,
    tokens: HashMap<TokenHash, TokenHolds>,
}

/// Waiting redeems, by token.
pub struct Holds {
    max: usize,
    wait: Duration,
    /// Most tokens remembered (a closed window must be remembered to refuse at once); the
    /// oldest closed windows are forgotten beyond it, which only grants their tokens one more.
    max_tokens: usize,
    held: IntGauge,
    state: Mutex<State>,
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds")
            .field("max", &self.max)
            .field("wait", &self.wait)
            .field("held", &self.held.get())
            .finish()
    }
}

/// One waiting redeem; leaving it (drop) frees its place.
pub struct Hold<'a> {
    holds: &'a Holds,
    hash: TokenHash,
    ticket: u64,
    closes: Instant,
    rx: watch::Receiver<Wake>,
}

impl Holds {
    /// Room for `max` waiting redeems, counted in `held`, each arm of a token waiting at most
    /// `wait` in all.
    pub fn new(max: usize, wait: Duration, held: IntGauge) -> Self {
        Self {
            max,
            wait,
            max_tokens: max.saturating_mul(64).max(1024),
            held,
            state: Mutex::new(State {
                waiting: 0,
                next_ticket: 0,
                tokens: HashMap::new(),
            }),
        }
    }

    /// A place to wait for the re-arm of `hash`, whose entry has been armed `arm` times, at
    /// `now`. Subscribe before looking at the entry again: a wake between that look and the wait
    /// is then not lost.
    pub fn hold(&self, hash: TokenHash, arm: usize, now: Instant) -> Result<Hold<'_>, NoHold> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *guard;
        let fresh = TokenHolds {
            arm,
            closes: now + self.wait,
            waiter: None,
        };
        let known = state.tokens.contains_key(&hash);
        let t = state.tokens.entry(hash).or_insert(fresh);
        if t.arm != arm {
            // Re-armed (and redeemed) since the last window: the controller acted, a new wait
            // may be for the next retry.
            t.arm = arm;
            t.closes = now + self.wait;
        }
        if now >= t.closes {
            return Err(NoHold::WindowClosed);
        }
        match t.waiter.take() {
            Some((_, older)) => {
                older.send_replace(Wake::Superseded);
            }
            None if state.waiting >= self.max => {
                if !known {
                    state.tokens.remove(&hash);
                }
                return Err(NoHold::Full);
            }
            None => {
                state.waiting += 1;
                self.held.inc();
            }
        }
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        let (tx, rx) = watch::channel(Wake::Waiting);
        let closes = t.closes;
        t.waiter = Some((ticket, tx));
        let excess = state.tokens.len().saturating_sub(self.max_tokens);
        if !known && excess > 0 {
            forget_closed(&mut state.tokens, now, excess);
        }
        Ok(Hold {
            holds: self,
            hash,
            ticket,
            closes,
            rx,
        })
    }

    /// Wakes the redeem waiting for `hash`.
    pub fn wake(&self, hash: &TokenHash, why: Wake) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = state.tokens.get(hash) {
            if let Some((_, tx)) = &t.waiter {
                tx.send_replace(why);
            } else if why == Wake::Revoked {
                // The entry is gone: its redeems never wait again.
                state.tokens.remove(hash);
            }
        }
    }

    /// How many redeems wait.
    pub fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).waiting
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Forgets up to `n` tokens nobody waits for whose window closed, oldest first.
fn forget_closed(tokens: &mut HashMap<TokenHash, TokenHolds>, now: Instant, n: usize) {
    let mut closed: Vec<(Instant, TokenHash)> = tokens
        .iter()
        .filter(|(_, t)| t.waiter.is_none() && t.closes <= now)
        .map(|(h, t)| (t.closes, *h))
        .collect();
    closed.sort_unstable_by_key(|(closes, _)| *closes);
    for (_, h) in closed.into_iter().take(n) {
        tokens.remove(&h);
    }
}

impl Hold<'_> {
    /// The next wake.
    pub async fn woken(&mut self) -> Wake {
        match self.rx.changed().await {
            Ok(()) => *self.rx.borrow_and_update(),
            // The sender lives as long as this waiter holds its place.
            Err(_) => Wake::Waiting,
        }
    }

    /// When this arm's window closes: the wait ends then at the latest.
    pub fn closes(&self) -> Instant {
        self.closes
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        let mut state = self.holds.state.lock().unwrap_or_else(|p| p.into_inner());
        let mine = state
            .tokens
            .get_mut(&self.hash)
            .filter(|t| matches!(&t.waiter, Some((ticket, _)) if *ticket == self.ticket));
        // A superseded waiter's place went to the newer one, which frees it in turn.
        if let Some(t) = mine {
            t.waiter = None;
            state.waiting -= 1;
            self.holds.held.dec();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(b: u8) -> TokenHash {
        TokenHash([b; 32])
    }

    const WAIT: Duration = Duration::from_secs(90);

    #[tokio::test]
    async fn waiters_are_capped_woken_by_token_and_freed_on_drop() {
        let gauge = IntGauge::new("held", "held").unwrap();
        let holds = Holds::new(2, WAIT, gauge.clone());
        let now = Instant::now();
        let mut a = holds.hold(hash(1), 1, now).unwrap();
        let mut b = holds.hold(hash(2), 1, now).unwrap();
        assert_eq!(
            holds.hold(hash(3), 1, now).err(),
            Some(NoHold::Full),
            "the cap holds across tokens"
        );
        assert_eq!((holds.len(), gauge.get()), (2, 2));

        // A wake for another token wakes nobody here.
        holds.wake(&hash(3), Wake::Rearmed);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), a.woken())
                .await
                .is_err()
        );
        // A wake sent before the waiter awaits is not lost.
        holds.wake(&hash(1), Wake::Rearmed);
        assert_eq!(a.woken().await, Wake::Rearmed);
        holds.wake(&hash(1), Wake::Rearmed);
        assert_eq!(a.woken().await, Wake::Rearmed, "every wake counts");
        holds.wake(&hash(2), Wake::Revoked);
        assert_eq!(b.woken().await, Wake::Revoked);

        drop(a);
        let c = holds.hold(hash(3), 1, now).unwrap();
        drop((b, c));
        assert!(holds.is_empty());
        assert_eq!(gauge.get(), 0);
    }

    #[tokio::test]
    async fn a_token_holds_one_place_and_a_newer_redeem_takes_it() {
        let gauge = IntGauge::new("held", "held").unwrap();
        let holds = Holds::new(2, WAIT, gauge.clone());
        let now = Instant::now();
        let mut first = holds.hold(hash(1), 1, now).unwrap();
        let mut waiters = Vec::new();
        for i in 1..260u64 {
            waiters.push(
                holds
                    .hold(hash(1), 1, now + Duration::from_millis(i))
                    .unwrap(),
            );
        }
        assert_eq!(first.woken().await, Wake::Superseded);
        assert_eq!((holds.len(), gauge.get()), (1, 1), "one place per token");
        // Another token still finds room.
        let other = holds.hold(hash(2), 1, now).unwrap();
        // The newer waiter's window is the first one's: superseding never extends it.
        assert_eq!(waiters.last().unwrap().closes(), now + WAIT);
        // Dropping superseded waiters frees nothing; the current one frees the place.
        drop(first);
        let current = waiters.pop().unwrap();
        drop(waiters);
        assert_eq!(holds.len(), 2);
        drop((current, other));
        assert!(holds.is_empty());
        assert_eq!(gauge.get(), 0);
    }

    #[tokio::test]
    async fn a_closed_window_refuses_until_the_token_is_rearmed() {
        let gauge = IntGauge::new("held", "held").unwrap();
        let holds = Holds::new(4, WAIT, gauge);
        let t0 = Instant::now();
        drop(holds.hold(hash(1), 1, t0).unwrap());
        // Later redeems of the same arm share the window...
        let late = holds.hold(hash(1), 1, t0 + WAIT / 2).unwrap();
        assert_eq!(late.closes(), t0 + WAIT);
        drop(late);
        // ...and once it closed they are refused at once.
        assert_eq!(
            holds.hold(hash(1), 1, t0 + WAIT).err(),
            Some(NoHold::WindowClosed)
        );
        assert_eq!(
            holds.hold(hash(1), 1, t0 + WAIT * 10).err(),
            Some(NoHold::WindowClosed)
        );
        // A re-arm (redeemed since) opens a new window for the next retry.
        let next = holds.hold(hash(1), 2, t0 + WAIT * 10).unwrap();
        assert_eq!(next.closes(), t0 + WAIT * 11);
        drop(next);
        // A revoke forgets the token.
        holds.wake(&hash(1), Wake::Revoked);
        assert!(holds.state.lock().unwrap().tokens.is_empty());
    }

    #[tokio::test]
    async fn remembered_tokens_are_bounded() {
        let gauge = IntGauge::new("held", "held").unwrap();
        let holds = Holds::new(1, WAIT, gauge);
        let max_tokens = holds.max_tokens;
        let t0 = Instant::now();
        for i in 0..(max_tokens as u32 + 10) {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&i.to_be_bytes());
            let now = t0 + WAIT * 2 * i;
            drop(holds.hold(TokenHash(h), 1, now).unwrap());
        }
        assert!(holds.state.lock().unwrap().tokens.len() <= max_tokens);
    }
}
