"""DNS rebinding (issue 20, item 4): without a token, a browser's state-changing request is
accepted only by a Host the service is really reached by; trainers, which send no browser
headers, are accepted by any Host."""

from __future__ import annotations

import pytest


def browser(host: str, origin: str | None = "same", site: str | None = "same-origin") -> dict:
    """The headers a browser page at ``host`` sends to its own origin."""
    headers = {"Host": host}
    if origin is not None:
        headers["Origin"] = f"http://{host}" if origin == "same" else origin
    if site is not None:
        headers["Sec-Fetch-Site"] = site
    return headers


def test_a_rebound_page_can_neither_start_nor_take_groups_nor_stop(harness, writer):
    harness.start(k=2)
    writer.group("g1", 2)
    harness.settle()
    evil = browser("evil.example:18889")
    for path, body in (
        ("/start_rollout", '{"job_session":"evil","num_repeat_per_sample":1}'),
        ("/get_rollout_data", "{}"),
        ("/stop_rollout", "{}"),
    ):
        r = harness.client.post(path, data=body, headers=evil, content_type="text/plain")
        assert r.status_code == 403, (path, r.get_data(as_text=True)[:300])
        error = r.get_json()["error"]
        assert "'evil.example:18889'" in error and "ROLLOUT_BUFFER_ALLOWED_HOSTS" in error, error
    # nothing changed: the job, its ready group and the launcher's state are as they were
    health = harness.client.get("/health").get_json()
    assert health["job_session"] == "job1"
    assert list(harness.poll()["data"]["meta_info"]["finished_groups"]) == ["g1"]


@pytest.mark.parametrize(
    "host",
    [
        "localhost:18889",
        "localhost",
        "LOCALHOST:18889",
        "localhost.:18889",
        "127.0.0.1:18889",
        "127.3.2.1:8080",
        "[::1]:18889",
        "[::ffff:127.0.0.1]:18889",
    ],
)
def test_a_page_by_a_loopback_name_may_poll(lite_url, harness_factory, host):
    harness = harness_factory(lite_url)
    harness.start(k=2)
    r = harness.client.post("/get_rollout_data", json={}, headers=browser(host))
    assert r.status_code == 200, r.get_data(as_text=True)[:300]


@pytest.mark.parametrize(
    "headers",
    [
        browser("localhost.evil.example:18889"),
        browser("127.0.0.1.evil.example"),
        browser("evil.example"),
        browser("EVIL.example.:18889"),
        browser("[::2]:18889"),
        browser("10.0.0.7:18889"),
        browser("evil.example:18889", origin=None),  # Sec-Fetch-Site alone
        browser("evil.example:18889", site=None),  # Origin alone
        {"Host": "", "Origin": "http://localhost"},
    ],
)
def test_a_page_by_any_other_name_is_refused(lite_url, harness_factory, headers):
    harness = harness_factory(lite_url)
    harness.start(k=2)
    r = harness.client.post("/start_rollout", json={"job_session": "other"}, headers=headers)
    assert r.status_code == 403, r.get_data(as_text=True)[:300]
    assert r.get_json()["status"] == 403
    assert harness.client.get("/health").get_json()["job_session"] == "job1"
    # a GET poll counts as taking groups too (the route is POST only: it would be a 405)
    assert harness.client.get("/get_rollout_data", headers=headers).status_code == 403


def test_the_advertised_host_and_the_allowed_hosts_pass_and_nothing_else(lite_url, harness_factory):
    harness = harness_factory(
        lite_url,
        advertise_url="http://Buffer-1.cluster:18889",
        allowed_hosts=("gpu-node-7", "10.0.0.7"),
    )
    harness.start(k=2)
    for host in ("buffer-1.cluster:18889", "buffer-1.cluster.:8080", "gpu-node-7", "10.0.0.7:1"):
        r = harness.client.post("/get_rollout_data", json={}, headers=browser(host))
        assert r.status_code == 200, (host, r.get_data(as_text=True)[:300])
    for host in ("buffer-2.cluster:18889", "gpu-node-7.evil.example", "10.0.0.8"):
        r = harness.client.post("/get_rollout_data", json={}, headers=browser(host))
        assert r.status_code == 403, host


def test_trainers_and_the_status_page_are_not_affected(lite_url, harness_factory):
    harness = harness_factory(lite_url)
    harness.start(k=2)
    # a trainer on another node: no browser headers, any Host
    r = harness.client.post("/get_rollout_data", json={}, headers={"Host": "buffer-1:18889"})
    assert r.status_code == 200
    # reading changes nothing: the status page's own JS polls GET /status by any name
    for host in ("buffer-1:18889", "localhost:18889"):
        assert harness.client.get("/", headers=browser(host, origin=None, site="none")).status_code
        r = harness.client.get("/status", headers=browser(host, origin=None))
        assert r.status_code == 200, r.get_data(as_text=True)[:300]


def test_with_a_token_the_token_decides_not_the_host(lite_url, harness_factory):
    harness = harness_factory(lite_url, token="s3cret-token")
    headers = browser("buffer-1:18889")
    r = harness.client.post("/get_rollout_data", json={}, headers=headers)
    assert r.status_code == 401
    headers["Authorization"] = "Bearer s3cret-token"
    harness.client.post(
        "/start_rollout",
        json={"num_repeat_per_sample": 2},
        headers={"Authorization": "Bearer s3cret-token"},
    )
    r = harness.client.post("/get_rollout_data", json={}, headers=headers)
    assert r.status_code == 200, r.get_data(as_text=True)[:300]
