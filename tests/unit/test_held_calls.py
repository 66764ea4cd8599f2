"""The pacing gate's held first calls (issue 23), driven on an event loop with no socket: let go in
the launcher's order, a client that leaves is forgotten, and one call whose question fails does not
keep the others held."""

from __future__ import annotations

import asyncio

from rollout_buffer.runtime.held import RECHECK_S, HeldCalls


def test_held_calls_go_in_the_launchers_order_and_a_client_that_leaves_is_forgotten() -> None:
    places = {"c1": 4, "b1": 2, "x1": None, "d1": 6}
    budget = [0]
    went: list[str] = []
    holds: list[str] = []

    def may_start(session: str) -> bool:
        if session == "boom":
            raise RuntimeError("a bug in the question")
        if budget[0] > 0:
            budget[0] -= 1
            return True
        return False

    async def scenario() -> None:
        calls = HeldCalls(may_start, places.get, lambda: holds.append("held"))
        asker = asyncio.ensure_future(calls.run())
        readers = {s: asyncio.StreamReader() for s in ("c1", "x1", "b1", "boom", "d1")}

        async def first_call(session: str) -> None:
            if await calls.admit(session, readers[session]):
                went.append(session)

        tasks = []
        for session in ("c1", "x1", "b1", "boom", "d1"):  # the arrival order
            tasks.append(asyncio.ensure_future(first_call(session)))
            await asyncio.sleep(0)
        await asyncio.sleep(RECHECK_S / 5)
        assert calls.held == 4 and not went  # (boom's question failed: that call failed)
        assert tasks[3].done()
        readers["d1"].feed_eof()  # d1's client gives up (it retries with a new call)
        await asyncio.sleep(RECHECK_S / 5)
        assert calls.held == 3
        for _ in range(3):  # a place frees, three times: b1, c1, then x1 (not listed: last)
            budget[0] = 1
            calls.wake()
            await asyncio.sleep(RECHECK_S / 5)
        assert went == ["b1", "c1", "x1"]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [type(r).__name__ for r in results] == [
            "NoneType",
            "NoneType",
            "NoneType",
            "RuntimeError",  # boom's question failed: that call failed, the others went
            "NoneType",
        ]
        assert calls.held == 0 and len(holds) == 4
        asker.cancel()

    asyncio.run(scenario())


def test_a_burst_of_pokes_makes_one_round_not_one_each() -> None:
    """A trainer polling back to back pokes the gate at every poll; each round asks every held
    call. Pokes within ROUND_GAP_S of a round are answered by one more round, not one each."""
    from rollout_buffer.runtime.held import ROUND_GAP_S

    asked: list[str] = []

    def may_start(session: str) -> bool:
        asked.append(session)
        return False

    async def scenario() -> None:
        calls = HeldCalls(may_start, lambda session: 0, lambda: None)
        asker = asyncio.ensure_future(calls.run())
        await asyncio.sleep(0)
        held = asyncio.ensure_future(calls.admit("s1", asyncio.StreamReader()))
        await asyncio.sleep(ROUND_GAP_S * 2)  # its first question, and one round
        asked.clear()
        for _ in range(50):  # fifty polls within a round's gap
            calls.wake()
            await asyncio.sleep(0)
        await asyncio.sleep(ROUND_GAP_S * 1.5)
        assert 1 <= len(asked) <= 3, asked  # (one, or two on a loaded machine; 17 without the gap)
        held.cancel()
        asker.cancel()
        await asyncio.gather(held, asker, return_exceptions=True)

    asyncio.run(scenario())
