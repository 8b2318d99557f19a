-- Delayed retries: messages parked after their immediate retries, and the later messages of their key parked
-- behind them. The id is the arrival order; a key's head is its lowest id. Times are milliseconds since the epoch,
-- written by idem, so that every store compares them the same way.
CREATE TABLE IF NOT EXISTS {t}parked_messages (
    id               bigserial   PRIMARY KEY,
    consumer_group   text        NOT NULL,
    event_id         text        NOT NULL,
    order_key        bytea,
    topic            text        NOT NULL,
    partition        int         NOT NULL,
    "offset"         bigint      NOT NULL,
    key              bytea,
    payload          bytea       NOT NULL,
    headers          text        NOT NULL,
    timestamp_ms     bigint,
    attempts         int         NOT NULL,
    delayed_retries int         NOT NULL,
    error            text,
    history          text        NOT NULL,
    parked_at        bigint      NOT NULL,
    due_at           bigint      NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS {p}parked_messages_event ON {t}parked_messages (consumer_group, event_id);
CREATE INDEX IF NOT EXISTS {p}parked_messages_key ON {t}parked_messages (consumer_group, order_key, id);
CREATE INDEX IF NOT EXISTS {p}parked_messages_due ON {t}parked_messages (consumer_group, due_at);
