"""The seam between gunicorn and web/gunicorn_worker.py.

HeadFirstWorker overrides private methods of gthread's ThreadWorker. A gunicorn release that
changes one would silently break the stalled-socket protection. So the release is pinned, and these
tests say which part of the seam moved."""

from __future__ import annotations

import configparser
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from gunicorn.http.unreader import Unreader
from gunicorn.workers.gthread import TConn, ThreadWorker

from rollout_buffer.web.gunicorn_worker import HeadFirstWorker

ROOT = Path(__file__).resolve().parents[2]

# The gthread methods the worker overrides, with the parameters it was written against
# (gunicorn 27.0). Update this table only after reading the new gthread and the worker together.
OVERRIDDEN = {
    "__init__": ["self", "args", "kwargs"],
    "accept": ["self", "listener"],
    "set_accept_enabled": ["self", "enabled"],
    "enqueue_req": ["self", "conn"],
    "finish_request": ["self", "conn", "fs"],
    "murder_pending": ["self"],
    "handle": ["self", "conn"],
}

# Where gthread calls them: an override that gthread no longer calls is dead code.
CALLED_AS = {
    "accept": "self.accept",
    "set_accept_enabled": "self.set_accept_enabled(",
    "enqueue_req": "self.enqueue_req(",
    "finish_request": "self.finish_request",
    "murder_pending": "self.murder_pending(",
    "handle": "self.handle",
}


def parameters(func: object) -> list[str]:
    return list(inspect.signature(func).parameters)  # type: ignore[arg-type]


def test_every_gthread_method_the_worker_overrides_is_in_the_table():
    overridden = {
        name
        for name, member in vars(HeadFirstWorker).items()
        if callable(member) and hasattr(ThreadWorker, name)
    }
    assert overridden == set(OVERRIDDEN), (
        "HeadFirstWorker overrides a different set of gthread methods than this test checks: "
        f"add or remove them in OVERRIDDEN ({sorted(overridden ^ set(OVERRIDDEN))})"
    )


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_the_overridden_gthread_method_keeps_its_signature(name):
    got = parameters(getattr(ThreadWorker, name))
    assert got == OVERRIDDEN[name], (
        f"gunicorn {version('gunicorn')} changed ThreadWorker.{name}: its parameters are {got}, "
        f"web/gunicorn_worker.py was written against {OVERRIDDEN[name]}. Read the new gthread "
        "before you raise the gunicorn pin in setup.cfg and requirements.txt"
    )
    assert parameters(getattr(HeadFirstWorker, name)) == OVERRIDDEN[name]


@pytest.mark.parametrize("name", sorted(CALLED_AS))
def test_gthread_still_calls_the_overridden_method(name):
    source = inspect.getsource(ThreadWorker)
    assert CALLED_AS[name] in source, (
        f"gunicorn {version('gunicorn')}'s ThreadWorker no longer calls {CALLED_AS[name]}: "
        f"HeadFirstWorker.{name} would never run, and with it the protection it carries"
    )


def test_the_gthread_parts_the_worker_reads_are_there():
    # attributes the worker reads or sets on gthread's objects, and the unreader it hands bytes to
    worker_source = inspect.getsource(ThreadWorker.__init__)
    for attribute in ("nr_conns", "keepalived_conns", "poller", "worker_connections"):
        assert f"self.{attribute}" in worker_source, (
            f"gunicorn {version('gunicorn')}'s ThreadWorker has no {attribute}: "
            "web/gunicorn_worker.py uses it"
        )
    conn_source = inspect.getsource(TConn.__init__)
    for attribute in ("data_ready", "parser", "sock"):
        assert f"self.{attribute}" in conn_source, f"gthread's TConn has no {attribute}"
    assert callable(TConn.init), "gthread's TConn has no init() for the worker to wrap"
    for method in ("take_buffered", "unread"):
        assert callable(getattr(Unreader, method, None)), f"gunicorn's Unreader has no {method}()"


def test_the_installed_gunicorn_is_the_pinned_one():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = cfg["options"]["install_requires"]
    pins = {
        "setup.cfg": re.search(r"^gunicorn(\S*)$", requires, re.M),
        "requirements.txt": re.search(
            r"^gunicorn(\S*)$", (ROOT / "requirements.txt").read_text(), re.M
        ),
    }
    for where, pin in pins.items():
        assert pin is not None and pin.group(1) == ">=27.0.1,<27.1", (
            f"{where} must pin gunicorn to the minor release CI tests (>=27.0.1,<27.1), "
            f"found {pin and pin.group(0)!r}"
        )
    assert version("gunicorn").startswith("27.0."), version("gunicorn")
