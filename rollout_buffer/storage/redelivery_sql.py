"""The redelivery queue's SQL: the ``rollout_buffer_redeliveries`` table (schema version 5).

Owns: the table's DDL and every statement on it, named, with a one-line purpose, written once with
``?`` for both backends. It must not hold anything but SQL text.
"""

from __future__ import annotations

QUEUED, DELIVERED, CANCELLED = "queued", "delivered", "cancelled"  # a failure is "failed:<reason>"

# A served group the trainer's checkpoint does not hold, to deliver again (issue 11): queued until
# a batch carries it again (``batch_id``), cancelled when a later skip list names it. One row per
# group; a group asked for again (the trainer crashed twice) is queued again, counts kept.
DDL = """CREATE TABLE IF NOT EXISTS rollout_buffer_redeliveries (
    job_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    state TEXT NOT NULL,
    seq BIGINT NOT NULL,
    batch_id TEXT,
    n_requests INTEGER NOT NULL DEFAULT 0,
    n_delivered INTEGER NOT NULL DEFAULT 0,
    updated_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job_id, group_id))"""

# The job's served groups in the order they were served (the candidates of a redelivery).
SERVED_GROUPS = (
    "SELECT group_id FROM rollout_buffer_groups WHERE job_id = ? AND status = 'served' "
    "ORDER BY resolved_at, group_id"
)
# The next queue position of the job.
NEXT_SEQ = "SELECT COALESCE(MAX(seq), 0) + 1 FROM rollout_buffer_redeliveries WHERE job_id = ?"
# Queue a group (again): state, position, one more request.
QUEUE = (
    "INSERT INTO rollout_buffer_redeliveries (job_id, group_id, state, seq, batch_id, n_requests, "
    "n_delivered, "
    "updated_at) VALUES (?, ?, 'queued', ?, NULL, 1, 0, ?) ON CONFLICT (job_id, group_id) DO "
    "UPDATE SET "
    "state = 'queued', seq = excluded.seq, batch_id = NULL, "
    "n_requests = rollout_buffer_redeliveries.n_requests + 1, updated_at = excluded.updated_at"
)
# A queued group named by a later skip list: the trainer holds it now, it is never delivered again.
CANCEL = (
    "UPDATE rollout_buffer_redeliveries SET state = 'cancelled', updated_at = ? "
    "WHERE job_id = ? AND group_id = ? AND state = 'queued'"
)
# The job's queued groups in queue order (loaded with the job).
QUEUED_GROUPS = (
    "SELECT group_id FROM rollout_buffer_redeliveries WHERE job_id = ? AND state = 'queued' "
    "ORDER BY seq, group_id"
)
# A queued group was delivered again in a batch, or could not be (state 'failed:<reason>').
SETTLE = (
    "UPDATE rollout_buffer_redeliveries SET state = ?, batch_id = ?, n_delivered = n_delivered + "
    "?, "
    "updated_at = ? WHERE job_id = ? AND group_id = ? AND state = 'queued'"
)
# The job's figures: groups asked for again, delivered again, cancelled, failed (after a restart).
TOTALS = (
    "SELECT COALESCE(SUM(n_requests), 0) AS requested, COALESCE(SUM(n_delivered), 0) AS delivered, "
    "COALESCE(SUM(CASE WHEN state = 'cancelled' THEN 1 ELSE 0 END), 0) AS cancelled, "
    "COALESCE(SUM(CASE WHEN substr(state, 1, 7) = 'failed:' THEN 1 ELSE 0 END), 0) AS failed "
    "FROM rollout_buffer_redeliveries WHERE job_id = ?"
)
# Retention: an ended job's redeliveries go with its other decisions.
PURGE = (
    "DELETE FROM rollout_buffer_redeliveries WHERE job_id = ? AND group_id IN (SELECT group_id "
    "FROM "
    "rollout_buffer_redeliveries WHERE job_id = ? LIMIT ?)"
)
