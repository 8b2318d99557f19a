//! Database outages while consuming: a running consumer rides them out (retrying without limit) and applies every
//! event once; at start-up an unreachable database fails at once, naming the cause.

mod common;

use std::time::{Duration, Instant};

use common::{Ledger, TestPool};
use idem::embedded::{ConsumerOptions, EmbeddedLog};
use idem::{Engine, Error};
use sqlx::{Connection, PgConnection};

const EVENTS: i64 = 1500;

/// Produces `EVENTS` payments into 3 partitions of a fresh log.
fn produce(dir: &std::path::Path) -> EmbeddedLog {
    let log = EmbeddedLog::open(dir).unwrap();
    log.create_topic("payments", 3).unwrap();
    let producer = log.producer();
    for i in 0..EVENTS {
        producer.send("payments", None, format!(r#"{{"id":"e{i}","amount":{}}}"#, i % 97 + 1).as_bytes(), &[]).unwrap();
    }
    producer.flush().unwrap();
    log
}

async fn admin() -> PgConnection {
    PgConnection::connect(&format!("{}/postgres", common::pg_server())).await.unwrap()
}

fn db_name(url: &str) -> &str {
    url.rsplit('/').next().unwrap()
}

/// Runs a consumer over the log until every event is in the ledger; `outage` runs once a third is in. Returns the
/// consumer's result, after a shutdown.
async fn consume_through(pool: sqlx::PgPool, log: &EmbeddedLog, outage: impl AsyncFnOnce()) -> Result<(), Error> {
    let source = log.consumer("ledger-writer", &["payments"], ConsumerOptions::default()).unwrap();
    let engine = Engine::new(pool.clone(), common::config(50))?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move { engine.run(source, Ledger::default(), stopped).await.map(drop) });
    let count = async |pool: &sqlx::PgPool| -> i64 {
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM ledger").fetch_one(pool).await.unwrap_or(-1)
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while count(&pool).await < EVENTS / 3 {
        assert!(!run.is_finished(), "the consumer stopped early: {:?}", run.await);
        assert!(Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    outage().await;
    while count(&pool).await < EVENTS {
        assert!(!run.is_finished(), "the consumer stopped during or after the outage: {:?}", run.await);
        assert!(Instant::now() < deadline, "the consumer did not finish after the outage");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap()
}

async fn assert_once(pool: &sqlx::PgPool) {
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM ledger").await, EVENTS);
    assert_eq!(pool.scalar("SELECT COUNT(DISTINCT event_id) FROM ledger").await, EVENTS, "an event applied twice");
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM processed_events").await, EVENTS);
    assert_eq!(pool.scalar("SELECT COUNT(*) FROM dead_letters").await, 0, "an outage is never a message's fault");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_rides_out_a_database_refusing_connections_for_ten_seconds() {
    let db = common::pg().await;
    common::setup(&db.pool).await;
    let dir = common::temp_dir();
    let log = produce(&dir.0);
    let name = db_name(&db.url).to_owned();
    let result = consume_through(db.pool.clone(), &log, async || {
        let mut admin = admin().await;
        let refuse = format!(
            "ALTER DATABASE {name} ALLOW_CONNECTIONS false;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}';"
        );
        sqlx::raw_sql(&refuse).execute(&mut admin).await.unwrap();
        tokio::time::sleep(Duration::from_secs(10)).await;
        sqlx::raw_sql(&format!("ALTER DATABASE {name} ALLOW_CONNECTIONS true")).execute(&mut admin).await.unwrap();
    })
    .await;
    result.expect("the consumer rides out the outage");
    assert_once(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_rides_out_an_exhausted_connection_limit() {
    let db = common::pg().await;
    let name = db_name(&db.url).to_owned();
    // Connection limits do not apply to superusers: the consumer runs as a role of its own, owning the database.
    let role = format!("{name}_r");
    let mut admin = admin().await;
    sqlx::raw_sql(&format!("CREATE ROLE {role} LOGIN; ALTER DATABASE {name} OWNER TO {role};"))
        .execute(&mut admin)
        .await
        .unwrap();
    let server = common::pg_server().replace("postgres@", &format!("{role}@"));
    let url = format!("{server}/{name}");
    let pool = idem::postgres::connect(&url, 4).await.unwrap();
    common::setup(&pool).await;
    let dir = common::temp_dir();
    let log = produce(&dir.0);
    let result = consume_through(pool.clone(), &log, async || {
        // Other clients take every connection the database allows; the consumer's are ended.
        sqlx::raw_sql(&format!(
            "ALTER DATABASE {name} CONNECTION LIMIT 2;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}';"
        ))
        .execute(&mut admin)
        .await
        .unwrap();
        let mut others: Vec<PgConnection> = Vec::new();
        let mut pids: Vec<i32> = Vec::new();
        while others.len() < 2 {
            match PgConnection::connect(&url).await {
                Ok(mut conn) => {
                    pids.push(sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut conn).await.unwrap());
                    others.push(conn);
                }
                // The consumer took a slot back between the two: its connections are ended again.
                Err(_) => {
                    let end = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND \
                               pid <> ALL($2)";
                    let _ = sqlx::query(end).bind(&name).bind(&pids).execute(&mut admin).await;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        let refused = PgConnection::connect(&url).await.map(drop).unwrap_err().to_string();
        assert!(refused.contains("too many connections"), "{refused}");
        tokio::time::sleep(Duration::from_secs(5)).await;
        sqlx::raw_sql(&format!("ALTER DATABASE {name} CONNECTION LIMIT -1")).execute(&mut admin).await.unwrap();
        for conn in others {
            let _ = conn.close().await;
        }
    })
    .await;
    result.expect("the consumer rides out the exhausted limit");
    assert_once(&pool).await;
    pool.close().await;
    drop(db);
    let mut cleanup = PgConnection::connect(&format!("{}/postgres", common::pg_server())).await.unwrap();
    let _ = sqlx::raw_sql(&format!("DROP ROLE IF EXISTS {role}")).execute(&mut cleanup).await;
}

#[tokio::test]
async fn an_unreachable_database_fails_at_start_up_with_the_cause() {
    let started = Instant::now();
    // Nothing listens on port 1.
    let refused = idem::postgres::connect("postgres://postgres@127.0.0.1:1/test", 2).await.unwrap_err().to_string();
    assert!(refused.contains("connection refused") && refused.contains("127.0.0.1:1"), "{refused}");
    assert!(started.elapsed() < Duration::from_secs(5), "refused must fail fast, took {:?}", started.elapsed());

    let server = common::pg_server();
    let missing = idem::postgres::connect(&format!("{server}/idem_no_such_database"), 2).await.unwrap_err().to_string();
    assert!(missing.contains("does not exist") && missing.contains("createdb"), "{missing}");
    let no_role = server.replace("postgres@", "idem_no_such_role@");
    let denied = idem::postgres::connect(&format!("{no_role}/test"), 2).await.unwrap_err().to_string();
    assert!(denied.contains("28000") && denied.contains("user and password"), "{denied}");
}
