//! The ordering guards and the natural-key mode, on PostgreSQL, SQLite and MySQL/MariaDB: stale and newer versions, gaps,
//! declared transitions, start-up checks against the schema, and concurrent deliveries of one entity.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::TestPool;
use idem::guard::{Decision, Disallowed, Field, GapDecision, StateMachine, StateMachineSpec, Transition, VersionGuard};
use idem::{Config, Engine, Event, Handled, Handler, HandlerError, KeyExtractor, Message, Outcome};

const ORDERS: &str = "CREATE TABLE orders (id BIGINT PRIMARY KEY, status TEXT, total BIGINT, version BIGINT)";

fn config() -> Config {
    Config::new("orders", KeyExtractor::JsonPointer("/id".into()))
        .batch_size(1)
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
        .max_attempts(2)
}

/// An order event: `{"id", "order", "version", "type", "status", "total", "sleep_ms"}`.
fn order(offset: i64, order: i64, version: i64, kind: &str, total: i64) -> Message {
    let status = match kind {
        "OrderCreated" => "created",
        "OrderPaid" => "paid",
        _ => "cancelled",
    };
    Message::new(
        "orders",
        0,
        offset,
        format!(
            r#"{{"id":"o{order}-v{version}","order":{order},"version":{version},"type":"{kind}","status":"{status}","total":{total}}}"#
        ),
    )
}

fn with_sleep(message: Message, ms: u64) -> Message {
    let mut payload: serde_json::Value = serde_json::from_slice(&message.payload).expect("json");
    payload["sleep_ms"] = ms.into();
    Message::new(message.topic, message.partition, message.offset, payload.to_string())
}

#[allow(clippy::large_enum_variant)] // one per test
enum Guard<DB> {
    Version(VersionGuard<DB>),
    States(StateMachine<DB>),
}

/// The handler under test: the guard, then the order's status and total.
struct Orders<DB>(Arc<Guard<DB>>);

#[derive(serde::Deserialize)]
struct Order {
    order: i64,
    status: String,
    total: i64,
    #[serde(default)]
    sleep_ms: u64,
}

macro_rules! orders_handler {
    ($db:ty, $conn:ty, $update:literal) => {
        impl Handler<$db> for Orders<$db> {
            async fn handle(&self, event: &Event, tx: &mut $conn) -> Result<(), HandlerError> {
                let decision = match &*self.0 {
                    Guard::Version(g) => g.check(event, tx).await?,
                    Guard::States(g) => g.check(event, tx).await?,
                };
                let o: Order = event.json()?;
                if o.sleep_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(o.sleep_ms)).await;
                }
                if decision == Decision::Skip {
                    return Ok(());
                }
                sqlx::query($update).bind(&o.status).bind(o.total).bind(o.order).execute(&mut *tx).await?;
                Ok(())
            }
        }
    };
}
orders_handler!(sqlx::Postgres, sqlx::PgConnection, "UPDATE orders SET status = $1, total = $2 WHERE id = $3");
orders_handler!(sqlx::Sqlite, sqlx::SqliteConnection, "UPDATE orders SET status = $1, total = $2 WHERE id = $3");
orders_handler!(sqlx::MySql, sqlx::MySqlConnection, "UPDATE orders SET status = ?, total = ? WHERE id = ?");

fn machine(on_disallowed: Disallowed, versioned: bool) -> StateMachineSpec {
    StateMachineSpec {
        table: "orders".into(),
        id_column: "id".into(),
        state_column: "status".into(),
        entity: Field::json("/order"),
        event_type: Field::json("/type"),
        initial: "none".into(),
        states: vec!["created".into(), "paid".into(), "cancelled".into()],
        types: vec!["OrderCreated".into(), "OrderPaid".into(), "OrderCancelled".into()],
        on_disallowed,
        version_column: versioned.then(|| "version".into()),
        version: versioned.then(|| Field::json("/version")),
        transitions: vec![
            Transition::new("none", "OrderCreated", "created"),
            Transition::new("created", "OrderPaid", "paid"),
            Transition::new("created", "OrderCancelled", "cancelled"),
            Transition::new("paid", "OrderCancelled", "cancelled"),
        ],
    }
}

async fn version_guard<DB: idem::guard::GuardStore>(pool: &sqlx::Pool<DB>) -> VersionGuard<DB> {
    VersionGuard::new(pool, "orders", "id", "version", Field::json("/order"), Field::json("/version"))
        .await
        .expect("version guard")
}

macro_rules! every_store {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test]
            async fn postgres() {
                let db = super::common::pg().await;
                super::$body(db.pool.clone()).await;
            }
            #[tokio::test]
            async fn sqlite() {
                let db = super::common::sqlite().await;
                super::$body(db.pool.clone()).await;
            }
            #[tokio::test]
            async fn mysql() {
                let db = super::common::mysql().await;
                super::$body(db.pool.clone()).await;
            }
        }
    };
}

async fn prepared<DB: idem::Backend>(pool: &sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
{
    idem::migrate(pool, &idem::Tables::default()).await.expect("migrate");
    pool.exec(ORDERS).await;
}

async fn row<P: TestPool>(pool: &P, order: i64) -> (i64, i64) {
    let version = pool.scalar(&format!("SELECT version FROM orders WHERE id = {order}")).await;
    let total = pool.scalar(&format!("SELECT total FROM orders WHERE id = {order}")).await;
    (version, total)
}

every_store!(version_guard_applies_newer_and_skips_stale, newer_and_stale);
async fn newer_and_stale<DB: idem::guard::GuardStore>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
    Orders<DB>: Handler<DB>,
{
    prepared(&pool).await;
    let handler = Orders(Arc::new(Guard::Version(version_guard(&pool).await)));
    let engine = Engine::new(pool.clone(), config()).expect("engine");
    // v1 creates the row, v2 moves it, v1 again (a duplicate), v3 and then a late v2 (a different event, stale).
    let messages = vec![
        order(0, 7, 1, "OrderCreated", 100),
        order(1, 7, 2, "OrderPaid", 200),
        order(2, 7, 1, "OrderCreated", 100),
        order(3, 7, 3, "OrderCancelled", 300),
        with_sleep(order(4, 7, 2, "OrderPaid", 999), 0),
    ];
    let mut late = messages[4].clone();
    late.payload =
        br#"{"id":"o7-v2-late","order":7,"version":2,"type":"OrderPaid","status":"paid","total":999}"#.to_vec();
    let mut outcomes = Vec::new();
    for m in messages.into_iter().take(4).chain([late]) {
        outcomes.extend(engine.process(vec![m], &handler).await.expect("process"));
    }
    assert_eq!(
        outcomes,
        [Outcome::Processed, Outcome::Processed, Outcome::Duplicate, Outcome::Processed, Outcome::Stale]
    );
    assert_eq!(row(&pool, 7).await, (3, 300), "the newest version's state stays");
    assert_eq!(engine.stats().stale, 1);
    // The stale event's marker committed: its redelivery is a plain duplicate.
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events WHERE event_id = 'o7-v2-late'").await, 1);
}

every_store!(version_gaps_go_to_the_hook, gaps);
async fn gaps<DB: idem::guard::GuardStore>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
    Orders<DB>: Handler<DB>,
{
    prepared(&pool).await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook_seen = seen.clone();
    let guard = version_guard(&pool).await.on_gap(move |gap| {
        hook_seen.lock().expect("lock").push((gap.current, gap.version));
        if gap.version - gap.current > 5 { GapDecision::DeadLetter } else { GapDecision::Apply }
    });
    let handler = Orders(Arc::new(Guard::Version(guard)));
    let engine = Engine::new(pool.clone(), config()).expect("engine");
    let mut outcomes = Vec::new();
    for m in [order(0, 1, 1, "OrderCreated", 1), order(1, 1, 3, "OrderPaid", 3), order(2, 1, 10, "OrderPaid", 10)] {
        outcomes.extend(engine.process(vec![m], &handler).await.expect("process"));
    }
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Processed, Outcome::DeadLettered]);
    assert_eq!(*seen.lock().expect("lock"), [(1, 3), (3, 10)]);
    assert_eq!(row(&pool, 1).await, (3, 3));
    let reason: String = pool.scalar_text("SELECT error FROM dead_letters WHERE event_id = 'o1-v10'").await;
    assert!(
        reason.contains("version gap") && reason.contains("at version 3") && reason.contains("version 10"),
        "{reason}"
    );
}

every_store!(bad_versions_and_ids_are_dead_lettered_with_the_field, bad_values);
async fn bad_values<DB: idem::guard::GuardStore>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
    Orders<DB>: Handler<DB>,
{
    prepared(&pool).await;
    let handler = Orders(Arc::new(Guard::Version(version_guard(&pool).await)));
    let engine = Engine::new(pool.clone(), config()).expect("engine");
    let bad = [
        r#"{"id":"a","order":1,"version":"two","type":"OrderPaid","status":"paid","total":1}"#,
        r#"{"id":"b","order":"x1","version":2,"type":"OrderPaid","status":"paid","total":1}"#,
        r#"{"id":"c","order":1,"type":"OrderPaid","status":"paid","total":1}"#,
    ];
    let messages = bad.iter().enumerate().map(|(i, p)| Message::new("orders", 0, i as i64, *p)).collect();
    let outcomes = engine.process(messages, &handler).await.expect("process");
    assert_eq!(outcomes, [Outcome::DeadLettered; 3]);
    for (id, expected) in [
        ("a", "version (json:/version) is \"two\", not an integer"),
        ("b", "entity id (json:/order) is \"x1\", not an integer"),
        ("c", "version (json:/version) points at nothing"),
    ] {
        let reason = pool.scalar_text(&format!("SELECT error FROM dead_letters WHERE event_id = '{id}'")).await;
        assert!(reason.contains(expected), "{id}: {reason}");
    }
}

every_store!(state_machine_rejects_what_the_state_does_not_allow, transitions);
async fn transitions<DB: idem::guard::GuardStore>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
    Orders<DB>: Handler<DB>,
{
    prepared(&pool).await;
    let spec = machine(Disallowed::Reject, false);
    let handler = Orders(Arc::new(Guard::States(StateMachine::new(&pool, spec).await.expect("machine"))));
    let engine = Engine::new(pool.clone(), config()).expect("engine");
    // Paid before created (rejected), created, cancelled, then paid after cancelled (rejected), and a type the
    // machine does not know (dead-lettered, naming it: a mistake in the declaration, to replay once fixed).
    let mut messages = vec![
        order(0, 5, 2, "OrderPaid", 50),
        order(1, 5, 1, "OrderCreated", 10),
        order(2, 5, 3, "OrderCancelled", 30),
        order(3, 5, 4, "OrderPaid", 40),
    ];
    messages.push(Message::new(
        "orders",
        0,
        4,
        r#"{"id":"o5-refund","order":5,"version":5,"type":"OrderRefunded","status":"x","total":0}"#,
    ));
    let mut outcomes = Vec::new();
    for m in messages {
        outcomes.extend(engine.process(vec![m], &handler).await.expect("process"));
    }
    assert_eq!(
        outcomes,
        [Outcome::Rejected, Outcome::Processed, Outcome::Processed, Outcome::Rejected, Outcome::DeadLettered]
    );
    assert_eq!(pool.scalar("SELECT total FROM orders WHERE id = 5").await, 30);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM orders WHERE status = 'cancelled'").await, 1);
    assert_eq!(engine.stats().rejected, 2);
    let reason = pool.scalar_text("SELECT error FROM dead_letters WHERE event_id = 'o5-refund'").await;
    assert!(reason.contains("event type `OrderRefunded` is not declared") && reason.contains("replay"), "{reason}");

    // Dead-lettered instead, by configuration, with the state and what it allows.
    let spec = machine(Disallowed::DeadLetter, false);
    let handler = Orders(Arc::new(Guard::States(StateMachine::new(&pool, spec).await.expect("machine"))));
    let outcomes = engine.process(vec![order(9, 5, 6, "OrderPaid", 60)], &handler).await.expect("process");
    assert_eq!(outcomes, [Outcome::DeadLettered]);
    let reason = pool.scalar_text("SELECT error FROM dead_letters WHERE event_id = 'o5-v6'").await;
    assert!(
        reason.contains("`OrderPaid` is not allowed in state `cancelled`") && reason.contains("allowed there: none"),
        "{reason}"
    );
}

every_store!(state_machine_with_versions_skips_stale_events, versioned_machine);
async fn versioned_machine<DB: idem::guard::GuardStore>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
    Orders<DB>: Handler<DB>,
{
    prepared(&pool).await;
    let handler =
        Orders(Arc::new(Guard::States(StateMachine::new(&pool, machine(Disallowed::Reject, true)).await.expect("m"))));
    let engine = Engine::new(pool.clone(), config()).expect("engine");
    let mut outcomes = Vec::new();
    let mut late = order(2, 3, 2, "OrderCancelled", 9);
    late.payload =
        br#"{"id":"o3-late","order":3,"version":2,"type":"OrderCancelled","status":"cancelled","total":9}"#.to_vec();
    for m in [order(0, 3, 1, "OrderCreated", 1), order(1, 3, 2, "OrderPaid", 2), late] {
        outcomes.extend(engine.process(vec![m], &handler).await.expect("process"));
    }
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Processed, Outcome::Stale]);
    assert_eq!(row(&pool, 3).await, (2, 2));
}

every_store!(guards_are_checked_against_the_schema_at_start_up, schema_checks);
async fn schema_checks<DB: idem::guard::GuardStore>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
{
    prepared(&pool).await;
    pool.exec("CREATE TABLE loose (id BIGINT, version BIGINT, note TEXT NOT NULL, v TEXT)").await;
    let err = |r: Result<VersionGuard<DB>, idem::Error>| r.expect_err("must be refused").to_string();
    let json = Field::json;
    let cases = [
        (
            err(VersionGuard::new(&pool, "missing", "id", "version", json("/order"), json("/version")).await),
            "table `missing` does not exist",
        ),
        (
            err(VersionGuard::new(&pool, "orders", "id", "revision", json("/order"), json("/version")).await),
            "the version column `revision` is not a column of `orders` (its columns: id, status, total, version)",
        ),
        (
            err(VersionGuard::new(&pool, "loose", "id", "v", json("/order"), json("/version")).await),
            "not an integer type",
        ),
        (
            err(VersionGuard::new(&pool, "loose", "id", "version", json("/order"), json("/version")).await),
            "is neither the primary key nor alone under a unique index",
        ),
        (
            err(VersionGuard::new(&pool, "Orders; DROP", "id", "version", json("/order"), json("/version")).await),
            "is not a plain lower-case name",
        ),
    ];
    for (message, expected) in cases {
        assert!(message.contains(expected), "{message}\nexpected: {expected}");
    }
    pool.exec("CREATE UNIQUE INDEX loose_id ON loose (id)").await;
    let message = err(VersionGuard::new(&pool, "loose", "id", "version", json("/order"), json("/version")).await);
    assert!(message.contains("note is NOT NULL without a default"), "{message}");

    let mut spec = machine(Disallowed::Reject, false);
    spec.state_column = "state".into();
    let message = StateMachine::new(&pool, spec).await.expect_err("no such column").to_string();
    assert!(message.contains("the state column `state` is not a column of `orders`"), "{message}");
}

#[test]
fn state_machine_declarations_are_validated() {
    let check = |edit: &dyn Fn(&mut StateMachineSpec), expected: &str| {
        let mut spec = machine(Disallowed::Reject, false);
        edit(&mut spec);
        let message = spec.validate().expect_err(expected).to_string();
        assert!(message.contains(expected), "{message}\nexpected: {expected}");
    };
    check(&|s| s.transitions.push(Transition::new("shipped", "OrderPaid", "paid")), "unknown state `shipped`");
    check(
        &|s| s.transitions.push(Transition::new("paid", "OrderShipped", "paid")),
        "unknown event type `OrderShipped`",
    );
    check(&|s| s.states.push("archived".into()), "state `archived` is unreachable from `none`");
    check(&|s| s.types.push("OrderShipped".into()), "event type `OrderShipped` has no transition");
    check(&|s| s.transitions.push(Transition::new("created", "OrderPaid", "cancelled")), "already goes to `paid`");
    check(&|s| s.version = Some(Field::json("/v")), "`version_column` and `version` go together");
    assert!(machine(Disallowed::Reject, true).validate().is_ok());

    let toml = r#"
        table = "orders"
        state_column = "status"
        entity = "json:/order"
        event_type = "header:type"
        states = ["open"]
        types = ["Opened"]
        on_disallowed = "dead-letter"
        [[transition]]
        from = "none"
        on = "Opened"
        to = "open"
    "#;
    let spec = StateMachineSpec::from_toml(toml).expect("parses");
    assert_eq!(spec.on_disallowed, Disallowed::DeadLetter);
    assert_eq!(spec.event_type, Field::header("type"));
    let message =
        StateMachineSpec::from_toml(&toml.replace("on_disallowed", "on_disalowed")).expect_err("typo").to_string();
    assert!(message.contains("unknown field `on_disalowed`") && message.contains("line 8"), "{message}");
    let message =
        StateMachineSpec::from_toml(&toml.replace("json:/order", "jsn:/order")).expect_err("field").to_string();
    assert!(message.contains("field `jsn:/order`: use `json:/pointer`"), "{message}");
}

/// Two deliveries of different versions of one entity in two transactions at once: whichever commits first, the
/// newer version's state is what stays.
async fn newer_wins<DB: idem::guard::GuardStore>(pool: sqlx::Pool<DB>, versioned_machine: bool)
where
    sqlx::Pool<DB>: TestPool,
    Orders<DB>: Handler<DB>,
{
    prepared(&pool).await;
    pool.exec("INSERT INTO orders (id, status, total, version) VALUES (1, 'created', 1, 1), (2, 'created', 1, 1)")
        .await;
    let guard = if versioned_machine {
        Guard::States(StateMachine::new(&pool, machine(Disallowed::Reject, true)).await.expect("machine"))
    } else {
        Guard::Version(version_guard(&pool).await)
    };
    let handler = Orders(Arc::new(guard));
    let engine = Engine::new(pool.clone(), config()).expect("engine");
    // Order 1: the newer version takes the row first and holds it; order 2: the older one does.
    for (entity, first, second) in [(1, 3, 2), (2, 2, 3)] {
        let kind = |v: i64| if v == 2 { "OrderPaid" } else { "OrderCancelled" };
        let held = with_sleep(order(0, entity, first, kind(first), first * 100), 300);
        let waiting = order(1, entity, second, kind(second), second * 100);
        let (a, b) = tokio::join!(engine.process(vec![held], &handler), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            engine.process(vec![waiting], &handler).await
        });
        let (a, b) = (a.expect("first"), b.expect("second"));
        assert_eq!(row(&pool, entity).await, (3, 300), "order {entity}: {a:?} {b:?}");
        let expected = if first == 3 { [Outcome::Processed, Outcome::Stale] } else { [Outcome::Processed; 2] };
        assert_eq!([a[0], b[0]], expected, "order {entity}");
    }
}

mod concurrent_versions {
    #[tokio::test]
    async fn postgres_version_guard() {
        let db = super::common::pg().await;
        super::newer_wins(db.pool.clone(), false).await;
    }
    #[tokio::test]
    async fn postgres_state_machine() {
        let db = super::common::pg().await;
        super::newer_wins(db.pool.clone(), true).await;
    }
    #[tokio::test]
    async fn sqlite_version_guard() {
        let db = super::common::sqlite().await;
        super::newer_wins(db.pool.clone(), false).await;
    }
    #[tokio::test]
    async fn sqlite_state_machine() {
        let db = super::common::sqlite().await;
        super::newer_wins(db.pool.clone(), true).await;
    }
    #[tokio::test]
    async fn mysql_version_guard() {
        let db = super::common::mysql().await;
        super::newer_wins(db.pool.clone(), false).await;
    }
    #[tokio::test]
    async fn mysql_state_machine() {
        let db = super::common::mysql().await;
        super::newer_wins(db.pool.clone(), true).await;
    }
}

/// The natural-key mode's handler: one insert under the order's id; `AlreadyApplied` when it found the row.
struct CreateOrder;

#[derive(serde::Deserialize)]
struct NewOrder {
    order: i64,
    total: i64,
    #[serde(default)]
    sleep_ms: u64,
}

macro_rules! create_order {
    ($db:ty, $conn:ty) => {
        impl Handler<$db> for CreateOrder {
            async fn handle(&self, event: &Event, tx: &mut $conn) -> Result<(), HandlerError> {
                let o: NewOrder = event.json()?;
                let inserted = sqlx::query(
                    "INSERT INTO orders (id, status, total, version) VALUES ($1, 'created', $2, 1) ON CONFLICT (id) DO NOTHING",
                )
                .bind(o.order)
                .bind(o.total)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                tokio::time::sleep(Duration::from_millis(o.sleep_ms)).await;
                if inserted == 0 {
                    event.mark(Handled::AlreadyApplied);
                }
                Ok(())
            }
        }
    };
}
create_order!(sqlx::Postgres, sqlx::PgConnection);
create_order!(sqlx::Sqlite, sqlx::SqliteConnection);

/// On MySQL the natural key's insert is a plain one: a duplicate fails with 1062 (after waiting for a concurrent
/// holder of the key to commit), and InnoDB undoes that statement alone, so the handler carries on.
impl Handler<sqlx::MySql> for CreateOrder {
    async fn handle(&self, event: &Event, tx: &mut sqlx::MySqlConnection) -> Result<(), HandlerError> {
        let o: NewOrder = event.json()?;
        let inserted = sqlx::query("INSERT INTO orders (id, status, total, version) VALUES (?, 'created', ?, 1)")
            .bind(o.order)
            .bind(o.total)
            .execute(&mut *tx)
            .await;
        tokio::time::sleep(Duration::from_millis(o.sleep_ms)).await;
        match inserted {
            Ok(_) => Ok(()),
            Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
                event.mark(Handled::AlreadyApplied);
                Ok(())
            }
            Err(error) => Err(error.into()),
        }
    }
}

every_store!(natural_key_mode_writes_no_marker_and_counts_duplicates, natural_key);
async fn natural_key<DB: idem::Backend>(pool: sqlx::Pool<DB>)
where
    sqlx::Pool<DB>: TestPool,
    CreateOrder: Handler<DB>,
{
    prepared(&pool).await;
    let engine = Engine::new(pool.clone(), config().natural_key()).expect("engine");
    let first = order(0, 8, 1, "OrderCreated", 80);
    // The same business event republished in a new envelope (another message id): the natural key catches it.
    let mut again = order(1, 8, 1, "OrderCreated", 80);
    again.payload = br#"{"id":"other-envelope","order":8,"version":1,"total":80}"#.to_vec();
    let mut outcomes = Vec::new();
    for m in [first.clone(), first, again] {
        outcomes.extend(engine.process(vec![m], &CreateOrder).await.expect("process"));
    }
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Duplicate, Outcome::Duplicate]);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM orders").await, 1);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events").await, 0, "no marker rows");
    let stats = engine.stats();
    assert_eq!((stats.processed, stats.duplicate), (1, 2));

    // Concurrent deliveries of one event: one inserts, the others wait on its row and find it.
    let event = with_sleep(order(5, 9, 1, "OrderCreated", 90), 200);
    let runs = (0..4).map(|_| engine.process(vec![event.clone()], &CreateOrder));
    let outcomes: Vec<Outcome> =
        futures_util::future::join_all(runs).await.into_iter().flat_map(|r| r.expect("process")).collect();
    assert_eq!(outcomes.iter().filter(|o| **o == Outcome::Processed).count(), 1, "{outcomes:?}");
    assert_eq!(outcomes.iter().filter(|o| **o == Outcome::Duplicate).count(), 3, "{outcomes:?}");
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM orders WHERE id = 9").await, 1);
}

#[tokio::test]
async fn the_sequential_inbox_refuses_the_natural_key_mode() {
    let db = common::pg().await;
    let engine = Engine::new(db.pool.clone(), config().natural_key()).expect("engine");
    let inbox = idem::inbox::InboxConfig::from_toml(
        "[[sequence]]\nname = \"s\"\nretention = \"1d\"\n[[sequence.type]]\nname = \"A\"\ncontext_id = \"json:/c\"\n\
         [[sequence.type]]\nname = \"B\"\ncontext_id = \"json:/c\"\nrelease = { predecessor = \"A\" }\n",
    )
    .expect("inbox config");
    let message = idem::inbox::SequentialInbox::new(engine, inbox).err().expect("refused").to_string();
    assert!(message.contains("natural-key mode"), "{message}");
}

/// An id longer than a `varchar(n)` id column is refused (22001), never cut short onto another entity's row.
#[tokio::test]
async fn a_long_id_is_not_cut_to_the_column_length() {
    let db = common::pg().await;
    idem::migrate(&db.pool, &idem::Tables::default()).await.expect("migrate");
    db.pool.exec("CREATE TABLE short_ids (id varchar(3) PRIMARY KEY, version bigint)").await;
    let guard = VersionGuard::new(&db.pool, "short_ids", "id", "version", Field::json("/e"), Field::json("/v"))
        .await
        .expect("guard");
    struct Guarded(VersionGuard<sqlx::Postgres>);
    impl Handler<sqlx::Postgres> for Guarded {
        async fn handle(&self, event: &Event, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
            let _ = self.0.check(event, tx).await?;
            Ok(())
        }
    }
    let engine = Engine::new(db.pool.clone(), config()).expect("engine");
    let messages = vec![
        Message::new("t", 0, 0, r#"{"id":"a","e":"abc","v":1}"#),
        Message::new("t", 0, 1, r#"{"id":"b","e":"abcdef","v":5}"#),
    ];
    let outcomes = engine.process(messages, &Guarded(guard)).await.expect("process");
    assert_eq!(outcomes, [Outcome::Processed, Outcome::DeadLettered]);
    assert_eq!(db.pool.scalar("SELECT version FROM short_ids WHERE id = 'abc'").await, 1, "abc keeps its version");
}

/// In the natural-key mode two different events under one extracted key in one batch both reach the handler.
#[tokio::test]
async fn natural_key_mode_hands_every_message_of_a_batch_to_the_handler() {
    let db = common::sqlite().await;
    prepared(&db.pool).await;
    let engine = Engine::new(db.pool.clone(), config().natural_key().batch_size(10)).expect("engine");
    // Both keyed by the order (`/id` is the same), different orders inside.
    let messages = vec![
        Message::new("orders", 0, 0, r#"{"id":"same","order":1,"total":10}"#),
        Message::new("orders", 0, 1, r#"{"id":"same","order":2,"total":20}"#),
        Message::new("orders", 0, 2, r#"{"id":"same","order":1,"total":10}"#),
    ];
    let outcomes = engine.process(messages, &CreateOrder).await.expect("process");
    assert_eq!(outcomes, [Outcome::Processed, Outcome::Processed, Outcome::Duplicate]);
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM orders").await, 2);
}
