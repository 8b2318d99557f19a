//! The guards' statements on MySQL and MariaDB: the user table read from `information_schema`, `?` bound in
//! order of appearance, no `RETURNING` (the version guard reads the row under lock first).

use std::future::Future;

use crate::guard::GuardStore;
use crate::guard::schema::{Bind, Column, Pair, execute, fetch_pair};

impl GuardStore for sqlx::MySql {
    async fn columns(pool: &sqlx::MySqlPool, table: &str) -> Result<Option<Vec<Column>>, sqlx::Error> {
        // COLUMN_TYPE keeps an enum's labels (`enum('new','paid')`), which `converts` reads.
        let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
            "SELECT CAST(column_name AS CHAR), CAST(column_type AS CHAR), CAST(is_nullable = 'NO' AS SIGNED),
                    CAST(column_default IS NOT NULL OR extra LIKE '%auto_increment%' OR extra LIKE '%GENERATED%'
                         AS SIGNED)
               FROM information_schema.columns
              WHERE table_schema = DATABASE() AND table_name = ? ORDER BY ordinal_position",
        )
        .bind(table)
        .fetch_all(pool)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        Ok(Some(
            rows.into_iter()
                .map(|(name, sql_type, not_null, has_default)| Column {
                    name,
                    sql_type,
                    not_null: not_null != 0,
                    has_default: has_default != 0,
                })
                .collect(),
        ))
    }

    async fn unique(pool: &sqlx::MySqlPool, table: &str, column: &str) -> Result<bool, sqlx::Error> {
        let found: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.statistics s
              WHERE s.table_schema = DATABASE() AND s.table_name = ? AND s.non_unique = 0 AND s.column_name = ?
                AND (SELECT COUNT(*) FROM information_schema.statistics o
                      WHERE o.table_schema = s.table_schema AND o.table_name = s.table_name
                        AND o.index_name = s.index_name) = 1",
        )
        .bind(table)
        .bind(column)
        .fetch_one(pool)
        .await?;
        Ok(found > 0)
    }

    /// An enum column holds only its labels; MySQL converts text to the other types as it stores it.
    async fn converts(_pool: &sqlx::MySqlPool, sql_type: &str, text: &str) -> Result<(), sqlx::Error> {
        let Some(labels) = sql_type.strip_prefix("enum(").and_then(|l| l.strip_suffix(')')) else {
            return Ok(());
        };
        let labels: Vec<String> = labels.split(',').map(|l| l.trim_matches('\'').replace("''", "'")).collect();
        if labels.iter().any(|l| l == text) {
            return Ok(());
        }
        Err(sqlx::Error::Protocol(format!("not one of the enum's labels ({})", labels.join(", "))))
    }

    fn param_as(_sql_type: &str, _n: usize) -> String {
        // MySQL converts the bound text to the column's type where it compares or stores it.
        "?".to_owned()
    }

    fn param(_n: usize) -> String {
        "?".to_owned()
    }

    fn as_text(expr: &str) -> String {
        format!("CAST({expr} AS CHAR)")
    }

    fn as_bigint(expr: &str) -> String {
        format!("CAST({expr} AS SIGNED)")
    }

    fn is_integer(sql_type: &str) -> bool {
        let t = sql_type.to_ascii_lowercase();
        ["tinyint", "smallint", "mediumint", "int", "bigint"].iter().any(|i| t.starts_with(i))
    }

    fn lock_row(table: &str, id: &str, id_param: &str, _touch: &str, columns: &str) -> String {
        format!("SELECT {columns} FROM {table} WHERE {id} = {id_param} FOR UPDATE")
    }

    /// No `RETURNING` on `UPDATE`: the guard locks the row and reads it first.
    fn next_version_upsert(_table: &str, _id: &str, _version: &str, _id_param: &str) -> Option<String> {
        None
    }

    /// The values come in as a derived table (the `?` in bind order), inserted unless the id is there.
    fn insert_absent(table: &str, id: &str, id_param: &str, others: &[(&str, String)]) -> String {
        let columns: Vec<&str> = others.iter().map(|(c, _)| *c).collect();
        let values: Vec<String> = others.iter().enumerate().map(|(n, (_, p))| format!("{p} AS v{n}")).collect();
        let picked: Vec<String> = (0..others.len()).map(|n| format!("p.v{n}")).collect();
        format!(
            "INSERT INTO {table} ({id}, {}) SELECT p.id, {} FROM (SELECT {id_param} AS id, {}) p
              WHERE NOT EXISTS (SELECT 1 FROM {table} e WHERE e.{id} = p.id)",
            columns.join(", "),
            picked.join(", "),
            values.join(", ")
        )
    }

    /// The id and the values as a derived table (the `?` in bind order), joined to the row.
    fn update_by_id(table: &str, id: &str, id_param: &str, sets: &[(&str, String)]) -> String {
        let values: Vec<String> = sets.iter().enumerate().map(|(n, (_, p))| format!("{p} AS v{n}")).collect();
        let assign: Vec<String> = sets.iter().enumerate().map(|(n, (c, _))| format!("t.{c} = p.v{n}")).collect();
        format!(
            "UPDATE {table} t JOIN (SELECT {id_param} AS id, {}) p ON t.{id} = p.id SET {}",
            values.join(", "),
            assign.join(", ")
        )
    }

    fn fetch_pair(
        conn: &mut sqlx::MySqlConnection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<Option<Pair>, sqlx::Error>> + Send {
        fetch_pair::<sqlx::MySql>(conn, sql, binds)
    }

    fn execute(
        conn: &mut sqlx::MySqlConnection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        execute::<sqlx::MySql>(conn, sql, binds)
    }
}
