//! Migrations and table names: safe twice, safe concurrently, refused when tampered with, prefixes apart.

mod common;

use common::{TestPool, pg, sqlite};
use idem::Tables;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_migrations_run_twice_and_concurrently() {
    let db = pg().await;
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let url = db.url.clone();
        tasks.push(tokio::spawn(async move {
            // Separate pools: as separate processes would.
            let pool = idem::postgres::connect(&url, 1).await.unwrap();
            let report = idem::migrate(&pool, &Tables::default()).await.unwrap();
            pool.close().await;
            report
        }));
    }
    let mut applied_by = 0;
    for task in tasks {
        let report = task.await.unwrap();
        assert_eq!(report.version, 12);
        if !report.applied.is_empty() {
            assert_eq!(report.applied, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
            applied_by += 1;
        }
    }
    assert_eq!(applied_by, 1, "exactly one migrator applies, the others find the schema current");
    let again = idem::migrate(&db.pool, &Tables::default()).await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(db.pool.scalar("SELECT COUNT(*) FROM idem_migrations").await, 12);
    // The marker table is as specified: its primary key and the processed_at index.
    let pk = db
        .pool
        .scalar(
            "SELECT COUNT(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid \
         WHERE c.relname = 'processed_events' AND i.indisprimary AND i.indnatts = 2",
        )
        .await;
    assert_eq!(pk, 1);
    let idx = db.pool.scalar("SELECT COUNT(*) FROM pg_indexes WHERE indexname = 'processed_events_processed_at'").await;
    assert_eq!(idx, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_migrations_run_twice_and_concurrently() {
    let db = sqlite().await;
    let url = format!("sqlite://{}", db.path.display());
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let pool = idem::sqlite::connect(&url).await.unwrap();
            idem::migrate(&pool, &Tables::default()).await.unwrap()
        }));
    }
    let mut applied_by = 0;
    for task in tasks {
        applied_by += usize::from(!task.await.unwrap().applied.is_empty());
    }
    assert_eq!(applied_by, 1);
    assert!(idem::migrate(&db.pool, &Tables::default()).await.unwrap().applied.is_empty());
}

#[tokio::test]
async fn a_changed_migration_is_refused() {
    let db = sqlite().await;
    idem::migrate(&db.pool, &Tables::default()).await.unwrap();
    db.pool.exec("UPDATE idem_migrations SET checksum = 1 WHERE version = 1").await;
    let err = idem::migrate(&db.pool, &Tables::default()).await.unwrap_err();
    assert!(err.to_string().contains("was changed after it was applied"), "{err}");
    db.pool.exec("UPDATE idem_migrations SET checksum = 0 WHERE version = 1; INSERT INTO idem_migrations (version, name, checksum) VALUES (99, 'future', 0)").await;
    let err = idem::migrate(&db.pool, &Tables::default()).await.unwrap_err();
    assert!(err.to_string().contains("upgrade idem") || err.to_string().contains("was changed"), "{err}");
}

#[tokio::test]
async fn prefixes_and_schemas_keep_services_apart() {
    let db = pg().await;
    let billing = Tables::new(Some("billing"), "svc_").unwrap();
    let shipping = Tables::new(None, "shipping_").unwrap();
    idem::migrate(&db.pool, &billing).await.unwrap();
    idem::migrate(&db.pool, &shipping).await.unwrap();
    idem::migrate(&db.pool, &Tables::default()).await.unwrap();
    for table in
        ["billing.svc_processed_events", "shipping_processed_events", "processed_events", "billing.svc_dead_letters"]
    {
        assert_eq!(db.pool.scalar(&format!("SELECT COUNT(*) FROM {table}")).await, 0, "{table}");
    }
    let lite = sqlite().await;
    let err = idem::migrate(&lite.pool, &billing).await.unwrap_err();
    assert!(err.to_string().contains("table_prefix"), "{err}");
}
