"""DNS rebinding in a real headless browser (issue 20, item 4): Chromium resolves evil.example and
buffer-1.test to 127.0.0.1 (--host-resolver-rules, as a rebound DNS answer would), so a script on
http://evil.example:PORT/ is, to the browser, on its own origin. Its POSTs must be refused without
a token; the status page and a script on a loopback origin or on the advertise URL's host keep
working. Needs chromium, chromedriver and selenium: skipped without them, except under CI=true."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
from servers import free_port, serve
from support import CHROMEDRIVER, CHROMIUM, require_browser, wait_until

pytestmark = pytest.mark.slow

# what a page's own script does to take groups, stop or switch the job: a simple request
# (text/plain, no preflight), its status and body back to the test
FETCH = """
const [path, body, done] = arguments;
fetch(path, {method: "POST", body: body, headers: {"Content-Type": "text/plain"}})
  .then(r => r.text().then(t => done([r.status, t])))
  .catch(e => done([0, String(e)]));
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-dev-shm-usage",
        "--host-resolver-rules=MAP evil.example 127.0.0.1, MAP buffer-1.test 127.0.0.1",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def post_from_page(driver: Any, origin: str, path: str, body: str) -> tuple[int, str]:
    """Open the status page at ``origin`` and POST from its script, as a page there would."""
    if not driver.current_url.startswith(origin + "/"):
        driver.get(origin + "/")
    status, text = driver.execute_async_script(FETCH, path, body)
    return int(status), text


def test_a_rebound_page_is_refused_and_the_service_own_names_are_not(browser, lite_url, tmp_path):
    port = free_port()
    advertised = f"http://buffer-1.test:{port}"
    with serve(
        lite_url, tmp_path / "srv", port=port, env={"ROLLOUT_BUFFER_ADVERTISE_URL": advertised}
    ) as srv:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "job1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        evil = f"http://evil.example:{port}"
        for path, body in (
            ("/get_rollout_data", "{}"),
            ("/start_rollout", '{"job_session":"evil","num_repeat_per_sample":1}'),
            ("/stop_rollout", "{}"),
        ):
            status, text = post_from_page(browser, evil, path, body)
            assert status == 403 and "ROLLOUT_BUFFER_ALLOWED_HOSTS" in text, (path, status, text)
        assert requests.get(srv.url + "/health", timeout=30).json()["job_session"] == "job1"
        # the status page itself reads by any name: it renders the job from its own /status
        wait_until(
            lambda: browser.find_element("id", "job").text == "job1",
            15,
            lambda: f"the page at {evil} showing the job: {browser.page_source[:1500]}",
        )
        for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", advertised):
            status, text = post_from_page(browser, origin, "/get_rollout_data", "{}")
            assert status == 200, (origin, status, text)
            wait_until(
                lambda: browser.find_element("id", "job").text == "job1",
                15,
                lambda origin=origin: f"the page at {origin}: {browser.page_source[:1500]}",
            )
