-- The transactional outbox: messages enqueued in an application's transaction, published by a relay once it
-- committed. One relay at a time holds the lease (SQLite has no row locks to share the slots by).
CREATE TABLE IF NOT EXISTS {t}outbox (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id     TEXT    NOT NULL,
    destination  TEXT    NOT NULL,
    key          BLOB,
    payload      BLOB    NOT NULL,
    headers      TEXT    NOT NULL,
    slot         INTEGER NOT NULL,
    enqueued_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT
);
CREATE INDEX IF NOT EXISTS {p}outbox_slot ON {t}outbox (slot, id);
CREATE TABLE IF NOT EXISTS {t}outbox_lease (
    id          INTEGER PRIMARY KEY CHECK (id = 1),
    owner       TEXT    NOT NULL,
    expires_at  INTEGER NOT NULL
);
