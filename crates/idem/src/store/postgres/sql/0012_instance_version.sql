-- The Sequential Inbox's instance version: every transaction that takes an instance's lock raises it. The statement
-- that claims a message, takes the lock and reads the instance's messages in one round trip compares it with the
-- version its snapshot saw, so it can tell whether another holder of the lock committed in between (its reading
-- is then done again, after the lock).
ALTER TABLE {t}sequence_instance ADD COLUMN IF NOT EXISTS version bigint NOT NULL DEFAULT 0;
