"""The status page in a real headless browser (Debian's chromium, driven by selenium and
chromedriver) against a real server (gunicorn), with and without ROLLOUT_BUFFER_TOKEN.

The browser is started with the flags that keep it off the network (this machine's network is
closed: without them Chromium's own background connections are refused and slow it down). When
the browser or selenium cannot be had, the tests skip, except under CI=true, where they fail:
``.ci/run`` installs chromium and chromium-driver.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from servers import serve
from support import CHROMEDRIVER, CHROMIUM, Writer, require_browser, wait_until

WIDTH, HEIGHT = 1200, 900
TOKEN = "page-test-token-5f1c"

pytestmark = pytest.mark.slow


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
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH},{HEIGHT}",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _served_job(srv_url: str, db_url: str, token: str | None) -> dict:
    """A job with 3 groups written, 2 complete: one poll serves them, one stays pending."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = requests.post(
        srv_url + "/start_rollout",
        json={"num_repeat_per_sample": 2, "job_session": "page-job"},
        headers=headers,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    w = Writer(db_url, job="page-job")
    try:
        w.group("ga", 2, steps=3)
        w.group("gb", 2, steps=2)
        w.group("gc", 2, steps=2, complete=1)
    finally:
        w.close()

    def all_read() -> bool:
        # every row written is read (14), so the figures the page shows later are these: waiting
        # for the 2 ready groups alone let gc's rows arrive after the figures were taken
        stats = requests.get(srv_url + "/status", headers=headers, timeout=10).json()["stats"]
        return stats["groups"]["ready"] == 2 and stats["rows"]["read"] == 14

    wait_until(all_read, 15, "2 groups ready and every row read")
    r = requests.post(srv_url + "/get_rollout_data", json={}, headers=headers, timeout=10)
    assert r.json()["success"] is True

    def sent() -> dict | None:
        # the send time is recorded once the server has written the last byte, which can come
        # after the client has read the answer
        doc = requests.get(srv_url + "/status", headers=headers, timeout=10).json()
        done = doc["history"]["batches"] and doc["history"]["batches"][0]["send_s"] is not None
        return doc if done else None

    doc = wait_until(sent, 10, "the batch recorded as sent")
    assert doc["stats"]["groups"]["served"] == 2
    return doc


def _text(driver: Any, el_id: str) -> str:
    return driver.find_element("id", el_id).text


def _wait_text(driver: Any, el_id: str, expected: str, timeout: float = 15.0) -> None:
    wait_until(
        lambda: _text(driver, el_id) == expected,
        timeout,
        lambda: (
            f"#{el_id} showing {expected!r} (it shows {_text(driver, el_id)!r}); page: "
            f"{driver.page_source[:2000]}"
        ),
    )


def _check_figures(driver: Any, doc: dict) -> None:
    """The page shows the running service's figures (from its own /status)."""
    s = doc["stats"]
    _wait_text(driver, "job", "page-job")
    assert _text(driver, "k") == "2"
    assert _text(driver, "role") == "owner"
    assert _text(driver, "rows-read") == str(s["rows"]["read"]) == "14"
    assert _text(driver, "rows-served") == str(s["rows"]["served"]) == "10"
    assert _text(driver, "rows-pending") == str(s["rows"]["pending"]) == "4"
    assert _text(driver, "groups-served") == "2"
    assert _text(driver, "groups-pending") == "1"
    assert _text(driver, "database") == "ok"
    assert _text(driver, "balanced") == "balanced"
    assert _text(driver, "launcher") == "not running"
    assert _text(driver, "lag") == "0"
    assert _text(driver, "proxy").startswith("0 sessions")
    # sessions: every one the service knows, those that never wrote a trainable row too
    sessions = s["sessions"]
    assert _text(driver, "sessions-known") == str(sessions["known"]) != "0"
    assert _text(driver, "sessions-without") == str(sessions["without_trainable_row"])
    assert _text(driver, "sessions-no-result") == str(sessions["ended_without_result"])
    # the waste: served against discarded generation, and its share
    waste = s["waste"]
    assert _text(driver, "waste-served").startswith(f"{waste['served']['groups']} groups")
    assert _text(driver, "waste-share").endswith("%")
    assert _text(driver, "salvaged") == "0 groups, sessions 0, 0.0 ms kept"
    rows = driver.find_elements("css selector", "#batches tr")
    assert len(rows) == 1
    cells = [c.text for c in rows[0].find_elements("tag name", "td")]
    assert cells[0] == doc["history"]["batches"][0]["batch_id"][:12]
    assert cells[2:4] == ["2", "10"]
    # the charts are inline SVG with one point per 10 s over 15 minutes
    points = (
        driver.find_element("css selector", "#chart-ingest polyline")
        .get_attribute("points")
        .split()
    )
    assert len(points) == 90
    assert float(_text(driver, "ingest-peak")) > 0


def _png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB(A) non-interlaced PNG: (width, height, rows of pixel bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def _check_screenshot(driver: Any, path: Any) -> None:
    """A screenshot renders: a PNG of the viewport's size, with the page drawn on it (not blank)."""
    data = driver.get_screenshot_as_png()
    path.write_bytes(data)
    vw, vh, ratio = driver.execute_script(
        "return [window.innerWidth, window.innerHeight, window.devicePixelRatio]"
    )
    width, height, rows = _png(data)
    assert (width, height) == (round(vw * ratio), round(vh * ratio)), (width, height, vw, vh, ratio)
    assert width >= 800 and height >= 600
    bpp = len(rows[0]) // width
    background = rows[height // 2][:3]
    colours, inked = set(), 0
    for row in rows[::4]:
        for i in range(0, len(row), bpp * 4):
            px = row[i : i + 3]
            colours.add(px)
            inked += px != background
    assert len(colours) > 20, f"the screenshot looks blank ({len(colours)} colours)"
    assert inked > 0.01 * (width // 4) * (height // 4), "almost nothing is drawn on the screenshot"


def test_page_without_token_shows_the_services_figures(browser, lite_url, tmp_path):
    with serve(lite_url, tmp_path / "srv") as srv:
        doc = _served_job(srv.url, lite_url, None)
        browser.get(srv.url + "/")
        _check_figures(browser, doc)
        assert not browser.find_element("id", "token-box").is_displayed()
        # nothing is loaded from anywhere but the service, and its answer says so to the browser
        fetched = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert fetched and all(u.startswith(srv.url + "/") for u in fetched), fetched
        csp = requests.get(srv.url + "/", timeout=10).headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        _check_screenshot(browser, tmp_path / "page.png")
        # it refreshes itself: new figures appear without a reload
        w = Writer(lite_url, job="page-job")
        try:
            w.group("gd", 2, steps=1)
        finally:
            w.close()
        _wait_text(browser, "groups-ready", "1")
        _wait_text(browser, "rows-read", "16")


def test_page_with_token_asks_for_it_and_keeps_it_out_of_urls(browser, lite_url, tmp_path):
    with serve(lite_url, tmp_path / "srv", env={"ROLLOUT_BUFFER_TOKEN": TOKEN}) as srv:
        assert requests.get(srv.url + "/status", timeout=10).status_code == 401
        doc = _served_job(srv.url, lite_url, TOKEN)
        browser.get(srv.url + "/")
        wait_until(
            browser.find_element("id", "token-box").is_displayed,
            15,
            "the page asking for the token",
        )
        assert not browser.find_element("id", "main").is_displayed()
        assert (
            browser.find_element("id", "job").get_attribute("textContent") == "-"
        )  # no figure without the token
        browser.find_element("id", "token-input").send_keys("wrong-token")
        browser.find_element("id", "token-submit").click()
        _wait_text(
            browser, "token-why", "The token was refused; enter the service's ROLLOUT_BUFFER_TOKEN."
        )
        assert (
            browser.execute_script("return sessionStorage.getItem('rollout_buffer_token')") is None
        )
        # a character no HTTP header can carry (a pasted en dash) is refused as such, never stored,
        # and
        # the service is not reported unreachable (every fetch used to throw and retry forever)
        browser.find_element("id", "token-input").send_keys(TOKEN[:4] + "\u2013" + TOKEN[5:])
        browser.find_element("id", "token-submit").click()
        assert "U+2013" in _text(browser, "token-why")
        assert (
            browser.execute_script("return sessionStorage.getItem('rollout_buffer_token')") is None
        )
        assert _text(browser, "overall") == "token required" and not _text(browser, "banner")
        browser.find_element("id", "token-input").send_keys(TOKEN)
        browser.find_element("id", "token-submit").click()
        _check_figures(browser, doc)
        assert (
            browser.execute_script("return sessionStorage.getItem('rollout_buffer_token')") == TOKEN
        )
        # a reload keeps it for the tab: the figures come back without asking
        browser.refresh()
        _check_figures(browser, doc)
        assert not browser.find_element("id", "token-box").is_displayed()
        urls = browser.execute_script(
            "return [location.href].concat(performance.getEntriesByType('navigation').map(e => "
            "e.name),"
            " performance.getEntriesByType('resource').map(e => e.name))"
        )
        assert any(u.endswith("/status") for u in urls), urls
        assert not any(TOKEN in u or "wrong-token" in u for u in urls), urls
        _check_screenshot(browser, tmp_path / "page-token.png")
    assert TOKEN not in srv.log()
