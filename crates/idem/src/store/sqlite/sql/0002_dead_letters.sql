CREATE TABLE IF NOT EXISTS {t}dead_letters (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer_group   TEXT    NOT NULL,
    event_id         TEXT,
    topic            TEXT    NOT NULL,
    partition        INTEGER NOT NULL,
    "offset"         INTEGER NOT NULL,
    key              BLOB,
    payload          BLOB    NOT NULL,
    headers          TEXT    NOT NULL,
    error            TEXT    NOT NULL,
    attempts         INTEGER NOT NULL,
    first_failed_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    last_failed_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    status           TEXT    NOT NULL DEFAULT 'dead'
);
CREATE UNIQUE INDEX IF NOT EXISTS {p}dead_letters_event ON {t}dead_letters (consumer_group, event_id);
CREATE UNIQUE INDEX IF NOT EXISTS {p}dead_letters_position ON {t}dead_letters (consumer_group, topic, partition, "offset")
    WHERE event_id IS NULL;
