//! Transactions kept open between batches. PostgreSQL opens the next transaction in the round trip that commits
//! the last ([`crate::store::Store::commit_intact`]); while the run loop is busy, that empty transaction waits
//! here for the next batch, which then starts without a `BEGIN` of its own, and its connection skips the pool's
//! release check (one more round trip). A transaction waits at most [`KEPT_FOR`]: a task of the run rolls back the
//! older ones, so an idle consumer keeps no connection "idle in transaction" for longer than that, and the run
//! rolls back every one of them before it returns. Nothing runs in such a transaction before the next batch's
//! first statement (no snapshot, no lock); only `now()` in a handler, the transaction's start, can be up to
//! [`KEPT_FOR`] earlier than the statement that reads it.
//!
//! Only a transaction of one message keeps its successor (the per-event path, where the saved round trips are a
//! third of the work). After a transaction of many messages the successor is rolled back: the statements of a
//! batch run measurably slower in a transaction opened that way (`idem-bench --events 20000 --runs 3`, batched
//! 100 with a per-message handler: about 10,000 events/s kept against 15,000 not; batched 1000: 12,000 against
//! 16,000), and a batch saves only one round trip in hundreds.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::{Database, Transaction};

/// How long an open, empty transaction waits for a batch before it is rolled back.
pub(super) const KEPT_FOR: Duration = Duration::from_millis(100);

/// The open, empty transactions waiting for a batch, newest last.
pub(super) struct Warm<DB: Database> {
    open: Mutex<Vec<(Instant, Transaction<'static, DB>)>>,
}

impl<DB: Database> Default for Warm<DB> {
    fn default() -> Self {
        Warm { open: Mutex::new(Vec::new()) }
    }
}

impl<DB: Database> Warm<DB> {
    /// The newest open transaction younger than [`KEPT_FOR`], if any; older ones are rolled back.
    pub(super) fn take(&self) -> Option<Transaction<'static, DB>> {
        let (fresh, stale) = {
            let mut open = self.lock();
            let fresh = open.pop().filter(|(since, _)| since.elapsed() < KEPT_FOR).map(|(_, tx)| tx);
            // The rest are older still.
            let stale = if fresh.is_none() { std::mem::take(&mut *open) } else { Vec::new() };
            (fresh, stale)
        };
        drop(stale);
        fresh
    }

    /// Keeps `tx`, an open transaction in which nothing has run yet, for the next batch.
    pub(super) fn keep(&self, tx: Transaction<'static, DB>) {
        self.lock().push((Instant::now(), tx));
    }

    /// Rolls back the transactions that waited [`KEPT_FOR`] or longer; their connections go back to the pool.
    pub(super) async fn expire(&self) {
        let stale: Vec<_> = {
            let mut open = self.lock();
            let fresh_from = open.iter().position(|(since, _)| since.elapsed() < KEPT_FOR).unwrap_or(open.len());
            open.drain(..fresh_from).collect()
        };
        roll_back(stale).await;
    }

    /// Rolls back every waiting transaction.
    pub(super) async fn clear(&self) {
        let all = std::mem::take(&mut *self.lock());
        roll_back(all).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Instant, Transaction<'static, DB>)>> {
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Rolls back `transactions` and waits for it (a dropped one would roll back only with its connection's next
/// message); a connection that fails it is closed by the pool.
async fn roll_back<DB: Database>(transactions: Vec<(Instant, Transaction<'static, DB>)>) {
    for (_, tx) in transactions {
        let _ = tx.rollback().await;
    }
}
