"""The blocking client: every call runs its steps in the caller's thread.

Owns: :class:`BufferClient` (its lifecycle, and running steps with ``requests`` and
``time.sleep``). What the calls do is :mod:`rollout_buffer.client.calls`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import requests

from rollout_buffer.client import calls
from rollout_buffer.client.transport import Connection, Emit, Feed, Sleep, Steps
from rollout_buffer.client.views import Group

P = ParamSpec("P")
R = TypeVar("R")


def _blocking(
    steps: Callable[Concatenate[Connection, P], Steps[R]],
) -> Callable[Concatenate[BufferClient, P], R]:
    """A method that runs the call's steps and returns their result."""

    @functools.wraps(steps)
    def method(self: BufferClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        feed = Feed(steps(self, *args, **kwargs))
        for _ in self._drive(feed):
            raise AssertionError(f"{steps.__name__} emitted a value")
        return feed.value  # type: ignore[return-value]  # set once the steps returned

    return method


def _iterator(
    steps: Callable[Concatenate[Connection, P], Steps[None]],
) -> Callable[Concatenate[BufferClient, P], Iterator[Group]]:
    """A method that returns an iterator over what the call's steps emit."""

    @functools.wraps(steps)
    def method(self: BufferClient, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[Group]:
        return self._drive(Feed(steps(self, *args, **kwargs)))

    return method


class BufferClient(Connection):
    """HTTP client of one rollout-buffer service (its owner and standbys); blocking.

    The constructor's arguments are :class:`~rollout_buffer.client.transport.Connection`'s.
    """

    def close(self) -> None:
        """Close the HTTP session (its pooled connections)."""
        self.session.close()

    def __enter__(self) -> BufferClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _drive(self, feed: Feed[Any]) -> Iterator[Any]:
        """Do the steps of ``feed`` here, yielding what they emit."""
        try:
            while (step := feed.next()) is not None:
                if isinstance(step, Emit):
                    yield step.value
                elif isinstance(step, Sleep):
                    time.sleep(step.seconds)
                else:
                    try:
                        feed.result = self.send(step)
                    except requests.exceptions.RequestException as exc:
                        feed.error = exc
        finally:
            feed.steps.close()

    health = _blocking(calls.health)
    stats = _blocking(calls.stats)
    start_rollout = _blocking(calls.start_rollout)
    stop_rollout = _blocking(calls.stop_rollout)
    get_rollout_data = _blocking(calls.get_rollout_data)
    get_batch = _blocking(calls.get_batch)
    iter_groups = _iterator(calls.iter_groups)
    resume = _blocking(calls.resume)
