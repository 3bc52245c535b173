//! Redeems of a used, re-armable token waiting for its re-arm (design §1.4): Tekton creates a
//! retry pod at once, so its redeem may arrive before the controller re-armed the token in its
//! secret. A waiter is woken when the token is re-armed (it then tries again) or revoked (it gives
//! up). At most `max` redeems wait at a time, so waiting cannot pin the server's resources.

use std::collections::HashMap;
use std::sync::Mutex;

use prometheus::IntGauge;
use tokio::sync::watch;

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
}

struct Waiters {
    count: usize,
    tx: watch::Sender<Wake>,
}

/// Waiting redeems, by token.
pub struct Holds {
    max: usize,
    held: IntGauge,
    state: Mutex<(usize, HashMap<TokenHash, Waiters>)>,
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds")
            .field("max", &self.max)
            .field("held", &self.held.get())
            .finish()
    }
}

/// One waiting redeem; leaving it (drop) frees its place.
pub struct Hold<'a> {
    holds: &'a Holds,
    hash: TokenHash,
    rx: watch::Receiver<Wake>,
}

impl Holds {
    /// Room for `max` waiting redeems, counted in `held`.
    pub fn new(max: usize, held: IntGauge) -> Self {
        Self {
            max,
            held,
            state: Mutex::new((0, HashMap::new())),
        }
    }

    /// A place to wait for `hash`, or `None` if `max` redeems already wait. Subscribe before
    /// looking at the entry again: a wake between that look and the wait is then not lost.
    pub fn hold(&self, hash: TokenHash) -> Option<Hold<'_>> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (total, waiters) = &mut *state;
        if *total >= self.max {
            return None;
        }
        *total += 1;
        let w = waiters.entry(hash).or_insert_with(|| Waiters {
            count: 0,
            tx: watch::channel(Wake::Waiting).0,
        });
        w.count += 1;
        let rx = w.tx.subscribe();
        self.held.inc();
        Some(Hold {
            holds: self,
            hash,
            rx,
        })
    }

    /// Wakes the redeems waiting for `hash`.
    pub fn wake(&self, hash: &TokenHash, why: Wake) {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = state.1.get(hash) {
            w.tx.send_replace(why);
        }
    }

    /// How many redeems wait.
    pub fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Hold<'_> {
    /// The next wake.
    pub async fn woken(&mut self) -> Wake {
        match self.rx.changed().await {
            Ok(()) => *self.rx.borrow_and_update(),
            // The sender lives as long as any waiter of its token, this one included.
            Err(_) => Wake::Waiting,
        }
    }
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        let mut state = self.holds.state.lock().unwrap_or_else(|p| p.into_inner());
        let (total, waiters) = &mut *state;
        *total -= 1;
        if let Some(w) = waiters.get_mut(&self.hash) {
            w.count -= 1;
            if w.count == 0 {
                waiters.remove(&self.hash);
            }
        }
        self.holds.held.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn hash(b: u8) -> TokenHash {
        TokenHash([b; 32])
    }

    #[tokio::test]
    async fn waiters_are_capped_woken_by_token_and_freed_on_drop() {
        let gauge = IntGauge::new("held", "held").unwrap();
        let holds = Holds::new(2, gauge.clone());
        let mut a1 = holds.hold(hash(1)).unwrap();
        let mut a2 = holds.hold(hash(1)).unwrap();
        assert!(holds.hold(hash(2)).is_none(), "the cap holds across tokens");
        assert_eq!((holds.len(), gauge.get()), (2, 2));

        // A wake for another token wakes nobody here.
        holds.wake(&hash(2), Wake::Rearmed);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), a1.woken())
                .await
                .is_err()
        );
        // A wake sent before the waiter awaits is not lost.
        holds.wake(&hash(1), Wake::Rearmed);
        assert_eq!(a1.woken().await, Wake::Rearmed);
        assert_eq!(a2.woken().await, Wake::Rearmed);
        holds.wake(&hash(1), Wake::Rearmed);
        assert_eq!(a1.woken().await, Wake::Rearmed, "every wake counts");
        holds.wake(&hash(1), Wake::Revoked);
        assert_eq!(a2.woken().await, Wake::Revoked);

        drop(a1);
        let b = holds.hold(hash(2)).unwrap();
        drop((a2, b));
        assert!(holds.is_empty());
        assert_eq!(gauge.get(), 0);
        assert!(
            holds.state.lock().unwrap().1.is_empty(),
            "no token left behind"
        );
    }
}
