//! The configured handler: a consumer's declared parameters, guards, statements and outbox emits, applied in
//! idem's transaction. One event at a time ([`Handler`]), or a batch at a time with each parameter bound as an
//! array ([`BatchHandler`], the bulk form).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use idem::console::trial::{Boxed, StatementRows};
use idem::console::{Trial, TrialReport};
use idem::guard::{Field, GuardStore, StateMachine, VersionGuard};
use idem::outbox::OutgoingMessage;
use idem::{BatchHandler, Event, Handler, HandlerError};
use sqlx::{MySqlConnection, PgConnection, SqliteConnection};

use super::plan::{ConsumerPlan, EmitPlan, PlannedSql};
use super::sql::Rendered;
use super::value::{self, Param, ParamType, Value};

/// What the service needs of a database beyond idem's stores: running a rendered statement with its values.
pub trait ServiceDb: GuardStore + idem::console::ConsoleStore {
    /// Runs `sql` once, each placeholder bound to its parameter's value; returns the rows it changed.
    fn run_each(
        conn: &mut Self::Connection,
        sql: &Rendered,
        params: &[Param],
        values: &[Value],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Runs `sql` once for many events, each placeholder bound to an array of its parameter's values (`rows`,
    /// one per event).
    fn run_bulk(
        conn: &mut Self::Connection,
        sql: &Rendered,
        params: &[Param],
        rows: &[Vec<Value>],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Prepares `sql` (nothing runs): the database's own check of it.
    fn prepare(pool: &sqlx::Pool<Self>, sql: &str) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Enqueues `messages` in the outbox, in the open transaction.
    fn emit(
        conn: &mut Self::Connection,
        outbox: &idem::outbox::Outbox,
        messages: &[OutgoingMessage],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Runs the consumer through the Sequential Inbox (PostgreSQL).
    fn inbox<S: idem::Source + 'static>(
        engine: idem::Engine<Self>,
        config: idem::inbox::InboxConfig,
        source: S,
        handler: Configured<Self>,
        shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> Running;
}

/// The methods whose text is the same for every database, only their connection and pool types differing.
macro_rules! same_for_every_store {
    ($conn:ty, $pool:ty) => {
        async fn emit(
            conn: &mut $conn,
            outbox: &idem::outbox::Outbox,
            messages: &[OutgoingMessage],
        ) -> Result<(), sqlx::Error> {
            outbox.enqueue_all(conn, messages).await.map(drop)
        }

        async fn prepare(pool: &$pool, sql: &str) -> Result<(), sqlx::Error> {
            // On a connection of its own, closed after: a statement prepared without its parameters' types must
            // not stay in the statement cache of a connection the consumers use.
            let mut conn = pool.acquire().await?.detach();
            let prepared = sqlx::Executor::prepare(&mut conn, sql).await.map(drop);
            let _ = sqlx::Connection::close(conn).await;
            prepared
        }
    };
}

/// The query of `sql` with each placeholder bound to its parameter's value, a null typed as its parameter
/// (PostgreSQL and MySQL check a null's type; SQLite binds an untyped null).
macro_rules! typed_binds {
    ($sql:expr, $params:expr, $values:expr) => {{
        let mut query = sqlx::query(&$sql.text);
        for &i in &$sql.binds {
            query = match (&$values[i], $params[i].ty) {
                (Value::Integer(v), _) => query.bind(*v),
                (Value::Boolean(v), _) => query.bind(*v),
                (Value::Text(v), _) => query.bind(v.as_str()),
                (Value::Null, ParamType::Integer) => query.bind(None::<i64>),
                (Value::Null, ParamType::Boolean) => query.bind(None::<bool>),
                (Value::Null, _) => query.bind(None::<&str>),
            };
        }
        query
    }};
}

/// A consumer's run, started.
pub type Running = Pin<Box<dyn Future<Output = Result<idem::StatsSnapshot, idem::Error>> + Send>>;

impl ServiceDb for sqlx::Postgres {
    same_for_every_store!(PgConnection, sqlx::PgPool);

    fn inbox<S: idem::Source + 'static>(
        engine: idem::Engine<Self>,
        config: idem::inbox::InboxConfig,
        source: S,
        handler: Configured<Self>,
        shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> Running {
        Box::pin(async move { idem::inbox::SequentialInbox::new(engine, config)?.run(source, handler, shutdown).await })
    }

    async fn run_each(
        conn: &mut PgConnection,
        sql: &Rendered,
        params: &[Param],
        values: &[Value],
    ) -> Result<u64, sqlx::Error> {
        typed_binds!(sql, params, values).execute(conn).await.map(|done| done.rows_affected())
    }

    async fn run_bulk(
        conn: &mut PgConnection,
        sql: &Rendered,
        params: &[Param],
        rows: &[Vec<Value>],
    ) -> Result<(), sqlx::Error> {
        let mut query = sqlx::query(&sql.text);
        for &i in &sql.binds {
            let column = rows.iter().map(|row| &row[i]);
            query = match params[i].ty {
                ParamType::Integer => query
                    .bind(column.map(|v| if let Value::Integer(n) = v { Some(*n) } else { None }).collect::<Vec<_>>()),
                ParamType::Boolean => query
                    .bind(column.map(|v| if let Value::Boolean(b) = v { Some(*b) } else { None }).collect::<Vec<_>>()),
                _ => query.bind(
                    column.map(|v| if let Value::Text(t) = v { Some(t.clone()) } else { None }).collect::<Vec<_>>(),
                ),
            };
        }
        query.execute(conn).await.map(drop)
    }
}

impl ServiceDb for sqlx::Sqlite {
    same_for_every_store!(SqliteConnection, sqlx::SqlitePool);

    fn inbox<S: idem::Source + 'static>(
        _: idem::Engine<Self>,
        _: idem::inbox::InboxConfig,
        _: S,
        _: Configured<Self>,
        _: Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> Running {
        Box::pin(async { Err(idem::Error::Config("the Sequential Inbox needs PostgreSQL".into())) })
    }

    async fn run_each(
        conn: &mut SqliteConnection,
        sql: &Rendered,
        _params: &[Param],
        values: &[Value],
    ) -> Result<u64, sqlx::Error> {
        let mut query = sqlx::query(&sql.text);
        for &i in &sql.binds {
            query = match &values[i] {
                Value::Integer(v) => query.bind(*v),
                Value::Boolean(v) => query.bind(*v),
                Value::Text(v) => query.bind(v.clone()),
                Value::Null => query.bind(None::<String>),
            };
        }
        query.execute(conn).await.map(|done| done.rows_affected())
    }

    async fn run_bulk(
        _: &mut SqliteConnection,
        _: &Rendered,
        _: &[Param],
        _: &[Vec<Value>],
    ) -> Result<(), sqlx::Error> {
        // Refused when the file is checked; kept an error rather than a panic.
        Err(sqlx::Error::Protocol("the bulk form needs PostgreSQL".into()))
    }
}

impl ServiceDb for sqlx::MySql {
    same_for_every_store!(MySqlConnection, sqlx::MySqlPool);

    fn inbox<S: idem::Source + 'static>(
        _: idem::Engine<Self>,
        _: idem::inbox::InboxConfig,
        _: S,
        _: Configured<Self>,
        _: Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> Running {
        Box::pin(async { Err(idem::Error::Config("the Sequential Inbox needs PostgreSQL".into())) })
    }

    /// Each `?` bound in order (a parameter used twice is bound twice), a null typed as its parameter.
    async fn run_each(
        conn: &mut MySqlConnection,
        sql: &Rendered,
        params: &[Param],
        values: &[Value],
    ) -> Result<u64, sqlx::Error> {
        typed_binds!(sql, params, values).execute(conn).await.map(|done| done.rows_affected())
    }

    async fn run_bulk(_: &mut MySqlConnection, _: &Rendered, _: &[Param], _: &[Vec<Value>]) -> Result<(), sqlx::Error> {
        // Refused when the file is checked; kept an error rather than a panic.
        Err(sqlx::Error::Protocol("the bulk form needs PostgreSQL".into()))
    }
}

/// A consumer's effects, as a handler.
pub struct Configured<DB: ServiceDb> {
    params: Arc<[Param]>,
    /// Whether a parameter reads the payload as JSON (else it is not parsed).
    reads_json: bool,
    each: Vec<PlannedSql>,
    bulk: Vec<PlannedSql>,
    emits: Vec<EmitPlan>,
    outbox: idem::outbox::Outbox,
    version: Option<VersionGuard<DB>>,
    machine: Option<StateMachine<DB>>,
}

impl<DB: ServiceDb> Configured<DB> {
    /// Builds the handler of `plan`, checking its guards against the database.
    pub async fn new(pool: &sqlx::Pool<DB>, plan: &ConsumerPlan) -> anyhow::Result<Self> {
        let field = |spec: &str, key: &str| -> anyhow::Result<Field> {
            spec.parse::<Field>().map_err(|e| anyhow::anyhow!("version_guard.{key}: {e}"))
        };
        let version = match &plan.version_guard {
            Some(v) => Some(
                VersionGuard::new(
                    pool,
                    &v.table,
                    &v.id_column,
                    &v.version_column,
                    field(&v.entity, "entity")?,
                    field(&v.version, "version")?,
                )
                .await?,
            ),
            None => None,
        };
        let machine = match &plan.state_machine {
            Some(spec) => Some(StateMachine::new(pool, spec.clone()).await?),
            None => None,
        };
        let reads_json = plan.params.iter().any(|p| match p.from {
            value::From::Json(_) => true,
            value::From::Payload => p.ty == ParamType::Json,
            _ => false,
        });
        Ok(Configured {
            params: plan.params.clone().into(),
            reads_json,
            each: plan.each.clone(),
            bulk: plan.bulk.clone(),
            emits: plan.emits.clone(),
            outbox: idem::outbox::Outbox::new(plan.config.tables.clone()),
            version,
            machine,
        })
    }

    /// Whether the consumer runs its statements per batch.
    pub fn is_bulk(&self) -> bool {
        !self.bulk.is_empty()
    }

    /// The event's parameter values, or the permanent error naming the one that does not convert.
    fn values(&self, event: &Event) -> Result<Vec<Value>, HandlerError> {
        let payload: Option<serde_json::Value> =
            if self.reads_json { serde_json::from_slice(event.payload()).ok() } else { None };
        self.params.iter().map(|p| p.value(event, payload.as_ref())).collect()
    }

    /// Runs the guards: `false` when one of them skips the event (stale or rejected; it marked the event).
    async fn guards_pass(&self, event: &Event, tx: &mut DB::Connection) -> Result<bool, HandlerError> {
        if let Some(guard) = &self.version
            && guard.check(event, tx).await?.skip()
        {
            return Ok(false);
        }
        if let Some(machine) = &self.machine
            && machine.check(event, tx).await?.skip()
        {
            return Ok(false);
        }
        Ok(true)
    }

    fn messages(&self, values: &[Value]) -> Vec<OutgoingMessage> {
        self.emits
            .iter()
            .filter(|emit| emit.wanted(&self.params, values))
            .map(|emit| {
                let payload = emit.payload.render(&self.params, values).to_string();
                let mut message = OutgoingMessage::new(emit.destination.render(values), payload);
                if let Some(key) = &emit.key {
                    message = message.with_key(key.render(values));
                }
                for (name, value) in &emit.headers {
                    message = message.with_header(name.clone(), value.render(values));
                }
                message
            })
            .collect()
    }
}

/// The statement's error, its key in the file in front, its retry classification kept.
fn at(sql: &PlannedSql) -> impl Fn(sqlx::Error) -> HandlerError + '_ {
    move |error| match HandlerError::from(error) {
        HandlerError::Retryable(r) => HandlerError::Retryable(format!("{} (line {}): {r}", sql.key, sql.line)),
        HandlerError::Permanent(r) => HandlerError::Permanent(format!("{} (line {}): {r}", sql.key, sql.line)),
        other => other,
    }
}

impl<DB: ServiceDb> Configured<DB> {
    /// Applies the effects to one event; each statement and the rows it changed go to `rows` when given (the
    /// console's dry run).
    async fn apply(
        &self,
        event: &Event,
        tx: &mut DB::Connection,
        mut rows: Option<&mut Vec<StatementRows>>,
    ) -> Result<(), HandlerError> {
        let values = self.values(event)?;
        if !self.guards_pass(event, tx).await? {
            return Ok(());
        }
        for sql in &self.each {
            let changed = DB::run_each(tx, &sql.rendered, &self.params, &values).await.map_err(at(sql))?;
            if let Some(rows) = rows.as_deref_mut() {
                rows.push(StatementRows { statement: format!("{} (line {})", sql.key, sql.line), rows: changed });
            }
            if let Some(expected) = sql.expect_rows
                && changed != expected
            {
                return Err(HandlerError::permanent(format!(
                    "{} (line {}) changed {changed} row(s), expect_rows is {expected}",
                    sql.key, sql.line
                )));
            }
        }
        for sql in &self.bulk {
            DB::run_bulk(tx, &sql.rendered, &self.params, std::slice::from_ref(&values)).await.map_err(at(sql))?;
        }
        let messages = self.messages(&values);
        if !messages.is_empty() {
            DB::emit(tx, &self.outbox, &messages).await?;
        }
        Ok(())
    }
}

impl<DB: ServiceDb> Handler<DB> for Configured<DB> {
    async fn handle(&self, event: &Event, tx: &mut DB::Connection) -> Result<(), HandlerError> {
        self.apply(event, tx, None).await
    }
}

/// A consumer's effects as the console's dry run of an edited dead letter: the statements run in a transaction
/// that is rolled back, each with the rows it changed.
pub struct ConfiguredTrial<DB: ServiceDb> {
    /// The pool the consumer runs on.
    pub pool: sqlx::Pool<DB>,
    /// The consumer group.
    pub group: String,
    /// Its effects.
    pub handler: Configured<DB>,
}

impl<DB: ServiceDb> Trial for ConfiguredTrial<DB> {
    fn group(&self) -> String {
        self.group.clone()
    }

    fn try_event(&self, event: Event) -> Boxed<'_, TrialReport> {
        Box::pin(async move {
            let mut tx = match self.pool.begin().await {
                Ok(tx) => tx,
                Err(e) => return TrialReport { error: Some(format!("the database: {e}")), ..TrialReport::default() },
            };
            let mut statements = Vec::new();
            let outcome = self.handler.apply(&event, &mut tx, Some(&mut statements)).await;
            drop(tx.rollback().await);
            TrialReport { ok: outcome.is_ok(), error: outcome.err().map(|e| e.to_string()), statements }
        })
    }
}

impl<DB: ServiceDb> BatchHandler<DB> for Configured<DB> {
    async fn handle_batch(&self, events: &[&Event], tx: &mut DB::Connection) -> Result<(), HandlerError> {
        let mut rows = Vec::with_capacity(events.len());
        let mut messages = Vec::new();
        for event in events {
            let values = self.values(event)?;
            if (self.version.is_some() || self.machine.is_some()) && !self.guards_pass(event, tx).await? {
                continue;
            }
            messages.extend(self.messages(&values));
            rows.push(values);
        }
        if rows.is_empty() {
            return Ok(());
        }
        for sql in &self.bulk {
            DB::run_bulk(tx, &sql.rendered, &self.params, &rows).await.map_err(at(sql))?;
        }
        if !messages.is_empty() {
            DB::emit(tx, &self.outbox, &messages).await?;
        }
        Ok(())
    }
}
