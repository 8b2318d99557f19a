-- Delayed retries: messages parked after their immediate retries, and the later messages of their key parked
-- behind them. The id is the arrival order; a key's head is its lowest id. Times are milliseconds since the epoch,
-- written by idem, so that every store compares them the same way.
CREATE TABLE IF NOT EXISTS {t}parked_messages (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer_group   TEXT    NOT NULL,
    event_id         TEXT    NOT NULL,
    order_key        BLOB,
    topic            TEXT    NOT NULL,
    partition        INTEGER NOT NULL,
    "offset"         INTEGER NOT NULL,
    key              BLOB,
    payload          BLOB    NOT NULL,
    headers          TEXT    NOT NULL,
    timestamp_ms     INTEGER,
    attempts         INTEGER NOT NULL,
    delayed_retries INTEGER NOT NULL,
    error            TEXT,
    history          TEXT    NOT NULL,
    parked_at        INTEGER NOT NULL,
    due_at           INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS {p}parked_messages_event ON {t}parked_messages (consumer_group, event_id);
CREATE INDEX IF NOT EXISTS {p}parked_messages_key ON {t}parked_messages (consumer_group, order_key, id);
CREATE INDEX IF NOT EXISTS {p}parked_messages_due ON {t}parked_messages (consumer_group, due_at);
