//! From the file to what runs: every value checked, every statement rendered for the database, each problem
//! collected with its line, so one pass reports them all. Nothing here connects to anything.

use std::net::SocketAddr;
use std::time::Duration;

use idem::guard::StateMachineSpec;
use idem::inbox::InboxConfig;
use idem::{Config, KeyExtractor, PartitionPeriod, Tables};
use serde_json::Value as Json;
use toml::Spanned;

use super::file::{self, Consumer, File, Problem, Text, VersionGuardSpec};
use super::overrides::Origins;
use super::sql::{Dialect, NamedSql, Rendered};
use super::value::{Param, Value};

/// The checked file.
#[derive(Debug)]
pub struct Plan {
    /// The database.
    pub database: DatabasePlan,
    /// Where the operations endpoint listens.
    pub listen: Option<SocketAddr>,
    /// The consumers.
    pub consumers: Vec<ConsumerPlan>,
    /// Where the lines named in problems came from (the file or an `IDEM_…__…` variable).
    pub origins: Origins,
}

/// The database, with its password (never printed: `shown` is what messages use).
pub struct DatabasePlan {
    /// The URL to connect with.
    pub url: String,
    /// The URL without its password.
    pub shown: String,
    /// Connections in the pool.
    pub connections: u32,
    /// idem's table names.
    pub tables: Tables,
    /// Run the migrations at start-up.
    pub migrate: bool,
    /// PostgreSQL or SQLite.
    pub dialect: Dialect,
}

impl std::fmt::Debug for DatabasePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabasePlan").field("url", &self.shown).field("connections", &self.connections).finish()
    }
}

/// Where a consumer reads.
#[derive(Debug, Clone)]
pub enum SourcePlan {
    /// The embedded log.
    Embedded { dir: String, topics: Vec<String> },
    /// Kafka.
    Kafka { brokers: String, topics: Vec<String>, settings: Vec<(String, String)> },
    /// NATS JetStream.
    Nats { url: String, stream: String, ack_wait: Duration, partitions: u32 },
    /// RabbitMQ.
    Rabbit { url: String, queues: Vec<String>, prefetch: Option<u16> },
    /// Amazon SQS.
    Sqs {
        queue: String,
        endpoint: Option<String>,
        region: Option<String>,
        max_batch_time: Duration,
        partitions: u32,
        max_receive_count: Option<u32>,
    },
}

impl SourcePlan {
    /// The broker's name when its messages have no stable offset (so `broker-id` cannot be their key).
    fn unstable_offsets(&self) -> Option<&'static str> {
        match self {
            SourcePlan::Rabbit { .. } => Some("rabbitmq"),
            SourcePlan::Sqs { .. } => Some("sqs"),
            _ => None,
        }
    }
}

/// A statement rendered for the database, with where it was written.
#[derive(Debug, Clone)]
pub struct PlannedSql {
    /// What runs.
    pub rendered: Rendered,
    /// Its key path in the file.
    pub key: String,
    /// Its line.
    pub line: usize,
    /// Rows it must change, if declared.
    pub expect_rows: Option<u64>,
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

/// Text that is fixed or a parameter's value.
#[derive(Debug, Clone)]
pub enum TextPart {
    /// As written.
    Fixed(String),
    /// The value of the parameter at this index.
    Param(usize),
}

/// A JSON payload template.
#[derive(Debug, Clone)]
pub enum JsonPart {
    /// As written.
    Fixed(Json),
    /// The value of the parameter at this index, as JSON.
    Param(usize),
    /// An object of templates.
    Object(Vec<(String, JsonPart)>),
    /// An array of templates.
    Array(Vec<JsonPart>),
}

/// A message enqueued with each applied event.
#[derive(Debug, Clone)]
pub struct EmitPlan {
    /// Where it goes.
    pub destination: TextPart,
    /// Its key.
    pub key: Option<TextPart>,
    /// Its body.
    pub payload: JsonPart,
    /// Its headers.
    pub headers: Vec<(String, TextPart)>,
}

impl TextPart {
    /// The text for an event's values.
    pub fn render(&self, values: &[Value]) -> String {
        match self {
            TextPart::Fixed(t) => t.clone(),
            TextPart::Param(i) => values[*i].to_text(),
        }
    }
}

impl JsonPart {
    /// The JSON for an event's values.
    pub fn render(&self, params: &[Param], values: &[Value]) -> Json {
        match self {
            JsonPart::Fixed(j) => j.clone(),
            JsonPart::Param(i) => values[*i].to_json(params[*i].ty),
            JsonPart::Object(fields) => {
                Json::Object(fields.iter().map(|(k, v)| (k.clone(), v.render(params, values))).collect())
            }
            JsonPart::Array(items) => Json::Array(items.iter().map(|v| v.render(params, values)).collect()),
        }
    }
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
    let database = database(&mut problems, &file.database);
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
    if file.consumers.is_empty() {
        problems.line(1, "consumer", "the file declares no [[consumer]]: add one (see the README's complete file)");
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
        (Some(database), true) => Ok(Plan { database, listen, consumers, origins: text.origins().clone() }),
        _ => Err(problems.found),
    }
}

fn expanded(problems: &mut Problems<'_>, value: &Spanned<String>, key: &str) -> Option<String> {
    file::expand(value.get_ref()).map_err(|e| problems.at(value, key, e)).ok()
}

fn duration(problems: &mut Problems<'_>, value: &Spanned<String>, key: &str) -> Option<Duration> {
    idem::duration::parse(value.get_ref()).map_err(|e| problems.at(value, key, e.to_string())).ok()
}

/// Whether a URL written in the file holds a password of its own (not one from `${…}`).
fn literal_password(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else { return false };
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    match authority.rsplit_once('@') {
        Some((userinfo, _)) => userinfo.split_once(':').is_some_and(|(_, password)| !password.contains("${")),
        None => false,
    }
}

fn database(problems: &mut Problems<'_>, db: &file::Database) -> Option<DatabasePlan> {
    let key = "database.url";
    let from_env = std::env::var("IDEM_DATABASE_URL").ok();
    if from_env.is_none() && literal_password(db.url.get_ref()) {
        problems.at(
            &db.url,
            key,
            "holds a password: the file gets copied and printed; set `password_env` (or \
             `password_file`) and leave the password out of the URL, or pass the whole URL in IDEM_DATABASE_URL",
        );
        return None;
    }
    let (mut url, from_env) = match from_env {
        Some(url) => (url, true),
        None => (expanded(problems, &db.url, key)?, false),
    };
    let dialect = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Dialect::Postgres
    } else if url.starts_with("sqlite:") {
        Dialect::Sqlite
    } else {
        let message =
            format!("`{}` is neither postgres://user@host:port/db nor sqlite://path.db", idem::error::redact_url(&url));
        match from_env {
            true => problems.found.push(Problem { line: None, key: "environment IDEM_DATABASE_URL".into(), message }),
            false => problems.at(&db.url, key, message),
        }
        return None;
    };
    let password = match (&db.password_env, &db.password_file) {
        (Some(_), Some(_)) => {
            problems.at(&db.url, "database", "both password_env and password_file: keep one");
            return None;
        }
        (Some(var), None) => match std::env::var(var) {
            Ok(p) => Some(p),
            Err(_) => {
                problems.at(
                    &db.url,
                    "database.password_env",
                    format!("the environment variable {var} is not set: export it with the database password"),
                );
                return None;
            }
        },
        (None, Some(path)) => match std::fs::read_to_string(path) {
            Ok(p) => Some(p.trim_end_matches(['\n', '\r']).to_owned()),
            Err(e) => {
                problems.at(&db.url, "database.password_file", format!("cannot read `{path}`: {e}"));
                return None;
            }
        },
        (None, None) => None,
    };
    if let Some(password) = password {
        if dialect == Dialect::Sqlite {
            problems.at(&db.url, "database", "SQLite has no password: drop password_env / password_file");
            return None;
        }
        url = with_password(&url, &password);
    }
    let tables = match Tables::new(db.schema.as_deref(), &db.table_prefix) {
        Ok(t) => t,
        Err(e) => {
            problems.at(&db.url, "database.schema / table_prefix", e.to_string());
            return None;
        }
    };
    if db.connections == Some(0) {
        problems.at(&db.url, "database.connections", "0: use at least 2");
    }
    Some(DatabasePlan {
        shown: idem::error::redact_url(&url),
        url,
        connections: db.connections.unwrap_or(10),
        tables,
        migrate: db.migrate,
        dialect,
    })
}

/// `url` with `password` (percent-encoded) after its user name.
fn with_password(url: &str, password: &str) -> String {
    let encoded: String = password
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((user, host)) if !user.contains('/') => format!("{scheme}://{user}:{encoded}@{host}"),
            _ => url.to_owned(),
        },
        None => url.to_owned(),
    }
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
    if let Some(r) = &c.marker_retention
        && let Some(d) = duration(problems, r, &here("marker_retention"))
    {
        config = config.marker_retention(d);
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
            if dialect == Dialect::Sqlite {
                problems.at(layout, &here("layout"), "partitioned markers need PostgreSQL: use plain on SQLite");
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
    let source = source(problems, line, c, &here);
    if key == Some(KeyExtractor::BrokerId)
        && let Some(broker @ ("rabbitmq" | "sqs")) = source.as_ref().and_then(SourcePlan::unstable_offsets)
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
    let (params, each, bulk, emits) = effects(problems, c, dialect, &here);
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
        if dialect == Dialect::Sqlite {
            problems.line(line, &here("inbox"), "the Sequential Inbox needs PostgreSQL");
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

use serde::Deserialize as _;

fn source(problems: &mut Problems<'_>, line: usize, c: &Consumer, here: &dyn Fn(&str) -> String) -> Option<SourcePlan> {
    let declared = [c.embedded.is_some(), c.kafka.is_some(), c.nats.is_some(), c.rabbitmq.is_some(), c.sqs.is_some()];
    if declared.iter().filter(|d| **d).count() != 1 {
        problems.line(
            line,
            &here("source"),
            "declare exactly one source table: [consumer.embedded], \
             [consumer.kafka], [consumer.nats], [consumer.rabbitmq] or [consumer.sqs]",
        );
        return None;
    }
    let topics = |problems: &mut Problems<'_>, topics: &[String], what: &str| {
        if topics.is_empty() || topics.iter().any(|t| t.trim().is_empty()) {
            problems.line(line, &here(what), "list at least one, none empty");
        }
    };
    if let Some(e) = &c.embedded {
        topics(problems, &e.topics, "embedded.topics");
        let dir = expanded(problems, &e.dir, &here("embedded.dir"))?;
        return Some(SourcePlan::Embedded { dir, topics: e.topics.clone() });
    }
    if let Some(k) = &c.kafka {
        topics(problems, &k.topics, "kafka.topics");
        let brokers = expanded(problems, &k.brokers, &here("kafka.brokers"))?;
        let settings = k.settings.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        return Some(SourcePlan::Kafka { brokers, topics: k.topics.clone(), settings });
    }
    if let Some(n) = &c.nats {
        let url = expanded(problems, &n.url, &here("nats.url"))?;
        let ack_wait = match &n.ack_wait {
            Some(w) => duration(problems, w, &here("nats.ack_wait"))?,
            None => Duration::from_secs(30),
        };
        return Some(SourcePlan::Nats {
            url,
            stream: n.stream.clone(),
            ack_wait,
            partitions: n.partitions.unwrap_or(1),
        });
    }
    if let Some(q) = &c.sqs {
        if q.queue.trim().is_empty() {
            problems.line(line, &here("sqs.queue"), "name the queue (its name or URL)");
        }
        let endpoint = match &q.endpoint {
            Some(e) => Some(expanded(problems, e, &here("sqs.endpoint"))?).filter(|e| e != "aws"),
            None => None,
        };
        let max_batch_time = match &q.max_batch_time {
            Some(t) => duration(problems, t, &here("sqs.max_batch_time"))?,
            None => Duration::from_secs(30),
        };
        return Some(SourcePlan::Sqs {
            queue: q.queue.clone(),
            endpoint,
            region: q.region.clone(),
            max_batch_time,
            partitions: q.partitions.unwrap_or(8),
            max_receive_count: q.max_receive_count,
        });
    }
    let r = c.rabbitmq.as_ref()?;
    if literal_password(r.url.get_ref()) {
        problems.at(
            &r.url,
            &here("rabbitmq.url"),
            "holds a password: write it as ${RABBITMQ_PASSWORD} (from the \
             environment), not in the file",
        );
        return None;
    }
    topics(problems, &r.queues, "rabbitmq.queues");
    let url = expanded(problems, &r.url, &here("rabbitmq.url"))?;
    Some(SourcePlan::Rabbit { url, queues: r.queues.clone(), prefetch: r.prefetch })
}

type Effects = (Vec<Param>, Vec<PlannedSql>, Vec<PlannedSql>, Vec<EmitPlan>);

fn effects(problems: &mut Problems<'_>, c: &Consumer, dialect: Dialect, here: &dyn Fn(&str) -> String) -> Effects {
    let mut params = Vec::new();
    for (name, spec) in &c.params {
        let valid_name = name.chars().next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
            && name.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_');
        if !valid_name {
            problems.at(spec, &here(&format!("params.{name}")), "a parameter name is letters, digits and _");
        }
        // A parameter whose source is wrong is still declared, so the statements using it are not also reported.
        let from = spec.get_ref().from.parse().unwrap_or_else(|e| {
            problems.at(spec, &here(&format!("params.{name}.from")), e);
            super::value::From::EventId
        });
        params.push(Param { name: name.clone(), from, ty: spec.get_ref().ty, optional: spec.get_ref().optional });
    }
    let declared: Vec<(&str, super::value::ParamType)> = params.iter().map(|p| (p.name.as_str(), p.ty)).collect();
    let render = |problems: &mut Problems<'_>, list: &[file::Statement], what: &str, array: bool| {
        let mut out = Vec::new();
        for (n, statement) in list.iter().enumerate() {
            let key = here(&format!("{what}[{n}].sql"));
            let rendered = NamedSql::parse(statement.sql.get_ref()).and_then(|s| s.render(dialect, &declared, array));
            match rendered {
                Ok(rendered) => {
                    if array && statement.expect_rows.is_some() {
                        problems.at(
                            &statement.sql,
                            &key,
                            "expect_rows applies to per-event statements: a bulk \
                             statement's row count depends on the batch",
                        );
                    }
                    let line = problems.text.line(statement.sql.span().start);
                    out.push(PlannedSql { rendered, line, key, expect_rows: statement.expect_rows })
                }
                Err(e) => problems.at(&statement.sql, &key, e),
            }
        }
        out
    };
    let each = render(problems, &c.effects, "effect", false);
    let bulk = render(problems, &c.bulk, "bulk", true);
    if !c.bulk.is_empty() {
        if dialect == Dialect::Sqlite {
            problems.at(
                &c.bulk[0].sql,
                &here("bulk"),
                "the bulk form binds arrays (UNNEST), which SQLite lacks: \
                 declare the statements as [[consumer.effect]] on SQLite",
            );
        }
        if !c.effects.is_empty() {
            problems.at(
                &c.bulk[0].sql,
                &here("bulk"),
                "declare either [[consumer.effect]] (per event) or \
                 [[consumer.bulk]] (per batch), not both",
            );
        }
    }
    let param_ref = |problems: &mut Problems<'_>, text: &str, key: &str, at: &Spanned<String>| -> Option<TextPart> {
        match text.strip_prefix(':') {
            Some(rest) if rest.starts_with(':') => Some(TextPart::Fixed(rest.to_owned())),
            Some(name) => match params.iter().position(|p| p.name == name) {
                Some(i) => Some(TextPart::Param(i)),
                None => {
                    problems.at(
                        at,
                        key,
                        format!("`:{name}` names no parameter: declare it under the consumer's params"),
                    );
                    None
                }
            },
            None => Some(TextPart::Fixed(text.to_owned())),
        }
    };
    let mut emits = Vec::new();
    for (n, emit) in c.emits.iter().enumerate() {
        let key_path = |f: &str| here(&format!("emit[{n}].{f}"));
        let (destination, method) = match (&emit.destination, &emit.http) {
            (Some(d), None) => (param_ref(problems, d.get_ref(), &key_path("destination"), d), None),
            (None, Some(http)) => match http_emit(http.get_ref()) {
                Ok((url, method)) => (Some(TextPart::Fixed(url)), Some(method)),
                Err(e) => {
                    problems.at(http, &key_path("http"), e);
                    (None, None)
                }
            },
            (Some(d), Some(_)) => {
                problems.at(
                    d,
                    &key_path("destination"),
                    "declare destination (a broker) or http (a request), not both",
                );
                (None, None)
            }
            (None, None) => {
                problems.at(
                    &emit.payload,
                    &key_path("destination"),
                    "missing: declare destination (a topic, subject \
                     or queue) or http = { url = \"https://…\" }",
                );
                (None, None)
            }
        };
        let anchor = emit.destination.as_ref().map_or(emit.payload.span(), |d| d.span());
        let anchor = Spanned::new(anchor, String::new());
        let key = emit.key.as_ref().map(|k| param_ref(problems, k.get_ref(), &key_path("key"), k));
        let headers: Vec<(String, Option<TextPart>)> = emit
            .headers
            .iter()
            .map(|(h, v)| (h.clone(), param_ref(problems, v, &key_path(&format!("headers.{h}")), &anchor)))
            .collect();
        let payload = json_template(emit.payload.get_ref(), &params)
            .map_err(|e| problems.at(&emit.payload, &key_path("payload"), e));
        if let (Some(destination), Some(key), Ok(payload)) = (destination, key.transpose_default(), payload) {
            let mut headers: Vec<(String, TextPart)> = headers.into_iter().filter_map(|(h, v)| Some((h, v?))).collect();
            if let Some(method) = method {
                headers.push((idem::outbox::METHOD_HEADER.to_owned(), TextPart::Fixed(method)));
            }
            emits.push(EmitPlan { destination, key, payload, headers });
        }
    }
    (params, each, bulk, emits)
}

/// The URL and method of an HTTP emit, checked.
fn http_emit(http: &super::file::HttpEmit) -> Result<(String, String), String> {
    let url = super::file::expand(&http.url)?;
    let host =
        url.strip_prefix("https://").or_else(|| url.strip_prefix("http://")).map(|rest| rest.split(['/', '?']).next());
    if !host.flatten().is_some_and(|h| !h.is_empty() && !h.contains(char::is_whitespace)) {
        return Err(format!("url `{url}` is not an http:// or https:// URL with a host"));
    }
    let method = http.method.clone().unwrap_or_else(|| "POST".into()).to_ascii_uppercase();
    if !["POST", "PUT", "PATCH", "DELETE", "GET"].contains(&method.as_str()) {
        return Err(format!("method `{method}` is not one of POST, PUT, PATCH, DELETE, GET"));
    }
    Ok((url, method))
}

/// `Option<Option<T>>` from an optional lookup that may fail: `Some(None)` (absent) or `Some(Some(t))`, `None`
/// when the lookup failed.
trait TransposeDefault<T> {
    fn transpose_default(self) -> Option<Option<T>>;
}

impl<T> TransposeDefault<T> for Option<Option<T>> {
    fn transpose_default(self) -> Option<Option<T>> {
        match self {
            None => Some(None),
            Some(Some(t)) => Some(Some(t)),
            Some(None) => None,
        }
    }
}

fn json_template(value: &toml::Value, params: &[Param]) -> Result<JsonPart, String> {
    Ok(match value {
        toml::Value::String(s) => match s.strip_prefix(':') {
            Some(rest) if rest.starts_with(':') => JsonPart::Fixed(Json::from(rest)),
            Some(name) => JsonPart::Param(
                params
                    .iter()
                    .position(|p| p.name == name)
                    .ok_or_else(|| format!("`:{name}` names no parameter: declare it under the consumer's params"))?,
            ),
            None => JsonPart::Fixed(Json::from(s.as_str())),
        },
        toml::Value::Table(t) => JsonPart::Object(
            t.iter().map(|(k, v)| Ok((k.clone(), json_template(v, params)?))).collect::<Result<_, String>>()?,
        ),
        toml::Value::Array(a) => JsonPart::Array(a.iter().map(|v| json_template(v, params)).collect::<Result<_, _>>()?),
        other => JsonPart::Fixed(serde_json::to_value(other).map_err(|e| e.to_string())?),
    })
}
