-- Discarded dead letters, whole, with who discarded them, when and why; pruned once older than the expiry.
CREATE TABLE IF NOT EXISTS {t}dead_letter_archive (
    id                 bigserial PRIMARY KEY,
    dead_letter_id     bigint    NOT NULL,
    consumer_group     text      NOT NULL,
    event_id           text,
    topic              text      NOT NULL,
    partition          int       NOT NULL,
    "offset"           bigint    NOT NULL,
    key                bytea,
    payload            bytea     NOT NULL,
    headers            text      NOT NULL,
    error              text      NOT NULL,
    attempts           int       NOT NULL,
    first_failed_at_ms bigint    NOT NULL,
    last_failed_at_ms  bigint    NOT NULL,
    discarded_at_ms    bigint    NOT NULL,
    discarded_by       text      NOT NULL,
    discard_reason     text      NOT NULL
);
CREATE INDEX IF NOT EXISTS {p}dead_letter_archive_discarded ON {t}dead_letter_archive (consumer_group, discarded_at_ms);
