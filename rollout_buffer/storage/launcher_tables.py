"""The launcher's tables as the service, its tools and its tests use them, beside ingest's cursor
(reader.py): what exists, the ids a job has reached, the rows a restart_training floor leaves
behind, the rows not read yet, the bodies of the rows a poll serves, what generating a group cost
(the export), and the launcher's own writes.

Owns: running those statements (launcher_sql.py holds them) and turning their results into plain
values; reading bodies by primary key in chunks, with the per-group byte cap (a huge group is
stopped as soon as it passes it), and rebuilding a served group's Take from its recorded pks. The
service only reads here: the launcher's tables are its own. The writes are the launcher's, as the
simulator and an export's replay make them (INSERT only: a launcher never updates nor deletes a
row), on a connection the caller owns and retries on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.items import COMPLETED, MESSAGES, RESPONSE, SID, STEP, TRAINABLE
from rollout_buffer.core.model import Take
from rollout_buffer.core.salvage import Recorded
from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.db import Database


# -- reads beside ingest ----------------------------------------------------------------------
def steps_table_exists(source: Database) -> bool:
    """True once the launcher has created session_steps (a fresh database has it only after the
    launcher starts)."""
    return bool(int(source.scalar(launcher_sql.HAS_STEPS_TABLE[source.backend]) or 0))


def sequence_cache(source: Database) -> Any:
    """How many ids the sequence of session_steps.id caches per connection (Postgres only; falsy
    when the table does not exist yet)."""
    return source.scalar(launcher_sql.HAS_STEPS_TABLE[source.backend]) and source.scalar(
        launcher_sql.SEQUENCE_CACHE
    )


def max_job_id(source: Database, job_id: str) -> int:
    """The largest id of the job's rows, 0 when it has none."""
    return int(source.scalar(launcher_sql.MAX_JOB_ID, (job_id,)) or 0)


def max_terminal_id(source: Database, job_id: str) -> int:
    """The id of the job's last terminal row, 0 when it has none."""
    return int(source.scalar(launcher_sql.MAX_TERMINAL_ID, (job_id,)) or 0)


def rows_at_or_below(source: Database, job_id: str, floor: int) -> list[tuple[Any, ...]]:
    """(id, group_id, session_id) of the job's trainable rows at or below ``floor``."""
    return source.rows(launcher_sql.ROWS_AT_OR_BELOW, (job_id, floor))


def unread_rows(source: Database, job_id: str, after: int) -> int:
    """How many trainable rows of the job have an id above ``after`` (written, not read yet)."""
    return int(source.scalar(launcher_sql.COUNT_AFTER, (job_id, after)) or 0)


def generation_rows(source: Database, job_id: str, group_id: str) -> list[tuple[Any, ...]]:
    """Per session of a group: (session_id, its rows of any kind, first and last created_at,
    whether it wrote a trainable row), what generating the group cost (the export)."""
    return source.rows(launcher_sql.EXPORT_GENERATION, (job_id, group_id))


def scheduled_sessions(source: Database, job_id: str, group_id: str) -> list[str]:
    """The sessions the launcher scheduled for a group (job_environments: a StorageError when a
    writer that is not the launcher has no such table)."""
    return [r[0] for r in source.rows(launcher_sql.EXPORT_SCHEDULED, (job_id, group_id))]


# -- row bodies (serving, replay, export) ---------------------------------------------------------
FETCH_CHUNK = 900  # pks per body query (SQLite's default variable limit is far above)


def fetch_rows(
    source: Database, pks: list[int], query: Callable[[int, str], str] = launcher_sql.fetch_bodies
) -> dict[int, tuple[Any, ...]]:
    """The body columns (queries.BODY_COLUMNS) of the given rows, by pk (``query``: the statement
    for n pks, ``fetch_bodies`` or one that selects more columns after those, as the export's)."""
    out: dict[int, tuple[Any, ...]] = {}
    for i in range(0, len(pks), FETCH_CHUNK):
        chunk = pks[i : i + FETCH_CHUNK]
        for r in source.rows(
            query(len(chunk), source.backend),
            launcher_sql.fetch_bodies_params(chunk, source.backend),
            binary=True,
        ):
            out[r[0]] = r
    return out


def fetch_takes(
    source: Database, takes: list[Take], cap: int
) -> tuple[dict[int, tuple[Any, ...]], set[str]]:
    """The body rows of the served sessions of ``takes``, and the groups whose rows alone exceed
    ``cap`` bytes (stopped as soon as they do, so one huge group never holds more than the cap)."""
    owner = {pk: t.group_id for t in takes for pk in t.served_pks}
    pks = list(owner)
    sizes: dict[str, int] = {}
    too_large: set[str] = set()
    out: dict[int, tuple[Any, ...]] = {}
    for i in range(0, len(pks), FETCH_CHUNK):
        chunk = [pk for pk in pks[i : i + FETCH_CHUNK] if owner[pk] not in too_large]
        if not chunk:
            continue
        for r in source.rows(
            launcher_sql.fetch_bodies(len(chunk), source.backend),
            launcher_sql.fetch_bodies_params(chunk, source.backend),
            binary=True,
        ):
            gid = owner[r[0]]
            size = sizes[gid] = sizes.get(gid, 0) + len(r[MESSAGES] or b"") + len(r[RESPONSE] or "")
            if size > cap:
                too_large.add(gid)
            out[r[0]] = r
        if too_large:
            for pk in [pk for pk in out if owner[pk] in too_large]:
                del out[pk]
    return out, too_large


def with_last_rows(source: Database, job_id: str, takes: list[Take]) -> list[Take]:
    """Salvage (issue 38): the takes, each salvaged one with the pks of its truncated sessions'
    last rows (at --message-cut <= 0), read by session id (never by reading the job's rows)."""
    out = []
    for t in takes:
        s = t.salvage
        if s is not None and s.last_row and not s.last_rows:
            last: dict[str, int] = {}
            for sid in s.sessions:
                found = source.rows(launcher_sql.LAST_ROW_OF_SESSION, (sid, job_id))
                if found:
                    last[sid] = int(found[0][0])
            t = dataclasses.replace(t, salvage=dataclasses.replace(s, last_rows=last))
        out.append(t)
    return out


def recorded_salvage(store: Any, job_id: str, group_id: str) -> Recorded | None:
    """A served group's salvage record (issue 38), to build its items again; None for a group
    that was not salvaged."""
    decision = store.group_decision(job_id, group_id)
    return Recorded.of(decision[1] if decision else None)


def take_from_rows(
    group_id: str,
    pks: list[int],
    rows: dict[int, tuple[Any, ...]],
    salvaged: Recorded | None = None,
) -> Take:
    """Rebuild a served group's Take from its recorded pks: sessions with a completed row are
    complete; ``salvaged`` (a salvaged group's record): the others are its truncated sessions."""
    done = {r[SID] for r in rows.values() if r[COMPLETED]}
    completed: dict[str, list[int]] = {}
    incomplete: dict[str, list[int]] = {}
    for pk in pks:
        r = rows.get(pk)
        if r is not None:
            (completed if r[SID] in done else incomplete).setdefault(r[SID], []).append(pk)
    take = Take(
        group_id,
        {s: tuple(p) for s, p in completed.items()},
        {s: tuple(p) for s, p in incomplete.items()},
    )
    if salvaged is None:
        return take
    rows_of: dict[str, list[tuple[int, int, bool]]] = {}
    for sid, spks in incomplete.items():
        for pk in spks:
            r = rows[pk]
            step = r[STEP] if isinstance(r[STEP], int) else -1  # (its build rejects the row)
            rows_of.setdefault(sid, []).append((step, pk, bool(r[TRAINABLE])))
    return salvaged.take(take, rows_of)


# -- the launcher's writes (the simulator, an export's replay, tests) ------------------------------


def tables_exist(db: Database) -> bool:
    """True when both of the launcher's tables can be read."""
    try:
        db.rows(launcher_sql.HAS_STEPS)
        db.rows(launcher_sql.HAS_SCHEDULE)
        return True
    except StorageError:
        return False


def create_launcher_tables(
    db: Database, failed: Callable[[StorageError], None] | None = None
) -> None:
    """Create the launcher's two tables and their indexes if they are missing (init-db, the
    simulator, tests), statement by statement. With ``failed``, a statement that fails (another
    creator raced this one) goes to it and the next one runs."""
    for stmt in launcher_sql.LAUNCHER_DDL[db.backend]:
        try:
            db.execute(stmt)
        except StorageError as exc:
            if failed is None:
                raise
            failed(exc)


def insert_sessions(db: Database, rows: Sequence[Sequence[Any]]) -> None:
    """Schedule sessions: job_environments rows (launcher_sql.ENV_COLUMNS), in one transaction."""
    with db.transaction():
        db.executemany(launcher_sql.INSERT_ENV, rows)


def insert_step(db: Database, row: Sequence[Any]) -> None:
    """Write one step: a session_steps row (launcher_sql.STEP_COLUMNS)."""
    db.execute(launcher_sql.INSERT_STEP, row)


def insert_steps(db: Database, rows: Sequence[Sequence[Any]]) -> None:
    """Write a flush of steps (session_steps rows) in one transaction, as the launcher flushes."""
    with db.transaction():
        db.executemany(launcher_sql.INSERT_STEP, rows)
