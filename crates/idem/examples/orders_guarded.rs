//! Ordering guards, runnable: order events (created, paid, cancelled) arrive scrambled across partitions and
//! duplicated, and a state-machine guard with a version column keeps every order's final state right; a late
//! "paid" after a cancellation is rejected. Checks every order and exits non-zero on any wrong state.
//!
//! SQLite in a temporary directory: `cargo run -p idem --example orders_guarded`

use std::collections::HashMap;

use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::guard::StateMachine;
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Tables};
use sqlx::SqliteConnection;

/// The state machine, as a deployment would keep it in a file.
pub const MACHINE: &str = include_str!("orders_guarded.toml");

/// The orders table the guard watches; the handler fills the total.
pub const SCHEMA: &str =
    "CREATE TABLE orders (id TEXT PRIMARY KEY, status TEXT, version INTEGER, total INTEGER NOT NULL DEFAULT 0)";

/// The guard moves the order's status and version; the handler writes the rest of the state the event carries.
pub struct Orders {
    /// The state machine on `orders`.
    pub guard: StateMachine<sqlx::Sqlite>,
}

#[derive(serde::Deserialize)]
struct Order {
    #[serde(rename = "orderId")]
    order_id: String,
    total: i64,
}

impl Handler<sqlx::Sqlite> for Orders {
    async fn handle(&self, event: &Event, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
        if self.guard.check(event, tx).await?.skip() {
            return Ok(()); // stale or rejected: counted, logged, its marker commits
        }
        let order: Order = event.json()?;
        sqlx::query("UPDATE orders SET total = $1 WHERE id = $2")
            .bind(order.total)
            .bind(&order.order_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// One event of an order's history.
pub struct Step {
    /// `OrderCreated`, `OrderPaid` or `OrderCancelled`.
    pub kind: &'static str,
    /// The order's version after it.
    pub version: i64,
    /// The order's total after it.
    pub total: i64,
}

/// Each order's id and history.
pub type Histories = Vec<(String, Vec<Step>)>;

/// The orders' histories (a deterministic mix of created, paid, cancelled after either) and, for some cancelled
/// orders, a late payment that comes after everything else. Returns the histories and the late payments.
pub fn histories(orders: usize, seed: u64) -> (Histories, Vec<(String, Step)>) {
    let mut rng = seed;
    let mut next = move || {
        rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        rng >> 33
    };
    let mut all = Vec::new();
    let mut late = Vec::new();
    for n in 0..orders {
        let id = format!("order-{n}");
        let total = (next() % 90_000) as i64 + 1_000;
        let mut steps = vec![Step { kind: "OrderCreated", version: 1, total }];
        if next() % 10 < 7 {
            steps.push(Step { kind: "OrderPaid", version: 2, total });
        }
        if next() % 10 < 3 {
            let version = steps.len() as i64 + 1;
            steps.push(Step { kind: "OrderCancelled", version, total: 0 });
            if next() % 2 == 0 {
                late.push((id.clone(), Step { kind: "OrderPaid", version: version + 1, total }));
            }
        }
        all.push((id, steps));
    }
    (all, late)
}

fn payload(id: &str, s: &Step) -> String {
    format!(r#"{{"eventId":"{id}-v{}","orderId":"{id}","version":{},"total":{}}}"#, s.version, s.version, s.total)
}

/// The late payments as messages: `(type, payload)`.
pub fn late_payments(orders: usize, seed: u64) -> Vec<(String, String)> {
    histories(orders, seed).1.iter().map(|(id, s)| (s.kind.to_owned(), payload(id, s))).collect()
}

/// The events as messages: `(type, payload)`, scrambled, a fifth of them twice.
pub fn scrambled(orders: usize, seed: u64) -> Vec<(String, String)> {
    let (all, _) = histories(orders, seed);
    let mut events: Vec<(String, String)> =
        all.iter().flat_map(|(id, steps)| steps.iter().map(move |s| (s.kind.to_owned(), payload(id, s)))).collect();
    let mut rng = seed ^ 0x5deece66d;
    for i in (1..events.len()).rev() {
        rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        events.swap(i, (rng >> 33) as usize % (i + 1));
    }
    let twice: Vec<(String, String)> = events.iter().step_by(5).cloned().collect();
    events.extend(twice);
    events
}

/// What every order must end as: the status and total of its newest real event.
pub fn expected(orders: usize, seed: u64) -> HashMap<String, (String, i64)> {
    let status = |kind: &str| match kind {
        "OrderCreated" => "created",
        "OrderPaid" => "paid",
        _ => "cancelled",
    };
    let (all, _) = histories(orders, seed);
    all.into_iter()
        .filter_map(|(id, steps)| steps.last().map(|s| (id.clone(), (status(s.kind).to_owned(), s.total))))
        .collect()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (orders, seed) = (300, 7);
    let dir = std::env::temp_dir().join(format!("idem-guarded-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pool = idem::sqlite::connect(&format!("sqlite://{}/orders.db", dir.display())).await?;
    idem::migrate(&pool, &Tables::default()).await?;
    sqlx::raw_sql(SCHEMA).execute(&pool).await?;

    // Four partitions, each event on any of them: one order's events race each other. Then, once those are
    // handled, a payment confirmation for some of the cancelled orders (with a newer version).
    let log = EmbeddedLog::open(dir.join("log"))?;
    log.create_topic("orders", 4)?;
    let producer = log.producer();
    let config = Config::new("order-states", KeyExtractor::JsonPointer("/eventId".into())).batch_size(50);
    let engine = Engine::new(pool.clone(), config)?;
    let mut events = 0;
    for phase in [scrambled(orders, seed), late_payments(orders, seed)] {
        for (kind, payload) in &phase {
            producer.send("orders", None, payload.as_bytes(), &[("type".to_owned(), kind.as_bytes().to_vec())])?;
        }
        producer.flush()?;
        events += phase.len();
        let until_end = ConsumerOptions { stop_at_end: true, ..Default::default() };
        let source = log.consumer("order-states", &["orders"], until_end)?;
        let guard = StateMachine::from_toml(&pool, MACHINE).await?; // checked against the table now
        engine.run(source, Orders { guard }, std::future::pending::<()>()).await?;
    }
    let stats = engine.stats();

    let rows: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT id, status, total FROM orders").fetch_all(&pool).await?;
    let expected = expected(orders, seed);
    let wrong: Vec<String> = rows
        .iter()
        .filter(|(id, status, total)| expected.get(id) != Some(&(status.clone(), *total)))
        .map(|(id, status, total)| format!("{id}: {status} {total}, expected {:?}", expected.get(id)))
        .collect();
    let late = histories(orders, seed).1.len() as u64;
    println!(
        "{events} deliveries: processed {}, stale {}, rejected {} (late payments after a cancellation: {late}), \
         duplicates {}; {} orders, {} wrong",
        stats.processed,
        stats.stale,
        stats.rejected,
        stats.duplicate,
        rows.len(),
        wrong.len()
    );
    std::fs::remove_dir_all(&dir)?;
    if !wrong.is_empty() || rows.len() != expected.len() || stats.rejected != late {
        for line in wrong.iter().take(10) {
            eprintln!("  {line}");
        }
        return Err("orders in a wrong final state".into());
    }
    println!("OK: every order in its right final state");
    Ok(())
}
