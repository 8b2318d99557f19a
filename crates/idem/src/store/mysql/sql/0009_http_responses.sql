-- The response an HTTP request was answered with, stored in the transaction of its marker: a retry with the same
-- idempotency key is answered with it. Pruned with the markers, by the same retention.
CREATE TABLE IF NOT EXISTS {t}http_responses (
    consumer_group VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_id       VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    status         INT          NOT NULL,
    headers        MEDIUMTEXT   NOT NULL,
    body           LONGBLOB     NOT NULL,
    stored_at_ms   BIGINT       NOT NULL,
    PRIMARY KEY (consumer_group, event_id),
    KEY {p}http_responses_stored_at (stored_at_ms)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci;
