-- A sharded member's fenced work off its lock connection (leadership/shard_lease.py,
-- docs/leadership.md "Shards").
--
-- As scheduler_fence (migration 0015) does for a loop, per shard: a member's fenced
-- transaction on a pooled connection takes the fencing row of each shard it is for
-- ('plugin/7') FOR SHARE and compares each token with the one its owner drew when it took
-- the shard. The shard's next owner draws a new token (fencing_next, an UPDATE of that
-- row) before its first claim of it, so the draw waits for every open transaction of the
-- old owner fenced for the shard, and every later one of theirs fails here. The rows are
-- taken in shard order: a draw of several shards in one transaction takes them in that
-- order too, so the two never wait for each other in a cycle.
--
-- It also checks that the member's lock session (backend member_pid) still holds its
-- member lock: a member whose session has ended commits nothing, not even for no shard
-- (a take-over's declarations).
--
-- The answer is true, or an error:
--   SDF01  tokens superseded; DETAIL: those shards, comma-separated (the caller loses
--          them and may fence again for the rest), or 'member' (the member is gone)
--   SDF02  the schema is newer than the caller knows (DETAIL: the version)
CREATE FUNCTION scheduler_fence_shards(
    fence_loop text, member_pid integer, member_class bigint, member_objid bigint,
    shards integer[], tokens bigint[], newest_known integer
)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    found integer;
    owned record;
    current_token bigint;
    superseded integer[] := '{}';
BEGIN
    SELECT max(version) INTO found FROM scheduler_schema_version;
    IF found > newest_known THEN
        RAISE EXCEPTION 'the schema is at version %, newer than this build knows (%)',
            found, newest_known USING ERRCODE = 'SDF02', DETAIL = found::text;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted AND l.pid = member_pid
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid::bigint = member_class AND l.objid::bigint = member_objid
    ) THEN
        RAISE EXCEPTION 'backend % no longer holds the member lock of loop %',
            member_pid, fence_loop USING ERRCODE = 'SDF01', DETAIL = 'member';
    END IF;
    FOR owned IN
        SELECT s.shard, s.token FROM unnest(shards, tokens) AS s(shard, token) ORDER BY s.shard
    LOOP
        SELECT f.token INTO current_token FROM scheduler_fencing f
        WHERE f.loop = fence_loop || '/' || owned.shard FOR SHARE;
        IF current_token IS DISTINCT FROM owned.token THEN
            superseded := superseded || owned.shard;
        END IF;
    END LOOP;
    IF cardinality(superseded) > 0 THEN
        RAISE EXCEPTION 'fencing tokens of loop % superseded for shards %',
            fence_loop, superseded USING ERRCODE = 'SDF01',
            DETAIL = array_to_string(superseded, ',');
    END IF;
    RETURN true;
END $$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION scheduler_fence_shards(text, integer, bigint, bigint, integer[], bigint[], integer) '
                   'SET search_path = %I, pg_temp', current_schema());
END $$;
