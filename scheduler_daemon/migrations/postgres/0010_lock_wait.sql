-- How a standby waits for a lock (leadership/postgres_session.py, a sharded member's watch
-- in leadership/shards.py) without stopping VACUUM.
--
-- A statement that waits holds the snapshot it started with, and with it the database's
-- xmin horizon: while `SELECT pg_advisory_lock(...)` waits, for hours on a healthy
-- standby, no dead row version newer than its start can be removed from any table of the
-- database, by autovacuum or anyone. Measured: 10,000 schedules every 10 s took
-- scheduler_plugin_tasks from 28 MB to 132 MB in five minutes, and the leader's due read
-- from 2 ms to 28 ms, until the runs fell behind.
--
-- These procedures wait in slices: each slice is a transaction of its own that waits up
-- to `slice_ms` for the lock (lock_timeout, set for that transaction alone), and the
-- COMMIT between slices lets the snapshot go. The wait is still a wait (granted the moment
-- the holder's session ends) and the horizon is never held longer than a slice. What it
-- gives up is the queue's order: each slice queues its standby again, behind the others.
-- A slice that times out is caught here, so the server logs no error for it; and a slice
-- is kept under deadlock_timeout, so that with log_lock_waits on the server logs no
-- "still waiting" line for it either. CALL them outside a transaction block, with
-- statement_timeout off.

CREATE PROCEDURE scheduler_wait_for_lock(key bigint, slice_ms integer)
LANGUAGE plpgsql AS $$
DECLARE
    slice integer := least(slice_ms, greatest(1, (
        SELECT setting::integer * 9 / 10 FROM pg_settings WHERE name = 'deadlock_timeout')));
BEGIN
    LOOP
        PERFORM set_config('lock_timeout', slice::text, true);
        BEGIN
            PERFORM pg_advisory_lock(key);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- the slice is over: let the snapshot go, then wait again
        END;
        COMMIT;
    END LOOP;
END $$;

-- The same for a key of the two-int space (a sharded member's lock).
CREATE PROCEDURE scheduler_wait_for_lock(class integer, objid integer, slice_ms integer)
LANGUAGE plpgsql AS $$
DECLARE
    slice integer := least(slice_ms, greatest(1, (
        SELECT setting::integer * 9 / 10 FROM pg_settings WHERE name = 'deadlock_timeout')));
BEGIN
    LOOP
        PERFORM set_config('lock_timeout', slice::text, true);
        BEGIN
            PERFORM pg_advisory_lock(class, objid);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        COMMIT;
    END LOOP;
END $$;
