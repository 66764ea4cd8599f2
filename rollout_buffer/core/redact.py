"""Passwords out of text: database URLs and DSNs in logs, errors and responses, and the secrets
this process was told of (:func:`hide`: the pacing gate's path secret).

Owns: the one redaction rule. It must not import anything of the package: settings, storage and
the launcher all use it.
"""

from __future__ import annotations

import re

_SECRET_KEY = r"(?:[A-Za-z_]*password)"
_REDACTIONS = (
    # userinfo of a URL: scheme://user:secret@host (the secret may be percent-encoded)
    (re.compile(r"(://[^:/@\s?#]*):[^/\s]*@"), r"\1:***@"),
    # a query parameter: ?password=secret&... or &sslpassword=secret
    (re.compile(r"([?&]" + _SECRET_KEY + r"=)[^&#\s'\"]*", re.I), r"\1***"),
    # a key=value DSN: password=secret, password = 'se cret', password="x"
    (
        re.compile(
            r"(\b" + _SECRET_KEY + r"\s*=\s*)('(?:[^'\\]|\\.)*'|\"[^\"]*\"|[^\s'\"&]+)", re.I
        ),
        r"\1***",
    ),
)


_HIDDEN: set[str] = set()  # secrets of this process, replaced wherever they appear


def hide(secret: str) -> None:
    """From now on :func:`redact` replaces ``secret`` (a gate's path secret) with ``***``."""
    if secret:
        _HIDDEN.add(secret)


def redact(text: str) -> str:
    """A database URL or DSN, or any text holding one (an error message, an argv), without its
    password, in every form libpq accepts: userinfo, a ``password``/``sslpassword`` query parameter,
    a key=value DSN (quoted or not). For logs, errors and responses."""
    for pattern, repl in _REDACTIONS:
        text = pattern.sub(repl, text)
    for secret in _HIDDEN:
        text = text.replace(secret, "***")
    return text
