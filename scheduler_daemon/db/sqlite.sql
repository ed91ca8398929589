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

-- name: publications_find
-- Parameters as in postgres.sql; ?1 is a JSON array of statuses.
SELECT * FROM scheduler_publications
WHERE (?1 IS NULL OR status IN (SELECT value FROM json_each(?1)))
  AND (?2 IS NULL OR julianday(publish_at) >= julianday(?2))
  AND (?3 IS NULL OR julianday(publish_at) < julianday(?3))
  AND (?4 IS NULL OR key = ?4)
  AND (?5 IS NULL OR substr(key, 1, length(?5)) = ?5)
ORDER BY julianday(publish_at), id
LIMIT ?6

-- name: publication_stats
SELECT count(*) AS scheduled,
       coalesce(sum(julianday(publish_at) <= julianday('now')), 0) AS due,
       min(julianday(publish_at)) AS next_due_jd
FROM scheduler_publications
WHERE status = 'scheduled'

-- name: fencing_next
-- One more than the last. (No sequence in SQLite; its transactions that draw a token
-- commit before any work starts.)
INSERT INTO scheduler_fencing AS f (loop, token, instance) VALUES (?1, 1, ?2)
ON CONFLICT (loop) DO UPDATE SET
    token = f.token + 1, instance = excluded.instance,
    changed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
RETURNING token, token - 1 AS previous

-- name: leader_claim
INSERT INTO scheduler_leaders
    (loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
     fencing_token)
VALUES (?1, ?2, ?3, ?4, ?5, NULL, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
        strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), ?6)
ON CONFLICT (loop, lock_key) DO UPDATE SET
    instance = excluded.instance,
    hostname = excluded.hostname, pid = excluded.pid, backend_pid = NULL,
    acquired_at = excluded.acquired_at, heartbeat_at = excluded.heartbeat_at,
    fencing_token = excluded.fencing_token

-- name: leader_heartbeat
UPDATE scheduler_leaders SET heartbeat_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE loop = ?1 AND lock_key = ?2 AND instance = ?3 AND pid = ?4

-- name: leader_release
DELETE FROM scheduler_leaders
WHERE loop = ?1 AND lock_key = ?2 AND instance = ?3 AND pid = ?4

-- name: leaders
SELECT loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
       (julianday('now') - julianday(heartbeat_at)) * 86400.0 AS heartbeat_age, fencing_token
FROM scheduler_leaders ORDER BY loop

-- Plugin loop. Parameters are numbered (?1, ?2, …) in the same order as postgres.sql.

-- name: now
SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now') AS now

-- name: task_states
SELECT name, schedule, next_run_at, active, paused, trigger_requested_at
FROM scheduler_plugin_tasks

-- name: task_insert
INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at) VALUES (?1, ?2, ?3)
ON CONFLICT (name) DO NOTHING

-- name: task_reschedule
UPDATE scheduler_plugin_tasks
SET schedule = ?2, next_run_at = ?3, active = 1,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1

-- name: task_activate
UPDATE scheduler_plugin_tasks SET active = 1,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1 AND NOT active

-- name: tasks_deactivate_others
UPDATE scheduler_plugin_tasks SET active = 0,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE active AND name NOT IN (SELECT value FROM json_each(?1))

-- name: runs_abandon_all
UPDATE scheduler_plugin_runs
SET status = 'abandoned', finished_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), error = ?1
WHERE status = 'running' AND id NOT IN (SELECT value FROM json_each(?2))
RETURNING name, slot, instance

-- name: slot_claim
INSERT INTO scheduler_plugin_runs (name, slot, instance, status, finished_at)
VALUES (?1, ?2, ?3, ?4,
        CASE WHEN ?4 = 'running' THEN NULL ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now') END)
ON CONFLICT (name, slot) DO NOTHING
RETURNING id

-- name: task_advance
UPDATE scheduler_plugin_tasks SET next_run_at = ?3,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1 AND julianday(next_run_at) = julianday(?2)
RETURNING name

-- name: trigger_consume
UPDATE scheduler_plugin_tasks SET trigger_requested_at = NULL,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1 AND julianday(trigger_requested_at) = julianday(?2)
RETURNING name

-- name: task_started
UPDATE scheduler_plugin_tasks
SET last_slot = ?2, last_started_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    last_status = 'running', run_count = run_count + 1,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1

-- name: run_finish
UPDATE scheduler_plugin_runs
SET status = ?2, error = ?3, finished_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE id = ?1 AND status = 'running'
RETURNING id

-- name: task_finished
UPDATE scheduler_plugin_tasks
SET last_finished_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), last_status = ?2,
    last_error = ?3,
    consecutive_failures = CASE WHEN ?2 = 'succeeded' THEN 0 ELSE consecutive_failures + 1 END,
    paused = paused OR (?2 <> 'succeeded' AND consecutive_failures + 1 >= ?4),
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1
RETURNING consecutive_failures, paused

-- name: runs_trim
DELETE FROM scheduler_plugin_runs
WHERE name = ?1 AND status <> 'running'
  AND id <= (SELECT id FROM scheduler_plugin_runs WHERE name = ?1
             ORDER BY id DESC LIMIT 1 OFFSET ?2)

-- name: purge_publications
DELETE FROM scheduler_publications
WHERE id IN (SELECT id FROM scheduler_publications
             WHERE status <> 'scheduled'
               AND julianday(publish_at) < julianday('now') - ?1 / 86400.0
             ORDER BY julianday(publish_at) LIMIT ?2)
RETURNING id

-- name: tasks_list
SELECT name, schedule, next_run_at, active, paused, trigger_requested_at,
       consecutive_failures, last_slot, last_started_at, last_finished_at, last_status,
       last_error, run_count
FROM scheduler_plugin_tasks ORDER BY name

-- name: task_pause
UPDATE scheduler_plugin_tasks SET paused = 1,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1
RETURNING name

-- name: task_resume
UPDATE scheduler_plugin_tasks SET paused = 0, consecutive_failures = 0,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1
RETURNING name

-- name: task_trigger
UPDATE scheduler_plugin_tasks
SET trigger_requested_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = ?1
RETURNING name

-- Publish loop.

-- name: publish_due
-- SQLite has one writer at a time (BEGIN IMMEDIATE), so no row locking is needed.
UPDATE scheduler_publications
SET status = 'published', published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    published_by = ?2, attempts = attempts + 1, last_error = NULL
WHERE id IN (
    SELECT id FROM scheduler_publications
    WHERE status = 'scheduled' AND julianday(publish_at) <= julianday('now')
    ORDER BY julianday(publish_at), id
    LIMIT ?1
)
RETURNING id, key, payload, publish_at, published_at

-- name: publish_due_ids
-- See the PostgreSQL query of the same name.
SELECT id FROM scheduler_publications
WHERE status = 'scheduled' AND julianday(publish_at) <= julianday('now')
ORDER BY julianday(publish_at), id
LIMIT ?1

-- name: publish_one
UPDATE scheduler_publications
SET status = 'published', published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    published_by = ?2, attempts = attempts + 1, last_error = NULL
WHERE id = ?1 AND status = 'scheduled'
RETURNING id, key, payload, publish_at, published_at

-- name: publication_fail
UPDATE scheduler_publications
SET status = 'failed', published_at = NULL, last_error = ?2
WHERE id = ?1

-- name: publication_undelivered
-- Its database effects were committed (published_at stays); its webhook never arrived.
UPDATE scheduler_publications
SET status = 'failed', last_error = ?2
WHERE id = ?1 AND status = 'published'

-- name: next_due_in
-- SQLite has a single writer, so nothing due is ever skipped.
SELECT (min(julianday(publish_at)) - julianday('now')) * 86400.0 AS seconds,
       (julianday('now') - 2440587.5) * 86400.0 AS db_epoch,
       0 AS skipped
FROM scheduler_publications WHERE status = 'scheduled'

-- name: outbox_add
INSERT INTO scheduler_webhook_outbox (publication_id)
SELECT value FROM json_each(?1)
WHERE true
ON CONFLICT (publication_id) DO NOTHING

-- name: outbox_due
SELECT o.publication_id AS id, o.attempts, p.key, p.payload, p.publish_at, p.published_at
FROM scheduler_webhook_outbox o
JOIN scheduler_publications p ON p.id = o.publication_id
WHERE o.status = 'pending' AND julianday(o.next_attempt_at) <= julianday('now')
ORDER BY julianday(o.next_attempt_at)
LIMIT ?1

-- name: outbox_delivered
UPDATE scheduler_webhook_outbox
SET status = 'delivered', attempts = attempts + 1,
    delivered_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), last_error = NULL
WHERE publication_id = ?1 AND status = 'pending'

-- name: outbox_retry
UPDATE scheduler_webhook_outbox
SET attempts = attempts + 1, last_error = ?3,
    next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || ?2 || ' seconds')
WHERE publication_id = ?1 AND status = 'pending'

-- name: outbox_failed
UPDATE scheduler_webhook_outbox
SET status = 'failed', attempts = attempts + 1, last_error = ?2
WHERE publication_id = ?1 AND status = 'pending'

-- name: outbox_next_in
SELECT (min(julianday(next_attempt_at)) - julianday('now')) * 86400.0 AS seconds
FROM scheduler_webhook_outbox WHERE status = 'pending'
