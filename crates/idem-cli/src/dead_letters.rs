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

/// A [`Selection`] checked: the duration and the message type parsed, the fingerprint's form checked.
struct Filter<'a> {
    select: &'a Selection,
    failed_before_ms: Option<i64>,
    typing: Option<MessageType>,
    fingerprint: Option<String>,
}

impl Selection {
    fn filter(&self) -> anyhow::Result<Filter<'_>> {
        let failed_before_ms = match &self.older_than {
            Some(text) => {
                let age = idem::duration::parse(text).map_err(|e| crate::flag_error("--older-than", e))?;
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
        let fingerprint = match &self.fingerprint {
            Some(text) => {
                let fingerprint = text.trim().to_ascii_lowercase();
                if fingerprint.len() != 12 || !fingerprint.bytes().all(|b| b.is_ascii_hexdigit()) {
                    bail!(
                        "--fingerprint {text}: a fingerprint is 12 hexadecimal digits, as `idem dead-letters groups` \
                         prints it"
                    );
                }
                Some(fingerprint)
            }
            None => None,
        };
        Ok(Filter { select: self, failed_before_ms, typing, fingerprint })
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
            && self.fingerprint.as_deref().is_none_or(|f| fingerprint_of(letter, self.typing.as_ref()) == f)
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
        DeadLetterCommand::Replay { db, to, ids, all, select, force, dry_run, json, actor } => {
            let target = to.target()?;
            let safety = if force { Safety::Forced } else { Safety::Checked };
            let chosen = Chosen { ids: &ids, all, filter: select.filter()? };
            let how = Acting { actor: actor.name(), dry_run, json };
            replay(&db, &target, &chosen, safety, &how).await
        }
        DeadLetterCommand::Discard { db, ids, all, select, reason, dry_run, json, actor } => {
            if reason.trim().is_empty() {
                bail!("--reason is empty: say why these dead letters are discarded (the archive keeps it)");
            }
            let chosen = Chosen { ids: &ids, all, filter: select.filter()? };
            discard(&db, &chosen, &reason, &Acting { actor: actor.name(), dry_run, json }).await
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
        let typing = filter.select.message_type.as_ref().map(|t| format!(" --message-type {t}")).unwrap_or_default();
        println!(
            "replay a group: idem dead-letters replay --fingerprint F{typing} (--log-dir DIR | --kafka BROKERS | …); \
             discard one: idem dead-letters discard --fingerprint F{typing} --reason TEXT"
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

/// Who runs an acting command, and how.
struct Acting {
    actor: String,
    dry_run: bool,
    json: bool,
}

impl Chosen<'_> {
    /// The letters, every id checked; refused, naming why, when nothing names them or an id is not there.
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
                bail!("{}", self.why_not_taken(db, tables, *id).await?);
            }
        }
        if let (Some(fingerprint), true) = (&self.filter.fingerprint, letters.is_empty()) {
            bail!("{}", self.why_no_group(db, tables, fingerprint).await?);
        }
        Ok(letters)
    }

    /// Why dead letter `id` is not among those taken: the filters leave it out, it was discarded (by whom, when,
    /// why), or there is no such letter.
    async fn why_not_taken(&self, db: &Db, tables: &Tables, id: i64) -> anyhow::Result<String> {
        let group = self.filter.select.group.as_deref();
        let all = with_pool!(db, pool => idem::dead_letter::list(pool, tables, group, i64::MAX).await?);
        if all.iter().any(|l| l.id == id) {
            return Ok(format!(
                "dead letter {id} is not among those the filters take ({}); drop the filters to name it by id",
                self.filter.describe()
            ));
        }
        let archived = with_pool!(db, pool => idem::dead_letter::archived_letter(pool, tables, id).await);
        if let Ok(Some(a)) = archived {
            return Ok(format!(
                "dead letter {id} was discarded by {} at {} ({}); see `idem dead-letters archived`",
                a.discarded_by,
                idem::store::rfc3339_from_ms(a.discarded_at_ms),
                a.reason
            ));
        }
        Ok(match group {
            Some(group) => format!("no dead letter of group {group} has id {id}; see `idem dead-letters list`"),
            None => format!("no dead letter has id {id} (replayed since?); see `idem dead-letters list`"),
        })
    }

    /// Why failure group `fingerprint` selects nothing: the other filters leave its letters out, they were all
    /// discarded, or the fingerprint was taken with another message-type setting (or is gone).
    async fn why_no_group(&self, db: &Db, tables: &Tables, fingerprint: &str) -> anyhow::Result<String> {
        let typing = self.filter.typing.as_ref();
        let group = self.filter.select.group.as_deref();
        let all = with_pool!(db, pool => idem::dead_letter::list(pool, tables, group, i64::MAX).await?);
        let of_group = all.iter().filter(|l| fingerprint_of(l, typing) == fingerprint).count();
        if of_group > 0 {
            return Ok(format!(
                "failure group {fingerprint} has {of_group} dead letter(s), but the other filters ({}) take none of \
                 them",
                self.filter.describe()
            ));
        }
        let archived = with_pool!(db, pool => idem::dead_letter::archived(pool, tables, group, 10_000).await);
        let discarded: Vec<_> = archived
            .unwrap_or_default()
            .into_iter()
            .filter(|a| fingerprint_of(&a.letter, typing) == fingerprint)
            .collect();
        if let Some(last) = discarded.first() {
            return Ok(format!(
                "failure group {fingerprint} has no dead letter left: {} of its letters were discarded, the last by \
                 {} at {}; see `idem dead-letters archived`",
                discarded.len(),
                last.discarded_by,
                idem::store::rfc3339_from_ms(last.discarded_at_ms)
            ));
        }
        let setting = match &self.filter.select.message_type {
            Some(t) => format!("with --message-type {t}"),
            None => "without --message-type".to_owned(),
        };
        Ok(format!(
            "no dead letter has fingerprint {fingerprint} {setting}: a fingerprint depends on the message-type \
             setting, so take it from `idem dead-letters groups` run with the same --message-type; or its letters \
             were replayed since"
        ))
    }

    /// What the audit trail records as the subjects: the ids named, or the filters and the ids they took.
    fn subjects(&self, taken: &[i64]) -> String {
        if !self.ids.is_empty() {
            return format!("ids {}", join(self.ids));
        }
        let filters = self.filter.describe();
        if taken.is_empty() { filters } else { format!("{filters}: ids {}", join(taken)) }
    }
}

fn join(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
}

async fn replay(
    args: &DbArgs,
    target: &BrokerTarget,
    chosen: &Chosen<'_>,
    safety: Safety,
    how: &Acting,
) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letters").await?;
    let forced = if safety == Safety::Forced { ", forced" } else { "" };
    let letters = match chosen.letters(&db, &tables, "replay").await {
        Ok(letters) => letters,
        Err(refused) => {
            if !how.dry_run {
                let subjects = format!("{}{forced}", chosen.subjects(&[]));
                note(&db, &tables, &how.actor, "dead-letters replay", subjects, &Err::<(), _>(&refused), 0).await;
            }
            return Err(refused);
        }
    };
    let tally = if how.dry_run {
        check_all(&db, &tables, &letters, safety).await
    } else {
        replay_to(&db, &tables, target, &letters, safety).await
    };
    if !how.dry_run {
        let taken: Vec<i64> = letters.iter().map(|l| l.id).collect();
        let subjects = format!("{}{forced}", chosen.subjects(&taken));
        let count = tally.as_ref().map_or(0, |t| t.replayed.len() as i64);
        let outcome = match &tally {
            Ok(Tally { stopped_by: Some(error), replayed, .. }) => {
                Err(anyhow::anyhow!("stopped after {} replayed: {error:#}", replayed.len()))
            }
            Ok(t) if !t.refused.is_empty() => Err(anyhow::anyhow!(
                "ids {} refused: a replay could apply their effect twice",
                join(&t.refused.iter().map(|r| r.0).collect::<Vec<_>>())
            )),
            Ok(_) => Ok(()),
            Err(error) => Err(anyhow::anyhow!("{error:#}")),
        };
        note(&db, &tables, &how.actor, "dead-letters replay", subjects, &outcome, count).await;
    }
    let mut tally = tally?;
    tally.report(how);
    if let Some(error) = tally.stopped_by.take() {
        return Err(error.context(format!("the replay stopped after {} dead letter(s)", tally.replayed.len())));
    }
    // A dry run did what it was asked (its report says which would be refused); a replay that refused some fails.
    if !tally.refused.is_empty() && !how.dry_run {
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// What a replay did (or, dry, would do), up to the error that stopped it if one did.
#[derive(Default)]
struct Tally {
    replayed: Vec<i64>,
    refused: Vec<(i64, idem::dead_letter::ReplayRisk, String)>,
    gone: Vec<i64>,
    stopped_by: Option<anyhow::Error>,
}

impl Tally {
    fn count(&mut self, letter: &DeadLetter, replayed: Replayed) {
        match replayed {
            Replayed::Published => self.replayed.push(letter.id),
            Replayed::Gone => self.gone.push(letter.id),
            Replayed::Refused(risk) => self.refused.push((letter.id, risk, risk.explain(letter))),
        }
    }

    /// Prints what was done: a line per letter, or one JSON object.
    fn report(&self, how: &Acting) {
        if how.json {
            let refused: Vec<serde_json::Value> = self
                .refused
                .iter()
                .map(|(id, risk, why)| {
                    let risk = match risk {
                        idem::dead_letter::ReplayRisk::MarkersPruned => "markers_pruned",
                        idem::dead_letter::ReplayRisk::AppliedSince => "applied_since",
                    };
                    serde_json::json!({ "id": id, "risk": risk, "why": why })
                })
                .collect();
            let done = if how.dry_run { "would_replay" } else { "replayed" };
            println!(
                "{}",
                serde_json::json!({
                    "dry_run": how.dry_run, done: self.replayed, "refused": refused, "gone": self.gone,
                    "stopped_by": self.stopped_by.as_ref().map(|e| format!("{e:#}")),
                })
            );
            return;
        }
        let (verb, summary) =
            if how.dry_run { ("would replay", "would be replayed") } else { ("replayed", "replayed") };
        for id in &self.replayed {
            println!("{verb} {id}");
        }
        for id in &self.gone {
            println!("{id}: gone (replayed or discarded meanwhile)");
        }
        for (_, _, why) in &self.refused {
            eprintln!("refused: {why}");
        }
        println!("{} dead letter(s) {summary}", self.replayed.len());
        if !self.refused.is_empty() {
            eprintln!("{} dead letter(s) refused (see above); nothing was published for them", self.refused.len());
        }
    }
}

/// A dry run: what a replay of each letter would do now.
async fn check_all(db: &Db, tables: &Tables, letters: &[DeadLetter], safety: Safety) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    for letter in letters {
        let checked = with_pool!(db, pool => idem::dead_letter::check_replay(pool, tables, letter, safety).await);
        match checked {
            Ok(checked) => tally.count(letter, checked),
            Err(error) => {
                tally.stopped_by = Some(anyhow::anyhow!("dead letter {}: {error}", letter.id));
                break;
            }
        }
    }
    Ok(tally)
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
        match replayed {
            Ok(replayed) => tally.count(letter, replayed),
            Err(error) => {
                tally.stopped_by = Some(anyhow::anyhow!("dead letter {}: {error}", letter.id));
                break;
            }
        }
    }
    Ok(tally)
}

async fn discard(args: &DbArgs, chosen: &Chosen<'_>, reason: &str, how: &Acting) -> anyhow::Result<ExitCode> {
    let (db, tables) = Db::open_with(args, "dead_letter_archive").await?;
    let actor = how.actor.as_str();
    let letters = match chosen.letters(&db, &tables, "discard").await {
        Ok(letters) => letters,
        Err(refused) => {
            if !how.dry_run {
                let subjects = format!("{}, reason: {reason}", chosen.subjects(&[]));
                note(&db, &tables, actor, "dead-letters discard", subjects, &Err::<(), _>(&refused), 0).await;
            }
            return Err(refused);
        }
    };
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
