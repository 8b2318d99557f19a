//! The database seam: one trait, [`Backend`], implemented for PostgreSQL and SQLite.
//!
//! The engine needs few things of a database: claim markers (`INSERT … ON CONFLICT DO NOTHING`, the row count
//! decides), write dead letters, migrate, and answer the operator's questions. Each backend module holds the
//! same functions over its own SQL; the SQL lives in `sql/<backend>/`, written with `{t}` for the (optionally
//! schema-qualified) table prefix and `{p}` for the bare prefix used in index names.

pub mod archive;
pub mod audit;
pub(crate) mod connect;
mod dead_letter_row;
mod headers;
pub mod letter_pages;
mod migrate;
pub mod parking;
pub mod responses;

pub mod mysql;
pub mod postgres;
pub use postgres::partitions;
mod replay;
pub use replay::{ReplayRisk, ReplayStart};
pub mod sqlite;

use std::future::Future;

pub(crate) use headers::{decode_headers, encode_headers};
pub use migrate::{Migration, MigrationReport, MigrationState, MigrationStatus, migration_script, migration_status};

use crate::config::MarkerLayout;
use crate::error::Error;
use crate::message::{Event, Message};

/// How [`Store::commit_intact`] ended.
#[derive(Debug)]
pub enum IntactCommit<'c, DB: sqlx::Database> {
    /// The transaction committed. A store that opens the next transaction in the same round trip (PostgreSQL)
    /// hands it back: an empty transaction on the same connection, ready for the next unit of work; dropping it
    /// rolls it back.
    Committed(Option<sqlx::Transaction<'c, DB>>),
    /// User code had ended the transaction itself (`COMMIT` or `ROLLBACK` through the connection).
    Ended,
    /// The transaction was aborted (a handler swallowed a database error); nothing committed.
    Aborted(sqlx::Error),
    /// `COMMIT` itself failed: a deferred constraint, a serialization failure, a lost connection.
    CommitFailed(sqlx::Error),
}

/// The hot path every store implements: what a consumer needs of its database (migrate, claim markers, write a
/// dead letter, check a transaction before `COMMIT`). Implemented for [`sqlx::Postgres`] and [`sqlx::Sqlite`];
/// a new store is one module implementing this and [`Operations`], with its SQL.
///
/// Handlers receive `&mut <DB as sqlx::Database>::Connection` (a `PgConnection` or `SqliteConnection`) with the
/// transaction already open; every write through it commits or rolls back together with the marker.
pub trait Store: sqlx::Database + Sized {
    /// `postgres` or `sqlite`, for logs and errors.
    const NAME: &'static str;

    /// A catalog query that counts the tables named by its one parameter (`$1` or `?`; qualified by a schema
    /// where the store has them): how idem tells a missing table without reading an error's text.
    const TABLE_EXISTS: &'static str;

    /// The migrations of this backend, in version order.
    fn migrations() -> &'static [Migration];
    /// The columns of this store's migration ledger, `{prefix}idem_migrations` (version, name, checksum, when).
    fn ledger_columns() -> &'static str;
    /// Applies the missing migrations under a lock, so that two processes migrating at once are safe.
    fn migrate(pool: &sqlx::Pool<Self>, tables: &Tables)
    -> impl Future<Output = Result<MigrationReport, Error>> + Send;
    /// Inserts the markers of `events` (with a digest of each payload) in the open transaction, first statement
    /// of the batch, and returns for each event whether its marker is new (handle it), already there with the
    /// same payload (a duplicate), or already there with another payload (a reused id). A marker held by a
    /// concurrent, uncommitted transaction makes this wait for that transaction's outcome. In the partitioned
    /// layout, markers in the partition before that are younger than the redelivery window count as well.
    fn claim(
        conn: &mut Self::Connection,
        tables: &Tables,
        layout: &MarkerLayout,
        group: &str,
        events: &[&Event],
    ) -> impl Future<Output = Result<Vec<Claim>, sqlx::Error>> + Send;
    /// Whether an error this database reported is transient (a retry can succeed: a serialization failure, a
    /// deadlock, a lock, the server shutting down or refusing connections for a while); [`crate::error::classify`]
    /// asks the store that reported it.
    fn transient(error: &dyn sqlx::error::DatabaseError) -> bool;

    /// The statement that opens idem's transactions; `None` (the default) sends the driver's `BEGIN`. A store
    /// whose intact check needs a mark in the transaction (MySQL: a savepoint that any end of the transaction
    /// removes) opens it here.
    fn begin_statement() -> Option<&'static str> {
        None
    }

    /// Whether the open transaction can still commit what it holds: `Ok(false)` when the handler ended it
    /// itself, an error when it is aborted (PostgreSQL then turns `COMMIT` into a silent `ROLLBACK`). `idem_wrote`:
    /// idem wrote in this transaction (its markers, its inbox claim), so a transaction that holds no write is not
    /// idem's any more (the handler ended it and began another).
    fn transaction_intact(
        conn: &mut Self::Connection,
        idem_wrote: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// Checks the transaction as [`Store::transaction_intact`] does and commits it when it is intact, in as few
    /// round trips as the database allows (PostgreSQL: one, which also opens the next transaction).
    fn commit_intact<'c>(
        tx: sqlx::Transaction<'c, Self>,
        idem_wrote: bool,
    ) -> impl Future<Output = IntactCommit<'c, Self>> + Send;
    /// Records a dead letter in the open transaction; a second failure of the same event updates its row.
    fn dead_letter(
        conn: &mut Self::Connection,
        tables: &Tables,
        group: &str,
        letter: &NewDeadLetter<'_>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Refuses to consume when the marker table's layout in the database is not the configured one; a store with
    /// the partitioned layout (PostgreSQL, see [`partitions`]) also creates the partitions of the current period
    /// and those ahead. A store without it keeps this default: the plain layout only.
    fn prepare_layout(
        _pool: &sqlx::Pool<Self>,
        _tables: &Tables,
        layout: &MarkerLayout,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        let result = match layout {
            MarkerLayout::Plain => Ok(()),
            MarkerLayout::Partitioned(_) => Err(Error::Config(format!(
                "layout: partitioned markers need PostgreSQL; on {} use the plain layout (the default)",
                <Self as Store>::NAME
            ))),
        };
        std::future::ready(result)
    }

    /// Drops the partitions of the partitioned layout whose whole range is past `retention`; returns their names
    /// and the markers that went with them. Only called when [`Store::prepare_layout`] accepted a partitioned
    /// layout; a store without it never is.
    fn drop_expired_partitions(
        _pool: &sqlx::Pool<Self>,
        _tables: &Tables,
        _retention: std::time::Duration,
    ) -> impl Future<Output = Result<(Vec<String>, u64), Error>> + Send {
        std::future::ready(Ok((Vec::new(), 0)))
    }
}

/// The operator's tooling over a store: figures, dead letters and their replay, pruning.
pub trait Operations: Store {
    /// Marker and dead-letter figures per consumer group (of `group` only, when given).
    fn stats(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
    ) -> impl Future<Output = Result<Vec<GroupStats>, Error>> + Send;
    /// First step of a replay, in one transaction: deletes the event's marker and marks the row `replaying`,
    /// unless replaying could apply the effect twice (see [`ReplayRisk`]; `force` accepts pruned markers). With
    /// `check_only` it changes nothing and says whether the replay would start.
    fn begin_replay(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        id: i64,
        force: bool,
        check_only: bool,
    ) -> impl Future<Output = Result<ReplayStart, Error>> + Send;
    /// Deletes at most `limit` markers older than `older_than` (of `group`, or of every group) in one statement
    /// (PostgreSQL: by `ctid`, oldest first; SQLite: by `rowid`) and returns how many went and, where the store
    /// tracks it, the newest `processed_at` deleted (seconds since the epoch). Passed back as `from`, it starts
    /// the next statement's index scan there: on PostgreSQL the entries of rows a pass already deleted stay in the
    /// index until a vacuum, and a scan from the oldest would walk all of them again at every statement.
    fn prune_batch(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
        limit: u32,
        from: Option<f64>,
    ) -> impl Future<Output = Result<(u64, Option<f64>), Error>> + Send;
    /// Counts the markers older than `older_than` (of `group`, or of every group): what a prune would delete.
    fn count_expired(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        group: Option<&str>,
        older_than: std::time::Duration,
    ) -> impl Future<Output = Result<i64, Error>> + Send;
    /// After a replay's publish failed: the row is `dead` again, held by no replay.
    fn abandon_replay(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        id: i64,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Last step of a replay: deletes the row if it is still `replaying` (a new failure would have set it back
    /// to `dead`, and then the row stays).
    fn finish_replay(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        id: i64,
    ) -> impl Future<Output = Result<(), Error>> + Send;
    /// Whether idem's table `name` (e.g. `outbox`, under `tables`' prefix) exists: how a missing table is told
    /// apart from other failures without reading an error's text.
    fn table_exists(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        name: &str,
    ) -> impl Future<Output = Result<bool, Error>> + Send;
    /// The migrations recorded in the ledger, `(version, checksum)`; none when the ledger does not exist yet.
    /// Reads only.
    fn applied_migrations(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
    ) -> impl Future<Output = Result<Vec<(i32, i64)>, Error>> + Send;
}

/// A store idem consumes into and operates on: [`Store`], [`Operations`], [`parking::Parking`] and
/// [`audit::AuditTrail`] together.
pub trait Backend:
    Store
    + Operations
    + parking::Parking
    + audit::AuditTrail
    + archive::Archive
    + letter_pages::LetterPages
    + responses::StoredResponses
{
    /// `postgres` or `sqlite` ([`Store::NAME`]).
    const NAME: &'static str;
}

impl<DB> Backend for DB
where
    DB: Store
        + Operations
        + parking::Parking
        + audit::AuditTrail
        + archive::Archive
        + letter_pages::LetterPages
        + responses::StoredResponses,
{
    const NAME: &'static str = <DB as Store>::NAME;
}

/// The result of claiming one event's marker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The marker is new: handle the event.
    New,
    /// The marker was there, for the same payload (or one stored before digests were kept): a redelivery.
    Duplicate,
    /// The marker was there for a different payload: the producer reused the id for another event.
    Reused {
        /// Where the first event with this id was delivered from.
        first: String,
    },
}

/// The digest stored with each marker: SHA-256 of the payload.
pub fn payload_digest(payload: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(payload).to_vec()
}

/// A message's offset for a broker without offsets (RabbitMQ, SQS): the first 63 bits of a SHA-256 `digest` of
/// what identifies the message, the same on every delivery of it.
pub(crate) fn offset_from_digest(digest: &[u8]) -> i64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first) & i64::MAX
}

/// Compares a stored marker with the event claiming it again.
pub(crate) fn judge_existing(stored_digest: Option<&[u8]>, first: String, event: &Event) -> Claim {
    match stored_digest {
        Some(stored) if stored != payload_digest(&event.message.payload).as_slice() => Claim::Reused { first },
        _ => Claim::Duplicate,
    }
}

/// Table names: an optional schema (PostgreSQL only) and a prefix, so several services can share one database.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tables {
    schema: Option<String>,
    prefix: String,
    rendered: Rendered,
}

/// The statements of the hot path, rendered once per [`Tables`] (and shared by its clones): a template is a
/// `&'static str`, so its address names it for as long as the program runs.
#[derive(Clone, Default)]
struct Rendered(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<Template, std::sync::Arc<str>>>>);

/// A `&'static str` template by its address and length.
type Template = (usize, usize);

/// A cache, not part of the value: two `Tables` with the same names are equal whatever each has rendered.
impl PartialEq for Rendered {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Rendered {}

impl std::fmt::Debug for Rendered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Rendered")
    }
}

impl Tables {
    /// Tables named `{schema.}{prefix}processed_events` and so on. Both parts must be lower-case SQL identifiers
    /// (`[a-z_][a-z0-9_]*`; the prefix may be empty).
    pub fn new(schema: Option<&str>, prefix: &str) -> Result<Self, Error> {
        if let Some(schema) = schema
            && !is_identifier(schema)
        {
            return Err(Error::Config(format!(
                "schema `{schema}` is not a plain SQL identifier: use lower-case letters, digits and _, starting with a letter"
            )));
        }
        if !prefix.is_empty() && !is_identifier(prefix) {
            return Err(Error::Config(format!(
                "table_prefix `{prefix}` is not a plain SQL identifier: use lower-case letters, digits and _ (e.g. `billing_`)"
            )));
        }
        Ok(Tables { schema: schema.map(str::to_owned), prefix: prefix.to_owned(), rendered: Rendered::default() })
    }

    /// The table prefix (possibly empty).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The schema, if any.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The qualified name of a table, e.g. `billing.svc_processed_events`.
    pub fn table(&self, name: &str) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}{name}", self.prefix),
            None => format!("{}{name}", self.prefix),
        }
    }

    /// Replaces `{t}` (qualified prefix) and `{p}` (bare prefix) in a SQL template.
    pub fn render(&self, sql: &str) -> String {
        let qualified = match &self.schema {
            Some(schema) => format!("{schema}.{}", self.prefix),
            None => self.prefix.clone(),
        };
        sql.replace("{t}", &qualified).replace("{p}", &self.prefix)
    }

    /// [`Tables::render`] of a statement the hot path runs for every message or batch: rendered the first time,
    /// then taken from the cache (no search and no allocation per use).
    pub(crate) fn render_once(&self, sql: &'static str) -> std::sync::Arc<str> {
        let key = (sql.as_ptr() as usize, sql.len());
        let mut cache = self.rendered.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        std::sync::Arc::clone(cache.entry(key).or_insert_with(|| self.render(sql).into()))
    }
}

pub(crate) fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && s.len() <= 40
}

/// A dead letter about to be written.
#[derive(Debug)]
pub struct NewDeadLetter<'a> {
    /// The event id, when the key extractor found one.
    pub event_id: Option<&'a str>,
    /// The message as delivered.
    pub message: &'a Message,
    /// Why it is dead: the handler's permanent error, the missing key, the last retryable error.
    pub error: &'a str,
    /// How many times handling was attempted.
    pub attempts: i32,
}

/// A stored dead letter.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeadLetter {
    /// Row id, used by `idem dead-letters replay`.
    pub id: i64,
    /// The consumer group that failed it.
    pub consumer_group: String,
    /// The event id, when the message had one.
    pub event_id: Option<String>,
    /// Topic of the original delivery.
    pub topic: String,
    /// Partition of the original delivery.
    pub partition: i32,
    /// Offset of the original delivery. Written in JSON as a decimal string: a Pub/Sub message id or an SQS
    /// message's digest makes a 64-bit offset, which JSON readers (jq, JavaScript) round beyond 2^53.
    #[serde(serialize_with = "decimal")]
    pub offset: i64,
    /// The message key, if any.
    #[serde(skip)]
    pub key: Option<Vec<u8>>,
    /// The stored payload.
    #[serde(serialize_with = "lossy_utf8")]
    pub payload: Vec<u8>,
    /// The stored headers.
    #[serde(skip)]
    pub headers: Vec<(String, Vec<u8>)>,
    /// The reason it failed.
    pub error: String,
    /// Attempts made.
    pub attempts: i32,
    /// First failure, ms since the epoch.
    #[serde(rename = "first_failed_at", serialize_with = "rfc3339")]
    pub first_failed_at_ms: i64,
    /// Last failure, ms since the epoch.
    #[serde(rename = "last_failed_at", serialize_with = "rfc3339")]
    pub last_failed_at_ms: i64,
    /// `dead`, or `replaying` while a replay is under way.
    pub status: String,
}

/// A dead letter from a row of either store, columns in the field order (times as epoch milliseconds): the one
/// row mapping, whatever the database.
impl<'r, R: sqlx::Row> sqlx::FromRow<'r, R> for DeadLetter
where
    usize: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<Vec<u8>>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        Ok(DeadLetter {
            id: row.try_get(0)?,
            consumer_group: row.try_get(1)?,
            event_id: row.try_get(2)?,
            topic: row.try_get(3)?,
            partition: row.try_get(4)?,
            offset: row.try_get(5)?,
            key: row.try_get(6)?,
            payload: row.try_get(7)?,
            headers: decode_headers(&row.try_get::<String, _>(8)?),
            error: row.try_get(9)?,
            attempts: row.try_get(10)?,
            first_failed_at_ms: row.try_get(11)?,
            last_failed_at_ms: row.try_get(12)?,
            status: row.try_get(13)?,
        })
    }
}

/// A group's figures from a row of any store: group, markers, oldest marker's age in seconds, dead letters, and
/// those of them that are ids reused with another payload.
impl<'r, R: sqlx::Row> sqlx::FromRow<'r, R> for GroupStats
where
    usize: sqlx::ColumnIndex<R>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<f64>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        Ok(GroupStats {
            consumer_group: row.try_get(0)?,
            markers: row.try_get(1)?,
            oldest_marker_age_seconds: row.try_get(2)?,
            dead_letters: row.try_get(3)?,
            id_reused: row.try_get(4)?,
        })
    }
}

/// Milliseconds since the Unix epoch as RFC 3339 in UTC (`2026-12-01T01:12:26.123Z`), the one form idem's JSON
/// output uses for times.
pub fn rfc3339_from_ms(ms: i64) -> String {
    let (days, rest) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, milli) = (rest / 3_600_000, rest / 60_000 % 60, rest / 1_000 % 60, rest % 1_000);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

pub(crate) fn rfc3339<S: serde::Serializer>(ms: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339_from_ms(*ms))
}

/// A 64-bit integer as a decimal string, exact for every JSON reader.
pub(crate) fn decimal<S: serde::Serializer>(n: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(n)
}

fn lossy_utf8<S: serde::Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(bytes))
}

impl DeadLetter {
    /// The message as it was delivered, ready to be published again.
    pub fn message(&self) -> Message {
        Message {
            topic: self.topic.clone(),
            partition: self.partition,
            offset: self.offset,
            key: self.key.clone(),
            payload: self.payload.clone(),
            headers: self.headers.clone(),
            timestamp_ms: None,
            ack_handle: None,
            dead_letter_reason: None,
        }
    }
}

/// Marker-table figures of one consumer group.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GroupStats {
    /// The consumer group.
    pub consumer_group: String,
    /// Markers stored.
    pub markers: i64,
    /// Age of the oldest marker, in seconds.
    pub oldest_marker_age_seconds: Option<f64>,
    /// Dead letters stored.
    pub dead_letters: i64,
    /// Of the dead letters, those of an event id that came again with another payload (`id_reused`).
    pub id_reused: i64,
}

/// Marker and dead-letter figures per consumer group (`idem stats`).
pub async fn stats<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
) -> Result<Vec<GroupStats>, Error> {
    DB::stats(pool, tables, group).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hot_statement_is_rendered_once_per_tables_and_shared_by_its_clones() {
        let t = Tables::new(Some("billing"), "svc_").unwrap();
        let first = t.render_once("SELECT 1 FROM {t}x");
        assert_eq!(&*first, "SELECT 1 FROM billing.svc_x");
        assert!(std::sync::Arc::ptr_eq(&first, &t.clone().render_once("SELECT 1 FROM {t}x")), "taken from the cache");
        let other = Tables::new(None, "o_").unwrap();
        assert_eq!(&*other.render_once("SELECT 1 FROM {t}x"), "SELECT 1 FROM o_x", "each Tables renders its own");
        assert_eq!(t, Tables::new(Some("billing"), "svc_").unwrap(), "what was rendered is no part of the value");
    }

    #[test]
    fn tables_validate_and_render() {
        let t = Tables::new(Some("billing"), "svc_").unwrap();
        assert_eq!(t.table("processed_events"), "billing.svc_processed_events");
        assert_eq!(t.render("{t}x {p}y"), "billing.svc_x svc_y");
        assert!(Tables::new(None, "bad-prefix").unwrap_err().to_string().contains("table_prefix"));
        assert!(Tables::new(Some("Drop Table"), "").unwrap_err().to_string().contains("schema"));
        assert_eq!(Tables::default().table("dead_letters"), "dead_letters");
    }
}
