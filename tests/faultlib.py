"""The fault-injection scenario engine (issue 14), shared by tests/test_faults.py and
tests/bench/fault_soak.py.

One seeded run: a real ``rollout-buffer serve`` (gunicorn, :class:`servers.Server`) on a real
SQLite file or Postgres schema; several writer processes (``tests/fakes/fault_writer.py``)
inserting launcher-style rows with random delays, some holding a transaction open across polls
(on Postgres some commit out of id order); random malformed rows; a trainer polling with
``request_id`` and retrying with the same id on any error; the service killed -9 (whole process
group) at random points, including during a poll and just after a batch was recorded, then
restarted on the same port and database; the LLM proxy (:class:`fakes.fake_proxy.FakeProxy`)
randomly down or hung.

At the end the outcome is checked against the database itself (``session_steps`` and the
``rollout_buffer_*`` tables) and what the trainer received; nothing is checked against the
plan. Every random choice comes from ``random.Random(seed)``; what cannot be seeded is the
timing of real processes, so a seed reproduces the workload and the fault schedule, not the
exact interleaving. A failure raises :class:`FaultSuiteFailure` whose message starts with the
seed and the commands that rerun it.

Only the HTTP endpoints and the database tables are used, so the engine does not depend on how
the service is built inside.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import hostile_rows
import requests
from fakes.fake_proxy import FakeProxy
from servers import ROOT, Server, log_tail
from support import paused_in_fence

from rollout_buffer.launcher.procfs import group_members

WRITER = Path(__file__).resolve().parent / "fakes" / "fault_writer.py"
JOB = "fjob"
OTHER_JOB = "fjob-other"  # rows of another job with the same group ids: never read
# past the service's idle-transaction timeout (0.8 of the default 10 s lease)
PAUSE_IN_FENCE_S = 8.5
BASE_TIME = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
DEEP = 2000  # JSON nesting depth of the deep rows (json.loads recurses ~1 level per frame)
MALFORMED_KINDS = {
    "sqlite": (
        "deep_messages",
        "deep_env_state",
        "bad_created_at",
        "null_group_id",
        "blob_session_id",
        "invalid_utf8",
    ),
    "postgres": ("deep_messages", "deep_env_state", "bad_created_at", "null_group_id"),
}


class FaultSuiteFailure(AssertionError):
    """The service broke a promise under faults (the message names the seed and how to rerun)."""


@dataclass
class Settings:
    """Knobs of one run; the defaults are what CI runs (about a minute per backend)."""

    seed: int
    backend: str  # sqlite | postgres
    writers: int = 3
    groups_per_writer: int = 8
    k: int = 3
    kills: int = 6
    ttl_s: float = 12.0
    p_malformed: float = 0.25
    p_incomplete: float = 0.2
    p_hostile: float = 0.12  # hostile versions, ids and control characters (hostile_rows.py)
    p_hold: float = 0.12
    kinds: tuple[str, ...] | None = (
        None  # malformed kinds to draw from (default: all of the backend)
    )

    def hold_range(self) -> tuple[float, float]:
        # A held SQLite write transaction blocks every other writer, the service's state writes
        # included (busy timeout 5 s): keep it short. Postgres writers only block nobody.
        # Postgres holds outlast the safe cursor's one-second pairing, so a kill can land while the
        # durable low-water mark could already have passed the row in flight (issue 14, scenario 1).
        return (0.5, 1.5) if self.backend == "sqlite" else (2.0, 7.0)


def rerun_hint(s: Settings) -> str:
    return (
        f"seed={s.seed} backend={s.backend}; rerun: RBTEST_FAULT_SEED={s.seed} python -m pytest "
        f"tests/test_faults.py -k {s.backend}   or   python tests/bench/fault_soak.py "
        f"--seed {s.seed} --backend {s.backend} --groups {s.groups_per_writer} --kills {s.kills}"
    )


# -- the plan: rows and transactions of each writer
# --------------------------------------------------------


def _hex_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"  # 32 chars: session_id is VARCHAR(36) on Postgres


def _created_at(rng: random.Random, offset_s: float) -> str:
    t = BASE_TIME + timedelta(seconds=offset_s)
    if rng.random() < 0.2:  # naive values are UTC
        return t.strftime("%Y-%m-%d %H:%M:%S.%f")
    return t.strftime("%Y-%m-%d %H:%M:%S.%f+00:00")


def _history(group: str, step: int, rng: random.Random) -> list[dict[str, str]]:
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": f"task {group} \u00e9\u4e2d"},
    ]
    for i in range(1, step):
        msgs += [
            {"role": "assistant", "content": f"a{i}"},
            {"role": "user", "content": f"obs {i} {rng.random():.3f}"},
        ]
    return msgs


def _row(
    s: Settings,
    rng: random.Random,
    group: str,
    session: str,
    step: int,
    *,
    completed: bool,
    job: str = JOB,
) -> dict[str, Any]:
    return {
        "session_id": session,
        "step_id": step,
        "env_name": "env",
        "llm_model": "model",
        "group_id": group,
        "job_id": job,
        "messages": json.dumps(_history(group, step, rng), ensure_ascii=rng.random() < 0.5),
        "response": f"answer {session[:6]} {step} \U0001f600",
        "step_reward": round(rng.uniform(-1, 1), 3),
        "reward": round(rng.uniform(0, 5), 3),
        "env_state": None
        if rng.random() < 0.15
        else json.dumps({"weight_version": rng.randint(0, 9)}),
        "is_terminal": 1 if completed else 0,
        "is_truncated": 1 if completed and rng.random() < 0.3 else 0,
        "is_session_completed": 1 if completed else 0,
        "is_trainable": 1,
        "created_at": _created_at(rng, rng.uniform(0, 3600)),
    }


def _spoil(s: Settings, rng: random.Random, row: dict[str, Any], kind: str) -> None:
    """Turn a well-formed row into one that cannot become an item."""
    if kind == "deep_messages":
        row["messages"] = "[" * DEEP + "]" * DEEP  # a list, nested too deep to parse recursively
    elif kind == "deep_env_state":
        row["env_state"] = '{"a": ' * DEEP + "1" + "}" * DEEP
    elif kind == "bad_created_at":
        row["created_at"] = "infinity" if s.backend == "postgres" else "garbage, not a time"
    elif kind == "null_group_id":
        row["group_id"] = None
    elif kind == "blob_session_id":
        row["session_id"] = {"kind": "blob", "hex": row["session_id"].encode().hex()}
    elif kind == "invalid_utf8":
        col = rng.choice(["messages", "response"])
        raw = b'["\xff\xfe broken"]' if col == "messages" else b"answer \xc3\x28"
        row[col] = {"kind": "text_bytes", "hex": raw.hex()}
    else:  # pragma: no cover
        raise ValueError(kind)


def _group_sessions(
    s: Settings, rng: random.Random, gid: str, hostile: str | None = None
) -> tuple[str, list[list[dict[str, Any]]]]:
    """(kind, the rows of each session of one group, in step order); ``hostile`` forces that
    hostile kind."""
    roll = rng.random()
    kind = "complete"
    if roll < s.p_malformed:
        kind = rng.choice(s.kinds or MALFORMED_KINDS[s.backend])
    elif roll < s.p_malformed + s.p_incomplete:
        kind = "incomplete"
    if s.p_malformed + s.p_incomplete <= roll < s.p_malformed + s.p_incomplete + s.p_hostile:
        hostile = hostile or rng.choice(hostile_rows.KINDS)  # a complete group, made hostile below
    if hostile is not None:
        kind = "complete"
    n_sessions = s.k
    n_complete = s.k
    if kind == "incomplete" or (kind != "complete" and rng.random() < 0.3):
        n_sessions = rng.randint(1, s.k)
        n_complete = (
            rng.randint(0, n_sessions - 1) if kind == "incomplete" else rng.randint(0, n_sessions)
        )
    sessions = []
    for j in range(n_sessions):
        sid = _hex_id(rng)
        completes = j < n_complete
        steps = rng.randint(2 if kind not in ("complete", "incomplete") and j == 0 else 1, 3)
        sessions.append(
            [
                _row(s, rng, gid, sid, st, completed=completes and st == steps)
                for st in range(1, steps + 1)
            ]
        )
    if kind not in ("complete", "incomplete"):
        # never the completed row: the group must be complete but for the one bad row
        victim = rng.randrange(len(sessions[0]) - 1)
        _spoil(s, rng, sessions[0][victim], kind)
    if hostile is not None:
        hostile_rows.spoil(rng, sessions, hostile)
        return hostile, sessions
    if kind == "complete" and rng.random() < 0.2:  # a non-trainable row is never read nor served
        extra = _row(s, rng, gid, sessions[0][0]["session_id"], 99, completed=False)
        extra["is_trainable"] = 0
        sessions[0].insert(0, extra)
    return kind, sessions


def _merge(rng: random.Random, sessions: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A random interleaving of sessions' rows that keeps each session's rows in step order."""
    queues = [list(x) for x in sessions if x]
    out = []
    while queues:
        q = rng.choice(queues)
        out.append(q.pop(0))
        if not q:
            queues.remove(q)
    return out


def make_plan(
    s: Settings, rng: random.Random, writer: int, url: str, log_path: str
) -> dict[str, Any]:
    """One writer's transactions; groups are written two at a time, so a group's rows are close in
    time."""
    stream: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    gids = [f"g{writer}-{i:02d}-{rng.getrandbits(24):06x}" for i in range(s.groups_per_writer)]
    # every hostile kind in every run (when the writer has groups enough), whatever the draws
    forced = dict(
        zip(gids[1::2], hostile_rows.KINDS if s.p_hostile and writer == 0 else (), strict=False)
    )
    for a in range(0, len(gids), 2):
        pair = []
        for gid in gids[a : a + 2]:
            kinds[gid], sessions = _group_sessions(s, rng, gid, forced.get(gid))
            pair += sessions
        stream += _merge(rng, pair)
    if writer == 0:  # the same group id in another job: must never be read for ours
        stream.insert(
            rng.randrange(len(stream)),
            _row(s, rng, gids[0], _hex_id(rng), 1, completed=True, job=OTHER_JOB),
        )
    lead: list[dict[str, Any]] = []
    if s.backend == "postgres" and writer == 0:
        # The leading hold: the first session of the run, held open while everything after it is
        # written, read, served and the cursor saved. A kill during it is issue 14's scenario 1.
        first = json.dumps(stream[0]["session_id"])
        lead = [r for r in stream if json.dumps(r["session_id"]) == first]
        stream = [r for r in stream if json.dumps(r["session_id"]) != first]
    last_index: dict[Any, int] = {}
    for i, row in enumerate(stream):
        last_index[json.dumps(row["session_id"])] = i
    txns = []
    i = 0
    lo, hi = s.hold_range()
    while i < len(stream):
        n = rng.randint(1, 5)
        rows = stream[i : i + n]
        hold = rng.uniform(lo, hi) if rng.random() < s.p_hold else 0.0
        # A detached transaction commits after later ones; only allowed when each of its sessions
        # ends in it, since the launcher commits a session's rows in step order.
        ends_here = all(last_index[json.dumps(r["session_id"])] < i + n for r in rows)
        txns.append(
            {
                "delay_s": round(rng.uniform(0.0, 0.25), 3),
                "hold_s": round(hold, 3),
                "rows": rows,
                "detach": bool(
                    hold and ends_here and s.backend == "postgres" and rng.random() < 0.7
                ),
            }
        )
        i += n
    if lead:
        txns.insert(0, {"delay_s": 0.0, "hold_s": 7.0, "rows": lead, "detach": True})
    return {"backend": s.backend, "url": url, "log_path": log_path, "txns": txns, "kinds": kinds}


def plan_duration(plan: dict[str, Any]) -> float:
    return sum(t["delay_s"] + (0 if t["detach"] else t["hold_s"]) for t in plan["txns"])


# -- the truth, read back from session_steps
# ---------------------------------------------------------------


@dataclass
class Row:
    pk: int
    session_id: Any  # str, or bytes for a BLOB
    step_id: int
    group_id: str | None
    messages: Any  # str, or bytes when not valid UTF-8
    response: Any
    step_reward: float
    env_state: Any
    truncated: int
    completed: int
    created_at: str

    def problem(self) -> str | None:
        """Why this row cannot become an item (an independent re-implementation of SPEC §3), or
        None."""
        if not isinstance(self.session_id, str):
            return "BLOB session_id"
        if self.group_id is None:
            return "NULL group_id"
        for name in ("messages", "response", "env_state"):
            if isinstance(getattr(self, name), bytes):
                return f"{name} is not valid UTF-8"
        try:
            msgs = _strict_json(self.messages)
        except (ValueError, RecursionError) as exc:
            return f"messages: {type(exc).__name__}"
        if not isinstance(msgs, list):
            return "messages not a list"
        if self.env_state is not None:
            try:
                env = _strict_json(self.env_state)
            except (ValueError, RecursionError) as exc:
                return f"env_state: {type(exc).__name__}"
            if not isinstance(env, dict):
                return "env_state not an object"
        if _epoch(self.created_at) is None:
            return f"created_at {self.created_at!r}"
        return None


def _strict_json(text: str) -> Any:
    def bad(const: str) -> Any:
        raise ValueError(const)

    return json.loads(text, parse_constant=bad)


def _epoch(text: str) -> float | None:
    try:
        t = datetime.fromisoformat(text.strip())
    except (ValueError, TypeError):
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    return value


def read_rows(url: str, backend: str, job: str = JOB) -> list[Row]:
    """Every trainable row of the job, read with the raw driver so that no bad value is hidden."""
    cols = (
        "id, session_id, step_id, group_id, messages, response, step_reward, env_state, "
        "is_truncated, is_session_completed"
    )
    if backend == "sqlite":
        conn = sqlite3.connect(url[len("sqlite://") :], timeout=30)
        conn.text_factory = bytes
        try:
            raw = conn.execute(
                f"SELECT {cols}, CAST(created_at AS BLOB), typeof(session_id) FROM session_steps "
                "WHERE job_id = ? AND is_trainable = 1",
                (job,),
            ).fetchall()
        finally:
            conn.close()
        out = []
        for r in raw:
            sid = r[1] if r[-1] == b"blob" else _text(r[1])
            out.append(
                Row(
                    r[0],
                    sid,
                    r[2],
                    _text(r[3]),
                    _text(r[4]),
                    _text(r[5]),
                    float(r[6]),
                    _text(r[7]),
                    r[8],
                    r[9],
                    _text(r[10]) if isinstance(_text(r[10]), str) else repr(r[10]),
                )
            )
        return out
    import psycopg

    with psycopg.connect(url) as conn:
        raw = conn.execute(
            f"SELECT {cols}, created_at::text FROM session_steps "
            "WHERE job_id = %s AND is_trainable = 1",
            (job,),
        ).fetchall()
    return [
        Row(r[0], r[1], r[2], r[3], r[4], r[5], float(r[6]), r[7], r[8], r[9], r[10]) for r in raw
    ]


@dataclass
class Group:
    group_id: str
    rows: list[Row] = field(default_factory=list)

    def sessions(self) -> set[Any]:
        return {r.session_id for r in self.rows}

    def completed_sessions(self) -> set[Any]:
        return {r.session_id for r in self.rows if r.completed}

    def problems(self) -> list[str]:
        return [f"step_pk {r.pk}: {p}" for r in self.rows if (p := r.problem()) is not None]

    def implausible(self) -> bool:
        """A row's weight version cannot be true (hostile_rows.py): dropped, never served."""
        return hostile_rows.implausible([r.env_state for r in self.rows])


def groups_of(rows: list[Row]) -> dict[str, Group]:
    """Groups by group_id; a row with NULL group_id belongs to the group its session's other rows
    name."""
    groups: dict[str, Group] = {}
    session_group: dict[Any, str] = {}
    for r in rows:
        if r.group_id is not None:
            groups.setdefault(r.group_id, Group(r.group_id)).rows.append(r)
            session_group[r.session_id] = r.group_id
    for r in rows:
        if r.group_id is None and r.session_id in session_group:
            groups[session_group[r.session_id]].rows.append(r)
    return groups


def expected_items(g: Group) -> list[dict[str, Any]]:
    """What the trainer must get for a complete, well-formed group: every row of its completed
    sessions."""
    done = g.completed_sessions()
    terminal = {}
    for sid in done:
        last = max(
            (r for r in g.rows if r.session_id == sid and r.completed),
            key=lambda r: (r.step_id, r.pk),
        )
        terminal[sid] = last.step_reward
    out = []
    for r in sorted(
        (r for r in g.rows if r.session_id in done), key=lambda r: (r.session_id, r.step_id, r.pk)
    ):
        env = json.loads(r.env_state) if r.env_state else {}
        out.append(
            {
                "step_pk": r.pk,
                "session_id": r.session_id,
                "steps": r.step_id,
                "reward": terminal[r.session_id],
                "step_reward": r.step_reward,
                "finish_reason": "length" if r.truncated else "stop",
                "weight_version": int(env.get("weight_version", 0)),
                "timestamp": _epoch(r.created_at),
                "messages": [*json.loads(r.messages), {"role": "assistant", "content": r.response}],
            }
        )
    return out


def compare_items(gid: str, got: list[dict[str, Any]], want: list[dict[str, Any]]) -> list[str]:
    """Differences between served items and the expected ones (empty when exact)."""
    got_pks = [i.get("extra_info", {}).get("step_pk") for i in got]
    want_pks = [w["step_pk"] for w in want]
    if got_pks != want_pks:
        return [
            f"group {gid}: served step_pks {got_pks}, expected {want_pks} "
            "(in (session, step, pk) order)"
        ]
    out = []
    for item, w in zip(got, want, strict=True):  # (their step_pks are equal: same length)
        x = item["extra_info"]
        checks = {
            "instance_id": (item.get("instance_id"), gid),
            "reward": (item.get("reward"), w["reward"]),
            "terminal_reward": (x.get("terminal_reward"), w["reward"]),
            "step_reward": (x.get("step_reward"), w["step_reward"]),
            "session_id": (x.get("session_id"), w["session_id"]),
            "steps": (x.get("steps"), w["steps"]),
            "finish_reason": (x.get("finish_reason"), w["finish_reason"]),
            "weight_version": (x.get("weight_version"), w["weight_version"]),
            "messages": (item.get("messages"), w["messages"]),
        }
        for name, (a, b) in checks.items():
            if a != b:
                out.append(
                    f"group {gid} step_pk {w['step_pk']}: {name} is {str(a)[:120]}, expected "
                    f"{str(b)[:120]}"
                )
        ts = x.get("timestamp")
        if not isinstance(ts, (int, float)) or not math.isclose(ts, w["timestamp"], abs_tol=1e-3):
            out.append(
                f"group {gid} step_pk {w['step_pk']}: timestamp {ts}, expected {w['timestamp']}"
            )
    return out


# -- the buffer's own tables
# -------------------------------------------------------------------------------


class StateReader:
    """Reads rollout_buffer_groups and rollout_buffer_batches with the raw driver (a fresh
    connection each time)."""

    def __init__(self, url: str, backend: str) -> None:
        self.url, self.backend = url, backend

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        try:
            if self.backend == "sqlite":
                conn = sqlite3.connect(self.url[len("sqlite://") :], timeout=5)
                try:
                    return conn.execute(sql, params).fetchall()
                finally:
                    conn.close()
            import psycopg

            with psycopg.connect(self.url, connect_timeout=5) as conn:
                return conn.execute(sql.replace("?", "%s"), params).fetchall()
        except Exception as exc:
            if (
                "rollout_buffer_" in str(exc)
                or "no such table" in str(exc)
                or "does not exist" in str(exc)
            ):
                return []
            raise

    def decisions(self, job: str = JOB) -> dict[str, tuple[str, str | None, str]]:
        """{group_id: (status, reason, clear_sessions)}."""
        rows = self.query(
            "SELECT group_id, status, reason, clear_sessions FROM rollout_buffer_groups "
            "WHERE job_id = ?",
            (job,),
        )
        return {g: (st, reason, cs) for g, st, reason, cs in rows}

    def batch_for(self, request_id: str) -> list[tuple]:
        return self.query(
            "SELECT batch_id, group_ids FROM rollout_buffer_batches WHERE request_id = ?",
            (request_id,),
        )

    def batches(self, job: str = JOB) -> list[tuple]:
        return self.query(
            "SELECT request_id, group_ids FROM rollout_buffer_batches WHERE job_id = ?", (job,)
        )


# -- the trainer
# -------------------------------------------------------------------------------------------


class Trainer:
    """Polls with a fresh request_id per logical poll and retries that id on any error until it gets
    a 200."""

    def __init__(self, base_url: str, rng: random.Random) -> None:
        self.url = base_url
        self.rng = rng
        self.http = requests.Session()
        self.pending: tuple[str, dict[str, Any]] | None = (
            None  # a logical poll still to be answered
        )
        self.received: dict[str, dict[str, Any]] = {}  # request_id -> first response with data
        self.lost: dict[str, dict[str, Any]] = {}  # request_id -> an answer the test threw away
        self.served: dict[str, list[tuple[str, list[dict]]]] = {}  # group -> [(request_id, items)]
        self.errors: dict[str, int] = {}
        self.problems: list[str] = []
        self.polls = 0

    def next_request(self) -> tuple[str, dict[str, Any]]:
        if self.pending is None:
            body: dict[str, Any] = {
                "request_id": uuid.UUID(int=self.rng.getrandbits(128), version=4).hex,
                "current_weight_version": hostile_rows.TRAINER_VERSION,
            }
            mg = self.rng.choice([None, None, 1, 2, 5])
            if mg is not None:
                body["max_groups"] = mg
            self.pending = (body["request_id"], body)
        return self.pending

    def attempt(self, body: dict[str, Any], timeout: float = 30.0) -> tuple[bool, Any]:
        """(True, doc) for a 200 with a JSON body, else (False, what went wrong). Never raises."""
        try:
            r = self.http.post(self.url + "/get_rollout_data", json=body, timeout=(3, timeout))
        except requests.RequestException as exc:
            self.http.close()
            self.http = requests.Session()
            return False, type(exc).__name__
        if r.status_code != 200:
            return False, f"HTTP {r.status_code} {r.text[:160]}"
        try:
            return True, r.json()
        except ValueError:
            return False, f"HTTP 200 with a body that is not JSON: {r.text[:160]!r}"

    def settle(self, body: dict[str, Any], outcome: tuple[bool, Any]) -> dict[str, Any] | None:
        """Record one attempt's outcome; the logical poll ends on success."""
        ok, doc = outcome
        self.polls += 1
        rid = body["request_id"]
        if not ok:
            key = str(doc).split(" {")[0][:60]
            self.errors[key] = self.errors.get(key, 0) + 1
            if str(doc).startswith("HTTP 410") or (
                str(doc).startswith("HTTP 4") and not doc.startswith("HTTP 429")
            ):
                self.problems.append(
                    f"request_id {rid}: the retry got {doc} (a retry must get its batch)"
                )
                self.pending = None
            return None
        self.pending = None
        if not isinstance(doc, dict) or "success" not in doc:
            self.problems.append(f"request_id {rid}: a 200 without success: {str(doc)[:200]}")
            return None
        if not doc["success"]:
            if rid in self.lost:
                self.problems.append(
                    f"request_id {rid}: its batch was recorded before the crash, and the retry "
                    f"answered {doc.get('message')!r}"
                )
            return doc
        meta = doc["data"]["meta_info"]
        items = doc["data"]["data"]
        if rid in self.lost and [i["uid"] for i in items] != [
            i["uid"] for i in self.lost[rid]["data"]["data"]
        ]:
            self.problems.append(
                f"request_id {rid}: the retry after the crash got other items than the batch "
                f"recorded before it (groups {meta.get('finished_groups')} vs "
                f"{self.lost[rid]['data']['meta_info'].get('finished_groups')})"
            )
        if rid in self.received:
            first = self.received[rid]
            if [i["uid"] for i in items] != [i["uid"] for i in first["data"]["data"]]:
                self.problems.append(f"request_id {rid}: a replay differs from the first answer")
            return doc
        if meta.get("request_id") not in (None, rid):
            self.problems.append(
                f"request_id {rid}: answered for request_id {meta.get('request_id')}"
            )
        self.received[rid] = doc
        by_group: dict[str, list[dict]] = {}
        for item in items:
            by_group.setdefault(item["instance_id"], []).append(item)
        if sorted(by_group) != sorted(meta.get("finished_groups", [])):
            self.problems.append(
                f"request_id {rid}: finished_groups {meta.get('finished_groups')} "
                f"but items of {sorted(by_group)}"
            )
        for gid, g_items in by_group.items():
            self.served.setdefault(gid, []).append((rid, g_items))
        return doc

    def poll(self) -> dict[str, Any] | None:
        _rid, body = self.next_request()
        return self.settle(body, self.attempt(body))

    def stats(self) -> dict[str, Any] | None:
        try:
            r = self.http.get(self.url + "/stats", timeout=(3, 10))
            return r.json() if r.status_code == 200 else None
        except (requests.RequestException, ValueError):
            return None

    def start_rollout(self, k: int, deadline_s: float = 30.0) -> None:
        end = time.monotonic() + deadline_s
        last = ""
        while time.monotonic() < end:
            try:
                r = self.http.post(
                    self.url + "/start_rollout",
                    json={"num_repeat_per_sample": k, "job_session": JOB},
                    timeout=(3, 30),
                )
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code} {r.text[:200]}"
            except requests.RequestException as exc:
                last = type(exc).__name__
            time.sleep(0.2)
        raise FaultSuiteFailure(f"/start_rollout never succeeded: {last}")


# -- one run
# -----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What happened in a run (printed by the soak script, and in every failure message)."""

    settings: Settings
    kills: list[str] = field(default_factory=list)
    proxy_modes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.settings.backend} seed {self.settings.seed}: {self.seconds:.1f} s, kills "
            f"{self.kills}, "
            f"proxy {self.proxy_modes}, {self.counts}"
        )


class Run:
    """One scenario: build the plan, run writers, trainer, kills and proxy faults, then check."""

    def __init__(self, s: Settings, url: str, workdir: Path) -> None:
        self.s = s
        self.url = url
        self.workdir = Path(workdir)
        self.rng = random.Random(s.seed)
        self.out = Outcome(s)
        self.state = StateReader(url, s.backend)
        self.proxy: FakeProxy | None = None
        self.srv: Server | None = None
        self.writers: list[subprocess.Popen] = []
        self.plans: list[dict[str, Any]] = []
        self.app_name = (
            f"rbtest-fault-{os.getpid()}-{id(self):x}"  # finds our writers in pg_stat_activity
        )

    # ---- driving

    def run(self) -> Outcome:
        t0 = time.monotonic()
        try:
            self._run()
        finally:
            self._teardown()
            self.out.seconds = time.monotonic() - t0
        if self.out.problems:
            raise FaultSuiteFailure(self.report())
        return self.out

    def _run(self) -> None:
        from rollout_buffer.storage.db import connect
        from rollout_buffer.storage.launcher_tables import create_launcher_tables

        db = connect(self.url)
        try:
            create_launcher_tables(db)
        finally:
            db.close()
        self.proxy = FakeProxy()
        env = {
            "AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS": str(self.s.ttl_s),
            "LLM_PROXY_HOST": "127.0.0.1",
            "LLM_PROXY_PORT": str(self.proxy.port),
            "ROLLOUT_BUFFER_PROXY_READ_TIMEOUT_SECONDS": "2",
            **hostile_rows.SERVICE_ENV,
        }
        self.srv = Server(self.url, self.workdir / "srv", env=env, name="faults")
        self._start_server()
        trainer = Trainer(self.srv.url, random.Random(self.rng.getrandbits(64)))
        self.trainer = trainer
        trainer.start_rollout(self.s.k)

        for w in range(self.s.writers):
            plan = make_plan(
                self.s,
                random.Random(self.rng.getrandbits(64)),
                w,
                self.url,
                str(self.workdir / f"writer{w}.jsonl"),
            )
            plan["app_name"] = self.app_name
            self.plans.append(plan)
        write_s = max(plan_duration(p) for p in self.plans)
        # the fault schedule, all drawn before anything runs
        pg_only = ["in_hold", "pause_in_fence"] if self.s.backend == "postgres" else []
        must = ["in_poll", "after_build", *pg_only]
        modes = must + [
            self.rng.choice(["idle", "in_poll", "after_build", *pg_only[:1]])
            for _ in range(self.s.kills - len(must))
        ]
        self.rng.shuffle(modes)
        span = max(write_s, 2.0 * self.s.kills)
        kill_at = sorted(self.rng.uniform(0.5, span) for _ in modes)
        if self.s.backend == "postgres":  # the first kill lands in the leading hold (see make_plan)
            modes.insert(0, modes.pop(modes.index("in_hold")))
            kill_at[0] = min(kill_at[0], 3.0)
        proxy_events = []
        t = 0.0
        while t < span:
            t += self.rng.uniform(1.0, 4.0)
            proxy_events.append((t, self.rng.choice(["up", "up", "down", "hung"])))
        poll_gaps = random.Random(self.rng.getrandbits(64))

        for w, plan in enumerate(self.plans):
            path = self.workdir / f"writer{w}.json"
            path.write_text(json.dumps(plan), encoding="utf-8")
            with open(self.workdir / f"writer{w}.out", "ab") as out:
                self.writers.append(
                    subprocess.Popen(
                        [sys.executable, str(WRITER), str(path)],
                        cwd=ROOT,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        start = time.monotonic()
        last_kill = 0.0
        while kill_at or any(p.poll() is None for p in self.writers):
            now = time.monotonic() - start
            while proxy_events and proxy_events[0][0] <= now:
                mode = proxy_events.pop(0)[1]
                self.proxy.set_mode(mode)
                self.out.proxy_modes.append(mode)
            if kill_at and kill_at[0] <= now and time.monotonic() - last_kill > 1.0:
                kill_at.pop(0)
                self._kill(modes[len(self.out.kills)])
                last_kill = time.monotonic()
                continue
            trainer.poll()
            time.sleep(poll_gaps.uniform(0.02, 0.25))
            if now > span + 120:
                self.out.problems.append(f"the writers did not finish within {span + 120:.0f} s")
                break
        self.proxy.set_mode("up")
        self.out.proxy_modes.append("up")
        for w, p in enumerate(self.writers):
            rc = p.wait(60)
            if rc != 0:
                self.out.problems.append(
                    f"writer {w} exited {rc} (a test bug or a database fault): "
                    f"{log_tail(self.workdir / f'writer{w}.out', 20)}"
                )
        self._drain_and_check()

    def _start_server(self) -> None:
        assert self.srv is not None
        try:
            self.srv.start(timeout=60)
        except BaseException as exc:  # pytest.fail raises an OutcomeException (a BaseException)
            self.out.problems.append(f"the server did not (re)start: {str(exc)[:3000]}")
            raise FaultSuiteFailure(self.report()) from None

    def _kill(self, mode: str) -> None:
        """kill -9 the whole process group at a point of the given kind, then restart on the same
        port."""
        assert self.srv is not None and self.srv.proc is not None
        trainer = self.trainer
        pgid = self.srv.proc.pid
        note = mode
        if mode == "pause_in_fence":
            # SIGSTOP inside a fenced transaction, past its idle-transaction timeout: the server
            # ends that backend (its locks go); woken, the service must carry on from the database
            with paused_in_fence(self.url, JOB, pgid) as caught:
                time.sleep(PAUSE_IN_FENCE_S if caught else 0.0)
            self.out.kills.append(f"{mode}({'paused' if caught else 'no fenced save seen'})")
            return
        if mode == "idle":
            self._kill9(pgid)
        elif mode == "in_hold":
            # wait (bounded) until a writer has held a transaction open for a few seconds
            end = time.monotonic() + 10
            held = False
            while time.monotonic() < end and not held:
                held = bool(
                    self.state.query(
                        "SELECT 1 FROM pg_stat_activity WHERE application_name = ? AND state = "
                        "'idle in transaction' "
                        "AND now() - xact_start > interval '2.5 seconds'",
                        (self.app_name,),
                    )
                )
                if not held:
                    trainer.poll()
                    time.sleep(0.05)
            note += "(a transaction held 2.5 s)" if held else "(no long hold seen)"
            self._kill9(pgid)
        else:
            # a batch is recorded only when a group is ready, and a poll with data takes longest:
            # wait for one
            end = time.monotonic() + 5
            while time.monotonic() < end and not ((trainer.stats() or {}).get("groups") or {}).get(
                "ready"
            ):
                time.sleep(0.05)
            rid, body = trainer.next_request()
            result: list[tuple[bool, Any]] = []
            th = threading.Thread(target=lambda: result.append(trainer.attempt(body)), daemon=True)
            th.start()
            recorded = False
            if mode == "in_poll":
                time.sleep(self.rng.uniform(0.0, 0.01))
            else:
                end = time.monotonic() + 5
                while time.monotonic() < end and th.is_alive() and not recorded:
                    recorded = bool(self.state.batch_for(rid))
                    time.sleep(0.002)
                recorded = recorded or bool(self.state.batch_for(rid))
                note += "(batch recorded)" if recorded else "(no batch)"
            answered = bool(result)
            self._kill9(pgid)
            note += "(answered before the kill)" if answered else "(in flight)"
            th.join(40)
            outcome = result[0] if result else (False, "no answer")
            if recorded and outcome[0]:
                # The batch is durable and the server died right after: treat the answer as lost in
                # transit, so the retry after the restart must replay exactly this batch.
                trainer.lost[rid] = outcome[1]
                outcome = (False, "answer dropped (lost in transit after the crash)")
            trainer.settle(body, outcome)
        self.out.kills.append(note)
        self._start_server()

    def _kill9(self, pgid: int) -> None:
        assert self.srv is not None
        self.srv.stop(signal.SIGKILL)
        end = time.monotonic() + 10
        while group_members(pgid):
            if time.monotonic() > end:
                self.out.problems.append(f"process group {pgid} survived kill -9 for 10 s")
                break
            time.sleep(0.02)

    def _teardown(self) -> None:
        for p in self.writers:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if self.srv is not None:
            self.srv.stop()
        if self.proxy is not None:
            self.proxy.close()

    # ---- the end state

    def _drain_and_check(self) -> None:
        trainer = self.trainer
        rows = read_rows(self.url, self.s.backend)
        groups = groups_of(rows)
        good = {
            g
            for g, grp in groups.items()
            if len(grp.completed_sessions()) >= self.s.k
            and not grp.problems()
            and not grp.implausible()
        }
        others = set(groups) - good
        self.out.counts.update(
            rows=len(rows), groups=len(groups), complete=len(good), other=len(others)
        )

        # poll until every good group arrived and every other one is decided, or the deadline
        deadline = time.monotonic() + self.s.ttl_s + 30
        gaps = random.Random(self.rng.getrandbits(64))
        while time.monotonic() < deadline:
            doc = trainer.poll()
            decided = self.state.decisions()
            if (
                good <= set(trainer.served)
                and others <= set(decided)
                and trainer.pending is None
                and doc is not None
                and not doc.get("success")
            ):
                break
            time.sleep(gaps.uniform(0.02, 0.2) if doc is None or not doc.get("success") else 0)
        self._check(rows, groups, good, others)

    def _check(
        self, rows: list[Row], groups: dict[str, Group], good: set[str], others: set[str]
    ) -> None:
        p = self.out.problems
        trainer = self.trainer
        p += trainer.problems
        decided = self.state.decisions()
        served = trainer.served
        for gid in sorted(good):
            got = served.get(gid, [])
            if len(got) != 1:
                dec = decided.get(gid)
                p.append(
                    f"complete well-formed group {gid} was served {len(got)} times "
                    f"(decision in rollout_buffer_groups: {dec[:2] if dec else None}; "
                    f"{self._timing(gid)})"
                )
                continue
            p += compare_items(gid, got[0][1], expected_items(groups[gid]))
            if decided.get(gid, ("?",))[0] != "served":
                p.append(
                    f"group {gid} reached the trainer but rollout_buffer_groups says "
                    f"{decided.get(gid)}"
                )
        for gid in sorted(set(served) - good):
            grp = groups.get(gid)
            why = (
                grp.problems()
                or [f"{len(grp.completed_sessions())} of {self.s.k} sessions completed"]
                if grp
                else ["not a group of this job"]
            )
            p.append(f"group {gid} was served but should not have been: {why[:3]}")
        for gid in sorted(others):
            dec = decided.get(gid)
            grp = groups[gid]
            complete = len(grp.completed_sessions()) >= self.s.k and not grp.problems()
            if complete and grp.implausible() and (dec or (None, None))[1] != "implausible_version":
                p.append(f"group {gid} with a version that cannot be true was decided as {dec}")
            if dec is None or dec[0] != "dropped" or not dec[1]:
                grp = groups[gid]
                p.append(
                    f"group {gid} ({grp.problems()[:2] or 'incomplete'}) is not dropped with a "
                    "reason: "
                    f"rollout_buffer_groups has {dec[:2] if dec else 'nothing'}"
                )
        pks = [
            i["extra_info"]["step_pk"]
            for doc in trainer.received.values()
            for i in doc["data"]["data"]
        ]
        twice = sorted({pk for pk in pks if pks.count(pk) > 1})
        if twice:
            p.append(f"step_pks served twice: {twice[:20]}")
        for rid, group_ids in self.state.batches():
            if rid and rid not in trainer.received:
                p.append(
                    f"batch for request_id {rid} (groups {group_ids}) was recorded but never "
                    "reached the "
                    f"trainer, which retried that id until it got an answer"
                )
        self._check_stats(len(rows))
        self._check_proxy(groups, others)
        assert self.srv is not None
        log_file = self.srv.workdir / "logs" / "rollout_buffer.log"
        for text in (self.srv.log(), log_file.read_text() if log_file.exists() else ""):
            p += [
                f"a row forged a log line: {ln[:200]!r}" for ln in hostile_rows.forged_lines(text)
            ]
        reasons: dict[str, int] = {}
        for gid in others:
            if gid in decided:
                reasons[str(decided[gid][1])] = reasons.get(str(decided[gid][1]), 0) + 1
        self.out.counts.update(
            served=len(served),
            dropped_by_reason=reasons,
            polls=trainer.polls,
            poll_errors=trainer.errors,
        )

    def _check_stats(self, n_rows: int) -> None:
        end = time.monotonic() + 15
        s: dict[str, Any] | None = None
        while time.monotonic() < end:
            s = self.trainer.stats()
            if (
                s
                and s.get("job_session") == JOB
                and (s.get("rows") or {}).get("read") == n_rows
                and s.get("accounting_balanced") is True
            ):
                return
            time.sleep(0.1)
        r = (s or {}).get("rows")
        self.out.problems.append(
            f"/stats: rows {r}, accounting_balanced {(s or {}).get('accounting_balanced')}; "
            f"the job has {n_rows} trainable rows"
        )

    def _check_proxy(self, groups: dict[str, Group], others: set[str]) -> None:
        assert self.proxy is not None
        want = {sid for gid in others for sid in groups[gid].sessions() if isinstance(sid, str)}

        def told() -> set[str]:
            return {sid for body in self.proxy.delivered for sid in body.get("session_ids", [])}

        self.proxy.wait_for(lambda _p: want <= told(), timeout=30)
        missing = want - told()
        if missing:
            by_group = sorted({gid for gid in others if groups[gid].sessions() & missing})
            self.out.problems.append(
                f"the proxy was never told (30 s with the proxy up) about {len(missing)} "
                f"sessions of dropped groups {by_group[:10]}"
            )

    def _timing(self, gid: str) -> str:
        """When the writers committed the group's rows (to tell a writing gap from a reading
        fault)."""
        pks = {
            r.pk for r in groups_of(read_rows(self.url, self.s.backend)).get(gid, Group(gid)).rows
        }
        times = []
        for w in range(self.s.writers):
            path = self.workdir / f"writer{w}.jsonl"
            if path.exists():
                for line in path.read_text(encoding="utf-8").splitlines():
                    rec = json.loads(line)
                    if pks & set(rec["pks"]):
                        times.append(rec["t"])
        if not times:
            return "commit times unknown"
        times.sort()
        gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        return (
            f"rows committed over {times[-1] - times[0]:.1f} s, largest gap {gap:.1f} s, "
            f"TTL {self.s.ttl_s} s"
        )

    def report(self) -> str:
        log = self.srv.log() if self.srv is not None else ""
        lines = log.splitlines()
        notable = [ln for ln in lines if "ERROR" in ln or "Traceback" in ln or "Error:" in ln][-25:]
        return "\n".join(
            [f"fault suite failed: {rerun_hint(self.s)}", f"  {len(self.out.problems)} problem(s):"]
            + [f"  - {x}" for x in self.out.problems[:60]]
            + [
                f"  run: {self.out.summary()}",
                f"  server log: {self.srv.log_path if self.srv else '?'}",
                "  notable server log lines:",
            ]
            + [f"    {ln[:300]}" for ln in notable]
        )


def run(s: Settings, url: str, workdir: str | os.PathLike) -> Outcome:
    """Run one scenario; raises :class:`FaultSuiteFailure` (with the seed) when a check fails."""
    return Run(s, url, Path(workdir)).run()
