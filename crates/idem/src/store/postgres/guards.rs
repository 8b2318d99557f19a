//! The guards' statements on PostgreSQL: the user table read from `pg_attribute`, a state converted by a cast
//! to the column's type (an enum label checked by the server), rows locked `FOR UPDATE`.

use std::future::Future;

use crate::guard::GuardStore;
use crate::guard::schema::{Bind, Column, Pair, execute, fetch_pair, to_columns};

impl GuardStore for sqlx::Postgres {
    async fn columns(pool: &sqlx::PgPool, table: &str) -> Result<Option<Vec<Column>>, sqlx::Error> {
        let rows = sqlx::query(
            // The type without its length (`character varying`, not `character varying(20)`): a cast to a length
            // would cut a longer id short instead of failing.
            "SELECT a.attname::text, format_type(a.atttypid, NULL), a.attnotnull,
                    a.atthasdef OR a.attidentity <> '' OR a.attgenerated <> ''
               FROM pg_attribute a
              WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
              ORDER BY a.attnum",
        )
        .bind(table)
        .fetch_all(pool)
        .await?;
        Ok(to_columns(&rows))
    }

    async fn unique(pool: &sqlx::PgPool, table: &str, column: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_index i
                              JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                             WHERE i.indrelid = to_regclass($1) AND i.indisunique AND i.indimmediate
                               AND i.indisvalid AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $2)",
        )
        .bind(table)
        .bind(column)
        .fetch_one(pool)
        .await
    }

    async fn converts(pool: &sqlx::PgPool, sql_type: &str, text: &str) -> Result<(), sqlx::Error> {
        sqlx::query(&format!("SELECT CAST(CAST($1 AS {sql_type}) AS text)")).bind(text).execute(pool).await?;
        Ok(())
    }

    fn param_as(sql_type: &str, n: usize) -> String {
        format!("CAST(${n} AS {sql_type})")
    }

    fn is_integer(sql_type: &str) -> bool {
        matches!(sql_type, "smallint" | "integer" | "bigint")
    }

    fn lock_row(table: &str, id: &str, id_param: &str, _touch: &str, columns: &str) -> String {
        format!("SELECT {columns} FROM {table} WHERE {id} = {id_param} FOR UPDATE")
    }

    fn fetch_pair(
        conn: &mut sqlx::PgConnection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<Option<Pair>, sqlx::Error>> + Send {
        fetch_pair::<sqlx::Postgres>(conn, sql, binds)
    }

    fn execute(
        conn: &mut sqlx::PgConnection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        execute::<sqlx::Postgres>(conn, sql, binds)
    }
}
