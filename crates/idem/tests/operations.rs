//! Operations: pruning in bounded statements.

mod common;

use std::time::Duration;

use common::{Ledger, TestPool, config, payment};
use idem::{Backend, Engine, Handler, Pruning, Tables};

type Pool<DB> = sqlx::Pool<DB>;

/// Markers past the retention go, in statements of at most the batch size, until one deletes nothing;
/// younger markers and other groups' markers stay.
async fn pruning_deletes_only_expired_markers_in_bounded_statements<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    common::setup(&pool).await;
    let engine = Engine::new(pool.clone(), config(100)).unwrap();
    let old: Vec<_> = (0..25).map(|i| payment(0, i, &format!("old-{i}"), 1, "")).collect();
    let young: Vec<_> = (0..10).map(|i| payment(0, 100 + i, &format!("young-{i}"), 1, "")).collect();
    engine.process(old, &Ledger::default()).await.unwrap();
    engine.process(young, &Ledger::default()).await.unwrap();
    let other = Engine::new(pool.clone(), idem::Config { group: "other-group".into(), ..config(100) }).unwrap();
    other.process(vec![payment(0, 0, "old-0", 1, "")], &Ledger::default()).await.unwrap();
    // Age the "old" markers by ten days.
    let age = format!(
        "UPDATE processed_events SET processed_at = {} WHERE event_id LIKE 'old-%'",
        <Pool<DB> as TestPool>::TEN_DAYS_EARLIER
    );
    pool.exec(&age).await;

    let tables = Tables::default();
    let week = Duration::from_secs(7 * 86_400);
    assert_eq!(idem::prune::count_expired(&pool, &tables, Some("ledger-writer"), week).await.unwrap(), 25);
    let pruning = Pruning { batch_size: 10, pause: Duration::from_millis(1), ..Pruning::default() };
    let mut seen = Vec::new();
    let report =
        idem::prune::prune(&pool, &tables, Some("ledger-writer"), week, &pruning, |n| seen.push(n)).await.unwrap();
    assert_eq!(report.deleted, 25);
    assert_eq!(report.statements, 4, "10 + 10 + 5 + one that deletes nothing");
    assert_eq!(seen, [10, 20, 25, 25]);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events WHERE consumer_group = 'ledger-writer'").await, 10);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events WHERE consumer_group = 'other-group'").await, 1);
    // Nothing younger than the retention is touched by a second pass.
    let again = idem::prune::prune(&pool, &tables, None, week, &pruning, |_| {}).await.unwrap();
    assert_eq!((again.deleted, again.statements), (1, 2), "only the other group's aged marker");
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events").await, 10);
}
on_every_store!(pruning_deletes_only_expired_markers_in_bounded_statements);
