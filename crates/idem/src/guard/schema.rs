//! What the guards need of a store: the user table's columns, checked at start-up, and the statements whose
//! SQL differs between databases (binding an entity id, inserting a row unless it exists, updating by id,
//! locking a row). What the guards do with them is written once, in `version` and `state`; each store's
//! statements are in its wing (`store::postgres::guards`, `store::sqlite::guards`, `store::mysql::guards`).

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

pub(crate) fn to_columns<R: Row>(rows: &[R]) -> Option<Vec<Column>>
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

pub(crate) async fn fetch_pair<DB>(
    conn: &mut DB::Connection,
    sql: &str,
    binds: &[Bind<'_>],
) -> Result<Option<Pair>, sqlx::Error>
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

pub(crate) async fn execute<DB>(conn: &mut DB::Connection, sql: &str, binds: &[Bind<'_>]) -> Result<u64, sqlx::Error>
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
