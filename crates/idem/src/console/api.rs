//! The console's JSON API, under `/api/v1/`: every request with `Authorization: Bearer TOKEN`; reads for viewers,
//! actions for operators. Errors are `{"error": "…"}` with the status that says whose fault it is.
//!
//! * `GET whoami`: the user and role.
//! * `GET failure-groups?group=&matching=&fingerprint=&older_than=&message_type=`: the groups, largest first.
//! * `GET dead-letters?…filters…&after=ID&limit=N`: dead letters oldest first, a page at a time (`next_after`).
//! * `GET dead-letters/{id}`: one, with its headers and (when shown) its payload.
//! * `POST dead-letters/replay`: `{"ids": [..]}` or `{"all": true, …filters}`, `force`, `dry_run`.
//! * `POST dead-letters/discard`: the same selection and `reason`, `dry_run`.
//! * `GET parked?group=`, `GET audit?limit=`.
//!
//! An action names its letters by id (the page's confirmation does): a letter another operator replayed or
//! discarded meanwhile refuses the whole action, naming who and when, and nothing is touched.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{Console, ConsoleStore, Role, User};
use crate::dead_letter::selection::{Chosen, Filter, FilterSpec, Taken};
use crate::dead_letter::{Safety, Tally};
use crate::source::Publisher;
use crate::store::DeadLetter;

/// `{"error": why}` with `status`.
pub fn error(status: StatusCode, why: &str) -> Response {
    (status, Json(serde_json::json!({ "error": why }))).into_response()
}

pub(crate) fn database(error: &crate::Error) -> Response {
    error_response(&format!("the database did not answer: {error}; try again"))
}

fn error_response(why: &str) -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, why)
}

/// The filters' parameter names.
const FILTER_PARAMETERS: [&str; 5] = ["group", "matching", "fingerprint", "older_than", "message_type"];

/// Refuses a query string naming a parameter not in `known` (a misspelt filter would otherwise widen the list).
pub(crate) fn known_parameters(uri: &axum::http::Uri, known: &[&str]) -> Result<(), Refusal> {
    for pair in uri.query().unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let name = pair.split_once('=').map_or(pair, |(name, _)| name);
        if !known.contains(&name) {
            return Err((
                StatusCode::BAD_REQUEST,
                format!("the query: `{name}` is not a parameter here; use {}", known.join(", ")),
            ));
        }
    }
    Ok(())
}

/// A query string checked: the parameter that does not read is named.
pub(crate) fn query<T>(query: Result<Query<T>, QueryRejection>) -> Result<T, Refusal> {
    query.map(|Query(q)| q).map_err(|e| (StatusCode::BAD_REQUEST, format!("the query: {}", e.body_text())))
}

/// `GET /api/v1/openapi.json`: the API's description (no token needed).
pub async fn openapi() -> Response {
    Json(super::openapi::document()).into_response()
}

/// The query of the dead-letter list: the filters, and where the page starts.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
pub struct Page {
    /// The filters.
    #[serde(flatten)]
    pub filter: FilterSpec,
    /// Only letters with a larger id (the previous page's `next_after`).
    pub after: Option<i64>,
    /// At most this many (default 50, at most 500).
    pub limit: Option<i64>,
}

/// An action's selection and options, as the API's body or the page's form gives them.
#[derive(Debug, Default)]
pub struct ActionRequest {
    /// Dead-letter ids.
    pub ids: Vec<i64>,
    /// Every letter the filters take (needed without ids and without a narrowing filter).
    pub all: bool,
    /// The filters.
    pub filter: FilterSpec,
    /// Replay: accept letters older than the markers kept.
    pub force: bool,
    /// Say what would happen; change nothing, write no audit entry.
    pub dry_run: bool,
    /// Discard: why (kept in the archive and the audit trail).
    pub reason: Option<String>,
}

/// An action's body as the API takes it: every field named (an unknown one, such as a misspelt `dry_run`, is
/// refused rather than ignored).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActionBody {
    ids: Vec<i64>,
    all: bool,
    group: Option<String>,
    matching: Option<String>,
    fingerprint: Option<String>,
    older_than: Option<String>,
    message_type: Option<String>,
    force: bool,
    dry_run: bool,
    reason: Option<String>,
}

impl From<ActionBody> for ActionRequest {
    fn from(b: ActionBody) -> Self {
        let filter = FilterSpec {
            group: b.group,
            matching: b.matching,
            fingerprint: b.fingerprint,
            older_than: b.older_than,
            message_type: b.message_type,
        };
        ActionRequest { ids: b.ids, all: b.all, filter, force: b.force, dry_run: b.dry_run, reason: b.reason }
    }
}

/// What an action did, or why it did nothing.
pub enum Acted {
    /// A replay's (or its dry run's) tally.
    Replayed(Tally),
    /// A discard.
    Discarded {
        /// The ids discarded (or, dry, that would be).
        ids: Vec<i64>,
        /// Those left: under replay or gone meanwhile.
        left: Vec<i64>,
    },
}

impl Acted {
    /// The result as the API answers it.
    pub fn json(&self, dry_run: bool) -> serde_json::Value {
        match self {
            Acted::Replayed(tally) => tally.json(dry_run),
            Acted::Discarded { ids, left } if dry_run => {
                serde_json::json!({ "dry_run": true, "would_discard": ids, "left": left })
            }
            Acted::Discarded { ids, left } => serde_json::json!({ "dry_run": false, "discarded": ids, "left": left }),
        }
    }
}

/// Why an action did nothing: the status and the reason.
pub type Refusal = (StatusCode, String);

impl<DB: ConsoleStore, P: Publisher + 'static> Console<DB, P> {
    /// The filter, its fields checked and the console's message-type setting applied when the request has none.
    pub(crate) fn filter(&self, mut spec: FilterSpec) -> Result<Filter, Refusal> {
        if spec.message_type.is_none() {
            spec.message_type.clone_from(&self.config.message_type);
        }
        Filter::parse(spec).map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))
    }

    /// Replays or discards (`action`) what `request` selects, as `user`; writes the audit trail unless a dry run
    /// (the entry's id is returned with what was done).
    pub(crate) async fn act(
        &self,
        user: &User,
        action: &str,
        request: &ActionRequest,
    ) -> Result<(Acted, Option<i64>), Refusal> {
        if !request.ids.is_empty() && request.all {
            let why = "ids and all: name the letters by id, or take all that the filters take, not both";
            return Err((StatusCode::BAD_REQUEST, why.into()));
        }
        let filter = self.filter(request.filter.clone())?;
        let chosen = Chosen { ids: &request.ids, all: request.all, filter: &filter };
        let (verb, audit_action) = match action {
            "replay" => ("replay", "dead-letters replay"),
            "discard" => ("discard", "dead-letters discard"),
            other => return Err((StatusCode::NOT_FOUND, format!("no action `{other}`: replay or discard"))),
        };
        let reason = request.reason.as_deref().map(str::trim).unwrap_or_default();
        if verb == "discard"
            && let Err(why) = crate::dead_letter::check_reason(reason)
        {
            return Err((StatusCode::BAD_REQUEST, format!("reason: {why}")));
        }
        let forced = if request.force && verb == "replay" { ", forced" } else { "" };
        let with_reason = if verb == "discard" { format!(", reason: {reason}") } else { String::new() };
        if request.ids.is_empty() && !request.all && !filter.narrows() {
            let why = format!(
                "name the dead letters to {verb}: `ids`, or `all: true`, or a filter (`matching`, `fingerprint`, \
                 `older_than`)"
            );
            if !request.dry_run {
                let subjects = format!("{}{forced}{with_reason}", chosen.subjects(&[]));
                self.audit(user, audit_action, subjects, 0, &Err(why.clone())).await;
            }
            return Err((StatusCode::BAD_REQUEST, why));
        }
        // One action of the console takes at most MAX_ACTION letters: its confirmation names every id, and a
        // larger one belongs to the command line, which prints its progress as it goes.
        let unavailable = |e: crate::Error| {
            (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}; nothing was done"))
        };
        let count = if request.ids.is_empty() {
            filter.count_at_most(&self.pool, &self.tables, MAX_ACTION + 1).await.map_err(unavailable)?
        } else {
            request.ids.len() as i64
        };
        if count > MAX_ACTION {
            let why = format!(
                "this selection takes more than {MAX_ACTION} dead letters; the console acts on at most {MAX_ACTION} at \
                 once: narrow it (group, older_than, fingerprint) and act again, or use `idem dead-letters {verb}` \
                 with the same filters"
            );
            if !request.dry_run {
                let subjects = format!("{}{forced}{with_reason}", chosen.subjects(&[]));
                self.audit(user, audit_action, subjects, 0, &Err(why.clone())).await;
            }
            return Err((StatusCode::CONFLICT, why));
        }
        let taken = chosen.letters(&self.pool, &self.tables, verb).await.map_err(|e| {
            (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}; nothing was done"))
        })?;
        let (letters, gone) = match taken {
            Taken::Letters(letters, gone) => (letters, gone),
            Taken::Refused(why) => {
                if !request.dry_run {
                    let subjects = format!("{}{forced}{with_reason}", chosen.subjects(&[]));
                    self.audit(user, audit_action, subjects, 0, &Err(why.clone())).await;
                }
                return Err((StatusCode::CONFLICT, why));
            }
        };
        // HTTP requests' replays publish nothing (they release their keys); any other replay needs the broker.
        if verb == "replay"
            && self.publisher.is_none()
            && !request.dry_run
            && !letters.iter().all(crate::dead_letter::is_http_request)
        {
            return Err((
                StatusCode::CONFLICT,
                "this console has no broker to replay to: start it with one (idem console --log-dir DIR | --kafka \
                 BROKERS | …)"
                    .into(),
            ));
        }
        let ids: Vec<i64> = letters.iter().map(|l| l.id).collect();
        let subjects = format!("{}{forced}{with_reason}", chosen.subjects(&ids));
        let safety = if request.force { Safety::Forced } else { Safety::Checked };
        match (verb, request.dry_run, &self.publisher) {
            ("replay", true, _) => {
                let mut tally =
                    crate::dead_letter::check_each(&self.pool, &self.tables, &letters, safety, |_, _| {}).await;
                tally.gone.extend(gone);
                Ok((Acted::Replayed(tally), None))
            }
            ("replay", false, publisher) => {
                let (pool, tables) = (&self.pool, &self.tables);
                let mut tally = match publisher {
                    Some(publisher) => {
                        crate::dead_letter::replay_each(pool, tables, publisher, &letters, safety, |_, _| {}).await
                    }
                    None => {
                        let nowhere = crate::dead_letter::NoBroker;
                        crate::dead_letter::replay_each(pool, tables, &nowhere, &letters, safety, |_, _| {}).await
                    }
                };
                tally.gone.extend(gone);
                let done = tally.replayed.len() + tally.released.len();
                let entry = self.audit(user, audit_action, subjects, done, &tally.outcome()).await;
                Ok((Acted::Replayed(tally), entry))
            }
            (_, true, _) => Ok((Acted::Discarded { ids, left: gone }, None)),
            _ => {
                let discarded =
                    crate::dead_letter::discard(&self.pool, &self.tables, &letters, &user.name, reason).await;
                let outcome = discarded.as_ref().map(|_| ()).map_err(ToString::to_string);
                let count = discarded.as_ref().map_or(0, Vec::len);
                let entry = self.audit(user, audit_action, subjects, count, &outcome).await;
                let discarded = discarded.map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, e.to_string()))?;
                let left = ids.into_iter().filter(|id| !discarded.contains(id)).chain(gone).collect();
                Ok((Acted::Discarded { ids: discarded, left }, entry))
            }
        }
    }

    /// A dead letter as the console shows it: its payload only when payloads are shown, its headers readable.
    pub(crate) fn letter_json(&self, letter: &DeadLetter) -> serde_json::Value {
        let mut value = serde_json::to_value(letter).unwrap_or_default();
        value["fingerprint"] = crate::dead_letter::groups::fingerprint_of(letter, self.typing.as_ref()).into();
        if self.config.show_payloads {
            value["payload_json"] = serde_json::from_slice::<serde_json::Value>(&letter.payload).unwrap_or_default();
        } else {
            value["payload"] = serde_json::Value::Null;
            value["payload_hidden"] = true.into();
        }
        let headers: Vec<serde_json::Value> = letter
            .headers
            .iter()
            .map(|(name, value)| serde_json::json!({ "name": name, "value": String::from_utf8_lossy(value) }))
            .collect();
        value["headers"] = headers.into();
        value
    }
}

/// `GET /api/v1/whoami`.
pub async fn whoami<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
) -> Response {
    match c.api_user(&headers, Role::Viewer) {
        Ok(user) => Json(user).into_response(),
        Err((status, why)) => error(status, &why),
    }
}

/// `GET /api/v1/failure-groups`.
pub async fn failure_groups<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    spec: Result<Query<FilterSpec>, QueryRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    if let Err((status, why)) = known_parameters(&uri, &FILTER_PARAMETERS) {
        return error(status, &why);
    }
    let filter = match query(spec).and_then(|spec| c.filter(spec)) {
        Ok(filter) => filter,
        Err((status, why)) => return error(status, &why),
    };
    match filter.groups(&c.pool, &c.tables).await {
        Ok(groups) => Json(groups).into_response(),
        Err(e) => database(&e),
    }
}

/// The most dead letters one action of the console takes.
pub const MAX_ACTION: i64 = 10_000;

/// How many a text search counts at most for its list page (past it, the page says "at least").
pub const TEXT_COUNT_LIMIT: i64 = 10_000;

/// One page of dead letters.
pub(crate) struct Listed {
    /// The letters, oldest first.
    pub letters: Vec<DeadLetter>,
    /// How many the filters take in all (at least this many when `at_least`).
    pub total: i64,
    /// A text search counted [`TEXT_COUNT_LIMIT`] and stopped.
    pub at_least: bool,
    /// The id the next page starts after.
    pub next: Option<i64>,
}

/// One page of dead letters, oldest first, how many the filters take in all, and where the next page starts.
pub(crate) async fn page_of<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    page: Page,
) -> Result<Listed, Refusal> {
    let limit = limit_of(page.limit, 50, 500)?;
    let filter = c.filter(page.filter)?;
    let unavailable =
        |e: crate::Error| (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}; try again"));
    let (letters, next) = filter.page(&c.pool, &c.tables, page.after, limit).await.map_err(unavailable)?;
    // A first page that is also the last holds them all: no count to make (a rare text searched for would scan
    // the table a second time).
    // A text is checked row by row: its matches are counted only so far.
    let at_most = if filter.spec().matching.is_some() { TEXT_COUNT_LIMIT } else { i64::MAX };
    let total = match (page.after, next) {
        (None, None) => letters.len() as i64,
        _ => filter.count_at_most(&c.pool, &c.tables, at_most).await.map_err(unavailable)?,
    };
    Ok(Listed { letters, total, at_least: total >= at_most, next })
}

/// A page's `limit`: `default` when not given; refused, naming the range, when out of it.
pub(crate) fn limit_of(limit: Option<i64>, default: i64, most: i64) -> Result<i64, Refusal> {
    match limit {
        None => Ok(default),
        Some(n) if (1..=most).contains(&n) => Ok(n),
        Some(n) => {
            Err((StatusCode::BAD_REQUEST, format!("limit: {n} is out of range; give 1 to {most} (default {default})")))
        }
    }
}

/// `GET /api/v1/dead-letters`.
pub async fn dead_letters<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    uri: axum::http::Uri,
    page: Result<Query<Page>, QueryRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let known: Vec<&str> = FILTER_PARAMETERS.iter().copied().chain(["after", "limit"]).collect();
    if let Err((status, why)) = known_parameters(&uri, &known) {
        return error(status, &why);
    }
    let page = match query(page) {
        Ok(page) => page,
        Err((status, why)) => return error(status, &why),
    };
    match page_of(&c, page).await {
        Ok(Listed { letters, total, at_least, next }) => {
            let items: Vec<serde_json::Value> = letters.iter().map(|l| c.letter_json(l)).collect();
            let body =
                serde_json::json!({ "items": items, "total": total, "total_at_least": at_least, "next_after": next });
            Json(body).into_response()
        }
        Err((status, why)) => error(status, &why),
    }
}

/// `GET /api/v1/dead-letters/{id}`.
pub async fn dead_letter<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    id: Result<Path<i64>, PathRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let Ok(Path(id)) = id else {
        return error(StatusCode::BAD_REQUEST, "id: a dead letter's id is an integer");
    };
    match find(&c, id).await {
        Ok(Some(letter)) => Json(c.letter_json(&letter)).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, &format!("no dead letter has id {id} (replayed or discarded since?)")),
        Err(e) => database(&e),
    }
}

/// Dead letter `id`, if there is one.
pub(crate) async fn find<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    id: i64,
) -> Result<Option<DeadLetter>, crate::Error> {
    let query =
        crate::store::letter_pages::LetterQuery { id: Some(id), ..crate::store::letter_pages::LetterQuery::ALL };
    Ok(DB::letter_page(&c.pool, &c.tables, &query, 1).await?.pop())
}

/// `POST /api/v1/dead-letters/replay`.
pub async fn replay<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    body: Result<Json<ActionBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    act_api(&c, &headers, "replay", body).await
}

/// `POST /api/v1/dead-letters/discard`.
pub async fn discard<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    body: Result<Json<ActionBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    act_api(&c, &headers, "discard", body).await
}

async fn act_api<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    headers: &HeaderMap,
    action: &str,
    body: Result<Json<ActionBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let user = match c.api_user(headers, Role::Operator) {
        Ok(user) => user,
        Err((status, why)) => return error(status, &why),
    };
    let request = match body {
        Ok(Json(body)) => ActionRequest::from(body),
        Err(rejection) => return error(StatusCode::BAD_REQUEST, &format!("the body: {rejection}")),
    };
    match c.act(&user, action, &request).await {
        Ok((acted, entry)) => {
            let failed = matches!(&acted, Acted::Replayed(t) if t.stopped_by.is_some());
            let status = if failed { StatusCode::BAD_GATEWAY } else { StatusCode::OK };
            let mut body = acted.json(request.dry_run);
            body["audit_id"] = entry.into();
            (status, Json(body)).into_response()
        }
        Err((status, why)) => error(status, &why),
    }
}

/// The query of `parked`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Listing {
    /// Only this consumer group.
    pub group: Option<String>,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<i64>,
}

/// The query of `audit`: filters, and where the page starts.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuditPage {
    /// Only this actor's entries.
    pub actor: Option<String>,
    /// Only this action's (`dead-letters replay`).
    pub action: Option<String>,
    /// Only entries older than this id (the previous page's `next_before`).
    pub before: Option<i64>,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<i64>,
}

/// One page of the audit trail, newest first, and the id the next (older) page starts before.
pub(crate) async fn audit_page<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    page: &AuditPage,
) -> Result<(Vec<crate::audit::AuditEntry>, Option<i64>), Refusal> {
    let limit = limit_of(page.limit, 100, 1_000)?;
    let set = |v: &Option<String>| v.as_deref().map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned);
    let (actor, action) = (set(&page.actor), set(&page.action));
    let query = crate::audit::AuditQuery { actor: actor.as_deref(), action: action.as_deref(), before_id: page.before };
    let mut entries = crate::audit::query(&c.pool, &c.tables, &query, limit + 1)
        .await
        .map_err(|e| (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}; try again")))?;
    let size = usize::try_from(limit).unwrap_or(usize::MAX);
    let next = (entries.len() > size).then(|| entries[size - 1].id);
    entries.truncate(size);
    Ok((entries, next))
}

/// `GET /api/v1/parked`.
pub async fn parked<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    listing: Result<Query<Listing>, QueryRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let listing = match query(listing) {
        Ok(listing) => listing,
        Err((status, why)) => return error(status, &why),
    };
    let limit = match limit_of(listing.limit, 100, 1_000) {
        Ok(limit) => limit,
        Err((status, why)) => return error(status, &why),
    };
    match crate::delayed_retry::list(&c.pool, &c.tables, listing.group.as_deref(), limit).await {
        Ok(parked) => Json(parked).into_response(),
        Err(e) => database(&e),
    }
}

/// `GET /api/v1/audit`.
pub async fn audit<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    page: Result<Query<AuditPage>, QueryRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let page = match query(page) {
        Ok(page) => page,
        Err((status, why)) => return error(status, &why),
    };
    match audit_page(&c, &page).await {
        Ok((entries, next)) => {
            let rows: Vec<serde_json::Value> = entries
                .iter()
                .map(|e| {
                    serde_json::json!({
                        "id": e.id, "at": crate::store::rfc3339_from_ms(e.at_ms), "actor": e.actor,
                        "action": e.action, "subjects": e.subjects, "count": e.count, "outcome": e.outcome,
                    })
                })
                .collect();
            Json(serde_json::json!({ "items": rows, "next_before": next })).into_response()
        }
        Err((status, why)) => error(status, &why),
    }
}

/// `GET /api/v1/consumers`: this process's consumers (none for a console started alone).
pub async fn consumers<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    Json(c.config.consumers.json()).into_response()
}

/// `POST /api/v1/consumers/{group}/resume`: closes the consumer's tripped kill switch (the consumer writes the
/// audit entry, naming the user).
pub async fn resume<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    group: Result<Path<String>, PathRejection>,
) -> Response {
    let user = match c.api_user(&headers, Role::Operator) {
        Ok(user) => user,
        Err((status, why)) => return error(status, &why),
    };
    let Ok(Path(group)) = group else {
        return error(StatusCode::BAD_REQUEST, "group: a consumer group's name in UTF-8");
    };
    match c.resume(&user, &group) {
        Ok(was_paused) => Json(serde_json::json!({ "group": group, "was_paused": was_paused })).into_response(),
        Err((status, why)) => error(status, &why),
    }
}

impl<DB: ConsoleStore, P: Publisher + 'static> Console<DB, P> {
    /// Resumes consumer `group` as `user`; whether it was paused.
    pub(crate) fn resume(&self, user: &User, group: &str) -> Result<bool, Refusal> {
        let consumer = self.config.consumers.find(group).ok_or_else(|| {
            let known: Vec<String> = self.config.consumers.0.iter().map(|c| c.group()).collect();
            let known = if known.is_empty() {
                "this console runs alone: resume a consumer on its own operations endpoint (POST /resume)".to_owned()
            } else {
                format!("this process runs {}", known.join(", "))
            };
            (StatusCode::NOT_FOUND, format!("no consumer `{group}` here: {known}"))
        })?;
        Ok(consumer.resume_as(&format!("{} (console)", user.name)))
    }
}

/// The largest edited payload the console takes.
pub const MAX_EDITED_PAYLOAD: usize = 1 << 20;

/// An edit of one dead letter's payload (an unknown field is refused).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EditRequest {
    /// The edited payload, as text (JSON when the original is JSON).
    pub payload: Option<String>,
    /// Run the consumer's handler on the edited message and roll back; change nothing.
    pub dry_run: bool,
    /// Replay even when the markers of the letter's time were pruned.
    pub force: bool,
}

/// What an edit did.
pub enum Edited {
    /// The dry run's report.
    Tried(crate::console::TrialReport),
    /// The edited copy was published (the original is in the archive); the audit entry.
    Replayed(Option<i64>),
}

impl<DB: ConsoleStore, P: Publisher + 'static> Console<DB, P> {
    /// Dry-runs or replays dead letter `id` with an edited payload, as `user`.
    pub(crate) async fn edit(&self, user: &User, id: i64, request: &EditRequest) -> Result<Edited, Refusal> {
        if !self.config.show_payloads {
            return Err((
                StatusCode::CONFLICT,
                "payloads are hidden in this console: start it with --show-payloads (show_payloads = true) to edit \
                 them"
                    .into(),
            ));
        }
        let payload = request
            .payload
            .as_deref()
            .ok_or_else(|| (StatusCode::BAD_REQUEST, "payload: the edited payload, as text".to_owned()))?;
        if payload.len() > MAX_EDITED_PAYLOAD {
            let why = format!("payload: {} bytes; an edited payload is at most {MAX_EDITED_PAYLOAD}", payload.len());
            return Err((StatusCode::BAD_REQUEST, why));
        }
        let unavailable =
            |e: crate::Error| (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}"));
        let letter = find(self, id).await.map_err(unavailable)?.ok_or_else(|| {
            (StatusCode::NOT_FOUND, format!("no dead letter has id {id} (replayed or discarded since?)"))
        })?;
        if serde_json::from_slice::<serde_json::Value>(&letter.payload).is_ok()
            && let Err(e) = serde_json::from_str::<serde_json::Value>(payload)
        {
            return Err((StatusCode::BAD_REQUEST, format!("payload: not JSON ({e}), and the original is")));
        }
        if request.dry_run {
            let trial = self.config.trials.find(&letter.consumer_group).ok_or_else(|| {
                let why = format!(
                    "no handler of consumer group {} runs beside this console: a dry run needs the console of the \
                     consumer's own process (idem run's [console], or HandlerTrial in a Rust binary)",
                    letter.consumer_group
                );
                (StatusCode::CONFLICT, why)
            })?;
            let mut message = letter.message();
            message.payload = payload.as_bytes().to_vec();
            let event_id = letter.event_id.clone().unwrap_or_else(|| format!("dead-letter-{id}"));
            return Ok(Edited::Tried(trial.try_event(crate::Event::new(event_id, message)).await));
        }
        let Some(publisher) = &self.publisher else {
            return Err((StatusCode::CONFLICT, "this console has no broker to replay to".into()));
        };
        let safety = if request.force { Safety::Forced } else { Safety::Checked };
        let edited = payload.as_bytes().to_vec();
        let subjects = format!("id {id}, payload edited ({} bytes, was {})", edited.len(), letter.payload.len());
        let action = "dead-letters edit and replay";
        let replayed =
            crate::dead_letter::replay_edited(&self.pool, &self.tables, publisher, &letter, edited, safety, &user.name)
                .await;
        let refusal = match replayed {
            Ok(crate::dead_letter::Replayed::Published) => {
                let entry = self.audit(user, action, subjects, 1, &Ok(())).await;
                return Ok(Edited::Replayed(entry));
            }
            Ok(crate::dead_letter::Replayed::Refused(risk)) => (StatusCode::CONFLICT, risk.explain(&letter)),
            // An edited replay never releases (an HTTP request's is refused), but the answer would say so.
            Ok(crate::dead_letter::Replayed::Released) => {
                (StatusCode::CONFLICT, crate::dead_letter::ReplayRisk::HttpRequest.explain(&letter))
            }
            Ok(crate::dead_letter::Replayed::Gone) => {
                (StatusCode::CONFLICT, format!("dead letter {id} is gone: replayed or discarded meanwhile"))
            }
            Ok(crate::dead_letter::Replayed::Busy { since_ms }) => (
                StatusCode::CONFLICT,
                format!(
                    "dead letter {id} is being replayed by another operator since {}: nothing was done",
                    crate::store::rfc3339_from_ms(since_ms)
                ),
            ),
            Err(e) => (StatusCode::BAD_GATEWAY, format!("the edited copy was not published: {e}")),
        };
        self.audit(user, action, subjects, 0, &Err(refusal.1.clone())).await;
        Err(refusal)
    }
}

/// `POST /api/v1/dead-letters/{id}/edit`: `{"payload": "…", "dry_run": true}` runs the consumer's handler on the
/// edited message and rolls back; without `dry_run`, the edited copy is replayed (the original kept in the archive).
pub async fn edit<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    id: Result<Path<i64>, PathRejection>,
    body: Result<Json<EditRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let user = match c.api_user(&headers, Role::Operator) {
        Ok(user) => user,
        Err((status, why)) => return error(status, &why),
    };
    let Ok(Path(id)) = id else {
        return error(StatusCode::BAD_REQUEST, "id: a dead letter's id is an integer");
    };
    let Json(request) = match body {
        Ok(body) => body,
        Err(rejection) => return error(StatusCode::BAD_REQUEST, &format!("the body: {rejection}")),
    };
    match c.edit(&user, id, &request).await {
        Ok(Edited::Tried(report)) => Json(serde_json::json!({ "dry_run": true, "trial": report })).into_response(),
        Ok(Edited::Replayed(entry)) => {
            Json(serde_json::json!({ "dry_run": false, "replayed": true, "audit_id": entry })).into_response()
        }
        Err((status, why)) => error(status, &why),
    }
}
