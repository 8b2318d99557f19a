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

/// Where the handler runs relative to the claim transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum InboxTransactions {
    /// The default: the handler runs inside the claim transaction, so its effects, the claim and the inbox
    /// state commit together or not at all: exactly-once for everything the handler writes through `tx`.
    /// A released (buffered) message runs in a savepoint of the releasing transaction.
    #[default]
    Shared,
    /// The handler runs in a transaction of its own on a second connection, which
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
        let mut mixed: Vec<String> = owner
            .keys()
            .filter(|t| t.sub_type.is_none() && with_sub.contains(t.name.as_str()))
            .map(|t| t.to_string())
            .collect();
        if !mixed.is_empty() {
            mixed.sort();
            let (types, are) = if mixed.len() == 1 { ("type", "is") } else { ("types", "are") };
            return Err(Error::Config(format!(
                "message {types} `{}` {are} declared with sub-types and also without one: declare each sub-type, or \
                 none",
                mixed.join("`, `")
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
mod file;

#[cfg(test)]
mod tests;
