-- Webhook deliveries happen after the publishing transaction commits, from this outbox:
-- a row is added in the same transaction as the state flip, so no publication is lost
-- between commit and delivery, and delivery is retried until it succeeds or gives up.
CREATE TABLE scheduler_webhook_outbox (
    publication_id  bigint PRIMARY KEY
                    REFERENCES scheduler_publications (id) ON DELETE CASCADE,
    status          text NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    delivered_at    timestamptz
);

CREATE INDEX scheduler_webhook_outbox_due_idx
    ON scheduler_webhook_outbox (next_attempt_at) WHERE status = 'pending';
