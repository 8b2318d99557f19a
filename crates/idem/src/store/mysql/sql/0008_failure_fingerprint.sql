-- Each dead letter's failure group (its fingerprint without a message type), written with the row: the console
-- lists a group's letters, counts them and pages through them by index, however many there are.
ALTER TABLE {t}dead_letters
    ADD COLUMN fingerprint VARCHAR(12) CHARACTER SET ascii COLLATE ascii_bin NULL,
    ADD INDEX {p}dead_letters_fingerprint (fingerprint, id),
    ADD INDEX {p}dead_letters_group_id (consumer_group, id);
