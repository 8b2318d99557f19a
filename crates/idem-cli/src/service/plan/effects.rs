//! A consumer's parameters, its statements (per event or per batch) rendered for the dialect, and the outbox
//! messages it emits, as templates over the parameters.

use serde_json::Value as Json;
use toml::Spanned;

use super::Problems;
use crate::service::file::{self, Consumer};
use crate::service::sql::{Dialect, NamedSql, Rendered};
use crate::service::value::{Param, Value};

/// A statement rendered for the database, with where it was written.
#[derive(Debug, Clone)]
pub struct PlannedSql {
    /// What runs.
    pub rendered: Rendered,
    /// Its key path in the file.
    pub key: String,
    /// Its line.
    pub line: usize,
    /// Rows it must change, if declared.
    pub expect_rows: Option<u64>,
}

/// Text that is fixed, a parameter's value, or pieces of both.
#[derive(Debug, Clone)]
pub enum TextPart {
    /// As written.
    Fixed(String),
    /// The value of the parameter at this index.
    Param(usize),
    /// Fixed text and parameters' values, one after the other (`orders.:type`).
    Joined(Vec<TextPart>),
}

/// A JSON payload template.
#[derive(Debug, Clone)]
pub enum JsonPart {
    /// As written.
    Fixed(Json),
    /// The value of the parameter at this index, as JSON.
    Param(usize),
    /// An object of templates.
    Object(Vec<(String, JsonPart)>),
    /// An array of templates.
    Array(Vec<JsonPart>),
}

/// A message enqueued with each applied event.
#[derive(Debug, Clone)]
pub struct EmitPlan {
    /// Only for events whose parameter (at this index) has one of these values.
    pub when: Option<(usize, Vec<Json>)>,
    /// Where it goes.
    pub destination: TextPart,
    /// Its key.
    pub key: Option<TextPart>,
    /// Its body.
    pub payload: JsonPart,
    /// Its headers.
    pub headers: Vec<(String, TextPart)>,
}

impl TextPart {
    /// The text for an event's values.
    pub fn render(&self, values: &[Value]) -> String {
        match self {
            TextPart::Fixed(t) => t.clone(),
            TextPart::Param(i) => values[*i].to_text(),
            TextPart::Joined(parts) => parts.iter().map(|p| p.render(values)).collect(),
        }
    }
}

impl EmitPlan {
    /// Whether the event with these values emits this message.
    pub fn wanted(&self, params: &[Param], values: &[Value]) -> bool {
        self.when.as_ref().is_none_or(|(i, accepted)| accepted.contains(&values[*i].to_json(params[*i].ty)))
    }
}

/// `text` with `:name` read as the parameter's value wherever it stands (`orders.:type`), `::` as a colon; an
/// unknown name is `Err` naming it.
fn text_template(text: &str, params: &[Param]) -> Result<TextPart, String> {
    let mut parts = Vec::new();
    let mut fixed = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(':') {
        fixed.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(more) = after.strip_prefix(':') {
            fixed.push(':');
            rest = more;
            continue;
        }
        let len = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
        let name = &after[..len];
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            fixed.push(':');
            rest = after;
            continue;
        }
        let i = params.iter().position(|p| p.name == name).ok_or_else(|| {
            format!("`:{name}` names no parameter: declare it under the consumer's params (write `::` for a colon)")
        })?;
        if !fixed.is_empty() {
            parts.push(TextPart::Fixed(std::mem::take(&mut fixed)));
        }
        parts.push(TextPart::Param(i));
        rest = &after[len..];
    }
    fixed.push_str(rest);
    if !fixed.is_empty() {
        parts.push(TextPart::Fixed(fixed));
    }
    Ok(match parts.len() {
        0 => TextPart::Fixed(String::new()),
        1 => parts.remove(0),
        _ => TextPart::Joined(parts),
    })
}

impl JsonPart {
    /// The JSON for an event's values.
    pub fn render(&self, params: &[Param], values: &[Value]) -> Json {
        match self {
            JsonPart::Fixed(j) => j.clone(),
            JsonPart::Param(i) => values[*i].to_json(params[*i].ty),
            JsonPart::Object(fields) => {
                Json::Object(fields.iter().map(|(k, v)| (k.clone(), v.render(params, values))).collect())
            }
            JsonPart::Array(items) => Json::Array(items.iter().map(|v| v.render(params, values)).collect()),
        }
    }
}

pub(super) type Effects = (Vec<Param>, Vec<PlannedSql>, Vec<PlannedSql>, Vec<EmitPlan>);

/// The consumer's parameters, statements per event and per batch, and emits; what fails is recorded and left out.
pub(super) fn plan(
    problems: &mut Problems<'_>,
    c: &Consumer,
    dialect: Dialect,
    here: &dyn Fn(&str) -> String,
) -> Effects {
    let mut params = Vec::new();
    for (name, spec) in &c.params {
        let valid_name = name.chars().next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
            && name.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_');
        if !valid_name {
            problems.at(spec, &here(&format!("params.{name}")), "a parameter name is letters, digits and _");
        }
        // A parameter whose source is wrong is still declared, so the statements using it are not also reported.
        let from = spec.get_ref().from.parse().unwrap_or_else(|e| {
            problems.at(spec, &here(&format!("params.{name}.from")), e);
            crate::service::value::From::EventId
        });
        params.push(Param { name: name.clone(), from, ty: spec.get_ref().ty, optional: spec.get_ref().optional });
    }
    let declared: Vec<(&str, crate::service::value::ParamType)> =
        params.iter().map(|p| (p.name.as_str(), p.ty)).collect();
    let render = |problems: &mut Problems<'_>, list: &[file::Statement], what: &str, array: bool| {
        let mut out = Vec::new();
        for (n, statement) in list.iter().enumerate() {
            let key = here(&format!("{what}[{n}].sql"));
            let rendered = NamedSql::parse(statement.sql.get_ref()).and_then(|s| s.render(dialect, &declared, array));
            match rendered {
                Ok(rendered) => {
                    if array && statement.expect_rows.is_some() {
                        problems.at(
                            &statement.sql,
                            &key,
                            "expect_rows applies to per-event statements: a bulk \
                             statement's row count depends on the batch",
                        );
                    }
                    let line = problems.text.line(statement.sql.span().start);
                    out.push(PlannedSql { rendered, line, key, expect_rows: statement.expect_rows })
                }
                Err(e) => problems.at(&statement.sql, &key, e),
            }
        }
        out
    };
    let each = render(problems, &c.effects, "effect", false);
    let bulk = render(problems, &c.bulk, "bulk", true);
    if !c.bulk.is_empty() {
        if dialect != Dialect::Postgres {
            problems.at(
                &c.bulk[0].sql,
                &here("bulk"),
                format!(
                    "the bulk form binds arrays (UNNEST), which {db} lacks: declare the statements as \
                     [[consumer.effect]] on {db}",
                    db = dialect.name()
                ),
            );
        }
        if !c.effects.is_empty() {
            problems.at(
                &c.bulk[0].sql,
                &here("bulk"),
                "declare either [[consumer.effect]] (per event) or \
                 [[consumer.bulk]] (per batch), not both",
            );
        }
    }
    let param_ref = |problems: &mut Problems<'_>, text: &str, key: &str, at: &Spanned<String>| -> Option<TextPart> {
        match text.strip_prefix(':') {
            Some(rest) if rest.starts_with(':') => Some(TextPart::Fixed(rest.to_owned())),
            Some(name) => match params.iter().position(|p| p.name == name) {
                Some(i) => Some(TextPart::Param(i)),
                None => {
                    problems.at(
                        at,
                        key,
                        format!("`:{name}` names no parameter: declare it under the consumer's params"),
                    );
                    None
                }
            },
            None => Some(TextPart::Fixed(text.to_owned())),
        }
    };
    let mut emits = Vec::new();
    for (n, emit) in c.emits.iter().enumerate() {
        let key_path = |f: &str| here(&format!("emit[{n}].{f}"));
        let (destination, method) = match (&emit.destination, &emit.http) {
            (Some(d), None) => match text_template(d.get_ref(), &params) {
                Ok(destination) => (Some(destination), None),
                Err(e) => {
                    problems.at(d, &key_path("destination"), e);
                    (None, None)
                }
            },
            (None, Some(http)) => match http_emit(http.get_ref()) {
                Ok((url, method)) => (Some(TextPart::Fixed(url)), Some(method)),
                Err(e) => {
                    problems.at(http, &key_path("http"), e);
                    (None, None)
                }
            },
            (Some(d), Some(_)) => {
                problems.at(
                    d,
                    &key_path("destination"),
                    "declare destination (a broker) or http (a request), not both",
                );
                (None, None)
            }
            (None, None) => {
                problems.at(
                    &emit.payload,
                    &key_path("destination"),
                    "missing: declare destination (a topic, subject \
                     or queue) or http = { url = \"https://…\" }",
                );
                (None, None)
            }
        };
        let anchor = emit.destination.as_ref().map_or(emit.payload.span(), |d| d.span());
        let anchor = Spanned::new(anchor, String::new());
        let key = emit.key.as_ref().map(|k| param_ref(problems, k.get_ref(), &key_path("key"), k));
        let headers: Vec<(String, Option<TextPart>)> = emit
            .headers
            .iter()
            .map(|(h, v)| (h.clone(), param_ref(problems, v, &key_path(&format!("headers.{h}")), &anchor)))
            .collect();
        let payload = json_template(emit.payload.get_ref(), &params)
            .map_err(|e| problems.at(&emit.payload, &key_path("payload"), e));
        let when = match &emit.when {
            None => Some(None),
            Some(when) => match when_of(when.get_ref(), &params) {
                Ok(when) => Some(Some(when)),
                Err(e) => {
                    problems.at(when, &key_path("when"), e);
                    None
                }
            },
        };
        if let (Some(destination), Some(key), Ok(payload), Some(when)) =
            (destination, key.transpose_default(), payload, when)
        {
            let mut headers: Vec<(String, TextPart)> = headers.into_iter().filter_map(|(h, v)| Some((h, v?))).collect();
            if let Some(method) = method {
                headers.push((idem::outbox::METHOD_HEADER.to_owned(), TextPart::Fixed(method)));
            }
            emits.push(EmitPlan { when, destination, key, payload, headers });
        }
    }
    (params, each, bulk, emits)
}

/// An emit's condition: the parameter's index and the values (as JSON) that emit.
fn when_of(when: &file::When, params: &[Param]) -> Result<(usize, Vec<Json>), String> {
    let name = when.param.strip_prefix(':').unwrap_or(&when.param);
    let i = params
        .iter()
        .position(|p| p.name == name)
        .ok_or_else(|| format!("param = \"{name}\" names no parameter: declare it under the consumer's params"))?;
    let values = match (&when.equals, &when.one_of) {
        (Some(one), None) => vec![one.clone()],
        (None, Some(many)) if !many.is_empty() => many.clone(),
        _ => return Err("give exactly one of equals = VALUE or in = [VALUES…]".into()),
    };
    let values = values.iter().map(|v| serde_json::to_value(v).map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    Ok((i, values))
}

/// The URL and method of an HTTP emit, checked.
fn http_emit(http: &file::HttpEmit) -> Result<(String, String), String> {
    let url = file::expand(&http.url)?;
    let host =
        url.strip_prefix("https://").or_else(|| url.strip_prefix("http://")).map(|rest| rest.split(['/', '?']).next());
    if !host.flatten().is_some_and(|h| !h.is_empty() && !h.contains(char::is_whitespace)) {
        return Err(format!("url `{url}` is not an http:// or https:// URL with a host"));
    }
    let method = http.method.clone().unwrap_or_else(|| "POST".into()).to_ascii_uppercase();
    if !["POST", "PUT", "PATCH", "DELETE", "GET"].contains(&method.as_str()) {
        return Err(format!("method `{method}` is not one of POST, PUT, PATCH, DELETE, GET"));
    }
    Ok((url, method))
}

/// `Option<Option<T>>` from an optional lookup that may fail: `Some(None)` (absent) or `Some(Some(t))`, `None`
/// when the lookup failed.
trait TransposeDefault<T> {
    fn transpose_default(self) -> Option<Option<T>>;
}

impl<T> TransposeDefault<T> for Option<Option<T>> {
    fn transpose_default(self) -> Option<Option<T>> {
        match self {
            None => Some(None),
            Some(Some(t)) => Some(Some(t)),
            Some(None) => None,
        }
    }
}

fn json_template(value: &toml::Value, params: &[Param]) -> Result<JsonPart, String> {
    Ok(match value {
        toml::Value::String(s) => match s.strip_prefix(':') {
            Some(rest) if rest.starts_with(':') => JsonPart::Fixed(Json::from(rest)),
            Some(name) => JsonPart::Param(
                params
                    .iter()
                    .position(|p| p.name == name)
                    .ok_or_else(|| format!("`:{name}` names no parameter: declare it under the consumer's params"))?,
            ),
            None => JsonPart::Fixed(Json::from(s.as_str())),
        },
        toml::Value::Table(t) => JsonPart::Object(
            t.iter().map(|(k, v)| Ok((k.clone(), json_template(v, params)?))).collect::<Result<_, String>>()?,
        ),
        toml::Value::Array(a) => JsonPart::Array(a.iter().map(|v| json_template(v, params)).collect::<Result<_, _>>()?),
        other => JsonPart::Fixed(serde_json::to_value(other).map_err(|e| e.to_string())?),
    })
}
