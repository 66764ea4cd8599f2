"""The real-launcher tier (issue 34): the unmodified upstream launcher (Safactory ``launcher.py``,
``math500_text``, ``--env-transport inproc``) under a real ``rollout-buffer serve``, a stand-in LLM
proxy, and a trainer that polls ``{}`` as the upstream client does (see stack.py).

Opt-in: it needs a copy of the upstream project, set up outside the repository by
``python tests/realstack/setup_upstream.py --copy PATH`` and named by ``RBTEST_REALSTACK``;
without it, every test here skips and says so. Run it with ``python -m pytest -m realstack``.

Pacing off: every group the launcher listed is served exactly once, whole (its K sessions, each
row once), every session ends with a result, the launcher exits 0 and the accounting balances.
Pacing on: the same, and the run ends within twice the pacing-off run's wall time, measured in
the same session (a ratio, not a time).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
from stack import Outcome, Params, Upstream, UpstreamError, run, skip_reason

from rollout_buffer.storage.db import connect

pytestmark = [pytest.mark.realstack, pytest.mark.slow]

K = 4
PARAMS = Params(k=K)


@pytest.fixture(scope="module")
def upstream() -> Upstream:
    try:
        found = Upstream.from_env()
    except UpstreamError as exc:  # asked for, but unusable: say so, never skip
        pytest.fail(str(exc))
    if found is None:
        pytest.skip(skip_reason())
    return found


@pytest.fixture(scope="module")
def off_run(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    outcome = run(upstream, PARAMS, pacing=False, workdir=tmp_path_factory.mktemp("off"))
    print("pacing off:", json.dumps(outcome.figures()))
    yield outcome


def trainable_rows(outcome: Outcome) -> int:
    db = connect("sqlite://" + str(outcome.workdir / "launcher.db"))
    try:
        return int(
            db.scalar(
                "SELECT COUNT(*) FROM session_steps WHERE job_id = ? AND is_trainable = 1",
                (outcome.job,),
            )
        )
    finally:
        db.close()


def said(outcome: Outcome) -> str:
    """The run's figures, and where its logs are, for a failure's message."""
    return f"{json.dumps(outcome.figures())} (logs in {outcome.workdir})"


def assert_every_group_once_whole(outcome: Outcome) -> None:
    """Every group the launcher listed reached the trainer once, with its K sessions' rows,
    each row once; nothing else reached it."""
    figures = said(outcome)
    assert len(outcome.listed) == PARAMS.groups, figures
    assert all(len(s) == K for s in outcome.listed.values()), outcome.listed
    assert set(outcome.served) == set(outcome.listed), figures
    twice = {g: len(batches) for g, batches in outcome.served.items() if len(batches) != 1}
    assert not twice, f"groups served more than once: {twice}"
    for gid, (items,) in outcome.served.items():
        sessions = {item["extra_info"]["session_id"] for item in items}
        assert sessions == outcome.listed[gid], (gid, sessions)
    items = [item for batches in outcome.served.values() for item in batches[0]]
    pks = [item["extra_info"]["step_pk"] for item in items]
    assert len(pks) == len(set(pks)), "a row was served twice"
    assert len({item["uid"] for item in items}) == len(items), "a uid was served twice"


def assert_nothing_lost(outcome: Outcome) -> None:
    """No session failed (each has a terminal row), no group was dropped, the launcher ran to
    its end, and every trainable row is accounted for."""
    figures = said(outcome)
    sessions = {s for members in outcome.listed.values() for s in members}
    assert sessions <= outcome.terminal, f"sessions without a result: {figures}"
    assert outcome.drops() == {}, figures
    assert outcome.launcher.get("exit_code") == 0, outcome.launcher
    rows = outcome.stats["rows"]
    assert rows["read"] == trainable_rows(outcome), rows
    assert (
        rows["read"]
        == rows["served"] + rows["dropped_total"] + rows["rejected_total"] + rows["pending"]
    ), rows
    assert rows["pending"] == 0 and rows["rejected_total"] == 0, rows
    assert outcome.stats["accounting_balanced"] is True, outcome.stats
    refused = outcome.admission[-1][1].get("refused") if outcome.admission else None
    if isinstance(refused, dict):  # a gate that counts its refusals refused none of these calls
        assert not any(refused.values()), refused


def test_pacing_off_serves_every_group_once_whole(off_run: Outcome) -> None:
    assert off_run.all_served, said(off_run)
    assert_every_group_once_whole(off_run)
    assert_nothing_lost(off_run)
    assert off_run.held().get("max", 0) == 0, off_run.held()  # no gate: nothing held
    # 3 model calls a session, each answered by the stand-in (none failed or was refused)
    assert len(off_run.calls) == PARAMS.groups * K * PARAMS.max_turns, len(off_run.calls)


def test_pacing_on_finishes_within_twice_the_pacing_off_time(
    upstream: Upstream, off_run: Outcome, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert off_run.wall_s is not None, "the pacing-off run did not finish: nothing to compare"
    bound = 2 * off_run.wall_s
    params = dataclasses.replace(PARAMS, timeout_s=bound)
    on = run(upstream, params, pacing=True, workdir=tmp_path_factory.mktemp("on"))
    figures = f"pacing off: {said(off_run)}; pacing on: {said(on)}"
    print(figures)
    assert on.wall_s is not None and on.wall_s <= bound, f"not done within {bound:.1f} s: {figures}"
    assert_every_group_once_whole(on)
    assert_nothing_lost(on)
