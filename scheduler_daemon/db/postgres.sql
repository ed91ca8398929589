-- Named queries for the PostgreSQL store (see sqlfiles.py for the format).

-- name: create_version_table
CREATE TABLE IF NOT EXISTS scheduler_schema_version (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: applied_versions
SELECT version FROM scheduler_schema_version ORDER BY version

-- name: record_version
INSERT INTO scheduler_schema_version (version, name) VALUES ($1, $2)

-- name: schema_version
SELECT CASE WHEN to_regclass('scheduler_schema_version') IS NULL THEN NULL
            ELSE (SELECT max(version) FROM scheduler_schema_version) END

-- name: schedule
INSERT INTO scheduler_publications (key, payload, publish_at)
VALUES ($1, $2::jsonb, $3)
ON CONFLICT (key) DO NOTHING
RETURNING *

-- name: get_by_key
SELECT * FROM scheduler_publications WHERE key = $1

-- name: get
SELECT * FROM scheduler_publications WHERE id = $1

-- name: cancel
UPDATE scheduler_publications SET status = 'cancelled'
WHERE id = $1 AND status = 'scheduled'
RETURNING *

-- name: publication_stats
SELECT count(*) AS scheduled,
       count(*) FILTER (WHERE publish_at <= now()) AS due,
       min(publish_at) AS next_due
FROM scheduler_publications
WHERE status = 'scheduled'

-- name: leader_claim
-- Run on the lock connection right after the lock is granted.
INSERT INTO scheduler_leaders
    (loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at)
VALUES ($1, $2, $3, $4, $5, pg_backend_pid(), now(), now())
ON CONFLICT (loop) DO UPDATE SET
    lock_key = EXCLUDED.lock_key, instance = EXCLUDED.instance,
    hostname = EXCLUDED.hostname, pid = EXCLUDED.pid, backend_pid = EXCLUDED.backend_pid,
    acquired_at = EXCLUDED.acquired_at, heartbeat_at = EXCLUDED.heartbeat_at
RETURNING backend_pid, acquired_at

-- name: leader_touch
-- Transaction mode: the tick's own transaction records who ran it. acquired_at only moves
-- when the instance changes, so it still says "leading since".
INSERT INTO scheduler_leaders AS l
    (loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at)
VALUES ($1, $2, $3, $4, $5, pg_backend_pid(), now(), now())
ON CONFLICT (loop) DO UPDATE SET
    lock_key = EXCLUDED.lock_key, hostname = EXCLUDED.hostname, pid = EXCLUDED.pid,
    backend_pid = EXCLUDED.backend_pid, heartbeat_at = EXCLUDED.heartbeat_at,
    acquired_at = CASE WHEN l.instance = EXCLUDED.instance THEN l.acquired_at
                       ELSE EXCLUDED.acquired_at END,
    instance = EXCLUDED.instance

-- name: leader_heartbeat
-- Through the pool, not the lock connection: it proves that the database itself still sees
-- our lock backend holding the key (pg_locks is the lock manager's own truth).
UPDATE scheduler_leaders SET heartbeat_at = now()
WHERE loop = $1 AND backend_pid = $2 AND instance = $3
  AND EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND pid = $2 AND objsubid = 1
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = (($4::bigint >> 32) & 4294967295)::oid
      AND objid = ($4::bigint & 4294967295)::oid)
RETURNING heartbeat_at

-- name: leader_release
DELETE FROM scheduler_leaders WHERE loop = $1 AND backend_pid = pg_backend_pid()

-- name: evict_stalled
-- Terminate the backend holding a loop's lock when its leader has gone silent: its
-- heartbeat (or, with no leader row, its last activity) is older than the stall timeout.
-- The whole judgement is one statement, so a fresh leader is never hit by a stale read.
-- A backend busy running a statement is not judged by activity: only the heartbeat can
-- say that its client is gone.
SELECT l.pid, s.instance, s.heartbeat_at, a.application_name,
       pg_terminate_backend(l.pid) AS terminated
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN scheduler_leaders s ON s.loop = $1 AND s.backend_pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (($2::bigint >> 32) & 4294967295)::oid
  AND l.objid = ($2::bigint & 4294967295)::oid
  AND l.pid <> pg_backend_pid()
  AND CASE WHEN s.backend_pid IS NOT NULL
           THEN s.heartbeat_at < now() - make_interval(secs => $3)
           ELSE a.state <> 'active' AND a.state_change < now() - make_interval(secs => $3)
      END

-- name: lock_sessions
-- Who holds and who waits for a loop's lock, straight from the lock manager.
SELECT l.pid, l.granted, a.application_name, a.backend_start, a.state,
       host(a.client_addr) AS client_addr,
       s.instance, s.hostname, s.pid AS os_pid, s.acquired_at, s.heartbeat_at,
       extract(epoch FROM now() - s.heartbeat_at)::float8 AS heartbeat_age
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN scheduler_leaders s ON s.loop = $1 AND s.backend_pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (($2::bigint >> 32) & 4294967295)::oid
  AND l.objid = ($2::bigint & 4294967295)::oid
ORDER BY l.granted DESC, a.backend_start

-- name: leaders
SELECT loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age
FROM scheduler_leaders ORDER BY loop
