"""Fixtures: a scrubbed environment, a database per test on both backends, a writer of
launcher-style rows, a started service with its Flask test client. The helpers they use live in
support.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy
from support import Harness, Writer, fresh_pg_schema, make_config, make_launcher_db, require_pg

from rollout_buffer.tools.runner import SCRUB_NAMES, SCRUB_PREFIXES


@pytest.fixture(autouse=True)
def _scrub_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(SCRUB_PREFIXES) or name in SCRUB_NAMES:
            if name == "ROLLOUT_BUFFER_TEST_PG":
                continue
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh schema on the Postgres server, as a URL whose search_path selects it."""
    require_pg()
    with fresh_pg_schema() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return "sqlite://" + str(tmp_path / "launcher.db")


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """The launcher database, on each backend in turn, with the launcher's tables created."""
    if request.param == "sqlite":
        url = "sqlite://" + str(tmp_path / "launcher.db")
    else:
        url = request.getfixturevalue("pg_url")
    make_launcher_db(url)
    return url


@pytest.fixture
def lite_url(sqlite_url: str) -> str:
    """A SQLite launcher database with the launcher's tables (where the backend does not matter)."""
    make_launcher_db(sqlite_url)
    return sqlite_url


@pytest.fixture
def writer(db_url: str) -> Iterator[Writer]:
    w = Writer(db_url)
    yield w
    w.close()


@pytest.fixture
def harness_factory(tmp_path) -> Iterator[Any]:
    made: list[Harness] = []

    def make(db_url: str, **overrides: Any) -> Harness:
        h = Harness(make_config(db_url, tmp_path, **overrides))
        made.append(h)
        return h

    yield make
    for h in made:
        h.stop()


@pytest.fixture
def harness(db_url: str, harness_factory: Any) -> Harness:
    return harness_factory(db_url)


@pytest.fixture
def fake_proxy() -> Iterator[FakeProxy]:
    """A real HTTP server standing in for the LLM proxy; it records every clear_sessions call."""
    with FakeProxy() as p:
        yield p


@pytest.fixture
def proxied(db_url: str, harness_factory: Any, fake_proxy: FakeProxy) -> Any:
    """Start a service on the test's backend that notifies ``fake_proxy``, with config
    overrides."""

    def build(**overrides: Any) -> Harness:
        return harness_factory(
            db_url, proxy_host="127.0.0.1", proxy_port=fake_proxy.port, **overrides
        )

    return build
