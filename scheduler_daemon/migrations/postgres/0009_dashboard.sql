-- The dashboard's failed runs, newest first: without this, finding the last few failures
-- among a million succeeded runs reads the whole history backwards.
CREATE INDEX scheduler_plugin_runs_failed_idx
    ON scheduler_plugin_runs (id) WHERE status IN ('failed', 'timed_out', 'abandoned');
