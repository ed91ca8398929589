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
-- On a database never migrated the table is missing: the store answers None for that.
SELECT max(version) FROM scheduler_schema_version

-- name: version_table_exists
-- `migrate`'s first look, before any DDL: found through search_path, as the migrations'
-- own unqualified names are. Absent: never migrated, or in a schema this role may not use
-- (unusable_schemas tells which).
SELECT to_regclass('scheduler_schema_version') IS NOT NULL

-- name: migration_lock
-- Serialises `migrate` across replicas (MIGRATION_LOCK_KEY): a transaction-level lock on a
-- dedicated connection, so a replica that starts at the same moment waits, then finds
-- nothing to do.
SELECT pg_advisory_xact_lock($1)

-- name: migration_session_lock
-- A migration outside a transaction (CREATE INDEX CONCURRENTLY) takes its own lock, held by
-- the session from its first statement to its record: tried, never waited for (postgres.py
-- _apply_outside says why).
SELECT pg_try_advisory_lock($1)

-- name: migration_session_unlock
SELECT pg_advisory_unlock($1)

-- name: migration_lock_versions
-- A migration's first step: wait until no fenced transaction of a loop is in flight (each
-- reads the version in its first statement, which holds ACCESS SHARE on the table until it
-- ends), and make every later one wait for this migration and then see its version
-- (schema_gate.py). The wait is bounded by lock_timeout_local (MIGRATION_LOCK_TIMEOUT).
LOCK TABLE scheduler_schema_version IN ACCESS EXCLUSIVE MODE

-- name: migration_wake_leaders
-- Sent by a migration that applied something, delivered when it commits: every leader
-- listening (loops/publish.py, loops/plugin.py) ticks now, so an older replica's next
-- fenced transaction sees the new version and it hands its locks over at once, not at its
-- next planned tick. An empty payload means "look again" on both channels.
SELECT pg_notify('scheduler_publications_due', ''),
       pg_notify('scheduler_plugin_tasks_changed', '')

-- name: missing_grants
-- Checked by `run` and `preflight` after migrating (privileges.py): of the grants asked for
-- (kind $1[i], 'table', 'sequence', 'procedure' or 'function'; object $2[i], a procedure by
-- its signature, a function by its name; privilege $3[i]), those the current role lacks. An object that does not
-- exist counts as lacking (to_regclass gives NULL), which cannot happen after migrating.
SELECT r.kind, r.name, r.privilege, quote_ident(current_user) AS role
FROM unnest($1::text[], $2::text[], $3::text[]) AS r(kind, name, privilege)
WHERE NOT coalesce(CASE r.kind
    WHEN 'table' THEN has_table_privilege(to_regclass(r.name), r.privilege)
    WHEN 'sequence' THEN has_sequence_privilege(to_regclass(r.name), r.privilege)
    WHEN 'procedure' THEN has_function_privilege(to_regprocedure(r.name), r.privilege)
    WHEN 'function' THEN has_function_privilege(to_regproc(r.name), r.privilege)
END, false)
ORDER BY r.kind DESC, r.name, r.privilege

-- name: unusable_schemas
-- Where the scheduler's tables are when name lookup cannot see them: PostgreSQL leaves a
-- schema the role has no USAGE on out of its search_path, without a word.
SELECT quote_ident(n.nspname) AS schema, quote_ident(current_user) AS role
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = 'scheduler_schema_version' AND c.relkind = 'r'
  AND NOT has_schema_privilege(n.oid, 'USAGE')
ORDER BY n.nspname

-- name: statement_timeout_read
-- A statement given a timeout of its own (a SQL publisher's or task's: PgTx.execute) has
-- it for that statement only: in transaction mode several runs share one transaction
-- (savepoints), and a SET LOCAL would outlive the savepoint that made it. So the setting
-- is read, set (statement_timeout_local), and put back after the statement
-- (statement_timeout_restore).
SELECT current_setting('statement_timeout')

-- name: statement_timeout_local
-- milliseconds: the statement's timeout.
SET LOCAL statement_timeout = {milliseconds}

-- name: statement_timeout_restore
SELECT set_config('statement_timeout', $1, true)

-- name: schedule
INSERT INTO scheduler_publications (key, payload, publish_at)
VALUES ($1, $2::text::jsonb, $3)
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

-- name: publications_find
-- `scheduler-daemon publications list`: each condition applies unless its parameter is NULL.
-- $1 statuses, $2 due_after (inclusive), $3 due_before (exclusive), $4 key, $5 key prefix.
-- Read in publish_at order from the partial index of each status's rows (the due index,
-- the finished one, that of failed and cancelled: migration 0014), each read stopping at
-- $6 rows, then merged: one ORDER BY over the whole table sorted every row first (at 50
-- million finished publications, seconds).
WITH found AS (
    (SELECT * FROM scheduler_publications
     WHERE status = 'scheduled' AND ($1::text[] IS NULL OR 'scheduled' = ANY($1::text[]))
       AND ($2::timestamptz IS NULL OR publish_at >= $2::timestamptz)
       AND ($3::timestamptz IS NULL OR publish_at < $3::timestamptz)
       AND ($4::text IS NULL OR key = $4::text)
       AND ($5::text IS NULL OR left(key, length($5::text)) = $5::text)
     ORDER BY publish_at, id LIMIT $6)
    UNION ALL
    (SELECT * FROM scheduler_publications
     WHERE status = 'published' AND ($1::text[] IS NULL OR 'published' = ANY($1::text[]))
       AND ($2::timestamptz IS NULL OR publish_at >= $2::timestamptz)
       AND ($3::timestamptz IS NULL OR publish_at < $3::timestamptz)
       AND ($4::text IS NULL OR key = $4::text)
       AND ($5::text IS NULL OR left(key, length($5::text)) = $5::text)
     ORDER BY publish_at, id LIMIT $6)
    UNION ALL
    (SELECT * FROM scheduler_publications
     WHERE status IN ('failed', 'cancelled') AND ($1::text[] IS NULL OR status = ANY($1::text[]))
       AND ($2::timestamptz IS NULL OR publish_at >= $2::timestamptz)
       AND ($3::timestamptz IS NULL OR publish_at < $3::timestamptz)
       AND ($4::text IS NULL OR key = $4::text)
       AND ($5::text IS NULL OR left(key, length($5::text)) = $5::text)
     ORDER BY publish_at, id LIMIT $6)
)
SELECT * FROM found ORDER BY publish_at, id LIMIT $6

-- name: publication_stats
-- `status`, /status and the dashboard: rows waiting and due, each counted up to $1 (the
-- due index's first $1 entries; a count of $1 means at least that many: counting all of a
-- million reads them all at every refresh), and the next one due (its first entry).
SELECT (SELECT count(*) FROM (SELECT FROM scheduler_publications
                              WHERE status = 'scheduled' LIMIT $1) waiting) AS scheduled,
       (SELECT count(*) FROM (SELECT FROM scheduler_publications
                              WHERE status = 'scheduled' AND publish_at <= now()
                              LIMIT $1) due) AS due,
       (SELECT min(publish_at) FROM scheduler_publications
        WHERE status = 'scheduled') AS next_due

-- name: table_health
-- `status`, and /metrics at most every 30 s: per table named in $1 (in that order), its
-- size, estimated live and dead rows and vacuums, a partitioned table's summed over its
-- partitions (pg_inherits, recursively; its vacuum time is its least recently vacuumed
-- leaf's). And on every row, what holds the database's oldest xmin, past which no VACUUM
-- removes a dead row version from any of them: a session of this database (or a
-- walsender, whose hot_standby_feedback counts for every database), a prepared
-- transaction, or a replication slot's xmin (its catalog_xmin holds back the system
-- catalogs only, not these tables). An autovacuum worker's xmin holds back no other
-- VACUUM. held_for is how long the holder's transaction (or statement) has run: NULL for
-- a slot, and for another role's session without pg_read_all_stats, whose times are
-- hidden; timed_held_for is then that of the oldest holder whose time is known. One
-- statement, one round trip: statistics and file sizes, no table is read.
WITH RECURSIVE ours AS (
    SELECT t.name, to_regclass(t.name) AS root, t.position
    FROM unnest($1::text[]) WITH ORDINALITY AS t(name, position)
),
tree AS (
    SELECT name, root AS relid FROM ours WHERE root IS NOT NULL
    UNION ALL
    SELECT tree.name, i.inhrelid FROM tree JOIN pg_inherits i ON i.inhparent = tree.relid
),
sizes AS (
    SELECT tree.name,
           sum(pg_total_relation_size(tree.relid))::bigint AS total_bytes,
           coalesce(sum(s.n_live_tup), 0)::bigint AS live_rows,
           coalesce(sum(s.n_dead_tup), 0)::bigint AS dead_rows,
           -- (Of the partitions holding rows: days made ahead are empty, never vacuumed.)
           CASE WHEN bool_or(greatest(s.last_vacuum, s.last_autovacuum) IS NULL)
                     FILTER (WHERE c.relkind <> 'p'
                             AND coalesce(s.n_live_tup, 0) + coalesce(s.n_dead_tup, 0) > 0)
                THEN NULL
                ELSE min(greatest(s.last_vacuum, s.last_autovacuum))
                     FILTER (WHERE c.relkind <> 'p'
                             AND coalesce(s.n_live_tup, 0) + coalesce(s.n_dead_tup, 0) > 0)
           END AS last_vacuum,
           coalesce(sum(s.vacuum_count), 0)::bigint AS vacuum_count,
           coalesce(sum(s.autovacuum_count), 0)::bigint AS autovacuum_count
    FROM tree
    JOIN pg_class c ON c.oid = tree.relid
    LEFT JOIN pg_stat_user_tables s ON s.relid = tree.relid
    GROUP BY tree.name
),
holders AS (
    SELECT 'session' AS kind, a.application_name AS name, a.state, a.pid AS backend_pid,
           greatest(age(a.backend_xmin), age(a.backend_xid)) AS xmin_age,
           -- A walsender's xmin (hot_standby_feedback) has no start of its own: its
           -- query_start is when replication began, not when this xmin was taken.
           CASE WHEN a.backend_type = 'walsender' THEN NULL
                ELSE extract(epoch FROM now() - coalesce(a.xact_start, a.query_start))::float8
           END AS held_for
    FROM pg_stat_activity a
    WHERE (a.datname = current_database() OR a.backend_type = 'walsender')
      AND a.pid <> pg_backend_pid()
      AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
      AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    UNION ALL
    SELECT 'prepared transaction', p.gid, NULL, NULL, age(p.transaction),
           extract(epoch FROM now() - p.prepared)::float8
    FROM pg_prepared_xacts p
    WHERE p.database = current_database()
    UNION ALL
    SELECT 'replication slot', r.slot_name,
           CASE WHEN r.active THEN 'active' ELSE 'inactive' END, r.active_pid, age(r.xmin),
           NULL
    FROM pg_replication_slots r
    WHERE r.xmin IS NOT NULL
),
oldest AS (
    SELECT * FROM holders ORDER BY xmin_age DESC, held_for DESC NULLS LAST LIMIT 1
)
SELECT ours.name AS table_name, sizes.total_bytes, sizes.live_rows, sizes.dead_rows,
       CASE WHEN sizes.live_rows + sizes.dead_rows > 0
            THEN sizes.dead_rows::float8 / (sizes.live_rows + sizes.dead_rows) ELSE 0
       END AS dead_ratio,
       sizes.last_vacuum, extract(epoch FROM now() - sizes.last_vacuum)::float8 AS vacuum_age,
       sizes.vacuum_count, sizes.autovacuum_count,
       oldest.kind AS holder_kind, oldest.name AS holder_name, oldest.state AS holder_state,
       oldest.backend_pid AS holder_pid, oldest.xmin_age AS holder_xmin_age,
       oldest.held_for AS holder_held_for,
       (SELECT h.held_for FROM holders h WHERE h.held_for IS NOT NULL
        ORDER BY h.xmin_age DESC, h.held_for DESC LIMIT 1) AS timed_held_for
FROM ours
LEFT JOIN sizes USING (name)
LEFT JOIN oldest ON true
ORDER BY ours.position

-- name: fencing_next
-- A new leader's fencing token: larger than any before it for this loop, and never handed
-- out twice, not even across an asynchronous failover or a crash (migration 0007,
-- docs/leadership.md). Run by the new leader, holding the lock, in the transaction that
-- records it as leader (in transaction mode: every transaction that wins the lock).
-- `previous` is the last committed one. token = epoch * 2^40 + counter, where
-- - epoch grows by as much as the WAL timeline grew since the last token. A promotion
--   increments the timeline, so the new primary's tokens are above every token of the
--   old one, even those its standby never received. A timeline lower than the last
--   token's is a new cluster counting from 1 again (pg_upgrade, a restore): the epoch
--   grows by the whole timeline, never goes back. The timeline is the one WAL is written
--   on, read from the current WAL file's name: pg_control_checkpoint() still shows the
--   old timeline for as long as the first checkpoint after a promotion takes.
-- - counter is the loop's sequence plus 256 per second from 2000-01-01 to the server's
--   start (never less than under an earlier start), so a restarted server's tokens are
--   above every token drawn before its crash, even one whose transaction was still open
--   and whose sequence record was lost with it (unless the loop drew more than 256 tokens
--   a second since the earlier start, or the server's clock went back).
-- Both depend on the server and the last committed row only: a draw rolled back and drawn
-- again gets the same epoch and offset, and the sequence never gives a value twice.
-- A shard of a loop ('plugin/7') has a row of its own and draws from its loop's sequence:
-- its tokens grow with every change of its owner, and no two owners share one.
WITH previous AS (
    SELECT token, epoch, timeline, start_offset FROM scheduler_fencing WHERE loop = :loop
), server AS (
    SELECT ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::bigint AS timeline,
           (256 * extract(epoch FROM pg_postmaster_start_time() - timestamptz '2000-01-01Z'))::bigint
               AS start_offset
), drawn AS (
    SELECT coalesce(p.epoch, p.token >> 40, 0) + CASE
               WHEN p.timeline IS NULL THEN s.timeline  -- the first token drawn this way
               WHEN s.timeline >= p.timeline THEN s.timeline - p.timeline
               ELSE s.timeline END AS epoch,
           s.timeline, greatest(s.start_offset, p.start_offset) AS start_offset
    FROM server s LEFT JOIN previous p ON true
)
INSERT INTO scheduler_fencing AS f (loop, token, instance, epoch, timeline, start_offset)
SELECT :loop, (d.epoch << 40) + d.start_offset
           + nextval(format('scheduler_fencing_%s_seq', split_part(:loop::text, '/', 1))::regclass),
       :instance, d.epoch, d.timeline, d.start_offset
FROM drawn d
ON CONFLICT (loop) DO UPDATE SET
    token = EXCLUDED.token, instance = EXCLUDED.instance, changed_at = now(),
    draws = f.draws + 1,
    epoch = EXCLUDED.epoch, timeline = EXCLUDED.timeline, start_offset = EXCLUDED.start_offset
RETURNING token, (SELECT token FROM previous) AS previous

-- name: fencing_supersede
-- The other layout's fencing rows of a loop superseded, for a leader that takes it in
-- this layout (docs/leadership.md "Shards"): every shard's row (':loop/<n>', :rows NULL)
-- for an unsharded leader, and for the first member of a sharded layout (the shards of
-- another count, or of members gone); the loop's own row (:rows, the one name) for every
-- member that joins. Each row's token moves on by one, which waits for every transaction
-- still fenced by it (their FOR SHARE) and fails every later one, as a draw does; the
-- rows' owners, and draws, stay as they were. The next owner draws a token of its own
-- from the loop's sequence, which nobody held: it may not be above the row's superseded
-- value (that one no leader held either), and only equality counts in a fence. The rows
-- are locked in shard order first, as the
-- fence takes them, so the two never wait for each other in a cycle. The names of the
-- rows superseded.
WITH rows AS MATERIALIZED (
    SELECT loop FROM scheduler_fencing
    WHERE CASE WHEN :rows::text[] IS NULL THEN loop ~ ('^' || :loop::text || '/[0-9]+$')
               ELSE loop = ANY(:rows::text[]) END
    ORDER BY length(loop), loop
    FOR UPDATE
)
UPDATE scheduler_fencing f SET token = f.token + 1, changed_at = now()
FROM rows WHERE f.loop = rows.loop
RETURNING f.loop

-- name: leader_predecessor
-- Read by a new leader before it claims the row: the schema version (an older replica
-- granted the lock on a newer schema lets it go at once: schema_gate.py), and who led last
-- and did not hand over (a graceful release deletes the row; instance is NULL then).
SELECT (SELECT max(version) FROM scheduler_schema_version) AS schema_version,
       p.instance, p.hostname, p.pid
FROM (SELECT 1) AS one
LEFT JOIN scheduler_leaders p ON p.loop = :loop AND p.lock_key = :key

-- name: instance_sessions
-- Sessions of a daemon instance (its application_name prefix), other than ours, and how
-- many of them wait for advisory lock :key (the one we hold): those stand by for the loop,
-- so the instance's own leadership of it has ended. Its old lock session, which the
-- server may still list a moment after freeing the lock, held the lock: it does not wait.
-- A sharded member's watch (leadership/shards.py) does not count: it only waits for a
-- lock, does no work, and outlives a killed process until the server next checks its
-- socket.
SELECT count(*) AS n,
       count(*) FILTER (WHERE EXISTS (
           SELECT 1 FROM pg_locks l
           WHERE l.pid = a.pid AND l.locktype = 'advisory' AND NOT l.granted
             AND l.objsubid = 1
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND l.classid = ((:key::bigint >> 32) & 4294967295)::oid
             AND l.objid = (:key::bigint & 4294967295)::oid)) AS waiting
FROM pg_stat_activity a
WHERE left(a.application_name, length(:prefix)) = :prefix AND a.pid <> pg_backend_pid()
  AND a.application_name NOT LIKE '%/watch:%'

-- name: leader_claim
-- Run on the lock connection right after the lock is granted.
INSERT INTO scheduler_leaders
    (loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
     fencing_token)
VALUES (:loop, :key, :instance, :hostname, :pid, pg_backend_pid(), now(), now(), :token)
ON CONFLICT (loop, lock_key) DO UPDATE SET
    instance = EXCLUDED.instance,
    hostname = EXCLUDED.hostname, pid = EXCLUDED.pid, backend_pid = EXCLUDED.backend_pid,
    acquired_at = EXCLUDED.acquired_at, heartbeat_at = EXCLUDED.heartbeat_at,
    fencing_token = EXCLUDED.fencing_token
RETURNING backend_pid, acquired_at

-- name: leader_touch
-- Transaction mode: the tick's own transaction records who ran it. acquired_at only moves
-- when the instance changes, so it still says "leading since".
INSERT INTO scheduler_leaders AS l
    (loop, lock_key, instance, hostname, pid, backend_pid, acquired_at, heartbeat_at,
     fencing_token)
VALUES (:loop, :key, :instance, :hostname, :pid, pg_backend_pid(), now(), now(), :token)
ON CONFLICT (loop, lock_key) DO UPDATE SET
    hostname = EXCLUDED.hostname, pid = EXCLUDED.pid,
    backend_pid = EXCLUDED.backend_pid, heartbeat_at = EXCLUDED.heartbeat_at,
    acquired_at = CASE WHEN l.instance = EXCLUDED.instance THEN l.acquired_at
                       ELSE EXCLUDED.acquired_at END,
    instance = EXCLUDED.instance, fencing_token = EXCLUDED.fencing_token

-- name: lock_held
-- The heartbeat, on the lock connection itself: this session still holds the key, in the
-- lock manager's own view. Read-only, so an idle leader writes nothing (no WAL, no flush);
-- the round trip also restarts the session's idle_session_timeout, which is what ends a
-- leader that stops sending (see the session guard).
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid() AND objsubid = 1
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = ((:key::bigint >> 32) & 4294967295)::oid
      AND objid = (:key::bigint & 4294967295)::oid)

-- name: leader_release
DELETE FROM scheduler_leaders
WHERE loop = :loop AND lock_key = :key AND backend_pid = pg_backend_pid()

-- name: token_fence
-- Session mode: what follows BEGIN in every fenced transaction on a pooled connection
-- (leadership/session_lease.py), sent with it in one round trip. READ COMMITTED whatever the
-- database's default: the fence's locking read must see a successor's committed token.
-- A client frozen inside the transaction is cut off after stall_ms (lock.stall_timeout),
-- which ends its share lock on the fencing row; one killed mid-statement is noticed
-- within check_ms, not when the statement ends. Then scheduler_fence (migration 0015):
-- the loop's fencing row FOR SHARE, the token still ours, the schema not newer than this
-- build knows, or an error (SQLSTATE SDF01, SDF02).
SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
SET LOCAL idle_in_transaction_session_timeout = {stall_ms};
SET LOCAL client_connection_check_interval = {check_ms};
SELECT scheduler_fence({loop}, {token}, {newest})

-- name: shard_token_fence
-- A sharded member's fenced transaction on a pooled connection (leadership/shard_lease.py),
-- as token_fence for a loop: the same settings, then scheduler_fence_shards (migration
-- 0016): the member's lock session still a member, the fencing row of each shard asked
-- FOR SHARE, each token still the one given (the two arrays in the same order), the
-- schema not newer than this build knows, or an error (SDF01, DETAIL: the shards
-- superseded, or 'member'; SDF02).
SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
SET LOCAL idle_in_transaction_session_timeout = {stall_ms};
SET LOCAL client_connection_check_interval = {check_ms};
SELECT scheduler_fence_shards({loop}, {member_pid}, {member_class}, {member_objid},
                              {shards}::integer[], {tokens}::bigint[], {newest})

-- name: session_clean
-- After a task's or a publisher's SQL on a pooled connection (session mode), sent with
-- its COMMIT or ROLLBACK: the session state that SQL may have left behind, which the next
-- user of the connection must not inherit (asyncpg's own reset, kept for these alone:
-- the loops' bookkeeping leaves none). RESET ALL goes back to the connection's own
-- startup settings (its statement_timeout, application_name, keepalives).
SELECT pg_advisory_unlock_all();
CLOSE ALL;
UNLISTEN *;
RESET ALL

-- name: fence_compete
-- Transaction mode's fence (leadership/postgres_transaction.py), for deployments behind a
-- transaction pooler, where no session state survives a statement: the first statement of
-- every transaction that does a loop's work. This transaction takes the lock, or another
-- holds it (won is false: the tick is skipped, NotLeader); the lock ends with the
-- transaction, so the work and the lock commit or roll back together, which is the
-- fencing. Also the server backend's pid (behind a pooler, the client cannot know it; a
-- hold proves its lock by it, lock_entry), and the schema version, whose read holds ACCESS
-- SHARE on scheduler_schema_version until the transaction ends, as scheduler_fence's does
-- (schema_gate.py). One statement: no round trip added to a tick.
SELECT pg_try_advisory_xact_lock(:key) AS won, pg_backend_pid() AS backend,
       (SELECT max(version) FROM scheduler_schema_version) AS schema_version

-- name: lock_entry
-- Backend :backend_pid's entry for key :key in the lock manager: true (it holds the
-- lock), false (it waits for it), NULL (neither). The session fence after SQL ended its transaction early,
-- a transaction-mode hold's heartbeat (through the pool) and its hand-over ask this.
SELECT granted FROM pg_locks
WHERE locktype = 'advisory' AND pid = :backend_pid AND objsubid = 1
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid = ((:key::bigint >> 32) & 4294967295)::oid
  AND objid = (:key::bigint & 4294967295)::oid

-- Session mode's lock connection (leadership/postgres_session.py): its settings, and the
-- loop's session-level lock (key :key), taken, waited for, let go.

-- name: session_limits
-- The lock session's server-side limits (PostgreSQL 14 or later, checked at start), set
-- before it waits for the lock, so that a standby frozen just as it is granted the lock
-- is covered too (a waiting statement is not idle). client_connection_check_interval: a
-- leader killed mid-statement is noticed at once, not when the statement ends (holding
-- the lock until then). The idle timeouts are the stall eviction: a session that sends
-- nothing for stall_ms (lock.stall_timeout) is ended by the server, freeing its lock.
-- Three statements, one round trip.
SET client_connection_check_interval = 1000;
SET idle_session_timeout = {stall_ms};
SET idle_in_transaction_session_timeout = {stall_ms}

-- name: lock_try
-- standby = "poll": the lock if it is free now, else false (tried every lock.poll_interval).
SELECT pg_try_advisory_lock(:key)

-- name: statement_timeout_off
-- Before lock_wait (and a shard member's watch, before shard_watch): the wait lasts until
-- the lock is granted, however long that is.
SET statement_timeout = 0

-- name: lock_wait
-- standby = "wait": one statement, granted the moment the leader's session ends. A waiting
-- standby sends nothing and costs the database nothing but its connection. It waits in
-- slices of :slice_ms ms (migration 0010 says why): a plain
-- `SELECT pg_advisory_lock(:key)` would hold the database's xmin horizon for as long as it
-- waits, and no VACUUM could remove a dead row meanwhile.
CALL scheduler_wait_for_lock(:key, :slice_ms)

-- name: statement_timeout_reset
-- After lock_wait: back to the value the session started with (database.statement_timeout,
-- set when it connected).
RESET statement_timeout

-- name: lock_unlock
-- A graceful hand-over, after leader_release: whoever waits next is granted the lock now.
SELECT pg_advisory_unlock(:key)

-- Transaction mode (leadership/postgres_transaction.py): nothing may be set for the
-- session behind a pooler, so each transaction makes its own settings (SET LOCAL).

-- name: transaction_limits
-- Every fenced transaction's, before fence_compete: a client frozen inside it is cut off
-- by the server after stall_ms (lock.stall_timeout), which aborts the transaction and
-- frees the lock; statement_ms is database.statement_timeout. Two statements, one round
-- trip.
SET LOCAL idle_in_transaction_session_timeout = {stall_ms};
SET LOCAL statement_timeout = {statement_ms}

-- name: backend_pid
-- This connection's server backend: a hand-over hold's, to find its own entry in the lock
-- manager (lock_entry); a shard member's lock session's, which the key of its member lock
-- carries; and the pooler probe's (db/pooler.py), which asks on one connection
-- several times: behind a transaction pooler the answer changes.
SELECT pg_backend_pid()

-- name: hold_queue
-- A hand-over hold queues for the lock that the tick which claimed its work holds: when
-- that transaction commits, the server grants the lock to this one in the same step, and
-- nobody can take it in between. The wait is bounded by lock_timeout_local.
SELECT pg_advisory_xact_lock(:key)

-- name: lock_timeout_local
-- How long this transaction's statements wait for a lock, milliseconds: a hand-over
-- hold's queue (lock.stall_timeout); a migration's lock on the version table
-- (MIGRATION_LOCK_TIMEOUT, then it rolls back and is retried).
SET LOCAL lock_timeout = {milliseconds}

-- name: lock_timeout_default
-- A hand-over hold, once granted: its own statements wait for locks as any others do.
SET LOCAL lock_timeout = DEFAULT

-- name: lock_sessions
-- Who holds and who waits for a loop's lock, straight from the lock manager. A leader's
-- heartbeat is the holder's last sign of life: now while it runs a statement, else when
-- its last one ended (it holds our lock, so its activity is ours), or the last one
-- recorded (transaction mode's ticks write heartbeat_at).
SELECT l.pid, l.granted, a.application_name, a.backend_start, a.state,
       host(a.client_addr) AS client_addr,
       s.instance, s.hostname, s.pid AS os_pid, s.acquired_at, h.heartbeat_at,
       extract(epoch FROM now() - h.heartbeat_at)::float8 AS heartbeat_age, s.fencing_token
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN scheduler_leaders s
    ON s.loop = $1 AND s.lock_key = $2 AND s.backend_pid = l.pid
CROSS JOIN LATERAL (SELECT greatest(s.heartbeat_at,
    CASE WHEN s.backend_pid IS NULL OR NOT l.granted THEN NULL
         WHEN a.state = 'active' THEN now() ELSE a.state_change END) AS heartbeat_at) h
WHERE l.locktype = 'advisory' AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = (($2::bigint >> 32) & 4294967295)::oid
  AND l.objid = ($2::bigint & 4294967295)::oid
ORDER BY l.granted DESC, a.backend_start

-- name: leaders
-- The recorded leaders, each with its lock session's last sign of life (see lock_sessions).
SELECT s.loop, s.lock_key, s.instance, s.hostname, s.pid, s.backend_pid, s.acquired_at,
       h.heartbeat_at, extract(epoch FROM now() - h.heartbeat_at)::float8 AS heartbeat_age,
       s.fencing_token
FROM scheduler_leaders s
LEFT JOIN pg_stat_activity a ON a.pid = s.backend_pid
CROSS JOIN LATERAL (SELECT greatest(s.heartbeat_at,
    CASE WHEN a.pid IS NULL OR a.application_name NOT LIKE '%/lock:%' THEN NULL
         WHEN a.state = 'active' THEN now() ELSE a.state_change END) AS heartbeat_at) h
ORDER BY s.loop

-- Sharded leadership (leadership/shards.py). Its locks use the two-key advisory lock space
-- (objsubid 2): shard s is (shard class, s); a member holds (member class, layout << 22 |
-- its lock session's backend pid), so the lock manager alone lists the members, the
-- shard count each was started with, and who holds which shard. Keys travel as bigint
-- (oid values); each query casts them.

-- name: shard_layouts
-- Run by a joining member under the join gate: members started with another shard count
-- (their layout differs from $2). Two counts at once would give one schedule two shards.
SELECT count(*) AS others, min((l.objid::bigint >> 22) + 1) AS other_count
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = $1::bigint::oid AND (l.objid::bigint & 4194303) = l.pid
  AND (l.objid::bigint >> 22) <> $2

-- name: shard_members
-- The members (kind 'member': its backend pid, application_name) and the shards' holders
-- (kind 'shard': the shard, its holder's backend pid), straight from the lock manager. A
-- member lock is counted only held by the session whose pid it names: a member watching
-- another (leadership/shards.py) holds that one's lock for an instant after it died.
SELECT 'member' AS kind, l.pid, a.application_name, NULL::int AS shard
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = $1::bigint::oid AND (l.objid::bigint & 4194303) = l.pid
  AND (l.objid::bigint >> 22) = $3
UNION ALL
SELECT 'shard', l.pid, NULL, l.objid::int
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = $2::bigint::oid AND l.objid::bigint < $4

-- name: shard_member_state
-- A sharded member's heartbeat: whether backend :backend_pid still holds its member lock
-- (:member_class, :member_objid), which shards of class :shard_class it holds, and the
-- members' pids (a change says: rebalance).
-- Read-only, as lock_held.
WITH mine AS (
    SELECT l.classid::bigint AS classid, l.objid::bigint AS objid FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted AND l.pid = :backend_pid
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
)
SELECT jsonb_build_object(
    'member', EXISTS (SELECT 1 FROM mine WHERE classid = :member_class AND objid = :member_objid),
    'shards', coalesce((SELECT jsonb_agg(objid ORDER BY objid) FROM mine
                        WHERE classid = :shard_class AND objid < 4194304), '[]'::jsonb),
    'members', coalesce((
        SELECT jsonb_agg(l.pid ORDER BY l.pid) FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = :member_class::bigint::oid AND (l.objid::bigint & 4194303) = l.pid),
        '[]'::jsonb))

-- name: shard_try_lock
-- The shards of :shards this session could take now (class :shard_class), each now held by it.
SELECT array_agg(s ORDER BY s) AS taken FROM unnest(:shards::int[]) AS s
WHERE pg_try_advisory_lock(:shard_class::bigint::int, s)

-- name: shard_stale_leaders
-- Leaders of loop :loop, unsharded (loop :loop) or of a shard (':loop/<n>'; shard class
-- :shard_class), whose recorded lock session no longer holds what it led, and which did not hand over (a
-- hand-over deletes its row): the predecessors a new holder must wait for, whatever
-- layout they ran with.
SELECT r.loop, r.instance, r.hostname, r.pid, r.backend_pid
FROM scheduler_leaders r
WHERE (r.loop = :loop OR r.loop LIKE :loop || '/%')
  AND NOT EXISTS (
      SELECT 1 FROM pg_locks l
      WHERE l.locktype = 'advisory' AND l.granted AND l.pid = r.backend_pid
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND ((l.objsubid = 2 AND l.classid = :shard_class::bigint::oid AND :loop || '/' || l.objid = r.loop)
             OR (l.objsubid = 1 AND r.loop = :loop
                 AND l.classid = ((r.lock_key >> 32) & 4294967295)::oid
                 AND l.objid = (r.lock_key & 4294967295)::oid)))

-- name: leaders_forget
-- The rows of leaders waited for (loop :loops[i], lock session :backend_pids[i]): nobody
-- waits again.
DELETE FROM scheduler_leaders r
USING unnest(:loops::text[], :backend_pids::int[]) AS f(loop, backend_pid)
WHERE r.loop = f.loop AND r.backend_pid IS NOT DISTINCT FROM f.backend_pid

-- name: shard_leaders_release
-- A graceful hand-over of shards :shards, committed before their locks are let go: the next
-- owner finds no leader row, so it knows there is nobody to wait for.
DELETE FROM scheduler_leaders
WHERE loop = ANY(SELECT 'plugin/' || s FROM unnest(:shards::int[]) AS s)
  AND backend_pid = pg_backend_pid()

-- name: shard_unlock
SELECT count(*) FILTER (WHERE pg_advisory_unlock(:shard_class::bigint::int, s)) AS released
FROM unnest(:shards::int[]) AS s

-- name: shard_owners
-- `status`: every shard of the plugin loop ($2 of them, class $1), who holds it (from the
-- lock manager), the leader row its holder wrote, and how often it changed hands.
SELECT s.shard, l.pid AS backend_pid, a.application_name, host(a.client_addr) AS client_addr,
       r.instance, r.hostname, r.pid AS os_pid, r.acquired_at, r.fencing_token,
       coalesce(f.draws, 0) AS changes
FROM generate_series(0, $2 - 1) AS s(shard)
LEFT JOIN pg_locks l
    ON l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.classid = $1::bigint::oid AND l.objid::bigint = s.shard
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
LEFT JOIN scheduler_leaders r ON r.loop = 'plugin/' || s.shard AND r.backend_pid = l.pid
LEFT JOIN scheduler_fencing f ON f.loop = 'plugin/' || s.shard
ORDER BY s.shard

-- Plugin loop (db/plugin_store.py calls these with named parameters, :name). Everything
-- here runs inside the tick's fenced transaction. Batches arrive as JSON arrays of
-- objects, one statement per batch whatever its size.
--
-- Sharded (plugin.shards > 1), a transaction is scoped to the shards its fence holds:
-- :owned is a JSON array of {shard, token}, :k the shard count (NULL owned: every
-- schedule, one leader). A schedule is in shard shard_hash % :k. Each statement that
-- claims or records checks every shard's fencing token against scheduler_fencing (the
-- shard's epoch, drawn by its owner when it took the shard): a statement of an owner that
-- has been replaced does nothing for that shard, whatever its connection still holds.
--
-- Row locks. An UPDATE locks each row it changes as its plan reaches it: an UPDATE ...
-- FROM jsonb_to_recordset(...) in its join's order (the batch's, the table's, an index's:
-- the planner's choice), an operator's bulk UPDATE in its scan's. Two statements that lock
-- rows of one table in different orders can deadlock, and PostgreSQL aborts one of them
-- (an operator's bulk UPDATE of 1,000 schedules and a result batch did, in a benchmark).
-- Two that lock in the same order cannot: the second waits for the first. So every
-- statement here that writes several rows of scheduler_plugin_tasks locks them first, in
-- name order, in a CTE `locked`: the batch joined to its schedules' rows, ORDER BY name
-- FOR NO KEY UPDATE OF t (the lock the UPDATE itself takes), MATERIALIZED (run once, in
-- that order). The UPDATE then takes its batch from `locked` (FROM locked, where it had
-- FROM the batch), so each row it changes has come out of `locked` before: it is locked
-- already, and the UPDATE takes no lock of its own, in no other order. Which rows change
-- is still the UPDATE's own WHERE: `locked` keeps the batch's rows whose schedule exists
-- (and is in the shard scope), and decides nothing else; where it repeats the UPDATE's
-- conditions (a declaration's, the trims'), that is only to lock no more than will
-- change, and it checks them on the newest version too. Nor does waiting there change an
-- outcome: the statement's snapshot is older than the change it waited for, so the UPDATE
-- finds the row changed and checks its WHERE again on the newest version, as it would
-- have had it waited itself (READ COMMITTED; the claim's compare-and-set relies on it). A
-- row locked and not changed (a claim whose compare-and-set fails) stays locked until the
-- transaction ends, a moment later. Operators are asked to lock in name order too
-- (docs/operations.md, "Changing many schedules in one statement"); tests/test_lock_order.py
-- runs their statement beside each of these.
--
-- Across the two tables, runs before schedules: a result batch locks its runs' rows, then
-- their schedules'; the claim locks schedules and only inserts runs (new rows, which no
-- one else waits for). A running run's row is written by one statement at a time: by the
-- batch that ran it (an abandon passes over the runs in flight, and a new leader's fence
-- waits for the old leader's transactions to end), so those are left in their join's
-- order. Where one transaction locks schedules in more than one statement (a takeover's
-- declaration, or a refusal, then the claim, where they share a transaction), each
-- statement's are in name order, not all of them together: a bulk change over both could
-- still deadlock with it, rarely (a changed declaration, a refused row), and fail a tick.

-- Self-fenced statements. Session mode runs a tick's claim, a refusal and a result batch
-- each as one statement outside a transaction (leadership/session_lease.py, one round trip):
-- such a statement fences itself in its first CTE, `fence`, with scheduler_fence (the
-- loop's fencing row FOR SHARE until the statement commits, its token still the caller's;
-- migration 0015), and writes nothing unless `fence` says so. In a transaction already
-- fenced (the other modes, a sharded member, a takeover's transaction) :fence_loop is NULL.

-- name: now
SELECT now() AS now

-- name: plugin_stats
-- `status`: the plugin loop's backlog (schedules due, counted up to :limit: a count of
-- :limit means at least that many; a backlog of a million read whole took 0.2 to 1 s),
-- its lag (the oldest due slot's age) and the next slot, each from the due index's first
-- entries.
SELECT (SELECT count(*) FROM (SELECT FROM scheduler_plugin_tasks
                              WHERE active AND NOT paused AND next_run_at <= now()
                              LIMIT :limit) due) AS due,
       extract(epoch FROM now() - (SELECT min(next_run_at) FROM scheduler_plugin_tasks
                                   WHERE active AND NOT paused
                                     AND next_run_at <= now()))::float8 AS lag,
       (SELECT min(next_run_at) FROM scheduler_plugin_tasks
        WHERE active AND NOT paused AND NOT (next_run_at <= now())) AS next_run_at

-- name: plugin_declare
-- A leader's first tick: the deployment's declared tasks (config, plugins, built-ins) as
-- rows, each known task keeping its next_run_at (a restart must not reschedule) unless its
-- schedule changed; declared rows no longer declared go inactive and keep their state.
-- Runtime schedules (target set) are the application's: never touched here.
WITH input AS (
    SELECT * FROM jsonb_to_recordset(:tasks::text::jsonb)
        AS i(name text, schedule text, first timestamptz, source text)
),
before AS (
    SELECT t.name, t.schedule, t.active, t.target FROM scheduler_plugin_tasks t
    JOIN input USING (name)
),
inserted AS (
    INSERT INTO scheduler_plugin_tasks (name, schedule, next_run_at, source)
    SELECT name, schedule, first, source FROM input
    ON CONFLICT (name) DO NOTHING
    RETURNING name
),
-- Row locks (above): the rows `changed` and `retired` change, together, in name order.
-- Their own conditions, so that a takeover that changes nothing locks nothing.
locked AS MATERIALIZED (
    SELECT t.name, i.name IS NOT NULL AS declared, i.schedule, i.first, i.source
    FROM scheduler_plugin_tasks t LEFT JOIN input i ON i.name = t.name
    WHERE t.target IS NULL
      AND CASE WHEN i.name IS NULL THEN t.active  -- to retire (below)
               ELSE t.schedule <> i.schedule OR NOT t.active OR t.source <> i.source END
    ORDER BY t.name
    FOR NO KEY UPDATE OF t
),
changed AS (
    UPDATE scheduler_plugin_tasks t
    SET schedule = i.schedule, source = i.source, active = true, updated_at = now(),
        next_run_at = CASE WHEN t.schedule <> i.schedule THEN i.first ELSE t.next_run_at END
    FROM locked i
    WHERE t.name = i.name AND i.declared AND t.target IS NULL
      AND (t.schedule <> i.schedule OR NOT t.active OR t.source <> i.source)
    RETURNING t.name
),
retired AS (
    UPDATE scheduler_plugin_tasks t SET active = false, updated_at = now()
    FROM locked l
    WHERE t.name = l.name AND NOT l.declared
      AND t.active AND t.target IS NULL AND t.name NOT IN (SELECT name FROM input)
    RETURNING t.name
)
SELECT 'registered' AS change, name FROM inserted
UNION ALL
SELECT CASE WHEN b.schedule <> i.schedule THEN 'rescheduled' ELSE 'activated' END, c.name
FROM changed c JOIN before b USING (name) JOIN input i USING (name)
UNION ALL
SELECT 'shadowed', b.name FROM before b WHERE b.target IS NOT NULL
UNION ALL
SELECT 'retired', name FROM retired

-- name: plugin_runnable
-- The targets runtime schedules may name: this leader's declaration replaces the last.
WITH input AS (SELECT jsonb_array_elements_text(:targets::text::jsonb) AS target),
gone AS (
    DELETE FROM scheduler_runnable_targets
    WHERE target NOT IN (SELECT target FROM input)
)
INSERT INTO scheduler_runnable_targets (target)
SELECT target FROM input
ON CONFLICT (target) DO UPDATE SET updated_at = now()

-- name: plugin_abandon
-- Run by whoever holds the lock while none of its own runs is in flight (a sticky leader
-- taking over; in transaction mode every tick that wins the lock). Runs execute only while
-- their replica holds the lock, so a run still marked running is not executing anywhere:
-- it can never record its result. Except the caller's own runs (:keep): after losing a
-- hold, a replica may win the next tick while its runs of the lost hold are still being
-- stopped; whichever other replica wins closes them, and waits for them to stop.
WITH current_shards AS (
    SELECT o.shard FROM jsonb_to_recordset(:owned::text::jsonb) AS o(shard int, token bigint)
    JOIN scheduler_fencing f ON f.loop = 'plugin/' || o.shard AND f.token = o.token
)
UPDATE scheduler_plugin_runs
SET status = 'abandoned', finished_at = now(), error = :reason
WHERE status = 'running' AND NOT (id = ANY(:keep::bigint[]))
  AND (:owned::text IS NULL
       OR scheduler_shard_hash(name) % :k IN (SELECT shard FROM current_shards))
RETURNING name, slot, instance

-- name: plugin_claim
-- A tick's one statement: claim what the tick planned (perhaps nothing), and read what the
-- next tick plans from (the window). The claim first, the whole batch at once: advance
-- each schedule's next_run_at by compare-and-set on what was read (its slot, its
-- definition: a change made meanwhile wins, and is read again below), consume the
-- trigger it saw, and insert its (name, slot) runs. The unique (name, slot) is the
-- guarantee that a slot runs once, whatever the leaders think. One run in flight per
-- schedule: the claim finds none running, and compares-and-sets the schedule's row on
-- next_run_at and, if it starts a run, on the trigger it saw, so that of two claims of one
-- schedule the second waits on the row and then finds it changed (a claim that starts a
-- run moves next_run_at or consumes the trigger). A tick may plan from a window read by an
-- earlier statement, on its own estimate of the database's clock, so a claim never
-- advances a schedule before its slot by this clock (it is read again instead). The clock
-- is the statement's (statement_timestamp()): in a transaction now() is its start, which
-- may be before a slot this statement finds due, and a run's started_at never is.
--
-- The window, O(due), never O(schedules): what is due (its slot passed, or a trigger
-- waits), oldest first, so that however far behind the leader is no schedule starves,
-- then what falls due within :ahead seconds of the next slot to come (the next tick's
-- work, which it then claims in one round trip); at most :limit rows read, plus the
-- schedules this statement advanced, as they are now (the rest of the statement sees the
-- rows as they were): kind 'due' and 'advanced'. 'outlook': the database's now (the
-- statement's: in a transaction, later than now()) and the next slot to come.
WITH fence AS MATERIALIZED (  -- Self-fenced (above)
    SELECT CASE WHEN :fence_loop::text IS NULL THEN true
                ELSE scheduler_fence(:fence_loop::text, :fence_token::bigint,
                                     :fence_newest::integer) END AS ok
),
claim AS (
    SELECT * FROM jsonb_to_recordset(:claims::text::jsonb)
        AS c(name text, seen_next timestamptz, seen_definition text, next timestamptz,
             seen_trigger timestamptz, run_slot timestamptz, skip_slot timestamptz)
),
owned AS (
    SELECT o.shard FROM jsonb_to_recordset(:owned::text::jsonb) AS o(shard int, token bigint)
),
current_shards AS (  -- the shards whose token is still the caller's
    SELECT o.shard FROM jsonb_to_recordset(:owned::text::jsonb) AS o(shard int, token bigint)
    JOIN scheduler_fencing f ON f.loop = 'plugin/' || o.shard AND f.token = o.token
),
-- Row locks (above): the claims whose schedules are in scope, each schedule's row locked,
-- in name order, before `advanced` changes any. By name and shard only: the compare-and-
-- set is still `advanced`'s, on each row's newest version (a claim that waited here for a
-- change of next_run_at, the trigger or the pause does nothing for that schedule: looked
-- at again next tick).
locked AS MATERIALIZED (
    SELECT c.* FROM scheduler_plugin_tasks t JOIN claim c ON c.name = t.name
    WHERE (SELECT ok FROM fence)
      AND (:owned::text IS NULL OR t.shard_hash % :k IN (SELECT shard FROM current_shards))
    ORDER BY t.name
    FOR NO KEY UPDATE OF t
),
advanced AS (
    UPDATE scheduler_plugin_tasks t
    SET next_run_at = c.next,
        trigger_requested_at = CASE WHEN t.trigger_requested_at = c.seen_trigger THEN NULL
                                    ELSE t.trigger_requested_at END,
        last_slot = coalesce(c.run_slot, t.last_slot),
        last_started_at = CASE WHEN c.run_slot IS NULL THEN t.last_started_at
                               ELSE statement_timestamp() END,
        last_status = CASE WHEN c.run_slot IS NULL THEN t.last_status ELSE 'running' END,
        run_count = t.run_count + (c.run_slot IS NOT NULL)::int,
        updated_at = statement_timestamp()
    FROM locked c
    WHERE t.name = c.name AND t.next_run_at = c.seen_next AND t.active AND NOT t.paused
      AND (c.seen_definition IS NULL OR c.seen_definition = md5(json_build_array(
          t.target, t.args, t.every_seconds, t.cron, t.timezone, t.timeout_seconds,
          t.misfire, t.jitter_seconds)::text))
      AND (c.next = c.seen_next OR c.seen_next <= statement_timestamp())
      -- A claim that starts a run saw the trigger it consumes (or none): still the same.
      AND (c.run_slot IS NULL OR t.trigger_requested_at IS NOT DISTINCT FROM c.seen_trigger)
      AND (:owned::text IS NULL OR t.shard_hash % :k IN (SELECT shard FROM current_shards))
      -- Never past a run still `running`: the schedule stays due until that run is closed.
      AND (c.run_slot IS NULL OR NOT EXISTS (
          SELECT 1 FROM scheduler_plugin_runs r WHERE r.name = t.name AND r.status = 'running'))
    RETURNING t.*
),
inserted AS (
    INSERT INTO scheduler_plugin_runs (name, slot, instance, status, started_at, finished_at)
    SELECT name, slot, :instance::text, status, statement_timestamp(),
           CASE WHEN status = 'running' THEN NULL ELSE statement_timestamp() END
    FROM (SELECT c.name, c.run_slot AS slot, 'running' AS status
          FROM claim c JOIN advanced USING (name) WHERE c.run_slot IS NOT NULL
          UNION ALL
          SELECT c.name, c.skip_slot, 'skipped_overlap'
          FROM claim c JOIN advanced USING (name) WHERE c.skip_slot IS NOT NULL) AS slots
    ON CONFLICT DO NOTHING
    RETURNING id, name, slot, status
),
outlook AS (
    SELECT min(next_run_at) AS slot FROM (
        SELECT next_run_at FROM scheduler_plugin_tasks
        WHERE active AND NOT paused AND next_run_at > statement_timestamp()
          AND (:owned::text IS NULL OR shard_hash % :k IN (SELECT shard FROM owned))
          AND name NOT IN (SELECT name FROM advanced)
        ORDER BY next_run_at LIMIT 1) AS first
),
seen AS (
    (SELECT name FROM scheduler_plugin_tasks
     WHERE active AND NOT paused
       AND next_run_at <= greatest(statement_timestamp(), (SELECT slot FROM outlook))
                          + make_interval(secs => :ahead::float8)
       AND (:owned::text IS NULL OR shard_hash % :k IN (SELECT shard FROM owned))
       AND name NOT IN (SELECT name FROM advanced)
     ORDER BY next_run_at LIMIT :limit)
    UNION
    (SELECT name FROM scheduler_plugin_tasks
     WHERE active AND NOT paused AND trigger_requested_at IS NOT NULL
       AND (:owned::text IS NULL OR shard_hash % :k IN (SELECT shard FROM owned))
       AND name NOT IN (SELECT name FROM advanced)
     ORDER BY trigger_requested_at LIMIT :limit)
),
window_rows AS (
    (SELECT 'due' AS kind, t.* FROM seen JOIN scheduler_plugin_tasks t USING (name)
     ORDER BY least(t.next_run_at, t.trigger_requested_at), t.name
     LIMIT :limit)
    UNION ALL
    SELECT 'advanced', * FROM advanced WHERE active AND NOT paused
)
SELECT w.kind, statement_timestamp() AS now, NULL::bigint AS id, w.name, NULL::timestamptz AS slot,
       NULL::text AS status, w.next_run_at, w.trigger_requested_at,
       md5(json_build_array(w.target, w.args, w.every_seconds, w.cron, w.timezone,
                            w.timeout_seconds, w.misfire, w.jitter_seconds)::text) AS definition,
       w.target, w.args::text AS args, w.every_seconds, w.cron, w.timezone,
       w.timeout_seconds, w.misfire, w.jitter_seconds,
       CASE WHEN :owned::text IS NULL THEN NULL ELSE w.shard_hash % :k END AS shard
FROM window_rows w
UNION ALL
SELECT 'run', statement_timestamp(), i.id, i.name, i.slot, i.status, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL
FROM inserted i
UNION ALL
SELECT 'outlook', statement_timestamp(), NULL, NULL, NULL, NULL, (SELECT slot FROM outlook), NULL, NULL,
       NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL

-- name: plugin_refuse
-- Runtime schedules this leader cannot run (a target it does not declare runnable, a
-- schedule it cannot read): paused, with the reason, until an operator resumes them.
WITH fence AS MATERIALIZED (  -- Self-fenced (above)
    SELECT CASE WHEN :fence_loop::text IS NULL THEN true
                ELSE scheduler_fence(:fence_loop::text, :fence_token::bigint,
                                     :fence_newest::integer) END AS ok
),
refused AS (
    SELECT * FROM jsonb_to_recordset(:refused::text::jsonb)
        AS r(name text, error text, seen_next timestamptz, seen_definition text)
),
locked AS MATERIALIZED (  -- Row locks (above)
    SELECT r.* FROM scheduler_plugin_tasks t JOIN refused r ON r.name = t.name
    WHERE (SELECT ok FROM fence)
    ORDER BY t.name
    FOR NO KEY UPDATE OF t
)
UPDATE scheduler_plugin_tasks t
SET paused = true, last_status = 'failed', last_error = r.error, updated_at = now()
FROM locked r
WHERE t.name = r.name
  -- Refused as it was read: not once it changed (fixed by someone, say) since.
  AND (r.seen_next IS NULL OR t.next_run_at = r.seen_next)
  AND (r.seen_definition IS NULL OR r.seen_definition = md5(json_build_array(
      t.target, t.args, t.every_seconds, t.cron, t.timezone, t.timeout_seconds,
      t.misfire, t.jitter_seconds)::text))
RETURNING t.name

-- name: plugin_finish
-- A batch of results: each run's row, then its schedule's last_* columns, failure count
-- and auto-pause (set-based: one statement, whatever the batch holds). A run already
-- closed by someone else (abandoned) records nothing.
WITH fence AS MATERIALIZED (  -- Self-fenced (above)
    SELECT CASE WHEN :fence_loop::text IS NULL THEN true
                ELSE scheduler_fence(:fence_loop::text, :fence_token::bigint,
                                     :fence_newest::integer) END AS ok
),
result AS (
    SELECT * FROM jsonb_to_recordset(:results::text::jsonb)
        AS r(id bigint, slot timestamptz, status text, error text, finished_at timestamptz)
),
current_shards AS (
    SELECT o.shard FROM jsonb_to_recordset(:owned::text::jsonb) AS o(shard int, token bigint)
    JOIN scheduler_fencing f ON f.loop = 'plugin/' || o.shard AND f.token = o.token
),
finished AS (
    UPDATE scheduler_plugin_runs p
    SET status = r.status, error = r.error, finished_at = r.finished_at
    FROM result r
    WHERE (SELECT ok FROM fence) AND p.id = r.id AND p.slot = r.slot AND p.status = 'running'
      AND (:owned::text IS NULL
           OR scheduler_shard_hash(p.name) % :k IN (SELECT shard FROM current_shards))
    RETURNING p.name, r.status, r.error, r.finished_at
),
locked AS MATERIALIZED (  -- Row locks (above): the runs' schedules, in name order
    SELECT f.* FROM scheduler_plugin_tasks t JOIN finished f ON f.name = t.name
    ORDER BY t.name
    FOR NO KEY UPDATE OF t
)
UPDATE scheduler_plugin_tasks t
SET last_finished_at = f.finished_at, last_status = f.status, last_error = f.error,
    consecutive_failures = CASE WHEN f.status = 'succeeded' THEN 0
                                ELSE t.consecutive_failures + 1 END,
    paused = t.paused OR (f.status <> 'succeeded'
                          AND t.consecutive_failures + 1 >= :max_failures),
    -- Every :trim_every runs, at the schedule's own phase (its name's hash: schedules made
    -- together, whose counts move in step, do not all come due at once).
    history_trim_due = t.history_trim_due OR (t.run_count + t.shard_hash) % :trim_every = 0,
    updated_at = now()
FROM locked f
WHERE t.name = f.name
RETURNING t.name, t.consecutive_failures, t.paused, t.run_count

-- name: plugin_trim
-- The runs of :names beyond their newest :keep, found from the (name, slot) index, per
-- schedule named (by the built-in purge_runs, off the tick: plugins/retention.py).
DELETE FROM scheduler_plugin_runs p
USING (SELECT n.name, c.slot AS cutoff
       FROM unnest(:names::text[]) AS n(name)
       CROSS JOIN LATERAL (SELECT slot FROM scheduler_plugin_runs
                           WHERE name = n.name ORDER BY slot DESC
                           OFFSET :keep LIMIT 1) c) old
WHERE p.name = old.name AND p.slot <= old.cutoff AND p.status <> 'running'
RETURNING p.id

-- name: plugin_trim_due
-- Schedules whose history is due a trim (the partial index: only those), in name order.
SELECT name FROM scheduler_plugin_tasks WHERE history_trim_due ORDER BY name LIMIT :limit

-- name: plugin_trim_done
WITH locked AS MATERIALIZED (  -- Row locks (above)
    SELECT name FROM scheduler_plugin_tasks
    WHERE name = ANY(:names::text[]) AND history_trim_due
    ORDER BY name
    FOR NO KEY UPDATE
)
UPDATE scheduler_plugin_tasks t SET history_trim_due = false
FROM locked l
WHERE t.name = l.name AND t.history_trim_due

-- name: runs_maintain
-- One step of the history's upkeep (migration 0012: days made ahead, days dropped whole
-- once older than :older_than seconds or emptied, the old table moved, strays purged).
SELECT action, target, rows
FROM scheduler_runs_maintain(:older_than, :ahead_days, :limit, :lock_ms)

-- name: purge_publications
DELETE FROM scheduler_publications
WHERE id IN (SELECT id FROM scheduler_publications
             WHERE status <> 'scheduled' AND publish_at < now() - make_interval(secs => :older_than)
             ORDER BY publish_at LIMIT :limit)
RETURNING id

-- name: tasks_list
SELECT name, schedule, next_run_at, active, paused, trigger_requested_at,
       consecutive_failures, last_slot, last_started_at, last_finished_at, last_status,
       last_error, run_count
FROM scheduler_plugin_tasks ORDER BY name

-- name: task_pause
UPDATE scheduler_plugin_tasks SET paused = true, updated_at = now() WHERE name = :name
RETURNING name

-- name: task_resume
UPDATE scheduler_plugin_tasks SET paused = false, consecutive_failures = 0, updated_at = now()
WHERE name = :name
RETURNING name

-- name: task_trigger
UPDATE scheduler_plugin_tasks SET trigger_requested_at = clock_timestamp(), updated_at = now()
WHERE name = :name
RETURNING name

-- Publish loop.

-- name: publish_due
-- One statement per batch: pick due rows in publish_at order (SKIP LOCKED: never wait on
-- a row someone is editing), flip them, return what the publishers need.
WITH due AS (
    SELECT id FROM scheduler_publications
    WHERE status = 'scheduled' AND publish_at <= now()
    ORDER BY publish_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
UPDATE scheduler_publications AS p
SET status = 'published', published_at = clock_timestamp(), published_by = :instance,
    attempts = p.attempts + 1, last_error = NULL
FROM due
WHERE p.id = due.id
RETURNING p.id, p.key, p.payload, p.publish_at, p.published_at

-- name: publish_due_ids
-- The rows publish_due would take, for a batch that one row in it makes unreadable (see
-- PublishWork._take_one_by_one): ids only, so that each row is then read on its own.
SELECT id FROM scheduler_publications
WHERE status = 'scheduled' AND publish_at <= now()
ORDER BY publish_at, id
LIMIT :limit
FOR UPDATE SKIP LOCKED

-- name: publish_one
UPDATE scheduler_publications AS p
SET status = 'published', published_at = clock_timestamp(), published_by = :instance,
    attempts = p.attempts + 1, last_error = NULL
WHERE p.id = :id AND p.status = 'scheduled'
RETURNING p.id, p.key, p.payload, p.publish_at, p.published_at

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
-- `skipped`: rows that were due when this transaction began and yet were not taken, i.e.
-- locked by another transaction (SKIP LOCKED); the caller waits a little for them. Only
-- min() over the partial due index: a bool_or() over every scheduled row was a sequential
-- scan, 241 ms with 1M rows scheduled (bench/growth.py), on every idle tick.
SELECT extract(epoch FROM min(publish_at) - clock_timestamp())::float8 AS seconds,
       extract(epoch FROM clock_timestamp())::float8 AS db_epoch,
       coalesce(min(publish_at) <= now(), false) AS skipped
FROM scheduler_publications WHERE status = 'scheduled'

-- name: notify_published
SELECT pg_notify(:channel, message) FROM unnest(:messages::text[]) AS message

-- name: outbox_add
INSERT INTO scheduler_webhook_outbox (publication_id)
SELECT unnest(:ids::bigint[])
ON CONFLICT (publication_id) DO NOTHING

-- name: outbox_due
-- In transaction mode the round's transaction keeps these rows locked while it POSTs.
SELECT o.publication_id AS id, o.attempts, p.key, p.payload, p.publish_at, p.published_at
FROM scheduler_webhook_outbox o
JOIN scheduler_publications p ON p.id = o.publication_id
WHERE o.status = 'pending' AND o.next_attempt_at <= now()
ORDER BY o.next_attempt_at
LIMIT :limit
FOR UPDATE OF o SKIP LOCKED

-- name: outbox_delivered
UPDATE scheduler_webhook_outbox
SET status = 'delivered', attempts = attempts + 1, delivered_at = now(), last_error = NULL
WHERE publication_id = :id AND status = 'pending'

-- name: outbox_retry
UPDATE scheduler_webhook_outbox
SET attempts = attempts + 1, last_error = :error,
    next_attempt_at = now() + make_interval(secs => :delay)
WHERE publication_id = :id AND status = 'pending'

-- name: outbox_failed
UPDATE scheduler_webhook_outbox
SET status = 'failed', attempts = attempts + 1, last_error = :error
WHERE publication_id = :id AND status = 'pending'

-- name: outbox_next_in
SELECT extract(epoch FROM min(next_attempt_at) - now())::float8 AS seconds
FROM scheduler_webhook_outbox WHERE status = 'pending'

-- Runtime schedules (docs/plugins.md, "Schedules as data"): what the application's API
-- (client/: Client and add_schedule_in), and the CLI's `tasks add|remove|show|list` run,
-- through db/schedules.py, with named parameters. Never run by the loops. A runtime
-- schedule is a row whose `target` is set; declared tasks (target NULL) are never written
-- here, only read (and paused or resumed, as `tasks pause|resume` does).

-- name: schedule_lookup
-- What an add decides on, before it writes: the database's clock (an application's open
-- transaction may be old: clock_timestamp(), not now()), whether the target is declared
-- runnable (asked first, so that a refusal leaves an application's transaction usable;
-- the trigger scheduler_plugin_tasks_target_check is the guarantee), and the row already
-- holding the name, if any.
SELECT clock_timestamp() AS now,
       EXISTS (SELECT 1 FROM scheduler_runnable_targets WHERE target = :target::text)
           AS runnable,
       t.name AS existing, t.target AS existing_target, t.source AS existing_source
FROM (SELECT 1) AS one
LEFT JOIN scheduler_plugin_tasks t ON t.name = :name::text

-- name: schedule_insert
INSERT INTO scheduler_plugin_tasks
    (name, source, target, args, schedule, every_seconds, cron, timezone, timeout_seconds,
     misfire, jitter_seconds, next_run_at)
VALUES (:name, 'runtime', :target, :args::text::jsonb, :schedule, :every_seconds, :cron,
        :timezone, :timeout_seconds, :misfire, :jitter_seconds, :first)
ON CONFLICT (name) DO NOTHING
RETURNING name, source, target, args, schedule, every_seconds, cron, timezone,
          timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
          trigger_requested_at, consecutive_failures, last_slot, last_started_at,
          last_finished_at, last_status, last_error, run_count, created_at, updated_at

-- name: schedule_replace
-- A runtime schedule's new definition. next_run_at stays unless the schedule itself
-- changed (every, cron, timezone, jitter) or the caller gave a start (:reschedule); its
-- paused state, counters and history stay. (UPDATEs see the old row in every expression.)
UPDATE scheduler_plugin_tasks
SET target = :target::text, args = :args::text::jsonb, schedule = :schedule::text,
    every_seconds = :every_seconds::float8, cron = :cron::text, timezone = :timezone::text,
    timeout_seconds = :timeout_seconds::float8, misfire = :misfire::text,
    jitter_seconds = :jitter_seconds::float8,
    next_run_at = CASE WHEN :reschedule::boolean
                         OR every_seconds IS DISTINCT FROM :every_seconds::float8
                         OR cron IS DISTINCT FROM :cron::text
                         OR timezone <> :timezone::text
                         OR jitter_seconds <> :jitter_seconds::float8
                       THEN :first::timestamptz ELSE next_run_at END,
    updated_at = now()
WHERE name = :name::text AND target IS NOT NULL
RETURNING name, source, target, args, schedule, every_seconds, cron, timezone,
          timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
          trigger_requested_at, consecutive_failures, last_slot, last_started_at,
          last_finished_at, last_status, last_error, run_count, created_at, updated_at

-- name: schedule_remove
-- Runtime schedules only. A run in flight is not touched: it ends normally and records
-- its result; with the row gone, nothing schedules the next one. Its history stays in
-- scheduler_plugin_runs.
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
-- A page in name order, after :after (NULL: from the first), at most :limit (NULL: all):
-- the primary key's order, so a page costs its own rows, however many schedules there
-- are (`tasks list` reads a million a page at a time, never with OFFSET).
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name > coalesce(:after::text, '')  -- a range of the index: no name is empty
ORDER BY name
LIMIT :limit

-- name: schedules_count
SELECT count(*) AS n FROM scheduler_plugin_tasks

-- The dashboard's schedules page (dashboard/reads.py): names in byte order (the C
-- collation: scheduler_plugin_tasks_name_c_idx, migration 0013), a page at a time by
-- keyset, never OFFSET. A search keeps the names that start with a prefix, which in byte
-- order are one range, [:low, :below) (:below is the prefix with its last character
-- incremented); the database's own collation gives no such range. Each block reads one
-- range of that index and stops after :limit rows, so the millionth schedule's page costs
-- what the first one's does. The bounds are always values, never `:x IS NULL OR …`,
-- which a generic plan could not use as the index's range: hence four blocks, forward or
-- backward, with or without an upper bound.

-- name: dashboard_schedules_forward
-- From :low on ('' : the first), leaving out :after (the name the page before ended with;
-- NULL on the first page): the caller passes :low = :after for the page after it.
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name COLLATE "C" >= :low::text AND name IS DISTINCT FROM :after::text
ORDER BY name COLLATE "C"
LIMIT :limit

-- name: dashboard_schedules_forward_below
-- As dashboard_schedules_forward, below :below (a search).
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name COLLATE "C" >= :low::text AND name COLLATE "C" < :below::text
  AND name IS DISTINCT FROM :after::text
ORDER BY name COLLATE "C"
LIMIT :limit

-- name: dashboard_schedules_backward
-- The last :limit names from :low on, last first: the last page (the caller reverses it).
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name COLLATE "C" >= :low::text
ORDER BY name COLLATE "C" DESC
LIMIT :limit

-- name: dashboard_schedules_backward_below
-- The last :limit names in [:low, :below), last first: the page before the one that
-- starts at :below, or a search's last page.
SELECT name, source, target, args, schedule, every_seconds, cron, timezone,
       timeout_seconds, misfire, jitter_seconds, next_run_at, active, paused,
       trigger_requested_at, consecutive_failures, last_slot, last_started_at,
       last_finished_at, last_status, last_error, run_count, created_at, updated_at
FROM scheduler_plugin_tasks
WHERE name COLLATE "C" >= :low::text AND name COLLATE "C" < :below::text
ORDER BY name COLLATE "C" DESC
LIMIT :limit

-- name: dashboard_schedules_estimate
-- About how many schedules there are, from the statistics: the live rows `status` shows
-- (pg_stat_user_tables), or the planner's reltuples where those were reset. Counting them
-- exactly reads the whole index (about a second at a million, at every refresh).
SELECT coalesce(nullif(s.n_live_tup, 0), nullif(c.reltuples, -1))::bigint AS schedules,
       true AS approximate
FROM pg_class c
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = to_regclass('scheduler_plugin_tasks')

-- name: dashboard_runs
-- Runs, newest first, older than :before (an id; NULL: from the newest). A range of ids
-- whatever :before is (not `:before IS NULL OR …`): a generic plan of that form filters
-- the history from the newest run down to :before (measured: 2.1 s at 3 million runs).
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs
WHERE id < coalesce(:before::bigint, 9223372036854775807)
ORDER BY id DESC
LIMIT :limit

-- name: dashboard_runs_failed
-- As dashboard_runs, only those that failed, timed out or were abandoned: the predicate
-- of scheduler_plugin_runs_failed_idx, written out, so that every plan can use it.
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs
WHERE id < coalesce(:before::bigint, 9223372036854775807)
  AND status IN ('failed', 'timed_out', 'abandoned')
ORDER BY id DESC
LIMIT :limit

-- name: dashboard_schedule_runs
-- One schedule's runs, newest slot first (the (name, slot) index).
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs
WHERE name = :name
ORDER BY slot DESC
LIMIT :limit

-- name: dashboard_run
SELECT id, name, slot, instance, started_at, finished_at, status, error
FROM scheduler_plugin_runs WHERE id = :id

-- name: dashboard_publications_upcoming
-- Scheduled rows in the order they will be published, after the row :after (an id; NULL,
-- or a row since deleted: from the first). Keyset on (publish_at, id), the due index's
-- own order, so a page costs the same however far it is; the row's publish_at is read
-- from the row, so a page's address is just the id it follows.
SELECT * FROM scheduler_publications
WHERE status = 'scheduled'
  AND (publish_at, id) > (coalesce((SELECT publish_at FROM scheduler_publications
                                    WHERE id = :after::bigint), '-infinity'),
                          coalesce(:after::bigint, 0))
ORDER BY publish_at, id
LIMIT :limit

-- name: dashboard_publications_recent
-- Rows no longer scheduled (:status, or any such), the latest publish_at first, before
-- the row :before (an id; NULL, or a row since deleted: from the latest): keyset on
-- (publish_at, id) as dashboard_publications_upcoming, down scheduler_publications_finished_idx.
SELECT * FROM scheduler_publications
WHERE status <> 'scheduled' AND (:status::text IS NULL OR status = :status::text)
  AND (publish_at, id) < (coalesce((SELECT publish_at FROM scheduler_publications
                                    WHERE id = :before::bigint), 'infinity'),
                          coalesce(:before::bigint, 0))
ORDER BY publish_at DESC, id DESC
LIMIT :limit

-- name: dashboard_publication_lateness
-- How late the last :sample published rows were (seconds), and the oldest due row's wait.
SELECT (SELECT avg(extract(epoch FROM published_at - publish_at))
        FROM (SELECT published_at, publish_at FROM scheduler_publications
              WHERE status <> 'scheduled' AND published_at IS NOT NULL
              ORDER BY publish_at DESC LIMIT :sample) recent) AS mean_lateness,
       (SELECT max(extract(epoch FROM published_at - publish_at))
        FROM (SELECT published_at, publish_at FROM scheduler_publications
              WHERE status <> 'scheduled' AND published_at IS NOT NULL
              ORDER BY publish_at DESC LIMIT :sample) recent) AS max_lateness,
       (SELECT extract(epoch FROM now() - min(publish_at)) FROM scheduler_publications
        WHERE status = 'scheduled' AND publish_at <= now()) AS oldest_due_wait

-- name: publication_retry
-- A failed publication, scheduled again (due at once: its publish_at has passed). Its
-- attempts and last error stay, for the record; the UPDATE wakes the publish leader.
UPDATE scheduler_publications SET status = 'scheduled', published_at = NULL,
       published_by = NULL
WHERE id = :id AND status = 'failed'
RETURNING *

-- Sharded leadership's guard (leadership/shards.py): joining under the gate, leaving,
-- telling the other members, and the watch. Keys as in the blocks above: the shard and
-- member classes and an objid as int4, the loop's own key as bigint.

-- name: shard_join_gate
-- Held by a joining member until its join transaction ends (:shard_class the shard class,
-- :gate the gate's key in it, above every shard): members join one at a time, so two of them cannot
-- both find no other shard count (shard_layouts) and join with different ones.
SELECT pg_advisory_xact_lock(:shard_class, :gate)

-- name: shard_join_share
-- Members hold the loop's own key (:key) shared; a replica that leads the loop unsharded
-- holds it exclusively. False while one leads it (or waits for it): no joining then.
SELECT pg_try_advisory_lock_shared(:key)

-- name: shard_join_member
-- The member lock (:member_class the member class, :objid the objid as int4). False only
-- while a watch holds it: granted the lock of a dead member whose pid the server has since given to
-- this session.
SELECT pg_try_advisory_lock(:member_class, :objid)

-- name: shard_join_unshare
-- No member lock to be had (shard_join_member): the shared hold on the loop's key (:key)
-- goes until the next try.
SELECT pg_advisory_unlock_shared(:key)

-- name: shard_leave
-- A graceful leave, after shard_leaders_release: every lock of the session (the member
-- lock, its shards, the loop's key shared) goes at once.
SELECT pg_advisory_unlock_all()

-- name: shard_notify
-- Tell the other members to look again: :channel the channel (scheduler_shards_changed),
-- :why why (member_joined, member_left, member_gone, shard_released), for their logs.
SELECT pg_notify(:channel, :why)

-- name: shard_watch
-- Wait for the next member's lock (:member_class the member class, :objid its objid as
-- int4): granted the moment that member's session ends. In slices of :slice_ms ms, as
-- lock_wait.
CALL scheduler_wait_for_lock(:member_class, :objid, :slice_ms)
