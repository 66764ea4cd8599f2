"""Exception hierarchy: every error this package raises on purpose is a RolloutBufferError.

Owns: the exception classes, and :func:`bounded` (a lock waited for at most a few seconds, else a
503). It must not import anything of the package.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class RolloutBufferError(Exception):
    """Something went wrong in rollout-buffer."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigError(RolloutBufferError):
    """The configuration is invalid."""


class StorageError(RolloutBufferError):
    """The database could not be reached or refused a statement.

    ``about_data`` is True when the statement failed on a value it read (a driver or server data
    error), not on the database being unreachable, locked or slow: only then can a retry with
    other rows succeed."""

    about_data = False


class DataError(StorageError):
    """A statement failed on a value it read (SQLSTATE class 22, or a value the driver cannot
    load)."""

    about_data = True


class IntegrityError(StorageError):
    """A statement violated a database constraint."""


class JobOwned(IntegrityError):
    """The job belongs to another buffer on the same state database (ROLLOUT_BUFFER_NAME)."""

    def __init__(self, job_id: str, buffer: str) -> None:
        shown = repr(buffer) if buffer else "the unnamed buffer ''"
        super().__init__(
            f"job {job_id!r} belongs to buffer {shown} on this state database, not to this one: "
            "send its /start_rollout to that buffer, or name another job_session"
        )
        self.job_id = job_id
        self.buffer = buffer


class LeaseLost(StorageError):
    """This instance does not own the job (any more): the transaction was rolled back, nothing
    recorded."""


class ClosedError(RolloutBufferError):
    """The object was used after it was closed."""


class ApiError(RolloutBufferError):
    """The request could not be served."""

    def __init__(self, status: int, message: str, **context: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.context = context


@contextlib.contextmanager
def bounded(lock: threading.Lock, holder: str, wait_s: float) -> Iterator[None]:
    """Hold ``lock``, waiting at most ``wait_s``: a request behind a stuck one answers 503, never
    hangs."""
    if not lock.acquire(timeout=wait_s):
        raise ApiError(
            503,
            f"{holder} has been busy for over {wait_s:.0f} s (the database may be stuck); retry",
            retry_after=2,
        )
    try:
        yield
    finally:
        lock.release()
