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

-- name: leader_claim
INSERT INTO scheduler_leaders
    (loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at)
VALUES (?, ?, ?, ?, ?, NULL, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
        strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
ON CONFLICT (loop) DO UPDATE SET
    lock_key = excluded.lock_key, instance = excluded.instance,
    hostname = excluded.hostname, pid = excluded.pid, backend_pid = NULL,
    acquired_at = excluded.acquired_at, heartbeat_at = excluded.heartbeat_at

-- name: leader_heartbeat
UPDATE scheduler_leaders SET heartbeat_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE loop = ? AND instance = ? AND pid = ?

-- name: leader_release
DELETE FROM scheduler_leaders WHERE loop = ? AND instance = ? AND pid = ?

-- name: leaders
SELECT loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
       (julianday('now') - julianday(heartbeat_at)) * 86400.0 AS heartbeat_age
FROM scheduler_leaders ORDER BY loop
