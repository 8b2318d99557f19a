-- One statement per migration: MySQL commits each DDL statement on its own, so a migration interrupted half-way
-- leaves either the whole table or none, and `IF NOT EXISTS` makes running it again safe.
-- Event ids compare byte for byte (utf8mb4_bin), as on PostgreSQL: `Pay-1` and `pay-1` are two events. They
-- hold idem's longest key (512 bytes) in a primary key within InnoDB's 3,072 bytes: 4 × (255 + 512).
CREATE TABLE IF NOT EXISTS {t}processed_events (
    consumer_group VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_id       VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    topic          VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    `partition`    INT          NOT NULL,
    `offset`       BIGINT       NOT NULL,
    payload_digest VARBINARY(32),
    -- UTC, written by idem as UTC_TIMESTAMP(6): DATETIME has no 2038 limit and no session time zone.
    processed_at   DATETIME(6)  NOT NULL,
    PRIMARY KEY (consumer_group, event_id),
    -- Pruning scans by time; a dedicated index keeps the reaper off the primary key.
    KEY {p}processed_events_processed_at (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci;
