//! The Sequential Inbox against a real PostgreSQL: ordering, conditions, closing, duplicates, concurrent
//! deliveries, failures and resends, instance races, housekeeping, recording mode, operator releases.

mod common;

use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use common::{TestPool, pg};
use idem::inbox::{InboxConfig, InboxOutcome, InboxTransactions, SequentialInbox, admin};
use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor, Message, Outcome};
use sqlx::PgConnection;

/// The example's order sequence, and a ticket sequence with an `any` condition and a one-second retention.
const SEQUENCES: &str = concat!(
    include_str!("../examples/order_sequence.toml"),
    r#"
[housekeeping]
expiry_delay = "0s"

[[sequence]]
name = "ticket"
retention = "1s"

[[sequence.type]]
name = "TicketOpened"
context_id = "json:/ticketId"

[[sequence.type]]
name = "EscalatedByMail"
context_id = "json:/ticketId"
release = { predecessor = "TicketOpened" }

[[sequence.type]]
name = "EscalatedByPhone"
context_id = "json:/ticketId"
release = { predecessor = "TicketOpened" }

[[sequence.type]]
name = "TicketClosed"
context_id = "json:/ticketId"
release = { any = [{ predecessor = "EscalatedByMail" }, { predecessor = "EscalatedByPhone" }] }
"#
);

/// Logs every handled message in `handled` (in the handler's transaction) and fails on demand.
#[derive(Default)]
struct Log {
    calls: AtomicUsize,
    /// Event ids that fail permanently.
    poisoned: Mutex<HashSet<String>>,
    /// Event ids that fail once with a retryable error.
    flaky: Mutex<HashSet<String>>,
    /// Sleep inside the transaction before writing.
    sleep: Mutex<Duration>,
    /// Event ids whose handling runs a failing statement and ignores its error.
    swallow: Mutex<HashSet<String>>,
    /// Event ids whose handling ends the transaction itself (`ROLLBACK` through `tx`).
    end: Mutex<HashSet<String>>,
    /// Event ids whose handling ends the transaction and writes again in one of its own (`ROLLBACK; BEGIN`
    /// through `tx`).
    restart: Mutex<HashSet<String>>,
}

impl Handler<sqlx::Postgres> for Log {
    async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let pause = *self.sleep.lock().unwrap();
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        sqlx::query("INSERT INTO handled (event_id, message_type) VALUES ($1, $2)")
            .bind(&event.id)
            .bind(type_of(&event.message))
            .execute(&mut *tx)
            .await?;
        if self.swallow.lock().unwrap().contains(&event.id) {
            let _ = sqlx::query("SELECT 1/0").execute(&mut *tx).await;
        }
        if self.end.lock().unwrap().contains(&event.id) {
            sqlx::query("ROLLBACK").execute(&mut *tx).await?;
        }
        if self.restart.lock().unwrap().contains(&event.id) {
            sqlx::query("ROLLBACK").execute(&mut *tx).await?;
            sqlx::query("BEGIN").execute(&mut *tx).await?;
            sqlx::query("INSERT INTO handled (event_id, message_type) VALUES ($1, 'again')")
                .bind(&event.id)
                .execute(&mut *tx)
                .await?;
        }
        if self.flaky.lock().unwrap().remove(&event.id) {
            return Err(HandlerError::retryable("flaky"));
        }
        if self.poisoned.lock().unwrap().contains(&event.id) {
            return Err(HandlerError::permanent("poisoned"));
        }
        Ok(())
    }
}

fn type_of(message: &Message) -> String {
    let header = |name: &str| message.header(name).map(|v| String::from_utf8_lossy(v).into_owned());
    match (header("type"), header("subtype")) {
        (Some(t), Some(s)) => format!("{t}/{s}"),
        (Some(t), None) => t,
        _ => "?".into(),
    }
}

static OFFSET: AtomicUsize = AtomicUsize::new(0);

/// An order message: `type` (and `subtype`) headers, `{"eventId": id, "orderId": order}`.
fn order(kind: &str, order: &str, id: &str) -> Message {
    let offset = OFFSET.fetch_add(1, Ordering::SeqCst) as i64;
    let message =
        Message::new("orders", 0, offset, format!(r#"{{"eventId":"{id}","orderId":"{order}","ticketId":"{order}"}}"#));
    match kind.split_once('/') {
        Some((t, s)) => message.with_header("type", t).with_header("subtype", s),
        None => message.with_header("type", kind),
    }
}

async fn inbox_on(pool: &sqlx::PgPool, sequences: &str, mode: InboxTransactions) -> SequentialInbox {
    let config = Config::new("orders", KeyExtractor::JsonPointer("/eventId".into()))
        .max_attempts(3)
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let inbox = InboxConfig::from_toml(sequences).unwrap().transactions(mode);
    SequentialInbox::new(Engine::new(pool.clone(), config).unwrap(), inbox).unwrap()
}

async fn setup(pool: &sqlx::PgPool) {
    idem::migrate(pool, &idem::Tables::default()).await.unwrap();
    pool.exec("CREATE TABLE handled (n bigserial, event_id text NOT NULL, message_type text NOT NULL)").await;
}

async fn handled(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT message_type FROM handled ORDER BY n").fetch_all(pool).await.unwrap()
}

async fn instance_status(pool: &sqlx::PgPool, sequence: &str, context: &str) -> String {
    sqlx::query_scalar("SELECT status FROM sequence_instance WHERE sequence_name = $1 AND context_id = $2")
        .bind(sequence)
        .bind(context)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn one(inbox: &SequentialInbox, message: Message, handler: &Log) -> InboxOutcome {
    inbox.process(vec![message], handler).await.unwrap()[0]
}

#[tokio::test]
async fn out_of_order_delivery_is_handled_in_the_declared_order_and_the_instance_closes() {
    for mode in [InboxTransactions::Shared, InboxTransactions::Separate] {
        let db = pg().await;
        setup(&db.pool).await;
        let inbox = inbox_on(&db.pool, SEQUENCES, mode).await;
        let log = Log::default();
        let outcomes = inbox
            .process(
                vec![
                    order("OrderShipped", "o1", "e4"),
                    order("OrderValidated/payment", "o1", "e3"),
                    order("OrderValidated/stock", "o1", "e2"),
                ],
                &log,
            )
            .await
            .unwrap();
        assert_eq!(outcomes, [InboxOutcome::Buffered; 3], "{mode:?}");
        assert!(handled(&db.pool).await.is_empty());
        assert_eq!(instance_status(&db.pool, "order", "o1").await, "OPEN");
        assert_eq!(one(&inbox, order("OrderCreated", "o1", "e1"), &log).await, InboxOutcome::Processed { released: 3 });
        assert_eq!(
            handled(&db.pool).await,
            ["OrderCreated", "OrderValidated/payment", "OrderValidated/stock", "OrderShipped"],
            "{mode:?}: released in arrival order once their conditions hold"
        );
        assert_eq!(instance_status(&db.pool, "order", "o1").await, "CLOSED");
        assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequenced_message WHERE status = 'PROCESSED'").await, 4);
        assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequential_inbox_idempotence").await, 4);
        // Processed messages keep their position, not their bytes.
        assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequenced_message WHERE payload IS NOT NULL").await, 0);
        let stats = inbox.stats();
        assert_eq!((stats.consumed, stats.buffered, stats.processed, stats.released), (4, 3, 1, 3));
    }
}

#[tokio::test]
async fn all_waits_for_every_predecessor_and_any_for_one() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    one(&inbox, order("OrderCreated", "o2", "a1"), &log).await;
    assert_eq!(one(&inbox, order("OrderShipped", "o2", "a2"), &log).await, InboxOutcome::Buffered);
    assert_eq!(
        one(&inbox, order("OrderValidated/stock", "o2", "a3"), &log).await,
        InboxOutcome::Processed { released: 0 }
    );
    assert_eq!(handled(&db.pool).await, ["OrderCreated", "OrderValidated/stock"], "`all` needs both validations");
    assert_eq!(
        one(&inbox, order("OrderValidated/payment", "o2", "a4"), &log).await,
        InboxOutcome::Processed { released: 1 }
    );

    assert_eq!(one(&inbox, order("TicketClosed", "t1", "b1"), &log).await, InboxOutcome::Buffered);
    assert_eq!(one(&inbox, order("TicketOpened", "t1", "b2"), &log).await, InboxOutcome::Processed { released: 0 });
    assert_eq!(one(&inbox, order("EscalatedByPhone", "t1", "b3"), &log).await, InboxOutcome::Processed { released: 1 });
    assert_eq!(handled(&db.pool).await.last().map(String::as_str), Some("TicketClosed"), "`any` needs one");
    assert_eq!(instance_status(&db.pool, "ticket", "t1").await, "OPEN", "EscalatedByMail is still to come");
    one(&inbox, order("EscalatedByMail", "t1", "b4"), &log).await;
    assert_eq!(instance_status(&db.pool, "ticket", "t1").await, "CLOSED");
}

#[tokio::test]
async fn duplicates_of_processed_and_waiting_messages_are_skipped() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    one(&inbox, order("OrderCreated", "o3", "d1"), &log).await;
    one(&inbox, order("OrderShipped", "o3", "d2"), &log).await;
    assert_eq!(one(&inbox, order("OrderCreated", "o3", "d1"), &log).await, InboxOutcome::Duplicate);
    assert_eq!(one(&inbox, order("OrderShipped", "o3", "d2"), &log).await, InboxOutcome::Duplicate);
    assert_eq!(log.calls.load(Ordering::SeqCst), 1);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequenced_message").await, 2);
    assert_eq!(inbox.stats().duplicates, 2);
}

#[tokio::test]
async fn thirty_two_concurrent_deliveries_of_one_message_call_the_handler_once() {
    let db = pg().await;
    setup(&db.pool).await;
    let log = std::sync::Arc::new(Log::default());
    *log.sleep.lock().unwrap() = Duration::from_millis(100);
    let message = order("OrderCreated", "o4", "c1");
    let mut tasks = Vec::new();
    for _ in 0..32 {
        // A pool of its own per delivery: separate connections, as separate consumers would have.
        let pool = idem::postgres::connect(&db.url, 2).await.unwrap();
        let inbox = inbox_on(&pool, SEQUENCES, InboxTransactions::Shared).await;
        let (log, message) = (log.clone(), message.clone());
        tasks.push(tokio::spawn(async move { inbox.process(vec![message], log.as_ref()).await.unwrap()[0] }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    let winners = outcomes.iter().filter(|o| matches!(o, InboxOutcome::Processed { .. })).count();
    assert_eq!(winners, 1, "{outcomes:?}");
    assert_eq!(outcomes.iter().filter(|o| **o == InboxOutcome::Duplicate).count(), 31);
    assert_eq!(log.calls.load(Ordering::SeqCst), 1);
    assert_eq!(handled(&db.pool).await.len(), 1);
}

#[tokio::test]
async fn a_waiting_delivery_takes_over_when_the_winner_rolls_back() {
    let db = pg().await;
    setup(&db.pool).await;
    let log = std::sync::Arc::new(Log::default());
    *log.sleep.lock().unwrap() = Duration::from_millis(300);
    log.flaky.lock().unwrap().insert("w1".into());
    let message = order("OrderCreated", "o5", "w1");
    let first = {
        let inbox =
            inbox_on(&idem::postgres::connect(&db.url, 2).await.unwrap(), SEQUENCES, InboxTransactions::Shared).await;
        let (log, message) = (log.clone(), message.clone());
        tokio::spawn(async move { inbox.process(vec![message], log.as_ref()).await.unwrap()[0] })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = {
        let inbox =
            inbox_on(&idem::postgres::connect(&db.url, 2).await.unwrap(), SEQUENCES, InboxTransactions::Shared).await;
        let (log, message) = (log.clone(), message.clone());
        tokio::spawn(async move { inbox.process(vec![message], log.as_ref()).await.unwrap()[0] })
    };
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    // The first fails (retryable) and rolls its claim back; the second, waiting on the claim, takes over and
    // commits; the first's retry then finds the claim committed.
    assert_eq!((first, second), (InboxOutcome::Duplicate, InboxOutcome::Processed { released: 0 }));
    assert_eq!(log.calls.load(Ordering::SeqCst), 2, "one rolled-back call, one committed call");
    assert_eq!(handled(&db.pool).await.len(), 1, "the effect is applied once");
}

#[tokio::test]
async fn a_buffered_message_failing_later_is_failed_and_a_resend_succeeds() {
    buffered_failure(InboxTransactions::Shared).await;
    buffered_failure(InboxTransactions::Separate).await;
}

async fn buffered_failure(mode: InboxTransactions) {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, mode).await;
    let log = Log::default();
    log.poisoned.lock().unwrap().insert("f2".into());
    assert_eq!(one(&inbox, order("OrderValidated/stock", "o6", "f2"), &log).await, InboxOutcome::Buffered);
    assert_eq!(one(&inbox, order("OrderCreated", "o6", "f1"), &log).await, InboxOutcome::Processed { released: 0 });
    assert_eq!(handled(&db.pool).await, ["OrderCreated"], "the failed message's effects were rolled back alone");
    let failed =
        db.pool.scalar("SELECT COUNT(*) FROM sequenced_message WHERE status = 'FAILED' AND error = 'poisoned'");
    assert_eq!(failed.await, 1);
    let claim = db.pool.scalar("SELECT COUNT(*) FROM sequential_inbox_idempotence WHERE idempotence_id = 'f2'");
    assert_eq!(claim.await, 0, "the claim went with the failure");
    assert_eq!(inbox.stats().failed, 1);

    log.poisoned.lock().unwrap().clear();
    assert_eq!(
        one(&inbox, order("OrderValidated/stock", "o6", "f2"), &log).await,
        InboxOutcome::Processed { released: 0 }
    );
    assert_eq!(handled(&db.pool).await, ["OrderCreated", "OrderValidated/stock"]);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequenced_message WHERE idempotence_id = 'f2'").await, 1);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequenced_message WHERE status = 'FAILED'").await, 0);
}

#[tokio::test]
async fn an_immediate_failure_rolls_the_claim_back_and_dead_letters_the_message() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    log.poisoned.lock().unwrap().insert("p1".into());
    assert_eq!(one(&inbox, order("OrderCreated", "o7", "p1"), &log).await, InboxOutcome::DeadLettered);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequential_inbox_idempotence").await, 0);
    let reason: String = sqlx::query_scalar("SELECT error FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert_eq!(reason, "`OrderCreated` p1: poisoned");
    assert!(handled(&db.pool).await.is_empty());
    log.poisoned.lock().unwrap().clear();
    assert_eq!(one(&inbox, order("OrderCreated", "o7", "p1"), &log).await, InboxOutcome::Processed { released: 0 });
}

#[tokio::test]
async fn two_consumers_creating_the_same_instance_share_one_row() {
    let db = pg().await;
    setup(&db.pool).await;
    let log = std::sync::Arc::new(Log::default());
    let mut tasks = Vec::new();
    for kind in ["OrderCreated", "OrderValidated/stock"] {
        let pool = idem::postgres::connect(&db.url, 2).await.unwrap();
        let inbox = inbox_on(&pool, SEQUENCES, InboxTransactions::Shared).await;
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..40 {
                let id = format!("{kind}-{n}");
                inbox.process(vec![order(kind, &format!("race-{n}"), &id)], log.as_ref()).await.unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequence_instance").await, 40);
    let both = "SELECT COUNT(*) FROM (SELECT sequence_instance_id FROM sequenced_message \
                GROUP BY 1 HAVING COUNT(*) = 2) x";
    assert_eq!(db.pool.scalar(both).await, 40, "each instance holds both messages");
    assert_eq!(handled(&db.pool).await.len(), 80, "every validation ran, before or after its creation");
}

#[tokio::test]
async fn housekeeping_deletes_expired_instances_with_their_claims_and_reports_waiting_messages() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    one(&inbox, order("TicketOpened", "t2", "h1"), &log).await;
    one(&inbox, order("TicketClosed", "t3", "h2"), &log).await; // waits for an escalation forever
    one(&inbox, order("OrderCreated", "o8", "h3"), &log).await; // retained 30 days
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let report = inbox.housekeep(&log).await.unwrap();
    assert_eq!((report.deleted, report.reported), (2, 1), "{report:?}");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequence_instance").await, 1);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequential_inbox_idempotence").await, 1, "claims cascade");
    let reason: String = sqlx::query_scalar("SELECT error FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("still WAITING") && reason.contains("`ticket`"), "{reason}");
    let payload: Vec<u8> = sqlx::query_scalar("SELECT payload FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(String::from_utf8_lossy(&payload).contains("\"ticketId\":\"t3\""), "the message's bytes are kept");
    // The retention boundary: with its history gone, a duplicate is handled as new.
    // The inbox remembered the deleted instance's id: the claim's foreign key finds it gone, and it is created anew.
    assert_eq!(one(&inbox, order("TicketOpened", "t2", "h1"), &log).await, InboxOutcome::Processed { released: 0 });
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequence_instance").await, 2);
}

#[tokio::test]
async fn recording_mode_handles_on_arrival_and_enforcement_starts_after() {
    let db = pg().await;
    setup(&db.pool).await;
    let log = Log::default();
    let mut config = InboxConfig::from_toml(SEQUENCES).unwrap();
    config.sequences[0].record_until = Some(SystemTime::now() + Duration::from_secs(3600));
    let engine_config = Config::new("orders", KeyExtractor::JsonPointer("/eventId".into()));
    let recording = SequentialInbox::new(Engine::new(db.pool.clone(), engine_config.clone()).unwrap(), config).unwrap();
    assert_eq!(one(&recording, order("OrderShipped", "o9", "r1"), &log).await, InboxOutcome::Recorded);
    assert_eq!(handled(&db.pool).await, ["OrderShipped"], "handled without its predecessors");
    assert_eq!(one(&recording, order("OrderShipped", "o9", "r1"), &log).await, InboxOutcome::Duplicate);

    let enforcing = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    assert_eq!(one(&enforcing, order("OrderValidated/stock", "o9", "r2"), &log).await, InboxOutcome::Buffered);
    assert_eq!(one(&enforcing, order("OrderCreated", "o9", "r3"), &log).await, InboxOutcome::Processed { released: 1 });
    assert_eq!(
        one(&enforcing, order("OrderValidated/payment", "o9", "r4"), &log).await,
        InboxOutcome::Processed { released: 0 }
    );
    assert_eq!(instance_status(&db.pool, "order", "o9").await, "CLOSED", "the recorded shipment counts");
}

#[tokio::test]
async fn unsequenced_messages_go_through_the_marker_path_and_misfits_are_dead_lettered() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    let unknown = order("InvoiceSent", "o10", "u1");
    let no_context = Message::new("orders", 0, 900, r#"{"eventId":"u2"}"#).with_header("type", "OrderCreated");
    let no_sub_type = order("OrderValidated", "o10", "u3");
    let outcomes = inbox.process(vec![unknown.clone(), no_context, no_sub_type, unknown], &log).await.unwrap();
    assert_eq!(
        outcomes,
        [
            InboxOutcome::Direct(Outcome::Processed),
            InboxOutcome::Direct(Outcome::Processed),
            InboxOutcome::DeadLettered,
            InboxOutcome::Direct(Outcome::Duplicate),
        ]
    );
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM processed_events").await, 2);
    let reason: String = sqlx::query_scalar("SELECT error FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("sequenced by sub-type"), "{reason}");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM sequence_instance").await, 0);
}

/// Only a change of the declared types leaves a complete instance OPEN (the claim transaction closes the instance
/// it completes): a housekeeping pass, which a run makes first, closes it.
#[tokio::test]
async fn housekeeping_closes_the_instances_a_change_of_the_declared_types_completed() {
    let db = pg().await;
    setup(&db.pool).await;
    let log = Log::default();
    let before = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    for (kind, id) in [("OrderCreated", "k1"), ("OrderValidated/stock", "k2"), ("OrderValidated/payment", "k3")] {
        one(&before, order(kind, "o12", id), &log).await;
    }
    one(&before, order("OrderCreated", "o13", "k4"), &log).await;
    assert_eq!(instance_status(&db.pool, "order", "o12").await, "OPEN", "OrderShipped is still to come");
    assert_eq!(before.housekeep(&log).await.unwrap().closed, 0, "nothing complete under these types");

    let shipped = "\n[[sequence.type]]\nname = \"OrderShipped\"";
    let cut = SEQUENCES.find(shipped).expect("the example declares OrderShipped");
    let end = SEQUENCES[cut + shipped.len()..].find("\n\n[").map_or(SEQUENCES.len(), |i| cut + shipped.len() + i);
    let without_shipping = format!("{}{}", &SEQUENCES[..cut], &SEQUENCES[end..]);
    let after = inbox_on(&db.pool, &without_shipping, InboxTransactions::Shared).await;
    let report = after.housekeep(&log).await.unwrap();
    assert_eq!(report.closed, 1, "{report:?}");
    assert_eq!(instance_status(&db.pool, "order", "o12").await, "CLOSED", "every type it now declares is processed");
    assert_eq!(instance_status(&db.pool, "order", "o13").await, "OPEN", "its validations are still to come");
    assert_eq!(after.housekeep(&log).await.unwrap().closed, 0);
}

#[tokio::test]
async fn an_operator_release_is_handled_by_the_next_housekeeping_pass() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let tables = idem::Tables::default();
    let log = Log::default();
    one(&inbox, order("OrderShipped", "o11", "s1"), &log).await;
    let id = admin::find(&db.pool, &tables, "order", "o11").await.unwrap().unwrap();
    let stuck = admin::ListFilter { stuck: true, ..Default::default() };
    assert_eq!(admin::list(&db.pool, &tables, &stuck, 10).await.unwrap()[0].waiting, 1);
    assert_eq!(admin::release(&db.pool, &tables, id, None).await.unwrap(), 1);
    let report = inbox.housekeep(&log).await.unwrap();
    assert_eq!(report.released, 1);
    assert_eq!(handled(&db.pool).await, ["OrderShipped"]);
    let (summary, messages) = admin::show(&db.pool, &tables, id).await.unwrap().unwrap();
    assert_eq!((summary.processed, summary.waiting), (1, 0));
    assert_eq!(messages[0].status, "PROCESSED");
    assert!(admin::close(&db.pool, &tables, id).await.unwrap());
    assert!(!admin::close(&db.pool, &tables, id).await.unwrap(), "already closed");
}

#[tokio::test]
async fn an_invalid_inbox_is_refused_before_anything_runs() {
    let db = pg().await;
    let config = Config::new("orders", KeyExtractor::JsonPointer("/eventId".into()));
    let engine = Engine::new(db.pool.clone(), config).unwrap();
    let no_sub_type_field = SEQUENCES.replace("sub_type = \"header:subtype\"\n", "");
    assert_ne!(no_sub_type_field, SEQUENCES);
    let error = InboxConfig::from_toml(&no_sub_type_field).unwrap_err().to_string();
    assert!(error.contains("`sub_type`"), "{error}");
    let error = SequentialInbox::new(engine, InboxConfig::new()).err().unwrap().to_string();
    assert!(error.contains("no sequence"), "{error}");
}

#[tokio::test]
async fn historical_duplicate_rows_do_not_block_the_lookup() {
    let db = pg().await;
    setup(&db.pool).await;
    // Rows written before claims existed, twice for one message: the index on idempotence_id is not unique.
    db.pool
        .exec(
            "INSERT INTO sequence_instance (sequence_name, context_id, retain_until) VALUES ('order', 'o12', now() + interval '1 day');
             INSERT INTO sequenced_message (sequence_instance_id, message_type, idempotence_id, status, topic, partition, \"offset\", headers)
             SELECT id, 'OrderCreated', 'old1', 'PROCESSED', 'orders', 0, n, '[]' FROM sequence_instance, generate_series(1, 2) n;",
        )
        .await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    assert_eq!(one(&inbox, order("OrderCreated", "o12", "old1"), &log).await, InboxOutcome::Duplicate);
    assert_eq!(log.calls.load(Ordering::SeqCst), 0);
    assert_eq!(
        one(&inbox, order("OrderValidated/stock", "o12", "new1"), &log).await,
        InboxOutcome::Processed { released: 0 }
    );
}

#[tokio::test]
async fn messages_of_one_context_delivered_at_once_queue_on_the_instance_without_deadlocks() {
    let db = pg().await;
    setup(&db.pool).await;
    let deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()";
    let log = std::sync::Arc::new(Log::default());
    *log.sleep.lock().unwrap() = Duration::from_millis(20);
    let first = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    one(&first, order("OrderCreated", "o13", "k0"), &log).await;
    let mut tasks = Vec::new();
    for n in 1..=8 {
        let pool = idem::postgres::connect(&db.url, 2).await.unwrap();
        let inbox = inbox_on(&pool, SEQUENCES, InboxTransactions::Shared).await;
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            inbox.process(vec![order("OrderValidated/stock", "o13", &format!("k{n}"))], log.as_ref()).await.unwrap()[0]
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), InboxOutcome::Processed { released: 0 });
    }
    db.pool.exec("SELECT pg_stat_force_next_flush()").await;
    assert_eq!(db.pool.scalar(deadlocks).await, 0, "claimers waiting for one instance deadlocked");
    assert_eq!(handled(&db.pool).await.len(), 9);
}

#[tokio::test]
async fn a_handler_that_swallows_an_error_dead_letters_its_message_and_the_consumer_goes_on() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    log.swallow.lock().unwrap().insert("x1".into());
    let outcomes = inbox
        .process(vec![order("OrderCreated", "o14", "x1"), order("OrderCreated", "o15", "x2")], &log)
        .await
        .unwrap();
    assert_eq!(outcomes, [InboxOutcome::DeadLettered, InboxOutcome::Processed { released: 0 }]);
    let reason: String = sqlx::query_scalar("SELECT error FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("aborted by an earlier error") && reason.contains("savepoint"), "{reason}");
    assert_eq!(handled(&db.pool).await.len(), 1);
}

/// A released message whose handler ends the transaction itself took the releasing transaction with it: the
/// attempt fails as a whole (the delivered message is dead-lettered, naming the released one), nothing is recorded
/// as done, and the released message stays WAITING.
#[tokio::test]
async fn a_released_handler_that_ends_the_transaction_fails_the_whole_attempt() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    log.end.lock().unwrap().insert("r2".into());
    assert_eq!(one(&inbox, order("OrderValidated/stock", "o20", "r2"), &log).await, InboxOutcome::Buffered);
    assert_eq!(one(&inbox, order("OrderCreated", "o20", "r1"), &log).await, InboxOutcome::DeadLettered);
    let reason: String = sqlx::query_scalar("SELECT error FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("ended the transaction itself") && reason.contains("r2"), "{reason}");
    let states: Vec<String> =
        sqlx::query_scalar("SELECT status FROM sequenced_message ORDER BY id").fetch_all(&db.pool).await.unwrap();
    assert_eq!(states, ["WAITING"], "the released message is neither FAILED nor PROCESSED");
    assert!(handled(&db.pool).await.is_empty(), "nothing of the attempt was kept");
}

/// A handler that ends the claim's transaction and writes again in one of its own (`ROLLBACK; BEGIN`) cannot
/// commit those writes as if they were the message's: its transaction lacks the claim's mark, the check before
/// `COMMIT` fails it, and the message is dead-lettered with the reason; a later delivery that behaves is handled
/// once. Both where the check rides on `COMMIT` and where it runs before a release.
#[tokio::test]
async fn a_handler_that_rolls_back_begins_and_writes_commits_nothing() {
    let db = pg().await;
    setup(&db.pool).await;
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    let log = Log::default();
    log.restart.lock().unwrap().insert("y1".into());
    assert_eq!(one(&inbox, order("OrderCreated", "o22", "y1"), &log).await, InboxOutcome::DeadLettered);
    assert!(handled(&db.pool).await.is_empty(), "the handler's own transaction was not committed");
    let reason: String = sqlx::query_scalar("SELECT error FROM dead_letters").fetch_one(&db.pool).await.unwrap();
    assert!(reason.contains("ended the transaction"), "{reason}");
    log.restart.lock().unwrap().clear();
    assert_eq!(one(&inbox, order("OrderCreated", "o22", "y1"), &log).await, InboxOutcome::Processed { released: 0 });
    assert_eq!(handled(&db.pool).await.len(), 1);

    // The check before a release: a WAITING message is there to release after the handler.
    assert_eq!(one(&inbox, order("OrderValidated/stock", "o23", "y3"), &log).await, InboxOutcome::Buffered);
    log.restart.lock().unwrap().insert("y2".into());
    assert_eq!(one(&inbox, order("OrderCreated", "o23", "y2"), &log).await, InboxOutcome::DeadLettered);
    assert_eq!(handled(&db.pool).await.len(), 1, "nothing of the attempt was kept");
    let states: Vec<String> = sqlx::query_scalar(
        "SELECT m.status FROM sequenced_message m JOIN sequence_instance i ON i.id = m.sequence_instance_id
          WHERE i.context_id = 'o23'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(states, ["WAITING"]);
}

/// The claim, the instance's lock and the read of its state share one statement, whose snapshot is taken before
/// the lock is granted: when another holder of the lock commits a buffered message in between, the state is read
/// again under the lock, so that message is released with its predecessor instead of being left waiting.
#[tokio::test]
async fn a_message_buffered_by_another_holder_of_the_lock_meanwhile_is_released() {
    let db = pg().await;
    setup(&db.pool).await;
    let log = std::sync::Arc::new(Log::default());
    let inbox = inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await;
    // A buffered message of another order: the row the other holder writes is a copy of it.
    assert_eq!(one(&inbox, order("OrderValidated/stock", "o31", "w31"), &log).await, InboxOutcome::Buffered);
    let instance: i64 = sqlx::query_scalar(
        "INSERT INTO sequence_instance (sequence_name, context_id, retain_until)
         VALUES ('order', 'o30', now() + interval '1 day') RETURNING id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    // The other holder: it takes the lock as idem does and buffers o30's OrderValidated/stock.
    let mut holder = db.pool.begin().await.unwrap();
    for sql in [
        "UPDATE sequence_instance SET version = version + 1 WHERE id = $1",
        r#"INSERT INTO sequenced_message (sequence_instance_id, message_type, idempotence_id, status, topic, partition,
                                          "offset", key, payload, headers)
           SELECT $1, message_type, 'w30', status, topic, partition, "offset", key, payload, headers
             FROM sequenced_message WHERE idempotence_id = 'w31'"#,
        "INSERT INTO sequential_inbox_idempotence (message_type, idempotence_id, sequence_instance_id, created_at)
         SELECT message_type, 'w30', $1, now() FROM sequential_inbox_idempotence WHERE idempotence_id = 'w31'",
    ] {
        sqlx::query(sql).bind(instance).execute(&mut *holder).await.unwrap();
    }
    let created = {
        let (inbox, log) = (inbox_on(&db.pool, SEQUENCES, InboxTransactions::Shared).await, log.clone());
        tokio::spawn(async move { inbox.process(vec![order("OrderCreated", "o30", "c30")], log.as_ref()).await })
    };
    // The OrderCreated's statement has taken its snapshot and waits for the lock.
    let waiting = "SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let mut waited = 0;
    while db.pool.scalar(waiting).await == 0 {
        waited += 1;
        assert!(waited < 500, "the OrderCreated never waited for the instance's lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.commit().await.unwrap();
    assert_eq!(created.await.unwrap().unwrap(), [InboxOutcome::Processed { released: 1 }]);
    assert_eq!(handled(&db.pool).await, ["OrderCreated", "OrderValidated/stock"]);
}
