-- The operator's actions: who did what to which messages, how many, when, and how it ended.
CREATE TABLE IF NOT EXISTS {t}audit_log (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms     INTEGER NOT NULL,
    actor     TEXT    NOT NULL,
    action    TEXT    NOT NULL,
    subjects  TEXT    NOT NULL,
    count     INTEGER NOT NULL,
    outcome   TEXT    NOT NULL
);
