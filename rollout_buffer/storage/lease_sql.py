"""The lease's SQL: the ``rollout_buffer_lease`` row and the ``rollout_buffer_instances`` table.

Owns: every statement lease.py runs, named, with a one-line purpose, per backend (``{now}`` is the
database's clock in epoch seconds, and only Postgres has row locks). The tables themselves are in
queries.py's STATE_DDL, with the buffer's others. It must not hold anything but SQL text.
"""

from __future__ import annotations

_NOW = {
    "postgres": "EXTRACT(EPOCH FROM now())",
    "sqlite": "(julianday('now') - 2440587.5) * 86400.0",
}


def _by_backend(sql: str, postgres_tail: str = "") -> dict[str, str]:
    return {
        "postgres": sql.format(now=_NOW["postgres"]) + postgres_tail,
        "sqlite": sql.format(now=_NOW["sqlite"]),
    }


# The lease as it is, with the database's time (LOCK: for a takeover, it waits for every fenced
# transaction).
LEASE_GET = _by_backend("SELECT *, {now} AS db_now FROM rollout_buffer_lease WHERE scope = ?")
LEASE_LOCK = {b: sql + (" FOR UPDATE" if b == "postgres" else "") for b, sql in LEASE_GET.items()}
# The first owner of a fresh database (two racing instances: one INSERT wins); columns in table
# order.
LEASE_INSERT = _by_backend(
    "INSERT INTO rollout_buffer_lease VALUES (?, ?, ?, ?, ?, ?, 1, {now} + ?, {now}, {now}) "
    "ON CONFLICT (scope) DO NOTHING"
)
# A takeover: a new owner and the next epoch, if nobody took it meanwhile.
LEASE_TAKE = _by_backend(
    "UPDATE rollout_buffer_lease SET owner = ?, owner_url = ?, owner_host = ?, owner_pid = ?, "
    "owner_start_ticks = ?, epoch = epoch + 1, lease_until = {now} + ?, acquired_at = {now}, "
    "renewed_at = {now} WHERE scope = ? AND epoch = ?"
)
# The owner renews (no lock the fence waits for); renewed for -1 s it is given up (a graceful stop).
LEASE_RENEW = _by_backend(
    "UPDATE rollout_buffer_lease SET lease_until = {now} + ?, renewed_at = {now} "
    "WHERE scope = ? AND owner = ? AND epoch = ?"
)
# The fence, first in every transaction that records a decision: a row only while this owner's epoch
# holds. On Postgres it also names the backend after the owner and epoch until the transaction ends
# (SET LOCAL application_name), so that a taker can end it should this owner be paused inside it.
LEASE_FENCE = {
    "postgres": "SELECT set_config('application_name', ?, true) FROM rollout_buffer_lease "
    "WHERE scope = ? AND owner = ? AND epoch = ? FOR KEY SHARE",
    "sqlite": "SELECT ? FROM rollout_buffer_lease WHERE scope = ? AND owner = ? AND epoch = ?",
}
# A taker (Postgres): end the backends still inside a fenced transaction of an expired owner's epoch
# (paused, stuck or cut off, they hold the lease row's KEY SHARE lock). The same role may do it.
TERMINATE_FENCED = (
    "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_catalog.pg_stat_activity "
    "WHERE application_name = ? AND pid <> pg_backend_pid()"
)
# This instance of a buffer is alive (its role, URL and what it saw of a launcher on its host).
INSTANCE_SEEN = _by_backend(
    "INSERT INTO rollout_buffer_instances (instance_id, host_id, url, role, seen_at, "
    "launcher_report, buffer) VALUES (?, ?, ?, ?, {now}, ?, ?) ON CONFLICT "
    "(instance_id) DO UPDATE SET url = excluded.url, role = excluded.role, "
    "seen_at = excluded.seen_at, launcher_report = excluded.launcher_report"
)
# A buffer's instances seen within some seconds.
INSTANCES_LIVE = _by_backend(
    "SELECT * FROM rollout_buffer_instances WHERE seen_at >= {now} - ? AND buffer = ?"
)
# Forget instances not seen for a while (every restart is a new instance), and one that stops.
INSTANCES_PRUNE = _by_backend(
    "DELETE FROM rollout_buffer_instances WHERE seen_at < {now} - ? OR instance_id = ?"
)
