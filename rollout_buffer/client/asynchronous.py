"""The asyncio client: every call is a coroutine whose steps run on the event loop.

Each request is sent from a worker thread of the client's own pool (``requests`` blocks), so a
long-poll never blocks the loop and never takes a thread of the loop's default executor; the
retries, backoff (``asyncio.sleep``), request ids and standby handling are the blocking client's
own steps (:mod:`rollout_buffer.client.calls`). No dependency beyond ``requests`` and the stdlib.

A cancelled call (``asyncio.wait_for``, a task cancelled) stops waiting at once, but the request
already sent still completes in its thread: a poll's batch may then be served and not seen. The
client's next poll resumes its request_id and gets that batch. Bound a poll with its own
``timeout``/``wait_s`` rather than by cancelling it.

Owns: :class:`AsyncBufferClient` (its lifecycle, its thread pool, running steps on the loop).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

import requests

from rollout_buffer.client import calls
from rollout_buffer.client.transport import Connection, Emit, Feed, Sleep, Steps
from rollout_buffer.client.views import Group

P = ParamSpec("P")
R = TypeVar("R")

MAX_REQUESTS_AT_ONCE = 8  # threads of one client's pool: concurrent calls past it wait their turn


def _coroutine(
    steps: Callable[Concatenate[Connection, P], Steps[R]],
) -> Callable[Concatenate[AsyncBufferClient, P], Coroutine[Any, Any, R]]:
    """A coroutine method that runs the call's steps and returns their result."""

    @functools.wraps(steps)
    async def method(self: AsyncBufferClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        feed = Feed(steps(self, *args, **kwargs))
        async for _ in self._drive(feed):
            raise AssertionError(f"{steps.__name__} emitted a value")
        return feed.value  # type: ignore[return-value]  # set once the steps returned

    return method


def _iterator(
    steps: Callable[Concatenate[Connection, P], Steps[None]],
) -> Callable[Concatenate[AsyncBufferClient, P], AsyncIterator[Group]]:
    """A method that returns an async iterator over what the call's steps emit."""

    @functools.wraps(steps)
    def method(
        self: AsyncBufferClient, /, *args: P.args, **kwargs: P.kwargs
    ) -> AsyncIterator[Group]:
        return self._drive(Feed(steps(self, *args, **kwargs)))

    return method


class AsyncBufferClient(Connection):
    """The asyncio twin of :class:`~rollout_buffer.client.BufferClient`: the same constructor
    arguments and methods, as coroutines (``iter_groups`` is an async iterator); use it with
    ``async with`` or ``await client.close()``."""

    _pool: ThreadPoolExecutor | None = None  # made by the first call, on the loop's thread

    async def close(self) -> None:
        """Close the HTTP session and the thread pool (a request under way finishes in its
        thread)."""
        # a call after close() makes a new pool, as requests makes new connections after it
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.session.close()

    async def __aenter__(self) -> AsyncBufferClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _drive(self, feed: Feed[Any]) -> AsyncIterator[Any]:
        """Do the steps of ``feed`` on the loop (requests in the pool), yielding what they
        emit."""
        loop = asyncio.get_running_loop()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                MAX_REQUESTS_AT_ONCE, thread_name_prefix="buffer-client"
            )
        pool = self._pool
        try:
            while (step := feed.next()) is not None:
                if isinstance(step, Emit):
                    yield step.value
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    try:
                        feed.result = await loop.run_in_executor(pool, self.send, step)
                    except requests.exceptions.RequestException as exc:
                        feed.error = exc
        finally:
            feed.steps.close()

    health = _coroutine(calls.health)
    stats = _coroutine(calls.stats)
    start_rollout = _coroutine(calls.start_rollout)
    stop_rollout = _coroutine(calls.stop_rollout)
    get_rollout_data = _coroutine(calls.get_rollout_data)
    get_batch = _coroutine(calls.get_batch)
    iter_groups = _iterator(calls.iter_groups)
    resume = _coroutine(calls.resume)
