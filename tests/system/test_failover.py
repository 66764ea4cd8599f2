"""Failover (issue 12) with real gunicorn servers on one database, on loopback.

- kill -9 of the owner mid-drain while a BufferClient holds every URL: every group exactly once,
  the takeover time measured (same host: the dead pid is seen at once; another host: the lease
  has to end);
- the owner SIGSTOPped longer than the lease: the standby takes over; on SIGCONT the old owner
  serves and records nothing (Postgres triggers attribute every write to its process) and turns
  standby;
- a rolling update (the new instance started before the old one is stopped) serves everything once;
- ROLLOUT_BUFFER_LAUNCHER=none with an external writer: a failover drops nothing (launcher_exited);
- SQLite: two instances on one file (the flock);
- the launcher across owners: adopted on its host, relaunched when it is gone, and on another host
  left alone until an instance there stops it, then relaunched by the owner.

Every wait is on an observable condition, bounded; figures are printed (``-s`` shows them).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests
from servers import ROOT, Server, free_port
from support import Writer, make_launcher_db, wait_until

from rollout_buffer.client import BufferClient, groups_of
from rollout_buffer.launcher import procfs
from rollout_buffer.storage.db import connect

pytestmark = pytest.mark.slow

LEASE_S = 3.0
BUFFER = "failover"
K = 2
FAKE_LAUNCHER = ROOT / "tests" / "fakes" / "fake_launcher.py"


# -- helpers ---------------------------------------------------------------------------------------
def instance(
    url: str,
    tmp_path: Path,
    name: str,
    *,
    host: str | None = None,
    launcher: str = "none",
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Server:
    """A server that advertises its own URL, with a short lease (and, given, its own host id)."""
    port = port or free_port()
    extra = {
        "ROLLOUT_BUFFER_ADVERTISE_URL": f"http://127.0.0.1:{port}",
        "ROLLOUT_BUFFER_LEASE_SECONDS": str(LEASE_S),
        "ROLLOUT_BUFFER_NAME": BUFFER,  # one buffer: an owner and its standbys
    }
    if host:
        extra["ROLLOUT_BUFFER_HOST_ID"] = host
    extra.update(env or {})
    return Server(url, tmp_path / name, port=port, launcher=launcher, env=extra, name=name)


def health(srv: Server) -> dict[str, Any]:
    return requests.get(srv.url + "/health", timeout=5).json()


def role(srv: Server) -> str | None:
    try:
        return health(srv)["role"]
    except (requests.RequestException, ValueError):
        return None


def stats(srv: Server) -> dict[str, Any]:
    r = requests.get(srv.url + "/stats", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def worker_pid(srv: Server) -> int:
    assert srv.proc is not None
    return wait_until(
        lambda: (lambda w: w[0] if len(w) == 1 else None)(procfs.children(srv.proc.pid)),
        10,
        f"the gunicorn worker of {srv.name}",
    )


def kill9(srv: Server) -> None:
    """kill -9 the whole process group (gunicorn master and worker) and wait until it is gone."""
    assert srv.proc is not None
    pgid = srv.proc.pid
    srv.stop(signal.SIGKILL)
    wait_until(lambda: not procfs.group_members(pgid), 5, "every server process gone")


def alive(pid: int) -> bool:
    return procfs.alive(pid)


def served_groups(url: str, job: str = "job1") -> dict[str, str]:
    db = connect(url)
    try:
        return {
            g: s
            for g, s in db.rows(
                "SELECT group_id, status FROM rollout_buffer_groups WHERE job_id = ?", (job,)
            )
        }
    finally:
        db.close()


class Drain:
    """A trainer: a BufferClient holding every URL, polling in a thread, counting each group it
    gets."""

    def __init__(self, urls: list[str]) -> None:
        self.client = BufferClient(urls, retries=60, backoff_s=0.1, backoff_max_s=1.0, timeout=30)
        self.got: collections.Counter = collections.Counter()
        self.items: dict[str, int] = {}
        self.when: list[float] = []  # monotonic time of each group received
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Drain:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                doc = self.client.get_rollout_data(max_groups=2, wait_s=0.5)
                for gid, items in groups_of(doc) if doc.get("success") else []:
                    self.got[gid] += 1
                    self.items[gid] = len(items)
                    self.when.append(time.monotonic())
        except BaseException as exc:
            self.error = exc

    def wait_for(self, n: int, timeout: float) -> None:
        wait_until(
            lambda: self.error is not None or len(self.got) >= n,
            timeout,
            lambda: f"{n} groups received (got {len(self.got)})",
        )
        assert self.error is None, f"the trainer failed: {self.error!r}"

    def first_after(self, t: float) -> float | None:
        return next((w - t for w in self.when if w > t), None)


def write_groups(url: str, names: list[str], pace_s: float, job: str = "job1") -> threading.Thread:
    """An external writer (as a launcher elsewhere): complete groups of K one-step sessions,
    paced."""

    def run() -> None:
        w = Writer(url, job=job)
        try:
            for gid in names:
                w.group(gid, K, steps=1)
                time.sleep(pace_s)
        finally:
            w.close()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


@contextlib.contextmanager
def instances(
    url: str, tmp_path: Path, *names: str, hosts: bool = False, **kw: Any
) -> Iterator[list[Server]]:
    """The launcher's tables and an instance per name (each on host ``host-<name>`` when ``hosts``),
    every one stopped (and woken first, if it was stopped with SIGSTOP) at the end."""
    make_launcher_db(url)
    made = [instance(url, tmp_path, n, host=f"host-{n}" if hosts else None, **kw) for n in names]
    with stopped_at_end(*made):
        yield made


@contextlib.contextmanager
def stopped_at_end(*servers: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for srv in servers:
            if srv.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(srv.proc.pid, signal.SIGCONT)
            srv.stop()


def owner_and_standby(a: Server, b: Server) -> None:
    a.start()
    wait_until(lambda: role(a) == "owner", 15, "the first instance owns the job")
    b.start()
    wait_until(lambda: role(b) == "standby", 15, "the second instance waits as a standby")


# -- kill -9 mid-drain
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("hosts", ["same_host", "other_host"])
def test_kill9_of_the_owner_mid_drain_serves_every_group_once(tmp_path, pg_url, hosts):
    other = hosts == "other_host"  # the lease must end before the standby may take over
    want = [f"g{i:03d}" for i in range(60)]
    with instances(pg_url, tmp_path, "a", "b", hosts=other) as (a, b):
        owner_and_standby(a, b)
        with Drain([b.url, a.url]) as trainer:  # the standby first: its 307s lead to the owner
            trainer.client.start_rollout(num_repeat_per_sample=K, job_session="job1")
            writer = write_groups(pg_url, want, 0.05)
            trainer.wait_for(20, 30)
            killed_at = time.monotonic()
            kill9(a)
            wait_until(lambda: role(b) == "owner", LEASE_S + 15, "the standby takes over")
            owner_after = time.monotonic() - killed_at
            writer.join(30)
            trainer.wait_for(len(want), 60)
            first_after = trainer.first_after(killed_at)
        assert set(trainer.got) == set(want) and set(trainer.got.values()) == {1}, {
            g: n for g, n in trainer.got.items() if n != 1
        } or sorted(set(want) - set(trainer.got))
        assert set(trainer.items.values()) == {K}
        assert served_groups(pg_url) == dict.fromkeys(want, "served")
        s = stats(b)
        assert s["accounting_balanced"] and s["groups"]["dropped_total"] == 0, s
        assert s["lease"]["takeovers"] == 1 and s["lease"]["role"] == "owner"
        print(
            f"\n[{hosts}] takeover: the standby owned the job {owner_after:.2f} s after kill -9 of "
            f"the owner (lease {LEASE_S:g} s); the trainer got its next group {first_after:.2f} s "
            f"after the kill; the service measured {s['lease']['last_takeover_s']:.2f} s from the "
            "end of the old lease to serving"
        )
        bound = LEASE_S + 5.0 if other else 5.0
        assert owner_after < bound, f"takeover took {owner_after:.1f} s (lease {LEASE_S:g} s)"
        metrics = requests.get(b.url + "/metrics", timeout=10).text
        assert (
            'rollout_buffer_role{role="owner"} 1' in metrics
            and "rollout_buffer_takeovers_total 1" in metrics
        )


# -- SIGSTOP longer than the lease
# ------------------------------------------------------------------------
AUDIT = (
    "CREATE TABLE audit (tbl TEXT, op TEXT, app TEXT, at DOUBLE PRECISION)",
    "CREATE FUNCTION audit_write() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "INSERT INTO audit VALUES (TG_TABLE_NAME, TG_OP, current_setting('application_name'), "
    "EXTRACT(EPOCH FROM clock_timestamp())); RETURN NULL; END $$",
    *(
        f"CREATE TRIGGER audit_{t} AFTER INSERT OR UPDATE OR DELETE ON rollout_buffer_{t} "
        "FOR EACH ROW EXECUTE FUNCTION audit_write()"
        for t in ("groups", "rows", "batches", "jobs")
    ),
)


def test_an_owner_paused_past_its_lease_records_nothing_when_it_wakes_and_turns_standby(
    tmp_path, pg_url
):
    want = [f"p{i}" for i in range(6)]
    with instances(pg_url, tmp_path, "a", "b") as (a, b):
        owner_and_standby(a, b)
        r = requests.post(
            a.url + "/start_rollout",
            json={"num_repeat_per_sample": K, "job_session": "job1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        with psycopg.connect(pg_url, autocommit=True) as conn:
            for ddl in AUDIT:
                conn.execute(ddl)
        a_app = f"rollout-buffer {os.uname().nodename}:{worker_pid(a)}"[:63]
        a_fenced = f"rb-fence {health(a)['instance']} 1"  # its name inside fenced transactions
        write_groups(pg_url, ["pre"], 0).join(
            30
        )  # served by the owner before its pause: the audit sees it
        wait_until(
            lambda: (
                "pre"
                in dict(
                    groups_of(
                        requests.post(a.url + "/get_rollout_data", json={}, timeout=30).json()
                    )
                )
            ),
            15,
            "the owner serves a group",
        )
        write_groups(pg_url, want, 0).join(30)
        wait_until(
            lambda: stats(a)["groups"]["ready"] == len(want), 15, "the owner has every group ready"
        )

        os.killpg(
            a.proc.pid, signal.SIGSTOP
        )  # a GC pause, a frozen VM: the process lives on, silent
        stale: dict[str, Any] = {}
        poll = threading.Thread(
            target=lambda: stale.update(
                r=requests.post(
                    a.url + "/get_rollout_data",
                    json={"request_id": "stale-1"},
                    allow_redirects=False,
                    timeout=60,
                )
            )
        )
        poll.start()  # waits in the paused owner's accept queue
        wait_until(
            lambda: role(b) == "owner", LEASE_S + 15, "the standby takes over from the paused owner"
        )
        wait_until(
            lambda: stats(b).get("groups", {}).get("ready") == len(want),
            15,
            "the new owner resumed the job",
        )
        with psycopg.connect(pg_url, autocommit=True) as conn:
            took_at, epoch = conn.execute(
                "SELECT acquired_at, epoch FROM rollout_buffer_lease"
            ).fetchone()
            assert epoch == 2
            before = conn.execute(
                "SELECT COUNT(*) FROM audit WHERE app IN (%s, %s)", (a_app, a_fenced)
            ).fetchone()[0]

        os.killpg(a.proc.pid, signal.SIGCONT)
        poll.join(60)
        assert stale["r"].status_code in (307, 503), (stale["r"].status_code, stale["r"].text[:300])
        answers = [
            requests.post(
                a.url + "/get_rollout_data",
                json={"request_id": uuid.uuid4().hex},
                allow_redirects=False,
                timeout=30,
            )
            for _ in range(5)
        ]
        assert all(r.status_code in (307, 503) for r in answers), [
            (r.status_code, r.text[:200]) for r in answers
        ]
        wait_until(lambda: role(a) == "standby", 15, "the old owner turns standby")
        h = health(a)
        assert h["owner"]["url"] == b.url and h["owner"]["epoch"] == 2
        r = requests.post(a.url + "/get_rollout_data", json={}, allow_redirects=False, timeout=30)
        assert r.status_code == 307 and r.headers["Location"] == b.url + "/get_rollout_data"

        with Drain([a.url, b.url]) as trainer:  # the old owner first: it redirects to the new one
            trainer.wait_for(len(want), 30)
        assert dict(trainer.got) == dict.fromkeys(want, 1)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            late = conn.execute(
                "SELECT tbl, op, at FROM audit WHERE app IN (%s, %s) AND at >= %s",
                (a_app, a_fenced, took_at),
            ).fetchall()
            others = conn.execute(
                "SELECT COUNT(*) FROM audit WHERE app NOT IN (%s, %s) AND at >= %s",
                (a_app, a_fenced, took_at),
            ).fetchone()[0]
        assert late == [], f"the paused owner wrote after the takeover: {late}"
        assert before > 0 and others > 0  # (the audit sees each instance's writes, by its process)
        assert "role: owner -> standby" in a.log()
        assert served_groups(pg_url) == dict.fromkeys([*want, "pre"], "served")


# -- a rolling update
# ----------------------------------------------------------------------------------
def test_a_rolling_update_serves_everything_exactly_once(tmp_path, pg_url):
    want = [f"r{i:03d}" for i in range(50)]
    with instances(pg_url, tmp_path, "old", "new") as (old, new):
        old.start()
        wait_until(lambda: role(old) == "owner", 15, "the old instance owns the job")
        with Drain([old.url, new.url]) as trainer:
            trainer.client.start_rollout(num_repeat_per_sample=K, job_session="job1")
            writer = write_groups(pg_url, want, 0.05)
            trainer.wait_for(10, 30)
            new.start()  # first the new one ...
            wait_until(lambda: role(new) == "standby", 15, "the new instance waits as a standby")
            stopped_at = time.monotonic()
            assert (
                old.stop(signal.SIGTERM) == 0
            )  # ... then the old one, gracefully: it gives the lease up
            wait_until(lambda: role(new) == "owner", 10, "the new instance takes over")
            handover = time.monotonic() - stopped_at
            writer.join(30)
            trainer.wait_for(len(want), 60)
        assert dict(trainer.got) == dict.fromkeys(want, 1)
        assert served_groups(pg_url) == dict.fromkeys(want, "served")
        print(
            f"\nrolling update: the new instance owned the job {handover:.2f} s after SIGTERM to "
            "the old one (which gave its lease up)"
        )
        assert "gave the lease up" in old.log()


# -- LAUNCHER=none: a failover drops nothing
# ------------------------------------------------------------
def test_with_an_external_writer_a_failover_drops_nothing(tmp_path, pg_url):
    with instances(pg_url, tmp_path, "a", "b", hosts=True) as (a, b):
        w = Writer(pg_url)
        owner_and_standby(a, b)
        with Drain([a.url, b.url]) as trainer:
            trainer.client.start_rollout(num_repeat_per_sample=3, job_session="job1")
            done = [f"d{i}" for i in range(4)]
            for gid in done:
                w.group(gid, 3, steps=2)
            open_sessions = {
                gid: w.group(gid, 3, steps=2, complete=2)[2] for gid in (f"o{i}" for i in range(4))
            }
            trainer.wait_for(4, 30)
            wait_until(
                lambda: stats(a)["groups"]["pending"] == 4, 10, "the owner holds the open groups"
            )
            kill9(a)
            wait_until(lambda: role(b) == "owner", LEASE_S + 15, "the standby takes over")
            wait_until(
                lambda: stats(b).get("groups", {}).get("pending") == 4,
                15,
                "the new owner holds them too",
            )
            for gid, sid in open_sessions.items():  # the launcher elsewhere goes on writing
                w.step(gid, sid, 3, completed=True, step_reward=0.9)
            trainer.wait_for(8, 30)
        w.close()
        assert dict(trainer.got) == dict.fromkeys(done + list(open_sessions), 1)
        s = stats(b)
        assert s["groups"]["dropped_total"] == 0 and s["rows"]["dropped_total"] == 0, s
        assert "launcher_exited" not in b.log()


# -- SQLite: two instances on one file
# ----------------------------------------------------------------
def test_sqlite_two_instances_on_one_file(tmp_path):
    url = "sqlite://" + str(tmp_path / "launcher.db")
    want = [f"s{i:02d}" for i in range(30)]
    with instances(url, tmp_path, "a", "b") as (a, b):
        owner_and_standby(a, b)
        r = requests.post(b.url + "/get_rollout_data", json={}, allow_redirects=False, timeout=10)
        assert r.status_code == 307 and r.headers["Location"] == a.url + "/get_rollout_data"
        with Drain([b.url, a.url]) as trainer:
            trainer.client.start_rollout(num_repeat_per_sample=K, job_session="job1")
            writer = write_groups(url, want, 0.05)
            trainer.wait_for(10, 30)
            killed_at = time.monotonic()
            kill9(a)  # the kernel releases its flock
            wait_until(lambda: role(b) == "owner", 10, "the standby takes over")
            took = time.monotonic() - killed_at
            writer.join(30)
            trainer.wait_for(len(want), 60)
        assert dict(trainer.got) == dict.fromkeys(want, 1)
        print(f"\nSQLite: the standby owned the job {took:.2f} s after kill -9 of the owner")
        a.start()  # back, as a standby of b
        wait_until(lambda: role(a) == "standby", 15, "the old owner, restarted, is a standby")
        assert health(a)["owner"]["url"] == b.url


# -- the launcher across owners
# ------------------------------------------------------------------------
def launcher_env(marker: Path) -> dict[str, str]:
    cmd = shlex.join(
        [sys.executable, str(FAKE_LAUNCHER), "--mode", "hang", "--marker", str(marker)]
    )
    return {"ROLLOUT_BUFFER_LAUNCHER_CMD": cmd, "ROLLOUT_BUFFER_STOP_GRACE_SECONDS": "1"}


def starts(marker: Path) -> list[int]:
    return [int(p) for p in marker.read_text().split()] if marker.exists() else []


@contextlib.contextmanager
def launchers_killed(marker: Path) -> Iterator[None]:
    try:
        yield
    finally:
        for pid in starts(marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def test_on_its_host_the_launcher_is_adopted_or_relaunched_when_it_is_gone(tmp_path, pg_url):
    marker = tmp_path / "launcher.starts"
    with (
        launchers_killed(marker),
        instances(pg_url, tmp_path, "a", "b", "c", launcher="auto", env=launcher_env(marker)) as (
            a,
            b,
            c,
        ),
    ):
        w = Writer(pg_url)
        owner_and_standby(a, b)
        r = requests.post(
            a.url + "/start_rollout",
            json={"num_repeat_per_sample": K, "job_session": "job1"},
            timeout=30,
        )
        first = r.json()["pid"]
        w.group("open", K, complete=1)
        wait_until(lambda: stats(a)["groups"]["pending"] == 1, 10, "the owner holds the open group")
        kill9(a)  # the launcher (its own session) lives on
        assert alive(first)
        wait_until(
            lambda: role(b) == "owner" and health(b)["launcher"]["adopted"],
            15,
            "b adopts the launcher",
        )
        assert health(b)["launcher"]["pid"] == first and starts(marker) == [first]
        assert stats(b)["groups"]["pending"] == 1  # nothing dropped

        c.start()
        wait_until(lambda: role(c) == "standby", 15, "c waits as a standby")
        kill9(b)
        os.killpg(
            first, signal.SIGKILL
        )  # ... and the launcher dies with it (a crash of the whole host)
        wait_until(lambda: not alive(first), 5, "the launcher gone")
        wait_until(lambda: len(starts(marker)) == 2, 20, "c starts a fresh launcher")
        fresh = starts(marker)[1]
        wait_until(
            lambda: health(c)["launcher"]["pid"] == fresh and health(c)["aievobox_running"],
            10,
            "c supervises the fresh launcher",
        )
        s = stats(c)
        assert s["groups"]["dropped"] == {"launcher_exited": 1}, s[
            "groups"
        ]  # its sessions died with it
        w.close()


def test_on_another_host_the_launcher_is_left_alone_until_an_instance_there_stops_it(
    tmp_path, pg_url
):
    marker = tmp_path / "launcher.starts"
    with (
        launchers_killed(marker),
        instances(
            pg_url, tmp_path, "a", "b", hosts=True, launcher="auto", env=launcher_env(marker)
        ) as (a, b),
    ):
        w = Writer(pg_url)
        owner_and_standby(a, b)
        r = requests.post(
            b.url + "/start_rollout",
            json={"num_repeat_per_sample": K, "job_session": "job1"},
            timeout=30,
        )  # (followed to the owner: requests keeps the method and body on a 307)
        assert r.status_code == 200 and r.url.startswith(a.url), (r.status_code, r.url, r.text)
        first = r.json()["pid"]
        w.group("open", K, complete=1)
        wait_until(lambda: stats(a)["groups"]["pending"] == 1, 10, "the owner holds the open group")

        os.killpg(a.proc.pid, signal.SIGSTOP)  # host A's instance is silent; its launcher runs on
        wait_until(lambda: role(b) == "owner", LEASE_S + 15, "b takes over")
        wait_until(
            lambda: (health(b)["launcher"]["elsewhere"] or {}).get("pid") == first,
            10,
            "b watches the launcher on host A",
        )
        elsewhere = health(b)["launcher"]["elsewhere"]
        assert elsewhere["host"] == "host-a" and elsewhere["state"].startswith("unknown")
        r = requests.post(
            b.url + "/start_rollout",
            json={"num_repeat_per_sample": K, "job_session": "job1"},
            timeout=30,
        )
        assert (
            r.status_code == 200
            and "already running" in r.json()["message"]
            and r.json()["pid"] == first
        )
        assert alive(first) and starts(marker) == [first]
        assert stats(b)["groups"]["pending"] == 1 and stats(b)["groups"]["dropped_total"] == 0

        os.killpg(
            a.proc.pid, signal.SIGCONT
        )  # host A's instance wakes: a standby now, it stops the
        wait_until(
            lambda: not alive(first), 20, "the launcher on host A is stopped there"
        )  # orphan
        wait_until(lambda: len(starts(marker)) == 2, 20, "b starts a fresh launcher on its host")
        fresh = starts(marker)[1]
        wait_until(
            lambda: health(b)["launcher"]["pid"] == fresh and health(b)["aievobox_running"],
            10,
            "b supervises the fresh launcher",
        )
        assert role(a) == "standby"
        assert stats(b)["groups"]["dropped"] == {"launcher_exited": 1}
        assert (
            "stopping launcher pid" in a.log()
            and "is gone, as an instance there reports" in b.log()
        )
        w.close()
