//! Failure groups: dead letters that failed the same way, whatever the ids, amounts and values in their reasons.
//!
//! A dead letter's **fingerprint** is its consumer group and its reason with the variable parts stripped: quoted
//! values (`'…'`, `"…"`, `` `…` ``) become `'…'`, and numbers, UUIDs and hexadecimal runs become `#`. So
//! `account 17 does not exist` and `account 4242 does not exist` share one, and `relation "orders" does not exist`
//! has another than `invalid input syntax for type integer: "12.00 EUR"`. The fingerprint's id is the first 12 hex
//! digits of the SHA-256 of the group and the stripped reason: stable across processes and versions, short enough
//! to type (`idem dead-letters replay --fingerprint 3f9a0c…`).
//!
//! Where messages say their type ([`MessageType`]: a header, or a JSON pointer into the payload), the type is
//! part of the fingerprint too: `OrderPlaced` and `OrderCancelled` failing the same way are two groups.

use std::collections::BTreeMap;

use crate::store::DeadLetter;

/// A reason with its variable parts stripped.
pub fn strip_reason(reason: &str) -> String {
    let mut out = String::with_capacity(reason.len());
    let chars: Vec<char> = reason.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        // A quoted value: everything up to the matching quote (or the end) is one value.
        if matches!(c, '\'' | '"' | '`') {
            match chars[i + 1..].iter().position(|&d| d == c) {
                Some(len) => {
                    out.push_str("'…'");
                    i += len + 2;
                    continue;
                }
                None => {
                    out.push(c);
                    i += 1;
                    continue;
                }
            }
        }
        // A run of letters, digits and dashes that holds a digit: a number, an id, a UUID, a hex run.
        if c.is_ascii_alphanumeric() {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '.') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let word = word.trim_end_matches(['.', '-']);
            let trailing = i - start - word.chars().count();
            if word.chars().any(|d| d.is_ascii_digit()) && !is_error_code(word) {
                out.push('#');
            } else {
                out.push_str(word);
            }
            // Sentence punctuation after the word is kept as it was.
            out.extend(&chars[i - trailing..i]);
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// SQLSTATEs and error codes name the kind of failure, not a value: `40P01`, `23505`, `55P03` stay.
fn is_error_code(word: &str) -> bool {
    word.len() == 5 && word.chars().all(|c| c.is_ascii_digit() || c.is_ascii_uppercase())
}

/// The fingerprint id of a failure: 12 hex digits of the SHA-256 of the consumer group, the message type (when
/// known) and the stripped reason.
pub fn fingerprint(consumer_group: &str, message_type: Option<&str>, reason: &str) -> String {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    hasher.update(consumer_group.as_bytes());
    hasher.update([0]);
    if let Some(message_type) = message_type {
        hasher.update(b"\x01type\x00");
        hasher.update(message_type.as_bytes());
        hasher.update([0]);
    }
    hasher.update(strip_reason(reason).as_bytes());
    hasher.finalize().iter().take(6).map(|b| format!("{b:02x}")).collect()
}

/// Where a message says its type: a header, or a JSON pointer into the payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageType {
    /// The value of this header.
    Header(String),
    /// The string (or number) at this JSON pointer (RFC 6901, `/type`, `/meta/kind`) of a JSON payload.
    Pointer(String),
}

impl MessageType {
    /// `header:NAME` or `json:/POINTER`.
    pub fn parse(text: &str) -> Result<MessageType, String> {
        match text.split_once(':') {
            Some(("header", name)) if !name.trim().is_empty() => Ok(MessageType::Header(name.trim().to_owned())),
            Some(("json", pointer)) if pointer.starts_with('/') => Ok(MessageType::Pointer(pointer.to_owned())),
            _ => Err(format!(
                "message type {text:?}: write header:NAME (a header holds the type) or json:/POINTER (a JSON \
                 pointer into the payload, such as json:/type)"
            )),
        }
    }

    /// The type `headers` and `payload` say, when they say one.
    pub fn of(&self, headers: &[(String, Vec<u8>)], payload: &[u8]) -> Option<String> {
        match self {
            MessageType::Header(name) => headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, value)| String::from_utf8_lossy(value).into_owned()),
            MessageType::Pointer(pointer) => {
                let json: serde_json::Value = serde_json::from_slice(payload).ok()?;
                match json.pointer(pointer)? {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Number(n) => Some(n.to_string()),
                    _ => None,
                }
            }
        }
    }
}

/// A dead letter's fingerprint id, with its type read as `typing` says.
pub fn fingerprint_of(letter: &DeadLetter, typing: Option<&MessageType>) -> String {
    let message_type = typing.and_then(|t| t.of(&letter.headers, &letter.payload));
    fingerprint(&letter.consumer_group, message_type.as_deref(), &letter.error)
}

/// How many of a group's ids [`FailureGroup::ids`] shows.
pub const SAMPLE_IDS: usize = 20;

/// Dead letters that failed the same way.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FailureGroup {
    /// The fingerprint id.
    pub fingerprint: String,
    /// The consumer group.
    pub consumer_group: String,
    /// The message type, where one is configured and the messages say it.
    pub message_type: Option<String>,
    /// The reason with its variable parts stripped.
    pub pattern: String,
    /// How many dead letters.
    pub count: usize,
    /// When the first of them failed first (milliseconds since the epoch; RFC 3339 in JSON).
    #[serde(rename = "first_failed_at", serialize_with = "crate::store::rfc3339")]
    pub first_failed_at_ms: i64,
    /// When the last of them failed last.
    #[serde(rename = "last_failed_at", serialize_with = "crate::store::rfc3339")]
    pub last_failed_at_ms: i64,
    /// The reason of the newest one, as it was.
    pub sample: String,
    /// The oldest ids, at most [`SAMPLE_IDS`] of them (`count` says how many there are).
    pub ids: Vec<i64>,
}

/// Failure groups counted one letter at a time: where each letter's type must be read from its message, which
/// the database cannot do.
#[derive(Debug, Default)]
pub struct Grouping<'t> {
    typing: Option<&'t MessageType>,
    groups: BTreeMap<String, (FailureGroup, i64)>,
}

impl<'t> Grouping<'t> {
    /// No letter yet; each letter's type read as `typing` says.
    pub fn new(typing: Option<&'t MessageType>) -> Self {
        Grouping { typing, groups: BTreeMap::new() }
    }

    /// Counts `letter` in its group (letters come by id, oldest first).
    pub fn add(&mut self, letter: &DeadLetter) {
        let message_type = self.typing.and_then(|t| t.of(&letter.headers, &letter.payload));
        let id = fingerprint(&letter.consumer_group, message_type.as_deref(), &letter.error);
        let (group, newest) = self.groups.entry(id.clone()).or_insert_with(|| {
            let group = FailureGroup {
                fingerprint: id,
                consumer_group: letter.consumer_group.clone(),
                message_type,
                pattern: strip_reason(&letter.error),
                count: 0,
                first_failed_at_ms: letter.first_failed_at_ms,
                last_failed_at_ms: letter.last_failed_at_ms,
                sample: letter.error.clone(),
                ids: Vec::new(),
            };
            (group, letter.id)
        });
        group.count += 1;
        if group.ids.len() < SAMPLE_IDS {
            group.ids.push(letter.id);
        }
        group.first_failed_at_ms = group.first_failed_at_ms.min(letter.first_failed_at_ms);
        group.last_failed_at_ms = group.last_failed_at_ms.max(letter.last_failed_at_ms);
        if letter.id >= *newest {
            *newest = letter.id;
            group.sample = letter.error.clone();
        }
    }

    /// The groups, the largest first (then the most recent).
    pub fn finish(self) -> Vec<FailureGroup> {
        let mut groups: Vec<FailureGroup> = self.groups.into_values().map(|(g, _)| g).collect();
        sort(&mut groups);
        groups
    }
}

/// The largest group first, then the most recent.
pub(crate) fn sort(groups: &mut [FailureGroup]) {
    groups.sort_by(|a, b| b.count.cmp(&a.count).then(b.last_failed_at_ms.cmp(&a.last_failed_at_ms)));
}

/// Groups `letters` by fingerprint (each one's type read as `typing` says), the largest group first (then the
/// most recent).
pub fn group(letters: &[DeadLetter], typing: Option<&MessageType>) -> Vec<FailureGroup> {
    let mut grouping = Grouping::new(typing);
    for letter in letters {
        grouping.add(letter);
    }
    grouping.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variable_parts_are_stripped_and_the_kind_of_failure_kept() {
        assert_eq!(strip_reason("account 17 does not exist"), "account # does not exist");
        assert_eq!(strip_reason("account 4242 does not exist"), strip_reason("account 17 does not exist"));
        assert_eq!(
            strip_reason(r#"invalid input syntax for type bigint: "12.00 EUR""#),
            "invalid input syntax for type bigint: '…'"
        );
        assert_eq!(
            strip_reason("order 0192a3f4-7c1e-7b4e-9d2a-5f6e7a8b9c0d not found (pay-000000045)."),
            "order # not found (#)."
        );
        assert_eq!(
            strip_reason("deadlock detected (40P01) after 3 attempts"),
            "deadlock detected (40P01) after # attempts"
        );
        assert_eq!(strip_reason("it's unterminated"), "it's unterminated");
    }

    #[test]
    fn fingerprints_tell_groups_and_failures_apart() {
        let a = fingerprint("ledger", None, "account 17 does not exist");
        assert_eq!(a.len(), 12);
        assert_eq!(a, fingerprint("ledger", None, "account 99 does not exist"));
        assert_ne!(a, fingerprint("billing", None, "account 17 does not exist"));
        assert_ne!(a, fingerprint("ledger", None, "relation \"accounts\" does not exist"));
        assert_ne!(a, fingerprint("ledger", Some("PaymentReceived"), "account 17 does not exist"));
        assert_ne!(
            fingerprint("ledger", Some("PaymentReceived"), "account 17 does not exist"),
            fingerprint("ledger", Some("RefundIssued"), "account 17 does not exist")
        );
    }

    #[test]
    fn message_types_come_from_a_header_or_a_json_pointer() {
        let header = MessageType::parse("header:ce-type").unwrap();
        let headers = vec![("CE-Type".to_owned(), b"order.placed".to_vec())];
        assert_eq!(header.of(&headers, b"{}").as_deref(), Some("order.placed"));
        assert_eq!(header.of(&[], b"{}"), None);
        let pointer = MessageType::parse("json:/meta/kind").unwrap();
        assert_eq!(pointer.of(&[], br#"{"meta":{"kind":"refund"}}"#).as_deref(), Some("refund"));
        assert_eq!(pointer.of(&[], br#"{"meta":{"kind":7}}"#).as_deref(), Some("7"));
        assert_eq!(pointer.of(&[], b"not json"), None);
        for bad in ["type", "header:", "json:type", "xml:/a"] {
            assert!(MessageType::parse(bad).unwrap_err().contains("header:NAME"), "{bad}");
        }
    }
}
