"""Domain errors (core.errors) and their one mapping to HTTP statuses (web.errors)."""

from __future__ import annotations

import pytest

from rollout_buffer.core import errors
from rollout_buffer.core.errors import RequestError
from rollout_buffer.web.errors import STATUS, status_of

KINDS = [
    kind
    for kind in vars(errors).values()
    if isinstance(kind, type) and issubclass(kind, RequestError) and kind is not RequestError
]


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_every_kind_of_refusal_has_its_own_status(kind):
    assert kind in STATUS, f"{kind.__name__} has no status in web.errors.STATUS"
    assert status_of(kind("why", field="x")) == STATUS[kind]


def test_the_statuses_are_the_ones_the_api_always_answered():
    assert {kind.__name__: status for kind, status in STATUS.items()} == {
        "Invalid": 400,
        "Conflict": 409,
        "Expired": 410,
        "Overloaded": 429,
        "OperationFailed": 500,
        "Unavailable": 503,
    }
