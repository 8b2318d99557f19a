-- When a replay of the dead letter began: a second replay within a minute is another operator's at work, and is
-- refused; an older one is a replay cut short, and is resumed.
ALTER TABLE {t}dead_letters ADD COLUMN IF NOT EXISTS replay_started_at_ms bigint;
