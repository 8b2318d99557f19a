//! The service's configuration file (`idem.toml`): its shape, the environment's part in it, and problems named
//! by line and key path.
//!
//! Every table refuses keys it does not know. Strings may name environment variables (`${PGHOST}`,
//! `${PGPORT:-5432}`); `IDEM_…__…` variables replace single keys (see `overrides`) and `IDEM_DATABASE_URL`
//! replaces `database.url` whole. A password is never read from the file:
//! `database.password_env` or `database.password_file` supply it.

use std::collections::BTreeMap;
use std::fmt;

use toml::Spanned;

use super::overrides::{Origins, Override};
use super::value::ParamType;

/// The whole file.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    /// Where the markers and the effects live.
    pub database: Database,
    /// The operations endpoint.
    #[serde(default)]
    pub operations: Operations,
    /// The consumers; each runs its own engine on the shared pool.
    #[serde(rename = "consumer", default)]
    pub consumers: Vec<Spanned<Consumer>>,
    /// The operator console beside the consumers (off without the section).
    pub console: Option<Spanned<ConsoleSection>>,
}

/// `[console]`: the operator console, served by `idem run` with this process's consumers.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleSection {
    /// Where to listen (default `127.0.0.1:9500`).
    pub listen: Option<Spanned<String>>,
    /// The users file (`NAME ROLE sha256:HEX` lines); without it, `IDEM_CONSOLE_TOKEN` (an operator) and
    /// `IDEM_CONSOLE_VIEWER_TOKEN`.
    pub users: Option<Spanned<String>>,
    /// Show payloads (they may hold personal data). Default false.
    #[serde(default)]
    pub show_payloads: bool,
    /// Behind a reverse proxy: its `X-Forwarded-Host` and `X-Forwarded-Proto` are believed. Default false.
    #[serde(default)]
    pub behind_proxy: bool,
    /// Where messages say their type: `header:NAME` or `json:/POINTER`.
    pub message_type: Option<Spanned<String>>,
}

/// `[database]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Database {
    /// `postgres://user@host:port/db` or `sqlite://path.db`, without a password.
    pub url: Spanned<String>,
    /// The environment variable holding the password.
    pub password_env: Option<String>,
    /// A file holding the password (a mounted secret).
    pub password_file: Option<String>,
    /// Connections in the pool (default: two per consumer, plus one per partition consumed at once).
    pub connections: Option<u32>,
    /// PostgreSQL schema of idem's tables.
    pub schema: Option<String>,
    /// Prefix of idem's table names.
    #[serde(default)]
    pub table_prefix: String,
    /// Create or upgrade idem's tables at start-up (default true).
    #[serde(default = "yes")]
    pub migrate: bool,
}

fn yes() -> bool {
    true
}

/// `[operations]`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Operations {
    /// Serve `/metrics`, `/healthz`, `/readyz` and `POST /resume` here (`127.0.0.1:9464`).
    pub listen: Option<Spanned<String>>,
}

/// A consumer's `delayed_retries`.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelayedRetriesFile {
    /// The delays, in order (`["10s", "1m", "10m", "1h"]`).
    pub schedule: Vec<String>,
    /// `key` (the default: later messages of a parked key wait behind it) or `none`.
    pub order: Option<String>,
}

/// A consumer's `backoff`: the delays between the immediate retries of a failing transaction.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackoffFile {
    /// The delay after the first failure (`50ms`, the default).
    pub first: String,
    /// The longest delay, doubling up to it (`5s`, the default).
    pub cap: String,
}

/// A consumer's `kill_switch`: when many messages in a row fail the same way, every partition is held.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KillSwitchFile {
    /// Messages failing permanently in a row with the same reason that trip it (default 20; 0 turns it off).
    pub threshold: Option<u32>,
    /// How long the consumer holds before it tries again (`30s`, the default).
    pub pause: Option<String>,
}

/// One `[[consumer]]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Consumer {
    /// Its name in logs and errors; also the consumer group unless `group` says otherwise.
    pub name: String,
    /// The consumer group (the marker namespace).
    pub group: Option<String>,
    /// The idempotency key: `json:/pointer`, `header:NAME` or `broker-id`.
    pub key: Spanned<String>,
    /// Messages per transaction (default 100).
    pub batch_size: Option<Spanned<usize>>,
    /// Attempts of a transaction that fails retryably before its message is dead-lettered (default 10).
    pub max_attempts: Option<Spanned<u32>>,
    /// How long a partition may hold work without a commit before it counts as stalled (`60s`, the default):
    /// logged, in `idem_partition_stalled_seconds` and in `/readyz`.
    pub stall_after: Option<Spanned<String>>,
    /// Delayed retries after the immediate ones: `{ schedule = ["10s", "1m", "10m", "1h"], order = "key" }`. A
    /// message still failing is parked in the database and acknowledged, and tried again on the schedule; later
    /// messages of its key wait behind it (`order = "none"`: they do not).
    pub delayed_retries: Option<Spanned<DelayedRetriesFile>>,
    /// The delays between immediate retries: `{ first = "50ms", cap = "5s" }` (the defaults).
    pub backoff: Option<Spanned<BackoffFile>>,
    /// The kill switch: `{ threshold = 20, pause = "30s" }` (the defaults; `threshold = 0` turns it off).
    pub kill_switch: Option<Spanned<KillSwitchFile>>,
    /// An event id that comes again with another payload: `skip` (the default: counted and logged at WARN) or
    /// `dead-letter` (also stored as a dead letter, to be looked at and replayed).
    pub id_reuse: Option<Spanned<String>>,
    /// How long markers are kept (`8d`); the retention guard checks it against the broker at start-up.
    pub marker_retention: Option<Spanned<String>>,
    /// How long discarded dead letters stay in the archive (`30d`, the default) before the pruner deletes them.
    pub dead_letter_archive_expiry: Option<Spanned<String>>,
    /// `plain` (default), `partitioned-day` or `partitioned-month` (PostgreSQL).
    pub layout: Option<Spanned<String>>,
    /// With a partitioned layout: how long the broker may redeliver (`7d`).
    pub redelivery_window: Option<Spanned<String>>,
    /// The embedded log.
    pub embedded: Option<EmbeddedSource>,
    /// Kafka.
    pub kafka: Option<KafkaSource>,
    /// NATS JetStream.
    pub nats: Option<NatsSource>,
    /// RabbitMQ.
    pub rabbitmq: Option<RabbitSource>,
    /// Amazon SQS.
    pub sqs: Option<SqsSource>,
    /// Google Cloud Pub/Sub.
    pub pubsub: Option<PubSubSource>,
    /// HTTP requests (webhooks, `Idempotency-Key` requests), answered after their commit.
    pub http: Option<HttpSource>,
    /// The parameters the statements use, by name.
    #[serde(default)]
    pub params: BTreeMap<String, Spanned<ParamSpec>>,
    /// Statements run for each new event, in order, in idem's transaction.
    #[serde(rename = "effect", default)]
    pub effects: Vec<Statement>,
    /// Statements run once per batch over all its new events, each parameter bound as an array (PostgreSQL).
    #[serde(rename = "bulk", default)]
    pub bulk: Vec<Statement>,
    /// Messages enqueued in the outbox with each applied event.
    #[serde(rename = "emit", default)]
    pub emits: Vec<Emit>,
    /// A version guard: only newer versions of an entity are applied.
    pub version_guard: Option<Spanned<VersionGuardSpec>>,
    /// A state-machine guard (the keys of `idem::guard::StateMachineSpec`).
    pub state_machine: Option<Spanned<toml::Table>>,
    /// The Sequential Inbox (the keys of its own file; PostgreSQL).
    pub inbox: Option<Spanned<toml::Table>>,
}

/// `[consumer.embedded]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddedSource {
    /// The log's directory.
    pub dir: Spanned<String>,
    /// The topics to consume.
    pub topics: Vec<String>,
}

/// `[consumer.kafka]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSource {
    /// Bootstrap servers (`host:port,…`).
    pub brokers: Spanned<String>,
    /// The topics to consume.
    pub topics: Vec<String>,
    /// Extra librdkafka settings.
    #[serde(default)]
    pub settings: BTreeMap<String, String>,
    /// How long a revocation waits for the batches in progress before letting the partitions go (`30s`).
    pub drain_timeout: Option<Spanned<String>>,
    /// Accept pruned markers against a topic that keeps messages forever (`retention.ms=-1`).
    pub accept_infinite_topic_retention: Option<bool>,
}

/// `[consumer.nats]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSource {
    /// The server (`nats://host:4222`).
    pub url: Spanned<String>,
    /// The JetStream stream.
    pub stream: String,
    /// AckWait of the durable consumer when it is created (`30s`).
    pub ack_wait: Option<Spanned<String>>,
    /// Partitions the stream's messages are spread over by subject.
    pub partitions: Option<u32>,
    /// Only the stream's messages on this subject (`orders.>`); default all of them.
    pub filter_subject: Option<String>,
    /// Deliveries after which a message is dead-lettered instead of handed to the handler again (MaxDeliver of the
    /// durable consumer when idem creates it); default no limit.
    pub max_deliver: Option<i64>,
    /// The durable consumer's name (default one made from the consumer group).
    pub durable: Option<String>,
    /// Messages delivered and not yet acknowledged, at most (the durable consumer's MaxAckPending).
    pub max_ack_pending: Option<i64>,
    /// Accept pruned markers against a stream that keeps messages forever (`max_age` 0).
    pub accept_infinite_stream_retention: Option<bool>,
}

/// `[consumer.rabbitmq]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitSource {
    /// The server (`amqp://user@host:5672/%2f`; its password from `password_env`).
    pub url: Spanned<String>,
    /// The queues, each one partition.
    pub queues: Vec<String>,
    /// Unacknowledged deliveries per queue (default: the batch size).
    pub prefetch: Option<u16>,
    /// The queues' `x-delivery-limit` (quorum queues): the last delivery is dead-lettered in the database instead
    /// of handed to the handler again.
    pub delivery_limit: Option<u32>,
    /// Reject a dead-lettered message (without requeue) instead of acknowledging it, so that RabbitMQ also routes
    /// it to the queue's dead-letter exchange.
    pub dead_letter_exchange: Option<bool>,
}

/// `[consumer.sqs]`: region and credentials from the standard AWS configuration.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqsSource {
    /// The queue's name or URL.
    pub queue: String,
    /// An SQS-compatible endpoint instead of the region's (`http://127.0.0.1:9324`); `aws` or absent for AWS.
    pub endpoint: Option<Spanned<String>>,
    /// The region, when not the standard configuration's.
    pub region: Option<String>,
    /// The longest a batch may take (`30s`); start-up is refused when the queue's visibility timeout is shorter.
    pub max_batch_time: Option<Spanned<String>>,
    /// Partitions the messages are spread over (by message group on FIFO queues); default 8.
    pub partitions: Option<u32>,
    /// Receives after which a message is dead-lettered instead of handled again.
    pub max_receive_count: Option<u32>,
    /// How long one receive waits for messages (long polling, `20s` at most; the default).
    pub wait_time: Option<Spanned<String>>,
}

/// `[consumer.pubsub]`: credentials from the standard Google configuration, the emulator through
/// `PUBSUB_EMULATOR_HOST` or `emulator_host`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PubSubSource {
    /// The subscription: its id, or `projects/P/subscriptions/S`.
    pub subscription: String,
    /// The project, when not `GOOGLE_CLOUD_PROJECT`.
    pub project: Option<Spanned<String>>,
    /// The emulator (`127.0.0.1:8681`), when not `PUBSUB_EMULATOR_HOST`.
    pub emulator_host: Option<Spanned<String>>,
    /// Partitions the messages are spread over by ordering key; default 8.
    pub partitions: Option<u32>,
    /// The longest a batch may take (`10s`).
    pub max_batch_time: Option<Spanned<String>>,
    /// The longest idem extends a message's ack deadline while it holds it (`1h`).
    pub max_lease: Option<Spanned<String>>,
    /// Refuse a subscription without message ordering.
    pub require_ordering: Option<bool>,
    /// Messages delivered and not yet acknowledged, at most (flow control); default 1000.
    pub max_outstanding_messages: Option<i64>,
    /// With `idem run --exit-at-end`: how long nothing arriving counts as the end (`3s`); Pub/Sub does not say
    /// how many messages wait.
    pub idle_end: Option<Spanned<String>>,
}

/// `[consumer.http]`: an endpoint whose requests are applied exactly once, each answered after its commit with
/// `200 {"id", "outcome"}` (stored, and answered again to every retry of its key).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSource {
    /// The address to listen on (`127.0.0.1:8080`).
    pub listen: Spanned<String>,
    /// The path requests are `POST`ed to (`/webhooks/stripe`).
    pub path: Spanned<String>,
    /// The largest body taken (bytes; default 1048576); a larger one is answered 413.
    pub max_body_bytes: Option<Spanned<usize>>,
    /// How long a body may take to arrive, and a client waits for the commit (`30s`).
    pub request_timeout: Option<Spanned<String>>,
    /// How long a connection may take to send a request's headers (`10s`).
    pub header_timeout: Option<Spanned<String>>,
    /// How long a request waits behind one with the same key before it is answered 409 (`10s`).
    pub wait_for_first: Option<Spanned<String>>,
    /// The signature every request must carry: `stripe`, `github` or `hmac`.
    pub signature: Option<Spanned<String>>,
    /// The environment variable holding the signing secret.
    pub secret_env: Option<Spanned<String>>,
    /// The file holding the signing secret.
    pub secret_file: Option<Spanned<String>>,
    /// With `stripe`: how far the signed timestamp may be from now (`5m`).
    pub tolerance: Option<Spanned<String>>,
    /// With `hmac`: the header holding the signature.
    pub signature_header: Option<Spanned<String>>,
    /// With `hmac`: what precedes the signature in the header (`sha256=`; default none).
    pub signature_prefix: Option<String>,
    /// With `hmac`: `hex` (default) or `base64`.
    pub signature_encoding: Option<Spanned<String>>,
}

/// A parameter's declaration: `amount = { from = "json:/amount", type = "numeric" }`.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamSpec {
    /// `json:/pointer`, `header:NAME`, `event-id`, `topic`, `partition`, `offset`, `key` or `payload`.
    pub from: String,
    /// integer, numeric, text, boolean, timestamp, uuid or json.
    #[serde(rename = "type")]
    pub ty: ParamType,
    /// Bind NULL for a missing value instead of dead-lettering the event.
    #[serde(default)]
    pub optional: bool,
}

/// `[[consumer.effect]]` or `[[consumer.bulk]]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Statement {
    /// The SQL, with `:name` parameters.
    pub sql: Spanned<String>,
    /// Rows the statement must change (per event): any other count rolls the event back and dead-letters it,
    /// naming the statement (an `UPDATE` of an account that does not exist, for example). Per-event statements
    /// only.
    pub expect_rows: Option<u64>,
}

/// `[[consumer.emit]]`: a message for the outbox, built from the parameters.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Emit {
    /// The topic, subject or queue the relay delivers it to: fixed text in which `:name` is a parameter's value
    /// (`orders.:type`; `::` is a colon).
    pub destination: Option<Spanned<String>>,
    /// Emit only for the events whose parameter has one of these values: `{ param = "type", equals = "Shipped" }`
    /// or `{ param = "type", in = ["Shipped", "Lost"] }`; default every applied event.
    pub when: Option<Spanned<When>>,
    /// An HTTP request instead of a broker message: the relay sends the payload to the URL, with the event id as
    /// `Idempotency-Key`.
    pub http: Option<Spanned<HttpEmit>>,
    /// The key (order per key): a parameter (`":account"`) or fixed text.
    pub key: Option<Spanned<String>>,
    /// The payload: a JSON template in which a string `":name"` is the parameter's value (`"::x"` is the text
    /// `":x"`), or `":name"` alone for one parameter's value.
    pub payload: Spanned<toml::Value>,
    /// Headers: fixed text or `":name"`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// `when = { param = "type", equals = "Shipped" }` of an emit: the parameter's value (as JSON) equal to `equals`, or
/// to one of `in`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct When {
    /// The parameter.
    pub param: String,
    /// The one value that emits.
    pub equals: Option<toml::Value>,
    /// The values that emit.
    #[serde(rename = "in")]
    pub one_of: Option<Vec<toml::Value>>,
}

/// `http = { url = "https://…", method = "POST" }` of an emit.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpEmit {
    /// The URL (`http://` or `https://`).
    pub url: String,
    /// The method (default `POST`).
    pub method: Option<String>,
}

/// `[consumer.version_guard]`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionGuardSpec {
    /// The entities' table.
    pub table: String,
    /// Its unique id column (default `id`).
    #[serde(default = "id_column")]
    pub id_column: String,
    /// The column holding the last applied version.
    pub version_column: String,
    /// Where the event says which entity (`json:/orderId`).
    pub entity: String,
    /// Where the event says its version (`json:/version`).
    pub version: String,
}

fn id_column() -> String {
    "id".into()
}

/// A problem of the file: where it is and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line, where known.
    pub line: Option<usize>,
    /// The key path (`consumer[0].effect[1].sql`).
    pub key: String,
    /// What is wrong and the fix.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(line) = self.line {
            write!(f, "{line}: ")?;
        }
        match self.key.as_str() {
            "" => f.write_str(&self.message),
            key => write!(f, "{key}: {}", self.message),
        }
    }
}

/// The configuration's text: the file, then one line per `IDEM_…__…` override, to turn byte spans into lines.
#[derive(Debug, Clone)]
pub struct Text {
    all: String,
    file_len: usize,
    overrides: Vec<(Override, std::ops::Range<usize>)>,
    origins: Origins,
}

impl Text {
    /// The file's text with the overrides that apply to it.
    pub fn new(file: String, overrides: Vec<Override>) -> Text {
        let file_len = file.len();
        let mut all = file;
        if !all.ends_with('\n') {
            all.push('\n');
        }
        let file_lines = all.bytes().filter(|&b| b == b'\n').count();
        let overrides: Vec<_> = overrides
            .into_iter()
            .map(|o| {
                let start = all.len();
                all.push_str(&o.line());
                all.push('\n');
                (o, start..start + 1)
            })
            .collect();
        let vars = overrides.iter().map(|(o, _)| o.var.clone()).collect();
        Text { all, file_len, overrides, origins: Origins { file_lines, vars, keys: Vec::new() } }
    }

    /// Where each line came from.
    pub fn origins(&self) -> &Origins {
        &self.origins
    }

    /// The 1-based line of byte offset `at`.
    pub fn line(&self, at: usize) -> usize {
        line_in(&self.all, at)
    }

    /// A problem at `span`.
    pub fn problem(&self, span: std::ops::Range<usize>, key: impl Into<String>, message: impl Into<String>) -> Problem {
        Problem { line: Some(self.line(span.start)), key: key.into(), message: message.into() }
    }
}

/// The 1-based line of byte offset `at` in `all`.
fn line_in(all: &str, at: usize) -> usize {
    all.as_bytes()[..at.min(all.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

/// A problem of the TOML parser or of a value's shape, with its line, its key and the fix.
fn toml_problem(all: &str, origins: &Origins, e: &toml::de::Error) -> Problem {
    let line = e.span().map(|s| line_in(all, s.start));
    let mut message = e.message().to_owned();
    for rust in ["usize", "u64", "u32", "u16"] {
        message = message.replace(&format!("expected {rust}"), "expected a whole number, 0 or more");
    }
    message = message.replace("expected i64", "expected a whole number");
    let from_file = line.is_some_and(|l| l <= origins.file_lines);
    // The key of the line at fault, when the line is `key = value`.
    let key = line
        .filter(|_| from_file)
        .and_then(|l| all.lines().nth(l - 1))
        .and_then(|l| l.split_once('='))
        .map(|(k, _)| k.trim().trim_matches('"').to_owned())
        .filter(|k| !k.is_empty() && !k.starts_with('['))
        .unwrap_or_default();
    let fix = if message.contains("unknown field") {
        " (a misspelt key? docs/configuration.md lists every key)"
    } else if !from_file && message.contains("expected a string") {
        " (the variable's value is read as TOML: quote a string that looks like a number or a boolean, e.g. \
         '\"123\"')"
    } else {
        ""
    };
    Problem { line, key, message: format!("{message}{fix}") }
}

/// Parses the file and applies the overrides (noting in `text` which key each set); a syntax error, an unknown key
/// or a wrong type is one problem with its line (or its variable).
pub fn parse(text: &mut Text) -> Result<File, Problem> {
    use serde::Deserialize;
    let Text { all, file_len, overrides, origins } = text;
    let at = |span: std::ops::Range<usize>, message: String| Problem {
        line: Some(line_in(all, span.start)),
        key: String::new(),
        message,
    };
    let mut root = toml::de::DeTable::parse(&all[..*file_len]).map_err(|e| toml_problem(all, origins, &e))?;
    for (o, span) in overrides.iter() {
        let key = o.apply(root.get_mut(), span.clone()).map_err(|message| at(span.clone(), message))?;
        origins.keys.push(key);
    }
    File::deserialize(toml::de::Deserializer::from(root)).map_err(|e| toml_problem(all, origins, &e))
}

/// Expands `${NAME}` and `${NAME:-default}` in `value` from the environment; a variable that is not set (and has
/// no default) is a problem naming it.
pub fn expand(value: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("`${{` at `{}` is not closed with `}}`", &rest[start..]))?;
        let (name, default) = match after[..end].split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (&after[..end], None),
        };
        match (std::env::var(name), default) {
            (Ok(v), _) => out.push_str(&v),
            (Err(_), Some(d)) => out.push_str(d),
            (Err(_), None) => {
                return Err(format!(
                    "the environment variable {name} is not set: export it, or write `${{{name}:-default}}`"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_key_is_named_with_its_line() {
        let mut text = Text::new(
            "[database]\nurl = \"sqlite://x.db\"\n\n[[consumer]]\nname = \"a\"\nkey = \"broker-id\"\nbatch = 5\n"
                .into(),
            Vec::new(),
        );
        let problem = parse(&mut text).expect_err("refused");
        assert_eq!(problem.line, Some(7), "{problem}");
        assert!(problem.message.contains("unknown field `batch`"), "{problem}");
    }

    #[test]
    fn environment_variables_expand_and_a_missing_one_is_named() {
        // SAFETY: the test sets a variable no other test reads.
        unsafe { std::env::set_var("IDEM_FILE_TEST_HOST", "db.internal") };
        assert_eq!(
            expand("postgres://app@${IDEM_FILE_TEST_HOST}:${IDEM_FILE_TEST_PORT:-5432}/x").as_deref(),
            Ok("postgres://app@db.internal:5432/x")
        );
        let missing = expand("${IDEM_FILE_TEST_NOT_SET}").expect_err("refused");
        assert!(missing.contains("IDEM_FILE_TEST_NOT_SET is not set"), "{missing}");
        assert!(expand("${OPEN").is_err());
    }
}

/// Every option of the library a service would set has a key in the file: each builder method of
/// [`idem::Config`] and each field of a broker's configuration is named here with its key, or with why it has
/// none. A new option without an entry fails this test, so the library and the file cannot drift apart.
#[cfg(test)]
mod every_option_has_a_key {
    /// The `pub fn name(mut self` methods of a source file (builders), or the `pub name:` fields of one struct.
    fn builders(source: &str) -> Vec<String> {
        source
            .lines()
            .filter_map(|l| l.trim().strip_prefix("pub fn "))
            .filter(|l| l.contains("(mut self"))
            .filter_map(|l| l.split('(').next())
            .map(str::to_owned)
            .collect()
    }

    fn fields(source: &str, strukt: &str) -> Vec<String> {
        let start = source.find(&format!("pub struct {strukt} {{")).unwrap_or_else(|| panic!("{strukt} not found"));
        let body = &source[start..];
        let body = &body[..body.find("\n}").unwrap_or(body.len())];
        body.lines()
            .filter_map(|l| l.strip_prefix("    pub "))
            .filter_map(|l| l.split(':').next())
            .map(str::to_owned)
            .collect()
    }

    /// The keys the file has: the field names of `strukt` in this module's source.
    fn keys(strukt: &str) -> Vec<String> {
        fields(include_str!("file.rs"), strukt)
    }

    fn check(what: &str, options: Vec<String>, keys: &[String], mapping: &[(&str, &str)]) {
        for option in options {
            let Some((_, key)) = mapping.iter().find(|(o, _)| *o == option) else {
                panic!("{what}: the option `{option}` has no key in the file and no reason for none: add one");
            };
            if let Some(reason) = key.strip_prefix("none: ") {
                assert!(!reason.is_empty(), "{what}.{option}");
                continue;
            }
            assert!(keys.iter().any(|k| k == key), "{what}.{option}: the key `{key}` is not in the file");
        }
    }

    #[test]
    fn the_engines_options() {
        let mapping = [
            ("natural_key", "none: the dedup by the effect's own unique key needs a handler that decides, not SQL"),
            ("partitioned", "layout"),
            ("kill_switch", "kill_switch"),
            ("marker_retention", "marker_retention"),
            ("batch_size", "batch_size"),
            ("max_attempts", "max_attempts"),
            ("backoff", "backoff"),
            ("stall_after", "stall_after"),
            ("delayed_retries", "delayed_retries"),
            ("id_reuse", "id_reuse"),
            ("tables", "none: [database] table_prefix and schema, for every consumer"),
        ];
        check("consumer", builders(include_str!("../../../idem/src/config.rs")), &keys("Consumer"), &mapping);
    }

    #[test]
    fn the_brokers_options() {
        let set_by_idem = "none: set by idem run (--exit-at-end)";
        // The broker, its module's source, its configuration struct, and each field's key (or why none).
        type Case = (&'static str, &'static str, &'static str, Vec<(&'static str, &'static str)>);
        let cases: [Case; 5] = [
            (
                "kafka",
                include_str!("../../../idem/src/brokers/kafka/mod.rs"),
                "KafkaConfig",
                vec![
                    ("brokers", "brokers"),
                    ("topics", "topics"),
                    ("settings", "settings"),
                    ("stop_at_end", set_by_idem),
                    ("drain_timeout", "drain_timeout"),
                    ("accept_infinite_topic_retention", "accept_infinite_topic_retention"),
                ],
            ),
            (
                "nats",
                include_str!("../../../idem/src/brokers/nats/mod.rs"),
                "NatsConfig",
                vec![
                    ("url", "url"),
                    ("stream", "stream"),
                    ("durable", "durable"),
                    ("filter_subject", "filter_subject"),
                    ("ack_policy", "none: explicit is the only policy idem accepts"),
                    ("ack_wait", "ack_wait"),
                    ("max_batch_time", "none: made from ack_wait (at most 10 s, below it)"),
                    ("max_deliver", "max_deliver"),
                    ("partitions", "partitions"),
                    ("max_ack_pending", "max_ack_pending"),
                    ("stop_at_end", set_by_idem),
                    ("accept_infinite_stream_retention", "accept_infinite_stream_retention"),
                ],
            ),
            (
                "rabbitmq",
                include_str!("../../../idem/src/brokers/rabbitmq/mod.rs"),
                "RabbitConfig",
                vec![
                    ("url", "url"),
                    ("queues", "queues"),
                    ("prefetch", "prefetch"),
                    ("no_ack", "none: acknowledging on delivery would lose messages; always refused"),
                    ("stop_at_end", set_by_idem),
                    ("dead_letter_exchange", "dead_letter_exchange"),
                    ("delivery_limit", "delivery_limit"),
                ],
            ),
            (
                "sqs",
                include_str!("../../../idem/src/brokers/sqs/mod.rs"),
                "SqsConfig",
                vec![
                    ("queue", "queue"),
                    ("endpoint", "endpoint"),
                    ("region", "region"),
                    ("wait_time", "wait_time"),
                    ("max_batch_time", "max_batch_time"),
                    ("partitions", "partitions"),
                    ("max_receive_count", "max_receive_count"),
                    ("stop_at_end", set_by_idem),
                ],
            ),
            (
                "pubsub",
                include_str!("../../../idem/src/brokers/pubsub/mod.rs"),
                "PubSubConfig",
                vec![
                    ("project", "project"),
                    ("subscription", "subscription"),
                    ("emulator_host", "emulator_host"),
                    ("partitions", "partitions"),
                    ("max_batch_time", "max_batch_time"),
                    ("max_lease", "max_lease"),
                    ("max_outstanding_messages", "max_outstanding_messages"),
                    ("require_ordering", "require_ordering"),
                    ("stop_at_end", set_by_idem),
                    ("idle_end", "idle_end"),
                ],
            ),
        ];
        let file_struct = |broker: &str| match broker {
            "kafka" => "KafkaSource",
            "nats" => "NatsSource",
            "rabbitmq" => "RabbitSource",
            "sqs" => "SqsSource",
            _ => "PubSubSource",
        };
        for (broker, source, strukt, mapping) in cases {
            check(broker, fields(source, strukt), &keys(file_struct(broker)), &mapping);
        }
    }
}
