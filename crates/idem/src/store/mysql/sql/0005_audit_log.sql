-- The operator's actions: who did what to which messages, how many, when, and how it ended.
CREATE TABLE IF NOT EXISTS {t}audit_log (
    id        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    at_ms     BIGINT       NOT NULL,
    actor     VARCHAR(255) NOT NULL,
    action    VARCHAR(255) NOT NULL,
    subjects  LONGTEXT     NOT NULL,
    `count`   BIGINT       NOT NULL,
    outcome   LONGTEXT     NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci;
