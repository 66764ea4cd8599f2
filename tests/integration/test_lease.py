"""The lease (rollout_buffer/lease.py) on both backends, in one process: who owns the job, the
fence on every decision, takeovers, and what a standby answers.

Each test builds real Lease objects (their own threads and connections) on a real SQLite file or
a fresh Postgres schema; two Leases with different instance ids are two instances. Waits are on
observable conditions (the role, the row), never sleeps that prove nothing.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest
from support import wait_until

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError, LeaseLost, StorageError, Unavailable
from rollout_buffer.core.model import Decisions, Drop
from rollout_buffer.launcher import procfs
from rollout_buffer.runtime.lease import OWNER, STANDBY, Lease
from rollout_buffer.storage.db import connect
from rollout_buffer.storage.store import Store
from rollout_buffer.web.app import standby_answer
from rollout_buffer.web.errors import status_of

LEASE_S = 1.5
BUFFER = "pair"


@pytest.fixture
def url(db_url: str) -> str:
    return db_url


@pytest.fixture
def leases(db_url: str, tmp_path) -> Iterator[Any]:
    made: list[Lease] = []

    def make(name: str, *, lease_s: float = LEASE_S, start: bool = True, **over: Any) -> Lease:
        over.setdefault("buffer_name", BUFFER)  # instances of one buffer: an owner and standbys
        config = Config.from_env(
            {}, db_url=db_url, run_dir=str(tmp_path / "logs"), lease_s=lease_s, **over
        )
        lease = Lease(config, name)
        made.append(lease)
        if start:
            lease.start()
        return lease

    yield make
    for lease in made:
        lease.stop()


def pause(lease: Lease) -> None:
    """The lease's thread stops renewing (a paused process) and the lease is kept as it is; a
    later start() resumes it."""
    assert lease._runtime is not None  # started alone, in a runtime of its own
    lease._runtime.stop_worker(lease, 5)


def lease_row(url: str) -> dict[str, Any]:
    db = connect(url)
    try:
        return (
            db.fetchone("SELECT owner, owner_url, epoch, lease_until FROM rollout_buffer_lease")
            or {}
        )
    finally:
        db.close()


def owned(lease: Lease) -> Lease:
    """Wait until ``lease`` owns the job and mark the job's state as loaded under its epoch (as the
    loop does)."""
    wait_until(lambda: lease.role == OWNER, 10, f"{lease.instance_id} owns the job")
    lease.state_epoch = lease.epoch
    return lease


def record_drop(url: str, lease: Lease, group: str) -> None:
    """A decision through the store with this lease's fence (as the service records one)."""
    db = connect(url)
    try:
        Store(db, lease.fence).record(
            "job1", Decisions(drops=[Drop(group, "incomplete_group_ttl", [1], [])])
        )
    finally:
        db.close()


def decided(url: str) -> list[str]:
    db = connect(url)
    try:
        return sorted(r[0] for r in db.rows("SELECT group_id FROM rollout_buffer_groups"))
    finally:
        db.close()


def test_the_first_instance_owns_the_job_and_a_second_waits_as_its_standby(url, leases):
    a = owned(leases("a", advertise_url="http://a.example:18889"))
    b = leases("b", advertise_url="http://b.example:18889")
    wait_until(lambda: b.role == STANDBY and b.holder is not None, 10, "b is a standby")
    assert (
        b.holder.instance == "a"
        and b.holder.url == "http://a.example:18889"
        and b.holder.epoch == 1
    )
    assert lease_row(url)["owner"] == "a"
    assert b.describe()["owner"]["url"] == "http://a.example:18889"
    # what b answers for the owner's endpoints: 307 to the owner's URL, the path kept
    answer = standby_answer(b, "/get_rollout_data")
    assert (
        answer.status == 307
        and answer.context["location"] == "http://a.example:18889/get_rollout_data"
    )
    with pytest.raises(LeaseLost):
        b.check(0.1)
    a.check(0.1)  # the owner passes

    def live() -> dict[str, str]:
        db = connect(url)
        try:
            return {i["instance_id"]: i["role"] for i in a.live_instances(db, 10)}
        finally:
            db.close()

    wait_until(
        lambda: live() == {"a": "owner", "b": "standby"}, 10, "both instances seen with their roles"
    )


def roles_logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """The role changes logged so far, as (level, "old -> new"); the log is cleared."""
    seen = [
        (r.levelname, r.getMessage().split(":")[1].strip())
        for r in caplog.records
        if r.name == "rollout_buffer.runtime.lease" and r.getMessage().startswith("role: ")
    ]
    caplog.clear()
    return seen


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The lease's WARNINGs so far."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "rollout_buffer.runtime.lease" and r.levelno >= logging.WARNING
    ]


def test_a_single_instance_start_logs_its_role_at_info_and_a_takeover_at_warning(
    url, leases, caplog
):
    """Issue 39: a normal start, or a restart after a clean stop, is no event an operator must
    look at; a standby taking the job over is."""
    caplog.set_level(logging.INFO, logger="rollout_buffer.runtime.lease")
    a = owned(leases("a"))
    assert roles_logged(caplog) == [("INFO", "starting -> owner")]
    a.stop()  # a clean stop gives the lease up
    again = owned(leases("a-restarted"))
    again.resumed()  # as the loop says once the job is loaded
    assert again.epoch == 2
    assert warnings(caplog) == []
    assert roles_logged(caplog) == [("INFO", "starting -> owner")]
    b = leases("b")
    wait_until(lambda: b.role == STANDBY, 10, "b is a standby")
    assert roles_logged(caplog) == [("INFO", "starting -> standby")]
    again.stop()
    owned(b).resumed()
    assert any(w.startswith("serving as the owner") for w in warnings(caplog))
    assert roles_logged(caplog) == [("WARNING", "standby -> owner")]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_instance_that_starts_by_taking_an_expired_lease_warns(url, leases, caplog):
    """Starting on a lease that its owner never gave up (it died, or is paused) is a takeover,
    whatever this instance's role was before: a WARNING."""
    caplog.set_level(logging.INFO, logger="rollout_buffer.runtime.lease")
    a = owned(leases("a", host_id="host-a"))
    assert roles_logged(caplog) == [("INFO", "starting -> owner")]
    pause(a)
    wait_until(lambda: lease_row(url)["lease_until"] < time.time(), 10, "the lease has ended")
    owned(leases("b", host_id="host-b"))
    assert roles_logged(caplog) == [("WARNING", "starting -> owner")]


def test_the_fence_lets_only_the_current_owner_record(url, leases):
    a = owned(leases("a"))
    b = leases("b")
    wait_until(lambda: b.role == STANDBY, 10, "b is a standby")
    record_drop(url, a, "g-a1")
    with pytest.raises(LeaseLost):
        record_drop(url, b, "g-b1")  # a standby records nothing
    a.stop()  # a graceful stop gives the lease up: b takes it over at once (within its poll)
    owned(b)
    assert lease_row(url)["epoch"] == 2
    record_drop(url, b, "g-b2")
    with pytest.raises(LeaseLost):
        record_drop(url, a, "g-a2")  # the old owner's epoch has ended
    assert decided(url) == ["g-a1", "g-b2"]


def test_state_loaded_under_an_older_epoch_is_fenced_even_when_this_instance_owns_again(
    url, leases
):
    a = owned(leases("a"))
    loaded_under = a.epoch
    a.state_epoch = loaded_under
    a.epoch, a.state_epoch = (
        loaded_under + 1,
        loaded_under,
    )  # as after losing and taking the job again
    with pytest.raises(LeaseLost):
        record_drop(url, a, "stale")
    assert decided(url) == []


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_expired_lease_is_taken_over_and_the_old_owner_turns_standby(url, leases):
    a = owned(leases("a", host_id="host-a"))
    b = leases("b", host_id="host-b")
    wait_until(lambda: b.role == STANDBY, 10, "b is a standby")
    pause(a)  # the owner's thread stops renewing (a paused process), the process lives on
    t0 = time.monotonic()
    owned(b)
    took = time.monotonic() - t0
    assert took < LEASE_S + 2.0, took
    assert b.counts["takeovers"] == 1 and lease_row(url)["owner"] == "b"
    with pytest.raises(LeaseLost):
        record_drop(url, a, "late")
    # the old owner's renewal finds the new epoch and it turns standby
    a.start()
    wait_until(lambda: a.role == STANDBY, 10, "the old owner turns standby")
    assert a.holder is not None and a.holder.instance == "b"
    assert decided(url) == []


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_takeover_ends_a_fenced_transaction_the_expired_owner_left_open(url, leases):
    """An owner paused (or cut off) inside a transaction that passed the fence holds the lease row's
    KEY SHARE lock. Once its lease has ended, the taker ends that backend instead of waiting on the
    lock forever: the transaction rolls back (nothing of it recorded) and the standby owns the job
    within the lease plus a few seconds. (This connection has no idle-transaction timeout, as a
    paused process's would: only the taker can free the lock in time.)"""
    a = owned(leases("a", host_id="host-a"))
    db = connect(url)
    store = Store(db, a.fence)
    b = leases("b", host_id="host-b", start=False)
    try:
        with pytest.raises(StorageError), store.decision():
            db.execute(
                "INSERT INTO rollout_buffer_groups (job_id, group_id, status, reason, batch_id, "
                "n_served, n_dropped, pks, clear_sessions, notified, resolved_at) VALUES ('job1', "
                "'in-flight', 'dropped', 'incomplete_group_ttl', NULL, 0, 1, '1', '[]', 1, 0)"
            )
            pause(a)  # no more renewals: the lease ends while this transaction is open
            wait_until(
                lambda: lease_row(url)["lease_until"] < time.time(), 10, "the lease has ended"
            )
            b.start()
            wait_until(lambda: b.role == OWNER, LEASE_S + 5, "b owns the job")
        assert "in-flight" not in decided(url)
    finally:
        db.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_owner_whose_process_on_this_host_is_gone_is_replaced_at_once(url, leases):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = procfs.start_ticks(gone.pid)
    gone.wait()
    db = connect(url)
    try:
        Store(db).ensure_schema()
        db.execute(
            "INSERT INTO rollout_buffer_lease (scope, owner, owner_url, owner_host, owner_pid, "
            "owner_start_ticks, epoch, lease_until, acquired_at, renewed_at) "
            "VALUES ('job', 'dead', NULL, ?, ?, ?, 7, EXTRACT(EPOCH FROM now()) + 600, 0, 0)",
            (procfs.host_id(), gone.pid, ticks),
        )
    finally:
        db.close()
    b = owned(leases("b", buffer_name=""))  # the unnamed buffer's owner crashed: not refused
    assert b.epoch == 8  # long before the 600 s lease would end


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_advertised_url_that_answers_as_another_instance_is_reported_and_comes_last(url, leases):
    class Other(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = json.dumps({"status": "healthy", "instance": "someone-else"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Other)
    th = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    th.start()
    try:
        # (a longer lease: the wrong one's extra wait, a third of it, must outlast a busy machine's
        # delays)
        right = owned(leases("right", host_id="host-r", lease_s=6.0))
        wrong = leases(
            "wrong",
            host_id="host-w",
            lease_s=6.0,
            advertise_url=f"http://127.0.0.1:{httpd.server_address[1]}",
        )
        wait_until(
            lambda: wrong.problem is not None and wrong.role == STANDBY,
            10,
            "the check of the advertised URL",
        )
        assert "answers as another instance" in wrong.problem
        assert wrong.describe()["lease_problem"] == wrong.problem
        other = leases(
            "other", host_id="host-o", lease_s=6.0
        )  # correctly configured (no URL to check)
        wait_until(lambda: other.role == STANDBY, 10, "a second standby")
        pause(right)  # the owner stops renewing: its lease ends
        owned(other)  # the correctly configured standby goes first ...
        assert wrong.role == STANDBY
        other.stop()
        owned(wrong)  # ... but a job served under a wrong URL beats none: it reports it, and owns
        assert "answers as another instance" in (wrong.problem or "")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_what_a_standby_answers_while_there_is_no_usable_owner(url, leases):
    a = owned(leases("a"))  # no advertised URL
    b = leases("b", advertise_url="http://b.example:1")
    wait_until(lambda: b.role == STANDBY and b.holder is not None, 10, "b is a standby")
    answer = standby_answer(b, "/start_rollout")
    assert answer.status == 503 and "no ROLLOUT_BUFFER_ADVERTISE_URL" in answer.message
    assert int(answer.context["retry_after"]) > 0
    a.stop()
    wait_until(lambda: b.role == OWNER, 10, "b takes over")
    c = leases("c", advertise_url="http://b.example:1")  # misconfigured: the owner's URL
    wait_until(lambda: c.holder is not None, 10, "c reads the lease")
    answer = standby_answer(c, "/get_rollout_data")
    assert answer.status == 503 and "misconfigured" in answer.message


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_an_owner_that_cannot_renew_stops_deciding_and_goes_on_once_it_can(url, leases):
    """A transaction holds the lease row (FOR UPDATE) for longer than the lease: renewals fail on
    their lock timeout, the owner stops deciding before its lease could end, and once the row is
    free it renews (nobody could take the job meanwhile) and decides again."""
    a = owned(leases("a"))
    assert a.holds()
    with psycopg.connect(url) as holder:
        holder.execute("SELECT * FROM rollout_buffer_lease FOR UPDATE")
        wait_until(lambda: not a.holds(), LEASE_S + 5, "the owner stops deciding")
        with pytest.raises(Unavailable) as info:
            a.check(0.1)
        assert status_of(info.value) == 503 and "cannot renew" in info.value.message
        a.check(0.1, sure=False)  # (what /stop_rollout asks: stopping the launcher is always safe)
        assert a.counts["renewal_failures"] >= 1 and a.role == OWNER
        holder.rollback()
    wait_until(lambda: a.holds(), 10, "renewed again")
    assert a.problem is None and a.epoch == 1
    record_drop(url, a, "after")
    assert decided(url) == ["after"]


def test_an_instance_without_a_lease_never_decides_next_to_one_that_has_it(url, leases):
    a = owned(leases("a"))
    unfenced = leases("unfenced", lease_s=0)
    assert unfenced.role == OWNER and unfenced.holds()  # no lease: it owns whatever it runs
    db = connect(url)
    try:
        with pytest.raises(ConfigError, match="ROLLOUT_BUFFER_LEASE_SECONDS=0"):
            unfenced.refuse_unfenced(db)
        a.stop()  # the lease given up: the unfenced instance may go on
        unfenced.refuse_unfenced(db)
    finally:
        db.close()
