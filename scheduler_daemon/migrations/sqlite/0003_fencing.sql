-- See the PostgreSQL migration of the same number.
CREATE TABLE scheduler_fencing (
    loop       TEXT PRIMARY KEY,
    token      INTEGER NOT NULL,
    instance   TEXT NOT NULL,
    changed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

ALTER TABLE scheduler_leaders ADD COLUMN fencing_token INTEGER;

CREATE INDEX scheduler_plugin_runs_running_idx
    ON scheduler_plugin_runs (name) WHERE status = 'running';
