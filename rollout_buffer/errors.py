"""Exception hierarchy: every error this package raises on purpose is a RolloutBufferError.

Owns: the exception classes. It must not import anything of the package.
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
    """A statement failed on a value it read (SQLSTATE class 22, or a value the driver cannot load)."""

    about_data = True


class IntegrityError(StorageError):
    """A statement violated a database constraint."""


class ClosedError(RolloutBufferError):
    """The object was used after it was closed."""


class ApiError(RolloutBufferError):
    """The request could not be served."""

    def __init__(self, status: int, message: str, **context: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.context = context
