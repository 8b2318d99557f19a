//! The Sequential Inbox's model (document 002): sequences of message types handled in a declared order per
//! business context (an order, a payment), whatever order the broker delivers them in.
//!
//! A [`Sequence`] has a name, a retention and two or more [`MessageType`]s. Each message type is a
//! [`QualifiedType`] (a type name and an optional sub-type) with a [`ContextId`] extractor (none: the message is
//! not sequenced), an optional [`Filter`] (false: handle it at once, unsequenced) and an optional release
//! [`Condition`] (`predecessor`, `all`, `any`; none: released on arrival).
//!
//! Sequences are declared in code or in a TOML file ([`InboxConfig::from_toml`]) and validated before anything
//! starts ([`InboxConfig::validate`]): every qualified type in at most one sequence, predecessors that exist in
//! the sequence, no cycles, at least two types per sequence, and a type declared with sub-types never also
//! declared without one.
//!
//! ```toml
//! [[sequence]]
//! name = "order"
//! retention = "30d"
//!
//! [[sequence.type]]
//! name = "OrderCreated"
//! context_id = "json:/orderId"
//!
//! [[sequence.type]]
//! name = "OrderValidated"
//! sub_type = "stock"
//! context_id = "json:/orderId"
//! release = { predecessor = "OrderCreated" }
//!
//! [[sequence.type]]
//! name = "OrderShipped"
//! context_id = "json:/orderId"
//! filter = { pointer = "/express", equals = false }
//! release = { all = [{ predecessor = "OrderValidated/stock" }, { predecessor = "OrderCreated" }] }
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
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

/// A sequence of message types handled in a declared order per context.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Its name.
    pub name: String,
    /// How long an instance is kept after its creation (`retain_until`).
    pub retention: Duration,
    /// Its message types.
    pub types: Vec<MessageType>,
}

/// Every sequence of one consumer.
#[derive(Debug, Clone, Default)]
pub struct InboxConfig {
    /// The sequences.
    pub sequences: Vec<Sequence>,
}

impl InboxConfig {
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
        let with_sub: HashSet<&str> = owner.keys().filter(|t| t.sub_type.is_some()).map(|t| t.name.as_str()).collect();
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
    use std::time::Duration;

    use super::{Condition, ContextId, Filter, InboxConfig, MessageType, QualifiedType, Sequence};
    use crate::error::Error;

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct InboxFile {
        #[serde(default)]
        sequence: Vec<SequenceFile>,
    }

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct SequenceFile {
        name: String,
        retention: String,
        #[serde(rename = "type", default)]
        types: Vec<TypeFile>,
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
            Ok(InboxConfig { sequences })
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
            Ok(Sequence { name, retention, types })
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
