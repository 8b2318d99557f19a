//! Reaching the database: a start-up probe that fails fast with the cause and the fix, and, once running, a
//! connection checkout that turns every failure to connect into an outage the engine retries without limit.
//!
//! A failure while connecting is never a message's fault: the server is down or refusing (connection refused,
//! `57P03` cannot connect now, `55000` the database does not accept connections, `53300` too many connections),
//! or its configuration changed under a running consumer (authentication, a dropped database). At start-up these
//! stop the program with an error naming the cause; later they are retried with backoff, each retry logged.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{ConnectOptions, Connection, Pool};

use super::Backend;

/// How long the start-up probe and the cause-finding probe wait for a connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects once with `options` and closes the connection; the error names the cause and the fix.
pub(crate) async fn probe<O>(options: &O, target: &str) -> Result<(), crate::Error>
where
    O: ConnectOptions,
    O::Connection: Sized,
{
    match tokio::time::timeout(PROBE_TIMEOUT, options.connect()).await {
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        Ok(Err(error)) => Err(crate::Error::Connect { target: target.to_owned(), reason: explain(&error) }),
        Err(_) => Err(crate::Error::Connect {
            target: target.to_owned(),
            reason: format!(
                "no answer within {}s (a firewall dropping packets, or a wrong host)",
                PROBE_TIMEOUT.as_secs()
            ),
        }),
    }
}

/// A connection from `pool`. A failure to connect comes back as an I/O error (a transient one) whose message says
/// why the server refused; a checkout that timed out says what a fresh connection attempt answered.
pub(crate) async fn connection<DB: Backend>(pool: &Pool<DB>) -> Result<PoolConnection<DB>, sqlx::Error> {
    match pool.acquire().await {
        Ok(conn) => Ok(conn),
        Err(sqlx::Error::PoolTimedOut) => {
            let cause = match tokio::time::timeout(PROBE_TIMEOUT, pool.connect_options().connect()).await {
                Ok(Ok(conn)) => {
                    let _ = conn.close().await;
                    "every connection of the pool is in use (a connection attempt now succeeds)".to_owned()
                }
                Ok(Err(error)) => explain(&error),
                Err(_) => format!("no answer within {}s", PROBE_TIMEOUT.as_secs()),
            };
            Err(unreachable(format!("no database connection became available in time: {cause}")))
        }
        Err(error @ sqlx::Error::Database(_)) => Err(unreachable(explain(&error))),
        Err(error) => Err(error),
    }
}

fn unreachable(message: String) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, message))
}

/// The cause of a failed connection attempt, and what to do about it.
pub(crate) fn explain(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Io(io) => match io.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                format!("connection refused ({io}): is the server running and listening on that host and port?")
            }
            std::io::ErrorKind::NotFound => format!("{io}: does the socket or file exist?"),
            _ if io.to_string().contains("failed to lookup address") => {
                format!("unknown host ({io}): check the host name in the URL")
            }
            _ => format!("{io}"),
        },
        sqlx::Error::Database(db) if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some() => {
            let fix = super::mysql::connect_fix(db.as_ref()).unwrap_or("see the server's error log");
            let number = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map_or(0, |e| e.number());
            format!("{} (error {number}): {fix}", db.message())
        }
        sqlx::Error::Database(db) => {
            let fix = match db.code().as_deref() {
                Some("28P01" | "28000") => "check the user and password in the URL (or the server's pg_hba.conf)",
                Some("3D000") => "create the database (`createdb <name>`) or fix its name in the URL",
                Some("55000") => {
                    "the database refuses connections (ALLOW_CONNECTIONS false); an administrator must allow them again"
                }
                Some("53300") => {
                    "the server's or the database's connection limit is reached; close other clients or raise the limit"
                }
                Some("57P03") => {
                    "the server is starting up, shutting down or in recovery; it will accept connections again"
                }
                _ => "see the server's log",
            };
            format!("{} (SQLSTATE {}): {fix}", db.message(), db.code().as_deref().unwrap_or("?"))
        }
        sqlx::Error::Tls(tls) => format!("TLS failed ({tls}): check sslmode and the server's certificate"),
        other => other.to_string(),
    }
}
