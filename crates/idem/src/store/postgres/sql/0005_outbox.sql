-- The transactional outbox: messages enqueued in an application's transaction, published by a relay once it
-- committed. `slot` (a hash of destination and key) is the unit a relay owns, so one key is relayed by one relay
-- at a time, in id order.
CREATE TABLE IF NOT EXISTS {t}outbox (
    id           bigserial   PRIMARY KEY,
    event_id     text        NOT NULL,
    destination  text        NOT NULL,
    key          bytea,
    payload      bytea       NOT NULL,
    headers      text        NOT NULL,
    slot         int         NOT NULL,
    enqueued_at  timestamptz NOT NULL DEFAULT now(),
    attempts     int         NOT NULL DEFAULT 0,
    last_error   text
);
CREATE INDEX IF NOT EXISTS {p}outbox_slot ON {t}outbox (slot, id);
-- New rows wake the relays (LISTEN {p}idem_outbox), once per inserting statement.
CREATE OR REPLACE FUNCTION {t}idem_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('{p}idem_outbox', ''); RETURN NULL; END $$;
DROP TRIGGER IF EXISTS {p}outbox_notify ON {t}outbox;
CREATE TRIGGER {p}outbox_notify AFTER INSERT ON {t}outbox FOR EACH STATEMENT EXECUTE FUNCTION {t}idem_outbox_notify();
