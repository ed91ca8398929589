-- When each schedule's history is trimmed to plugin.history next (as PostgreSQL's 0012):
-- the run count it waits for, planned by the built-in purge_runs (plugins/retention.py),
-- off the tick. NULL: not planned yet.
ALTER TABLE scheduler_plugin_tasks ADD COLUMN history_trim_at INTEGER;
