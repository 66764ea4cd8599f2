"""rollout-buffer: groups agentic RL rollout steps from the launcher's database and serves
complete prompt groups to the trainer over HTTP."""
from __future__ import annotations

__version__ = "0.1.0"


def create_app(config=None):  # noqa: D401 - thin re-export, nothing runs at import
    """Build the Flask app (see :func:`rollout_buffer.app.create_app`)."""
    from .app import create_app as _create_app

    return _create_app(config)


__all__ = ["__version__", "create_app"]
