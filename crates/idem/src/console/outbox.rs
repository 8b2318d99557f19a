//! The outbox view: each destination's backlog (how many wait, the oldest one's age, how many failed), the
//! waiting rows that failed with their last error, and the relays' dead letters with their requeue: the same
//! figures and the same selection as `idem outbox stats --by-destination`, `idem outbox list --failing` and
//! `idem outbox requeue` ([`crate::outbox::requeue`]).

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::api::{Refusal, error};
use super::auth::User;
use super::page::{esc, failed, field, operator_form, signed_in, to_sign_in};
use super::{Console, ConsoleStore, Role};
use crate::outbox::requeue::{RequeueError, Requeued, requeue};
use crate::outbox::{DestinationStats, OutboxMessage};
use crate::source::Publisher;
use crate::store::DeadLetter;
use crate::store::letter_pages::LetterQuery;

/// How many failing rows the view lists.
const LISTED: i64 = 50;

/// The query of the outbox view: where the page of relay dead letters starts.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutboxQuery {
    /// Only relay dead letters with a larger id (the previous page's `next_after`).
    pub after: Option<i64>,
    /// At most this many relay dead letters (1 to 500, default 50).
    pub limit: Option<i64>,
}

/// The outbox view's figures.
pub(crate) struct Backlog {
    destinations: Vec<DestinationStats>,
    failing: Vec<OutboxMessage>,
    dead: Vec<DeadLetter>,
    dead_total: i64,
    next_after: Option<i64>,
}

async fn backlog<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    asked: &OutboxQuery,
) -> Result<Backlog, Refusal> {
    let limit = super::api::limit_of(asked.limit, 50, 500)?;
    let unavailable =
        |e: crate::Error| (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}; try again"));
    let destinations = crate::outbox::destinations(&c.pool, &c.tables).await.map_err(unavailable)?;
    let failing = crate::outbox::list(&c.pool, &c.tables, true, LISTED).await.map_err(unavailable)?;
    let relays = LetterQuery { group_prefix: Some("outbox:"), ..LetterQuery::ALL };
    let page = LetterQuery { after_id: asked.after, ..relays };
    let mut dead = DB::letter_page(&c.pool, &c.tables, &page, limit + 1).await.map_err(unavailable)?;
    let size = usize::try_from(limit).unwrap_or(usize::MAX);
    let next_after = (dead.len() > size).then(|| dead[size - 1].id);
    dead.truncate(size);
    let dead_total = DB::count_letters(&c.pool, &c.tables, &relays, None).await.map_err(unavailable)?;
    Ok(Backlog { destinations, failing, dead, dead_total, next_after })
}

fn message_json(m: &OutboxMessage) -> serde_json::Value {
    serde_json::json!({
        "id": m.id, "event_id": m.event_id, "destination": m.destination, "attempts": m.attempts,
        "last_error": m.last_error, "age_seconds": m.age_seconds,
    })
}

/// `GET /api/v1/outbox`.
pub async fn api<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    asked: Result<Query<OutboxQuery>, QueryRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let asked = match super::api::query(asked) {
        Ok(asked) => asked,
        Err((status, why)) => return error(status, &why),
    };
    match backlog(&c, &asked).await {
        Ok(b) => {
            let dead: Vec<serde_json::Value> = b.dead.iter().map(|l| c.letter_json(l)).collect();
            Json(serde_json::json!({
                "destinations": b.destinations,
                "failing": b.failing.iter().map(message_json).collect::<Vec<_>>(),
                "dead_letters": { "items": dead, "total": b.dead_total, "next_after": b.next_after },
            }))
            .into_response()
        }
        Err((status, why)) => error(status, &why),
    }
}

/// What to requeue: relay dead-letter ids, or all of them (of `relay`, when given).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RequeueBody {
    /// Dead-letter ids (of consumer groups `outbox:<relay>`).
    pub ids: Vec<i64>,
    /// Every relay dead letter (of `relay`, when given).
    pub all: bool,
    /// Only this relay's.
    pub relay: Option<String>,
    /// Say what would be requeued, and do nothing.
    pub dry_run: bool,
}

impl<DB: ConsoleStore, P: Publisher + 'static> Console<DB, P> {
    /// Requeues what `body` names (or says what it would), writing the audit entry; what was done and the entry.
    async fn requeue(&self, user: &User, body: &RequeueBody) -> Result<(Requeued, Option<i64>), Refusal> {
        if !body.ids.is_empty() && body.all {
            return Err((StatusCode::BAD_REQUEST, "ids and all: name ids, or all, not both".to_owned()));
        }
        let relay = body.relay.as_deref().map(str::trim).filter(|r| !r.is_empty());
        let subjects = |chosen: &[i64]| format!("dead letters {}", crate::dead_letter::selection::join(chosen));
        let named = match (body.all, relay) {
            (true, Some(r)) => format!("all of relay {r}"),
            (true, None) => "all".to_owned(),
            (false, _) if body.ids.is_empty() => "nothing named".to_owned(),
            (false, _) => subjects(&body.ids),
        };
        if body.ids.is_empty() && !body.all {
            let why = "name the relay dead letters to requeue: `ids`, or `all: true` (with `relay`, one relay's)";
            if !body.dry_run {
                self.audit(user, "outbox requeue", named, 0, &Err(why.to_owned())).await;
            }
            return Err((StatusCode::BAD_REQUEST, why.to_owned()));
        }
        let done = requeue(&self.pool, &self.tables, &body.ids, body.all, relay, body.dry_run).await;
        match done {
            Ok(done) if body.dry_run => Ok((done, None)),
            Ok(done) => {
                let entry =
                    self.audit(user, "outbox requeue", subjects(&done.chosen), done.requeued.len(), &Ok(())).await;
                Ok((done, entry))
            }
            Err(RequeueError::Refused(why)) => {
                if !body.dry_run {
                    self.audit(user, "outbox requeue", named, 0, &Err(why.clone())).await;
                }
                Err((StatusCode::CONFLICT, why))
            }
            Err(RequeueError::Failed { done, error }) => {
                let why = format!("the database failed after {} requeued: {error}", done.requeued.len());
                let outcome = Err(why.clone());
                self.audit(user, "outbox requeue", subjects(&done.chosen), done.requeued.len(), &outcome).await;
                Err((StatusCode::SERVICE_UNAVAILABLE, why))
            }
        }
    }
}

/// `POST /api/v1/outbox/requeue`.
pub async fn requeue_api<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    body: Result<Json<RequeueBody>, JsonRejection>,
) -> Response {
    let user = match c.api_user(&headers, Role::Operator) {
        Ok(user) => user,
        Err((status, why)) => return error(status, &why),
    };
    let body = match body {
        Ok(Json(body)) => body,
        Err(rejection) => return error(StatusCode::BAD_REQUEST, &format!("the body: {rejection}")),
    };
    match c.requeue(&user, &body).await {
        Ok((done, entry)) => Json(serde_json::json!({
            "dry_run": body.dry_run, "chosen": done.chosen, "requeued": done.requeued, "gone": done.gone,
            "audit_id": entry,
        }))
        .into_response(),
        Err((status, why)) => error(status, &why),
    }
}

/// `GET /outbox`.
pub async fn page<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Query(asked): Query<OutboxQuery>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let b = match backlog(&c, &asked).await {
        Ok(b) => b,
        Err((status, why)) => return failed(status, &why),
    };
    let mut body = String::from("<h2>Backlog per destination</h2>");
    if b.destinations.is_empty() {
        body.push_str(r#"<p class="count" id="empty">The outbox is empty: every message was delivered.</p>"#);
    } else {
        body.push_str(
            "<table id=\"destinations\"><tr><th>Destination</th><th>Waiting</th><th>Oldest</th><th>Failing</th></tr>",
        );
        for d in &b.destinations {
            let oldest = d.oldest_age_seconds.map_or("-".to_owned(), |s| format!("{s:.1}s"));
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{oldest}</td><td>{}</td></tr>",
                esc(&d.destination),
                d.pending,
                d.failing
            );
        }
        body.push_str("</table>");
    }
    if !b.failing.is_empty() {
        body.push_str("<h2>Waiting rows that failed (the relay tries them again)</h2><table id=\"failing\"><tr><th>Id</th><th>Destination</th><th>Event id</th><th>Attempts</th><th>Age</th><th>Last error</th></tr>");
        for m in &b.failing {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}s</td><td>{}</td></tr>",
                m.id,
                esc(&m.destination),
                esc(&m.event_id),
                m.attempts,
                m.age_seconds,
                esc(m.last_error.as_deref().unwrap_or("")),
            );
        }
        body.push_str("</table>");
    }
    let _ = write!(
        body,
        r#"<h2>Given up (the relays' dead letters)</h2><p class="count"><span id="dead-total">{}</span> dead letter(s)</p>"#,
        b.dead_total
    );
    if !b.dead.is_empty() {
        let csrf = esc(&session.csrf);
        let operator = session.user.role >= Role::Operator;
        body.push_str("<table id=\"relay-letters\"><tr><th>Id</th><th>Relay</th><th>Destination</th><th>Event id</th><th>Attempts</th><th>Reason</th><th></th></tr>");
        for l in &b.dead {
            let action = if operator {
                format!(
                    r#"<form method="post" action="/outbox/requeue"><input type="hidden" name="ids" value="{}"><input type="hidden" name="csrf" value="{csrf}"><button>Requeue…</button></form>"#,
                    l.id
                )
            } else {
                String::new()
            };
            let _ = write!(
                body,
                r#"<tr><td><a href="/dead-letters/{id}">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{action}</td></tr>"#,
                esc(l.consumer_group.trim_start_matches("outbox:")),
                esc(&l.topic),
                esc(l.event_id.as_deref().unwrap_or("")),
                l.attempts,
                esc(&l.error),
                id = l.id,
            );
        }
        body.push_str("</table>");
        if let Some(after) = b.next_after {
            let limit = asked.limit.map(|n| format!("&limit={n}")).unwrap_or_default();
            let _ = write!(body, r#"<p><a id="next" href="/outbox?after={after}{limit}">Next page</a></p>"#);
        }
        if operator {
            let _ = write!(
                body,
                r#"<form method="post" action="/outbox/requeue"><input type="hidden" name="all" value="true"><input type="hidden" name="csrf" value="{csrf}"><button id="requeue-all">Requeue all {}…</button></form>"#,
                b.dead_total
            );
        }
    }
    c.layout("Outbox", &session, &body)
}

/// `POST /outbox/requeue`: without `confirm`, which dead letters it would take and a form to confirm it on
/// exactly those; with it, the requeue and a link to the audit trail.
pub async fn requeue_form<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let session = match operator_form(&c, &headers, &form) {
        Ok(session) => session,
        Err((status, why)) => return failed(status, &why),
    };
    let mut ids = Vec::new();
    for (_, value) in form.iter().filter(|(k, _)| k == "ids") {
        match value.trim().parse::<i64>() {
            Ok(id) => ids.push(id),
            Err(_) => return failed(StatusCode::BAD_REQUEST, &format!("ids: `{value}` is not a dead-letter id")),
        }
    }
    let confirmed = field(&form, "confirm") == Some("yes");
    let body = RequeueBody {
        ids,
        all: field(&form, "all") == Some("true"),
        relay: field(&form, "relay").map(str::to_owned),
        dry_run: !confirmed,
    };
    let (done, entry) = match c.requeue(&session.user, &body).await {
        Ok(done) => done,
        Err((status, why)) => {
            let body = format!(r#"<p class="error" id="refused">{}</p><p>Nothing was done.</p>"#, esc(&why));
            let mut page = c.layout("Not done", &session, &body);
            *page.status_mut() = status;
            return page;
        }
    };
    let listed = crate::dead_letter::selection::join(&done.chosen);
    if !confirmed {
        let csrf = esc(&session.csrf);
        let hidden: String =
            done.chosen.iter().map(|id| format!(r#"<input type="hidden" name="ids" value="{id}">"#)).collect();
        let n = done.chosen.len();
        let body = format!(
            r#"<p id="dry-run">This will put <strong id="count">{n}</strong> dead letter(s) back into the outbox, to be delivered again under their event ids: {listed}.</p>
<form method="post" action="/outbox/requeue">{hidden}<input type="hidden" name="csrf" value="{csrf}"><input type="hidden" name="confirm" value="yes"><button id="confirm">Confirm: requeue {n}</button></form>
<p><a href="/outbox" class="cancel">Cancel</a></p>"#
        );
        return c.layout(&format!("Requeue {n} dead letter(s)?"), &session, &body);
    }
    let mut body = format!(
        r#"<p id="done">Requeued {}: {}.</p>"#,
        done.requeued.len(),
        crate::dead_letter::selection::join(&done.requeued)
    );
    if !done.gone.is_empty() {
        let _ = write!(body, "<p>Gone meanwhile: {}.</p>", crate::dead_letter::selection::join(&done.gone));
    }
    body.push_str(&super::page::audit_link(entry));
    c.layout("Requeued", &session, &body)
}
