"""Every SQL statement on the buffer's own tables, named, with a one-line purpose, written once
with ``?``.

The buffer's own ``rollout_buffer_*`` tables use types both backends accept. The statements on the
launcher's two tables are in launcher_sql.py, the lease's in lease.py.

Owns: those statements (the redeliveries' too) and the schema text (``STATE_DDL``,
``MIGRATIONS``, ``SCHEMA_VERSION``). It must not execute anything: there is no connection here.
"""

from __future__ import annotations

SCHEMA_VERSION = 6

# -- the buffer's own tables (same DDL on both backends) -------------------------------------

STATE_DDL = (
    # Schema version and other single values.
    """CREATE TABLE IF NOT EXISTS rollout_buffer_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL)""",
    # One row per job the buffer has served; exactly one is active.
    """CREATE TABLE IF NOT EXISTS rollout_buffer_jobs (
    job_id TEXT PRIMARY KEY,
    k INTEGER NOT NULL,
    floor_pk BIGINT NOT NULL DEFAULT 0,
    cursor_pk BIGINT NOT NULL DEFAULT 0,
    low_water_pk BIGINT NOT NULL DEFAULT 0,
    active SMALLINT NOT NULL DEFAULT 0,
    started_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    launcher_pid INTEGER,
    launcher_pgid INTEGER,
    launcher_start_ticks BIGINT,
    launcher_state TEXT)""",
    # A group's final decision: served (in a batch) or dropped (with a reason). The tombstone.
    """CREATE TABLE IF NOT EXISTS rollout_buffer_groups (
    job_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT,
    batch_id TEXT,
    n_served INTEGER NOT NULL DEFAULT 0,
    n_dropped INTEGER NOT NULL DEFAULT 0,
    pks TEXT NOT NULL,
    clear_sessions TEXT NOT NULL,
    notified SMALLINT NOT NULL DEFAULT 0,
    resolved_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job_id, group_id))""",
    # Rows accounted one by one: rejected rows and late rows of resolved groups.
    """CREATE TABLE IF NOT EXISTS rollout_buffer_rows (
    job_id TEXT NOT NULL,
    step_pk BIGINT NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL,
    group_id TEXT,
    session_id TEXT,
    notified SMALLINT NOT NULL DEFAULT 0,
    recorded_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job_id, step_pk))""",
    # Delivered batches; a request_id binds to one batch for replay.
    """CREATE TABLE IF NOT EXISTS rollout_buffer_batches (
    batch_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    request_id TEXT,
    seed TEXT NOT NULL,
    group_ids TEXT NOT NULL,
    n_items INTEGER NOT NULL,
    n_bytes BIGINT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    UNIQUE (job_id, request_id))""",
    # Who owns the state database's active job (one row; lease.py): the fencing epoch, the lease.
    """CREATE TABLE IF NOT EXISTS rollout_buffer_lease (
    scope TEXT PRIMARY KEY, owner TEXT, owner_url TEXT, owner_host TEXT, owner_pid INTEGER,
    owner_start_ticks BIGINT, epoch BIGINT NOT NULL, lease_until DOUBLE PRECISION NOT NULL,
    acquired_at DOUBLE PRECISION NOT NULL, renewed_at DOUBLE PRECISION NOT NULL)""",
    # Every running instance: role, URL, host, and what it saw of a launcher on its host (lease.py).
    """CREATE TABLE IF NOT EXISTS rollout_buffer_instances (
    instance_id TEXT PRIMARY KEY, host_id TEXT NOT NULL, url TEXT, role TEXT NOT NULL,
    seen_at DOUBLE PRECISION NOT NULL, launcher_report TEXT)""",
    # What startup and retention scan: undelivered notifications, batches by age.
    "CREATE INDEX IF NOT EXISTS rollout_buffer_groups_unnotified ON rollout_buffer_groups "
    "(notified) WHERE notified = 0",
    "CREATE INDEX IF NOT EXISTS rollout_buffer_rows_unnotified ON rollout_buffer_rows (notified) "
    "WHERE notified = 0",
    "CREATE INDEX IF NOT EXISTS rollout_buffer_batches_created ON rollout_buffer_batches "
    "(created_at)",
)

# -- redeliveries (issue 11) ------------------------------------------------------------------
# A redelivery's state; a failure is "failed:<reason>".
QUEUED, DELIVERED, CANCELLED = "queued", "delivered", "cancelled"

# A served group the trainer's checkpoint does not hold, to deliver again (issue 11): queued until
# a batch carries it again (``batch_id``), cancelled when a later skip list names it. One row per
# group; a group asked for again (the trainer crashed twice) is queued again, counts kept.
REDELIVERY_DDL = """CREATE TABLE IF NOT EXISTS rollout_buffer_redeliveries (
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
REDELIVERY_SERVED_GROUPS = (
    "SELECT group_id FROM rollout_buffer_groups WHERE job_id = ? AND status = 'served' "
    "ORDER BY resolved_at, group_id"
)
# The next queue position of the job.
REDELIVERY_NEXT_SEQ = (
    "SELECT COALESCE(MAX(seq), 0) + 1 FROM rollout_buffer_redeliveries WHERE job_id = ?"
)
# Queue a group (again): state, position, one more request.
REDELIVERY_QUEUE = (
    "INSERT INTO rollout_buffer_redeliveries (job_id, group_id, state, seq, batch_id, n_requests, "
    "n_delivered, "
    "updated_at) VALUES (?, ?, 'queued', ?, NULL, 1, 0, ?) ON CONFLICT (job_id, group_id) DO "
    "UPDATE SET "
    "state = 'queued', seq = excluded.seq, batch_id = NULL, "
    "n_requests = rollout_buffer_redeliveries.n_requests + 1, updated_at = excluded.updated_at"
)
# A queued group named by a later skip list: the trainer holds it now, it is never delivered again.
REDELIVERY_CANCEL = (
    "UPDATE rollout_buffer_redeliveries SET state = 'cancelled', updated_at = ? "
    "WHERE job_id = ? AND group_id = ? AND state = 'queued'"
)
# The job's queued groups in queue order (loaded with the job).
REDELIVERY_QUEUED_GROUPS = (
    "SELECT group_id FROM rollout_buffer_redeliveries WHERE job_id = ? AND state = 'queued' "
    "ORDER BY seq, group_id"
)
# A queued group was delivered again in a batch, or could not be (state 'failed:<reason>').
REDELIVERY_SETTLE = (
    "UPDATE rollout_buffer_redeliveries SET state = ?, batch_id = ?, n_delivered = n_delivered + "
    "?, "
    "updated_at = ? WHERE job_id = ? AND group_id = ? AND state = 'queued'"
)
# The job's figures: groups asked for again, delivered again, cancelled, failed (after a restart).
REDELIVERY_TOTALS = (
    "SELECT COALESCE(SUM(n_requests), 0) AS requested, COALESCE(SUM(n_delivered), 0) AS delivered, "
    "COALESCE(SUM(CASE WHEN state = 'cancelled' THEN 1 ELSE 0 END), 0) AS cancelled, "
    "COALESCE(SUM(CASE WHEN substr(state, 1, 7) = 'failed:' THEN 1 ELSE 0 END), 0) AS failed "
    "FROM rollout_buffer_redeliveries WHERE job_id = ?"
)
# Retention: an ended job's redeliveries go with its other decisions.
REDELIVERY_PURGE = (
    "DELETE FROM rollout_buffer_redeliveries WHERE job_id = ? AND group_id IN (SELECT group_id "
    "FROM "
    "rollout_buffer_redeliveries WHERE job_id = ? LIMIT ?)"
)

# Schema migrations: MIGRATIONS[v] brings a version-v schema to v + 1 (one transaction each).
MIGRATIONS = {
    1: (
        # Which instance adopted or started the job's launcher (an instance never stops another's).
        "ALTER TABLE rollout_buffer_jobs ADD COLUMN launcher_owner TEXT",
        # When an ended job's decisions were purged (retention); NULL while they are kept.
        "ALTER TABLE rollout_buffer_jobs ADD COLUMN purged_at DOUBLE PRECISION",
    ),
    2: (
        # Training-data policies (issue 10): the job's versions come back after a restart.
        "ALTER TABLE rollout_buffer_jobs ADD COLUMN trainer_version BIGINT",
        "ALTER TABLE rollout_buffer_jobs ADD COLUMN rows_version BIGINT",
        # A decided group's figures: its sessions and their terminal rewards (NULL before version
        # 3).
        "ALTER TABLE rollout_buffer_groups ADD COLUMN n_sessions INTEGER",
        "ALTER TABLE rollout_buffer_groups ADD COLUMN reward_sum DOUBLE PRECISION",
        "ALTER TABLE rollout_buffer_groups ADD COLUMN n_rewarded INTEGER",
        # A batch's meta_info keys that the rows cannot give again (group figures, filtered,
        # partial).
        "ALTER TABLE rollout_buffer_batches ADD COLUMN meta TEXT",
    ),
    3: (
        # adopted only there (issue 12)
        "ALTER TABLE rollout_buffer_jobs ADD COLUMN launcher_host TEXT",
    ),
    4: (REDELIVERY_DDL,),  # served groups to deliver again after a trainer crash (issue 11)
    5: (
        # Named buffers (ROLLOUT_BUFFER_NAME, issue 20): a job belongs to one buffer, and each
        # buffer has its own active job and instances; what was written before names is the
        # unnamed one's.
        "ALTER TABLE rollout_buffer_jobs ADD COLUMN buffer TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE rollout_buffer_instances ADD COLUMN buffer TEXT NOT NULL DEFAULT ''",
    ),
}

# The buffer's tables and indexes that exist (CREATE INDEX IF NOT EXISTS waits for every open
# write).
STATE_OBJECTS = {
    "postgres": "SELECT relname FROM pg_catalog.pg_class "
    "WHERE starts_with(relname, 'rollout_buffer_') AND pg_catalog.pg_table_is_visible(oid)",
    "sqlite": "SELECT name FROM sqlite_master WHERE substr(name, 1, 15) = 'rollout_buffer_'",
}
# Read the schema version.
GET_META = "SELECT value FROM rollout_buffer_meta WHERE key = ?"
# Record the schema version (first start).
PUT_META = (
    "INSERT INTO rollout_buffer_meta (key, value) VALUES (?, ?) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)

# -- jobs ---------------------------------------------------------------------------------------
# The buffer's active job, if any.
ACTIVE_JOB = "SELECT * FROM rollout_buffer_jobs WHERE active = 1 AND buffer = ?"
# One job by id.
GET_JOB = "SELECT * FROM rollout_buffer_jobs WHERE job_id = ?"
# The buffer a job belongs to (None: no buffer has selected it yet).
JOB_BUFFER = "SELECT buffer FROM rollout_buffer_jobs WHERE job_id = ?"
# Deactivate the buffer's jobs (before activating another).
DEACTIVATE_JOBS = (
    "UPDATE rollout_buffer_jobs SET active = 0, updated_at = ? WHERE active = 1 AND buffer = ?"
)
# Create or reactivate a job with its K and cursor floor; never one of another buffer (no row).
UPSERT_JOB = (
    "INSERT INTO rollout_buffer_jobs (job_id, k, floor_pk, cursor_pk, low_water_pk, active, "
    "started_at, updated_at, buffer) VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?) "
    "ON CONFLICT (job_id) DO UPDATE SET k = excluded.k, floor_pk = excluded.floor_pk, "
    "cursor_pk = excluded.cursor_pk, low_water_pk = excluded.low_water_pk, active = 1, "
    "updated_at = excluded.updated_at WHERE rollout_buffer_jobs.buffer = excluded.buffer"
)
# Change a job's K (num_repeat_per_sample).
SET_K = "UPDATE rollout_buffer_jobs SET k = ?, updated_at = ? WHERE job_id = ?"
# Persist the ingest cursor, the low-water mark below which every row is accounted, and the
# versions.
SAVE_CURSOR = (
    "UPDATE rollout_buffer_jobs SET cursor_pk = ?, low_water_pk = ?, trainer_version = ?, "
    "rows_version = ?, updated_at = ? WHERE job_id = ?"
)
# Record the launcher process of a job and the instance that owns it (for adoption after a crash).
SAVE_LAUNCHER = (
    "UPDATE rollout_buffer_jobs SET launcher_pid = ?, launcher_pgid = ?, launcher_start_ticks = ?, "
    "launcher_state = ?, launcher_owner = ?, launcher_host = ?, updated_at = ? WHERE job_id = ?"
)
# The instance that owns a job's launcher.
LAUNCHER_OWNER = "SELECT launcher_owner FROM rollout_buffer_jobs WHERE job_id = ?"

# -- retention ----------------------------------------------------------------------------------
# Batches recorded before a time, oldest first, a few at a time (past the replay window).
PRUNE_BATCHES = (
    "DELETE FROM rollout_buffer_batches WHERE batch_id IN (SELECT batch_id FROM "
    "rollout_buffer_batches "
    "WHERE created_at < ? ORDER BY created_at LIMIT ?)"
)
# The buffer's ended jobs, not active since a time, whose decisions are still kept.
ENDED_JOBS = (
    "SELECT job_id, cursor_pk, low_water_pk, floor_pk FROM rollout_buffer_jobs WHERE active = 0 "
    "AND updated_at < ? AND purged_at IS NULL AND buffer = ? ORDER BY updated_at LIMIT 10"
)
# A few of an ended job's group decisions.
PURGE_GROUPS = (
    "DELETE FROM rollout_buffer_groups WHERE job_id = ? AND group_id IN (SELECT group_id FROM "
    "rollout_buffer_groups WHERE job_id = ? LIMIT ?)"
)
# A few of an ended job's rows accounted one by one.
PURGE_ROWS = (
    "DELETE FROM rollout_buffer_rows WHERE job_id = ? AND step_pk IN (SELECT step_pk FROM "
    "rollout_buffer_rows WHERE job_id = ? LIMIT ?)"
)
# A few of an ended job's batches.
PURGE_BATCHES = (
    "DELETE FROM rollout_buffer_batches WHERE batch_id IN (SELECT batch_id FROM "
    "rollout_buffer_batches "
    "WHERE job_id = ? LIMIT ?)"
)
# A purged job reads after everything it had read: selected again, it never re-reads old rows as new
# groups.
MARK_PURGED = (
    "UPDATE rollout_buffer_jobs SET purged_at = ?, floor_pk = ?, cursor_pk = ?, low_water_pk = ? "
    "WHERE job_id = ? AND active = 0"
)

# -- groups -------------------------------------------------------------------------------------
# Record a group's decision (the tombstone); a second decision for one group is an integrity error.
INSERT_GROUP = (
    "INSERT INTO rollout_buffer_groups (job_id, group_id, status, reason, batch_id, n_served, "
    "n_dropped, pks, clear_sessions, notified, resolved_at, n_sessions, reward_sum, n_rewarded) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# Record a drop; a decision already recorded (a retried COMMIT) is kept as it is.
INSERT_GROUP_IF_ABSENT = INSERT_GROUP + " ON CONFLICT (job_id, group_id) DO NOTHING"
# A group's stored decision (after a COMMIT whose outcome is unknown, or a conflict with another
# instance).
GROUP_STATUS = "SELECT status, reason FROM rollout_buffer_groups WHERE job_id = ? AND group_id = ?"
# Every decided group of a job (tombstones to load on start).
JOB_GROUP_STATUS = "SELECT group_id, status FROM rollout_buffer_groups WHERE job_id = ?"
# The pks a decided group accounted for (rebuild after a crash).
GROUP_PKS = "SELECT pks FROM rollout_buffer_groups WHERE job_id = ? AND group_id = ?"
# Rows served and dropped per reason (accounting after a restart).
GROUP_TOTALS = (
    "SELECT status, reason, COUNT(*) AS n_groups, SUM(n_served) AS n_served, "
    "SUM(n_dropped) AS n_dropped, SUM(n_sessions) AS n_sessions, SUM(reward_sum) AS reward_sum, "
    "SUM(n_rewarded) AS n_rewarded FROM rollout_buffer_groups WHERE job_id = ? GROUP BY status, "
    "reason"
)
# Groups dropped since the job's last served group, by reason (meta_info.filtered after a restart).
FILTERED_SINCE_SERVED = (
    "SELECT reason, COUNT(*) AS n FROM rollout_buffer_groups WHERE job_id = ? "
    "AND status = 'dropped' AND resolved_at > COALESCE((SELECT MAX(resolved_at) FROM "
    "rollout_buffer_groups WHERE job_id = ? AND status = 'served'), -1) GROUP BY reason"
)
# Not a job of another buffer (its notifications are that buffer's to send).
_BUFFER_JOBS = "job_id NOT IN (SELECT job_id FROM rollout_buffer_jobs WHERE buffer <> ?)"
# The buffer's group decisions whose sessions the proxy has not confirmed clearing.
UNNOTIFIED_GROUPS = (
    "SELECT job_id, group_id, status, reason, clear_sessions FROM rollout_buffer_groups "
    f"WHERE notified = 0 AND {_BUFFER_JOBS}"
)
# The proxy cleared a group's sessions.
MARK_GROUP_NOTIFIED = (
    "UPDATE rollout_buffer_groups SET notified = 1 WHERE job_id = ? AND group_id = ?"
)

# -- rows accounted one by one ------------------------------------------------------------------
# Record a rejected or late row (ignored if it is already recorded).
INSERT_ROW = (
    "INSERT INTO rollout_buffer_rows (job_id, step_pk, outcome, reason, group_id, session_id, "
    "notified, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, step_pk) DO "
    "NOTHING"
)
# Rows rejected / dropped one by one, per reason (accounting after a restart).
ROW_TOTALS = (
    "SELECT outcome, reason, COUNT(*) AS n FROM rollout_buffer_rows WHERE job_id = ? "
    "GROUP BY outcome, reason"
)
# pks accounted one by one at or above a pk (rebuild after a crash).
ROW_PKS_FROM = "SELECT step_pk FROM rollout_buffer_rows WHERE job_id = ? AND step_pk >= ?"
# Sessions that wrote a row without group_id (their groups are malformed).
TAINTED_SESSIONS = (
    "SELECT DISTINCT session_id FROM rollout_buffer_rows WHERE job_id = ? "
    "AND reason IN ('missing_group_id', 'invalid_utf8_group_id') AND session_id IS NOT NULL"
)
# Groups with a row whose session_id is not text (they can never be served whole).
TAINTED_GROUPS = (
    "SELECT DISTINCT group_id FROM rollout_buffer_rows WHERE job_id = ? "
    "AND reason = 'invalid_session_id' AND group_id IS NOT NULL"
)
# Sessions of undecided groups dropped as oversampled (after a restart they stay out of their
# group).
OVERSAMPLED_SESSIONS = (
    "SELECT DISTINCT r.group_id, r.session_id FROM rollout_buffer_rows r WHERE r.job_id = ? "
    "AND r.reason = 'oversampled' AND r.group_id IS NOT NULL AND r.session_id IS NOT NULL "
    "AND NOT EXISTS (SELECT 1 FROM rollout_buffer_groups g WHERE g.job_id = r.job_id "
    "AND g.group_id = r.group_id)"
)
# The buffer's late rows whose sessions the proxy has not confirmed clearing.
UNNOTIFIED_ROWS = (
    "SELECT job_id, step_pk, reason, group_id, session_id FROM rollout_buffer_rows "
    f"WHERE notified = 0 AND session_id IS NOT NULL AND {_BUFFER_JOBS}"
)
# The proxy cleared a late row's session.
MARK_ROW_NOTIFIED = "UPDATE rollout_buffer_rows SET notified = 1 WHERE job_id = ? AND step_pk = ?"

# -- batches ------------------------------------------------------------------------------------
# Record a delivered batch.
INSERT_BATCH = (
    "INSERT INTO rollout_buffer_batches (batch_id, job_id, request_id, seed, group_ids, n_items, "
    "n_bytes, created_at, meta) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# The batch bound to a request_id.
BATCH_BY_REQUEST = "SELECT * FROM rollout_buffer_batches WHERE job_id = ? AND request_id = ?"
# request_ids of a job's batches recorded since a time (empty polls answer from memory).
RECENT_REQUEST_IDS = (
    "SELECT request_id FROM rollout_buffer_batches WHERE job_id = ? AND created_at >= ? "
    "AND request_id IS NOT NULL"
)
# The buffer's other jobs (a request_id resumed after a job switch is bound to one of theirs).
_OTHER_JOBS = "job_id IN (SELECT job_id FROM rollout_buffer_jobs WHERE buffer = ? AND job_id <> ?)"
# request_ids of the buffer's other jobs' batches recorded since a time.
RECENT_REQUEST_IDS_ELSEWHERE = (
    "SELECT request_id FROM rollout_buffer_batches WHERE created_at >= ? "
    f"AND request_id IS NOT NULL AND {_OTHER_JOBS}"
)
# The batch of another job of the buffer that a request_id is bound to (one key probe per job).
BATCH_ELSEWHERE = (
    f"SELECT job_id, batch_id FROM rollout_buffer_batches WHERE {_OTHER_JOBS} AND request_id = ?"
)
# Whether a batch was recorded (after a COMMIT whose outcome is unknown).
BATCH_EXISTS = "SELECT 1 FROM rollout_buffer_batches WHERE batch_id = ?"

# -- export (rollout-buffer export): a job's decisions, streamed a page at a time
# -------------------
# Keyset pages in byte order of group_id on both backends ("C" collation on Postgres), so the
# groups and the rows accounted one by one can be merged by group_id in constant memory.
EXPORT_GROUPS = {
    "sqlite": (
        "SELECT group_id, status, reason, batch_id, pks, resolved_at FROM rollout_buffer_groups "
        "WHERE job_id = ? AND group_id > ? ORDER BY group_id LIMIT ?"
    ),
    "postgres": (
        "SELECT group_id, status, reason, batch_id, pks, resolved_at FROM rollout_buffer_groups "
        'WHERE job_id = ? AND group_id COLLATE "C" > ? ORDER BY group_id COLLATE "C" LIMIT ?'
    ),
}
# Export: the rows accounted one by one that belong to a group (rejected and late rows), by
# (group_id, step_pk).
EXPORT_GROUP_ROWS = {
    "sqlite": (
        "SELECT group_id, step_pk, outcome, reason FROM rollout_buffer_rows WHERE job_id = ? "
        "AND group_id IS NOT NULL AND (group_id > ? OR (group_id = ? AND step_pk > ?)) "
        "ORDER BY group_id, step_pk LIMIT ?"
    ),
    "postgres": (
        "SELECT group_id, step_pk, outcome, reason FROM rollout_buffer_rows WHERE job_id = ? "
        'AND group_id IS NOT NULL AND (group_id COLLATE "C" > ? OR (group_id = ? AND step_pk > ?)) '
        'ORDER BY group_id COLLATE "C", step_pk LIMIT ?'
    ),
}
# Export: rejected rows with no usable group (missing or undecodable group_id), by step_pk.
EXPORT_ORPHAN_ROWS = (
    "SELECT step_pk, outcome, reason, recorded_at FROM rollout_buffer_rows WHERE job_id = ? "
    "AND group_id IS NULL AND step_pk > ? ORDER BY step_pk LIMIT ?"
)
# Export: how many records a job has (for the progress bar).
EXPORT_COUNT_GROUPS = "SELECT COUNT(*) FROM rollout_buffer_groups WHERE job_id = ?"
EXPORT_COUNT_ORPHANS = (
    "SELECT COUNT(*) FROM rollout_buffer_rows WHERE job_id = ? AND group_id IS NULL"
)
# Export: the newest jobs (to name them when an unknown one is asked for).
EXPORT_RECENT_JOBS = "SELECT job_id FROM rollout_buffer_jobs ORDER BY started_at DESC LIMIT 10"
# Export: the uid seed of a delivered batch and its meta (gone once the batch is pruned).
BATCH_SEED = "SELECT seed, meta FROM rollout_buffer_batches WHERE batch_id = ?"
