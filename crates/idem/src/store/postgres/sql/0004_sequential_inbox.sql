-- The Sequential Inbox (document 002). One instance per (sequence, context id); two consumers creating it at once
-- end up on the same row through the unique constraint.
CREATE TABLE IF NOT EXISTS {t}sequence_instance (
    id             bigserial   PRIMARY KEY,
    sequence_name  text        NOT NULL,
    context_id     text        NOT NULL,
    status         text        NOT NULL DEFAULT 'OPEN',
    created_at     timestamptz NOT NULL DEFAULT now(),
    closed_at      timestamptz,
    retain_until   timestamptz NOT NULL,
    CONSTRAINT {p}sequence_instance_context UNIQUE (sequence_name, context_id)
);
-- Housekeeping finds expired instances by time.
CREATE INDEX IF NOT EXISTS {p}sequence_instance_retain_until ON {t}sequence_instance (retain_until);
-- Messages of an instance: WAITING (buffered with their bytes and headers), PROCESSED, FAILED.
CREATE TABLE IF NOT EXISTS {t}sequenced_message (
    id                   bigserial   PRIMARY KEY,
    sequence_instance_id bigint      NOT NULL REFERENCES {t}sequence_instance (id) ON DELETE CASCADE,
    message_type         text        NOT NULL,
    idempotence_id       text        NOT NULL,
    status               text        NOT NULL,
    topic                text        NOT NULL,
    partition            int         NOT NULL,
    "offset"             bigint      NOT NULL,
    key                  bytea,
    payload              bytea,
    headers              text        NOT NULL,
    error                text,
    force_release        boolean     NOT NULL DEFAULT false,
    received_at          timestamptz NOT NULL DEFAULT now(),
    processed_at         timestamptz
);
-- The lookup by idempotence id; deliberately not unique, so historical duplicates never block this migration.
CREATE INDEX IF NOT EXISTS {p}sequenced_message_idempotence_id ON {t}sequenced_message (idempotence_id);
CREATE INDEX IF NOT EXISTS {p}sequenced_message_instance ON {t}sequenced_message (sequence_instance_id, status);
-- The waiting-message gauges read only waiting rows.
CREATE INDEX IF NOT EXISTS {p}sequenced_message_waiting ON {t}sequenced_message (received_at) WHERE status = 'WAITING';
-- The claim, exactly as document 002 gives it: the primary key arbitrates concurrent deliveries.
CREATE TABLE IF NOT EXISTS {t}sequential_inbox_idempotence (
    message_type         text        NOT NULL,
    idempotence_id       text        NOT NULL,
    sequence_instance_id bigint      NOT NULL REFERENCES {t}sequence_instance (id) ON DELETE CASCADE,
    created_at           timestamptz NOT NULL,
    CONSTRAINT {p}sequential_inbox_idempotence_pkey PRIMARY KEY (message_type, idempotence_id)
);
CREATE INDEX IF NOT EXISTS {p}sequential_inbox_idempotence_sequence_instance_id
    ON {t}sequential_inbox_idempotence (sequence_instance_id);
