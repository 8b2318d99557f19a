CREATE TABLE IF NOT EXISTS {t}processed_events (
    consumer_group TEXT    NOT NULL,
    event_id       TEXT    NOT NULL,
    topic          TEXT    NOT NULL,
    partition      INTEGER NOT NULL,
    "offset"       INTEGER NOT NULL,
    -- Milliseconds since the Unix epoch.
    processed_at   INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    PRIMARY KEY (consumer_group, event_id)
);
CREATE INDEX IF NOT EXISTS {p}processed_events_processed_at ON {t}processed_events (processed_at);
