-- See the PostgreSQL migration of the same number. SQLite cannot change a column's
-- default or add a constraint in place, so scheduler_plugin_tasks is rebuilt (the way
-- SQLite's documentation prescribes: new table, copy, drop, rename), and 0005's triggers
-- on it are created again.

CREATE TABLE scheduler_plugin_tasks_new (
    name                 TEXT PRIMARY KEY,
    schedule             TEXT NOT NULL DEFAULT '',
    next_run_at          TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    active               INTEGER NOT NULL DEFAULT 1,
    paused               INTEGER NOT NULL DEFAULT 0,
    trigger_requested_at TEXT,
    consecutive_failures INTEGER NOT NULL DEFAULT 0,
    last_slot            TEXT,
    last_started_at      TEXT,
    last_finished_at     TEXT,
    last_status          TEXT,
    last_error           TEXT,
    run_count            INTEGER NOT NULL DEFAULT 0,
    created_at           TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    updated_at           TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    source               TEXT NOT NULL DEFAULT 'runtime',
    target               TEXT,
    args                 TEXT NOT NULL DEFAULT '{}',
    every_seconds        REAL,
    cron                 TEXT,
    timezone             TEXT NOT NULL DEFAULT 'UTC',
    timeout_seconds      REAL NOT NULL DEFAULT 300,
    misfire              TEXT NOT NULL DEFAULT 'run_once',
    jitter_seconds       REAL NOT NULL DEFAULT 0,
    CONSTRAINT scheduler_plugin_tasks_runtime_check CHECK (
        target IS NULL OR (
            (every_seconds IS NULL) <> (cron IS NULL)
            -- Bounded as config's durations (100 years): a bound also refuses NaN and
            -- Infinity, which PostgreSQL's float8 takes and no schedule can follow.
            AND (every_seconds IS NULL OR (every_seconds > 0 AND every_seconds <= 3153600000))
            AND timeout_seconds > 0 AND timeout_seconds <= 3153600000
            AND misfire IN ('run_once', 'skip')
            AND jitter_seconds >= 0 AND jitter_seconds <= 3153600000
            AND json_valid(args) AND json_type(args) = 'object'
        ))
);

INSERT INTO scheduler_plugin_tasks_new
    (name, schedule, next_run_at, active, paused, trigger_requested_at,
     consecutive_failures, last_slot, last_started_at, last_finished_at, last_status,
     last_error, run_count, created_at, updated_at, source)
SELECT name, schedule, next_run_at, active, paused, trigger_requested_at,
       consecutive_failures, last_slot, last_started_at, last_finished_at, last_status,
       last_error, run_count, created_at, updated_at, 'config'
FROM scheduler_plugin_tasks;

DROP TABLE scheduler_plugin_tasks;
ALTER TABLE scheduler_plugin_tasks_new RENAME TO scheduler_plugin_tasks;

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

CREATE TABLE scheduler_runnable_targets (
    target     TEXT PRIMARY KEY,
    updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TRIGGER scheduler_plugin_tasks_target_check_insert
BEFORE INSERT ON scheduler_plugin_tasks
WHEN NEW.target IS NOT NULL
     AND NOT EXISTS (SELECT 1 FROM scheduler_runnable_targets WHERE target = NEW.target)
BEGIN
    SELECT RAISE(ABORT, 'scheduler_plugin_tasks_target_check: target is not runnable here: the deployment declares runnable targets in plugin.runnable or as a declared task''s target, and a plugin leader publishes them when it takes over');
END;

CREATE TRIGGER scheduler_plugin_tasks_target_check_update
BEFORE UPDATE OF target ON scheduler_plugin_tasks
WHEN NEW.target IS NOT NULL
     AND NOT EXISTS (SELECT 1 FROM scheduler_runnable_targets WHERE target = NEW.target)
BEGIN
    SELECT RAISE(ABORT, 'scheduler_plugin_tasks_target_check: target is not runnable here: the deployment declares runnable targets in plugin.runnable or as a declared task''s target, and a plugin leader publishes them when it takes over');
END;

CREATE INDEX scheduler_plugin_tasks_due_idx
    ON scheduler_plugin_tasks (julianday(next_run_at)) WHERE active AND NOT paused;

UPDATE scheduler_plugin_runs
SET status = 'abandoned', finished_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    error = 'abandoned: a newer run of the same task was in flight (migration 0006)'
WHERE status = 'running' AND EXISTS (
    SELECT 1 FROM scheduler_plugin_runs n
    WHERE n.name = scheduler_plugin_runs.name AND n.status = 'running'
      AND n.id > scheduler_plugin_runs.id);
DROP INDEX scheduler_plugin_runs_running_idx;
CREATE UNIQUE INDEX scheduler_plugin_runs_one_running_idx
    ON scheduler_plugin_runs (name) WHERE status = 'running';
