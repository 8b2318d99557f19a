//! The console's page: HTML rendered on the server, one stylesheet, no script. Signing in with a token opens a
//! session (cookie `idem_console`, `HttpOnly`, `SameSite=Strict`); every form carries the session's CSRF token.
//! An action first shows what it would do (how many letters, which, and for a replay the safety check's verdict
//! on each: the dry run), then acts on exactly the ids shown once confirmed, and links to the audit trail.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};

use super::api::{Acted, ActionRequest, Listing, Page};
use super::auth::{Session, csrf_ok};
use super::{Console, ConsoleStore, Role, refuse};
use crate::dead_letter::selection::FilterSpec;
use crate::source::Publisher;
use crate::store::{DeadLetter, rfc3339_from_ms};

const COOKIE: &str = "idem_console";

/// Text made safe for HTML, in an element or an attribute.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A query-string value.
pub(crate) fn q(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// `GET /static/console.css`.
pub async fn stylesheet() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], include_str!("console.css")).into_response()
}

impl<DB: ConsoleStore, P: Publisher + 'static> Console<DB, P> {
    /// The session of the request's cookie, its user's role as the users are now: a session of a user removed
    /// from the users file ends.
    fn session(&self, headers: &HeaderMap) -> Option<(String, Session)> {
        let cookies = headers.get_all(header::COOKIE);
        for value in cookies.iter().filter_map(|v| v.to_str().ok()) {
            for pair in value.split(';') {
                if let Some(id) = pair.trim().strip_prefix(&format!("{COOKIE}="))
                    && let Some(mut session) = self.sessions.get(id)
                {
                    let Some(role) = self.config.users.role_of(&session.user.name) else {
                        tracing::info!(user = %session.user.name, "console: a session of a user no longer in the users ended");
                        self.sessions.close(id);
                        return None;
                    };
                    session.user.role = role;
                    return Some((id.to_owned(), session));
                }
            }
        }
        None
    }

    /// The page around `body`: the navigation, who is signed in, and the sign-out form.
    pub(crate) fn layout(&self, title: &str, session: &Session, body: &str) -> Response {
        let user = &session.user;
        let html = format!(
            r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title} · idem console</title>
<link rel="stylesheet" href="/static/console.css"></head>
<body><header><strong>idem</strong>
<nav><a href="/">Failure groups</a> <a href="/dead-letters">Dead letters</a> <a href="/parked">Parked</a> <a href="/outbox">Outbox</a> <a href="/inbox">Inbox</a> <a href="/markers">Markers</a> <a href="/consumers">Consumers</a> <a href="/audit">Audit trail</a></nav>
<form method="post" action="/logout" class="who"><span id="user">{name} ({role})</span>
<input type="hidden" name="csrf" value="{csrf}"><button>Sign out</button></form></header>
<main><h1>{title}</h1>
{body}</main></body></html>"#,
            title = esc(title),
            name = esc(&user.name),
            role = user.role.as_str(),
            csrf = esc(&session.csrf),
        );
        Html(html).into_response()
    }
}

/// The session of a page's request; without one, the page sends the browser to sign in ([`to_sign_in`]).
pub(crate) fn signed_in<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    headers: &HeaderMap,
) -> Option<Session> {
    c.session(headers).map(|(_, s)| s)
}

pub(crate) fn to_sign_in() -> Response {
    Redirect::to("/login").into_response()
}

pub(crate) fn failed(status: StatusCode, why: &str) -> Response {
    refuse(status, why)
}

/// The session of an operator's form: from this console's own pages (same origin), signed in, with the session's
/// CSRF token, by an operator; else the status and why.
pub(crate) fn operator_form<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    headers: &HeaderMap,
    form: &[(String, String)],
) -> Result<Session, super::api::Refusal> {
    same_origin(headers, c.config.behind_proxy).map_err(|why| (StatusCode::FORBIDDEN, why))?;
    let (_, session) = c.session(headers).ok_or((StatusCode::UNAUTHORIZED, "sign in first: /login".to_owned()))?;
    if !csrf_ok(&session, field(form, "csrf").unwrap_or_default()) {
        let why = "this form has no valid CSRF token: reload the page and try again";
        return Err((StatusCode::FORBIDDEN, why.to_owned()));
    }
    if session.user.role < Role::Operator {
        let why = format!("{} is a viewer: acting needs the operator role", session.user.name);
        return Err((StatusCode::FORBIDDEN, why));
    }
    Ok(session)
}

/// `GET /login`.
pub async fn login_form() -> Response {
    login_page("")
}

fn login_page(message: &str) -> Response {
    let message = if message.is_empty() { String::new() } else { format!(r#"<p class="error">{}</p>"#, esc(message)) };
    Html(format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sign in · idem console</title>
<link rel="stylesheet" href="/static/console.css"></head>
<body><main class="login"><h1>idem console</h1>{message}
<form method="post" action="/login"><label>Token <input type="password" name="token" id="token" autocomplete="current-password" required></label>
<button id="sign-in">Sign in</button></form></main></body></html>"#
    ))
    .into_response()
}

/// `POST /login`: a token of the console's users opens a session.
pub async fn login<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    if let Err(why) = same_origin(&headers, c.config.behind_proxy) {
        return failed(StatusCode::FORBIDDEN, &why);
    }
    let token = field(&form, "token").unwrap_or_default();
    let Some(user) = c.config.users.authenticate(token) else {
        tracing::warn!("console: a sign-in with a token that is not one of the users'");
        let mut page = login_page("That token is not one of the console's users.");
        *page.status_mut() = StatusCode::UNAUTHORIZED;
        return page;
    };
    tracing::info!(user = %user.name, role = user.role.as_str(), "console: signed in");
    let id = c.sessions.open(user);
    let mut response = Redirect::to("/").into_response();
    let https = c.config.behind_proxy && first_value(&headers, "x-forwarded-proto") == Some("https");
    let secure = if https { "; Secure" } else { "" };
    let cookie = format!("{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/{secure}");
    if let Ok(value) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// `POST /logout`.
pub async fn logout<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    if let Some((id, session)) = c.session(&headers)
        && csrf_ok(&session, field(&form, "csrf").unwrap_or_default())
    {
        c.sessions.close(&id);
    }
    let mut response = Redirect::to("/login").into_response();
    let expired = format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0");
    if let Ok(value) = HeaderValue::from_str(&expired) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// A browser's form from another site is refused: its `Origin` (when sent) must be this console's host.
/// The first value of header `name`, trimmed.
fn first_value<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.split(',').next()).map(str::trim)
}

/// Whether a form comes from the console's own pages: its `Origin` (else its `Referer`) names the console's host.
/// A form with neither is refused: every browser sends one with a form.
fn same_origin(headers: &HeaderMap, behind_proxy: bool) -> Result<(), String> {
    let origin = headers
        .get(header::ORIGIN)
        .or_else(|| headers.get(header::REFERER))
        .and_then(|v| v.to_str().ok())
        .map(|o| o.split_once("://").map_or(o, |(_, rest)| rest).split('/').next().unwrap_or_default().to_owned());
    let Some(origin_host) = origin else {
        return Err("a form without an Origin header is refused: post it from the console's own page".to_owned());
    };
    let origin = origin_host.as_str();
    let forwarded = behind_proxy.then(|| first_value(headers, "x-forwarded-host")).flatten();
    let host = forwarded.or_else(|| first_value(headers, "host")).unwrap_or_default();
    if origin == host {
        Ok(())
    } else {
        Err(format!("a form from {origin} is refused: the console only takes its own"))
    }
}

pub(crate) fn field<'a>(form: &'a [(String, String)], name: &str) -> Option<&'a str> {
    form.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// A form's filters (hidden fields) for an action on what the page shows.
fn filter_fields(spec: &FilterSpec) -> String {
    let mut out = String::new();
    for (name, value) in [
        ("group", &spec.group),
        ("matching", &spec.matching),
        ("fingerprint", &spec.fingerprint),
        ("older_than", &spec.older_than),
        ("message_type", &spec.message_type),
    ] {
        if let Some(value) = value {
            let _ = write!(out, r#"<input type="hidden" name="{name}" value="{}">"#, esc(value));
        }
    }
    out
}

fn filter_query(spec: &FilterSpec) -> String {
    [
        ("group", &spec.group),
        ("matching", &spec.matching),
        ("fingerprint", &spec.fingerprint),
        ("older_than", &spec.older_than),
        ("message_type", &spec.message_type),
    ]
    .into_iter()
    .filter_map(|(name, value)| value.as_ref().map(|v| format!("{name}={}", q(v))))
    .collect::<Vec<_>>()
    .join("&")
}

/// The filter form above a list.
fn filter_form(action: &str, spec: &FilterSpec) -> String {
    let value = |v: &Option<String>| esc(v.as_deref().unwrap_or_default());
    format!(
        r#"<form method="get" action="{action}" class="filters">
<label>Group <input name="group" value="{}"></label>
<label>Reason contains <input name="matching" value="{}"></label>
<label>Failure group <input name="fingerprint" value="{}" size="12"></label>
<label>Older than <input name="older_than" value="{}" size="6"></label>
<label>Message type <input name="message_type" value="{}" placeholder="header:NAME"></label>
<button>Filter</button></form>"#,
        value(&spec.group),
        value(&spec.matching),
        value(&spec.fingerprint),
        value(&spec.older_than),
        value(&spec.message_type),
    )
}

/// `GET /`: the failure groups.
pub async fn groups<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Query(spec): Query<FilterSpec>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let filter = match c.filter(spec.clone()) {
        Ok(filter) => filter,
        Err((status, why)) => return failed(status, &why),
    };
    let groups = match filter.groups(&c.pool, &c.tables).await {
        Ok(groups) => groups,
        Err(e) => return failed(StatusCode::SERVICE_UNAVAILABLE, &format!("the database did not answer: {e}")),
    };
    let mut body = filter_form("/", &spec);
    let total: usize = groups.iter().map(|g| g.count).sum();
    let _ = if groups.len() as i64 >= crate::dead_letter::selection::MAX_GROUPS {
        write!(
            body,
            r#"<p class="count">the {} largest failure groups, {total} dead letter(s) in them</p>"#,
            groups.len()
        )
    } else {
        write!(body, r#"<p class="count">{} failure group(s), {total} dead letter(s)</p>"#, groups.len())
    };
    if !groups.is_empty() {
        body.push_str(
            "<table id=\"groups\"><tr><th>Failure group</th><th>Consumer group</th><th>Type</th><th>Count</th>\
             <th>First</th><th>Last</th><th>Pattern</th></tr>",
        );
        let typing = spec.message_type.as_ref().map(|t| format!("&message_type={}", q(t))).unwrap_or_default();
        for g in &groups {
            let _ = write!(
                body,
                r#"<tr><td><a class="group" href="/dead-letters?fingerprint={f}{typing}">{f}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
                esc(&g.consumer_group),
                esc(g.message_type.as_deref().unwrap_or("-")),
                g.count,
                rfc3339_from_ms(g.first_failed_at_ms),
                rfc3339_from_ms(g.last_failed_at_ms),
                esc(&g.pattern),
                f = esc(&g.fingerprint),
            );
        }
        body.push_str("</table>");
    }
    c.layout("Failure groups", &session, &body)
}

fn letters_table(letters: &[DeadLetter]) -> String {
    let mut body = String::from(
        "<table id=\"letters\"><tr><th>Id</th><th>Consumer group</th><th>Event id</th><th>Position</th>\
         <th>Attempts</th><th>Last failed</th><th>Reason</th></tr>",
    );
    for l in letters {
        let _ = write!(
            body,
            r#"<tr><td><a href="/dead-letters/{id}">{id}</a></td><td>{}</td><td>{}</td><td>{}/{}@{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            esc(&l.consumer_group),
            esc(l.event_id.as_deref().unwrap_or("(no key)")),
            esc(&l.topic),
            l.partition,
            l.offset,
            l.attempts,
            rfc3339_from_ms(l.last_failed_at_ms),
            esc(&l.error),
            id = l.id,
        );
    }
    body.push_str("</table>");
    body
}

/// The operator's forms for every letter a selection takes: replay, discard with a reason.
fn action_forms(session: &Session, hidden: &str, count: &str) -> String {
    if session.user.role < Role::Operator {
        return r#"<p class="note">You are a viewer: an operator replays and discards.</p>"#.to_owned();
    }
    let csrf = esc(&session.csrf);
    format!(
        r#"<div class="actions">
<form method="post" action="/actions/replay">{hidden}<input type="hidden" name="csrf" value="{csrf}"><button id="replay">Replay {count}…</button></form>
<form method="post" action="/actions/discard">{hidden}<input type="hidden" name="csrf" value="{csrf}"><label>Reason <input name="reason" required></label> <button id="discard">Discard {count}…</button></form>
</div>"#
    )
}

/// `GET /dead-letters`: a page of dead letters and the actions on all that the filters take.
pub async fn dead_letters<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Query(page): Query<Page>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let (spec, limit) = (page.filter.clone(), page.limit);
    let super::api::Listed { letters, total, at_least, next } = match super::api::page_of(&c, page).await {
        Ok(page) => page,
        Err((status, why)) => return failed(status, &why),
    };
    let mut body = filter_form("/dead-letters", &spec);
    let more = if at_least { " or more" } else { "" };
    let _ = write!(body, r#"<p class="count"><span id="total">{total}</span>{more} dead letter(s)</p>"#);
    if total > 0 {
        let narrowed = spec.matching.is_some() || spec.fingerprint.is_some() || spec.older_than.is_some();
        let all = if narrowed { "" } else { r#"<input type="hidden" name="all" value="true">"# };
        let count = if at_least { format!("{total}+") } else { total.to_string() };
        body.push_str(&action_forms(&session, &format!("{}{all}", filter_fields(&spec)), &count));
        body.push_str(&letters_table(&letters));
    }
    if let Some(after) = next {
        let mut query: Vec<String> = vec![filter_query(&spec), format!("after={after}")];
        query.extend(limit.map(|n| format!("limit={n}")));
        let query = query.into_iter().filter(|part| !part.is_empty()).collect::<Vec<_>>().join("&");
        let _ = write!(body, r#"<p><a id="next" href="/dead-letters?{query}">Next page</a></p>"#);
    }
    c.layout("Dead letters", &session, &body)
}

/// `GET /dead-letters/{id}`: one letter whole.
pub async fn dead_letter<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let letter = match super::api::find(&c, id).await {
        Ok(Some(letter)) => letter,
        Ok(None) => {
            return failed(
                StatusCode::NOT_FOUND,
                &format!("no dead letter has id {id} (replayed or discarded since?)"),
            );
        }
        Err(e) => return failed(StatusCode::SERVICE_UNAVAILABLE, &format!("the database did not answer: {e}")),
    };
    let fingerprint = crate::dead_letter::groups::fingerprint_of(&letter, c.typing.as_ref());
    let mut body = format!(
        r#"<dl><dt>Consumer group</dt><dd>{}</dd><dt>Event id</dt><dd>{}</dd><dt>Position</dt><dd>{}/{}@{}</dd>
<dt>Failure group</dt><dd><a href="/dead-letters?fingerprint={fingerprint}">{fingerprint}</a></dd>
<dt>Attempts</dt><dd>{}</dd><dt>First failed</dt><dd>{}</dd><dt>Last failed</dt><dd>{}</dd><dt>Status</dt><dd>{}</dd></dl>
<h2>Reason and history</h2><pre id="reason">{}</pre><h2>Headers</h2><table>"#,
        esc(&letter.consumer_group),
        esc(letter.event_id.as_deref().unwrap_or("(no key)")),
        esc(&letter.topic),
        letter.partition,
        letter.offset,
        letter.attempts,
        rfc3339_from_ms(letter.first_failed_at_ms),
        rfc3339_from_ms(letter.last_failed_at_ms),
        esc(&letter.status),
        esc(&letter.error),
    );
    for (name, value) in &letter.headers {
        let _ = write!(body, "<tr><th>{}</th><td>{}</td></tr>", esc(name), esc(&String::from_utf8_lossy(value)));
    }
    body.push_str("</table><h2>Payload</h2>");
    if c.config.show_payloads {
        let pretty = serde_json::from_slice::<serde_json::Value>(&letter.payload)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| String::from_utf8_lossy(&letter.payload).into_owned());
        let _ = write!(body, r#"<pre id="payload">{}</pre>"#, esc(&pretty));
    } else {
        body.push_str(
            r#"<p class="note" id="payload">Hidden: payloads may hold personal data (start the console with --show-payloads to see them).</p>"#,
        );
    }
    let hidden = format!(r#"<input type="hidden" name="ids" value="{id}">"#);
    body.push_str(&action_forms(&session, &hidden, "1"));
    if c.config.show_payloads && session.user.role >= Role::Operator {
        let pretty = serde_json::from_slice::<serde_json::Value>(&letter.payload)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| String::from_utf8_lossy(&letter.payload).into_owned());
        body.push_str(&edit_form(&session, id, &pretty, "dry", "Dry run the edit"));
    }
    c.layout(&format!("Dead letter {id}"), &session, &body)
}

/// `POST /actions/{replay|discard}`: without `confirm`, what would happen (the dry run) and a form to confirm it
/// on exactly those ids; with it, the action, then the result and a link to the audit trail.
pub async fn act<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Path(action): Path<String>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let session = match operator_form(&c, &headers, &form) {
        Ok(session) => session,
        Err((status, why)) => return failed(status, &why),
    };
    let mut ids = Vec::new();
    for (name, value) in form.iter().filter(|(k, _)| k == "ids") {
        match value.trim().parse::<i64>() {
            Ok(id) => ids.push(id),
            Err(_) => return failed(StatusCode::BAD_REQUEST, &format!("{name}: `{value}` is not a dead-letter id")),
        }
    }
    let text = |name: &str| field(&form, name).map(str::to_owned).filter(|v| !v.trim().is_empty());
    let confirmed = field(&form, "confirm") == Some("yes");
    let request = ActionRequest {
        ids,
        all: field(&form, "all") == Some("true"),
        filter: FilterSpec {
            group: text("group"),
            matching: text("matching"),
            fingerprint: text("fingerprint"),
            older_than: text("older_than"),
            message_type: text("message_type"),
        },
        force: field(&form, "force") == Some("true"),
        dry_run: !confirmed,
        reason: text("reason"),
    };
    match c.act(&session.user, &action, &request).await {
        Ok((acted, _)) if !confirmed => confirm_page(&c, &session, &action, &request, &acted),
        Ok((acted, entry)) => result_page(&c, &session, &action, &acted, entry),
        Err((status, why)) => {
            let body = format!(r#"<p class="error" id="refused">{}</p><p>Nothing was done.</p>"#, esc(&why));
            let mut page = c.layout("Not done", &session, &body);
            *page.status_mut() = status;
            page
        }
    }
}

fn confirm_page<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    session: &Session,
    action: &str,
    request: &ActionRequest,
    acted: &Acted,
) -> Response {
    let csrf = esc(&session.csrf);
    let (ids, explain) = match acted {
        Acted::Replayed(tally) => {
            let mut explain = String::new();
            for (id, _, why) in &tally.refused {
                let _ = write!(explain, r#"<li class="refused">{id}: {}</li>"#, esc(why));
            }
            if !explain.is_empty() {
                explain = format!(
                    r#"<p>These would be refused (a replay could apply their effect twice):</p><ul>{explain}</ul>"#
                );
            }
            if !tally.released.is_empty() {
                let _ = write!(
                    explain,
                    r#"<p id="released">HTTP requests {} are not published: their keys are released, and their senders' next retries are applied as new.</p>"#,
                    crate::dead_letter::selection::join(&tally.released)
                );
            }
            (tally.replayed.iter().chain(&tally.released).copied().collect(), explain)
        }
        Acted::Discarded { ids, .. } => (ids.clone(), String::new()),
    };
    let listed = crate::dead_letter::selection::join(&ids);
    let mut hidden: String = ids.iter().map(|id| format!(r#"<input type="hidden" name="ids" value="{id}">"#)).collect();
    if let Some(reason) = &request.reason {
        let _ = write!(hidden, r#"<input type="hidden" name="reason" value="{}">"#, esc(reason));
    }
    if request.force {
        hidden.push_str(r#"<input type="hidden" name="force" value="true">"#);
    }
    if let Some(typing) = &request.filter.message_type {
        let _ = write!(hidden, r#"<input type="hidden" name="message_type" value="{}">"#, esc(typing));
    }
    let what = if action == "replay" { "publish again" } else { "move to the archive" };
    let body = if ids.is_empty() {
        format!(r#"{explain}<p id="dry-run">Nothing to {action}.</p>"#)
    } else {
        format!(
            r#"<p id="dry-run">This will {what} <strong id="count">{n}</strong> dead letter(s): {listed}.</p>{explain}
<form method="post" action="/actions/{action}">{hidden}<input type="hidden" name="csrf" value="{csrf}"><input type="hidden" name="confirm" value="yes"><button id="confirm">Confirm: {action} {n}</button></form>
<p><a href="/dead-letters" class="cancel">Cancel</a></p>"#,
            n = ids.len(),
        )
    };
    c.layout(&format!("{} {} dead letter(s)?", capitalized(action), ids.len()), session, &body)
}

fn result_page<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    session: &Session,
    action: &str,
    acted: &Acted,
    entry: Option<i64>,
) -> Response {
    let mut body = String::new();
    match acted {
        Acted::Replayed(tally) => {
            let _ = write!(
                body,
                r#"<p id="done">Replayed {}: {}.</p>"#,
                tally.replayed.len(),
                crate::dead_letter::selection::join(&tally.replayed)
            );
            if !tally.released.is_empty() {
                let _ = write!(
                    body,
                    r#"<p id="released">Released the keys of HTTP requests {}: their senders' next retries are applied.</p>"#,
                    crate::dead_letter::selection::join(&tally.released)
                );
            }
            for (id, _, why) in &tally.refused {
                let _ = write!(body, r#"<p class="refused">Refused {id}: {}</p>"#, esc(why));
            }
            for (id, since) in &tally.busy {
                let _ = write!(
                    body,
                    r#"<p class="refused">Not replayed {id}: another operator's replay of it began at {}.</p>"#,
                    rfc3339_from_ms(*since)
                );
            }
            if !tally.gone.is_empty() {
                let _ = write!(body, "<p>Gone meanwhile: {}.</p>", crate::dead_letter::selection::join(&tally.gone));
            }
            if let Some(error) = &tally.stopped_by {
                let _ = write!(body, r#"<p class="error">Stopped: {}</p>"#, esc(error));
            }
        }
        Acted::Discarded { ids, left } => {
            let _ = write!(
                body,
                r#"<p id="done">Discarded {} into the archive: {}.</p>"#,
                ids.len(),
                crate::dead_letter::selection::join(ids)
            );
            if !left.is_empty() {
                let _ = write!(
                    body,
                    "<p>Left (under replay or gone meanwhile): {}.</p>",
                    crate::dead_letter::selection::join(left)
                );
            }
        }
    }
    body.push_str(&audit_link(entry));
    c.layout(&format!("{} done", capitalized(action)), session, &body)
}

fn capitalized(word: &str) -> String {
    let mut chars = word.chars();
    chars.next().map(|c| c.to_uppercase().chain(chars).collect()).unwrap_or_default()
}

/// `GET /parked`.
pub async fn parked<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Query(listing): Query<Listing>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let limit = match super::api::limit_of(listing.limit, 100, 1_000) {
        Ok(limit) => limit,
        Err((status, why)) => return failed(status, &why),
    };
    let parked = match crate::delayed_retry::list(&c.pool, &c.tables, listing.group.as_deref(), limit).await {
        Ok(parked) => parked,
        Err(e) => return failed(StatusCode::SERVICE_UNAVAILABLE, &format!("the database did not answer: {e}")),
    };
    let mut body = format!(r#"<p class="count">{} parked message(s)</p>"#, parked.len());
    if !parked.is_empty() {
        body.push_str("<table id=\"parked\"><tr><th>Id</th><th>Consumer group</th><th>Event id</th><th>Position</th><th>Attempts</th><th>Last error</th></tr>");
        for p in &parked {
            let _ = write!(
                body,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}</td><td>{}</td></tr>",
                p.id,
                esc(&p.consumer_group),
                esc(&p.event_id),
                esc(&p.topic),
                p.partition,
                p.attempts,
                esc(p.error.as_deref().unwrap_or("waiting behind its key")),
            );
        }
        body.push_str("</table>");
    }
    c.layout("Parked messages", &session, &body)
}

/// `GET /audit`: the audit trail, newest first, a page at a time, by actor and action.
pub async fn audit<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Query(page): Query<super::api::AuditPage>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let (entries, next) = match super::api::audit_page(&c, &page).await {
        Ok(found) => found,
        Err((status, why)) => return failed(status, &why),
    };
    let value = |v: &Option<String>| esc(v.as_deref().unwrap_or_default());
    let mut body = format!(
        r#"<form method="get" action="/audit" class="filters">
<label>Who <input name="actor" value="{}"></label>
<label>Action <input name="action" value="{}" placeholder="dead-letters replay"></label>
<button>Filter</button></form>
<table id="audit"><tr><th>Id</th><th>At</th><th>Who</th><th>Action</th><th>Count</th><th>Outcome</th><th>Subjects</th></tr>"#,
        value(&page.actor),
        value(&page.action),
    );
    for e in &entries {
        let _ = write!(
            body,
            r#"<tr id="audit-{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            e.id,
            e.id,
            rfc3339_from_ms(e.at_ms),
            esc(&e.actor),
            esc(&e.action),
            e.count,
            esc(&e.outcome),
            esc(&e.subjects),
        );
    }
    body.push_str("</table>");
    if let Some(before) = next {
        let mut query = format!("before={before}");
        for (name, v) in [("actor", &page.actor), ("action", &page.action)] {
            if let Some(v) = v.as_deref().filter(|v| !v.trim().is_empty()) {
                let _ = write!(query, "&{name}={}", q(v));
            }
        }
        if let Some(limit) = page.limit {
            let _ = write!(query, "&limit={limit}");
        }
        let _ = write!(body, r#"<p><a id="older" href="/audit?{}">Older entries</a></p>"#, esc(&query));
    }
    c.layout("Audit trail", &session, &body)
}

/// `GET /consumers`: this process's consumers, and the kill switch's resume for a paused one.
pub async fn consumers<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let consumers = &c.config.consumers.0;
    if consumers.is_empty() {
        let body = r#"<p class="note" id="alone">This console runs alone (<code>idem console</code>): its consumers run in other processes, each with its own operations endpoint (<code>/readyz</code>, <code>POST /resume</code>). Give <code>idem run</code> a <code>[console]</code> section to see them here.</p>"#;
        return c.layout("Consumers", &session, body);
    }
    let mut body = String::from(
        "<table id=\"consumers\"><tr><th>Consumer group</th><th>State</th><th>Partitions</th><th>Lag</th><th>Stalled</th><th>Processed</th><th>Duplicates</th><th>Dead-lettered</th><th>Parked</th><th></th></tr>",
    );
    let csrf = esc(&session.csrf);
    for consumer in consumers {
        let (health, stats, group) = (consumer.health(), consumer.stats(), consumer.group());
        let state = match (health.running, health.draining, health.paused) {
            (_, _, true) => "paused: the kill switch tripped",
            (true, true, _) => "draining",
            (true, false, _) => "consuming",
            (false, _, _) => "stopped",
        };
        let stalled: Vec<String> = health
            .stalled
            .iter()
            .map(|s| format!("{}/{} ({} s, {} waiting)", esc(&s.topic), s.partition, s.seconds, s.waiting))
            .collect();
        let lag = consumer.lag();
        let lag = if lag.is_empty() {
            "-".to_owned()
        } else {
            let parts: Vec<String> = lag
                .iter()
                .map(|l| match l.partition {
                    Some(p) => format!("{}/{p}: {}", esc(&l.topic), l.messages),
                    None => format!("{}: {}", esc(&l.topic), l.messages),
                })
                .collect();
            format!("{} ({})", lag.iter().map(|l| l.messages).sum::<i64>(), parts.join(", "))
        };
        let resume = if health.paused && session.user.role >= Role::Operator {
            format!(
                r#"<form method="post" action="/consumers/{g}/resume"><input type="hidden" name="csrf" value="{csrf}"><button class="resume">Resume</button></form>"#,
                g = q(&group)
            )
        } else {
            String::new()
        };
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{state}</td><td>{}</td><td>{lag}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{resume}</td></tr>",
            esc(&group),
            health.partitions,
            if stalled.is_empty() { "-".to_owned() } else { stalled.join(", ") },
            stats.processed,
            stats.duplicate,
            stats.dead_lettered,
            stats.parked,
        );
    }
    body.push_str("</table>");
    c.layout("Consumers", &session, &body)
}

/// `POST /consumers/{group}/resume`.
pub async fn resume<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Path(group): Path<String>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let session = match operator_form(&c, &headers, &form) {
        Ok(session) => session,
        Err((status, why)) => return failed(status, &why),
    };
    let body = match c.resume(&session.user, &group) {
        Ok(true) => format!(
            r#"<p id="done">{} resumed: it tries the message that tripped the kill switch again.</p>"#,
            esc(&group)
        ),
        Ok(false) => format!(r#"<p id="done">{} was not paused.</p>"#, esc(&group)),
        Err((status, why)) => {
            let mut page =
                c.layout("Not done", &session, &format!(r#"<p class="error" id="refused">{}</p>"#, esc(&why)));
            *page.status_mut() = status;
            return page;
        }
    };
    c.layout(
        "Resume",
        &session,
        &format!(r#"{body}<p><a href="/consumers">Consumers</a> · <a href="/audit">Audit trail</a></p>"#),
    )
}

/// The form that edits a letter's payload: a dry run first, then the retry.
fn edit_form(session: &Session, id: i64, payload: &str, step: &str, button: &str) -> String {
    format!(
        r#"<h2>Edit and retry</h2><p class="note">The dry run runs the consumer's handler on the edited message in a transaction that is rolled back; the retry then publishes exactly what was tried, and keeps the original in the archive.</p><form method="post" action="/dead-letters/{id}/edit" class="edit">
<input type="hidden" name="csrf" value="{csrf}"><input type="hidden" name="step" value="{step}">
<textarea name="payload" id="edited" rows="12" cols="80">{payload}</textarea>
<p><button id="{step}-edit">{button}</button></p></form>"#,
        csrf = esc(&session.csrf),
        payload = esc(payload),
    )
}

/// `POST /dead-letters/{id}/edit`: `step=dry` runs the consumer's handler on the edited payload and rolls back,
/// then offers the retry; `step=retry` replays the edited copy (the original kept in the archive).
pub async fn edit<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Path(id): Path<i64>,
    Form(form): Form<Vec<(String, String)>>,
) -> Response {
    let session = match operator_form(&c, &headers, &form) {
        Ok(session) => session,
        Err((status, why)) => return failed(status, &why),
    };
    let payload = field(&form, "payload").unwrap_or_default().replace("\r\n", "\n");
    let dry = field(&form, "step") != Some("retry");
    let request = super::api::EditRequest { payload: Some(payload.clone()), dry_run: dry, force: false };
    match c.edit(&session.user, id, &request).await {
        Ok(super::api::Edited::Tried(report)) => {
            let mut body = String::new();
            if report.ok {
                body.push_str(r#"<p id="trial" class="ok">The handler succeeds on the edited message (rolled back: nothing was written).</p>"#);
            } else {
                let _ = write!(
                    body,
                    r#"<p id="trial" class="error">The handler fails on the edited message: {}</p>"#,
                    esc(report.error.as_deref().unwrap_or("unknown error"))
                );
            }
            if !report.statements.is_empty() {
                body.push_str("<table id=\"statements\"><tr><th>Statement</th><th>Rows</th></tr>");
                for s in &report.statements {
                    let _ = write!(body, "<tr><td>{}</td><td>{}</td></tr>", esc(&s.statement), s.rows);
                }
                body.push_str("</table>");
            }
            if report.ok {
                // Exactly the payload that was tried, not an editable copy of it.
                let _ = write!(
                    body,
                    r#"<form method="post" action="/dead-letters/{id}/edit"><input type="hidden" name="csrf" value="{}"><input type="hidden" name="step" value="retry"><input type="hidden" name="payload" value="{}"><p><button id="retry-edit">Retry with this payload</button></p></form>"#,
                    esc(&session.csrf),
                    esc(&payload)
                );
            }
            body.push_str(&edit_form(&session, id, &payload, "dry", "Dry run again"));
            c.layout(&format!("Dry run of dead letter {id}, edited"), &session, &body)
        }
        Ok(super::api::Edited::Replayed(entry)) => {
            let link = entry.map_or_else(
                || {
                    r#"<p class="error">The audit trail could not record this action (see the console's log).</p>"#
                        .to_owned()
                },
                |n| format!(r##"<p><a id="audit-link" href="/audit#audit-{n}">The audit trail's entry ({n})</a></p>"##),
            );
            let body = format!(
                r#"<p id="done">Replayed dead letter {id} with the edited payload; the original is in the archive.</p>{link}"#
            );
            c.layout("Edit and retry done", &session, &body)
        }
        Err((status, why)) => {
            let body = format!(r#"<p class="error" id="refused">{}</p><p>Nothing was done.</p>"#, esc(&why));
            let mut page = c.layout("Not done", &session, &body);
            *page.status_mut() = status;
            page
        }
    }
}

/// The link to an action's audit entry, or why there is none.
pub(crate) fn audit_link(entry: Option<i64>) -> String {
    match entry {
        Some(id) => format!(
            r##"<p><a id="audit-link" href="/audit?before={}#audit-{id}">The audit trail's entry ({id})</a></p>"##,
            id + 1
        ),
        None => {
            r#"<p class="error">The audit trail could not record this action (see the console's log).</p>"#.to_owned()
        }
    }
}
