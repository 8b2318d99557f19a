-- Discarded dead letters, whole, with who discarded them, when and why; pruned once older than the expiry.
CREATE TABLE IF NOT EXISTS {t}dead_letter_archive (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    dead_letter_id     INTEGER NOT NULL,
    consumer_group     TEXT    NOT NULL,
    event_id           TEXT,
    topic              TEXT    NOT NULL,
    partition          INTEGER NOT NULL,
    "offset"           INTEGER NOT NULL,
    key                BLOB,
    payload            BLOB    NOT NULL,
    headers            TEXT    NOT NULL,
    error              TEXT    NOT NULL,
    attempts           INTEGER NOT NULL,
    first_failed_at_ms INTEGER NOT NULL,
    last_failed_at_ms  INTEGER NOT NULL,
    discarded_at_ms    INTEGER NOT NULL,
    discarded_by       TEXT    NOT NULL,
    discard_reason     TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS {p}dead_letter_archive_discarded ON {t}dead_letter_archive (consumer_group, discarded_at_ms);
