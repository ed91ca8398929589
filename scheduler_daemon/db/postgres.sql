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
SELECT CASE WHEN to_regclass('scheduler_schema_version') IS NULL THEN NULL
            ELSE (SELECT max(version) FROM scheduler_schema_version) END

-- name: schedule
INSERT INTO scheduler_publications (key, payload, publish_at)
VALUES ($1, $2::jsonb, $3)
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

-- name: publication_stats
SELECT count(*) AS scheduled,
       count(*) FILTER (WHERE publish_at <= now()) AS due,
       min(publish_at) AS next_due
FROM scheduler_publications
WHERE status = 'scheduled'
