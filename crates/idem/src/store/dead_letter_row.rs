//! Writing a dead letter, the same statement on every store but for how it says "now".

use super::{NewDeadLetter, Tables, encode_headers};

/// Inserts (or, for the same event or position, updates) a dead letter in the open transaction; `now` is the
/// store's expression for the current time in its `last_failed_at` column.
pub(crate) async fn write<DB>(
    conn: &mut DB::Connection,
    tables: &Tables,
    group: &str,
    letter: &NewDeadLetter<'_>,
    now: &str,
) -> Result<(), sqlx::Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> &'q str: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    for<'q> Option<&'q str>: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    for<'q> Option<&'q [u8]>: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    for<'q> &'q [u8]: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    for<'q> String: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    for<'q> i32: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
    for<'q> i64: sqlx::Type<DB> + sqlx::Encode<'q, DB>,
{
    let conflict = if letter.event_id.is_some() {
        "(consumer_group, event_id)"
    } else {
        r#"(consumer_group, topic, partition, "offset") WHERE event_id IS NULL"#
    };
    let sql = tables.render(&format!(
        r#"INSERT INTO {{t}}dead_letters AS d
             (consumer_group, event_id, topic, partition, "offset", key, payload, headers, error, attempts, fingerprint)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
           ON CONFLICT {conflict} DO UPDATE SET
             topic = excluded.topic, partition = excluded.partition, "offset" = excluded."offset",
             key = excluded.key, payload = excluded.payload, headers = excluded.headers,
             error = excluded.error, fingerprint = excluded.fingerprint, attempts = d.attempts + excluded.attempts,
             last_failed_at = {now}, status = 'dead'"#
    ));
    let m = letter.message;
    let error = letter.error.replace('\0', "\\0");
    let fingerprint = crate::dead_letter::groups::fingerprint(group, None, &error);
    sqlx::query(&sql)
        .bind(group)
        .bind(letter.event_id)
        .bind(m.topic.as_str())
        .bind(m.partition)
        .bind(m.offset)
        .bind(m.key.as_deref())
        .bind(m.payload.as_slice())
        .bind(encode_headers(&m.headers))
        .bind(error)
        .bind(letter.attempts)
        .bind(fingerprint)
        .execute(conn)
        .await?;
    Ok(())
}
