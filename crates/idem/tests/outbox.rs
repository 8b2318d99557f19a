//! The outbox and its relay, on PostgreSQL and SQLite: a handler's enqueue delivered to a second consumer group
//! exactly once; several relays sharing the slots with each key in order under failures; dead letters and their
//! requeue; a relay on a database without the outbox table.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Ledger, TestPool, config, ledger_total, temp_dir};
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::outbox::{
    Call, DeliveryError, OutboxConnection, OutboxMessage, OutboxStore, OutgoingMessage, Publish, Relay, RelayConfig,
};
use idem::{Backend, Engine, Event, Handler, HandlerError, KeyExtractor, Tables};
use sqlx::Pool;

fn until_end() -> ConsumerOptions {
    ConsumerOptions { stop_at_end: true, ..ConsumerOptions::default() }
}

fn quick(name: &str) -> RelayConfig {
    RelayConfig {
        name: name.into(),
        batch_size: 50,
        poll_interval: Duration::from_millis(50),
        backoff: idem::Backoff::new(Duration::from_millis(5), Duration::from_millis(40)),
        ..RelayConfig::default()
    }
}

/// Enqueues a `credited` event for each payment, keyed by account, in the transaction of the payment's marker.
struct Announce;

impl<DB: Backend> Handler<DB> for Announce
where
    DB::Connection: OutboxConnection,
{
    async fn handle(&self, event: &Event, tx: &mut DB::Connection) -> Result<(), HandlerError> {
        let payment: serde_json::Value = event.json()?;
        let account = payment["account"].as_i64().unwrap_or(0);
        let body = serde_json::json!({ "id": event.id, "amount": payment["amount"] }).to_string();
        idem::outbox::enqueue(tx, OutgoingMessage::new("credited", body).with_key(account.to_string())).await?;
        Ok(())
    }
}

/// Payments consumed, a `credited` event enqueued with each, relayed to the log, consumed by a second group
/// into the ledger: every amount once, even when the first consumer and the relay run twice.
async fn a_handlers_enqueue_reaches_a_second_consumer_once<DB: Backend + OutboxStore>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    DB::Connection: OutboxConnection,
    Ledger: Handler<DB>,
{
    common::setup(&pool).await;
    let dir = temp_dir();
    let log = EmbeddedLog::open(&dir.0).unwrap();
    log.create_topic("payments", 2).unwrap();
    log.create_topic("credited", 3).unwrap();
    let producer = log.producer();
    let mut total = 0;
    for n in 0..120i64 {
        let payload = format!(r#"{{"id":"p{n}","account":{},"amount":{n}}}"#, n % 7);
        producer.send("payments", Some(format!("{}", n % 7).as_bytes()), payload.as_bytes(), &[]).unwrap();
        total += n;
    }
    producer.flush().unwrap();

    for round in 0..2 {
        // The second round reads every payment again (offsets lost): the markers stop a second enqueue.
        let _ = std::fs::remove_dir_all(dir.0.join("groups").join("announcer"));
        let engine = Engine::new(pool.clone(), idem::Config { group: "announcer".into(), ..config(16) }).unwrap();
        let source = log.consumer("announcer", &["payments"], until_end()).unwrap();
        let stats = engine.run(source, Announce, std::future::pending::<()>()).await.unwrap();
        assert_eq!((stats.processed, stats.duplicate), if round == 0 { (120, 0) } else { (0, 120) });
        let relay = Relay::new(
            pool.clone(),
            Tables::default(),
            RelayConfig { stop_when_empty: true, ..quick("relay") },
            Publish(log.producer()),
        )
        .unwrap();
        let relayed = relay.run(std::future::pending::<()>()).await.unwrap();
        assert_eq!(relayed.delivered, if round == 0 { 120 } else { 0 });
    }
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM outbox").await, 0, "delivered messages are deleted");

    let second =
        idem::Config { group: "second".into(), key: KeyExtractor::Header("idem-event-id".into()), ..config(10) };
    let engine = Engine::new(pool.clone(), second).unwrap();
    let source = log.consumer("second", &["credited"], until_end()).unwrap();
    let stats = engine.run(source, Ledger::default(), std::future::pending::<()>()).await.unwrap();
    assert_eq!(stats.processed, 120);
    assert_eq!(ledger_total(&pool).await, total);
    // Each account's events went to one partition in the order they were credited.
    let reader = log.consumer("reader", &["credited"], until_end()).unwrap();
    let mut last: HashMap<Vec<u8>, i64> = HashMap::new();
    while let Some(idem::source::Received::Message(m)) = idem::Source::recv(&reader).await.unwrap() {
        let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        let n: i64 = body["id"].as_str().unwrap().trim_start_matches('p').parse().unwrap();
        let key = m.key.clone().unwrap();
        assert!(last.get(&key).is_none_or(|&before| before < n), "account {key:?}: {n} after a later one");
        last.insert(key, n);
        assert_eq!(m.header("idem-event-id").map(|v| v.len()), Some(36), "a UUID event id on every message");
    }
    assert_eq!(last.len(), 7);
}
on_every_store!(a_handlers_enqueue_reaches_a_second_consumer_once);

/// What a test delivery saw: (key, sequence, event id) in the order deliveries succeeded.
type Seen = Arc<Mutex<Vec<(String, i64, String)>>>;

/// A delivery that takes a little while and fails now and then (transiently), recording what succeeded.
fn flaky_recorder(seen: Seen, relay: usize, per_relay: Arc<Mutex<HashMap<usize, u64>>>) -> impl idem::outbox::Delivery {
    Call(move |m: OutboxMessage| {
        let (seen, per_relay) = (Arc::clone(&seen), Arc::clone(&per_relay));
        async move {
            let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
            let seq = body["seq"].as_i64().unwrap();
            tokio::time::sleep(Duration::from_micros(200 + (seq as u64 * 37) % 700)).await;
            if (seq * 7 + m.id) % 19 == 0 && m.attempts == 0 {
                return Err(DeliveryError::transient("the service is busy"));
            }
            let key = String::from_utf8(m.key.clone().unwrap()).unwrap();
            seen.lock().unwrap().push((key, seq, m.event_id.clone()));
            *per_relay.lock().unwrap().entry(relay).or_default() += 1;
            Ok(())
        }
    })
}

/// Three relays run while four writers enqueue 1,200 messages over 24 keys: each key's messages are delivered in
/// the order they were committed, every message at least once, a repeat only with its event id.
async fn relays_share_the_work_and_keep_each_keys_order<DB: Backend + OutboxStore>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    DB::Connection: OutboxConnection,
{
    common::setup(&pool).await;
    let seen: Seen = Arc::default();
    let per_relay: Arc<Mutex<HashMap<usize, u64>>> = Arc::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut relays = Vec::new();
    for r in 0..3 {
        let relay = Relay::new(
            pool.clone(),
            Tables::default(),
            quick("shared"),
            flaky_recorder(Arc::clone(&seen), r, Arc::clone(&per_relay)),
        )
        .unwrap();
        let mut stopped = stopped.clone();
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        relays.push(tokio::spawn(async move { relay.run(shutdown).await }));
    }
    let mut writers = Vec::new();
    for w in 0..4 {
        let pool = pool.clone();
        writers.push(tokio::spawn(async move {
            // Writer w owns keys w, w+4, ..., so each key's order is the order of one writer's commits.
            let mut next: HashMap<String, i64> = HashMap::new();
            for t in 0..60 {
                let mut tx = pool.begin().await.unwrap();
                let messages: Vec<OutgoingMessage> = (0..5)
                    .map(|i| {
                        let key = format!("k{}", w + 4 * ((t * 5 + i) % 6));
                        let seq = next.entry(key.clone()).or_default();
                        *seq += 1;
                        OutgoingMessage::new("orders", format!(r#"{{"seq":{}}}"#, *seq - 1)).with_key(key)
                    })
                    .collect();
                idem::outbox::Outbox::default().enqueue_all(&mut *tx, &messages).await.unwrap();
                tx.commit().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            next
        }));
    }
    let mut expected: HashMap<String, i64> = HashMap::new();
    for writer in writers {
        expected.extend(writer.await.unwrap());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while pool.scalar("SELECT COUNT(*) FROM outbox").await > 0 {
        assert!(std::time::Instant::now() < deadline, "the relays did not empty the outbox");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(true).unwrap();
    for relay in relays {
        relay.await.unwrap().unwrap();
    }

    let seen = seen.lock().unwrap().clone();
    let mut delivered: HashMap<String, Vec<i64>> = HashMap::new();
    let mut ids: HashMap<(String, i64), String> = HashMap::new();
    for (key, seq, event_id) in seen {
        let first = ids.entry((key.clone(), seq)).or_insert_with(|| event_id.clone());
        assert_eq!(*first, event_id, "a repeat of {key}/{seq} carries its event id");
        let order = delivered.entry(key).or_default();
        if !order.contains(&seq) {
            order.push(seq);
        }
    }
    assert_eq!(delivered.len(), 24);
    for (key, order) in &delivered {
        let want: Vec<i64> = (0..expected[key]).collect();
        assert_eq!(order, &want, "key {key} delivered out of order or incompletely");
    }
    let per_relay = per_relay.lock().unwrap().clone();
    if <DB as Backend>::NAME == "postgres" {
        assert!(per_relay.len() >= 2, "the slots were shared: {per_relay:?}");
    }
}
on_every_store!(relays_share_the_work_and_keep_each_keys_order);

/// A permanent failure moves the message to the dead letters and its key goes on; a message failing
/// transiently past `max_attempts` does too; a requeued dead letter is delivered with its event id.
async fn dead_letters_and_their_requeue<DB: Backend + OutboxStore>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    DB::Connection: OutboxConnection,
{
    common::setup(&pool).await;
    let mut tx = pool.begin().await.unwrap();
    let outbox = idem::outbox::Outbox::default();
    let ids = outbox
        .enqueue_all(
            &mut *tx,
            &[
                OutgoingMessage::new("mail", "refused").with_key("a"),
                OutgoingMessage::new("mail", "after-refused").with_key("a"),
                OutgoingMessage::new("mail", "always-busy").with_key("b"),
                OutgoingMessage::new("mail", "fine").with_key("c"),
            ],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut rolled_back = pool.begin().await.unwrap();
    outbox.enqueue(&mut *rolled_back, OutgoingMessage::new("mail", "never")).await.unwrap();
    drop(rolled_back);

    let sent: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let healed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let delivery = |sent: Arc<Mutex<Vec<(String, String)>>>, healed: Arc<std::sync::atomic::AtomicBool>| {
        Call(move |m: OutboxMessage| {
            let (sent, healed) = (Arc::clone(&sent), Arc::clone(&healed));
            async move {
                let body = String::from_utf8(m.payload.clone()).unwrap();
                let healed = healed.load(std::sync::atomic::Ordering::SeqCst);
                match body.as_str() {
                    "refused" if !healed => return Err(DeliveryError::permanent("550 mailbox unavailable")),
                    "always-busy" if !healed => return Err(DeliveryError::transient("421 try again later")),
                    _ => {}
                }
                sent.lock().unwrap().push((body, m.event_id));
                Ok(())
            }
        })
    };
    let config = RelayConfig { stop_when_empty: true, max_attempts: Some(3), ..quick("mailer") };
    let relay =
        Relay::new(pool.clone(), Tables::default(), config.clone(), delivery(Arc::clone(&sent), Arc::clone(&healed)))
            .unwrap();
    let stats = relay.run(std::future::pending::<()>()).await.unwrap();
    assert_eq!((stats.delivered, stats.dead_lettered, stats.failed), (2, 2, 2));
    let mut bodies: Vec<String> = sent.lock().unwrap().iter().map(|(b, _)| b.clone()).collect();
    bodies.sort();
    assert_eq!(bodies, ["after-refused", "fine"], "the refused message's key went on; the busy one was given up");
    assert!(!bodies.contains(&"never".to_owned()), "a rolled-back enqueue is never delivered");

    let letters: Vec<(i64, String, String, i32)> =
        idem::dead_letter::list(&pool, &Tables::default(), Some("outbox:mailer"), 10)
            .await
            .unwrap()
            .into_iter()
            .map(|d| (d.id, d.event_id.unwrap_or_default(), d.error, d.attempts))
            .collect();
    assert_eq!(letters.len(), 2, "{letters:?}");
    assert!(letters[0].2.contains("550 mailbox unavailable") && letters[0].2.contains("for good"), "{letters:?}");
    assert_eq!(letters[0].1, ids[0]);
    assert!(letters[1].2.contains("3 times") && letters[1].2.contains("421"), "{letters:?}");
    assert_eq!(letters[1].3, 3);

    // Once the cause is fixed, both go back into the outbox and out with the event ids they had.
    healed.store(true, std::sync::atomic::Ordering::SeqCst);
    for (id, ..) in &letters {
        assert!(idem::outbox::requeue_dead_letter(&pool, &Tables::default(), *id).await.unwrap());
        assert!(!idem::outbox::requeue_dead_letter(&pool, &Tables::default(), *id).await.unwrap(), "only once");
    }
    let relay = Relay::new(pool.clone(), Tables::default(), config, delivery(Arc::clone(&sent), healed)).unwrap();
    assert_eq!(relay.run(std::future::pending::<()>()).await.unwrap().delivered, 2);
    let sent = sent.lock().unwrap().clone();
    for (body, index) in [("refused", 0), ("always-busy", 2)] {
        let (_, event_id) = sent.iter().find(|(b, _)| b == body).expect("delivered after the requeue");
        assert_eq!(event_id, &ids[index]);
    }
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters").await, 0);
}
on_every_store!(dead_letters_and_their_requeue);

#[tokio::test]
async fn a_relay_on_a_database_without_the_outbox_says_to_migrate() {
    let db = common::pg().await;
    let relay = Relay::new(
        db.pool.clone(),
        Tables::default(),
        RelayConfig::default(),
        Call(|_m: OutboxMessage| async { Ok(()) }),
    )
    .unwrap();
    let err = relay.run(std::future::pending::<()>()).await.unwrap_err().to_string();
    assert!(err.contains("idem migrate"), "{err}");
    let bad = RelayConfig { batch_size: 0, ..RelayConfig::default() };
    let err = Relay::new(db.pool.clone(), Tables::default(), bad, Call(|_m: OutboxMessage| async { Ok(()) }))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("batch_size"), "{err}");
}
