//! Durable one-time entries in a redb file, with group commit.
//!
//! Why redb: a pure-Rust, actively maintained embedded B-tree store with ACID transactions, a
//! stable file format, crash safety without a write-ahead log to tune, and exclusive-writer file
//! locking (a second server on the same volume fails fast instead of corrupting it). The workload
//! is tiny, key-value and write-heavy, which rules out needing SQL (SQLite would also bring C code),
//! and sled/RocksDB are respectively unmaintained and a large C++ dependency.
//!
//! Every operation runs on one writer thread. It takes whatever requests are queued, applies them
//! in order inside one write transaction and commits once (one fsync), and only then answers
//! them. So a redeem is read-check-tombstone in a single serialised transaction: two concurrent
//! redeems of one token cannot both see it live, and no key is returned before the tombstone is
//! durable, which is what makes "exactly once" survive crashes. Batching is what lets a disk with
//! millisecond fsyncs serve thousands of redeems per second.
//!
//! Owner-keyed entries (the controller's stores, keyed by TaskRun UID) remember which requests
//! armed them, so a retried store or re-arm changes nothing, and are indexed by owner so a revoke
//! deletes them all in one transaction. A revoked owner is remembered for a TTL, so a late retry
//! cannot bring an entry back.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aws_lc_rs::digest;
use redb::{
    Database, MultimapTableDefinition, ReadableMultimapTable, ReadableTable, TableDefinition,
};
use tokio::sync::{mpsc, oneshot};
use zeroize::Zeroizing;

use super::seal::{KeyDigest, SealError, Sealer};
use super::token::TokenHash;

const ENTRIES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("entries");
/// Owner → the token hashes of its entries.
const OWNERS: MultimapTableDefinition<&[u8], &[u8]> = MultimapTableDefinition::new("owners");
/// Revoked owner → Unix ms until which stores for it are refused.
const REVOKED: TableDefinition<&[u8], u64> = TableDefinition::new("revoked");
/// Owner → the request id of its latest first store: what a re-arm by owner re-arms (the token
/// is derived from owner and request, so the controller need not read it back from the
/// TaskRun's Secret).
const LATEST: TableDefinition<&[u8], &[u8]> = TableDefinition::new("latest");
const MAX_BATCH: usize = 512;
/// Most requests that may arm one entry (its first store plus re-arms): far more retries than any
/// Task sets, and a bound on an entry's size.
pub const MAX_ARMS: usize = 64;
/// Longest owner or request id, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// Wall-clock milliseconds since the Unix epoch (entries outlive the process, so a monotonic clock
/// will not do). Injected so tests can move time.
pub trait Clock: Send + Sync + 'static {
    /// Now, in Unix milliseconds.
    fn now_ms(&self) -> u64;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or_default()
    }
}

/// A request id as entries remember it: a prefix of its SHA-256 (fixed size, no collisions in
/// practice).
pub type RequestDigest = [u8; 16];

/// The [`RequestDigest`] of a request id.
pub fn request_digest(request: &str) -> RequestDigest {
    let d = digest::digest(&digest::SHA256, request.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&d.as_ref()[..16]);
    out
}

/// A stored entry. `sealed` holds the key while it waits to be redeemed; a redeemed entry stays
/// as a tombstone until it expires, so a second attempt says "used" and its owner can re-arm it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Expiry, Unix ms.
    pub expires_at_ms: u64,
    /// Output of [`Sealer::seal`], until redeemed.
    pub sealed: Option<Vec<u8>>,
    /// [`Sealer::digest`] of the current key; `None` for entries written before digests were kept.
    pub key_digest: Option<KeyDigest>,
    /// The owner (a TaskRun UID) of an owner-keyed entry.
    pub owner: Option<Vec<u8>>,
    /// The requests that armed it, oldest first: the last one's key is the current one.
    pub arms: Vec<RequestDigest>,
    /// How many more times the owner may re-arm it (its TaskRun's retries not yet started);
    /// `None` for entries of stores that did not say (no bound).
    pub rearms_left: Option<u8>,
}

// Entries of the first format: state byte, expiry, sealed key (live only).
const V1_LIVE: u8 = 1;
const V1_REDEEMED: u8 = 2;
const V2: u8 = 3;
const F_LIVE: u8 = 1;
const F_DIGEST: u8 = 2;
const F_OWNER: u8 = 4;
const F_BUDGET: u8 = 8;

impl Entry {
    /// Serialised form: `3`, expiry (u64 BE), flags, then as flagged the key digest (32 bytes)
    /// and the owner (length byte + bytes), the arms (count byte + 16 bytes each), as flagged
    /// the re-arms left (one byte), and last the sealed key.
    pub fn encode(&self) -> Vec<u8> {
        let owner_len = self.owner.as_ref().map_or(0, |o| 1 + o.len());
        let mut v = Vec::with_capacity(
            11 + 32 + owner_len + 16 * self.arms.len() + self.sealed.as_ref().map_or(0, Vec::len),
        );
        v.push(V2);
        v.extend_from_slice(&self.expires_at_ms.to_be_bytes());
        let flag = |set: bool, f: u8| if set { f } else { 0 };
        let flags = flag(self.sealed.is_some(), F_LIVE)
            | flag(self.key_digest.is_some(), F_DIGEST)
            | flag(self.owner.is_some(), F_OWNER)
            | flag(self.rearms_left.is_some(), F_BUDGET);
        v.push(flags);
        if let Some(d) = &self.key_digest {
            v.extend_from_slice(d);
        }
        if let Some(o) = &self.owner {
            // Owners are validated to at most MAX_ID_LEN bytes, arms capped at MAX_ARMS.
            v.push(o.len() as u8);
            v.extend_from_slice(o);
        }
        v.push(self.arms.len() as u8);
        for a in &self.arms {
            v.extend_from_slice(a);
        }
        if let Some(n) = self.rearms_left {
            v.push(n);
        }
        if let Some(s) = &self.sealed {
            v.extend_from_slice(s);
        }
        v
    }

    /// Parses [`Self::encode`]'s output, and entries of the first format.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let (&tag, rest) = b.split_first()?;
        let (expiry, mut rest) = rest.split_first_chunk::<8>()?;
        let expires_at_ms = u64::from_be_bytes(*expiry);
        let v1 = |sealed| Self {
            expires_at_ms,
            sealed,
            key_digest: None,
            owner: None,
            arms: Vec::new(),
            rearms_left: None,
        };
        match tag {
            V1_LIVE => return Some(v1(Some(rest.to_vec()))),
            V1_REDEEMED if rest.is_empty() => return Some(v1(None)),
            V2 => {}
            _ => return None,
        }
        let (&flags, r) = rest.split_first()?;
        rest = r;
        if flags & !(F_LIVE | F_DIGEST | F_OWNER | F_BUDGET) != 0 {
            return None;
        }
        let mut key_digest = None;
        if flags & F_DIGEST != 0 {
            let (d, r) = rest.split_first_chunk::<32>()?;
            key_digest = Some(*d);
            rest = r;
        }
        let mut owner = None;
        if flags & F_OWNER != 0 {
            let (&n, r) = rest.split_first()?;
            let (o, r) = r.split_at_checked(usize::from(n))?;
            owner = Some(o.to_vec());
            rest = r;
        }
        let (&n, r) = rest.split_first()?;
        let (arms, mut rest) = r.split_at_checked(16 * usize::from(n))?;
        let arms = arms
            .chunks_exact(16)
            .map(|c| c.try_into().expect("16-byte chunk"))
            .collect();
        let mut rearms_left = None;
        if flags & F_BUDGET != 0 {
            let (&n, r) = rest.split_first()?;
            rearms_left = Some(n);
            rest = r;
        }
        let sealed = if flags & F_LIVE != 0 {
            Some(rest.to_vec())
        } else if rest.is_empty() {
            None
        } else {
            return None;
        };
        Some(Self {
            expires_at_ms,
            sealed,
            key_digest,
            owner,
            arms,
            rearms_left,
        })
    }

    /// A used entry its owner may still re-arm: owned, with a re-arm left (or no bound given).
    /// Only a redeem of such an entry may wait for a re-arm.
    pub fn rearmable(&self) -> bool {
        self.owner.is_some() && self.rearms_left != Some(0)
    }
}

/// Why a redeem yields no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No such token (never issued, revoked, or purged after expiry).
    Unknown,
    /// Already redeemed. `rearmable`: its owner may re-arm it for a retry attempt.
    Used {
        /// The entry is owner-keyed and has a re-arm left ([`Entry::rearmable`]).
        rearmable: bool,
        /// How many requests armed it so far: a re-arm raises it, so holds can tell one arm's
        /// wait from the next.
        arms: usize,
    },
    /// Past its TTL.
    Expired,
}

/// What a redeem should do, given the entry: the pure core of the exactly-once rule.
pub fn decide_redeem(entry: Option<&Entry>, now_ms: u64) -> Result<(), Refusal> {
    match entry {
        None => Err(Refusal::Unknown),
        Some(e) if e.expires_at_ms <= now_ms => Err(Refusal::Expired),
        Some(e) if e.sealed.is_none() => Err(Refusal::Used {
            rearmable: e.rearmable(),
            arms: e.arms.len(),
        }),
        Some(_) => Ok(()),
    }
}

/// Who stores a key, as the store sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// No owner: the Go controller's protocol, or an `Idempotency-Key`.
    Anonymous,
    /// An owner's request: the first key of the request (the token is derived from owner and
    /// request), or with `rearm` a new key for a token the owner already holds.
    Owned {
        /// The TaskRun UID.
        owner: Vec<u8>,
        /// The controller's id for this provisioning, stable across its retries.
        request: RequestDigest,
        /// The request id itself: a first store remembers it as the owner's latest.
        request_id: Vec<u8>,
        /// Re-arm an existing token rather than create one.
        rearm: bool,
        /// How many more re-arms may follow this store (`None`: not said, no bound).
        rearms_left: Option<u8>,
    },
}

/// A store to apply.
pub struct StoreRequest {
    /// The token's hash.
    pub hash: TokenHash,
    /// Who stores.
    pub claim: Claim,
    /// The sealed key.
    pub sealed: Vec<u8>,
    /// [`Sealer::digest`] of the key.
    pub key_digest: KeyDigest,
    /// The key, only to recognise a retry (against a digest made under a rotated secret, or an
    /// entry without a digest).
    pub plaintext: Zeroizing<Vec<u8>>,
    /// Lifetime of a new or re-armed entry.
    pub ttl: Duration,
}

/// Result of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// A new entry.
    Created,
    /// A retried request: the entry already holds its key (or a later request's), unchanged.
    Replayed,
    /// The owner's token redeems once more, with the new key. `was_redeemed`: it had been used
    /// (else its unredeemed key was replaced, never to be handed out).
    Rearmed {
        /// The entry was a tombstone before.
        was_redeemed: bool,
    },
}

/// Why a store was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreRefusal {
    /// The request already stored a different key (an idempotency key or request id was reused).
    DifferentKey,
    /// An anonymous entry was already redeemed.
    AlreadyRedeemed,
    /// The token to re-arm does not exist.
    Unknown,
    /// The token to re-arm expired.
    Expired,
    /// The token belongs to another owner (or to none).
    OtherOwner,
    /// The owner was revoked: its TaskRun ended.
    OwnerRevoked,
    /// The token was re-armed [`MAX_ARMS`] times.
    TooManyRearms,
}

/// What a store came to (a storage failure is a [`StoreError`] instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Applied (or already applied): the token redeems the request's key.
    Stored(Stored),
    /// Nothing changed.
    Refused(StoreRefusal),
}

/// What a store does: the pure core of idempotency and re-arming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Write this entry and answer.
    Write(Entry, Stored),
    /// Change nothing and answer.
    Answer(Stored),
    Refuse(StoreRefusal),
}

/// Decides a store against the current entry. `same_key` tells whether an entry holds the
/// request's key; `owner_revoked` whether the claim's owner was revoked.
pub fn decide_store(
    entry: Option<Entry>,
    req: &StoreRequest,
    now_ms: u64,
    owner_revoked: bool,
    same_key: impl FnOnce(&Entry) -> bool,
) -> Plan {
    let expires_at_ms = now_ms.saturating_add(req.ttl.as_millis() as u64);
    let found_expired = entry.as_ref().is_some_and(|e| e.expires_at_ms <= now_ms);
    let current = entry.filter(|e| e.expires_at_ms > now_ms);
    let fresh = |owner: Option<Vec<u8>>, arms, rearms_left| {
        let e = Entry {
            expires_at_ms,
            sealed: Some(req.sealed.clone()),
            key_digest: Some(req.key_digest),
            owner,
            arms,
            rearms_left,
        };
        Plan::Write(e, Stored::Created)
    };
    let (owner, request, rearm, rearms_left) = match &req.claim {
        Claim::Anonymous => {
            return match current {
                None => fresh(None, Vec::new(), None),
                Some(e) if e.owner.is_some() => Plan::Refuse(StoreRefusal::OtherOwner),
                Some(e) if e.sealed.is_none() => Plan::Refuse(StoreRefusal::AlreadyRedeemed),
                Some(e) if same_key(&e) => Plan::Answer(Stored::Replayed),
                Some(_) => Plan::Refuse(StoreRefusal::DifferentKey),
            };
        }
        Claim::Owned {
            owner,
            request,
            rearm,
            rearms_left,
            ..
        } => (owner, request, *rearm, *rearms_left),
    };
    if owner_revoked {
        return Plan::Refuse(StoreRefusal::OwnerRevoked);
    }
    let Some(mut e) = current else {
        return match (rearm, found_expired) {
            (false, _) => fresh(Some(owner.clone()), vec![*request], rearms_left),
            (true, true) => Plan::Refuse(StoreRefusal::Expired),
            (true, false) => Plan::Refuse(StoreRefusal::Unknown),
        };
    };
    if e.owner.as_ref() != Some(owner) {
        return Plan::Refuse(StoreRefusal::OtherOwner);
    }
    if e.arms.last() == Some(request) {
        return if same_key(&e) {
            Plan::Answer(Stored::Replayed)
        } else {
            Plan::Refuse(StoreRefusal::DifferentKey)
        };
    }
    if e.arms.contains(request) {
        // A late copy of a request a later one superseded: arming again would bring back a key
        // that was already replaced (or handed out).
        return Plan::Answer(Stored::Replayed);
    }
    if e.arms.len() >= MAX_ARMS {
        return Plan::Refuse(StoreRefusal::TooManyRearms);
    }
    let was_redeemed = e.sealed.is_none();
    e.sealed = Some(req.sealed.clone());
    e.key_digest = Some(req.key_digest);
    e.arms.push(*request);
    e.expires_at_ms = expires_at_ms;
    // The controller says how many retries are still to come; a store that does not say spends
    // one.
    e.rearms_left = rearms_left.or(e.rearms_left.map(|n| n.saturating_sub(1)));
    Plan::Write(e, Stored::Rearmed { was_redeemed })
}

/// Result of a redeem.
pub enum Redeemed {
    /// The key, exactly once.
    Key(Zeroizing<Vec<u8>>),
    /// No key.
    Refused(Refusal),
}

/// What a revoke deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Revoked {
    /// The deleted entries.
    pub hashes: Vec<TokenHash>,
    /// How many of them were waiting to be redeemed.
    pub pending: u64,
}

/// What a purge removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Expired entries that were never redeemed.
    pub expired: u64,
    /// Tombstones of redeemed entries past their expiry.
    pub tombstones: u64,
    /// Revoked owners forgotten after their TTL.
    pub owners: u64,
    /// Entries still waiting after the purge.
    pub pending: u64,
    /// Entries kept (waiting keys and redeemed tombstones).
    pub entries: u64,
}

/// Storage failures (the request may be retried).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed.
    #[error("database error: {0}")]
    Db(String),
    /// A stored value could not be opened.
    #[error("{0}")]
    Seal(#[from] SealError),
    /// The writer thread is gone (shutting down).
    #[error("the store is shut down")]
    Closed,
}

fn db_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Db(e.to_string())
}

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

enum Op {
    Store {
        req: StoreRequest,
        reply: Reply<StoreOutcome>,
    },
    Redeem {
        hash: TokenHash,
        reply: Reply<Redeemed>,
    },
    Revoke {
        owner: Vec<u8>,
        ttl: Duration,
        reply: Reply<Revoked>,
    },
    Purge {
        reply: Reply<Purged>,
    },
    Latest {
        owner: Vec<u8>,
        reply: Reply<Option<Vec<u8>>>,
    },
}

impl Op {
    /// Answers without applying (the transaction could not even start).
    fn fail(self, e: &str) {
        let err = || StoreError::Db(e.to_owned());
        match self {
            Self::Store { reply, .. } => drop(reply.send(Err(err()))),
            Self::Redeem { reply, .. } => drop(reply.send(Err(err()))),
            Self::Revoke { reply, .. } => drop(reply.send(Err(err()))),
            Self::Purge { reply } => drop(reply.send(Err(err()))),
            Self::Latest { reply, .. } => drop(reply.send(Err(err()))),
        }
    }
}

/// Handle to the store; cheap to clone.
#[derive(Clone)]
pub struct Store {
    tx: mpsc::Sender<Op>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

/// Joins the writer thread when the last handle owner shuts down.
pub struct StoreThread(Option<std::thread::JoinHandle<()>>);

impl StoreThread {
    /// Waits for the writer to finish queued work (after every [`Store`] handle is dropped).
    pub fn join(mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

impl Store {
    /// Opens (or creates) the database at `path` and starts the writer thread.
    pub fn open(
        path: &Path,
        sealer: Arc<Sealer>,
        clock: Arc<dyn Clock>,
    ) -> Result<(Self, StoreThread), StoreError> {
        let mut builder = Database::builder();
        builder.set_cache_size(32 << 20);
        let db = builder
            .create(path)
            .map_err(|e| StoreError::Db(format!("opening {}: {e}", path.display())))?;
        // Create the tables so reads before the first write work.
        let txn = db.begin_write().map_err(db_err)?;
        txn.open_table(ENTRIES).map_err(db_err)?;
        txn.open_multimap_table(OWNERS).map_err(db_err)?;
        txn.open_table(REVOKED).map_err(db_err)?;
        txn.open_table(LATEST).map_err(db_err)?;
        txn.commit().map_err(db_err)?;
        let (tx, rx) = mpsc::channel(4 * MAX_BATCH);
        let handle = std::thread::Builder::new()
            .name("otp-store".into())
            .spawn(move || writer(db, rx, &sealer, &*clock))
            .map_err(|e| StoreError::Db(format!("starting the writer thread: {e}")))?;
        Ok((Self { tx }, StoreThread(Some(handle))))
    }

    async fn call<T>(
        &self,
        op: Op,
        rx: oneshot::Receiver<Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.tx.send(op).await.map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    /// Applies a store (see [`decide_store`]).
    pub async fn store(&self, req: StoreRequest) -> Result<StoreOutcome, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(Op::Store { req, reply }, rx).await
    }

    /// Redeems `hash`: the key if it is live (and from then on never again), else why not.
    pub async fn redeem(&self, hash: TokenHash) -> Result<Redeemed, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(Op::Redeem { hash, reply }, rx).await
    }

    /// Deletes every entry of `owner` and refuses its stores for `ttl`. Idempotent.
    pub async fn revoke(&self, owner: Vec<u8>, ttl: Duration) -> Result<Revoked, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(Op::Revoke { owner, ttl, reply }, rx).await
    }

    /// The request id of `owner`'s latest first store (whose token a re-arm by owner re-arms),
    /// while the owner has entries.
    pub async fn latest(&self, owner: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(Op::Latest { owner, reply }, rx).await
    }

    /// Deletes expired entries, tombstones and revoked owners.
    pub async fn purge(&self) -> Result<Purged, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(Op::Purge { reply }, rx).await
    }
}

/// An answer held back until the batch is committed; it is given the commit's error, if any, so
/// nothing is acknowledged (and no key handed out) unless it is durable.
type Answer = Box<dyn FnOnce(Option<&str>) + Send>;

/// The answer for `r`, noting a database failure in `fatal`.
fn answer<T: Send + 'static>(
    reply: Reply<T>,
    r: Result<T, StoreError>,
    fatal: &mut Option<String>,
) -> Answer {
    if let Err(StoreError::Db(e)) = &r {
        fatal.get_or_insert_with(|| e.clone());
    }
    Box::new(move |failed: Option<&str>| {
        let r = match failed {
            Some(e) => Err(StoreError::Db(format!("commit failed: {e}"))),
            None => r,
        };
        drop(reply.send(r));
    })
}

fn writer(db: Database, mut rx: mpsc::Receiver<Op>, sealer: &Sealer, clock: &dyn Clock) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while let Some(op) = rx.blocking_recv() {
        batch.push(op);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        run_batch(&db, &mut batch, sealer, clock);
    }
}

/// The tables of one write transaction.
struct Tables<'t> {
    entries: redb::Table<'t, &'static [u8], &'static [u8]>,
    owners: redb::MultimapTable<'t, &'static [u8], &'static [u8]>,
    revoked: redb::Table<'t, &'static [u8], u64>,
    latest: redb::Table<'t, &'static [u8], &'static [u8]>,
}

impl<'t> Tables<'t> {
    fn open(txn: &'t redb::WriteTransaction) -> Result<Self, redb::TableError> {
        Ok(Self {
            entries: txn.open_table(ENTRIES)?,
            owners: txn.open_multimap_table(OWNERS)?,
            revoked: txn.open_table(REVOKED)?,
            latest: txn.open_table(LATEST)?,
        })
    }
}

fn run_batch(db: &Database, batch: &mut Vec<Op>, sealer: &Sealer, clock: &dyn Clock) {
    let txn = match db.begin_write() {
        Ok(t) => t,
        Err(e) => {
            let msg = e.to_string();
            batch.drain(..).for_each(|op| op.fail(&msg));
            return;
        }
    };
    let mut answers: Vec<Answer> = Vec::with_capacity(batch.len());
    let mut fatal: Option<String> = None;
    {
        let mut t = match Tables::open(&txn) {
            Ok(t) => t,
            Err(e) => {
                let msg = e.to_string();
                batch.drain(..).for_each(|op| op.fail(&msg));
                return;
            }
        };
        let now = clock.now_ms();
        for op in batch.drain(..) {
            let a = match op {
                Op::Store { req, reply } => {
                    answer(reply, apply_store(&mut t, sealer, &req, now), &mut fatal)
                }
                Op::Redeem { hash, reply } => {
                    answer(reply, apply_redeem(&mut t, sealer, &hash, now), &mut fatal)
                }
                Op::Revoke { owner, ttl, reply } => {
                    answer(reply, apply_revoke(&mut t, &owner, ttl, now), &mut fatal)
                }
                Op::Purge { reply } => answer(reply, apply_purge(&mut t, now), &mut fatal),
                Op::Latest { owner, reply } => {
                    let r = t
                        .latest
                        .get(owner.as_slice())
                        .map(|v| v.map(|v| v.value().to_vec()))
                        .map_err(db_err);
                    answer(reply, r, &mut fatal)
                }
            };
            answers.push(a);
        }
    }
    if let Some(e) = fatal {
        // A table operation failed mid-batch: keep nothing of it.
        let _ = txn.abort();
        answers.into_iter().for_each(|a| a(Some(&e)));
        return;
    }
    match txn.commit() {
        Ok(()) => answers.into_iter().for_each(|a| a(None)),
        Err(e) => {
            let e = e.to_string();
            tracing::error!(error = %e, "OTP store commit failed");
            answers.into_iter().for_each(|a| a(Some(&e)));
        }
    }
}

fn read(t: &Tables<'_>, hash: &TokenHash) -> Result<Option<Entry>, StoreError> {
    match t.entries.get(&hash.0[..]).map_err(db_err)? {
        None => Ok(None),
        Some(v) => Entry::decode(v.value())
            .map(Some)
            .ok_or_else(|| StoreError::Db("undecodable entry".into())),
    }
}

fn write(t: &mut Tables<'_>, hash: &TokenHash, e: &Entry) -> Result<(), StoreError> {
    t.entries
        .insert(&hash.0[..], e.encode().as_slice())
        .map_err(db_err)?;
    Ok(())
}

/// Whether `e` holds `plaintext` as its current key.
fn holds_key(e: &Entry, sealer: &Sealer, hash: &TokenHash, plaintext: &[u8]) -> bool {
    match (&e.key_digest, &e.sealed) {
        (Some(d), _) => sealer.digest_matches(&hash.0, plaintext, d),
        (None, Some(sealed)) => sealer
            .open(&hash.0, sealed)
            .is_ok_and(|k| k.as_slice() == plaintext),
        (None, None) => false,
    }
}

fn apply_store(
    t: &mut Tables<'_>,
    sealer: &Sealer,
    req: &StoreRequest,
    now: u64,
) -> Result<StoreOutcome, StoreError> {
    let entry = read(t, &req.hash)?;
    let revoked = match &req.claim {
        Claim::Anonymous => false,
        Claim::Owned { owner, .. } => t
            .revoked
            .get(owner.as_slice())
            .map_err(db_err)?
            .is_some_and(|until| until.value() > now),
    };
    let plan = decide_store(entry, req, now, revoked, |e| {
        holds_key(e, sealer, &req.hash, &req.plaintext)
    });
    match plan {
        Plan::Refuse(r) => Ok(StoreOutcome::Refused(r)),
        Plan::Answer(stored) => Ok(StoreOutcome::Stored(stored)),
        Plan::Write(e, stored) => {
            if let Some(owner) = &e.owner {
                // Idempotent: a re-armed entry is already indexed.
                t.owners
                    .insert(owner.as_slice(), &req.hash.0[..])
                    .map_err(db_err)?;
            }
            write(t, &req.hash, &e)?;
            if let (
                Stored::Created,
                Claim::Owned {
                    owner, request_id, ..
                },
            ) = (stored, &req.claim)
            {
                t.latest
                    .insert(owner.as_slice(), request_id.as_slice())
                    .map_err(db_err)?;
            }
            Ok(StoreOutcome::Stored(stored))
        }
    }
}

fn apply_redeem(
    t: &mut Tables<'_>,
    sealer: &Sealer,
    hash: &TokenHash,
    now: u64,
) -> Result<Redeemed, StoreError> {
    let entry = read(t, hash)?;
    if let Err(refusal) = decide_redeem(entry.as_ref(), now) {
        return Ok(Redeemed::Refused(refusal));
    }
    let Some(mut e) = entry else {
        return Ok(Redeemed::Refused(Refusal::Unknown));
    };
    let Some(sealed) = e.sealed.take() else {
        return Ok(Redeemed::Refused(Refusal::Used {
            rearmable: e.rearmable(),
            arms: e.arms.len(),
        }));
    };
    // Open before consuming: an entry we cannot open stays for an operator to recover.
    let key = sealer.open(&hash.0, &sealed)?;
    write(t, hash, &e)?;
    Ok(Redeemed::Key(key))
}

fn apply_revoke(
    t: &mut Tables<'_>,
    owner: &[u8],
    ttl: Duration,
    now: u64,
) -> Result<Revoked, StoreError> {
    t.latest.remove(owner).map_err(db_err)?;
    let mut hashes = Vec::new();
    for v in t.owners.remove_all(owner).map_err(db_err)? {
        let v = v.map_err(db_err)?;
        if let Ok(h) = <[u8; 32]>::try_from(v.value()) {
            hashes.push(TokenHash(h));
        }
    }
    let mut revoked = Revoked::default();
    for h in hashes {
        let Some(old) = t.entries.remove(&h.0[..]).map_err(db_err)? else {
            continue;
        };
        if Entry::decode(old.value()).is_some_and(|e| e.sealed.is_some() && e.expires_at_ms > now) {
            revoked.pending += 1;
        }
        revoked.hashes.push(h);
    }
    let until = now.saturating_add(ttl.as_millis() as u64);
    let until = match t.revoked.get(owner).map_err(db_err)? {
        Some(prev) => prev.value().max(until),
        None => until,
    };
    t.revoked.insert(owner, until).map_err(db_err)?;
    Ok(revoked)
}

fn apply_purge(t: &mut Tables<'_>, now: u64) -> Result<Purged, StoreError> {
    let mut purged = Purged::default();
    let mut doomed = Vec::new();
    for item in t.entries.iter().map_err(db_err)? {
        let (k, v) = item.map_err(db_err)?;
        match Entry::decode(v.value()) {
            Some(e) if e.expires_at_ms <= now => {
                if e.sealed.is_some() {
                    purged.expired += 1;
                } else {
                    purged.tombstones += 1;
                }
                doomed.push((k.value().to_vec(), e.owner));
            }
            Some(e) => {
                purged.entries += 1;
                purged.pending += u64::from(e.sealed.is_some());
            }
            None => {
                tracing::warn!("dropping an undecodable OTP entry");
                doomed.push((k.value().to_vec(), None));
            }
        }
    }
    for (k, owner) in doomed {
        t.entries.remove(k.as_slice()).map_err(db_err)?;
        if let Some(owner) = owner {
            t.owners
                .remove(owner.as_slice(), k.as_slice())
                .map_err(db_err)?;
            // An owner without entries has no latest token either.
            let left = t
                .owners
                .get(owner.as_slice())
                .map_err(db_err)?
                .next()
                .is_some();
            if !left {
                t.latest.remove(owner.as_slice()).map_err(db_err)?;
            }
        }
    }
    let mut forgotten = Vec::new();
    for item in t.revoked.iter().map_err(db_err)? {
        let (k, until) = item.map_err(db_err)?;
        if until.value() <= now {
            forgotten.push(k.value().to_vec());
        }
    }
    for k in &forgotten {
        t.revoked.remove(k.as_slice()).map_err(db_err)?;
    }
    purged.owners = forgotten.len() as u64;
    Ok(purged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::otp::token::Token;
    use std::sync::atomic::{AtomicU64, Ordering};

    struct ManualClock(AtomicU64);
    impl Clock for ManualClock {
        fn now_ms(&self) -> u64 {
            self.0.load(Ordering::SeqCst)
        }
    }

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    const TTL: Duration = Duration::from_secs(10);

    fn entry(owner: Option<&str>, arms: &[&str], live: bool) -> Entry {
        Entry {
            expires_at_ms: 100,
            sealed: live.then(|| vec![7; 40]),
            key_digest: Some([3; 32]),
            owner: owner.map(|o| o.as_bytes().to_vec()),
            arms: arms.iter().map(|r| request_digest(r)).collect(),
            rearms_left: None,
        }
    }

    #[test]
    fn entry_encoding_round_trips_and_reads_the_first_format() {
        for e in [
            entry(None, &[], true),
            entry(None, &[], false),
            entry(Some("uid-1"), &["r1"], true),
            entry(Some("uid-1"), &["r1", "r2", "r3"], false),
            Entry {
                key_digest: None,
                ..entry(Some(&"u".repeat(MAX_ID_LEN)), &["r"; MAX_ARMS], true)
            },
            Entry {
                rearms_left: Some(0),
                ..entry(Some("uid-1"), &["r1"], false)
            },
            Entry {
                rearms_left: Some(3),
                ..entry(Some("uid-1"), &["r1", "r2"], true)
            },
        ] {
            assert_eq!(Entry::decode(&e.encode()), Some(e));
        }
        let mut v1 = vec![V1_LIVE];
        v1.extend_from_slice(&42u64.to_be_bytes());
        v1.extend_from_slice(&[1, 2, 3]);
        let live = Entry::decode(&v1).unwrap();
        assert_eq!(
            (live.expires_at_ms, live.sealed, live.owner, live.key_digest),
            (42, Some(vec![1, 2, 3]), None, None)
        );
        let mut dead = vec![V1_REDEEMED];
        dead.extend_from_slice(&7u64.to_be_bytes());
        assert_eq!(Entry::decode(&dead).unwrap().sealed, None);
        assert_eq!(Entry::decode(&[9; 9]), None);
        assert_eq!(Entry::decode(&[1, 0]), None);
        // Truncated or padded second-format entries are rejected, not misread.
        let full = entry(Some("uid-1"), &["r1"], false).encode();
        for cut in 0..full.len() {
            assert_eq!(Entry::decode(&full[..cut]), None, "cut at {cut}");
        }
        let mut padded = full;
        padded.push(0);
        assert_eq!(Entry::decode(&padded), None);
    }

    #[test]
    fn redeem_decisions() {
        let live = entry(None, &[], true);
        let used = entry(None, &[], false);
        let owned_used = entry(Some("uid"), &["r"], false);
        let no_retry_left = Entry {
            rearms_left: Some(0),
            ..owned_used.clone()
        };
        assert_eq!(
            decide_redeem(Some(&no_retry_left), 50),
            Err(Refusal::Used {
                rearmable: false,
                arms: 1
            })
        );
        assert_eq!(decide_redeem(Some(&live), 99), Ok(()));
        assert_eq!(decide_redeem(Some(&live), 100), Err(Refusal::Expired));
        assert_eq!(
            decide_redeem(Some(&used), 50),
            Err(Refusal::Used {
                rearmable: false,
                arms: 0
            })
        );
        assert_eq!(
            decide_redeem(Some(&owned_used), 50),
            Err(Refusal::Used {
                rearmable: true,
                arms: 1
            })
        );
        assert_eq!(decide_redeem(Some(&owned_used), 100), Err(Refusal::Expired));
        assert_eq!(decide_redeem(None, 0), Err(Refusal::Unknown));
    }

    fn request(claim: Claim) -> StoreRequest {
        StoreRequest {
            hash: TokenHash([1; 32]),
            claim,
            sealed: vec![9; 40],
            key_digest: [4; 32],
            plaintext: Zeroizing::new(b"KEY".to_vec()),
            ttl: TTL,
        }
    }

    fn owned(owner: &str, req: &str, rearm: bool) -> StoreRequest {
        request(claim(owner, req, rearm))
    }

    #[test]
    fn store_decisions() {
        use StoreRefusal as R;
        let now = 50;
        let expired = |mut e: Entry| {
            e.expires_at_ms = now;
            e
        };
        let (anon, first, rearm, rearm_x) = (
            request(Claim::Anonymous),
            owned("u", "r1", false),
            owned("u", "r2", true),
            owned("u", "x", true),
        );
        let names: Vec<String> = (0..MAX_ARMS).map(|i| format!("r{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let full = entry(Some("u"), &names, false);
        let replay = Plan::Answer(Stored::Replayed);
        // (entry, request, owner revoked, entry holds the request's key, expected)
        #[rustfmt::skip]
        let cases: Vec<(Option<Entry>, &StoreRequest, bool, bool, Plan)> = vec![
            // Anonymous: replay the same key, refuse another key, a used entry, an owned one.
            (Some(entry(None, &[], true)), &anon, false, true, replay.clone()),
            (Some(entry(None, &[], true)), &anon, false, false, Plan::Refuse(R::DifferentKey)),
            (Some(entry(None, &[], false)), &anon, false, true, Plan::Refuse(R::AlreadyRedeemed)),
            (Some(entry(Some("u"), &["r1"], true)), &anon, false, true, Plan::Refuse(R::OtherOwner)),
            // Owned, first key of a request: a retry, used or not, changes nothing.
            (Some(entry(Some("u"), &["r1"], true)), &first, false, true, replay.clone()),
            (Some(entry(Some("u"), &["r1"], false)), &first, false, true, replay.clone()),
            (Some(entry(Some("u"), &["r1"], false)), &first, false, false, Plan::Refuse(R::DifferentKey)),
            (None, &first, true, true, Plan::Refuse(R::OwnerRevoked)),
            // Re-arm: only an existing, current token of the same owner, not revoked.
            (None, &rearm, false, true, Plan::Refuse(R::Unknown)),
            (Some(expired(entry(Some("u"), &["r1"], false))), &rearm, false, true, Plan::Refuse(R::Expired)),
            (Some(entry(Some("other"), &["r1"], false)), &rearm, false, true, Plan::Refuse(R::OtherOwner)),
            (Some(entry(None, &[], false)), &rearm, false, true, Plan::Refuse(R::OtherOwner)),
            (Some(entry(Some("u"), &["r1"], false)), &rearm, true, true, Plan::Refuse(R::OwnerRevoked)),
            (Some(full), &rearm_x, false, true, Plan::Refuse(R::TooManyRearms)),
            // The same re-arm again is a retry.
            (Some(entry(Some("u"), &["r1", "r2"], false)), &rearm, false, true, replay.clone()),
            (Some(entry(Some("u"), &["r1", "r2"], false)), &rearm, false, false, Plan::Refuse(R::DifferentKey)),
            // A late copy of a superseded request never brings its key back.
            (Some(entry(Some("u"), &["r1", "r2", "r3"], false)), &rearm, false, false, replay.clone()),
            (Some(entry(Some("u"), &["r1", "r2", "r3"], false)), &first, false, false, replay),
        ];
        for (i, (e, req, revoked, same, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                decide_store(e, req, now, revoked, |_| same),
                want,
                "case {i}"
            );
        }

        // What is written: new entries, an expired one replaced, re-arms.
        let write = |e: Option<Entry>, req: &StoreRequest| match decide_store(
            e,
            req,
            now,
            false,
            |_| false,
        ) {
            Plan::Write(e, stored) => (e, stored),
            other => panic!("expected a write, got {other:?}"),
        };
        let (e, stored) = write(None, &anon);
        assert_eq!(stored, Stored::Created);
        assert_eq!(
            (e.expires_at_ms, e.owner, e.arms.len()),
            (now + 10_000, None, 0)
        );
        assert_eq!((e.sealed, e.key_digest), (Some(vec![9; 40]), Some([4; 32])));
        assert_eq!(
            write(Some(expired(entry(None, &[], false))), &anon).1,
            Stored::Created
        );
        let (e, stored) = write(None, &first);
        assert_eq!(stored, Stored::Created);
        assert_eq!(e.owner.as_deref(), Some(&b"u"[..]));
        assert_eq!(e.arms, vec![request_digest("r1")]);
        let (e, stored) = write(Some(entry(Some("u"), &["r1"], false)), &rearm);
        assert_eq!(stored, Stored::Rearmed { was_redeemed: true });
        assert_eq!((e.sealed, e.key_digest), (Some(vec![9; 40]), Some([4; 32])));
        assert_eq!(e.arms, vec![request_digest("r1"), request_digest("r2")]);
        assert_eq!(e.expires_at_ms, now + 10_000);
        // An unredeemed key is replaced, never to be handed out.
        let (_, stored) = write(Some(entry(Some("u"), &["r1"], true)), &rearm);
        assert_eq!(
            stored,
            Stored::Rearmed {
                was_redeemed: false
            }
        );
    }

    struct Harness {
        store: Store,
        sealer: Arc<Sealer>,
        clock: Arc<ManualClock>,
        _dir: tempfile::TempDir,
        thread: StoreThread,
    }

    fn harness() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let sealer = Arc::new(Sealer::new(&[SECRET]).unwrap());
        let clock = Arc::new(ManualClock(AtomicU64::new(1_000)));
        let (store, thread) =
            Store::open(&dir.path().join("db"), Arc::clone(&sealer), clock.clone()).unwrap();
        Harness {
            store,
            sealer,
            clock,
            _dir: dir,
            thread,
        }
    }

    impl Harness {
        fn req(&self, hash: TokenHash, claim: Claim, key: &[u8]) -> StoreRequest {
            StoreRequest {
                hash,
                claim,
                sealed: self.sealer.seal(&hash.0, key),
                key_digest: self.sealer.digest(&hash.0, key),
                plaintext: Zeroizing::new(key.to_vec()),
                ttl: TTL,
            }
        }

        async fn store(
            &self,
            hash: TokenHash,
            claim: Claim,
            key: &[u8],
        ) -> Result<Stored, StoreRefusal> {
            match self.store.store(self.req(hash, claim, key)).await.unwrap() {
                StoreOutcome::Stored(s) => Ok(s),
                StoreOutcome::Refused(r) => Err(r),
            }
        }

        async fn redeem(&self, hash: TokenHash) -> Result<Vec<u8>, Refusal> {
            match self.store.redeem(hash).await.unwrap() {
                Redeemed::Key(k) => Ok(k.to_vec()),
                Redeemed::Refused(r) => Err(r),
            }
        }
    }

    fn claim(owner: &str, req: &str, rearm: bool) -> Claim {
        budgeted(owner, req, rearm, None)
    }

    fn budgeted(owner: &str, req: &str, rearm: bool, rearms_left: Option<u8>) -> Claim {
        Claim::Owned {
            owner: owner.as_bytes().to_vec(),
            request: request_digest(req),
            request_id: req.as_bytes().to_vec(),
            rearm,
            rearms_left,
        }
    }

    #[tokio::test]
    async fn a_used_token_is_rearmable_only_while_a_rearm_is_to_come() {
        let h = harness();
        let t = Token::random().hash();
        // One retry to come.
        h.store(t, budgeted("u", "r1", false, Some(1)), b"K1")
            .await
            .unwrap();
        assert_eq!(
            h.store.latest(b"u".to_vec()).await.unwrap(),
            Some(b"r1".to_vec())
        );
        h.redeem(t).await.unwrap();
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: true,
                arms: 1
            })
        );
        // The re-arm for that retry spends it (a store that does not say spends one)...
        h.store(t, claim("u", "r2", true), b"K2").await.unwrap();
        assert_eq!(h.redeem(t).await.unwrap(), b"K2");
        // ...so a redeem of the used token is no longer one to hold.
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: false,
                arms: 2
            })
        );
        // The controller may still re-arm (it alone decides), and says what is left.
        h.store(t, budgeted("u", "r3", true, Some(2)), b"K3")
            .await
            .unwrap();
        assert_eq!(h.redeem(t).await.unwrap(), b"K3");
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: true,
                arms: 3
            })
        );
        // No retries at all: never rearmable; a re-arm does not change the latest first store.
        let z = Token::random().hash();
        h.store(z, budgeted("u", "z1", false, Some(0)), b"Z")
            .await
            .unwrap();
        h.redeem(z).await.unwrap();
        assert_eq!(
            h.redeem(z).await,
            Err(Refusal::Used {
                rearmable: false,
                arms: 1
            })
        );
        assert_eq!(
            h.store.latest(b"u".to_vec()).await.unwrap(),
            Some(b"z1".to_vec())
        );
        // A revoke forgets the latest; so does the purge of an owner's last entry.
        h.store.revoke(b"u".to_vec(), TTL).await.unwrap();
        assert_eq!(h.store.latest(b"u".to_vec()).await.unwrap(), None);
        let v = Token::random().hash();
        h.store(v, budgeted("v", "v1", false, Some(1)), b"V")
            .await
            .unwrap();
        h.clock.0.store(1_000 + 10_000, Ordering::SeqCst);
        h.store.purge().await.unwrap();
        assert_eq!(h.store.latest(b"v".to_vec()).await.unwrap(), None);
    }

    #[tokio::test]
    async fn store_redeem_once_replay_and_expiry() {
        let h = harness();
        let t = Token::random().hash();
        assert_eq!(
            h.store(t, Claim::Anonymous, b"KEY").await,
            Ok(Stored::Created)
        );
        assert_eq!(
            h.store(t, Claim::Anonymous, b"KEY").await,
            Ok(Stored::Replayed)
        );
        assert_eq!(
            h.store(t, Claim::Anonymous, b"OTHER").await,
            Err(StoreRefusal::DifferentKey)
        );
        assert_eq!(h.redeem(t).await.unwrap(), b"KEY");
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: false,
                arms: 0
            })
        );
        assert_eq!(
            h.store(t, Claim::Anonymous, b"KEY").await,
            Err(StoreRefusal::AlreadyRedeemed)
        );

        let t2 = Token::random().hash();
        h.store(t2, Claim::Anonymous, b"K2").await.unwrap();
        h.clock.0.store(1_000 + 10_000, Ordering::SeqCst);
        assert_eq!(h.redeem(t2).await, Err(Refusal::Expired));
        let purged = h.store.purge().await.unwrap();
        assert_eq!(
            purged,
            Purged {
                expired: 1,
                tombstones: 1,
                owners: 0,
                pending: 0,
                entries: 0
            }
        );
        assert_eq!(h.redeem(t).await, Err(Refusal::Unknown));
        drop(h.store);
        h.thread.join();
    }

    #[tokio::test]
    async fn rearm_hands_out_each_key_once_and_never_the_old_one() {
        let h = harness();
        let t = Token::random().hash();
        assert_eq!(
            h.store(t, claim("u", "r1", false), b"K1").await,
            Ok(Stored::Created)
        );
        assert_eq!(h.redeem(t).await.unwrap(), b"K1");
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: true,
                arms: 1
            })
        );
        // A retried first store after the redeem: the same entry, still used.
        assert_eq!(
            h.store(t, claim("u", "r1", false), b"K1").await,
            Ok(Stored::Replayed)
        );
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: true,
                arms: 1
            })
        );
        assert_eq!(
            h.store(t, claim("other", "r2", true), b"K2").await,
            Err(StoreRefusal::OtherOwner)
        );
        assert_eq!(
            h.store(t, claim("u", "r2", true), b"K2").await,
            Ok(Stored::Rearmed { was_redeemed: true })
        );
        assert_eq!(
            h.store(t, claim("u", "r2", true), b"K2").await,
            Ok(Stored::Replayed)
        );
        assert_eq!(h.redeem(t).await.unwrap(), b"K2");
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: true,
                arms: 2
            })
        );
        // Re-armed before the redeem: the replaced key is never handed out.
        h.store(t, claim("u", "r3", true), b"K3").await.unwrap();
        assert_eq!(
            h.store(t, claim("u", "r4", true), b"K4").await,
            Ok(Stored::Rearmed {
                was_redeemed: false
            })
        );
        // Late copies of earlier requests change nothing.
        assert_eq!(
            h.store(t, claim("u", "r2", true), b"K2").await,
            Ok(Stored::Replayed)
        );
        assert_eq!(
            h.store(t, claim("u", "r1", false), b"K1").await,
            Ok(Stored::Replayed)
        );
        assert_eq!(h.redeem(t).await.unwrap(), b"K4");
        assert_eq!(
            h.redeem(t).await,
            Err(Refusal::Used {
                rearmable: true,
                arms: 4
            })
        );
        let unknown = Token::random().hash();
        assert_eq!(
            h.store(unknown, claim("u", "r5", true), b"K5").await,
            Err(StoreRefusal::Unknown)
        );
        let anon = Token::random().hash();
        h.store(anon, Claim::Anonymous, b"A").await.unwrap();
        assert_eq!(
            h.store(anon, claim("u", "r6", true), b"K6").await,
            Err(StoreRefusal::OtherOwner)
        );
    }

    #[tokio::test]
    async fn revoke_deletes_an_owners_entries_durably_and_purge_cleans_up() {
        let h = harness();
        let (a, b, c) = (
            Token::random().hash(),
            Token::random().hash(),
            Token::random().hash(),
        );
        h.store(a, claim("u", "r1", false), b"A").await.unwrap();
        h.store(b, claim("u", "r2", false), b"B").await.unwrap();
        h.store(c, claim("v", "r1", false), b"C").await.unwrap();
        assert_eq!(h.redeem(a).await.unwrap(), b"A");
        let revoked = h.store.revoke(b"u".to_vec(), TTL).await.unwrap();
        let mut got = revoked.hashes.clone();
        got.sort_by_key(|h| h.0);
        let mut want = vec![a, b];
        want.sort_by_key(|h| h.0);
        assert_eq!((got, revoked.pending), (want, 1));
        assert_eq!(h.redeem(a).await, Err(Refusal::Unknown));
        assert_eq!(h.redeem(b).await, Err(Refusal::Unknown));
        assert_eq!(
            h.store.revoke(b"u".to_vec(), TTL).await.unwrap(),
            Revoked::default()
        );
        // A late retry cannot bring an entry back, nor can a re-arm.
        assert_eq!(
            h.store(b, claim("u", "r2", false), b"B").await,
            Err(StoreRefusal::OwnerRevoked)
        );
        assert_eq!(
            h.store(a, claim("u", "r3", true), b"A2").await,
            Err(StoreRefusal::OwnerRevoked)
        );
        // Other owners are untouched.
        assert_eq!(h.redeem(c).await.unwrap(), b"C");

        // After the TTL the owner is forgotten and expired entries leave the owner index.
        h.clock.0.store(1_000 + 10_000, Ordering::SeqCst);
        assert_eq!(
            h.store.purge().await.unwrap(),
            Purged {
                expired: 0,
                tombstones: 1,
                owners: 1,
                pending: 0,
                entries: 0
            }
        );
        assert_eq!(
            h.store.revoke(b"v".to_vec(), TTL).await.unwrap(),
            Revoked::default()
        );
        assert_eq!(
            h.store(b, claim("u", "r2", false), b"B").await,
            Ok(Stored::Created)
        );
    }

    #[tokio::test]
    async fn concurrent_redeems_of_one_token_yield_one_key() {
        let h = harness();
        for round in 0..20 {
            let t = Token::random().hash();
            let c = if round % 2 == 0 {
                Claim::Anonymous
            } else {
                claim("u", &format!("r{round}"), false)
            };
            h.store(t, c, b"KEY").await.unwrap();
            let tasks: Vec<_> = (0..16)
                .map(|_| {
                    let store = h.store.clone();
                    tokio::spawn(async move { store.redeem(t).await.unwrap() })
                })
                .collect();
            let mut keys = 0;
            for task in tasks {
                if let Redeemed::Key(_) = task.await.unwrap() {
                    keys += 1;
                }
            }
            assert_eq!(keys, 1);
        }
    }
}
