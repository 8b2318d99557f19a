-- Delayed retries: messages parked after their immediate retries, and the later messages of their key parked
-- behind them. The id is the arrival order; a key's head is its lowest id. Times are milliseconds since the epoch,
-- written by idem, so that every store compares them the same way.
CREATE TABLE IF NOT EXISTS {t}parked_messages (
    id               BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer_group   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_id         VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    order_key        VARBINARY(32),
    topic            VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    `partition`      INT          NOT NULL,
    `offset`         BIGINT       NOT NULL,
    `key`            LONGBLOB,
    payload          LONGBLOB     NOT NULL,
    headers          LONGTEXT     NOT NULL,
    timestamp_ms     BIGINT,
    attempts         INT          NOT NULL,
    delayed_retries INT          NOT NULL,
    error            LONGTEXT,
    history          LONGTEXT     NOT NULL,
    parked_at        BIGINT       NOT NULL,
    due_at           BIGINT       NOT NULL,
    UNIQUE KEY {p}parked_messages_event (consumer_group, event_id),
    KEY {p}parked_messages_key (consumer_group, order_key, id),
    KEY {p}parked_messages_due (consumer_group, due_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci;
