CREATE TABLE IF NOT EXISTS {t}processed_events (
    consumer_group text        NOT NULL,
    event_id       text        NOT NULL,
    topic          text        NOT NULL,
    partition      int         NOT NULL,
    "offset"       bigint      NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id)
);
-- Pruning scans by time; a dedicated index keeps the reaper off the primary key.
CREATE INDEX IF NOT EXISTS {p}processed_events_processed_at ON {t}processed_events (processed_at);
