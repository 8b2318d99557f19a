//! How a message's headers are kept in the `headers` column of the dead letters and the outbox: JSON an operator
//! can read, bytes that are not UTF-8 in hex.

/// Encodes headers for the `headers` column: a JSON array of `[name, value]`, the value as text when it is
/// UTF-8 and as `{"hex": "…"}` otherwise, so an operator can read them.
pub(crate) fn encode_headers(headers: &[(String, Vec<u8>)]) -> String {
    let items: Vec<serde_json::Value> = headers
        .iter()
        .map(|(name, value)| {
            let value = match std::str::from_utf8(value) {
                Ok(text) => serde_json::Value::String(text.to_owned()),
                Err(_) => serde_json::json!({ "hex": hex(value) }),
            };
            serde_json::json!([name, value])
        })
        .collect();
    serde_json::Value::Array(items).to_string()
}

/// The inverse of [`encode_headers`]; a column that does not decode yields no headers rather than an error.
pub(crate) fn decode_headers(text: &str) -> Vec<(String, Vec<u8>)> {
    let Ok(serde_json::Value::Array(items)) = serde_json::from_str::<serde_json::Value>(text) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let name = item.get(0)?.as_str()?.to_owned();
            let value = match item.get(1)? {
                serde_json::Value::String(s) => s.as_bytes().to_vec(),
                other => unhex(other.get("hex")?.as_str()?)?,
            };
            Some((name, value))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let headers = vec![("a".to_owned(), b"x".to_vec()), ("bin".to_owned(), vec![0xff, 0x00, 0x10])];
        assert_eq!(decode_headers(&encode_headers(&headers)), headers);
        assert!(decode_headers("garbage").is_empty());
    }
}
