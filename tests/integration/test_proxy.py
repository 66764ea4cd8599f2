"""ProxyNotifier against a real HTTP server (tests/fakes/fake_proxy.py); nothing is mocked."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fakes.fake_proxy import FakeProxy, closed_port
from support import wait_until

from rollout_buffer.runtime.proxy import ProxyNotifier

LOGGER = "rollout_buffer.runtime.proxy"


def thread_names() -> list[str]:
    return [t.name for t in threading.enumerate()]


class Recorder:
    """An on_delivered callback that remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], list[str], list[Any]]] = []
        self.lock = threading.Lock()

    def __call__(
        self, reason: str, session_ids: list[str], group_ids: list[str], keys: list[Any]
    ) -> None:
        with self.lock:
            self.calls.append((reason, session_ids, group_ids, keys))


@pytest.fixture(autouse=True)
def _no_env_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # requests honours HTTP(S)_PROXY: make sure 127.0.0.1 is always reached directly.
    for name in (
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def fake() -> Iterator[FakeProxy]:
    with FakeProxy() as proxy:
        yield proxy


@pytest.fixture
def make_notifier(request: pytest.FixtureRequest) -> Iterator[Callable[..., ProxyNotifier]]:
    made: list[ProxyNotifier] = []

    def make(**kwargs: Any) -> ProxyNotifier:
        kwargs.setdefault("name", f"proxy-test-{request.node.name}-{len(made)}")
        kwargs.setdefault("backoff_s", 0.05)
        kwargs.setdefault("backoff_max_s", 0.2)
        kwargs.setdefault("connect_timeout", 1.0)
        kwargs.setdefault("read_timeout", 2.0)
        notifier = ProxyNotifier(**kwargs)
        made.append(notifier)
        return notifier

    yield make
    for notifier in made:
        notifier.stop(timeout=5)


def test_delivers_sorted_unique_ids_one_post_per_reason(fake: FakeProxy, make_notifier) -> None:
    rec = Recorder()
    notifier = make_notifier(base_url=fake.url + "/", on_delivered=rec)
    notifier.start()
    notifier.notify(
        "incomplete_group_ttl",
        ["s3", "s1", "s2", "s1"],
        ["g2", "g1", "g2"],
        keys=[("group", "job", "g1"), ("group", "job", "g2")],
    )
    notifier.notify("job_ended", ["x1"], ["gx"], keys=[("group", "job", "gx")])

    assert wait_until(lambda: len(rec.calls) == 2)
    assert sorted(fake.calls, key=lambda b: b["reason"]) == [
        {
            "session_ids": ["s1", "s2", "s3"],
            "reason": "incomplete_group_ttl",
            "group_ids": ["g1", "g2"],
        },
        {"session_ids": ["x1"], "reason": "job_ended", "group_ids": ["gx"]},
    ]
    assert sorted(rec.calls) == [
        (
            "incomplete_group_ttl",
            ["s1", "s2", "s3"],
            ["g1", "g2"],
            [("group", "job", "g1"), ("group", "job", "g2")],
        ),
        ("job_ended", ["x1"], ["gx"], [("group", "job", "gx")]),
    ]
    stats = notifier.pending()
    assert stats == {
        "sessions": 0,
        "reasons": {},
        "failures": 0,
        "delivered_calls": 2,
        "last_error": None,
        "enabled": True,
        "clear_endpoint": "present",
        "dropped_sessions": 0,
        "rejected_sessions": 0,
    }


def test_notifies_before_start_are_coalesced_into_one_call(fake: FakeProxy, make_notifier) -> None:
    rec = Recorder()
    notifier = make_notifier(base_url=fake.url, on_delivered=rec)
    for _ in range(3):
        notifier.notify(
            "late_rows_from_dropped_groups", ["b", "a"], ["g1"], keys=[("group", "j", "g1")]
        )
    assert notifier.pending()["reasons"] == {"late_rows_from_dropped_groups": 2}

    notifier.start()
    assert wait_until(lambda: rec.calls)
    assert fake.calls == [
        {"session_ids": ["a", "b"], "reason": "late_rows_from_dropped_groups", "group_ids": ["g1"]}
    ]
    assert rec.calls == [
        ("late_rows_from_dropped_groups", ["a", "b"], ["g1"], [("group", "j", "g1")])
    ]


def test_coalesces_repeats_while_proxy_fails(fake: FakeProxy, make_notifier) -> None:
    fake.status = 503
    rec = Recorder()
    notifier = make_notifier(base_url=fake.url, on_delivered=rec)
    notifier.start()
    for i in range(3):
        notifier.notify("restart_training", ["s2", "s1"], ["g1"], keys=["k"])
        assert wait_until(lambda i=i: notifier.pending()["failures"] > i)
    stats = notifier.pending()
    assert stats["sessions"] == 2 and stats["reasons"] == {"restart_training": 2}
    assert stats["last_error"] and "503" in stats["last_error"]

    fake.status = 200
    assert wait_until(lambda: rec.calls)
    # the notifier's thread goes round again (it delivers a later notification): the coalesced one
    # was not sent a second time meanwhile
    notifier.notify("job_ended", ["s9"], ["g9"], keys=["k9"])
    assert wait_until(lambda: len(rec.calls) == 2)
    assert fake.delivered == [
        {"session_ids": ["s1", "s2"], "reason": "restart_training", "group_ids": ["g1"]},
        {"session_ids": ["s9"], "reason": "job_ended", "group_ids": ["g9"]},
    ]
    assert all(call["session_ids"] == ["s1", "s2"] for call in fake.calls[:-1])
    assert rec.calls == [
        ("restart_training", ["s1", "s2"], ["g1"], ["k"]),
        ("job_ended", ["s9"], ["g9"], ["k9"]),
    ]
    assert notifier.pending()["sessions"] == 0


def test_proxy_down_then_back(make_notifier) -> None:
    port = closed_port()
    rec = Recorder()
    notifier = make_notifier(base_url=f"http://127.0.0.1:{port}", on_delivered=rec)
    notifier.start()

    started = time.monotonic()
    notifier.notify("launcher_exited", ["s1", "s2"], ["g1"], keys=[("group", "j", "g1")])
    assert time.monotonic() - started < 0.1  # never blocks on the network

    assert wait_until(lambda: notifier.pending()["failures"] >= 2)
    stats = notifier.pending()
    assert stats["sessions"] == 2 and stats["reasons"] == {"launcher_exited": 2}
    assert stats["delivered_calls"] == 0 and stats["last_error"]
    assert rec.calls == []

    with FakeProxy(port=port) as fake:  # the proxy comes back on the same port
        assert wait_until(lambda: rec.calls)
        assert fake.calls == [
            {"session_ids": ["s1", "s2"], "reason": "launcher_exited", "group_ids": ["g1"]}
        ]
    assert rec.calls == [("launcher_exited", ["s1", "s2"], ["g1"], [("group", "j", "g1")])]
    assert notifier.pending()["sessions"] == 0


def test_hung_proxy_never_blocks_notify_and_stop_is_prompt(make_notifier) -> None:
    with FakeProxy(hold_s=30) as fake:
        notifier = make_notifier(
            base_url=fake.url, read_timeout=1.0, backoff_s=5.0, backoff_max_s=5.0
        )
        notifier.start()
        notifier.notify("job_ended", ["s1"], ["g1"])
        assert fake.wait_for(lambda f: len(f.calls) == 1)  # the POST is now held by the proxy

        started = time.monotonic()
        notifier.notify("job_ended", ["s2"], ["g2"])
        assert time.monotonic() - started < 0.1
        assert notifier.pending()["sessions"] == 2  # in-flight ids count as pending

        started = time.monotonic()
        notifier.stop()
        assert time.monotonic() - started < notifier.read_timeout + 1.0
        assert notifier.name not in thread_names()
        # Not delivered, so still pending for the caller to re-send after a restart; and no
        # final flush was tried against a proxy whose last attempt failed.
        assert notifier.pending()["reasons"] == {"job_ended": 2}
        assert len(fake.calls) == 1


def test_non_2xx_is_a_failure_and_retried(make_notifier, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with FakeProxy(script=[500, 429, 503]) as fake:
        rec = Recorder()
        notifier = make_notifier(base_url=fake.url, on_delivered=rec)
        notifier.start()
        notifier.notify("malformed_row", ["s1"], ["g1"], keys=[1])
        assert wait_until(lambda: rec.calls)

    assert len(fake.calls) == 4
    assert all(
        call == {"session_ids": ["s1"], "reason": "malformed_row", "group_ids": ["g1"]}
        for call in fake.calls
    )
    stats = notifier.pending()
    assert stats["failures"] == 3 and stats["delivered_calls"] == 1 and stats["last_error"] is None
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1, "failures are logged at most once per minute"
    assert "500" in warnings[0].getMessage()


@pytest.mark.parametrize("status", [404, 405])
def test_a_proxy_without_the_clear_endpoint_is_said_once_and_not_retried(
    make_notifier, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The upstream rl/llm_proxy.py answers 404: retrying it forever only burnt requests and kept
    every notification pending. Said once; later notifications are dropped, counted, never sent,
    and marked handled so a restart does not send them again."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    with FakeProxy(status=status) as fake:
        rec = Recorder()
        notifier = make_notifier(base_url=fake.url, on_delivered=rec)
        notifier.start()
        notifier.notify("job_ended", ["s1", "s2"], ["g1"], keys=["k1"])
        assert wait_until(lambda: notifier.pending().get("clear_endpoint") == "absent")
        notifier.notify("incomplete_group_ttl", ["s3"], ["g2"], keys=["k2"])
        assert wait_until(lambda: notifier.pending().get("dropped_sessions") == 3)
        stats = notifier.pending()
        assert len(fake.calls) == 1, "a proxy without the endpoint is asked once"
        assert stats["sessions"] == 0 and stats["reasons"] == {}
        assert str(status) in stats["last_error"]
        assert sorted(call[0] for call in rec.calls) == ["incomplete_group_ttl", "job_ended"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no clear_sessions endpoint" in warnings[0], warnings


def test_other_4xx_answers_are_tried_a_bounded_number_of_times(make_notifier) -> None:
    """A 400 or 403 is the proxy refusing this request: retried forever, it would stay pending and
    be sent every backoff for the life of the service. Given up after rejected_tries, counted; the
    next request is tried afresh, and 429 (come back later) is still retried until it passes."""
    with FakeProxy(status=403) as fake:
        rec = Recorder()
        notifier = make_notifier(base_url=fake.url, on_delivered=rec)  # rejected_tries=5
        notifier.start()
        notifier.notify("job_ended", ["s1", "s2"], ["g1"], keys=["k1"])
        assert wait_until(lambda: notifier.pending().get("rejected_sessions") == 2)
        assert len(fake.calls) == 5
        stats = notifier.pending()
        assert stats["sessions"] == 0 and stats["clear_endpoint"] == "unknown"
        assert not rec.calls, "given up, not delivered: a restart sends it once more"
        fake.status = 200
        fake.script = [429, 429, 429, 429]
        notifier.notify("job_ended", ["s3"], ["g2"], keys=["k2"])
        assert wait_until(lambda: rec.calls)
        assert len(fake.calls) == 10 and notifier.pending()["clear_endpoint"] == "present"
        assert rec.calls[0][1] == ["s3"] and notifier.pending()["rejected_sessions"] == 2


def test_a_proxy_without_the_clear_endpoint_is_asked_again_later(make_notifier) -> None:
    """A 404 can also come from a gateway while the proxy behind it is being deployed: after
    ABSENT_RECHECK_S the next notification is sent again, and delivered once the proxy takes it."""
    with FakeProxy(status=404) as fake:
        rec = Recorder()
        notifier = make_notifier(base_url=fake.url, on_delivered=rec)
        notifier.ABSENT_RECHECK_S = 0.3
        notifier.start()
        notifier.notify("job_ended", ["s1"], ["g1"], keys=["k1"])
        assert wait_until(lambda: notifier.pending().get("clear_endpoint") == "absent")
        fake.status = 200
        notifier.notify("job_ended", ["s2"], ["g2"], keys=["k2"])  # dropped: within the recheck
        assert wait_until(lambda: notifier.pending()["dropped_sessions"] == 2)

        def delivered_again() -> bool:
            notifier.notify("job_ended", ["s3"], ["g3"], keys=["k3"])
            return notifier.pending()["clear_endpoint"] == "present"

        assert wait_until(delivered_again)
        assert {"s3"} <= {s for call in fake.calls for s in call["session_ids"]}
        assert "s2" not in {s for call in fake.calls for s in call["session_ids"]}


@pytest.mark.parametrize("status", [301, 302, 303, 307])
def test_a_redirect_is_a_failure_never_followed(make_notifier, status) -> None:
    """An auth gateway in front of the proxy answers 302 to its login page: following it turned the
    redirect into a 200, the sessions were marked cleared, and the proxy never freed them."""
    with FakeProxy(status=status, location="/login") as fake:
        rec = Recorder()
        notifier = make_notifier(base_url=fake.url, on_delivered=rec)
        notifier.start()
        notifier.notify("incomplete_group_ttl", ["s1"], ["g1"], keys=[1])
        assert wait_until(lambda: notifier.pending()["failures"] >= 2)
        assert not rec.calls and fake.gets == 0
        assert (
            notifier.pending()["sessions"] == 1 and str(status) in notifier.pending()["last_error"]
        )
        fake.status = 200  # the proxy answers again: delivered then
        assert wait_until(lambda: rec.calls)


def test_large_reasons_are_split_and_delivered_once(fake: FakeProxy, make_notifier) -> None:
    rec = Recorder()
    notifier = make_notifier(base_url=fake.url, on_delivered=rec, max_ids_per_request=3)
    ids = [f"s{i}" for i in range(7)]
    notifier.notify("job_ended", reversed(ids), ["g1", "g0"], keys=["k"])
    notifier.start()
    assert wait_until(lambda: rec.calls)
    assert [call["session_ids"] for call in fake.calls] == [
        sorted(ids)[0:3],
        sorted(ids)[3:6],
        sorted(ids)[6:],
    ]
    assert all(call["group_ids"] == ["g0", "g1"] for call in fake.calls)
    assert rec.calls == [("job_ended", sorted(ids), ["g0", "g1"], ["k"])]


def test_disabled_without_proxy_url(make_notifier, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    before = threading.active_count()
    notifier = make_notifier(base_url=None, name="proxy-test-disabled")
    notifier.start()
    for _ in range(3):
        notifier.notify("job_ended", ["s1"], ["g1"], keys=["k"])
    assert "proxy-test-disabled" not in thread_names()
    assert threading.active_count() == before
    assert notifier.pending() == {
        "sessions": 0,
        "reasons": {},
        "failures": 0,
        "delivered_calls": 0,
        "last_error": None,
        "enabled": False,
        "clear_endpoint": "unknown",
        "dropped_sessions": 0,
        "rejected_sessions": 0,
    }
    notifier.stop()
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disabled" in warnings[0].getMessage()


def test_start_stop_idempotent_and_restartable(fake: FakeProxy, make_notifier) -> None:
    rec = Recorder()
    notifier = make_notifier(base_url=fake.url, on_delivered=rec)
    notifier.stop()  # stop before start is a no-op
    notifier.start()
    notifier.start()
    assert thread_names().count(notifier.name) == 1
    notifier.stop()
    notifier.stop()
    assert notifier.name not in thread_names()

    notifier.notify("job_ended", ["s1"], [])  # kept while stopped
    notifier.start()
    assert wait_until(lambda: rec.calls)
    assert fake.calls == [{"session_ids": ["s1"], "reason": "job_ended", "group_ids": []}]
    notifier.stop()
    assert notifier.name not in thread_names()


def test_on_delivered_errors_are_logged_not_raised(
    fake: FakeProxy, make_notifier, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[str] = []

    def explode(reason: str, *_: Any) -> None:
        calls.append(reason)
        raise RuntimeError("db is down")

    notifier = make_notifier(base_url=fake.url, on_delivered=explode)
    notifier.start()
    notifier.notify("a", ["s1"], ["g1"])
    assert wait_until(lambda: calls == ["a"])
    notifier.notify("b", ["s2"], ["g2"])  # the thread survived
    assert wait_until(lambda: calls == ["a", "b"])
    assert any(
        "on_delivered" in r.getMessage() and r.exc_info for r in caplog.records if r.name == LOGGER
    )


def test_notify_with_bad_arguments_never_raises(fake: FakeProxy, make_notifier) -> None:
    notifier = make_notifier(base_url=fake.url)
    notifier.notify("job_ended", None, ["g1"])  # type: ignore[arg-type]
    assert notifier.pending()["sessions"] == 0


def test_final_flush_when_proxy_answered(fake: FakeProxy, make_notifier) -> None:
    rec = Recorder()
    notifier = make_notifier(base_url=fake.url, on_delivered=rec)
    notifier.start()
    notifier.notify("a", ["s1"], [])
    assert wait_until(lambda: rec.calls)
    notifier.notify("b", ["s2"], [])
    notifier.stop()  # either the loop or the one final attempt delivers it
    assert [c[0] for c in rec.calls] == ["a", "b"]
    assert notifier.pending()["sessions"] == 0
