//! `idem migrate --print-sql` applied by hand (as a team's own migration tool would), then `idem migrate info`
//! and `idem migrate` agreeing that nothing is left to do; on PostgreSQL (a schema of its own) and SQLite.

use std::process::{Command, Output};

use serde_json::Value;

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().expect("run idem")
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

fn info(url: &str, extra: &[&str]) -> Value {
    let output = idem(&[&["migrate", "info", "--json", "--database-url", url], extra].concat());
    assert!(output.status.success(), "{}", text(&output));
    serde_json::from_slice(&output.stdout).expect("json")
}

fn check(url: &str, extra: &[&str], apply: impl FnOnce(&str)) {
    let before = info(url, extra);
    let migrations = before["migrations"].as_array().expect("migrations").len();
    assert!(migrations >= 4, "{before}");
    assert_eq!(before["pending"], migrations, "{before}");

    let printed = idem(&[&["migrate", "--print-sql", "--database-url", url], extra].concat());
    assert!(printed.status.success(), "{}", text(&printed));
    apply(&String::from_utf8_lossy(&printed.stdout));

    let after = info(url, extra);
    assert_eq!((after["pending"].as_u64(), after["changed"].as_u64()), (Some(0), Some(0)), "{after}");
    for m in after["migrations"].as_array().expect("migrations") {
        assert_eq!(m["state"], "applied", "{m}");
        assert_eq!(m["checksum"], m["applied_checksum"], "{m}");
    }
    let migrate = idem(&[&["migrate", "--database-url", url], extra].concat());
    assert!(text(&migrate).contains("schema is current"), "{}", text(&migrate));

    let plain = idem(&[&["migrate", "info", "--database-url", url], extra].concat());
    assert!(plain.status.success() && text(&plain).contains("schema is current"), "{}", text(&plain));

    // After an upgrade: only the migrations past a version.
    let last = migrations.to_string();
    let after =
        idem(&[&["migrate", &format!("--print-sql={}", migrations - 1), "--database-url", url], extra].concat());
    let after = text(&after);
    assert!(after.contains(&format!("-- migration {last}:")) && !after.contains("-- migration 1:"), "{after}");
}

#[tokio::test(flavor = "multi_thread")]
async fn printed_sql_applied_by_hand_on_postgres() {
    let server = std::env::var("IDEM_TEST_POSTGRES").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    let url = format!("{server}/test");
    let schema = format!("idem_print_sql_{}", std::process::id());
    let pool = sqlx::PgPool::connect(&url).await.expect("PostgreSQL");
    sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).execute(&pool).await.expect("drop");
    let handle = tokio::runtime::Handle::current();
    let apply_pool = pool.clone();
    tokio::task::spawn_blocking(move || {
        check(&url, &["--schema", &schema], |sql| {
            let sql = format!("BEGIN;\n{sql}\nCOMMIT;");
            handle.block_on(sqlx::raw_sql(&sql).execute(&apply_pool)).expect("apply the printed SQL");
        });
        handle.block_on(sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE")).execute(&apply_pool)).expect("drop");
    })
    .await
    .expect("check");
}

#[tokio::test(flavor = "multi_thread")]
async fn printed_sql_applied_by_hand_on_sqlite() {
    let path = std::env::temp_dir().join(format!("idem-print-sql-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let url = format!("sqlite://{}", path.display());
    let pool = sqlx::SqlitePool::connect(&format!("{url}?mode=rwc")).await.expect("sqlite");
    let handle = tokio::runtime::Handle::current();
    let apply_pool = pool.clone();
    let check_url = url.clone();
    tokio::task::spawn_blocking(move || {
        check(&check_url, &[], |sql| {
            let sql = format!("BEGIN;\n{sql}\nCOMMIT;");
            handle.block_on(sqlx::raw_sql(&sql).execute(&apply_pool)).expect("apply the printed SQL");
        });
    })
    .await
    .expect("check");
    // A migration edited after it was applied: `info` names it and exits 1.
    sqlx::query("UPDATE idem_migrations SET checksum = 1 WHERE version = 2").execute(&pool).await.expect("edit");
    let output = idem(&["migrate", "info", "--database-url", &url]);
    assert!(!output.status.success());
    assert!(
        text(&output).contains("CHANGED") && text(&output).contains("1 changed after they were applied"),
        "{}",
        text(&output)
    );
    let _ = std::fs::remove_file(&path);
}
