"""Reading the bodies of the rows a poll serves, by primary key, in chunks.

Owns: the body queries of serving and replay, the per-group byte cap while reading (a huge group
is stopped as soon as it passes it), and rebuilding a served group's Take from its recorded pks.
It reads the launcher's table only.

It must not write, and it reads the launcher's table only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rollout_buffer.core.items import COMPLETED, MESSAGES, RESPONSE, SID, STEP, TRAINABLE
from rollout_buffer.core.model import Take
from rollout_buffer.core.salvage import Recorded
from rollout_buffer.storage import launcher_sql
from rollout_buffer.storage.db import Database

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
