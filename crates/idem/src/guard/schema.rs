//! What the guards need of a store: the user table's columns, checked at start-up, and the statements whose
//! SQL differs between databases (binding an entity id, inserting a row unless it exists, updating by id,
//! locking a row). What the guards do with them is written once, in `version` and `state`.

use std::future::Future;

use sqlx::Row;

use crate::error::Error;
use crate::store::Backend;

/// A column of the table a guard watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Its name.
    pub name: String,
    /// Its declared type, as the database prints it (`bigint`, `text`, `INTEGER`, …).
    pub sql_type: String,
    /// Declared `NOT NULL`.
    pub not_null: bool,
    /// Has a default (or is filled by the database: an identity, a generated column, SQLite's rowid).
    pub has_default: bool,
}

/// A row as a guard's statements return it: a text column (a state) and a bigint column (a version).
pub type Pair = (Option<String>, Option<i64>);

/// A value bound to a guard's statement.
#[derive(Debug, Clone, Copy)]
pub enum Bind<'a> {
    /// Text (an entity id or a state, converted to the column's type by the statement).
    Text(&'a str),
    /// A version.
    Int(i64),
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for sqlx::Postgres {}
    impl Sealed for sqlx::Sqlite {}
    impl Sealed for sqlx::MySql {}
}

/// The stores the guards run on: PostgreSQL, SQLite and MySQL/MariaDB (sealed: its statements are idem's).
///
/// A statement's parameters are bound in one order: the entity id first, then the other values in the order the
/// statement builders were given them. PostgreSQL and SQLite number their placeholders (`$1`), MySQL binds `?`
/// in order of appearance, which is why the builders, not the guards, write the SQL.
pub trait GuardStore: Backend + sealed::Sealed {
    /// The columns of `table` (`name` or `schema.name`), or `None` when there is no such table.
    fn columns(
        pool: &sqlx::Pool<Self>,
        table: &str,
    ) -> impl Future<Output = Result<Option<Vec<Column>>, sqlx::Error>> + Send;
    /// Whether `column` alone is unique in `table` (its primary key, or a unique index on it alone), as
    /// `ON CONFLICT (column)` needs.
    fn unique(
        pool: &sqlx::Pool<Self>,
        table: &str,
        column: &str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;
    /// Whether `text` converts to a value of the column type `sql_type` (a state that is not a label of an
    /// enum type does not); checked at start-up for every declared state.
    fn converts(
        pool: &sqlx::Pool<Self>,
        sql_type: &str,
        text: &str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
    /// Parameter `$n`, bound as text, as a value of the column type `sql_type`.
    fn param_as(sql_type: &str, n: usize) -> String;
    /// Parameter `$n` as bound (a version).
    fn param(n: usize) -> String {
        format!("${n}")
    }
    /// `expr` as text, in this store's SQL.
    fn as_text(expr: &str) -> String {
        format!("CAST({expr} AS TEXT)")
    }
    /// `expr` as a 64-bit integer, in this store's SQL.
    fn as_bigint(expr: &str) -> String {
        format!("CAST({expr} AS BIGINT)")
    }
    /// The version guard's common case in one statement: insert the entity's row, or move it to the next version
    /// (`$1` the id as `id_param`, `$2` the version), returning a row only when it did (and locking the row).
    /// `None` where the store has no such statement: the guard then reads the row under lock first.
    fn next_version_upsert(table: &str, id: &str, version: &str, id_param: &str) -> Option<String> {
        Some(format!(
            "INSERT INTO {table} AS cur ({id}, {version}) VALUES ({id_param}, $2)
             ON CONFLICT ({id}) DO UPDATE SET {version} = excluded.{version}
              WHERE cur.{version} = excluded.{version} - 1
             RETURNING {}, {}",
            Self::as_text("NULL"),
            Self::as_bigint(version)
        ))
    }
    /// Inserts a row with `id` (bound first, as `id_param`) and `others` (column and parameter, bound after in
    /// order) unless a row with that id exists; the statement changes one row or none.
    fn insert_absent(table: &str, id: &str, id_param: &str, others: &[(&str, String)]) -> String {
        let columns: Vec<&str> = others.iter().map(|(c, _)| *c).collect();
        let params: Vec<&str> = others.iter().map(|(_, p)| p.as_str()).collect();
        format!(
            "INSERT INTO {table} ({id}, {}) VALUES ({id_param}, {}) ON CONFLICT ({id}) DO NOTHING",
            columns.join(", "),
            params.join(", ")
        )
    }
    /// Sets `sets` (column and parameter, bound after the id in order) on the row whose `id` is `id_param`
    /// (bound first).
    fn update_by_id(table: &str, id: &str, id_param: &str, sets: &[(&str, String)]) -> String {
        let sets: Vec<String> = sets.iter().map(|(c, p)| format!("{c} = {p}")).collect();
        format!("UPDATE {table} SET {} WHERE {id} = {id_param}", sets.join(", "))
    }
    /// Whether the column type holds integers.
    fn is_integer(sql_type: &str) -> bool;
    /// A statement that locks the row of `table` whose `id` equals `id_param` until the transaction ends (taking
    /// the write lock on SQLite, which has no row locks, by rewriting `touch` unchanged) and returns `columns`.
    fn lock_row(table: &str, id: &str, id_param: &str, touch: &str, columns: &str) -> String;
    /// Runs `sql` and returns its first row's two columns (text, bigint), if it returned a row.
    fn fetch_pair(
        conn: &mut Self::Connection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<Option<Pair>, sqlx::Error>> + Send;
    /// Runs `sql` and returns the rows it changed.
    fn execute(
        conn: &mut Self::Connection,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

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

fn to_columns<R: Row>(rows: &[R]) -> Option<Vec<Column>>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    if rows.is_empty() {
        return None;
    }
    let columns = rows
        .iter()
        .filter_map(|row| {
            Some(Column {
                name: row.try_get(0).ok()?,
                sql_type: row.try_get(1).ok()?,
                not_null: row.try_get(2).ok()?,
                has_default: row.try_get(3).ok()?,
            })
        })
        .collect();
    Some(columns)
}

fn query<'q, DB>(sql: &'q str, binds: &[Bind<'q>]) -> sqlx::query::Query<'q, DB, DB::Arguments<'q>>
where
    DB: sqlx::Database,
    for<'a> &'a str: sqlx::Type<DB> + sqlx::Encode<'a, DB>,
    i64: sqlx::Type<DB> + for<'a> sqlx::Encode<'a, DB>,
{
    binds.iter().fold(sqlx::query(sql), |q, bind| match *bind {
        Bind::Text(text) => q.bind(text),
        Bind::Int(n) => q.bind(n),
    })
}

async fn fetch_pair<DB>(conn: &mut DB::Connection, sql: &str, binds: &[Bind<'_>]) -> Result<Option<Pair>, sqlx::Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'a> &'a str: sqlx::Type<DB> + sqlx::Encode<'a, DB>,
    i64: sqlx::Type<DB> + for<'a> sqlx::Encode<'a, DB> + for<'r> sqlx::Decode<'r, DB>,
    String: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let row = query::<DB>(sql, binds).fetch_optional(conn).await?;
    row.map(|row| Ok((row.try_get(0)?, row.try_get(1)?))).transpose()
}

async fn execute<DB>(conn: &mut DB::Connection, sql: &str, binds: &[Bind<'_>]) -> Result<u64, sqlx::Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'a> &'a str: sqlx::Type<DB> + sqlx::Encode<'a, DB>,
    i64: sqlx::Type<DB> + for<'a> sqlx::Encode<'a, DB>,
{
    let done = query::<DB>(sql, binds).execute(conn).await?;
    Ok(rows_affected::<DB>(&done))
}

fn rows_affected<DB: sqlx::Database>(done: &DB::QueryResult) -> u64 {
    // Every store's result says how many rows changed; sqlx has no trait for it.
    let any: &dyn std::any::Any = done;
    if let Some(pg) = any.downcast_ref::<sqlx::postgres::PgQueryResult>() {
        pg.rows_affected()
    } else if let Some(lite) = any.downcast_ref::<sqlx::sqlite::SqliteQueryResult>() {
        lite.rows_affected()
    } else if let Some(my) = any.downcast_ref::<sqlx::mysql::MySqlQueryResult>() {
        my.rows_affected()
    } else {
        0
    }
}

/// A table's columns as a guard checks them at start-up: the table must exist, and so must every column named.
pub(crate) struct Table {
    pub(crate) name: String,
    columns: Vec<Column>,
}

impl Table {
    /// Reads `name`'s columns; a name that is not an identifier, or a table that does not exist, is an error
    /// that names the guard (`what`) and the fix.
    pub(crate) async fn read<DB: GuardStore>(pool: &sqlx::Pool<DB>, what: &str, name: &str) -> Result<Table, Error> {
        let valid = {
            let mut parts = name.split('.');
            let ok = parts.clone().count() <= 2 && parts.all(crate::store::is_identifier);
            ok && (!name.contains('.') || <DB as crate::store::Store>::NAME == "postgres")
        };
        if !valid {
            return Err(Error::Config(format!(
                "{what}: table `{name}` is not a plain lower-case name (`orders`, or `schema.orders` on PostgreSQL)"
            )));
        }
        match DB::columns(pool, name).await? {
            Some(columns) => Ok(Table { name: name.to_owned(), columns }),
            None => Err(Error::Config(format!(
                "{what}: table `{name}` does not exist in the {} database: create it before the consumer starts, \
                 or name the table the guard should watch",
                <DB as crate::store::Store>::NAME
            ))),
        }
    }

    /// The column called `name`, or an error naming the columns there are.
    pub(crate) fn column(&self, what: &str, role: &str, name: &str) -> Result<&Column, Error> {
        self.columns.iter().find(|c| c.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.columns.iter().map(|c| c.name.as_str()).collect();
            Error::Config(format!(
                "{what}: the {role} column `{name}` is not a column of `{}` (its columns: {})",
                self.name,
                known.join(", ")
            ))
        })
    }

    /// Checks that the guard can create a row with only `filled` set: every other `NOT NULL` column needs a
    /// default.
    pub(crate) fn creatable(&self, what: &str, filled: &[&str]) -> Result<(), Error> {
        let missing: Vec<&str> = self
            .columns
            .iter()
            .filter(|c| c.not_null && !c.has_default && !filled.contains(&c.name.as_str()))
            .map(|c| c.name.as_str())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(Error::Config(format!(
            "{what}: the guard creates a `{}` row with only {} set when an entity has none, and {} {} NOT NULL \
             without a default: give {} a DEFAULT or allow NULL (the handler fills the rest after the guard)",
            self.name,
            filled.join(" and "),
            missing.join(", "),
            if missing.len() == 1 { "is" } else { "are" },
            if missing.len() == 1 { "it" } else { "them" },
        )))
    }

    /// Checks that the guard's columns are distinct and its fields well-formed.
    pub(crate) fn distinct(what: &str, columns: &[(&str, &str)], fields: &[&super::Field]) -> Result<(), Error> {
        for (i, (role, name)) in columns.iter().enumerate() {
            if let Some((other, _)) = columns[..i].iter().find(|(_, n)| n == name) {
                return Err(Error::Config(format!(
                    "{what}: `{name}` is both the {other} and the {role} column: each needs a column of its own"
                )));
            }
        }
        for field in fields {
            if let super::Field::Json(pointer) = field
                && !pointer.starts_with('/')
            {
                return Err(Error::Config(format!(
                    "{what}: the JSON pointer `{pointer}` does not start with `/`: write `/{pointer}`"
                )));
            }
        }
        Ok(())
    }

    /// Checks that `column` alone is unique in the table.
    pub(crate) async fn unique<DB: GuardStore>(
        &self,
        pool: &sqlx::Pool<DB>,
        what: &str,
        column: &str,
    ) -> Result<(), Error> {
        if DB::unique(pool, &self.name, column).await? {
            return Ok(());
        }
        Err(Error::Config(format!(
            "{what}: `{}.{column}` is neither the primary key nor alone under a unique index (not deferrable); the \
             guard needs one row per entity: add `PRIMARY KEY ({column})` or `CREATE UNIQUE INDEX ON {} ({column})`",
            self.name, self.name
        )))
    }
}
