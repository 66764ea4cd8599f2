"""The real stack's parts as they are (issue 22): an LLM proxy without the clear endpoint, a
launcher that exits at once, the upstream client's ``rollout_group_key``; through the Flask test
client, on both backends."""

from __future__ import annotations

from typing import Any

from fakes.fake_proxy import FakeProxy
from support import Writer, wait_until


def test_a_proxy_without_the_clear_endpoint_shows_in_health_and_stats(
    db_url: str, writer: Writer, harness_factory: Any
) -> None:
    with FakeProxy(status=404) as proxy:
        h = harness_factory(
            db_url, proxy_host="127.0.0.1", proxy_port=proxy.port, proxy_read_timeout_s=2.0
        )
        h.start(k=2, job="job1")
        writer.group("g1", 2, complete=1)  # never completes: dropped when the job changes
        h.settle()
        h.start(k=2, job="job2")  # job1's pending group is dropped as job_ended: 2 sessions
        assert wait_until(
            lambda: (
                h.client.get("/health").get_json()["proxy_notifications"].get("dropped_sessions")
                == 2
            )
        )
        health = h.client.get("/health")
        assert health.status_code == 200 and health.get_json()["status"] == "healthy"
        assert health.get_json()["proxy_notifications"]["clear_endpoint"] == "absent"
        stats = h.stats()["proxy_notifications"]
        assert stats["clear_endpoint"] == "absent" and stats["sessions"] == 0
        assert len(proxy.calls) == 1
