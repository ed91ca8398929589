-- The PostgreSQL migration of the same number adds CHECK constraints. SQLite cannot add a
-- constraint to an existing table without rebuilding it (and the webhook outbox's foreign
-- key with it), so here triggers refuse the same rows, with the same names, at the
-- statement that writes them. An UPDATE is checked only on the columns it changes, so a row
-- written before this migration still publishes as before.
-- Beyond PostgreSQL's rules, a time must be one the daemon reads: a date first
-- ('2027-01-01', '2027-01-01 09:00 +02:00', as julianday() takes it) or a Julian day
-- number, in the years 1 to 9999; not 'now' or '09:00', which julianday() takes too. A
-- number is compared with julianday()'s reading of it to within 2e-8 days: julianday()
-- rounds to the millisecond (1.2e-8 days).
-- The payload's depth has no trigger: SQLite has no cheap way to measure it. The publish
-- loop fails a row it cannot read (docs/publishing.md).

CREATE TRIGGER scheduler_publications_rules_insert
BEFORE INSERT ON scheduler_publications
BEGIN
    SELECT RAISE(ABORT, 'scheduler_publications_attempts_check: attempts must be a whole number, 0 or more')
    WHERE NOT (typeof(NEW.attempts) = 'integer' AND NEW.attempts >= 0);
    SELECT RAISE(ABORT, 'scheduler_publications_published_at_check: published_at is set only when a row is published (status published, or failed after)')
    WHERE NEW.published_at IS NOT NULL AND NEW.status NOT IN ('published', 'failed');
    SELECT RAISE(ABORT, 'scheduler_publications_publish_at_check: publish_at must be an ISO 8601 date and time or a Julian day number, in the years 1 to 9999')
    WHERE NOT coalesce(julianday(NEW.publish_at) >= 1721425.5
                    AND (NEW.publish_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*'
                         OR abs(julianday(NEW.publish_at) - CAST(NEW.publish_at AS REAL)) < 2e-8), 0);
END;

CREATE TRIGGER scheduler_publications_rules_update
BEFORE UPDATE OF attempts, status, published_at, publish_at ON scheduler_publications
BEGIN
    SELECT RAISE(ABORT, 'scheduler_publications_attempts_check: attempts must be a whole number, 0 or more')
    WHERE NEW.attempts IS NOT OLD.attempts
      AND NOT (typeof(NEW.attempts) = 'integer' AND NEW.attempts >= 0);
    SELECT RAISE(ABORT, 'scheduler_publications_published_at_check: published_at is set only when a row is published (status published, or failed after)')
    WHERE (NEW.published_at IS NOT OLD.published_at OR NEW.status IS NOT OLD.status)
      AND NEW.published_at IS NOT NULL AND NEW.status NOT IN ('published', 'failed');
    SELECT RAISE(ABORT, 'scheduler_publications_publish_at_check: publish_at must be an ISO 8601 date and time or a Julian day number, in the years 1 to 9999')
    WHERE NEW.publish_at IS NOT OLD.publish_at
      AND NOT coalesce(julianday(NEW.publish_at) >= 1721425.5
                    AND (NEW.publish_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*'
                         OR abs(julianday(NEW.publish_at) - CAST(NEW.publish_at AS REAL)) < 2e-8), 0);
END;

CREATE TRIGGER scheduler_plugin_tasks_rules_insert
BEFORE INSERT ON scheduler_plugin_tasks
BEGIN
    SELECT RAISE(ABORT, 'scheduler_plugin_tasks_counts_check: consecutive_failures and run_count must be whole numbers, 0 or more')
    WHERE NOT (typeof(NEW.consecutive_failures) = 'integer' AND NEW.consecutive_failures >= 0
               AND typeof(NEW.run_count) = 'integer' AND NEW.run_count >= 0);
    SELECT RAISE(ABORT, 'scheduler_plugin_tasks_next_run_at_check: next_run_at must be an ISO 8601 date and time or a Julian day number, in the years 1 to 9999')
    WHERE NOT coalesce(julianday(NEW.next_run_at) >= 1721425.5
                    AND (NEW.next_run_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*'
                         OR abs(julianday(NEW.next_run_at) - CAST(NEW.next_run_at AS REAL)) < 2e-8), 0);
END;

CREATE TRIGGER scheduler_plugin_tasks_rules_update
BEFORE UPDATE OF consecutive_failures, run_count, next_run_at ON scheduler_plugin_tasks
BEGIN
    SELECT RAISE(ABORT, 'scheduler_plugin_tasks_counts_check: consecutive_failures and run_count must be whole numbers, 0 or more')
    WHERE (NEW.consecutive_failures IS NOT OLD.consecutive_failures
           OR NEW.run_count IS NOT OLD.run_count)
      AND NOT (typeof(NEW.consecutive_failures) = 'integer' AND NEW.consecutive_failures >= 0
               AND typeof(NEW.run_count) = 'integer' AND NEW.run_count >= 0);
    SELECT RAISE(ABORT, 'scheduler_plugin_tasks_next_run_at_check: next_run_at must be an ISO 8601 date and time or a Julian day number, in the years 1 to 9999')
    WHERE NEW.next_run_at IS NOT OLD.next_run_at
      AND NOT coalesce(julianday(NEW.next_run_at) >= 1721425.5
                    AND (NEW.next_run_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]*'
                         OR abs(julianday(NEW.next_run_at) - CAST(NEW.next_run_at AS REAL)) < 2e-8), 0);
END;

CREATE TRIGGER scheduler_webhook_outbox_rules_insert
BEFORE INSERT ON scheduler_webhook_outbox
WHEN NOT (typeof(NEW.attempts) = 'integer' AND NEW.attempts >= 0)
BEGIN
    SELECT RAISE(ABORT, 'scheduler_webhook_outbox_attempts_check: attempts must be a whole number, 0 or more');
END;

CREATE TRIGGER scheduler_webhook_outbox_rules_update
BEFORE UPDATE OF attempts ON scheduler_webhook_outbox
WHEN NOT (typeof(NEW.attempts) = 'integer' AND NEW.attempts >= 0)
BEGIN
    SELECT RAISE(ABORT, 'scheduler_webhook_outbox_attempts_check: attempts must be a whole number, 0 or more');
END;
