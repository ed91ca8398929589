-- Fenced work off the lock connection (leadership/session_lease.py, docs/leadership.md).
--
-- A session-mode leader's fenced transactions run on pooled connections, several at once,
-- not queued on its one lock connection. Each is fenced in its first statement by this
-- function: it takes the loop's row of scheduler_fencing FOR SHARE and compares the token
-- with the caller's. A new leader draws its token (fencing_next: an UPDATE of that row)
-- before its first claim, so
-- - its draw waits for every transaction of its predecessor still open (they hold the row
--   FOR SHARE, which an UPDATE's row lock conflicts with), and
-- - every later transaction of the predecessor reads the new token (READ COMMITTED: a
--   locking read that waited for the draw reads the row as the draw left it) and fails
--   here, before it has done anything.
-- So no transaction of a replaced leader commits after its successor's first fenced
-- statement. A frozen holder is bounded by the transaction's own
-- idle_in_transaction_session_timeout (lock.stall_timeout, set with the BEGIN).
--
-- It also reads the schema version (holding ACCESS SHARE on scheduler_schema_version until
-- the transaction ends, so a migration waits for it: schema_gate.py), against the newest
-- the caller's build knows.
--
-- It answers true, or fails, so that BEGIN, the settings and this check go in one round
-- trip, and so that a single statement can fence itself in its first CTE (db/postgres.sql,
-- "Self-fenced statements"):
--   SDF01  the token is no longer the caller's (a successor drew one)
--   SDF02  the schema is newer than the caller knows (DETAIL: the version)
CREATE FUNCTION scheduler_fence(fence_loop text, fence_token bigint, newest_known integer)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    current_token bigint;
    found integer;
BEGIN
    SELECT max(version) INTO found FROM scheduler_schema_version;
    IF found > newest_known THEN
        RAISE EXCEPTION 'the schema is at version %, newer than this build knows (%)',
            found, newest_known USING ERRCODE = 'SDF02', DETAIL = found::text;
    END IF;
    SELECT token INTO current_token FROM scheduler_fencing WHERE loop = fence_loop FOR SHARE;
    IF current_token IS DISTINCT FROM fence_token THEN
        RAISE EXCEPTION 'fencing token % of loop % is superseded (now %)',
            fence_token, fence_loop, current_token USING ERRCODE = 'SDF01';
    END IF;
    RETURN true;  -- or no answer at all: the error
END $$;

-- Its names resolve in this schema (not the caller's search_path).
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION scheduler_fence(text, bigint, integer) '
                   'SET search_path = %I, pg_temp', current_schema());
END $$;
