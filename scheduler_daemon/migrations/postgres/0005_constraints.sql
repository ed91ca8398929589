-- The rules every writer keeps, the daemon and plain SQL alike (applications insert into
-- scheduler_publications directly; operators edit tasks): a row that breaks one is refused
-- at the statement that wrote it, with the constraint's name, instead of breaking a tick,
-- `publications list` or `status` later. NOT VALID: rows already there are not scanned
-- (a scan would hold ACCESS EXCLUSIVE on a large table for its whole length, blocking every
-- writer and every loop; docs/operations.md, rolling upgrades), as SQLite's triggers judge
-- new writes only. `ALTER TABLE … VALIDATE CONSTRAINT …` checks them later, without that
-- lock, when an operator chooses.

ALTER TABLE scheduler_publications
    ADD CONSTRAINT scheduler_publications_attempts_check CHECK (attempts >= 0) NOT VALID,
    -- Set when a row is published and kept if it fails afterwards (an undelivered webhook):
    -- a row that was never published has none.
    ADD CONSTRAINT scheduler_publications_published_at_check
        CHECK (published_at IS NULL OR status IN ('published', 'failed')) NOT VALID,
    -- Python's datetime holds the years 1 to 9999 (and no infinity): a row outside them
    -- could not be read by the loop that must publish it.
    ADD CONSTRAINT scheduler_publications_publish_at_check
        CHECK (publish_at >= '0001-01-01 00:00:00+00' AND publish_at < '10000-01-01 00:00:00+00') NOT VALID,
    -- client.MAX_PAYLOAD_DEPTH: nothing inside more than 100 arrays and objects.
    ADD CONSTRAINT scheduler_publications_payload_depth_check
        CHECK (NOT jsonb_path_exists(payload, 'strict $.**{101}')) NOT VALID;

ALTER TABLE scheduler_plugin_tasks
    ADD CONSTRAINT scheduler_plugin_tasks_counts_check
        CHECK (consecutive_failures >= 0 AND run_count >= 0) NOT VALID,
    ADD CONSTRAINT scheduler_plugin_tasks_next_run_at_check
        CHECK (next_run_at >= '0001-01-01 00:00:00+00' AND next_run_at < '10000-01-01 00:00:00+00') NOT VALID;

ALTER TABLE scheduler_webhook_outbox
    ADD CONSTRAINT scheduler_webhook_outbox_attempts_check CHECK (attempts >= 0) NOT VALID;
