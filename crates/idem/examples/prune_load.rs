//! Pruning under load (PostgreSQL): 2,000,000 markers of which half are past the retention, and a consumer
//! crediting accounts. Measures the consumer's throughput alone, then while a pruning pass runs, and the pass
//! itself (rows per second, longest statement). Prints one JSON object.
//!
//! `cargo run --release -p idem --example prune_load -- postgres://postgres@127.0.0.1:5432/test [markers]`
//!
//! Uses tables prefixed `prune_load_`, recreated on every run.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Message, Pruning, Tables};
use sqlx::PgConnection;

struct Credit;

impl Handler<sqlx::Postgres> for Credit {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let account = event.message.offset % 10_000;
        sqlx::query("UPDATE prune_load_accounts SET balance = balance + 1 WHERE id = $1")
            .bind(account)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// Consumes batches of 100 fresh events until `stop` is set; returns events per second.
async fn consume(engine: Engine<sqlx::Postgres>, next: Arc<AtomicU64>, stop: Arc<AtomicBool>) -> f64 {
    let started = Instant::now();
    let mut handled = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let first = next.fetch_add(100, Ordering::SeqCst);
        let batch: Vec<Message> = (first..first + 100)
            .map(|n| Message::new("payments", 0, n as i64, format!(r#"{{"id":"live-{n}"}}"#).into_bytes()))
            .collect();
        match engine.process(batch, &Credit).await {
            Ok(outcomes) => handled += outcomes.len() as u64,
            Err(error) => {
                eprintln!("consumer failed: {error}");
                break;
            }
        }
    }
    handled as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let markers: i64 = args.next().map(|n| n.parse()).transpose()?.unwrap_or(2_000_000);
    let pool = idem::postgres::connect(&url, 4).await?;
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS prune_load_processed_events, prune_load_dead_letters, prune_load_idem_migrations,
                              prune_load_accounts;
         CREATE TABLE prune_load_accounts (id bigint PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO prune_load_accounts SELECT i, 0 FROM generate_series(0, 9999) i;",
    )
    .execute(&pool)
    .await?;
    let tables = Tables::new(None, "prune_load_")?;
    idem::migrate(&pool, &tables).await?;
    // Half the markers ten days old, half an hour old, interleaved as a live table would hold them.
    sqlx::query(
        "INSERT INTO prune_load_processed_events (consumer_group, event_id, topic, partition, \"offset\", processed_at)
         SELECT 'bench', 'old-' || i, 'payments', 0, i,
                now() - CASE WHEN i % 2 = 0 THEN interval '10 days' ELSE interval '30 minutes' END
           FROM generate_series(1, $1) i",
    )
    .bind(markers)
    .execute(&pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE prune_load_processed_events").execute(&pool).await?;

    let config = Config::new("bench", KeyExtractor::JsonPointer("/id".into())).tables(tables.clone());
    let engine = Engine::new(pool.clone(), config)?;
    let next = Arc::new(AtomicU64::new(0));

    // The consumer alone, for as long as the pruning pass will take (measured below; 20 s first).
    let alone_for = Duration::from_secs(20);
    let stop = Arc::new(AtomicBool::new(false));
    let alone = tokio::spawn(consume(engine.clone(), Arc::clone(&next), Arc::clone(&stop)));
    tokio::time::sleep(alone_for).await;
    stop.store(true, Ordering::SeqCst);
    let alone = alone.await?;

    // The consumer while one pruning pass runs.
    let stop = Arc::new(AtomicBool::new(false));
    let during = tokio::spawn(consume(engine.clone(), Arc::clone(&next), Arc::clone(&stop)));
    let week = Duration::from_secs(7 * 86_400);
    // Each statement's duration: the time between two progress calls, less the pause between them.
    let pruning = Pruning::default();
    let mut ends = vec![Instant::now()];
    let report = idem::prune::prune(&pool, &tables, None, week, &pruning, |_| ends.push(Instant::now())).await?;
    let mut statements_ms: Vec<f64> = ends
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let pause = if i == 0 { Duration::ZERO } else { pruning.pause };
            (w[1] - w[0]).saturating_sub(pause).as_secs_f64() * 1000.0
        })
        .collect();
    let slowest_at = statements_ms.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i + 1);
    statements_ms.sort_by(f64::total_cmp);
    let at =
        |q: f64| statements_ms.get(((statements_ms.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
    let over_200 = statements_ms.iter().filter(|ms| **ms > 200.0).count();
    stop.store(true, Ordering::SeqCst);
    let during = during.await?;

    let balance: i64 =
        sqlx::query_scalar("SELECT sum(balance)::bigint FROM prune_load_accounts").fetch_one(&pool).await?;
    let applied = next.load(Ordering::SeqCst);
    println!(
        "{}",
        serde_json::json!({
            "markers": markers,
            "deleted": report.deleted,
            "statements": report.statements,
            "longest_statement_ms": (report.longest_statement.as_secs_f64() * 1000.0 * 10.0).round() / 10.0,
            "statement_ms_median": (at(0.5) * 10.0).round() / 10.0,
            "statement_ms_p99": (at(0.99) * 10.0).round() / 10.0,
            "statements_over_200_ms": over_200,
            "slowest_statement_number": slowest_at,
            "prune_seconds": (report.elapsed.as_secs_f64() * 10.0).round() / 10.0,
            "deleted_per_second": (report.deleted as f64 / report.elapsed.as_secs_f64()).round(),
            "consumer_alone_per_second": alone.round(),
            "consumer_during_prune_per_second": during.round(),
            "ratio_during_to_alone": (during / alone * 100.0).round() / 100.0,
            "ledger_ok": balance as u64 == applied,
        })
    );
    Ok(())
}
