//! `idem dead-letters …`: list them, group them by failure, replay them, discard them into the archive (see
//! `idem::dead_letter`). Every command that acts writes the audit trail.

use std::process::ExitCode;

use anyhow::bail;
use clap::Subcommand;
use idem::Tables;
use idem::dead_letter::groups::fingerprint_of;
use idem::dead_letter::selection::{Chosen, Filter, FilterSpec, Taken, join};
use idem::dead_letter::{Replayed, Safety, Tally};
use idem::store::DeadLetter;

use crate::DbArgs;
use crate::audit::{Actor, note};
use crate::commands::{BrokerTarget, OptionalBrokerFlags};
use crate::db::Db;
use crate::with_pool;

/// `idem dead-letters …`.
#[derive(Subcommand, Debug)]
pub enum DeadLetterCommand {
    /// List dead letters, oldest first.
    List {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        select: Selection,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        /// Print one JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Failure groups: dead letters that failed the same way (the consumer group, the message type where
    /// --message-type says where to read it, and the reason with its ids, numbers and quoted values stripped),
    /// the largest first, with their count, first and last failure and a sample reason.
    Groups {
        #[command(flatten)]
        db: DbArgs,
        #[command(flatten)]
        select: Selection,
        /// Print one JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Replay dead letters: remove marker and row together and publish the stored message again (a --dry-run
    /// needs no broker). A letter older than every marker its group keeps is refused without --force (its marker was pruned: a copy
    /// delivered since may have been applied); one whose event was applied since is always refused.
    Replay {
        #[command(flatten)]
        db: DbArgs,
        /// Where to publish: each message goes back to the topic, subject or queue it came from.
        #[command(flatten)]
        to: OptionalBrokerFlags,
        /// Dead-letter ids to replay (see `list`).
        ids: Vec<i64>,
        /// Every dead letter the filters take (all of them without filters).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        #[command(flatten)]
        select: Selection,
        /// Replay letters older than the markers kept (after checking their effect is not there).
        #[arg(long)]
        force: bool,
        /// Check each letter and say what a replay would do; publish nothing, change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print one JSON object (replayed, refused with why, gone) instead of a line per letter.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        actor: Actor,
    },
    /// Discard dead letters: each moves, in one transaction, to the archive with who discarded it, when and why
    /// (kept for the archive expiry, `idem prune --archive-expiry`, then deleted). Its marker stays: a
    /// redelivery of the event is still absorbed.
    Discard {
        #[command(flatten)]
        db: DbArgs,
        /// Dead-letter ids to discard (see `list`).
        ids: Vec<i64>,
        /// Every dead letter the filters take (all of them without filters).
        #[arg(long, conflicts_with = "ids")]
        all: bool,
        #[command(flatten)]
        select: Selection,
        /// Why: kept in the archive and the audit trail.
        #[arg(long)]
        reason: String,
        /// List what would be discarded; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print one JSON object (discarded, left) instead of lines.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        actor: Actor,
    },
    /// Discarded dead letters, newest first: who discarded them, when and why.
    Archived {
        #[command(flatten)]
        db: DbArgs,
        /// Only this consumer group.
        #[arg(long)]
        group: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
        limit: i64,
        /// Print one JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// Which dead letters a command takes, and how their failure groups are told apart.
#[derive(clap::Args, Debug, Default)]
pub struct Selection {
    /// Only this consumer group.
    #[arg(long)]
    pub group: Option<String>,
    /// Only those whose reason contains this text.
    #[arg(long)]
    pub matching: Option<String>,
    /// Only those of this failure group (see `groups`).
    #[arg(long, visible_alias = "failure-group", value_name = "FINGERPRINT")]
    pub fingerprint: Option<String>,
    /// Only those that last failed longer ago than this (`30m`, `2h`, `7d`).
    #[arg(long, value_name = "DURATION")]
    pub older_than: Option<String>,
    /// Where messages say their type, part of the failure group: `header:NAME` or `json:/POINTER`.
    #[arg(long, env = "IDEM_MESSAGE_TYPE", value_name = "WHERE")]
    pub message_type: Option<String>,
}

impl Selection {
    /// The selection checked, a wrong value named by its flag.
    fn filter(&self) -> anyhow::Result<Filter> {
        let spec = FilterSpec {
            group: self.group.clone(),
            matching: self.matching.clone(),
            fingerprint: self.fingerprint.clone(),
            older_than: self.older_than.clone(),
            message_type: self.message_type.clone(),
        };
        Filter::parse(spec).map_err(|e| anyhow::anyhow!("--{}: {}", e.field.replace('_', "-"), e.why))
    }
}

/// The dead letters `filter` takes, oldest first, at most `limit`.
async fn letters(db: &Db, tables: &Tables, filter: &Filter, limit: i64) -> anyhow::Result<Vec<DeadLetter>> {
    Ok(with_pool!(db, pool => filter.letters(pool, tables, limit).await?))
}

/// Runs an `idem dead-letters` command.
pub async fn run(command: DeadLetterCommand) -> anyhow::Result<ExitCode> {
    match command {
        DeadLetterCommand::List { db, select, limit, json } => list(&db, &select.filter()?, limit, json).await,
        DeadLetterCommand::Groups { db, select, json } => groups(&db, &select.filter()?, json).await,
        DeadLetterCommand::Replay { db, to, ids, all, select, force, dry_run, json, actor } => {
            // A dry run publishes nothing, nor does the replay of HTTP requests (it releases their keys): neither
            // needs a broker (see `replay`).
            let target = to.target()?;
            let safety = if force { Safety::Forced } else { Safety::Checked };
            let filter = select.filter()?;
            let chosen = Chosen { ids: &ids, all, filter: &filter };
            let how = Acting { actor: actor.name(), dry_run, json };
            replay(&db, target.as_ref(), &chosen, safety, &how).await
        }
        DeadLetterCommand::Discard { db, ids, all, select, reason, dry_run, json, actor } => {
            if let Err(why) = idem::dead_letter::check_reason(&reason) {
                bail!("--reason: {why}");
            }
            let filter = select.filter()?;
            let chosen = Chosen { ids: &ids, all, filter: &filter };
            discard(&db, &chosen, &reason, &Acting { actor: actor.name(), dry_run, json }).await
        }
        DeadLetterCommand::Archived { db, group, limit, json } => archived(&db, group.as_deref(), limit, json).await,
    }
}

async fn list(args: &DbArgs, filter: &Filter, limit: i64, json: bool) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letters").await?;
    let letters = letters(&db, &tables, filter, limit).await?;
    if json {
        let rows: Vec<serde_json::Value> = letters
            .iter()
            .map(|l| {
                let mut row = serde_json::to_value(l).unwrap_or_default();
                row["fingerprint"] = fingerprint_of(l, filter.typing()).into();
                row
            })
            .collect();
        println!("{}", serde_json::to_string(&rows)?);
    } else if letters.is_empty() {
        println!("no dead letters");
    } else {
        println!(
            "{:>6} {:<20} {:<24} {:<28} {:>8} {:<24}  error",
            "id", "group", "event_id", "position", "attempts", "last_failed"
        );
        for l in &letters {
            let position = format!("{}/{}@{}", l.topic, l.partition, l.offset);
            let event_id = l.event_id.as_deref().unwrap_or("(no key)");
            let failed = idem::store::rfc3339_from_ms(l.last_failed_at_ms);
            println!(
                "{:>6} {:<20} {:<24} {:<28} {:>8} {:<24}  {}",
                l.id, l.consumer_group, event_id, position, l.attempts, failed, l.error
            );
        }
        if letters.len() as i64 == limit {
            let total = with_pool!(&db, pool => filter.count(pool, &tables).await?);
            if total > limit {
                eprintln!("{limit} of {total} shown: raise --limit, or narrow with the filters");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn groups(args: &DbArgs, filter: &Filter, json: bool) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letters").await?;
    let groups = with_pool!(&db, pool => filter.groups(pool, &tables).await?);
    if json {
        println!("{}", serde_json::to_string(&groups)?);
    } else if groups.is_empty() {
        println!("no dead letters");
    } else {
        println!(
            "{:<12} {:<20} {:<16} {:>6} {:<24} {:<24}  pattern",
            "fingerprint", "group", "type", "count", "first", "last"
        );
        for g in &groups {
            println!(
                "{:<12} {:<20} {:<16} {:>6} {:<24} {:<24}  {}",
                g.fingerprint,
                g.consumer_group,
                g.message_type.as_deref().unwrap_or("-"),
                g.count,
                idem::store::rfc3339_from_ms(g.first_failed_at_ms),
                idem::store::rfc3339_from_ms(g.last_failed_at_ms),
                g.pattern
            );
        }
        let typing = filter.spec().message_type.as_ref().map(|t| format!(" --message-type {t}")).unwrap_or_default();
        println!(
            "replay a group: idem dead-letters replay --fingerprint F{typing} (--log-dir DIR | --kafka BROKERS | …); \
             discard one: idem dead-letters discard --fingerprint F{typing} --reason TEXT"
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Who runs an acting command, and how.
struct Acting {
    actor: String,
    dry_run: bool,
    json: bool,
}

/// The letters `chosen` names; a refusal is written to the audit trail (unless a dry run) and returned.
async fn taken(
    db: &Db,
    tables: &Tables,
    chosen: &Chosen<'_>,
    how: &Acting,
    verb: &str,
    subjects: String,
) -> anyhow::Result<Vec<DeadLetter>> {
    match with_pool!(db, pool => chosen.letters(pool, tables, verb).await?) {
        Taken::Letters(letters, gone) => {
            if !gone.is_empty() {
                eprintln!("gone meanwhile (replayed since?), left out: {}", idem::dead_letter::selection::join(&gone));
            }
            Ok(letters)
        }
        Taken::Refused(why) => {
            if !how.dry_run {
                let action = format!("dead-letters {verb}");
                note(db, tables, &how.actor, &action, subjects, &Err::<(), _>(&why), 0).await;
            }
            bail!("{why}")
        }
    }
}

async fn replay(
    args: &DbArgs,
    target: Option<&BrokerTarget>,
    chosen: &Chosen<'_>,
    safety: Safety,
    how: &Acting,
) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letters").await?;
    let forced = if safety == Safety::Forced { ", forced" } else { "" };
    let refused_subjects = format!("{}{forced}", chosen.subjects(&[]));
    let letters = taken(&db, &tables, chosen, how, "replay", refused_subjects).await?;
    if !how.dry_run && target.is_none() && !letters.iter().all(idem::dead_letter::is_http_request) {
        bail!(crate::commands::NO_BROKER);
    }
    // A dry run only checks.
    let tally = if !how.dry_run {
        let tally = replay_to(&db, &tables, target, &letters, safety, how).await;
        let taken: Vec<i64> = letters.iter().map(|l| l.id).collect();
        let subjects = format!("{}{forced}", chosen.subjects(&taken));
        let count = tally.as_ref().map_or(0, |t| (t.replayed.len() + t.released.len()) as i64);
        let outcome = match &tally {
            Ok(tally) => tally.outcome(),
            Err(error) => Err(format!("{error:#}")),
        };
        note(&db, &tables, &how.actor, "dead-letters replay", subjects, &outcome, count).await;
        tally?
    } else {
        with_pool!(&db, pool => idem::dead_letter::check_each(pool, &tables, &letters, safety, |l, r| progress(how, l, r)).await)
    };
    report(&tally, how);
    if let Some(error) = &tally.stopped_by {
        let (what, done) = if how.dry_run { ("check", "checked") } else { ("replay", "replayed") };
        bail!("the {what} stopped after {} dead letter(s) {done}: {error}", tally.replayed.len());
    }
    // A dry run did what it was asked (its report says which would be refused); a replay that refused some, or
    // found some at another operator's hands, fails.
    if (!tally.refused.is_empty() || !tally.busy.is_empty()) && !how.dry_run {
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// A line per letter as the replay (or its dry run) goes, in the human form.
fn progress(how: &Acting, letter: &DeadLetter, replayed: Replayed) {
    if how.json {
        return;
    }
    let event = letter.event_id.as_deref().unwrap_or("no key");
    match replayed {
        Replayed::Published if how.dry_run => println!("would replay {} ({event})", letter.id),
        Replayed::Published => println!("replayed {} ({event})", letter.id),
        Replayed::Released if how.dry_run => {
            println!("would release {} ({event}): an HTTP request, its client's next retry applied as new", letter.id)
        }
        Replayed::Released => {
            println!("released {} ({event}): an HTTP request, its client's next retry is applied as new", letter.id)
        }
        Replayed::Gone => println!("{}: gone (replayed or discarded meanwhile)", letter.id),
        Replayed::Busy { since_ms } => eprintln!(
            "{}: being replayed by another operator since {}; nothing published for it",
            letter.id,
            idem::store::rfc3339_from_ms(since_ms)
        ),
        Replayed::Refused(risk) => eprintln!("refused: {}", risk.explain(letter)),
    }
}

/// Prints what a replay did at its end: the summary, or one JSON object.
fn report(tally: &Tally, how: &Acting) {
    if how.json {
        println!("{}", tally.json(how.dry_run));
        return;
    }
    let summary = if how.dry_run { "would be replayed" } else { "replayed" };
    println!("{} dead letter(s) {summary}", tally.replayed.len());
    if !tally.released.is_empty() {
        let released = if how.dry_run { "would have their keys released" } else { "had their keys released" };
        println!("{} HTTP request(s) {released}", tally.released.len());
    }
    if !tally.refused.is_empty() {
        eprintln!("{} dead letter(s) refused (see above); nothing was published for them", tally.refused.len());
    }
}

/// Replays `letters` through the broker `target` names.
async fn replay_to(
    db: &Db,
    tables: &Tables,
    target: Option<&BrokerTarget>,
    letters: &[DeadLetter],
    safety: Safety,
    how: &Acting,
) -> anyhow::Result<Tally> {
    // Without a broker, only HTTP requests are taken (see `replay`): their replays publish nothing.
    Ok(match target {
        Some(target) => {
            let publisher = target.publisher().await?;
            with_pool!(db, pool =>
                idem::dead_letter::replay_each(pool, tables, &publisher, letters, safety, |l, r| progress(how, l, r)).await)
        }
        None => with_pool!(db, pool => idem::dead_letter::replay_each(
            pool, tables, &idem::dead_letter::NoBroker, letters, safety, |l, r| progress(how, l, r)).await),
    })
}

async fn discard(args: &DbArgs, chosen: &Chosen<'_>, reason: &str, how: &Acting) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letter_archive").await?;
    let actor = how.actor.as_str();
    let refused_subjects = format!("{}, reason: {reason}", chosen.subjects(&[]));
    let letters = taken(&db, &tables, chosen, how, "discard", refused_subjects).await?;
    let taken: Vec<i64> = letters.iter().map(|l| l.id).collect();
    if how.dry_run {
        if how.json {
            println!("{}", serde_json::json!({ "dry_run": true, "would_discard": taken }));
        } else {
            for l in &letters {
                println!("would discard {} ({}): {}", l.id, l.event_id.as_deref().unwrap_or("no key"), l.error);
            }
            println!("{} dead letter(s) would be discarded", taken.len());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let discarded: anyhow::Result<Vec<i64>> = with_pool!(&db, pool =>
        idem::dead_letter::discard(pool, &tables, &letters, actor, reason).await.map_err(anyhow::Error::from));
    let count = discarded.as_ref().map_or(0, |ids| ids.len() as i64);
    let subjects = format!("{}, reason: {reason}", chosen.subjects(&taken));
    note(&db, &tables, actor, "dead-letters discard", subjects, &discarded, count).await;
    let discarded = discarded?;
    let left: Vec<i64> = taken.iter().copied().filter(|id| !discarded.contains(id)).collect();
    if how.json {
        println!("{}", serde_json::json!({ "dry_run": false, "discarded": discarded, "left": left }));
    } else {
        println!("{} dead letter(s) discarded into the archive; see `idem dead-letters archived`", discarded.len());
        if !left.is_empty() {
            eprintln!("ids {} were under replay or gone meanwhile, and were left", join(&left));
        }
    }
    Ok(if left.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

async fn archived(args: &DbArgs, group: Option<&str>, limit: i64, json: bool) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letter_archive").await?;
    let archived = with_pool!(&db, pool => idem::dead_letter::archived(pool, &tables, group, limit).await?);
    if json {
        println!("{}", serde_json::to_string(&archived)?);
    } else if archived.is_empty() {
        println!("no discarded dead letters");
    } else {
        println!("{:>6} {:<20} {:<24} {:<24} {:<12}  reason (error)", "id", "group", "event_id", "discarded", "by");
        for a in &archived {
            let l = &a.letter;
            println!(
                "{:>6} {:<20} {:<24} {:<24} {:<12}  {} ({})",
                l.id,
                l.consumer_group,
                l.event_id.as_deref().unwrap_or("(no key)"),
                idem::store::rfc3339_from_ms(a.discarded_at_ms),
                a.discarded_by,
                a.reason,
                l.error
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
