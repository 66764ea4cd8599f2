"""Every group counted as served reaches the trainer across an outage (issue 35, item 3), through
a real gunicorn on SQLite and Postgres, reached through a real TCP relay that is cut
(tests/fakes/tcp_forwarder.py), with BufferClient and AsyncBufferClient.

The trainers' long-polls are inside the server when the relay stalls; groups become ready, the
server serves and records them, and its answers are held in the relay; then the relay is cut for
40 s, and the server is killed -9 and restarted meanwhile. The clients retry the same request_id
within their retry window (120 s by default) and get the kept batches replayed. A client that
gives up (its retries used up) raises BufferUnavailable with the request_id, and the same
client's next poll, or a new client's ``get_batch(request_id=...)``, returns the same batch."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from fakes.tcp_forwarder import TcpForwarder
from servers import Server, Trainer, free_port, kill9, serve
from support import Writer, wait_until

from rollout_buffer.client import (
    AsyncBufferClient,
    Batch,
    BufferClient,
    BufferError,
    BufferUnavailable,
)
from rollout_buffer.core.config import Config
from rollout_buffer.storage.db import connect

pytestmark = pytest.mark.slow

K = 2
OUTAGE_S = 40.0


@contextlib.contextmanager
def relayed(db_url: str, tmp_path: Any) -> Iterator[tuple[Server, TcpForwarder, Writer]]:
    """A started server with job J (K = 2), a TCP relay in front of it, a row writer."""
    srv = Server(db_url, tmp_path / "srv")
    relay = None
    w = Writer(db_url, job="J")
    try:
        srv.start()
        Trainer(srv).start_rollout("J", k=K)
        relay = TcpForwarder(srv.port)
        yield srv, relay, w
    finally:
        if relay is not None:
            relay.close()
        srv.stop()
        w.close()


def served_in_db(db_url: str) -> set[str]:
    db = connect(db_url)
    try:
        rows = db.rows("SELECT group_id FROM rollout_buffer_groups WHERE status = 'served'")
        return {r[0] for r in rows}
    finally:
        db.close()


def stall_with_polls_inside(srv: Server, relay: TcpForwarder, waiting: int) -> None:
    """Stall the relay once ``waiting`` long-polls are held inside the server (their answers, when
    the server serves them, are then held in the relay)."""
    trainer = Trainer(srv)
    wait_until(
        lambda: trainer.stats()["polls"]["waiting"] == waiting, 30, f"{waiting} polls waiting"
    )
    relay.stall()


def serve_while_stalled(srv: Server, w: Writer, groups: list[str], served: int) -> None:
    for g in groups:
        w.group(g, K, steps=1)
    trainer = Trainer(srv)
    wait_until(
        lambda: trainer.stats()["groups"]["served"] == served,
        30,
        lambda: f"{served} groups served behind the stalled relay ({trainer.stats()['groups']})",
    )


# -- a 40 s outage, the sync and the async client at once ------------------------------------------


class Received:
    """What one trainer got: its batches (as served) and the errors its calls raised."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def groups(self) -> list[str]:
        return [g.group_id for b in self.batches for g in b.groups]

    def take(self, call: Callable[[], Batch]) -> None:
        """A trainer's loop: poll, keep the batch, go on after an error (as a trainer would)."""
        while not self.stop.is_set():
            try:
                self.batches.append(call())
            except TimeoutError:
                continue
            except BufferError as exc:
                self.errors.append(exc)


def sync_trainer(url: str, got: Received) -> None:
    with BufferClient(url, backoff_s=0.2) as client:
        got.take(lambda: client.get_batch(min_groups=2, max_groups=2, timeout=10))


def async_trainer(url: str, got: Received) -> None:
    async def main() -> None:
        async with AsyncBufferClient(url, backoff_s=0.2) as client:
            while not got.stop.is_set():
                try:
                    batch = await client.get_batch(min_groups=2, max_groups=2, timeout=10)
                    got.batches.append(batch)
                except TimeoutError:
                    continue
                except BufferError as exc:
                    got.errors.append(exc)

    asyncio.run(main())


def test_every_group_counted_as_served_reaches_the_trainers_across_a_40_s_outage(db_url, tmp_path):
    with relayed(db_url, tmp_path) as (srv, relay, w):
        trainers = {"sync": Received(), "async": Received()}
        threads = [
            threading.Thread(
                target=sync_trainer, args=(f"http://127.0.0.1:{relay.port}", trainers["sync"])
            ),
            threading.Thread(
                target=async_trainer, args=(f"http://127.0.0.1:{relay.port}", trainers["async"])
            ),
        ]
        for t in threads:
            t.start()
        try:

            def received() -> list[str]:
                return trainers["sync"].groups() + trainers["async"].groups()

            w.group("a0", K, steps=1)
            w.group("a1", K, steps=1)
            wait_until(lambda: sorted(received()) == ["a0", "a1"], 30, "a0, a1 received")
            stall_with_polls_inside(srv, relay, 2)
            serve_while_stalled(srv, w, ["b0", "b1", "b2", "b3"], 6)
            relay.down()  # the answers are lost; nothing answers for 40 s
            began = time.monotonic()
            kill9(srv)  # and the service crashes: the batches are kept in its database only
            srv.start()
            time.sleep(OUTAGE_S - (time.monotonic() - began))  # the outage: the clients retry
            relay.up()
            w.group("c0", K, steps=1)
            w.group("c1", K, steps=1)
            want = {"a0", "a1", "b0", "b1", "b2", "b3", "c0", "c1"}
            wait_until(lambda: set(received()) == want, 60, lambda: f"all received ({received()})")
            assert served_in_db(db_url) == want  # every group counted as served was received...
            assert sorted(received()) == sorted(want)  # ...once
            for name, got in trainers.items():
                assert got.errors == [], name
                assert any(b.meta_info["replayed"] for b in got.batches), name  # resumed its poll
            stats = Trainer(srv).stats()
            assert stats["polls"]["replayed"] == 2
            metrics = requests.get(srv.url + "/metrics", timeout=30).text
            assert "rollout_buffer_polls_replayed_total 2" in metrics
        finally:
            for got in trainers.values():
                got.stop.set()
            for t in threads:
                t.join(30)


# -- a client that gives up: its error carries the request_id, and it is resumed ----------------


def give_up(
    run: Callable[[Callable[..., Any]], Any], client: Any, srv, relay, w
) -> BufferUnavailable:
    """A poll held in the server is served behind a stalled relay, then the relay is cut: the
    client gives up. Returns its error."""
    raised: list[BaseException] = []

    def poll() -> None:
        try:
            run(lambda: client.get_batch(min_groups=2, max_groups=2, timeout=60))
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=poll)
    thread.start()
    stall_with_polls_inside(srv, relay, 1)
    serve_while_stalled(srv, w, ["g0", "g1"], 2)
    relay.down()
    thread.join(30)
    assert len(raised) == 1 and isinstance(raised[0], BufferUnavailable), raised
    return raised[0]


def run_sync(call: Callable[[], Any]) -> Any:
    return call()


def run_async(call: Callable[[], Any]) -> Any:
    """Await a call of an AsyncBufferClient on a loop of its own (asyncio.run)."""

    async def once() -> Any:
        return await call()

    return asyncio.run(once())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_poll_given_up_on_carries_its_request_id_and_is_resumed(db_url, tmp_path, kind):
    make = BufferClient if kind == "sync" else AsyncBufferClient
    run = run_sync if kind == "sync" else run_async
    with relayed(db_url, tmp_path) as (srv, relay, w):
        url = f"http://127.0.0.1:{relay.port}"
        client = make(url, retries=2, backoff_s=0.1)  # retries given: they end the call
        exc = give_up(run, client, srv, relay, w)
        db = connect(db_url)
        try:
            bound = db.scalar("SELECT request_id FROM rollout_buffer_batches")
        finally:
            db.close()
        assert getattr(exc, "request_id", None) == bound and bound in str(exc)
        relay.up()
        # the same client's next poll resumes it by itself: the same batch, as it was served
        again = run(lambda: client.get_batch(timeout=30))
        assert again.meta_info["request_id"] == exc.request_id and again.meta_info["replayed"]
        assert [g.group_id for g in again.groups] == ["g0", "g1"]
        # and only that poll: the next one is a new poll
        w.group("h0", K, steps=1)
        fresh = run(lambda: client.get_batch(timeout=30))
        assert fresh.meta_info["request_id"] != exc.request_id and not fresh.meta_info["replayed"]
        # a new client resumes it by passing the id
        other = make(url)
        same = run(lambda: other.get_batch(request_id=exc.request_id, timeout=30))
        assert [i["uid"] for i in same.items] == [i["uid"] for i in again.items]
        for c in (client, other):
            run(c.close)
        assert Trainer(srv).stats()["polls"]["replayed"] == 2


# -- the retry window and retries ---------------------------------------------------------------


def test_the_retry_window_ends_a_call_and_retries_when_given_end_it_sooner():
    dead = f"http://127.0.0.1:{free_port()}"
    for make in (BufferClient, AsyncBufferClient):
        assert getattr(make(dead), "retry_window_s", 0) >= 120 and make(dead).retries is None
    # the service keeps a batch answerable at least twice the client's window, by default
    assert Config.from_env({}).replay_retention_s >= 2 * BufferClient(dead).retry_window_s
    began = time.monotonic()
    with (
        BufferClient(dead, retry_window_s=1.5, backoff_s=0.05, backoff_max_s=0.2) as client,
        pytest.raises(BufferUnavailable) as info,
    ):
        client.get_rollout_data()
    assert 1.5 <= time.monotonic() - began < 10
    assert info.value.request_id is not None
    with (
        BufferClient(dead, retries=2, backoff_s=0.01) as client,
        pytest.raises(BufferUnavailable, match=r"after 3 attempt\(s\)") as info,
    ):
        client.stats()
    assert info.value.request_id is None  # not a poll
    for bad in ({"retries": -1}, {"retries": 1.5}, {"retry_window_s": -1}):
        with pytest.raises(ValueError):
            BufferClient(dead, **bad)


def test_a_cancelled_async_poll_is_resumed_by_the_next_poll(lite_url, tmp_path):
    """A cancelled poll's request still runs in its thread and may be served: the next poll of the
    client resumes its request_id and gets that batch, instead of it being lost."""
    w = Writer(lite_url, job="J")
    with serve(lite_url, tmp_path) as srv:
        trainer = Trainer(srv)
        trainer.start_rollout("J", k=K)

        async def main() -> Batch:
            async with AsyncBufferClient(srv.url) as client:
                task = asyncio.create_task(client.get_batch(timeout=60))
                await asyncio.to_thread(
                    wait_until, lambda: trainer.stats()["polls"]["waiting"] == 1, 30, "a poll held"
                )
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                w.group("g0", K, steps=1)
                await asyncio.to_thread(
                    wait_until, lambda: trainer.stats()["groups"]["served"] == 1, 30, "g0 served"
                )
                return await client.get_batch(timeout=30)

        batch = asyncio.run(main())
    w.close()
    assert [g.group_id for g in batch.groups] == ["g0"] and batch.meta_info["replayed"] is True


def test_iter_groups_resumes_a_poll_given_up_on_and_yields_its_batch_whole(lite_url, tmp_path):
    with relayed(lite_url, tmp_path) as (srv, relay, w):
        client = BufferClient(f"http://127.0.0.1:{relay.port}", retries=1, backoff_s=0.1)
        exc = give_up(run_sync, client, srv, relay, w)
        relay.up()
        groups = list(client.iter_groups(n=1, timeout=30))  # the batch holds 2: none is lost
        assert [g.group_id for g in groups] == ["g0", "g1"]
        assert {g.meta_info["request_id"] for g in groups} == {exc.request_id}
        client.close()


def test_after_a_job_switch_a_poll_given_up_on_is_not_resumed_into_the_new_job(lite_url, tmp_path):
    """The batch of the poll given up on belongs to job J. The trainer switches to job J2: the
    client's next poll does not get J's batch, nor binds J2's groups to J's request_id: the service
    refuses the id (409), the client logs it and polls anew. Passing the id explicitly raises."""
    with relayed(lite_url, tmp_path) as (srv, relay, w):
        url = f"http://127.0.0.1:{relay.port}"
        client = BufferClient(url, retries=1, backoff_s=0.1)
        exc = give_up(run_sync, client, srv, relay, w)
        relay.up()
        Trainer(srv).start_rollout("J2", k=K)
        other_job = Writer(lite_url, job="J2")
        other_job.group("new", K, steps=1)
        other_job.close()
        batch = client.get_batch(timeout=30)
        assert [g.group_id for g in batch.groups] == ["new"]
        assert batch.meta_info["request_id"] != exc.request_id and not batch.meta_info["replayed"]
        with pytest.raises(BufferError, match="of job 'J'") as info:
            BufferClient(url).get_batch(request_id=exc.request_id, timeout=30)
        assert info.value.status == 409 and info.value.request_id == exc.request_id
        client.close()
