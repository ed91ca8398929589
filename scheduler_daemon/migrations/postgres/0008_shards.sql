-- Sharded leadership of the plugin loop (plugin.shards, docs/leadership.md "Shards").
--
-- A schedule's shard is its name's hash modulo the shard count, and the hash is fixed in
-- its row: every replica, and every statement, reads the same one (a replica never hashes
-- a name itself). hashtextextended is what PostgreSQL's hash partitioning uses: stable
-- within a server version, and a dump restored elsewhere recomputes the column there.
CREATE FUNCTION scheduler_shard_hash(name text) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
AS $$ SELECT (hashtextextended(name, 0) & 2147483647)::integer $$;

-- A stored column rewrites the table under an ACCESS EXCLUSIVE lock: with many runtime
-- schedules, the migration holds the plugin loop (and writers of schedules) that long.
ALTER TABLE scheduler_plugin_tasks
    ADD COLUMN shard_hash integer GENERATED ALWAYS AS (scheduler_shard_hash(name)) STORED;

-- How many tokens a loop (or a shard: loop 'plugin/<shard>') drew since this migration. In
-- session mode, and for a shard, one per change of its leader: `status` reports the
-- shards' rebalances from it (transaction mode draws one per tick that wins the lock).
ALTER TABLE scheduler_fencing ADD COLUMN draws bigint NOT NULL DEFAULT 0;
