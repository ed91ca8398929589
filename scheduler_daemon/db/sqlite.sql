-- Named queries for the SQLite store (see sqlfiles.py for the format).
-- Times are compared through julianday() (see migrations/sqlite/0001_initial.sql).

-- name: create_version_table
CREATE TABLE IF NOT EXISTS scheduler_schema_version (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
)

-- name: applied_versions
SELECT version FROM scheduler_schema_version ORDER BY version

-- name: record_version
INSERT INTO scheduler_schema_version (version, name) VALUES (?, ?)

-- name: schema_version
SELECT max(version) FROM scheduler_schema_version

-- name: schedule
INSERT INTO scheduler_publications (key, payload, publish_at)
VALUES (?, json(?), ?)
ON CONFLICT (key) DO NOTHING
RETURNING *

-- name: get_by_key
SELECT * FROM scheduler_publications WHERE key = ?

-- name: get
SELECT * FROM scheduler_publications WHERE id = ?

-- name: cancel
UPDATE scheduler_publications SET status = 'cancelled'
WHERE id = ? AND status = 'scheduled'
RETURNING *

-- name: publication_stats
SELECT count(*) AS scheduled,
       coalesce(sum(julianday(publish_at) <= julianday('now')), 0) AS due,
       min(julianday(publish_at)) AS next_due_jd
FROM scheduler_publications
WHERE status = 'scheduled'
