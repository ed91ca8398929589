-- See the PostgreSQL migration of the same number.
CREATE TABLE scheduler_webhook_outbox (
    publication_id  INTEGER PRIMARY KEY
                    REFERENCES scheduler_publications (id) ON DELETE CASCADE,
    status          TEXT NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    last_error      TEXT,
    delivered_at    TEXT
);

CREATE INDEX scheduler_webhook_outbox_due_idx
    ON scheduler_webhook_outbox (julianday(next_attempt_at)) WHERE status = 'pending';
