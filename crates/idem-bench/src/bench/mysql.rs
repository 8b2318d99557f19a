//! The MySQL/MariaDB legs (with `--mysql`): idem per-event and batched (batch handler) against raw SQL loops
//! doing the same work on the same server over one connection: per event `BEGIN; INSERT marker; UPDATE account;
//! COMMIT`, and per batch one multi-row marker insert, one `UPDATE` per account touched, one commit.

use std::collections::HashMap;

use sqlx::{MySqlConnection, MySqlPool};

use super::idem_legs::{Credit, MemorySource};
use super::*;

/// The legs' names, for the ratios.
pub(super) const PER_EVENT: &str = "MySQL idem per-event, 1 partition(s)";
pub(super) const RAW_PER_EVENT: &str = "MySQL raw SQL loop per-event";

pub(super) fn batched(batch: usize) -> String {
    format!("MySQL idem batched {batch}, batch handler")
}

pub(super) fn raw_batched_name(batch: usize) -> String {
    format!("MySQL batched SQL limit {batch}")
}

/// One UPDATE per event.
struct CreditEach;

impl Handler<sqlx::MySql> for CreditEach {
    async fn handle(&self, event: &Event, tx: &mut MySqlConnection) -> Result<(), HandlerError> {
        let c: Credit = event.json()?;
        sqlx::query("UPDATE bench_accounts SET balance = balance + ? WHERE id = ?")
            .bind(c.amount)
            .bind(c.account)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// One UPDATE per account the batch touches (MySQL has no `UPDATE … FROM UNNEST`), in account order.
struct CreditAll;

impl BatchHandler<sqlx::MySql> for CreditAll {
    async fn handle_batch(&self, events: &[&Event], tx: &mut MySqlConnection) -> Result<(), HandlerError> {
        let mut credits = Vec::with_capacity(events.len());
        for event in events {
            let c: Credit = event.json()?;
            credits.push((c.account, c.amount));
        }
        credit_accounts(tx, &credits).await?;
        Ok(())
    }
}

/// Sums the credits per account and applies them in account order (the same lock order in every transaction).
async fn credit_accounts(tx: &mut MySqlConnection, credits: &[(i64, i64)]) -> Result<(), sqlx::Error> {
    let mut sums: HashMap<i64, i64> = HashMap::new();
    for &(account, amount) in credits {
        *sums.entry(account).or_default() += amount;
    }
    let mut sums: Vec<(i64, i64)> = sums.into_iter().collect();
    sums.sort_unstable();
    for (account, amount) in sums {
        sqlx::query("UPDATE bench_accounts SET balance = balance + ? WHERE id = ?")
            .bind(amount)
            .bind(account)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// Runs the MySQL legs that `wanted` selects; none without `--mysql`.
pub(super) async fn run(
    args: &BenchArgs,
    work: &Workload,
    wanted: &dyn Fn(&str) -> bool,
    progress: &dyn Fn(&str),
    notes: &mut Vec<String>,
) -> anyhow::Result<Vec<Leg>> {
    let Some(url) = &args.mysql else {
        notes.push("MySQL legs skipped: no --mysql".into());
        return Ok(Vec::new());
    };
    let pool = idem::mysql::connect(url, 4)
        .await
        .with_context(|| format!("--mysql: cannot connect to {}", idem_cli::db::redact(url)))?;
    let mut legs = Vec::new();
    let mut names = vec![PER_EVENT.to_owned(), RAW_PER_EVENT.to_owned()];
    for batch in [100usize, 1_000] {
        names.push(batched(batch));
        names.push(raw_batched_name(batch));
    }
    for name in names {
        if !wanted(&name) {
            continue;
        }
        progress(&name);
        let mut runs = Vec::new();
        for _ in 0..args.runs {
            let batch = name.split_whitespace().find_map(|w| w.trim_end_matches(',').parse::<usize>().ok());
            runs.push(match (name.contains("idem"), batch) {
                (true, None) => idem_leg(&pool, url, args, work, 1).await?,
                (true, Some(batch)) => idem_leg(&pool, url, args, work, batch).await?,
                (false, None) => raw_per_event(&pool, url, args, work).await?,
                (false, Some(batch)) => raw_batched(&pool, url, args, work, batch).await?,
            });
        }
        legs.push(Leg::new(name, runs));
    }
    pool.close().await;
    Ok(legs)
}

/// A payment as a consumer reads it from its payload.
#[derive(serde::Deserialize)]
struct RawPayment {
    id: String,
    account: i64,
    amount: i64,
}

/// Fresh tables: idem's (prefixed `bench_`) and the accounts.
async fn fresh_tables(pool: &MySqlPool, accounts: i64) -> anyhow::Result<Tables> {
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS bench_processed_events, bench_dead_letters, bench_idem_migrations, bench_accounts, \
         bench_outbox",
    )
    .execute(pool)
    .await?;
    sqlx::raw_sql("CREATE TABLE bench_accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL DEFAULT 0)")
        .execute(pool)
        .await?;
    let ids: Vec<String> = (0..accounts).map(|i| format!("({i}, 0)")).collect();
    for chunk in ids.chunks(5_000) {
        sqlx::raw_sql(&format!("INSERT INTO bench_accounts (id, balance) VALUES {}", chunk.join(", ")))
            .execute(pool)
            .await?;
    }
    let tables = Tables::new(None, PREFIX)?;
    idem::migrate(pool, &tables).await?;
    Ok(tables)
}

async fn check_ledger(pool: &MySqlPool, leg: &str, work: &Workload) -> anyhow::Result<()> {
    let total: i64 = sqlx::query_scalar("SELECT CAST(COALESCE(SUM(balance), 0) AS SIGNED) FROM bench_accounts")
        .fetch_one(pool)
        .await?;
    let markers: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM bench_processed_events").fetch_one(pool).await?;
    if total != work.expected_total || markers != work.unique as i64 {
        bail!(
            "{leg}: ledger total {total} (expected {}), markers {markers} (expected {})",
            work.expected_total,
            work.unique
        );
    }
    Ok(())
}

/// idem on one partition: per-event (`batch` 1, per-message handler) or batched (batch handler).
async fn idem_leg(pool: &MySqlPool, url: &str, args: &BenchArgs, work: &Workload, batch: usize) -> anyhow::Result<f64> {
    let tables = fresh_tables(pool, args.accounts).await?;
    let engine_pool = idem::mysql::connect(url, 3).await?;
    let config = Config::new(GROUP, KeyExtractor::JsonPointer("/id".into())).batch_size(batch).tables(tables);
    let engine = Engine::new(engine_pool.clone(), config)?;
    let messages = work
        .deliveries
        .iter()
        .enumerate()
        .map(|(i, p)| Message::new(TOPIC, 0, i as i64, payload(p).into_bytes()))
        .collect();
    let source = MemorySource(Mutex::new(messages));
    let started = Instant::now();
    let stats = if batch == 1 {
        engine.run(source, CreditEach, std::future::pending::<()>()).await?
    } else {
        engine.run_batched(source, CreditAll, std::future::pending::<()>()).await?
    };
    let seconds = started.elapsed().as_secs_f64();
    engine_pool.close().await;
    if stats.processed != work.unique {
        bail!("MySQL idem leg: processed {} of {} events", stats.processed, work.unique);
    }
    check_ledger(pool, "MySQL idem", work).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}

/// The per-event transaction by hand: `BEGIN; INSERT marker; UPDATE account; COMMIT`, a duplicate's insert
/// failing with 1062 and its transaction rolled back.
async fn raw_per_event(pool: &MySqlPool, url: &str, args: &BenchArgs, work: &Workload) -> anyhow::Result<f64> {
    fresh_tables(pool, args.accounts).await?;
    let mut conn = MySqlConnection::connect(url).await?;
    let started = Instant::now();
    for (offset, m) in work.deliveries.iter().enumerate() {
        let p: RawPayment = serde_json::from_str(&payload(m))?;
        let digest = idem::store::payload_digest(payload(m).as_bytes());
        let mut tx = conn.begin().await?;
        let claimed = sqlx::query(
            "INSERT INTO bench_processed_events
               (consumer_group, event_id, topic, `partition`, `offset`, payload_digest, processed_at)
             VALUES (?, ?, ?, 0, ?, ?, UTC_TIMESTAMP(6))",
        )
        .bind(GROUP)
        .bind(&p.id)
        .bind(TOPIC)
        .bind(offset as i64)
        .bind(digest)
        .execute(&mut *tx)
        .await;
        match claimed {
            Ok(_) => {}
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                tx.rollback().await?;
                continue;
            }
            Err(error) => return Err(error.into()),
        }
        sqlx::query("UPDATE bench_accounts SET balance = balance + ? WHERE id = ?")
            .bind(p.amount)
            .bind(p.account)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    check_ledger(pool, "MySQL raw per-event", work).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}

/// The batched SQL limit: per batch, the markers already there read, one multi-row insert of the others, one
/// `UPDATE` per account touched, one commit; one connection, nothing else.
async fn raw_batched(
    pool: &MySqlPool,
    url: &str,
    args: &BenchArgs,
    work: &Workload,
    batch: usize,
) -> anyhow::Result<f64> {
    fresh_tables(pool, args.accounts).await?;
    let mut conn = MySqlConnection::connect(url).await?;
    let started = Instant::now();
    for (n, chunk) in work.deliveries.chunks(batch).enumerate() {
        let payments: Vec<RawPayment> =
            chunk.iter().map(|m| serde_json::from_str(&payload(m))).collect::<Result<_, _>>()?;
        let mut tx = conn.begin().await?;
        let ids = vec!["?"; payments.len()].join(", ");
        let sql = format!(
            "SELECT CAST(event_id AS CHAR) FROM bench_processed_events WHERE consumer_group = ? AND event_id IN ({ids})"
        );
        let mut lookup = sqlx::query_scalar::<_, String>(&sql).bind(GROUP);
        for p in &payments {
            lookup = lookup.bind(&p.id);
        }
        let mut seen: HashSet<String> = lookup.fetch_all(&mut *tx).await?.into_iter().collect();
        let fresh: Vec<&RawPayment> = payments.iter().filter(|p| seen.insert(p.id.clone())).collect();
        if !fresh.is_empty() {
            let mut insert = sqlx::QueryBuilder::<sqlx::MySql>::new(
                "INSERT INTO bench_processed_events
                   (consumer_group, event_id, topic, `partition`, `offset`, payload_digest, processed_at) ",
            );
            insert.push_values(fresh.iter().enumerate(), |mut b, (i, p)| {
                b.push_bind(GROUP)
                    .push_bind(p.id.as_str())
                    .push_bind(TOPIC)
                    .push_bind(0)
                    .push_bind((n * batch + i) as i64)
                    .push_bind(idem::store::payload_digest(
                        format!(r#"{{"id":"{}","account":{},"amount":{}}}"#, p.id, p.account, p.amount).as_bytes(),
                    ))
                    .push("UTC_TIMESTAMP(6)");
            });
            insert.build().execute(&mut *tx).await?;
            let credits: Vec<(i64, i64)> = fresh.iter().map(|p| (p.account, p.amount)).collect();
            credit_accounts(&mut tx, &credits).await?;
        }
        tx.commit().await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    check_ledger(pool, "MySQL batched SQL limit", work).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}
