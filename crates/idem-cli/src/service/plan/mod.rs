//! From the file to what runs: every value checked, every statement rendered for the database, each problem
//! collected with its line, so one pass reports them all. Nothing here connects to anything. The database's
//! checks are in `database`, the sources' in `source`, the statements' and the outbox messages' in `effects`.

mod database;
mod effects;
mod source;

use std::net::SocketAddr;
use std::time::Duration;

use idem::guard::StateMachineSpec;
use idem::inbox::InboxConfig;
use idem::{Config, KeyExtractor, PartitionPeriod, Tables};
use serde::Deserialize as _;
use toml::Spanned;

pub use database::DatabasePlan;
pub use effects::{EmitPlan, JsonPart, PlannedSql, TextPart};
pub use source::SourcePlan;

use super::file::{self, Consumer, File, Problem, Text, VersionGuardSpec};
use super::overrides::Origins;
use super::sql::Dialect;
use super::value::Param;

/// The checked file.
#[derive(Debug)]
pub struct Plan {
    /// The database.
    pub database: DatabasePlan,
    /// Where the operations endpoint listens.
    pub listen: Option<SocketAddr>,
    /// The consumers.
    pub consumers: Vec<ConsumerPlan>,
    /// The operator console, when the file has a `[console]` section.
    pub console: Option<ConsolePlan>,
    /// Where the lines named in problems came from (the file or an `IDEM_…__…` variable).
    pub origins: Origins,
}

/// One consumer, ready to build.
#[derive(Debug)]
pub struct ConsumerPlan {
    /// Its name.
    pub name: String,
    /// The line of its `[[consumer]]`.
    pub line: usize,
    /// The engine's configuration.
    pub config: Config,
    /// The source.
    pub source: SourcePlan,
    /// The declared parameters.
    pub params: Vec<Param>,
    /// Statements per event.
    pub each: Vec<PlannedSql>,
    /// Statements per batch (arrays).
    pub bulk: Vec<PlannedSql>,
    /// Outbox messages per applied event.
    pub emits: Vec<EmitPlan>,
    /// The version guard.
    pub version_guard: Option<VersionGuardSpec>,
    /// The state-machine guard.
    pub state_machine: Option<StateMachineSpec>,
    /// The line of the guards' declaration (the version guard's, else the state machine's).
    pub guard_line: usize,
    /// The Sequential Inbox.
    pub inbox: Option<InboxConfig>,
}

/// The operator console of `idem run`, checked.
#[derive(Debug)]
pub struct ConsolePlan {
    /// Where it listens.
    pub listen: SocketAddr,
    /// Who may sign in.
    pub users: idem::console::Users,
    /// Show payloads.
    pub show_payloads: bool,
    /// Behind a reverse proxy.
    pub behind_proxy: bool,
    /// Where messages say their type.
    pub message_type: Option<String>,
}

/// Collects problems while the plan is built.
struct Problems<'t> {
    text: &'t Text,
    found: Vec<Problem>,
}

impl Problems<'_> {
    fn at<T>(&mut self, spanned: &Spanned<T>, key: &str, message: impl Into<String>) {
        self.found.push(self.text.problem(spanned.span(), key, message));
    }

    fn line(&mut self, line: usize, key: &str, message: impl Into<String>) {
        self.found.push(Problem { line: Some(line), key: key.into(), message: message.into() });
    }
}

/// Checks the whole file and builds the plan, or returns every problem found.
pub fn plan(text: &Text, file: File) -> Result<Plan, Vec<Problem>> {
    let mut problems = Problems { text, found: Vec::new() };
    let database = database::plan(&mut problems, &file.database);
    let listen =
        file.operations.listen.as_ref().and_then(|listen| {
            let value = expanded(&mut problems, listen, "operations.listen")?;
            value
                .parse::<SocketAddr>()
                .map_err(|_| {
                    problems.at(listen, "operations.listen", format!(
            "`{value}` is not an address: write host:port with an IP, e.g. 127.0.0.1:9464 or 0.0.0.0:9464"
        ))
                })
                .ok()
        });
    let console = file.console.as_ref().and_then(|section| console_plan(&mut problems, section));
    if file.consumers.is_empty() {
        problems.line(
            1,
            "consumer",
            "the file declares no [[consumer]]: add one (see examples/config/payments.toml and docs/configuration.md)",
        );
    }
    let mut names: Vec<&str> = Vec::new();
    let mut consumers = Vec::new();
    for (i, consumer) in file.consumers.iter().enumerate() {
        let line = text.line(consumer.span().start);
        let c = consumer.get_ref();
        if names.contains(&c.name.as_str()) {
            problems.line(
                line,
                &format!("consumer[{i}].name"),
                format!("`{}` is declared twice: names are unique", c.name),
            );
        }
        names.push(&c.name);
        let dialect = database.as_ref().map_or(Dialect::Postgres, |d| d.dialect);
        let tables = database.as_ref().map(|d| d.tables.clone());
        if let Some(plan) = consumer_plan(&mut problems, i, line, c, dialect, tables) {
            consumers.push(plan);
        }
    }
    let mut groups: Vec<&str> = Vec::new();
    for c in &consumers {
        if groups.contains(&c.config.group.as_str()) {
            problems.line(c.line, &format!("consumer `{}`.group", c.name), format!(
                "the group `{}` is already another consumer's: two consumers of one group would share markers; give \
                 each its own group (run several processes of one file to scale one consumer out)",
                c.config.group
            ));
        }
        groups.push(&c.config.group);
    }
    problems.found.sort_by_key(|p| p.line);
    match (database, problems.found.is_empty()) {
        (Some(database), true) => Ok(Plan { database, listen, consumers, console, origins: text.origins().clone() }),
        _ => Err(problems.found),
    }
}

/// `[console]` checked: the address parses, the users file reads and names a user (or a token is in the
/// environment), the message type parses.
fn console_plan(problems: &mut Problems<'_>, section: &Spanned<super::file::ConsoleSection>) -> Option<ConsolePlan> {
    let c = section.get_ref();
    let listen = match &c.listen {
        Some(listen) => {
            let value = expanded(problems, listen, "console.listen")?;
            match value.parse::<SocketAddr>() {
                Ok(addr) => addr,
                Err(_) => {
                    let why = format!("`{value}` is not an address: write host:port with an IP, e.g. 127.0.0.1:9500");
                    problems.at(listen, "console.listen", why);
                    return None;
                }
            }
        }
        None => SocketAddr::from(([127, 0, 0, 1], 9500)),
    };
    let users_file = match &c.users {
        Some(users) => Some((users, expanded(problems, users, "console.users")?)),
        None => None,
    };
    let users = match crate::console::users(users_file.as_ref().map(|(_, path)| std::path::Path::new(path.as_str()))) {
        Ok(users) => users,
        Err(e) => {
            match &users_file {
                Some((spanned, _)) => problems.at(spanned, "console.users", format!("{e:#}")),
                None => problems.at(section, "console", format!("{e:#}")),
            }
            return None;
        }
    };
    let message_type = match &c.message_type {
        Some(spanned) => {
            let value = expanded(problems, spanned, "console.message_type")?;
            if let Err(e) = idem::dead_letter::groups::MessageType::parse(&value) {
                problems.at(spanned, "console.message_type", e);
                return None;
            }
            Some(value)
        }
        None => None,
    };
    Some(ConsolePlan { listen, users, show_payloads: c.show_payloads, behind_proxy: c.behind_proxy, message_type })
}

/// What an HTTP consumer cannot have: a broker-id key (a request has none), the bulk form (each request is its
/// own transaction), delayed retries (its client waits for the answer) and the Sequential Inbox. Its header key is
/// matched in lower case, as HTTP/1.1 sends header names.
fn http_consumer(
    problems: &mut Problems<'_>,
    line: usize,
    c: &Consumer,
    config: &mut Config,
    here: &dyn Fn(&str) -> String,
) {
    match &config.key {
        KeyExtractor::BrokerId => problems.at(
            &c.key,
            &here("key"),
            "an HTTP request has no broker id: key it on a header (header:idempotency-key, GitHub's \
             header:x-github-delivery) or on the body (json:/id, Stripe's event id)",
        ),
        KeyExtractor::Header(name) => config.key = KeyExtractor::Header(name.to_ascii_lowercase()),
        KeyExtractor::JsonPointer(_) => {}
    }
    if !c.bulk.is_empty() {
        problems.line(
            line,
            &here("bulk"),
            "an HTTP request is its own transaction: declare the statements as [[consumer.effect]], not [[consumer.bulk]]",
        );
    }
    if let Some(retries) = &c.delayed_retries {
        problems.at(
            retries,
            &here("delayed_retries"),
            "an HTTP client waits for its answer, so requests are not parked: remove delayed_retries (a request that \
             keeps failing is answered 503 and retried by its client)",
        );
    }
    if c.inbox.is_some() {
        problems.line(
            line,
            &here("inbox"),
            "the Sequential Inbox takes its messages from a broker, not from [consumer.http]",
        );
    }
}

fn expanded(problems: &mut Problems<'_>, value: &Spanned<String>, key: &str) -> Option<String> {
    file::expand(value.get_ref()).map_err(|e| problems.at(value, key, e)).ok()
}

fn duration(problems: &mut Problems<'_>, value: &Spanned<String>, key: &str) -> Option<Duration> {
    idem::duration::parse(value.get_ref()).map_err(|e| problems.at(value, key, e.to_string())).ok()
}

/// A duration written inside a table (whose keys carry no position of their own), or why it is not one.
fn parse_duration(text: &str) -> Result<Duration, String> {
    idem::duration::parse(text).map_err(|e| e.to_string())
}

fn consumer_plan(
    problems: &mut Problems<'_>,
    i: usize,
    line: usize,
    c: &Consumer,
    dialect: Dialect,
    tables: Option<Tables>,
) -> Option<ConsumerPlan> {
    let before = problems.found.len();
    let here = |field: &str| format!("consumer `{}`.{field}", c.name);
    if c.name.trim().is_empty() {
        problems.line(line, &format!("consumer[{i}].name"), "is empty: name the consumer");
    }
    let key =
        c.key.get_ref().parse::<KeyExtractor>().map_err(|e| problems.at(&c.key, &here("key"), e.to_string())).ok();
    let group = c.group.clone().unwrap_or_else(|| c.name.clone());
    // The group names the markers' rows and every log line and metric: a line break or a control character in it
    // would split a log line and make a label no dashboard can match.
    for (field, value) in [("name", Some(&c.name)), ("group", c.group.as_ref())] {
        let Some(value) = value else { continue };
        if value.chars().any(char::is_control) {
            problems.line(
                line,
                &here(field),
                format!("{value:?} holds a line break or another control character: use printable characters"),
            );
        }
    }
    let mut config = Config::new(group, key.clone().unwrap_or(KeyExtractor::BrokerId));
    if let Some(tables) = tables {
        config = config.tables(tables);
    }
    if let Some(n) = &c.batch_size {
        config = config.batch_size(*n.get_ref());
    }
    if let Some(n) = &c.max_attempts {
        config = config.max_attempts(*n.get_ref());
    }
    if let Some(s) = &c.stall_after
        && let Some(d) = duration(problems, s, &here("stall_after"))
    {
        if d.is_zero() {
            problems.at(s, &here("stall_after"), "0 would call every partition with work stalled: use e.g. \"60s\"");
        } else {
            config = config.stall_after(d);
        }
    }
    if let Some(spanned) = &c.delayed_retries {
        let file = spanned.get_ref();
        let parsed = idem::DelayedRetries::parse(&file.schedule).and_then(|retries| match &file.order {
            Some(order) => idem::ParkOrder::parse(order).map(|order| retries.order(order)),
            None => Ok(retries),
        });
        match parsed {
            Ok(retries) => config = config.delayed_retries(retries),
            Err(e) => problems.at(spanned, &here("delayed_retries"), e.to_string()),
        }
    }
    if let Some(spanned) = &c.backoff {
        let b = spanned.get_ref();
        let first = parse_duration(&b.first).map_err(|e| problems.at(spanned, &here("backoff.first"), e));
        let cap = parse_duration(&b.cap).map_err(|e| problems.at(spanned, &here("backoff.cap"), e));
        if let (Ok(first), Ok(cap)) = (first, cap) {
            match idem::Backoff::new(first, cap).validate("backoff") {
                Ok(()) => config = config.backoff(first, cap),
                Err(e) => problems.at(spanned, &here("backoff"), e.to_string()),
            }
        }
    }
    if let Some(spanned) = &c.kill_switch {
        let k = spanned.get_ref();
        let mut switch = idem::KillSwitch::default();
        if let Some(threshold) = k.threshold {
            switch.threshold = threshold;
        }
        match k.pause.as_deref().map(parse_duration) {
            Some(Err(e)) => problems.at(spanned, &here("kill_switch.pause"), e),
            Some(Ok(pause)) if pause.is_zero() => {
                problems.at(spanned, &here("kill_switch.pause"), "0 would not hold at all: use e.g. \"30s\"")
            }
            Some(Ok(pause)) => switch.pause = pause,
            None => {}
        }
        config = config.kill_switch(switch);
    }
    if let Some(policy) = &c.id_reuse {
        match policy.get_ref().as_str() {
            "skip" => config = config.id_reuse(idem::IdReusePolicy::Skip),
            "dead-letter" => config = config.id_reuse(idem::IdReusePolicy::DeadLetter),
            other => problems.at(policy, &here("id_reuse"), format!("`{other}` is no policy: use skip or dead-letter")),
        }
    }
    if let Some(r) = &c.marker_retention
        && let Some(d) = duration(problems, r, &here("marker_retention"))
    {
        config = config.marker_retention(d);
    }
    if let Some(e) = &c.dead_letter_archive_expiry
        && let Some(d) = duration(problems, e, &here("dead_letter_archive_expiry"))
    {
        config.pruning.archive_expiry = d;
    }
    if let Some(layout) = &c.layout {
        let period = match layout.get_ref().as_str() {
            "plain" => None,
            "partitioned-day" => Some(PartitionPeriod::Day),
            "partitioned-month" => Some(PartitionPeriod::Month),
            other => {
                problems.at(
                    layout,
                    &here("layout"),
                    format!("`{other}` is no layout: use plain, partitioned-day or partitioned-month"),
                );
                None
            }
        };
        if let Some(period) = period {
            if dialect != Dialect::Postgres {
                problems.at(
                    layout,
                    &here("layout"),
                    format!("partitioned markers need PostgreSQL: use plain on {}", dialect.name()),
                );
            }
            match &c.redelivery_window {
                None => problems.at(
                    layout,
                    &here("redelivery_window"),
                    "a partitioned layout needs redelivery_window (how long the broker may redeliver, e.g. \"7d\"): \
                     whole partitions are dropped only once older than it",
                ),
                Some(w) => {
                    if let Some(w) = duration(problems, w, &here("redelivery_window")) {
                        config = config.partitioned(period, w);
                    }
                }
            }
        }
    }
    if let Err(e) = config.validate() {
        // At the key the error is about, where the file has it.
        let message = e.to_string();
        match (&c.batch_size, &c.max_attempts) {
            (Some(n), _) if message.contains("batch_size") => problems.at(n, &here("batch_size"), message),
            (_, Some(n)) if message.contains("max_attempts") => problems.at(n, &here("max_attempts"), message),
            _ => problems.line(line, &here("configuration"), message),
        }
    }
    let source = source::plan(problems, line, c, &here);
    if let Some(SourcePlan::Http { .. }) = &source {
        http_consumer(problems, line, c, &mut config, &here);
    }
    if key == Some(KeyExtractor::BrokerId)
        && let Some(broker @ ("rabbitmq" | "sqs" | "pubsub")) = source.as_ref().and_then(SourcePlan::unstable_offsets)
    {
        problems.at(
            &c.key,
            &here("key"),
            format!(
                "broker-id is refused on {broker}: it has no offset that stays the same for a message, so two messages \
             could share an id, or one message look new on each delivery; key on the producer's event id \
             (header:idem-event-id) or a business key in the payload (json:/…)"
            ),
        );
    }
    let (params, each, bulk, emits) = effects::plan(problems, c, dialect, &here);
    if c.effects.is_empty() && c.bulk.is_empty() && c.emits.is_empty() {
        problems.line(
            line,
            &here("effect"),
            "the consumer has no [[consumer.effect]], [[consumer.bulk]] or \
             [[consumer.emit]]: it would only mark events seen; declare what each event does",
        );
    }
    let state_machine = c.state_machine.as_ref().and_then(|table| {
        let spec = StateMachineSpec::deserialize(table.get_ref().clone())
            .map_err(|e| e.to_string())
            .and_then(|s: StateMachineSpec| s.validate().map(|()| s).map_err(|e| e.to_string()));
        spec.map_err(|e| problems.at(table, &here("state_machine"), e)).ok()
    });
    let inbox = c.inbox.as_ref().and_then(|table| {
        if dialect != Dialect::Postgres {
            problems.line(
                line,
                &here("inbox"),
                format!("the Sequential Inbox needs PostgreSQL, not {}", dialect.name()),
            );
            return None;
        }
        if !bulk.is_empty() {
            problems.line(
                line,
                &here("inbox"),
                "the Sequential Inbox hands over one event at a time: declare the \
                 statements as [[consumer.effect]], not [[consumer.bulk]]",
            );
        }
        if c.delayed_retries.is_some() {
            problems.line(
                line,
                &here("delayed_retries"),
                "the Sequential Inbox keeps its own waiting messages and does not park: remove delayed_retries \
                 from this consumer",
            );
        }
        let text = toml::to_string(table.get_ref()).unwrap_or_default();
        InboxConfig::from_toml(&text).map_err(|e| problems.at(table, &here("inbox"), e.to_string())).ok()
    });
    (problems.found.len() == before).then(|| ConsumerPlan {
        name: c.name.clone(),
        line,
        config,
        source: source.expect("no problem means a source"),
        params,
        each,
        bulk,
        emits,
        guard_line: c
            .version_guard
            .as_ref()
            .map(|v| v.span())
            .or_else(|| c.state_machine.as_ref().map(|s| s.span()))
            .map_or(line, |span| problems.text.line(span.start)),
        version_guard: c.version_guard.as_ref().map(|v| v.get_ref()).map(|v| VersionGuardSpec {
            table: v.table.clone(),
            id_column: v.id_column.clone(),
            version_column: v.version_column.clone(),
            entity: v.entity.clone(),
            version: v.version.clone(),
        }),
        state_machine,
        inbox,
    })
}
