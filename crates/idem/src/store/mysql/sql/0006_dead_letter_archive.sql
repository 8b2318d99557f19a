-- Discarded dead letters, whole, with who discarded them, when and why; pruned once older than the expiry.
CREATE TABLE IF NOT EXISTS {t}dead_letter_archive (
    id                 BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    dead_letter_id     BIGINT       NOT NULL,
    consumer_group     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_id           VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    topic              VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    `partition`        INT          NOT NULL,
    `offset`           BIGINT       NOT NULL,
    `key`              LONGBLOB,
    payload            LONGBLOB     NOT NULL,
    headers            LONGTEXT     NOT NULL,
    error              LONGTEXT     NOT NULL,
    attempts           INT          NOT NULL,
    first_failed_at_ms BIGINT       NOT NULL,
    last_failed_at_ms  BIGINT       NOT NULL,
    discarded_at_ms    BIGINT       NOT NULL,
    discarded_by       VARCHAR(255) NOT NULL,
    discard_reason     LONGTEXT     NOT NULL,
    KEY {p}dead_letter_archive_discarded (consumer_group, discarded_at_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci;
