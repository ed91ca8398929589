-- Schedules as data (docs/plugins.md): the application adds, changes, pauses and removes
-- schedules at runtime, each naming a target the deployment declared runnable, with its
-- own JSON `args`. They live in scheduler_plugin_tasks beside the declared tasks (config,
-- plugins, built-ins), which keep `target` NULL: their code is the deployment's, and the
-- leader runs them from its own declarations. A row whose `target` is set is a runtime
-- schedule, run from its row.

ALTER TABLE scheduler_plugin_tasks
    ADD COLUMN source          text NOT NULL DEFAULT 'runtime',
    ADD COLUMN target          text,
    ADD COLUMN args            jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN every_seconds   double precision,
    ADD COLUMN cron            text,
    ADD COLUMN timezone        text NOT NULL DEFAULT 'UTC',
    ADD COLUMN timeout_seconds double precision NOT NULL DEFAULT 300,
    ADD COLUMN misfire         text NOT NULL DEFAULT 'run_once',
    ADD COLUMN jitter_seconds  double precision NOT NULL DEFAULT 0,
    ALTER COLUMN schedule SET DEFAULT '',
    -- A runtime schedule inserted without one is due at once (then follows its schedule).
    ALTER COLUMN next_run_at SET DEFAULT now(),
    ADD CONSTRAINT scheduler_plugin_tasks_runtime_check CHECK (
        target IS NULL OR (
            (every_seconds IS NULL) <> (cron IS NULL)
            -- Bounded as config's durations (100 years): a bound also refuses NaN and
            -- Infinity, which PostgreSQL's float8 takes and no schedule can follow.
            AND (every_seconds IS NULL OR (every_seconds > 0 AND every_seconds <= 3153600000))
            AND timeout_seconds > 0 AND timeout_seconds <= 3153600000
            AND misfire IN ('run_once', 'skip')
            AND jitter_seconds >= 0 AND jitter_seconds <= 3153600000
            AND jsonb_typeof(args) = 'object'
        )) NOT VALID;

-- Every declared task so far came from the deployment.
UPDATE scheduler_plugin_tasks SET source = 'config' WHERE target IS NULL;

-- The targets this deployment declares runnable at runtime, written by each plugin leader
-- when it takes over (plugin.runnable, and the targets of declared tasks). A runtime
-- schedule naming anything else is refused at the statement that writes it: a database
-- writer cannot make the daemon import and call an arbitrary installed callable. The
-- leader checks again before it runs one (docs/security.md).
CREATE TABLE scheduler_runnable_targets (
    target     text PRIMARY KEY,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION scheduler_plugin_tasks_target_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.target IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM scheduler_runnable_targets WHERE target = NEW.target
    ) THEN
        RAISE EXCEPTION 'scheduler_plugin_tasks_target_check: target % is not runnable here: the deployment declares runnable targets in plugin.runnable or as a declared task''s target, and a plugin leader publishes them when it takes over', quote_literal(NEW.target)
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER scheduler_plugin_tasks_target_check
    BEFORE INSERT OR UPDATE OF target ON scheduler_plugin_tasks
    FOR EACH ROW EXECUTE FUNCTION scheduler_plugin_tasks_target_check();

-- What the leader reads per tick: due schedules, oldest slot first, and the next one to
-- come, from this index alone (O(due), never a read of every row).
CREATE INDEX scheduler_plugin_tasks_due_idx
    ON scheduler_plugin_tasks (next_run_at) WHERE active AND NOT paused;
CREATE INDEX scheduler_plugin_tasks_triggered_idx
    ON scheduler_plugin_tasks (trigger_requested_at)
    WHERE trigger_requested_at IS NOT NULL AND active AND NOT paused;

-- A schedule added at runtime wakes the leader, as a trigger or a resume does (0004).
CREATE FUNCTION scheduler_plugin_tasks_added() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('scheduler_plugin_tasks_changed', '');
    RETURN NULL;
END $$;

CREATE TRIGGER scheduler_plugin_tasks_added
    AFTER INSERT ON scheduler_plugin_tasks
    FOR EACH STATEMENT EXECUTE FUNCTION scheduler_plugin_tasks_added();

-- At most one run of a schedule in flight, enforced by the database: a batch claim can
-- never start a second run of a schedule whose previous run has not ended (nor two runs of
-- one schedule at once). Replaces the plain index of 0003. Older duplicates, which only a
-- bug could have left, are closed first.
UPDATE scheduler_plugin_runs r
SET status = 'abandoned', finished_at = now(),
    error = 'abandoned: a newer run of the same task was in flight (migration 0006)'
WHERE status = 'running' AND EXISTS (
    SELECT 1 FROM scheduler_plugin_runs n
    WHERE n.name = r.name AND n.status = 'running' AND n.id > r.id);
DROP INDEX scheduler_plugin_runs_running_idx;
CREATE UNIQUE INDEX scheduler_plugin_runs_one_running_idx
    ON scheduler_plugin_runs (name) WHERE status = 'running';

-- 0004's trigger joins the statement's old and new rows by name. Transition tables have
-- no statistics, so the planner guessed a nested loop: quadratic in the rows a statement
-- touches (62 ms of an 85 ms claim of 1,000 schedules, measured). A hash join is linear.
ALTER FUNCTION scheduler_plugin_tasks_wakeup() SET enable_nestloop = off;
