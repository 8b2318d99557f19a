-- One row per dead event: a redelivery of a dead-lettered event updates its row instead of adding one. Messages
-- without a key have no event id; their broker position identifies them (a unique key over a generated column,
-- MySQL having no partial index; NULLs never collide in a unique key).
CREATE TABLE IF NOT EXISTS {t}dead_letters (
    id               BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer_group   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_id         VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    topic            VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    `partition`      INT          NOT NULL,
    `offset`         BIGINT       NOT NULL,
    `key`            LONGBLOB,
    payload          LONGBLOB     NOT NULL,
    headers          LONGTEXT     NOT NULL,
    error            LONGTEXT     NOT NULL,
    attempts         INT          NOT NULL,
    first_failed_at  DATETIME(6)  NOT NULL,
    last_failed_at   DATETIME(6)  NOT NULL,
    status           VARCHAR(16)  NOT NULL DEFAULT 'dead',
    position_without_id VARCHAR(300) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin
        AS (CASE WHEN event_id IS NULL THEN CONCAT(topic, '/', `partition`, '/', `offset`) END) STORED,
    UNIQUE KEY {p}dead_letters_event (consumer_group, event_id),
    UNIQUE KEY {p}dead_letters_position (consumer_group, position_without_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci;
