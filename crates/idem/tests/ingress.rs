//! The HTTP ingress on every store, over real HTTP: a retry gets the first reply (stored in the marker's
//! transaction), a different body under the same key is 422, concurrent requests of one key apply once, a client
//! that gave up gets the answer on its retry, a permanent failure is answered the same every time, a bad
//! signature or an oversized body stores nothing, and stored replies are pruned with their markers.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use common::{HttpAnswer, Ledger, TestPool, ledger_rows, markers, setup};
use idem::ingress::{Ingress, Limits, Options, Reply, Respond, Secret, Signature};
use idem::{Backend, Config, Event, Handler, HandlerError, KeyExtractor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Pool<DB> = sqlx::Pool<DB>;

/// Every reply carries a receipt number drawn when it is made: a replay shows the first one.
static RECEIPTS: AtomicU64 = AtomicU64::new(1);

/// The ledger handler behind an endpoint: `201 {"id", "receipt"}`.
struct Payments(Ledger);

impl<DB: Backend> Respond<DB> for Payments
where
    Ledger: Handler<DB>,
{
    async fn respond(&self, request: &Event, tx: &mut DB::Connection) -> Result<Reply, HandlerError> {
        self.0.handle(request, tx).await?;
        let receipt = RECEIPTS.fetch_add(1, Ordering::Relaxed);
        Ok(Reply::json(201, &serde_json::json!({ "id": request.id, "receipt": receipt }))
            .with_header("x-receipt", receipt.to_string()))
    }
}

/// One `POST` on a connection of its own.
async fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> HttpAnswer {
    common::http(addr, "POST", path, headers, body).await
}

fn config() -> Config {
    Config::new("payments-api", KeyExtractor::Header("Idempotency-Key".into()))
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
}

/// Serves an ingress at `/payments` on a free port.
async fn serve<DB: Backend>(pool: &Pool<DB>, options: Options) -> SocketAddr
where
    Ledger: Handler<DB>,
{
    serve_with(pool, config(), options).await
}

async fn serve_with<DB: Backend>(pool: &Pool<DB>, config: Config, options: Options) -> SocketAddr
where
    Ledger: Handler<DB>,
{
    let ingress = Ingress::new(pool.clone(), config, Payments(Ledger::default()), options).expect("ingress");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { ingress.serve(listener, "/payments", std::future::pending()).await });
    addr
}

fn body(id: &str, amount: i64, extra: &str) -> String {
    let extra = if extra.is_empty() { String::new() } else { format!(",{extra}") };
    format!(r#"{{"id":"{id}","amount":{amount}{extra}}}"#)
}

async fn stored_responses<P: TestPool>(pool: &P) -> i64 {
    pool.scalar("SELECT COUNT(*) FROM http_responses").await
}

/// A retry gets the first reply byte for byte, marked replayed; the same key with another body is 422; no key is
/// 400 naming the header.
async fn a_retry_gets_the_first_reply<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let addr = serve(&pool, Options::default()).await;
    let key = [("Idempotency-Key", "pay-1"), ("Content-Type", "application/json")];
    let first = post(addr, "/payments", &key, &body("pay-1", 5, "")).await;
    assert_eq!(first.status, 201, "{}", first.body);
    assert!(first.header(idem::ingress::REPLAYED).is_none());
    let again = post(addr, "/payments", &key, &body("pay-1", 5, "")).await;
    assert_eq!((again.status, again.body.as_str()), (201, first.body.as_str()), "the stored reply");
    assert_eq!(again.header("x-receipt"), first.header("x-receipt"), "its headers too");
    assert_eq!(again.header(idem::ingress::REPLAYED).as_deref(), Some("true"));
    assert_eq!(ledger_rows(&pool, "pay-1").await, 1, "applied once");
    assert_eq!(markers(&pool, "pay-1").await, 1);
    let other = post(addr, "/payments", &key, &body("pay-1", 500, "")).await;
    assert_eq!(other.status, 422, "{}", other.body);
    assert!(other.body.contains("different request body"), "{}", other.body);
    assert_eq!(ledger_rows(&pool, "pay-1").await, 1, "nothing applied");
    let keyless = post(addr, "/payments", &[], &body("pay-2", 5, "")).await;
    assert_eq!(keyless.status, 400, "{}", keyless.body);
    assert!(keyless.body.contains("idempotency-key"), "{}", keyless.body);
    assert_eq!(ledger_rows(&pool, "pay-2").await, 0);
    assert_eq!(stored_responses(&pool).await, 1);
}
on_every_store!(a_retry_gets_the_first_reply);

/// Eight requests of one key at once: one applies, all get its reply. With a short wait for the first, the others
/// get 409 and Retry-After, and a later retry gets the reply.
async fn concurrent_requests_of_one_key_apply_once<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let addr = serve(&pool, Options::default()).await;
    let payload = body("pay-c", 7, r#""sleep_ms":200"#);
    let sends = (0..8).map(|_| {
        let payload = payload.clone();
        tokio::spawn(async move { post(addr, "/payments", &[("Idempotency-Key", "pay-c")], &payload).await })
    });
    let mut bodies = Vec::new();
    for send in sends {
        let answer = send.await.expect("send");
        assert_eq!(answer.status, 201, "{}", answer.body);
        bodies.push(answer.body);
    }
    assert!(bodies.iter().all(|b| b == &bodies[0]), "one reply for all: {bodies:?}");
    assert_eq!(ledger_rows(&pool, "pay-c").await, 1);

    let limits = Limits { wait_for_first: Duration::from_millis(50), ..Limits::default() };
    let addr = serve(&pool, Options { limits, ..Options::default() }).await;
    let payload = body("pay-d", 7, r#""sleep_ms":600"#);
    let sends: Vec<_> = (0..4)
        .map(|_| {
            let payload = payload.clone();
            tokio::spawn(async move { post(addr, "/payments", &[("Idempotency-Key", "pay-d")], &payload).await })
        })
        .collect();
    let mut statuses = Vec::new();
    for send in sends {
        let answer = send.await.expect("send");
        if answer.status == 409 {
            assert_eq!(answer.header("retry-after").as_deref(), Some("1"));
        }
        statuses.push(answer.status);
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [201, 409, 409, 409]);
    let retry = post(addr, "/payments", &[("Idempotency-Key", "pay-d")], &payload).await;
    assert_eq!(retry.status, 201);
    assert_eq!(ledger_rows(&pool, "pay-d").await, 1);
}
on_every_store!(concurrent_requests_of_one_key_apply_once);

/// The client is answered 503 when the commit takes longer than the request timeout; the work commits anyway and
/// the retry gets its reply, applied once.
async fn a_client_that_gave_up_gets_the_answer_on_its_retry<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let limits = Limits { request_timeout: Duration::from_millis(150), ..Limits::default() };
    let addr = serve(&pool, Options { limits, ..Options::default() }).await;
    let payload = body("pay-t", 3, r#""sleep_ms":600"#);
    let first = post(addr, "/payments", &[("Idempotency-Key", "pay-t")], &payload).await;
    assert_eq!(first.status, 503, "{}", first.body);
    assert_eq!(first.header("retry-after").as_deref(), Some("1"));
    // The retry waits behind the work still in progress, then gets its reply.
    let mut retry = post(addr, "/payments", &[("Idempotency-Key", "pay-t")], &payload).await;
    for _ in 0..20 {
        if retry.status == 201 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = post(addr, "/payments", &[("Idempotency-Key", "pay-t")], &payload).await;
    }
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert_eq!(ledger_rows(&pool, "pay-t").await, 1);
}
on_every_store!(a_client_that_gave_up_gets_the_answer_on_its_retry);

/// A permanent failure is dead-lettered and answered 422, the same body on every retry; nothing applied.
async fn a_permanent_failure_is_answered_the_same_every_time<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let addr = serve(&pool, Options::default()).await;
    let payload = body("pay-p", 3, r#""poison":true"#);
    let first = post(addr, "/payments", &[("Idempotency-Key", "pay-p")], &payload).await;
    let again = post(addr, "/payments", &[("Idempotency-Key", "pay-p")], &payload).await;
    assert_eq!(first.status, 422, "{}", first.body);
    assert_eq!((again.status, again.body.as_str()), (422, first.body.as_str()));
    assert!(first.body.contains("dead letter"), "{}", first.body);
    assert_eq!(ledger_rows(&pool, "pay-p").await, 0);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters WHERE event_id = 'pay-p'").await, 1);
}
on_every_store!(a_permanent_failure_is_answered_the_same_every_time);

/// A request that fails retryably past `max_attempts` is answered 503 with nothing written (no dead letter, no
/// marker, no stored reply), and its retry is tried afresh and applied once.
async fn a_retryable_failure_is_given_back_to_the_client<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let addr = serve_with(&pool, config().max_attempts(2), Options::default()).await;
    // Fails its first three attempts: two in the first request, one in the retry's.
    let payload = body("pay-f", 4, r#""flaky":3"#);
    let first = post(addr, "/payments", &[("Idempotency-Key", "pay-f")], &payload).await;
    assert_eq!(first.status, 503, "{}", first.body);
    assert_eq!(first.header("retry-after").as_deref(), Some("1"));
    assert!(first.body.contains("nothing of it was applied"), "{}", first.body);
    assert_eq!(markers(&pool, "pay-f").await, 0, "no marker: the retry is tried afresh");
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters WHERE event_id = 'pay-f'").await, 0);
    assert_eq!(stored_responses(&pool).await, 0);
    let retry = post(addr, "/payments", &[("Idempotency-Key", "pay-f")], &payload).await;
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert_eq!(ledger_rows(&pool, "pay-f").await, 1);
    let again = post(addr, "/payments", &[("Idempotency-Key", "pay-f")], &payload).await;
    assert_eq!((again.status, again.body.as_str()), (201, retry.body.as_str()));
}
on_every_store!(a_retryable_failure_is_given_back_to_the_client);

/// A publisher that must not be called: an HTTP request's replay publishes nothing.
struct MustNotPublish;

impl idem::Publisher for MustNotPublish {
    async fn publish(&self, message: &idem::Message) -> Result<(), idem::SourceError> {
        panic!("an HTTP request's replay published {}", message.topic)
    }
}

/// Once the cause is fixed, a dead-lettered request's replay releases its key (the letter archived, its marker
/// gone, nothing published): until then its client's retries are answered 422, after it the next retry is applied
/// once. An edited replay of it is refused.
async fn a_released_dead_letter_is_applied_on_the_clients_next_retry<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    use idem::dead_letter::{ReplayRisk, Replayed, Safety};
    setup(&pool).await;
    let addr = serve(&pool, Options::default()).await;
    let tables = idem::Tables::default();
    pool.exec("INSERT INTO blocked (id) VALUES ('pay-r')").await;
    let payload = body("pay-r", 6, "");
    let key = [("Idempotency-Key", "pay-r")];
    assert_eq!(post(addr, "/payments", &key, &payload).await.status, 422);
    pool.exec("DELETE FROM blocked WHERE id = 'pay-r'").await;
    assert_eq!(post(addr, "/payments", &key, &payload).await.status, 422, "the key stays answered until released");
    let letters = idem::dead_letter::list(&pool, &tables, None, 10).await.expect("letters");
    let letter = letters.iter().find(|l| l.event_id.as_deref() == Some("pay-r")).expect("the request's letter");
    assert!(idem::dead_letter::is_http_request(letter));
    let edited = idem::dead_letter::replay_edited(
        &pool,
        &tables,
        &MustNotPublish,
        letter,
        b"{}".to_vec(),
        Safety::Checked,
        "op",
    );
    assert_eq!(edited.await.expect("edit"), Replayed::Refused(ReplayRisk::HttpRequest));
    let check = idem::dead_letter::check_replay(&pool, &tables, letter, Safety::Checked).await.expect("check");
    assert_eq!(check, Replayed::Released, "a dry run says it would release");
    let replayed =
        idem::dead_letter::replay(&pool, &tables, &MustNotPublish, letter, Safety::Checked).await.expect("replay");
    assert_eq!(replayed, Replayed::Released);
    assert_eq!(markers(&pool, "pay-r").await, 0);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters WHERE event_id = 'pay-r'").await, 0);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letter_archive WHERE event_id = 'pay-r'").await, 1);
    let retry = post(addr, "/payments", &key, &payload).await;
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert_eq!(post(addr, "/payments", &key, &payload).await.body, retry.body);
    assert_eq!(ledger_rows(&pool, "pay-r").await, 1);
}
on_every_store!(a_released_dead_letter_is_applied_on_the_clients_next_retry);

/// A missing or wrong signature is 401 and an oversized body 413: nothing stored, nothing applied.
async fn refused_requests_store_nothing<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let github = Signature::GitHub { secret: Secret::new("webhook-secret") };
    let limits = Limits { max_body_bytes: 256, ..Limits::default() };
    let addr = serve(&pool, Options { signature: Some(github.clone()), limits }).await;
    let payload = body("pay-s", 9, "");
    let unsigned = post(addr, "/payments", &[("Idempotency-Key", "pay-s")], &payload).await;
    assert_eq!(unsigned.status, 401, "{}", unsigned.body);
    assert!(unsigned.body.contains("x-hub-signature-256"), "{}", unsigned.body);
    let forged = idem::ingress::signature::sign(
        &Signature::GitHub { secret: Secret::new("not-the-secret") },
        payload.as_bytes(),
        SystemTime::now(),
    );
    let wrong =
        post(addr, "/payments", &[("Idempotency-Key", "pay-s"), ("X-Hub-Signature-256", &forged)], &payload).await;
    assert_eq!(wrong.status, 401, "{}", wrong.body);
    let big = body("pay-b", 1, &format!(r#""pad":"{}""#, "x".repeat(400)));
    let signed_big = idem::ingress::signature::sign(&github, big.as_bytes(), SystemTime::now());
    let oversized =
        post(addr, "/payments", &[("Idempotency-Key", "pay-b"), ("X-Hub-Signature-256", &signed_big)], &big).await;
    assert_eq!(oversized.status, 413, "{}", oversized.body);
    assert_eq!(markers(&pool, "pay-s").await + markers(&pool, "pay-b").await, 0);
    assert_eq!(stored_responses(&pool).await, 0);
    let signed = idem::ingress::signature::sign(&github, payload.as_bytes(), SystemTime::now());
    let good =
        post(addr, "/payments", &[("Idempotency-Key", "pay-s"), ("X-Hub-Signature-256", &signed)], &payload).await;
    assert_eq!(good.status, 201, "{}", good.body);
    assert_eq!(ledger_rows(&pool, "pay-s").await, 1);
}
on_every_store!(refused_requests_store_nothing);

/// Stored replies go with their markers' retention: a prune deletes both.
async fn stored_replies_are_pruned_with_the_markers<DB: Backend>(pool: Pool<DB>)
where
    Pool<DB>: TestPool,
    Ledger: Handler<DB>,
{
    setup(&pool).await;
    let addr = serve(&pool, Options::default()).await;
    for key in ["old", "new"] {
        let answer = post(addr, "/payments", &[("Idempotency-Key", key)], &body(key, 1, "")).await;
        assert_eq!(answer.status, 201, "{}", answer.body);
    }
    let ten_days_ms = 10 * 24 * 3_600 * 1_000;
    pool.exec(&format!("UPDATE http_responses SET stored_at_ms = stored_at_ms - {ten_days_ms} WHERE event_id = 'old'"))
        .await;
    let pruning = idem::Pruning::default();
    idem::prune::prune(&pool, &idem::Tables::default(), None, Duration::from_secs(86_400), &pruning, |_| {})
        .await
        .expect("prune");
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM http_responses WHERE event_id = 'old'").await, 0);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM http_responses WHERE event_id = 'new'").await, 1);

    // A marker pruned before its reply: the key is new again, and its new reply replaces the old one.
    pool.exec("DELETE FROM processed_events WHERE event_id = 'new'").await;
    let again = post(addr, "/payments", &[("Idempotency-Key", "new")], &body("new", 2, "")).await;
    assert_eq!(again.status, 201, "{}", again.body);
    assert!(again.header(idem::ingress::REPLAYED).is_none(), "applied as new");
    let replay = post(addr, "/payments", &[("Idempotency-Key", "new")], &body("new", 2, "")).await;
    assert_eq!((replay.status, replay.body.as_str()), (201, again.body.as_str()), "the new reply is the stored one");
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM http_responses WHERE event_id = 'new'").await, 1);
}
on_every_store!(stored_replies_are_pruned_with_the_markers);

/// Configurations the ingress cannot honour are refused, naming the fix; so are paths that are not plain.
#[tokio::test]
async fn what_the_ingress_cannot_honour_is_refused() {
    let db = common::sqlite().await;
    let refuse = |config: Config| {
        Ingress::new(db.pool.clone(), config, Payments(Ledger::default()), Options::default())
            .err()
            .map(|e| e.to_string())
    };
    let by_broker = refuse(Config::new("g", KeyExtractor::BrokerId)).expect("refused");
    assert!(by_broker.contains("header:Idempotency-Key"), "{by_broker}");
    let natural = refuse(config().natural_key()).expect("refused");
    assert!(natural.contains("markers"), "{natural}");
    let ingress = Ingress::new(db.pool.clone(), config(), Payments(Ledger::default()), Options::default()).unwrap();
    let err = ingress.router("/webhooks/../admin").unwrap_err().to_string();
    assert!(err.contains("plain absolute path"), "{err}");
}

/// A client that sends its headers too slowly is cut off (nothing stored); a shutdown answers the request in
/// progress and waits for the work of a client that went away before the server ends, and the engine's figures
/// count both.
#[tokio::test]
async fn slow_clients_are_cut_off_and_a_shutdown_answers_what_is_in_progress() {
    let db = common::sqlite().await;
    setup(&db.pool).await;
    let limits = Limits { header_timeout: Duration::from_millis(300), ..Limits::default() };
    let options = Options { limits, ..Options::default() };
    let ingress = Ingress::new(db.pool.clone(), config(), Payments(Ledger::default()), options).expect("ingress");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = {
        let ingress = ingress.clone();
        tokio::spawn(async move {
            ingress
                .serve(listener, "/payments", async {
                    let _ = stopped.await;
                })
                .await
        })
    };

    // Half a request line, then nothing: the connection is closed after the header timeout.
    let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: sl").await.expect("write");
    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut raw)).await;
    assert!(read.is_ok(), "the slow connection was not closed");
    assert!(raw.is_empty() || String::from_utf8_lossy(&raw).contains("408"), "{}", String::from_utf8_lossy(&raw));

    assert!(ingress.engine().health().running, "serving counts as running");

    // A request in progress when the shutdown comes is answered, and the work of one whose client went away
    // ends with its commit; only then does the server end.
    let payload = body("pay-g", 2, r#""sleep_ms":400"#);
    let in_progress =
        tokio::spawn(async move { post(addr, "/payments", &[("Idempotency-Key", "pay-g")], &payload).await });
    // (SQLite takes one writer at a time: the abandoned request commits last, well after pay-g's answer.)
    tokio::time::sleep(Duration::from_millis(100)).await;
    let abandoned = body("pay-h", 3, r#""sleep_ms":900"#);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(150),
        post(addr, "/payments", &[("Idempotency-Key", "pay-h")], &abandoned),
    )
    .await;
    assert!(gave_up.is_err(), "the client was answered before it gave up");
    let _ = stop.send(());
    let answer = in_progress.await.expect("request");
    assert_eq!(answer.status, 201, "{}", answer.body);
    let stats = tokio::time::timeout(Duration::from_secs(10), server).await.expect("the server ends").expect("join");
    assert_eq!(ledger_rows(&db.pool, "pay-h").await, 1, "the server ended before the abandoned work committed");
    assert_eq!(stats.expect("serve").processed, 2);
    assert!(!ingress.engine().health().running);
    assert_eq!(ledger_rows(&db.pool, "pay-g").await, 1);
    assert_eq!(markers(&db.pool, "sl").await, 0);
}

/// Requests of any shape: random bytes, or a request line with random headers, keys, signatures and bodies.
fn raw_requests() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
    use proptest::prelude::*;
    let header = prop_oneof![
        Just("Idempotency-Key".to_owned()),
        Just("X-Hub-Signature-256".to_owned()),
        Just("Content-Length".to_owned()),
        Just("Transfer-Encoding".to_owned()),
        "[A-Za-z-]{1,12}",
    ];
    let value = prop_oneof![
        "sha256=[0-9a-f]{0,70}",
        "[ -~]{0,40}",
        prop::collection::vec(any::<u8>(), 0..24).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ];
    let body = prop_oneof![
        Just(r#"{"id":"k","amount":1}"#.to_owned()),
        r#"\{"id":"[a-z0-9]{0,6}","amount":-?[0-9]{1,20}\}"#,
        "[ -~]{0,200}",
    ];
    let path = prop_oneof![Just("/payments".to_owned()), "/[a-z./%]{0,16}"];
    let method = prop_oneof![Just("POST"), Just("GET"), Just("PUT"), "[A-Z]{1,8}".prop_map(|_| "PATCH")];
    let shaped = (method, path, prop::collection::vec((header, value), 0..6), body, any::<bool>()).prop_map(
        |(method, path, headers, body, with_length)| {
            let mut request = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
            for (name, value) in headers {
                request.push_str(&format!("{name}: {value}\r\n"));
            }
            if with_length {
                request.push_str(&format!("Content-Length: {}\r\n", body.len()));
            }
            request.push_str("\r\n");
            request.push_str(&body);
            request.into_bytes()
        },
    );
    prop_oneof![4 => shaped, 1 => prop::collection::vec(any::<u8>(), 0..300)]
}

/// Any bytes sent to a signed endpoint are answered 4xx (or the connection closed): never a server error, never
/// applied, nothing stored. `PROPTEST_CASES` raises the count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_request_is_answered_without_a_server_error_and_a_forged_one_stores_nothing() {
    use proptest::test_runner::{Config as Cases, TestCaseError, TestRunner};
    let db = common::sqlite().await;
    setup(&db.pool).await;
    let limits = Limits {
        max_body_bytes: 1024,
        request_timeout: Duration::from_millis(300),
        header_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let github = Signature::GitHub { secret: Secret::new("webhook-secret") };
    let addr = serve(&db.pool, Options { signature: Some(github), limits }).await;
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(256);
    let handle = tokio::runtime::Handle::current();
    let mut runner = TestRunner::new(Cases { cases, ..Cases::default() });
    let result = tokio::task::block_in_place(|| {
        runner.run(&raw_requests(), |raw| {
            let answer = handle.block_on(async {
                let Ok(mut conn) = tokio::net::TcpStream::connect(addr).await else { return Err("connect".to_owned()) };
                let _ = conn.write_all(&raw).await;
                let _ = conn.shutdown().await;
                let mut back = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut back)).await;
                Ok(String::from_utf8_lossy(&back).into_owned())
            });
            let answer = answer.map_err(TestCaseError::fail)?;
            let status: u16 = answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            if !(answer.is_empty() || (400..500).contains(&status)) {
                return Err(TestCaseError::fail(format!(
                    "{:?} was answered {answer:?}",
                    String::from_utf8_lossy(&raw)
                )));
            }
            Ok(())
        })
    });
    result.expect("every request answered 4xx or closed");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM processed_events").await, 0, "nothing applied");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM http_responses").await, 0, "nothing stored");
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM dead_letters").await, 0, "nothing dead-lettered");
}

fn every_signature() -> Vec<Signature> {
    let secret = || Secret::new("s3cret");
    vec![
        Signature::Stripe { secret: secret(), tolerance: Duration::from_secs(300) },
        Signature::GitHub { secret: secret() },
        Signature::Hmac {
            header: "x-signature".into(),
            prefix: "sha256=".into(),
            encoding: idem::ingress::Encoding::Hex,
            secret: secret(),
        },
        Signature::Hmac {
            header: "x-signature".into(),
            prefix: String::new(),
            encoding: idem::ingress::Encoding::Base64,
            secret: secret(),
        },
    ]
}

proptest::proptest! {
    /// Each form accepts its own signature of the body, and nothing else: not a changed body, not any other
    /// header value, not a Stripe timestamp outside the tolerance. No input panics.
    #[test]
    fn a_signature_accepts_only_its_own(
        body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..128),
        forged in "[ -~]{0,100}",
        flip in proptest::prelude::any::<usize>(),
        skew in 0u64..1_000,
    ) {
        use axum::http::{HeaderMap, HeaderName, HeaderValue};
        let now = SystemTime::now();
        for signature in every_signature() {
            let name = HeaderName::try_from(signature.header()).expect("header name");
            let headers = |value: &str| {
                let mut map = HeaderMap::new();
                if let Ok(value) = HeaderValue::try_from(value) {
                    map.insert(name.clone(), value);
                }
                map
            };
            let signed = idem::ingress::signature::sign(&signature, &body, now);
            proptest::prop_assert!(signature.verify(&headers(&signed), &body, now).is_ok());
            proptest::prop_assert!(signature.verify(&headers(&forged), &body, now).is_err(), "{forged}");
            proptest::prop_assert!(signature.verify(&HeaderMap::new(), &body, now).is_err());
            if !body.is_empty() {
                let mut changed = body.clone();
                changed[flip % body.len()] ^= 1;
                proptest::prop_assert!(signature.verify(&headers(&signed), &changed, now).is_err());
            }
            if let Signature::Stripe { tolerance, .. } = &signature {
                let later = now + *tolerance + Duration::from_secs(1 + skew);
                let err = signature.verify(&headers(&signed), &body, later).expect_err("a replay outside the tolerance");
                proptest::prop_assert!(err.to_string().contains("tolerance"), "{err}");
            }
        }
    }
}
