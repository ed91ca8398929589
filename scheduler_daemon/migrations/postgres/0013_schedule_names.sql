-- migrate: outside a transaction
-- The dashboard's schedules page at a million schedules (docs/operations.md, "Dashboard";
-- bench/dashboard.py): names in byte order, a page at a time from a name on, and the names
-- that start with a prefix. The primary key orders names by the database's collation,
-- where the names that start with a prefix need not be one range of the index (en-US puts
-- "Ab" between "ab" and "ad"; some languages sort "ch" after "h"), so on such a database
-- neither `name LIKE 'p%'` nor a range of names is read from it: measured on en-US at a
-- million, the LIKE read every entry of the key. In the C collation they are one range,
-- [prefix, prefix with its last character incremented), on any database.
-- `name` never changes once a row is written: this index costs an insert one more entry,
-- and the updates every run makes stay HOT. Built concurrently, outside a transaction
-- (db/sqlfiles.py): a plain CREATE INDEX would hold every writer of this hot table (each
-- run's claim and result) until it is built, 0.5 to 1 s at a million schedules. A migrate
-- cut short leaves an invalid index of this name: dropped first, then built again.
DROP INDEX CONCURRENTLY IF EXISTS scheduler_plugin_tasks_name_c_idx;
CREATE INDEX CONCURRENTLY scheduler_plugin_tasks_name_c_idx
    ON scheduler_plugin_tasks (name COLLATE "C");
