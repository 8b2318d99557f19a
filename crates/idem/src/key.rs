//! Idempotency keys: where the id of an event comes from.
//!
//! Prefer a business key in the payload (`/idempotencyKey`) to the broker's message id, because
//! the same business event can be republished in a new envelope. The extractor is chosen by configuration and
//! parsed from a short spec: `json:/idempotencyKey`, `header:event-id` or `broker-id`.

use std::fmt;
use std::str::FromStr;

use crate::message::Message;

/// Longest idempotency key accepted; a longer one is treated as malformed rather than bloating the marker index.
pub const MAX_KEY_LEN: usize = 512;

/// Where the idempotency key of a message is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyExtractor {
    /// The value of a header, which must be UTF-8 (for example the producer helper's `idem-event-id`).
    Header(String),
    /// A JSON pointer (RFC 6901) into the payload, for example `/idempotencyKey`; strings and integers qualify.
    JsonPointer(String),
    /// The broker's identity of the message (`topic/partition/offset`); changes when a topic is recreated.
    BrokerId,
}

/// Why a message has no usable idempotency key. The message is dead-lettered with this reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no idempotency key: {extractor} {problem}")]
pub struct MissingKey {
    /// The extractor that was asked, in its spec form (`json:/idempotencyKey`).
    pub extractor: String,
    /// What was wrong: missing, empty, not a string, too long.
    pub problem: String,
}

/// A key spec that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid key extractor `{0}`: use `json:/pointer` (e.g. json:/idempotencyKey), `header:NAME` (e.g. header:idem-event-id) or `broker-id`"
)]
pub struct InvalidKeySpec(pub String);

impl KeyExtractor {
    /// Extracts the key of `message`, or says precisely why there is none.
    pub fn extract(&self, message: &Message) -> Result<String, MissingKey> {
        let key = match self {
            KeyExtractor::Header(name) => {
                let value = message.header(name).ok_or_else(|| self.missing("header is absent"))?;
                std::str::from_utf8(value).map_err(|_| self.missing("header is not UTF-8"))?.to_owned()
            }
            KeyExtractor::JsonPointer(pointer) => {
                let doc: serde_json::Value = serde_json::from_slice(&message.payload)
                    .map_err(|e| self.missing(&format!("payload is not JSON ({e})")))?;
                match doc.pointer(pointer) {
                    None | Some(serde_json::Value::Null) => return Err(self.missing("points at nothing")),
                    Some(serde_json::Value::String(s)) => s.clone(),
                    Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
                    Some(_) => return Err(self.missing("points at a value that is not a string or an integer")),
                }
            }
            KeyExtractor::BrokerId => message.broker_id(),
        };
        if key.trim().is_empty() {
            return Err(self.missing("gave an empty key"));
        }
        if key.contains('\0') {
            return Err(self.missing("gave a key containing a NUL character"));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(self.missing(&format!("gave a key of {} bytes (at most {MAX_KEY_LEN})", key.len())));
        }
        Ok(key)
    }

    fn missing(&self, problem: &str) -> MissingKey {
        MissingKey { extractor: self.to_string(), problem: problem.to_owned() }
    }
}

impl fmt::Display for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyExtractor::Header(name) => write!(f, "header:{name}"),
            KeyExtractor::JsonPointer(pointer) => write!(f, "json:{pointer}"),
            KeyExtractor::BrokerId => f.write_str("broker-id"),
        }
    }
}

impl FromStr for KeyExtractor {
    type Err = InvalidKeySpec;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidKeySpec(spec.to_owned());
        match spec.split_once(':') {
            Some(("header", name)) if !name.is_empty() => Ok(KeyExtractor::Header(name.to_owned())),
            Some(("json", pointer)) if pointer.starts_with('/') => Ok(KeyExtractor::JsonPointer(pointer.to_owned())),
            None if spec == "broker-id" => Ok(KeyExtractor::BrokerId),
            _ => Err(invalid()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(payload: &str) -> Message {
        Message::new("payments", 2, 41, payload.as_bytes().to_vec())
    }

    #[test]
    fn json_pointer_reads_strings_and_integers() {
        let k: KeyExtractor = "json:/idempotencyKey".parse().unwrap();
        assert_eq!(k.extract(&msg(r#"{"idempotencyKey":"pi_1"}"#)).unwrap(), "pi_1");
        assert_eq!(k.extract(&msg(r#"{"idempotencyKey":42}"#)).unwrap(), "42");
        let nested: KeyExtractor = "json:/meta/id".parse().unwrap();
        assert_eq!(nested.extract(&msg(r#"{"meta":{"id":"x"}}"#)).unwrap(), "x");
    }

    #[test]
    fn json_pointer_missing_names_the_extractor() {
        let k: KeyExtractor = "json:/idempotencyKey".parse().unwrap();
        for payload in [
            r#"{"other":1}"#,
            "not json",
            r#"{"idempotencyKey":null}"#,
            r#"{"idempotencyKey":""}"#,
            r#"{"idempotencyKey":{"a":1}}"#,
        ] {
            let err = k.extract(&msg(payload)).unwrap_err();
            assert_eq!(err.extractor, "json:/idempotencyKey", "{payload}");
            assert!(err.to_string().contains("json:/idempotencyKey"), "{err}");
        }
    }

    #[test]
    fn header_extractor() {
        let k: KeyExtractor = "header:idem-event-id".parse().unwrap();
        let m = msg("{}").with_header("idem-event-id", "evt-1");
        assert_eq!(k.extract(&m).unwrap(), "evt-1");
        let err = k.extract(&msg("{}")).unwrap_err();
        assert!(err.to_string().contains("header:idem-event-id is absent") || err.problem.contains("absent"));
        let bad = msg("{}").with_header("idem-event-id", vec![0xff, 0xfe]);
        assert!(k.extract(&bad).unwrap_err().problem.contains("UTF-8"));
    }

    #[test]
    fn nul_in_a_key_is_refused() {
        let k: KeyExtractor = "json:/id".parse().unwrap();
        assert!(k.extract(&msg(r#"{"id":"a\u0000b"}"#)).unwrap_err().problem.contains("NUL"));
    }

    #[test]
    fn broker_id_extractor() {
        let k: KeyExtractor = "broker-id".parse().unwrap();
        assert_eq!(k.extract(&msg("x")).unwrap(), "payments/2/41");
    }

    #[test]
    fn too_long_key_is_refused() {
        let k = KeyExtractor::Header("id".into());
        let m = msg("{}").with_header("id", "a".repeat(MAX_KEY_LEN + 1));
        assert!(k.extract(&m).unwrap_err().problem.contains("at most"));
    }

    #[test]
    fn bad_specs_are_refused_with_the_fix() {
        for spec in ["json:idempotencyKey", "header:", "offset", "xml:/a"] {
            let err = spec.parse::<KeyExtractor>().unwrap_err();
            assert!(err.to_string().contains("json:/pointer"), "{err}");
        }
        assert_eq!("json:/a".parse::<KeyExtractor>().unwrap().to_string(), "json:/a");
    }
}
