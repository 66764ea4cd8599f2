"""Every session accounted for (issue 22): the service learns each group's sessions from
``job_environments`` and from the launcher's rows that are not trainable, so a group with a session
that reached the step cap without a terminal row is dropped at once (not after the TTL), its
proxy notification names every session of the group, and /stats counts the sessions that never
wrote a trainable row. Both backends, a real HTTP server for the proxy."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy
from support import Writer, assert_balanced, groups_of, now_text, wait_until

from rollout_buffer.storage import launcher_sql as q

FAKE_LAUNCHER = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"
MAX_STEPS = 3


@pytest.fixture
def proxy() -> Any:
    with FakeProxy() as p:
        yield p


def schedule(writer: Writer, group: str, sessions: list[str], job: str = "job1") -> None:
    """job_environments rows, as the launcher writes them when it starts."""
    for sid in sessions:
        writer.db.execute(
            q.INSERT_ENV,
            (job, sid, "env", json.dumps({"task": group}), None, group, 0, 0, now_text()),
        )


def start(harness_factory: Any, db_url: str, proxy: FakeProxy, **overrides: Any) -> Any:
    """A service whose launcher gets ``--max-steps 3`` (a fake one that keeps running).
    /start_rollout answers at once (no launch grace): these tests look at the census, not at a
    launcher that fails at its start (tests/integration/test_stack.py does)."""
    cmd = (sys.executable, str(FAKE_LAUNCHER), "--mode", "hang", "--max-steps", str(MAX_STEPS))
    overrides.setdefault("launch_grace_s", 0.0)
    h = harness_factory(
        db_url,
        launcher="command",
        launcher_cmd=cmd,
        proxy_host="127.0.0.1",
        proxy_port=proxy.port,
        **overrides,
    )
    h.start(k=3)
    return h


def cleared(proxy: FakeProxy, reason: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for call in proxy.calls:
        if call["reason"] == reason:
            for gid in call["group_ids"]:
                out.setdefault(gid, set()).update(call["session_ids"])
    return out


def test_a_step_capped_sessions_group_is_dropped_at_once_and_every_session_cleared(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    h = start(harness_factory, db_url, proxy)
    doomed = ["d-ok-1", "d-ok-2", "d-capped"]
    fine = ["f-1", "f-2", "f-3"]
    schedule(writer, "doomed", doomed)
    schedule(writer, "fine", fine)
    # message-cut 0: only terminal rows are trainable; the capped session writes 3 rows, none
    # trainable and none terminal
    for sid in doomed[:2]:
        writer.session("doomed", sid, 2, trainable=False, complete=False)
        writer.step("doomed", sid, 3, completed=True, step_reward=0.5)
    for i, sid in enumerate(fine):
        writer.step("fine", sid, 1, trainable=False)
        writer.step("fine", sid, 2, completed=True, step_reward=0.1 * (i + 1))
    # the capped session's rows once the rest are read: a tick between the writes could read them
    # before d-ok-2's trainable row, and count d-ok-2 without one when the group drops
    h.settle()
    writer.session("doomed", "d-capped", MAX_STEPS, trainable=False, complete=False)
    h.settle()

    # dropped now, with a reason of its own: the TTL (1,800 s) is nowhere near
    stats = h.stats()
    assert stats["groups"]["dropped"] == {"session_without_result": 1}, stats["groups"]
    assert wait_until(lambda: "doomed" in cleared(proxy, "session_without_result"), 10)
    # every session of the group, the one that never wrote a trainable row too
    assert cleared(proxy, "session_without_result")["doomed"] == set(doomed)
    assert stats["sessions"]["ended_without_result"] == 1
    assert stats["sessions"]["without_trainable_row"] == 1
    assert stats["sessions"]["known"] == 6
    assert_balanced(stats)

    # the complete group is served whole, one item per session
    doc = h.poll()
    got = groups_of(doc)
    assert set(got) == {"fine"} and len(got["fine"]) == 3


def test_a_group_whose_sessions_never_wrote_a_trainable_row_is_cleared_whole(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """Every session of the group capped: no trainable row ever shows it; the census does."""
    h = start(harness_factory, db_url, proxy)
    sessions = ["x-1", "x-2", "x-3"]
    schedule(writer, "invisible", sessions)
    for sid in sessions:
        writer.session("invisible", sid, MAX_STEPS, trainable=False, complete=False)
    h.settle()
    assert h.stats()["groups"]["dropped"] == {"session_without_result": 1}
    assert wait_until(lambda: "invisible" in cleared(proxy, "session_without_result"), 10)
    assert cleared(proxy, "session_without_result")["invisible"] == set(sessions)
    # a late trainable row of it is a late row, never a new group
    writer.step("invisible", "x-1", MAX_STEPS + 1, completed=True)
    h.settle()
    stats = h.stats()
    assert stats["rows"]["dropped"].get("late_rows_from_dropped_groups") == 1
    assert_balanced(stats)


def test_a_launcher_without_a_step_cap_never_has_a_session_taken_for_capped(
    harness_factory: Any, db_url: str, writer: Writer
) -> None:
    """With no --max-steps in the launcher's argv (here: no launcher), long sessions are normal."""
    h = harness_factory(db_url)
    h.start(k=2)
    sessions = writer.group("long", 2, steps=12)
    h.settle()
    assert h.stats()["groups"].get("dropped", {}) == {}
    assert set(groups_of(h.poll())) == {"long"}
    assert len(sessions) == 2


def test_sessions_scheduled_but_silent_are_cleared_when_the_launcher_exits(
    harness_factory: Any, db_url: str, writer: Writer, proxy: FakeProxy
) -> None:
    """A group listed in job_environments whose sessions failed before any row: the launcher's
    exit drops it, and its sessions are cleared too."""
    cmd = (sys.executable, str(FAKE_LAUNCHER), "--mode", "exit0")
    h = harness_factory(
        db_url,
        launcher="command",
        launcher_cmd=cmd,
        proxy_host="127.0.0.1",
        proxy_port=proxy.port,
    )
    schedule(writer, "silent", ["z-1", "z-2"])
    h.start(k=2)
    assert wait_until(
        lambda: h.stats()["groups"].get("dropped", {}).get("launcher_exited") == 1, 20
    ), h.stats()
    assert wait_until(lambda: "silent" in cleared(proxy, "launcher_exited"), 10)
    assert cleared(proxy, "launcher_exited")["silent"] == {"z-1", "z-2"}
