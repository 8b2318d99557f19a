-- The operator's actions: who did what to which messages, how many, when, and how it ended.
CREATE TABLE IF NOT EXISTS {t}audit_log (
    id        bigserial PRIMARY KEY,
    at_ms     bigint    NOT NULL,
    actor     text      NOT NULL,
    action    text      NOT NULL,
    subjects  text      NOT NULL,
    count     bigint    NOT NULL,
    outcome   text      NOT NULL
);
