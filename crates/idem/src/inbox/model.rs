//! The Sequential Inbox's model: sequences, message types, release conditions, and their validation.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::error::Error;
use crate::key::KeyExtractor;
use crate::message::Message;

/// A message type name and an optional sub-type, written `Name` or `Name/sub`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QualifiedType {
    /// The type name.
    pub name: String,
    /// The sub-type, when the type has several.
    pub sub_type: Option<String>,
}

impl QualifiedType {
    /// A type without sub-type.
    pub fn new(name: impl Into<String>) -> Self {
        QualifiedType { name: name.into(), sub_type: None }
    }

    /// A type with a sub-type.
    pub fn with_sub_type(name: impl Into<String>, sub_type: impl Into<String>) -> Self {
        QualifiedType { name: name.into(), sub_type: Some(sub_type.into()) }
    }

    /// Parses `Name` or `Name/sub`.
    pub fn parse(text: &str) -> Result<Self, Error> {
        let bad = |why: &str| Error::Config(format!("message type `{text}`: {why}; write `Name` or `Name/sub-type`"));
        let (name, sub) = match text.split_once('/') {
            Some((name, sub)) => (name.trim(), Some(sub.trim())),
            None => (text.trim(), None),
        };
        if name.is_empty() || sub.is_some_and(str::is_empty) {
            return Err(bad("a part is empty"));
        }
        if sub.is_some_and(|s| s.contains('/')) {
            return Err(bad("more than one `/`"));
        }
        Ok(QualifiedType { name: name.to_owned(), sub_type: sub.map(str::to_owned) })
    }
}

impl fmt::Display for QualifiedType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.sub_type {
            Some(sub) => write!(f, "{}/{sub}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// When a message may be handled: after its predecessors, as a tree of `all` and `any`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// Released once a message of this type was processed in the same sequence instance.
    Predecessor(QualifiedType),
    /// Released when every condition holds.
    All(Vec<Condition>),
    /// Released when one condition holds.
    Any(Vec<Condition>),
}

impl Condition {
    /// Every predecessor the condition names.
    pub fn predecessors(&self) -> Vec<&QualifiedType> {
        match self {
            Condition::Predecessor(t) => vec![t],
            Condition::All(cs) | Condition::Any(cs) => cs.iter().flat_map(Condition::predecessors).collect(),
        }
    }

    /// Whether the condition holds once the types in `processed` were processed.
    pub fn holds(&self, processed: &HashSet<QualifiedType>) -> bool {
        match self {
            Condition::Predecessor(t) => processed.contains(t),
            Condition::All(cs) => cs.iter().all(|c| c.holds(processed)),
            Condition::Any(cs) => cs.iter().any(|c| c.holds(processed)),
        }
    }
}

/// A function of a message, for extractors and filters declared in code.
pub type MessageFn<T> = Arc<dyn Fn(&Message) -> T + Send + Sync>;

/// Where a message's context id (its sequence instance) comes from.
#[derive(Clone)]
pub enum ContextId {
    /// A JSON pointer into the payload (a string or a number).
    JsonPointer(String),
    /// A message header (UTF-8).
    Header(String),
    /// A function; `None` means the message cannot be sequenced.
    Custom(MessageFn<Option<String>>),
}

impl fmt::Debug for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ContextId::JsonPointer(p) => write!(f, "json:{p}"),
            ContextId::Header(h) => write!(f, "header:{h}"),
            ContextId::Custom(_) => f.write_str("custom"),
        }
    }
}

impl ContextId {
    /// Parses `json:/pointer` or `header:NAME`.
    pub fn parse(text: &str) -> Result<Self, Error> {
        if let Some(pointer) = text.strip_prefix("json:") {
            if !pointer.starts_with('/') {
                return Err(Error::Config(format!("context_id `{text}`: a JSON pointer starts with `/`")));
            }
            return Ok(ContextId::JsonPointer(pointer.to_owned()));
        }
        match text.strip_prefix("header:") {
            Some(name) if !name.is_empty() => Ok(ContextId::Header(name.to_owned())),
            _ => Err(Error::Config(format!("context_id `{text}`: use `json:/pointer` or `header:NAME`"))),
        }
    }

    /// The context id of `message`, or `None` when it has none.
    pub fn extract(&self, message: &Message) -> Option<String> {
        let id = match self {
            ContextId::JsonPointer(pointer) => {
                let value: serde_json::Value = serde_json::from_slice(&message.payload).ok()?;
                match value.pointer(pointer)? {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Number(n) => n.to_string(),
                    _ => return None,
                }
            }
            ContextId::Header(name) => {
                let value = message.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v)?;
                String::from_utf8(value.clone()).ok()?
            }
            ContextId::Custom(f) => f(message)?,
        };
        (!id.is_empty()).then_some(id)
    }
}

/// Whether a message is sequenced at all: `false` hands it to the handler at once.
#[derive(Clone)]
pub enum Filter {
    /// The JSON value at `pointer` equals `value`.
    JsonEquals {
        /// A JSON pointer into the payload.
        pointer: String,
        /// The value it must have.
        value: serde_json::Value,
    },
    /// A function.
    Custom(MessageFn<bool>),
}

impl fmt::Debug for Filter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Filter::JsonEquals { pointer, value } => write!(f, "{pointer} == {value}"),
            Filter::Custom(_) => f.write_str("custom"),
        }
    }
}

impl Filter {
    /// Whether `message` is to be sequenced.
    pub fn accepts(&self, message: &Message) -> bool {
        match self {
            Filter::JsonEquals { pointer, value } => serde_json::from_slice::<serde_json::Value>(&message.payload)
                .ok()
                .and_then(|v| v.pointer(pointer).cloned())
                .is_some_and(|found| &found == value),
            Filter::Custom(f) => f(message),
        }
    }
}

/// One message type of a sequence.
#[derive(Debug, Clone)]
pub struct MessageType {
    /// The qualified type.
    pub qualified: QualifiedType,
    /// Its context id.
    pub context_id: ContextId,
    /// Which of its messages are sequenced (all when `None`).
    pub filter: Option<Filter>,
    /// When it is released (on arrival when `None`).
    pub release: Option<Condition>,
}

impl MessageType {
    /// A message type whose context id comes from `context_id`, released on arrival and never filtered out.
    pub fn new(qualified: QualifiedType, context_id: ContextId) -> Self {
        MessageType { qualified, context_id, filter: None, release: None }
    }

    /// Released only when `condition` holds.
    pub fn release(mut self, condition: Condition) -> Self {
        self.release = Some(condition);
        self
    }

    /// Released once a message of `predecessor` was processed (a shorthand for [`MessageType::release`]).
    pub fn after(self, predecessor: QualifiedType) -> Self {
        self.release(Condition::Predecessor(predecessor))
    }

    /// Sequences only the messages `filter` accepts; the others are handled at once.
    pub fn filter(mut self, filter: Filter) -> Self {
        self.filter = Some(filter);
        self
    }
}

/// A sequence of message types handled in a declared order per context.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Its name.
    pub name: String,
    /// How long an instance is kept after its creation (`retain_until`).
    pub retention: Duration,
    /// Its message types.
    pub types: Vec<MessageType>,
    /// Recording mode: until this time, messages are handled on arrival and recorded as PROCESSED without their
    /// release conditions being enforced, so that an inbox can be introduced on a live topic.
    pub record_until: Option<SystemTime>,
}

impl Sequence {
    /// A sequence named `name` whose instances are kept `retention` after their creation.
    pub fn new(name: impl Into<String>, retention: Duration) -> Self {
        Sequence { name: name.into(), retention, types: Vec::new(), record_until: None }
    }

    /// Adds a message type.
    pub fn with_type(mut self, message_type: MessageType) -> Self {
        self.types.push(message_type);
        self
    }

    /// Records without enforcing release conditions until `until` (see [`Sequence::record_until`]).
    pub fn recording_until(mut self, until: SystemTime) -> Self {
        self.record_until = Some(until);
        self
    }

    /// Whether the sequence is in recording mode at `now`.
    pub fn recording(&self, now: SystemTime) -> bool {
        self.record_until.is_some_and(|until| now < until)
    }
}

/// Where the handler runs relative to the claim transaction (document 002, "Transaction boundaries").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum InboxTransactions {
    /// The default: the handler runs inside the claim transaction, so its effects, the claim and the inbox
    /// state commit together or not at all: exactly-once for everything the handler writes through `tx`.
    /// A released (buffered) message runs in a savepoint of the releasing transaction.
    #[default]
    Shared,
    /// Document 002's boundaries: the handler runs in a transaction of its own on a second connection, which
    /// idem commits before it records the inbox state and commits the claim. A crash between the two commits
    /// runs the handler again on redelivery, so its effects must be idempotent on their own. Needs two
    /// connections per partition.
    Separate,
}

/// How the inbox tidies its tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxHousekeeping {
    /// How often housekeeping runs while consuming (closing, expiring, deleting, gauges, operator releases).
    pub interval: Duration,
    /// How long after `retain_until` an instance is deleted.
    pub expiry_delay: Duration,
    /// Instances closed or deleted per statement.
    pub batch_size: u32,
    /// Instances whose `retain_until` falls within this much of now count as expiring soon (a gauge).
    pub expiring_soon: Duration,
}

impl Default for InboxHousekeeping {
    fn default() -> Self {
        InboxHousekeeping {
            interval: Duration::from_secs(30),
            expiry_delay: Duration::from_secs(86_400),
            batch_size: 500,
            expiring_soon: Duration::from_secs(86_400),
        }
    }
}

/// Every sequence of one consumer, and how messages are typed.
#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// The sequences.
    pub sequences: Vec<Sequence>,
    /// Where a message's type name comes from (default `header:type`).
    pub message_type: KeyExtractor,
    /// Where its sub-type comes from, for types declared with sub-types.
    pub sub_type: Option<KeyExtractor>,
    /// Where the handler runs relative to the claim transaction.
    pub transactions: InboxTransactions,
    /// Housekeeping.
    pub housekeeping: InboxHousekeeping,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig {
            sequences: Vec::new(),
            message_type: KeyExtractor::Header("type".into()),
            sub_type: None,
            transactions: InboxTransactions::default(),
            housekeeping: InboxHousekeeping::default(),
        }
    }
}

impl InboxConfig {
    /// No sequences yet; types read from the `type` header.
    pub fn new() -> Self {
        InboxConfig::default()
    }

    /// Adds a sequence.
    pub fn with_sequence(mut self, sequence: Sequence) -> Self {
        self.sequences.push(sequence);
        self
    }

    /// Reads the type name with `extractor` instead of the `type` header.
    pub fn message_type_from(mut self, extractor: KeyExtractor) -> Self {
        self.message_type = extractor;
        self
    }

    /// Reads sub-types with `extractor`.
    pub fn sub_type_from(mut self, extractor: KeyExtractor) -> Self {
        self.sub_type = Some(extractor);
        self
    }

    /// Chooses where the handler runs relative to the claim transaction.
    pub fn transactions(mut self, mode: InboxTransactions) -> Self {
        self.transactions = mode;
        self
    }

    /// Refuses a configuration that cannot work, naming the sequence, the type and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        let mut owner: HashMap<&QualifiedType, &str> = HashMap::new();
        let mut names = HashSet::new();
        for sequence in &self.sequences {
            let s = sequence.name.as_str();
            if s.trim().is_empty() {
                return Err(Error::Config("sequence: a sequence needs a name".into()));
            }
            if !names.insert(s) {
                return Err(Error::Config(format!("sequence `{s}` is declared twice")));
            }
            if sequence.retention.is_zero() {
                return Err(Error::Config(format!("sequence `{s}`: retention is zero; use e.g. 30d")));
            }
            if sequence.types.len() < 2 {
                return Err(Error::Config(format!(
                    "sequence `{s}` has {} message type(s): a sequence orders two or more",
                    sequence.types.len()
                )));
            }
            for t in &sequence.types {
                if let Some(other) = owner.insert(&t.qualified, s) {
                    return Err(Error::Config(format!(
                        "message type `{}` is declared in sequence `{other}` and again in `{s}`: a qualified type \
                         belongs to at most one sequence (the claim is keyed by type and id only)",
                        t.qualified
                    )));
                }
            }
            validate_predecessors(sequence)?;
        }
        if self.sequences.is_empty() {
            return Err(Error::Config("inbox: no sequence is declared; declare at least one `[[sequence]]`".into()));
        }
        let h = &self.housekeeping;
        if h.interval.is_zero() || h.batch_size == 0 {
            return Err(Error::Config("inbox housekeeping: interval and batch_size must be above zero".into()));
        }
        let with_sub: HashSet<&str> = owner.keys().filter(|t| t.sub_type.is_some()).map(|t| t.name.as_str()).collect();
        if !with_sub.is_empty() && self.sub_type.is_none() {
            let mut names: Vec<&str> = with_sub.iter().copied().collect();
            names.sort();
            return Err(Error::Config(format!(
                "inbox: `{}` is declared with sub-types but `sub_type` (where a message's sub-type is read, e.g. \
                 `header:subtype`) is not set",
                names.join("`, `")
            )));
        }
        if let Some(t) = owner.keys().find(|t| t.sub_type.is_none() && with_sub.contains(t.name.as_str())) {
            return Err(Error::Config(format!(
                "message type `{t}` is declared with sub-types and also without one: declare each sub-type, or none"
            )));
        }
        Ok(())
    }

    /// Reads sequences from TOML (see the module documentation for the format) and validates them.
    pub fn from_toml(text: &str) -> Result<Self, Error> {
        let file: file::InboxFile =
            toml::from_str(text).map_err(|e| Error::Config(format!("inbox configuration: {e}")))?;
        let config = file.into_config()?;
        config.validate()?;
        Ok(config)
    }
}

/// Predecessors exist in the sequence, and following them never comes back to where it started.
fn validate_predecessors(sequence: &Sequence) -> Result<(), Error> {
    let s = &sequence.name;
    let declared: HashSet<&QualifiedType> = sequence.types.iter().map(|t| &t.qualified).collect();
    let mut edges: HashMap<&QualifiedType, Vec<&QualifiedType>> = HashMap::new();
    for t in &sequence.types {
        let predecessors = t.release.as_ref().map(Condition::predecessors).unwrap_or_default();
        for p in &predecessors {
            if !declared.contains(p) {
                return Err(Error::Config(format!(
                    "sequence `{s}`: `{}` waits for `{p}`, which is not a message type of this sequence",
                    t.qualified
                )));
            }
        }
        edges.insert(&t.qualified, predecessors);
    }
    // Depth-first search with colours: grey on the current path, black when done.
    let mut colour: HashMap<&QualifiedType, bool> = HashMap::new();
    fn visit<'a>(
        node: &'a QualifiedType,
        edges: &HashMap<&'a QualifiedType, Vec<&'a QualifiedType>>,
        colour: &mut HashMap<&'a QualifiedType, bool>,
        path: &mut Vec<&'a QualifiedType>,
    ) -> Option<Vec<&'a QualifiedType>> {
        match colour.get(node) {
            Some(true) => return None,
            Some(false) => {
                let start = path.iter().position(|n| *n == node).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(node);
                return Some(cycle);
            }
            None => {}
        }
        colour.insert(node, false);
        path.push(node);
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, colour, path) {
                return Some(cycle);
            }
        }
        path.pop();
        colour.insert(node, true);
        None
    }
    let mut order: Vec<&QualifiedType> = edges.keys().copied().collect();
    order.sort();
    for node in order {
        if let Some(cycle) = visit(node, &edges, &mut colour, &mut Vec::new()) {
            let cycle: Vec<String> = cycle.iter().map(ToString::to_string).collect();
            return Err(Error::Config(format!(
                "sequence `{s}`: the release conditions wait in a circle ({}), so none of them is ever released",
                cycle.join(" waits for ")
            )));
        }
    }
    Ok(())
}

/// The TOML form.
mod file {
    use std::time::{Duration, SystemTime};

    use super::{Condition, ContextId, Filter, InboxConfig, InboxTransactions, MessageType, QualifiedType, Sequence};
    use crate::error::Error;
    use crate::key::KeyExtractor;

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct InboxFile {
        message_type: Option<String>,
        sub_type: Option<String>,
        transactions: Option<String>,
        housekeeping: Option<HousekeepingFile>,
        #[serde(default)]
        sequence: Vec<SequenceFile>,
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct HousekeepingFile {
        interval: Option<String>,
        expiry_delay: Option<String>,
        batch_size: Option<u32>,
        expiring_soon: Option<String>,
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct SequenceFile {
        name: String,
        retention: String,
        record_until: Option<toml::value::Datetime>,
        #[serde(rename = "type", default)]
        types: Vec<TypeFile>,
    }

    fn extractor(field: &str, text: &str) -> Result<KeyExtractor, Error> {
        text.parse::<KeyExtractor>().map_err(|e| Error::Config(format!("inbox `{field}`: {e}")))
    }

    fn duration(field: &str, text: &str) -> Result<Duration, Error> {
        crate::prune::parse_duration(text).map_err(|e| Error::Config(format!("inbox housekeeping `{field}`: {e}")))
    }

    /// A TOML offset date-time (`2026-12-01T00:00:00Z`) as a point in time.
    fn instant(sequence: &str, at: &toml::value::Datetime) -> Result<SystemTime, Error> {
        let bad = || {
            Error::Config(format!(
                "sequence `{sequence}`: record_until `{at}` needs a date, a time and an offset, e.g. \
                 2026-12-01T00:00:00Z"
            ))
        };
        let (Some(date), Some(time), Some(offset)) = (at.date, at.time, at.offset) else { return Err(bad()) };
        let offset_minutes = match offset {
            toml::value::Offset::Z => 0,
            toml::value::Offset::Custom { minutes } => i64::from(minutes),
        };
        let days = days_from_civil(i64::from(date.year), i64::from(date.month), i64::from(date.day));
        let seconds =
            days * 86_400 + i64::from(time.hour) * 3_600 + i64::from(time.minute) * 60 + i64::from(time.second)
                - offset_minutes * 60;
        let seconds = u64::try_from(seconds).map_err(|_| bad())?;
        Ok(SystemTime::UNIX_EPOCH + Duration::new(seconds, time.nanosecond))
    }

    /// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
    fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
        let y = if month <= 2 { year - 1 } else { year };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let mp = (month + 9) % 12;
        let doy = (153 * mp + 2) / 5 + day - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        era * 146_097 + doe - 719_468
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct TypeFile {
        name: String,
        sub_type: Option<String>,
        context_id: String,
        filter: Option<FilterFile>,
        release: Option<ConditionFile>,
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct FilterFile {
        pointer: String,
        equals: toml::Value,
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct ConditionFile {
        predecessor: Option<String>,
        all: Option<Vec<ConditionFile>>,
        any: Option<Vec<ConditionFile>>,
    }

    impl InboxFile {
        pub(super) fn into_config(self) -> Result<InboxConfig, Error> {
            let sequences = self.sequence.into_iter().map(SequenceFile::into_sequence).collect::<Result<_, _>>()?;
            let mut config = InboxConfig { sequences, ..InboxConfig::default() };
            if let Some(text) = &self.message_type {
                config.message_type = extractor("message_type", text)?;
            }
            config.sub_type = self.sub_type.as_deref().map(|text| extractor("sub_type", text)).transpose()?;
            config.transactions = match self.transactions.as_deref() {
                None | Some("shared") => InboxTransactions::Shared,
                Some("separate") => InboxTransactions::Separate,
                Some(other) => {
                    return Err(Error::Config(format!(
                        "inbox `transactions = \"{other}\"`: use \"shared\" (the handler in the claim transaction, \
                         the default) or \"separate\""
                    )));
                }
            };
            if let Some(h) = self.housekeeping {
                let k = &mut config.housekeeping;
                if let Some(t) = &h.interval {
                    k.interval = duration("interval", t)?;
                }
                if let Some(t) = &h.expiry_delay {
                    k.expiry_delay = duration("expiry_delay", t)?;
                }
                if let Some(t) = &h.expiring_soon {
                    k.expiring_soon = duration("expiring_soon", t)?;
                }
                if let Some(n) = h.batch_size {
                    k.batch_size = n;
                }
            }
            Ok(config)
        }
    }

    impl SequenceFile {
        fn into_sequence(self) -> Result<Sequence, Error> {
            let name = self.name;
            let retention: Duration = crate::prune::parse_duration(&self.retention)
                .map_err(|e| Error::Config(format!("sequence `{name}`: retention: {e}")))?;
            let types = self
                .types
                .into_iter()
                .map(|t| t.into_type().map_err(|e| Error::Config(format!("sequence `{name}`: {}", message(e)))))
                .collect::<Result<_, _>>()?;
            let record_until = self.record_until.as_ref().map(|at| instant(&name, at)).transpose()?;
            Ok(Sequence { name, retention, types, record_until })
        }
    }

    fn message(e: Error) -> String {
        match e {
            Error::Config(m) => m,
            other => other.to_string(),
        }
    }

    impl TypeFile {
        fn into_type(self) -> Result<MessageType, Error> {
            let qualified = QualifiedType { name: self.name, sub_type: self.sub_type };
            let qualified = QualifiedType::parse(&qualified.to_string())?;
            let context_id = ContextId::parse(&self.context_id)?;
            let filter = match self.filter {
                Some(f) if !f.pointer.starts_with('/') => {
                    return Err(Error::Config(format!(
                        "`{qualified}`: filter pointer `{}` must start with `/`",
                        f.pointer
                    )));
                }
                Some(f) => {
                    let value = serde_json::to_value(&f.equals)
                        .map_err(|e| Error::Config(format!("`{qualified}`: filter value: {e}")))?;
                    Some(Filter::JsonEquals { pointer: f.pointer, value })
                }
                None => None,
            };
            let release = self.release.map(|c| c.into_condition(&qualified)).transpose()?;
            Ok(MessageType { qualified, context_id, filter, release })
        }
    }

    impl ConditionFile {
        fn into_condition(self, of: &QualifiedType) -> Result<Condition, Error> {
            match (self.predecessor, self.all, self.any) {
                (Some(p), None, None) => Ok(Condition::Predecessor(QualifiedType::parse(&p)?)),
                (None, Some(all), None) if !all.is_empty() => {
                    Ok(Condition::All(all.into_iter().map(|c| c.into_condition(of)).collect::<Result<_, _>>()?))
                }
                (None, None, Some(any)) if !any.is_empty() => {
                    Ok(Condition::Any(any.into_iter().map(|c| c.into_condition(of)).collect::<Result<_, _>>()?))
                }
                _ => Err(Error::Config(format!(
                    "`{of}`: a release condition is exactly one of `predecessor = \"Type\"`, `all = [...]` or \
                     `any = [...]` (non-empty)"
                ))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER: &str = r#"
        sub_type = "header:subtype"

        [[sequence]]
        name = "order"
        retention = "30d"

        [[sequence.type]]
        name = "OrderCreated"
        context_id = "json:/orderId"

        [[sequence.type]]
        name = "OrderValidated"
        sub_type = "stock"
        context_id = "json:/orderId"
        release = { predecessor = "OrderCreated" }

        [[sequence.type]]
        name = "OrderValidated"
        sub_type = "payment"
        context_id = "json:/orderId"
        release = { predecessor = "OrderCreated" }

        [[sequence.type]]
        name = "OrderShipped"
        context_id = "json:/orderId"
        filter = { pointer = "/express", equals = false }
        release = { all = [{ predecessor = "OrderValidated/stock" }, { predecessor = "OrderValidated/payment" }] }
    "#;

    fn error_of(text: &str) -> String {
        InboxConfig::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn the_order_sequence_parses_and_its_conditions_hold_in_order() {
        let config = InboxConfig::from_toml(ORDER).unwrap();
        let order = &config.sequences[0];
        assert_eq!(order.retention, Duration::from_secs(30 * 86_400));
        let shipped = order.types.iter().find(|t| t.qualified.name == "OrderShipped").unwrap();
        let release = shipped.release.as_ref().unwrap();
        let mut done: HashSet<QualifiedType> = [QualifiedType::new("OrderCreated")].into();
        assert!(!release.holds(&done));
        done.insert(QualifiedType::with_sub_type("OrderValidated", "stock"));
        assert!(!release.holds(&done));
        done.insert(QualifiedType::with_sub_type("OrderValidated", "payment"));
        assert!(release.holds(&done));
        let filter = shipped.filter.as_ref().unwrap();
        assert!(filter.accepts(&Message::new("t", 0, 0, br#"{"orderId":"o1","express":false}"#.to_vec())));
        assert!(!filter.accepts(&Message::new("t", 0, 0, br#"{"orderId":"o1","express":true}"#.to_vec())));
        let context = &shipped.context_id;
        assert_eq!(context.extract(&Message::new("t", 0, 0, br#"{"orderId":42}"#.to_vec())).as_deref(), Some("42"));
        assert_eq!(context.extract(&Message::new("t", 0, 0, br#"{"other":1}"#.to_vec())), None);
    }

    #[test]
    fn nested_conditions_and_recording_parse() {
        let nested = ORDER
            .replace(
                r#"release = { all = [{ predecessor = "OrderValidated/stock" }, { predecessor = "OrderValidated/payment" }] }"#,
                r#"release = { all = [{ predecessor = "OrderValidated/stock" }, { any = [{ predecessor = "OrderCreated" }] }] }"#,
            )
            .replace("retention = \"30d\"", "retention = \"30d\"\nrecord_until = 2026-12-01T01:00:00+01:00");
        let config = InboxConfig::from_toml(&nested).unwrap();
        let order = &config.sequences[0];
        let midnight = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_083_200); // 2026-12-01T00:00:00Z
        assert_eq!(order.record_until, Some(midnight));
        assert!(order.recording(midnight - Duration::from_secs(1)));
        assert!(!order.recording(midnight));
        let shipped = order.types.iter().find(|t| t.qualified.name == "OrderShipped").unwrap();
        let done: HashSet<QualifiedType> =
            [QualifiedType::new("OrderCreated"), QualifiedType::with_sub_type("OrderValidated", "stock")].into();
        assert!(shipped.release.as_ref().unwrap().holds(&done));
        let local = nested.replace("2026-12-01T01:00:00+01:00", "2026-12-01");
        assert!(error_of(&local).contains("needs a date, a time and an offset"), "{}", error_of(&local));
    }

    #[test]
    fn validation_names_the_problem() {
        let one_type = r#"[[sequence]]
            name = "s"
            retention = "1d"
            [[sequence.type]]
            name = "A"
            context_id = "json:/id""#;
        assert!(error_of(one_type).contains("two or more"), "{}", error_of(one_type));

        let missing = ORDER.replace(r#"predecessor = "OrderCreated" }"#, r#"predecessor = "OrderOpened" }"#);
        assert!(error_of(&missing).contains("`OrderOpened`, which is not a message type"), "{}", error_of(&missing));

        let cycle = r#"[[sequence]]
            name = "s"
            retention = "1d"
            [[sequence.type]]
            name = "A"
            context_id = "json:/id"
            release = { predecessor = "B" }
            [[sequence.type]]
            name = "B"
            context_id = "json:/id"
            release = { any = [{ predecessor = "A" }] }"#;
        assert!(error_of(cycle).contains("circle"), "{}", error_of(cycle));

        let twice = format!("{ORDER}\n{}", ORDER.replace(r#"name = "order""#, r#"name = "other""#));
        assert!(error_of(&twice).contains("at most one sequence"), "{}", error_of(&twice));

        let mixed = ORDER
            .replace("name = \"OrderShipped\"\n        context_id", "name = \"OrderValidated\"\n        context_id");
        assert!(error_of(&mixed).contains("with sub-types and also without"), "{}", error_of(&mixed));

        let bad_condition = ORDER.replace(r#"release = { predecessor = "OrderCreated" }"#, "release = {}");
        assert!(error_of(&bad_condition).contains("exactly one of"), "{}", error_of(&bad_condition));

        let bad_context = ORDER.replace(r#"context_id = "json:/orderId""#, r#"context_id = "orderId""#);
        assert!(error_of(&bad_context).contains("context_id"), "{}", error_of(&bad_context));

        let unknown = ORDER.replace("retention = \"30d\"", "retention = \"30d\"\nretain = 1");
        assert!(error_of(&unknown).contains("retain"), "{}", error_of(&unknown));
    }
}
