"""No response body and no log line shows a database password or the token (issue 14, scenario 5),
through a real gunicorn on a real Postgres whose URL carries a password in every form libpq takes
(the test server trusts any password, so the URL really connects)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests
from servers import Server
from support import fresh_pg_schema, require_pg, wait_until

from rollout_buffer.core.redact import redact

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

PW = "S3cretPw-7f"
TOKEN = "Tok3n-9c1e"
FAKE = Path(__file__).resolve().parent.parent / "fakes" / "fake_launcher.py"


def with_password(dsn: str, form: str) -> str:
    """A Postgres URL with a password in the given form (userinfo or query parameter)."""
    if form == "userinfo":
        return dsn.replace("://root@", f"://root:{PW}@", 1)
    sep = "&" if "?" in dsn else "?"
    return f"{dsn}{sep}password={PW}"


@pytest.mark.parametrize(
    "text",
    [
        f"postgresql://u:{PW}@h:5432/db",
        f"postgresql://u@h/db?password={PW}&sslmode=require",
        f"postgres://h/db?sslmode=require&sslpassword={PW}",
        f"host=h user=u password={PW} dbname=d",
        f"host=h password = '{PW} x' dbname=d",
        f'password="{PW}" host=h',
        f"PASSWORD={PW}",
        f"postgresql://u:{PW}@@h/db",
        "--db-path " + f"postgresql://u:{PW}@h/db",
    ],
)
def test_redact_removes_every_form_of_password(text):
    assert PW not in redact(text)


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_no_answer_or_log_line_shows_the_password_or_the_token(tmp_path, form):
    require_pg()
    with fresh_pg_schema() as schema_url:  # never the shared public schema: other builds migrate it
        check_no_secret_is_shown(tmp_path, with_password(schema_url, form))


def check_no_secret_is_shown(tmp_path, url: str) -> None:
    dump = tmp_path / "launcher.json"
    srv = Server(
        url,
        tmp_path / "srv",
        launcher="auto",
        env={
            "ROLLOUT_BUFFER_TOKEN": TOKEN,
            "ROLLOUT_BUFFER_LAUNCHER_CMD": (
                f"{sys.executable} {FAKE} --mode hang --dump {dump} --db-path {{db_url}}"
            ),
        },
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    seen: list[str] = []
    srv.start()
    try:
        r = requests.post(
            srv.url + "/start_rollout",
            json={"num_repeat_per_sample": 2, "job_session": "sec"},
            headers=auth,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        seen.append(r.text)
        wait_until(dump.exists, 10, "the launcher started")
        launched = json.loads(dump.read_text())
        assert url in launched["argv"]  # the launcher gets the real URL ...
        assert "ROLLOUT_BUFFER_TOKEN" not in launched["env"]  # ... but not the service's token
        for path in ("/health", "/stats", "/metrics"):
            seen.append(requests.get(srv.url + path, headers=auth, timeout=10).text)
        seen.append(
            requests.post(srv.url + "/stop_rollout", json={}, headers=auth, timeout=30).text
        )
    finally:
        srv.stop()
    logs = list((tmp_path / "srv").rglob("*.log"))
    assert any(p.name.startswith("launcher-") for p in logs), logs
    seen += [p.read_text(errors="replace") for p in logs]
    for text in seen:
        assert PW not in text and TOKEN not in text


def test_a_database_error_on_health_and_a_failed_start_show_no_password(tmp_path):
    # a server that refuses connections: the error text names the URL, never the password
    url = f"postgresql://root:{PW}@127.0.0.1:1/test?password={PW}"
    srv = Server(
        url,
        tmp_path / "srv",
        launcher="auto",
        env={
            "ROLLOUT_BUFFER_LAUNCHER_CMD": "/nonexistent/launcher --db-path {db_url}",
            "ROLLOUT_BUFFER_DB_UNHEALTHY_AFTER_SECONDS": "0.1",
        },
    )
    srv.start()
    try:
        health = wait_until(
            lambda: (lambda h: h if h["status"] != "healthy" else None)(
                requests.get(srv.url + "/health", timeout=10).json()
            ),
            15,
            "health degraded",
        )
        assert "127.0.0.1" in json.dumps(health)  # the error is there, and says where
        texts = [json.dumps(health)]
        r = requests.post(srv.url + "/start_rollout", json={"num_repeat_per_sample": 2}, timeout=30)
        assert r.status_code in (500, 503), r.text
        texts.append(r.text)
        texts.append(requests.post(srv.url + "/get_rollout_data", json={}, timeout=30).text)
    finally:
        srv.stop()
    texts += [p.read_text(errors="replace") for p in (tmp_path / "srv").rglob("*.log")]
    for text in texts:
        assert PW not in text
