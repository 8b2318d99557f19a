//! Dead letters: see them and replay them.
//!
//! A replay must neither lose the message nor apply it twice. It runs in three steps: (1) one transaction
//! deletes the event's marker and marks the row `replaying`; (2) the stored message is published again (with
//! its original headers and payload, so it carries the same event id); (3) the row is deleted if it is still
//! `replaying`. A crash between the steps leaves the row in place, and replaying it again is safe: step 1 of a
//! row already `replaying` keeps the marker, which then absorbs a second copy. If the replayed message fails
//! again, the engine sets the row back to `dead` and step 3 leaves it.
//!
//! Step 1 refuses a replay that could apply the effect twice ([`ReplayRisk`]): a letter older than every marker
//! its consumer group keeps (the markers of its time were pruned, so a copy delivered since may have been
//! applied without a trace; [`Safety::Forced`] accepts that), and a letter whose event was applied after it
//! failed (never replayed; discard it instead).
//!
//! The copy carries the header `idem-replay-for: <group>`: other consumer groups of the topic skip it (it was
//! delivered to them the first time), so a replay re-runs one group's handler only.
//!
//! An HTTP request's dead letter (one the ingress wrote, [`HTTP_REQUEST_HEADER`]) has no broker to go back to, and
//! its client retries on its own (a webhook sender retries a `422` for days): its replay **releases its key**
//! instead. A copy goes to the archive, step 1 deletes its marker, step 3 deletes the row, and nothing is
//! published: the client's next retry is applied as new ([`Replayed::Released`]).

pub mod groups;
pub mod selection;

use crate::error::Error;
use crate::source::Publisher;
use crate::store::archive::{ArchivedLetter, Discard};
use crate::store::{Backend, DeadLetter, ReplayStart, Tables};

pub use crate::store::ReplayRisk;

/// The header that addresses a replayed copy to one consumer group.
pub const REPLAY_FOR_HEADER: &str = "idem-replay-for";

/// The header the HTTP ingress puts on each request's message (its value: the request's path); a request cannot
/// set it.
pub const HTTP_REQUEST_HEADER: &str = "idem-http-request";

/// The publisher of a replay that has no broker: an HTTP request's replay publishes nothing and goes ahead, any
/// other letter's fails, naming the broker flags.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoBroker;

impl Publisher for NoBroker {
    async fn publish(&self, message: &crate::message::Message) -> Result<(), crate::source::SourceError> {
        Err(crate::source::SourceError::permanent(
            "replay",
            format!(
                "no broker was named to publish a copy to {}: only HTTP requests are replayed without one",
                message.topic
            ),
        ))
    }
}

/// How the reason of an id-reuse dead letter starts.
pub const ID_REUSED_PREFIX: &str = "id_reused:";

/// Dead letters, oldest first, of one group or of all.
pub async fn list<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadLetter>, Error> {
    let query = crate::store::letter_pages::LetterQuery { group, ..crate::store::letter_pages::LetterQuery::ALL };
    DB::letter_page(pool, tables, &query, limit).await
}

/// Whether a replay goes ahead when the markers of the letter's time have been pruned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Safety {
    /// Refuse it ([`ReplayRisk::MarkersPruned`]).
    Checked,
    /// Replay anyway: the operator checked that the effect was not applied (`--force`).
    Forced,
}

/// How a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replayed {
    /// The copy is published.
    Published,
    /// An HTTP request's key is released (its marker deleted, the letter archived): nothing is published, the
    /// client's next retry is applied as new.
    Released,
    /// No dead letter has that id any more.
    Gone,
    /// Another replay of it is at work (begun less than [`crate::store::replay::REPLAY_LEASE`] ago): nothing done.
    Busy {
        /// When that replay began, ms since the epoch.
        since_ms: i64,
    },
    /// Not replayed: it could apply the effect twice.
    Refused(ReplayRisk),
}

impl ReplayRisk {
    /// Why `letter` is not replayed, and what to do instead.
    pub fn explain(self, letter: &DeadLetter) -> String {
        let failed = crate::store::rfc3339_from_ms(letter.last_failed_at_ms);
        match self {
            ReplayRisk::MarkersPruned => format!(
                "dead letter {} failed at {failed}, and consumer group {:?} keeps no marker from that time or before: \
                 the markers of its time were pruned (the marker retention), so a copy the broker delivered since \
                 could have been applied without a trace, and a replay would apply it twice. Check its effect; replay \
                 it with --force if it is not there (a group on natural keys keeps no markers: its unique key absorbs \
                 a second copy, so --force is safe there), or discard it with `idem dead-letters discard {} --reason \
                 TEXT`",
                letter.id, letter.consumer_group, letter.id
            ),
            ReplayRisk::IdReused => format!(
                "dead letter {} is an event whose id was already used by another event: a copy under the same id \
                 would be refused again. Fix the producer and publish it under a new id, then discard this one with \
                 `idem dead-letters discard {} --reason TEXT`",
                letter.id, letter.id
            ),
            ReplayRisk::RelayLetter => format!(
                "dead letter {} is a message outbox relay {:?} gave up on, not a consumer's: put it back into the \
                 outbox with `idem outbox requeue {}` (or the console's outbox page)",
                letter.id,
                letter.consumer_group.trim_start_matches("outbox:"),
                letter.id
            ),
            ReplayRisk::HttpRequest => format!(
                "dead letter {} is an HTTP request: it cannot be edited and replayed, as its client sends it again. \
                 Replay it unedited to release its key (its client's next retry is applied as new), or discard it",
                letter.id
            ),
            ReplayRisk::AppliedSince => format!(
                "dead letter {}'s event {:?} was applied by consumer group {:?} after it failed at {failed} (its \
                 marker is newer): a replay would apply it twice. Discard it with `idem dead-letters discard {} \
                 --reason TEXT`",
                letter.id,
                letter.event_id.as_deref().unwrap_or(""),
                letter.consumer_group,
                letter.id
            ),
        }
    }
}

/// Replays one dead letter through `publisher`, unless that could apply its effect twice (see the module).
pub async fn replay<DB: Backend, P: Publisher>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    publisher: &P,
    letter: &DeadLetter,
    safety: Safety,
) -> Result<Replayed, Error> {
    if let Some(risk) = unreplayable(letter) {
        return Ok(Replayed::Refused(risk));
    }
    let replayed = publish_copy(pool, tables, publisher, letter, None, safety).await?;
    if replayed == Replayed::Published {
        tracing::info!(id = letter.id, consumer_group = %letter.consumer_group, event_id = letter.event_id.as_deref().unwrap_or(""), topic = %letter.topic, "dead letter replayed");
    }
    Ok(replayed)
}

/// Steps 1 to 3 of a replay (see the module): the letter held and its marker deleted, its copy (with `payload` in
/// place of its own, when given) published, the row deleted. Anything but `Published` did nothing.
async fn publish_copy<DB: Backend, P: Publisher>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    publisher: &P,
    letter: &DeadLetter,
    payload: Option<Vec<u8>>,
    safety: Safety,
) -> Result<Replayed, Error> {
    if is_http_request(letter) {
        return release(pool, tables, letter, safety).await;
    }
    let start = DB::begin_replay(pool, tables, letter.id, safety == Safety::Forced, false).await?;
    if let Some(not_started) = not_started(start) {
        return Ok(not_started);
    }
    let mut copy = letter.message();
    if let Some(payload) = payload {
        copy.payload = payload;
    }
    copy.headers.retain(|(name, _)| name != REPLAY_FOR_HEADER);
    copy.headers.push((REPLAY_FOR_HEADER.to_owned(), letter.consumer_group.clone().into_bytes()));
    if let Err(error) = publisher.publish(&copy).await {
        // Not published: the letter is dead again at once, rather than held as a replay for a minute.
        if let Err(abandon) = DB::abandon_replay(pool, tables, letter.id).await {
            tracing::warn!(id = letter.id, error = %abandon, "a failed replay's letter stays held until its lease ends");
        }
        return Err(error.into());
    }
    DB::finish_replay(pool, tables, letter.id).await?;
    Ok(Replayed::Published)
}

/// An HTTP request's replay: after the same checks, a copy of the letter goes to the archive (the request stays at
/// hand should its client never retry), then its marker and the row are deleted, so that the client's next retry
/// is applied as new. A cut between the steps leaves the row `replaying` (resumed by the next replay after the
/// lease) or `dead` with an archive copy: nothing applied twice, nothing lost.
async fn release<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    letter: &DeadLetter,
    safety: Safety,
) -> Result<Replayed, Error> {
    match check_replay(pool, tables, letter, safety).await? {
        Replayed::Released => {}
        other => return Ok(other),
    }
    let reason = "an HTTP request's key released by a replay: its client's next retry is applied as new";
    let copy = Discard { actor: "replay", reason, at_ms: crate::engine::now_ms() };
    if !DB::archive_copy(pool, tables, letter, &copy).await? {
        return Ok(Replayed::Gone);
    }
    let start = DB::begin_replay(pool, tables, letter.id, safety == Safety::Forced, false).await?;
    if let Some(not_started) = not_started(start) {
        return Ok(not_started);
    }
    DB::finish_replay(pool, tables, letter.id).await?;
    tracing::info!(id = letter.id, consumer_group = %letter.consumer_group, event_id = letter.event_id.as_deref().unwrap_or(""), "an HTTP request's dead letter released: its client's next retry is applied");
    Ok(Replayed::Released)
}

/// Whether `letter` is an HTTP request's (the ingress marked its message).
pub fn is_http_request(letter: &DeadLetter) -> bool {
    letter.headers.iter().any(|(name, _)| name == HTTP_REQUEST_HEADER)
}

/// What a replay's first step that did not start means for the operator; `None` when it started.
fn not_started(start: ReplayStart) -> Option<Replayed> {
    match start {
        ReplayStart::Started => None,
        ReplayStart::Gone => Some(Replayed::Gone),
        ReplayStart::Busy { since_ms } => Some(Replayed::Busy { since_ms }),
        ReplayStart::Refused(risk) => Some(Replayed::Refused(risk)),
    }
}

/// Replays `letter` with its payload replaced by `payload` (an operator's edit), after the same checks as
/// [`replay`]: the original is first copied to the archive (reason `edited by ACTOR and replayed; this is the
/// original`), then the edited copy is published under the same event id, and the letter leaves the dead letters.
pub async fn replay_edited<DB: Backend, P: Publisher>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    publisher: &P,
    letter: &DeadLetter,
    payload: Vec<u8>,
    safety: Safety,
    actor: &str,
) -> Result<Replayed, Error> {
    if is_http_request(letter) {
        return Ok(Replayed::Refused(ReplayRisk::HttpRequest));
    }
    match check_replay(pool, tables, letter, safety).await? {
        Replayed::Published => {}
        other => return Ok(other),
    }
    let reason = format!("edited by {actor} and replayed; this is the original");
    let original = Discard { actor, reason: &reason, at_ms: crate::engine::now_ms() };
    if !DB::archive_copy(pool, tables, letter, &original).await? {
        return Ok(Replayed::Gone);
    }
    let replayed = publish_copy(pool, tables, publisher, letter, Some(payload), safety).await?;
    if replayed == Replayed::Published {
        tracing::info!(id = letter.id, consumer_group = %letter.consumer_group, actor, "dead letter edited and replayed");
    }
    Ok(replayed)
}

/// What [`replay`] would do with `letter` now, without doing it: `Published` says it would be published,
/// `Released` that its key would be released (an HTTP request's).
pub async fn check_replay<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    letter: &DeadLetter,
    safety: Safety,
) -> Result<Replayed, Error> {
    if let Some(risk) = unreplayable(letter) {
        return Ok(Replayed::Refused(risk));
    }
    let start = DB::begin_replay(pool, tables, letter.id, safety == Safety::Forced, true).await?;
    let started = if is_http_request(letter) { Replayed::Released } else { Replayed::Published };
    Ok(not_started(start).unwrap_or(started))
}

/// What a replay of several letters did (or, checked only, would do), up to the error that stopped it if one did.
#[derive(Debug, Default)]
pub struct Tally {
    /// Published (or, checked only, would be).
    pub replayed: Vec<i64>,
    /// HTTP requests whose key was released (or, checked only, would be).
    pub released: Vec<i64>,
    /// Refused: the id, the risk, and why in words with what to do.
    pub refused: Vec<(i64, ReplayRisk, String)>,
    /// Gone meanwhile (replayed or discarded by someone else).
    pub gone: Vec<i64>,
    /// Being replayed by someone else right now: the id and when that replay began (ms since the epoch).
    pub busy: Vec<(i64, i64)>,
    /// The error that stopped the run, naming the letter.
    pub stopped_by: Option<String>,
}

impl Tally {
    fn count(&mut self, letter: &DeadLetter, replayed: Replayed) {
        match replayed {
            Replayed::Published => self.replayed.push(letter.id),
            Replayed::Released => self.released.push(letter.id),
            Replayed::Gone => self.gone.push(letter.id),
            Replayed::Busy { since_ms } => self.busy.push((letter.id, since_ms)),
            Replayed::Refused(risk) => self.refused.push((letter.id, risk, risk.explain(letter))),
        }
    }

    /// The tally as one JSON object: `replayed` (`would_replay` when `dry_run`), `released` (`would_release`),
    /// `refused` (`id`, `risk`, `why`), `gone`, `busy`, `stopped_by`.
    pub fn json(&self, dry_run: bool) -> serde_json::Value {
        let refused: Vec<serde_json::Value> = self
            .refused
            .iter()
            .map(|(id, risk, why)| serde_json::json!({ "id": id, "risk": risk.as_str(), "why": why }))
            .collect();
        let (done, released) = if dry_run { ("would_replay", "would_release") } else { ("replayed", "released") };
        let busy: Vec<serde_json::Value> = self
            .busy
            .iter()
            .map(|(id, since)| serde_json::json!({ "id": id, "since": crate::store::rfc3339_from_ms(*since) }))
            .collect();
        serde_json::json!({
            "dry_run": dry_run, done: self.replayed, released: self.released, "refused": refused, "gone": self.gone,
            "busy": busy,
            "stopped_by": self.stopped_by,
        })
    }

    /// How it ended, as the audit trail records it: `Ok` or what went wrong.
    pub fn outcome(&self) -> Result<(), String> {
        if let Some(error) = &self.stopped_by {
            return Err(format!("stopped after {} replayed: {error}", self.replayed.len() + self.released.len()));
        }
        if !self.refused.is_empty() {
            let ids: Vec<i64> = self.refused.iter().map(|r| r.0).collect();
            return Err(format!("ids {} refused: a replay could apply their effect twice", selection::join(&ids)));
        }
        if !self.busy.is_empty() {
            let ids: Vec<i64> = self.busy.iter().map(|b| b.0).collect();
            return Err(format!("ids {} were being replayed by another operator", selection::join(&ids)));
        }
        Ok(())
    }
}

impl ReplayRisk {
    /// The risk's name in reports: `markers_pruned`, `applied_since`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayRisk::MarkersPruned => "markers_pruned",
            ReplayRisk::AppliedSince => "applied_since",
            ReplayRisk::IdReused => "id_reused",
            ReplayRisk::RelayLetter => "relay_letter",
            ReplayRisk::HttpRequest => "http_request",
        }
    }
}

/// Replays `letters` in order through `publisher`, telling `on_each` how each went as it goes; the first error
/// stops the run (see [`Tally::stopped_by`]).
pub async fn replay_each<DB: Backend, P: Publisher>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    publisher: &P,
    letters: &[DeadLetter],
    safety: Safety,
    mut on_each: impl FnMut(&DeadLetter, Replayed) + Send,
) -> Tally {
    let mut tally = Tally::default();
    for letter in letters {
        match replay(pool, tables, publisher, letter, safety).await {
            Ok(replayed) => {
                on_each(letter, replayed);
                tally.count(letter, replayed);
            }
            Err(error) => {
                tally.stopped_by = Some(format!("dead letter {}: {error}", letter.id));
                break;
            }
        }
    }
    tally
}

/// What [`replay_each`] would do now, changing nothing (a dry run), told to `on_each` as it goes.
pub async fn check_each<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    letters: &[DeadLetter],
    safety: Safety,
    mut on_each: impl FnMut(&DeadLetter, Replayed) + Send,
) -> Tally {
    let mut tally = Tally::default();
    for letter in letters {
        match check_replay(pool, tables, letter, safety).await {
            Ok(replayed) => {
                on_each(letter, replayed);
                tally.count(letter, replayed);
            }
            Err(error) => {
                tally.stopped_by = Some(format!("dead letter {}: {error}", letter.id));
                break;
            }
        }
    }
    tally
}

/// Why `letter` is never replayed, whatever the database says: an id-reuse letter cannot be replayed under its id,
/// and a relay's letter goes back into the outbox instead.
fn unreplayable(letter: &DeadLetter) -> Option<ReplayRisk> {
    if letter.consumer_group.starts_with("outbox:") {
        Some(ReplayRisk::RelayLetter)
    } else if letter.error.starts_with(ID_REUSED_PREFIX) {
        Some(ReplayRisk::IdReused)
    } else {
        None
    }
}

/// The longest discard reason, in characters.
pub const MAX_REASON: usize = 1_000;

/// Whether `reason` can be a discard's reason: some text, one line without control characters, at most
/// [`MAX_REASON`] characters (it is kept in the archive and the audit trail, and printed on terminals).
pub fn check_reason(reason: &str) -> Result<(), String> {
    if reason.trim().is_empty() {
        return Err("a discard needs a reason, which the archive keeps".into());
    }
    let length = reason.chars().count();
    if length > MAX_REASON {
        return Err(format!("the reason is {length} characters: say why in at most {MAX_REASON}"));
    }
    if reason.chars().any(char::is_control) {
        return Err("the reason holds a line break or a control character: write it on one line".into());
    }
    Ok(())
}

/// Discards dead letters: each, in one transaction, leaves the dead letters for the archive with who discarded
/// it, when and why. Its marker stays, so a redelivery of the event is still absorbed. Returns the ids of those
/// discarded (a letter under replay, or gone, is left).
pub async fn discard<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    letters: &[DeadLetter],
    actor: &str,
    reason: &str,
) -> Result<Vec<i64>, Error> {
    check_reason(reason).map_err(Error::Config)?;
    let discard = Discard { actor, reason, at_ms: crate::engine::now_ms() };
    let mut discarded = Vec::new();
    for letter in letters {
        if DB::archive_dead_letter(pool, tables, letter, &discard).await? {
            discarded.push(letter.id);
            tracing::info!(id = letter.id, consumer_group = %letter.consumer_group, actor, reason, "dead letter discarded into the archive");
        }
    }
    Ok(discarded)
}

/// Discarded dead letters, newest first, of one group or of all.
pub async fn archived<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    limit: i64,
) -> Result<Vec<ArchivedLetter>, Error> {
    Ok(DB::archived_letters(pool, tables, group, limit).await?)
}

/// The archived letter that was dead letter `id` (who discarded it, when and why), if the archive still holds it.
pub async fn archived_letter<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    id: i64,
) -> Result<Option<ArchivedLetter>, Error> {
    Ok(DB::archived_letter(pool, tables, id).await?)
}

/// Counts the archived letters (of `group`, or of every group) discarded more than `expiry` ago: what
/// [`prune_archive`] would delete.
pub async fn count_archive_expired<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    expiry: std::time::Duration,
) -> Result<i64, Error> {
    Ok(DB::count_archive_expired(pool, tables, group, expired_before(expiry)).await?)
}

/// The discard time before which an archived letter has expired.
fn expired_before(expiry: std::time::Duration) -> i64 {
    crate::engine::now_ms().saturating_sub(i64::try_from(expiry.as_millis()).unwrap_or(i64::MAX))
}

/// Deletes the archived letters (of `group`, or of every group) discarded more than `expiry` ago, in statements
/// of at most `batch_size` rows; how many went.
pub async fn prune_archive<DB: Backend>(
    pool: &sqlx::Pool<DB>,
    tables: &Tables,
    group: Option<&str>,
    expiry: std::time::Duration,
    batch_size: u32,
) -> Result<u64, Error> {
    let before = expired_before(expiry);
    let limit = i64::from(batch_size.max(1));
    let mut deleted = 0;
    loop {
        let n = DB::prune_archive_batch(pool, tables, group, before, limit).await?;
        deleted += n;
        if n < limit as u64 {
            return Ok(deleted);
        }
    }
}
