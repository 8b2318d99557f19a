//! Parameters: where each value comes from in the event, its declared type, and its conversion.
//!
//! A value that does not convert is the event's fault, not the database's: the handler returns a permanent error
//! naming the parameter, and the event is dead-lettered while its partition goes on.

use idem::{Event, HandlerError};
use serde_json::Value as Json;

/// The declared type of a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamType {
    /// A 64-bit integer (bound as `bigint`).
    Integer,
    /// An exact decimal (`numeric` on PostgreSQL), from a JSON number or a decimal string.
    Numeric,
    /// Text; a JSON number, boolean, object or array is bound as its JSON text.
    Text,
    /// `true` or `false` (also the strings).
    Boolean,
    /// An RFC 3339 instant (`2026-12-02T10:00:00Z`), bound as `timestamptz`.
    Timestamp,
    /// A UUID, bound as `uuid`.
    Uuid,
    /// Any JSON value, bound as `jsonb`.
    Json,
}

impl ParamType {
    fn name(self) -> &'static str {
        match self {
            ParamType::Integer => "integer",
            ParamType::Numeric => "numeric",
            ParamType::Text => "text",
            ParamType::Boolean => "boolean",
            ParamType::Timestamp => "timestamp",
            ParamType::Uuid => "uuid",
            ParamType::Json => "json",
        }
    }
}

/// Where a parameter's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum From {
    /// A JSON pointer into the payload (`json:/amount`).
    Json(String),
    /// A header's value (`header:x-tenant`).
    Header(String),
    /// The event's idempotency key (`event-id`).
    EventId,
    /// The topic, queue or stream it came from (`topic`).
    Topic,
    /// Its partition (`partition`).
    Partition,
    /// Its offset or sequence number (`offset`).
    Offset,
    /// Its broker key, as text (`key`).
    Key,
    /// The whole payload (`payload`): JSON for the `json` type, UTF-8 text for `text`.
    Payload,
}

impl std::str::FromStr for From {
    type Err = String;

    fn from_str(spec: &str) -> Result<Self, String> {
        Ok(match spec {
            "event-id" => From::EventId,
            "topic" => From::Topic,
            "partition" => From::Partition,
            "offset" => From::Offset,
            "key" => From::Key,
            "payload" => From::Payload,
            _ => match spec.split_once(':') {
                Some(("json", pointer)) if pointer.is_empty() || pointer.starts_with('/') => From::Json(pointer.into()),
                Some(("header", name)) if !name.is_empty() => From::Header(name.into()),
                _ => {
                    return Err(format!(
                        "`{spec}` is no value of the event: use json:/pointer (json:/amount), header:NAME, event-id, \
                         topic, partition, offset, key or payload"
                    ));
                }
            },
        })
    }
}

impl std::fmt::Display for From {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            From::Json(p) => write!(f, "json:{p}"),
            From::Header(h) => write!(f, "header:{h}"),
            From::EventId => f.write_str("event-id"),
            From::Topic => f.write_str("topic"),
            From::Partition => f.write_str("partition"),
            From::Offset => f.write_str("offset"),
            From::Key => f.write_str("key"),
            From::Payload => f.write_str("payload"),
        }
    }
}

/// A declared parameter.
#[derive(Debug, Clone)]
pub struct Param {
    /// Its name in the SQL (`:amount`).
    pub name: String,
    /// Where its value comes from.
    pub from: From,
    /// Its type.
    pub ty: ParamType,
    /// A missing value or JSON `null` binds NULL instead of dead-lettering the event.
    pub optional: bool,
}

/// A converted value, ready to bind: what it is bound as (the SQL casts text to numeric, timestamp, uuid, json).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// SQL NULL.
    Null,
    /// A `bigint`.
    Integer(i64),
    /// A boolean.
    Boolean(bool),
    /// Text (also the normalised form of numeric, timestamp, uuid and json values).
    Text(String),
}

impl Value {
    /// The value as JSON, for a payload built from parameters.
    pub fn to_json(&self, ty: ParamType) -> Json {
        match self {
            Value::Null => Json::Null,
            Value::Integer(i) => Json::from(*i),
            Value::Boolean(b) => Json::Bool(*b),
            Value::Text(t) if ty == ParamType::Json => serde_json::from_str(t).unwrap_or(Json::Null),
            Value::Text(t) if ty == ParamType::Numeric => serde_json::from_str::<serde_json::Number>(t)
                .map(Json::Number)
                .unwrap_or_else(|_| Json::from(t.clone())),
            Value::Text(t) => Json::from(t.clone()),
        }
    }

    /// The value as text (a key, a header).
    pub fn to_text(&self) -> String {
        match self {
            Value::Null => String::new(),
            Value::Integer(i) => i.to_string(),
            Value::Boolean(b) => b.to_string(),
            Value::Text(t) => t.clone(),
        }
    }
}

impl Param {
    /// Reads and converts this parameter's value from `event` (`payload`: its payload parsed once, if JSON).
    pub fn value(&self, event: &Event, payload: Option<&Json>) -> Result<Value, HandlerError> {
        let fail = |problem: String| {
            HandlerError::permanent(format!(
                "parameter `{}` ({}, from {}): {problem}",
                self.name,
                self.ty.name(),
                self.from
            ))
        };
        let raw: Option<Json> = match &self.from {
            From::Json(pointer) => {
                let doc = payload.ok_or_else(|| fail("the payload is not JSON".into()))?;
                doc.pointer(pointer).cloned()
            }
            From::Header(name) => match event.message.header(name) {
                Some(bytes) => Some(Json::String(
                    std::str::from_utf8(bytes).map_err(|_| fail("the header is not UTF-8".into()))?.to_owned(),
                )),
                None => None,
            },
            From::EventId => Some(Json::String(event.id.clone())),
            From::Topic => Some(Json::String(event.message.topic.clone())),
            From::Partition => Some(Json::from(event.message.partition)),
            From::Offset => Some(Json::from(event.message.offset)),
            From::Key => match &event.message.key {
                Some(key) => Some(Json::String(
                    std::str::from_utf8(key).map_err(|_| fail("the key is not UTF-8".into()))?.to_owned(),
                )),
                None => None,
            },
            From::Payload => match self.ty {
                ParamType::Json => Some(payload.cloned().ok_or_else(|| fail("the payload is not JSON".into()))?),
                _ => Some(Json::String(
                    std::str::from_utf8(event.payload())
                        .map_err(|_| fail("the payload is not UTF-8".into()))?
                        .to_owned(),
                )),
            },
        };
        match raw {
            None | Some(Json::Null) if self.optional => Ok(Value::Null),
            None => {
                Err(fail("the event has no such value (declare the parameter `optional = true` to bind NULL)".into()))
            }
            Some(Json::Null) => {
                Err(fail("the value is null (declare the parameter `optional = true` to bind NULL)".into()))
            }
            Some(raw) => convert(self.ty, raw).map_err(fail),
        }
    }
}

/// Converts a JSON value to `ty`, or says why it does not convert.
fn convert(ty: ParamType, raw: Json) -> Result<Value, String> {
    let shown = || {
        let mut s = raw.to_string();
        if s.len() > 80 {
            let cut = (0..=80).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
            s.truncate(cut);
            s.push('…');
        }
        s
    };
    match ty {
        ParamType::Integer => match &raw {
            Json::Number(n) => n.as_i64().map(Value::Integer),
            Json::String(s) => s.trim().parse::<i64>().ok().map(Value::Integer),
            _ => None,
        }
        .ok_or_else(|| format!("{} is not an integer (64-bit, no fraction)", shown())),
        ParamType::Numeric => match &raw {
            Json::Number(n) => Some(Value::Text(n.to_string())),
            Json::String(s) if is_decimal(s.trim()) => Some(Value::Text(s.trim().to_owned())),
            _ => None,
        }
        .ok_or_else(|| format!("{} is not a decimal number", shown())),
        ParamType::Text => Ok(Value::Text(match raw {
            Json::String(s) => s,
            other => other.to_string(),
        }))
        .and_then(|v| match &v {
            Value::Text(t) if t.contains('\0') => Err("the text contains a NUL character".to_owned()),
            _ => Ok(v),
        }),
        ParamType::Boolean => match &raw {
            Json::Bool(b) => Some(Value::Boolean(*b)),
            Json::String(s) if s == "true" => Some(Value::Boolean(true)),
            Json::String(s) if s == "false" => Some(Value::Boolean(false)),
            _ => None,
        }
        .ok_or_else(|| format!("{} is not a boolean (true or false)", shown())),
        ParamType::Timestamp => match &raw {
            Json::String(s) => s.trim().parse::<jiff::Timestamp>().ok().map(|t| Value::Text(t.to_string())),
            _ => None,
        }
        .ok_or_else(|| format!("{} is not an RFC 3339 timestamp (2026-12-02T10:00:00Z)", shown())),
        ParamType::Uuid => match &raw {
            Json::String(s) => uuid::Uuid::parse_str(s.trim()).ok().map(|u| Value::Text(u.hyphenated().to_string())),
            _ => None,
        }
        .ok_or_else(|| format!("{} is not a UUID", shown())),
        ParamType::Json => Ok(Value::Text(raw.to_string())),
    }
}

/// `-12`, `12.50`, `1e3`: what PostgreSQL's `numeric` accepts, without `NaN` or infinities.
fn is_decimal(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = match s.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e.strip_prefix(['-', '+']).unwrap_or(e))),
        None => (s, None),
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match mantissa.split_once('.') {
        Some((i, f)) => (digits(i) || i.is_empty()) && (digits(f) || (f.is_empty() && digits(i))),
        None => digits(mantissa),
    };
    mantissa_ok && exponent.is_none_or(digits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem::Message;

    fn event(payload: &str) -> Event {
        Event::new("k-1", Message::new("payments", 2, 7, payload.as_bytes().to_vec()).with_header("x-tenant", "acme"))
    }

    fn param(from: &str, ty: ParamType) -> Param {
        Param { name: "p".into(), from: from.parse().expect("spec"), ty, optional: false }
    }

    fn value(from: &str, ty: ParamType, payload: &str) -> Result<Value, String> {
        let e = event(payload);
        let doc = serde_json::from_str(payload).ok();
        param(from, ty).value(&e, doc.as_ref()).map_err(|e| e.reason().to_owned())
    }

    #[test]
    fn values_convert_to_their_declared_types() {
        let p = r#"{"n": 12, "s": "34", "d": "12.50", "f": 0.1, "b": true, "t": "2026-12-02T10:00:00+01:00",
                    "u": "67E55044-10B1-426F-9247-BB680E5FE0C8", "o": {"a": [1]}}"#;
        assert_eq!(value("json:/n", ParamType::Integer, p), Ok(Value::Integer(12)));
        assert_eq!(value("json:/s", ParamType::Integer, p), Ok(Value::Integer(34)));
        assert_eq!(value("json:/d", ParamType::Numeric, p), Ok(Value::Text("12.50".into())));
        assert_eq!(value("json:/f", ParamType::Numeric, p), Ok(Value::Text("0.1".into())));
        assert_eq!(value("json:/b", ParamType::Boolean, p), Ok(Value::Boolean(true)));
        assert_eq!(value("json:/t", ParamType::Timestamp, p), Ok(Value::Text("2026-12-02T09:00:00Z".into())));
        assert_eq!(
            value("json:/u", ParamType::Uuid, p),
            Ok(Value::Text("67e55044-10b1-426f-9247-bb680e5fe0c8".into()))
        );
        assert_eq!(value("json:/o", ParamType::Json, p), Ok(Value::Text(r#"{"a":[1]}"#.into())));
        assert_eq!(value("json:/n", ParamType::Text, p), Ok(Value::Text("12".into())));
        assert_eq!(value("header:x-tenant", ParamType::Text, p), Ok(Value::Text("acme".into())));
        assert_eq!(value("event-id", ParamType::Text, p), Ok(Value::Text("k-1".into())));
        assert_eq!(value("partition", ParamType::Integer, p), Ok(Value::Integer(2)));
        assert_eq!(value("offset", ParamType::Integer, p), Ok(Value::Integer(7)));
        assert_eq!(value("topic", ParamType::Text, p), Ok(Value::Text("payments".into())));
    }

    #[test]
    fn a_value_that_does_not_convert_names_the_parameter_and_the_problem() {
        let p = r#"{"n": 1.5, "s": "12x", "d": "NaN", "t": "yesterday", "nul": null}"#;
        for (from, ty, problem) in [
            ("json:/n", ParamType::Integer, "1.5 is not an integer"),
            ("json:/s", ParamType::Integer, "\"12x\" is not an integer"),
            ("json:/d", ParamType::Numeric, "\"NaN\" is not a decimal"),
            ("json:/t", ParamType::Timestamp, "not an RFC 3339 timestamp"),
            ("json:/missing", ParamType::Text, "has no such value"),
            ("json:/nul", ParamType::Integer, "the value is null"),
            ("header:none", ParamType::Text, "has no such value"),
        ] {
            let error = value(from, ty, p).expect_err(from);
            assert!(error.starts_with("parameter `p` ("), "{error}");
            assert!(error.contains(problem), "{from}: {error}");
        }
        assert!(value("json:/a", ParamType::Integer, "not json").expect_err("refused").contains("not JSON"));
    }

    #[test]
    fn an_optional_parameter_binds_null_for_a_missing_value() {
        let e = event("{}");
        let p = Param { optional: true, ..param("json:/none", ParamType::Integer) };
        assert_eq!(p.value(&e, Some(&serde_json::json!({}))).expect("null"), Value::Null);
    }

    #[test]
    fn decimals_are_recognised() {
        for ok in ["0", "-12.50", "+3", ".5", "5.", "1e3", "2.5E-4"] {
            assert!(is_decimal(ok), "{ok}");
        }
        for bad in ["", ".", "NaN", "1..2", "1e", "12x", "--1", "Infinity"] {
            assert!(!is_decimal(bad), "{bad}");
        }
    }

    #[test]
    fn specs_parse_and_bad_ones_say_what_exists() {
        assert_eq!("json:/a/0".parse::<From>(), Ok(From::Json("/a/0".into())));
        assert_eq!("header:h".parse::<From>(), Ok(From::Header("h".into())));
        assert!("jsn:/a".parse::<From>().expect_err("refused").contains("json:/pointer"));
        assert!("json:a".parse::<From>().is_err());
    }
}
