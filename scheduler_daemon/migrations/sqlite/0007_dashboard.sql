-- The dashboard's failed runs, newest first (as the PostgreSQL migration 0009).
CREATE INDEX scheduler_plugin_runs_failed_idx
    ON scheduler_plugin_runs (id) WHERE status IN ('failed', 'timed_out', 'abandoned');
