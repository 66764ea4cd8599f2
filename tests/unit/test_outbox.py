"""The outbox (unit tier): a plan is recorded before its sessions are handed to the notifier; a plan
whose recording failed is kept, and recorded first by the next flush; a delivered notification is
marked in the store. Real SQLite files; the notifier is never started (no socket): its pending map
shows what it was handed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import make_config, make_launcher_db

from rollout_buffer.core.errors import StorageError
from rollout_buffer.core.model import Decisions, Drop, GroupKey
from rollout_buffer.runtime.notifications import Outbox
from rollout_buffer.runtime.proxy import ProxyNotifier
from rollout_buffer.storage.db import Database
from rollout_buffer.storage.store import LazyPair, Store


class Fence:
    """The lease's fence hook of the store: it refuses while ``down`` (the database is away)."""

    def __init__(self) -> None:
        self.down = False

    def __call__(self, db: Database) -> None:
        if self.down:
            raise StorageError("the database is unreachable (test)")


@pytest.fixture
def parts(tmp_path) -> Iterator[tuple[Outbox, Store, Fence, ProxyNotifier]]:
    url = "sqlite://" + str(tmp_path / "launcher.db")
    make_launcher_db(url)
    config = make_config(url, tmp_path)
    notifier = ProxyNotifier(base_url="http://127.0.0.1:9")  # never started: nothing is sent
    outbox = Outbox(notifier=notifier, config=config)
    notifier.deliver_to(outbox.on_delivered)
    fence = Fence()
    conns = LazyPair(config, fence)
    store = conns.get().store
    store.ensure_schema()
    store.activate_job("job1", 2, 0, 0, 1, [])
    yield outbox, store, fence, notifier
    conns.close()


def drop(group_id: str) -> Decisions:
    return Decisions(drops=[Drop(group_id, "incomplete_group_ttl", [1, 2], [f"{group_id}-s1"])])


def test_a_plan_is_recorded_then_its_sessions_are_handed_to_the_notifier(parts) -> None:
    outbox, store, _, notifier = parts
    outbox.act(store, "job1", drop("g1"))
    assert store.group_decision("job1", "g1") == ("dropped", "incomplete_group_ttl")
    assert notifier.pending()["reasons"] == {"incomplete_group_ttl": 1}
    assert outbox.empty()


def test_a_plan_that_could_not_be_recorded_is_kept_and_recorded_first(parts) -> None:
    outbox, store, fence, notifier = parts
    fence.down = True
    with pytest.raises(StorageError):
        outbox.act(store, "job1", drop("g1"))
    outbox.act_quietly(store, "job1", drop("g2"))  # queued too, nothing raised
    assert not outbox.empty() and notifier.pending()["sessions"] == 0  # never before the record
    assert store.group_decision("job1", "g1") is None
    with pytest.raises(StorageError):
        outbox.flush(store)
    assert not outbox.empty()
    fence.down = False
    outbox.flush(store)
    assert outbox.empty()
    assert store.group_decision("job1", "g1") == ("dropped", "incomplete_group_ttl")
    assert store.group_decision("job1", "g2") == ("dropped", "incomplete_group_ttl")
    assert notifier.pending()["sessions"] == 2


def test_discard_forgets_the_unrecorded_plans(parts) -> None:
    outbox, store, fence, _ = parts
    fence.down = True
    outbox.act_quietly(store, "job1", drop("g1"))
    assert outbox.discard() == 1 and outbox.empty()


def test_a_delivered_notification_is_marked_and_not_sent_again(parts) -> None:
    outbox, store, _, _ = parts
    outbox.act(store, "job1", drop("g1"))
    assert [u.key for u in store.unnotified()] == [GroupKey("job1", "g1")]
    outbox.on_delivered("incomplete_group_ttl", ["g1-s1"], ["g1"], [GroupKey("job1", "g1")])
    assert list(store.unnotified()) == []
    fresh = ProxyNotifier(base_url="http://127.0.0.1:9")
    Outbox(notifier=fresh, config=outbox.config).resend_unnotified(store)  # after a restart
    assert fresh.pending()["sessions"] == 0
