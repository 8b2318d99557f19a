-- The transactional outbox: messages enqueued in an application's transaction, published by a relay once it
-- committed. `slot` (a hash of destination and key) is the unit a relay owns (a named lock, GET_LOCK), so one
-- key is relayed by one relay at a time, in id order.
CREATE TABLE IF NOT EXISTS {t}outbox (
    id           BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id     VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    destination  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    `key`        LONGBLOB,
    payload      LONGBLOB     NOT NULL,
    headers      LONGTEXT     NOT NULL,
    slot         INT          NOT NULL,
    enqueued_at  DATETIME(6)  NOT NULL,
    attempts     INT          NOT NULL DEFAULT 0,
    last_error   LONGTEXT,
    KEY {p}outbox_slot (slot, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_unicode_ci;
