//! Reading dead letters a page at a time: the filters in the `WHERE` clause, keyset pagination on the id, and
//! counts and failure-group figures computed by the database, so that a page costs the same with a million dead
//! letters as with ten. Each row keeps its failure group's fingerprint (the one without a message type, see
//! [`crate::dead_letter::groups`]) in an indexed column, written with the row.

use std::future::Future;

use super::parking::{Style, numbered};
use super::{DeadLetter, Tables};
use crate::error::Error;

/// Which dead letters to read: every field narrows, `None` does not.
#[derive(Debug, Clone, Copy)]
pub struct LetterQuery<'a> {
    /// Only this consumer group.
    pub group: Option<&'a str>,
    /// Only the consumer groups that start with this (`outbox:`, a relay's).
    pub group_prefix: Option<&'a str>,
    /// Only the letter with this id.
    pub id: Option<i64>,
    /// Only those of this failure group (the stored fingerprint, without a message type).
    pub fingerprint: Option<&'a str>,
    /// Only those whose reason contains this text (case-sensitive).
    pub matching: Option<&'a str>,
    /// Only those that last failed before this time, ms since the epoch.
    pub failed_before_ms: Option<i64>,
    /// Only those with a greater id: the previous page's last id.
    pub after_id: Option<i64>,
}

impl LetterQuery<'_> {
    /// Every dead letter.
    pub const ALL: LetterQuery<'static> = LetterQuery {
        group: None,
        group_prefix: None,
        id: None,
        fingerprint: None,
        matching: None,
        failed_before_ms: None,
        after_id: None,
    };
}

/// One failure group's figures, as the database counts them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupFigures {
    /// The consumer group.
    pub consumer_group: String,
    /// The stored fingerprint.
    pub fingerprint: String,
    /// How many dead letters.
    pub count: i64,
    /// When the first of them failed first, ms since the epoch.
    pub first_failed_at_ms: i64,
    /// When the last of them failed last.
    pub last_failed_at_ms: i64,
    /// The newest letter's id (its reason is the group's sample).
    pub newest_id: i64,
}

/// Reading dead letters by page (every store: the same statements in its style).
pub trait LetterPages: sqlx::Database + Sized {
    /// At most `limit` dead letters that `query` takes, by id.
    fn letter_page(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        query: &LetterQuery<'_>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<DeadLetter>, Error>> + Send;
    /// How many dead letters `query` takes (its `after_id` ignored), counting no further than `at_most`.
    fn count_letters(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        query: &LetterQuery<'_>,
        at_most: Option<i64>,
    ) -> impl Future<Output = Result<i64, Error>> + Send;
    /// The failure groups of the letters `query` takes, the largest first, at most `limit`.
    fn group_figures(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        query: &LetterQuery<'_>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<GroupFigures>, Error>> + Send;
    /// The ids of the letters `query` takes, by id, at most `limit`.
    fn letter_ids(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        query: &LetterQuery<'_>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<i64>, Error>> + Send;
    /// The reasons of the letters `ids` (those still there), by id.
    fn reasons(
        pool: &sqlx::Pool<Self>,
        tables: &Tables,
        ids: &[i64],
    ) -> impl Future<Output = Result<Vec<(i64, String)>, Error>> + Send;
    /// Writes the fingerprint of rows written without one (by an idem older than the column), a batch at a time;
    /// returns how many.
    fn fill_fingerprints(pool: &sqlx::Pool<Self>, tables: &Tables) -> impl Future<Output = Result<u64, Error>> + Send;
}

/// A value bound to a placeholder.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Bind<'a> {
    Text(&'a str),
    Int(i64),
    /// A 32-bit integer (PostgreSQL's `substr` takes no `bigint`).
    Int32(i32),
}

/// The statements of one store.
pub(crate) struct Statements {
    style: Style,
    columns: String,
    table: String,
}

impl Statements {
    pub(crate) fn new(tables: &Tables, style: Style) -> Statements {
        let columns = match style {
            Style::Postgres => {
                r#"id, consumer_group, event_id, topic, partition, "offset", key, payload, headers, error,
                attempts, (EXTRACT(EPOCH FROM first_failed_at) * 1000)::bigint,
                (EXTRACT(EPOCH FROM last_failed_at) * 1000)::bigint, status"#
                    .to_owned()
            }
            Style::Sqlite => r#"id, consumer_group, event_id, topic, partition, "offset", key, payload, headers, error,
                attempts, first_failed_at, last_failed_at, status"#
                .to_owned(),
            Style::MySql => {
                "id, CAST(consumer_group AS CHAR), CAST(event_id AS CHAR), CAST(topic AS CHAR), `partition`,
                `offset`, `key`, payload, headers, error, attempts,
                TIMESTAMPDIFF(MICROSECOND, '1970-01-01', first_failed_at) DIV 1000,
                TIMESTAMPDIFF(MICROSECOND, '1970-01-01', last_failed_at) DIV 1000, status"
                    .to_owned()
            }
        };
        Statements { style, columns, table: tables.table("dead_letters") }
    }

    /// The `WHERE` clause of `query` (empty when it takes everything) and its values, in order.
    fn filters<'q>(&self, query: &LetterQuery<'q>, with_after: bool) -> (String, Vec<Bind<'q>>) {
        let mut conditions = Vec::new();
        let mut binds = Vec::new();
        if let Some(group) = query.group {
            conditions.push("consumer_group = ?");
            binds.push(Bind::Text(group));
        }
        if let Some(prefix) = query.group_prefix {
            conditions.push("substr(consumer_group, 1, ?) = ?");
            binds.push(Bind::Int32(i32::try_from(prefix.chars().count()).unwrap_or(i32::MAX)));
            binds.push(Bind::Text(prefix));
        }
        if let Some(id) = query.id {
            conditions.push("id = ?");
            binds.push(Bind::Int(id));
        }
        if let Some(fingerprint) = query.fingerprint {
            conditions.push("fingerprint = ?");
            binds.push(Bind::Text(fingerprint));
        }
        if let Some(text) = query.matching {
            conditions.push(match self.style {
                Style::Postgres => "strpos(error, ?) > 0",
                Style::Sqlite => "instr(error, ?) > 0",
                // The table's collation ignores case; idem's filter does not.
                Style::MySql => "INSTR(error COLLATE utf8mb4_bin, ?) > 0",
            });
            binds.push(Bind::Text(text));
        }
        if let Some(before) = query.failed_before_ms {
            conditions.push(match self.style {
                Style::Postgres => "last_failed_at < to_timestamp(? / 1000.0)",
                Style::Sqlite => "last_failed_at < ?",
                Style::MySql => "last_failed_at < TIMESTAMPADD(MICROSECOND, ? * 1000, '1970-01-01')",
            });
            binds.push(Bind::Int(before));
        }
        if let (true, Some(after)) = (with_after, query.after_id) {
            conditions.push("id > ?");
            binds.push(Bind::Int(after));
        }
        let clause = if conditions.is_empty() { String::new() } else { format!(" WHERE {}", conditions.join(" AND ")) };
        (clause, binds)
    }

    fn finish(&self, sql: String) -> String {
        match self.style {
            Style::Postgres => numbered(&sql),
            Style::Sqlite | Style::MySql => sql,
        }
    }

    pub(crate) fn page<'q>(&self, query: &LetterQuery<'q>, limit: i64) -> (String, Vec<Bind<'q>>) {
        let (clause, mut binds) = self.filters(query, true);
        binds.push(Bind::Int(limit));
        // A text searched for can match few rows: walking the primary key in order would read the whole table
        // one row at a time before it finds a page. PostgreSQL scans it in parallel and sorts what matched instead.
        let order = if self.style == Style::Postgres && query.matching.is_some() { "id + 0" } else { "id" };
        (self.finish(format!("SELECT {} FROM {}{clause} ORDER BY {order} LIMIT ?", self.columns, self.table)), binds)
    }

    pub(crate) fn ids<'q>(&self, query: &LetterQuery<'q>, limit: i64) -> (String, Vec<Bind<'q>>) {
        let (clause, mut binds) = self.filters(query, true);
        binds.push(Bind::Int(limit));
        (self.finish(format!("SELECT id FROM {}{clause} ORDER BY id LIMIT ?", self.table)), binds)
    }

    pub(crate) fn count<'q>(&self, query: &LetterQuery<'q>, at_most: Option<i64>) -> (String, Vec<Bind<'q>>) {
        let (clause, mut binds) = self.filters(query, false);
        let sql = match at_most {
            None => format!("SELECT COUNT(*) FROM {}{clause}", self.table),
            Some(n) => {
                binds.push(Bind::Int(n));
                format!("SELECT COUNT(*) FROM (SELECT 1 AS one FROM {}{clause} LIMIT ?) taken", self.table)
            }
        };
        (self.finish(sql), binds)
    }

    pub(crate) fn groups<'q>(&self, query: &LetterQuery<'q>, limit: i64) -> (String, Vec<Bind<'q>>) {
        let (clause, mut binds) = self.filters(query, false);
        binds.push(Bind::Int(limit));
        let (group, first, last) = match self.style {
            Style::Postgres => (
                "consumer_group",
                "(EXTRACT(EPOCH FROM MIN(first_failed_at)) * 1000)::bigint",
                "(EXTRACT(EPOCH FROM MAX(last_failed_at)) * 1000)::bigint",
            ),
            Style::Sqlite => ("consumer_group", "MIN(first_failed_at)", "MAX(last_failed_at)"),
            Style::MySql => (
                "CAST(consumer_group AS CHAR)",
                "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', MIN(first_failed_at)) DIV 1000",
                "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', MAX(last_failed_at)) DIV 1000",
            ),
        };
        let fingerprint = if self.style == Style::MySql { "CAST(fingerprint AS CHAR)" } else { "fingerprint" };
        (
            self.finish(format!(
                "SELECT {group}, {fingerprint}, COUNT(*), {first}, {last}, MAX(id) FROM {}{clause}
                  GROUP BY consumer_group, fingerprint ORDER BY COUNT(*) DESC, MAX(last_failed_at) DESC LIMIT ?",
                self.table
            )),
            binds,
        )
    }

    pub(crate) fn reasons(&self, n: usize) -> String {
        let list = vec!["?"; n.max(1)].join(", ");
        self.finish(format!("SELECT id, error FROM {} WHERE id IN ({list})", self.table))
    }

    pub(crate) fn unfingerprinted(&self) -> String {
        let group = if self.style == Style::MySql { "CAST(consumer_group AS CHAR)" } else { "consumer_group" };
        format!("SELECT id, {group}, error FROM {} WHERE fingerprint IS NULL LIMIT 500", self.table)
    }

    pub(crate) fn set_fingerprint(&self) -> String {
        self.finish(format!("UPDATE {} SET fingerprint = ? WHERE id = ?", self.table))
    }
}

/// Binds each of `binds` to query `q`, in order.
macro_rules! bind_all {
    ($q:expr, $binds:expr) => {{
        let mut q = $q;
        for bind in $binds {
            q = match bind {
                $crate::store::letter_pages::Bind::Text(text) => q.bind(text),
                $crate::store::letter_pages::Bind::Int(n) => q.bind(n),
                $crate::store::letter_pages::Bind::Int32(n) => q.bind(n),
            };
        }
        q
    }};
}

pub(crate) use bind_all;

/// Implements [`LetterPages`] for a store over [`Statements`] in its style.
macro_rules! impl_letter_pages {
    ($db:ty, $style:expr) => {
        impl $crate::store::letter_pages::LetterPages for $db {
            async fn letter_page(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                query: &$crate::store::letter_pages::LetterQuery<'_>,
                limit: i64,
            ) -> Result<Vec<$crate::store::DeadLetter>, $crate::Error> {
                use $crate::store::letter_pages::Statements;
                let (sql, binds) = Statements::new(tables, $style).page(query, limit);
                let q = sqlx::query_as::<_, $crate::store::DeadLetter>(&sql);
                let q = $crate::store::letter_pages::bind_all!(q, binds);
                Ok(q.fetch_all(pool).await?)
            }

            async fn count_letters(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                query: &$crate::store::letter_pages::LetterQuery<'_>,
                at_most: Option<i64>,
            ) -> Result<i64, $crate::Error> {
                use $crate::store::letter_pages::Statements;
                let (sql, binds) = Statements::new(tables, $style).count(query, at_most);
                let q = sqlx::query_scalar::<_, i64>(&sql);
                let q = $crate::store::letter_pages::bind_all!(q, binds);
                Ok(q.fetch_one(pool).await?)
            }

            async fn letter_ids(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                query: &$crate::store::letter_pages::LetterQuery<'_>,
                limit: i64,
            ) -> Result<Vec<i64>, $crate::Error> {
                use $crate::store::letter_pages::Statements;
                let (sql, binds) = Statements::new(tables, $style).ids(query, limit);
                let q = sqlx::query_scalar::<_, i64>(&sql);
                let q = $crate::store::letter_pages::bind_all!(q, binds);
                Ok(q.fetch_all(pool).await?)
            }

            async fn group_figures(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                query: &$crate::store::letter_pages::LetterQuery<'_>,
                limit: i64,
            ) -> Result<Vec<$crate::store::letter_pages::GroupFigures>, $crate::Error> {
                use $crate::store::letter_pages::{GroupFigures, Statements};
                let (sql, binds) = Statements::new(tables, $style).groups(query, limit);
                let q = sqlx::query_as::<_, (String, Option<String>, i64, i64, i64, i64)>(&sql);
                let q = $crate::store::letter_pages::bind_all!(q, binds);
                let rows = q.fetch_all(pool).await?;
                Ok(rows
                    .into_iter()
                    .map(|(consumer_group, fingerprint, count, first, last, newest_id)| GroupFigures {
                        consumer_group,
                        fingerprint: fingerprint.unwrap_or_default(),
                        count,
                        first_failed_at_ms: first,
                        last_failed_at_ms: last,
                        newest_id,
                    })
                    .collect())
            }

            async fn reasons(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
                ids: &[i64],
            ) -> Result<Vec<(i64, String)>, $crate::Error> {
                if ids.is_empty() {
                    return Ok(Vec::new());
                }
                let sql = $crate::store::letter_pages::Statements::new(tables, $style).reasons(ids.len());
                let mut q = sqlx::query_as::<_, (i64, String)>(&sql);
                for id in ids {
                    q = q.bind(*id);
                }
                Ok(q.fetch_all(pool).await?)
            }

            async fn fill_fingerprints(
                pool: &sqlx::Pool<$db>,
                tables: &$crate::store::Tables,
            ) -> Result<u64, $crate::Error> {
                let statements = $crate::store::letter_pages::Statements::new(tables, $style);
                let (select, update) = (statements.unfingerprinted(), statements.set_fingerprint());
                let mut filled = 0;
                loop {
                    let rows: Vec<(i64, String, String)> = sqlx::query_as(&select).fetch_all(pool).await?;
                    if rows.is_empty() {
                        return Ok(filled);
                    }
                    for (id, group, error) in rows {
                        let fingerprint = $crate::dead_letter::groups::fingerprint(&group, None, &error);
                        sqlx::query(&update).bind(fingerprint).bind(id).execute(pool).await?;
                        filled += 1;
                    }
                }
            }
        }
    };
}

pub(crate) use impl_letter_pages;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_filters_given_reach_the_statement() {
        let tables = Tables::default();
        let pg = Statements::new(&tables, Style::Postgres);
        let (sql, binds) = pg.page(&LetterQuery::ALL, 50);
        assert!(sql.contains("FROM dead_letters ORDER BY id LIMIT $1"), "{sql}");
        assert_eq!(binds.len(), 1);
        let query = LetterQuery {
            group: Some("ledger"),
            fingerprint: Some("0123456789ab"),
            after_id: Some(7),
            ..LetterQuery::ALL
        };
        let (sql, binds) = pg.page(&query, 50);
        assert!(
            sql.contains("WHERE consumer_group = $1 AND fingerprint = $2 AND id > $3 ORDER BY id LIMIT $4"),
            "{sql}"
        );
        assert_eq!(binds.len(), 4);
        let (count, binds) = pg.count(&query, None);
        assert!(!count.contains("id >"), "a count ignores the page: {count}");
        assert_eq!(binds.len(), 2);
        let mysql = Statements::new(&tables, Style::MySql);
        let (sql, _) = mysql.page(&LetterQuery { matching: Some("x"), ..LetterQuery::ALL }, 1);
        assert!(sql.contains("COLLATE utf8mb4_bin, ?) > 0 ORDER BY id LIMIT ?"), "{sql}");
    }
}
