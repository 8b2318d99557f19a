//! `idem dead-letters …`: list them, group them by failure, replay them, discard them into the archive (see
//! `idem::dead_letter`). Every command that acts writes the audit trail.

use std::process::ExitCode;

use anyhow::bail;
use clap::Subcommand;
use idem::dead_letter::groups::{MessageType, fingerprint_of};
use idem::dead_letter::{Replayed, Safety};
use idem::embedded::EmbeddedLog;
use idem::store::DeadLetter;
use idem::{Publisher, Tables};

use crate::DbArgs;
use crate::audit::{Actor, note};
use crate::commands::{BrokerFlags, BrokerTarget};
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
        #[arg(long, default_value_t = 100)]
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
    /// Replay dead letters: remove marker and row together and publish the stored message again. A letter
    /// older than every marker its group keeps is refused without --force (its marker was pruned: a copy
    /// delivered since may have been applied); one whose event was applied since is always refused.
    Replay {
        #[command(flatten)]
        db: DbArgs,
        /// Where to publish: each message goes back to the topic, subject or queue it came from.
        #[command(flatten)]
        to: BrokerFlags,
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
        #[arg(long, default_value_t = 100)]
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

/// A [`Selection`] checked: the duration and the message type parsed.
struct Filter<'a> {
    select: &'a Selection,
    failed_before_ms: Option<i64>,
    typing: Option<MessageType>,
}

impl Selection {
    fn filter(&self) -> anyhow::Result<Filter<'_>> {
        let failed_before_ms = match &self.older_than {
            Some(text) => {
                let age = idem::duration::parse(text).map_err(|e| anyhow::anyhow!("--older-than: {e}"))?;
                Some(now_ms().saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX)))
            }
            None => None,
        };
        let typing = self
            .message_type
            .as_deref()
            .map(MessageType::parse)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--message-type: {e}"))?;
        Ok(Filter { select: self, failed_before_ms, typing })
    }

    /// Whether a filter beyond the consumer group is set.
    fn narrows(&self) -> bool {
        self.matching.is_some() || self.fingerprint.is_some() || self.older_than.is_some()
    }
}

impl Filter<'_> {
    fn takes(&self, letter: &DeadLetter) -> bool {
        let s = self.select;
        s.matching.as_deref().is_none_or(|text| letter.error.contains(text))
            && self.failed_before_ms.is_none_or(|before| letter.last_failed_at_ms < before)
            && s.fingerprint.as_deref().is_none_or(|f| fingerprint_of(letter, self.typing.as_ref()) == f.trim())
    }

    /// The dead letters taken, oldest first, at most `limit`.
    async fn letters(&self, db: &Db, tables: &Tables, limit: i64) -> anyhow::Result<Vec<DeadLetter>> {
        let fetch = if self.select.narrows() { i64::MAX } else { limit };
        let group = self.select.group.as_deref();
        let letters = with_pool!(db, pool => idem::dead_letter::list(pool, tables, group, fetch).await?);
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        Ok(letters.into_iter().filter(|l| self.takes(l)).take(limit).collect())
    }

    /// The selection as the audit trail records it.
    fn describe(&self) -> String {
        let s = self.select;
        let parts: Vec<String> = [
            s.group.as_ref().map(|g| format!("group {g}")),
            s.matching.as_ref().map(|m| format!("matching {m:?}")),
            s.fingerprint.as_ref().map(|f| format!("fingerprint {f}")),
            s.older_than.as_ref().map(|o| format!("older than {o}")),
            s.message_type.as_ref().map(|t| format!("message type from {t}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        if parts.is_empty() { "all".to_owned() } else { parts.join(", ") }
    }
}

fn now_ms() -> i64 {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}

/// Runs an `idem dead-letters` command.
pub async fn run(command: DeadLetterCommand) -> anyhow::Result<ExitCode> {
    match command {
        DeadLetterCommand::List { db, select, limit, json } => list(&db, &select.filter()?, limit, json).await,
        DeadLetterCommand::Groups { db, select, json } => groups(&db, &select.filter()?, json).await,
        DeadLetterCommand::Replay { db, to, ids, all, select, force, actor } => {
            let target = to.target()?;
            let safety = if force { Safety::Forced } else { Safety::Checked };
            replay(&db, &target, &Chosen { ids: &ids, all, filter: select.filter()? }, safety, &actor.name()).await
        }
        DeadLetterCommand::Discard { db, ids, all, select, reason, actor } => {
            if reason.trim().is_empty() {
                bail!("--reason is empty: say why these dead letters are discarded (the archive keeps it)");
            }
            discard(&db, &Chosen { ids: &ids, all, filter: select.filter()? }, &reason, &actor.name()).await
        }
        DeadLetterCommand::Archived { db, group, limit, json } => archived(&db, group.as_deref(), limit, json).await,
    }
}

async fn list(args: &DbArgs, filter: &Filter<'_>, limit: i64, json: bool) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letters").await?;
    let letters = filter.letters(&db, &tables, limit).await?;
    if json {
        let rows: Vec<serde_json::Value> = letters
            .iter()
            .map(|l| {
                let mut row = serde_json::to_value(l).unwrap_or_default();
                row["fingerprint"] = fingerprint_of(l, filter.typing.as_ref()).into();
                row
            })
            .collect();
        println!("{}", serde_json::to_string(&rows)?);
    } else if letters.is_empty() {
        println!("no dead letters");
    } else {
        println!("{:>6} {:<20} {:<24} {:<28} {:>8}  error", "id", "group", "event_id", "position", "attempts");
        for l in &letters {
            let position = format!("{}/{}@{}", l.topic, l.partition, l.offset);
            let event_id = l.event_id.as_deref().unwrap_or("(no key)");
            println!(
                "{:>6} {:<20} {:<24} {:<28} {:>8}  {}",
                l.id, l.consumer_group, event_id, position, l.attempts, l.error
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn groups(args: &DbArgs, filter: &Filter<'_>, json: bool) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letters").await?;
    let letters = filter.letters(&db, &tables, i64::MAX).await?;
    let groups = idem::dead_letter::groups::group(&letters, filter.typing.as_ref());
    if json {
        let rows: Vec<serde_json::Value> = groups
            .iter()
            .map(|g| {
                serde_json::json!({
                    "fingerprint": g.fingerprint, "consumer_group": g.consumer_group,
                    "message_type": g.message_type, "pattern": g.pattern, "count": g.count,
                    "first_failed_at": idem::store::rfc3339_from_ms(g.first_failed_at_ms),
                    "last_failed_at": idem::store::rfc3339_from_ms(g.last_failed_at_ms), "sample": g.sample,
                    "ids": g.ids,
                })
            })
            .collect();
        println!("{}", serde_json::to_string(&rows)?);
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
        println!(
            "replay a group: idem dead-letters replay --fingerprint F (--log-dir DIR | --kafka BROKERS | …); \
             discard one: idem dead-letters discard --fingerprint F --reason TEXT"
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The dead letters an acting command names: ids, or `--all` of what the filters take.
struct Chosen<'a> {
    ids: &'a [i64],
    all: bool,
    filter: Filter<'a>,
}

impl Chosen<'_> {
    /// The letters, every id checked; refused when nothing names them.
    async fn letters(&self, db: &Db, tables: &Tables, verb: &str) -> anyhow::Result<Vec<DeadLetter>> {
        let narrowed = self.filter.select.narrows();
        if self.ids.is_empty() && !self.all && !narrowed {
            bail!(
                "name the dead letters to {verb} (ids from `idem dead-letters list`), or pass --all, --matching TEXT, \
                 --fingerprint F (from `idem dead-letters groups`) or --older-than DURATION"
            );
        }
        let every = self.ids.is_empty();
        let letters: Vec<DeadLetter> = self
            .filter
            .letters(db, tables, i64::MAX)
            .await?
            .into_iter()
            .filter(|l| every || self.ids.contains(&l.id))
            .collect();
        for id in self.ids {
            if !letters.iter().any(|l| l.id == *id) {
                bail!("no dead letter with id {id} among those the filters take; see `idem dead-letters list`");
            }
        }
        if let (Some(fingerprint), true) = (&self.filter.select.fingerprint, letters.is_empty()) {
            let typing = match &self.filter.select.message_type {
                Some(t) => format!("with --message-type {t}"),
                None => "without --message-type".to_owned(),
            };
            bail!(
                "no dead letter has fingerprint {fingerprint} {typing}: a fingerprint depends on the message type \
                 setting, so take it from `idem dead-letters groups` run with the same --message-type (and filters)"
            );
        }
        Ok(letters)
    }

    /// What the audit trail records as the subjects.
    fn subjects(&self) -> String {
        if self.ids.is_empty() { self.filter.describe() } else { format!("ids {:?}", self.ids) }
    }
}

async fn replay(
    args: &DbArgs,
    target: &BrokerTarget,
    chosen: &Chosen<'_>,
    safety: Safety,
    actor: &str,
) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letters").await?;
    let letters = chosen.letters(&db, &tables, "replay").await?;
    let tally = replay_to(&db, &tables, target, &letters, safety).await;
    let count = tally.as_ref().map_or(0, |t| t.replayed as i64);
    let mut subjects = chosen.subjects();
    if safety == Safety::Forced {
        subjects.push_str(", forced");
    }
    let outcome = match &tally {
        Ok(Tally { stopped_by: Some(error), replayed, .. }) => {
            Err(anyhow::anyhow!("stopped after {replayed} replayed: {error:#}"))
        }
        Ok(t) if t.refused > 0 => Err(anyhow::anyhow!("{} refused: it could apply an effect twice", t.refused)),
        Ok(_) => Ok(()),
        Err(error) => Err(anyhow::anyhow!("{error:#}")),
    };
    note(&db, &tables, actor, "dead-letters replay", subjects, &outcome, count).await;
    let mut tally = tally?;
    println!("{} dead letter(s) replayed", tally.replayed);
    if let Some(error) = tally.stopped_by.take() {
        return Err(error.context(format!("the replay stopped after {} dead letter(s)", tally.replayed)));
    }
    if tally.refused > 0 {
        eprintln!("{} dead letter(s) refused (see above); nothing was published for them", tally.refused);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// What a replay did, up to the error that stopped it if one did.
#[derive(Default)]
struct Tally {
    replayed: usize,
    refused: usize,
    stopped_by: Option<anyhow::Error>,
}

/// Replays `letters` through the broker `target` names.
async fn replay_to(
    db: &Db,
    tables: &Tables,
    target: &BrokerTarget,
    letters: &[DeadLetter],
    safety: Safety,
) -> anyhow::Result<Tally> {
    match target {
        BrokerTarget::Log(dir) => {
            if !dir.join("topics").is_dir() {
                bail!("--log-dir {}: there is no embedded log there (it holds a topics/ folder)", dir.display());
            }
            replay_through(db, tables, &EmbeddedLog::open(dir)?.producer(), letters, safety).await
        }
        BrokerTarget::Kafka(brokers) => {
            replay_through(db, tables, &idem::kafka::KafkaProducer::new(brokers)?, letters, safety).await
        }
        BrokerTarget::Nats(url) => replay_nats(db, tables, url, letters, safety).await,
        BrokerTarget::Rabbitmq(url) => replay_rabbitmq(db, tables, url, letters, safety).await,
        BrokerTarget::Sqs(endpoint) => {
            replay_through(db, tables, &crate::sqs::producer(endpoint).await?.0, letters, safety).await
        }
        BrokerTarget::PubSub(project) => replay_pubsub(db, tables, project, letters, safety).await,
    }
}

#[cfg(feature = "nats")]
async fn replay_nats(
    db: &Db,
    tables: &Tables,
    url: &str,
    letters: &[DeadLetter],
    safety: Safety,
) -> anyhow::Result<Tally> {
    replay_through(db, tables, &idem::nats::NatsProducer::connect(url).await?, letters, safety).await
}

#[cfg(not(feature = "nats"))]
async fn replay_nats(_: &Db, _: &Tables, _: &str, _: &[DeadLetter], _: Safety) -> anyhow::Result<Tally> {
    bail!("--nats: this idem is built without the `nats` feature")
}

#[cfg(feature = "rabbitmq")]
async fn replay_rabbitmq(
    db: &Db,
    tables: &Tables,
    url: &str,
    letters: &[DeadLetter],
    safety: Safety,
) -> anyhow::Result<Tally> {
    replay_through(db, tables, &idem::rabbitmq::RabbitProducer::connect(url).await?, letters, safety).await
}

#[cfg(not(feature = "rabbitmq"))]
async fn replay_rabbitmq(_: &Db, _: &Tables, _: &str, _: &[DeadLetter], _: Safety) -> anyhow::Result<Tally> {
    bail!("--rabbitmq: this idem is built without the `rabbitmq` feature")
}

#[cfg(feature = "pubsub")]
async fn replay_pubsub(
    db: &Db,
    tables: &Tables,
    project: &str,
    letters: &[DeadLetter],
    safety: Safety,
) -> anyhow::Result<Tally> {
    let producer = idem::pubsub::PubSubProducer::connect(Some(project), None).await?;
    replay_through(db, tables, &producer, letters, safety).await
}

#[cfg(not(feature = "pubsub"))]
async fn replay_pubsub(_: &Db, _: &Tables, _: &str, _: &[DeadLetter], _: Safety) -> anyhow::Result<Tally> {
    bail!("--pubsub: this idem is built without the `pubsub` feature")
}

async fn replay_through<P: Publisher>(
    db: &Db,
    tables: &Tables,
    publisher: &P,
    letters: &[DeadLetter],
    safety: Safety,
) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    for letter in letters {
        let replayed = with_pool!(db, pool => idem::dead_letter::replay(pool, tables, publisher, letter, safety).await);
        let replayed = match replayed {
            Ok(replayed) => replayed,
            Err(error) => {
                tally.stopped_by = Some(anyhow::anyhow!("dead letter {}: {error}", letter.id));
                return Ok(tally);
            }
        };
        match replayed {
            Replayed::Published => {
                tally.replayed += 1;
                println!("replayed {} ({})", letter.id, letter.event_id.as_deref().unwrap_or("no key"));
            }
            Replayed::Gone => println!("{}: gone (replayed or discarded meanwhile)", letter.id),
            Replayed::Refused(risk) => {
                tally.refused += 1;
                eprintln!("refused: {}", risk.explain(letter));
            }
        }
    }
    Ok(tally)
}

async fn discard(args: &DbArgs, chosen: &Chosen<'_>, reason: &str, actor: &str) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letter_archive").await?;
    let letters = chosen.letters(&db, &tables, "discard").await?;
    let discarded: anyhow::Result<usize> = with_pool!(&db, pool =>
        idem::dead_letter::discard(pool, &tables, &letters, actor, reason).await.map_err(anyhow::Error::from));
    let count = discarded.as_ref().map_or(0, |n| *n as i64);
    let subjects = format!("{}, reason: {reason}", chosen.subjects());
    note(&db, &tables, actor, "dead-letters discard", subjects, &discarded, count).await;
    let discarded = discarded?;
    println!("{discarded} dead letter(s) discarded into the archive; see `idem dead-letters archived`");
    if discarded < letters.len() {
        eprintln!("{} were under replay or gone meanwhile, and were left", letters.len() - discarded);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
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
