//! A duplicate test kit for any handler (feature `testing`, for dev-dependencies): the "duplicate
//! handling tested in CI for every consumer handler", in a few lines, on a real database.
//!
//! The kit delivers a list of messages to a [`Handler`] or [`BatchHandler`] through a real [`Engine`] and
//! compares the state that matters (a snapshot function of yours: balances, order states) against a single clean
//! run, after every event, under each way a broker or a crash duplicates work:
//!
//! 1. every event delivered twice in a row;
//! 2. the whole stream delivered twice;
//! 3. each event redelivered after a crash between the commit and the acknowledgement (a new engine, as after a
//!    restart);
//! 4. each event redelivered after a crash before the commit (the handler ran, its transaction rolled back):
//!    this is where a handler that writes outside idem's transaction (a second connection, an HTTP call that
//!    records something) applies its effect twice;
//! 5. each event delivered by several transactions at once, on separate connections;
//! 6. with [`DuplicateKit::shuffle_by`], the events of each key in another order: reported as a note, not a
//!    failure, when the final state depends on the order (use a [`crate::guard`] or the Sequential Inbox).
//!
//! The first event after which the state differs is reported with its position and a line diff of the two
//! snapshots (their `{:#?}`). The three-line test, "duplicate message does not double credit":
//!
//! ```no_run
//! # use idem::{Config, Event, Handler, HandlerError, KeyExtractor, Message};
//! # struct Credit;
//! # impl Handler<sqlx::Sqlite> for Credit {
//! #     async fn handle(&self, _: &Event, _: &mut sqlx::SqliteConnection) -> Result<(), HandlerError> { Ok(()) }
//! # }
//! # async fn test(pool: sqlx::SqlitePool, payments: Vec<Message>) -> Result<(), idem::Error> {
//! use idem::testing::DuplicateKit;
//!
//! let config = Config::new("ledger-writer", KeyExtractor::JsonPointer("/id".into()));
//! let kit = DuplicateKit::new(
//!     pool,
//!     config,
//!     async |conn| sqlx::query("UPDATE accounts SET balance = 0").execute(conn).await.map(|_| ()),
//!     async |conn| sqlx::query_as::<_, (i64, i64)>("SELECT id, balance FROM accounts ORDER BY id").fetch_all(conn).await,
//! );
//! kit.check(&Credit, &payments).await?.assert_exactly_once();
//! # Ok(()) }
//! ```
//!
//! Each scenario runs under a consumer group of its own (`<group>-kit-<run>-<n>`, new for every run), after your
//! `reset` function has put your tables back to their initial state; idem's tables need to be migrated
//! beforehand. A clean run that dead-letters every event fails (it would prove nothing); one that dead-letters
//! some is noted.
//!
//! For a source's own crate, [`conformance`] is the source conformance suite: what a broker's consumer and
//! producer must do for the guarantee to hold.

pub mod conformance;

use std::fmt::{self, Debug, Write as _};

use crate::config::Config;
use crate::engine::{Engine, Outcome};
use crate::error::Error;
use crate::handler::{BatchHandler, Handler};
use crate::key::KeyExtractor;
use crate::message::{Event, Message};
use crate::store::Backend;

/// The duplicate test kit: a database, the consumer's configuration, how to reset your state and how to read it.
pub struct DuplicateKit<DB: Backend, R, S> {
    pool: sqlx::Pool<DB>,
    config: Config,
    reset: R,
    snapshot: S,
    shuffle_key: Option<KeyExtractor>,
    concurrency: usize,
}

/// What the kit found: one line per scenario, the failures with their first differing event, the notes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Events delivered in the clean run.
    pub events: usize,
    /// Each scenario and whether its state always matched the clean run.
    pub scenarios: Vec<(String, bool)>,
    /// The scenarios that failed: which event first left a different state, and the diff.
    pub failures: Vec<Finding>,
    /// Observations that are not failures (an order-dependent outcome without a guard).
    pub notes: Vec<String>,
}

/// A scenario whose state differed from the clean run's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The scenario.
    pub scenario: String,
    /// The position (0-based) of the first event after which the state differed.
    pub index: usize,
    /// That event's idempotency key, as the configured extractor reads it (or its broker position).
    pub event: String,
    /// The two snapshots, line by line: `-` after a single clean delivery, `+` in this scenario.
    pub diff: String,
}

impl Report {
    /// No scenario found a difference.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    /// Panics with the whole report when a scenario found a difference.
    #[track_caller]
    pub fn assert_exactly_once(&self) {
        assert!(self.passed(), "{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.passed() { "exactly once" } else { "NOT exactly once" };
        writeln!(f, "duplicate test kit: {verdict} ({} scenarios over {} events)", self.scenarios.len(), self.events)?;
        for (scenario, ok) in &self.scenarios {
            writeln!(f, "  {}  {scenario}", if *ok { "ok  " } else { "FAIL" })?;
        }
        for finding in &self.failures {
            writeln!(
                f,
                "\n{}: the state differs after event {} (id {:?}); `-` after one clean delivery, `+` here:",
                finding.scenario, finding.index, finding.event
            )?;
            for line in finding.diff.lines() {
                writeln!(f, "    {line}")?;
            }
        }
        for note in &self.notes {
            writeln!(f, "\nnote: {note}")?;
        }
        Ok(())
    }
}

/// User code under test: a per-message or a batch handler, or a handler behind the Sequential Inbox.
trait Subject<DB: Backend> {
    /// Delivers one message and says whether it was dead-lettered; an error is the kit's (the database went
    /// away), not a finding.
    async fn deliver(&self, engine: &Engine<DB>, message: &Message) -> Result<bool, Error>;
    /// Runs the effect of `event` in a transaction that then rolls back, as a crash before `COMMIT` would.
    async fn run_and_roll_back(&self, event: &Event, tx: &mut DB::Connection);
    /// Empties idem's own tables that are not kept per consumer group (the Sequential Inbox's).
    async fn clear(&self, _engine: &Engine<DB>) -> Result<(), Error> {
        Ok(())
    }
}

struct PerMessage<'h, H>(&'h H);
struct PerBatch<'h, B>(&'h B);

struct Inbox<'h, H>(&'h H, &'h crate::inbox::InboxConfig);

impl<DB: Backend, H: Handler<DB>> Subject<DB> for PerMessage<'_, H> {
    async fn deliver(&self, engine: &Engine<DB>, message: &Message) -> Result<bool, Error> {
        Ok(engine.process(vec![message.clone()], self.0).await?.contains(&Outcome::DeadLettered))
    }
    async fn run_and_roll_back(&self, event: &Event, tx: &mut DB::Connection) {
        let _ = self.0.handle(event, tx).await;
    }
}

impl<DB: Backend, B: BatchHandler<DB>> Subject<DB> for PerBatch<'_, B> {
    async fn deliver(&self, engine: &Engine<DB>, message: &Message) -> Result<bool, Error> {
        Ok(engine.process_batched(vec![message.clone()], self.0).await?.contains(&Outcome::DeadLettered))
    }
    async fn run_and_roll_back(&self, event: &Event, tx: &mut DB::Connection) {
        let _ = self.0.handle_batch(&[event], tx).await;
    }
}

impl<H: Handler<sqlx::Postgres>> Subject<sqlx::Postgres> for Inbox<'_, H> {
    async fn deliver(&self, engine: &Engine<sqlx::Postgres>, message: &Message) -> Result<bool, Error> {
        use crate::inbox::InboxOutcome;
        let inbox = crate::inbox::SequentialInbox::new(engine.clone(), self.1.clone())?;
        let outcomes = inbox.process(vec![message.clone()], self.0).await?;
        Ok(outcomes
            .iter()
            .any(|o| matches!(o, InboxOutcome::DeadLettered | InboxOutcome::Direct(Outcome::DeadLettered))))
    }
    async fn run_and_roll_back(&self, event: &Event, tx: &mut sqlx::PgConnection) {
        let _ = self.0.handle(event, tx).await;
    }
    async fn clear(&self, engine: &Engine<sqlx::Postgres>) -> Result<(), Error> {
        let sql = engine.config().tables.render(
            "DELETE FROM {t}sequenced_message; DELETE FROM {t}sequence_instance; \
             DELETE FROM {t}sequential_inbox_idempotence",
        );
        sqlx::raw_sql(&sql).execute(engine.pool()).await?;
        Ok(())
    }
}

impl<R, S, T> DuplicateKit<sqlx::Postgres, R, S>
where
    R: AsyncFn(&mut sqlx::PgConnection) -> Result<(), sqlx::Error>,
    S: AsyncFn(&mut sqlx::PgConnection) -> Result<T, sqlx::Error>,
    T: Debug + PartialEq,
{
    /// Runs every scenario with a handler behind the Sequential Inbox configured by `inbox` (PostgreSQL). The
    /// inbox's tables are emptied before each scenario; `shuffle_by` is not needed (the inbox orders each
    /// context itself), and the clean run delivers the messages in the order given.
    pub async fn check_inbox<H: Handler<sqlx::Postgres>>(
        &self,
        handler: &H,
        inbox: &crate::inbox::InboxConfig,
        messages: &[Message],
    ) -> Result<Report, Error> {
        self.run(&Inbox(handler, inbox), messages).await
    }
}

impl<DB, R, S, T> DuplicateKit<DB, R, S>
where
    DB: Backend,
    R: AsyncFn(&mut DB::Connection) -> Result<(), sqlx::Error>,
    S: AsyncFn(&mut DB::Connection) -> Result<T, sqlx::Error>,
    T: Debug + PartialEq,
{
    /// A kit on `pool` (idem's tables migrated) for a consumer configured by `config`: `reset` puts your tables
    /// back to their initial state, `snapshot` reads the state that must come out the same however often an
    /// event is delivered.
    pub fn new(pool: sqlx::Pool<DB>, config: Config, reset: R, snapshot: S) -> Self {
        DuplicateKit { pool, config, reset, snapshot, shuffle_key: None, concurrency: 4 }
    }

    /// Also runs the events of each key (for example `json:/account`) in reverse and reports, as a note, when
    /// the final state then differs.
    pub fn shuffle_by(mut self, key: KeyExtractor) -> Self {
        self.shuffle_key = Some(key);
        self
    }

    /// How many transactions deliver one event at once in the concurrent scenario (default 4; the pool needs as
    /// many connections).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(2);
        self
    }

    /// Runs every scenario with a per-message handler.
    pub async fn check<H: Handler<DB>>(&self, handler: &H, messages: &[Message]) -> Result<Report, Error> {
        self.run(&PerMessage(handler), messages).await
    }

    /// Runs every scenario with a batch handler (each event delivered as a batch of its own).
    pub async fn check_batched<B: BatchHandler<DB>>(&self, handler: &B, messages: &[Message]) -> Result<Report, Error> {
        self.run(&PerBatch(handler), messages).await
    }

    async fn run(&self, subject: &impl Subject<DB>, messages: &[Message]) -> Result<Report, Error> {
        let mut report = Report { events: messages.len(), ..Report::default() };
        // Each run's groups are its own: markers left by an earlier run must not make every event a duplicate.
        let run = uuid::Uuid::now_v7().simple().to_string();
        let mut scenario = Scenario { run: &run[20..], n: 0 };

        // The clean run: the state after each event.
        let engine = self.fresh(&mut scenario, subject).await?;
        let mut clean = Vec::with_capacity(messages.len());
        let mut dead_lettered = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            if subject.deliver(&engine, message).await? {
                dead_lettered.push(i);
            }
            clean.push(self.read().await?);
        }
        let Some(last) = clean.last() else { return Ok(report) };
        if !dead_lettered.is_empty() {
            let which = format!(
                "event{} {} of the clean run {} dead-lettered (see its dead letters, group {})",
                if dead_lettered.len() == 1 { "" } else { "s" },
                dead_lettered.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
                if dead_lettered.len() == 1 { "was" } else { "were" },
                engine.config().group
            );
            if dead_lettered.len() == messages.len() {
                // Nothing was applied: every comparison would hold and prove nothing.
                report.scenarios.push(("the clean run applies the events".into(), false));
                report.failures.push(Finding {
                    scenario: "the clean run applies the events".into(),
                    index: 0,
                    event: self.config.key.extract(&messages[0]).unwrap_or_else(|_| messages[0].broker_id()),
                    diff: format!("every {which}"),
                });
                return Ok(report);
            }
            report.notes.push(which);
        }

        // 1. Each event twice in a row.
        let engine = self.fresh(&mut scenario, subject).await?;
        let mut found = None;
        for (i, message) in messages.iter().enumerate() {
            subject.deliver(&engine, message).await?;
            subject.deliver(&engine, message).await?;
            if found.is_none() {
                found = self.compare(i, message, &clean[i]).await?;
            }
        }
        report.record("every event delivered twice in a row", found);

        // 2. The whole stream twice.
        let engine = self.fresh(&mut scenario, subject).await?;
        for message in messages {
            subject.deliver(&engine, message).await?;
        }
        let mut found = None;
        for (i, message) in messages.iter().enumerate() {
            subject.deliver(&engine, message).await?;
            if found.is_none() {
                found = self.compare(i, message, last).await?;
            }
        }
        report.record("the whole stream delivered twice", found);

        // 3. A crash between COMMIT and the acknowledgement: the event again, to a restarted consumer.
        let group = self.fresh(&mut scenario, subject).await?.config().group.clone();
        let mut found = None;
        for (i, message) in messages.iter().enumerate() {
            subject.deliver(&self.engine(&group)?, message).await?;
            subject.deliver(&self.engine(&group)?, message).await?;
            if found.is_none() {
                found = self.compare(i, message, &clean[i]).await?;
            }
        }
        report.record("redelivered after a crash between commit and acknowledgement", found);

        // 4. A crash before COMMIT: the handler ran and its transaction rolled back, then the event again.
        let engine = self.fresh(&mut scenario, subject).await?;
        let mut found = None;
        for (i, message) in messages.iter().enumerate() {
            if let Ok(id) = self.config.key.extract(message) {
                let event = Event::new(id, message.clone());
                let mut conn = self.pool.acquire().await?;
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                let claimed = DB::claim(
                    &mut tx,
                    &engine.config().tables,
                    &engine.config().layout,
                    &engine.config().group,
                    &[&event],
                )
                .await;
                if claimed.is_ok() {
                    subject.run_and_roll_back(&event, &mut tx).await;
                }
                let _ = tx.rollback().await;
            }
            subject.deliver(&engine, message).await?;
            if found.is_none() {
                found = self.compare(i, message, &clean[i]).await?;
            }
        }
        report.record("redelivered after a crash before commit (the handler's transaction rolled back)", found);

        // 5. Concurrent deliveries of each event from separate connections.
        let engine = self.fresh(&mut scenario, subject).await?;
        let mut found = None;
        for (i, message) in messages.iter().enumerate() {
            let deliveries = (0..self.concurrency).map(|_| subject.deliver(&engine, message));
            for result in futures_util::future::join_all(deliveries).await {
                result?;
            }
            if found.is_none() {
                found = self.compare(i, message, &clean[i]).await?;
            }
        }
        report.record(&format!("{} concurrent deliveries of each event", self.concurrency), found);

        // 6. Each key's events in reverse: a note when the final state depends on their order.
        if let Some(key) = &self.shuffle_key {
            let engine = self.fresh(&mut scenario, subject).await?;
            for message in reversed_per_key(messages, key) {
                subject.deliver(&engine, &message).await?;
            }
            let state = self.read().await?;
            if state != *last {
                report.notes.push(format!(
                    "with the events of each key ({}) in reverse, the final state differs; if events can arrive out \
                     of order, guard the handler (idem::guard) or order them (the Sequential Inbox):\n{}",
                    key_spec(key),
                    diff(last, &state)
                ));
            }
        }
        Ok(report)
    }

    /// An engine under the next scenario's group, with your state reset.
    async fn fresh(&self, scenario: &mut Scenario<'_>, subject: &impl Subject<DB>) -> Result<Engine<DB>, Error> {
        scenario.n += 1;
        let mut conn = self.pool.acquire().await?;
        (self.reset)(&mut conn).await?;
        let engine = self.engine(&format!("{}-kit-{}-{}", self.config.group, scenario.run, scenario.n))?;
        subject.clear(&engine).await?;
        Ok(engine)
    }

    fn engine(&self, group: &str) -> Result<Engine<DB>, Error> {
        let mut config = self.config.clone();
        config.group = group.to_owned();
        Engine::new(self.pool.clone(), config)
    }

    async fn read(&self) -> Result<T, Error> {
        let mut conn = self.pool.acquire().await?;
        Ok((self.snapshot)(&mut conn).await?)
    }

    async fn compare(&self, index: usize, message: &Message, expected: &T) -> Result<Option<Finding>, Error> {
        let state = self.read().await?;
        if state == *expected {
            return Ok(None);
        }
        let event = self.config.key.extract(message).unwrap_or_else(|_| message.broker_id());
        Ok(Some(Finding { scenario: String::new(), index, event, diff: diff(expected, &state) }))
    }
}

/// The run and the number of a scenario, which name its consumer group.
struct Scenario<'r> {
    run: &'r str,
    n: usize,
}

impl Report {
    fn record(&mut self, scenario: &str, found: Option<Finding>) {
        self.scenarios.push((scenario.to_owned(), found.is_none()));
        if let Some(mut finding) = found {
            finding.scenario = scenario.to_owned();
            self.failures.push(finding);
        }
    }
}

fn key_spec(key: &KeyExtractor) -> String {
    match key {
        KeyExtractor::Header(name) => format!("header:{name}"),
        KeyExtractor::JsonPointer(pointer) => format!("json:{pointer}"),
        KeyExtractor::BrokerId => "broker-id".into(),
    }
}

/// The messages with each key's own messages in reverse order, each keeping the others' positions.
fn reversed_per_key(messages: &[Message], key: &KeyExtractor) -> Vec<Message> {
    let keys: Vec<String> = messages.iter().map(|m| key.extract(m).unwrap_or_default()).collect();
    let mut out = messages.to_vec();
    let mut seen = std::collections::HashSet::new();
    for k in &keys {
        if !seen.insert(k.clone()) {
            continue;
        }
        let at: Vec<usize> = keys.iter().enumerate().filter(|(_, x)| *x == k).map(|(i, _)| i).collect();
        for (slot, from) in at.iter().zip(at.iter().rev()) {
            out[*slot] = messages[*from].clone();
        }
    }
    out
}

/// A line diff of two values' `{:#?}`: the changed lines (`-` expected, `+` actual) between up to three lines in
/// common on either side.
fn diff<T: Debug>(expected: &T, actual: &T) -> String {
    let (a, b) = (format!("{expected:#?}"), format!("{actual:#?}"));
    let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let suffix = a[prefix..].iter().rev().zip(b[prefix..].iter().rev()).take_while(|(x, y)| x == y).count();
    const CONTEXT: usize = 3;
    let mut out = String::new();
    for line in &a[prefix.saturating_sub(CONTEXT)..prefix] {
        let _ = writeln!(out, "  {line}");
    }
    for line in &a[prefix..a.len() - suffix] {
        let _ = writeln!(out, "- {line}");
    }
    for line in &b[prefix..b.len() - suffix] {
        let _ = writeln!(out, "+ {line}");
    }
    for line in a[a.len() - suffix..].iter().take(CONTEXT) {
        let _ = writeln!(out, "  {line}");
    }
    out
}
