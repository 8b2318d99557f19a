//! The legs over an in-memory source: idem per-event and batched (per-message and batch handlers), the Sequential
//! Inbox, and the raw batched SQL loop they are measured against.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum HandlerKind {
    PerMessage,
    Batch,
}

impl HandlerKind {
    pub(super) fn label(self) -> &'static str {
        match self {
            HandlerKind::PerMessage => "per-message handler",
            HandlerKind::Batch => "batch handler",
        }
    }
}

/// A payment's account and amount, as the handlers read them.
#[derive(serde::Deserialize)]
pub(super) struct Credit {
    pub(super) account: i64,
    pub(super) amount: i64,
}

#[derive(serde::Deserialize)]
struct RawPayment {
    id: String,
    account: i64,
    amount: i64,
}

/// One UPDATE per event.
pub(super) struct CreditEach;

impl Handler<sqlx::Postgres> for CreditEach {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let c: Credit = event.json()?;
        sqlx::query("UPDATE bench_accounts SET balance = balance + $1 WHERE id = $2")
            .bind(c.amount)
            .bind(c.account)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// One UPDATE for the whole batch.
pub(super) struct CreditAll;

impl BatchHandler<sqlx::Postgres> for CreditAll {
    async fn handle_batch(&self, events: &[&Event], tx: &mut PgConnection) -> Result<(), HandlerError> {
        let mut accounts = Vec::with_capacity(events.len());
        let mut amounts = Vec::with_capacity(events.len());
        for event in events {
            let c: Credit = event.json()?;
            accounts.push(c.account);
            amounts.push(c.amount);
        }
        credit_all(tx, &accounts, &amounts).await?;
        Ok(())
    }
}

async fn credit_all(tx: &mut PgConnection, accounts: &[i64], amounts: &[i64]) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE bench_accounts a SET balance = a.balance + d.amount
           FROM (SELECT account, sum(amount)::bigint AS amount FROM UNNEST($1::bigint[], $2::bigint[]) AS t(account, amount)
                  GROUP BY account) d
          WHERE a.id = d.account",
    )
    .bind(accounts)
    .bind(amounts)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Preloaded messages handed out in order; acknowledgements are not needed here.
pub(super) struct MemorySource(pub(super) Mutex<VecDeque<Message>>);

impl Source for MemorySource {
    async fn recv(&self) -> Result<Option<Received>, SourceError> {
        let next = self.0.lock().map_err(|_| SourceError::permanent("bench source", "poisoned"))?.pop_front();
        Ok(next.map(Received::Message))
    }

    async fn ack(&self, _ack: &idem::Acknowledgement) -> Result<(), SourceError> {
        Ok(())
    }
}

/// The workload as messages over `partitions` partitions (by account), interleaved as a broker would.
pub(super) fn messages(work: &Workload, partitions: i32) -> VecDeque<Message> {
    let mut offsets = vec![0i64; partitions as usize];
    work.deliveries
        .iter()
        .map(|p| {
            let partition = (p.account % i64::from(partitions)) as i32;
            let offset = &mut offsets[partition as usize];
            *offset += 1;
            Message::new(TOPIC, partition, *offset - 1, payload(p).into_bytes())
        })
        .collect()
}

pub(super) async fn idem_leg(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    batch_size: usize,
    partitions: i32,
    kind: HandlerKind,
) -> anyhow::Result<f64> {
    let (engine, engine_pool, source) = engine_over(pool, args, work, batch_size, partitions).await?;
    let started = Instant::now();
    let stats = match kind {
        HandlerKind::PerMessage => engine.run(source, CreditEach, std::future::pending::<()>()).await?,
        HandlerKind::Batch => engine.run_batched(source, CreditAll, std::future::pending::<()>()).await?,
    };
    finished(pool, &engine_pool, work, stats.processed, started).await
}

/// The batched leg with any batch handler, one partition (the outbox legs' consumer).
pub(super) async fn idem_leg_with<B: BatchHandler<sqlx::Postgres>>(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    batch_size: usize,
    handler: B,
) -> anyhow::Result<f64> {
    let (engine, engine_pool, source) = engine_over(pool, args, work, batch_size, 1).await?;
    let started = Instant::now();
    let stats = engine.run_batched(source, handler, std::future::pending::<()>()).await?;
    finished(pool, &engine_pool, work, stats.processed, started).await
}

/// Fresh tables, an engine on a pool of its own (returned too, to close), and the workload as a source over
/// `partitions`.
pub(super) async fn engine_over(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    batch_size: usize,
    partitions: i32,
) -> anyhow::Result<(Engine<sqlx::Postgres>, PgPool, MemorySource)> {
    let tables = fresh_tables(pool, args.accounts).await?;
    let engine_pool = idem::postgres::connect(&args.database_url, partitions as u32 + 2).await?;
    let config = Config::new(GROUP, KeyExtractor::JsonPointer("/id".into())).batch_size(batch_size).tables(tables);
    let engine = Engine::new(engine_pool.clone(), config)?;
    Ok((engine, engine_pool, MemorySource(Mutex::new(messages(work, partitions)))))
}

/// Closes the engine's pool, checks that every event was handled and the ledger, and returns the rate.
pub(super) async fn finished(
    pool: &PgPool,
    engine_pool: &PgPool,
    work: &Workload,
    processed: u64,
    started: Instant,
) -> anyhow::Result<f64> {
    let seconds = started.elapsed().as_secs_f64();
    engine_pool.close().await;
    if processed != work.unique {
        bail!("idem leg: processed {processed} of {} events", work.unique);
    }
    check_ledger(pool, "idem", work.expected_total, work.unique as i64).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}

/// The name of the Sequential Inbox leg, on empty tables (`open` 0) or beside `open` open instances (a name that
/// does not contain the first, so that `--only` can pick either).
pub(super) fn inbox_name(open: u64) -> String {
    match open {
        0 => "idem Sequential Inbox, 4 partition(s), released on arrival".to_owned(),
        n => format!("idem Sequential Inbox beside {n} open instances, 4 partition(s), released on arrival"),
    }
}

/// The Sequential Inbox on the same events: each payment is a `Credit` of the sequence of its account, released
/// on arrival, so every event pays the inbox's whole path (instance, claim, lock, lookup, record, release scan).
/// With `open` above 0, that many other instances are open already, each with one processed message and its
/// claim (loaded untimed).
pub(super) async fn inbox_leg(
    pool: &PgPool,
    args: &BenchArgs,
    work: &Workload,
    partitions: i32,
    open: u64,
) -> anyhow::Result<f64> {
    let tables = fresh_tables(pool, args.accounts).await?;
    if open > 0 {
        load_open_instances(pool, open).await?;
    }
    let engine_pool = idem::postgres::connect(&args.database_url, partitions as u32 + 2).await?;
    let config = Config::new(GROUP, KeyExtractor::JsonPointer("/id".into())).batch_size(1).tables(tables);
    let sequences = r#"
        [[sequence]]
        name = "account"
        retention = "1d"
        [[sequence.type]]
        name = "Credit"
        context_id = "json:/account"
        [[sequence.type]]
        name = "AccountClosed"
        context_id = "json:/account"
        release = { predecessor = "Credit" }
    "#;
    let inbox = idem::inbox::SequentialInbox::new(
        Engine::new(engine_pool.clone(), config)?,
        idem::inbox::InboxConfig::from_toml(sequences)?,
    )?;
    let messages = messages(work, partitions).into_iter().map(|m| m.with_header("type", "Credit")).collect();
    let source = MemorySource(Mutex::new(messages));
    let started = Instant::now();
    inbox.run(source, CreditEach, std::future::pending::<()>()).await?;
    let seconds = started.elapsed().as_secs_f64();
    engine_pool.close().await;
    let stats = inbox.stats();
    if stats.processed != work.unique {
        bail!("inbox leg: processed {} of {} events", stats.processed, work.unique);
    }
    check_ledger(pool, "inbox", work.expected_total, 0).await?;
    let claims: i64 =
        sqlx::query_scalar("SELECT count(*) FROM bench_sequential_inbox_idempotence").fetch_one(pool).await?;
    if claims != work.unique as i64 + open as i64 {
        bail!("inbox leg: {claims} claims for {} events and {open} loaded", work.unique);
    }
    Ok(work.deliveries.len() as f64 / seconds)
}

/// Loads `open` open instances of the leg's sequence, each with one processed `Credit` and its claim, then
/// analyzes the tables; none of their context ids is an account's.
async fn load_open_instances(pool: &PgPool, open: u64) -> anyhow::Result<()> {
    let open = i64::try_from(open)?;
    for sql in [
        "INSERT INTO bench_sequence_instance (sequence_name, context_id, retain_until)
         SELECT 'account', 'open-' || g, now() + interval '1 day' FROM generate_series(1, $1) g",
        r#"INSERT INTO bench_sequenced_message (sequence_instance_id, message_type, idempotence_id, status, topic,
                                               partition, "offset", headers, processed_at)
           SELECT id, 'Credit', 'open-' || id, 'PROCESSED', 'payments', 0, id, '{}', now()
             FROM bench_sequence_instance WHERE $1 > 0"#,
        "INSERT INTO bench_sequential_inbox_idempotence (message_type, idempotence_id, sequence_instance_id, created_at)
         SELECT 'Credit', 'open-' || id, id, now() FROM bench_sequence_instance WHERE $1 > 0",
    ] {
        sqlx::query(sql).bind(open).execute(pool).await?;
    }
    sqlx::query("VACUUM ANALYZE bench_sequence_instance, bench_sequenced_message, bench_sequential_inbox_idempotence")
        .execute(pool)
        .await?;
    sqlx::query("CHECKPOINT").execute(pool).await?;
    Ok(())
}

/// The batched SQL limit: per batch, one multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING`, one UPDATE for
/// the new events, one commit; one connection, nothing else.
pub(super) async fn raw_batched(pool: &PgPool, args: &BenchArgs, work: &Workload, batch: usize) -> anyhow::Result<f64> {
    fresh_tables(pool, args.accounts).await?;
    let mut conn = PgConnection::connect(&args.database_url).await?;
    let messages: Vec<Message> = messages(work, 1).into();
    let started = Instant::now();
    for chunk in messages.chunks(batch) {
        // What a consumer has to do anyway: read each payload.
        let payments: Vec<RawPayment> =
            chunk.iter().map(|m| serde_json::from_slice(&m.payload)).collect::<Result<_, _>>()?;
        let ids: Vec<&str> = payments.iter().map(|p| p.id.as_str()).collect();
        let offsets: Vec<i64> = chunk.iter().map(|m| m.offset).collect();
        let digests: Vec<Vec<u8>> = chunk.iter().map(|m| idem::store::payload_digest(&m.payload)).collect();
        let mut tx = conn.begin().await?;
        let fresh: Vec<String> = sqlx::query_scalar(
            r#"INSERT INTO bench_processed_events (consumer_group, event_id, topic, partition, "offset", payload_digest)
               SELECT $1, id, $2, 0, o, d FROM UNNEST($3::text[], $4::bigint[], $5::bytea[]) AS u(id, o, d)
               ON CONFLICT (consumer_group, event_id) DO NOTHING RETURNING event_id"#,
        )
        .bind(GROUP)
        .bind(TOPIC)
        .bind(&ids)
        .bind(&offsets)
        .bind(&digests)
        .fetch_all(&mut *tx)
        .await?;
        let mut fresh: HashSet<String> = fresh.into_iter().collect();
        let (mut accounts, mut amounts) = (Vec::new(), Vec::new());
        for p in &payments {
            if fresh.remove(&p.id) {
                accounts.push(p.account);
                amounts.push(p.amount);
            }
        }
        credit_all(&mut tx, &accounts, &amounts).await?;
        tx.commit().await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    check_ledger(pool, "batched SQL limit", work.expected_total, work.unique as i64).await?;
    Ok(work.deliveries.len() as f64 / seconds)
}
