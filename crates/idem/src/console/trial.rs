//! The dry run of an edited dead letter: its handler run on the edited message in a transaction that is always
//! rolled back, so the operator sees what a retry would do (success or the error; where the handler says, each
//! statement's rows) before retrying for real. A console has a trial for each consumer group whose handler it
//! runs beside (`idem run`'s `[console]`, or [`HandlerTrial`] in a Rust binary); a console started alone has none.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::handler::Handler;
use crate::message::Event;
use crate::store::Backend;

/// What a dry run found.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TrialReport {
    /// The handler succeeded (the retry would commit, unless the database changes meanwhile).
    pub ok: bool,
    /// Why it failed, when it did.
    pub error: Option<String>,
    /// Each statement the handler ran, with the rows it changed, where the handler reports them (`idem run`'s
    /// effects do; a Rust handler reports none).
    pub statements: Vec<StatementRows>,
}

/// One statement of a dry run.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StatementRows {
    /// The statement as the configuration names it (`consumer `ledger`.effect[1].sql (line 32)`).
    pub statement: String,
    /// Rows it changed.
    pub rows: u64,
}

/// A boxed future, for a trait the console holds as an object.
pub type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Runs one consumer group's handler on an event and rolls back.
pub trait Trial: Send + Sync + 'static {
    /// The consumer group whose handler this is.
    fn group(&self) -> String;
    /// Runs the handler on `event` in a transaction that is rolled back.
    fn try_event(&self, event: Event) -> Boxed<'_, TrialReport>;
}

/// The trials a console can run, by consumer group.
#[derive(Clone, Default)]
pub struct Trials(pub Vec<Arc<dyn Trial>>);

impl std::fmt::Debug for Trials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.iter().map(|t| t.group())).finish()
    }
}

impl Trials {
    /// The trial of `group`.
    pub fn find(&self, group: &str) -> Option<&Arc<dyn Trial>> {
        self.0.iter().find(|t| t.group() == group)
    }
}

/// A Rust handler as a trial: success or its error (no per-statement rows).
pub struct HandlerTrial<DB: Backend, H> {
    pool: sqlx::Pool<DB>,
    group: String,
    handler: Arc<H>,
}

impl<DB: Backend, H: Handler<DB> + 'static> HandlerTrial<DB, H> {
    /// `handler`, the one consumer group `group` runs, on `pool`.
    pub fn new(pool: sqlx::Pool<DB>, group: &str, handler: H) -> Self {
        HandlerTrial { pool, group: group.to_owned(), handler: Arc::new(handler) }
    }
}

impl<DB: Backend, H: Handler<DB> + 'static> Trial for HandlerTrial<DB, H> {
    fn group(&self) -> String {
        self.group.clone()
    }

    fn try_event(&self, event: Event) -> Boxed<'_, TrialReport> {
        Box::pin(async move {
            let mut tx = match self.pool.begin().await {
                Ok(tx) => tx,
                Err(e) => return TrialReport { error: Some(format!("the database: {e}")), ..TrialReport::default() },
            };
            let outcome = self.handler.handle(&event, &mut tx).await;
            drop(tx.rollback().await);
            match outcome {
                Ok(()) => TrialReport { ok: true, ..TrialReport::default() },
                Err(e) => TrialReport { error: Some(e.to_string()), ..TrialReport::default() },
            }
        })
    }
}
