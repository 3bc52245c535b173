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

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use redb::{Database, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};
use zeroize::Zeroizing;

use super::seal::{SealError, Sealer};
use super::token::TokenHash;

const ENTRIES: TableDefinition<&[u8], &[u8]> = TableDefinition::new("entries");
const MAX_BATCH: usize = 512;

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

/// A stored entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Waiting to be redeemed: the sealed key.
    Live {
        /// Expiry, Unix ms.
        expires_at_ms: u64,
        /// Output of [`Sealer::seal`].
        sealed: Vec<u8>,
    },
    /// Redeemed (the key is gone); kept until expiry so a second attempt says "used".
    Redeemed {
        /// Expiry, Unix ms.
        expires_at_ms: u64,
    },
}

const LIVE: u8 = 1;
const REDEEMED: u8 = 2;

impl Entry {
    /// Serialised form: state byte, expiry (u64 BE), then the sealed key for live entries.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Live {
                expires_at_ms,
                sealed,
            } => {
                let mut v = Vec::with_capacity(9 + sealed.len());
                v.push(LIVE);
                v.extend_from_slice(&expires_at_ms.to_be_bytes());
                v.extend_from_slice(sealed);
                v
            }
            Self::Redeemed { expires_at_ms } => {
                let mut v = vec![REDEEMED];
                v.extend_from_slice(&expires_at_ms.to_be_bytes());
                v
            }
        }
    }

    /// Parses [`Self::encode`]'s output.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let expires_at_ms = u64::from_be_bytes(b.get(1..9)?.try_into().ok()?);
        match b[0] {
            LIVE => Some(Self::Live {
                expires_at_ms,
                sealed: b[9..].to_vec(),
            }),
            REDEEMED if b.len() == 9 => Some(Self::Redeemed { expires_at_ms }),
            _ => None,
        }
    }

    fn expires_at_ms(&self) -> u64 {
        match self {
            Self::Live { expires_at_ms, .. } | Self::Redeemed { expires_at_ms } => *expires_at_ms,
        }
    }
}

/// Why a redeem yields no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No such token (never issued, or purged after expiry).
    Unknown,
    /// Already redeemed.
    Used,
    /// Past its TTL.
    Expired,
}

/// What a redeem should do, given the entry: the pure core of the exactly-once rule.
pub fn decide_redeem(entry: Option<&Entry>, now_ms: u64) -> Result<(), Refusal> {
    match entry {
        None => Err(Refusal::Unknown),
        Some(e) if e.expires_at_ms() <= now_ms => Err(Refusal::Expired),
        Some(Entry::Redeemed { .. }) => Err(Refusal::Used),
        Some(Entry::Live { .. }) => Ok(()),
    }
}

/// Result of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// A new entry.
    Created,
    /// The same token already holds this key (a retried request).
    Replayed,
}

/// A store was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreConflict {
    /// The token already holds a different key (an idempotency key was reused).
    DifferentKey,
    /// The token was already redeemed.
    AlreadyRedeemed,
}

/// Result of a redeem.
pub enum Redeemed {
    /// The key, exactly once.
    Key(Zeroizing<Vec<u8>>),
    /// No key.
    Refused(Refusal),
}

/// What a purge removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Expired entries that were never redeemed.
    pub expired: u64,
    /// Tombstones of redeemed entries past their expiry.
    pub tombstones: u64,
    /// Entries still waiting after the purge.
    pub pending: u64,
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

enum Op {
    Store {
        hash: TokenHash,
        sealed: Vec<u8>,
        plaintext: Zeroizing<Vec<u8>>,
        ttl: Duration,
        reply: oneshot::Sender<Result<Result<Stored, StoreConflict>, StoreError>>,
    },
    Redeem {
        hash: TokenHash,
        reply: oneshot::Sender<Result<Redeemed, StoreError>>,
    },
    Purge {
        reply: oneshot::Sender<Result<Purged, StoreError>>,
    },
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
        // Create the table so reads before the first write work.
        let txn = db.begin_write().map_err(db_err)?;
        txn.open_table(ENTRIES).map_err(db_err)?;
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

    /// Stores a sealed key under `hash` for `ttl`. `plaintext` is only compared with an existing
    /// entry to recognise a retried request.
    pub async fn store(
        &self,
        hash: TokenHash,
        sealed: Vec<u8>,
        plaintext: Zeroizing<Vec<u8>>,
        ttl: Duration,
    ) -> Result<Result<Stored, StoreConflict>, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(
            Op::Store {
                hash,
                sealed,
                plaintext,
                ttl,
                reply,
            },
            rx,
        )
        .await
    }

    /// Redeems `hash`: the key if it is live (and from then on never again), else why not.
    pub async fn redeem(&self, hash: TokenHash) -> Result<Redeemed, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(Op::Redeem { hash, reply }, rx).await
    }

    /// Deletes expired entries and tombstones.
    pub async fn purge(&self) -> Result<Purged, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.call(Op::Purge { reply }, rx).await
    }
}

/// An answer to send once the batch is committed.
enum Reply {
    Store(
        oneshot::Sender<Result<Result<Stored, StoreConflict>, StoreError>>,
        Result<Result<Stored, StoreConflict>, StoreError>,
    ),
    Redeem(
        oneshot::Sender<Result<Redeemed, StoreError>>,
        Result<Redeemed, StoreError>,
    ),
    Purge(
        oneshot::Sender<Result<Purged, StoreError>>,
        Result<Purged, StoreError>,
    ),
}

impl Reply {
    fn send(self) {
        match self {
            Self::Store(tx, r) => drop(tx.send(r)),
            Self::Redeem(tx, r) => drop(tx.send(r)),
            Self::Purge(tx, r) => drop(tx.send(r)),
        }
    }

    /// Replaces a successful answer by the commit error: nothing is acknowledged (and no key
    /// handed out) unless it is durable.
    fn fail(self, e: &str) {
        let err = || StoreError::Db(format!("commit failed: {e}"));
        match self {
            Self::Store(tx, _) => drop(tx.send(Err(err()))),
            Self::Redeem(tx, _) => drop(tx.send(Err(err()))),
            Self::Purge(tx, _) => drop(tx.send(Err(err()))),
        }
    }
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

fn run_batch(db: &Database, batch: &mut Vec<Op>, sealer: &Sealer, clock: &dyn Clock) {
    let txn = match db.begin_write() {
        Ok(t) => t,
        Err(e) => {
            let msg = e.to_string();
            for op in batch.drain(..) {
                fail_op(op, &msg);
            }
            return;
        }
    };
    let mut replies = Vec::with_capacity(batch.len());
    let mut fatal: Option<String> = None;
    {
        let mut table = match txn.open_table(ENTRIES) {
            Ok(t) => t,
            Err(e) => {
                let msg = e.to_string();
                for op in batch.drain(..) {
                    fail_op(op, &msg);
                }
                return;
            }
        };
        let now = clock.now_ms();
        for op in batch.drain(..) {
            match op {
                Op::Store {
                    hash,
                    sealed,
                    plaintext,
                    ttl,
                    reply,
                } => {
                    let r = apply_store(&mut table, sealer, &hash, sealed, &plaintext, ttl, now);
                    if let Err(StoreError::Db(e)) = &r {
                        fatal.get_or_insert_with(|| e.clone());
                    }
                    replies.push(Reply::Store(reply, r));
                }
                Op::Redeem { hash, reply } => {
                    let r = apply_redeem(&mut table, sealer, &hash, now);
                    if let Err(StoreError::Db(e)) = &r {
                        fatal.get_or_insert_with(|| e.clone());
                    }
                    replies.push(Reply::Redeem(reply, r));
                }
                Op::Purge { reply } => {
                    let r = apply_purge(&mut table, now);
                    if let Err(StoreError::Db(e)) = &r {
                        fatal.get_or_insert_with(|| e.clone());
                    }
                    replies.push(Reply::Purge(reply, r));
                }
            }
        }
    }
    if let Some(e) = fatal {
        // A table operation failed mid-batch: keep nothing of it.
        let _ = txn.abort();
        for r in replies {
            r.fail(&e);
        }
        return;
    }
    match txn.commit() {
        Ok(()) => replies.into_iter().for_each(Reply::send),
        Err(e) => {
            let e = e.to_string();
            tracing::error!(error = %e, "OTP store commit failed");
            for r in replies {
                r.fail(&e);
            }
        }
    }
}

fn fail_op(op: Op, e: &str) {
    let err = || StoreError::Db(e.to_owned());
    match op {
        Op::Store { reply, .. } => drop(reply.send(Err(err()))),
        Op::Redeem { reply, .. } => drop(reply.send(Err(err()))),
        Op::Purge { reply } => drop(reply.send(Err(err()))),
    }
}

type Table<'t> = redb::Table<'t, &'static [u8], &'static [u8]>;

fn read(table: &Table<'_>, hash: &TokenHash) -> Result<Option<Entry>, StoreError> {
    match table.get(&hash.0[..]).map_err(db_err)? {
        None => Ok(None),
        Some(v) => Entry::decode(v.value())
            .map(Some)
            .ok_or_else(|| StoreError::Db("undecodable entry".into())),
    }
}

fn apply_store(
    table: &mut Table<'_>,
    sealer: &Sealer,
    hash: &TokenHash,
    sealed: Vec<u8>,
    plaintext: &[u8],
    ttl: Duration,
    now: u64,
) -> Result<Result<Stored, StoreConflict>, StoreError> {
    match read(table, hash)? {
        Some(Entry::Live {
            sealed: existing,
            expires_at_ms,
        }) if expires_at_ms > now => {
            let same = sealer
                .open(&hash.0, &existing)
                .is_ok_and(|k| k.as_slice() == plaintext);
            return Ok(if same {
                Ok(Stored::Replayed)
            } else {
                Err(StoreConflict::DifferentKey)
            });
        }
        Some(Entry::Redeemed { expires_at_ms }) if expires_at_ms > now => {
            return Ok(Err(StoreConflict::AlreadyRedeemed));
        }
        // Absent, or expired and not yet purged: (re)create.
        _ => {}
    }
    let entry = Entry::Live {
        expires_at_ms: now.saturating_add(ttl.as_millis() as u64),
        sealed,
    };
    table
        .insert(&hash.0[..], entry.encode().as_slice())
        .map_err(db_err)?;
    Ok(Ok(Stored::Created))
}

fn apply_redeem(
    table: &mut Table<'_>,
    sealer: &Sealer,
    hash: &TokenHash,
    now: u64,
) -> Result<Redeemed, StoreError> {
    let entry = read(table, hash)?;
    if let Err(refusal) = decide_redeem(entry.as_ref(), now) {
        return Ok(Redeemed::Refused(refusal));
    }
    let Some(Entry::Live {
        expires_at_ms,
        sealed,
    }) = entry
    else {
        return Ok(Redeemed::Refused(Refusal::Unknown));
    };
    // Open before consuming: an entry we cannot open stays for an operator to recover.
    let key = sealer.open(&hash.0, &sealed)?;
    table
        .insert(
            &hash.0[..],
            Entry::Redeemed { expires_at_ms }.encode().as_slice(),
        )
        .map_err(db_err)?;
    Ok(Redeemed::Key(key))
}

fn apply_purge(table: &mut Table<'_>, now: u64) -> Result<Purged, StoreError> {
    let mut purged = Purged::default();
    let mut doomed = Vec::new();
    for item in table.iter().map_err(db_err)? {
        let (k, v) = item.map_err(db_err)?;
        match Entry::decode(v.value()) {
            Some(Entry::Live { expires_at_ms, .. }) if expires_at_ms <= now => {
                purged.expired += 1;
                doomed.push(k.value().to_vec());
            }
            Some(Entry::Redeemed { expires_at_ms }) if expires_at_ms <= now => {
                purged.tombstones += 1;
                doomed.push(k.value().to_vec());
            }
            Some(Entry::Live { .. }) => purged.pending += 1,
            Some(Entry::Redeemed { .. }) => {}
            None => {
                tracing::warn!("dropping an undecodable OTP entry");
                doomed.push(k.value().to_vec());
            }
        }
    }
    for k in doomed {
        table.remove(k.as_slice()).map_err(db_err)?;
    }
    Ok(purged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    struct ManualClock(AtomicU64);
    impl Clock for ManualClock {
        fn now_ms(&self) -> u64 {
            self.0.load(Ordering::SeqCst)
        }
    }

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn entry_encoding_round_trips() {
        let live = Entry::Live {
            expires_at_ms: 42,
            sealed: vec![1, 2, 3],
        };
        assert_eq!(Entry::decode(&live.encode()), Some(live));
        let dead = Entry::Redeemed { expires_at_ms: 7 };
        assert_eq!(Entry::decode(&dead.encode()), Some(dead));
        assert_eq!(Entry::decode(&[9; 9]), None);
        assert_eq!(Entry::decode(&[1, 0]), None);
    }

    #[test]
    fn redeem_decisions() {
        let live = Entry::Live {
            expires_at_ms: 100,
            sealed: vec![],
        };
        let used = Entry::Redeemed { expires_at_ms: 100 };
        assert_eq!(decide_redeem(Some(&live), 99), Ok(()));
        assert_eq!(decide_redeem(Some(&live), 100), Err(Refusal::Expired));
        assert_eq!(decide_redeem(Some(&used), 50), Err(Refusal::Used));
        assert_eq!(decide_redeem(None, 0), Err(Refusal::Unknown));
    }

    fn sealed(s: &Sealer, h: &TokenHash, k: &[u8]) -> (Vec<u8>, Zeroizing<Vec<u8>>) {
        (s.seal(&h.0, k), Zeroizing::new(k.to_vec()))
    }

    #[tokio::test]
    async fn store_redeem_once_replay_and_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let sealer = Arc::new(Sealer::new(&[SECRET]).unwrap());
        let clock = Arc::new(ManualClock(AtomicU64::new(1_000)));
        let (store, thread) =
            Store::open(&dir.path().join("db"), Arc::clone(&sealer), clock.clone()).unwrap();
        let ttl = Duration::from_secs(10);
        let t = super::super::token::Token::random();
        let h = t.hash();
        let (s, p) = sealed(&sealer, &h, b"KEY");
        assert_eq!(
            store.store(h, s, p, ttl).await.unwrap(),
            Ok(Stored::Created)
        );
        let (s, p) = sealed(&sealer, &h, b"KEY");
        assert_eq!(
            store.store(h, s, p, ttl).await.unwrap(),
            Ok(Stored::Replayed)
        );
        let (s, p) = sealed(&sealer, &h, b"OTHER");
        assert_eq!(
            store.store(h, s, p, ttl).await.unwrap(),
            Err(StoreConflict::DifferentKey)
        );
        match store.redeem(h).await.unwrap() {
            Redeemed::Key(k) => assert_eq!(k.as_slice(), b"KEY"),
            Redeemed::Refused(r) => panic!("{r:?}"),
        }
        assert!(matches!(
            store.redeem(h).await.unwrap(),
            Redeemed::Refused(Refusal::Used)
        ));
        let (s, p) = sealed(&sealer, &h, b"KEY");
        assert_eq!(
            store.store(h, s, p, ttl).await.unwrap(),
            Err(StoreConflict::AlreadyRedeemed)
        );

        let t2 = super::super::token::Token::random().hash();
        let (s, p) = sealed(&sealer, &t2, b"K2");
        store.store(t2, s, p, ttl).await.unwrap().unwrap();
        clock.0.store(1_000 + 10_000, Ordering::SeqCst);
        assert!(matches!(
            store.redeem(t2).await.unwrap(),
            Redeemed::Refused(Refusal::Expired)
        ));
        let purged = store.purge().await.unwrap();
        assert_eq!(
            purged,
            Purged {
                expired: 1,
                tombstones: 1,
                pending: 0
            }
        );
        assert!(matches!(
            store.redeem(h).await.unwrap(),
            Redeemed::Refused(Refusal::Unknown)
        ));
        drop(store);
        thread.join();
    }

    #[tokio::test]
    async fn concurrent_redeems_of_one_token_yield_one_key() {
        let dir = tempfile::tempdir().unwrap();
        let sealer = Arc::new(Sealer::new(&[SECRET]).unwrap());
        let (store, _thread) = Store::open(
            &dir.path().join("db"),
            Arc::clone(&sealer),
            Arc::new(SystemClock),
        )
        .unwrap();
        for _ in 0..20 {
            let h = super::super::token::Token::random().hash();
            let (s, p) = sealed(&sealer, &h, b"KEY");
            store
                .store(h, s, p, Duration::from_secs(60))
                .await
                .unwrap()
                .unwrap();
            let tasks: Vec<_> = (0..16)
                .map(|_| {
                    let store = store.clone();
                    tokio::spawn(async move { store.redeem(h).await.unwrap() })
                })
                .collect();
            let mut keys = 0;
            for t in tasks {
                if let Redeemed::Key(_) = t.await.unwrap() {
                    keys += 1;
                }
            }
            assert_eq!(keys, 1);
        }
    }
}
