"""Postgres faults of issue 14, through a real gunicorn and a real Postgres server.

- a row in flight in an open transaction below the durable low-water mark survives a kill -9
  and a job switch (A -> B -> A): the resume point never passes the reader's safe cursor;
- a sequence that caches ids (``SET CACHE 20``) is refused clearly, and the service recovers by
  itself once it is ``CACHE 1`` again -- no row is ever skipped;
- a table locked ``ACCESS EXCLUSIVE`` does not stall /health, polls or /stop_rollout;
- two instances on one schema serve every group exactly once between them (the second as the
  first one's standby).

Writers are real connections (tests/conftest.py ``Writer``); a transaction held open is a real
``BEGIN`` on one of them. Every wait is bounded and on an observable condition.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import requests
from fakes.tcp_forwarder import TcpForwarder
from servers import ROOT, Server, Trainer, assert_stats_balance, free_port, kill9, trainable_rows
from support import PG_DSN, Writer, groups_of, make_launcher_db, wait_until

from rollout_buffer.launcher import procfs
from rollout_buffer.storage.db import connect

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

FAKE_LAUNCHER = ROOT / "tests" / "fakes" / "fake_launcher.py"


# -- helpers
# ------------------------------------------------------------------------------------------------


def saved_job(url: str, job: str) -> dict[str, Any]:
    """The durable row of a job in rollout_buffer_jobs ({} before it exists)."""
    db = connect(url)
    try:
        rows = db.rows(
            "SELECT cursor_pk, low_water_pk, active FROM rollout_buffer_jobs WHERE job_id = ?",
            (job,),
        )
    finally:
        db.close()
    if not rows:
        return {}
    cursor, low_water, active = rows[0]
    return {"cursor_pk": int(cursor), "low_water_pk": int(low_water), "active": int(active)}


def max_id(url: str) -> int:
    db = connect(url)
    try:
        return int(db.scalar("SELECT MAX(id) FROM session_steps") or 0)
    finally:
        db.close()


def ids_of(url: str, session: str) -> list[int]:
    """The ids of one session's rows (``Writer.step`` returns MAX(id), which is not the row's own id
    here)."""
    db = connect(url)
    try:
        return [
            int(r[0])
            for r in db.rows(
                "SELECT id FROM session_steps WHERE session_id = ? ORDER BY id", (session,)
            )
        ]
    finally:
        db.close()


def alter_cache(url: str, cache: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE session_steps ALTER COLUMN id SET CACHE {int(cache)}")


class RecordingTrainer(Trainer):
    """A Trainer that keeps the text of every non-200 answer (to check what errors said)."""

    def __init__(self, srv: Server) -> None:
        super().__init__(srv)
        self.errors: list[str] = []

    def post(self, body: dict[str, Any]) -> requests.Response:
        r = super().post(body)
        if r.status_code != 200:
            self.errors.append(f"{self.srv.name}: HTTP {r.status_code} {r.text[:300]}")
        return r


def open_transaction(w: Writer) -> None:
    """Begin a transaction on the writer's connection; its inserts stay invisible until COMMIT."""
    w.db.execute("BEGIN")


# -- scenario 1: a row in flight below the low-water mark
# -----------------------------------------------------


def test_a_row_committed_late_below_the_low_water_mark_is_served_after_kill9(tmp_path, pg_url):
    make_launcher_db(pg_url)
    # A short TTL: a resume that skipped the late row would drop G2 as incomplete instead of
    # waiting.
    srv = Server(
        pg_url, tmp_path / "srv", env={"AIEVOBOX_BUFFER_INCOMPLETE_GROUP_TTL_SECONDS": "8"}
    )
    w1, w2 = Writer(pg_url), Writer(pg_url)
    srv.start()
    try:
        t = Trainer(srv)
        t.start_rollout(k=2)
        w2.group("G1", 2, steps=1)
        g1_max = max_id(pg_url)
        # The durable cursor has passed G1: the row in flight lands above it, where only the rule
        # "the low-water mark never passes the safe cursor" protects it.
        wait_until(
            lambda: saved_job(pg_url, "job1").get("cursor_pk", 0) >= g1_max,
            15,
            "cursor saved past G1",
        )
        open_transaction(w1)
        pk_b = w1.step("G2", "G2-sB-" + uuid.uuid4().hex[:8], 1, completed=True, step_reward=0.7)
        pk_a = w2.step("G2", "G2-sA-" + uuid.uuid4().hex[:8], 1, completed=True, step_reward=0.3)
        assert g1_max < pk_b < pk_a
        wait_until(lambda: t.stats()["rows"]["read"] == 3, 15, "G1 and G2/A read")
        doc = t.poll()
        assert set(groups_of(doc)) == {"G1"}
        # G1 is accounted now: the next save moves the durable mark past it
        wait_until(
            lambda: saved_job(pg_url, "job1")["low_water_pk"] > g1_max,
            15,
            "low-water mark saved after the poll",
        )
        saved = saved_job(pg_url, "job1")
        kill9(srv)
        w1.db.execute("COMMIT")
        srv.start()

        def g2_decided() -> bool:
            t.poll()
            return "G2" in t.served or t.stats()["groups"]["dropped_total"] > 0

        wait_until(g2_decided, 25, "G2 served or dropped after the restart")
        assert "G2" in t.served, (
            f"G2 was not served (row {pk_b} committed after the crash; saved before it: "
            f"{saved}): {t.stats()}"
        )
        assert sorted(i["extra_info"]["step_pk"] for i in t.served["G2"][0]) == [pk_b, pk_a]
        assert_stats_balance(t, pg_url)
    finally:
        with contextlib.suppress(Exception):
            w1.db.execute("ROLLBACK")
        w1.close()
        w2.close()
        srv.stop()


def test_a_job_selected_again_reads_every_row_written_while_it_was_not(tmp_path, pg_url):
    make_launcher_db(pg_url)
    srv = Server(pg_url, tmp_path / "srv")
    held, wa = Writer(pg_url, job="jobA"), Writer(pg_url, job="jobA")
    srv.start()
    try:
        t = Trainer(srv)
        t.start_rollout("jobA", k=2)
        wa.group("G1", 2, steps=1)
        g1_max = max_id(pg_url)
        wait_until(
            lambda: saved_job(pg_url, "jobA").get("cursor_pk", 0) >= g1_max,
            15,
            "cursor saved past G1",
        )
        open_transaction(held)  # held open across both switches
        held.step("G2", "G2-sB-" + uuid.uuid4().hex[:8], 1, completed=True)
        wa.step("G2", "G2-sA-" + uuid.uuid4().hex[:8], 1, completed=True)
        wa.group("G3", 2, steps=1)
        t.drain({"G1", "G3"})
        wait_until(
            lambda: saved_job(pg_url, "jobA")["low_water_pk"] > g1_max,
            15,
            "low-water mark saved after G1",
        )

        t.start_rollout("jobB", k=2)
        wa.group("G4", 2, steps=2)  # job A's writer keeps writing while B is selected
        held.db.execute("COMMIT")
        t.start_rollout("jobA", k=2)
        total = trainable_rows(pg_url, "jobA")

        def all_read() -> bool:
            s = t.stats()
            return s["job_session"] == "jobA" and s["rows"]["read"] == total

        wait_until(
            all_read,
            15,
            lambda: f"every one of job A's {total} trainable rows read (stats {t.stats()})",
        )
        t.drain({"G4"})
        assert (
            "G2" not in t.served
        )  # dropped as job_ended at the switch; its late row is accounted as such
        assert_stats_balance(t, pg_url, "jobA")
    finally:
        with contextlib.suppress(Exception):
            held.db.execute("ROLLBACK")
        held.close()
        wa.close()
        srv.stop()


# -- scenario 14: a sequence that caches ids
# --------------------------------------------------------------------


def test_a_caching_sequence_is_refused_clearly_and_no_row_is_skipped(tmp_path, pg_url):
    make_launcher_db(pg_url)
    srv = Server(pg_url, tmp_path / "srv", env={"ROLLOUT_BUFFER_DB_UNHEALTHY_AFTER_SECONDS": "1"})
    x, y = Writer(pg_url), Writer(pg_url)
    try:
        srv.start()
        t = Trainer(srv)
        t.start_rollout(k=2)
        srv.stop()
        alter_cache(pg_url, 20)
        srv.start()
        # Two connections, each with its own block of 20 ids: X writes 1, Y writes 21-25 (G2,
        # complete).
        s1, s2 = "G1-s0-" + uuid.uuid4().hex[:8], "G1-s1-" + uuid.uuid4().hex[:8]
        x.step("G1", s1, 1, completed=True, step_reward=0.1)
        pks = y.session("G2", "G2-s0-" + uuid.uuid4().hex[:8], 3) + y.session(
            "G2", "G2-s1-" + uuid.uuid4().hex[:8], 2
        )
        assert (ids_of(pg_url, s1), pks) == ([1], [21, 22, 23, 24, 25]), (
            "the sequence did not hand out cached blocks"
        )

        def refused_or_read_past() -> dict | None:
            h = requests.get(srv.url + "/health", timeout=5).json()
            cursor = t.stats().get("cursor") or 0
            return h if h["status"] != "healthy" or cursor >= 25 else None

        health = wait_until(refused_or_read_past, 15, "refusal (or the cursor past 25)")
        r = requests.post(
            srv.url + "/get_rollout_data", json={"request_id": uuid.uuid4().hex}, timeout=15
        )
        poll = (r.status_code, r.headers.get("Retry-After"), r.text[:500])
        # ... and seconds later X writes G1's last completed session as id 2, below what was read
        x.step("G1", s2, 1, completed=True, step_reward=0.2)
        assert ids_of(pg_url, s2) == [2]
        alter_cache(pg_url, 1)
        t.drain({"G1", "G2"}, timeout=20)
        assert sorted(i["extra_info"]["step_pk"] for i in t.served["G1"][0]) == [1, 2]

        assert health["status"] == "degraded", health
        assert "CACHE 1" in health["database"], health
        assert poll[0] == 503 and poll[1], poll
        assert requests.get(srv.url + "/health", timeout=5).json()["status"] == "healthy"
        assert_stats_balance(t, pg_url)
    finally:
        x.close()
        y.close()
        srv.stop()


# -- scenario 4: Postgres stuck on a lock
# ------------------------------------------------------------------------


def timed_post(
    url: str, body: dict | None = None, timeout: float = 15.0
) -> tuple[float, requests.Response | str]:
    """(seconds, response or the exception's name) of one POST."""
    started = time.monotonic()
    try:
        r: requests.Response | str = requests.post(url, json=body or {}, timeout=timeout)
    except requests.RequestException as exc:
        r = type(exc).__name__
    return time.monotonic() - started, r


def test_a_locked_table_never_stalls_health_polls_or_stop_rollout(tmp_path, pg_url):
    make_launcher_db(pg_url)
    marker = tmp_path / "launcher.starts"
    cmd = shlex.join(
        [sys.executable, str(FAKE_LAUNCHER), "--mode", "hang", "--marker", str(marker)]
    )
    grace = 2.0
    srv = Server(
        pg_url,
        tmp_path / "srv",
        env={
            "ROLLOUT_BUFFER_LAUNCHER_CMD": cmd,
            "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": str(grace),
            "ROLLOUT_BUFFER_DB_UNHEALTHY_AFTER_SECONDS": "2",
        },
    )
    w = Writer(pg_url)
    srv.start()
    try:
        t = Trainer(srv)
        pid = t.start_rollout(k=2)["pid"]
        wait_until(
            lambda: marker.exists() and marker.read_text().strip() == str(pid),
            10,
            "launcher started",
        )
        want = {f"c{i}" for i in range(6)}
        for gid in sorted(want):
            w.group(gid, 2, steps=1)
        wait_until(lambda: t.stats()["groups"]["ready"] == 6, 15, "6 groups ready")
        assert t.poll(max_groups=1)["success"] is True

        locker = psycopg.connect(pg_url)  # not autocommit: the lock lasts until rollback
        try:
            locker.execute("LOCK TABLE session_steps IN ACCESS EXCLUSIVE MODE")
            while_locked(srv, pid, grace)
        finally:
            locker.rollback()
            locker.close()
        wait_until(
            lambda: requests.get(srv.url + "/health", timeout=5).json()["status"] == "healthy",
            20,
            "healthy again",
        )
        t.drain(want - set(t.served))
        assert all(len(v) == 1 for v in t.served.values()) and set(t.served) == want
        assert_stats_balance(t, pg_url)
    finally:
        w.close()
        srv.stop()


def while_locked(srv: Server, pid: int, grace: float) -> None:
    """What must hold while session_steps is locked: /health, polls and /stop_rollout all answer."""
    locked_at = time.monotonic()
    poll_url = srv.url + "/get_rollout_data"
    started = time.monotonic()
    h = requests.get(srv.url + "/health", timeout=5).json()
    assert time.monotonic() - started < 2.0 and "last_tick_age_s" in h, h

    took, r = timed_post(poll_url, {"request_id": uuid.uuid4().hex, "max_groups": 1})
    assert not isinstance(r, str), f"a poll with ready data got no answer in {took:.1f} s ({r})"
    assert took <= 10.0 and r.status_code == 503 and r.headers.get("Retry-After"), (
        took,
        r.status_code,
        r.text,
    )

    took, r = timed_post(srv.url + "/stop_rollout")
    assert not isinstance(r, str), f"/stop_rollout got no answer in {took:.1f} s ({r})"
    assert r.status_code == 200 and took < grace + 3.0, (took, r.status_code, r.text)
    wait_until(lambda: not procfs.alive(pid), 5, "launcher gone")

    def degraded() -> dict | None:
        doc = requests.get(srv.url + "/health", timeout=5).json()
        return doc if doc["status"] == "degraded" else None

    h = wait_until(degraded, max(1.0, 15.0 - (time.monotonic() - locked_at)), "/health degraded")
    assert isinstance(h["last_tick_age_s"], (int, float)) and h["database"] != "ok", h

    answers: list[tuple[float, requests.Response | str]] = []
    lock = threading.Lock()

    def one_poll() -> None:
        res = timed_post(poll_url, {"request_id": uuid.uuid4().hex, "max_groups": 1})
        with lock:
            answers.append(res)

    threads = [threading.Thread(target=one_poll, name=f"poll-{i}") for i in range(20)]
    for th in threads:
        th.start()
    started = time.monotonic()
    h_during = requests.get(srv.url + "/health", timeout=5)
    health_took = time.monotonic() - started
    for th in threads:
        th.join(20)
    bad = [
        (round(s, 1), r if isinstance(r, str) else r.status_code)
        for s, r in answers
        if isinstance(r, str)
        or s > 10.0
        or r.status_code != 503
        or not r.headers.get("Retry-After")
    ]
    assert len(answers) == 20 and not bad, bad
    assert h_during.status_code == 200 and health_took < 2.0, health_took


def test_a_statement_that_never_gets_an_answer_shows_in_health_and_the_service_recovers(
    tmp_path, pg_url
):
    """A hung PgBouncer or a network path that stops carrying packets: the server-side timeouts
    cannot answer a statement whose answer never arrives, the loop hangs in it without failing, and
    only the age of its last tick tells. /health must say so, polls must answer 503 in bounded time,
    and the service must carry on by itself once packets flow again."""
    make_launcher_db(pg_url)
    dsn = urlsplit(PG_DSN)
    relay = TcpForwarder(dsn.port or 5432, dsn.hostname or "127.0.0.1")
    try:  # the service reaches Postgres through the relay; the test's writer directly
        srv = Server(
            pg_url.replace(dsn.netloc.rsplit("@", 1)[-1], f"127.0.0.1:{relay.port}", 1),
            tmp_path / "srv",
        )
        w = Writer(pg_url)
        srv.start()
        try:
            t = Trainer(srv)
            t.start_rollout(k=2)
            for gid in ("a", "b"):
                w.group(gid, 2, steps=1)
            wait_until(lambda: t.stats()["groups"]["ready"] == 2, 15, "2 groups ready")
            relay.stall()
            w.group("c", 2, steps=1)  # written while stuck: read once packets flow again

            def degraded() -> dict | None:
                doc = requests.get(srv.url + "/health", timeout=5).json()
                return doc if doc["status"] == "degraded" else None

            h = wait_until(degraded, 20, "/health degraded while the loop waits for an answer")
            assert "has not completed a tick" in h["database"] and h["last_tick_age_s"] >= 10, h
            took, r = timed_post(srv.url + "/get_rollout_data", {"max_groups": 1})
            assert not isinstance(r, str) and r.status_code == 503 and took <= 10.0, (took, r)
            relay.flow()
            wait_until(
                lambda: requests.get(srv.url + "/health", timeout=5).json()["status"] == "healthy",
                30,
                "healthy again",
            )
            t.drain({"a", "b", "c"})
            assert all(len(v) == 1 for v in t.served.values())
            assert_stats_balance(t, pg_url)
        finally:
            w.close()
            srv.stop()
    finally:
        relay.close()


# -- scenario 12: two instances on one database
# --------------------------------------------------------------------


def test_two_instances_on_one_schema_serve_each_group_once(tmp_path, pg_url):
    """With the lease (issue 12) the second instance is the first one's standby: its polls and its
    /start_rollout are redirected (307) to the owner, which serves each group once; once the owner
    stops, the standby takes over and serves what comes next."""
    make_launcher_db(pg_url)
    ports = [free_port(), free_port()]
    a, b = (
        Server(
            pg_url,
            tmp_path / n,
            name=n,
            port=p,
            env={
                "ROLLOUT_BUFFER_ADVERTISE_URL": f"http://127.0.0.1:{p}",
                "ROLLOUT_BUFFER_NAME": "ab",
            },
        )
        for n, p in zip("ab", ports, strict=True)
    )
    w = Writer(pg_url)
    try:
        a.start()
        b.start()
        ta, tb = RecordingTrainer(a), RecordingTrainer(b)
        ta.start_rollout(k=2)
        tb.start_rollout(k=2)  # (redirected to a: requests keeps the method and body of a 307)
        want = {f"c{i:02d}" for i in range(16)}
        for gid in sorted(want):
            w.group(gid, 2, steps=1)
        wait_until(
            lambda: (
                ta.stats()["groups"]["ready"] + ta.stats()["groups"]["served"] == 16
                and tb.stats()["lease"]["role"] == "standby"
            ),
            15,
            "16 groups ready on the owner",
        )

        def served() -> dict[str, int]:
            out: dict[str, int] = {}
            for tr in (ta, tb):
                for gid, batches in tr.served.items():
                    out[gid] = out.get(gid, 0) + len(batches)
            return out

        def no_unique_errors() -> None:
            bad = [
                e
                for e in ta.errors + tb.errors
                if "UNIQUE" in e or "unique constraint" in e or "duplicate key" in e
            ]
            assert not bad, bad

        deadline = time.monotonic() + 40
        empty_in_a_row = 0
        while not (want <= set(served()) and empty_in_a_row >= 2):
            assert time.monotonic() < deadline, f"never served: {sorted(want - set(served()))}"
            for tr in (ta, tb):
                doc = tr.poll(max_groups=3, retry_for=15)
                no_unique_errors()
                empty_in_a_row = 0 if doc["success"] else empty_in_a_row + 1
        counts = served()
        assert set(counts) == want and set(counts.values()) == {1}, counts
        pks = [
            i["extra_info"]["step_pk"] for tr in (ta, tb) for v in tr.served.values() for i in v[0]
        ]
        assert len(pks) == len(set(pks)) == 32
        db = connect(pg_url)
        try:
            rows = db.rows(
                "SELECT group_id, status FROM rollout_buffer_groups WHERE job_id = ?", ("job1",)
            )
        finally:
            db.close()
        assert sorted(g for g, _s in rows) == sorted(want) and {s for _g, s in rows} == {
            "served"
        }, rows

        a.stop()
        late = {"late0", "late1", "late2"}
        for gid in sorted(late):
            w.group(gid, 2, steps=1)
        got_before = set(tb.served)
        deadline = time.monotonic() + 20
        while not late <= set(tb.served):
            assert time.monotonic() < deadline, (
                f"b never served {sorted(late - set(tb.served))}: {tb.stats()}"
            )
            if not tb.poll(max_groups=3, retry_for=15)["success"]:
                time.sleep(0.05)
            no_unique_errors()
        assert set(tb.served) - got_before == late
        assert all(len(v) == 1 for v in tb.served.values())
    finally:
        w.close()
        a.stop()
        b.stop()
