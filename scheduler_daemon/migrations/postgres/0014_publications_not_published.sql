-- migrate: outside a transaction
-- Failed and cancelled publications in publish_at order (`publications list --status
-- failed`, the dashboard's failed ones): among 50 million finished rows, nearly all
-- published, the finished index has to be read to its end to find a few hundred of them.
-- Built concurrently, outside a transaction (db/sqlfiles.py): a plain CREATE INDEX holds
-- every writer of the table for as long as it reads it (tens of seconds at that size). A
-- migrate cut short leaves an invalid index of this name: dropped first, then built again.
DROP INDEX CONCURRENTLY IF EXISTS scheduler_publications_not_published_idx;
CREATE INDEX CONCURRENTLY scheduler_publications_not_published_idx
    ON scheduler_publications (publish_at, id) WHERE status IN ('failed', 'cancelled');
