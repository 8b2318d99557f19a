//! The JSON API's OpenAPI 3.0 document, served at `/api/v1/openapi.json`. It is written beside the handlers
//! ([`super::api`]), and the test suite holds the two together: schemathesis runs the live console against it
//! (every response's status and body must be the documented ones; no server error).

use serde_json::{Value, json};

/// The filters every dead-letter selection takes: name, description, schema. A blank value is no filter.
fn filters() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        ("group", "Only this consumer group.", string()),
        ("matching", "Only letters whose reason contains this text.", string()),
        (
            "fingerprint",
            "Only this failure group: 12 hexadecimal digits.",
            json!({ "type": "string", "pattern": "^\\s*([0-9a-fA-F]{12})?\\s*$" }),
        ),
        ("older_than", "Only letters that last failed longer ago than this (30m, 2h, 7d).", string()),
        (
            "message_type",
            "Where messages say their type: header:NAME or json:/POINTER.",
            json!({ "type": "string", "pattern": "^\\s*((header:\\S.*)|(json:/.*))?\\s*$" }),
        ),
    ]
}

fn filter_parameters() -> Vec<Value> {
    filters().into_iter().map(|(name, description, schema)| query(name, description, schema)).collect()
}

/// The body of an action: ids or `all`, the filters, and the options.
fn action_properties() -> Value {
    let mut properties = serde_json::Map::new();
    properties.insert("ids".into(), ids());
    properties.insert("all".into(), json!({ "type": "boolean" }));
    for (name, description, mut schema) in filters() {
        schema["description"] = description.into();
        properties.insert(name.into(), schema);
    }
    properties.insert(
        "force".into(),
        json!({ "type": "boolean", "description": "Replay: accept letters older than the markers kept." }),
    );
    properties.insert(
        "dry_run".into(),
        json!({ "type": "boolean", "description": "Say what would happen; change nothing." }),
    );
    properties.insert("reason".into(), json!({ "type": "string", "pattern": "\\S", "description": "Discard: why." }));
    Value::Object(properties)
}

fn query(name: &str, description: &str, schema: Value) -> Value {
    json!({ "name": name, "in": "query", "required": false, "description": description, "schema": schema })
}

fn reference(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn body(schema: Value) -> Value {
    json!({ "content": { "application/json": { "schema": schema } } })
}

fn answer(description: &str, schema: Value) -> Value {
    json!({ "description": description, "content": { "application/json": { "schema": schema } } })
}

/// The answers every authenticated endpoint may give besides its own.
fn refusals(extra: &[(&str, &str)]) -> serde_json::Map<String, Value> {
    let mut answers = serde_json::Map::new();
    let mut add = |status: &str, description: &str| {
        answers.insert(status.to_owned(), answer(description, reference("Error")));
    };
    add("400", "A parameter or the body is not what the endpoint takes (the error names it).");
    add("401", "No bearer token, or one that is not a user's.");
    add("503", "The database did not answer.");
    for (status, description) in extra {
        add(status, description);
    }
    answers
}

fn operation(summary: &str, parameters: Vec<Value>, ok: Value, extra: &[(&str, &str)]) -> Value {
    let mut responses = refusals(extra);
    responses.insert("200".into(), ok);
    json!({ "summary": summary, "parameters": parameters, "responses": responses, "security": [{ "bearer": [] }] })
}

fn action(summary: &str, request: &str, ok: &str) -> Value {
    let mut op = operation(
        summary,
        Vec::new(),
        answer("What was done (or, with dry_run, what would be).", reference(ok)),
        &[
            ("403", "The user is a viewer."),
            (
                "409",
                "The selection takes nothing, a letter is gone or was discarded meanwhile, or there is no broker to replay to; nothing was done.",
            ),
            ("502", "The broker refused a publish: the replay stopped (see stopped_by)."),
        ],
    );
    op["requestBody"] = body(reference(request));
    op["requestBody"]["required"] = true.into();
    op
}

fn edit() -> Value {
    let id = json!({ "name": "id", "in": "path", "required": true, "schema": integer() });
    let mut op = operation(
        "Dry-run an edited payload through the consumer's handler, or replay the edited copy.",
        vec![id],
        answer("The dry run's report, or the replay.", reference("EditResult")),
        &[
            ("403", "The user is a viewer."),
            ("404", "No dead letter has that id."),
            ("409", "Payloads are hidden, no handler or broker here, or the replay was refused or the letter is gone."),
            ("502", "The broker refused the edited copy."),
        ],
    );
    op["requestBody"] = body(reference("EditRequest"));
    op["requestBody"]["required"] = true.into();
    op
}

fn resume() -> Value {
    let group = json!({ "name": "group", "in": "path", "required": true, "schema": { "type": "string" } });
    operation(
        "Close a consumer's tripped kill switch (the consumer writes the audit entry).",
        vec![group],
        answer("Whether it was paused.", reference("Resumed")),
        &[("403", "The user is a viewer."), ("404", "No such consumer in this process.")],
    )
}

/// A POST with a JSON body of schema `request` answering `ok`, with path parameters.
fn posted(summary: &str, parameters: Vec<Value>, request: &str, ok: &str, extra: &[(&str, &str)]) -> Value {
    let mut op = operation(
        summary,
        parameters,
        answer("What was done (or, with dry_run, what would be).", reference(ok)),
        extra,
    );
    op["requestBody"] = body(reference(request));
    op["requestBody"]["required"] = true.into();
    op
}

fn string() -> Value {
    json!({ "type": "string" })
}

fn nullable_string() -> Value {
    json!({ "type": "string", "nullable": true })
}

fn integer() -> Value {
    json!({ "type": "integer", "format": "int64" })
}

fn ids() -> Value {
    json!({ "type": "array", "items": integer() })
}

fn object(properties: Value, required: &[&str]) -> Value {
    json!({ "type": "object", "properties": properties, "required": required })
}

/// The document.
pub fn document() -> Value {
    let mut letter_page = filter_parameters();
    letter_page.push(query("after", "Only letters with a larger id: the previous page's next_after.", integer()));
    letter_page.push(query("limit", "At most this many (1 to 500, default 50; out of range is refused).", integer()));
    let listing = |group: bool| {
        let mut parameters =
            vec![query("limit", "At most this many (1 to 1000, default 100; out of range is refused).", integer())];
        if group {
            parameters.push(query("group", "Only this consumer group.", string()));
        }
        parameters
    };
    let mut audit_page = listing(false);
    audit_page.push(query("actor", "Only this actor's entries.", string()));
    audit_page.push(query("action", "Only this action's (dead-letters replay).", string()));
    audit_page.push(query("before", "Only entries older than this id: the previous page's next_before.", integer()));
    let id = json!({ "name": "id", "in": "path", "required": true, "schema": integer() });
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "idem console",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Failure groups, dead letters, parked messages and the audit trail; replay and discard with \
                            the command line's selection, safety check and audit entries.",
        },
        "paths": {
            "/api/v1/whoami": { "get": operation("The signed-in user.", vec![], answer("The user.", reference("User")), &[]) },
            "/api/v1/failure-groups": { "get": operation(
                "Failure groups, the largest first.",
                filter_parameters(),
                answer("The groups.", json!({ "type": "array", "items": reference("FailureGroup") })),
                &[],
            ) },
            "/api/v1/dead-letters": { "get": operation(
                "Dead letters, oldest first, a page at a time.",
                letter_page,
                answer("A page.", reference("LetterPage")),
                &[],
            ) },
            "/api/v1/dead-letters/{id}": { "get": operation(
                "One dead letter with its headers (and payload when shown).",
                vec![id],
                answer("The letter.", reference("DeadLetter")),
                &[("404", "No dead letter has that id.")],
            ) },
            "/api/v1/dead-letters/replay": { "post": action("Replay the selected dead letters.", "ActionRequest", "ReplayResult") },
            "/api/v1/dead-letters/discard": { "post": action("Discard the selected dead letters into the archive.", "DiscardRequest", "DiscardResult") },
            "/api/v1/dead-letters/{id}/edit": { "post": edit() },
            "/api/v1/parked": { "get": operation(
                "Parked messages in arrival order.",
                listing(true),
                answer("The parked messages.", json!({ "type": "array", "items": reference("ParkedMessage") })),
                &[],
            ) },
            "/api/v1/consumers": { "get": operation(
                "This process's consumers (none for a console started alone).",
                vec![],
                answer("The consumers.", json!({ "type": "array", "items": reference("Consumer") })),
                &[],
            ) },
            "/api/v1/consumers/{group}/resume": { "post": resume() },
            "/api/v1/outbox": { "get": operation(
                "Each destination's backlog, the waiting rows that failed, the relays' dead letters a page at a time.",
                vec![
                    query("after", "Only relay dead letters with a larger id: the previous page's next_after.", integer()),
                    query("limit", "At most this many relay dead letters (1 to 500, default 50; out of range is refused).", integer()),
                ],
                answer("The backlog.", reference("Outbox")),
                &[],
            ) },
            "/api/v1/outbox/requeue": { "post": posted(
                "Put relay dead letters back into the outbox.",
                vec![],
                "RequeueRequest",
                "RequeueResult",
                &[("403", "The user is a viewer."), ("409", "Nothing named, or an id that is not a relay's dead letter; nothing was done.")],
            ) },
            "/api/v1/inbox": { "get": operation(
                "Sequential Inbox instances, oldest first (PostgreSQL).",
                vec![
                    query("sequence", "Only this sequence's instances.", string()),
                    query("status", "OPEN or CLOSED.", string()),
                    query("stuck", "Only those holding WAITING or FAILED messages.", json!({ "type": "boolean" })),
                    query("limit", "At most this many (1 to 1000, default 100; out of range is refused).", integer()),
                ],
                answer("The instances.", object(json!({ "items": { "type": "array", "items": reference("Instance") } }), &["items"])),
                &[("404", "The console's database has no Sequential Inbox (it runs on PostgreSQL).")],
            ) },
            "/api/v1/inbox/{id}": { "get": operation(
                "One instance and its messages, in arrival order.",
                vec![json!({ "name": "id", "in": "path", "required": true, "schema": integer() })],
                answer("The instance.", object(json!({
                    "instance": reference("Instance"),
                    "messages": { "type": "array", "items": reference("InstanceMessage") },
                }), &["instance", "messages"])),
                &[("404", "No such instance, or no Sequential Inbox here.")],
            ) },
            "/api/v1/inbox/{id}/{action}": { "post": posted(
                "Close an instance, or release its held messages (or one of them).",
                vec![
                    json!({ "name": "id", "in": "path", "required": true, "schema": integer() }),
                    json!({ "name": "action", "in": "path", "required": true, "schema": { "type": "string", "enum": ["close", "release"] } }),
                ],
                "InstanceAction",
                "InstanceResult",
                &[("403", "The user is a viewer."), ("404", "No such instance or message."), ("409", "Already closed, or nothing to release; nothing was done.")],
            ) },
            "/api/v1/markers": { "get": operation(
                "Each consumer group's markers and dead letters, and a prune dry run.",
                vec![query("retention", "The prune dry run's retention (7d, 36h; default 7d).", string())],
                answer("The figures.", reference("Markers")),
                &[],
            ) },
            "/api/v1/audit": { "get": operation(
                "The audit trail, newest first, a page at a time.",
                audit_page,
                answer("A page.", reference("AuditPage")),
                &[],
            ) },
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": {
                "Error": object(json!({ "error": string() }), &["error"]),
                "User": object(json!({ "name": string(), "role": { "type": "string", "enum": ["viewer", "operator"] } }), &["name", "role"]),
                "FailureGroup": object(json!({
                    "fingerprint": string(), "consumer_group": string(), "message_type": nullable_string(),
                    "pattern": string(), "count": { "type": "integer" }, "first_failed_at": string(),
                    "last_failed_at": string(), "sample": string(), "ids": ids(),
                }), &["fingerprint", "consumer_group", "pattern", "count", "first_failed_at", "last_failed_at", "sample", "ids"]),
                "DeadLetter": object(json!({
                    "id": integer(), "consumer_group": string(), "event_id": nullable_string(), "topic": string(),
                    "partition": { "type": "integer" },
                    "offset": { "type": "string", "pattern": "^-?[0-9]+$", "description": "The 64-bit offset as a decimal string (exact beyond 2^53)." },
                    "error": string(),
                    "attempts": { "type": "integer" }, "first_failed_at": string(), "last_failed_at": string(),
                    "status": string(), "fingerprint": string(),
                    "payload": { "type": "string", "nullable": true, "description": "Null unless payloads are shown." },
                    "payload_hidden": { "type": "boolean" },
                    "payload_json": { "nullable": true, "description": "The payload parsed as JSON, when shown and JSON." },
                    "headers": { "type": "array", "items": object(json!({ "name": string(), "value": string() }), &["name", "value"]) },
                }), &["id", "consumer_group", "topic", "partition", "offset", "error", "attempts", "status", "fingerprint", "headers"]),
                "LetterPage": object(json!({
                    "items": { "type": "array", "items": reference("DeadLetter") },
                    "total": { "type": "integer", "description": "How many the filters take (at least this many when total_at_least)." },
                    "total_at_least": { "type": "boolean", "description": "A reason text is counted only up to 10,000 matches." },
                    "next_after": { "type": "integer", "format": "int64", "nullable": true },
                }), &["items", "total", "total_at_least", "next_after"]),
                "ActionRequest": { "type": "object", "properties": action_properties(), "additionalProperties": false },
                "DiscardRequest": {
                    "type": "object",
                    "properties": action_properties(),
                    "required": ["reason"],
                    "additionalProperties": false,
                },
                "ReplayResult": object(json!({
                    "dry_run": { "type": "boolean" }, "replayed": ids(), "would_replay": ids(), "gone": ids(),
                    "released": ids(), "would_release": ids(),
                    "refused": { "type": "array", "items": object(json!({
                        "id": integer(), "risk": { "type": "string", "enum": ["markers_pruned", "applied_since", "id_reused", "relay_letter", "http_request"] }, "why": string(),
                    }), &["id", "risk", "why"]) },
                    "busy": { "type": "array", "items": object(json!({ "id": integer(), "since": string() }), &["id", "since"]) },
                    "stopped_by": nullable_string(),
                    "audit_id": { "type": "integer", "format": "int64", "nullable": true, "description": "The audit trail's entry (none for a dry run)." },
                }), &["dry_run", "refused", "gone", "busy", "stopped_by", "audit_id"]),
                "DiscardResult": object(json!({
                    "dry_run": { "type": "boolean" }, "discarded": ids(), "would_discard": ids(), "left": ids(),
                    "audit_id": { "type": "integer", "format": "int64", "nullable": true, "description": "The audit trail's entry (none for a dry run)." },
                }), &["dry_run", "left", "audit_id"]),
                "ParkedMessage": { "type": "object", "properties": { "id": integer(), "consumer_group": string(), "event_id": string() }, "required": ["id", "consumer_group", "event_id"] },
                "Consumer": object(json!({
                    "group": string(), "ready": { "type": "boolean" }, "running": { "type": "boolean" },
                    "draining": { "type": "boolean" }, "paused": { "type": "boolean" }, "partitions": { "type": "integer" },
                    "stalled": { "type": "array", "items": { "type": "object" } }, "stats": { "type": "object" },
                    "lag": { "type": "array", "description": "Messages behind, where the source tells (Kafka per partition, JetStream per consumer).",
                        "items": object(json!({
                            "topic": string(), "partition": { "type": "integer", "nullable": true }, "messages": integer(), "at": string(),
                        }), &["topic", "partition", "messages", "at"]) },
                }), &["group", "ready", "running", "draining", "paused", "partitions", "stalled", "stats", "lag"]),
                "EditRequest": {
                    "type": "object",
                    "properties": { "payload": string(), "dry_run": { "type": "boolean" }, "force": { "type": "boolean" } },
                    "required": ["payload"],
                    "additionalProperties": false,
                },
                "EditResult": object(json!({
                    "dry_run": { "type": "boolean" },
                    "trial": object(json!({
                        "ok": { "type": "boolean" }, "error": nullable_string(),
                        "statements": { "type": "array", "items": object(json!({ "statement": string(), "rows": integer() }), &["statement", "rows"]) },
                    }), &["ok", "error", "statements"]),
                    "replayed": { "type": "boolean" },
                    "audit_id": { "type": "integer", "format": "int64", "nullable": true },
                }), &["dry_run"]),
                "Resumed": object(json!({ "group": string(), "was_paused": { "type": "boolean" } }), &["group", "was_paused"]),
                "AuditEntry": object(json!({
                    "id": integer(), "at": string(), "actor": string(), "action": string(), "subjects": string(),
                    "count": integer(), "outcome": string(),
                }), &["id", "at", "actor", "action", "subjects", "count", "outcome"]),
                "Markers": object(json!({
                    "groups": { "type": "array", "items": object(json!({
                        "consumer_group": string(), "markers": integer(), "dead_letters": integer(),
                        "id_reused": integer(), "oldest_marker_age_seconds": { "type": "number", "nullable": true },
                    }), &["consumer_group", "markers", "dead_letters", "id_reused", "oldest_marker_age_seconds"]) },
                    "prune": object(json!({ "retention": string(), "would_delete": integer(), "command": string(), "warning": nullable_string() }), &["retention", "would_delete", "command"]),
                }), &["groups", "prune"]),
                "Outbox": object(json!({
                    "destinations": { "type": "array", "items": object(json!({
                        "destination": string(), "pending": integer(), "failing": integer(),
                        "oldest_age_seconds": { "type": "number", "nullable": true },
                    }), &["destination", "pending", "failing", "oldest_age_seconds"]) },
                    "failing": { "type": "array", "items": object(json!({
                        "id": integer(), "event_id": string(), "destination": string(), "attempts": { "type": "integer" },
                        "last_error": nullable_string(), "age_seconds": { "type": "number" },
                    }), &["id", "event_id", "destination", "attempts", "age_seconds"]) },
                    "dead_letters": object(json!({
                        "items": { "type": "array", "items": reference("DeadLetter") }, "total": integer(),
                        "next_after": { "type": "integer", "format": "int64", "nullable": true },
                    }), &["items", "total", "next_after"]),
                }), &["destinations", "failing", "dead_letters"]),
                "RequeueRequest": {
                    "type": "object",
                    "properties": {
                        "ids": ids(), "all": { "type": "boolean" }, "relay": string(), "dry_run": { "type": "boolean" },
                    },
                    "additionalProperties": false,
                },
                "RequeueResult": object(json!({
                    "dry_run": { "type": "boolean" }, "chosen": ids(), "requeued": ids(), "gone": ids(),
                    "audit_id": { "type": "integer", "format": "int64", "nullable": true },
                }), &["dry_run", "chosen", "requeued", "gone", "audit_id"]),
                "Instance": object(json!({
                    "id": integer(), "sequence_name": string(), "context_id": string(), "status": string(),
                    "created_at": string(), "retain_until": string(), "processed": integer(), "waiting": integer(),
                    "failed": integer(),
                }), &["id", "sequence_name", "context_id", "status", "created_at", "retain_until", "processed", "waiting", "failed"]),
                "InstanceMessage": object(json!({
                    "id": integer(), "message_type": string(), "idempotence_id": string(), "status": string(),
                    "position": string(), "error": nullable_string(), "force_release": { "type": "boolean" },
                    "received_at": string(), "processed_at": nullable_string(),
                }), &["id", "message_type", "idempotence_id", "status", "position", "force_release", "received_at"]),
                "InstanceAction": {
                    "type": "object",
                    "properties": { "message": integer(), "dry_run": { "type": "boolean" } },
                    "additionalProperties": false,
                },
                "InstanceResult": object(json!({
                    "dry_run": { "type": "boolean" }, "closed": { "type": "boolean" }, "waiting": integer(),
                    "released": integer(), "audit_id": { "type": "integer", "format": "int64", "nullable": true },
                }), &["dry_run", "audit_id"]),
                "AuditPage": object(json!({
                    "items": { "type": "array", "items": reference("AuditEntry") },
                    "next_before": { "type": "integer", "format": "int64", "nullable": true },
                }), &["items", "next_before"]),
            },
        },
    })
}
