-- The example's own tables (PostgreSQL or SQLite): ten accounts and a ledger of credits.
CREATE TABLE IF NOT EXISTS accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS ledger (
    event_id TEXT PRIMARY KEY,
    account  BIGINT NOT NULL,
    amount   BIGINT NOT NULL,
    paid_at  TEXT NOT NULL
);
INSERT INTO accounts (id) VALUES (1), (2), (3), (4), (5), (6), (7), (8), (9), (10) ON CONFLICT DO NOTHING;
