//! The Rust snippets of README.md and docs/*.md, each compiled as a doc test (`no_run`: they need a database or a
//! broker) with the lines a page leaves out (imports, the handler, the function around a fragment) hidden. The
//! test `doc_snippets` holds every snippet of the pages to its copy here, so a page cannot show code that does
//! not compile. Changing a snippet: change it in both places.

/// `README.md`, snippet 1.
///
/// ```no_run
/// use idem::embedded::{ConsumerOptions, EmbeddedLog};
/// use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
/// use sqlx::SqliteConnection;
///
/// struct Credit;
///
/// impl Handler<sqlx::Sqlite> for Credit {
///     // `tx` is the transaction idem opened; the event's marker is already in it. The handler cannot commit,
///     // roll back or reach idem's pool: every write it makes commits or rolls back with the marker.
///     async fn handle(&self, event: &Event, tx: &mut SqliteConnection) -> Result<(), HandlerError> {
///         #[derive(serde::Deserialize)]
///         struct Payment { account: i64, amount: i64 }
///         let p: Payment = event.json()?; // does not decode: dead-lettered with the reason
///         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///             .bind(p.amount)
///             .bind(p.account)
///             .execute(&mut *tx)
///             .await?; // 40001, 40P01, lost connection: retried; anything else: dead-lettered
///         Ok(())
///     }
/// }
///
/// #[tokio::main]
/// async fn main() -> Result<(), idem::Error> {
///     let pool = idem::sqlite::connect("sqlite://ledger.db").await?;
///     let config = Config::new("ledger-writer", KeyExtractor::JsonPointer("/idempotencyKey".into()));
///     idem::migrate(&pool, &config.tables).await?;
///     let log = EmbeddedLog::open("events")?;
///     let source = log.consumer("ledger-writer", &["payments"], ConsumerOptions::default())?;
///     Engine::new(pool, config)?.run(source, Credit, tokio::signal::ctrl_c()).await?;
///     Ok(())
/// }
/// ```
pub struct ReadmeSnippet1;

/// `docs/brokers.md`, snippet 1.
///
/// ```no_run
/// # use std::time::Duration;
/// # use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
/// # use idem::kafka::{KafkaConfig, KafkaSource};
/// # struct Credit;
/// # impl Handler<sqlx::Postgres> for Credit {
/// #     async fn handle(&self, _: &Event, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # async fn consume(pool: sqlx::PgPool, shutdown: impl Future + Send) -> Result<(), idem::Error> {
/// let config = Config::new("ledger-writer", KeyExtractor::Header("idem-event-id".into()))
///     .marker_retention(Duration::from_secs(8 * 86_400));       // checked against the topic's retention.ms
/// let kafka = KafkaConfig::new("127.0.0.1:9092", &["payments"]);
/// let source = KafkaSource::connect(&kafka, &config).await?;  // refuses enable.auto.commit=true, runs the retention guard
/// Engine::new(pool, config)?.run(source, Credit, shutdown).await?;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "kafka")]
pub struct BrokersSnippet1;

/// `docs/brokers.md`, snippet 2.
///
/// ```no_run
/// # use std::time::Duration;
/// # use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
/// # use idem::nats::{NatsConfig, NatsSource};
/// # struct Credit;
/// # impl Handler<sqlx::Postgres> for Credit {
/// #     async fn handle(&self, _: &Event, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # async fn consume(pool: sqlx::PgPool, shutdown: impl Future + Send) -> Result<(), idem::Error> {
/// let config = Config::new("ledger-writer", KeyExtractor::Header("idem-event-id".into()))
///     .marker_retention(Duration::from_secs(8 * 86_400));       // checked against the stream's max_age
/// let nats = NatsConfig::new("nats://127.0.0.1:4222", "payments");
/// let source = NatsSource::connect(&nats, &config).await?;     // refuses AckPolicy none/all and a short AckWait
/// Engine::new(pool, config)?.run(source, Credit, shutdown).await?;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "nats")]
pub struct BrokersSnippet2;

/// `docs/brokers.md`, snippet 3.
///
/// ```no_run
/// # use std::time::Duration;
/// # use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
/// # use idem::rabbitmq::{RabbitConfig, RabbitSource};
/// # struct Credit;
/// # impl Handler<sqlx::Postgres> for Credit {
/// #     async fn handle(&self, _: &Event, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # async fn consume(pool: sqlx::PgPool, shutdown: impl Future + Send) -> Result<(), idem::Error> {
/// # let config = Config::new("ledger-writer", KeyExtractor::Header("idem-event-id".into()));
/// let rabbit = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", &["payments-0", "payments-1"]);
/// let source = RabbitSource::connect(&rabbit, &config).await?;  // refuses no_ack, names a missing queue
/// Engine::new(pool, config)?.run(source, Credit, shutdown).await?;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "rabbitmq")]
pub struct BrokersSnippet3;

/// `docs/brokers.md`, snippet 4.
///
/// ```no_run
/// # use std::time::Duration;
/// # use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
/// # use idem::sqs::{SqsConfig, SqsSource};
/// # struct Credit;
/// # impl Handler<sqlx::Postgres> for Credit {
/// #     async fn handle(&self, _: &Event, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # async fn consume(pool: sqlx::PgPool, shutdown: impl Future + Send) -> Result<(), idem::Error> {
/// # let config = Config::new("ledger-writer", KeyExtractor::Header("idem-event-id".into()));
/// let sqs = SqsConfig { max_batch_time: Duration::from_secs(30), ..SqsConfig::new("payments.fifo") };
/// let source = SqsSource::connect(&sqs, &config).await?;  // both guards run here; a missing queue is named
/// Engine::new(pool, config)?.run(source, Credit, shutdown).await?;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "sqs")]
pub struct BrokersSnippet4;

/// `docs/brokers.md`, snippet 5.
///
/// ```no_run
/// # use std::time::Duration;
/// # use idem::{Config, Engine, Event, Handler, HandlerError, KeyExtractor};
/// # use idem::pubsub::{PubSubConfig, PubSubSource};
/// # struct Credit;
/// # impl Handler<sqlx::Postgres> for Credit {
/// #     async fn handle(&self, _: &Event, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # async fn consume(pool: sqlx::PgPool, shutdown: impl Future + Send) -> Result<(), idem::Error> {
/// # let config = Config::new("ledger-writer", KeyExtractor::Header("idem-event-id".into()));
/// let pubsub = PubSubConfig { require_ordering: true, ..PubSubConfig::new("payments-sub") };
/// let source = PubSubSource::connect(&pubsub, &config).await?;  // the subscription is read and checked here
/// Engine::new(pool, config)?.run(source, Credit, shutdown).await?;
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "pubsub")]
pub struct BrokersSnippet5;

/// `docs/guards.md`, snippet 1.
///
/// ```no_run
/// # use idem::guard::{Field, GapDecision, VersionGuard};
/// # use idem::Event;
/// # async fn guarded(pool: sqlx::PgPool, event: &Event, tx: &mut sqlx::PgConnection)
/// #     -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let guard = VersionGuard::new(&pool, "orders", "id", "version", Field::json("/orderId"), Field::json("/version"))
///     .await?                                   // checked against the schema now: table, columns, unique id
///     .on_gap(|gap| GapDecision::Apply);        // or DeadLetter, or Retry; the default applies and logs at WARN
///
/// // in the handler, first:
/// if guard.check(event, tx).await?.skip() {
///     return Ok(()); // stale: counted `stale`, logged at INFO with both versions, its marker commits
/// }
/// # Ok(())
/// # }
/// ```
pub struct GuardsSnippet1;

/// `docs/guards.md`, snippet 2.
///
/// ```no_run
/// # use idem::{Event, Handled, HandlerError};
/// # struct Order { id: String, total: i64 }
/// # async fn apply(order: Order, event: &Event, tx: &mut sqlx::PgConnection) -> Result<(), HandlerError> {
/// let inserted = sqlx::query("INSERT INTO orders (id, total) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING")
///     .bind(order.id).bind(order.total).execute(&mut *tx).await?.rows_affected();
/// if inserted == 0 {
///     event.mark(Handled::AlreadyApplied);
/// }
/// # Ok(())
/// # }
/// ```
pub struct GuardsSnippet2;

/// `docs/guards.md`, snippet 3.
///
/// ```no_run
/// # use idem::testing::DuplicateKit;
/// # use idem::{Config, Event, Handler, HandlerError, KeyExtractor, Message};
/// # struct Credit;
/// # impl Handler<sqlx::Sqlite> for Credit {
/// #     async fn handle(&self, _: &Event, _: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # async fn test(pool: sqlx::SqlitePool, config: Config, payments: Vec<Message>) -> Result<(), idem::Error> {
/// let kit = DuplicateKit::new(pool, config,
///     async |c| sqlx::query("UPDATE accounts SET balance = 0").execute(c).await.map(drop),
///     async |c| sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts ORDER BY id").fetch_all(c).await);
/// kit.check(&Credit, &payments).await?.assert_exactly_once();
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "testing")]
pub struct GuardsSnippet3;

/// `docs/http-ingress.md`, snippet 1.
///
/// ```no_run
/// # use idem::ingress::{Ingress, Options, Reply, Respond};
/// # use idem::{Config, Event, HandlerError, KeyExtractor, Postgres};
/// # use serde_json::json;
/// # use sqlx::PgConnection;
/// # struct Orders;
/// # #[derive(serde::Deserialize)]
/// # struct Order { id: String, amount: i64 }
/// impl Respond<Postgres> for Orders {
///     async fn respond(&self, request: &Event, tx: &mut PgConnection) -> Result<Reply, HandlerError> {
///         let order: Order = request.json()?;
///         sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
///             .bind(&order.id).bind(order.amount).execute(&mut *tx).await?;
///         Ok(Reply::json(201, &json!({ "order": order.id })))
///     }
/// }
/// # async fn serve(pool: sqlx::PgPool, listener: tokio::net::TcpListener)
/// #     -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///
/// let config = Config::new("orders-api", KeyExtractor::Header("Idempotency-Key".into()));
/// let ingress = Ingress::new(pool, config, Orders, Options::default())?;
/// axum::serve(listener, ingress.router("/orders")?).await?;   // or .route(path, ingress.method_router())
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "ingress")]
pub struct HttpIngressSnippet1;

/// `docs/outbox.md`, snippet 1.
///
/// ```no_run
/// # use idem::outbox::OutgoingMessage;
/// # use idem::{Event, Handler, HandlerError, Postgres};
/// # use sqlx::PgConnection;
/// # struct Credit;
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct Payment { account: i64, amount: i64 }
/// impl Handler<Postgres> for Credit {
///     async fn handle(&self, event: &Event, tx: &mut PgConnection) -> Result<(), HandlerError> {
///         let p: Payment = event.json()?;
///         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///             .bind(p.amount).bind(p.account).execute(&mut *tx).await?;
///         let credited = OutgoingMessage::new("payment-credited", serde_json::to_vec(&p)?).with_key(p.account.to_string());
///         idem::outbox::enqueue(&mut *tx, credited).await?;   // committed with the credit, or not at all
///         Ok(())
///     }
/// }
/// # fn main() {}
/// ```
pub struct OutboxSnippet1;

/// `docs/sequential-inbox.md`, snippet 1.
///
/// ```no_run
/// # use idem::inbox::{InboxConfig, SequentialInbox};
/// # use idem::{Config, Engine, Event, Handler, HandlerError, Source};
/// # struct Orders;
/// # impl Handler<sqlx::Postgres> for Orders {
/// #     async fn handle(&self, _: &Event, _: &mut sqlx::PgConnection) -> Result<(), HandlerError> { Ok(()) }
/// # }
/// # async fn consume(pool: sqlx::PgPool, config: Config, text: String, source: impl Source, shutdown: impl Future + Send)
/// #     -> Result<(), idem::Error> {
/// let inbox = SequentialInbox::new(Engine::new(pool, config)?, InboxConfig::from_toml(&text)?)?;
/// inbox.run(source, Orders, shutdown).await?;   // Orders: the same Handler<Postgres> as with Engine::run
/// # Ok(())
/// # }
/// ```
pub struct SequentialInboxSnippet1;
