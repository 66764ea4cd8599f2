"""An owner paused inside a fenced transaction (issue 20, item 3), with real gunicorn servers on
Postgres, on loopback.

The owner's backend then sits inside a transaction that passed the fence, holding the lease row's
KEY SHARE lock, and a takeover (SELECT ... FOR UPDATE on that row) would wait for it for as long
as the process stays paused. The standby must own the job and serve within the lease plus 5 s.

To catch the owner inside a fenced transaction, support.paused_in_fence holds the job's row while
rows arrive: the owner's next cursor save passes the fence, then waits for the row; the owner is
SIGSTOPped right then, and the row released.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests
from servers import Server, free_port
from support import Writer, make_launcher_db, paused_in_fence, wait_until

from rollout_buffer.client import BufferClient, groups_of

pytestmark = pytest.mark.slow

LEASE_S = 3.0
TAKEOVER_WITHIN_S = LEASE_S + 5.0
K = 2


def instance(url: str, tmp_path, name: str) -> Server:
    port = free_port()
    env = {
        "ROLLOUT_BUFFER_ADVERTISE_URL": f"http://127.0.0.1:{port}",
        "ROLLOUT_BUFFER_LEASE_SECONDS": str(LEASE_S),
        "ROLLOUT_BUFFER_NAME": "paused",
        # on another host the pid check cannot free the lease: it must end
        "ROLLOUT_BUFFER_HOST_ID": f"host-{name}",
    }
    return Server(url, tmp_path / name, port=port, env=env, name=name)


def role(srv: Server) -> str | None:
    try:
        return requests.get(srv.url + "/health", timeout=2).json().get("role")
    except (requests.RequestException, ValueError):
        return None


def drain(client: BufferClient, want: set[str], got: dict[str, int]) -> bool:
    doc = client.get_rollout_data(wait_s=0.5)
    for gid, _items in groups_of(doc) if doc.get("success") else []:
        got[gid] = got.get(gid, 0) + 1
    return want <= set(got)


def test_an_owner_paused_inside_a_fenced_transaction_is_taken_over_within_the_lease(
    tmp_path, pg_url
):
    make_launcher_db(pg_url)
    a, b = instance(pg_url, tmp_path, "a"), instance(pg_url, tmp_path, "b")
    writer = Writer(pg_url)
    try:
        a.start()
        wait_until(lambda: role(a) == "owner", 15, "a owns the job")
        b.start()
        wait_until(lambda: role(b) == "standby", 15, "b waits as a standby")
        BufferClient(a.url).start_rollout(num_repeat_per_sample=K, job_session="job1")
        got: dict[str, int] = {}
        writer.group("g0", K, steps=1)
        wait_until(lambda: drain(BufferClient(a.url), {"g0"}, got), 15, "the owner serves g0")

        assert a.proc is not None
        with paused_in_fence(
            pg_url, "job1", a.proc.pid, timeout=10, poke=lambda: writer.group("g1", K, steps=1)
        ) as caught:
            assert caught, "the owner's fenced cursor save was not seen"
            paused_at = time.monotonic()
            wait_until(
                lambda: role(b) == "owner",
                TAKEOVER_WITHIN_S + 10,
                "the standby takes over from the owner paused inside a fenced transaction",
            )
            took = time.monotonic() - paused_at
            print(f"\ntakeover {took:.2f} s after the pause (lease {LEASE_S:g} s)")
            assert took < TAKEOVER_WITHIN_S, f"takeover took {took:.1f} s (lease {LEASE_S:g} s)"
            writer.group("g2", K, steps=1)
            with BufferClient(b.url, timeout=30) as client:
                wait_until(lambda: drain(client, {"g1", "g2"}, got), 15, "the new owner serves")
        wait_until(lambda: role(a) == "standby", 15, "the woken owner turns standby")
        assert got == {"g0": 1, "g1": 1, "g2": 1}
        stats = requests.get(b.url + "/stats", timeout=10).json()
        assert stats["accounting_balanced"] and stats["lease"]["takeovers"] == 1, stats
    finally:
        writer.close()
        for srv in (a, b):
            if srv.proc is not None:
                os.killpg(srv.proc.pid, signal.SIGCONT)
            srv.stop()
