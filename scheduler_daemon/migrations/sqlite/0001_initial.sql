-- The public schema of scheduler-daemon on SQLite. Times are ISO 8601 text in UTC
-- ('2026-01-31T12:00:00.000000Z'); comparisons go through julianday() so that rows
-- written by hand with an offset ('…+02:00') still compare correctly.

CREATE TABLE scheduler_publications (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    key          TEXT UNIQUE,
    payload      TEXT NOT NULL DEFAULT '{}' CHECK (json_valid(payload)),
    publish_at   TEXT NOT NULL CHECK (julianday(publish_at) IS NOT NULL),
    status       TEXT NOT NULL DEFAULT 'scheduled'
                 CHECK (status IN ('scheduled', 'published', 'cancelled', 'failed')),
    published_at TEXT,
    published_by TEXT,
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT,
    created_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE INDEX scheduler_publications_due_idx
    ON scheduler_publications (julianday(publish_at), id) WHERE status = 'scheduled';
CREATE INDEX scheduler_publications_finished_idx
    ON scheduler_publications (publish_at) WHERE status <> 'scheduled';

CREATE TABLE scheduler_plugin_tasks (
    name                 TEXT PRIMARY KEY,
    schedule             TEXT NOT NULL,
    next_run_at          TEXT NOT NULL,
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
    updated_at           TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

CREATE TABLE scheduler_plugin_runs (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT NOT NULL,
    slot        TEXT NOT NULL,
    instance    TEXT NOT NULL,
    started_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    finished_at TEXT,
    status      TEXT NOT NULL DEFAULT 'running'
                CHECK (status IN ('running', 'succeeded', 'failed', 'timed_out',
                                  'skipped_overlap', 'abandoned')),
    error       TEXT,
    CONSTRAINT scheduler_plugin_runs_slot_key UNIQUE (name, slot)
);

CREATE TABLE scheduler_leaders (
    loop         TEXT NOT NULL,
    lock_key     INTEGER NOT NULL,
    instance     TEXT NOT NULL,
    hostname     TEXT NOT NULL,
    pid          INTEGER NOT NULL,
    backend_pid  INTEGER,
    acquired_at  TEXT NOT NULL,
    heartbeat_at TEXT NOT NULL,
    PRIMARY KEY (loop, lock_key)
);
