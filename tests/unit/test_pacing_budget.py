"""The pacing budget's terms (issue 34, item 4), fed as the accumulator and the polls feed it."""

from __future__ import annotations

from rollout_buffer.pacing.budget import Budget


def budget(**kw: object) -> Budget:
    settings: dict[str, object] = {
        "staleness": None,
        "max_off_policy": None,
        "batch_groups": 4,
        "session_timeout_s": 60.0,
        "clock": lambda: 0.0,
    }
    settings.update(kw)
    b = Budget(**settings)  # type: ignore[arg-type]
    b.publish(("job1", "job"))
    return b


def feed(b: Budget, *events: tuple[object, ...]) -> dict[str, int]:
    for event in events:
        b.publish(event)
    with b.lock:
        b.read_inbox()
        return b.terms()


def served(b: Budget, *groups: str) -> list[tuple[object, ...]]:
    events: list[tuple[object, ...]] = []
    for g in groups:
        events += [("job1", "started", g), ("job1", "ready", g), ("job1", "decided", g, True)]
    return events


def test_the_capacity_and_where_s_and_b_come_from() -> None:
    b = budget(batch_groups=None, max_off_policy=2)
    assert b.staleness == (2, "setting ROLLOUT_BUFFER_MAX_OFF_POLICY")
    assert b.batch() == (8, "default")
    feed(b, (None, "poll", None, None))  # a {} poll states no B
    assert b.batch() == (8, "default")
    feed(b, (None, "poll", 5, None))
    assert b.batch() == (5, "the min_groups of the trainer's last poll")
    assert b.capacity() == 15


def test_without_versions_the_last_take_counts_until_the_next_poll_arrives() -> None:
    b = budget()
    feed(b, (None, "poll", 4, None), *served(b, "g1", "g2", "g3", "g4"))
    assert feed(b)["trainer_holds"] == 4
    assert feed(b, (None, "poll", 4, None))["trainer_holds"] == 0


def test_with_versions_the_trainer_holds_what_it_was_not_trained_on() -> None:
    b = budget()
    feed(b, (None, "poll", 4, 0), *served(b, "g1", "g2", "g3", "g4", "g5", "g6"))
    assert feed(b)["trainer_holds"] == 6  # it took 6, trains on 4
    assert feed(b, (None, "poll", 4, 1))["trainer_holds"] == 2  # one step done: 6 - 4


def test_a_step_the_rows_show_late_is_never_subtracted_twice() -> None:
    """Versions from rows lag behind the trainer's step (no row of the new version until a group
    runs again): a poll's arrival caps what it holds at B - 1 plus what it took since; the
    step seen later must not lower it below what it really holds."""
    b = budget()
    feed(b, ("job1", "version", 0), (None, "poll", None, None))
    feed(b, *served(b, *[f"a{i}" for i in range(4)]), ("job1", "version", 1))  # steps 1
    feed(b, *served(b, *[f"b{i}" for i in range(7)]))  # holds 7 (+4 trained on)
    assert feed(b)["trainer_holds"] == 7
    assert feed(b, (None, "poll", None, None))["trainer_holds"] == 3  # polls: lacks one
    assert feed(b, ("job1", "version", 2))["trainer_holds"] == 3  # the step it trained: seen


def test_a_quiet_session_is_gone_and_a_call_brings_it_back() -> None:
    now = [0.0]
    b = budget(session_timeout_s=10.0, clock=lambda: now[0])
    feed(b, ("job1", "listed", "s1", "g1", 0))
    with b.lock:
        b.admit("g1")
        b.call("g1", "s1", +1)
    now[0] = 100.0
    assert feed(b)["in_progress"] == 1  # a call in flight, however long
    with b.lock:
        b.call("g1", "s1", -1)
    now[0] = 109.0
    assert feed(b)["in_progress"] == 1
    now[0] = 111.0
    assert feed(b)["in_progress"] == 0
    with b.lock:
        b.call("g1", "s1", +1)
    assert feed(b)["in_progress"] == 1


def s1_calls_for_12_s_after_s2s_last_call(*events: tuple[object, ...]) -> dict[str, int]:
    """g1's sessions s1 and s2 each make a call at 0 s (then ``events``); s1 calls again at 4,
    8 and 12 s (timeout 10 s). The terms at 12 s."""
    now = [0.0]
    b = budget(session_timeout_s=10.0, clock=lambda: now[0])
    feed(b, ("job1", "listed", "s1", "g1", 0), ("job1", "listed", "s2", "g1", 1))
    with b.lock:
        b.admit("g1")
        for session in ("s1", "s2"):
            b.call("g1", session, +1)
            b.call("g1", session, -1)
    feed(b, *events)
    for t in (4.0, 8.0, 12.0):
        now[0] = t
        with b.lock:
            b.call("g1", "s1", +1)
            b.call("g1", "s1", -1)
    return feed(b)


def test_one_gone_session_frees_its_groups_place_while_another_keeps_calling() -> None:
    """Item 5 is per session: a session quiet for the timeout is gone, whatever its group's other
    sessions do."""
    assert s1_calls_for_12_s_after_s2s_last_call()["in_progress"] == 0  # s2 quiet 12 s: gone


def test_a_finished_session_is_never_gone() -> None:
    terms = s1_calls_for_12_s_after_s2s_last_call(("job1", "finished", "s2"))
    assert terms["in_progress"] == 1


def test_another_jobs_changes_and_an_ended_job_count_for_nothing() -> None:
    b = budget()
    feed(b, ("job1", "listed", "s1", "g1", 0), ("job0", "started", "x"))
    assert b.groups == {} and b.group_of("s1") == ("g1", 0)
    feed(
        b,
        (
            "job1",
            "ended",
        ),
    )
    assert b.job is None and b.group_of("s1") is None
