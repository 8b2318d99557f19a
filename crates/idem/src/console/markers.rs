//! The markers view: each consumer group's markers (how many, the oldest one's age) and dead letters, and a prune
//! dry run: how many markers `idem prune --retention R` would delete now. The same figures as `idem stats` and
//! `idem prune --dry-run`.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::api::{Refusal, error, query};
use super::page::{esc, failed, signed_in, to_sign_in};
use super::{Console, ConsoleStore, Role};
use crate::source::Publisher;
use crate::store::GroupStats;

/// The retention of the prune dry run when none is asked for.
pub const DEFAULT_RETENTION: &str = "7d";

/// The query of the markers view.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MarkersQuery {
    /// The retention of the prune dry run (`7d`, `36h`; default 7d).
    pub retention: Option<String>,
}

/// The markers view's figures.
#[derive(Debug, serde::Serialize)]
pub struct Markers {
    /// Per consumer group.
    pub groups: Vec<GroupStats>,
    /// The prune dry run.
    pub prune: PruneDryRun,
}

/// What a prune would delete.
#[derive(Debug, serde::Serialize)]
pub struct PruneDryRun {
    /// The retention asked for, as written.
    pub retention: String,
    /// The markers older than it: what `idem prune --retention` would delete now.
    pub would_delete: i64,
    /// The command that prunes them.
    pub command: String,
    /// Why that retention is dangerous, when it is (below an hour: `idem prune` needs `--force`).
    pub warning: Option<String>,
}

async fn figures<DB: ConsoleStore, P: Publisher + 'static>(
    c: &Console<DB, P>,
    asked: &MarkersQuery,
) -> Result<Markers, Refusal> {
    let retention = asked.retention.as_deref().map(str::trim).filter(|r| !r.is_empty()).unwrap_or(DEFAULT_RETENTION);
    let age = crate::duration::parse(retention).map_err(|e| {
        let why = match e {
            crate::Error::Config(why) => why,
            other => other.to_string(),
        };
        (StatusCode::BAD_REQUEST, format!("retention: {why}"))
    })?;
    let unavailable =
        |e: crate::Error| (StatusCode::SERVICE_UNAVAILABLE, format!("the database did not answer: {e}; try again"));
    let groups = crate::store::stats(&c.pool, &c.tables, None).await.map_err(unavailable)?;
    let would_delete = DB::count_expired(&c.pool, &c.tables, None, age).await.map_err(unavailable)?;
    let short = age < crate::prune::RETENTION_FLOOR;
    let command = format!("idem prune --retention {retention}{}", if short { " --force" } else { "" });
    let warning = short.then(|| {
        format!(
            "a retention of {retention} is below an hour: markers would go while the broker can still redeliver their \
             events, which would then be applied twice; keep at least the broker's retention (`idem prune` refuses it \
             without --force)"
        )
    });
    let prune = PruneDryRun { retention: retention.to_owned(), would_delete, command, warning };
    Ok(Markers { groups, prune })
}

/// `GET /api/v1/markers`.
pub async fn api<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    asked: Result<Query<MarkersQuery>, QueryRejection>,
) -> Response {
    if let Err((status, why)) = c.api_user(&headers, Role::Viewer) {
        return error(status, &why);
    }
    let asked = match query(asked) {
        Ok(asked) => asked,
        Err((status, why)) => return error(status, &why),
    };
    match figures(&c, &asked).await {
        Ok(markers) => Json(markers).into_response(),
        Err((status, why)) => error(status, &why),
    }
}

/// `GET /markers`.
pub async fn page<DB: ConsoleStore, P: Publisher + 'static>(
    State(c): State<Arc<Console<DB, P>>>,
    headers: HeaderMap,
    Query(asked): Query<MarkersQuery>,
) -> Response {
    let Some(session) = signed_in(&c, &headers) else {
        return to_sign_in();
    };
    let markers = match figures(&c, &asked).await {
        Ok(markers) => markers,
        Err((status, why)) => return failed(status, &why),
    };
    let mut body = String::from(
        "<table id=\"markers\"><tr><th>Consumer group</th><th>Markers</th><th>Oldest</th><th>Dead letters</th></tr>",
    );
    for g in &markers.groups {
        let oldest = g.oldest_marker_age_seconds.map(age).unwrap_or_else(|| "-".to_owned());
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{}</td><td>{oldest}</td><td>{}</td></tr>",
            esc(&g.consumer_group),
            g.markers,
            g.dead_letters
        );
    }
    body.push_str("</table>");
    let prune = &markers.prune;
    let _ = write!(
        body,
        r#"<form method="get" action="/markers" class="filters"><label>Retention <input name="retention" value="{}" size="6"></label><button>Prune dry run</button></form>
<p id="prune">A prune with retention {} would delete <strong>{}</strong> marker(s) now: <code>{}</code> (never run from here: markers the broker may still redeliver must stay).</p>"#,
        esc(&prune.retention),
        esc(&prune.retention),
        prune.would_delete,
        esc(&prune.command),
    );
    if let Some(warning) = &prune.warning {
        let _ = write!(body, r#"<p class="error" id="prune-warning">{}</p>"#, esc(warning));
    }
    c.layout("Markers", &session, &body)
}

/// An age in seconds as `3d 4h`, `2h 5m`, `40s`.
fn age(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match (s / 86_400, s % 86_400 / 3_600, s % 3_600 / 60) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, m) => format!("{m}m {}s", s % 60),
        (0, h, m) => format!("{h}h {m}m"),
        (d, h, _) => format!("{d}d {h}h"),
    }
}
