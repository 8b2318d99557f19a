-- A digest of each event's payload: a duplicate whose payload differs is a reused id, not a redelivery.
-- Markers written before this migration have none and are compared as plain duplicates.
ALTER TABLE {t}processed_events ADD COLUMN payload_digest BLOB;
-- Per-group figures (row count, oldest marker) without scanning other groups' markers.
CREATE INDEX IF NOT EXISTS {p}processed_events_group_time ON {t}processed_events (consumer_group, processed_at);
