//! The guards' statements on SQLite: the user table read from `pragma_table_info`; SQLite has no row locks, so
//! a row is locked by taking the database's write lock (an update that changes nothing).

use std::future::Future;

use crate::guard::GuardStore;
use crate::guard::schema::{Bind, Column, Pair, execute, fetch_pair, to_columns};

impl GuardStore for sqlx::Sqlite {
    async fn columns(pool: &sqlx::SqlitePool, table: &str) -> Result<Option<Vec<Column>>, sqlx::Error> {
        // An INTEGER PRIMARY KEY is the rowid: filled by the database.
        let rows = sqlx::query(
            r#"SELECT name, type, "notnull" <> 0,
                      dflt_value IS NOT NULL OR (pk = 1 AND upper(type) = 'INTEGER')
                 FROM pragma_table_info($1) ORDER BY cid"#,
        )
        .bind(table)
        .fetch_all(pool)
        .await?;
        Ok(to_columns(&rows))
    }

    async fn unique(pool: &sqlx::SqlitePool, table: &str, column: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            r#"SELECT ((SELECT count(*) FROM pragma_table_info($1) WHERE pk > 0) = 1
                       AND EXISTS (SELECT 1 FROM pragma_table_info($1) WHERE pk = 1 AND name = $2))
                   OR EXISTS (SELECT 1 FROM pragma_index_list($1) l
                               WHERE l."unique" = 1 AND l.partial = 0
                                 AND (SELECT count(*) FROM pragma_index_info(l.name)) = 1
                                 AND (SELECT name FROM pragma_index_info(l.name)) = $2)"#,
        )
        .bind(table)
        .bind(column)
        .fetch_one(pool)
        .await
    }

    async fn converts(_pool: &sqlx::SqlitePool, _sql_type: &str, _text: &str) -> Result<(), sqlx::Error> {
        // SQLite stores any value in any column.
        Ok(())
    }

    fn param_as(_sql_type: &str, n: usize) -> String {
        // The column's affinity converts the text (an INTEGER column compares and stores '42' as 42).
        format!("${n}")
    }

    fn is_integer(sql_type: &str) -> bool {
        // SQLite's affinity rule: a declared type containing "INT".
        sql_type.to_ascii_uppercase().contains("INT")
    }

    fn lock_row(table: &str, id: &str, id_param: &str, touch: &str, columns: &str) -> String {
        format!("UPDATE {table} SET {touch} = {touch} WHERE {id} = {id_param} RETURNING {columns}")
    }

    fn fetch_pair(
        conn: &mut sqlx::SqliteConnection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<Option<Pair>, sqlx::Error>> + Send {
        fetch_pair::<sqlx::Sqlite>(conn, sql, binds)
    }

    fn execute(
        conn: &mut sqlx::SqliteConnection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        execute::<sqlx::Sqlite>(conn, sql, binds)
    }
}
