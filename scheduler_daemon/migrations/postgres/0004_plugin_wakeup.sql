-- Wakes the plugin loop's leader when a task becomes due sooner than it planned: it sleeps
-- until its next slot (and is otherwise idle). A statement trigger comparing old and new
-- rows, so only what can move a slot earlier notifies — a trigger requested, a pause
-- lifted, next_run_at moved back (`tasks trigger`, `tasks resume`, plain SQL) — and not
-- the leader's own bookkeeping of every run, which would wake it after each one.
CREATE FUNCTION scheduler_plugin_tasks_wakeup() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM new_rows n JOIN old_rows o USING (name)
        WHERE (n.trigger_requested_at IS NOT NULL
               AND n.trigger_requested_at IS DISTINCT FROM o.trigger_requested_at)
           OR (o.paused AND NOT n.paused)
           OR (n.active AND NOT o.active)
           OR n.next_run_at < o.next_run_at
    ) THEN
        PERFORM pg_notify('scheduler_plugin_tasks_changed', '');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER scheduler_plugin_tasks_wakeup
    AFTER UPDATE ON scheduler_plugin_tasks
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION scheduler_plugin_tasks_wakeup();
