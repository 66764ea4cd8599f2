"""Host names as a browser sends them, for the check against DNS rebinding.

A page on evil.example whose name is rebound to 127.0.0.1 is, to the browser, its own origin: it
sends ``Host: evil.example:PORT`` and a matching ``Origin``. Only the Host tells such a request
apart from the status page's own, so the service accepts a browser's state-changing request only
for the names it is really reached by (issue 20, item 4).

Owns: reading a Host value into a comparable name (lower case, no port, no trailing dot, IPv6
without brackets), telling loopback names apart, and parsing ``ROLLOUT_BUFFER_ALLOWED_HOSTS``.
It must not import anything of the package: the settings (core.config) and the web layer both
use it.
"""

from __future__ import annotations

import ipaddress
import re

# DNS labels (letters, digits, '-', and '_' which some internal names carry), dot-separated.
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_PORT_RE = re.compile(r"[0-9]{1,5}")


def host_name(host: str | None) -> str | None:
    """The name in a Host header value (``name``, ``name:port``, ``[v6]`` or ``[v6]:port``): lower
    case, without port or trailing dot, an IP address in its canonical form; None when it is
    missing or not a host name at all (a browser never sends such a value)."""
    if host is None:
        return None
    text = host.strip().lower()
    if text.startswith("["):
        literal, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not (rest[0] == ":" and _PORT_RE.fullmatch(rest[1:]))):
            return None
        return _address(literal)
    name, colon, port = text.partition(":")
    if colon and not _PORT_RE.fullmatch(port):
        return None  # an unbracketed IPv6 address, or a port that is no number
    name = name[:-1] if name.endswith(".") else name
    address = _address(name)
    if address is not None:
        return address
    return name if _NAME_RE.fullmatch(name) else None


def _address(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """``localhost``, 127.0.0.0/8, ::1 and ::ffff:127.x.x.x (a name from :func:`host_name`).

    Names under ``.localhost`` are not counted: browsers resolve them to loopback, but the service
    is not reached by them unless an operator lists them in ROLLOUT_BUFFER_ALLOWED_HOSTS."""
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def parse_allowed_hosts(raw: str) -> tuple[str, ...]:
    """``ROLLOUT_BUFFER_ALLOWED_HOSTS``: comma-separated host names or IP addresses, no port and no
    scheme; each is stored as :func:`host_name` reads a Host header, so the two compare equal.
    Raises ValueError saying what is expected (the config names the variable)."""
    names: list[str] = []
    for entry in raw.split(","):
        text = entry.strip()
        if not text:
            continue
        # an IPv6 address may come with or without brackets; anything else with ':' has a port
        name = _address(text.strip("[]")) or (host_name(text) if ":" not in text else None)
        if name is None:
            raise ValueError(
                f"comma-separated host names or IP addresses without scheme or port "
                f"(e.g. buffer-1,buffer-1.cluster.local,10.0.0.7); {text!r} is not one"
            )
        names.append(name)
    return tuple(dict.fromkeys(names))
