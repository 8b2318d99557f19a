//! The version guard: apply an event only if its version is newer than the entity's row.

use std::marker::PhantomData;
use std::sync::Arc;

use super::schema::{Bind, GuardStore, Table};
use super::{Decision, Field};
use crate::error::{Error, HandlerError};
use crate::message::{Event, Handled};

/// A jump of more than one version: the events between are missing, late, or were never sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    /// The event's idempotency key.
    pub event_id: String,
    /// The entity's id, as text.
    pub entity: String,
    /// The version stored in the row.
    pub current: i64,
    /// The event's version (more than `current + 1`).
    pub version: i64,
}

/// What to do with an event that arrives after a [`Gap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GapDecision {
    /// Apply it; the missing versions will be stale when they come (right when events carry the whole state).
    Apply,
    /// Dead-letter it, to be replayed by an operator once the missing versions are in.
    DeadLetter,
    /// Roll back and retry it with the consumer's backoff (the partition waits; after the configured attempts it
    /// is dead-lettered). To let an entity wait without holding its partition, use the Sequential Inbox
    /// ([`crate::inbox`]) with the version as the sequence.
    Retry,
}

type GapHook = Arc<dyn Fn(&Gap) -> GapDecision + Send + Sync>;

/// "Apply only if this event's version is newer than the row's", inside idem's transaction.
///
/// [`VersionGuard::check`] moves the row's version column to the event's version and returns
/// [`Decision::Apply`], or leaves it and returns [`Decision::Skip`] for an event that is not newer (marked
/// [`Handled::Stale`]: counted as `stale` in `idem_events_handled_total`, logged at INFO with both versions, its marker
/// committed). An entity without a row gets one, with only the id and the version set (so the table's other
/// `NOT NULL` columns need defaults; checked at start-up), which the handler then fills.
///
/// The common case, the next version or a new entity, is one statement (`INSERT … ON CONFLICT DO UPDATE … WHERE`,
/// which also locks the row): two transactions holding versions of one entity run one after the other, and
/// whichever commits first, the newer version wins. A stale event or a gap costs one more statement, under that
/// lock.
pub struct VersionGuard<DB> {
    table: String,
    entity: Field,
    version: Field,
    id_is_integer: bool,
    /// The one-statement common case, where the store has one.
    upsert: Option<String>,
    /// Creates the entity's row (where there is no upsert).
    create: String,
    read: String,
    force: String,
    on_gap: GapHook,
    store: PhantomData<fn() -> DB>,
}

impl<DB> std::fmt::Debug for VersionGuard<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VersionGuard")
            .field("table", &self.table)
            .field("entity", &self.entity)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl<DB: GuardStore> VersionGuard<DB> {
    /// A guard on `table`, whose row per entity is found by `id_column` (the entity id read from the event at
    /// `entity`) and whose `version_column` holds the last applied version (the event's at `version`).
    /// Checked against the database now: the table and both columns must exist, the id column must be unique,
    /// the version column an integer, and the table's other `NOT NULL` columns must have defaults.
    /// Gaps are applied and logged at WARN until [`VersionGuard::on_gap`] says otherwise.
    pub async fn new(
        pool: &sqlx::Pool<DB>,
        table: &str,
        id_column: &str,
        version_column: &str,
        entity: Field,
        version: Field,
    ) -> Result<Self, Error> {
        let what = format!("version guard on `{table}`");
        Table::distinct(&what, &[("id", id_column), ("version", version_column)], &[&entity, &version])?;
        let t = Table::read(pool, &what, table).await?;
        let id = t.column(&what, "id", id_column)?;
        let v = t.column(&what, "version", version_column)?;
        if !DB::is_integer(&v.sql_type) {
            return Err(Error::Config(format!(
                "{what}: the version column `{version_column}` is {}, not an integer type: use bigint",
                v.sql_type
            )));
        }
        t.unique(pool, &what, id_column).await?;
        t.creatable(&what, &[id_column, version_column])?;
        let id_param = DB::param_as(&id.sql_type, 1);
        let (i, v) = (id_column, version_column);
        let columns = format!("{}, {}", DB::as_text("NULL"), DB::as_bigint(v));
        Ok(VersionGuard {
            upsert: DB::next_version_upsert(table, i, v, &id_param),
            create: DB::insert_absent(table, i, &id_param, &[(v, DB::param(2))]),
            read: DB::lock_row(table, i, &id_param, v, &columns),
            force: DB::update_by_id(table, i, &id_param, &[(v, DB::param(2))]),
            id_is_integer: DB::is_integer(&id.sql_type),
            table: table.to_owned(),
            entity,
            version,
            on_gap: Arc::new(|_| GapDecision::Apply),
            store: PhantomData,
        })
    }

    /// Decides what happens to an event after a [`Gap`] (the default applies it, logged at WARN).
    pub fn on_gap(mut self, hook: impl Fn(&Gap) -> GapDecision + Send + Sync + 'static) -> Self {
        self.on_gap = Arc::new(hook);
        self
    }

    /// Moves the entity's row to the event's version when the event is newer ([`Decision::Apply`]), or marks
    /// the event stale ([`Decision::Skip`]). Call it from the handler, on idem's transaction, before the effect.
    /// A missing or unparsable entity id or version is a permanent error (the event is dead-lettered, the
    /// field named).
    pub async fn check(&self, event: &Event, tx: &mut DB::Connection) -> Result<Decision, HandlerError> {
        let entity = self.entity.text(event, "entity id")?;
        if self.id_is_integer && entity.parse::<i64>().is_err() {
            return Err(HandlerError::permanent(format!(
                "entity id ({}) is {entity:?}, not an integer as `{}`'s id column holds",
                self.entity, self.table
            )));
        }
        let version = self.version.integer(event, "version")?;
        let binds = [Bind::Text(&entity), Bind::Int(version)];
        let current = match &self.upsert {
            Some(upsert) => {
                if DB::fetch_pair(&mut *tx, upsert, &binds).await?.is_some() {
                    return Ok(Decision::Apply);
                }
                // Not the next version: the row is locked now; read what it holds.
                DB::fetch_pair(&mut *tx, &self.read, &binds[..1]).await?.and_then(|(_, v)| v)
            }
            None => match self.read_or_create(tx, &binds).await? {
                Some(current) if current.is_some_and(|c| version == c + 1) => {
                    DB::execute(&mut *tx, &self.force, &binds).await?;
                    return Ok(Decision::Apply);
                }
                Some(current) => current,
                None => return Ok(Decision::Apply),
            },
        };
        let Some(current) = current else {
            // A row without a version (written before the guard): set it. No row at all means the upsert wrote
            // nothing (a trigger refused it): nothing to apply to.
            if DB::execute(&mut *tx, &self.force, &binds).await? == 0 {
                return Err(self.unwritable(&entity));
            }
            return Ok(Decision::Apply);
        };
        if version <= current {
            event.mark(Handled::Stale);
            tracing::info!(event_id = %event.id, table = %self.table, entity = %entity, version, current,
                outcome = "stale", "stale event skipped: its version is not newer than the row's");
            return Ok(Decision::Skip);
        }
        let gap = Gap { event_id: event.id.clone(), entity: entity.clone(), current, version };
        let decision = (self.on_gap)(&gap);
        tracing::warn!(event_id = %gap.event_id, table = %self.table, entity = %gap.entity, version, current,
            missing = version - current - 1, decision = ?decision, "version gap: versions between are missing");
        match decision {
            GapDecision::Apply => {
                if DB::execute(&mut *tx, &self.force, &binds).await? == 0 {
                    return Err(self.unwritable(&gap.entity));
                }
                Ok(Decision::Apply)
            }
            GapDecision::DeadLetter => Err(HandlerError::permanent(gap_reason(&self.table, &gap))),
            GapDecision::Retry => Err(HandlerError::retryable(gap_reason(&self.table, &gap))),
        }
    }
}

impl<DB: GuardStore> VersionGuard<DB> {
    /// Without an upsert: the row's version under lock (`Some`), or `None` once the row was created at the event's
    /// version. A row created by a concurrent transaction between the read and the insert is read again.
    async fn read_or_create(
        &self,
        tx: &mut DB::Connection,
        binds: &[Bind<'_>],
    ) -> Result<Option<Option<i64>>, HandlerError> {
        for _ in 0..3 {
            if let Some((_, current)) = DB::fetch_pair(&mut *tx, &self.read, &binds[..1]).await? {
                return Ok(Some(current));
            }
            if DB::execute(&mut *tx, &self.create, binds).await? == 1 {
                return Ok(None);
            }
        }
        Err(HandlerError::retryable(format!(
            "version guard on `{}`: the entity's row kept appearing and disappearing; retrying",
            self.table
        )))
    }
}

impl<DB> VersionGuard<DB> {
    fn unwritable(&self, entity: &str) -> HandlerError {
        HandlerError::permanent(format!(
            "version guard on `{}`: the row of entity {entity} could not be written (a trigger or rule on the table \
             refused the guard's insert or update)",
            self.table
        ))
    }
}

fn gap_reason(table: &str, gap: &Gap) -> String {
    format!(
        "version gap on `{table}` entity {}: the row is at version {}, this event is version {} ({} missing); \
         replay it once the versions between are applied",
        gap.entity,
        gap.current,
        gap.version,
        gap.version - gap.current - 1
    )
}
