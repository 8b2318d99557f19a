//! The Sequential Inbox view (PostgreSQL): instances with their messages per state, one instance with its
//! messages, and its close and release, as `idem inbox list|show|close|release` do them
//! ([`crate::inbox::admin`]), with the same audit entries.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Form, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::api::{Refusal, error, limit_of, query};
use super::auth::User;
use super::page::{audit_link, esc, failed, field, operator_form, signed_in, to_sign_in};
use super::{Console, ConsoleStore, Role};
use crate::inbox::admin::{self, InstanceSummary, ListFilter, StoredMessage};
use crate::source::Publisher;

/// The query of the instance list.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InstanceQuery {
    /// Only this sequence's instances.
    pub sequence: Option<String>,
    /// Only `OPEN` or only `CLOSED` ones.
    pub status: Option<String>,
    /// Only those holding WAITING or FAILED messages.
    pub stuck: bool,
    /// At most this many (1 to 1000, default 100).
    pub limit: Option<i64>,
}

/// What an instance action takes.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct InstanceAction {
    /// Release only this message (release).
    pub message: Option<i64>,
    /// Say what it would do, and do nothing.
    pub dry_run: bool,
}

fn unavailable(e: crate::Error) -> Refusal {
    (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}; try again"))
}

impl<DB: ConsoleStore, P: Publisher + 'static> Console<DB, P> {
    fn inbox_pool(&self) -> Result<&sqlx::PgPool, Refusal> {
        DB::sequential_inbox(&self.pool).ok_or_else(|| {
            let why = format!(
                "the Sequential Inbox runs on PostgreSQL; this console's database is {}",
                <DB as crate::store::Store>::NAME
            );
            (StatusCode::NOT_FOUND, why)
        })
    }

    async fn instances(&self, asked: &InstanceQuery) -> Result<Vec<InstanceSummary>, Refusal> {
        let limit = limit_of(asked.limit, 100, 1_000)?;
        let set = |v: &Option<String>| v.as_deref().map(str::trim).filter(|v| !v.is_empty()).map(str::to_owned);
        let status = set(&asked.status).map(|s| s.to_ascii_uppercase());
        if let Some(status) = status.as_deref().filter(|s| *s != "OPEN" && *s != "CLOSED") {
            return Err((StatusCode::BAD_REQUEST, format!("status: `{status}` is not a state; give OPEN or CLOSED")));
        }
        let filter = ListFilter { sequence: set(&asked.sequence), status, stuck: asked.stuck };
        admin::list(self.inbox_pool()?, &self.tables, &filter, limit).await.map_err(unavailable)
    }

    async fn instance(&self, id: i64) -> Result<(InstanceSummary, Vec<StoredMessage>), Refusal> {
        admin::show(self.inbox_pool()?, &self.tables, id)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| (StatusCode::NOT_FOUND, format!("no sequence instance has id {id}")))
    }

    /// Writes a refused action to the audit trail (unless a dry run) and hands the refusal on.
    async fn refused<T>(
        &self,
        user: &User,
        action: &str,
        subjects: String,
        dry_run: bool,
        done: Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        // A database that failed is no refusal: the action recorded its own failure, or could not be recorded.
        if let (Err((status, why)), false) = (&done, dry_run)
            && *status != StatusCode::SERVICE_UNAVAILABLE
        {
            self.audit(user, action, subjects, 0, &Err(why.clone())).await;
        }
        done
    }

    /// Closes instance `id` (or says what closing would leave), writing the audit entry (a refusal's too): whether
    /// it closed, how many WAITING messages it holds, and the entry.
    async fn close_instance(&self, user: &User, id: i64, dry_run: bool) -> Result<(bool, i64, Option<i64>), Refusal> {
        let done = self.try_close(user, id, dry_run).await;
        self.refused(user, "inbox close", format!("instance {id}"), dry_run, done).await
    }

    async fn try_close(&self, user: &User, id: i64, dry_run: bool) -> Result<(bool, i64, Option<i64>), Refusal> {
        let (summary, _) = self.instance(id).await?;
        if summary.status != "OPEN" {
            return Err((StatusCode::CONFLICT, format!("instance {id} is already closed: nothing to do")));
        }
        if dry_run {
            return Ok((false, summary.waiting, None));
        }
        let closed = admin::close(self.inbox_pool()?, &self.tables, id).await;
        let outcome = closed.as_ref().map(|_| ()).map_err(|e| e.to_string());
        let count = usize::from(closed.as_ref().is_ok_and(|c| *c));
        let entry = self.audit(user, "inbox close", format!("instance {id}"), count, &outcome).await;
        let closed = closed.map_err(unavailable)?;
        Ok((closed, summary.waiting, entry))
    }

    /// Releases instance `id`'s WAITING and FAILED messages (or only `message`), or says how many it would,
    /// writing the audit entry (a refusal's too): how many, and the entry.
    async fn release_instance(
        &self,
        user: &User,
        id: i64,
        message: Option<i64>,
        dry_run: bool,
    ) -> Result<(u64, Option<i64>), Refusal> {
        let done = self.try_release(user, id, message, dry_run).await;
        let subjects = match message {
            Some(m) => format!("instance {id}, message {m}"),
            None => format!("instance {id}"),
        };
        self.refused(user, "inbox release", subjects, dry_run, done).await
    }

    async fn try_release(
        &self,
        user: &User,
        id: i64,
        message: Option<i64>,
        dry_run: bool,
    ) -> Result<(u64, Option<i64>), Refusal> {
        let (_, messages) = self.instance(id).await?;
        if let Some(m) = message
            && !messages.iter().any(|s| s.id == m)
        {
            return Err((StatusCode::NOT_FOUND, format!("instance {id} has no message {m}")));
        }
        let held = |s: &&StoredMessage| {
            message.is_none_or(|m| s.id == m) && (s.status == "FAILED" || (s.status == "WAITING" && !s.force_release))
        };
        let would = messages.iter().filter(held).count() as u64;
        if would == 0 {
            let released = messages.iter().filter(|s| message.is_none_or(|m| s.id == m)).any(|s| s.force_release);
            let why = if released {
                format!(
                    "instance {id}'s held messages were released already: they wait for the consumer's next \
                     housekeeping pass (see the audit trail for who released them)"
                )
            } else {
                format!("instance {id} holds no WAITING or FAILED message to release")
            };
            return Err((StatusCode::CONFLICT, why));
        }
        if dry_run {
            return Ok((would, None));
        }
        let released = admin::release(self.inbox_pool()?, &self.tables, id, message).await;
        let subjects = match message {
            Some(m) => format!("instance {id}, message {m}"),
            None => format!("instance {id}"),
        };
        let outcome = released.as_ref().map(|_| ()).map_err(|e| e.to_string());
        let count = released.as_ref().map_or(0, |n| usize::try_from(*n).unwrap_or(usize::MAX));
        let entry = self.audit(user, "inbox release", subjects, count, &outcome).await;
        Ok((released.map_err(unavailable)?, entry))
    }
}

fn id_of(id: Result<Path<i64>, PathRejection>) -> Result<i64, Refusal> {
    id.map(|Path(id)| id).map_err(|_| (StatusCode::BAD_REQUEST, "id: an instance's id is an integer".to_owned()))
}

/// `GET /api/v1/inbox`.
pub async fn list_api<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    asked: Result<Query<InstanceQuery>, QueryRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let asked = match query(asked) {
        Ok(asked) => asked,
        Err((status, why)) => return error(status, &why),
    };
    match c.instances(&asked).await {
        Ok(items) => Json(serde_json::json!({ "items": items })).into_response(),
        Err((status, why)) => error(status, &why),
    }
}

/// `GET /api/v1/inbox/{id}`.
pub async fn show_api<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    id: Result<Path<i64>, PathRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let found = match id_of(id) {
        Ok(id) => c.instance(id).await,
        Err(refusal) => Err(refusal),
    };
    match found {
        Ok((instance, messages)) => {
            Json(serde_json::json!({ "instance": instance, "messages": messages })).into_response()
        }
        Err((status, why)) => error(status, &why),
    }
}

/// `POST /api/v1/inbox/{id}/close` and `POST /api/v1/inbox/{id}/release`.
pub async fn act_api<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Path((id, action)): Path<(String, String)>,
    body: Result<Json<InstanceAction>, JsonRejection>,
) -> Response {
    let user = match c.api_user(&headers, Role::Operator) {
        Ok(user) => user,
        Err((status, why)) => return error(status, &why),
    };
    let Ok(id) = id.parse::<i64>() else {
        return error(StatusCode::BAD_REQUEST, "id: an instance's id is an integer");
    };
    let body = match body {
        Ok(Json(body)) => body,
        Err(rejection) => return error(StatusCode::BAD_REQUEST, &format!("the body: {rejection}")),
    };
    let done = match action.as_str() {
        "close" if body.message.is_some() => {
            Err((StatusCode::BAD_REQUEST, "message: close takes a whole instance, not a message".to_owned()))
        }
        "close" => c.close_instance(&user, id, body.dry_run).await.map(|(closed, waiting, entry)| {
            serde_json::json!({ "dry_run": body.dry_run, "closed": closed, "waiting": waiting, "audit_id": entry })
        }),
        "release" => c.release_instance(&user, id, body.message, body.dry_run).await.map(|(n, entry)| {
            serde_json::json!({ "dry_run": body.dry_run, "released": n, "audit_id": entry })
        }),
        other => Err((StatusCode::NOT_FOUND, format!("`{other}` is not an instance action: close or release"))),
    };
    match done {
        Ok(answer) => Json(answer).into_response(),
        Err((status, why)) => error(status, &why),
    }
}

/// `GET /inbox`.
pub async fn list_page<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Query(asked): Query<InstanceQuery>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let instances = match c.instances(&asked).await {
        Ok(instances) => instances,
        Err((status, why)) => return failed(status, &why),
    };
    let value = |v: &Option<String>| esc(v.as_deref().unwrap_or_default());
    let mut body = format!(
        r#"<form method="get" action="/inbox" class="filters"><label>Sequence <input name="sequence" value="{}"></label>
<label>State <input name="status" value="{}" placeholder="OPEN" size="7"></label>
<label><input type="checkbox" name="stuck" value="true"{}> Stuck only</label><button>Filter</button></form>
<p class="count">{} instance(s)</p>"#,
        value(&asked.sequence),
        value(&asked.status),
        if asked.stuck { " checked" } else { "" },
        instances.len()
    );
    if !instances.is_empty() {
        body.push_str("<table id=\"instances\"><tr><th>Id</th><th>Sequence</th><th>Context</th><th>State</th><th>Processed</th><th>Waiting</th><th>Failed</th><th>Created</th></tr>");
        for i in &instances {
            let _ = write!(
                body,
                r#"<tr><td><a href="/inbox/{id}">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
                esc(&i.sequence_name),
                esc(&i.context_id),
                esc(&i.status),
                i.processed,
                i.waiting,
                i.failed,
                esc(&i.created_at),
                id = i.id,
            );
        }
        body.push_str("</table>");
    }
    c.layout("Sequential Inbox", &session, &body)
}

/// `GET /inbox/{id}`.
pub async fn show_page<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    id: Result<Path<i64>, PathRejection>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let (id, (summary, messages)) = match id_of(id) {
        Ok(id) => match c.instance(id).await {
            Ok(found) => (id, found),
            Err((status, why)) => return failed(status, &why),
        },
        Err((status, why)) => return failed(status, &why),
    };
    let mut body = format!(
        r#"<p id="instance">Instance {id} of <code>{}</code> for <code>{}</code>: {}, created {}, retained until {}.</p>"#,
        esc(&summary.sequence_name),
        esc(&summary.context_id),
        esc(&summary.status),
        esc(&summary.created_at),
        esc(&summary.retain_until)
    );
    let csrf = esc(&session.csrf);
    let operator = session.user.role >= Role::Operator;
    body.push_str("<table id=\"messages\"><tr><th>Id</th><th>State</th><th>Type</th><th>Idempotence id</th><th>Position</th><th>Arrived</th><th>Handled</th><th>Error</th><th></th></tr>");
    for m in &messages {
        let held = m.status == "FAILED" || (m.status == "WAITING" && !m.force_release);
        let action = if operator && held {
            format!(
                r#"<form method="post" action="/inbox/{id}/release"><input type="hidden" name="message" value="{}"><input type="hidden" name="csrf" value="{csrf}"><button>Release…</button></form>"#,
                m.id
            )
        } else if m.force_release && m.status == "WAITING" {
            "released: the consumer handles it at its next housekeeping pass".to_owned()
        } else {
            String::new()
        };
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{action}</td></tr>",
            m.id,
            esc(&m.status),
            esc(&m.message_type),
            esc(&m.idempotence_id),
            esc(&m.position),
            esc(&m.received_at),
            esc(m.processed_at.as_deref().unwrap_or("")),
            esc(m.error.as_deref().unwrap_or("")),
        );
    }
    body.push_str("</table>");
    if operator {
        let _ = write!(
            body,
            r#"<div class="actions"><form method="post" action="/inbox/{id}/release"><input type="hidden" name="csrf" value="{csrf}"><button id="release">Release every held message…</button></form>
<form method="post" action="/inbox/{id}/close"><input type="hidden" name="csrf" value="{csrf}"><button id="close">Close the instance…</button></form></div>"#
        );
    }
    c.layout(&format!("Instance {id}"), &session, &body)
}

/// `POST /inbox/{id}/{close|release}`: without `confirm`, what it would do and a form to confirm it; with it,
/// the action and a link to the audit trail.
pub async fn act_form<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Path((id, action)): Path<(i64, String)>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let session = match operator_form(&c, &headers, &form) {
        Ok(session) => session,
        Err((status, why)) => return failed(status, &why),
    };
    let message = match field(&form, "message").map(|m| m.trim().parse::<i64>()) {
        None => None,
        Some(Ok(m)) => Some(m),
        Some(Err(_)) => return failed(StatusCode::BAD_REQUEST, "message: a message's id is an integer"),
    };
    let confirmed = field(&form, "confirm") == Some("yes");
    let user = &session.user;
    let done = match action.as_str() {
        "close" => c.close_instance(user, id, !confirmed).await.map(|(closed, waiting, entry)| match confirmed {
            false if waiting > 0 => (format!("Closing instance {id} does not handle its <strong id=\"count\">{waiting}</strong> WAITING message(s): they stay, and are dead-lettered when it expires (release them instead to handle them)."), entry),
            false => (format!("This will close instance {id}: a message of its sequence that arrives later opens no new one."), entry),
            true if closed => (format!("Instance {id} closed."), entry),
            true => (format!("Instance {id} was closed meanwhile."), entry),
        }),
        "release" => c.release_instance(user, id, message, !confirmed).await.map(|(n, entry)| match confirmed {
            false => (format!("This will release <strong id=\"count\">{n}</strong> message(s) of instance {id} whatever their condition (a FAILED one is handled again): the running consumer handles them at its next housekeeping pass."), entry),
            true => (format!("Released {n} message(s) of instance {id}: the running consumer handles them at its next housekeeping pass."), entry),
        }),
        other => Err((StatusCode::NOT_FOUND, format!("`{other}` is not an instance action: close or release"))),
    };
    let (said, entry) = match done {
        Ok(done) => done,
        Err((status, why)) => {
            let body = format!(r#"<p class="error" id="refused">{}</p><p>Nothing was done.</p>"#, esc(&why));
            let mut page = c.layout("Not done", &session, &body);
            *page.status_mut() = status;
            return page;
        }
    };
    if confirmed {
        let body = format!(
            r#"<p id="done">{said}</p>{}<p><a href="/inbox/{id}">Back to the instance</a></p>"#,
            audit_link(entry)
        );
        return c.layout("Done", &session, &body);
    }
    let csrf = esc(&session.csrf);
    let hidden = message.map(|m| format!(r#"<input type="hidden" name="message" value="{m}">"#)).unwrap_or_default();
    let body = format!(
        r#"<p id="dry-run">{said}</p>
<form method="post" action="/inbox/{id}/{action}">{hidden}<input type="hidden" name="csrf" value="{csrf}"><input type="hidden" name="confirm" value="yes"><button id="confirm">Confirm: {action}</button></form>
<p><a href="/inbox/{id}" class="cancel">Cancel</a></p>"#
    );
    c.layout(&format!("{action} instance {id}?"), &session, &body)
}
