"""``rollout-buffer export``: every group the buffer decided for a job, as JSONL (gzipped for
``.gz``).

Owns: the export format (README "Export format", one record per line) and streaming it. One
record per decided group (served or dropped), plus one per rejected row that has no usable group;
each carries its sessions and their steps as the launcher wrote them, every row with its outcome
and reason, and for a served group its items exactly as the trainer got them: rebuilt from the
immutable rows with the batch's uid seed, as a replayed poll is (``fetch.take_from_rows`` then
``items.build_group``), so the uids are the same.

Memory is constant in the job's size: decided groups and the rows accounted one by one are read
in keyset pages sorted by group_id and merged, one group's rows are fetched at a time, and batch
seeds are kept in a small cache. It only reads, so it runs against a live service on either
backend. The file is written as ``FILE.partial`` and renamed when complete.

It must not write to either database: it only reads, through read-only connections.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import os
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, TextIO

from rollout_buffer.core.errors import RolloutBufferError, StorageError
from rollout_buffer.core.items import GID, PARTIAL_FLAG, Malformed, build_group, epoch
from rollout_buffer.core.model import DROPPED, INCOMPLETE_IN_SERVED, REJECTED, SERVED
from rollout_buffer.core.salvage import Recorded
from rollout_buffer.storage import launcher_sql, launcher_tables
from rollout_buffer.storage.db import Database, connect
from rollout_buffer.storage.exports import ExportPages
from rollout_buffer.storage.launcher_tables import fetch_rows, take_from_rows
from rollout_buffer.tools.export_steps import (
    json_number,
    session_plan,
    sessions_of,
    streamed_sessions,
    text_of,
)
from rollout_buffer.tools.progress import Progress, bar

WHAT = ("served", "dropped", "all")
PAGE = 500
SEED_CACHE = 1024
FORMAT_VERSION = 1


class ExportError(RolloutBufferError):
    """The export cannot be made (no such job, unreadable database)."""


@dataclass
class Summary:
    """What an export wrote."""

    records: int = 0
    bytes: int = 0


def _open_out(path: str, gz: bool) -> IO[str]:
    if gz:
        return gzip.open(path, "wt", encoding="utf-8", newline="\n")
    return open(path, "w", encoding="utf-8", newline="\n")


class Exporter:
    """Streams one job's records from a source (launcher) and a state connection."""

    def __init__(self, launcher_db: Database, state_db: Database, job_id: str) -> None:
        self.launcher_db = launcher_db
        self.pages = ExportPages(state_db, job_id, PAGE)
        self.job_id = job_id
        self._has_schedule = True
        # batch_id -> (uid seed, its partial groups), None once the batch was pruned
        self._seeds: collections.OrderedDict[str, tuple[bytes, frozenset[str]] | None] = (
            collections.OrderedDict()
        )

    def count(self) -> int:
        """How many records an ``all`` export has."""
        return self.pages.count()

    def check_job(self) -> None:
        if not self.pages.job_known():
            known = self.pages.recent_jobs()
            raise ExportError(
                f"no job {self.job_id!r} in the buffer's tables; known jobs (newest first): "
                f"{', '.join(known) or 'none'}"
            )

    # -- records -----------------------------------------------------------------------------------
    def records(self, what: str = "all") -> Iterator[str | Iterator[str]]:
        """The export's lines (JSON text without the newline; a dropped group's as an iterator of
        pieces, to be written before the next record is asked for), groups in group_id order, then
        the rejected rows without a group in step_pk order."""
        if what not in WHAT:
            raise ExportError(f"--what {what!r}: expected one of {', '.join(WHAT)}")
        extra = self.pages.group_rows()
        pending = next(extra, None)
        for group in self.pages.groups():
            gid = group["group_id"]
            accounted: list[tuple] = []
            while pending is not None and pending[0] <= gid:
                if pending[0] == gid:
                    accounted.append(pending)
                pending = next(
                    extra, None
                )  # a row of an undecided group (never rejected) is skipped
            if what == "all" or (what == "served") == (group["status"] == SERVED):
                yield self._group_record(group, accounted)
        if what != "served":
            for r in self.pages.orphans():
                yield self._orphan_record(r)

    def _rows(self, pks: list[int]) -> dict[int, tuple]:
        return fetch_rows(self.launcher_db, pks, launcher_sql.fetch_export_rows)

    def _seed(self, batch_id: str) -> tuple[bytes, frozenset[str]] | None:
        if batch_id not in self._seeds:
            r = self.pages.batch_seed(batch_id)
            meta = json.loads(r["meta"]) if r is not None and r.get("meta") else {}
            self._seeds[batch_id] = (
                (bytes.fromhex(r["seed"]), frozenset(meta.get("partial_groups") or ()))
                if r is not None
                else None
            )
            if len(self._seeds) > SEED_CACHE:
                self._seeds.popitem(last=False)
        return self._seeds[batch_id]

    def _group_record(self, group: dict[str, Any], accounted: list[tuple]) -> str | Iterator[str]:
        gid, status = group["group_id"], group["status"]
        pks = [int(p) for p in (group["pks"] or "").split(",") if p]
        extra = {int(r[1]): (r[2], r[3]) for r in accounted}
        if status != SERVED:  # no items to rebuild: streamed, whatever its size
            return self._dropped_record(group, pks, extra)
        rows = self._rows(sorted(set(pks) | set(extra)))
        outcomes: dict[int, tuple[str, str | None]] = {}
        items_json: str | None = None
        uids = None
        take = take_from_rows(
            gid, pks, {pk: rows[pk] for pk in pks if pk in rows}, Recorded.of(group["reason"])
        )
        for pk in take.served_pks:
            outcomes[pk] = (SERVED, None)
        for pk in take.incomplete_pks:
            outcomes[pk] = (DROPPED, INCOMPLETE_IN_SERVED)
        items_json, uids = self._items(take, rows, group["batch_id"])
        for pk, (outcome, why) in extra.items():
            outcomes[pk] = (REJECTED if outcome == REJECTED else DROPPED, why)
        record = self._head(group, sorted(set(outcomes) - set(rows)))
        record["sessions"] = sessions_of(rows, outcomes)
        record["uids"] = uids
        if take.salvage is not None:  # its truncated sessions, by reason (issue 38)
            record["salvaged"] = dict(sorted(take.salvage.sessions.items()))
        # the items are spliced in as the trainer received them, byte for byte
        head = json.dumps(record, ensure_ascii=False)
        return head[:-1] + ',"items":[' + items_json + "]}"

    def _head(self, group: dict[str, Any], missing: list[int]) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "job_id": self.job_id,
            "group_id": group["group_id"],
            "status": group["status"],
            "reason": group["reason"],
            "batch_id": group["batch_id"],
            "decided_at": json_number(group["resolved_at"]),
            "missing_step_pks": missing,
            "generation": self._generation(group["group_id"]),
        }

    def _generation(self, group_id: str) -> dict[str, Any]:
        """What generating the group cost (from every row of its sessions, trainable or not, and
        the sessions the launcher scheduled): generation seconds (first to last row of each
        session, at the launcher's flush times), rows, and the sessions that never wrote a
        trainable row."""
        seconds, rows, trainable = 0.0, 0, set()
        sessions: set[str] = set()
        for session, count, first, last, any_trainable in launcher_tables.generation_rows(
            self.launcher_db, self.job_id, group_id
        ):
            sessions.add(session)
            rows += int(count)
            if any_trainable:
                trainable.add(session)
            with contextlib.suppress(Malformed):
                seconds += max(0.0, epoch(last) - epoch(first))
        if self._has_schedule:
            try:
                sessions.update(
                    launcher_tables.scheduled_sessions(self.launcher_db, self.job_id, group_id)
                )
            except StorageError:
                self._has_schedule = False  # a writer that is not the launcher: no such table
        return {
            "generation_s": round(seconds, 3),
            "rows": rows,
            "sessions": len(sessions),
            "sessions_without_trainable_row": sorted(s for s in sessions if s not in trainable),
        }

    def _dropped_record(
        self, group: dict[str, Any], pks: list[int], extra: dict[int, tuple[str, str | None]]
    ) -> Iterator[str]:
        """A dropped group's record in pieces: planned from its rows' metadata and text sizes,
        then its steps fetched a few at a time (a group dropped as group_too_large is as large as
        its launcher made it; the export never holds it whole)."""
        outcomes = dict.fromkeys(pks, (DROPPED, group["reason"]))
        for pk, (outcome, why) in extra.items():
            outcomes[pk] = (REJECTED if outcome == REJECTED else DROPPED, why)
        meta = fetch_rows(self.launcher_db, sorted(outcomes), launcher_sql.fetch_export_sizes)
        sizes = {pk: int(r[-1] or 0) for pk, r in meta.items()}
        head = json.dumps(self._head(group, sorted(set(outcomes) - set(meta))), ensure_ascii=False)
        yield head[:-1] + ', "sessions": '
        yield from streamed_sessions(session_plan(meta), sizes, self._rows, outcomes)
        yield "}"

    def _items(self, take: Any, rows: dict[int, tuple], batch_id: str | None) -> tuple[str, str]:
        """The served items of a group as JSON text, and whether their uids are the served ones."""
        known = self._seed(batch_id) if batch_id else None
        seed, partial = known if known is not None else (None, frozenset())
        buf = bytearray()
        try:
            build_group(
                take,
                rows,
                seed or b"\0" * 16,
                self.job_id,
                buf,
                PARTIAL_FLAG if take.group_id in partial else "",
            )
        except Malformed as exc:  # pragma: no cover - served rows were valid and rows are immutable
            return json.dumps({"error": f"cannot rebuild: {exc.reason}"}), "unbuildable"
        text = buf.decode("utf-8")
        if seed is not None:
            return text, "as_served"
        # the batch (and its seed) was pruned after the replay window: the uids cannot be known
        items = json.loads("[" + text + "]")
        for it in items:
            it["uid"] = None
        return json.dumps(items, ensure_ascii=False)[1:-1], "lost"

    def _orphan_record(self, r: tuple) -> str:
        pk, outcome, reason, recorded_at = int(r[0]), r[1], r[2], r[3]
        rows = self._rows([pk])
        record = {
            "format": FORMAT_VERSION,
            "job_id": self.job_id,
            "group_id": None,
            "status": REJECTED,
            "reason": reason,
            "batch_id": None,
            "decided_at": json_number(recorded_at),
            "missing_step_pks": [] if pk in rows else [pk],
            "sessions": sessions_of(
                rows, {pk: (REJECTED if outcome == REJECTED else DROPPED, reason)}
            ),
        }
        if rows:
            record["group_id_text"] = text_of(
                rows[pk][GID]
            )  # what the row held instead of a usable group_id
        return json.dumps(record, ensure_ascii=False)


def export(
    launcher_db: Database,
    state_db: Database,
    job_id: str,
    path: str,
    *,
    what: str = "all",
    progress_to: TextIO | None = None,
) -> Summary:
    """Write the job's records to ``path`` (gzip when it ends in .gz); returns what was written."""
    exporter = Exporter(launcher_db, state_db, job_id)
    exporter.check_job()
    total = exporter.count() if what == "all" else None
    progress = Progress(progress_to) if progress_to is not None else None
    summary = Summary()
    started = shown = time.monotonic()
    partial = path + ".partial"
    try:
        with _open_out(partial, gz=path.endswith(".gz")) as f:
            for record in exporter.records(what):
                for piece in [record] if isinstance(record, str) else record:
                    f.write(piece)
                    summary.bytes += len(piece)
                f.write("\n")
                summary.records += 1
                summary.bytes += 1
                now = time.monotonic()
                if progress is not None and now - shown >= 0.2:
                    shown = now
                    rate = summary.records / max(now - started, 1e-6)
                    progress.show(
                        f"  export {bar(summary.records, total)}  {summary.records} records  "
                        f"{summary.bytes / 1e6:7.1f} MB  {rate:6.0f} records/s"
                    )
        os.replace(partial, path)
    except BaseException:
        if progress is not None:
            progress.end()
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    if progress is not None:
        progress.show(
            f"  export {bar(summary.records, total or summary.records)}  "
            f"{summary.records} records  {summary.bytes / 1e6:7.1f} MB  "
            f"{time.monotonic() - started:.1f} s",
            force=True,
        )
        progress.end()
    return summary


def read_export(path: str) -> Iterator[dict[str, Any]]:
    """The records of an export file, one at a time (plain or gzip, told by its first bytes). A file
    that is not an export (a line that is no JSON object, a truncated or corrupt gzip, bytes that
    are not UTF-8) raises ExportError naming the line."""
    with open(path, "rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    n = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise ExportError(f"{path}:{n}: not a JSON record ({exc})") from None
                    if not isinstance(record, dict) or not isinstance(
                        record.get("sessions", []), list
                    ):
                        raise ExportError(
                            f"{path}:{n}: not an export record (a JSON object with its sessions)"
                        )
                    yield record
    except (EOFError, gzip.BadGzipFile, UnicodeDecodeError, zlib.error) as exc:
        raise ExportError(
            f"{path}: unreadable after line {n} ({type(exc).__name__}: {exc}); "
            "a truncated or corrupt file?"
        ) from None


def main_export(db_url: str, state_db_url: str | None, job_id: str, out: str, what: str) -> int:
    """``rollout-buffer export``: the exit status (0 written, 1 database or file trouble, 2 bad
    arguments). The databases are opened read-only (SQLite: a mistyped path is an error, never a new
    empty file). The progress bar is shown on a terminal only; the last line says what was
    written."""
    if what not in WHAT:
        print(
            f"rollout-buffer export: --what {what!r}: expected one of {', '.join(WHAT)}",
            file=sys.stderr,
        )
        return 2
    launcher_db = state_db = None
    try:
        launcher_db = connect(db_url, readonly=True)
        state_db = (
            connect(state_db_url, readonly=True)
            if state_db_url and state_db_url != db_url
            else launcher_db
        )
        summary = export(
            launcher_db,
            state_db,
            job_id,
            out,
            what=what,
            progress_to=sys.stderr if sys.stderr.isatty() else None,
        )
    except ExportError as exc:
        print(f"rollout-buffer export: {exc}", file=sys.stderr)
        return 2
    except RolloutBufferError as exc:
        print(f"rollout-buffer export: {exc}", file=sys.stderr)
        return 1
    except (
        OSError
    ) as exc:  # the output cannot be written (no such directory, no space, no permission)
        print(f"rollout-buffer export: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        for db in {id(d): d for d in (launcher_db, state_db) if d is not None}.values():
            db.close()
    print(
        f"exported {summary.records} records of job {job_id} to {out} "
        f"({summary.bytes / 1e6:.1f} MB)"
    )
    return 0
