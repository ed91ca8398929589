-- Autovacuum for the run history, from measurement (bench/sustained.py, docs/operations.md
-- "Storage"). At steady state every run leaves dead row versions in scheduler_plugin_runs:
-- its `running` row, replaced when its result is written (status is in the predicate of
-- two partial indexes, so that update is never HOT), and one row trimmed per run once a
-- task has `plugin.history` of them. At 1,000 runs a second that is about 2,000 a second,
-- against 10 million live rows (10,000 tasks, history 1,000). The default scale factor
-- (20%) waits for 2 million of them, half an hour, and then vacuums a table bloated by as
-- much; at 1% it ran every two to three minutes (measured: 4 times in 10 minutes, dead
-- rows never above 2% of the table), and a run that finds dead rows on few pages prunes
-- them without scanning the indexes (PostgreSQL skips index vacuuming below 2% of the
-- table's pages).
-- The insert threshold likewise: a history that only grows (a fresh database) gets its
-- visibility map set as it goes, not in one long pass later.
-- A storage parameter: SHARE UPDATE EXCLUSIVE, held for an instant; writers go on.
ALTER TABLE scheduler_plugin_runs SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01
);
