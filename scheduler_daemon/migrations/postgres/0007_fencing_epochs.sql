-- Fencing tokens that are never handed out twice: not after an asynchronous failover,
-- not after a crash (docs/leadership.md, Fencing tokens). A sequence alone repeats in both:
-- it is WAL-logged 32 values ahead, and a value drawn under a record the standby never got
-- (or that was never flushed, its transaction still open when the server died) is drawn
-- again by the next primary (or the restarted server).
--
-- From now on token = epoch * 2^40 + counter (fencing_next in db/postgres.sql):
-- - epoch grows with the server's WAL timeline, which every promotion increments, so the
--   new primary's tokens are above anything the old one handed out, lost or not;
-- - counter is the loop's sequence plus an offset that grows with the server's start time,
--   so a restarted server's tokens are above anything it handed out before its crash.
-- Every token drawn before this migration (the sequence's value, far below 2^40) is below
-- every token drawn after it: epoch >= 1.
--
-- What the last token was drawn under, per loop (NULL: drawn before this migration):
-- epoch, the timeline it was the epoch of, and the counter's offset.
ALTER TABLE scheduler_fencing
    ADD COLUMN epoch        bigint,
    ADD COLUMN timeline     bigint,
    ADD COLUMN start_offset bigint,
    -- A counter that reached 2^40 would carry into the epoch, where a later promotion's
    -- tokens live: refused instead (about the year 2130, or 2^40 changes of leader).
    -- Also refuses a token written the old way (a replica of an older build) over a
    -- row with an epoch.
    ADD CONSTRAINT scheduler_fencing_epoch_check CHECK (token >> 40 = epoch);
