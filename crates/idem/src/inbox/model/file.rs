//! The TOML form.

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
    crate::duration::parse(text).map_err(|e| Error::Config(format!("inbox housekeeping `{field}`: {}", message(e))))
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
    let seconds = days * 86_400 + i64::from(time.hour) * 3_600 + i64::from(time.minute) * 60 + i64::from(time.second)
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
        let retention: Duration = crate::duration::parse(&self.retention)
            .map_err(|e| Error::Config(format!("sequence `{name}`: retention: {}", message(e))))?;
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
