//! `idem parked …`: the messages parked for delayed retries (see `idem::delayed_retry`): list them, make them due
//! now, discard them into the dead letters.

use std::process::ExitCode;

use anyhow::bail;
use clap::Subcommand;

use crate::DbArgs;
use crate::audit::{Actor, note};
use crate::db::Db;
use crate::with_pool;

/// `idem parked …`.
#[derive(Subcommand, Debug)]
pub enum ParkedCommand {
    /// Parked messages in arrival order: each key's first one is the one its delayed retries try, the others of
    /// its key wait behind it.
    List {
        #[command(flatten)]
        db: DbArgs,
        /// Only this consumer group.
        #[arg(long)]
        group: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        /// Where messages say their type, part of the failure fingerprint: `header:NAME` or `json:/POINTER`.
        #[arg(long, env = "IDEM_MESSAGE_TYPE", value_name = "WHERE")]
        message_type: Option<String>,
        /// Print one JSON array instead of a table (with each failing message's failure fingerprint).
        #[arg(long)]
        json: bool,
    },
    /// Make parked messages due now (after a fix): a running consumer tries them at its next look, each key in
    /// order.
    RetryNow {
        #[command(flatten)]
        db: DbArgs,
        /// Parked message ids (see `list`).
        ids: Vec<i64>,
        /// Every parked message (of --group, if given).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        /// Only this consumer group (with --all).
        #[arg(long)]
        group: Option<String>,
        #[command(flatten)]
        actor: Actor,
    },
    /// Give up on parked messages: each becomes a dead letter that says who discarded it, why, and its history
    /// (replayable like any dead letter); the next message of its key goes on.
    Discard {
        #[command(flatten)]
        db: DbArgs,
        /// Parked message ids (see `list`).
        #[arg(required = true)]
        ids: Vec<i64>,
        /// Why: kept in the dead letter's reason.
        #[arg(long)]
        reason: String,
        /// Who: kept in the dead letter's reason and the audit trail.
        #[command(flatten)]
        actor: Actor,
    },
}

/// Runs an `idem parked` command.
pub async fn run(command: ParkedCommand) -> anyhow::Result<ExitCode> {
    match command {
        ParkedCommand::List { db, group, limit, message_type, json } => {
            let typing = message_type
                .as_deref()
                .map(idem::dead_letter::groups::MessageType::parse)
                .transpose()
                .map_err(|e| anyhow::anyhow!("--message-type: {e}"))?;
            let (pool, tables) = Db::open_with(&db, "parked_messages").await?;
            let parked =
                with_pool!(&pool, pool => idem::delayed_retry::list(pool, &tables, group.as_deref(), limit).await?);
            if json {
                let rows: Vec<serde_json::Value> = parked
                    .iter()
                    .map(|p| {
                        let message = p.message();
                        let fingerprint = p.error.as_deref().map(|error| {
                            let message_type = typing.as_ref().and_then(|t| t.of(&message.headers, &message.payload));
                            idem::dead_letter::groups::fingerprint(&p.consumer_group, message_type.as_deref(), error)
                        });
                        serde_json::json!({
                            "fingerprint": fingerprint,
                            "id": p.id, "consumer_group": p.consumer_group, "event_id": p.event_id,
                            "topic": p.topic, "partition": p.partition, "offset": p.offset.to_string(),
                            "key": p.key.as_deref().map(String::from_utf8_lossy),
                            "payload": crate::json_payload(&p.payload), "attempts": p.attempts,
                            "delayed_retries": p.delayed_retries, "error": p.error,
                            "history": p.history.lines().filter_map(|l| serde_json::from_str(l).ok())
                                .collect::<Vec<serde_json::Value>>(),
                            "parked_at": idem::store::rfc3339_from_ms(p.parked_at),
                            "due_at": idem::store::rfc3339_from_ms(p.due_at),
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string(&rows)?);
            } else if parked.is_empty() {
                println!("no parked messages");
            } else {
                println!(
                    "{:>6} {:<20} {:<24} {:<28} {:>8} {:>7} {:<24}  last error",
                    "id", "group", "event_id", "position", "attempts", "delayed", "due"
                );
                for p in &parked {
                    let position = format!("{}/{}@{}", p.topic, p.partition, p.offset);
                    println!(
                        "{:>6} {:<20} {:<24} {:<28} {:>8} {:>7} {:<24}  {}",
                        p.id,
                        p.consumer_group,
                        p.event_id,
                        position,
                        p.attempts,
                        p.delayed_retries,
                        idem::store::rfc3339_from_ms(p.due_at),
                        p.error.as_deref().unwrap_or("(waits behind its key)")
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        ParkedCommand::RetryNow { db, ids, all, group, actor } => {
            if ids.is_empty() && !all {
                bail!("name the parked messages to retry now (ids from `idem parked list`), or pass --all");
            }
            let (pool, tables) = Db::open_with(&db, "parked_messages").await?;
            let made_due = retry_now(&pool, &tables, &ids, all, group.as_deref()).await;
            let subjects = if all {
                format!("all of group {}", group.as_deref().unwrap_or("(any)"))
            } else {
                format!("ids {ids:?}")
            };
            let count = made_due.as_ref().map_or(0, |n| *n as i64);
            note(&pool, &tables, &actor.name(), "parked retry-now", subjects, &made_due, count).await;
            println!("{} parked message(s) due now; a running consumer tries them at its next look", made_due?);
            Ok(ExitCode::SUCCESS)
        }
        ParkedCommand::Discard { db, ids, reason, actor } => {
            if reason.trim().is_empty() {
                bail!("--reason is empty: say why these messages are discarded (it is kept with them)");
            }
            let by = actor.name();
            let (pool, tables) = Db::open_with(&db, "parked_messages").await?;
            let mut missing = Vec::new();
            let mut discarded = 0;
            let mut failure = None;
            for id in &ids {
                match with_pool!(&pool, pool => idem::delayed_retry::discard(pool, &tables, *id, &by, &reason).await) {
                    Ok(true) => {
                        discarded += 1;
                        println!("parked message {id} discarded into the dead letters");
                    }
                    Ok(false) => missing.push(*id),
                    Err(error) => {
                        failure = Some(error);
                        break;
                    }
                }
            }
            let outcome: anyhow::Result<()> = match failure {
                Some(error) => Err(error.into()),
                None => Ok(()),
            };
            let subjects = format!("ids {ids:?}, reason: {reason}");
            note(&pool, &tables, &by, "parked discard", subjects, &outcome, discarded).await;
            outcome?;
            if !missing.is_empty() {
                eprintln!("not parked (any more): {missing:?}");
                return Ok(ExitCode::FAILURE);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Makes the named parked messages (or all, of `group`) due now; how many.
async fn retry_now(
    pool: &Db,
    tables: &idem::Tables,
    ids: &[i64],
    all: bool,
    group: Option<&str>,
) -> anyhow::Result<u64> {
    let mut made_due = 0;
    if all {
        made_due = with_pool!(pool, pool => idem::delayed_retry::retry_now(pool, tables, group, None).await?);
    }
    for id in ids {
        made_due += with_pool!(pool, pool => idem::delayed_retry::retry_now(pool, tables, None, Some(*id)).await?);
    }
    Ok(made_due)
}
