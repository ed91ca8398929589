-- The PostgreSQL migration of the same number adds a NOTIFY trigger. SQLite has no
-- NOTIFY: its plugin leader looks every plugin.interval. Kept so both backends count
-- their schema versions alike.
SELECT 1;
