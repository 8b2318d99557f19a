//! The Sequential Inbox's statements (PostgreSQL only): instances, the claim and the instance lock, sequenced
//! messages, housekeeping's batches and gauges; `admin` holds the operator's (`idem inbox …`).

pub mod admin;

use sqlx::{PgConnection, PgPool, Row};

use crate::message::Message;
use crate::store::{Tables, decode_headers, encode_headers};

/// The state of a sequenced message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Waiting,
    Processed,
    Failed,
}

impl Status {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Status::Waiting => "WAITING",
            Status::Processed => "PROCESSED",
            Status::Failed => "FAILED",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "WAITING" => Some(Status::Waiting),
            "PROCESSED" => Some(Status::Processed),
            "FAILED" => Some(Status::Failed),
            _ => None,
        }
    }
}

/// A buffered message, as the release loop reads it back.
pub(crate) struct Waiting {
    pub id: i64,
    pub message_type: String,
    pub idempotence_id: String,
    pub message: Message,
    pub forced: bool,
}

/// The newest row of the message being decided (`$1` its id, `$2` its type, `$3` the instance), as the CTE `e`.
macro_rules! newest_row {
    () => {
        "e AS (SELECT id, status FROM {t}sequenced_message
                WHERE idempotence_id = $1 AND message_type = $2 AND sequence_instance_id = $3
                ORDER BY id DESC LIMIT 1)"
    };
}

/// The state's columns over `e` (`newest_row!`): its row, the instance's processed types and its waiting count.
macro_rules! state_columns {
    () => {
        "e.id, e.status,
         ARRAY(SELECT DISTINCT message_type FROM {t}sequenced_message
                WHERE sequence_instance_id = $3 AND status = 'PROCESSED'),
         (SELECT count(*) FROM {t}sequenced_message WHERE sequence_instance_id = $3 AND status = 'WAITING')"
    };
}

/// The state read over `e` (`newest_row!`), as a query of its own.
macro_rules! read_state {
    () => {
        concat!("SELECT ", state_columns!(), " FROM (SELECT 1) one LEFT JOIN e ON true")
    };
}

/// The message (`$1` its id, `$2` its type, `$3` the instance; `$4`–`$7` its topic, partition, offset and headers)
/// recorded PROCESSED over `e` (`newest_row!`), as the CTEs `resent` and `fresh`, when `$gate` (SQL that starts
/// with ` AND `, or nothing) holds: nothing is written when its newest row is PROCESSED or WAITING; a FAILED one is
/// updated in place, as [`record`] does for a resend; otherwise a row is inserted. PostgreSQL runs a
/// data-modifying `WITH` part once whether or not the query reads it.
macro_rules! record_processed {
    ($gate:literal) => {
        concat!(
            r#"resent AS (UPDATE {t}sequenced_message m
                           SET status = 'PROCESSED', topic = $4, partition = $5, "offset" = $6, key = NULL,
                               payload = NULL, headers = $7, error = NULL, force_release = false,
                               received_at = now(), processed_at = clock_timestamp()
                          FROM e WHERE m.id = e.id AND e.status = 'FAILED'"#,
            $gate,
            r#"),
               fresh AS (INSERT INTO {t}sequenced_message (sequence_instance_id, message_type, idempotence_id, status,
                                topic, partition, "offset", key, payload, headers, processed_at)
                         SELECT $3, $2, $1, 'PROCESSED', $4, $5, $6, NULL, NULL, $7, clock_timestamp()
                          WHERE NOT EXISTS (SELECT 1 FROM e)"#,
            $gate,
            ")"
        )
    };
}

/// Finds or creates the instance of (`sequence`, `context`), as the first statement of the processing transaction:
/// two consumers creating it at once both get the row that won the unique constraint (the second waits for the
/// first's transaction, then finds its row, or creates it when that transaction rolled back). Returns its id.
///
/// One statement, one round trip, whether the instance is there or not: the lookup, and the insert only when the
/// lookup found nothing (an insert of no rows writes nothing).
pub(crate) async fn resolve_instance(
    conn: &mut PgConnection,
    tables: &Tables,
    sequence: &str,
    context: &str,
    retention_secs: f64,
) -> Result<i64, sqlx::Error> {
    let sql = tables.render_once(
        "WITH found AS (SELECT id FROM {t}sequence_instance WHERE sequence_name = $1 AND context_id = $2),
              created AS (
                INSERT INTO {t}sequence_instance (sequence_name, context_id, retain_until)
                SELECT $1, $2, now() + make_interval(secs => $3) WHERE NOT EXISTS (SELECT 1 FROM found)
                ON CONFLICT (sequence_name, context_id) DO NOTHING RETURNING id)
         SELECT id FROM found UNION ALL SELECT id FROM created",
    );
    loop {
        // Neither found nor created: another consumer created it after this statement's snapshot was taken (the
        // insert waited for it, then gave way), or housekeeping deleted it in between. A new statement sees the
        // row that was committed meanwhile.
        let id: Option<i64> = sqlx::query_scalar(&sql)
            .bind(sequence)
            .bind(context)
            .bind(retention_secs)
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(id) = id {
            return Ok(id);
        }
    }
}

/// What the first statement of the processing transaction found.
#[derive(Debug)]
pub(crate) enum Claim {
    /// This delivery won the claim, and holds the instance's lock; `open`: the instance is OPEN. `state`: what
    /// the decision needs, read in the same statement; `None` when another holder of the lock committed between
    /// that statement's snapshot and the lock (the state must then be read again, by a statement of its own).
    Won { open: bool, state: Option<InstanceState> },
    /// Another delivery of the message claimed it first.
    Duplicate,
    /// The instance is gone (deleted by housekeeping after it was resolved).
    Gone,
}

/// The claim and, only when this delivery won it, the instance's lock, as the CTEs `c` (`won`: rows claimed) and
/// `locked`; `$1` is the message's id, `$2` its type, `$3` the instance. The lock is an update of the instance's
/// `version` (`FOR NO KEY UPDATE`, the lock that leaves the `KEY SHARE` of another claim's foreign key alone, so
/// two claimers waiting for the instance cannot deadlock). Every holder of the lock raises `version`, so
/// `current` holds a row exactly when no other holder committed between this statement's snapshot (`seen`) and
/// the lock: the instance's messages read with that snapshot are then the ones the lock protects. The lock reads
/// the claim's count, so it is taken after the claim, as two statements would: a concurrent delivery waits on
/// the claim and a duplicate takes no lock. An instance deleted after it was resolved fails the claim's foreign
/// key.
macro_rules! claim_and_lock {
    () => {
        "claimed AS (
           INSERT INTO {t}sequential_inbox_idempotence
                  (message_type, idempotence_id, sequence_instance_id, created_at)
           VALUES ($2, $1, $3, now())
           ON CONFLICT (message_type, idempotence_id) DO NOTHING RETURNING 1),
         c AS (SELECT count(*) AS won FROM claimed),
         seen AS (SELECT version FROM {t}sequence_instance WHERE id = $3),
         locked AS (UPDATE {t}sequence_instance SET version = version + 1
                     WHERE id = $3 AND (SELECT won FROM c) > 0 RETURNING version, status),
         current AS (SELECT 1 FROM locked, seen WHERE locked.version = seen.version + 1)"
    };
}

/// The first statement's answer over `c`, `locked`, `current` (`claim_and_lock!`) and `e` (`newest_row!`): rows
/// claimed, the instance's status when locked, whether the snapshot is current, the claim's mark, the state.
macro_rules! claim_select {
    () => {
        concat!(
            "SELECT c.won, l.status, EXISTS (SELECT 1 FROM current),
                    CASE WHEN c.won > 0 THEN set_config('idem.claimed', '1', true) END, ",
            state_columns!(),
            " FROM c LEFT JOIN locked l ON true LEFT JOIN e ON true"
        )
    };
}

/// The first statement of the processing transaction, one round trip: the claim, the instance's lock when this
/// delivery won it, and what the decision needs (see [`state`]), read with the statement's snapshot and returned
/// only when that snapshot saw every holder of the lock before this one (`claim_and_lock!`). With `record`
/// (a type without a release condition, always released), the message is also recorded PROCESSED, as
/// [`state_and_record_processed`] does, under the same condition. A won claim marks the transaction as idem's
/// (`idem.claimed`), which the intact check before `COMMIT` looks for.
pub(crate) async fn claim_lock_and_read(
    conn: &mut PgConnection,
    tables: &Tables,
    message_type: &str,
    idempotence_id: &str,
    instance: i64,
    record: Option<&Message>,
) -> Result<Claim, sqlx::Error> {
    let row = match record {
        None => {
            let sql =
                tables.render_once(concat!("WITH ", claim_and_lock!(), ", ", newest_row!(), " ", claim_select!()));
            sqlx::query(&sql).bind(idempotence_id).bind(message_type).bind(instance).fetch_one(conn).await?
        }
        Some(message) => {
            let sql = tables.render_once(concat!(
                "WITH ",
                claim_and_lock!(),
                ", ",
                newest_row!(),
                ", ",
                record_processed!(" AND EXISTS (SELECT 1 FROM current)"),
                " ",
                claim_select!()
            ));
            bind_processed(sqlx::query(&sql).bind(idempotence_id).bind(message_type).bind(instance), message)
                .fetch_one(conn)
                .await?
        }
    };
    let won: i64 = row.get(0);
    let status: Option<String> = row.get(1);
    let current: bool = row.get(2);
    Ok(match status {
        _ if won == 0 => Claim::Duplicate,
        None => Claim::Gone,
        Some(status) => Claim::Won { open: status == "OPEN", state: current.then(|| instance_state(&row, 4)) },
    })
}

/// Deletes a claim, so that a resend of a failed message can claim it again.
pub(crate) async fn delete_claim(
    conn: &mut PgConnection,
    tables: &Tables,
    message_type: &str,
    idempotence_id: &str,
) -> Result<(), sqlx::Error> {
    let sql =
        tables.render("DELETE FROM {t}sequential_inbox_idempotence WHERE message_type = $1 AND idempotence_id = $2");
    sqlx::query(&sql).bind(message_type).bind(idempotence_id).execute(conn).await?;
    Ok(())
}

/// Takes the instance's lock for the rest of the transaction, raising its `version` as every holder of the lock
/// does (see `claim_and_lock!`); returns whether it is OPEN (`None`: it is gone).
pub(crate) async fn lock_instance(
    conn: &mut PgConnection,
    tables: &Tables,
    instance: i64,
) -> Result<Option<bool>, sqlx::Error> {
    // The lock is idem's hold on the instance for this transaction: it marks the transaction as idem's
    // (`idem.claimed`), as a claim does, for the intact check of the handlers that run under it.
    let sql = tables.render_once(
        "UPDATE {t}sequence_instance SET version = version + 1 WHERE id = $1
         RETURNING status, set_config('idem.claimed', '1', true)",
    );
    let status: Option<(String, String)> = sqlx::query_as(&sql).bind(instance).fetch_optional(conn).await?;
    Ok(status.map(|(s, _)| s == "OPEN"))
}

/// Binds a message's position and headers as `$4`–`$7` of `record_processed!`.
fn bind_processed<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    message: &'q Message,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query.bind(&message.topic).bind(message.partition).bind(message.offset).bind(encode_headers(&message.headers))
}

/// The state in a row's columns from `first` on, in the order of `state_columns!`.
fn instance_state(row: &sqlx::postgres::PgRow, first: usize) -> InstanceState {
    let id: Option<i64> = row.get(first);
    let status: Option<String> = row.get(first + 1);
    InstanceState {
        existing: id.zip(status.as_deref().and_then(Status::parse)),
        processed: row.get(first + 2),
        waiting: row.get(first + 3),
    }
}

/// What the decision needs once the instance is locked, read in one statement (so with a snapshot taken after
/// the lock was granted): the legacy lookup of this message (its newest row), the processed types, and how
/// many messages wait.
#[derive(Debug)]
pub(crate) struct InstanceState {
    pub existing: Option<(i64, Status)>,
    pub processed: Vec<String>,
    pub waiting: i64,
}

pub(crate) async fn state(
    conn: &mut PgConnection,
    tables: &Tables,
    instance: i64,
    message_type: &str,
    idempotence_id: &str,
) -> Result<InstanceState, sqlx::Error> {
    let sql = tables.render_once(concat!("WITH ", newest_row!(), " ", read_state!()));
    let row = sqlx::query(&sql).bind(idempotence_id).bind(message_type).bind(instance).fetch_one(conn).await?;
    Ok(instance_state(&row, 0))
}

/// [`state`] and, in the same statement, the message recorded PROCESSED (`record_processed!`), for a message type
/// without a release condition (always released): one round trip where the two took two. Every part of the
/// statement reads the same snapshot, taken after the instance lock, so `processed` is what it was before this
/// message, as with [`state`].
pub(crate) async fn state_and_record_processed(
    conn: &mut PgConnection,
    tables: &Tables,
    instance: i64,
    message_type: &str,
    idempotence_id: &str,
    message: &Message,
) -> Result<InstanceState, sqlx::Error> {
    let sql = tables.render_once(concat!("WITH ", newest_row!(), ", ", record_processed!(""), " ", read_state!()));
    let query = sqlx::query(&sql).bind(idempotence_id).bind(message_type).bind(instance);
    let row = bind_processed(query, message).fetch_one(conn).await?;
    Ok(instance_state(&row, 0))
}

/// The types of the instance already processed.
pub(crate) async fn processed_types(
    conn: &mut PgConnection,
    tables: &Tables,
    instance: i64,
) -> Result<Vec<String>, sqlx::Error> {
    let sql = tables.render(
        "SELECT DISTINCT message_type FROM {t}sequenced_message WHERE sequence_instance_id = $1 AND status = 'PROCESSED'",
    );
    sqlx::query_scalar(&sql).bind(instance).fetch_all(conn).await
}

/// Stores a message of the instance in `status`; `replaces` is the FAILED row a resend retries. A PROCESSED
/// row keeps the message's position but not its bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn record(
    conn: &mut PgConnection,
    tables: &Tables,
    instance: i64,
    message_type: &str,
    idempotence_id: &str,
    message: &Message,
    status: Status,
    replaces: Option<i64>,
) -> Result<(), sqlx::Error> {
    // processed_at: when a PROCESSED row is written, NULL for the others.
    match replaces {
        // The FAILED row a resend retries is updated in place.
        Some(id) => {
            let sql = tables.render_once(
                r#"UPDATE {t}sequenced_message SET status = $2, topic = $3, partition = $4, "offset" = $5, key = $6,
                          payload = $7, headers = $8, error = NULL, force_release = false, received_at = now(),
                          processed_at = CASE WHEN $2 = 'PROCESSED' THEN clock_timestamp() END
                    WHERE id = $1"#,
            );
            bind_contents(sqlx::query(&sql).bind(id), status, message).execute(conn).await?;
        }
        None => {
            let sql = tables.render_once(
                r#"INSERT INTO {t}sequenced_message (sequence_instance_id, message_type, idempotence_id, status,
                          topic, partition, "offset", key, payload, headers, processed_at)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
                           CASE WHEN $4 = 'PROCESSED' THEN clock_timestamp() END)"#,
            );
            let insert = sqlx::query(&sql).bind(instance).bind(message_type).bind(idempotence_id);
            bind_contents(insert, status, message).execute(conn).await?;
        }
    }
    Ok(())
}

/// Binds a message's state and contents, in this order: status, topic, partition, offset, key, payload, headers.
/// A PROCESSED message keeps its position, not its bytes.
fn bind_contents<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    status: Status,
    message: &'q Message,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let keep_bytes = status != Status::Processed;
    query
        .bind(status.as_str())
        .bind(&message.topic)
        .bind(message.partition)
        .bind(message.offset)
        .bind(message.key.as_deref().filter(|_| keep_bytes))
        .bind(keep_bytes.then_some(message.payload.as_slice()))
        .bind(encode_headers(&message.headers))
}

/// The WAITING messages of an instance, in the order they are considered for release: arrival, then row id.
pub(crate) async fn waiting(
    conn: &mut PgConnection,
    tables: &Tables,
    instance: i64,
) -> Result<Vec<Waiting>, sqlx::Error> {
    let sql = tables.render(
        r#"SELECT id, message_type, idempotence_id, topic, partition, "offset", key, payload, headers, force_release
             FROM {t}sequenced_message
            WHERE sequence_instance_id = $1 AND status = 'WAITING'
            ORDER BY received_at, id"#,
    );
    let rows = sqlx::query(&sql).bind(instance).fetch_all(conn).await?;
    Ok(rows
        .into_iter()
        .map(|r| Waiting {
            id: r.get(0),
            message_type: r.get(1),
            idempotence_id: r.get(2),
            message: Message {
                topic: r.get(3),
                partition: r.get(4),
                offset: r.get(5),
                key: r.get(6),
                payload: r.get::<Option<Vec<u8>>, _>(7).unwrap_or_default(),
                headers: decode_headers(r.get::<&str, _>(8)),
                timestamp_ms: None,
                ack_handle: None,
                dead_letter_reason: None,
            },
            forced: r.get(9),
        })
        .collect())
}

/// Marks a released message PROCESSED (its bytes are no longer needed).
pub(crate) async fn mark_processed(conn: &mut PgConnection, tables: &Tables, id: i64) -> Result<(), sqlx::Error> {
    let sql = tables.render(
        "UPDATE {t}sequenced_message
            SET status = 'PROCESSED', processed_at = clock_timestamp(), payload = NULL, key = NULL, force_release = false
          WHERE id = $1",
    );
    sqlx::query(&sql).bind(id).execute(conn).await?;
    Ok(())
}

/// Marks a released message FAILED with its reason and deletes its claim, in the caller's transaction.
pub(crate) async fn mark_failed(
    conn: &mut PgConnection,
    tables: &Tables,
    waiting: &Waiting,
    reason: &str,
) -> Result<(), sqlx::Error> {
    let sql = tables
        .render("UPDATE {t}sequenced_message SET status = 'FAILED', error = $2, force_release = false WHERE id = $1");
    sqlx::query(&sql).bind(waiting.id).bind(reason).execute(&mut *conn).await?;
    delete_claim(conn, tables, &waiting.message_type, &waiting.idempotence_id).await
}

/// Closes the instance.
pub(crate) async fn close(conn: &mut PgConnection, tables: &Tables, instance: i64) -> Result<(), sqlx::Error> {
    let sql = tables.render(
        "UPDATE {t}sequence_instance SET status = 'CLOSED', closed_at = now() WHERE id = $1 AND status = 'OPEN'",
    );
    sqlx::query(&sql).bind(instance).execute(conn).await?;
    Ok(())
}

/// Closes at most `batch` OPEN instances of `sequence` whose every type (`types`) was processed, skipping those a
/// consumer holds; returns how many it closed.
pub(crate) async fn close_complete(
    pool: &PgPool,
    tables: &Tables,
    sequence: &str,
    types: &[String],
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let sql = tables.render_once(
        "UPDATE {t}sequence_instance SET status = 'CLOSED', closed_at = now()
          WHERE id IN (SELECT i.id FROM {t}sequence_instance i
                        WHERE i.sequence_name = $1 AND i.status = 'OPEN'
                          AND (SELECT count(DISTINCT m.message_type) FROM {t}sequenced_message m
                                WHERE m.sequence_instance_id = i.id AND m.status = 'PROCESSED'
                                  AND m.message_type = ANY($2)) = $3
                        LIMIT $4 FOR UPDATE SKIP LOCKED)",
    );
    let done = sqlx::query(&sql).bind(sequence).bind(types).bind(types.len() as i64).bind(batch).execute(pool).await?;
    Ok(done.rows_affected())
}

/// At most `limit` instances (id and sequence name) holding WAITING messages an operator released.
pub(crate) async fn instances_with_forced(
    pool: &PgPool,
    tables: &Tables,
    limit: i64,
) -> Result<Vec<(i64, String)>, sqlx::Error> {
    let sql = tables.render_once(
        "SELECT DISTINCT i.id, i.sequence_name FROM {t}sequenced_message m
           JOIN {t}sequence_instance i ON i.id = m.sequence_instance_id
          WHERE m.status = 'WAITING' AND m.force_release
          LIMIT $1",
    );
    sqlx::query_as(&sql).bind(limit).fetch_all(pool).await
}

/// Locks (skipping those a consumer holds) and returns at most `batch` instances past `retain_until` plus
/// `delay_secs`, oldest first, in the caller's transaction.
pub(crate) async fn lock_expired(
    conn: &mut PgConnection,
    tables: &Tables,
    delay_secs: f64,
    batch: i64,
) -> Result<Vec<i64>, sqlx::Error> {
    let sql = tables.render_once(
        "SELECT id FROM {t}sequence_instance
          WHERE retain_until < now() - make_interval(secs => $1)
          ORDER BY retain_until LIMIT $2 FOR UPDATE SKIP LOCKED",
    );
    sqlx::query_scalar(&sql).bind(delay_secs).bind(batch).fetch_all(conn).await
}

/// Deletes the instances `ids` (their claims and messages go by cascade); returns how many it deleted.
pub(crate) async fn delete_instances(
    conn: &mut PgConnection,
    tables: &Tables,
    ids: &[i64],
) -> Result<u64, sqlx::Error> {
    let sql = tables.render_once("DELETE FROM {t}sequence_instance WHERE id = ANY($1)");
    Ok(sqlx::query(&sql).bind(ids).execute(conn).await?.rows_affected())
}

/// A WAITING or FAILED message of an instance about to be deleted.
pub(crate) struct Leftover {
    pub sequence: String,
    pub context: String,
    /// The instance's `retain_until`, as text.
    pub retain_until: String,
    pub message_type: String,
    pub idempotence_id: String,
    pub status: String,
    pub error: Option<String>,
    pub message: Message,
}

/// The WAITING or FAILED messages of `instances`, in arrival order, in the caller's transaction.
pub(crate) async fn leftovers(
    conn: &mut PgConnection,
    tables: &Tables,
    instances: &[i64],
) -> Result<Vec<Leftover>, sqlx::Error> {
    let sql = tables.render_once(
        r#"SELECT i.sequence_name, i.context_id, i.retain_until::text, m.message_type, m.idempotence_id,
                  m.status, m.error, m.topic, m.partition, m."offset", m.key, m.payload, m.headers
             FROM {t}sequenced_message m JOIN {t}sequence_instance i ON i.id = m.sequence_instance_id
            WHERE m.sequence_instance_id = ANY($1) AND m.status IN ('WAITING', 'FAILED')
            ORDER BY m.id"#,
    );
    let rows = sqlx::query(&sql).bind(instances).fetch_all(conn).await?;
    rows.iter()
        .map(|row| {
            Ok(Leftover {
                sequence: row.try_get(0)?,
                context: row.try_get(1)?,
                retain_until: row.try_get(2)?,
                message_type: row.try_get(3)?,
                idempotence_id: row.try_get(4)?,
                status: row.try_get(5)?,
                error: row.try_get(6)?,
                message: Message {
                    topic: row.try_get(7)?,
                    partition: row.try_get(8)?,
                    offset: row.try_get(9)?,
                    key: row.try_get(10)?,
                    payload: row.try_get::<Option<Vec<u8>>, _>(11)?.unwrap_or_default(),
                    headers: decode_headers(row.try_get::<&str, _>(12)?),
                    timestamp_ms: None,
                    ack_handle: None,
                    dead_letter_reason: None,
                },
            })
        })
        .collect()
}

/// Per sequence: its WAITING messages and the age in seconds of the oldest.
pub(crate) async fn waiting_by_sequence(
    pool: &PgPool,
    tables: &Tables,
) -> Result<Vec<(String, i64, f64)>, sqlx::Error> {
    let sql = tables.render_once(
        "SELECT i.sequence_name, count(*), EXTRACT(EPOCH FROM now() - min(m.received_at))::float8
           FROM {t}sequenced_message m JOIN {t}sequence_instance i ON i.id = m.sequence_instance_id
          WHERE m.status = 'WAITING' GROUP BY i.sequence_name",
    );
    sqlx::query_as(&sql).fetch_all(pool).await
}

/// Per sequence: instances whose `retain_until` falls within `soon_secs` (not yet passed), and those past it.
pub(crate) async fn expiring_by_sequence(
    pool: &PgPool,
    tables: &Tables,
    soon_secs: f64,
) -> Result<Vec<(String, i64, i64)>, sqlx::Error> {
    let sql = tables.render_once(
        "SELECT sequence_name, count(*) FILTER (WHERE retain_until >= now()), count(*) FILTER (WHERE retain_until < now())
           FROM {t}sequence_instance WHERE retain_until < now() + make_interval(secs => $1)
          GROUP BY sequence_name",
    );
    sqlx::query_as(&sql).bind(soon_secs).fetch_all(pool).await
}
