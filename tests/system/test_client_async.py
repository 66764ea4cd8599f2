"""AsyncBufferClient through real servers, driven by ``asyncio.run``: a real gunicorn instance
(its long-poll must not block the event loop), a real owner and standby on one SQLite file (the
standby's 307 followed with the token, then the owner killed -9 mid-iteration), and the scripted
server of test_client.py where a server must fail on cue (a 503: the same request_id retried).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from servers import serve
from support import Writer, make_launcher_db
from test_client import EMPTY, UNAVAILABLE, Scripted, batch
from test_failover import K as FAILOVER_K
from test_failover import instances, kill9, owner_and_standby, role, write_groups

from rollout_buffer.client import AsyncBufferClient, BufferUnavailable, Group

JOB = "async-job"
K = 2


async def until(predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    """Await ``predicate()`` until it is true, on the loop (other tasks run meanwhile)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not reached in {timeout} s"
        await asyncio.sleep(0.02)


def test_the_async_client_long_polls_without_blocking_the_loop_and_serves_every_group_once(
    sqlite_url: str, tmp_path: Path
) -> None:
    make_launcher_db(sqlite_url)
    writer = Writer(sqlite_url, job=JOB)
    writer.group("a", K)

    async def trainer(url: str) -> list[str]:
        async with AsyncBufferClient(url, backoff_s=0.1) as client:
            assert (await client.health())["status"] == "healthy"
            await client.start_rollout(num_repeat_per_sample=K, job_session=JOB)

            async def ready() -> bool:
                return (await client.stats())["groups"]["ready"] == 1

            await until(ready, "group a ready")
            poll = asyncio.create_task(client.get_batch(min_groups=2, timeout=60))

            async def waiting() -> bool:  # answered while the long-poll is held: the loop is free
                return (await client.stats())["polls"]["waiting"] == 1

            await until(waiting, "the poll waits for a second group")
            assert not poll.done()
            writer.group("b", K)
            first = await poll
            assert [g.group_id for g in first.groups] == ["a", "b"]
            assert first.meta_info["finished_groups"] == ["a", "b"]
            writer.group("c", K)
            writer.group("d", K)
            rest = [g async for g in client.iter_groups(2, wait_s=5, timeout=30)]
            assert all(isinstance(g, Group) and len(g.sessions) == K for g in rest)
            stats = await client.stats()
            assert stats["groups"]["served"] == 4 and stats["accounting_balanced"] is True
            return [g.group_id for g in first.groups + rest]

    with serve(sqlite_url, tmp_path) as srv:
        got = asyncio.run(trainer(srv.url))
    writer.close()
    assert got == ["a", "b", "c", "d"]


def test_the_async_client_retries_with_the_same_request_id_and_gives_up_clearly() -> None:
    async def run(url: str) -> None:
        async with AsyncBufferClient(url, retries=2, backoff_s=0.01) as client:
            batch_ = await client.get_batch(max_groups=1, timeout=5)
            assert [g.group_id for g in batch_.groups] == ["g1"]
            with pytest.raises(BufferUnavailable) as info:
                await client.get_rollout_data()
            assert info.value.status == 503

    with Scripted([UNAVAILABLE, batch("g1"), UNAVAILABLE, UNAVAILABLE, UNAVAILABLE], EMPTY) as srv:
        asyncio.run(run(srv.url))
        first, retry, *given_up = srv.bodies
        assert first == retry and first["request_id"] and first["max_groups"] == 1
        assert len(given_up) == 3 and len({b["request_id"] for b in given_up}) == 1
        assert given_up[0]["request_id"] != first["request_id"]


@pytest.mark.slow
def test_the_async_client_follows_a_standby_and_survives_the_owners_kill9(tmp_path: Path) -> None:
    url = "sqlite://" + str(tmp_path / "launcher.db")
    want = [f"a{i:02d}" for i in range(12)]
    env = {"ROLLOUT_BUFFER_TOKEN": "async-token"}
    with instances(url, tmp_path, "a", "b", env=env) as (a, b):
        owner_and_standby(a, b)

        async def trainer() -> list[str]:
            got: list[str] = []
            async with AsyncBufferClient(
                [b.url, a.url], token="async-token", retries=30, backoff_s=0.1, backoff_max_s=0.5
            ) as client:
                assert client.url == b.url  # the standby first: its 307 leads to the owner
                await client.start_rollout(num_repeat_per_sample=FAILOVER_K, job_session="job1")
                assert client.url == a.url
                writer = write_groups(url, want, 0.02)
                async for group in client.iter_groups(len(want), max_groups=2, timeout=90):
                    got.append(group.group_id)
                    if len(got) == 4:
                        kill9(a)  # the kernel releases its flock: b takes over
                await asyncio.to_thread(writer.join, 30)
                assert client.url == b.url
            return got

        got = asyncio.run(trainer())
        assert role(b) == "owner"
    assert sorted(got) == want and len(got) == len(set(got))
