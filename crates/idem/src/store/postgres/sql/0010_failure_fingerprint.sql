-- Each dead letter's failure group (its fingerprint without a message type), written with the row: the console
-- lists a group's letters, counts them and pages through them by index, however many there are.
ALTER TABLE {t}dead_letters ADD COLUMN IF NOT EXISTS fingerprint text;
CREATE INDEX IF NOT EXISTS {p}dead_letters_fingerprint ON {t}dead_letters (fingerprint, id);
CREATE INDEX IF NOT EXISTS {p}dead_letters_group_id ON {t}dead_letters (consumer_group, id);
