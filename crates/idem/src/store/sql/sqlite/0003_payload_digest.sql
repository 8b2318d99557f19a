-- A digest of each event's payload: a duplicate whose payload differs is a reused id, not a redelivery.
-- Markers written before this migration have none and are compared as plain duplicates.
ALTER TABLE {t}processed_events ADD COLUMN payload_digest BLOB;
