-- A schedule whose history is due a trim to plugin.history (as PostgreSQL's 0012): set by
-- the results' write at the schedule's phase, cleared by the built-in purge_runs once
-- trimmed, found through the partial index.
ALTER TABLE scheduler_plugin_tasks ADD COLUMN history_trim_due INTEGER NOT NULL DEFAULT 0;
CREATE INDEX scheduler_plugin_tasks_trim_due_idx
    ON scheduler_plugin_tasks (name) WHERE history_trim_due;
