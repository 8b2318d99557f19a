//! The outbox seam: what a store does for the outbox (enqueue, the relay's ownership of slots, reading and
//! settling what a relay delivered, the operator's figures) and the row mapping every store shares. Each store's
//! SQL is in its wing: `store::postgres::outbox` (advisory locks), `store::sqlite::outbox` (a lease) and
//! `store::mysql::outbox` (named locks).

use std::future::Future;
use std::time::Duration;

use sqlx::Row;

use super::{OutboxMessage, OutgoingMessage};
use crate::error::Error;
use crate::store::{Backend, Tables, decode_headers};

/// A row about to be enqueued: the message with its event id and slot.
pub(crate) struct NewRow<'a> {
    pub(crate) event_id: String,
    pub(crate) slot: i32,
    pub(crate) message: &'a OutgoingMessage,
}

/// A connection an application enqueues through, inside its open transaction: `PgConnection`,
/// `MySqlConnection` or `SqliteConnection` (what a handler receives, or what a `sqlx::Transaction` dereferences
/// to).
pub trait OutboxConnection: Send {
    /// The store the connection belongs to.
    type Store: OutboxStore<Connection = Self>;
}

/// The outbox's figures, for metrics and `idem outbox stats`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct OutboxStats {
    /// Messages waiting to be delivered.
    pub pending: i64,
    /// The age of the oldest, in seconds; `None` when there is none.
    pub oldest_age_seconds: Option<f64>,
    /// Waiting messages that failed at least once.
    pub failing: i64,
}

/// One destination's backlog, for the console's outbox view.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DestinationStats {
    /// The destination (topic, subject, queue).
    pub destination: String,
    /// Messages waiting to be delivered there.
    pub pending: i64,
    /// The age of the oldest, in seconds.
    pub oldest_age_seconds: Option<f64>,
    /// Waiting messages that failed at least once.
    pub failing: i64,
}

/// What the relay wakes on besides its poll interval.
pub enum Wakeup {
    /// PostgreSQL: notifications from the outbox's insert trigger.
    Listener(Box<sqlx::postgres::PgListener>),
    /// Polling only.
    Poll,
}

/// The outbox on a store: PostgreSQL, MySQL/MariaDB and SQLite.
pub trait OutboxStore: Backend {
    /// Inserts `rows` in order in the open transaction, in as few statements as the store allows.
    #[doc(hidden)]
    #[allow(private_interfaces)]
    fn enqueue(
        conn: &mut Self::Connection,
        tables: &Tables,
        rows: &[NewRow<'_>],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Takes this relay's share of the slots on its own connection and gives back what is above it; returns the
    /// slots it owns now. `lease` is how long a lease lasts where the store uses one.
    fn own(
        conn: &mut Self::Connection,
        tables: &Tables,
        relay: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<i32>, sqlx::Error>> + Send;
    /// Gives up every slot (a relay stopping), so another relay takes them at once.
    fn release(
        conn: &mut Self::Connection,
        tables: &Tables,
        relay: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// The oldest `limit` messages of `slots`, but those of `exclude` (delivered, their delete not committed
    /// yet), in id order.
    fn fetch(
        conn: &mut Self::Connection,
        tables: &Tables,
        slots: &[i32],
        exclude: &[i64],
        limit: i64,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, sqlx::Error>> + Send;
    /// Deletes the delivered messages `ids` in the open transaction.
    fn delete(
        conn: &mut Self::Connection,
        tables: &Tables,
        ids: &[i64],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Counts a failed attempt of message `id` with its reason, in the open transaction.
    fn failed(
        conn: &mut Self::Connection,
        tables: &Tables,
        id: i64,
        reason: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// What waits, how old the oldest is, and how many failed.
    fn outbox_stats(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
    ) -> impl Future<Output = Result<OutboxStats, Error>> + Send;
    /// The same figures per destination, the largest backlog first.
    fn destinations(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
    ) -> impl Future<Output = Result<Vec<DestinationStats>, Error>> + Send;
    /// The oldest `limit` waiting messages (only those that failed at least once, with `failing_only`).
    fn list(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        failing_only: bool,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<OutboxMessage>, Error>> + Send;
    /// What wakes a relay when rows are enqueued.
    fn wakeup(pool: &sqlx::Pool<Self>, tables: &Tables) -> impl Future<Output = Result<Wakeup, Error>> + Send;
    /// Moves dead letter `id` of an outbox relay back into the outbox (same event id, a new place in line) in one
    /// transaction; false when there is no such dead letter.
    fn requeue(pool: &sqlx::Pool<Self>, tables: &Tables, id: i64) -> impl Future<Output = Result<bool, Error>> + Send;
}

/// Moves dead letter `id` (written by a relay, consumer group `outbox:<name>`) back into the outbox: it is
/// delivered again with its event id, behind what is waiting. Returns false when there is no such dead letter.
pub async fn requeue_dead_letter<DB: OutboxStore>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    id: i64,
) -> Result<bool, Error> {
    DB::requeue(pool, tables, id).await
}

/// The oldest `limit` messages waiting in the outbox in `tables` (only those that failed at least once, with
/// `failing_only`).
pub async fn list<DB: OutboxStore>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    failing_only: bool,
    limit: i64,
) -> Result<Vec<OutboxMessage>, Error> {
    DB::list(pool, tables, failing_only, limit).await
}

/// Each destination's backlog, the largest first.
pub async fn destinations<DB: OutboxStore>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
) -> Result<Vec<DestinationStats>, Error> {
    DB::destinations(pool, tables).await
}

/// The condition `list` adds for `failing_only`.
pub(crate) fn failing_condition(failing_only: bool) -> &'static str {
    if failing_only { " WHERE attempts > 0" } else { "" }
}

/// A destination's figures from a row of any store: destination, pending, oldest age, failing.
pub(crate) fn destination_of(row: (String, i64, Option<f64>, i64)) -> DestinationStats {
    let (destination, pending, oldest_age_seconds, failing) = row;
    DestinationStats { destination, pending, oldest_age_seconds, failing }
}

/// How many messages wait in the outbox in `tables`, the oldest one's age, how many failed.
pub async fn stats<DB: OutboxStore>(pool: &sqlx::Pool<DB>, tables: &Tables) -> Result<OutboxStats, Error> {
    DB::outbox_stats(pool, tables).await
}

/// The columns every store's outbox reads, in [`row_of`]'s order (MySQL quotes `key` itself).
pub(crate) const COLUMNS: &str = "id, event_id, destination, key, payload, headers, slot, attempts, last_error";

/// An outbox row from any store: [`COLUMNS`] in order, the age given apart.
pub(crate) fn row_of<R: Row>(row: &R, age_seconds: f64) -> Result<OutboxMessage, sqlx::Error>
where
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    Ok(OutboxMessage {
        id: row.try_get(0)?,
        event_id: row.try_get(1)?,
        destination: row.try_get(2)?,
        key: row.try_get(3)?,
        payload: row.try_get(4)?,
        headers: decode_headers(&row.try_get::<String, _>(5)?),
        slot: row.try_get(6)?,
        attempts: row.try_get(7)?,
        last_error: row.try_get(8)?,
        age_seconds,
    })
}
