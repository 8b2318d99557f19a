//! What user code implements: a [`Handler`] per event, or a [`BatchHandler`] for bulk effects.
//!
//! Both receive `&mut` access to the connection of the open transaction, and nothing else of idem's: no pool,
//! no commit, no rollback. The engine has already inserted the event's marker in that transaction; whatever the
//! handler writes through the connection commits or rolls back with it.

use std::future::Future;

use crate::error::HandlerError;
use crate::message::Event;
use crate::store::Backend;

/// Applies the effect of one event inside the engine's transaction.
///
/// Return `Ok(())` to commit it, [`HandlerError::Retryable`] to retry, [`HandlerError::Permanent`] to roll back
/// its effects and dead-letter the message. `?` on a `sqlx::Error` classifies it for you.
///
/// ```no_run
/// use idem::{Event, Handler, HandlerError};
/// use sqlx::PgConnection;
///
/// struct Credit;
///
/// impl Handler<sqlx::Postgres> for Credit {
///     async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
///         #[derive(serde::Deserialize)]
///         struct Payment { account: i64, amount: i64 }
///         let p: Payment = event.json()?;
///         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///             .bind(p.amount)
///             .bind(p.account)
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler<DB: Backend>: Send + Sync + 'static {
    /// Applies `event`; every write goes through `tx`.
    fn handle(&self, event: &Event, tx: &mut DB::Connection) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Applies the effects of all new events of a batch at once (one `UPDATE` for many events).
///
/// `events` holds the batch's non-duplicate events of one partition, in offset order. An error fails them all:
/// the engine rolls back and re-runs the batch one event at a time to find the message at fault, which alone is
/// dead-lettered.
pub trait BatchHandler<DB: Backend>: Send + Sync + 'static {
    /// Applies `events`; every write goes through `tx`.
    fn handle_batch(
        &self,
        events: &[&Event],
        tx: &mut DB::Connection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}
