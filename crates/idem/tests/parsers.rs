//! Property tests of the parsers of untrusted input: key extraction (JSON pointers, headers) over any payload, the
//! Sequential Inbox's TOML (any text, and the example's file with bytes changed), message types and context ids.
//! No input panics or hangs; every bad one is an error that names what is wrong. `PROPTEST_CASES` raises the
//! case count for long runs. (The embedded log's record decoder has its own, in the library's unit tests.)

use idem::inbox::{ContextId, InboxConfig, QualifiedType};
use idem::{KeyExtractor, Message};
use proptest::prelude::*;

const EXAMPLE: &str = include_str!("../examples/order_sequence.toml");

fn message(payload: Vec<u8>, headers: Vec<(String, Vec<u8>)>) -> Message {
    let mut message = Message::new("t", 0, 0, payload);
    message.headers = headers;
    message
}

/// JSON-ish payloads: real JSON documents most of the time, arbitrary bytes otherwise.
fn payloads() -> impl Strategy<Value = Vec<u8>> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, Into::into)),
        ".{0,12}".prop_map(serde_json::Value::from),
    ];
    let json = leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map("[a-z~/0-9]{0,4}", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    prop_oneof![
        3 => json.prop_map(|v| serde_json::to_vec(&v).unwrap_or_default()),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

proptest! {
    #[test]
    fn json_pointer_keys_never_panic(payload in payloads(), pointer in "(/[a-z~0-9]{0,4}){0,4}|.{0,10}") {
        let extractor = KeyExtractor::JsonPointer(pointer);
        match extractor.extract(&message(payload, Vec::new())) {
            Ok(key) => prop_assert!(!key.is_empty()),
            Err(missing) => prop_assert!(!missing.to_string().is_empty()),
        }
    }

    #[test]
    fn header_keys_never_panic(
        name in ".{0,8}",
        headers in prop::collection::vec((".{0,8}", prop::collection::vec(any::<u8>(), 0..16)), 0..4),
    ) {
        let extractor = KeyExtractor::Header(name.clone());
        let message = message(b"{}".to_vec(), headers.clone());
        match extractor.extract(&message) {
            Ok(key) => {
                let value = headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone());
                prop_assert_eq!(Some(key.into_bytes()), value);
            }
            Err(missing) => prop_assert!(missing.to_string().contains(&name)),
        }
    }

    #[test]
    fn inbox_toml_of_any_text_is_a_clear_error_or_valid(text in "\\PC{0,300}") {
        if let Err(error) = InboxConfig::from_toml(&text) {
            prop_assert!(error.to_string().starts_with("configuration:"), "{}", error);
        }
    }

    /// The example's file with a few bytes replaced: still no panic, and every error says what is wrong.
    #[test]
    fn inbox_toml_with_changed_bytes(changes in prop::collection::vec((any::<prop::sample::Index>(), 0x20u8..0x7f), 1..6)) {
        let mut bytes = EXAMPLE.as_bytes().to_vec();
        for (at, byte) in changes {
            let at = at.index(bytes.len());
            bytes[at] = byte;
        }
        let text = String::from_utf8(bytes).unwrap_or_default();
        if let Err(error) = InboxConfig::from_toml(&text) {
            prop_assert!(error.to_string().len() > "configuration: ".len(), "{}", error);
        }
    }

    #[test]
    fn message_types_and_context_ids_never_panic(text in "\\PC{0,40}") {
        let _ = QualifiedType::parse(&text);
        let _ = ContextId::parse(&text);
    }
}

#[test]
fn the_example_file_is_valid() {
    InboxConfig::from_toml(EXAMPLE).expect("the example's sequence is valid");
}
