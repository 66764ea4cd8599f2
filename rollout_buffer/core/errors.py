"""Exception hierarchy: every error this package raises on purpose is a RolloutBufferError.

Owns: the exception classes, a refused request by its meaning (Invalid, Conflict, Expired,
Overloaded, Unavailable, OperationFailed), never by an HTTP status: the web layer maps them. It
must not import anything of the package.
"""

from __future__ import annotations

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


class RequestError(RolloutBufferError):
    """A request the service cannot carry out, said by its meaning: the web layer alone turns the
    kind into an HTTP status (rollout_buffer.web.errors). ``context`` goes into the answer as it
    is: the field at fault, the job, ``retry_after`` (seconds after which a retry may succeed)."""

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context


class Invalid(RequestError):
    """The request itself is wrong (a field of the wrong type or out of range)."""


class Conflict(RequestError):
    """The request contradicts the job's state (another job's launcher still runs)."""


class Expired(RequestError):
    """What the request names is no longer kept (a request_id beyond the replay window)."""


class Overloaded(RequestError):
    """Too many requests of this kind are in progress; retry after ``retry_after``."""


class Unavailable(RequestError):
    """The service cannot answer now (database unreachable, still loading, a lock held too long);
    the same request may succeed after ``retry_after``."""


class OperationFailed(RequestError):
    """The service failed at something it must be able to do (start the launcher, rebuild a
    recorded batch); retrying the same request will not help without an operator."""
