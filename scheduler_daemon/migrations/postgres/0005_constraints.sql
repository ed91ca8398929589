-- The rules every writer keeps, the daemon and plain SQL alike (applications insert into
-- scheduler_publications directly; operators edit tasks): a row that breaks one is refused
-- at the statement that wrote it, with the constraint's name, instead of breaking a tick,
-- `publications list` or `status` later. Existing rows are checked too: a database holding
-- such a row fails this migration, naming the constraint, until the row is fixed.

ALTER TABLE scheduler_publications
    ADD CONSTRAINT scheduler_publications_attempts_check CHECK (attempts >= 0),
    -- Set when a row is published and kept if it fails afterwards (an undelivered webhook):
    -- a row that was never published has none.
    ADD CONSTRAINT scheduler_publications_published_at_check
        CHECK (published_at IS NULL OR status IN ('published', 'failed')),
    -- Python's datetime holds the years 1 to 9999 (and no infinity): a row outside them
    -- could not be read by the loop that must publish it.
    ADD CONSTRAINT scheduler_publications_publish_at_check
        CHECK (publish_at >= '0001-01-01 00:00:00+00' AND publish_at < '10000-01-01 00:00:00+00'),
    -- client.MAX_PAYLOAD_DEPTH: nothing inside more than 100 arrays and objects.
    ADD CONSTRAINT scheduler_publications_payload_depth_check
        CHECK (NOT jsonb_path_exists(payload, 'strict $.**{101}'));

ALTER TABLE scheduler_plugin_tasks
    ADD CONSTRAINT scheduler_plugin_tasks_counts_check
        CHECK (consecutive_failures >= 0 AND run_count >= 0),
    ADD CONSTRAINT scheduler_plugin_tasks_next_run_at_check
        CHECK (next_run_at >= '0001-01-01 00:00:00+00' AND next_run_at < '10000-01-01 00:00:00+00');

ALTER TABLE scheduler_webhook_outbox
    ADD CONSTRAINT scheduler_webhook_outbox_attempts_check CHECK (attempts >= 0);
