-- The response an HTTP request was answered with, stored in the transaction of its marker: a retry with the same
-- idempotency key is answered with it. Pruned with the markers, by the same retention.
CREATE TABLE IF NOT EXISTS {t}http_responses (
    consumer_group TEXT    NOT NULL,
    event_id       TEXT    NOT NULL,
    status         INTEGER NOT NULL,
    headers        TEXT    NOT NULL,
    body           BLOB    NOT NULL,
    stored_at_ms   INTEGER NOT NULL,
    PRIMARY KEY (consumer_group, event_id)
);
CREATE INDEX IF NOT EXISTS {p}http_responses_stored_at ON {t}http_responses (stored_at_ms);
