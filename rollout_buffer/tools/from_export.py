"""``python -m rollout_buffer.simulate --from-export FILE``: write an export back as launcher rows.

Owns: turning export records (``rollout_buffer.tools.export``) into ``job_environments`` and
``session_steps`` rows of a new job, at the simulator's ``--pace``, with the simulator's
signals, retries and final ``SIMULATE {json}`` line. A trainer can then be debugged against real
data with no environment at all.

What is written back: every record of the file, group by group in file order, the steps of a
group's sessions interleaved round-robin (as concurrent sessions write them). Each session gets
a fresh session_id (env_id) as a new launcher run would, the group keeps its group_id, and every
step keeps its content: messages (the stored text when it was not a JSON list, so a malformed row
is malformed again), response, step_reward, reward, env_state, the truncated/terminal/completed
flags, env_name and llm_model. Rows that arrived after their group was decided (``late_rows_*``)
are left out: in a new job they would have joined the group before its decision, so the same
groups come back. ``created_at`` is the time of writing.

A row the target database cannot hold as it is is still written when it can be: Postgres text
cannot hold NUL, so there each NUL becomes U+FFFD (the row is *changed*). A row the database
refuses (a value of the wrong type, say a SQLite step_id that is text) is *skipped*, and the next
one is written. Each changed or skipped row is reported on stderr with its reason, and counted
in the final line (``changed_rows``, ``skipped_rows``).

It must not read or write the buffer's tables: it reads the export file and INSERTs launcher rows,
as a launcher does.
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from typing import Any

from rollout_buffer.core.errors import IntegrityError, StorageError
from rollout_buffer.storage import launcher_tables
from rollout_buffer.tools.export import read_export
from rollout_buffer.tools.simulator import Simulator
from rollout_buffer.tools.workload import LLM_MODEL

LATE = "late_rows_"
NUL, REPLACEMENT = "\x00", "\ufffd"


def _number(v: Any, backend: str) -> Any:
    """A reward of the export, as the database can hold it. 'nan', 'inf', '-inf' stand for
    non-finite numbers; absent is 0. A value that is no number (text the launcher stored) or NaN on
    SQLite (which would store NULL) is written as its text: the row is rejected again
    (non_finite_step_reward), as it was, instead of stopping the replay. Postgres gets NaN for
    it."""
    if v is None:
        return 0.0
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = math.nan
    if math.isnan(f) and backend == "sqlite":
        return str(v)
    return f


def without_nul(values: dict[str, Any], backend: str) -> list[str]:
    """On Postgres (its text cannot hold NUL): replace NUL in the text values, in place; returns the
    names of the values changed."""
    if backend != "postgres":
        return []
    changed = [k for k, v in values.items() if isinstance(v, str) and NUL in v]
    for k in changed:
        values[k] = values[k].replace(NUL, REPLACEMENT)
    return changed


def _messages_text(step: dict[str, Any]) -> str:
    if step.get("messages") is None:
        return step.get("messages_text") or ""
    return json.dumps(step["messages"], ensure_ascii=False)


class ExportReplayer(Simulator):
    """Writes the records of an export file as the rows of ``--job-id``."""

    def __init__(self, args: Any, url: str) -> None:
        super().__init__(args, url)
        self.records = 0
        self.sessions = 0
        self.group_ids: set[str] = set()
        self.changed_rows = 0
        self.skipped_rows = 0

    def run(self) -> None:
        a = self.args
        self.check_stop()
        self.ensure_tables()
        if not a.quiet:
            print(
                f"simulate: job {a.job_id}: writing back {a.from_export}, pace {a.pace}s -> "
                f"{self.connect().safe_url}",
                flush=True,
            )
        first = True
        for record in read_export(a.from_export):
            self.check_stop()
            sessions = [
                (
                    str(uuid.uuid4()),
                    [
                        step
                        for step in s.get("steps", [])
                        if not str(step.get("reason") or "").startswith(LATE)
                    ],
                )
                for s in record.get("sessions", [])
            ]
            sessions = [(sid, steps) for sid, steps in sessions if steps]
            if not sessions:
                continue
            self.records += 1
            self.sessions += len(sessions)
            gid = record.get("group_id")
            if gid is not None:
                self.group_ids.add(gid)
            held = {"group_id": gid}
            nul_in_gid = without_nul(held, self.backend())  # the same id for all its rows
            self._environments(record, held["group_id"], sessions)
            for i in range(max(len(steps) for _, steps in sessions)):
                for sid, steps in sessions:
                    if i < len(steps):
                        if a.pace > 0 and not first:
                            self.pause(a.pace)
                        first = False
                        self._step(sid, gid, held["group_id"], steps[i], nul_in_gid)
                        self.progress()

    def backend(self) -> str:
        return str(self.connect().backend)

    def _environments(
        self,
        record: dict[str, Any],
        gid: str | None,
        sessions: list[tuple[str, list[dict[str, Any]]]],
    ) -> None:
        a, created = self.args, self.now()
        # json.dumps writes a NUL as \u0000: the parameters keep the exported group_id as it was
        params = json.dumps(
            {"replayed_from": record.get("job_id"), "group_id": record.get("group_id")}
        )
        names = [steps[0].get("env_name") or "replay" for _, steps in sessions]
        if self.backend() == "postgres":
            names = [n.replace(NUL, REPLACEMENT) if isinstance(n, str) else n for n in names]
        rows = [
            (a.job_id, sid, name, params, None, gid, 0, 0, created)
            for (sid, _), name in zip(sessions, names, strict=True)
        ]

        def insert(db: Any) -> None:
            launcher_tables.insert_sessions(db, rows)

        try:
            self.write(insert, "inserting job_environments")
        except (IntegrityError, StorageError) as exc:
            if not (exc.about_data or isinstance(exc, IntegrityError)):
                raise
            # only the listing of its sessions: its steps are still written (or reported)
            print(
                f"simulate: job_environments of group {json.dumps(record.get('group_id'))} "
                f"skipped: the database refused them: {exc}",
                file=sys.stderr,
                flush=True,
            )

    def _step(
        self,
        sid: str,
        exported_gid: str | None,
        gid: str | None,
        step: dict[str, Any],
        why: list[str],
    ) -> None:
        """Write one step (``gid``: the exported group id as the database can hold it; ``why``:
        the names of the values already changed for it)."""
        a, backend = self.args, self.backend()
        text = {
            "env_name": step.get("env_name") or "replay",
            "llm_model": step.get("llm_model") or LLM_MODEL,
            "messages": _messages_text(step),
            "response": step.get("response") or "",
            "env_state": step.get("env_state"),
        }
        changed = why + without_nul(text, backend)
        row = (
            sid,
            step.get("step_id"),
            text["env_name"],
            text["llm_model"],
            gid,
            a.job_id,
            text["messages"],
            text["response"],
            _number(step.get("step_reward"), backend),
            _number(step.get("reward"), backend),
            text["env_state"],
            int(bool(step.get("terminal"))),
            int(bool(step.get("truncated"))),
            int(bool(step.get("completed"))),
            1,
            self.now(),
        )

        def insert(db: Any) -> None:
            launcher_tables.insert_step(db, row)

        try:
            self.write(insert, f"inserting step {step.get('step_id')} of session {sid}")
        except (IntegrityError, StorageError) as exc:
            if not (exc.about_data or isinstance(exc, IntegrityError)):
                raise  # the database, not this row: stop as before
            self.skipped_rows += 1
            self._report(step, exported_gid, "skipped", f"the database refused it: {exc}")
            return
        self.rows += 1
        if changed:
            self.changed_rows += 1
            self._report(
                step,
                exported_gid,
                "changed",
                f"NUL replaced by U+FFFD in {', '.join(changed)} (Postgres text cannot hold NUL)",
            )

    def _report(self, step: dict[str, Any], gid: str | None, what: str, why: str) -> None:
        """One line per changed or skipped row, naming it as the export does (its step_pk there)."""
        print(
            f"simulate: row step_pk={step.get('step_pk')} (group {json.dumps(gid)}, step "
            f"{json.dumps(step.get('step_id'))}) {what}: {why}",
            file=sys.stderr,
            flush=True,
        )

    def progress_line(self, rate: float) -> str:
        return (
            f"simulate: job {self.args.job_id}: {self.rows} rows, {self.records} records, "
            f"{self.sessions} sessions written back, {rate:.0f} rows/s"
        )

    def summary(self, interrupted: bool) -> dict[str, Any]:
        out = super().summary(interrupted)
        out.update(
            {
                "from_export": self.args.from_export,
                "records": self.records,
                "groups": len(self.group_ids),
                "sessions": self.sessions,
                "sessions_started": self.sessions,
                "complete_groups": None,
                "completed_sessions": None,
                "failed_sessions": None,
                "truncated_sessions": None,
                "changed_rows": self.changed_rows,
                "skipped_rows": self.skipped_rows,
            }
        )
        return out
