//! Inspecting and acting on sequence instances: what `idem inbox list|show|close|release` calls.

use sqlx::{PgPool, Row};

use crate::error::Error;
use crate::store::Tables;

/// One sequence instance with the count of its messages per state.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InstanceSummary {
    /// Row id, used by `show`, `close` and `release`.
    pub id: i64,
    /// The sequence.
    pub sequence_name: String,
    /// The business context (order id, payment id).
    pub context_id: String,
    /// `OPEN` or `CLOSED`.
    pub status: String,
    /// Creation time (RFC 3339).
    pub created_at: String,
    /// When housekeeping may delete it, plus its delay (RFC 3339).
    pub retain_until: String,
    /// Messages processed.
    pub processed: i64,
    /// Messages waiting for their release condition.
    pub waiting: i64,
    /// Released messages whose handler failed.
    pub failed: i64,
}

/// One stored message of an instance.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StoredMessage {
    /// Row id, for `release --message`.
    pub id: i64,
    /// Its qualified type.
    pub message_type: String,
    /// Its idempotence id.
    pub idempotence_id: String,
    /// `WAITING`, `PROCESSED` or `FAILED`.
    pub status: String,
    /// Where it was delivered from.
    pub position: String,
    /// Why it failed.
    pub error: Option<String>,
    /// Released by an operator, to be handled by the next housekeeping pass.
    pub force_release: bool,
    /// When it arrived (RFC 3339).
    pub received_at: String,
    /// When it was handled (RFC 3339), if it was.
    pub processed_at: Option<String>,
}

/// Which instances [`list`] returns.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Of this sequence only.
    pub sequence: Option<String>,
    /// In this state only (`OPEN` or `CLOSED`).
    pub status: Option<String>,
    /// Only those holding WAITING or FAILED messages.
    pub stuck: bool,
}

const SUMMARY: &str = r#"SELECT i.id, i.sequence_name, i.context_id, i.status,
        to_char(i.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
        to_char(i.retain_until AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
        count(m.id) FILTER (WHERE m.status = 'PROCESSED'),
        count(m.id) FILTER (WHERE m.status = 'WAITING'),
        count(m.id) FILTER (WHERE m.status = 'FAILED')
   FROM {t}sequence_instance i LEFT JOIN {t}sequenced_message m ON m.sequence_instance_id = i.id"#;

fn summary(row: &sqlx::postgres::PgRow) -> InstanceSummary {
    InstanceSummary {
        id: row.get(0),
        sequence_name: row.get(1),
        context_id: row.get(2),
        status: row.get(3),
        created_at: row.get(4),
        retain_until: row.get(5),
        processed: row.get(6),
        waiting: row.get(7),
        failed: row.get(8),
    }
}

/// Instances, oldest first, at most `limit`.
pub async fn list(
    pool: &PgPool,
    tables: &Tables,
    filter: &ListFilter,
    limit: i64,
) -> Result<Vec<InstanceSummary>, Error> {
    if let Some(status) = &filter.status
        && status != "OPEN"
        && status != "CLOSED"
    {
        return Err(Error::Config(format!("status `{status}`: use OPEN or CLOSED")));
    }
    let sql = tables.render(&format!(
        "{SUMMARY}
          WHERE ($1::text IS NULL OR i.sequence_name = $1) AND ($2::text IS NULL OR i.status = $2)
          GROUP BY i.id
         HAVING NOT $3 OR count(m.id) FILTER (WHERE m.status IN ('WAITING', 'FAILED')) > 0
          ORDER BY i.created_at, i.id LIMIT $4"
    ));
    let rows = sqlx::query(&sql)
        .bind(filter.sequence.as_deref())
        .bind(filter.status.as_deref())
        .bind(filter.stuck)
        .bind(limit)
        .fetch_all(pool)
        .await?;
    Ok(rows.iter().map(summary).collect())
}

/// The id of the instance of (`sequence`, `context`), if there is one.
pub async fn find(pool: &PgPool, tables: &Tables, sequence: &str, context: &str) -> Result<Option<i64>, Error> {
    let sql = tables.render("SELECT id FROM {t}sequence_instance WHERE sequence_name = $1 AND context_id = $2");
    Ok(sqlx::query_scalar(&sql).bind(sequence).bind(context).fetch_optional(pool).await?)
}

/// An instance and its messages, in arrival order.
pub async fn show(
    pool: &PgPool,
    tables: &Tables,
    id: i64,
) -> Result<Option<(InstanceSummary, Vec<StoredMessage>)>, Error> {
    let sql = tables.render(&format!("{SUMMARY} WHERE i.id = $1 GROUP BY i.id"));
    let Some(row) = sqlx::query(&sql).bind(id).fetch_optional(pool).await? else { return Ok(None) };
    let messages = tables.render(
        r#"SELECT id, message_type, idempotence_id, status, topic || '/' || partition || '/' || "offset", error,
                  force_release, to_char(received_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
                  to_char(processed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
             FROM {t}sequenced_message WHERE sequence_instance_id = $1 ORDER BY received_at, id"#,
    );
    let rows = sqlx::query(&messages).bind(id).fetch_all(pool).await?;
    let messages = rows
        .iter()
        .map(|r| StoredMessage {
            id: r.get(0),
            message_type: r.get(1),
            idempotence_id: r.get(2),
            status: r.get(3),
            position: r.get(4),
            error: r.get(5),
            force_release: r.get(6),
            received_at: r.get(7),
            processed_at: r.get(8),
        })
        .collect();
    Ok(Some((summary(&row), messages)))
}

/// Closes an instance by hand (its WAITING messages stay, and are reported when it expires). Returns false
/// when it does not exist or is already closed. Waits for a consumer handling the instance to finish.
pub async fn close(pool: &PgPool, tables: &Tables, id: i64) -> Result<bool, Error> {
    let sql = tables.render(
        "UPDATE {t}sequence_instance SET status = 'CLOSED', closed_at = now() WHERE id = $1 AND status = 'OPEN'",
    );
    Ok(sqlx::query(&sql).bind(id).execute(pool).await?.rows_affected() == 1)
}

/// Releases the WAITING messages of an instance (or only message `message`) whatever their condition, and
/// re-queues its FAILED ones: the running consumer handles them at its next housekeeping pass. A FAILED
/// message a resend has claimed meanwhile is left alone. Returns how many messages were released.
pub async fn release(pool: &PgPool, tables: &Tables, id: i64, message: Option<i64>) -> Result<u64, Error> {
    let mut tx = pool.begin().await?;
    let requeue = tables.render(
        "WITH failed AS (
             SELECT id, message_type, idempotence_id FROM {t}sequenced_message
              WHERE sequence_instance_id = $1 AND status = 'FAILED' AND ($2::bigint IS NULL OR id = $2)
         ), claimed AS (
             INSERT INTO {t}sequential_inbox_idempotence (message_type, idempotence_id, sequence_instance_id, created_at)
             SELECT message_type, idempotence_id, $1, now() FROM failed
             ON CONFLICT (message_type, idempotence_id) DO NOTHING
             RETURNING message_type, idempotence_id
         )
         UPDATE {t}sequenced_message m SET status = 'WAITING', force_release = true, error = NULL
           FROM failed f JOIN claimed c USING (message_type, idempotence_id)
          WHERE m.id = f.id",
    );
    let requeued = sqlx::query(&requeue).bind(id).bind(message).execute(&mut *tx).await?.rows_affected();
    let force = tables.render(
        "UPDATE {t}sequenced_message SET force_release = true
          WHERE sequence_instance_id = $1 AND status = 'WAITING' AND NOT force_release AND ($2::bigint IS NULL OR id = $2)",
    );
    let forced = sqlx::query(&force).bind(id).bind(message).execute(&mut *tx).await?.rows_affected();
    tx.commit().await?;
    Ok(requeued + forced)
}
