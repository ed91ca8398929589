-- Fencing tokens: per loop, a number that grows with every change of leader. Work the
-- database cannot fence (a Python task calling an API, a webhook) carries it, so the
-- system it talks to can refuse a leader that has been replaced (the fencing-token
-- pattern). One row per loop, not per lock key: during a rolling change of lock.keys both
-- leaders draw from the same sequence, and the newer one always holds the larger number.
-- Tokens come from a sequence per loop, whose values are never handed out twice, not even
-- to a transaction that rolls back (in transaction mode the token is drawn inside the
-- work's own transaction, which may roll back after the token was used outside the
-- database). The table records the latest committed one per loop, so a gap between the
-- two says that a holder of the lock since then did not commit.
CREATE SEQUENCE scheduler_fencing_publish_seq;
CREATE SEQUENCE scheduler_fencing_plugin_seq;

CREATE TABLE scheduler_fencing (
    loop       text PRIMARY KEY,
    token      bigint NOT NULL,
    instance   text NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE scheduler_leaders ADD COLUMN fencing_token bigint;

-- Runs still `running`: every tick that takes over the lock looks for them.
CREATE INDEX scheduler_plugin_runs_running_idx
    ON scheduler_plugin_runs (name) WHERE status = 'running';
