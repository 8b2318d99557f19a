//! User code behind one interface: a [`Handler`] per message or a [`BatchHandler`] per batch ([`Apply`]), and
//! what a partition worker does with a batch ([`Process`]: the marker path here, the Sequential Inbox elsewhere).
//!
//! Both are objects (their futures boxed, one allocation per batch): the run loop, the transaction order and the
//! retry loop behind them are compiled once per database, not once per handler type of the program.

use futures_util::future::BoxFuture;
use tracing::Instrument;

use super::Engine;
use super::outcome::Outcome;
use super::retry::Shutdown;
use crate::error::{Error, HandlerError};
use crate::handler::{BatchHandler, Handler};
use crate::message::{Event, Message};
use crate::store::Backend;

/// The two kinds of user code behind one interface.
pub(crate) trait Apply<DB: Backend>: Send + Sync {
    /// Applies `fresh` (the new events, in order); on failure, the index into `fresh` when it is known.
    fn apply<'a>(
        &'a self,
        fresh: &'a [&'a Event],
        tx: &'a mut DB::Connection,
    ) -> BoxFuture<'a, Result<(), (Option<usize>, HandlerError)>>;
}

/// What a partition worker does with one batch of its partition's messages, in order; the engine's marker path
/// and the Sequential Inbox are the two implementations. `Err(Error::Stopped)` leaves the batch unacknowledged.
pub(crate) trait Process<DB: Backend>: Send + Sync + 'static {
    /// Handles `batch` to the end (committed or dead-lettered), so that it can be acknowledged; says, for each
    /// message in order, whether it was dead-lettered.
    fn process<'a>(
        &'a self,
        engine: &'a Engine<DB>,
        batch: Vec<Message>,
        shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Result<Vec<bool>, Error>>;

    /// Tries the consumer's due parked messages again until `shutdown` (delayed retries, see
    /// [`crate::delayed_retry`]). The marker path's messages park; the default parks nothing and returns.
    fn release_parked(&self, _engine: Engine<DB>, _shutdown: Shutdown) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}

/// The marker path: every message of the batch through [`Engine::process_items`].
pub(super) struct Marked<A>(pub(super) A);

impl<DB: Backend, A: Apply<DB> + 'static> Process<DB> for Marked<A> {
    fn process<'a>(
        &'a self,
        engine: &'a Engine<DB>,
        batch: Vec<Message>,
        shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Result<Vec<bool>, Error>> {
        Box::pin(async move {
            let items = engine.items(batch);
            let outcomes = engine.process_items(&items, &self.0, shutdown).await?;
            Ok(outcomes.into_iter().map(|o| o == Outcome::DeadLettered).collect())
        })
    }

    fn release_parked(&self, engine: Engine<DB>, shutdown: Shutdown) -> BoxFuture<'_, ()> {
        Box::pin(async move { engine.release_parked(&self.0, shutdown).await })
    }
}

pub(super) struct PerMessage<H>(pub(super) H);
pub(super) struct PerBatch<B>(pub(super) B);
pub(crate) struct PerMessageRef<'h, H>(pub(crate) &'h H);
pub(super) struct PerBatchRef<'h, B>(pub(super) &'h B);

async fn apply_each<DB: Backend, H: Handler<DB>>(
    handler: &H,
    fresh: &[&Event],
    tx: &mut DB::Connection,
) -> Result<(), (Option<usize>, HandlerError)> {
    for (i, event) in fresh.iter().enumerate() {
        handler.handle(event, tx).instrument(event.span().clone()).await.map_err(|e| (Some(i), e))?;
    }
    Ok(())
}

async fn apply_all<DB: Backend, B: BatchHandler<DB>>(
    handler: &B,
    fresh: &[&Event],
    tx: &mut DB::Connection,
) -> Result<(), (Option<usize>, HandlerError)> {
    if fresh.is_empty() {
        return Ok(());
    }
    let at = (fresh.len() == 1).then_some(0);
    handler.handle_batch(fresh, tx).await.map_err(|e| (at, e))
}

impl<DB: Backend, H: Handler<DB>> Apply<DB> for PerMessage<H> {
    fn apply<'a>(
        &'a self,
        fresh: &'a [&'a Event],
        tx: &'a mut DB::Connection,
    ) -> BoxFuture<'a, Result<(), (Option<usize>, HandlerError)>> {
        Box::pin(apply_each(&self.0, fresh, tx))
    }
}

impl<DB: Backend, H: Handler<DB>> Apply<DB> for PerMessageRef<'_, H> {
    fn apply<'a>(
        &'a self,
        fresh: &'a [&'a Event],
        tx: &'a mut DB::Connection,
    ) -> BoxFuture<'a, Result<(), (Option<usize>, HandlerError)>> {
        Box::pin(apply_each(self.0, fresh, tx))
    }
}

impl<DB: Backend, B: BatchHandler<DB>> Apply<DB> for PerBatch<B> {
    fn apply<'a>(
        &'a self,
        fresh: &'a [&'a Event],
        tx: &'a mut DB::Connection,
    ) -> BoxFuture<'a, Result<(), (Option<usize>, HandlerError)>> {
        Box::pin(apply_all(&self.0, fresh, tx))
    }
}

impl<DB: Backend, B: BatchHandler<DB>> Apply<DB> for PerBatchRef<'_, B> {
    fn apply<'a>(
        &'a self,
        fresh: &'a [&'a Event],
        tx: &'a mut DB::Connection,
    ) -> BoxFuture<'a, Result<(), (Option<usize>, HandlerError)>> {
        Box::pin(apply_all(self.0, fresh, tx))
    }
}
