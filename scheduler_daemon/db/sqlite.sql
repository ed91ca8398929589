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

-- name: table_exists
-- A row if table ? exists: a database never migrated has no scheduler_schema_version.
SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?

-- name: connection_settings
-- The store's one connection, as it opens: four statements, run one at a time. busy_ms
-- (database.statement_timeout) is how long a statement waits for the write lock another
-- process holds. In WAL mode readers never wait for the writer, nor hold it up.
PRAGMA busy_timeout = {busy_ms};
PRAGMA journal_mode = WAL;
PRAGMA synchronous = NORMAL;
PRAGMA foreign_keys = ON

-- name: data_version
-- Changes when another connection (another process) commits, never for our own commits.
-- Cheap: it reads the WAL index in shared memory, no page of the database. The publish
-- leader's stand-in for LISTEN, asked when the files moved.
PRAGMA data_version

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
-- As in postgres.sql: each count up to ?1.
SELECT (SELECT count(*) FROM (SELECT 1 FROM scheduler_publications
                              WHERE status = 'scheduled' LIMIT ?1)) AS scheduled,
       (SELECT count(*) FROM (SELECT 1 FROM scheduler_publications
                              WHERE status = 'scheduled'
                                AND julianday(publish_at) <= julianday('now')
                              LIMIT ?1)) AS due,
       (SELECT min(julianday(publish_at)) FROM scheduler_publications
        WHERE status = 'scheduled') AS next_due_jd

-- name: table_health
-- `status`: the database file's size and free pages, read from its header. SQLite has no
-- dead row versions (a deleted row's space is free once its transaction commits) and no
-- VACUUM horizon: a free page is reused by later writes, and only VACUUM gives it back to
-- the file system.
SELECT p.page_count * s.page_size AS bytes, s.page_size, f.freelist_count AS free_pages
FROM pragma_page_count() AS p, pragma_page_size() AS s, pragma_freelist_count() AS f

-- name: fencing_next
-- One more than the last. (No sequence in SQLite; its transactions that draw a token
-- commit before any work starts.)
INSERT INTO scheduler_fencing AS f (loop, token, instance) VALUES (:loop, 1, :instance)
ON CONFLICT (loop) DO UPDATE SET
    token = f.token + 1, instance = excluded.instance,
    changed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
RETURNING token, token - 1 AS previous

-- name: leader_predecessor
-- As in postgres.sql: read by a new leader before it claims the row, the schema version
-- (a replica granted the locks on a newer schema lets them go at once: schema_gate.py),
-- and who led last and did not hand over (a graceful release deletes the row; instance is
-- NULL then).
SELECT (SELECT max(version) FROM scheduler_schema_version) AS schema_version,
       p.instance, p.hostname, p.pid
FROM (SELECT 1) AS one
LEFT JOIN scheduler_leaders p ON p.loop = :loop AND p.lock_key = :key

-- name: leader_claim
INSERT INTO scheduler_leaders
    (loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
     fencing_token)
VALUES (:loop, :key, :instance, :hostname, :pid, NULL, strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
        strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), :token)
ON CONFLICT (loop, lock_key) DO UPDATE SET
    instance = excluded.instance,
    hostname = excluded.hostname, pid = excluded.pid, backend_pid = NULL,
    acquired_at = excluded.acquired_at, heartbeat_at = excluded.heartbeat_at,
    fencing_token = excluded.fencing_token

-- name: leader_heartbeat
UPDATE scheduler_leaders SET heartbeat_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE loop = :loop AND lock_key = :key AND instance = :instance AND pid = :pid

-- name: leader_release
DELETE FROM scheduler_leaders
WHERE loop = :loop AND lock_key = :key AND instance = :instance AND pid = :pid

-- name: leaders
SELECT loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
       (julianday('now') - julianday(heartbeat_at)) * 86400.0 AS heartbeat_age, fencing_token
FROM scheduler_leaders ORDER BY loop

-- Plugin loop: the same names, parameters and results as postgres.sql (see there for the
-- why). SQLite has no data-modifying CTE, so a query may be several statements, run in
-- order with the same named parameters; rows come from each that returns any. The tick
-- holds the write lock (BEGIN IMMEDIATE) from its first statement, so nothing changes
-- between its read and its claim. Times are compared through julianday(): rows written by
-- hand may spell them differently.

-- name: now
SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now') AS now

-- name: plugin_stats
-- As in postgres.sql: the backlog counted up to :limit.
SELECT (SELECT count(*) FROM (SELECT 1 FROM scheduler_plugin_tasks
                              WHERE active AND NOT paused
                                AND julianday(next_run_at) <= julianday('now')
                              LIMIT :limit)) AS due,
       (julianday('now') - (SELECT min(julianday(next_run_at)) FROM scheduler_plugin_tasks
                            WHERE active AND NOT paused
                              AND julianday(next_run_at) <= julianday('now'))) * 86400.0
           AS lag,
       (SELECT next_run_at FROM scheduler_plugin_tasks
        WHERE active AND NOT paused AND NOT (julianday(next_run_at) <= julianday('now'))
        ORDER BY julianday(next_run_at) LIMIT 1) AS next_run_at

-- name: plugin_declare
CREATE TEMP TABLE IF NOT EXISTS scheduler_declared (
    name TEXT PRIMARY KEY, schedule TEXT, first TEXT, source TEXT,
    change TEXT, was_runtime INTEGER);
DELETE FROM temp.scheduler_declared;
INSERT INTO temp.scheduler_declared (name, schedule, first, source, change, was_runtime)
SELECT json_extract(i.value, '$.name'), json_extract(i.value, '$.schedule'),
       json_extract(i.value, '$.first'), json_extract(i.value, '$.source'),
       CASE WHEN t.name IS NULL THEN 'registered'
            WHEN t.target IS NOT NULL THEN 'shadowed'
            WHEN t.schedule <> json_extract(i.value, '$.schedule') THEN 'rescheduled'
            WHEN NOT t.active OR t.source <> json_extract(i.value, '$.source') THEN 'activated'
       END,
       t.target IS NOT NULL
FROM json_each(:tasks) AS i
LEFT JOIN scheduler_plugin_tasks t ON t.name = json_extract(i.value, '$.name');
INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source)
SELECT name, schedule, first, source FROM temp.scheduler_declared WHERE change = 'registered'
ON CONFLICT (name) DO NOTHING;
UPDATE scheduler_plugin_tasks AS t
SET schedule = d.schedule, source = d.source, active = 1, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    next_run_at = CASE WHEN d.change = 'rescheduled' THEN d.first ELSE t.next_run_at END
FROM temp.scheduler_declared AS d
WHERE t.name = d.name AND d.change IN ('rescheduled', 'activated');
SELECT change, name FROM temp.scheduler_declared WHERE change IS NOT NULL;
UPDATE scheduler_plugin_tasks SET active = 0, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE active AND target IS NULL AND name NOT IN (SELECT name FROM temp.scheduler_declared)
RETURNING 'retired' AS change, name;

-- name: plugin_runnable
DELETE FROM scheduler_runnable_targets
WHERE target NOT IN (SELECT value FROM json_each(:targets));
INSERT INTO scheduler_runnable_targets (target)
SELECT value FROM json_each(:targets) WHERE true
ON CONFLICT (target) DO UPDATE SET updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now');

-- name: plugin_abandon
UPDATE scheduler_plugin_runs
SET status = 'abandoned', finished_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), error = :reason
WHERE status = 'running' AND id NOT IN (SELECT value FROM json_each(:keep))
RETURNING name, slot, instance

-- name: plugin_claim
-- As on PostgreSQL (postgres.sql): the claim, then the window, which here sees the claim.
CREATE TEMP TABLE IF NOT EXISTS scheduler_claimed (
    name TEXT PRIMARY KEY, next TEXT, seen_trigger TEXT, run_slot TEXT, skip_slot TEXT);
DELETE FROM temp.scheduler_claimed;
INSERT INTO temp.scheduler_claimed (name, next, seen_trigger, run_slot, skip_slot)
SELECT t.name, json_extract(c.value, '$.next'), json_extract(c.value, '$.seen_trigger'),
       json_extract(c.value, '$.run_slot'), json_extract(c.value, '$.skip_slot')
FROM json_each(:claims) AS c
JOIN scheduler_plugin_tasks t
  ON t.name = json_extract(c.value, '$.name')
 AND julianday(t.next_run_at) = julianday(json_extract(c.value, '$.seen_next'))
WHERE t.active AND NOT t.paused
  AND (json_extract(c.value, '$.seen_definition') IS NULL
       OR json_extract(c.value, '$.seen_definition') = json_array(
           t.target, t.args, t.every_seconds, t.cron, t.timezone, t.timeout_seconds,
           t.misfire, t.jitter_seconds))
  AND (julianday(json_extract(c.value, '$.next')) = julianday(t.next_run_at)
       OR julianday(t.next_run_at) <= julianday('now'))
  AND (json_extract(c.value, '$.run_slot') IS NULL
       OR julianday(t.trigger_requested_at) IS julianday(json_extract(c.value, '$.seen_trigger')))
  AND (json_extract(c.value, '$.run_slot') IS NULL OR NOT EXISTS (
      SELECT 1 FROM scheduler_plugin_runs r WHERE r.name = t.name AND r.status = 'running'))
ON CONFLICT (name) DO NOTHING;
UPDATE scheduler_plugin_tasks AS t
SET next_run_at = c.next,
    trigger_requested_at = CASE
        WHEN julianday(t.trigger_requested_at) = julianday(c.seen_trigger) THEN NULL
        ELSE t.trigger_requested_at END,
    last_slot = coalesce(c.run_slot, t.last_slot),
    last_started_at = CASE WHEN c.run_slot IS NULL THEN t.last_started_at ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now') END,
    last_status = CASE WHEN c.run_slot IS NULL THEN t.last_status ELSE 'running' END,
    run_count = t.run_count + (c.run_slot IS NOT NULL),
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
FROM temp.scheduler_claimed AS c
WHERE t.name = c.name;
INSERT INTO scheduler_plugin_runs (name, slot, instance, status, finished_at)
SELECT name, slot, :instance, status, CASE WHEN status = 'running' THEN NULL ELSE strftime('%Y-%m-%dT%H:%M:%fZ', 'now') END
FROM (SELECT name, run_slot AS slot, 'running' AS status
      FROM temp.scheduler_claimed WHERE run_slot IS NOT NULL
      UNION ALL
      SELECT name, skip_slot, 'skipped_overlap'
      FROM temp.scheduler_claimed WHERE skip_slot IS NOT NULL)
WHERE true
ON CONFLICT DO NOTHING
RETURNING 'run' AS kind, id, name, slot, status;
WITH outlook AS (
    SELECT next_run_at AS slot FROM scheduler_plugin_tasks
    WHERE active AND NOT paused AND julianday(next_run_at) > julianday('now')
    ORDER BY julianday(next_run_at) LIMIT 1
),
seen AS (
    SELECT name FROM (
        SELECT name FROM scheduler_plugin_tasks
        WHERE active AND NOT paused
          AND julianday(next_run_at) <= max(julianday('now'),
                                            coalesce(julianday((SELECT slot FROM outlook)), 0))
                                        + :ahead / 86400.0
          AND name NOT IN (SELECT name FROM temp.scheduler_claimed)
        ORDER BY julianday(next_run_at) LIMIT :limit)
    UNION
    SELECT name FROM (
        SELECT name FROM scheduler_plugin_tasks
        WHERE active AND NOT paused AND trigger_requested_at IS NOT NULL
          AND name NOT IN (SELECT name FROM temp.scheduler_claimed)
        ORDER BY julianday(trigger_requested_at) LIMIT :limit)
),
window AS (
    SELECT name FROM (
        SELECT t.name FROM seen JOIN scheduler_plugin_tasks t USING (name)
        ORDER BY min(julianday(t.next_run_at),
                     coalesce(julianday(t.trigger_requested_at), julianday(t.next_run_at))),
                 t.name
        LIMIT :limit)
    UNION
    SELECT name FROM temp.scheduler_claimed
)
SELECT CASE WHEN t.name IN (SELECT name FROM temp.scheduler_claimed) THEN 'advanced'
            ELSE 'due' END AS kind,
       strftime('%Y-%m-%dT%H:%M:%fZ', 'now') AS now, t.name, t.next_run_at,
       t.trigger_requested_at,
       json_array(t.target, t.args, t.every_seconds, t.cron, t.timezone, t.timeout_seconds,
                  t.misfire, t.jitter_seconds) AS definition,
       t.target, t.args, t.every_seconds, t.cron, t.timezone, t.timeout_seconds,
       t.misfire, t.jitter_seconds
FROM window JOIN scheduler_plugin_tasks t USING (name)
WHERE t.active AND NOT t.paused
UNION ALL
SELECT 'outlook', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), NULL, (SELECT slot FROM outlook),
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL;

-- name: plugin_refuse
UPDATE scheduler_plugin_tasks AS t
SET paused = 1, last_status = 'failed', last_error = json_extract(r.value, '$.error'),
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
FROM json_each(:refused) AS r
WHERE t.name = json_extract(r.value, '$.name')
  AND (json_extract(r.value, '$.seen_next') IS NULL
       OR julianday(t.next_run_at) = julianday(json_extract(r.value, '$.seen_next')))
  AND (json_extract(r.value, '$.seen_definition') IS NULL
       OR json_extract(r.value, '$.seen_definition') = json_array(
           t.target, t.args, t.every_seconds, t.cron, t.timezone, t.timeout_seconds,
           t.misfire, t.jitter_seconds))
RETURNING name

-- name: plugin_finish
CREATE TEMP TABLE IF NOT EXISTS scheduler_finished (
    id INTEGER PRIMARY KEY, name TEXT, status TEXT, error TEXT, finished_at TEXT);
DELETE FROM temp.scheduler_finished;
INSERT INTO temp.scheduler_finished (id, name, status, error, finished_at)
SELECT p.id, p.name, json_extract(r.value, '$.status'), json_extract(r.value, '$.error'),
       json_extract(r.value, '$.finished_at')
FROM json_each(:results) AS r
JOIN scheduler_plugin_runs p ON p.id = json_extract(r.value, '$.id') AND p.status = 'running';
UPDATE scheduler_plugin_runs AS p
SET status = f.status, error = f.error, finished_at = f.finished_at
FROM temp.scheduler_finished AS f WHERE p.id = f.id;
UPDATE scheduler_plugin_tasks AS t
SET last_finished_at = f.finished_at, last_status = f.status, last_error = f.error,
    consecutive_failures = CASE WHEN f.status = 'succeeded' THEN 0
                                ELSE t.consecutive_failures + 1 END,
    paused = t.paused OR (f.status <> 'succeeded'
                          AND t.consecutive_failures + 1 >= :max_failures),
    -- As PostgreSQL's, the phase from the rowid (schedules made together: consecutive).
    history_trim_due = t.history_trim_due OR (t.run_count + t.rowid) % :trim_every = 0,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
FROM temp.scheduler_finished AS f
WHERE t.name = f.name
RETURNING name, consecutive_failures, paused, run_count;

-- name: plugin_trim
DELETE FROM scheduler_plugin_runs
WHERE status <> 'running' AND name IN (SELECT value FROM json_each(:names))
  AND slot <= (SELECT r.slot FROM scheduler_plugin_runs r
               WHERE r.name = scheduler_plugin_runs.name
               ORDER BY r.slot DESC LIMIT 1 OFFSET :keep)
RETURNING id

-- name: plugin_trim_due
SELECT name FROM scheduler_plugin_tasks WHERE history_trim_due ORDER BY name LIMIT :limit

-- name: plugin_trim_done
UPDATE scheduler_plugin_tasks SET history_trim_due = 0
WHERE name IN (SELECT value FROM json_each(:names)) AND history_trim_due

-- name: runs_maintain
-- SQLite's history is one table: its upkeep is deleting by age, oldest first. Of the
-- :limit lowest ids (the oldest runs: ids grow with started_at), those finished and
-- started more than :older_than seconds ago; a row per run deleted (the other parameters
-- are PostgreSQL's).
DELETE FROM scheduler_plugin_runs
WHERE id IN (SELECT id FROM scheduler_plugin_runs ORDER BY id LIMIT :limit)
  AND status <> 'running'
  AND julianday(started_at) < julianday('now') - :older_than / 86400.0
RETURNING 'purged' AS action, 'scheduler_plugin_runs' AS target, 1 AS rows

-- name: purge_publications
DELETE FROM scheduler_publications
WHERE id IN (SELECT id FROM scheduler_publications
             WHERE status <> 'scheduled'
               AND julianday(publish_at) < julianday('now') - :older_than / 86400.0
             ORDER BY julianday(publish_at) LIMIT :limit)
RETURNING id

-- name: tasks_list
SELECT name, schedule, next_run_at, active, paused, trigger_requested_at,
       consecutive_failures, last_slot, last_started_at, last_finished_at, last_status,
       last_error, run_count
FROM scheduler_plugin_tasks ORDER BY name

-- name: task_pause
UPDATE scheduler_plugin_tasks SET paused = 1,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = :name
RETURNING name

-- name: task_resume
UPDATE scheduler_plugin_tasks SET paused = 0, consecutive_failures = 0,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = :name
RETURNING name

-- name: task_trigger
UPDATE scheduler_plugin_tasks
SET trigger_requested_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = :name
RETURNING name

-- Publish loop.

-- name: publish_due
-- SQLite has one writer at a time (BEGIN IMMEDIATE), so no row locking is needed.
UPDATE scheduler_publications
SET status = 'published', published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    published_by = :instance, attempts = attempts + 1, last_error = NULL
WHERE id IN (
    SELECT id FROM scheduler_publications
    WHERE status = 'scheduled' AND julianday(publish_at) <= julianday('now')
    ORDER BY julianday(publish_at), id
    LIMIT :limit
)
RETURNING id, key, payload, publish_at, published_at

-- name: publish_due_ids
-- See the PostgreSQL query of the same name.
SELECT id FROM scheduler_publications
WHERE status = 'scheduled' AND julianday(publish_at) <= julianday('now')
ORDER BY julianday(publish_at), id
LIMIT :limit

-- name: publish_one
UPDATE scheduler_publications
SET status = 'published', published_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
    published_by = :instance, attempts = attempts + 1, last_error = NULL
WHERE id = :id AND status = 'scheduled'
RETURNING id, key, payload, publish_at, published_at

-- name: publication_fail
UPDATE scheduler_publications
SET status = 'failed', published_at = NULL, last_error = :error
WHERE id = :id

-- name: publication_undelivered
-- Its database effects were committed (published_at stays); its webhook never arrived.
UPDATE scheduler_publications
SET status = 'failed', last_error = :error
WHERE id = :id AND status = 'published'

-- name: next_due_in
-- SQLite has a single writer, so nothing due is ever skipped.
SELECT (min(julianday(publish_at)) - julianday('now')) * 86400.0 AS seconds,
       (julianday('now') - 2440587.5) * 86400.0 AS db_epoch,
       0 AS skipped
FROM scheduler_publications WHERE status = 'scheduled'

-- name: outbox_add
INSERT INTO scheduler_webhook_outbox (publication_id)
SELECT value FROM json_each(:ids)
WHERE true
ON CONFLICT (publication_id) DO NOTHING

-- name: outbox_due
SELECT o.publication_id AS id, o.attempts, p.key, p.payload, p.publish_at, p.published_at
FROM scheduler_webhook_outbox o
JOIN scheduler_publications p ON p.id = o.publication_id
WHERE o.status = 'pending' AND julianday(o.next_attempt_at) <= julianday('now')
ORDER BY julianday(o.next_attempt_at)
LIMIT :limit

-- name: outbox_delivered
UPDATE scheduler_webhook_outbox
SET status = 'delivered', attempts = attempts + 1,
    delivered_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), last_error = NULL
WHERE publication_id = :id AND status = 'pending'

-- name: outbox_retry
UPDATE scheduler_webhook_outbox
SET attempts = attempts + 1, last_error = :error,
    next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || :delay || ' seconds')
WHERE publication_id = :id AND status = 'pending'

-- name: outbox_failed
UPDATE scheduler_webhook_outbox
SET status = 'failed', attempts = attempts + 1, last_error = :error
WHERE publication_id = :id AND status = 'pending'

-- name: outbox_next_in
SELECT (min(julianday(next_attempt_at)) - julianday('now')) * 86400.0 AS seconds
FROM scheduler_webhook_outbox WHERE status = 'pending'

-- Runtime schedules: the same names, parameters and results as postgres.sql (see there).

-- name: schedule_lookup
SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now') AS now,
       EXISTS (SELECT 1 FROM scheduler_runnable_targets WHERE target = :target) AS runnable,
       t.name AS existing, t.target AS existing_target, t.source AS existing_source
FROM (SELECT 1) AS one
LEFT JOIN scheduler_plugin_tasks t ON t.name = :name

-- name: schedule_insert
INSERT INTO scheduler_plugin_tasks
    (name, source, target, args, schedule, every_seconds, cron, timezone, timeout_seconds,
     misfire, jitter_seconds, next_run_at)
VALUES (:name, 'runtime', :target, json(:args), :schedule, :every_seconds, :cron,
        :timezone, :timeout_seconds, :misfire, :jitter_seconds, :first)
ON CONFLICT (name) DO NOTHING
RETURNING name, source, target, args, schedule, every_seconds, cron, timezone,
          timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
          trigger_requested_at, consecutive_failures, last_slot, last_started_at,
          last_finished_at, last_status, last_error, run_count, created_at, updated_at

-- name: schedule_replace
UPDATE scheduler_plugin_tasks
SET target = :target, args = json(:args), schedule = :schedule,
    every_seconds = :every_seconds, cron = :cron, timezone = :timezone,
    timeout_seconds = :timeout_seconds, misfire = :misfire, jitter_seconds = :jitter_seconds,
    next_run_at = CASE WHEN :reschedule
                         OR every_seconds IS NOT :every_seconds
                         OR cron IS NOT :cron
                         OR timezone <> :timezone
                         OR jitter_seconds <> :jitter_seconds
                       THEN :first ELSE next_run_at END,
    updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
WHERE name = :name AND target IS NOT NULL
RETURNING name, source, target, args, schedule, every_seconds, cron, timezone,
          timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
          trigger_requested_at, consecutive_failures, last_slot, last_started_at,
          last_finished_at, last_status, last_error, run_count, created_at, updated_at

-- name: schedule_remove
DELETE FROM scheduler_plugin_tasks
WHERE name = :name AND target IS NOT NULL
RETURNING name, source, target, args, schedule, every_seconds, cron, timezone,
          timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
          trigger_requested_at, consecutive_failures, last_slot, last_started_at,
          last_finished_at, last_status, last_error, run_count, created_at, updated_at

-- name: schedule_get
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks WHERE name = :name

-- name: schedules_list
-- As in postgres.sql (a NULL :limit is no limit: LIMIT -1).
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name > coalesce(:after, '')
ORDER BY name
LIMIT coalesce(:limit, -1)

-- name: schedules_count
SELECT count(*) AS n FROM scheduler_plugin_tasks

-- The dashboard's schedules page, as in postgres.sql, on the primary key: its BINARY
-- collation is byte order already. (SQLite plans a statement once, whatever its
-- parameters: `:x IS NULL OR name > :x` would scan the whole index.)

-- name: dashboard_schedules_forward
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name >= :low AND name IS NOT :after
ORDER BY name
LIMIT :limit

-- name: dashboard_schedules_forward_below
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name >= :low AND name < :below AND name IS NOT :after
ORDER BY name
LIMIT :limit

-- name: dashboard_schedules_backward
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name >= :low
ORDER BY name DESC
LIMIT :limit

-- name: dashboard_schedules_backward_below
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name >= :low AND name < :below
ORDER BY name DESC
LIMIT :limit

-- name: dashboard_schedules_estimate
-- SQLite keeps no such statistics; counting the primary key is cheap here (a million
-- names in about 10 ms), so the count is exact.
SELECT count(*) AS schedules, 0 AS approximate FROM scheduler_plugin_tasks

-- name: dashboard_runs
-- As in postgres.sql (SQLite plans `:before IS NULL OR id < :before` as a scan from the
-- newest run down).
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs
WHERE id < coalesce(:before, 9223372036854775807)
ORDER BY id DESC
LIMIT :limit

-- name: dashboard_runs_failed
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs
WHERE id < coalesce(:before, 9223372036854775807)
  AND status IN ('failed', 'timed_out', 'abandoned')
ORDER BY id DESC
LIMIT :limit

-- name: dashboard_schedule_runs
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs
WHERE name = :name
ORDER BY slot DESC
LIMIT :limit

-- name: dashboard_run
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs WHERE id = :id

-- name: dashboard_publications_upcoming
-- As in postgres.sql, on the due index's (julianday(publish_at), id). SQLite reads a
-- range of an expression index from a plain comparison only, not from a row value's:
-- hence the first condition, which the second then refines.
SELECT * FROM scheduler_publications
WHERE status = 'scheduled'
  AND julianday(publish_at)
      >= coalesce((SELECT julianday(publish_at) FROM scheduler_publications WHERE id = :after),
                  -1e308)
  AND (julianday(publish_at), id)
      > (coalesce((SELECT julianday(publish_at) FROM scheduler_publications WHERE id = :after),
                  -1e308),
         coalesce(:after, 0))
ORDER BY julianday(publish_at), id
LIMIT :limit

-- name: dashboard_publications_recent
-- As in postgres.sql. (No index orders these by julianday(publish_at): each page sorts
-- the finished rows past its keyset, as it sorted them all before its OFFSET.)
SELECT * FROM scheduler_publications
WHERE status <> 'scheduled' AND (:status IS NULL OR status = :status)
  AND (julianday(publish_at), id)
      < (coalesce((SELECT julianday(publish_at) FROM scheduler_publications WHERE id = :before),
                  1e308),
         coalesce(:before, 0))
ORDER BY julianday(publish_at) DESC, id DESC
LIMIT :limit

-- name: dashboard_publication_lateness
SELECT (SELECT avg((julianday(published_at) - julianday(publish_at)) * 86400.0)
        FROM (SELECT published_at, publish_at FROM scheduler_publications
              WHERE status <> 'scheduled' AND published_at IS NOT NULL
              ORDER BY julianday(publish_at) DESC LIMIT :sample)) AS mean_lateness,
       (SELECT max((julianday(published_at) - julianday(publish_at)) * 86400.0)
        FROM (SELECT published_at, publish_at FROM scheduler_publications
              WHERE status <> 'scheduled' AND published_at IS NOT NULL
              ORDER BY julianday(publish_at) DESC LIMIT :sample)) AS max_lateness,
       (SELECT (julianday('now') - min(julianday(publish_at))) * 86400.0
        FROM scheduler_publications
        WHERE status = 'scheduled' AND julianday(publish_at) <= julianday('now')) AS oldest_due_wait

-- name: publication_retry
UPDATE scheduler_publications SET status = 'scheduled', published_at = NULL,
       published_by = NULL
WHERE id = :id AND status = 'failed'
RETURNING *
