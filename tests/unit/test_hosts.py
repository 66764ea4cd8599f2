"""Host names as browsers send them, and ROLLOUT_BUFFER_ALLOWED_HOSTS (core.hosts)."""

from __future__ import annotations

import pytest

from rollout_buffer.core.config import Config
from rollout_buffer.core.errors import ConfigError
from rollout_buffer.core.hosts import host_name, is_loopback, parse_allowed_hosts


@pytest.mark.parametrize(
    ("header", "name", "loopback"),
    [
        ("localhost", "localhost", True),
        ("LOCALHOST:18889", "localhost", True),
        ("localhost.:18889", "localhost", True),
        ("127.0.0.1:18889", "127.0.0.1", True),
        ("127.200.0.9", "127.200.0.9", True),
        ("[::1]:18889", "::1", True),
        ("[0:0:0:0:0:0:0:1]", "::1", True),
        ("[::ffff:127.0.0.1]:80", "::ffff:7f00:1", True),
        ("localhost.evil.example:18889", "localhost.evil.example", False),
        ("127.0.0.1.evil.example", "127.0.0.1.evil.example", False),
        ("Evil.Example.:18889", "evil.example", False),
        ("10.0.0.7:18889", "10.0.0.7", False),
        ("[::2]:18889", "::2", False),
    ],
)
def test_a_host_header_is_read_into_a_comparable_name(header, name, loopback):
    assert host_name(header) == name
    assert is_loopback(name) is loopback


@pytest.mark.parametrize(
    "header", [None, "", "::1", "[::1", "[::1]x", "host:port", "a b", "evil.example:1:2", "a/b"]
)
def test_what_is_no_host_name_is_none(header):
    assert host_name(header) is None


def test_the_allowed_hosts_are_read_as_host_headers_are():
    parsed = parse_allowed_hosts(" Buffer-1, buffer-1.cluster.local. ,10.0.0.7,::1,[fd00::5],,")
    assert parsed == ("buffer-1", "buffer-1.cluster.local", "10.0.0.7", "::1", "fd00::5")
    assert Config.from_env({"ROLLOUT_BUFFER_ALLOWED_HOSTS": "a,B."}).allowed_hosts == ("a", "b")
    assert Config.from_env({}).allowed_hosts == ()


@pytest.mark.parametrize("raw", ["http://buffer-1", "buffer-1:18889", "*.cluster", "a b", "a/b"])
def test_an_allowed_host_with_a_scheme_port_or_wildcard_is_refused_at_startup(raw):
    with pytest.raises(ConfigError, match=r"ROLLOUT_BUFFER_ALLOWED_HOSTS=.*without scheme or port"):
        Config.from_env({"ROLLOUT_BUFFER_ALLOWED_HOSTS": raw})
