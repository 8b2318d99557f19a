//! The commit observer is the engine's, not one clone's: set on a clone, it sees every commit.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::Ledger;
use idem::Engine;

#[tokio::test]
async fn an_observer_set_on_a_clone_sees_every_commit() {
    let db = common::sqlite().await;
    common::setup(&db.pool).await;
    let engine = Engine::new(db.pool.clone(), common::config(10)).unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&seen);
    let _clone = engine.clone().on_commit(move |committed| {
        counter.fetch_add(committed.processed, Ordering::SeqCst);
    });
    let messages = vec![common::payment(0, 0, "a", 1, ""), common::payment(0, 1, "b", 2, "")];
    engine.process(messages, &Ledger::default()).await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 2);
}
