CREATE TABLE IF NOT EXISTS {t}dead_letters (
    id               bigserial   PRIMARY KEY,
    consumer_group   text        NOT NULL,
    event_id         text,
    topic            text        NOT NULL,
    partition        int         NOT NULL,
    "offset"         bigint      NOT NULL,
    key              bytea,
    payload          bytea       NOT NULL,
    headers          text        NOT NULL,
    error            text        NOT NULL,
    attempts         int         NOT NULL,
    first_failed_at  timestamptz NOT NULL DEFAULT now(),
    last_failed_at   timestamptz NOT NULL DEFAULT now(),
    status           text        NOT NULL DEFAULT 'dead'
);
-- One row per dead event: a redelivery of a dead-lettered event updates its row instead of adding one.
CREATE UNIQUE INDEX IF NOT EXISTS {p}dead_letters_event ON {t}dead_letters (consumer_group, event_id);
-- Messages without a key have no event id; their broker position identifies them.
CREATE UNIQUE INDEX IF NOT EXISTS {p}dead_letters_position ON {t}dead_letters (consumer_group, topic, partition, "offset")
    WHERE event_id IS NULL;
